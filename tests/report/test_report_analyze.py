"""The analysis names the simulator's straggler and fault kind, and nothing on a clean run.

The simulator's truth.json is the referee; the analysis never reads it.
"""

import pytest

from ingero_forensics.report import analyze_fleet


@pytest.mark.parametrize("fault", ["cpu", "io", "network", "gpu", "memory"])
def test_names_straggler_and_cause(fleets, fault):
    db, truth = fleets(fault)
    a = analyze_fleet(db)
    assert a.straggler == truth["fault"]["straggler"]
    assert a.cause == fault, [s for s in a.signals if s.score > 2]
    assert a.cause_confidence == "clear"
    assert a.windows, "a fault must come with the windows it was seen in"
    assert a.evidence, "the verdict must cite evidence"
    if fault == "gpu":
        # one GPU is slow: the report must point at that rank, not the whole node
        assert a.late_ranks == truth["fault"]["late_ranks"]


def test_clean_run_finds_nothing(fleets):
    db, truth = fleets("none")
    a = analyze_fleet(db)
    assert truth["fault"]["kind"] == "none"
    assert a.straggler is None and a.cause is None
    assert a.windows == []
    assert "No straggler" in a.verdict


def test_intermittent_window_is_located(fleets):
    db, truth = fleets("cpu", steps=150, extra=("--fault-window", "50:100"))
    a = analyze_fleet(db)
    assert a.straggler == truth["fault"]["straggler"] and a.cause == "cpu"
    (tw,) = truth["fault"]["windows"]
    assert len(a.windows) == 1, [(w.start_ns, w.end_ns, w.lateness_ms) for w in a.windows]
    true_len = tw["end_utc_ns"] - tw["start_utc_ns"]
    found = sum(w.end_ns - w.start_ns for w in a.windows)
    overlap = sum(max(0, min(w.end_ns, tw["end_utc_ns"]) - max(w.start_ns, tw["start_utc_ns"]))
                  for w in a.windows)
    # aligned fleet time is within micro- to milliseconds of true UTC, bins are ~0.25 s
    assert overlap >= 0.8 * true_len
    assert found - overlap <= 0.25 * true_len


def test_lateness_table_covers_every_node(fleets):
    db, truth = fleets("io")
    a = analyze_fleet(db)
    assert sorted(n.name for n in a.lateness) == sorted(n["name"] for n in truth["nodes"])
    worst = max(a.lateness, key=lambda n: n.p90_ms)
    assert worst.name == truth["fault"]["straggler"]
