"""Sync-point extraction (merge/syncpoints.py) against a plain Python reading of the rule,
on real bundle images, and what the merge keeps of them."""

import random

import apsw

from ingero_forensics.bundle import BundleWriter, open_bundle
from ingero_forensics.merge import merge_bundles
from ingero_forensics.merge.collectives import STAGING_DDL
from ingero_forensics.merge.syncpoints import (SYNC_APIS, extract_fleet_sync_points,
                                               extract_sync_points)

from .fleetgen import make_fleet

MIN_WAIT = 20_000


def reference(rows, min_wait=MIN_WAIT):
    """The rule, written as plainly as possible: per thread, events in (time, collective
    before sync, row id) order; a waiting sync preceded by a collective observes it."""
    out = []
    by_thread = {}
    for r in rows:
        by_thread.setdefault((r["pid"], r["tid"]), []).append(r)
    for (pid, tid), evs in by_thread.items():
        evs.sort(key=lambda r: (r["t"], r["is_sync"], r["id"]))
        for prev, cur in zip(evs, evs[1:]):
            if cur["is_sync"] and not prev["is_sync"] and cur["d"] >= min_wait:
                out.append((prev["comm"], prev["seq"], pid, tid, cur["t"] + cur["d"], cur["d"]))
    return sorted(out)


def rows_of(con):
    rows = []
    for i, t, d, comm, seq, pid, tid in con.execute(
            "SELECT id, timestamp_ns, duration_ns, comm_id_hash, seq, pid, tid "
            "FROM nccl_events"):
        rows.append(dict(id=i, t=t, d=d, comm=comm, seq=seq, pid=pid, tid=tid, is_sync=0))
    for i, t, d, api, pid, tid in con.execute(
            "SELECT id, timestamp_ns, duration_ns, api, pid, tid FROM cuda_events"):
        if api in SYNC_APIS:
            rows.append(dict(id=i, t=t, d=d, comm=None, seq=None, pid=pid, tid=tid,
                             is_sync=1))
    return rows


def extracted(path):
    con = apsw.Connection(str(path))
    try:
        return sorted(con.execute("SELECT comm_id_hash, seq, pid, tid, mono_ns, wait_ns "
                                  "FROM sp").fetchall())
    finally:
        con.close()


def nccl(t, seq, pid, tid, comm="aa00aa00aa00aa00"):
    return (t, 5_000, "ALL_REDUCE", 0, 2, comm, seq, 1024, "float32", "sum", None, 7,
            4096, 0, 0, pid, tid, None)


def cuda(t, d, pid, tid, api="cudaStreamSynchronize", queued=0, gap=None):
    return (t, d, api, "runtime", 7, None, None, None, 0, 0, pid, tid, None, queued, gap)


def test_tricky_orders_match_the_rule(tmp_path):
    rng = random.Random(5)
    w = BundleWriter(tmp_path / "x.spool", node="n0",
                     host={"hostname": "h0", "boot_id": "b0", "kernel_release": "6.1"},
                     capture_start=(1_700_000_000_000_000_000, 1_000))
    w.add_many("nccl_events", [
        nccl(100_000, 1, 10, 10),            # two collectives, then one sync: seq 2 only
        nccl(200_000, 2, 10, 10),
        nccl(500_000, 3, 10, 10),            # then a short sync (no pair) ...
        nccl(900_000, 4, 10, 11),            # other thread, sync at the same instant
        nccl(2_000_000, 5, 10, 10),          # ... then a sync after a sync: no pair
    ])
    w.add_many("cuda_events", [
        cuda(300_000, 50_000, 10, 10),       # pairs with seq 2
        cuda(600_000, 1_000, 10, 10),        # too short: no pair, and it resets
        cuda(700_000, 40_000, 10, 10),       # after a sync: no pair
        cuda(900_000, 30_000, 10, 11),       # same instant as seq 4: the collective first
        cuda(2_100_000, 25_000, 10, 10),     # pairs with seq 5
        cuda(2_200_000, 25_000, 10, 10),     # after a sync: no pair
        cuda(2_300_000, 25_000, 10, 10, api="cudaMemcpy"),   # not a sync at all
    ])
    # a noisy thread with random interleavings
    t = 3_000_000
    for seq in range(100, 400):
        t += rng.randint(1, 50_000)
        if rng.random() < 0.7:
            w.add("nccl_events", nccl(t, seq, 20, 21, comm="bb00bb00bb00bb00"))
        if rng.random() < 0.6:
            w.add("cuda_events", cuda(t + rng.choice([0, 5, 3_000]), rng.randint(0, 60_000),
                                      20, 21))
    path = w.seal(tmp_path, capture_end=(1_700_000_000_100_000_000, 100_000_000))
    b = open_bundle(path, tmpdir=tmp_path)
    try:
        expect = reference(rows_of(b.con))
        n = extract_sync_points(b.db_path, tmp_path / "s.db", MIN_WAIT)
    finally:
        b.close()
    got = extracted(tmp_path / "s.db")
    assert got == expect
    pairs = {(c, s) for c, s, *_ in got}
    assert ("aa00aa00aa00aa00", 2) in pairs and ("aa00aa00aa00aa00", 1) not in pairs
    assert ("aa00aa00aa00aa00", 4) in pairs and ("aa00aa00aa00aa00", 5) in pairs
    assert ("aa00aa00aa00aa00", 3) not in pairs
    assert n == len(pairs)
    assert len(got) > 50         # the random thread contributes


def test_fleet_extraction_equals_bundle_extraction(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=4, seed=12)
    expect = []
    for p in fleet.paths:
        b = open_bundle(p, tmpdir=tmp_path)
        try:
            extract_sync_points(b.db_path, tmp_path / f"{p.name}.sp", MIN_WAIT)
            expect += [(b.manifest["node"],) + r for r in extracted(tmp_path / f"{p.name}.sp")]
        finally:
            b.close()
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    con = apsw.Connection(str(db))
    con.execute("ATTACH ? AS st", (str(tmp_path / "st.db"),))
    for stmt in STAGING_DDL:
        con.execute(stmt.replace("EXISTS ", "EXISTS st.", 1))
    extract_fleet_sync_points(con, MIN_WAIT, 10**9)
    got = sorted(con.execute(
        "SELECT n.name, s.comm_id_hash, s.seq, s.pid, s.tid, s.mono_ns, s.wait_ns "
        "FROM st.sp s JOIN nodes n USING (node_id)").fetchall())
    con.close()
    assert len(expect) > 100
    assert got == sorted(expect)


def test_merge_counts_every_observation_and_keeps_the_sample(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=4, seconds=6, seed=21)
    total = 0
    for p in fleet.paths:
        b = open_bundle(p, tmpdir=tmp_path)
        try:
            extract_sync_points(b.db_path, tmp_path / f"{p.name}.sp", MIN_WAIT)
            total += len(extracted(tmp_path / f"{p.name}.sp"))
        finally:
            b.close()
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    con = apsw.Connection(str(db))
    try:
        obs = con.execute("SELECT SUM(completion_observations) FROM collectives").fetchone()[0]
        assert obs == total
        step = con.execute("SELECT json_extract(value, '$.sample_step') FROM fleet_info "
                           "WHERE key = 'alignment'").fetchone()[0]
        assert step >= 1
        kept = con.execute("SELECT COUNT(*) FROM sync_points").fetchone()[0]
        assert 0 < kept <= total
        assert con.execute("SELECT COUNT(*) FROM sync_points WHERE seq % ? <> 0",
                           (step,)).fetchone()[0] == 0
        # the kept rows are exactly the observations of the sampled collectives
        sampled = con.execute("SELECT SUM(completion_observations) FROM collectives "
                              "WHERE seq % ? = 0", (step,)).fetchone()[0]
        assert sampled == kept
        used = con.execute("SELECT SUM(used) FROM sync_points").fetchone()[0]
        assert used > 0.9 * kept
    finally:
        con.close()
