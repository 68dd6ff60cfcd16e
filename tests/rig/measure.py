"""What the rig can check in a merged fleet.db because all its nodes share one clock.

Every namespace reads the same CLOCK_MONOTONIC, so the true fleet time of any event is
its raw ``mono_ns`` (mapped back through the skew when a bundle was rewritten) plus one
constant. A correct alignment therefore gives ``timestamp_ns - true mono`` the same value
on every node; how far a node's value is from the others' is its alignment error.
Lateness measured on the raw clock is the truth the report's lateness can be compared
with.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import apsw

#: rows per node taken at each end of the run
EDGE_ROWS = 40


def connect(fleet_db) -> apsw.Connection:
    return apsw.Connection(str(fleet_db), flags=apsw.SQLITE_OPEN_READONLY)


def node_names(con) -> dict[int, str]:
    return dict(con.execute("SELECT node_id, name FROM nodes"))


def _edge_offsets(con, node_id: int, true_mono) -> tuple[float, float]:
    """Median of (aligned - true mono) over the node's first and last EDGE_ROWS events
    (nccl_events and cuda_events)."""
    sql = ("SELECT timestamp_ns, mono_ns FROM (SELECT timestamp_ns, mono_ns FROM nccl_events "
           "WHERE node_id = ?1 UNION ALL SELECT timestamp_ns, mono_ns FROM cuda_events "
           "WHERE node_id = ?1) ORDER BY mono_ns {} LIMIT {}")
    out = []
    for order in ("ASC", "DESC"):
        rows = list(con.execute(sql.format(order, EDGE_ROWS), (node_id,)))
        if not rows:
            raise AssertionError(f"node {node_id} has no nccl_events/cuda_events rows")
        out.append(statistics.median(ts - true_mono(m) for ts, m in rows))
    return out[0], out[1]


def alignment_errors(fleet_db, true_mono=None) -> dict[str, float]:
    """Per node, the alignment error in microseconds: the largest distance, at the start
    and at the end of the run, between the node's (aligned - true mono) and the median of
    all nodes' values. ``true_mono(node_name)`` returns the mapping from a node's raw
    mono_ns to the true clock (identity unless its bundles were skewed)."""
    with connect(fleet_db) as con:
        names = node_names(con)
        edges = {}
        for nid, name in names.items():
            fn = true_mono(name) if true_mono else (lambda m: m)
            edges[name] = _edge_offsets(con, nid, fn)
    errors = {name: 0.0 for name in edges}
    for i in (0, 1):
        ref = statistics.median(e[i] for e in edges.values())
        for name, e in edges.items():
            errors[name] = max(errors[name], abs(e[i] - ref) / 1e3)
    return {k: round(v, 1) for k, v in errors.items()}


def true_lateness(fleet_db, true_mono=None) -> dict[str, float]:
    """Per node, the median over collectives of its arrival (latest entry of its ranks,
    on the true clock) minus the median arrival of all nodes, in ms."""
    with connect(fleet_db) as con:
        names = node_names(con)
        maps = {nid: (true_mono(name) if true_mono else (lambda m: m))
                for nid, name in names.items()}
        arrival: dict[tuple, dict[int, int]] = defaultdict(dict)
        for nid, comm, seq, mono in con.execute(
                "SELECT node_id, comm_id_hash, seq, MAX(mono_ns) FROM nccl_events "
                "WHERE comm_id_hash IS NOT NULL GROUP BY node_id, comm_id_hash, seq"):
            arrival[(comm, seq)][nid] = maps[nid](mono)
    late: dict[int, list[float]] = defaultdict(list)
    for per in arrival.values():
        if len(per) < len(names):
            continue
        med = statistics.median(per.values())
        for nid, t in per.items():
            late[nid].append((t - med) / 1e6)
    return {names[nid]: round(statistics.median(v), 3) for nid, v in late.items()}


def inbound_message_slack(fleet_db, node: str) -> float | None:
    """Median over the arrivals ``node`` recorded (tcp_progress) of the time from the
    start of the send that carried those bytes to their arrival, on the shared clock,
    in ms: the best a send-before-receive pair into ``node`` can place its clock. Sends
    that wait for the receiver's window (a reader starved of CPU) start long before
    their bytes leave. None without such pairs."""
    with connect(fleet_db) as con:
        slacks = [r[0] for r in con.execute(
            "SELECT (SELECT r.mono_ns - s.mono_ns FROM tcp_progress s "
            "        WHERE s.direction = 'send' AND s.node_id != r.node_id "
            "          AND s.saddr = r.daddr AND s.sport = r.dport "
            "          AND s.daddr = r.saddr AND s.dport = r.sport "
            "          AND s.stream_offset <= r.stream_offset "
            "        ORDER BY s.stream_offset DESC LIMIT 1) "
            "FROM tcp_progress r JOIN nodes n USING (node_id) "
            "WHERE n.name = ? AND r.direction = 'arrive'", (node,)) if r[0] is not None]
    return round(statistics.median(slacks) / 1e6, 3) if slacks else None
