"""Captures attached after ncclCommInitRank (issue 17): the merge infers the communicator
from the streams' shapes and times (merge/lateattach.py), and says how.

The fleets are real bundles (fleetgen) whose late nodes write what the capture writes
then: no comm_id_hash, seq or rank, a comm_handle and a handle_seq counted from the
attach. The truth (which collective each row is) comes from the rows' true times.
"""

from __future__ import annotations

import apsw
import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.merge.lateattach import Stream, match

from .fleetgen import T_JOB, make_fleet

STEP_MS = 100
COMM = "00c0ffee00c0ffee"


def rows(db, sql, args=()):
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def true_seq(fleet, node_name, mono):
    """Which collective a row is: from its true time (entries come 0-3 ms after the
    step's start, the straggler's 60 ms)."""
    tr = next(t for t in fleet.nodes if t.name == node_name)
    return int((tr.true_of_mono(mono) - T_JOB - 200_000_000) // (STEP_MS * 1_000_000)) + 1


def seq_offsets(db, fleet):
    """comm_id_hash -> the set of (seq - true seq) over its rows: one value when every
    rank numbers every collective alike."""
    out: dict = {}
    for h, seq, name, mono in rows(db, "SELECT e.comm_id_hash, e.seq, n.name, e.mono_ns "
                                       "FROM nccl_events e JOIN nodes n USING (node_id)"):
        out.setdefault(h, set()).add(seq - true_seq(fleet, name, mono))
    return out


def test_all_late_streams_become_one_communicator(tmp_path):
    """Every node attached 2-5 s into the job: the eight streams are one communicator,
    numbered alike on every rank, the world communicator (ranks from the environment),
    and the report's lateness sees the straggler as with an early attach."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=2, seconds=12, seed=3,
                       step_ms=STEP_MS, shapes=5, straggler_rank=5, straggler_every=3,
                       late_attach={0: 2.0, 1: 3.5, 2: 5.0, 3: 2.7}, retransmits=False)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    inferred = rows(db, "SELECT comm_id_hash, streams, rank, env_rank, basis, detail "
                        "FROM inferred_comms ORDER BY env_rank")
    assert len(inferred) == 8
    assert len({r[0] for r in inferred}) == 1 and {r[1] for r in inferred} == {8}, inferred
    assert [r[2] for r in inferred] == list(range(8))
    assert {r[4] for r in inferred} <= {"reference", "shape+causality"}, inferred
    offsets = seq_offsets(db, fleet)
    assert len(offsets) == 1 and len(next(iter(offsets.values()))) == 1, offsets
    # seq 1 is the earliest call any of them saw (node 0 attached first, at 2 s)
    assert rows(db, "SELECT MIN(seq) FROM nccl_events")[0][0] == 1
    # the rows' ranks are the global ranks (pid 1000 + rank in fleetgen)
    assert rows(db, "SELECT COUNT(*) FROM nccl_events WHERE rank IS NOT pid - 1000")[0][0] == 0
    assert rows(db, "SELECT COUNT(*) FROM nccl_events WHERE nranks IS NOT 8")[0][0] == 0
    # the merge's own collectives see them: the straggler's rank arrives last
    last = rows(db, "SELECT last_rank, COUNT(*) FROM collectives GROUP BY last_rank "
                    "ORDER BY 2 DESC LIMIT 1")
    assert last[0][0] == 5, last
    log = rows(db, "SELECT level, message FROM merge_log WHERE event = 'late_attach'")
    assert log and log[0][0] == "info" and "8 matched into 1" in log[0][1], log


def test_late_ranks_join_a_communicator_seen_at_init(tmp_path):
    """Two nodes were captured from the start, two attached later: the late ranks take
    the communicator's real identity and seq."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=2, seconds=10, seed=4,
                       step_ms=STEP_MS, shapes=4, late_attach={2: 3.0, 3: 4.2},
                       retransmits=False)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    assert rows(db, "SELECT DISTINCT comm_id_hash FROM nccl_events") == [(COMM,)]
    assert seq_offsets(db, fleet) == {COMM: {0}}
    late = rows(db, "SELECT n.name, i.rank, i.nranks, i.basis FROM inferred_comms i JOIN "
                    "nodes n USING (node_id) ORDER BY i.env_rank")
    assert [r[:3] for r in late] == [("node-2", 4, 8), ("node-2", 5, 8),
                                     ("node-3", 6, 8), ("node-3", 7, 8)], late


def test_incremental_merge_matches_later_nodes(tmp_path):
    """Bundles merged as they arrive, two nodes at a time: the later streams join the
    communicator the first merge inferred, with the same numbering."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=10, seed=6,
                       step_ms=STEP_MS, shapes=3,
                       late_attach={0: 1.0, 1: 2.5, 2: 4.0, 3: 3.0}, retransmits=False)
    db = tmp_path / "f.db"
    merge_bundles([p for p in fleet.paths if "node-0" in p.name or "node-1" in p.name], db)
    first = rows(db, "SELECT DISTINCT comm_id_hash FROM inferred_comms")
    merge_bundles(fleet.paths, db)
    assert rows(db, "SELECT DISTINCT comm_id_hash FROM inferred_comms") == first
    offsets = seq_offsets(db, fleet)
    assert len(offsets) == 1 and len(next(iter(offsets.values()))) == 1, offsets
    # the world communicator is complete now: the first merge's rows got their ranks too
    assert rows(db, "SELECT COUNT(*) FROM nccl_events WHERE rank IS NOT pid - 1000")[0][0] == 0


def test_clocks_too_loose_to_tell_leave_streams_alone(tmp_path):
    """One shape repeated every step and clocks whose stated error exceeds a step: the
    offset cannot be told, so nothing is matched, and inferred_comms says why."""
    fleet = make_fleet(tmp_path / "b", nodes=3, ranks_per_node=1, seconds=8, seed=7,
                       step_ms=STEP_MS, shapes=1, max_offset_ms=80, ntp_step=False,
                       late_attach={0: 1.0, 1: 2.0, 2: 1.5}, retransmits=False)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    left = rows(db, "SELECT streams, basis, detail FROM inferred_comms")
    assert len(left) == 3 and all(r[0] == 1 and r[1] == "alone" for r in left), left
    assert any("cannot tell them apart" in r[2] for r in left), left
    log = rows(db, "SELECT level, message FROM merge_log WHERE event = 'late_attach'")
    assert log[0][0] == "warning" and "3 left alone" in log[0][1], log


def _stream(node, seqs, times, shapes, observed=None):
    times = list(times)
    return Stream(node, 1, 1, seqs=list(seqs), times=times, shapes=list(shapes),
                  observed=list(observed) if observed is not None else [None] * len(times))


def test_match_a_rank_over_half_a_step_late_by_causality():
    """One all-reduce per 100 ms step; the candidate enters each 60 ms late, so the
    previous step's call of the same shape is nearer in time (-40 ms) than its own
    (+60 ms). Causality decides: every rank entered before any observed the completion
    (the syncs return 5-6 ms after the late entry), which only the true offset allows."""
    ms = 1_000_000
    shapes = [("ALL_REDUCE", 100, "float32", "sum", None)] * 300
    ref = _stream(1, range(1, 301), [k * 100 * ms for k in range(300)], shapes,
                  [k * 100 * ms + 65 * ms for k in range(300)])
    cand = _stream(2, range(1, 101), [(k + 100) * 100 * ms + 60 * ms for k in range(100)],
                   shapes[:100], [(k + 100) * 100 * ms + 66 * ms for k in range(100)])
    one_boot = {"samples": {}, "boot": {1: "a", 2: "a"}}
    m, why = match(ref, cand, one_boot)
    assert m is not None and m.offset == 100 and m.basis == "shape+causality", (m, why)
    # without the syncs the nearer call in time (-40 ms) would be the wrong one: not
    # matched, and the reason says why
    blind = _stream(2, cand.seqs, cand.times, cand.shapes)
    bare = _stream(1, ref.seqs, ref.times, ref.shapes)
    m, why = match(bare, blind, one_boot)
    assert m is None and "cannot tell them apart" in why, (m, why)
    # a rank 10 ms late needs no sync: the wrong call is 90 ms away
    near = _stream(2, cand.seqs, [t - 50 * ms for t in cand.times], cand.shapes)
    m, why = match(bare, near, one_boot)
    assert m is not None and m.offset == 100 and m.basis == "shape+time", (m, why)
    assert "nearest in time by far" in m.detail


def test_match_unsynchronized_clocks_is_a_marked_choice():
    """Shapes repeat, clocks claim nothing: the nearest offset is taken and said to be
    a choice; a shape sequence that occurs once needs no clock at all."""
    shapes = [("ALL_REDUCE", 100 + k % 4, "float32", "sum", None) for k in range(400)]
    ref = _stream(1, range(1, 401), [k * 10_000_000 for k in range(400)], shapes)
    cand = _stream(2, range(1, 201), [(k + 150) * 10_000_000 + 700_000 for k in range(200)],
                   shapes[150:350])
    clocks = {"samples": {}, "boot": {1: "a", 2: "b"}}      # two boots, no claims
    ref.clock_err = cand.clock_err = None
    m, why = match(ref, cand, clocks)
    assert m is not None and m.offset == 150 and m.basis.startswith("nearest"), (m, why)
    assert "choice" in m.detail
    unique = [("ALL_REDUCE", k, "float32", "sum", None) for k in range(400)]
    ref = _stream(1, range(1, 401), [k * 10_000_000 for k in range(400)], unique)
    cand = _stream(2, range(1, 101), [(k + 40) * 10_000_000 + 5_000_000_000
                                      for k in range(100)], unique[40:140])
    ref.clock_err = cand.clock_err = None
    m, why = match(ref, cand, clocks)
    assert m is not None and m.offset == 40 and m.basis == "shape", (m, why)


@pytest.mark.parametrize("wrong", ["count", "op"])
def test_match_refuses_a_different_communicator(wrong):
    """A stream whose calls differ in shape from the reference's is not matched, however
    close in time."""
    shapes = [("ALL_REDUCE", 100 + k % 4, "float32", "sum", None) for k in range(300)]
    ref = _stream(1, range(1, 301), [k * 10_000_000 for k in range(300)], shapes)
    other = [(("ALL_GATHER",) + s[1:]) if wrong == "op" else (s[0], s[1] * 2) + s[2:]
             for s in shapes[100:200]]
    cand = _stream(2, range(1, 101), [(k + 100) * 10_000_000 for k in range(100)], other)
    m, why = match(ref, cand, {"samples": {}, "boot": {1: "a", 2: "a"}})
    assert m is None and "no offset gives the same sequence" in why


def _buckets(late_ns, steps, first_step):
    """A DDP-like step: 20 gradient buckets of one size 2 ms apart, then the step-end
    sync returning after every completion (loss.item())."""
    ms = 1_000_000
    seqs, times, obs = [], [], []
    for step in range(first_step, first_step + steps):
        for b in range(20):
            seqs.append(len(seqs) + 1)
            times.append(step * 100 * ms + 20 * ms + b * 2 * ms + late_ns)
            obs.append(step * 100 * ms + 95 * ms)
    return seqs, times, obs


@pytest.mark.parametrize("late_ms", [6, 11, 17, 24])
def test_match_many_alike_calls_per_step(late_ms):
    """Twenty same-size buckets per step: hundreds of offsets have the same shapes and
    the nearest in time is a neighbouring bucket; causality still finds the rank's own
    calls (the first look ranks offsets by causality before time)."""
    shape_ = ("ALL_REDUCE", 25 << 20, "float32", "sum", None)
    ref = _stream(1, *_buckets(0, 100, 0)[:2], [shape_] * 2000, _buckets(0, 100, 0)[2])
    seqs, times, obs = _buckets(late_ms * 1_000_000, 50, 30)
    cand = _stream(2, seqs, times, [shape_] * len(seqs), obs)
    m, why = match(ref, cand, {"samples": {}, "boot": {1: "a", 2: "a"}})
    assert m is not None and m.offset == 600 and m.basis == "shape+causality", (m, why)


def test_match_refuses_an_offset_no_causality_allows():
    """One boot, so the shift between the clocks is 0; the candidate entered every call
    25-35 ms after the reference had observed its completion: no offset is possible, and
    the reason says so (rather than the only offset with these shapes)."""
    ms = 1_000_000
    shapes = [("ALL_REDUCE", 100 + k, "float32", "sum", None) for k in range(100)]
    ref = _stream(1, range(1, 101), [k * 100 * ms for k in range(100)], shapes,
                  [k * 100 * ms + 5 * ms for k in range(100)])
    cand = _stream(2, range(1, 51), [(k + 20) * 100 * ms + 35 * ms for k in range(50)],
                   shapes[20:70], [(k + 20) * 100 * ms + 40 * ms for k in range(50)])
    m, why = match(ref, cand, {"samples": {}, "boot": {1: "a", 2: "a"}})
    assert m is None and "no offset is causal on these clocks" in why, (m, why)


def test_a_second_capture_run_is_another_stream(tmp_path, monkeypatch):
    """The capture on one node is restarted mid-job: that process's counter starts at 1
    again. Each run is its own stream, and both are numbered like the other ranks."""
    from . import fleetgen
    original = fleetgen._late_row
    first: dict = {}

    def restarted(row, seen):
        pid = row[15]
        first.setdefault(pid, row[0])
        if pid == 1001 and row[0] - first[pid] > 3_000_000_000 and "done" not in first:
            first["done"] = True
            seen[pid] = 0
        return original(row, seen)
    monkeypatch.setattr(fleetgen, "_late_row", restarted)
    fleet = make_fleet(tmp_path / "b", nodes=3, ranks_per_node=1, seconds=10, seed=6,
                       step_ms=STEP_MS, shapes=3, segments=2,
                       late_attach={0: 1.0, 1: 2.0, 2: 1.5}, retransmits=False)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    runs = rows(db, "SELECT pid, basis FROM inferred_comms WHERE pid = 1001")
    assert len(runs) == 2 and "alone" not in {b for _, b in runs}, runs
    offsets = seq_offsets(db, fleet)
    assert len(offsets) == 1 and len(next(iter(offsets.values()))) == 1, offsets


def test_hostile_counter_values_are_skipped_with_one_line(tmp_path, monkeypatch):
    """A handle_seq at the bottom of int64 (a hostile or damaged bundle): the rows are
    skipped and counted like any invalid row, the merge goes on, no traceback."""
    import subprocess
    from . import fleetgen
    original = fleetgen._late_row

    def hostile(row, seen):
        out = original(row, seen)
        return out[:-1] + (-2 ** 63 + out[-1],) if row[15] == 1000 else out
    monkeypatch.setattr(fleetgen, "_late_row", hostile)
    fleet = make_fleet(tmp_path / "b", nodes=3, ranks_per_node=1, seconds=5, seed=6,
                       step_ms=STEP_MS, shapes=3, late_attach={0: 1.0, 1: 2.0, 2: 1.5},
                       retransmits=False)
    db = tmp_path / "f.db"
    p = subprocess.run(["ingero-merge", *map(str, fleet.paths), "-o", str(db)],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "invalid rows of nccl_events skipped" in p.stderr
    assert rows(db, "SELECT COUNT(*) FROM nccl_events WHERE pid = 1000")[0][0] == 0
    assert rows(db, "SELECT COUNT(DISTINCT pid) FROM inferred_comms")[0][0] == 2


def test_calls_in_flight_of_a_late_communicator_get_its_identity(tmp_path):
    """A collective still open at the stop on a communicator the capture saw only from
    the attach: the merge numbers it like the stream's other calls (the next seq), so a
    hang on it can be named."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=10, seed=8,
                       step_ms=STEP_MS, shapes=4, late_attach={0: 1.0, 1: 2.0, 2: 1.5, 3: 3},
                       retransmits=False, late_in_flight=True)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    open_calls = rows(db, "SELECT f.pid, f.comm_id_hash, f.seq, (SELECT MAX(e.seq) FROM "
                          "nccl_events e WHERE e.pid = f.pid), (SELECT DISTINCT e.comm_id_hash "
                          "FROM nccl_events e WHERE e.pid = f.pid) FROM calls_in_flight f "
                          "ORDER BY f.pid")
    assert len(open_calls) == 4, open_calls
    for pid, h, seq, last, h_rows in open_calls:
        assert h == h_rows and seq == last + 1, open_calls


def test_pass_one_flags_the_bundles_a_late_capture_wrote(tmp_path, monkeypatch):
    """The helper threads mark which images hold late rows; the main thread reads only
    those for the inference (the others are not scanned again), and the inference is
    the same as when it reads every image."""
    from ingero_forensics import accel
    from ingero_forensics.merge import lateattach
    from ingero_forensics.merge.opening import open_one
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=4, seed=8,
                       step_ms=STEP_MS, late_attach={2: 1.0}, retransmits=False)
    fc = accel.load("merge._fastcoll", "sqlite3_fastcoll_init")
    flags = {}
    for p in fleet.paths:
        sha, bundle = open_one(p, {}, None, "none", 1_000_000, fc)
        flags[bundle.node] = bundle.late_rows
        bundle.close()
    assert flags == {"node-0": False, "node-1": False, "node-2": True, "node-3": False}
    read = []
    real = lateattach._read_streams

    def read_streams(con, pending, known):
        read.extend(i["bundle"].node for i in pending if getattr(i["bundle"], "late_rows", 1))
        return real(con, pending, known)
    monkeypatch.setattr(lateattach, "_read_streams", read_streams)
    merge_bundles(fleet.paths, tmp_path / "flagged.db")
    assert read == ["node-2"]       # the only image _read_streams scans
    monkeypatch.setattr(lateattach, "has_late_rows", lambda con, bundle, schema="b": True)
    monkeypatch.setattr("ingero_forensics.merge.opening.has_late_rows",
                        lambda con, bundle, schema="b": True)
    merge_bundles(fleet.paths, tmp_path / "all.db")
    inferred = []
    for db in ("flagged.db", "all.db"):
        con = apsw.Connection(str(tmp_path / db), flags=apsw.SQLITE_OPEN_READONLY)
        inferred.append(con.execute("SELECT * FROM inferred_comms ORDER BY 1, 2, 3").fetchall())
        con.close()
    assert inferred[0] == inferred[1] and inferred[0]
