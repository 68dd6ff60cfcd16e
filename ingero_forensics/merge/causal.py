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
every constraint and the rate bound), one node at a time, the worst first, until none
is broken. ``extent`` then tells, per node, how far its line could still move earlier
or later with every other node fixed: where nothing tighter (tight completion
observations, honest clock claims) pins the node, that is its relative uncertainty.

Pure Python: the systems are a few thousand sampled collectives by the node count.
"""

from __future__ import annotations

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
        for r, tau in zip(self.rows, self.tau):
            for nid, _, _ in r:
                lo, hi = self.span.get(nid, (tau, tau))
                self.span[nid] = (min(lo, tau), max(hi, tau))

    def _shift(self, nid: int, tau: float) -> float:
        a, b = self.corr.get(nid, (0.0, 0.0))
        return a + b * tau

    def constraints(self) -> dict[int, list[tuple[float, float, float]]]:
        """Per node: (tau, lo, hi) bounds on its extra shift at tau (binned, tightest)."""
        per: dict[int, dict[int, list[float]]] = {}
        for r, tau in zip(self.rows, self.tau):
            # the two earliest observations and the two latest entries, with their nodes
            s1 = s2 = e1 = e2 = None
            for nid, e, s in r:
                sh = self._shift(nid, tau)
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
            for nid, e, s in r:
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
                k = min(int((tau - t0) / (t1 - t0) * BINS), BINS - 1) if t1 > t0 else 0
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

    def enforce(self, movable, rate_bound: dict[int, float], rounds: int | None = None,
                ) -> dict[int, NodeBounds]:
        """Move broken nodes (among ``movable``) minimally until no constraint is broken;
        rate_bound[node]: the largest |b| (ns/s) its correction may reach."""
        info = {nid: NodeBounds() for nid in self.span}
        stuck: set[int] = set()
        for _ in range(rounds if rounds is not None else 2 * len(self.span) + 2):
            cons = self.constraints()
            worst, wv = None, TOLERANCE_NS
            for nid, cs in cons.items():
                if nid not in movable or nid in stuck:
                    continue
                v = _violation(cs, self.corr.get(nid, (0.0, 0.0)))
                if v > wv:
                    worst, wv = nid, v
            if worst is None:
                break
            a0, b0 = self.corr.get(worst, (0.0, 0.0))
            t0, t1 = self.span[worst]
            poly = _polygon(cons[worst], t0, t1, a0, b0, rate_bound.get(worst, math.inf))
            if not poly:
                info[worst].infeasible = True
                stuck.add(worst)
                continue
            pa, pb = _project(poly, a0 + b0 * t0, a0 + b0 * t1)
            if t1 > t0:
                b = (pb - pa) / (t1 - t0)
                a = pa - b * t0
            else:
                a, b = pa, b0
            nb = info[worst]
            nb.violation_ns = max(nb.violation_ns, wv)
            nb.moved_ns = max(nb.moved_ns, abs(a - a0 + (b - b0) * t0),
                              abs(a - a0 + (b - b0) * t1))
            self.corr[worst] = (a, b)
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


def _violation(cons, corr) -> float:
    a, b = corr
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
