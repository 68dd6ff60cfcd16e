"""The rig with two ranks per node (eight ranks, and their "GPU" threads, on the VM's 2
cores): where a busy host blurs the signals. Two verdicts were wrong here and right with
one rank per node (test_rig.py):

- "gpu" (one node's shim kernels three times longer): the slow node, late by its
  forward pass's sync, was named; its upstream ring neighbour, late with it, was named a
  second straggler with "network retransmits, clear" for the segments it resent towards
  the slow node. A sender waiting for a late receiver is its victim (docs/report.md,
  rule 5): no network cause.
- "compute" (the straggler's ranks spend 8 ms more of their own CPU per step): "Most
  likely cause: GPU slowdown" from waits for its own GPU work of 1.4 ms against its
  peers' 0.5 ms at the median, while their waits reach 2.7 ms at the 90th percentile.
  The GPU-wait score now needs a median beyond nine in ten of the peers' waits.

Real faults, real captures, the same commands as test_rig.py."""

from __future__ import annotations

import pytest

from . import measure, verdict
from .conftest import scenario_runs, skip_without_rig
from .rig import Rig

pytestmark = [pytest.mark.ebpf, pytest.mark.slow]

#: about 60 ms a step with eight ranks on two cores: 80 steps are about 20 time bins,
#: in about 25 s of the rig's CI time per scenario (start, job, stop, merge, report)
STEPS = 80


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    skip_without_rig()
    with Rig(tmp_path_factory.mktemp("two-ranks"), nodes=4, ranks_per_node=2,
             straggler=2) as rig:
        yield scenario_runs(rig, STEPS)


def test_slow_gpu_never_blames_another_node(two_ranks):
    """Here the slow GPU is near the report's bars: in runs it was late enough to be
    named, with GPU slowdown (weak) or "cannot tell"; in another its host was 3.8 ms late
    against a bar of 9.5 ms and its GPU waits scored 2.9 against the 3 of weak evidence
    ("No straggler"; docs/report.md, Limits). What must hold every time: if it is named,
    its cause is its GPU or none; any other node named is late for want of it, never with
    a clear cause, never the network for what it resent towards the slow node."""
    o = two_ranks("gpu")
    truth = o.run.truth
    for s in verdict.stragglers(o.report):
        if s.node == truth.node:
            assert s.cause in ("gpu", None) and set(s.ranks) <= set(truth.ranks), \
                verdict.summary(o.report)
        else:
            assert s.cause != "network" and s.confidence != "clear", verdict.summary(o.report)


def test_own_code_slower_is_named_without_a_cause(two_ranks):
    o = two_ranks("compute")
    truth = o.run.truth
    assert measure.true_lateness(o.fleet_db)[truth.node] >= 5.0, verdict.summary(o.report)
    named = verdict.stragglers(o.report)
    assert [s.node for s in named] == [truth.node], verdict.summary(o.report)
    assert named[0].cause is None, verdict.summary(o.report)
