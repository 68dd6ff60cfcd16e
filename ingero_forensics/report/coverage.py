"""Ranks of the job that no capture saw.

A node whose bundles were not merged (not collected, a capture that failed) is absent
from every comparison: the captured ranks wait for it at each collective, and the report
would find them all on time. fleet.db still says so: each collective records its
communicator's size (``nranks``) and how many of its ranks entered it (``ranks_seen``).
When most collectives of the job's largest communicator were entered by fewer ranks
than its size, the report cannot say "no straggler", and says which ranks are missing.
"""

from __future__ import annotations

import json


def uncaptured_ranks(con) -> dict | None:
    """{"comm_id_hash", "nranks", "ranks_seen" (median over its collectives),
    "collectives", "short" (collectives entered by fewer ranks than nranks), "missing"
    (global ranks of no captured process; empty when the captured ones are unknown)} of
    the largest communicator (most collectives among equal sizes), when most of its
    collectives lack ranks; None when they do not."""
    row = con.execute(
        "SELECT comm_id_hash, MAX(nranks), COUNT(*) FROM collectives "
        "WHERE typeof(nranks) = 'integer' AND nranks > 1 GROUP BY comm_id_hash "
        "ORDER BY 2 DESC, 3 DESC, 1 LIMIT 1").fetchone()
    if row is None:
        return None
    comm, nranks, n = row
    short = con.execute("SELECT COUNT(*) FROM collectives WHERE comm_id_hash = ? AND "
                        "ranks_seen < ?", (comm, nranks)).fetchone()[0]
    if 2 * short <= n:
        return None
    (seen,) = con.execute("SELECT ranks_seen FROM collectives WHERE comm_id_hash = ? "
                          "ORDER BY ranks_seen LIMIT 1 OFFSET ?", (comm, n // 2)).fetchone()
    captured = set()
    for (ranks,) in con.execute("SELECT ranks FROM nodes"):
        try:
            captured |= {r for r in json.loads(ranks or "[]") if isinstance(r, int)}
        except ValueError:
            pass
    missing = sorted(set(range(nranks)) - captured) if captured and \
        max(captured) < nranks else []
    return {"comm_id_hash": comm, "nranks": nranks, "ranks_seen": seen, "collectives": n,
            "short": short, "missing": missing}


def uncaptured_text(u: dict, rank_text) -> str:
    """One sentence: which ranks no capture saw, and what that hides."""
    if u["missing"]:
        verb = "was" if len(u["missing"]) == 1 else "were"
        who = f"{rank_text(u['missing'])} of the {u['nranks']}"
        what = f"{verb} not captured"
    else:       # their processes are known, their collectives are not
        k = u["nranks"] - u["ranks_seen"]
        who = f"{k} of the {u['nranks']} ranks"
        what = f"{'is' if k == 1 else 'are'} missing from its collectives"
    return (f"{who[0].upper()}{who[1:]} in the job's largest communicator {what} "
            f"({u['short']:,} of its {u['collectives']:,} collectives were entered by "
            f"{u['ranks_seen']} ranks at the median): a straggler among them would not show, "
            "as the others would wait for it at every collective. Merge the bundles of "
            "every node of the job.")


def network_unsure_text(u: dict) -> str:
    """One sentence: the network suspect not named because its retransmits went towards
    a peer no bundle captured (analyze.py, rule 4)."""
    return (f"{u['node']}'s job connections retransmitted {u['retransmits']:,} segments, "
            f"{u['unseen']:,} of them towards addresses that no merged bundle owns, and "
            "its retransmits towards the captured nodes alone do not single it out: a "
            "lossy NIC or link at " + ("that uncaptured peer" if u["unseen_addresses"] == 1
                                        else f"the uncaptured node or nodes behind those "
                                             f"{u['unseen_addresses']} addresses")
            + " would look the same from here, so no node's network is named.")
