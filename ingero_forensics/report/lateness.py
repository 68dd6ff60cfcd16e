"""Lateness statistics of the report (docs/report.md, rules 2 and 3): the fleet's
jitter from the (bin, node) cells, the late-cell bar, the cost of a node's lateness and
the run it is a share of, and a straggler's windows."""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass
from statistics import NormalDist

from .evidence import median

#: A node must be late in at least this many time bins to be called a straggler.
MIN_LATE_BINS = 3
#: The spread of all cells is taken for the jitter unless it is more than this many
#: times what the nodes vary by on their own (fleet_noise_ms).
NOISE_SPLIT = 3.0
#: Lateness under this is never a late cell, however quiet the fleet.
LATE_FLOOR_MS = 1.0
#: At most this chance, over all cells of the run, that noise alone makes a late cell
#: (the Bonferroni bound uses a Gaussian tail; heavier tails are what the cost rule is
#: for).
FALSE_CELL_RATE = 0.01
#: Lateness values above this are kept for the cost (below it nobody waited).
COST_FLOOR_MS = 0.5


@dataclass
class Window:
    start_ns: int
    end_ns: int
    lateness_ms: float | None  # mean lateness of the straggler in the window; None for a
    #                             suspect that arrives on time (network, GPU, a link)


def _mad(vals) -> float:
    """1.4826 x the median absolute deviation: sigma, for Gaussian values."""
    if not vals:
        return 0.0
    m = median(vals)
    return median([abs(v - m) for v in vals]) * 1.4826


def fleet_noise_ms(cell: dict) -> tuple[float, str]:
    """The fleet's normal jitter from the (bin, node) -> mean lateness cells, and what it
    was taken from. The spread of all cells is robust while fewer than half of them are
    shifted, which a straggler among three or more nodes never does (the median arrival
    is a healthy node's). With two nodes every cell moves with the fault and that spread
    is the fault itself: a node 20 ms late for the whole run would set the bar above its
    own lateness. So, with two nodes, when the spread of all cells is more than
    NOISE_SPLIT times what the nodes vary by on their own (each cell against its node's
    median, or against the node's previous cell, which a fault that comes and goes does
    not inflate; the smaller), the jitter is that variation instead."""
    pooled = _mad(list(cell.values()))
    by_node: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (b, n), v in cell.items():
        by_node[n].append((b, v))
    if len(by_node) != 2 or min(len(v) for v in by_node.values()) < 2 * MIN_LATE_BINS:
        return pooled, "fleet"
    within, steps = [], []
    for series in by_node.values():
        series.sort()
        m = median([v for _, v in series])
        within += [v - m for _, v in series]
        steps += [(v1 - v0) / math.sqrt(2) for (_, v0), (_, v1) in zip(series, series[1:])]
    own = min(_mad(within), _mad(steps))
    if pooled > NOISE_SPLIT * own:
        return own, "per_node"
    return pooled, "fleet"


def _later_in_most_bins(cell: dict, nodes: dict, late_bins: dict,
                        min_bins: int) -> dict | None:
    """Of two nodes, the one that arrived later in so many time bins that chance cannot
    explain it (one-sided sign test, p < 0.001), by more than LATE_FLOOR_MS at its median
    bin, and yet late beyond the bar in fewer than ``min_bins`` bins; None otherwise."""
    by_node: dict[int, list[float]] = defaultdict(list)
    for (_, n), v in cell.items():
        by_node[n].append(v)
    for nid, vals in by_node.items():
        n, k = len(vals), sum(1 for v in vals if v > 0)
        if n < 2 * MIN_LATE_BINS or len(late_bins.get(nid, ())) >= min_bins or \
                median(vals) <= LATE_FLOOR_MS or _sign_tail(n, k) >= 0.001:
            continue
        return {"node": nodes[nid][0], "later_bins": k, "bins": n,
                "median_ms": round(median(vals), 3)}
    return None


def _sign_tail(n: int, k: int) -> float:
    """P(at least k of n fair coin flips come up heads): exact to 200 flips, the normal
    approximation (with continuity correction) beyond."""
    if n <= 200:
        return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n
    return 0.5 * math.erfc((k - 0.5 - n / 2) / math.sqrt(n / 4) / math.sqrt(2))


def late_threshold_ms(noise_ms: float, cells: int) -> float:
    """The lateness a (node, bin) cell must exceed: a Gaussian tail bound over every
    cell of the run at FALSE_CELL_RATE, in units of the fleet's robust spread."""
    k = NormalDist().inv_cdf(1.0 - FALSE_CELL_RATE / max(cells, 1))
    return max(LATE_FLOOR_MS, max(k, 4.0) * noise_ms)


def active_ns(times, gap_ns: int) -> int:
    """The run's length for its cost shares: the time collectives ran, from the first to
    the last, a pause longer than ``gap_ns`` (a bin) counted as one bin. A job paused for
    an evaluation, or two jobs merged into one fleet.db, would otherwise dilute every
    cost: node-02 of one of two merged 50 s jobs, 12 % of its job, was 0.05 % of the
    146 min between their collectives."""
    total = sum(min(b - a, gap_ns) for a, b in zip(times, itertools.islice(times, 1, None)))
    return max(total, 1)


def _cost_ns(points, times, jitter_ms: float) -> float:
    """Sum of the rises of a node's excess lateness (lateness - jitter, at least 0) over
    the collectives in time order. ``points``: (collective time, lateness ms) of the
    collectives where it was late by more than COST_FLOOR_MS (at most that elsewhere:
    excess 0); ``times``: every collective's time, sorted."""
    return rises_ns(sorted((bisect.bisect_left(times, t), late) for t, late in points),
                    jitter_ms)


def rises_ns(points, jitter_ms: float) -> float:
    """_cost_ns of points given as (position of the collective in time order, lateness
    ms), sorted."""
    total, prev_x, prev_k = 0.0, 0.0, None
    for k, late in points:
        if prev_k is None or k != prev_k + 1:
            prev_x = 0.0          # a collective in between where it was on time
        x = max(0.0, late - jitter_ms)
        if x > prev_x:
            total += x - prev_x
        prev_x, prev_k = x, k
    return total * 1e6


def _straggler_windows(late: list[int], t0: int, bin_ns: int, cell, node,
                       counts) -> tuple[list[Window], float]:
    """A straggler's windows from its late bins, and its mean lateness per collective
    over them (the bins a window bridges included: the figure the verdict quotes)."""
    windows = _join_bins(sorted(late), t0, bin_ns, cell, node, counts)
    # A short blip far weaker than the fault itself is a hiccup, not a window; repeated
    # short stalls of similar size are all kept. (Not by its share of the largest
    # window's lateness: a fault's own short period, as strong as its long one, holds a
    # sliver of it too, and a review found two such periods dropped. A benign pause of
    # one of the straggler's ranks, over half its fault's lateness in its bin, stays a
    # window: the node was that late then.)
    peak = max(w.lateness_ms for w in windows)
    windows = [w for w in windows
               if w.end_ns - w.start_ns >= 3 * bin_ns or w.lateness_ms >= 0.5 * peak]
    total = n = 0.0
    for w in windows:
        for b in range((w.start_ns - t0) // bin_ns, (w.end_ns - t0) // bin_ns):
            k = counts.get((b, node), 0)
            total += cell.get((b, node), 0.0) * k
            n += k
    return windows, total / n if n else 0.0


def _join_bins(bins_: list[int], t0: int, bin_ns: int, cell, node,
               counts=None) -> list[Window]:
    """Late bins joined into windows across gaps of one bin; each window's lateness is
    the node's mean per collective over every bin it spans (each bin's mean weighted by
    its collectives), so a gap bridged counts with what it held."""
    out: list[Window] = []
    run: list[int] = []
    for b in bins_ + [None]:
        if run and (b is None or b - run[-1] > 2):   # bridge gaps of one bin
            lat = None
            if node is not None:
                span = [(cell[(x, node)], counts.get((x, node), 1) if counts else 1)
                        for x in range(run[0], run[-1] + 1) if (x, node) in cell]
                lat = sum(v * k for v, k in span) / max(1, sum(k for _, k in span))
            out.append(Window(t0 + run[0] * bin_ns, t0 + (run[-1] + 1) * bin_ns,
                              None if lat is None else round(lat, 3)))
            run = []
        if b is not None:
            run.append(b)
    return out
