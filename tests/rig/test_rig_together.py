"""The rig with two of its four nodes degraded at once: half the fleet late at the same
collectives. Against the median arrival (which is then midway between the two groups)
the report said "No straggler", taking the fault for the fleet's jitter: 109 ms for a
CPU hog shared by nodes 1 and 2 (each 88 ms late at every collective on the shared
clock), 23 ms for O_DIRECT reads on both loaders. Both nodes must be named, each with
its cause, compared with the healthy nodes (report/together.py). Real faults, real
captures, the same commands as test_rig.py."""

from __future__ import annotations

import pytest

from . import measure, verdict
from .conftest import scenario_runs, skip_without_rig
from .rig import Rig

pytestmark = [pytest.mark.ebpf, pytest.mark.slow]

#: enough time bins (the late group costs half the run) at a few seconds of CI time; a
#: CPU-starved step takes about 250 ms: 45 of them are 11 s of job
STEPS = 80
STEPS_OF = {"cpu": 45}


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    skip_without_rig()
    with Rig(tmp_path_factory.mktemp("together"), nodes=4, straggler=(1, 2)) as rig:
        yield scenario_runs(rig, STEPS, STEPS_OF)


@pytest.mark.parametrize("scenario", ["cpu", "io"])
def test_two_nodes_late_together_both_named_with_their_cause(together, scenario):
    o = together(scenario)
    late = set(o.run.truth.nodes)
    # on the shared clock both degraded nodes really were late, the others not
    truth = measure.true_lateness(o.fleet_db)
    assert all(truth[n] > 5 for n in late) and all(truth[n] < 0 for n in truth if n not in late), truth
    named = verdict.stragglers(o.report)
    assert {s.node for s in named} == late, verdict.summary(o.report)
    if scenario == "cpu":
        assert {(s.node, s.cause, s.confidence) for s in named} == \
            {(n, "cpu", "clear") for n in late}, verdict.summary(o.report)
    # io: the two loaders' reads also double those nodes' run-queue delay on 2 cores
    # (88-93 against 44-47 ms/s), so the I/O evidence beats the CPU's by 2-7x, at times
    # under the 2x that "clear" asks, and on a slow hour of this VM (2026-11-27, 1 run
    # in 10) by less than nothing: CPU 9.3, I/O 8.0. Then the report may lead with the
    # other cause, but only as "weak" and with I/O named beside it (close_cause): wrong
    # and sure, or I/O left out, is what must never happen
    for s in o.report["stragglers"] if scenario == "io" else ():
        ok = s["cause"] == "io" and s["cause_confidence"] in ("clear", "weak") or (
            s["cause_confidence"] == "weak" and s["close_cause"] == "io")
        assert ok, (s["node"], s["cause"], s["cause_confidence"], s["close_cause"],
                    s["signals"])
    by_node = {s["node"]: s for s in o.report["stragglers"]}
    for n in late:
        assert by_node[n]["reference"] == "early_half"
        assert by_node[n]["late_with"] == sorted(late - {n})
        assert by_node[n]["cost_share"] >= 0.01
