"""The merge's C path (merge/_fastcoll.c) against its SQL path: the same sync points from
one bundle, and the same fleet.db from the same inputs (fresh, incremental, partitioned
runs, and the fall-back for a collective too large for the C path)."""

import apsw
import pytest

from ingero_forensics.bundle import BundleWriter, open_bundle
from ingero_forensics.merge import collectives, core, merge_bundles, syncpoints
from ingero_forensics.merge.screen import row_predicate as _valid_predicate

from .fleetgen import make_fleet
from .test_syncpoints import MIN_WAIT, cuda, extracted, nccl


@pytest.fixture(scope="module")
def fc(built_accel):
    return built_accel("merge._fastcoll", "sqlite3_fastcoll_init")


def tricky_bundle(tmp_path):
    w = BundleWriter(tmp_path / "x.spool", node="n0",
                     host={"hostname": "h0", "boot_id": "b0", "kernel_release": "6.1"},
                     capture_start=(1_700_000_000_000_000_000, 1_000))
    w.add_many("nccl_events", [
        nccl(100_000, 1, 10, 10), nccl(200_000, 2, 10, 10), nccl(500_000, 3, 10, 10),
        nccl(900_000, 4, 10, 11), nccl(2_000_000, 5, 10, 10),
        nccl(3_000_000, 6, 12, 13, comm="aa00aa00aa00aa0"),     # a shorter comm id
    ])
    w.add_many("cuda_events", [
        cuda(300_000, 50_000, 10, 10), cuda(600_000, 1_000, 10, 10),
        cuda(700_000, 40_000, 10, 10), cuda(900_000, 30_000, 10, 11),
        cuda(2_100_000, 25_000, 10, 10), cuda(2_200_000, 25_000, 10, 10),
        cuda(2_300_000, 25_000, 10, 10, api="cudaMemcpy"), cuda(3_000_100, 99_000, 12, 13),
    ])
    t = 4_000_000
    for seq in range(100, 2100):     # many threads, interleaved
        t += 7_000
        pid, tid = 20 + seq % 3, 30 + seq % 5
        w.add("nccl_events", nccl(t, seq, pid, tid, comm="bb00bb00bb00bb00"))
        if seq % 4:
            # queued work of every kind: none, not recorded, a copy right after the
            # collective, too many ops, ops enqueued too long after it (a negative gap
            # from a broken writer), two ops
            queued, gap = [(0, None), (None, None), (1, 5), (9, 3), (2, -70_000),
                           (2, 0)][seq % 6]
            w.add("cuda_events", cuda(t + 10, 20_000 + seq, pid, tid, queued=queued, gap=gap))
    return w.seal(tmp_path, capture_end=(1_700_000_000_100_000_000, 100_000_000))


@pytest.mark.parametrize("run_rows", [syncpoints.RUN_ROWS, 500])
def test_runs_observe_what_the_sql_rule_observes(tmp_path, fc, monkeypatch, run_rows):
    monkeypatch.setattr(syncpoints, "RUN_ROWS", run_rows)
    b = open_bundle(tricky_bundle(tmp_path), tmpdir=tmp_path)
    try:
        n_sql = syncpoints.extract_sync_points(b.db_path, tmp_path / "s.db", MIN_WAIT)
        rows = b.manifest["tables"]["nccl_events"] + b.manifest["tables"]["cuda_events"]
        paths, n_c = syncpoints.image_runs(fc, b.db_path, tmp_path / "r", _valid_predicate(
            "nccl_events"), rows, MIN_WAIT)
        entries = sorted(b.con.execute(
            "SELECT comm_id_hash, seq, timestamp_ns FROM nccl_events e WHERE seq % 7 = 0 AND "
            f"typeof(comm_id_hash) = 'text' AND {_valid_predicate('nccl_events')}"))
    finally:
        b.close()
    expect = sorted((c, s, m) for c, s, _, _, m, _ in extracted(tmp_path / "s.db"))
    got = sorted(r for p in paths for r in fc.sample(str(p), 1))
    assert len(paths) == (1 if run_rows > 10_000 else -(-rows // run_rows))
    assert len(expect) > 1000
    assert got == expect
    assert n_c == n_sql
    # every k-th seq only
    assert sorted(r for p in paths for r in fc.sample(str(p), 7)) == \
        [r for r in expect if r[1] % 7 == 0]
    # sample_into: every collective row of a sampled seq, each bound with the node given:
    # the same observations (tight as the SQL rule says), and the entries of the rows
    # nccl_events gets
    con = apsw.Connection(":memory:")
    con.execute("CREATE TABLE s (node_id, comm_id_hash, seq, mono_ns, entry_ns, tight, op)")
    insert = "INSERT INTO s VALUES (?, ?, ?, ?, ?, ?, ?)"
    n = sum(fc.sample_into(con.sqlite3_pointer(), str(p), 7, insert, 42) for p in paths)
    rows = con.execute("SELECT node_id, comm_id_hash, seq, mono_ns, entry_ns, tight, op "
                       "FROM s").fetchall()
    assert n == len(rows) > 0
    assert {r[0] for r in rows} == {42}
    assert sorted(r[1:4] for r in rows if r[3] is not None) == \
        [r for r in expect if r[1] % 7 == 0]
    sql_tight = sorted((c, s, m, t) for c, s, m, t in apsw.Connection(
        str(tmp_path / "s.db")).execute("SELECT comm_id_hash, seq, mono_ns, tight FROM sp "
                                        "WHERE seq % 7 = 0"))
    assert sorted((r[1], r[2], r[3], r[5]) for r in rows if r[3] is not None) == sql_tight
    assert {t for *_, t in sql_tight} == {0, 1}     # the bundle has both kinds
    assert sorted((r[1], r[2], r[4]) for r in rows if r[4] is not None) == entries
    assert {syncpoints.SORTED_OPS[r[6]] for r in rows if r[4] is not None} == {"ALL_REDUCE"}
    with pytest.raises(RuntimeError, match="no such table"):
        fc.sample_into(con.sqlite3_pointer(), str(paths[0]), 7, "INSERT INTO nope VALUES "
                       "(?, ?, ?, ?, ?, ?, ?)", 1)


def dump(db):
    """The tables the collective machinery writes, and what it changes in nccl_events."""
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        out = {}
        for table, order in (("collectives", "comm_id_hash, seq"),
                             ("sync_points", "comm_id_hash, seq, node_id, bundle_id, pid, "
                                             "tid, mono_ns"),
                             ("clock_alignment", "node_id")):
            cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})") if r[1] != "id"]
            out[table] = con.execute(f"SELECT {', '.join(cols)} FROM {table} "
                                     f"ORDER BY {order}").fetchall()
        out["nccl_events"] = con.execute(
            "SELECT node_id, mono_ns, timestamp_ns, duration_ns, completion_ns "
            "FROM nccl_events ORDER BY node_id, mono_ns, id").fetchall()
        return out
    finally:
        con.close()


def assert_same(a, b):
    for table in a:
        assert len(a[table]) == len(b[table]), table
        assert a[table] == b[table], table


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, fc):
    d = tmp_path_factory.mktemp("fastcoll")
    return make_fleet(d / "b", nodes=4, ranks_per_node=3, seconds=8, straggler_rank=5,
                      segments=2, seed=33)


def test_c_and_sql_paths_give_the_same_fleet(tmp_path, fleet):
    merge_bundles(fleet.paths, tmp_path / "c.db")
    merge_bundles(fleet.paths, tmp_path / "sql.db", accel=False)
    a, b = dump(tmp_path / "c.db"), dump(tmp_path / "sql.db")
    assert len(a["collectives"]) > 50 and len(a["sync_points"]) > 100
    assert any(r[-1] for r in a["sync_points"])          # "used" flags set
    assert_same(a, b)


def test_incremental_c_path_equals_sql_path(tmp_path, fleet):
    for name, acc in (("c.db", True), ("sql.db", False)):
        merge_bundles(fleet.paths[:3], tmp_path / name, accel=acc)
        merge_bundles(fleet.paths, tmp_path / name, accel=acc)
    assert_same(dump(tmp_path / "c.db"), dump(tmp_path / "sql.db"))


def test_partitioned_runs_give_the_same_fleet(tmp_path, fleet, monkeypatch):
    merge_bundles(fleet.paths, tmp_path / "one.db")
    monkeypatch.setattr(syncpoints, "RUN_ROWS", 300)
    merge_bundles(fleet.paths, tmp_path / "parts.db")
    assert_same(dump(tmp_path / "one.db"), dump(tmp_path / "parts.db"))


def test_too_large_a_collective_falls_back_to_sql(tmp_path, fleet, monkeypatch):
    calls = []
    real = core._merge_bundles

    def spy(*args):
        calls.append(args[8] is not None)       # fastcoll
        return real(*args)
    monkeypatch.setattr(core, "_merge_bundles", spy)
    monkeypatch.setattr(collectives, "MAX_GROUP_ROWS", 2)
    res = merge_bundles(fleet.paths, tmp_path / "fb.db")
    assert calls == [True, False]          # the C path gave up, the SQL path finished
    assert any("ran again on its SQL path" in w for w in res.warnings), res.warnings
    monkeypatch.undo()
    merge_bundles(fleet.paths, tmp_path / "sql.db", accel=False)
    assert_same(dump(tmp_path / "fb.db"), dump(tmp_path / "sql.db"))
    assert not [p for p in tmp_path.iterdir() if ".run" in p.name or ".tmp" in p.name]


def odd_fleet(tmp_path):
    """Two nodes on one communicator, with what real captures rarely have: equal entry
    times on both nodes (ties), missing, text and repeated ranks, bytes that differ,
    observed completions spread over +-100 us (some used by the alignment, some not)."""
    import random
    rng = random.Random(9)
    tmp_path.mkdir()
    paths = []
    for node in range(2):
        w = BundleWriter(tmp_path / f"o{node}.spool", node=f"odd-{node}",
                         host={"hostname": f"oh{node}", "boot_id": f"ob{node}",
                               "kernel_release": "6.1"},
                         capture_start=(1_700_000_000_000_000_000, 1_000))
        t = 1_000_000
        for seq in range(1, 400):
            t += 1_000_000
            row = list(nccl(t, seq, 100 + node, 100 + node, comm="cc00cc00cc00cc00"))
            row[3] = node                                    # rank
            if node and seq % 3 == 0:
                row[0] = t + 400_000                         # node 1 last; else a tie
            if node and seq % 7 == 0:
                row[3] = None
            if node and seq % 11 == 0:
                row[3] = "r1"
            if node and seq % 13 == 0:
                row[12] = 999                                # bytes differ
            w.add("nccl_events", tuple(row))
            if node and seq % 5 == 0:                        # the same rank twice
                w.add("nccl_events", tuple(row[:1]) + (6_000,) + tuple(row[2:]))
            if node and seq % 6 == 0:      # another rank, same instant: the lower row id wins
                w.add("nccl_events", tuple(row[:3]) + (5,) + tuple(row[4:]))
            # some syncs after queued kernels: they only bound the completion
            w.add("cuda_events", cuda(row[0] + 10, 300_000 + rng.randint(-100_000, 100_000),
                                      100 + node, 100 + node,
                                      queued=8 if seq % 4 == 0 else 0))
        paths.append(w.seal(tmp_path, capture_end=(1_700_000_000_500_000_000, 500_000_000)))
    return paths


def test_odd_values_give_the_same_fleet(tmp_path, fc):
    paths = odd_fleet(tmp_path / "b")
    merge_bundles(paths, tmp_path / "c.db")
    merge_bundles(paths, tmp_path / "sql.db", accel=False)
    a, b = dump(tmp_path / "c.db"), dump(tmp_path / "sql.db")
    used = [r[-2] for r in a["sync_points"]]
    tight = [r[-1] for r in a["sync_points"]]
    assert 0 < sum(used) < len(used)                   # both kinds of observation
    assert 0 < sum(tight) < len(tight)                 # tight and bounding ones
    coll = apsw.Connection(str(tmp_path / "c.db"))
    kinds = coll.execute(
        "SELECT SUM(ranks_seen < (SELECT COUNT(*) FROM nccl_events e WHERE "
        "e.comm_id_hash = c.comm_id_hash AND e.seq = c.seq)), SUM(op_mismatch), "
        "COUNT(DISTINCT last_node_id), SUM(last_rank IS NULL) FROM collectives c").fetchone()
    coll.close()
    assert kinds[0] > 0 and kinds[1] > 0 and kinds[2] == 2 and kinds[3] > 0
    assert_same(a, b)


def test_hostile_times_give_the_same_fleet_on_both_paths(tmp_path, fc):
    """Issue 20: times, durations and queue gaps at the int64 limits (signed overflow in
    the C before, a different fleet.db from the SQL path): both paths bound them alike
    (syncpoints.TIME_BOUND) and agree; the C arithmetic is checked."""
    from .hostile import reseal
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=3, seed=33)
    sql = ("UPDATE cuda_events SET duration_ns = 9223372036854775807 WHERE id % 5 = 0;"
           "UPDATE cuda_events SET timestamp_ns = 9223372036854775000 WHERE id % 7 = 0;"
           "UPDATE cuda_events SET queue_gap_ns = -9223372036854775808 WHERE id % 3 = 0;"
           "UPDATE nccl_events SET duration_ns = 9223372036854775807 WHERE id % 4 = 0;"
           "UPDATE nccl_events SET timestamp_ns = -9223372036854775808 WHERE id % 9 = 0;")
    bad = reseal(fleet.paths[1], tmp_path / "bad", sql, "limits")
    paths = [fleet.paths[0], bad, fleet.paths[2]]
    c = merge_bundles(paths, tmp_path / "c.db")
    s = merge_bundles(paths, tmp_path / "sql.db", accel=False)
    assert c.accelerated and not s.accelerated
    assert not c.skipped and not s.skipped
    assert_same(dump(tmp_path / "c.db"), dump(tmp_path / "sql.db"))
