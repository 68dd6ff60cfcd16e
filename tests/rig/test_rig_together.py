"""The rig with two of its four nodes degraded at once: half the fleet late at the same
collectives. Against the median arrival (which is then midway between the two groups)
the report said "No straggler", taking the fault for the fleet's jitter: 109 ms for a
CPU hog shared by nodes 1 and 2 (each 88 ms late at every collective on the shared
clock), 23 ms for O_DIRECT reads on both loaders. Both nodes must be named, each with
its cause, compared with the healthy nodes (report/together.py).

The cpu run has a third fault, on another node: node 3's link queues (tbf, as the
scenario "slowlink": no drops). Tried by hand beside one CPU-starved node, the report
named that node and said nothing of the link, whose bytes took 5.4 ms against 0.05 ms on
the others: an operator who moved the hog away would have found the job still slow. The
link must be named beside the late nodes, as a second, separate finding (docs/report.md,
rule 4c); in one run, not two, for the rig's CI time. Real faults, real captures, the
same commands as test_rig.py."""

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
#: the node whose link queues beside the cpu run's hog (its link out goes to node 0)
SLOW_LINK_OF = {"cpu": 3}


@pytest.fixture(scope="module")
def together(tmp_path_factory):
    skip_without_rig()
    with Rig(tmp_path_factory.mktemp("together"), nodes=4, straggler=(1, 2)) as rig:
        yield scenario_runs(rig, STEPS, STEPS_OF, SLOW_LINK_OF)


@pytest.mark.parametrize("scenario", ["cpu", "io"])
def test_two_nodes_late_together_both_named_with_their_cause(together, scenario):
    o = together(scenario)
    late = set(o.run.truth.nodes)
    # on the shared clock both degraded nodes really were late, the others not
    truth = measure.true_lateness(o.fleet_db)
    assert all(truth[n] > 5 for n in late) and all(truth[n] < 0 for n in truth if n not in late), truth
    named = verdict.stragglers(o.report)
    by_node = {s["node"]: s for s in o.report["stragglers"]}
    # The rig's "nodes" share the machine's 2 CPUs: a healthy rank the scheduler puts
    # beside the hog for a moment is starved too (a CI run: rank 0 held 93 ms once, late
    # in one time bin, 1.5 % of the run, against 70 % for each degraded node). Named, it
    # must be for what happened: the CPU, the hog its top offender, costing far less.
    extra = {s.node for s in named} - late
    for n in extra if scenario == "cpu" else ():
        s = by_node[n]
        assert s["cause"] == "cpu" and s["top_offenders"][0]["pid"] in o.run.hog_pids, \
            (s, o.run.hog_pids)
        assert s["cost_share"] < 0.1 * min(by_node[m]["cost_share"] for m in late), s
    assert {s.node for s in named} - extra == late and not (
        extra and scenario != "cpu"), verdict.summary(o.report)
    if scenario == "cpu":
        assert {(s.node, s.cause, s.confidence) for s in named if s.node in late} == \
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
    for n in late:
        assert by_node[n]["reference"] == "early_half"
        assert set(by_node[n]["late_with"]) - extra == late - {n}, by_node[n]
        assert by_node[n]["cost_share"] >= 0.01


def test_slow_link_beside_the_late_nodes_is_a_second_finding(together):
    o = together("cpu")
    slow_node = o.run.node_of_rank[SLOW_LINK_OF["cpu"]]
    # the link queues without dropping: its sender hardly retransmits
    assert o.run.retransmits[slow_node] < 50, o.run.retransmits
    # the ring sends from each rank to the next (one rank per node)
    nxt = o.run.node_of_rank[(SLOW_LINK_OF["cpu"] + 1) % len(o.run.results)]
    also = o.report["also_slow_link"]
    assert also is not None, (o.report["links"], verdict.summary(o.report))
    assert (also["from"], also["to"]) == (slow_node, nxt), also
    assert also["median_ms"] >= 2.5 and also["median_ms"] >= 20 * also["others_ms"], also
    # the late nodes lead the verdict; the link is beside them, not their cause
    assert o.report["link_suspect"] is None and o.report["network_basis"] is None
    assert "Separately, a second problem: the job's link from " + slow_node in \
        o.report["verdict"]
    assert "A second finding:" in (o.fleet_db.parent / "report.html").read_text()


def test_io_run_has_no_second_finding(together):
    """The io run has no queueing link: none is named beside its late nodes."""
    o = together("io")
    assert o.report["also_slow_link"] is None and o.report["link_suspect"] is None, \
        (o.report["links"], verdict.summary(o.report))
