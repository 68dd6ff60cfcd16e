"""A straggler's windows (report/lateness.py): its late bins joined, weak blips left out,
a fault's own short periods kept."""

import json

import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.lateness import _straggler_windows
from ingero_forensics.simulate import FleetConfig, simulate_fleet

BIN = 10**9
NODE = 5


def _windows(late_ms: dict[int, float], per_bin: int = 20):
    cell = {(b, NODE): v for b, v in late_ms.items()}
    counts = {(b, NODE): per_bin for b in late_ms}
    return _straggler_windows(sorted(late_ms), 0, BIN, cell, NODE, counts)


def test_a_weak_one_bin_blip_beside_a_long_window_is_left_out():
    late = {3: 4.0} | {b: 11.3 for b in range(20, 57)}
    windows, mean = _windows(late)
    assert [(w.start_ns, w.end_ns) for w in windows] == [(20 * BIN, 57 * BIN)]
    assert mean == 11.3


def test_a_short_period_as_strong_as_the_long_one_is_kept():
    late = {3: 10.2, 4: 10.5} | {b: 11.3 for b in range(20, 57)}
    windows, _ = _windows(late)
    assert [(w.start_ns, w.end_ns) for w in windows] == [(3 * BIN, 5 * BIN),
                                                        (20 * BIN, 57 * BIN)]


def test_repeated_short_stalls_of_similar_size_are_all_kept():
    late = {b: 8.0 + (b % 3) for b in range(0, 60, 6)}
    windows, _ = _windows(late)
    assert len(windows) == 10


@pytest.mark.parametrize("fault,straggler,periods,seed", [
    ("io", 6, ((40, 45), (150, 290)), 7),
    ("cpu", 5, ((30, 34), (120, 280)), 21),
])
def test_a_fault_s_short_period_beside_its_long_one_is_a_window(tmp_path, fault, straggler,
                                                                 periods, seed):
    """From a review: a fault on for 4-5 steps, then again for 140-160 steps. A rule
    that dropped short windows holding a sliver of the largest one's lateness lost the
    short period; both are windows, each within a bin of the truth's."""
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=8, ranks_per_node=2, steps=300,
                                               fault=fault, straggler=straggler,
                                               fault_windows=periods, seed=seed))
    merge_bundles([tmp_path / "b"], tmp_path / "fleet.db")
    a = analyze_fleet(tmp_path / "fleet.db")
    truth = json.loads((tmp_path / "b" / "truth.json").read_text())["fault"]
    assert (a.straggler, a.cause) == (truth["straggler"], fault), a.verdict
    assert len(a.windows) == len(truth["windows"]) == 2, (a.windows, truth["windows"])
    for w, t in zip(a.windows, truth["windows"]):
        assert abs(w.start_ns - t["start_utc_ns"]) <= a.bin_ns and \
            abs(w.end_ns - t["end_utc_ns"]) <= a.bin_ns, (w, t)
    assert "in 2 windows totalling" in a.verdict, a.verdict
