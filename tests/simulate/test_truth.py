"""truth.json agrees with the bundles: clocks, ranks, communicators, sync points."""

from __future__ import annotations

import json
import statistics

import pytest

from ingero_forensics.bundle.schema import HOST_METRICS, TABLES


def test_truth_lists_every_bundle_and_lives_beside_them(make_fleet):
    f = make_fleet(fault="cpu", straggler=1)
    names = sorted(p.name for p in f.dir.glob("*.bundle"))
    assert sorted(n["bundle"] for n in f.truth["nodes"]) == names
    assert [n["name"] for n in f.truth["nodes"]] == ["node-00", "node-01", "node-02", "node-03"]
    for b in f.bundles.values():
        tables = [n for (n,) in b.con.execute("SELECT name FROM sqlite_schema")]
        assert "truth" not in " ".join(tables)
        meta = json.dumps(b.con.execute("SELECT * FROM meta").fetchall())
        assert "straggler" not in meta and "cpu" not in meta


def test_ranks_match_processes(make_fleet):
    f = make_fleet(fault="cpu", straggler=1)
    R = f.truth["job"]["ranks_per_node"]
    for n in f.truth["nodes"]:
        rows = f.q(n["name"], "SELECT pid, rank, local_rank, world_size, node_rank, env "
                              "FROM processes ORDER BY rank")
        assert [r[1] for r in rows] == n["ranks"] == list(range(n["index"] * R,
                                                                  n["index"] * R + R))
        assert [r[0] for r in rows] == n["pids"]
        for pid, rank, lr, ws, node_rank, env in rows:
            env = json.loads(env)
            assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(lr) == str(rank % R)
            assert ws == f.truth["job"]["world_size"] and node_rank == n["index"]
        # NCCL calls come from these processes with the matching rank
        assert set(f.q(n["name"], "SELECT DISTINCT pid, rank FROM nccl_events")) == \
            {(r[0], r[1]) for r in rows}
    assert f.truth["fault"]["ranks"] == f.truth["nodes"][1]["ranks"]


def test_communicators(make_fleet):
    f = make_fleet(fault="none")
    world, split = f.truth["communicators"]
    hashes = set()
    for node in f.bundles:
        for comm, n, lo, hi in f.q(node, "SELECT comm_id_hash, count(DISTINCT seq), min(seq), "
                                         "max(seq) FROM nccl_events GROUP BY comm_id_hash, pid"):
            hashes.add(comm)
            assert lo == 1 and hi == n  # seq counts from 1 without gaps, per rank
        assert f.q(node, "SELECT DISTINCT parent_hash, split_color FROM nccl_comm_events "
                         "WHERE api = 'ncclCommSplit'") == [(world["comm_id_hash"], 0)]
    assert hashes == {world["comm_id_hash"], split["comm_id_hash"]}
    assert all(len(h) == 16 and int(h, 16) >= 0 and h == h.lower() for h in hashes)
    # every (comm, seq) is called by every rank exactly once
    for key, by_rank in f.entries().items():
        assert sorted(by_rank) == list(range(f.truth["job"]["world_size"]))


def _system_rows(f, node):
    return f.q(node, "SELECT mono_before_ns, mono_after_ns, realtime_ns, adj_maxerror_ns, "
                     "adj_esterror_ns FROM clock_samples WHERE source = 'system' "
                     "ORDER BY mono_before_ns")


def _model_error(clock, t0, true):
    step = clock["step"]
    if step and true >= step["true_utc_ns"]:
        return step["residual_ns"] + clock["drift_ppm"] * 1e-6 * (true - step["true_utc_ns"])
    return clock["offset_ns"] + clock["drift_ppm"] * 1e-6 * (true - t0)


def test_clock_samples_follow_the_clock_truth(make_fleet):
    f = make_fleet(fault="none", ntp_step=True, lying_clock=3, steps=120)
    t0 = f.truth["job"]["start_utc_ns"]
    for n in f.truth["nodes"]:
        clock = n["clock"]
        assert clock["step"] is not None
        rows = _system_rows(f, n["name"])
        assert len(rows) > 20
        diffs = []
        for mb, ma, real, maxerr, esterr in rows:
            true = f.true_ns(n["name"], (mb + ma) / 2)
            err = real - true
            # realtime - true time is the modelled error (within the read bracket)
            assert abs(err - _model_error(clock, t0, true)) < (ma - mb) + 2_000
            diffs.append((true, real - (mb + ma) // 2))
            if clock["claims_honest"]:
                assert maxerr >= abs(err)
        # realtime - mono is constant except at the NTP step, where it jumps
        before = [d for t, d in diffs if t < clock["step"]["true_utc_ns"]]
        after = [d for t, d in diffs if t >= clock["step"]["true_utc_ns"]]
        assert before and after
        assert max(before) - min(before) < 2_000 and max(after) - min(after) < 2_000
        jump = statistics.median(after) - statistics.median(before)
        assert abs(jump) > 0 or clock["offset_ns"] == clock["step"]["residual_ns"]
        mono_step = clock["step"]["mono_ns"]
        assert abs(f.true_ns(n["name"], mono_step) - clock["step"]["true_utc_ns"]) < 1_000
    liar = f.truth["nodes"][3]
    assert liar["clock"]["claims_honest"] is False
    assert sum(1 for r in _system_rows(f, "node-03")
               if r[3] < abs(r[2] - f.true_ns("node-03", (r[0] + r[1]) / 2))) > 10


def test_chrony_rows_on_some_nodes(make_fleet):
    f = make_fleet(fault="none", steps=120)
    with_chrony = [n for n in f.truth["nodes"] if n["clock"]["chrony_reference_error_ns"]
                   is not None]
    assert with_chrony and len(with_chrony) < len(f.truth["nodes"])
    for n in f.truth["nodes"]:
        rows = f.q(n["name"], "SELECT ref_offset_ns, realtime_ns, mono_before_ns, "
                              "mono_after_ns FROM clock_samples WHERE source = 'chrony'")
        assert bool(rows) == (n in with_chrony)
        for ref, real, mb, ma in rows:
            err = real - f.true_ns(n["name"], (mb + ma) / 2)
            assert abs(ref - (err - n["clock"]["chrony_reference_error_ns"])) < 50_000 + (ma - mb)


def test_syncs_pin_collective_completion_across_ranks(make_fleet):
    """The shared model: a sync that waited, with nothing but the loss value's copy
    queued after the collective (queued_ops <= 2), ends at the completion (+ wake-up) on
    every rank, so mapped to true time those ends agree within tens of microseconds. A
    sync behind the optimizer's kernels ends when they end: later on the rank whose CPU
    is starved, which is why the merge must not read it as the completion."""
    f = make_fleet(fault="cpu", straggler=2, max_offset_ms=80, max_drift_ppm=100)
    tight, loose = {}, {}
    for node in f.bundles:
        for pid in [p for (p,) in f.q(node, "SELECT pid FROM processes")]:
            calls = f.q(node, "SELECT timestamp_ns, comm_id_hash, seq FROM nccl_events "
                              "WHERE pid = ? ORDER BY timestamp_ns", (pid,))
            syncs = f.q(node, "SELECT timestamp_ns, duration_ns, queued_ops FROM cuda_events "
                              "WHERE pid = ? AND api IN ('cudaStreamSynchronize', "
                              "'cudaEventSynchronize') ORDER BY timestamp_ns", (pid,))
            i = 0
            for s_ts, s_dur, queued in syncs:
                last = None
                while i < len(calls) and calls[i][0] < s_ts:
                    last = calls[i]
                    i += 1
                if last is not None and s_dur > 200_000:  # it waited
                    into = tight if queued <= 2 else loose
                    into.setdefault((last[1], last[2]), []).append(
                        (f.true_ns(node, s_ts + s_dur), node))
    spreads = [max(v)[0] - min(v)[0] for v in tight.values() if len(v) > 1]
    assert len(spreads) >= 50       # the loss all-reduce of (nearly) every step
    assert statistics.median(spreads) < 30_000 and max(spreads) < 200_000
    # behind the optimizer: the CPU-starved node's syncs end late in the fault windows
    last = [max(v)[1] for v in loose.values() if len(v) > 1
            and max(v)[0] - min(v)[0] > 1_000_000]
    assert len(last) > 10 and max(set(last), key=last.count) == "node-02"


def test_every_table_populated_and_valid(make_fleet):
    f = make_fleet(fault="network", straggler=0)
    # every metric but the capture's BPF run time, which a real capture writes only where
    # kernel.bpf_stats_enabled is on (off by default; the simulated nodes keep the default),
    # and the job cgroup's, written only where the traced processes live in a cgroup of
    # their own (the simulated job runs in the root cgroup of a machine of its own)
    metrics = {m for m, _, _ in HOST_METRICS if ".job." not in m} - {"capture.bpf_cpu_pct"}
    for node, b in f.bundles.items():
        for t in TABLES:
            n = b.con.execute(f"SELECT count(*) FROM {t.name}").fetchone()[0]
            # calls_in_flight (optional, 1.1) is empty in a run whose job ended before
            # the capture stopped: no call was open at a seal or at the stop
            assert n > 0 or not t.required, f"{node}: {t.name} is empty"
            for c in t.columns:
                if c.values:
                    bad = b.con.execute(f"SELECT DISTINCT {c.name} FROM {t.name} WHERE "
                                        f"{c.name} IS NOT NULL AND {c.name} NOT IN "
                                        f"({','.join('?' * len(c.values))})", c.values).fetchall()
                    assert not bad, f"{t.name}.{c.name}: {bad}"
                want = {"INTEGER": "integer", "REAL": "real", "TEXT": "text"}[c.type]
                types = {r[0] for r in b.con.execute(
                    f"SELECT DISTINCT typeof({c.name}) FROM {t.name}")}
                assert types <= {want, "null"} | ({"integer"} if want == "real" else set()), \
                    f"{t.name}.{c.name}: {types}"
                if not c.nullable:
                    assert "null" not in types
        assert b.con.execute("SELECT count(*) FROM capture_log WHERE event = "
                             "'rejected_rows'").fetchone()[0] == 0
        got = {m for (m,) in b.con.execute("SELECT DISTINCT metric FROM host_samples")}
        assert got == metrics
        # 10 Hz host samples, 1 Hz clock samples
        for metric, hz in (("cpu.busy_pct", 10),):
            ts = [t for (t,) in b.con.execute("SELECT timestamp_ns FROM host_samples WHERE "
                                              "metric = ? ORDER BY 1", (metric,))]
            gaps = [b_ - a for a, b_ in zip(ts, ts[1:])]
            assert abs(statistics.median(gaps) - 1e9 / hz) < 2e6
        ts = [t for (t,) in b.con.execute("SELECT mono_before_ns FROM clock_samples WHERE "
                                          "source = 'system' ORDER BY 1")]
        assert abs(statistics.median([b_ - a for a, b_ in zip(ts, ts[1:])]) - 1e9) < 2e6
        # stacks are JSON frame objects of the two documented shapes
        for (frames,) in b.con.execute("SELECT frames FROM stacks"):
            for fr in json.loads(frames):
                assert set(fr) in ({"module", "symbol", "offset"},
                                   {"file", "line", "function", "kind"})
        assert b.con.execute("SELECT count(*) FROM nccl_events WHERE stack_id NOT IN "
                             "(SELECT stack_id FROM stacks)").fetchone()[0] == 0
        sources = {s for (s,) in b.con.execute("SELECT source FROM capture_log WHERE "
                                               "event = 'source_on'")}
        assert {"clock", "host", "nccl", "cuda", "tcp", "sched", "block"} <= sources
        assert b.con.execute("SELECT count(*) FROM event_stats WHERE source = 'cuda' AND "
                             "name = 'cudaLaunchKernel'").fetchone()[0] > 0
        for count, hist in b.con.execute("SELECT count, hist_log2 FROM event_stats"):
            assert sum(json.loads(hist)) == count


def test_thread_ids_are_unique_and_owned(make_fleet):
    f = make_fleet(fault="cpu", straggler=1)
    comp = f.truth["fault"]["detail"]["competitor_pid"]
    for node in f.bundles:
        tids = f.q(node, "SELECT tid FROM threads")
        assert len(tids) == len(set(tids))
        pids = {p for (p,) in f.q(node, "SELECT pid FROM processes")}
        assert {p for (p,) in f.q(node, "SELECT DISTINCT pid FROM threads")} == pids
        assert comp not in {t for (t,) in tids}
        # every traced thread that shows up in events is a known thread of its process
        known = set(f.q(node, "SELECT pid, tid FROM threads"))
        for table in ("nccl_events", "cuda_events", "sched_events"):
            assert set(f.q(node, f"SELECT DISTINCT pid, tid FROM {table}")) <= known, table
        assert set(f.q(node, "SELECT DISTINCT pid, tid FROM block_events WHERE pid IN "
                             "(SELECT pid FROM processes)")) <= known


@pytest.mark.parametrize("fault", ["none", "cpu", "io", "network", "gpu", "memory"])
def test_rows_lie_inside_the_capture(make_fleet, fault):
    f = make_fleet(fault=fault, straggler=2) if fault != "none" else make_fleet(fault=fault)
    for node, b in f.bundles.items():
        cap = b.manifest["capture"]
        for t in ("nccl_events", "nccl_comm_events", "cuda_events", "sched_events",
                  "block_events", "tcp_events", "host_samples", "capture_log"):
            lo, hi = b.con.execute(f"SELECT min(timestamp_ns), max(timestamp_ns + "
                                   f"{'duration_ns' if t.endswith('events') and t != 'tcp_events' else '0'}) "
                                   f"FROM {t}").fetchone()
            if lo is not None:
                assert cap["start_mono_ns"] <= lo and hi <= cap["end_mono_ns"], (node, t)
        lo, hi = b.con.execute("SELECT min(interval_start_ns), max(interval_end_ns) "
                               "FROM event_stats").fetchone()
        assert cap["start_mono_ns"] <= lo and hi <= cap["end_mono_ns"]
        lo, hi = b.con.execute("SELECT min(first_seen_ns), max(last_seen_ns) FROM threads"
                               ).fetchone()
        assert cap["start_mono_ns"] <= lo and hi <= cap["end_mono_ns"]
        # realtime in the manifest is the node's own (skewed) clock at those instants
        true0 = f.true_ns(node, cap["start_mono_ns"])
        clock = f.node_truth(node)["clock"]
        assert abs(cap["start_utc_ns"] - true0 - clock["offset_ns"]) < 5e6 + abs(
            clock["drift_ppm"]) * 1e-6 * 60e9
