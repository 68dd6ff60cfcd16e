"""The slow-link suspect of the report (docs/report.md, rule 4c): a link between two
nodes whose bytes take far longer from sender to receiver than on every other link of
the job, with no retransmits to show for it.

A link that queues (a NIC that negotiated a lower speed, a congested or misconfigured
switch port, a shaping qdisc) slows a ring all-reduce for every rank alike: nobody
arrives late, and a link that drops nothing retransmits nothing. What does show is the
time its bytes spend in transit. The capture's tcp_progress rows (bundle format 1.1,
docs/ebpf.md "TCP progress") date the same stream positions on both ends of a job
connection: on the sender, an instant before byte N left (a send that began copying it,
or an 'unsent' row: not sent yet); on the receiver, an instant by which the bytes up to
E had arrived (an 'arrive' row, written when the kernel queues them, before the reader
gets a CPU). For each arrival, the latest sender row below E bounds the transit of that
byte from above: ``arrival - sent_after``. On the real-kernel rig it is 20-40 us at the
median on every healthy link, under a CPU hog, O_DIRECT reads or memory pressure alike,
and 10.8 ms on a link shaped to 100 Mbit/s with a 400 ms queue (tests/rig, scenario
``slowlink``).

The figures are on the merged time axis: a link's transit is off by the alignment error
between its two nodes, so a link is named only where its excess is well above that
uncertainty (CLOCK_MARGIN). Receives ('recv' rows) are never used: a CPU-starved reader
returns late, which is the reader's delay, not the link's.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass, field

from ..merge.messages import LOCAL_ADDRESSES, SAME_CONNECTION_NS, plain_address
from .evidence import CLEAR_SCORE, median, quantile

#: transits measured on a link before it is compared with the others
MIN_LINK_PAIRS = 20
#: the smallest spread of the other links' medians a link's excess is measured in (ms):
#: a clear score (5) then needs 2.5 ms more than the typical link; busy healthy links
#: queue hundreds of microseconds at most
LINK_FLOOR_MS = 0.5
#: a link's excess must be at least this share of the slowest link's for the other links
#: of its sender (or receiver) to count as slow too (the fault on that node's side)
SAME_SIDE_SHARE = 0.5

_ENDS = (
    # the sending end: an instant before the byte at stream_offset left
    "SELECT node_id, 0 AS side, {sa} AS s_addr, sport AS s_port, {da} AS r_addr, "
    "dport AS r_port, connected_ns, stream_offset AS pos, timestamp_ns AS t "
    "FROM tcp_progress WHERE direction IN ('send', 'unsent') "
    "UNION ALL "
    # the receiving end: the bytes below stream_offset + bytes had arrived
    "SELECT node_id, 1, {da}, dport, {sa}, sport, connected_ns, stream_offset + bytes, "
    "timestamp_ns FROM tcp_progress WHERE direction = 'arrive'")

#: Per arrival: the node that sent, the node that received, and an upper bound on the
#: transit of a byte it brought (ns). A connection is one 4-tuple with one sending and
#: one receiving node, each with one establishment (a 4-tuple reused is left out), never
#: a local address. Sender rows at the arrival's end position are not below it: the
#: arrival is ordered first at equal positions.
LINK_TRANSITS_SQL = (
    f"WITH ends AS ({_ENDS.format(sa=plain_address('saddr'), da=plain_address('daddr'))}), "
    "conn AS (SELECT s_addr, s_port, r_addr, r_port, "
    "MIN(CASE side WHEN 0 THEN node_id END) AS sender, "
    "MAX(CASE side WHEN 0 THEN node_id END) AS sender_hi, "
    "MIN(CASE side WHEN 1 THEN node_id END) AS receiver, "
    "MAX(CASE side WHEN 1 THEN node_id END) AS receiver_hi, "
    "MAX(CASE side WHEN 0 THEN connected_ns END) - MIN(CASE side WHEN 0 THEN connected_ns "
    "END) AS s_span, MAX(CASE side WHEN 1 THEN connected_ns END) - "
    "MIN(CASE side WHEN 1 THEN connected_ns END) AS r_span "
    "FROM ends GROUP BY 1, 2, 3, 4), "
    "ordered AS (SELECT e.side, e.s_addr, e.s_port, e.r_addr, e.r_port, e.t, "
    "MAX(CASE e.side WHEN 0 THEN e.t END) OVER (PARTITION BY e.s_addr, e.s_port, e.r_addr, "
    "e.r_port ORDER BY e.pos, e.side DESC ROWS UNBOUNDED PRECEDING) AS sent_after "
    "FROM ends e) "
    "SELECT c.sender, c.receiver, o.t - o.sent_after AS transit_ns, o.t AS arrival_ns "
    "FROM ordered o "
    "JOIN conn c USING (s_addr, s_port, r_addr, r_port) "
    "WHERE o.side = 1 AND o.sent_after IS NOT NULL AND c.sender = c.sender_hi AND "
    "c.receiver = c.receiver_hi AND c.sender <> c.receiver AND c.s_span <= :same AND "
    "c.r_span <= :same AND NOT (" + " OR ".join(
        f"{col} LIKE '{p}'" for col in ("c.s_addr", "c.r_addr") for p in LOCAL_ADDRESSES)
    + ")")


@dataclass
class Link:
    sender: int          # node ids
    receiver: int
    transits: int        # arrivals measured
    median_ms: float
    p90_ms: float
    #: report time bin -> the median transit of the arrivals in it (ms)
    per_bin: dict[int, float] = field(default_factory=dict, repr=False)


def link_transits(con, t0: int = 0, bin_ns: int = 1_000_000_000) -> list[Link]:
    """Every link (sending node, receiving node) of the job's connections with at least
    MIN_LINK_PAIRS measured arrivals: the median and 90th percentile of the transit
    bound, and its median per time bin of bin_ns from t0. Empty where the fleet has no
    tcp_progress (an older capture, a job whose collectives do not use TCP: InfiniBand,
    NVLink) or no 'arrive' rows (kernels before the sock: tracepoints)."""
    have = con.execute("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND "
                       "name = 'tcp_progress'").fetchone()
    if have is None:
        return []
    per: dict[tuple[int, int], array] = defaultdict(lambda: array("d"))
    binned: dict[tuple[int, int], dict[int, array]] = defaultdict(
        lambda: defaultdict(lambda: array("d")))
    for s, r, ns, at in con.execute(LINK_TRANSITS_SQL, {"same": SAME_CONNECTION_NS}):
        per[(s, r)].append(ns / 1e6)
        binned[(s, r)][(at - t0) // bin_ns].append(ns / 1e6)
    out = []
    for (s, r), v in sorted(per.items()):
        if len(v) >= MIN_LINK_PAIRS:
            out.append(Link(s, r, len(v), round(median(v), 3), round(quantile(v, 0.9), 3),
                            {b: median(x) for b, x in binned[(s, r)].items()}))
    return out


def link_series(links: list[Link], slow: "SlowLink", bin_ns: int) -> dict:
    """The cause chart's series: the slow link's median transit per bin against the
    median of the other links' (evidence.cause_series's form)."""
    mine = next(lk for lk in links if (lk.sender, lk.receiver) == (slow.sender, slow.receiver))
    others = [lk for lk in links if lk is not mine]
    points = []
    for b in sorted(mine.per_bin):
        if b < 0:
            continue
        rest = [lk.per_bin[b] for lk in others if b in lk.per_bin]
        points.append({"t_s": round(b * bin_ns / 1e9, 3), "suspect": round(mine.per_bin[b], 3),
                       "others": round(median(rest), 3) if rest else 0.0})
    return {"metric": LINK_METRIC, "points": points}


@dataclass
class SlowLink:
    sender: int
    receiver: int
    median_ms: float          # the slow link's transit at the median
    others_ms: float          # the median of the other links' medians
    score: float
    #: "sender" (every other link out of the sender is slow too), "receiver" (every other
    #: link into the receiver), or "path" (no other link tells the two ends apart)
    side: str
    suspect: int              # the node named: the receiver on "receiver", else the sender
    clock_bound_ms: float | None   # the alignment uncertainty between the two nodes
    #: the excess is not above CLOCK_MARGIN times that uncertainty (or it is unbounded):
    #: the link cannot be named, and the verdict says why
    clock_limited: bool = False


def slow_link(links: list[Link], pair_uncertainty_ms, clock_margin: float) -> SlowLink | None:
    """The link whose transit at the median is far above every other link's (robust
    score >= CLEAR_SCORE, spread floored at LINK_FLOOR_MS) by more than clock_margin
    times the alignment uncertainty between its two nodes (pair_uncertainty_ms(a, b):
    ms, or None when unbounded); ``clock_limited`` where it is not. None where fewer
    than two links were measured or none stands out."""
    if len(links) < 2:
        return None
    worst = max(links, key=lambda lk: lk.median_ms)
    rest = [lk.median_ms for lk in links if lk is not worst]
    med = median(rest)
    spread = 1.4826 * median([abs(x - med) for x in rest])
    excess = worst.median_ms - med
    score = excess / max(spread, LINK_FLOOR_MS)
    if score < CLEAR_SCORE:
        return None
    bound = pair_uncertainty_ms(worst.sender, worst.receiver)

    def slow_too(lk: Link) -> bool:
        return lk.median_ms - med >= SAME_SIDE_SHARE * excess
    out_of = [lk for lk in links if lk.sender == worst.sender and lk is not worst]
    into = [lk for lk in links if lk.receiver == worst.receiver and lk is not worst]
    if out_of and all(map(slow_too, out_of)) and not (into and all(map(slow_too, into))):
        side = "sender"
    elif into and all(map(slow_too, into)) and not (out_of and all(map(slow_too, out_of))):
        side = "receiver"
    else:
        side = "path"
    return SlowLink(worst.sender, worst.receiver, worst.median_ms, round(med, 3),
                    round(score, 1), side,
                    worst.receiver if side == "receiver" else worst.sender, bound,
                    clock_limited=bound is None or excess <= clock_margin * bound)


#: the cause's title where a slow link named it (the JSON's cause stays "network")
LINK_CAUSE_TITLE = "slow network link"
#: the cause chart's metric where a slow link named it (not a host_samples metric)
LINK_METRIC = "link.transit_ms"


def side_text(s: dict) -> str:
    """Which end of the link the other links point at, in a sentence."""
    if s["side"] == "sender":
        return (f"Every other link out of {s['from']} is slow too: the fault is on "
                f"{s['from']}'s side (its NIC, its queueing discipline, its switch port).")
    if s["side"] == "receiver":
        return (f"Every other link into {s['to']} is slow too: the fault is on {s['to']}'s "
                "side (its NIC, its switch port).")
    return (f"No other link of the job tells which end is at fault: {s['from']}'s NIC or "
            f"queueing discipline, the switch ports between them, or {s['to']}'s NIC.")


def link_evidence(s: dict, links: list[dict]) -> list[str]:
    """The figures that named the link, each in a sentence."""
    mine = next(lk for lk in links if (lk["from"], lk["to"]) == (s["from"], s["to"]))
    clock = ("Both nodes run on one clock (one boot): the transit needs no alignment."
             if s["clock_bound_ms"] == 0 else
             f"The clocks of the two nodes are aligned to within {s['clock_bound_ms']:.3f} ms "
             "of each other, well under the excess.")
    return [
        f"Bytes of the job's connections from {s['from']} to {s['to']} took "
        f"{s['median_ms']:,.3f} ms from sender to receiver at the median (90th percentile "
        f"{s['p90_ms']:,.3f} ms, {mine['transits']:,} arrivals measured), against "
        f"{s['others_ms']:,.3f} ms at the median on the job's other links (score "
        f"{s['score']:g}): the bytes wait in a queue on that link.",
        "No node's job connections retransmitted markedly: the link is slow, not lossy.",
        side_text(s),
        clock,
        f"The collectives spent {s['transfer_share']:.0%} of the run between the last "
        "arrival and completion, where every rank waits for the link."]


def link_next_step(s: dict) -> str:
    if s["side"] == "receiver":
        return (f"On {s['to']}, check the NIC the job's traffic arrives on (ethtool: speed "
                "and duplex; ethtool -S: errors, drops, pause frames) and its switch port; "
                f"compare with a healthy node's.")
    return (f"On {s['from']}, check the NIC the job's traffic to {s['to']} leaves by "
            "(ethtool: speed and duplex; ethtool -S: errors, drops, pause frames) and its "
            "queueing discipline (tc -s qdisc: a shaper, a backlog), then the switch ports "
            f"on the path to {s['to']}; compare with a healthy node's.")


def link_unsure_text(s: dict) -> str:
    """A slow-looking link whose excess the clocks cannot rule out, in a sentence."""
    bound = ("an unbounded error" if s["clock_bound_ms"] is None
             else f"{s['clock_bound_ms']:,.3f} ms")
    return (f"The job's link from {s['from']} to {s['to']} looks slower than the others "
            f"({s['median_ms']:,.3f} ms at the median against {s['others_ms']:,.3f} ms), "
            f"but the clocks of the two nodes are aligned only to within {bound} of each "
            "other: clock error cannot be ruled out, and the link is not named.")
