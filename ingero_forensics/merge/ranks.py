"""Global ranks of the traced processes in a fleet.db.

nccl_events.rank and nccl_comm_events.rank are ranks within each call's communicator: a
node-local split (tensor parallel) numbers its members 0..k-1. What a user is shown is
the global rank: the process's rank environment (RANK, OMPI_COMM_WORLD_RANK, ...) when
the capture saw it, else its rank in the largest communicator it joined (the world).
"""

from __future__ import annotations


def process_ranks(con, node_id: int | None = None) -> dict[tuple[int, int], int]:
    """(node_id, pid) -> global rank, for one node or all."""
    where, binds = ("AND node_id = ?", (node_id,)) if node_id is not None else ("", ())
    best: dict[tuple[int, int], tuple[int, int]] = {}     # (node, pid) -> (nranks, rank)
    for nid, pid, rank, nranks in con.execute(
            "SELECT node_id, pid, rank, nranks FROM nccl_comm_events WHERE "
            f"api <> 'ncclCommSplit' AND rank IS NOT NULL AND nranks IS NOT NULL {where} "
            "UNION ALL SELECT node_id, pid, rank, MAX(nranks) FROM nccl_events WHERE "
            f"rank IS NOT NULL AND nranks IS NOT NULL {where} "
            "GROUP BY node_id, pid, comm_id_hash", binds * 2):
        if isinstance(rank, int) and isinstance(nranks, int) and \
                ((nid, pid) not in best or nranks > best[(nid, pid)][0]):
            best[(nid, pid)] = (nranks, rank)
    out = {k: rank for k, (_, rank) in best.items()}
    for nid, pid, rank in con.execute(
            f"SELECT node_id, pid, rank FROM processes WHERE rank IS NOT NULL {where}", binds):
        if isinstance(rank, int):
            out[(nid, pid)] = rank
    return out
