"""The table builder of a fresh merge (merge/copying.py, TableBuilder): which tables it
takes, and that the result does not depend on which thread is faster (the images, run
files and scratch databases are shared between threads and removed as soon as none
reads them)."""

import time

import apsw
import pytest

from .fleetgen import make_fleet
from ingero_forensics.merge import core, merge_bundles
from ingero_forensics.merge.copying import PASS3_TABLES, builder_share as _builder_share
from ingero_forensics.simulate import FleetConfig, simulate_fleet

BIG = ("nccl_events", "cuda_events", "sched_events", "host_samples", "tcp_events",
       "block_events")


def _rows(**kw):
    rows = {t: 0 for t in PASS3_TABLES}
    rows.update(processes=100, threads=1000)
    rows.update(kw)
    return rows


def test_share_starts_with_nccl_and_ends_small():
    share = _builder_share(_rows(nccl_events=6_400_000, cuda_events=9_600_000,
                                 sched_events=6_400_000, host_samples=6_400_000,
                                 tcp_events=1_600_000, block_events=1_600_000))
    assert share[0] == "nccl_events"
    assert 1 < len(share) < len(BIG)                 # both threads get a share
    assert "processes" not in share and "threads" not in share      # under 1%
    rest = share[1:]
    sizes = [(1 + len(core.FLEET_TABLES_BY_NAME[t].indexes)) * _rows(
        nccl_events=6_400_000, cuda_events=9_600_000, sched_events=6_400_000,
        host_samples=6_400_000, tcp_events=1_600_000, block_events=1_600_000)[t]
        for t in rest]
    assert sizes == sorted(sizes, reverse=True)      # the last transfer is the smallest


def test_share_is_event_tables_only():
    # processes and nccl_comm_events feed the node facts, written while the builder may
    # still run: they stay with the main thread even when they are most of the rows.
    share = _builder_share(_rows(nccl_events=1000, cuda_events=2000, processes=50_000,
                                 nccl_comm_events=50_000, threads=50_000))
    assert set(share) <= set(BIG) and share[0] == "nccl_events"


def test_share_follows_the_mix():
    nccl_heavy = _builder_share(_rows(nccl_events=20_000_000, cuda_events=1_000_000,
                                      host_samples=1_000_000))
    host_heavy = _builder_share(_rows(nccl_events=1_000_000, cuda_events=3_000_000,
                                      sched_events=1_000_000, host_samples=20_000_000))
    # nccl_events is most of the work: one more table at most, so that its transfer
    # overlaps something; host_samples is: the main thread keeps it, the builder the rest.
    assert nccl_heavy[0] == "nccl_events" and len(nccl_heavy) <= 2
    assert "host_samples" not in host_heavy and len(host_heavy) > len(nccl_heavy)


def _summary(db):
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        out = {t: con.execute(f"SELECT COUNT(*), SUM(timestamp_ns % 1000003), "
                              f"MIN(timestamp_ns), MAX(timestamp_ns) FROM {t}").fetchone()
               for t in BIG}
        out["collectives"] = con.execute("SELECT COUNT(*), SUM(completion_ns % 1000003) "
                                         "FROM collectives").fetchone()
        out["nodes"] = con.execute("SELECT name, ranks, bundles FROM nodes "
                                   "ORDER BY name").fetchall()
        out["indexes"] = con.execute("SELECT name FROM sqlite_schema WHERE type = 'index' "
                                     "ORDER BY name").fetchall()
        return out
    finally:
        con.close()


@pytest.fixture(scope="module")
def small_fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    fleet = make_fleet(d / "b", nodes=3, ranks_per_node=2, seconds=3, seed=31)
    want = d / "want.db"
    merge_bundles(fleet.paths, want)
    return fleet, _summary(want)


@pytest.mark.parametrize("slow", ["main", "builder", "collectives"])
def test_result_does_not_depend_on_which_thread_is_slower(small_fleet, tmp_path,
                                                          monkeypatch, slow):
    fleet, want = small_fleet
    monkeypatch.setattr(core, "builder_share",
                        lambda rows, move_cost=None: ["nccl_events", "host_samples", "tcp_events"])
    if slow == "main":
        real = core._copy_tables

        def copy_tables(*a, **k):
            time.sleep(0.1)
            return real(*a, **k)
        monkeypatch.setattr(core, "_copy_tables", copy_tables)
    elif slow == "builder":
        real_copy = core.TableBuilder._copy

        def copy(self, table):
            time.sleep(0.2)
            return real_copy(self, table)
        monkeypatch.setattr(core.TableBuilder, "_copy", copy)
    else:
        real_run = core.CollectiveJob.run

        def run(self):
            time.sleep(0.5)
            return real_run(self)
        monkeypatch.setattr(core.CollectiveJob, "run", run)
    db = tmp_path / "f.db"
    res = merge_bundles(fleet.paths, db)
    assert not res.skipped
    assert _summary(db) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.db"]      # no scratch left


def test_node_ranks_from_the_collectives_wait_for_the_builder(tmp_path, monkeypatch):
    """Processes without a rank environment and no communicator events: a node's ranks
    come from its collectives, which the builder holds. With the builder slow, the main
    thread writes the collectives and alignment while waiting; the node facts must still
    see every nccl_events row (they read none before)."""
    fleet = make_fleet(tmp_path / "b", nodes=3, ranks_per_node=2, seconds=3, seed=32,
                       rank_env=False)
    real_copy = core.TableBuilder._copy

    def copy(self, table):
        out = real_copy(self, table)
        if table == "nccl_events":
            time.sleep(0.5)         # the main thread reaches its idle work first
        return out
    monkeypatch.setattr(core.TableBuilder, "_copy", copy)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        assert con.execute("SELECT COUNT(*) FROM processes WHERE rank IS NOT NULL"
                           ).fetchone() == (0,)
        ranks = dict(con.execute("SELECT name, ranks FROM nodes"))
    finally:
        con.close()
    assert ranks == {f"node-{i}": f"[{2 * i}, {2 * i + 1}]" for i in range(3)}


def _summaries(db):
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return {t: con.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3, 4").fetchall()
                for t in ("host_bins", "sync_waits", "job_block_io")} | {
            "nodes": con.execute("SELECT name, ranks FROM nodes ORDER BY 1").fetchall(),
            "bins": con.execute("SELECT value FROM fleet_info WHERE key = 'host_bins'"
                                ).fetchall()}
    finally:
        con.close()


@pytest.mark.parametrize("accel", [True, False], ids=["c", "sql"])
@pytest.mark.parametrize("source", ["fleetgen", "simulator"])
def test_summaries_written_by_the_builder_equal_the_main_threads(tmp_path, monkeypatch,
                                                                  source, accel):
    """host_bins and sync_waits written beside their tables by the builder, and the
    node ranks read from its nccl_events, are what the main thread writes at the end.
    fleetgen: ranks from the collectives only; the simulator: host samples and event
    synchronizations. On the SQL path the collectives are aggregated late, the builder
    may leave host_bins to the main thread (it never waits for them): the same rows."""
    if source == "fleetgen":
        paths = make_fleet(tmp_path / "b", nodes=3, ranks_per_node=2, seconds=3, seed=33,
                           rank_env=False).paths
    else:
        simulate_fleet(tmp_path / "b", FleetConfig(nodes=3, ranks_per_node=2, steps=60,
                                                   fault="gpu", seed=6), overwrite=True)
        paths = sorted((tmp_path / "b").glob("*.bundle"))
    from ingero_forensics.merge import copying
    written, real = [], copying.write_summary

    def spy(con, summary, window):
        written.append(summary)
        return real(con, summary, window)
    monkeypatch.setattr(copying, "write_summary", spy)
    if accel:
        # a tiny fleet's builder may reach host_samples before the collectives thread
        # has aggregated (then the main thread writes host_bins): here it waits, so the
        # builder's way is the one compared
        real_derive = copying.TableBuilder._derive

        def derive(self, con, table):
            assert self.job.aggregated.wait(60)
            return real_derive(self, con, table)
        monkeypatch.setattr(copying.TableBuilder, "_derive", derive)
    got = {}
    for share in (["nccl_events"], ["nccl_events", "host_samples", "cuda_events"]):
        monkeypatch.setattr(core, "builder_share", lambda rows, move_cost=None: share)
        db = tmp_path / f"{len(share)}.db"
        assert not merge_bundles(paths, db, accel=accel).skipped
        got[len(share)] = _summaries(db)
    if accel:
        assert sorted(written) == ["host_bins", "sync_waits"]      # by the builder, once
    else:
        assert "sync_waits" in written
    builder, main = got[3], got[1]
    assert builder == main and main["bins"]
    if source == "fleetgen":
        assert main["nodes"] == [(f"node-{i}", f"[{2 * i}, {2 * i + 1}]") for i in range(3)]
    else:
        assert len(main["host_bins"]) > 10 and len(main["sync_waits"]) > 10
