"""A straggler's windows (report/lateness.py): its late bins joined, hiccups left out."""

import json

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.lateness import MIN_BLIP_SHARE, _straggler_windows
from ingero_forensics.simulate import FleetConfig, simulate_fleet

BIN = 10**9
NODE = 5


def _windows(late_ms: dict[int, float], per_bin: int = 20):
    cell = {(b, NODE): v for b, v in late_ms.items()}
    counts = {(b, NODE): per_bin for b in late_ms}
    return _straggler_windows(sorted(late_ms), 0, BIN, cell, NODE, counts)


def test_a_one_bin_hiccup_beside_a_long_window_is_left_out():
    """One bin at 6.8 ms, well apart from 37 bins at 11.3 ms (1.6 % of its lateness):
    over half the peak, yet a hiccup, not a window."""
    late = {3: 6.8} | {b: 11.3 for b in range(20, 57)}
    windows, mean = _windows(late)
    assert [(w.start_ns, w.end_ns) for w in windows] == [(20 * BIN, 57 * BIN)]
    assert mean == 11.3


def test_a_short_stall_with_enough_of_the_lateness_is_kept():
    """The same long window and one bin at 30 ms (7 % of the window's lateness summed):
    a stall of its own, kept."""
    late = {3: 30.0} | {b: 11.3 for b in range(20, 57)}
    assert 30.0 / (37 * 11.3) >= MIN_BLIP_SHARE
    windows, _ = _windows(late)
    assert [(w.start_ns, w.end_ns) for w in windows] == [(3 * BIN, 4 * BIN),
                                                        (20 * BIN, 57 * BIN)]


def test_repeated_short_stalls_of_similar_size_are_all_kept():
    late = {b: 8.0 + (b % 3) for b in range(0, 60, 6)}
    windows, _ = _windows(late)
    assert len(windows) == 10


def test_a_random_rank_s_pause_before_the_fault_opens_no_window(tmp_path):
    """From a review (8 x 2 nodes, CPU contention on node-05 in steps 100-200 of 300,
    NTP steps): a benign pause of one of node-05's ranks, one step 6 s before the fault,
    was a second window of the straggler's; the windows are now the fault's own."""
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=8, ranks_per_node=2, steps=300,
                                               fault="cpu", straggler=5,
                                               fault_windows=((100, 200),), ntp_step=True))
    merge_bundles([tmp_path / "b"], tmp_path / "fleet.db")
    a = analyze_fleet(tmp_path / "fleet.db")
    truth = json.loads((tmp_path / "b" / "truth.json").read_text())["fault"]
    assert (a.straggler, a.cause) == ("node-05", "cpu"), a.verdict
    (t,) = truth["windows"]
    assert len(a.windows) == 1, [(w.start_ns, w.end_ns) for w in a.windows]
    (w,) = a.windows
    assert abs(w.start_ns - t["start_utc_ns"]) <= a.bin_ns and \
        abs(w.end_ns - t["end_utc_ns"]) <= a.bin_ns, (w, t)
    assert "in 1 window totalling" in a.verdict, a.verdict
