"""The rig with two ranks per node (eight ranks, and their "GPU" threads, on the VM's 2
cores): where a busy host blurs the signals. Two verdicts were wrong here and right with
one rank per node (test_rig.py):

- "gpu" (one node's shim kernels three times longer; four now): the slow node, late by its
  forward pass's sync, was named; its upstream ring neighbour, late with it, was named a
  second straggler with "network retransmits, clear" for the segments it resent towards
  the slow node. A sender waiting for a late receiver is its victim (docs/report.md,
  rule 5): no network cause.
- "compute" (the straggler's ranks spend 8 ms more of their own CPU per step): "Most
  likely cause: GPU slowdown" from waits for its own GPU work of 1.4 ms against its
  peers' 0.5 ms at the median, while their waits reach 2.7 ms at the 90th percentile.
  The GPU-wait score now needs a median beyond nine in ten of the peers' waits.

Each node's two ranks also share a tensor-parallel communicator of their own (made as
PyTorch's new_group makes one, an all-reduce after every forward pass), whose ranks are
0 and 1 on every node: the report names world ranks, and a communicator whose ranks are
all on one node is no evidence of lateness between nodes.

Real faults, real captures, the same commands as test_rig.py."""

from __future__ import annotations

import json

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
             straggler=2, tensor_parallel=True) as rig:
        yield scenario_runs(rig, STEPS)


def test_slow_gpu_never_blames_another_node(two_ranks):
    """Here the slow GPU is near the report's bars (measured three times slower, before
    the shim's device kept its own time and the tensor-parallel communicator): in runs it was late enough to be
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
    # world ranks (4 and 5), not the tensor-parallel communicator's (0 and 1)
    assert set(named[0].ranks) == set(truth.ranks), verdict.summary(o.report)
    assert o.report["straggler_ranks"] == sorted(truth.ranks), verdict.summary(o.report)


def test_tensor_parallel_communicators_keep_world_ranks(two_ranks):
    """The captures saw the world communicator and the four node-local ones with their
    local ranks; fleet.db lists each node's world ranks and names no other."""
    o = two_ranks("compute")
    with measure.connect(o.fleet_db) as con:
        comms = sorted(con.execute(
            "SELECT MAX(c.nranks), MAX(c.ranks_seen), COUNT(DISTINCT e.node_id) "
            "FROM collectives c JOIN nccl_events e USING (comm_id_hash, seq) "
            "GROUP BY c.comm_id_hash"))
        ranks = {name: json.loads(r) for name, r in con.execute(
            "SELECT name, ranks FROM nodes")}
        local = sorted({r for (r,) in con.execute(
            "SELECT DISTINCT e.rank FROM nccl_events e JOIN collectives c USING "
            "(comm_id_hash, seq) WHERE c.nranks = 2")})
    # (size, ranks seen, nodes): four of two ranks on one node each, the world's
    assert comms == [(2, 2, 1)] * 4 + [(8, 8, 4)], comms
    assert local == [0, 1], local
    assert ranks == {name: sorted(r for r, n in o.run.node_of_rank.items() if n == name)
                     for name in ranks}, ranks
