"""What a real kernel cannot produce, the simulator must not produce either.

A fleet that breaks these would let the analysis pass on artefacts: overlapping waits
for a CPU on one thread, a thread waiting for a CPU while it sleeps, clocks that run
backwards, retransmits on connections that do not exist.
"""

import pytest


def _overlaps(intervals):
    """Pairs (a, b) of [start, end) intervals that overlap, in start order."""
    out = []
    ordered = sorted(intervals)
    for (s1, e1), (s2, e2) in zip(ordered, ordered[1:]):
        if s2 < e1:
            out.append(((s1, e1), (s2, e2)))
    return out


@pytest.mark.parametrize("fault", ["cpu", "memory", "none"])
def test_sched_spans_of_one_thread_never_overlap(make_fleet, fault):
    f = make_fleet(fault=fault, steps=120, **({} if fault == "none" else {"straggler": 1}))
    checked = 0
    for node in f.bundles:
        threads = f.q(node, "SELECT DISTINCT tid FROM sched_events")
        for (tid,) in threads:
            runq = f.q(node, "SELECT timestamp_ns, timestamp_ns + duration_ns FROM "
                             "sched_events WHERE tid = ? AND kind = 'runq_delay'", (tid,))
            asleep = f.q(node, "SELECT timestamp_ns, timestamp_ns + duration_ns FROM "
                               "sched_events WHERE tid = ? AND kind = 'off_cpu' "
                               "AND prev_state IN ('S', 'D')", (tid,))
            assert _overlaps(runq) == [], (node, tid)
            # runnable and asleep at once is impossible
            both = [(s, e, "r") for s, e in runq] + [(s, e, "s") for s, e in asleep]
            both.sort()
            for (s1, e1, k1), (s2, e2, k2) in zip(both, both[1:]):
                if k1 != k2:
                    assert s2 >= e1, (node, tid, (s1, e1, k1), (s2, e2, k2))
            checked += len(runq)
    if fault == "cpu":
        assert checked > 100      # the straggler's loader workers wait, one at a time


def test_clocks_run_forward(make_fleet):
    f = make_fleet(fault="none", steps=80, ntp_step=True)
    for node in f.bundles:
        rows = f.q(node, "SELECT mono_before_ns, mono_after_ns, realtime_ns FROM "
                         "clock_samples WHERE source = 'system' ORDER BY mono_before_ns")
        assert len(rows) > 5
        for (b1, a1, r1), (b2, a2, r2) in zip(rows, rows[1:]):
            assert b1 <= a1 < b2 <= a2
        # realtime steps at most once (the NTP step); otherwise it advances with mono
        jumps = [(r2 - r1) - (b2 - b1) for (b1, _, r1), (b2, _, r2) in zip(rows, rows[1:])]
        assert sum(abs(j) > 1_000_000 for j in jumps) <= 1


def test_job_retransmits_only_on_connections_that_exist(make_fleet):
    f = make_fleet(fault="network", straggler=2, steps=80)
    addr = {n["name"]: n["address"] for n in f.truth["nodes"]}
    ring = {n["name"]: n["ring_neighbours"] for n in f.truth["nodes"]}
    for node in f.bundles:
        peers = {addr[p] for p in ring[node]}
        rows = f.q(node, "SELECT saddr, daddr FROM tcp_events WHERE scope = 'job'")
        for saddr, daddr in rows:
            assert saddr == addr[node] and daddr in peers, (node, saddr, daddr)
