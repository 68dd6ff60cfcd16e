"""The real-kernel multi-node rig (issue 16): four network-namespace nodes, a TCP ring
all-reduce, one ingero-capture per node, real faults, then ingero-merge and
ingero-report as a user would run them. The faults: a CPU hog, O_DIRECT reads, a lossy
link (tbf), a slow link that drops nothing (tbf with a long queue), memory pressure (a
cgroup limit) and a GPU four times slower (the cudart shim's kernels: the host is barely
late, its all-reduces start late on the GPU). test_rig_two_ranks.py adds a rank's own
code 8 ms slower per step, a cause the capture has no signal for ("cannot tell", never
a cause).

All nodes share one CLOCK_MONOTONIC, so the truth is known twice over: the rig knows
which node it degraded and how, and every aligned timestamp can be checked against the
shared clock. The rig's own checks (test_rig_*) come first: a scenario that failed to
degrade its straggler would make the report's verdict meaningless either way.
"""

from __future__ import annotations

import bisect
import itertools
import json

import apsw
import pytest

from ingero_forensics.bundle.reader import open_bundle
from ingero_forensics.report.analyze import CLOCK_MARGIN
from ingero_forensics.report.gpuwait import GPU_SHARE_LEFT, gpu_suspect

from . import measure, verdict
from .conftest import merge_and_report
from .rig import MILD, SCENARIOS
from .skew import mono_columns, skew_node

pytestmark = [pytest.mark.ebpf, pytest.mark.slow]

#: the scenarios run here, one rank per node ("compute" runs with two per node, in
#: test_rig_two_ranks.py: within the rig's CI time)
ONE_RANK = tuple(s for s in SCENARIOS if s != "compute")
MAX_ALIGNMENT_ERROR_US = 100.0
#: (role, clock offset in ns) of the skewed variants; both drift 50 ppm
SKEWS = (("straggler", 37_000_000), ("bystander", -23_000_000))
#: what a stated relative uncertainty of the skewed node may be at most: collectives
#: alone leave milliseconds (the rig's ranks observe one completion up to ~1.5 ms apart
#: on 2 loaded cores); the ring's TCP messages, sampled at the same bytes on both ends
#: and bounded by the senders' 'unsent' rows where sends wait for a starved reader's
#: window, leave tens of microseconds (16-19 us measured)
MAX_STATED_UNCERTAINTY_US = 1_000.0


def show(scenario, outcome) -> str:
    """Everything a failure message needs: the report's verdict and the rig's truth."""
    run = outcome.run
    return json.dumps({
        "scenario": scenario, "truth": run.truth.__dict__,
        "report": verdict.summary(outcome.report),
        "true_lateness_ms": measure.true_lateness(outcome.fleet_db),
        "retransmits": run.retransmits,
        "median_step_ms": round(run.median_step_ms(), 2), "seconds": run.seconds,
        "capture_start_s": run.capture_start_s, "capture_stop_s": run.capture_stop_s,
    }, indent=1, default=str)


# -- the rig itself -----------------------------------------------------------------------

@pytest.mark.parametrize("scenario", ONE_RANK)
def test_rig_job_ran_and_was_captured(runs, scenario):
    o = runs.get(scenario)
    print(show(scenario, o))
    world = len(o.run.results)
    assert world == 4
    # the ring all-reduce really summed every rank's loss (1 + rank)
    assert {r["loss"] for r in o.run.results.values()} == {sum(range(1, world + 1))}
    assert len({r["steps"] for r in o.run.results.values()}) == 1
    assert sorted(o.run.bundles) == [f"rig-node-{k}" for k in range(4)]
    assert all(len(b) == 1 for b in o.run.bundles.values()), o.run.bundles


@pytest.mark.parametrize("scenario", ("cpu", "io", "memory"))
def test_rig_straggler_really_arrives_late(runs, scenario):
    """On the shared clock, the degraded node reaches the collectives late and nobody
    else does."""
    o = runs.get(scenario)
    late = measure.true_lateness(o.fleet_db)
    straggler = late.pop(o.run.truth.node)
    assert straggler >= 3.0 and straggler >= 3 * max(abs(v) for v in late.values()), \
        show(scenario, o)


def test_rig_clean_run_has_no_late_node(runs):
    o = runs.get("none")
    late = measure.true_lateness(o.fleet_db)
    assert max(abs(v) for v in late.values()) < 1.5, show("none", o)


def test_rig_network_fault_retransmits(runs):
    """tbf drops the straggler's packets: its own connections retransmit (real TCP
    retransmits, counted by its namespace's kernel), and the whole job slows down."""
    o = runs.get("network")
    retrans = dict(o.run.retransmits)
    mine = retrans.pop(o.run.truth.node)
    assert mine >= 1000 and mine >= 20 * max(max(retrans.values()), 1), retrans
    assert o.run.median_step_ms() >= 1.3 * runs.get("none").run.median_step_ms()


def test_rig_slow_link_queues_without_loss(runs):
    """tbf with a long queue delays the straggler's packets and drops none: its own
    connections barely retransmit, nobody arrives late on the shared clock, and the
    whole job slows down (the ring moves at the slow link's pace)."""
    o = runs.get("slowlink")
    retrans = dict(o.run.retransmits)
    assert retrans[o.run.truth.node] < 50, retrans
    assert o.run.median_step_ms() >= 1.5 * runs.get("none").run.median_step_ms(), \
        show("slowlink", o)
    late = measure.true_lateness(o.fleet_db)
    assert max(late.values()) < o.report["threshold_ms"], show("slowlink", o)


def test_a_slow_link_under_the_bar_is_said(rig, tmp_path, monkeypatch):
    """A link queueing at 400 mbit instead of 200 (1.1-1.3 ms at the median against
    0.015 ms, the job 60 % slower): "No straggler" said that no link of the job was far
    slower than the others, in 4 runs of 4. Under the 2.5 ms that names a link, it is
    said (link_unnamed, "small"); named where a run's queue is slower (rule 4c), or said
    for a period, it is in the verdict all the same: from the straggler's node to its
    ring successor, never "no link"."""
    monkeypatch.setitem(MILD, "tbf_slow", ("rate", "400mbit", "burst", "64kb",
                                           "latency", "400ms"))
    run = rig.run_scenario("slowlink", steps=50, severity="mild",
                           capture_args=("--start-priority", "normal"))
    _, report = merge_and_report(run.all_bundles(), tmp_path / "merged")
    said = report["link_suspect"] or report["link_unnamed"]
    nxt = run.node_of_rank[(max(run.truth.ranks) + 1) % len(run.results)]
    assert said and (said["from"], said["to"]) == (run.truth.node, nxt), \
        json.dumps(verdict.summary(report))
    assert "no link of the job is far slower" not in report["verdict"], report["verdict"]
    # in the verdict's words, not only in the JSON
    assert f"link from {run.truth.node} to {nxt}" in report["verdict"], report["verdict"]
    assert all(s.node == run.truth.node for s in verdict.stragglers(report)), \
        report["verdict"]


def _longest_waits(fleet):
    """(node name, rule 4b's suspect) of a fleet.db read with no bar (report/gpuwait.py):
    the node whose process waits longest for its own GPU work, and its measures."""
    con = measure.connect(fleet)
    try:
        names = measure.node_names(con)
        first, last = con.execute("SELECT MIN(timestamp_ns), MAX(timestamp_ns) "
                                  "FROM sync_waits").fetchone()
        g = gpu_suspect(con, list(names), last - first, 0.0, [(first, last)],
                        min_score=float("-inf"))
    finally:
        con.close()
    return names[g.node_id], g


def test_a_milder_gpu_is_said(rig, tmp_path):
    """A GPU twice as slow instead of four times (tests/rig/rig.py MILD): its node was
    0.7-1.5 ms late, its waits for its own GPU work 0.79-1.0 ms against 0.38-0.39
    (score 1.6-2.2, under the 3 that names a GPU), the job 25 % slower, and "No straggler"
    said nothing of it, in 4 runs of 4. Named or said under the bar, it is the GPU
    node, and no other node is named."""
    run = rig.run_scenario("gpu", steps=100, severity="mild",
                           capture_args=("--start-priority", "normal"))
    fleet, report = merge_and_report(run.all_bundles(), tmp_path / "merged")
    named = verdict.stragglers(report)     # (a GPU suspect is among them)
    assert all(s.node == run.truth.node for s in named), json.dumps(verdict.summary(report))
    # its longer waits are the GPU's: with the waiting threads' run-queue delay inside
    # them taken out, most of the excess is left (0.72-0.98 on the rig)
    node, g = _longest_waits(fleet)
    assert node == run.truth.node and g.gpu_share >= GPU_SHARE_LEFT, (node, g)
    if not named:
        said = report["gpu_unnamed"]
        assert said and said["node"] == run.truth.node, json.dumps(verdict.summary(report))
        assert report["verdict"].startswith("No straggler") and \
            f"{run.truth.node} (rank {run.truth.ranks[0]}) waited for its own GPU work " \
            "longer than every other node" in report["verdict"], report["verdict"]


def test_a_milder_cpu_hog_is_not_named_a_gpu(rig, tmp_path):
    """One busy process at nice 0 on the rank's CPU instead of four at nice -10 (MILD).
    The rig's four ranks share two cores: the ranks the scheduler keeps beside the hog
    wait for a CPU after their GPU waits (1.0-1.2 ms against 0.33-0.41 on the others),
    and in 4 runs of 16 the GPU rule named such a node "GPU slowdown, weak". With the
    waiting thread's run-queue delay inside each wait taken out they took what the
    others' did (-0.02-0.13 of the excess left). No GPU is slower here: the longest waits
    are read as waits for a CPU, whichever node has them, and no GPU is named."""
    run = rig.run_scenario("cpu", steps=100, severity="mild",
                           capture_args=("--start-priority", "normal"))
    fleet, report = merge_and_report(run.all_bundles(), tmp_path / "merged")
    # the rule's own measure, whatever the verdict: waits half again as long as the
    # others' are their waiting threads' waits for a CPU
    node, g = _longest_waits(fleet)
    if g.wait_ratio >= 1.5:
        assert g.gpu_share is not None and g.gpu_share < GPU_SHARE_LEFT, (node, g)
    named = verdict.stragglers(report)
    assert all(s.node == run.truth.node for s in named), json.dumps(verdict.summary(report))
    assert all(s.cause != "gpu" for s in named), report["verdict"]
    said = report.get("gpu_unnamed")
    if said:
        assert said["reading"] in ("cpu", "unsure"), report["verdict"]
        assert ("but its threads were waiting for a CPU" if said["reading"] == "cpu" else
                "cannot be told") in report["verdict"], report["verdict"]


def test_rig_gpu_fault_slows_the_job_from_the_gpu(runs):
    """A GPU four times slower on one node slows every rank's steps, while that node's
    host is barely late at the collectives (its all-reduces start late on the GPU):
    the case rule 4b of docs/report.md exists for."""
    o = runs.get("gpu")
    assert o.run.median_step_ms() >= 1.15 * runs.get("none").run.median_step_ms(), \
        show("gpu", o)
    late = measure.true_lateness(o.fleet_db)
    assert late[o.run.truth.node] < o.report["threshold_ms"], show("gpu", o)


def test_rig_memory_fault_reads_back_what_it_evicted(runs):
    """The memory limit is real: on the straggler's job cgroup (its own, as every node's),
    the kernel counts pages read back after eviction and the job at its limit; no other
    node's job reads any back; every node did the same reads, so the job slowed down."""
    o = runs.get("memory")
    with measure.connect(o.fleet_db) as con:
        refaults = dict(con.execute(
            "SELECT n.name, AVG(h.value) FROM host_samples h JOIN nodes n USING (node_id) "
            "WHERE h.metric = 'vm.job.refault_bytes_per_s' GROUP BY n.name"))
        at_limit = con.execute(
            "SELECT MAX(u.value) / MAX(l.value) FROM host_samples u JOIN host_samples l "
            "ON l.node_id = u.node_id AND l.metric = 'mem.job.limit_bytes' "
            "JOIN nodes n ON n.node_id = u.node_id "
            "WHERE u.metric = 'mem.job.usage_bytes' AND n.name = ?",
            (o.run.truth.node,)).fetchone()[0]
    # (v1 memory.stat counts refaults from about kernel 5.13: docs/capture.md)
    assert o.run.truth.node in refaults, ("no job refaults recorded", refaults)
    mine = refaults.pop(o.run.truth.node)
    assert sorted(refaults) == sorted(n for n in o.run.bundles if n != o.run.truth.node)
    assert mine >= 2 << 20 and max(refaults.values()) < 0.02 * mine, (mine, refaults)
    assert at_limit is not None and at_limit >= 0.9, at_limit
    assert o.run.median_step_ms() >= 1.2 * runs.get("none").run.median_step_ms(), \
        show("memory", o)


# -- the verdict ----------------------------------------------------------------------------

@pytest.mark.parametrize("scenario", ONE_RANK)
def test_report_names_the_straggler_and_cause(runs, scenario):
    o = runs.get(scenario)
    named = verdict.stragglers(o.report)
    truth = o.run.truth
    if truth.node is None:
        assert named == [], show(scenario, o)
        return
    assert [s.node for s in named] == [truth.node], show(scenario, o)
    assert named[0].cause == truth.cause, show(scenario, o)
    if scenario == "slowlink":
        # named for its link's transit, against every other link's, not for retransmits
        # (the ring sends from each rank to the next: the straggler's last rank's next)
        nxt = o.run.node_of_rank[(max(truth.ranks) + 1) % len(o.run.results)]
        s = o.report["link_suspect"]
        assert (s["from"], s["to"]) == (truth.node, nxt), show(scenario, o)
        assert s["median_ms"] >= 2.5 and s["median_ms"] >= 20 * s["others_ms"], s
    else:
        assert o.report["link_suspect"] is None, show(scenario, o)
    # one fault on one node: no second finding beside it
    assert o.report["also_slow_link"] is None, show(scenario, o)
    if scenario in ("cpu", "gpu", "memory", "slowlink"):
        # a CPU-starved node's waits for its GPU work are long too (its woken threads
        # wait for a CPU): they must not make the GPU a close second to the run queue;
        # a node short of memory reads from disk (the block I/O of its refaults): that
        # must not make the disk its cause, nor a close second
        assert named[0].confidence == "clear", show(scenario, o)
    # one rank per node: the node's rank is the late one (cpu, io), or the rank of the
    # node whose link is lossy or whose GPU is slow (network, gpu: it arrives on time,
    # the report names its ranks)
    assert set(named[0].ranks) == set(truth.ranks), show(scenario, o)


def test_a_lossy_node_left_out_is_not_blamed_on_its_neighbour(runs, tmp_path):
    """The lossy node's bundles not merged (from a review, on simulated fleets: its
    upstream neighbour, resending into it, was named "network retransmits, clear"): the
    neighbour's retransmits all go to an address no merged bundle owns, so no node's
    network is named. With the node opposite it left out instead, the lossy node's own
    retransmits towards captured nodes still name it."""
    o = runs.get("network")
    truth = o.run.truth
    (rank,) = truth.ranks
    n = len(o.run.node_of_rank)
    _, without_lossy = merge_and_report(
        [b for node, bs in o.run.bundles.items() if node != truth.node for b in bs],
        tmp_path / "without-lossy")
    named = verdict.stragglers(without_lossy)
    assert not any(s.cause == "network" for s in named), show("network", o) + \
        json.dumps(verdict.summary(without_lossy))
    # Its downstream neighbour may look late, in the bins of a retransmit timeout (two
    # runs in five): late it was, but with no cause of its own, and the missing rank said
    assert all(s.confidence != "clear" for s in named), without_lossy["verdict"]
    assert "was not captured" in without_lossy["verdict"], without_lossy["verdict"]
    # (on the rig the upstream neighbour's resends are mostly too few to make it a
    # suspect at all; where they are, it is said, not named)
    unsure = without_lossy["network_unsure"]
    if unsure is not None:
        upstream = o.run.node_of_rank[(rank - 1) % n]
        assert unsure["node"] == upstream and \
            f"{upstream}'s job connections retransmitted" in without_lossy["verdict"]
    opposite = o.run.node_of_rank[(rank + 2) % n]
    _, without_other = merge_and_report(
        [b for node, bs in o.run.bundles.items() if node != opposite for b in bs],
        tmp_path / "without-other")
    named = verdict.stragglers(without_other)
    assert [(s.node, s.cause) for s in named] == [(truth.node, "network")], \
        json.dumps(verdict.summary(without_other))
    assert without_other["network_unsure"] is None


@pytest.mark.parametrize("scenario", ONE_RANK)
def test_alignment_error_within_100us(runs, scenario):
    """The namespaces share one boot, which the merge sees: one clock, exact by
    construction. test_every_node_its_own_clock and test_skewed_clock_recovered are
    the alignments that could go wrong."""
    o = runs.get(scenario)
    errors = measure.alignment_errors(o.fleet_db)
    print(scenario, "alignment error (us)", errors)
    assert max(errors.values()) <= MAX_ALIGNMENT_ERROR_US, (errors, show(scenario, o))


@pytest.mark.parametrize("scenario", ONE_RANK)
def test_message_bounds_hold_on_the_shared_clock(runs, scenario):
    """Every receive or arrival of a byte came after the send that began copying it and
    after any 'unsent' row that said it had not left (tcp:tcp_probe, bytes_acked read
    at its BTF offset): on the real kernel, under every fault (the network one
    retransmits), so the merge's message bounds are never wrong, only loose."""
    o = runs.get(scenario)
    pairs, broken, some = measure.message_bounds_broken(o.fleet_db)
    with measure.connect(o.fleet_db) as con:
        kinds = dict(con.execute("SELECT direction, COUNT(*) FROM tcp_progress GROUP BY 1"))
    print(scenario, "message pairs checked", pairs, "rows", kinds)
    assert kinds.get("unsent", 0) > 0 and kinds.get("arrive", 0) > 0, kinds
    assert pairs > 100 and broken == 0, (pairs, broken, some)


# -- every node a clock of its own ------------------------------------------------------------

def _own_clocks(runs, scenario, tmp_path):
    """The scenario's bundles with every node given a boot of its own, its readings
    unchanged (skew_node with no offset and no drift), merged and reported again."""
    o = runs.get(scenario)
    inputs = []
    for node, bundles in sorted(o.run.bundles.items()):
        inputs += skew_node(bundles, tmp_path / "own" / node, 0, ppm=0.0)[0]
    fleet, report = merge_and_report(inputs, tmp_path / "merged")
    return o, fleet, report


@pytest.mark.parametrize("scenario", ONE_RANK)
def test_every_node_its_own_clock(runs, scenario, tmp_path):
    """test_alignment_error_within_100us holds by construction: the four namespaces
    share one boot, so the merge rightly makes them one clock. Here every node is a
    boot of its own, its readings unchanged, so nothing tells the merge that they
    agree: its clock samples are unsynchronized (a starting line, not a bound), and the
    collectives' causal bounds and the ring's TCP messages place it. Against the shared
    clock, every node lies within the relative uncertainty the merge states, and within
    100 us but behind the lossy link or the slow one (0.3-4 us off, stated 34-150 us, with the grid rows
    and the senders' 'unsent' rows; 3-118 us, stated 0.1-15.5 ms, before them); the
    report says what it says on the shared clock: the same straggler and cause, none on
    the clean run; and where the stated uncertainty comes near the lateness it says that
    clock error cannot be ruled out instead of naming a clear cause."""
    o, fleet, report = _own_clocks(runs, scenario, tmp_path)
    errors = measure.alignment_errors(fleet)
    stated = {a["node"]: a["relative_uncertainty_us"] for a in report["alignment"]}
    print(f"{scenario}, every node its own clock: alignment error (us) {errors}; stated "
          f"relative uncertainty (us) {stated}; verdict {verdict.summary(report)}")
    # four clocks as the merge sees them: none placed exactly against the others, and
    # every one within a bound the merge states
    assert all(stated[n] is not None and stated[n] > 0 for n in errors), stated
    assert all(errors[n] <= stated[n] for n in errors), (errors, stated)
    if scenario not in ("network", "slowlink"):
        # the lossy link's tbf queue holds bytes up to 1 ms after TCP sent them, which
        # loosens the pairs across it on one side: there the bound is the stated one
        # (30-87 us off, stated 127-334 us, in four runs); the slow link's holds them
        # 5-20 ms (5-300 us off, stated 2.6-3.3 ms: the messages' bound, the queue being
        # in every cycle of the ring; a CI run stated its sync points' fit's bound plus
        # causality's move, 63 us, for a node 68 us off, before merge/align.py checked
        # that move against the fit's precision)
        assert max(errors.values()) <= MAX_ALIGNMENT_ERROR_US, errors
    truth = o.run.truth
    named = verdict.stragglers(report)
    if scenario == "slowlink":
        # a link is named only where its excess is 3 times the two nodes' alignment
        # uncertainty: with nothing else to tie the clocks, the room the slow link
        # itself leaves them can be too much; the link is then said, not named, and
        # nothing else is named in its place
        shared_link = o.report["link_suspect"]
        s = report["link_suspect"] or report["link_unsure"]
        assert s and (s["from"], s["to"]) == (shared_link["from"], shared_link["to"]), \
            verdict.summary(report)
        bound = s["clock_bound_ms"]
        loose = bound is None or s["median_ms"] - s["others_ms"] <= CLOCK_MARGIN * bound
        assert (report["link_suspect"] is None) == loose, (s, verdict.summary(report))
        if loose:
            assert named == [] and "clock error cannot be ruled out" in report["verdict"], \
                verdict.summary(report)
            return
    assert all(s.node == truth.node and s.cause in (truth.cause, None) for s in named), \
        show(scenario, o) + json.dumps(verdict.summary(report), default=str)
    shared = verdict.stragglers(o.report)
    assert [(s.node, s.cause) for s in named] == [(s.node, s.cause) for s in shared], \
        (verdict.summary(report), verdict.summary(o.report))
    assert report["cause"] == o.report["cause"], (report["verdict"], o.report["verdict"])
    if truth.node is None:
        assert named == [] and report["verdict"].startswith("No straggler"), \
            report["verdict"]
    for st in report.get("stragglers") or []:
        u = st["relative_uncertainty_ms"]
        if u is None or st["peak_ms"] <= CLOCK_MARGIN * u:
            assert st["clock_caveat"] and st["cause_confidence"] != "clear", st
            assert "clock error cannot be ruled out" in report["verdict"], report["verdict"]


# -- a node whose clock is off and drifting ---------------------------------------------------

def _skewed_variant(runs, role, offset_ns, tmp_path):
    o = runs.get("cpu")
    others = sorted(n for n in o.run.bundles if n != o.run.truth.node)
    node = o.run.truth.node if role == "straggler" else others[0]
    skewed, skew = skew_node(o.run.bundles[node], tmp_path / "skewed", offset_ns, ppm=50.0)
    inputs = skewed + [b for name, bs in o.run.bundles.items() if name != node for b in bs]
    fleet, report = merge_and_report(inputs, tmp_path / "merged")
    true_mono = lambda name: skew.true if name == node else (lambda m: m)  # noqa: E731
    return o, node, skew, fleet, report, true_mono


@pytest.mark.parametrize("role,offset_ns", SKEWS)
def test_skewed_clock_recovered(runs, role, offset_ns, tmp_path):
    """One node's clock (monotonic and wall clock alike, unsynchronized as the rig's
    kernel says) is 23-37 ms off and drifts 50 ppm; it is another boot, so only what the
    nodes exchanged can place it: the collectives, and the ring's TCP messages (a send
    before the receive of its bytes, tcp_progress). Its clock-sample line is proven wrong
    and replaced; the three nodes of one kernel stay one clock; it lands within 100 us
    of the truth, which the collectives alone did not reach (their ranks leave a
    completion up to ~1.5 ms apart on 2 loaded cores: 217-256 us off before the
    messages); the straggler is still named, with its cause.

    Sends into the CPU-starved straggler wait for its receive window and begin long
    before their bytes leave (165 ms here): those bind its clock from one side only
    (0.07-1.4 ms off, stated up to 15 ms, before the grid rows and the 'unsent' rows).
    The senders' rows at the same stream positions as the straggler's arrivals, and
    the ACK that opened the window ('unsent'), bind it from both."""
    o, node, skew, fleet, report, true_mono = _skewed_variant(runs, role, offset_ns, tmp_path)
    errors = measure.alignment_errors(fleet, true_mono)
    stated = {a["node"]: a["relative_uncertainty_us"] for a in report["alignment"]}
    inbound = measure.inbound_message_slack(o.fleet_db, node)
    inbound_ms = inbound["best"]
    with measure.connect(fleet) as con:
        pairs = dict(con.execute("SELECT n.name, a.message_pairs FROM clock_alignment a "
                                 "JOIN nodes n USING (node_id)"))
    print(f"skewed {node} by {offset_ns / 1e6} ms, 50 ppm: alignment error (us) {errors}; "
          f"stated relative uncertainty (us) {stated}; message pairs {pairs}; "
          f"bound to arrival into it (ms, median, true clock) {inbound}; "
          f"verdict {verdict.summary(report)}")
    # the 37 or 23 ms offset is gone, and the merge says how close it got: the true
    # error is within the stated uncertainty, which is small enough to be useful
    assert pairs[node] > 0, pairs
    assert stated[node] is not None and errors[node] <= stated[node], (errors, stated)
    assert errors[node] <= MAX_ALIGNMENT_ERROR_US, (errors, stated, inbound)
    assert stated[node] <= MAX_STATED_UNCERTAINTY_US, (stated, inbound)
    # the pairs into it are tight: a bound within a millisecond of each arrival
    assert inbound_ms is not None and inbound_ms < 1.0, inbound
    one_kernel = [errors[n] for n in errors if n != node]
    assert max(one_kernel) - min(one_kernel) <= MAX_ALIGNMENT_ERROR_US, errors
    # the straggler is named with its cause and without a clock caveat: nodes of one
    # boot are one clock, so only the skewed node's own uncertainty counts against it
    named = verdict.stragglers(report)
    assert [(s.node, s.cause) for s in named] == [(o.run.truth.node, "cpu")], \
        verdict.summary(report)
    assert report["cause_confidence"] == "clear", verdict.summary(report)


def test_skew_moves_every_clock_reading_consistently(runs, tmp_path):
    """The skew tool itself: every CLOCK_MONOTONIC value maps back to the original, and
    realtime - mono of each clock sample moves by exactly the skew at that instant."""
    o = runs.get("cpu")
    node = o.run.truth.node
    (skewed,), skew = skew_node(o.run.bundles[node], tmp_path, 5_000_000, ppm=50.0)
    with open_bundle(o.run.bundles[node][0], integrity="full") as a, \
            open_bundle(skewed, integrity="full") as b:
        for table, cols in mono_columns().items():
            for col in cols:
                sql = f"SELECT {col} FROM {table} ORDER BY rowid"
                orig = [r[0] for r in a.con.execute(sql)]
                new = [r[0] for r in b.con.execute(sql)]
                assert len(orig) == len(new)
                assert all(n is None if v is None else abs(skew.true(n) - v) <= 1
                           for v, n in zip(orig, new)), (table, col)
        # a measured interval grows with the clock's rate: its end is the skewed end
        for table in ("sched_events", "cuda_events", "nccl_events"):
            sql = f"SELECT timestamp_ns, duration_ns FROM {table} ORDER BY rowid"
            pairs = zip(a.con.execute(sql), b.con.execute(sql))
            assert all(abs(skew.true(t1 + d1) - (t0 + d0)) <= 2
                       for (t0, d0), (t1, d1) in pairs if d0 is not None), table
        sql = ("SELECT mono_before_ns, mono_after_ns, realtime_ns FROM clock_samples "
               "ORDER BY rowid")
        for (b0, a0, r0), (b1, a1, r1) in zip(a.con.execute(sql), b.con.execute(sql)):
            shift = skew.skewed((b0 + a0) // 2) - (b0 + a0) // 2
            assert abs((r1 - r0) - shift) <= 1
        assert b.manifest["capture"]["start_mono_ns"] == \
            skew.skewed(a.manifest["capture"]["start_mono_ns"])
        drift = (skew.skewed(a.manifest["capture"]["end_mono_ns"])
                 - a.manifest["capture"]["end_mono_ns"]) - 5_000_000
        assert drift > 0   # 50 ppm over the run: the skew really drifts


# -- a capture attached to a job already running (issue 17) ----------------------------------

#: the job runs this long; the captures start LATE_ATTACH_S after it, so a hundred or
#: more collectives are seen (the hog makes a cpu step about 250 ms; the four captures,
#: started at normal priority beside the running job and its hog, have every source on
#: 20-25 s after launch: jobs of 48, 38 and 32 s let them see 352, 220 and 96)
LATE_JOB = "38s"
LATE_ATTACH_S = 3.0


@pytest.fixture(scope="module")
def late(rig, tmp_path_factory):
    # what is tested here is the inference, not the idle-priority start (bench_rig
    # --attach-after measures that): started at normal priority, the sources come on in
    # seconds whatever else the machine runs
    run = rig.run_scenario("cpu", steps=LATE_JOB, attach_after_s=LATE_ATTACH_S,
                           capture_args=("--start-priority", "normal"))
    fleet, report = merge_and_report(run.all_bundles(), tmp_path_factory.mktemp("late"))
    return run, fleet, report


def test_late_attach_infers_the_world_communicator(late):
    """The captures missed ncclCommInitRank: each rank's calls are matched to the others'
    by shape and causality into one communicator, numbered alike (checked on the shared
    clock: one seq is one collective on every rank), ranks from the environment."""
    run, fleet, report = late
    con = apsw.Connection(str(fleet), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        inferred = con.execute("SELECT n.name, i.streams, i.rank, i.env_rank, i.basis, "
                               "i.detail FROM inferred_comms i JOIN nodes n USING (node_id) "
                               "ORDER BY n.name").fetchall()
        rows = con.execute("SELECT comm_id_hash, seq, pid, mono_ns FROM nccl_events").fetchall()
    finally:
        con.close()
    # The truth, from the job itself: each rank's own step boundaries on the shared clock
    # (its printed start and step times) say in which training step each of its calls
    # was; one (comm, seq) must be one step on every rank. A rank numbered a step off
    # (the straggler's calls are nearer the previous step's in time) breaks it.
    rank_of = {pid: r for node, pids in run.pids.items() for pid in pids
               for r, n in run.node_of_rank.items() if n == node}
    ends = {r: list(itertools.accumulate(res["step_ns"], initial=res["start_mono_ns"]))
            for r, res in run.results.items()}
    steps: dict = {}
    for h, seq, pid, mono in rows:
        steps.setdefault((h, seq), set()).add(bisect.bisect(ends[rank_of[pid]], mono))
    full = sum(1 for v in steps.values() if len(v) == 1)
    print(inferred, full, len(steps))
    assert full >= 100 and full == len(steps), \
        [(k, v) for k, v in steps.items() if len(v) > 1][:5]
    assert [r[0] for r in inferred] == sorted(run.bundles) and \
        {r[1] for r in inferred} == {4}, inferred
    assert [r[2] for r in inferred] == [r[3] for r in inferred] == [0, 1, 2, 3], inferred
    assert report.get("inferred_communicators"), report.keys()


def test_late_attach_names_the_cpu_straggler(late):
    run, fleet, report = late
    named = verdict.stragglers(report)
    assert [(s.node, s.cause) for s in named] == [(run.truth.node, "cpu")], \
        verdict.summary(report)



def test_late_attach_counts_the_connections_established_before(late):
    """The ring's connections were established before the captures: their bytes are
    counted from the sockets' own sequence numbers (rows marked attached). On the shared
    clock every receive or arrival still comes after the sends of its bytes, the merge
    pairs them on every node, and the report measures every link of the ring."""
    run, fleet, report = late
    pairs, broken, some = measure.message_bounds_broken(fleet)
    with measure.connect(fleet) as con:
        kinds = dict(con.execute("SELECT direction, COUNT(*) FROM tcp_progress "
                                 "WHERE attached = 1 GROUP BY 1"))
        counted = con.execute("SELECT COUNT(*) FROM tcp_progress WHERE attached = 0"
                              ).fetchone()[0]
        (paired,) = con.execute("SELECT message FROM merge_log WHERE event = "
                                "'message_pairs'").fetchone()
    print("late attach: message pairs checked", pairs, "rows", kinds, "links",
          report["links"])
    assert paired.startswith(f"{len(run.bundles)} TCP connections between nodes"), paired
    assert counted == 0 and all(kinds.get(k, 0) > 0 for k in
                                ("send", "recv", "arrive", "unsent")), (kinds, counted)
    assert pairs > 100 and broken == 0, (pairs, broken, some)
    ring = {(run.node_of_rank[r], run.node_of_rank[(r + 1) % len(run.results)])
            for r in run.results}
    assert {(lk["from"], lk["to"]) for lk in report["links"]} == ring, report["links"]
    assert max(lk["median_ms"] for lk in report["links"]) < 1.0, report["links"]


def test_late_attach_every_node_its_own_clock(late, tmp_path):
    """The late run's bundles with every node a boot of its own (readings unchanged):
    its communicator inferred, the ring's messages (counted from the sockets) place
    every clock within 100 us of the shared one, within what the merge states, and the
    straggler is still named with its cause."""
    run, _fleet, _report = late
    inputs = []
    for node, bundles in sorted(run.bundles.items()):
        inputs += skew_node(bundles, tmp_path / "own" / node, 0, ppm=0.0)[0]
    fleet, report = merge_and_report(inputs, tmp_path / "merged")
    errors = measure.alignment_errors(fleet)
    stated = {a["node"]: a["relative_uncertainty_us"] for a in report["alignment"]}
    with measure.connect(fleet) as con:
        used = dict(con.execute("SELECT n.name, a.message_pairs FROM clock_alignment a "
                                "JOIN nodes n USING (node_id)"))
    print(f"late attach, every node its own clock: alignment error (us) {errors}; stated "
          f"(us) {stated}; message pairs {used}; verdict {verdict.summary(report)}")
    assert all(n > 0 for n in used.values()), used
    assert all(stated[n] is not None and errors[n] <= stated[n] for n in errors), \
        (errors, stated)
    assert max(errors.values()) <= MAX_ALIGNMENT_ERROR_US, errors
    assert [(s.node, s.cause) for s in verdict.stragglers(report)] == \
        [(run.truth.node, "cpu")], verdict.summary(report)
