"""Nodes late together: half the fleet or more late at the same collectives.

Lateness against the median arrival (analyze.py, rule 1) cannot see them: the median is
then theirs, or midway between them and the healthy nodes, and the spread of all cells
is their fault itself. Measured before this rule (tests/merge/fleetgen.py, 4 nodes, two
of them 20 ms late at the same fifth of the collectives): "No straggler", both late
nodes at +0.1 ms and a jitter of 2.1 ms. So each node's arrival is also measured against
the *early half*: the median of the earliest floor(n/2) arrivals of the collective,
which stays a healthy node's as long as floor(n/2) nodes are on time; the jitter for it
comes from the nodes of the early half alone (those whose median cell is at most the
median of all nodes'), centred on their own median cell, so neither the late group's
cells nor the shift that the lower reference brings in a clean fleet move it.

A node is named by this rule only where the median rule named it not, with the same
bars (late cells in MIN_LATE_BINS bins, a cost of MIN_COST_SHARE of the run), and only
when at least two nodes pass: one node alone is what the median rule is for.

Cheap on purpose (the report reads 12,000 collectives x 64 nodes in about 8 s): the
lateness against the early half is the median lateness plus one shift per collective
(median - early-half median), so the pass over the collectives keeps one number per
collective and per arrival the collective's index; a cell against the early half is
the median cell plus its bin's mean shift (exact for a node in every collective of the
bin), and only the nodes that pass that screen get their exact cells and cost.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass

from .evidence import median


def early_half_ref(ts: list[int]) -> float:
    """The median of the earliest floor(n/2) of a collective's sorted arrivals."""
    return median(ts[: len(ts) // 2])


@dataclass
class LateTogether:
    node_id: int
    late_bins: list[int]
    cells: dict          # (bin, node) -> mean lateness against the early half, centred,
                         # for every bin it took part in
    counts: dict         # (bin, node) -> its collectives in that bin
    peak_ms: float       # median over its late bins of the latest collective's lateness
    cost_ns: float


class EarlyHalf:
    """The shifts (median - early-half median, ms) of each collective, in the order the
    lateness pass reads them; per bin their sum and count."""

    def __init__(self) -> None:
        self.shift = array("d")           # per collective read (0 with two arrivals)
        self.time = array("q")            # its first entry
        self.bin_shift: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])

    def add(self, b: int, first: int, shift_ms: float) -> int:
        """Record one collective; returns its index (kept per arrival by the caller)."""
        self.shift.append(shift_ms)
        self.time.append(first)
        acc = self.bin_shift[b]
        acc[0] += shift_ms
        acc[1] += 1
        return len(self.shift) - 1

    def late_nodes(self, cell_med: dict, node_lates: dict, node_index: dict, *,
                   t0: int, bin_ns: int, threshold_of, min_bins: int, min_cost_ns: float,
                   skip: set, cost_of, cost_floor_ms: float) -> tuple[list[LateTogether], float]:
        """The nodes late together (at least two, else none), and the jitter used.
        ``cell_med``: (bin, node) -> mean median lateness; ``node_lates[n]`` and
        ``node_index[n]``: a node's median lateness per collective and that collective's
        index here; ``threshold_of(spread, cells)`` is the late-cell bar and
        ``cost_of(points, jitter_ms)`` the cost rule of lateness.py (rises_ns: points as
        (position in time order, lateness ms), sorted)."""
        if not self.shift:
            return [], 0.0
        mean_shift = {b: s / k for b, (s, k) in self.bin_shift.items() if k}
        cells = {(b, n): v + mean_shift.get(b, 0.0) for (b, n), v in cell_med.items()}
        per_node: dict[int, list[float]] = defaultdict(list)
        for (_, n), v in cells.items():
            per_node[n].append(v)
        node_med = {n: median(v) for n, v in per_node.items()}
        cut = median(list(node_med.values()))
        early = [v for (_, n), v in cells.items() if node_med[n] <= cut]
        centre = median(early)
        spread = 1.4826 * median([abs(v - centre) for v in early])
        threshold = threshold_of(spread, len(cells))
        screened: dict[int, int] = defaultdict(int)
        for (b, n), v in cells.items():
            if v - centre > threshold and n not in skip:
                screened[n] += 1
        jitter = max(cost_floor_ms, 3.0 * spread)
        shift, time = self.shift, self.time
        order = sorted(range(len(time)), key=time.__getitem__)
        pos = array("l", bytes(8 * len(order)))
        for k, ci in enumerate(order):
            pos[ci] = k
        out = []
        for n, count in screened.items():
            if count < min_bins:
                continue
            # the node's exact cells against the early half (the screen assumed it took
            # part in every collective of each bin), then its cost
            exact: dict[int, list[float]] = {}
            pts = []
            for late, ci in zip(node_lates[n], node_index[n]):
                v = late + shift[ci] - centre
                b = (time[ci] - t0) // bin_ns
                acc = exact.get(b)
                if acc is None:
                    exact[b] = [v, 1, v]
                else:
                    acc[0] += v
                    acc[1] += 1
                    if v > acc[2]:
                        acc[2] = v
                if v > cost_floor_ms:
                    pts.append((pos[ci], v))
            late_bins = sorted(b for b, (sv, k, _) in exact.items() if sv / k > threshold)
            if len(late_bins) < min_bins:
                continue
            pts.sort()
            cost = cost_of(pts, jitter)
            if cost < min_cost_ns:
                continue
            out.append(LateTogether(
                n, late_bins, {(b, n): sv / k for b, (sv, k, _) in exact.items()},
                {(b, n): k for b, (_, k, _) in exact.items()},
                median([exact[b][2] for b in late_bins]), cost))
        return (out if len(out) >= 2 else []), spread
