"""Calls in flight (bundle table calls_in_flight, format 1.1) after a merge.

A capture records the NCCL and CUDA calls still open when it seals a segment or stops.
A call open at a seal usually returns later: its row in the next segment (nccl_events,
nccl_comm_events or cuda_events, same node, pid, tid and entry time) supersedes the
in-flight one. A call open at several seals leaves one in-flight row per seal; the last
observation is kept. What remains are the calls that never returned while the capture
watched: where a hung rank is.
"""

from __future__ import annotations

#: (source, completed-call table, condition on its row e): where a call's return is kept
_RETURNED = (
    ("nccl", "nccl_events", "f.op IS NOT NULL"),
    ("nccl", "nccl_comm_events", "f.op IS NULL"),
    ("cuda", "cuda_events", "e.duration_ns IS NOT NULL"),
)


def settle_in_flight(con) -> int:
    """Drop the in-flight rows a later return or a later observation supersedes; return
    how many were dropped. Runs over the whole table (an incremental merge may bring
    the return of a call an earlier merge left in flight)."""
    dropped = 0
    for source, table, cond in _RETURNED:
        con.execute(
            f"DELETE FROM calls_in_flight WHERE id IN (SELECT f.id FROM calls_in_flight f "
            f"JOIN {table} e ON e.node_id = f.node_id AND e.pid = f.pid AND e.tid = f.tid "
            f"AND e.timestamp_ns = f.timestamp_ns AND e.mono_ns = f.mono_ns "
            f"WHERE f.source = '{source}' AND {cond})")
        dropped += con.changes()
    con.execute(
        "DELETE FROM calls_in_flight WHERE EXISTS (SELECT 1 FROM calls_in_flight g "
        "WHERE g.node_id = calls_in_flight.node_id AND g.pid = calls_in_flight.pid "
        "AND g.tid = calls_in_flight.tid AND g.mono_ns = calls_in_flight.mono_ns "
        "AND g.api = calls_in_flight.api AND (g.observed_ns > calls_in_flight.observed_ns "
        "OR (g.observed_ns = calls_in_flight.observed_ns AND g.id < calls_in_flight.id)))")
    return dropped + con.changes()


__all__ = ["settle_in_flight"]
