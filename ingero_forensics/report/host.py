"""What a capture shows when no node can be compared with another (a single node, or no
NCCL collectives): host signals per node, the job connections' retransmits, where the
traced processes waited off CPU, who held their CPUs, their slowest CUDA calls and
block I/O. Every figure is rounded in SQL, so the statement shown under a table gives
exactly the numbers in it.
"""

from __future__ import annotations

from .evidence import JOB_BLOCK

#: Host metrics summarized per node (those present).
HOST_METRICS = ("psi.cpu.some_pct", "cpu.busy_pct", "psi.io.some_pct", "disk.await_ms",
                "psi.memory.some_pct", "vm.pgmajfault_per_s", "vm.pgscan_per_s",
                "tcp.retrans_segs_per_s", "gpu.sm_clock_mhz", "gpu.temp_c",
                "gpu.throttle_reasons", "load.avg1")
_METRICS_SQL = ", ".join(f"'{m}'" for m in HOST_METRICS)

#: (key, title, note, SQL, columns as (key, heading, numeric))
VIEWS = (
    ("signals", "Host signals", "Per node and metric over the whole capture (GPU and disk "
     "metrics: the worst device's mean and peak).",
     "SELECT nd.name AS node, metric, SUM(n) AS samples, ROUND(MAX(m), 2) AS mean, "
     "ROUND(MAX(p), 2) AS peak FROM (SELECT node_id, metric, device, COUNT(*) AS n, "
     "AVG(value) AS m, MAX(value) AS p FROM host_samples WHERE metric IN (" + _METRICS_SQL + ") "
     "GROUP BY node_id, metric, device) JOIN nodes nd USING (node_id) "
     "GROUP BY nd.name, metric ORDER BY nd.name, metric",
     [("node", "node", False), ("metric", "metric", False), ("samples", "samples", True),
      ("mean", "mean", True), ("peak", "peak", True)]),
    ("retransmits", "Retransmits on the job's own connections",
     "TCP retransmits of connections owned by the traced processes (background traffic "
     "left out), per connection.",
     "SELECT nd.name AS node, saddr, daddr, dport, COUNT(*) AS retransmits "
     "FROM tcp_events t JOIN nodes nd USING (node_id) WHERE t.scope = 'job' "
     "AND t.event = 'tcp_retransmit_skb' GROUP BY nd.name, saddr, daddr, dport "
     "ORDER BY retransmits DESC LIMIT 10",
     [("node", "node", False), ("saddr", "from", False), ("daddr", "to", False),
      ("dport", "port", True), ("retransmits", "retransmits", True)]),
    ("off_cpu", "Where the traced processes waited off CPU",
     "Time their threads spent switched out, by thread name and state (S: sleeping, "
     "waiting for an event or a lock; D: uninterruptible, usually I/O), summed over "
     "threads.",
     "SELECT nd.name AS node, s.comm AS thread, s.prev_state AS state, COUNT(*) AS spans, "
     "ROUND(SUM(s.duration_ns) / 1e6, 1) AS total_ms, ROUND(MAX(s.duration_ns) / 1e6, 1) "
     "AS longest_ms FROM sched_events s JOIN nodes nd USING (node_id) "
     "WHERE s.kind = 'off_cpu' GROUP BY nd.name, s.comm, s.prev_state "
     "ORDER BY SUM(s.duration_ns) DESC LIMIT 10",
     [("node", "node", False), ("thread", "thread", False), ("state", "state", False),
      ("spans", "spans", True), ("total_ms", "total, ms (summed)", True),
      ("longest_ms", "longest, ms", True)]),
    ("runq", "Who held their CPUs",
     "Run-queue delay of the traced threads (runnable, waiting for a CPU), by the task "
     "that was running, summed over threads.",
     "SELECT nd.name AS node, s.other_comm AS task, s.other_pid AS pid, COUNT(*) AS spans, "
     "ROUND(SUM(s.duration_ns) / 1e6, 1) AS total_ms FROM sched_events s "
     "JOIN nodes nd USING (node_id) WHERE s.kind = 'runq_delay' "
     "GROUP BY nd.name, s.other_comm, s.other_pid ORDER BY SUM(s.duration_ns) DESC LIMIT 10",
     [("node", "node", False), ("task", "task", False), ("pid", "pid", True),
      ("spans", "spans", True), ("total_ms", "total, ms (summed)", True)]),
    ("cuda", "CUDA calls by total time",
     "Calls kept one by one (synchronizations, copies, allocations, sampled launches), "
     "summed over the traced processes.",
     "SELECT nd.name AS node, api, COUNT(*) AS calls, ROUND(SUM(duration_ns) / 1e6, 1) "
     "AS total_ms, ROUND(MAX(duration_ns) / 1e6, 2) AS longest_ms, "
     "SUM(duration_ns IS NULL) AS in_flight FROM cuda_events JOIN nodes nd USING (node_id) "
     "GROUP BY nd.name, api ORDER BY SUM(duration_ns) DESC LIMIT 10",
     [("node", "node", False), ("api", "call", False), ("calls", "calls", True),
      ("total_ms", "total, ms (summed)", True), ("longest_ms", "longest, ms", True),
      ("in_flight", "never returned", True)]),
    ("block", "Block I/O of the job's processes",
     "Requests issued by a traced process or one of its threads, per device.",
     "SELECT nd.name AS node, b.device, COUNT(*) AS requests, "
     "ROUND(AVG(b.duration_ns) / 1e6, 2) AS mean_ms, ROUND(MAX(b.duration_ns) / 1e6, 1) "
     "AS max_ms FROM block_events b JOIN nodes nd USING (node_id) WHERE " + JOB_BLOCK + " "
     "GROUP BY nd.name, b.device ORDER BY MAX(b.duration_ns) DESC LIMIT 10",
     [("node", "node", False), ("device", "device", False), ("requests", "requests", True),
      ("mean_ms", "mean, ms", True), ("max_ms", "max, ms", True)]),
)

__all__ = ["HOST_METRICS", "host_view"]


def host_view(con) -> list[dict]:
    """The tables that have rows: {"key", "title", "note", "cols", "rows"}; each table's
    statement is recorded under the figure "host:<key>"."""
    out = []
    for key, title, note, sql, cols in VIEWS:
        with con.figure(f"host:{key}"):
            rows = [dict(zip([c[0] for c in cols], r)) for r in con.execute(sql)]
        if rows:
            out.append({"key": f"host:{key}", "title": title, "note": note, "cols": cols,
                        "rows": rows})
    return out
