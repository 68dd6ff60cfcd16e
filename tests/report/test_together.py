"""Nodes late together (report/together.py): half the fleet or more late at the same
collectives. Against the median arrival they were invisible ("No straggler", with the
late group's fault taken for the fleet's jitter); against the early half of each
collective's arrivals every one of them is named, each compared with the healthy nodes
for its cause. Real bundles (tests/merge/fleetgen.py), the real merge; the rig does the
same on real processes (tests/rig/test_rig_together.py)."""

import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.analyze import MIN_COST_SHARE

from ..merge.fleetgen import make_fleet


def _analyze(tmp_path, **kw):
    fleet = make_fleet(tmp_path / "b", ranks_per_node=1, seconds=20, retransmits=False, **kw)
    merge_bundles(fleet.paths, tmp_path / "f.db")
    return analyze_fleet(tmp_path / "f.db")


@pytest.mark.parametrize("nodes,late", [(4, (1, 2)), (4, (0, 3)), (3, (1, 2)), (6, (1, 2, 3))])
def test_nodes_late_together_are_all_named(tmp_path, nodes, late):
    """Ranks (one per node) 20 ms late at the same fifth of the collectives."""
    a = _analyze(tmp_path, nodes=nodes, straggler_rank=late, straggler_every=5,
                 straggler_late_ns=20_000_000, seed=3)
    names = {f"node-{r}" for r in late}
    assert {s.node for s in a.stragglers} == names, a.verdict
    assert a.verdict.startswith(f"{len(late)} stragglers."), a.verdict
    for s in a.stragglers:
        assert s.reference == "early_half" and set(s.late_with) == names - {s.node}
        assert s.late_ranks == [int(s.node.split("-")[1])]
        # late by 20 ms at one collective in five: well above the cost bar, and the
        # lateness shown is in the late collectives' range, not the median's +0.1 ms
        assert s.cost_share >= 2 * MIN_COST_SHARE and 3.0 <= s.lateness_ms <= 20.0, s
        assert f"late together with {', '.join(sorted(names - {s.node}))}" in a.verdict
    # the lateness table shows the figures that named them
    table = {n.name: n for n in a.lateness}
    assert all(table[n].cost_share >= MIN_COST_SHARE and table[n].late_bins >= 3 for n in names)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_clean_fleets_name_nobody_against_the_early_half(tmp_path, seed):
    a = _analyze(tmp_path, nodes=4, seed=seed)
    assert a.stragglers == [] and a.verdict.startswith("No straggler"), a.verdict


def test_one_late_node_is_still_the_median_rules(tmp_path):
    """A single late node among four: named by the median rule as before, and nobody
    else is named against the early half (the rule needs two nodes late together)."""
    a = _analyze(tmp_path, nodes=4, straggler_rank=2, straggler_every=5,
                 straggler_late_ns=20_000_000, seed=3)
    assert [(s.node, s.reference) for s in a.stragglers] == [("node-2", "median")], a.verdict
