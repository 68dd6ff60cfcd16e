"""Communicators the merge inferred for captures attached after their init (fleet.db's
inferred_comms; merge/lateattach.py): which, on what basis, and which streams it could
not match, so that the report never compares ranks on an identity it did not see
without saying so."""

from __future__ import annotations

import json

from .evidence import table_exists

__all__ = ["inferred_communicators", "unmatched_text"]


def inferred_communicators(con) -> list[dict]:
    """One entry per inferred communicator: its streams, nodes and global ranks (where
    known), how its streams were placed, and for a stream matched with nothing why."""
    if not table_exists(con, "inferred_comms"):
        return []
    out = []
    for h, streams, nodes, ranks, env, bases, details, calls in con.execute(
            "SELECT i.comm_id_hash, MAX(i.streams), json_group_array(DISTINCT n.name), "
            "json_group_array(i.rank) FILTER (WHERE i.rank IS NOT NULL), "
            "json_group_array(i.env_rank) FILTER (WHERE i.env_rank IS NOT NULL), "
            "json_group_array(DISTINCT i.basis), json_group_array(i.detail), SUM(i.calls) "
            "FROM inferred_comms i JOIN nodes n USING (node_id) "
            "GROUP BY i.comm_id_hash ORDER BY MAX(i.streams) DESC, i.comm_id_hash"):
        bases = sorted(json.loads(bases))
        alone = bases == ["alone"]
        out.append({
            "comm_id_hash": h, "streams": streams, "nodes": sorted(json.loads(nodes)),
            "ranks": sorted(json.loads(ranks or "[]")),
            "env_ranks": sorted(json.loads(env or "[]")), "basis": bases, "calls": calls,
            "matched": not alone,
            "choice": any(b.startswith("nearest in time (unsynchronized") for b in bases),
            "why_alone": json.loads(details)[0] if alone else None})
    return out


def unmatched_text(comms: list[dict]) -> str:
    """A sentence for the verdict when some streams could not be matched, else ''."""
    alone = [c for c in comms if not c["matched"]]
    if not alone:
        return ""
    where = ", ".join(sorted({n for c in alone for n in c["nodes"]}))
    ranks = sorted({r for c in alone for r in c["env_ranks"]})
    who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on {where}"
           if ranks else where)
    return (f"{len(alone)} stream{'s' if len(alone) > 1 else ''} of NCCL calls "
            f"({who}) could not be matched to the other ranks' (the capture attached after "
            "the communicator was created; see 'Communicators inferred'): not compared "
            "there.")
