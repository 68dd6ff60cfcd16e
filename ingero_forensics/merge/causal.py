"""Causal bounds on the alignment: what collectives prove about clocks, as inequalities.

Every rank's entry into a collective whose completion needs every rank (all-reduce,
all-gather, reduce-scatter, all-to-all) happens before any rank's return from the
synchronization that observed that completion, whatever was queued in between. So for
nodes i and j sharing collective c, in fleet time::

    entry_j(c) + min_latency <= observed_i(c)

These are the message constraints of post-mortem trace synchronization (a send before
its receive; Scalasca's controlled logical clock, the convex-hull bounds of Duda's and
Hofmann's algorithms): they bound each node's line from both sides and never pull a node
towards an assumed simultaneity. Lateness at entry is the straggler signal, and a
constraint of this form cannot consume it: a late node only loosens its own bounds.

``enforce`` moves a node's line only when it breaks a constraint, and only as far as
needed (the closest line, in its values at both ends of the capture, that satisfies
every constraint and the rate bound): nodes are placed one at a time against those
already placed, the most trusted first, so a few broken clocks move towards the good
ones and never the other way. ``extent`` then tells, per node, how far its line could still move earlier
or later with every other node fixed: where nothing tighter (tight completion
observations, honest clock claims) pins the node, that is its relative uncertainty.

Pure Python: the systems are a few thousand sampled collectives by the node count.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

#: Ops whose completion on any rank needs every rank's entry.
FULL_DEPENDENCY_OPS = ("ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "ALL_TO_ALL")
#: Constraints per node are binned in time, the tightest kept per bin (a looser but
#: still valid polygon; the solve stays small whatever the sample).
BINS = 64
#: A move or bound larger than this (ns) means "unbounded" (no constraint that side).
UNBOUNDED_NS = 1e12
#: Violations below this (ns) are rounding, not a broken constraint.
TOLERANCE_NS = 500.0
#: Passes of CausalSystem._centre over the nodes it centres.
CENTRE_PASSES = 3
#: A moved line keeps this far (ns) inside its bounds: the line is applied per event,
#: not per collective, and rounded to whole nanoseconds.
MARGIN_NS = 1000.0


_NONE = (None, None, None, None)


def _enter(ext: tuple, nid: int, e, s, sh: float) -> tuple:
    """(s1, s2, e1, e2), a row's two earliest observations and two latest entries as
    (time, node), with one more node's entry e and observation s (None: none) shifted by
    sh. Earlier nodes win ties, as in the row's order."""
    s1, s2, e1, e2 = ext
    if s is not None:
        v = s + sh
        if s1 is None or v < s1[0]:
            s1, s2 = (v, nid), s1
        elif s2 is None or v < s2[0]:
            s2 = (v, nid)
    if e is not None:
        v = e + sh
        if e1 is None or v > e1[0]:
            e1, e2 = (v, nid), e1
        elif e2 is None or v > e2[0]:
            e2 = (v, nid)
    return s1, s2, e1, e2


@dataclass
class NodeBounds:
    moved_ns: float = 0.0           # largest |shift| applied at either end of the capture
    violation_ns: float = 0.0       # worst broken constraint before the move
    early_ns: float | None = 0.0    # how far the line may still move earlier (None: free)
    late_ns: float | None = 0.0     # ... later
    constraints: int = 0
    infeasible: bool = False        # no line satisfies its constraints (others' errors)


class CausalSystem:
    """The sampled collectives of one fleet as per-node constraints.

    ``rows``: per collective, [(node, entry, observed)] in fleet time relative to a
    reference (ns, floats; None where the node has no entry or no observation), for
    full-dependency ops only. Corrections are lines ``a + b * tau`` per node (ns, tau in
    seconds from the reference), added to the times given here."""

    def __init__(self, rows: list[list[tuple[int, float | None, float | None]]],
                 min_latency_ns: float):
        self.rows = [r for r in rows if len(r) >= 2]
        self.lat = float(min_latency_ns)
        self.tau = []
        for r in self.rows:
            ts = sorted(v for _, e, s in r for v in (e, s) if v is not None)
            self.tau.append(ts[len(ts) // 2] / 1e9 if ts else 0.0)
        self.corr: dict[int, tuple[float, float]] = {}
        self.span: dict[int, tuple[float, float]] = {}
        #: per node, its entries (row index, entry, observed) in row order: the
        #: constraints of a few nodes read those, not every row (a fleet-wide collective
        #: is a row of every node: centring each of 1,000 nodes against every row was
        #: quadratic in the nodes)
        self.entries_of: dict[int, list[tuple[int, float | None, float | None]]] = {}
        for k, (r, tau) in enumerate(zip(self.rows, self.tau)):
            for nid, e, s in r:
                lo, hi = self.span.get(nid, (tau, tau))
                self.span[nid] = (min(lo, tau), max(hi, tau))
                self.entries_of.setdefault(nid, []).append((k, e, s))
        #: per row, its two earliest observations and two latest entries on the current
        #: lines (_extremes), dropped when the line of a node in it changes (_set_corr)
        self._ext: dict[int, tuple] = {}

    def _shift(self, nid: int, tau: float) -> float:
        a, b = self.corr.get(nid, (0.0, 0.0))
        return a + b * tau

    def _set_corr(self, nid: int, a: float, b: float) -> None:
        """A node's new line; each row's extremes kept where the node is not among
        them before (its new times enter them where they are earlier or later), made
        again on the next read where it is."""
        self.corr[nid] = (a, b)
        for k, e, s in self.entries_of.get(nid, ()):
            ext = self._ext.get(k)
            if ext is None:
                continue
            if any(x is not None and x[1] == nid for x in ext):
                del self._ext[k]
                continue
            self._ext[k] = _enter(ext, nid, e, s, a + b * self.tau[k])

    def _extremes(self, k: int, among=None) -> tuple:
        """Row k's two earliest observations and two latest entries, (time, node) each
        (None where there is none), on the current lines, of the nodes ``among``
        (default: all; only that case is kept between calls)."""
        if among is None:
            hit = self._ext.get(k)
            if hit is not None:
                return hit
        tau = self.tau[k]
        out = (None, None, None, None)
        for nid, e, s in self.rows[k]:
            if among is None or nid in among:
                out = _enter(out, nid, e, s, self._shift(nid, tau))
        if among is None:
            self._ext[k] = out
        return out

    def constraints(self, among=None, only=None, bins: int = BINS, among_ext=None,
                    ) -> dict[int, list[tuple[float, float, float]]]:
        """Per node: (tau, lo, hi) bounds on its extra shift at tau (binned, tightest),
        against the nodes ``among`` (default: all), for the nodes ``only`` (default:
        all). ``among_ext``: the rows' extremes among those nodes, where the caller keeps
        them (_place: the set only grows, and its lines no longer move)."""
        per: dict[int, dict[int, list[float]]] = {}
        nodes = self.entries_of if only is None else sorted(n for n in only
                                                            if n in self.entries_of)
        kept = among_ext is not None
        if not kept:
            among_ext = {}                     # this call's, for a set of nodes
        for nid in nodes:
            for row, e, s in self.entries_of[nid]:
                tau = self.tau[row]
                # the two earliest observations and the two latest entries, with their nodes
                if among is None:
                    s1, s2, e1, e2 = self._extremes(row)
                else:
                    ext = among_ext.get(row)
                    if ext is None:
                        ext = _NONE if kept else self._extremes(row, among)
                        if not kept:
                            among_ext[row] = ext
                    s1, s2, e1, e2 = ext
                sh = self._shift(nid, tau)
                hi = lo = None
                if e is not None:
                    other = s1 if s1 is not None and s1[1] != nid else s2
                    if other is not None:
                        hi = other[0] - (e + sh) - self.lat
                if s is not None:
                    other = e1 if e1 is not None and e1[1] != nid else e2
                    if other is not None:
                        lo = other[0] - (s + sh) + self.lat
                if hi is None and lo is None:
                    continue
                t0, t1 = self.span[nid]
                k = min(int((tau - t0) / (t1 - t0) * bins), bins - 1) if t1 > t0 else 0
                cell = per.setdefault(nid, {}).setdefault(k, [tau, -math.inf, math.inf, tau])
                if lo is not None and lo > cell[1]:
                    cell[1] = lo
                    cell[0] = tau
                if hi is not None and hi < cell[2]:
                    cell[2] = hi
                    cell[3] = tau
        out = {}
        for nid, cells in per.items():
            cons = []
            for tlo, lo, hi, thi in cells.values():
                if tlo == thi:
                    cons.append((tlo, lo, hi))
                else:
                    if lo > -math.inf:
                        cons.append((tlo, lo, math.inf))
                    if hi < math.inf:
                        cons.append((thi, -math.inf, hi))
            out[nid] = cons
        return out

    def enforce(self, order_hint: dict[int, int], rate_bound: dict[int, float],
                centre: dict[int, float] | None = None) -> dict[int, NodeBounds]:
        """Make every line satisfy the constraints, moving as little as needed.

        Nothing moves when nothing is broken. Otherwise the nodes are placed one at a
        time, each against the nodes placed before it only (a set consistent with
        itself): first those ``order_hint`` ranks first (lower = more trusted, e.g. lines
        tied by tight observations), then always the one the placed set contradicts
        least; a node whose line breaks a constraint of the placed set moves to the
        nearest line that satisfies them all and its rate bound. A few broken clocks
        among good ones therefore move; the good ones do not follow them."""
        info = {nid: NodeBounds() for nid in self.span}
        cons = self.constraints()
        broken = {nid: _violation(cs) for nid, cs in cons.items()}
        if max(broken.values(), default=0.0) > TOLERANCE_NS:
            self._place(order_hint, rate_bound, info)
        if centre:
            self._centre(centre, rate_bound, info)
        cons = self.constraints()
        for nid in self.span:
            a0, b0 = self.corr.get(nid, (0.0, 0.0))
            cs = cons.get(nid, [])
            info[nid].constraints = len(cs)
            t0, t1 = self.span[nid]
            poly = _polygon(cs, t0, t1, a0, b0, rate_bound.get(nid, math.inf))
            if not poly:
                info[nid].early_ns = info[nid].late_ns = None
                info[nid].infeasible = True
                continue
            now = (a0 + b0 * t0, a0 + b0 * t1)
            early = max(max(now[0] - p[0], now[1] - p[1]) for p in poly)
            late = max(max(p[0] - now[0], p[1] - now[1]) for p in poly)
            info[nid].early_ns = None if early >= UNBOUNDED_NS / 2 else max(early, 0.0)
            info[nid].late_ns = None if late >= UNBOUNDED_NS / 2 else max(late, 0.0)
        return info

    def _centre(self, nodes: dict[int, float], rate_bound, info,
                passes: int = CENTRE_PASSES) -> None:
        """Move each node of ``nodes`` to the middle of the lines its constraints allow,
        the others held fixed (the polygon's centroid, in its values at both ends), a
        few passes round, where that middle is within ``nodes[nid]`` (ns: the fit's own
        uncertainty) of every allowed line. Where tight bounds hold a node from both
        sides (messages), the middle is the point whose worst case is smallest, and
        better than a fit, which is biased wherever its observations are (a CPU-starved
        node's late returns); where one side is loose (that node's receives), the fit
        knows more than the middle of a wide room."""
        for _ in range(passes):
            for nid in sorted(nodes):
                if nid not in self.span:
                    continue
                cs = self.constraints(only={nid}).get(nid, [])
                a0, b0 = self.corr.get(nid, (0.0, 0.0))
                t0, t1 = self.span[nid]
                poly = _polygon(cs, t0, t1, a0, b0, rate_bound.get(nid, math.inf))
                if len(poly) < 3 or any(abs(v) >= UNBOUNDED_NS / 2 for p in poly for v in p):
                    continue
                half = max(max(p[k] for p in poly) - min(p[k] for p in poly)
                           for k in (0, 1)) / 2
                if half >= nodes[nid]:
                    continue
                pa, pb = _centroid(poly)
                if t1 > t0:
                    b = (pb - pa) / (t1 - t0)
                    a = pa - b * t0
                else:
                    a, b = pa, b0
                moved = max(abs(a - a0 + (b - b0) * t0), abs(a - a0 + (b - b0) * t1))
                self._set_corr(nid, a, b)
                info[nid].moved_ns = max(info[nid].moved_ns, moved)

    def _place(self, order_hint, rate_bound, info) -> None:
        todo = set(self.span)
        first = min(todo, key=lambda n: (order_hint.get(n, 1), n))
        placed = {first}
        todo.discard(first)
        # the rows' extremes among the placed nodes, each node entered once placed (its
        # line final then): reading them again for every candidate at every step was
        # quadratic in the nodes times the rows' length
        placed_ext: dict[int, tuple] = {}

        def enter(n):
            for k, e, s in self.entries_of.get(n, ()):
                placed_ext[k] = _enter(placed_ext.get(k, _NONE), n, e, s,
                                       self._shift(n, self.tau[k]))
        enter(first)
        while todo:
            best_rank = min(order_hint.get(n, 1) for n in todo)
            cands = [n for n in todo if order_hint.get(n, 1) == best_rank]
            # the least contradicted, the smallest id among equals: in id order, the first
            # that nothing contradicts ends the search (with consistent clocks, at once)
            best = None
            for n in sorted(cands):
                cs_n = self.constraints(among=placed, only={n},
                                        among_ext=placed_ext).get(n, [])
                v_n = _violation(cs_n)
                if best is None or v_n < best[0]:
                    best = (v_n, n, cs_n)
                if v_n <= 0.0:
                    break
            v, nid, cs = best
            if v > 0:
                a0, b0 = self.corr.get(nid, (0.0, 0.0))
                t0, t1 = self.span[nid]
                poly = _polygon(cs, t0, t1, a0, b0, rate_bound.get(nid, math.inf))
                if not poly:
                    info[nid].infeasible = True
                else:
                    pa, pb = _project(poly, a0 + b0 * t0, a0 + b0 * t1)
                    if t1 > t0:
                        b = (pb - pa) / (t1 - t0)
                        a = pa - b * t0
                    else:
                        a, b = pa, b0
                    self._set_corr(nid, a, b)
                    # the binned polygon holds at each bin's tightest points; a tilted
                    # line may still graze a point between them: settle the offset on
                    # every point
                    every = self.constraints(among=placed, only={nid},
                                             bins=len(self.rows),
                                             among_ext=placed_ext).get(nid, [])
                    up = max((lo for _, lo, _ in every), default=-math.inf)
                    down = min((hi for _, _, hi in every), default=math.inf)
                    room = max(0.0, min(MARGIN_NS, (down - up) / 2))
                    if up > -room and up <= down:
                        a += up + room
                    elif down < room and up <= down:
                        a += down - room
                    self._set_corr(nid, a, b)
                    info[nid].violation_ns = v
                    info[nid].moved_ns = max(abs(a - a0 + (b - b0) * t0),
                                             abs(a - a0 + (b - b0) * t1))
            placed.add(nid)
            enter(nid)
            todo.discard(nid)


def _violation(cons) -> float:
    """The worst broken bound: 0 must lie within every [lo, hi] of extra shift."""
    worst = 0.0
    for tau, lo, hi in cons:
        # bounds are on the extra shift beyond the current correction: 0 must fit
        if lo > worst:
            worst = lo
        if -hi > worst:
            worst = -hi
    return worst


def _polygon(cons, t0, t1, a0, b0, rate_bound):
    """Vertices (pa, pb) = (line at t0, line at t1) of the total correction lines that
    satisfy every constraint (extra shift at tau within [lo, hi], relative to the line
    (a0, b0)) and |b| <= rate_bound; [] if none."""
    span = t1 - t0
    base0, base1 = a0 + b0 * t0, a0 + b0 * t1
    big = UNBOUNDED_NS
    poly = [(base0 - big, base1 - big), (base0 + big, base1 - big),
            (base0 + big, base1 + big), (base0 - big, base1 + big)]
    halfplanes = []   # (c0, c1, r): c0 * pa + c1 * pb <= r
    for tau, lo, hi in cons:
        f = (tau - t0) / span if span > 0 else 0.0
        base = a0 + b0 * tau
        # value of the total line at tau: pa (1 - f) + pb f
        if hi < math.inf:
            halfplanes.append((1.0 - f, f, base + hi))
        if lo > -math.inf:
            halfplanes.append((-(1.0 - f), -f, -(base + lo)))
    if span > 0 and rate_bound < math.inf:
        halfplanes.append((-1.0, 1.0, rate_bound * span))      # pb - pa <= R span
        halfplanes.append((1.0, -1.0, rate_bound * span))
    elif span <= 0:
        halfplanes.append((-1.0, 1.0, 0.0))
        halfplanes.append((1.0, -1.0, 0.0))
    for c0, c1, r in halfplanes:
        poly = _clip(poly, c0, c1, r)
        if not poly:
            return []
    return poly


def _clip(poly, c0, c1, r):
    """Sutherland-Hodgman: the part of a convex polygon with c0 x + c1 y <= r."""
    out = []
    n = len(poly)
    tol = 1e-6 * (abs(r) + 1.0)
    for k in range(n):
        p, q = poly[k], poly[(k + 1) % n]
        vp = c0 * p[0] + c1 * p[1] - r
        vq = c0 * q[0] + c1 * q[1] - r
        if vp <= tol:
            out.append(p)
        if (vp < -tol and vq > tol) or (vp > tol and vq < -tol):
            t = vp / (vp - vq)
            out.append((p[0] + t * (q[0] - p[0]), p[1] + t * (q[1] - p[1])))
    return out


def _project(poly, x, y):
    """The point of a convex polygon closest to (x, y)."""
    if _inside(poly, x, y):
        return x, y
    best, bd = None, math.inf
    n = len(poly)
    for k in range(n):
        (px, py), (qx, qy) = poly[k], poly[(k + 1) % n]
        dx, dy = qx - px, qy - py
        ll = dx * dx + dy * dy
        t = 0.0 if ll <= 0 else max(0.0, min(1.0, ((x - px) * dx + (y - py) * dy) / ll))
        cx, cy = px + t * dx, py + t * dy
        d = (cx - x) ** 2 + (cy - y) ** 2
        if d < bd:
            best, bd = (cx, cy), d
    return best


def _centroid(poly) -> tuple[float, float]:
    """Area centroid of a convex polygon (the vertex mean if it has no area)."""
    ox, oy = poly[0]
    area = cx = cy = 0.0
    for k in range(1, len(poly) - 1):
        (x1, y1), (x2, y2) = poly[k], poly[k + 1]
        w = ((x1 - ox) * (y2 - oy) - (x2 - ox) * (y1 - oy)) / 2.0
        area += w
        cx += w * (ox + x1 + x2) / 3.0
        cy += w * (oy + y1 + y2) / 3.0
    if abs(area) < 1e-9:
        return (sum(p[0] for p in poly) / len(poly), sum(p[1] for p in poly) / len(poly))
    return cx / area, cy / area


def _inside(poly, x, y) -> bool:
    n = len(poly)
    if n < 3:
        return False
    sign = 0
    for k in range(n):
        (px, py), (qx, qy) = poly[k], poly[(k + 1) % n]
        cross = (qx - px) * (y - py) - (qy - py) * (x - px)
        if abs(cross) < 1e-9:
            continue
        s = 1 if cross > 0 else -1
        if sign == 0:
            sign = s
        elif s != sign:
            return False
    return True


#: project_messages aims this far (ns) inside each bound, and gives up after MAX_SWEEPS
#: sweeps (a contradiction among the messages themselves).
SETTLED_NS = 20.0
MAX_SWEEPS = 3000
#: message_bounds looks at the pairs in windows of the capture: at least this many, at
#: most BOUND_WINDOW_MAX_S long (within one, the errors are taken as constant: lines
#: whose rates differ by 0.01 ppm drift 0.6 us apart in 60 s).
BOUND_WINDOWS = 8
BOUND_WINDOW_MAX_S = 60.0


def project_messages(pairs, min_latency_ns: float
                     ) -> tuple[dict[int, tuple[float, float]], tuple[float, float], bool]:
    """A small change of every node's line that puts each send before its receive.

    ``pairs``: (sending node, send, receiving node, receive), fleet times (ns, floats)
    relative to a reference, on the current lines. Returns per node its extra
    correction at the start and the end of the pairs' span (ns), the span's ends
    (tau, seconds), and whether every pair now holds (False: the pairs contradict each
    other, after MAX_SWEEPS sweeps). Alternating projections onto each pair's bound, in those end values
    (so a correction is small at both ends), starting from no change: each broken pair
    moves its two lines apart by what it lacks, split between them. Messages form
    cycles (a ring of nodes, each sending to the next), where placing one node at a time,
    as ``CausalSystem.enforce`` does, can push the last one into a contradiction; moving
    all lines together cannot. (Dykstra's variant, which would find the smallest change,
    took thousands of sweeps here where this takes a few dozen.) Nodes without pairs are
    absent."""
    if not pairs:
        return {}, (0.0, 0.0), True
    # each end is corrected at its own time: before the projection the nodes' times of
    # one message may be far apart (unsynchronized clocks), and a line's rate matters
    t0 = min(min(s, r) for _, s, _, r in pairs) / 1e9
    t1 = max(max(s, r) for _, s, _, r in pairs) / 1e9
    span = t1 - t0

    def frac(t):
        return (t / 1e9 - t0) / span if span > 0 else 0.5

    cons = []
    for i, s, j, r in pairs:
        ws, wr = frac(s), frac(r)
        # (1 - wr) p0_j + wr p1_j - (1 - ws) p0_i - ws p1_i >= s + lat - r
        g = (-(1.0 - ws), -ws, 1.0 - wr, wr)
        cons.append((i, j, g, sum(v * v for v in g), s + min_latency_ns - r))
    x = {n: [0.0, 0.0] for c in cons for n in c[:2]}
    for _sweep in range(MAX_SWEEPS):
        broken = 0.0
        for i, j, g, gg, c in cons:
            xi, xj = x[i], x[j]
            val = g[0] * xi[0] + g[1] * xi[1] + g[2] * xj[0] + g[3] * xj[1]
            if val < c:
                broken = max(broken, c - val)
                step = (c + SETTLED_NS - val) / gg
                xi[0] += step * g[0]
                xi[1] += step * g[1]
                xj[0] += step * g[2]
                xj[1] += step * g[3]
        if broken <= 0.0:
            break
    return {n: (v[0], v[1]) for n, v in x.items()}, (t0, t1), broken <= 0.0


def message_bounds(pairs, min_latency_ns: float
                   ) -> dict[int, list[tuple[float, float]]]:
    """How far each node's clock may be from any other node's, by the messages alone:
    per node, (window centre in seconds, bound in ns) for the windows that bound it.

    ``pairs``: (sending node, send, receiving node, receive) on the final lines (ns). A
    send before its receive is the difference constraint x_j - x_i >= s + lat - r on
    the nodes' errors x; its slack on the final lines is how much more node i could be
    late relative to j. Within a short window the errors are nearly constant, and the
    truth and the estimate both satisfy every constraint, so two nodes' relative errors
    differ by at most the shortest chain of slacks between them, either way round
    (Dijkstra over the window's smallest slack per link); a node's bound in a window is
    the largest over the other nodes. A window where some node is not tied to it both
    ways (no cycle through them) does not bound it. Errors are linear in time, so the
    caller extends the windows' bounds over the capture (align.error_bound)."""
    pairs = [p for p in pairs if p[0] != p[2]]
    if not pairs:
        return {}
    nodes = {n for i, _, j, _ in pairs for n in (i, j)}
    t0 = min(s for _, s, _, _ in pairs)
    span = max(s for _, s, _, _ in pairs) - t0
    count = max(BOUND_WINDOWS, math.ceil(span / (BOUND_WINDOW_MAX_S * 1e9)))
    width = span / count or 1.0
    windows: list[dict[tuple[int, int], float]] = [{} for _ in range(count)]
    for i, s, j, r in pairs:
        slack = windows[min(int((s - t0) / width), count - 1)]
        v = max(r - s - min_latency_ns, 0.0)
        # how far x_i - x_j may still grow: along the edge j -> i
        if v < slack.get((j, i), math.inf):
            slack[(j, i)] = v
    out: dict[int, list[tuple[float, float]]] = {}
    for k, w in enumerate(windows):
        centre = (t0 + (k + 0.5) * width) / 1e9
        for n, bound in _cycle_bounds(w, nodes).items():
            out.setdefault(n, []).append((centre, bound))
    return out


#: Nodes up to which _cycle_bounds computes every shortest chain (a Dijkstra from each
#: node: quadratic in the nodes); above, it bounds them through HUBS of them.
EXACT_CYCLE_NODES = 128
HUBS = 16


def _cycle_bounds(slack: dict[tuple[int, int], float], nodes) -> dict[int, float]:
    adj: dict[int, list[tuple[int, float]]] = {n: [] for n in nodes}
    for (u, v), w in slack.items():
        adj[u].append((v, w))
    if len(nodes) > EXACT_CYCLE_NODES:
        return _hub_bounds(adj, nodes)
    dist = {n: _dijkstra(adj, n) for n in nodes}
    out = {}
    for n in nodes:
        worst = 0.0
        for m in nodes:
            if m == n:
                continue
            a, b = dist[n].get(m), dist[m].get(n)
            if a is None or b is None:
                break
            worst = max(worst, a, b)
        else:
            out[n] = worst
    return out


def _hub_bounds(adj, nodes) -> dict[int, float]:
    """_cycle_bounds through a few hubs, for large fleets: the chain from n to any m is
    at most the chain from n to a hub r plus the longest chain out of r (and the chain
    from any m to n at most the longest chain into r plus r's to n), the least over the
    hubs; valid bounds, looser than every chain computed (in a ring of N nodes about
    (1 + 1/HUBS) times the exact one), at 2 x HUBS Dijkstras instead of N."""
    order = sorted(nodes)
    hubs = order[::max(1, len(order) // HUBS)][:HUBS]
    radj: dict[int, list[tuple[int, float]]] = {n: [] for n in nodes}
    for u, edges in adj.items():
        for v, w in edges:
            radj[v].append((u, w))
    out_of, into = {}, {}
    for r in hubs:
        out_of[r] = _dijkstra(adj, r)      # r to every node
        into[r] = _dijkstra(radj, r)       # every node to r
    ecc_out = {r: max(d.values()) if len(d) == len(order) else math.inf
               for r, d in out_of.items()}
    ecc_in = {r: max(d.values()) if len(d) == len(order) else math.inf
              for r, d in into.items()}
    out = {}
    for n in order:
        to_any = min(into[r].get(n, math.inf) + ecc_out[r] for r in hubs)
        from_any = min(ecc_in[r] + out_of[r].get(n, math.inf) for r in hubs)
        worst = max(to_any, from_any)
        if worst < math.inf:
            out[n] = worst
    return out


def _dijkstra(adj, src) -> dict[int, float]:
    best = {src: 0.0}
    heap = [(0.0, src)]
    while heap:
        d, u = heapq.heappop(heap)
        if d > best.get(u, math.inf):
            continue
        for v, w in adj[u]:
            nd = d + w
            if nd < best.get(v, math.inf):
                best[v] = nd
                heapq.heappush(heap, (nd, v))
    return best
