"""The bounded samples behind the report's medians and percentiles (memory stays flat)."""

from ingero_forensics.report.evidence import Reservoir, median as _median, quantile as _q


def test_exact_while_small():
    r = Reservoir(100, seed=1)
    for x in range(50):
        r.add(float(x))
    assert r.n == 50 and sorted(r.values) == [float(x) for x in range(50)]
    assert _median(r.values) == 24.5


def test_bounded_uniform_and_reproducible():
    a, b = Reservoir(2_000, seed=7), Reservoir(2_000, seed=7)
    for x in range(200_000):
        a.add(float(x))
        b.add(float(x))
    assert a.n == 200_000 and len(a.values) == 2_000
    assert list(a.values) == list(b.values)            # same input, same sample
    # a uniform sample: its quantiles track the population's
    assert abs(_median(a.values) - 100_000) < 6_000
    assert abs(_q(a.values, 0.9) - 180_000) < 6_000
    # late values are not starved (a prefix-only sample would fail this)
    assert sum(1 for v in a.values if v >= 150_000) > 350
