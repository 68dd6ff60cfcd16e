"""Each fault leaves its signature in the bundles (checked with SQL, never on internals)."""

from __future__ import annotations

import statistics

import pytest

STRAGGLER = "node-02"
OTHERS = ("node-00", "node-01", "node-03")


def _late_split(fleet):
    late = fleet.lateness_ms()
    bad = set(fleet.truth["fault"]["late_ranks"])
    return ([v for r, v in late.items() if r in bad],
            [v for r, v in late.items() if r not in bad])


def _metric(fleet, node, metric, device=None):
    sql = "SELECT avg(value), max(value) FROM host_samples WHERE metric = ?"
    params = [metric]
    if device is not None:
        sql += " AND device = ?"
        params.append(device)
    return fleet.q(node, sql, params)[0]


def _train_metric(fleet, node, metric):
    """Mean of a metric while the job ran (between the first and last NCCL call)."""
    lo, hi = fleet.q(node, "SELECT min(timestamp_ns), max(timestamp_ns) FROM nccl_events")[0]
    return fleet.q(node, "SELECT avg(value) FROM host_samples WHERE metric = ? AND "
                         "timestamp_ns BETWEEN ? AND ?", (metric, lo, hi))[0][0]


def test_cpu_contention(make_fleet):
    f = make_fleet(fault="cpu", straggler=2)
    assert f.truth["fault"]["straggler"] == STRAGGLER
    comp = f.truth["fault"]["detail"]["competitor_comm"]
    # the straggler's training threads wait in the runqueue behind the competing task
    n, total_ms = f.q(STRAGGLER, "SELECT count(*), sum(duration_ns) / 1e6 FROM sched_events "
                                 "WHERE kind = 'runq_delay' AND other_comm = ?", (comp,))[0]
    assert n > 100 and total_ms > 500
    for node in OTHERS:
        ms = f.q(node, "SELECT coalesce(sum(duration_ns), 0) / 1e6 FROM sched_events "
                       "WHERE kind = 'runq_delay'")[0][0]
        assert ms < total_ms / 10
        assert f.q(node, "SELECT count(*) FROM sched_events WHERE other_comm = ?",
                   (comp,))[0][0] == 0
    assert _train_metric(f, STRAGGLER, "cpu.busy_pct") > 90
    assert all(_train_metric(f, n, "cpu.busy_pct") < 30 for n in OTHERS)
    late, normal = _late_split(f)
    assert min(late) > 5 and max(normal) < 3


def test_io_stall(make_fleet):
    f = make_fleet(fault="io", straggler=2)
    slow = f.q(STRAGGLER, "SELECT count(*) FROM block_events WHERE op = 'read' "
                          "AND duration_ns > 20e6")[0][0]
    assert slow > 20
    for node in OTHERS:
        assert f.q(node, "SELECT max(duration_ns) FROM block_events WHERE op = 'read'")[0][0] < 5e6
        assert _train_metric(f, node, "psi.io.some_pct") < 2
    assert _train_metric(f, STRAGGLER, "psi.io.some_pct") > 20
    assert _train_metric(f, STRAGGLER, "disk.await_ms") > 10
    late, normal = _late_split(f)
    assert min(late) > 5 and max(normal) < 3


def test_memory_pressure(make_fleet):
    f = make_fleet(fault="memory", straggler=2)
    for metric, floor in (("psi.memory.some_pct", 15), ("vm.pgmajfault_per_s", 1000),
                          ("vm.pgscan_per_s", 10_000)):
        assert _train_metric(f, STRAGGLER, metric) > floor
        assert all(_train_metric(f, n, metric) < floor / 10 for n in OTHERS)
    d_spans = f.q(STRAGGLER, "SELECT count(*) FROM sched_events WHERE kind = 'off_cpu' "
                             "AND prev_state = 'D' AND tid = pid")[0][0]
    assert d_spans > 20
    late, normal = _late_split(f)
    assert min(late) > 5 and max(normal) < 3


def test_gpu_throttle(make_fleet):
    f = make_fleet(fault="gpu", straggler=2)
    (rank,) = f.truth["fault"]["ranks"]
    gpu = str(f.truth["fault"]["detail"]["gpu"])
    lo, hi = f.q(STRAGGLER, "SELECT min(timestamp_ns), max(timestamp_ns) FROM nccl_events")[0]
    clk = f.q(STRAGGLER, "SELECT device, avg(value) FROM host_samples WHERE "
                         "metric = 'gpu.sm_clock_mhz' AND timestamp_ns BETWEEN ? AND ? "
                         "GROUP BY device", (lo, hi))
    clk = dict(clk)
    assert clk[gpu] < 1500 and all(v > 1900 for d, v in clk.items() if d != gpu)
    assert _metric(f, STRAGGLER, "gpu.temp_c", gpu)[1] >= 85
    # the slow rank's forward sync waits longer than its node peer's
    pid = dict(f.q(STRAGGLER, "SELECT rank, pid FROM processes"))
    fwd = {r: f.q(STRAGGLER, "SELECT avg(duration_ns) FROM cuda_events WHERE "
                             "api = 'cudaEventSynchronize' AND pid = ?", (p,))[0][0]
           for r, p in pid.items()}
    assert fwd[rank] > 1.2 * min(fwd.values())
    late = f.lateness_ms()
    assert late[rank] > 5 and max(v for r, v in late.items() if r != rank) < 3
    # no other kind's signature
    assert _train_metric(f, STRAGGLER, "cpu.busy_pct") < 30


def test_network_retransmits(make_fleet):
    f = make_fleet(fault="network", straggler=2, fault_windows=((20, 50),))
    detail = f.truth["fault"]["detail"]
    me = f.node_truth(STRAGGLER)["address"]
    rows = f.q(STRAGGLER, "SELECT saddr, daddr, owner_pid FROM tcp_events WHERE scope = 'job'")
    assert len(rows) > 50
    pids = {p for (p,) in f.q(STRAGGLER, "SELECT pid FROM processes")}
    assert {s for s, _, _ in rows} == {me}
    assert {d for _, d, _ in rows} == set(detail["neighbour_addresses"])
    assert {o for _, _, o in rows} <= pids
    # neighbours see some toward the straggler; the far node only rare ones
    assert f.q("node-01", "SELECT count(*) FROM tcp_events WHERE scope = 'job' AND "
                          "daddr = ?", (me,))[0][0] > 5
    assert f.q("node-00", "SELECT count(*) FROM tcp_events WHERE scope = 'job'")[0][0] < 10
    # collectives slow for everyone inside the window, but nobody arrives markedly late
    late = f.lateness_ms()
    assert max(abs(v) for v in late.values()) < 2
    waits = _collective_ms(f)
    inside = [v for s, v in waits.items() if 20 <= s < 50]
    outside = [v for s, v in waits.items() if s < 20 or s >= 50]
    assert statistics.median(inside) > 2.5 * statistics.median(outside)


def test_slow_link_queues_one_hop_and_drops_nothing(make_fleet):
    """A link that queues (slowlink) between the straggler and the next node: its bytes
    take milliseconds from send to arrival against tens of microseconds on every other
    hop, collectives are slower for everyone inside the window, nobody arrives late and
    nothing is retransmitted."""
    f = make_fleet(fault="slowlink", straggler=2, fault_windows=((20, 50),))
    detail = f.truth["fault"]["detail"]
    assert detail["link"] == [STRAGGLER, "node-03"]
    assert 4.0 <= detail["queue_ms"][0] <= detail["queue_ms"][1] <= 12.0
    assert 2.0 <= detail["rate_factor"][0] <= detail["rate_factor"][1] <= 4.0
    addr = {n["name"]: n["address"] for n in f.truth["nodes"]}
    window = f.truth["fault"]["windows"][0]
    lo, hi = window["start_utc_ns"], window["end_utc_ns"]
    transit = {}
    for node in f.bundles:
        sends = sorted((o, f.true_ns(node, t)) for o, t in f.q(
            node, "SELECT stream_offset, timestamp_ns FROM tcp_progress "
                  "WHERE direction = 'send'"))
        (dst,) = {d for (d,) in f.q(node, "SELECT daddr FROM tcp_progress "
                                          "WHERE direction = 'send'")}
        peer = next(n for n, a in addr.items() if a == dst)
        inside = []
        for o, b, t in f.q(peer, "SELECT stream_offset, bytes, timestamp_ns FROM tcp_progress "
                                 "WHERE direction = 'arrive' AND daddr = ?", (addr[node],)):
            below = [s for off, s in sends if off < o + b]
            tt = f.true_ns(peer, t)
            if below and lo <= tt < hi:
                inside.append(tt - max(below))
        transit[(node, peer)] = statistics.median(inside) / 1e6
    slow = transit.pop((STRAGGLER, "node-03"))
    assert slow > 2.0, (slow, transit)
    assert max(transit.values()) < 0.2, transit
    assert max(abs(v) for v in f.lateness_ms().values()) < 2
    for node in f.bundles:
        assert f.q(node, "SELECT count(*) FROM tcp_events WHERE scope = 'job'")[0][0] < 10
    waits = _collective_ms(f)
    inside = [v for s, v in waits.items() if 20 <= s < 50]
    outside = [v for s, v in waits.items() if s < 20 or s >= 50]
    assert statistics.median(inside) > statistics.median(outside) + 3


def _collective_ms(f):
    """Per step: observed completion of the last gradient bucket minus the last entry.

    Completion is observed as the end of the first synchronization after the enqueue
    on the same thread (docs/simulator.md); both ends are mapped to true time.
    """
    world = f.truth["communicators"][0]["comm_id_hash"]
    per_bucket = f.truth["communicators"][0]["per_step"]
    ends, entries = {}, {}
    for node in f.bundles:
        syncs = f.q(node, "SELECT pid, timestamp_ns + duration_ns, timestamp_ns FROM "
                          "cuda_events WHERE api LIKE 'cuda%Synchronize' ORDER BY timestamp_ns")
        for pid, ts, seq in f.q(node, "SELECT pid, timestamp_ns, seq FROM nccl_events WHERE "
                                      "comm_id_hash = ? AND seq % ? = 0", (world, per_bucket)):
            step = seq // per_bucket - 1
            end = next(e for p, e, s in syncs if p == pid and s > ts)
            ends.setdefault(step, []).append(f.true_ns(node, end))
            entries.setdefault(step, []).append(f.true_ns(node, ts))
    return {s: (statistics.median(ends[s]) - max(entries[s])) / 1e6 for s in ends}


def test_none_is_clean(make_fleet):
    f = make_fleet(fault="none")
    assert f.truth["fault"]["kind"] == "none" and f.truth["fault"]["straggler"] is None
    late = f.lateness_ms()
    assert max(abs(v) for v in late.values()) < 2
    busy = [_train_metric(f, n, "cpu.busy_pct") for n in f.bundles]
    assert max(busy) < 30
    for node in f.bundles:
        assert f.q(node, "SELECT count(*) FROM tcp_events WHERE scope = 'job'")[0][0] < 5
        assert f.q(node, "SELECT max(duration_ns) FROM block_events WHERE op = 'read'")[0][0] < 5e6


def test_clean_runs_have_benign_noise(make_fleet):
    """A clean fleet is not sterile: background retransmits and brief kernel-task waits."""
    f = make_fleet(fault="none", steps=200)
    bg = sum(f.q(n, "SELECT count(*) FROM tcp_events WHERE scope = 'background' AND "
                    "owner_pid IS NULL")[0][0] for n in f.bundles)
    assert bg > 0
    benign = sum(f.q(n, "SELECT count(*) FROM sched_events WHERE kind = 'runq_delay'")[0][0]
                 for n in f.bundles)
    assert benign > 0


@pytest.mark.parametrize("kind", ["cpu", "io", "memory"])
def test_fault_window_limits_the_fault(make_fleet, kind):
    f = make_fleet(fault=kind, straggler=1, fault_windows=((15, 30), (45, 55)))
    world = f.truth["communicators"][0]["comm_id_hash"]
    per = f.truth["communicators"][0]["per_step"]
    inside = {(world, s * per + j + 1) for a, b in ((15, 30), (45, 55))
              for s in range(a, b) for j in range(per)}
    outside = {(world, s * per + j + 1) for s in range(60) for j in range(per)} - inside
    bad = set(f.truth["fault"]["late_ranks"])
    late_in = f.lateness_ms(inside)
    late_out = f.lateness_ms(outside)
    assert min(late_in[r] for r in bad) > 5
    assert max(abs(late_out[r]) for r in bad) < 3
    wins = f.truth["fault"]["windows"]
    assert [w["steps"] for w in wins] == [[15, 30], [45, 55]]
    assert all(w["start_utc_ns"] < w["end_utc_ns"] for w in wins)
    assert wins[0]["end_utc_ns"] < wins[1]["start_utc_ns"]
