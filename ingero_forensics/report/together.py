"""Nodes late together: half the fleet or more late at the same collectives.

Lateness against the median arrival (analyze.py, rule 1) cannot see them: the median is
then theirs, or midway between them and the healthy nodes, and the spread of all cells
is their fault itself. Measured before this rule (tests/merge/fleetgen.py, 4 nodes, two
of them 20 ms late at the same fifth of the collectives): "No straggler", both late
nodes at +0.1 ms and a jitter of 2.1 ms. So each node's arrival is also measured against
the *early half*: the median of the earliest floor(n/2) arrivals of the collective,
which stays a healthy node's as long as floor(n/2) nodes are on time; the jitter for it
comes from the nodes of the early half alone (those whose median cell is
at most the median of all nodes'), centred on their own median cell, so neither the late
group's cells nor the shift that the lower reference brings in a clean fleet move it.

A node is named by this rule only where the median rule named it not, with the same
bars (late cells in MIN_LATE_BINS bins, a cost of MIN_COST_SHARE of the run), and only
when at least two nodes pass: one node alone is what the median rule is for.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass

from .evidence import median


def add_to_cell(cells: dict, nid: int, late_ms: float) -> None:
    """One collective's lateness into a (bin, node) cell: [sum, count, max]."""
    acc = cells.get(nid)
    if acc is None:
        cells[nid] = [late_ms, 1, late_ms]
    else:
        acc[0] += late_ms
        acc[1] += 1
        acc[2] = max(acc[2], late_ms)


@dataclass
class LateTogether:
    node_id: int
    late_bins: list[int]
    cells: dict          # (bin, node) -> mean lateness against the early half, centred
    peak_ms: float       # median over its late bins of the latest collective's lateness
    cost_ns: float


class EarlyHalf:
    """Lateness against the early half of each collective's arrivals (fleets of 3+)."""

    def __init__(self) -> None:
        self.bins: dict[int, dict[int, list[float]]] = defaultdict(dict)  # b -> n -> [sum, k, max]
        self.points: dict[int, tuple[array, array]] = defaultdict(
            lambda: (array("q"), array("d")))   # node -> (collective time, lateness ms)

    def add(self, b: int, first: int, arrivals: list) -> None:
        ts = sorted(t for _, t in arrivals)
        ref = median(ts[: len(ts) // 2])
        cells = self.bins[b]
        for nid, t in arrivals:
            late = (t - ref) / 1e6
            add_to_cell(cells, nid, late)
            if late > 0:
                ts_, ls = self.points[nid]
                ts_.append(first)
                ls.append(late)

    def noise(self) -> tuple[dict, float, float]:
        """(cells, centre, robust spread) of the early-half nodes' cells."""
        cells = {(b, n): sv / k for b, per in self.bins.items() for n, (sv, k, _) in per.items()}
        per_node: dict[int, list[float]] = defaultdict(list)
        for (_, n), v in cells.items():
            per_node[n].append(v)
        node_med = {n: median(v) for n, v in per_node.items()}
        cut = median(list(node_med.values()))
        early = [v for (_, n), v in cells.items() if node_med[n] <= cut]
        centre = median(early)
        spread = 1.4826 * median([abs(v - centre) for v in early])
        return cells, centre, spread

    def late_nodes(self, *, threshold_of, min_bins: int, min_cost_ns: float, skip: set,
                   cost_of, cost_floor_ms: float) -> tuple[list[LateTogether], float]:
        """The nodes late together (at least two, else none), and the jitter used.
        ``threshold_of(spread, cells)`` is the late-cell bar, ``cost_of(points,
        jitter_ms)`` the cost rule of analyze.py."""
        if not self.bins:
            return [], 0.0
        cells, centre, spread = self.noise()
        threshold = threshold_of(spread, len(cells))
        late_bins: dict[int, list[int]] = defaultdict(list)
        for (b, n), v in cells.items():
            if v - centre > threshold and n not in skip:
                late_bins[n].append(b)
        jitter = max(cost_floor_ms, 3.0 * spread)
        out = []
        for n, bl in late_bins.items():
            if len(bl) < min_bins:
                continue
            ts, ls = self.points[n]
            pts = [(t, v - centre) for t, v in zip(ts, ls) if v - centre > cost_floor_ms]
            cost = cost_of(pts, jitter)
            if cost < min_cost_ns:
                continue
            out.append(LateTogether(
                n, sorted(bl), {(b, n): cells[(b, n)] - centre for b in bl},
                median([self.bins[b][n][2] - centre for b in bl]), cost))
        return (out if len(out) >= 2 else []), spread
