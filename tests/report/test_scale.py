"""Diagnosis at 16 nodes (issue: the largest of N nodes' noisy lateness grows with N, and
a network fault's ring neighbour retransmits too). The cases that went wrong before the
size-aware threshold, the cost rule and the per-node network rule, kept from coming
back; bench/bench_accuracy.py sweeps sizes up to 64 nodes."""

import json

import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.simulate import FleetConfig, simulate_fleet


@pytest.mark.slow
@pytest.mark.parametrize("fault, seed", [("none", 31), ("none", 32), ("network", 31),
                                         ("network", 32), ("cpu", 31), ("cpu", 32)])
def test_sixteen_nodes(tmp_path, fault, seed):
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=16, ranks_per_node=4, steps=600,
                                               fault=fault, seed=seed))
    merge_bundles([tmp_path / "b"], tmp_path / "fleet.db")
    truth = json.loads((tmp_path / "b" / "truth.json").read_text())
    a = analyze_fleet(tmp_path / "fleet.db")
    assert a.straggler == truth["fault"]["straggler"], a.verdict
    if fault == "none":
        assert a.stragglers == [] and a.cause is None and a.verdict.startswith("No straggler")
    else:
        assert a.cause == fault and a.cause_confidence == "clear", a.verdict
