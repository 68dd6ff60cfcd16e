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
byte from above: ``arrival - sent_after``. On the real-kernel rig it is 17-43 us at the
median on every healthy link, under a CPU hog, O_DIRECT reads or memory pressure alike,
and 5-11 ms on a link shaped to 100-200 Mbit/s with a 400 ms queue (tests/rig, scenario
``slowlink``).

The figures are on the merged time axis: a link's transit is off by the alignment error
between its two nodes, so a link is named only where its excess is well above that
uncertainty (CLOCK_MARGIN). Receives ('recv' rows) are never used: a CPU-starved reader
returns late, which is the reader's delay, not the link's.
"""

from __future__ import annotations

import datetime as _dt
import math
from array import array
from bisect import bisect_right
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
#: the least score (excess over the other links' median, in their floored spread) of a
#: link said as slower than every other where none is named: "No straggler" must not
#: say that no link is far slower when one is (on the rig a link queueing at 400 mbit,
#: 1.27 ms at the median against 0.015 ms, the job 60 % slower: score 2.5)
SMALL_LINK_SCORE = 2.0
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

#: Per arrival: the node that sent, the node that received, an upper bound on the
#: transit of a byte it brought (ns), and its time: link_pairs's pairs in one statement
#: (the report's next command; link_pairs reads the rows once and pairs them in Python,
#: twice as fast). A connection is one 4-tuple with one sending and one receiving node,
#: each with one establishment (a 4-tuple reused is left out), never a local address.
#: Sender rows at the arrival's end position are not below it: the arrival is ordered
#: first at equal positions.
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


#: The rows the report pairs (link_pairs), in the order it needs them: per connection
#: (its 4-tuple, addresses as tcp_progress's sending end writes them), by stream position,
#: an arrival before a sender row at the same position. Above LINK_ROWS_READ rows, the
#: arrivals of one second in every ``:every`` are read, with the sender rows of that
#: second and the one before it (link_transits).
LINK_ROWS_SQL = (
    f"WITH ends AS ({_ENDS.format(sa=plain_address('saddr'), da=plain_address('daddr'))}) "
    "SELECT s_addr, s_port, r_addr, r_port, side, node_id, connected_ns, t FROM ends "
    f"WHERE t / {1_000_000_000} % :every = 0 OR "
    f"(side = 0 AND (t / {1_000_000_000} + 1) % :every = 0) "
    "ORDER BY s_addr, s_port, r_addr, r_port, pos, side DESC")
#: Rows of tcp_progress read whole; a larger table is read one second in every k (k the
#: smallest that keeps about this many): at 5.5 M rows (64 nodes, 8 connections a link,
#: an hour) the whole read takes 10.6-13.6 s, and the medians need far fewer arrivals
LINK_ROWS_READ = 2_000_000


def _local(addr: str) -> bool:
    """An address that never leaves its node (merge.messages.LOCAL_ADDRESSES's patterns)."""
    return any(addr.startswith(p[:-1]) if p.endswith("%") else addr == p
               for p in LOCAL_ADDRESSES)


def link_pairs(con, every: int = 1):
    """(sending node, receiving node, transit bound ns, arrival ns) per arrival, as
    LINK_TRANSITS_SQL computes them (the same rows when every is 1; tested), from one
    ordered read of LINK_ROWS_SQL: a window function and a join over millions of rows
    took twice as long. With every > 1, an arrival is paired only with a sender row of
    its own second or the one before (an older row may lie in a second not read): a
    transit over a second is then not measured."""
    key = None
    senders: set = set()
    receivers: set = set()
    s_conn: list = []
    r_conn: list = []
    arrivals: list = []
    sent_after = None

    def complete():
        return (len(senders) == 1 and len(receivers) == 1 and senders != receivers
                and (max(s_conn) - min(s_conn)) <= SAME_CONNECTION_NS
                and (max(r_conn) - min(r_conn)) <= SAME_CONNECTION_NS
                and not _local(key[0]) and not _local(key[2]))
    for sa, sp, ra, rp, side, nid, conn, t in con.execute(LINK_ROWS_SQL, {"every": every}):
        if (sa, sp, ra, rp) != key:
            if key is not None and complete():
                (s,) = senders
                yield from ((s, r, ns, at) for r, ns, at in arrivals)
            key = (sa, sp, ra, rp)
            senders, receivers, s_conn, r_conn, arrivals = set(), set(), [], [], []
            sent_after = None
        if side == 0:
            senders.add(nid)
            s_conn.append(conn)
            if sent_after is None or t > sent_after:
                sent_after = t
        else:
            receivers.add(nid)
            r_conn.append(conn)
            if sent_after is not None and (every == 1 or
                                           sent_after // 1_000_000_000 >= t // 1_000_000_000 - 1):
                arrivals.append((nid, t - sent_after, t))
    if key is not None and complete():
        (s,) = senders
        yield from ((s, r, ns, at) for r, ns, at in arrivals)


@dataclass
class Link:
    sender: int          # node ids
    receiver: int
    transits: int        # arrivals measured
    median_ms: float
    p90_ms: float
    #: each arrival's time (ns) and transit bound (ms), for the cause chart (at most
    #: about LINK_ROWS_READ / 3 arrivals in all: the read is bounded)
    times: array = field(default_factory=lambda: array("q"), repr=False)
    values: array = field(default_factory=lambda: array("d"), repr=False)


def link_transits(con, max_rows: int | None = None) -> list[Link]:
    """Every link (sending node, receiving node) of the job's connections with at least
    MIN_LINK_PAIRS measured arrivals: the median and 90th percentile of the transit
    bound, and the arrivals themselves. Empty where the fleet has no
    tcp_progress (an older capture, a job whose collectives do not use TCP: InfiniBand,
    NVLink) or no 'arrive' rows (kernels before the sock: tracepoints). A table of more
    than max_rows (LINK_ROWS_READ) rows is read one second in every k."""
    have = con.execute("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND "
                       "name = 'tcp_progress'").fetchone()
    if have is None:
        return []
    # rows written in order: the largest rowid is their number, without a count's scan
    rows = con.execute("SELECT MAX(id) FROM tcp_progress").fetchone()[0] or 0
    every = max(1, -(-rows // (max_rows or LINK_ROWS_READ)))
    per: dict[tuple[int, int], Link] = {}
    for s, r, ns, at in link_pairs(con, every):
        lk = per.get((s, r))
        if lk is None:
            lk = per[(s, r)] = Link(s, r, 0, 0.0, 0.0)
        lk.times.append(at)
        lk.values.append(ns / 1e6)
    out = []
    for key, lk in sorted(per.items()):
        if len(lk.values) >= MIN_LINK_PAIRS:
            lk.transits = len(lk.values)
            lk.median_ms = round(median(lk.values), 3)
            lk.p90_ms = round(quantile(lk.values, 0.9), 3)
            out.append(lk)
    return out


def link_series(links: list[Link], slow: "SlowLink", t0: int, bin_ns: int) -> dict:
    """The cause chart's series: the slow link's median transit per report bin against
    the median of the other links' arrivals in the same bin (figures.cause_series's
    form)."""
    def per_bin(lks) -> dict[int, array]:
        out: dict[int, array] = defaultdict(lambda: array("d"))
        for lk in lks:
            for t, v in zip(lk.times, lk.values):
                out[(t - t0) // bin_ns].append(v)
        return out
    key = (slow.sender, slow.receiver)
    mine = per_bin(lk for lk in links if (lk.sender, lk.receiver) == key)
    rest = per_bin(lk for lk in links if (lk.sender, lk.receiver) != key)
    points = [{"t_s": round(b * bin_ns / 1e9, 3), "suspect": round(median(v), 3),
               **({"others": round(median(rest[b]), 3)} if b in rest else {})}
              for b, v in sorted(mine.items()) if b >= 0]
    return {"metric": LINK_METRIC, "points": points}


@dataclass
class SlowLink:
    sender: int
    receiver: int
    median_ms: float          # the slow link's transit at the median
    p90_ms: float             # ... and at the 90th percentile
    transits: int             # its arrivals measured
    others_ms: float          # the median of the other links' medians
    score: float
    #: "sender" (every other link out of the sender is slow too), "receiver" (every other
    #: link into the receiver), "node" (several links slow, one node at an end of each:
    #: its NIC, both ways), or "path" (no other link tells the two ends apart)
    side: str
    suspect: int              # the node named: the receiver on "receiver", else the sender
    clock_bound_ms: float | None   # the alignment uncertainty between the two nodes
    #: the excess is not above CLOCK_MARGIN times that uncertainty (or it is unbounded):
    #: the link cannot be named, and the verdict says why
    clock_limited: bool = False
    #: every slow link (the slowest first): (sender, receiver, median ms)
    slow: list = field(default_factory=list)
    #: where the link was slow only in periods of the run (slow_link_windows): those
    #: periods, (start ns, end ns), and the report bins in them where it was slow; the
    #: figures above are then the arrivals in those periods only. Empty: the whole run.
    windows: list = field(default_factory=list)
    slow_bins: int = 0
    period_bins: int = 0      # the bins the periods span
    #: the excess over the other links' median that names a link here (CLEAR_SCORE
    #: floored spreads, ms): what a link said under the bar fell short of
    bar_ms: float = 0.0
    #: fewer than MIN_PERIOD_ARRIVALS arrivals in those periods: said, not named
    thin: bool = False


def slow_link(links: list[Link], pair_uncertainty_ms, clock_margin: float,
              min_score: float = CLEAR_SCORE) -> SlowLink | None:
    """The link whose transit at the median is far above every other link's (robust
    score >= min_score, spread floored at LINK_FLOOR_MS) by more than clock_margin
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
    if score < min_score:
        return None
    bound = pair_uncertainty_ms(worst.sender, worst.receiver)

    def slow_too(lk: Link) -> bool:
        return lk.median_ms - med >= SAME_SIDE_SHARE * excess
    slow = sorted((lk for lk in links if slow_too(lk)), key=lambda lk: -lk.median_ms)
    # a NIC that negotiated a lower speed slows its node's links both ways (in a ring,
    # the one in and the one out): one node at an end of every slow link, in both roles
    common = set.intersection(*({lk.sender, lk.receiver} for lk in slow))
    both = [n for n in common if any(lk.sender == n for lk in slow) and
            any(lk.receiver == n for lk in slow)]
    out_of = [lk for lk in links if lk.sender == worst.sender and lk is not worst]
    into = [lk for lk in links if lk.receiver == worst.receiver and lk is not worst]
    if len(both) == 1:
        side, suspect = "node", both[0]
    elif out_of and all(map(slow_too, out_of)) and not (into and all(map(slow_too, into))):
        side, suspect = "sender", worst.sender
    elif into and all(map(slow_too, into)) and not (out_of and all(map(slow_too, out_of))):
        side, suspect = "receiver", worst.receiver
    else:
        side, suspect = "path", worst.sender
    return SlowLink(worst.sender, worst.receiver, worst.median_ms, worst.p90_ms,
                    worst.transits, round(med, 3),
                    round(score, 1), side, suspect, bound,
                    clock_limited=bound is None or excess <= clock_margin * bound,
                    slow=[(lk.sender, lk.receiver, lk.median_ms) for lk in slow],
                    bar_ms=round(CLEAR_SCORE * max(spread, LINK_FLOOR_MS), 3))


#: bins without an arrival on a link that its slow period may span (the job's transfers
#: pause between steps: a link queueing for a period can show no arrival for a bin or two)
WINDOW_GAP_BINS = 4


def _slow_runs(bin_medians: dict[int, float], threshold: float) -> list[tuple[int, int, int]]:
    """(first bin, last bin, slow bins) of each period where a link's bins with arrivals
    are slow (median above threshold): a single bin that is not slow between slow ones is
    bridged, as are up to WINDOW_GAP_BINS bins without arrivals."""
    out: list[tuple[int, int, int]] = []
    run = None          # [first, last, slow bins]
    fast = 0            # bins with arrivals, not slow, since the run's last slow bin
    prev = None         # the last bin with arrivals
    for b in sorted(bin_medians):
        if run is not None and b - prev > WINDOW_GAP_BINS + 1:
            out.append(tuple(run))
            run, fast = None, 0
        prev = b
        if bin_medians[b] > threshold:
            if run is None:
                run = [b, b, 0]
            run[1], run[2], fast = b, run[2] + 1, 0
        elif run is not None:
            fast += 1
            if fast > 1:
                out.append(tuple(run))
                run, fast = None, 0
    if run is not None:
        out.append(tuple(run))
    return out


#: arrivals a link's slow periods need before they name it (fewer over the whole run:
#: MIN_LINK_PAIRS; each of its slow bins is itself a median above the bar)
MIN_PERIOD_ARRIVALS = 10
#: a link found slow over the whole run but slow in less than this share of its time
#: bins with arrivals is named with its periods instead (a queue early in the run, when
#: the connections' first bytes make the most arrivals, can carry the whole-run median)
WHOLE_RUN_SHARE = 0.5


def _in_spans(t: int, starts: list[int], spans: list[tuple[int, int]]) -> bool:
    k = bisect_right(starts, t) - 1
    return k >= 0 and t < spans[k][1]


def _link_bins(lk: Link, t0: int, bin_ns: int) -> dict[int, array]:
    per: dict[int, array] = defaultdict(lambda: array("d"))
    for t, v in zip(lk.times, lk.values):
        per[(t - t0) // bin_ns].append(v)
    return per


def slow_outside(links: list[Link], link: SlowLink, spans: list[tuple[int, int]],
                 pair_uncertainty_ms, clock_margin: float) -> bool:
    """Whether ``link`` is still the slow link (slow_link) with every link's arrivals
    inside ``spans`` (start, end ns; in any order, nested or overlapping) left out: outside a late node's windows its
    own lateness cannot be what slows its links (the rig: a link that queued all run,
    7.2 ms against 0.02 ms, went unsaid because a CPU hog once held its receiving
    node's rank for 93 ms, one time bin in which that node was named)."""
    merged: list[tuple[int, int]] = []        # (_in_spans reads disjoint spans)
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    spans = merged
    starts = [s for s, _ in spans]
    outside = []
    for lk in links:
        keep = array("d", (v for t, v in zip(lk.times, lk.values)
                           if not _in_spans(t, starts, spans)))
        if len(keep) >= MIN_LINK_PAIRS:
            outside.append(Link(lk.sender, lk.receiver, len(keep), round(median(keep), 3),
                                round(quantile(keep, 0.9), 3)))
    again = slow_link(outside, pair_uncertainty_ms, clock_margin)
    return again is not None and (again.sender, again.receiver) == (link.sender, link.receiver)


def slow_link_windows(links: list[Link], pair_uncertainty_ms, clock_margin: float,
                      t0: int, bin_ns: int, min_bins: int,
                      whole: SlowLink | None = None,
                      end_ns: int | None = None) -> SlowLink | None:
    """Rule 4c over periods of the run, for a link slow in part of it only (a switch port
    congested for minutes, a shaper switched on mid-run), which the whole-run medians of
    slow_link miss. A link's report bins are slow where its median transit is above what
    would name a link over the whole run (the links' median plus CLEAR_SCORE times their
    spread, floored at LINK_FLOOR_MS); its slow periods are those bins joined
    (_slow_runs). Links slow in at least min_bins bins in all are candidates, the most
    excess first; slow_link judges each against every link's arrivals in its periods
    only (score, side, clocks), and the first that is that comparison's slowest link is
    the answer, with its periods (``thin`` where fewer than MIN_PERIOD_ARRIVALS of its
    arrivals lie in them: not enough to name it). ``whole``: the link slow_link found
    over the whole run; it is answered with its periods where it was slow in less than
    WHOLE_RUN_SHARE of its bins, else None (the whole run it is). The periods are
    clipped to the run, from t0 to end_ns (a bin can reach past the last collective,
    one with arrivals before the first lies before t0)."""
    if len(links) < 2:
        return None
    med = median([lk.median_ms for lk in links])
    spread = 1.4826 * median([abs(lk.median_ms - med) for lk in links])
    threshold = med + CLEAR_SCORE * max(spread, LINK_FLOOR_MS)
    candidates = []
    for lk in links:
        if whole is not None and (lk.sender, lk.receiver) != (whole.sender, whole.receiver):
            continue
        per = _link_bins(lk, t0, bin_ns)
        bin_medians = {b: median(v) for b, v in per.items()}
        runs = _slow_runs(bin_medians, threshold)
        slow_bins = sum(n for _, _, n in runs)
        if slow_bins < min_bins:
            continue
        if whole is not None and slow_bins >= WHOLE_RUN_SHARE * len(bin_medians):
            return None
        arrivals = excess = 0.0
        for b in sorted(bin_medians):
            k = bisect_right(runs, (b, math.inf)) - 1
            if k >= 0 and b <= runs[k][1]:
                arrivals += len(per[b])
                excess += bin_medians[b] - med
        candidates.append((-excess, lk.sender, lk.receiver, runs, slow_bins, int(arrivals)))
    for _, sender, receiver, runs, slow_bins, arrivals in sorted(candidates):
        spans = [(t0 + first * bin_ns, t0 + (last + 1) * bin_ns) for first, last, _ in runs]
        starts = [s for s, _ in spans]
        # (arrivals are kept over the whole bins; the periods said are the run's part)
        shown = [(max(s, t0), min(e, end_ns) if end_ns is not None else e) for s, e in spans]
        shown = [(s, e) for s, e in shown if e > s] or spans
        inside = []
        for lk in links:
            keep = [(t, v) for t, v in zip(lk.times, lk.values) if _in_spans(t, starts, spans)]
            if len(keep) < 3:       # too few to stand for the link in those periods
                continue
            values = array("d", (v for _, v in keep))
            inside.append(Link(lk.sender, lk.receiver, len(keep), round(median(values), 3),
                               round(quantile(values, 0.9), 3),
                               array("q", (t for t, _ in keep)), values))
        found = slow_link(inside, pair_uncertainty_ms, clock_margin)
        if found is not None and (found.sender, found.receiver) == (sender, receiver):
            found.windows, found.slow_bins = shown, slow_bins
            found.period_bins = sum(last - first + 1 for first, last, _ in runs)
            found.thin = arrivals < MIN_PERIOD_ARRIVALS
            return found
    return None


def period_transfer(link: SlowLink, tr_med: dict, transfer: dict, t0: int, bin_ns: int,
                    run_ns: int) -> dict:
    """The collectives' transfer (last arrival to completion) in a slow link's periods:
    its median there, its median in the rest of the run (the run's where the periods
    cover it all), and what the periods cost beyond the rest's median (the sum over
    their collectives, as a share of the run: collectives of one communicator run one
    after another, so their excess adds up). Against the whole run's median, a link
    slow for most of the run would be measured against itself (a queue over steps
    10-150 of 150: 1.4 % of the run, against about 6 ms more per collective)."""
    starts = [s for s, _ in link.windows]
    inside = [b for b in tr_med if _in_spans(t0 + b * bin_ns, starts, link.windows)]
    inside_set = set(inside)
    rest = [v for b, v in tr_med.items() if b not in inside_set] or list(tr_med.values())
    base = median(rest) if rest else 0.0
    excess_ns = sum(max(0.0, tr_med[b] - base) * 1e6 * transfer[b].n for b in inside)
    return {"period_transfer_ms": round(median([tr_med[b] for b in inside]), 3) if inside
            else None, "rest_transfer_ms": round(base, 3),
            "period_cost_share": round(excess_ns / run_ns, 4) if run_ns else 0.0}


def link_finding(link: SlowLink, nodes, transfer_share: float,
                 period: dict | None = None) -> dict:
    """The slow link's figures as the JSON gives them (link_suspect, link_unsure,
    also_slow_link, link_unnamed): where it was slow in periods of the run only, those
    periods (fleet times, as the straggler windows), the slow bins in them, the bins
    they span, and period_transfer's figures; the same keys, empty or None, where it was
    slow over the whole run."""
    return {"from": nodes[link.sender][0], "to": nodes[link.receiver][0],
            "median_ms": link.median_ms, "p90_ms": link.p90_ms, "transits": link.transits,
            "others_ms": link.others_ms, "score": link.score,
            "side": link.side, "clock_bound_ms": link.clock_bound_ms,
            "transfer_share": transfer_share, "node": nodes[link.suspect][0],
            "slow_links": [{"from": nodes[s][0], "to": nodes[r][0], "median_ms": m}
                           for s, r, m in link.slow],
            "windows": [{"start_ns": s, "end_ns": e} for s, e in link.windows],
            "slow_bins": link.slow_bins,
            "period_bins": link.period_bins, "bar_ms": link.bar_ms,
            "period_transfer_ms": None, "rest_transfer_ms": None, "period_cost_share": None,
            **(period or {})}


#: the cause's title where a slow link named it (the JSON's cause stays "network")
LINK_CAUSE_TITLE = "slow network link"
#: the cause chart's metric where a slow link named it (not a host_samples metric)
LINK_METRIC = "link.transit_ms"
#: how the link's own row in the scored signals begins (the page titles it by this)
LINK_SIGNAL_PREFIX = "transit of the job's bytes"


def side_text(s: dict) -> str:
    """Which end of the link the other links point at, in a sentence."""
    if s["side"] == "sender":
        return (f"Every other link out of {s['from']} is slow too: the fault is on "
                f"{s['from']}'s side (its NIC, its queueing discipline, its switch port).")
    if s["side"] == "receiver":
        return (f"Every other link into {s['to']} is slow too: the fault is on {s['to']}'s "
                "side (its NIC, its switch port).")
    if s["side"] == "node":
        ways = ", ".join(f"{x['from']} to {x['to']} {x['median_ms']:,.3f} ms"
                         for x in s["slow_links"])
        return (f"The links into and out of {s['node']} are slow ({ways}): the fault is on "
                f"{s['node']}'s side, both ways (its NIC, its switch port: a NIC that "
                "negotiated a lower speed does that).")
    return (f"No other link of the job tells which end is at fault: {s['from']}'s NIC or "
            f"queueing discipline, the switch ports between them, or {s['to']}'s NIC.")


def _clock(ns: int) -> str:
    """A fleet time as the UTC time of day to the millisecond (the page gives the date)."""
    t = _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%H:%M:%S.") + f"{t.microsecond // 1000:03d}"


def period_text(s: dict) -> str:
    """Where the link was slow in periods of the run only (slow_link_windows): " from
    12:39:34.184 to 12:39:41.684 UTC", the times of the page's table of them; else ""."""
    w = s.get("windows")
    if not w:
        return ""
    if len(w) == 1:
        return f" from {_clock(w[0]['start_ns'])} to {_clock(w[0]['end_ns'])} UTC"
    total = sum(x["end_ns"] - x["start_ns"] for x in w) / 1e9
    shown = ", ".join(f"{_clock(x['start_ns'])}-{_clock(x['end_ns'])}" for x in w[:4])
    return (f" in {len(w)} periods of the run ({shown}{', ...' if len(w) > 4 else ''} UTC; "
            f"{total:,.1f} s in all)")


def _there(s: dict) -> str:
    """" in those periods" after a figure, where the link was slow in periods only."""
    if not s.get("windows"):
        return ""
    return " in that period" if len(s["windows"]) == 1 else " in those periods"


def link_evidence(s: dict, links: list[dict]) -> list[str]:
    """The figures that named the link, each in a sentence."""
    clock = ("Both nodes run on one clock (one boot): the transit needs no alignment."
             if s["clock_bound_ms"] == 0 else
             f"The clocks of the two nodes are aligned to within {s['clock_bound_ms']:.3f} ms "
             "of each other, well under the excess.")
    return [
        f"Bytes of the job's connections from {s['from']} to {s['to']} took "
        f"{s['median_ms']:,.3f} ms from sender to receiver at the median{period_text(s)}, "
        f"against {s['others_ms']:,.3f} ms at the median on the job's other links"
        f"{_there(s)} (score {s['score']:g}; 90th percentile {s['p90_ms']:,.3f} ms, "
        f"{s['transits']:,} arrivals measured): the bytes wait in a queue on that link.",
        "No node's job connections retransmitted markedly: the link is slow, not lossy.",
        side_text(s),
        clock,
        (f"The link was slow in {s['slow_bins']} of the {s['period_bins']} time bins "
         f"{_there(s).strip() or 'of the run'} (a bin between slow ones, or without an "
         f"arrival, is bridged); {period_cost_text(s, lambda ms: f'{ms:,.3f} ms')}."
         if s.get("windows") else
         f"The collectives spent {s['transfer_share']:.0%} of the run between the last "
         "arrival and completion: the transfer, which a slow link lengthens (how much of "
         "it this link added, one run cannot tell; a slowdown that lasts the whole run "
         "does not show in the per-bin chart of that time).")]


def periods_list(s: dict) -> str:
    """Every period of a link slow in periods, "12:39:34.184-12:39:41.684, ..." (UTC)."""
    return ", ".join(f"{_clock(w['start_ns'])}-{_clock(w['end_ns'])}" for w in s["windows"])


def link_note(a) -> str | None:
    """What the transit table (over the whole run) shows of a link said but not named,
    in a sentence: slow within clock error (link_unsure) or in periods that name no one
    (link_unnamed); None without one."""
    if a.link_unnamed:
        return (f"The link from {a.link_unnamed['from']} to {a.link_unnamed['to']}: "
                + unnamed_link_text(a.link_unnamed) + ".")
    if a.link_unsure:
        return link_unsure_text(a.link_unsure)
    return None


def period_cost_text(s: dict, ms) -> str:
    """What the collectives' transfer did in a slow link's periods, in a clause; ``ms``
    formats milliseconds."""
    if s["period_transfer_ms"] is None:
        return "no collective completed in them" if len(s["windows"]) > 1 else \
            "no collective completed in it"
    return (f"the collectives' transfer (the last arrival to completion) took "
            f"{ms(s['period_transfer_ms'])} at the median{_there(s)}, against "
            f"{ms(s['rest_transfer_ms'])} in the rest of the run: beyond that, "
            f"{s['period_cost_share']:.1%} of the run")


def unnamed_link_text(s: dict) -> str:
    """A link slow in periods of the run that is not named (link_unnamed): why, in a
    clause of "No straggler"'s list."""
    if s["why"] == "small":
        return (f"the job's link from {s['from']} to {s['to']} was slower than every other "
                f"link ({s['median_ms']:,.3f} ms at the median against "
                f"{s['others_ms']:,.3f} ms), but by less than the {s['bar_ms']:,.1f} ms beyond "
                "them that names a link (busy healthy links queue hundreds of "
                "microseconds), so it is not named: check it if the job ran slower than "
                "it should")
    lead = (f"the job's link from {s['from']} to {s['to']} was far slower than the others"
            f"{period_text(s)} ({s['median_ms']:,.3f} ms at the median against "
            f"{s['others_ms']:,.3f} ms), but ")
    if s["why"] == "thin":
        return (lead + f"only {s['transits']:,} of its arrivals were measured"
                f"{_there(s)}, too few to name it")
    return (lead + f"the collectives' transfer{_there(s)} cost only "
            f"{s['period_cost_share']:.1%} of the run beyond its median in the rest of the "
            "run (under 1 %), so it is not named")


def link_next_step(s: dict) -> str:
    nic = "(ethtool: speed and duplex; ethtool -S: errors, drops, pause frames)"
    if s["side"] == "receiver":
        return (f"On {s['to']}, check the NIC the job's traffic arrives on {nic} and its "
                "switch port; compare with a healthy node's.")
    if s["side"] == "node":
        return (f"On {s['node']}, check the NIC the job's traffic uses {nic}, its queueing "
                "discipline (tc -s qdisc: a shaper, a backlog) and its switch port; compare "
                "with a healthy node's.")
    step = (f"On {s['from']}, check the NIC the job's traffic to {s['to']} leaves by {nic} "
            "and its queueing discipline (tc -s qdisc: a shaper, a backlog), then the switch "
            f"ports on the path to {s['to']}")
    if s["side"] == "path":
        step += f", and the NIC of {s['to']} it arrives on"
    return step + "; compare with a healthy node's."


def also_slow_link_text(s: dict) -> str:
    """A slow link beside the finding the verdict leads with: what it is, which end,
    what to check."""
    return (f"Separately, a second problem: the job's link from {s['from']} to {s['to']} "
            f"is far slower than the job's other links{period_text(s)} ({s['median_ms']:,.3f} "
            f"ms from sender to receiver at the median, against {s['others_ms']:,.3f} ms on "
            "the others). " + _ends_text(s) + side_text(s) + " " + link_next_step(s))


def _ends_text(s: dict) -> str:
    named = s.get("named_ends") or []
    if not named:
        return ("Neither of its ends is a node named above, so it does not explain that "
                "finding and needs fixing on its own. ")
    one = len(named) == 1
    where = ("an end of it" if one else "its ends") if len(s["slow_links"]) <= 1 else \
        f"{'an end' if one else 'ends'} of it or of a link slow with it"
    return (f"{' and '.join(named)}, at {where}, "
            f"{'is' if one else 'are'} named above for {'its' if one else 'their'} windows only, with a clear cause "
            f"of {'its' if one else 'their'} own; outside them the link is still the "
            "slowest by far, so it needs fixing on its own. ")


def link_unsure_text(s: dict) -> str:
    """A slow-looking link whose excess the clocks cannot rule out, in a sentence."""
    bound = ("an unbounded error" if s["clock_bound_ms"] is None
             else f"{s['clock_bound_ms']:,.3f} ms")
    return (f"The job's link from {s['from']} to {s['to']} looks slower than the others"
            f"{period_text(s)} ({s['median_ms']:,.3f} ms at the median against {s['others_ms']:,.3f} ms), "
            f"but the clocks of the two nodes are aligned only to within {bound} of each "
            "other: clock error cannot be ruled out, and the link is not named.")
