"""Issue 20: one hostile bundle (validly sealed, hostile values inside) never takes the
fleet down. Each is skipped with one line naming the bundle, table, row and reason, or
(a time far outside the capture window, a stack too deep to be one) merged without the
rows that cannot be, counted; every other bundle merges as without it."""

import apsw
import pytest
from click.testing import CliRunner

from .fleetgen import make_fleet
from .hostile import HOSTILE, reseal
from ingero_forensics.merge import merge_bundles
from ingero_forensics.merge.cli import main as merge_cli

#: hostile bundle -> what the skip reason says (None: the bundle merges, rows counted)
SKIPPED = {
    "realtime_min": None,
    "deep_frames": None,
    "comm_not_utf8": "table nccl_events row id '1': comm_id_hash is not UTF-8 text",
    "meta_not_utf8": "table meta row key 'created_by': value is not UTF-8 text",
    "job_not_utf8": "table processes row id '1': job_id is not UTF-8 text",
    "segment_index_huge": "manifest field segment.index missing, negative or not a 64-bit integer",
}


@pytest.fixture(scope="module")
def fleet3(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    return make_fleet(d / "b", nodes=3, seconds=3, seed=21), d


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_one_hostile_bundle_does_not_take_the_fleet_down(fleet3, tmp_path, name):
    fleet, _ = fleet3
    bad = reseal(fleet.paths[1], tmp_path / "bad", HOSTILE[name][0], name)
    out = tmp_path / "fleet.db"
    r = CliRunner().invoke(merge_cli, ["-q", "-o", str(out), str(fleet.paths[0]), str(bad),
                                       str(fleet.paths[2])], catch_exceptions=False)
    lines = r.stderr.splitlines() if hasattr(r, "stderr") else r.output.splitlines()
    con = apsw.Connection(str(out), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        nodes = con.execute("SELECT COUNT(*) FROM nodes").fetchone()[0]
        first = con.execute("SELECT MIN(realtime_ns) FROM clock_samples").fetchone()[0]
    finally:
        con.close()
    assert first > 1_700_000_000 * 10 ** 9      # no clock sample from another century
    if SKIPPED[name] is None:
        assert r.exit_code == 0, r.output
        assert nodes == 3
    else:
        assert r.exit_code == 3, r.output
        assert nodes == 2
        errors = [ln for ln in lines if ln.startswith("Error:")]
        assert errors == [f"Error: {bad}: {SKIPPED[name]} (skipped)"], r.output


def test_far_realtime_samples_are_dropped_and_counted(fleet3, tmp_path):
    fleet, _ = fleet3
    bad = reseal(fleet.paths[1], tmp_path / "bad", HOSTILE["realtime_min"][0], "rt")
    res = merge_bundles([fleet.paths[0], bad, fleet.paths[2]], tmp_path / "fleet.db")
    assert not res.skipped
    assert any(w.startswith(f"{bad}: ") and "invalid rows of clock_samples skipped" in w
               for w in res.warnings), res.warnings


class _LateEvent:
    """An event set by the other thread just after wait() gave up (the race of issue
    20: the thread sets it and ends between the timeout and future.done())."""

    def __init__(self):
        self.flag = False

    def wait(self, timeout):
        was, self.flag = self.flag, True
        return was

    def is_set(self):
        return self.flag


def test_wait_staged_rechecks_ready_after_the_thread_ended():
    from concurrent.futures import Future
    from types import SimpleNamespace
    from ingero_forensics.merge.core import _wait_staged
    done = Future()
    done.set_result(None)
    job = SimpleNamespace(completions_ready=_LateEvent(), bundles_read=_LateEvent())
    _wait_staged(job, done)         # no "ended before its results"
