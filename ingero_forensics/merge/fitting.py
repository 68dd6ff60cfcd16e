"""The numerical building blocks of the clock alignment (align.py): medians, the robust
line fit of one edge of the node graph, the least-squares solve over the graph, and the
worst-case bound of a line under interval constraints. Pure Python: the systems are a
few numbers per node and per edge.
"""

from __future__ import annotations

import functools
import heapq
import math

#: Bins of a robust line fit (bin medians), and of a node's constraints per window.
LINE_BINS = 16


def median(values) -> float:
    s = sorted(values)
    n = len(s)
    if not n:
        raise ValueError("median of nothing")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def weighted_median(pairs: list[tuple[float, float]]) -> float:
    """pairs of (value, weight)."""
    pairs = sorted(pairs)
    total = sum(w for _, w in pairs)
    acc = 0.0
    for v, w in pairs:
        acc += w
        if acc >= total / 2:
            return v
    return pairs[-1][0]


def solve_laplacian(n: int, weights: dict[tuple[int, int], float],
                    b: list[float]) -> list[float]:
    """x with L x = b and sum(x) = 0, L the weighted Laplacian of the graph on nodes
    0..n-1 (``weights``: (p, q) -> w > 0; p != q) and sum(b) = 0, the graph connected.

    Sparse elimination, the node of fewest neighbours first (a ring or a chain, as the
    collectives' edges make: each step links two neighbours, nothing fills in), one
    node grounded: O(edges) for those instead of the dense solve's O(n^3), which took
    most of a 1,000-node merge. Raises ZeroDivisionError where the graph is not
    connected."""
    if n == 0:
        return []
    adj: list[dict[int, float]] = [{} for _ in range(n)]
    diag = [0.0] * n
    for (p, q), w in weights.items():
        if p == q or not w:
            continue
        diag[p] += w
        diag[q] += w
        adj[p][q] = adj[p].get(q, 0.0) - w
        adj[q][p] = adj[q].get(p, 0.0) - w
    rhs = list(b)
    ground = n - 1                      # x[ground] = 0 until the mean is taken out
    for v in adj[ground]:
        del adj[v][ground]
    adj[ground] = {}
    heap = [(len(adj[v]), v) for v in range(n - 1)]
    heapq.heapify(heap)
    done = [False] * n
    done[ground] = True
    order = []
    while heap:
        deg, k = heapq.heappop(heap)
        if done[k] or deg != len(adj[k]):
            continue                    # eliminated, or its degree changed since
        d = diag[k]
        if abs(d) < 1e-300:
            raise ZeroDivisionError("singular system")
        nbrs = adj[k]
        for i, aik in nbrs.items():
            f = aik / d
            diag[i] -= f * aik
            rhs[i] -= f * rhs[k]
            row = adj[i]
            del row[k]
            for j, akj in nbrs.items():
                if j != i:
                    row[j] = row.get(j, 0.0) - f * akj
            heapq.heappush(heap, (len(row), i))
        done[k] = True
        order.append((k, dict(nbrs)))
        adj[k] = {}
    x = [0.0] * n
    for k, nbrs in reversed(order):
        x[k] = (rhs[k] - sum(a * x[j] for j, a in nbrs.items())) / diag[k]
    mean = sum(x) / n
    return [v - mean for v in x]


def robust_line(xs, ys) -> tuple[float, float, float, int]:
    """Fit y = a + b x robustly: bin medians (twice, the second time detrended), a
    weighted least-squares line through them with one round of bin rejection.
    Returns (a, b, scale, n_used), scale = 1.4826 MAD of the point residuals."""
    n = len(xs)
    if n == 0:
        raise ValueError("no points")
    lo, hi = min(xs), max(xs)
    a, b = median(ys), 0.0
    if hi - lo > 0 and n >= 6:
        width = (hi - lo) / LINE_BINS
        for _ in range(2):
            bins: list[list[tuple[float, float]]] = [[] for _ in range(LINE_BINS)]
            for x, y in zip(xs, ys):
                k = min(int((x - lo) / width), LINE_BINS - 1)
                bins[k].append((x, y - b * x))
            pts = [(median([p[0] for p in bn]), median([p[1] for p in bn]), len(bn))
                   for bn in bins if len(bn) >= 2]
            if len(pts) < 2:
                break
            da, db = _wls_line(pts)
            res = [abs(r - (da + db * x)) for x, r, _ in pts]
            cut = 5 * 1.4826 * median(res) if len(pts) > 3 else math.inf
            kept = [p for p, e in zip(pts, res) if e <= max(cut, 1e-9)]
            if len(kept) >= 2 and len(kept) < len(pts):
                da, db = _wls_line(kept)
            a, b = da, b + db
    res = [y - (a + b * x) for x, y in zip(xs, ys)]
    mad = median([abs(r) for r in res])
    scale = 1.4826 * mad
    cut = max(5 * scale, 1000.0)
    used = sum(1 for r in res if abs(r) <= cut)
    # Re-centre on the inliers (the bin medians are robust but coarse).
    inl = [r for r in res if abs(r) <= cut]
    if inl:
        a += median(inl)
    return a, b, scale, used


def _wls_line(pts) -> tuple[float, float]:
    sw = sum(w for _, _, w in pts)
    mx = sum(x * w for x, _, w in pts) / sw
    my = sum(y * w for _, y, w in pts) / sw
    sxx = sum(w * (x - mx) ** 2 for x, _, w in pts)
    if sxx <= 0:
        return my, 0.0
    b = sum(w * (x - mx) * (y - my) for x, y, w in pts) / sxx
    return my - b * mx, b


def error_bound(cons: list[tuple[float, float, float]], t0: float, t1: float,
                rate_bound: float) -> float | None:
    """Worst |a + b t| for t in {t0, t1} over all (a, b) with lo <= a + b t_k <= hi for
    every constraint (t_k, lo, hi) and |b| <= rate_bound. None if infeasible.
    Vertex enumeration: the constraint sets are small (best sample per time bin)."""
    lines = []  # (ca, cb, rhs): ca*a + cb*b = rhs
    for t, lo, hi in cons:
        lines.append((1.0, t, lo))
        lines.append((1.0, t, hi))
    lines.append((0.0, 1.0, rate_bound))
    lines.append((0.0, 1.0, -rate_bound))
    tol = 1e-6 + 1e-9 * max((abs(c[1]) + abs(c[2]) for c in cons), default=0.0)

    def feasible(a, b):
        if abs(b) > rate_bound * (1 + 1e-12) + 1e-12:
            return False
        for t, lo, hi in cons:
            v = a + b * t
            if v < lo - tol or v > hi + tol:
                return False
        return True

    best = None
    for i in range(len(lines)):
        a1, b1, r1 = lines[i]
        for j in range(i + 1, len(lines)):
            a2, b2, r2 = lines[j]
            det = a1 * b2 - a2 * b1
            if abs(det) < 1e-12:
                continue
            a = (r1 * b2 - r2 * b1) / det
            b = (a1 * r2 - a2 * r1) / det
            if feasible(a, b):
                v = max(abs(a + b * t0), abs(a + b * t1))
                best = v if best is None else max(best, v)
    return best


def bin_constraints(items: list[tuple[float, float, float]], t0: float, t1: float,
                     bins: int = LINE_BINS) -> list[tuple[float, float, float]]:
    """Keep the tightest constraint per time bin (fewer constraints = a looser but still
    valid bound)."""
    if not items:
        return []
    width = (t1 - t0) / bins if t1 > t0 else 1.0
    best: dict[int, tuple[float, float, float]] = {}
    for c in items:
        k = min(max(int((c[0] - t0) / width), 0), bins - 1)
        if k not in best or (c[2] - c[1]) < (best[k][2] - best[k][1]):
            best[k] = c
    return list(best.values())


def solve_graph(members: list[int], cedges: dict) -> dict[int, tuple[float, float]]:
    """Weighted least squares over the graph: rates first, then offsets at each edge's
    own centre of data; edges inconsistent with the solution are down-weighted."""
    idx = {nid: k for k, nid in enumerate(members)}
    n = len(members)
    # edge: d = u_i - u_j ~ a + b x  ->  want (x_i - x_j) + (y_i - y_j) x = -(a + b x)
    wy = {e: max(f[3], 1) * max(f[5], 1e-3) ** 2 / f[2] ** 2 for e, f in cedges.items()}
    wx = {e: max(f[3], 1) / f[2] ** 2 for e, f in cedges.items()}

    def lap_solve(weights, target):
        lap: dict[tuple[int, int], float] = {}
        b = [0.0] * n
        for (i, j), w in weights.items():
            p, q = idx[i], idx[j]
            t = target[(i, j)]
            lap[(p, q)] = lap.get((p, q), 0.0) + w
            b[p] += w * t
            b[q] -= w * t
        # gauge: the mean correction is zero (the common mode is fixed later)
        return solve_laplacian(n, lap, b)

    for _round in range(3):
        ty = {e: -f[1] for e, f in cedges.items()}
        y = lap_solve(wy, ty)
        tx = {e: -(f[0] + f[1] * f[4]) - (y[idx[e[0]]] - y[idx[e[1]]]) * f[4]
              for e, f in cedges.items()}
        x = lap_solve(wx, tx)
        changed = False
        for e, f in cedges.items():
            i, j = idx[e[0]], idx[e[1]]
            r = (x[i] - x[j]) - tx[e]
            tol = max(5 * f[2] / math.sqrt(max(f[3], 1)), 1000.0)
            if abs(r) > tol and wx[e] > 1e-30:
                wx[e] *= 1e-4
                wy[e] *= 1e-4
                changed = True
        if not changed:
            break
    return {nid: (x[idx[nid]], y[idx[nid]]) for nid in members}


def t_within(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with ``dof`` degrees of freedom (dof >= 1): the
    closed form for whole degrees (Abramowitz and Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(dof))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if dof % 2:
        if dof == 1:
            return 2 * theta / math.pi
        term = total = 1.0
        for k in range(1, (dof - 3) // 2 + 1):      # 2/3 c^2, 2*4/(3*5) c^4, ...
            term *= (2 * k) / (2 * k + 1) * c2
            total += term
        return 2 / math.pi * (theta + s * math.cos(theta) * total)
    term = total = 1.0
    for k in range(1, (dof - 2) // 2 + 1):          # 1/2 c^2, 1*3/(2*4) c^4, ...
        term *= (2 * k - 1) / (2 * k) * c2
        total += term
    return s * total


#: t_quantile's degrees of freedom at most: t_within costs a term per two degrees, and
#: beyond this t is the normal's (at 99.73 %: 3.0075 here, 3.0 for the normal)
T_DOF_CAP = 1000


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, dof: int) -> float:
    """t with P(|T| <= t) = p (bisection on t_within): how many standard errors a mean
    of dof + 1 values, its spread estimated from them, may lie from the truth."""
    dof = min(dof, T_DOF_CAP)
    lo, hi = 0.0, 1.0
    while t_within(hi, dof) < p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_within(mid, dof) < p else (lo, mid)
    return (lo + hi) / 2
