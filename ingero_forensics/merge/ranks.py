"""Global ranks of the traced processes in a fleet.db.

nccl_events.rank and nccl_comm_events.rank are ranks within each call's communicator: a
node-local split (tensor parallel) numbers its members 0..k-1. What a user is shown is
the global rank: the process's rank environment (RANK, OMPI_COMM_WORLD_RANK, ...) when
the capture saw it, else its rank in the largest communicator it joined (the world).
"""

from __future__ import annotations


#: The distinct (node_id, pid, rank, nranks) of the collectives: a scan of nccl_events,
#: which the merge's table builder runs beside the table it builds (collective_rows).
COLLECTIVE_RANKS_SQL = ("SELECT DISTINCT node_id, pid, rank, nranks FROM nccl_events "
                        "WHERE rank IS NOT NULL AND nranks IS NOT NULL")


def process_ranks(con, node_id: int | None = None,
                  collective_rows=None) -> dict[tuple[int, int], int]:
    """(node_id, pid) -> global rank, for one node or all. The rank environment first;
    communicator lifecycle events next; the collectives themselves (a scan of
    nccl_events) only for processes neither names (a capture attached late).
    collective_rows: the rows of COLLECTIVE_RANKS_SQL, when they were read already
    (then nccl_events is not scanned)."""
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
    if (unknown or not out) and collective_rows is not None:
        # in the order of the query below
        sources.append(sorted((r for r in collective_rows if (node_id is None or
                               r[0] == node_id) and isinstance(r[2], int) and
                               isinstance(r[3], int)),
                              key=lambda r: (r[0], r[1], -r[3], r[2])))
    elif unknown or not out:
        # DISTINCT, not GROUP BY: a handful of distinct rows is kept in a small temporary
        # index instead of sorting every collective (1.6 M rows: 0.25 s against 0.9 s).
        # Per process the largest communicator comes first, equal ones by lowest rank.
        sources.append(f"{COLLECTIVE_RANKS_SQL} {where} ORDER BY node_id, pid, nranks DESC, "
                       "rank")
    for source in sources:
        for nid, pid, rank, nranks in (con.execute(source, binds) if isinstance(source, str)
                                       else source):
            if (nid, pid) in out or not (isinstance(rank, int) and isinstance(nranks, int)):
                continue
            if (nid, pid) not in best or nranks > best[(nid, pid)][0]:
                best[(nid, pid)] = (nranks, rank)
    for k, (_, rank) in best.items():
        out[k] = rank
    return out
