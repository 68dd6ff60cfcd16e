"""Global ranks of the traced processes in a fleet.db.

nccl_events.rank and nccl_comm_events.rank are ranks within each call's communicator: a
node-local split (tensor parallel) numbers its members 0..k-1. What a user is shown is
the global rank: the process's rank environment (RANK, OMPI_COMM_WORLD_RANK, ...) when
the capture saw it, else its rank in the largest communicator it joined (the world).
"""

from __future__ import annotations


def process_ranks(con, node_id: int | None = None) -> dict[tuple[int, int], int]:
    """(node_id, pid) -> global rank, for one node or all. The rank environment first;
    communicator lifecycle events next; the collectives themselves (a scan of
    nccl_events) only for processes neither names (a capture attached late)."""
    where, binds = ("AND node_id = ?", (node_id,)) if node_id is not None else ("", ())
    out: dict[tuple[int, int], int] = {}
    for nid, pid, rank in con.execute(
            f"SELECT node_id, pid, rank FROM processes WHERE rank IS NOT NULL {where}", binds):
        if isinstance(rank, int):
            out[(nid, pid)] = rank
    unknown = {(nid, pid) for nid, pid in con.execute(
        f"SELECT DISTINCT node_id, pid FROM processes WHERE 1 {where}", binds)} - set(out)
    best: dict[tuple[int, int], tuple[int, int]] = {}     # (node, pid) -> (nranks, rank)
    sources = ["SELECT node_id, pid, rank, nranks FROM nccl_comm_events WHERE "
               f"api <> 'ncclCommSplit' AND rank IS NOT NULL AND nranks IS NOT NULL {where}"]
    if unknown or not out:
        # DISTINCT, not GROUP BY: a handful of distinct rows is kept in a small temporary
        # index instead of sorting every collective (1.6 M rows: 0.25 s against 0.9 s).
        # Per process the largest communicator comes first, equal ones by lowest rank.
        sources.append("SELECT DISTINCT node_id, pid, rank, nranks FROM nccl_events WHERE "
                       f"rank IS NOT NULL AND nranks IS NOT NULL {where} "
                       "ORDER BY node_id, pid, nranks DESC, rank")
    for sql in sources:
        for nid, pid, rank, nranks in con.execute(sql, binds):
            if (nid, pid) in out or not (isinstance(rank, int) and isinstance(nranks, int)):
                continue
            if (nid, pid) not in best or nranks > best[(nid, pid)][0]:
                best[(nid, pid)] = (nranks, rank)
    for k, (_, rank) in best.items():
        out[k] = rank
    return out
