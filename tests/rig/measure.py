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


#: the sending end's latest row below an arrival's last byte, of one kind: 'send' (the
#: call began copying it) or 'unsent' (it had not left yet)
_LATEST = ("(SELECT MAX(s.mono_ns) FROM tcp_progress s WHERE s.direction = '{kind}' "
           "AND s.node_id != r.node_id AND s.saddr = r.daddr AND s.sport = r.dport "
           "AND s.daddr = r.saddr AND s.dport = r.sport "
           "AND s.stream_offset < r.stream_offset + r.bytes)")


def inbound_message_slack(fleet_db, node: str) -> dict[str, float | None]:
    """Per kind of bound on the sending end ('send', 'unsent', and 'best' for the later
    of the two), the median over the arrivals ``node`` recorded (tcp_progress) of the
    time from that bound to the arrival, on the shared clock, in ms: the best a
    send-before-receive pair into ``node`` can place its clock. Sends that wait for the
    receiver's window (a reader starved of CPU) start long before their bytes leave;
    the ACK that opens the window ('unsent') comes just before. None without pairs.
    Each kind's latest row below an arrival is its largest position there (rows of one
    kind only move forward)."""
    with connect(fleet_db) as con:
        rows = con.execute(
            f"SELECT r.mono_ns, {_LATEST.format(kind='send')}, "
            f"{_LATEST.format(kind='unsent')} FROM tcp_progress r JOIN nodes n "
            "USING (node_id) WHERE n.name = ? AND r.direction = 'arrive'", (node,)).fetchall()
    out: dict[str, float | None] = {}
    for kind, pick in (("send", lambda s, u: s), ("unsent", lambda s, u: u),
                       ("best", lambda s, u: max(x for x in (s, u) if x is not None)
                        if (s, u) != (None, None) else None)):
        slacks = [t - b for t, s, u in rows if (b := pick(s, u)) is not None]
        out[kind] = round(statistics.median(slacks) / 1e6, 3) if slacks else None
    return out


def message_bounds_broken(fleet_db) -> tuple[int, int, list]:
    """On the shared clock, every receive or arrival of a byte came after the send that
    began copying it and after any 'unsent' row that said it had not left: (pairs
    checked, pairs broken, a few broken ones). The claim the merge's message bounds rest
    on, checked on the real kernel whatever the fault."""
    with connect(fleet_db) as con:
        broken = con.execute(
            "SELECT r.node_id, r.direction, r.mono_ns, r.stream_offset, r.bytes, "
            "s.direction, s.mono_ns, s.stream_offset FROM tcp_progress r "
            "JOIN tcp_progress s ON s.direction IN ('send', 'unsent') "
            "AND s.node_id != r.node_id AND s.saddr = r.daddr AND s.sport = r.dport "
            "AND s.daddr = r.saddr AND s.dport = r.sport "
            "AND s.stream_offset < r.stream_offset + r.bytes AND s.mono_ns >= r.mono_ns "
            "WHERE r.direction IN ('recv', 'arrive') LIMIT 5").fetchall()
        pairs = con.execute(
            "SELECT COUNT(*) FROM tcp_progress r JOIN tcp_progress s "
            "ON s.direction IN ('send', 'unsent') AND s.node_id != r.node_id "
            "AND s.saddr = r.daddr AND s.sport = r.dport AND s.daddr = r.saddr "
            "AND s.dport = r.sport AND s.stream_offset < r.stream_offset + r.bytes "
            "WHERE r.direction IN ('recv', 'arrive')").fetchone()[0]
        count = con.execute(
            "SELECT COUNT(*) FROM tcp_progress r JOIN tcp_progress s "
            "ON s.direction IN ('send', 'unsent') AND s.node_id != r.node_id "
            "AND s.saddr = r.daddr AND s.sport = r.dport AND s.daddr = r.saddr "
            "AND s.dport = r.sport AND s.stream_offset < r.stream_offset + r.bytes "
            "AND s.mono_ns >= r.mono_ns WHERE r.direction IN ('recv', 'arrive')"
            ).fetchone()[0]
    return pairs, count, broken
