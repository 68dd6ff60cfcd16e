"""The network suspect of the report (docs/report.md, rule 4): the node whose own job
connections retransmit when collectives are slow for everyone, never counting
retransmits towards a late node (its victim's), and the addresses that name a node."""

from __future__ import annotations

import json
from collections import defaultdict

from ..merge.messages import LOCAL_ADDRESSES, plain_address
from .evidence import CLEAR_SCORE, LEAVES_NODE, median

#: A node's job connections must retransmit at least this often, per collective of the
#: run, for the network to slow collectives for everyone (a clean run has a few
#: retransmits in all; a lossy NIC, several per collective).
MIN_RETRANSMITS_PER_COLLECTIVE = 0.5
#: addresses that name no node: loopback and unspecified (merge/messages.py's list)
_LOCAL_ADDRESSES = LOCAL_ADDRESSES
#: an IPv4-mapped IPv6 address (a v4 peer on a v6 socket, as tcp_events keeps it)
#: written as the IPv4 address, as tcp_progress has it
_plain = plain_address


def towards_late(con, late: dict) -> tuple[str, list]:
    """SQL (and its parameters) true for a tcp_events row sent towards a late node while
    it was late: its destination one of that node's addresses, its time in one of that
    node's windows. late: node id -> [(start_ns, end_ns)]. Outside its windows a late
    node is on time, and what is resent towards it then is the sender's own link's: a
    lossy link at its upstream neighbour made it late in a few bins of retransmit
    timeouts while the neighbour resent all run long (the real-kernel rig's network
    scenario)."""
    parts, params = [], []
    for node_id, windows in sorted(late.items()):
        w = " OR ".join("(timestamp_ns >= ? AND timestamp_ns < ?)" for _ in windows) or "0"
        parts.append(f"({_plain('daddr')} IN {addresses_of(con, '?')} AND ({w}))")
        params += [json.dumps([node_id])] + [x for win in windows for x in win]
    return "(" + (" OR ".join(parts) or "0") + ")", params


def _network_suspect(con, node_ids, t0, bin_ns, slow, n_bins, n_coll, slow_coll,
                     late=None, seen_only=False) -> tuple[int | None, list[int], str | None]:
    """The node whose own job connections retransmit, when collectives are slow for
    everyone while nobody arrives late: retransmits far above the other nodes' (a
    persistent fault leaves no contrast in time, but it does across nodes) and often
    enough to slow every collective, or the most of them in the slow bins, as often
    there (``slow_coll``: the collectives in the slow bins). A link that queues for a
    period makes a few spurious timeouts while TCP's round-trip estimate catches up
    (the rig: 10 segments resent at once, in one of 4 slow bins holding 31
    collectives); those did not slow the period's collectives, the queue did (rule 4c).
    A lossy link stalls them on every loss, and few collectives fit in its slow bins.

    Retransmits towards a late node while it was late (``late``: node id -> its windows;
    towards_late) do not count: a peer whose sends to a starved or stalled node are
    retransmitted is that node's victim, not a lossy link of its own (the issue's cpu run
    blamed exactly that peer).

    seen_only: count only retransmits towards the addresses of captured nodes (where
    ranks went uncaptured: the loss towards a peer no bundle shows may be that peer's).

    Returns (node, bins, basis): basis "contrast" (its retransmits far above the other
    nodes'; bins: those of its retransmits and the slow ones) or "slow_bins" (the most
    retransmits in the slow bins; bins: the slow ones)."""
    per: dict[int, set[int]] = defaultdict(set)       # bins with retransmits
    count: dict[int, int] = defaultdict(int)
    in_slow: dict[int, int] = defaultdict(int)
    slow_set = set(slow)
    skip, skip_params = towards_late(con, late) if late else ("0", [])
    seen, seen_params = ((f"{_plain('daddr')} IN {addresses_of(con, '?')}",
                          [json.dumps(sorted(node_ids))]) if seen_only else ("1", []))
    for nid, b, n in con.execute(
            "SELECT node_id, (timestamp_ns - ?) / ?, COUNT(*) FROM tcp_events "
            f"WHERE scope = 'job' AND event = 'tcp_retransmit_skb' AND {LEAVES_NODE} "
            f"AND NOT {skip} AND {seen} GROUP BY 1, 2", [t0, bin_ns] + skip_params
            + seen_params):
        per[nid].add(b)
        count[nid] += n
        if b in slow_set:
            in_slow[nid] += n
    if not per:
        return None, [], None
    counts = {n: count.get(n, 0) for n in node_ids}
    top = max(counts, key=counts.get)
    rest = [c for n, c in counts.items() if n != top]
    med = median(rest) if rest else 0.0
    spread = 1.4826 * median([abs(c - med) for c in rest]) if rest else 0.0
    often = max(10, MIN_RETRANSMITS_PER_COLLECTIVE * n_coll)
    if counts[top] >= often and (counts[top] - med) / max(spread, 3.0) >= CLEAR_SCORE:
        return top, sorted(set(per[top]) | slow_set), "contrast"
    if len(slow) >= max(2, int(0.02 * n_bins)) and in_slow and \
            max(in_slow.values()) >= max(10, MIN_RETRANSMITS_PER_COLLECTIVE * slow_coll):
        return max(in_slow, key=in_slow.get), sorted(slow_set), "slow_bins"
    return None, [], None


def retransmits_unseen(con, node_id: int, node_ids) -> tuple[int, dict[str, int]]:
    """node_id's job retransmits that leave the node: how many in all, and those towards
    each address that no captured node owns."""
    total, unseen = 0, {}
    for addr, owned, n in con.execute(
            f"SELECT {_plain('daddr')} AS addr, {_plain('daddr')} IN {addresses_of(con, '?')}, "
            "COUNT(*) "
            "FROM tcp_events WHERE node_id = ? AND scope = 'job' AND "
            f"event = 'tcp_retransmit_skb' AND {LEAVES_NODE} GROUP BY addr",
            (json.dumps(sorted(node_ids)), node_id)):
        total += n
        if not owned:
            unseen[addr] = n
    return total, unseen


def addresses_of(con, param: str) -> str:
    """SQL: the addresses of the nodes whose ids the JSON array ``param`` (a bound
    parameter) lists: the source addresses of their own TCP rows (tcp_events,
    tcp_progress), less loopback and unspecified ones and any another node uses too (a
    NAT), so that a destination address names one node or none. A node's own rows are
    its job connections' and those of its other traffic in the network namespaces its
    job connections use (all of them where no job row names a namespace), never in a
    namespace whose job connections another node of the same kernel (boot id) recorded:
    where several nodes share a kernel (network namespaces, the real-kernel rig) each
    capture also records the others' retransmits, as background in their namespaces,
    and their addresses then named no node at all. (On separate hosts the root
    namespaces share an inode number: hence the same boot.) A node whose capture recorded no TCP row of its
    own has none. Node ids, not addresses, are bound: the statements the report shows
    name no address."""
    have = {r[0] for r in con.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    local = " AND ".join(f"saddr NOT LIKE '{p}'" for p in _LOCAL_ADDRESSES)
    # the namespaces of each node's job connections
    job_ns = ("SELECT DISTINCT node_id, netns FROM tcp_events "
              "WHERE scope = 'job' AND netns IS NOT NULL")
    # ... and those another node of the same kernel has: not this node's own
    theirs = (f"SELECT b.node_id, e.netns FROM ({job_ns}) e JOIN nodes a ON a.node_id = "
              "e.node_id JOIN nodes b ON b.boot_id = a.boot_id AND b.node_id <> a.node_id")
    own_ns = (f" AND (scope = 'job' OR netns IS NULL OR ((node_id NOT IN (SELECT node_id "
              f"FROM ({job_ns})) OR (node_id, netns) IN ({job_ns})) AND "
              f"(node_id, netns) NOT IN ({theirs})))")
    own = " UNION ".join(f"SELECT DISTINCT node_id, {_plain('saddr')} AS addr FROM {t} "
                         f"WHERE {local}{ns}" for t, ns in (
                             ("tcp_events", own_ns), ("tcp_progress", ""))
                         if t in have)        # an older fleet.db has no tcp_progress
    return (f"(SELECT addr FROM ({own}) GROUP BY addr HAVING COUNT(DISTINCT node_id) = 1 "
            f"AND MIN(node_id) IN (SELECT value FROM json_each({param})))")


def retransmits_towards(con, sender: int, node_id: int) -> int:
    """Job retransmits of node ``sender`` whose destination is one of node_id's
    addresses."""
    return con.execute(
        "SELECT COUNT(*) FROM tcp_events WHERE node_id = ? AND scope = 'job' "
        f"AND event = 'tcp_retransmit_skb' AND {_plain('daddr')} IN "
        f"{addresses_of(con, '?')}", (sender, json.dumps([node_id]))).fetchone()[0]


def retransmits_in(con, node_id: int, windows, towards: int) -> int:
    """Job retransmits of node ``node_id`` towards node ``towards`` (its addresses), in
    ``windows`` (Window objects)."""
    w = " OR ".join("(timestamp_ns >= ? AND timestamp_ns < ?)" for _ in windows) or "0"
    return con.execute(
        "SELECT COUNT(*) FROM tcp_events WHERE node_id = ? AND scope = 'job' AND "
        f"event = 'tcp_retransmit_skb' AND {_plain('daddr')} IN {addresses_of(con, '?')} "
        f"AND ({w})", [node_id, json.dumps([towards])]
        + [x for win in windows for x in (win.start_ns, win.end_ns)]).fetchone()[0]
