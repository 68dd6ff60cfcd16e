import hashlib
import json
import threading

import apsw
import pytest

from .fleetgen import make_fleet
from ingero_forensics.bundle import read_manifest
from ingero_forensics.bundle.writer import BundleWriter, seal_spool
from ingero_forensics.merge import MergeError, merge_bundles
from ingero_forensics.merge.fleet_schema import FLEET_TABLES, render_markdown

SEED_QUERY = """WITH slow_collectives AS (
    SELECT timestamp_ns, duration_ns, rank, nranks, comm_id_hash, pid
    FROM nccl_events WHERE op = 'ALL_REDUCE' AND duration_ns > 50000000)
  SELECT s.rank, s.duration_ns/1e6 AS ms, COUNT(t.timestamp_ns) AS retransmits_in_window
  FROM slow_collectives s LEFT JOIN tcp_events t
    ON t.timestamp_ns BETWEEN s.timestamp_ns AND s.timestamp_ns + s.duration_ns
   AND t.event = 'tcp_retransmit_skb'
  GROUP BY s.rank, s.duration_ns, s.timestamp_ns ORDER BY ms DESC LIMIT 20;"""


def q(path, sql, *args):
    con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def manifest_total(paths, table):
    return sum(read_manifest(p)["tables"][table] for p in paths)


def test_schema_matches_fleet_tables(fleet4):
    _, _, db = fleet4
    for t in FLEET_TABLES:
        cols = [r[1] for r in q(db, f"PRAGMA table_info({t.name})")]
        assert cols == list(t.column_names), t.name
    assert q(db, "PRAGMA application_id")[0][0] == 0x494E474D


def test_doc_carries_generated_tables():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "fleet-db.md").read_text()
    assert render_markdown() in doc


def test_rows_written_equal_bundle_rows(fleet4):
    fleet, res, db = fleet4
    for table in ("nccl_events", "cuda_events", "tcp_events", "clock_samples", "processes",
                  "host_samples"):
        want = manifest_total(fleet.paths, table)
        assert q(db, f"SELECT COUNT(*) FROM {table}")[0][0] == want, table
        assert res.rows[table] == want
    assert res.bundles_merged == 4 and not res.skipped
    # node-namespaced: every row names a node and a bundle of that node
    bad = q(db, "SELECT COUNT(*) FROM nccl_events e JOIN bundles b USING (bundle_id) "
                "WHERE b.node_id <> e.node_id")[0][0]
    assert bad == 0
    per_node = dict(q(db, "SELECT node_id, COUNT(*) FROM nccl_events GROUP BY node_id"))
    summary = {n["node_id"]: n["rows"]["nccl_events"] for n in res.nodes}
    assert per_node == summary


def test_nodes_table(fleet4):
    _, _, db = fleet4
    rows = q(db, "SELECT name, hostname, ranks, job_ids, bundles FROM nodes ORDER BY name")
    assert [r[0] for r in rows] == ["node-0", "node-1", "node-2", "node-3"]
    assert json.loads(rows[1][2]) == [2, 3]
    assert json.loads(rows[0][3]) == ["job-42"]


def test_seed_query_finds_slow_allreduce(fleet4):
    _, _, db = fleet4
    rows = q(db, SEED_QUERY)
    assert rows, "the 60 ms straggler must make AllReduce slow for the other ranks"
    ranks = {r[0] for r in rows}
    assert 3 not in ranks  # the straggler itself arrives late and waits little
    assert all(r[1] > 50 for r in rows)
    # duration_ns is entry -> observed completion, call_duration_ns the host call
    d, call, comp, ts = q(db, "SELECT duration_ns, call_duration_ns, completion_ns, "
                              "timestamp_ns FROM nccl_events WHERE duration_ns > 50000000 "
                              "LIMIT 1")[0]
    assert call < 100_000 and comp - ts == d


def test_collectives_and_straggler(fleet4):
    fleet, _, db = fleet4
    n = len(fleet.completions)
    assert q(db, "SELECT COUNT(*) FROM collectives")[0][0] == n
    late = q(db, "SELECT last_rank, entry_spread_ns FROM collectives WHERE seq % 10 = 0")
    assert late and all(r == 3 and s > 55_000_000 for r, s in late)
    ranks_seen = q(db, "SELECT MIN(ranks_seen), MAX(ranks_seen) FROM collectives")[0]
    assert ranks_seen == (8, 8)


def test_stack_dedup(fleet4):
    _, res, db = fleet4
    # 4 nodes x 2 stacks that differ only in addresses and install directories
    assert q(db, "SELECT COUNT(*) FROM stacks")[0][0] == 2
    assert res.stacks["bundle_stacks"] == 8 and res.stacks["dedup_ratio"] == 4.0
    frames = json.loads(q(db, "SELECT frames FROM stacks WHERE frames LIKE '%nccl%'")[0][0])
    assert frames[0] == {"module": "libnccl.so.2", "offset": 16, "symbol": "ncclAllReduce"}
    assert q(db, "SELECT COUNT(*) FROM nccl_events WHERE stack_id IS NULL")[0][0] == 0


def test_hash_collision_never_merges_stacks(tmp_path, monkeypatch):
    import ingero_forensics.merge.core as core
    monkeypatch.setattr(core, "stack_hash", lambda canon: "0" * 64)
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=2)
    merge_bundles(fleet.paths, tmp_path / "f.db")
    rows = q(tmp_path / "f.db", "SELECT hash, frames FROM stacks ORDER BY stack_id")
    assert len(rows) == 2 and rows[0][1] != rows[1][1]
    assert rows[1][0] == "0" * 64 + "-2"


def test_idempotent_and_incremental(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=6, seed=4)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths[:2], db)
    assert q(db, "SELECT COUNT(*) FROM nodes")[0][0] == 2
    res = merge_bundles(fleet.paths, db)
    assert res.bundles_merged == 1 and res.bundles_already == 2
    again = merge_bundles(fleet.paths, db)
    assert again.bundles_merged == 0 and again.bundles_already == 3 and again.events == 0
    full = tmp_path / "full.db"
    merge_bundles(fleet.paths, full)
    for table in ("nccl_events", "cuda_events", "clock_samples", "sync_points"):
        assert q(db, f"SELECT COUNT(*) FROM {table}") == q(full, f"SELECT COUNT(*) FROM {table}")
    # realigned: the same times as a one-shot merge (to the nanosecond, same inputs)
    a = q(db, "SELECT node_id, mono_ns, timestamp_ns FROM nccl_events ORDER BY node_id, mono_ns")
    b = q(full, "SELECT node_id, mono_ns, timestamp_ns FROM nccl_events ORDER BY node_id, mono_ns")
    assert max(abs(x[2] - y[2]) for x, y in zip(a, b)) <= 2
    logs = q(db, "SELECT COUNT(*) FROM merge_log WHERE event = 'already_merged'")[0][0]
    assert logs == 5


@pytest.mark.parametrize("after", [1, 2, 3, 5])
def test_a_truncated_copy_of_a_merged_bundle_is_not_taken_as_it(tmp_path, after):
    """A damaged copy whose manifest (read first) names a bundle merged before, in this
    run or an earlier one, is verified like any new input: --strict aborts wherever it
    sits among the inputs (the helper threads open ahead of the main thread), and an
    incremental merge skips it with the reason instead of calling it "already present"."""
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=3, seed=41)
    good = fleet.paths[0]
    trunc = tmp_path / "trunc.bundle"
    trunc.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    spacers = [p for p in fleet.paths if p != good] * 3
    inputs = [good] + spacers[: after - 1] + [trunc]
    with pytest.raises(MergeError, match=f"{trunc}: .*--strict: nothing was written"):
        merge_bundles(inputs, tmp_path / "s.db", strict=True)
    assert not (tmp_path / "s.db").exists()
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    res = merge_bundles([*fleet.paths, trunc], db)
    assert res.bundles_already == 3 and [s["input"] for s in res.skipped] == [str(trunc)]


def test_a_bundle_skipped_after_its_stacks_leaves_no_stale_stack(tmp_path, monkeypatch):
    """A bundle skipped in pass 1 after its stacks went in (rolled back with it) must not
    leave them in the merge's stack index: a later bundle would map its events onto a
    stack id that another stack then takes."""
    import ingero_forensics.merge.core as core
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=3, seed=5)
    bad = fleet.paths[0]
    real = core.copy_bundle_table

    def failing(con, table, bundle, *args):
        if table == "clock_samples" and str(bundle.path) == str(bad):
            raise apsw.ConstraintError("a constraint this bundle breaks")
        return real(con, table, bundle, *args)
    monkeypatch.setattr(core, "copy_bundle_table", failing)
    db = tmp_path / "f.db"
    res = merge_bundles(fleet.paths, db)
    assert [s["input"] for s in res.skipped] == [str(bad)]
    monkeypatch.setattr(core, "copy_bundle_table", real)
    want = tmp_path / "want.db"
    merge_bundles(fleet.paths[1:], want)
    sql = ("SELECT n.name, s.frames, COUNT(*) FROM cuda_events e JOIN nodes n USING (node_id) "
           "LEFT JOIN stacks s ON s.stack_id = e.stack_id GROUP BY 1, 2 ORDER BY 1, 2")
    got, expected = q(db, sql), q(want, sql)
    assert got == expected and all(frames for _, frames, _ in got), got


def test_same_name_other_host_is_kept_apart(tmp_path):
    a = make_fleet(tmp_path / "a", nodes=1, seconds=3, seed=5)
    b = make_fleet(tmp_path / "b", nodes=1, seconds=3, seed=6, host_of={0: "other-host"})
    res = merge_bundles(a.paths + b.paths, tmp_path / "f.db")
    names = [r[0] for r in q(tmp_path / "f.db", "SELECT name FROM nodes ORDER BY node_id")]
    assert names == ["node-0", "node-0#2"]
    assert any("already used by another host" in w for w in res.warnings)
    assert q(tmp_path / "f.db", "SELECT COUNT(*) FROM merge_log WHERE event = "
             "'node_name_conflict'")[0][0] == 1


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_bad_inputs_skipped_rest_merged(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=7)
    trunc = tmp_path / "trunc.bundle"
    trunc.write_bytes(fleet.paths[0].read_bytes()[:-100])
    foreign = tmp_path / "foreign.bundle"
    foreign.write_bytes(b"hello world, not a bundle at all")
    res = merge_bundles([trunc, foreign, fleet.paths[1], tmp_path / "missing.bundle"],
                        tmp_path / "f.db")
    assert res.bundles_merged == 1
    reasons = {s["input"]: s["reason"] for s in res.skipped}
    assert reasons[str(foreign)] == "not an ingero bundle (wrong magic bytes)"
    assert "truncated" in reasons[str(trunc)]
    assert reasons[str(tmp_path / "missing.bundle")] == "no such file or directory"
    assert q(tmp_path / "f.db", "SELECT COUNT(*) FROM merge_log WHERE event = "
             "'skipped_input'")[0][0] == 3


def test_strict_leaves_existing_untouched(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=8)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths[:1], db)
    before = _sha(db)
    bad = tmp_path / "bad.bundle"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(MergeError, match="--strict: nothing was written"):
        merge_bundles([fleet.paths[1], bad], db, strict=True)
    assert _sha(db) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".f.db")] == []


def test_nothing_usable_to_add_leaves_existing_untouched(tmp_path):
    """Only unusable bundles into an existing fleet.db: an error (exit 1), not a
    partial success (exit 3) that rewrote the file with nothing added (a review)."""
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=8)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths[:1], db)
    before = _sha(db)
    trunc = tmp_path / "trunc.bundle"
    trunc.write_bytes(fleet.paths[1].read_bytes()[:-100])
    with pytest.raises(MergeError, match=r"no usable bundle among the 1 input \(.*trunc"
                                         r".*\); it is unchanged$"):
        merge_bundles([trunc], db)
    assert _sha(db) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".f.db")] == []
    # with a bundle already merged beside it: nothing new, a partial success (the
    # merged one is there)
    res = merge_bundles([fleet.paths[0], trunc], db)
    assert res.bundles_already == 1 and res.bundles_merged == 0 and len(res.skipped) == 1


@pytest.mark.parametrize("at_call", [2, 4])   # pass 1; pass 3 beside the collectives thread
def test_interrupt_leaves_previous_fleet(tmp_path, at_call):
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=3, seed=9)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths[:1], db)
    before = _sha(db)
    threads = threading.active_count()
    calls = []

    def progress(n=1):
        calls.append(n)
        if len(calls) == at_call:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        merge_bundles(fleet.paths, db, progress=progress)
    assert _sha(db) == before
    # no temp, scratch, decompressed image or sync-point file left; no thread left running
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "f.db"]
    assert threading.active_count() == threads


def test_output_not_a_fleet_is_refused(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=1, seconds=2, seed=10)
    other = tmp_path / "other.db"
    con = apsw.Connection(str(other))
    con.execute("CREATE TABLE t (x)")
    con.close()
    with pytest.raises(MergeError, match="exists and is not a fleet.db"):
        merge_bundles(fleet.paths, other)


def test_invalid_enum_rows_are_skipped_and_counted(tmp_path):
    host = {"hostname": "h", "boot_id": "b" * 8, "kernel_release": "6.1"}
    spool = tmp_path / "n.spool"
    w = BundleWriter(spool, node="n1", host=host, capture_start=(10**18, 10**9))
    good = (2 * 10**9, 1000, "ALL_REDUCE", 0, 1, "ab" * 8, 1, 4, "float32", "sum", None, 0, 16,
            0, 0, 1, 1, None)
    w.add_many("nccl_events", [good, good[:1] + (2000,) + good[2:]])
    w.add("clock_samples", ("system", 10**9, 10**9 + 2000, 10**18 + 1000, None, None, 2000, 1,
                            0, 0.0, 100_000, 50_000, 0, 37, None, None, None, None, None))
    w.abort()
    con = apsw.Connection(str(spool))
    con.execute("UPDATE nccl_events SET op = 'BOGUS' WHERE duration_ns = 2000")
    con.close()
    out = seal_spool(spool, tmp_path)
    res = merge_bundles([out], tmp_path / "f.db")
    assert res.rows["nccl_events"] == 1
    assert q(tmp_path / "f.db", "SELECT skipped_rows FROM bundles")[0][0] == \
        json.dumps({"clock_samples": 0, "meta": 0, **{t: 1 if t == "nccl_events" else 0
                    for t in json.loads(q(tmp_path / "f.db", "SELECT rows FROM bundles")[0][0])
                    if t not in ("clock_samples", "meta", "stacks")}}, sort_keys=True)
    log = q(tmp_path / "f.db", "SELECT count, message FROM merge_log WHERE event = 'skipped_rows'")
    (msg,) = [m for n, m in log if n == 1]
    assert len(log) == 1 and msg.startswith("1 rows of nccl_events not merged (the first, "
                                            "id 2: op 'BOGUS' is not a known value ("), log


def test_aligned_times_and_raw_mono(fleet4):
    fleet, _, db = fleet4
    for nid, off, slope in q(db, "SELECT node_id, offset_ns, slope FROM clock_alignment"):
        rows = q(db, "SELECT timestamp_ns, mono_ns FROM cuda_events WHERE node_id = ? LIMIT 50",
                 nid)
        assert all(ts == off + m + round(m * slope) for ts, m in rows)
    samples = q(db, "SELECT COUNT(*) FROM clock_samples WHERE aligned_ns IS NULL")[0][0]
    assert samples == 0
