"""The page's figures beside the verdict: the cause's metric over time, the seed
article's slowest collectives, the clocks' alignment, the capture's blind spots and cost,
and the fleet's inventory."""

from __future__ import annotations

from collections import defaultdict

from .capturelog import unknown_coverage
from .evidence import REFAULT_SIGNALS, in_rowid_order, median, table_exists

def cause_series(con, cause, target, t0, bin_ns, bins=None, signals=()) -> dict:
    """The cause's main metric over time: the suspect node vs the other nodes' median
    (from host_bins when its bins are the report's). Memory: the refaults where they
    were the cause's best signal (``signals``: the suspect's)."""
    metric = {"cpu": "psi.cpu.some_pct", "io": "psi.io.some_pct",
              "memory": "psi.memory.some_pct", "network": "tcp.retrans_segs_per_s",
              "gpu": "gpu.sm_clock_mhz"}[cause]
    best = max((s for s in signals if s.cause == cause), key=lambda s: s.score, default=None)
    if cause == "memory" and best is not None and best.score > 0 and \
            best.name in REFAULT_SIGNALS.values():
        metric = next(m for m, name in REFAULT_SIGNALS.items() if name == best.name)
    scale = 1 / 2**20 if metric in REFAULT_SIGNALS else 1.0     # MiB/s, as its signal
    agg = "MIN" if cause == "gpu" else "MAX"
    per: dict[int, dict[int, float]] = defaultdict(dict)
    if bins is not None and bins.aligned:
        rows = con.execute(bins.series_sql(agg), [metric])
    else:
        rows = con.execute(
            f"SELECT node_id, (timestamp_ns - ?) / ?, {agg}(v) FROM (SELECT node_id, "
            "timestamp_ns, device, value v FROM host_samples WHERE "
            f"{in_rowid_order('host_samples', 'metric = ?')}) "
            f"GROUP BY node_id, (timestamp_ns - ?) / ?", [t0, bin_ns, metric, t0, bin_ns])
    for nid, b, v in rows:
        if b is not None and b >= 0:
            per[b][nid] = v
    series = []
    for b in sorted(per):
        vals = per[b]
        others = [v for n, v in vals.items() if n != target]
        series.append({"t_s": round(b * bin_ns / 1e9, 3),
                       "suspect": round(vals.get(target, 0.0) * scale, 3),
                       "others": round(median(others) * scale, 3) if others else 0.0})
    return {"metric": metric, "points": series}


def slow_collectives(con) -> list[dict]:
    """The seed article's question: slowest AllReduces and the retransmits of that node's
    own job connections in their window."""
    out = []
    for rank, node, ms, n in con.execute(
            "WITH slow AS (SELECT timestamp_ns, duration_ns, rank, node_id FROM nccl_events "
            "  WHERE op = 'ALL_REDUCE' AND duration_ns > 50000000 "
            "  ORDER BY duration_ns DESC LIMIT 10) "
            "SELECT s.rank, nd.name, s.duration_ns / 1e6, "
            "  (SELECT COUNT(*) FROM tcp_events t WHERE t.event = 'tcp_retransmit_skb' "
            "   AND t.node_id = s.node_id AND t.scope = 'job' "
            "   AND t.timestamp_ns BETWEEN s.timestamp_ns AND s.timestamp_ns + s.duration_ns) "
            "FROM slow s JOIN nodes nd USING (node_id) ORDER BY s.duration_ns DESC"):
        out.append({"rank": rank, "node": node, "ms": round(ms, 1), "retransmits": n})
    return out


def alignment_rows(con, nodes) -> list[dict]:
    if not table_exists(con, "clock_alignment"):
        return []
    out = []
    # message_pairs came with fleet.db version 6
    pairs = "message_pairs" if "message_pairs" in {
        r[1] for r in con.execute("PRAGMA table_info(clock_alignment)")} else "0"
    for row in con.execute(
            "SELECT node_id, method, drift_ppm, uncertainty_ns, relative_uncertainty_ns, "
            "sync_points, violations_before, violations_after, steps, exceeds_claim, "
            f"causal_moved_ns, rate_clamped, {pairs} FROM clock_alignment ORDER BY node_id"):
        nid, method, drift, unc, rel, sp, vb, va, steps, liar, moved, clamped, mp = row
        out.append({"node": nodes.get(nid, ("?",))[0], "node_id": nid, "method": method,
                    "drift_ppm": round(drift or 0.0, 2),
                    "uncertainty_us": None if unc is None else round(unc / 1e3, 1),
                    "relative_uncertainty_us": None if rel is None else round(rel / 1e3, 1),
                    "sync_points": sp, "violations_before": vb, "violations_after": va,
                    "steps": steps, "exceeds_claim": bool(liar),
                    "causal_moved_us": round((moved or 0) / 1e3, 1),
                    "rate_clamped": bool(clamped), "message_pairs": mp or 0})
    return out


#: A source turned off this close to the end of its bundle's capture was stopped with
#: the capture (SIGTERM, --duration): not a blind spot.
SHUTDOWN_NS = 2_000_000_000


def capture_issues(con, nodes) -> list[dict]:
    """What the capture could not see: sources that were off for a reason, lost events,
    warnings and errors; a source stopped with the capture at its end is no gap. A node
    whose bundles do not say which sources ran says nothing either way: it is listed as
    unknown, never as complete (capturelog.py)."""
    out = []
    for nid, source, event, n, msg in con.execute(
            "SELECT l.node_id, l.source, l.event, SUM(COALESCE(l.count, 1)), MAX(l.message) "
            "FROM capture_log l JOIN bundles b USING (bundle_id) "
            "WHERE (l.event IN ('source_off', 'lost_events') OR l.level IN ('warning', "
            "'error')) AND NOT (l.event = 'lost_events' AND l.count IS NULL) "
            "AND NOT (l.level IN ('debug', 'info') AND l.event = 'source_off' "
            "AND l.mono_ns >= b.capture_end_mono_ns - ?) "
            "GROUP BY l.node_id, l.source, l.event ORDER BY l.node_id, l.source",
            (SHUTDOWN_NS,)):
        out.append({"node": nodes.get(nid, ("?",))[0], "source": source, "event": event,
                    "count": n, "message": msg})
    return out + unknown_coverage(con, nodes)


def capture_cost(con, nodes, metric: str = "capture.cpu_pct",
                 bins=None) -> dict[str, float]:
    """Per node, the capture's own mean CPU use (% of one core, host_samples
    capture.cpu_pct): what tracing cost the node. With capture.bpf_cpu_pct: its BPF
    programs' in-kernel run time, recorded only where the kernel kept it. bins:
    host_bins, which hold every sample of these metrics in some bin."""
    sql = (bins.whole_run_mean_sql(metric) if bins is not None else
           "SELECT node_id, AVG(value) FROM host_samples WHERE "
           + in_rowid_order("host_samples", f"metric = '{metric}'")
           + " GROUP BY node_id ORDER BY node_id")
    return {nodes.get(nid, ("?",))[0]: round(v, 2) for nid, v in con.execute(sql)}


def inventory(con) -> dict:
    inv = {}
    for t in ("nccl_events", "cuda_events", "tcp_events", "sched_events", "block_events",
              "host_samples", "clock_samples", "stacks"):
        if table_exists(con, t):
            inv[t] = con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
    inv["bundles"] = con.execute("SELECT COUNT(*) FROM bundles").fetchone()[0] \
        if table_exists(con, "bundles") else 0
    return inv
