"""merge/fitting.py: the sparse Laplacian solve of the node graph, Student's t."""

import random

import pytest

from ingero_forensics.merge.fitting import solve_laplacian, t_quantile, t_within


def _dense(n, weights, b):
    """The dense solve the merge used before: L + (max diag / n) everywhere (the gauge),
    Gaussian elimination with partial pivoting."""
    a = [[0.0] * n for _ in range(n)]
    for (p, q), w in weights.items():
        a[p][p] += w
        a[q][q] += w
        a[p][q] -= w
        a[q][p] -= w
    big = max(a[k][k] for k in range(n)) or 1.0
    m = [[v + big / n for v in row] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _graph(kind, n, rng):
    w = {}
    if kind in ("ring", "chain", "ring+chords"):
        for k in range(n - 1):
            w[(k, k + 1)] = rng.uniform(1e-6, 1e-2)
        if kind != "chain":
            w[(0, n - 1)] = rng.uniform(1e-6, 1e-2)
        if kind == "ring+chords":
            for _ in range(n // 3):
                p, q = rng.sample(range(n), 2)
                w[(p, q)] = w.get((p, q), 0.0) + rng.uniform(1e-6, 1e-2)
    else:                                   # dense: every pair
        for p in range(n):
            for q in range(p + 1, n):
                w[(p, q)] = rng.uniform(1e-6, 1e-2)
    # edges down-weighted as the solve does to an outlier (1e-4)
    for e in rng.sample(sorted(w), max(1, len(w) // 10)):
        w[e] *= 1e-4
    return w


@pytest.mark.parametrize("kind", ["ring", "chain", "ring+chords", "dense"])
@pytest.mark.parametrize("n", [2, 3, 17, 60])
def test_the_sparse_solve_is_the_dense_one(kind, n):
    rng = random.Random(n * 31 + len(kind))
    w = _graph(kind, n, rng)
    b = [0.0] * n
    for (p, q), wt in w.items():            # as the graph solve makes them: sum(b) = 0
        t = rng.uniform(-5e6, 5e6)
        b[p] += wt * t
        b[q] -= wt * t
    x = solve_laplacian(n, w, b)
    ref = _dense(n, w, b)
    scale = max(map(abs, ref)) or 1.0
    assert max(abs(u - v) for u, v in zip(x, ref)) <= 1e-7 * scale
    assert abs(sum(x)) <= 1e-9 * scale * n
    # and it solves L x = b
    r = list(b)
    for (p, q), wt in w.items():
        r[p] -= wt * (x[p] - x[q])
        r[q] -= wt * (x[q] - x[p])
    assert max(map(abs, r)) <= 1e-7 * max(map(abs, b))


def test_a_graph_in_two_parts_is_singular():
    w = {(0, 1): 1.0, (2, 3): 1.0}
    with pytest.raises(ZeroDivisionError):
        solve_laplacian(4, w, [1.0, -1.0, 2.0, -2.0])


@pytest.mark.parametrize("p, dof, table", [
    (0.95, 1, 12.706), (0.95, 2, 4.303), (0.95, 3, 3.182), (0.95, 10, 2.228),
    (0.95, 30, 2.042), (0.99, 5, 4.032), (0.99, 8, 3.355), (0.999, 4, 8.610)])
def test_t_quantile_matches_the_printed_tables(p, dof, table):
    """Two-sided quantiles of Student's t, as statistics tables print them (odd and even
    degrees take different closed forms)."""
    assert t_quantile(p, dof) == pytest.approx(table, abs=6e-4)
    assert t_within(table, dof) == pytest.approx(p, abs=1e-4)


def test_t_quantile_tends_to_the_normal():
    """Many degrees of freedom: the normal's 3 standard errors at 99.73 %."""
    assert t_quantile(0.9973, 5000) == pytest.approx(3.0, abs=0.01)
    assert t_quantile(0.9973, 3) > t_quantile(0.9973, 30) > t_quantile(0.9973, 5000)
