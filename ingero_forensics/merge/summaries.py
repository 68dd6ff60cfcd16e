"""Summaries the merge writes for ingero-report (fleet.db version 4): ``host_bins``,
``job_block_io`` and ``sync_waits``.

Why: the report compares host metrics between nodes over its straggler windows, which
are runs of its lateness time bins. Read from host_samples, every such figure is a pass
over one metric of every node (2 M rows per GPU metric at 64 nodes x 8 GPUs, about 1 to
4 s each, on pages spread over the whole file: fleet.db keeps each node's rows
together). The merge, which has every sample at hand, sums them once per (node, metric,
device, report bin); a window is then a range of bins and a figure reads a few thousand
summary rows.

The bins are the report's default ones: ``t0`` = the first collective's entry
(``MIN(collectives.first_entry_ns)``) and ``bin_ns`` from :func:`default_bin_s`, which
the report calls too, so the two agree by construction. The parameters are kept in
``fleet_info`` (key ``host_bins``); a report with other bins (``--bin``), or on a
fleet.db without the table (version 3), computes from host_samples as before.

Bin of a sample: ``floor((timestamp_ns - t0) / bin_ns)`` from t0 on, so a window
``[t0 + i bin_ns, t0 + j bin_ns)`` is exactly the bins i to j - 1. Before t0 the bins
are counted back from t0 the other way round (``-1 - (t0 - timestamp_ns) / bin_ns``):
bin -1 holds the samples in (t0 - bin_ns, t0), which SQLite's integer division (it
truncates toward zero) puts in bin 0 of a plain ``(timestamp_ns - t0) / bin_ns`` as
the report's metric-over-time figure groups them; bins -1 and 0 together give that
figure's first point exactly.

job_block_io and sync_waits are not sums but the few columns of the rows two of the
report's figures read, in the order their samples are drawn in: the block requests of
the job's own processes (a block I/O p95 and time per node: 3 M requests of 6 M at 64
nodes, read whole and sorted, 3 s) and the GPU work waits (event and device
synchronizations: a sixth of cuda_events, read whole, 1.8 s). Each is a narrow
WITHOUT ROWID table keyed in that order, so the report reads it forward, without a
sort, and draws the same samples.
"""

from __future__ import annotations

import json

__all__ = ["HOST_BIN_METRICS", "JOB_BLOCK", "SUMMARY_OF", "SYNC_WAIT_APIS", "default_bin_s",
           "host_bin_params", "host_bin_window", "write_summaries", "write_summary"]

#: The host metrics the report reads (report/evidence.py: signals; figures.py: cause series;
#: citing.py: cited evidence; the capture's cost). Others are not summarized; nor are per-CPU rows of
#: cpu.* metrics, which the report never reads (only the whole-node row, device NULL).
HOST_BIN_METRICS = ("psi.cpu.some_pct", "cpu.busy_pct", "psi.io.some_pct", "disk.await_ms",
                    "psi.memory.some_pct", "vm.pgmajfault_per_s", "vm.pgscan_per_s",
                    "vm.refault_bytes_per_s", "psi.job.io.some_pct", "psi.job.memory.some_pct",
                    "vm.job.refault_bytes_per_s", "tcp.retrans_segs_per_s", "gpu.sm_clock_mhz", "gpu.temp_c",
                    "gpu.throttle_reasons", "capture.cpu_pct", "capture.bpf_cpu_pct")


#: SQL: block request b was issued by one of its node's traced processes or their threads
#: (row values against each table once, not a subquery per request).
JOB_BLOCK = ("((b.node_id, b.pid) IN (SELECT node_id, pid FROM processes) OR "
             "(b.node_id, b.tid) IN (SELECT node_id, tid FROM threads))")
#: Waits of a rank for its own GPU work (stream synchronizations wait for collectives).
SYNC_WAIT_APIS = ("cudaEventSynchronize", "cuEventSynchronize", "cudaDeviceSynchronize",
                  "cuCtxSynchronize")


def default_bin_s(first_ns, last_ns) -> float:
    """The report's lateness bin (seconds) for collectives from first_ns to last_ns:
    about 100 bins over the run, between 0.25 s and 10 s each."""
    dur_s = ((last_ns or 0) - (first_ns or 0)) / 1e9
    return min(10.0, max(0.25, dur_s / 100)) if dur_s > 0 else 1.0


def host_bin_window(first_ns, last_ns) -> tuple[int, int] | None:
    """(t0_ns, bin_ns) of host_bins for collectives from first_ns to last_ns (the first
    and last entry over the fleet); None without collectives."""
    if first_ns is None:
        return None
    return first_ns, int(default_bin_s(first_ns, last_ns) * 1e9)


def host_bin_params(con) -> tuple[int, int] | None:
    """(t0_ns, bin_ns) of this fleet.db's host_bins; None without them."""
    if con.execute("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'host_bins'"
                   ).fetchone() is None:
        return None
    row = con.execute("SELECT value FROM fleet_info WHERE key = 'host_bins'").fetchone()
    if row is None:
        return None
    p = json.loads(row[0])
    return p["t0_ns"], p["bin_ns"]


_METRICS_SQL = ", ".join(f"'{m}'" for m in HOST_BIN_METRICS)

# In metric order, so that a metric's rows are on pages of their own. NOT INDEXED: the metrics summarized are most of the table, read in storage order; by
# the (metric, timestamp_ns) index every row would be fetched from another page.
_HOST_BINS_SQL = f"""
    INSERT INTO host_bins (metric, node_id, device, bin, samples, total, positive, lo, hi)
    SELECT metric, node_id, device,
           CASE WHEN timestamp_ns >= :t0 THEN (timestamp_ns - :t0) / :bin
                ELSE -1 - (:t0 - timestamp_ns) / :bin END,
           COUNT(*), SUM(value), SUM(value > 0), MIN(value), MAX(value)
    FROM host_samples NOT INDEXED
    WHERE metric IN ({_METRICS_SQL}) AND (device IS NULL OR metric NOT LIKE 'cpu.%')
    GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4"""


# In key order: the WITHOUT ROWID tables are then appended to, page after page.
_JOB_BLOCK_IO_SQL = ("INSERT INTO job_block_io (node_id, timestamp_ns, block_id, duration_ns) "
                     "SELECT b.node_id, b.timestamp_ns, b.id, b.duration_ns "
                     f"FROM block_events b NOT INDEXED WHERE {JOB_BLOCK} ORDER BY 1, 2, 3")
_SYNC_WAITS_SQL = ("INSERT INTO sync_waits (node_id, pid, cuda_id, timestamp_ns, duration_ns) "
                   "SELECT node_id, pid, id, timestamp_ns, duration_ns "
                   "FROM cuda_events NOT INDEXED WHERE duration_ns IS NOT NULL AND api IN ("
                   + ", ".join(f"'{a}'" for a in SYNC_WAIT_APIS) + ") ORDER BY 1, 2, 3")


#: The summaries read from one table each, which the thread that builds that table may
#: write beside it (merge/copying.py, TableBuilder), instead of the main thread at the
#: end of the merge, where nothing else overlaps it.
SUMMARY_OF = {"host_samples": "host_bins", "cuda_events": "sync_waits"}


def write_summary(con, summary: str, window: tuple[int, int] | None) -> None:
    """(Re)write one summary of SUMMARY_OF from its table in con's main database.
    window: host_bin_window() of the fleet (host_bins stays empty without one)."""
    con.execute(f"DELETE FROM {summary}")
    if summary == "sync_waits":
        con.execute(_SYNC_WAITS_SQL)
    elif window is not None:
        con.execute(_HOST_BINS_SQL, {"t0": window[0], "bin": window[1]})


def write_summaries(con, done=frozenset()) -> None:
    """(Re)write host_bins, job_block_io and sync_waits from the tables now in fleet.db,
    inside the caller's transaction, except the summaries in ``done`` (written with
    their table by the table builder, from the same rows and the same window). Without
    collectives there is no report bin: host_bins stays empty and fleet_info has no
    host_bins key (the report reads host_samples)."""
    con.execute("DELETE FROM job_block_io")
    con.execute(_JOB_BLOCK_IO_SQL)
    con.execute("DELETE FROM fleet_info WHERE key = 'host_bins'")
    window = host_bin_window(*con.execute("SELECT MIN(first_entry_ns), MAX(last_entry_ns) "
                                          "FROM collectives").fetchone())
    for summary in SUMMARY_OF.values():
        if summary not in done:
            write_summary(con, summary, window)
    if window is not None:
        con.execute("INSERT INTO fleet_info (key, value) VALUES ('host_bins', ?)",
                    (json.dumps({"t0_ns": window[0], "bin_ns": window[1]}),))
