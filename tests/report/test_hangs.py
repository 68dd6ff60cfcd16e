"""A rank that stops: its peers enter collectives it never enters. The report names the
rank, its last collective and seq, and what it was doing (its last CUDA call, in flight
when the capture stopped, and that call's stack), in the verdict and in a section."""

import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.render import render_html
from ingero_forensics.report.text import render_text

from ..merge import fleetgen
from .test_report_sql import check_page_sql

STOP_RANK, STOP_SEQ, PEERS_TO = 5, 40, 44
#: a second rank that stops later (its peers have already lost rank 5), and one that
#: misses a collective (lost events) but goes on: not a hang
LATER_RANK, LATER_SEQ, LOST_RANK, LOST_SEQ = 2, 42, 7, 20


class StoppingWriter(fleetgen.BundleWriter):
    """Bundles of a fleet in which rank STOP_RANK stops after seq STOP_SEQ while its peers
    go on to PEERS_TO and wait there: each process's last CUDA call is a stream
    synchronization that never returned. Rows are dropped before they are written, so
    the bundles are as a capture of that hang would write them."""

    def add_many(self, table, rows):
        rows = list(rows)
        if table == "nccl_events":
            rows = [r for r in rows if r[6] <= PEERS_TO
                    and not (r[3] == STOP_RANK and r[6] > STOP_SEQ)
                    and not (r[3] == LATER_RANK and r[6] > LATER_SEQ)
                    and not (r[3] == LOST_RANK and r[6] == LOST_SEQ)]
            self._last = {}
            for r in rows:                    # pid -> (mono of its last entry, tid)
                self._last[r[15]] = max(self._last.get(r[15], (0, 0)), (r[0] + r[1], r[16]))
        elif table == "cuda_events":
            stack = {r[10]: r[12] for r in rows}
            rows = [r for r in rows if r[0] <= self._last.get(r[10], (0,))[0]]
            for pid, (mono, tid) in self._last.items():
                rows.append((mono + 50_000, None, "cudaStreamSynchronize", "runtime", 7, None,
                             None, None, 0, None, pid, tid, stack.get(pid), 0, None))
        return super().add_many(table, rows)


@pytest.fixture(scope="module")
def hung_fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("hang")
    mp = pytest.MonkeyPatch()
    mp.setattr(fleetgen, "BundleWriter", StoppingWriter)
    try:
        fleet = fleetgen.make_fleet(d / "b", nodes=4, ranks_per_node=2, seconds=10, seed=3,
                                    retransmits=False)
    finally:
        mp.undo()
    merge_bundles(fleet.paths, d / "fleet.db")
    return d / "fleet.db"


def test_the_rank_that_stopped_is_named(hung_fleet):
    a = analyze_fleet(hung_fleet)
    assert [h["rank"] for h in a.hangs] == [STOP_RANK, LATER_RANK], a.hangs
    h, later = a.hangs
    assert (later["last_seq"], later["missed_seq"], later["peers_entered"]) == (
        LATER_SEQ, LATER_SEQ + 1, 6)
    assert h["node"] == "node-2" and h["pid"] == 1000 + STOP_RANK
    assert (h["last_seq"], h["missed_seq"], h["peers_last_seq"]) == (STOP_SEQ, STOP_SEQ + 1,
                                                                    PEERS_TO)
    assert h["peers_entered"] == 7 and h["nranks"] == 8
    assert 4.0 < h["quiet_s"] < 7.0      # the capture ran 10 s, the peers stopped near 4.5 s
    assert h["last_calls"][0]["api"] == "cudaStreamSynchronize"
    assert h["last_calls"][0]["in_flight"] and h["in_flight"] == 1
    assert h["stack"] and "cudaStreamSynchronize" in h["stack"][0]
    assert a.verdict.startswith(f"The job hung: rank {STOP_RANK} (node-2, pid 1005) never "
                                f"entered ALL_REDUCE seq {STOP_SEQ + 1}")
    assert "still in flight when the capture stopped" in a.verdict
    assert "1 more rank(s) stopped elsewhere" in a.verdict
    assert "Until then, no straggler" in a.verdict and "No straggler" not in a.verdict
    page = render_html(a)
    assert "Hang: ranks that stopped" in page and 'class="verdict hang"' in page
    check_page_sql(hung_fleet, page, min_blocks=5)
    assert "The job hung" in render_text(a)


def test_no_hang_in_a_run_that_ends(fleets):
    db, _ = fleets("cpu")
    assert analyze_fleet(db).hangs == []


class _NoRankWriter(fleetgen.BundleWriter):
    def add_many(self, table, rows):
        if table == "nccl_events":
            rows = [tuple(r[:3]) + (None, None) + tuple(r[5:]) for r in rows]
        return super().add_many(table, rows)


class InferredStoppingWriter(StoppingWriter, _NoRankWriter):
    """The same hang (StoppingWriter picks the rows) on a communicator whose rows carry
    no rank and no size (_NoRankWriter writes them so), as the merge leaves a
    communicator it inferred from captures attached after its init (one that is not the
    world communicator): two of its processes on each node."""


def test_a_hang_on_a_communicator_of_unknown_size_is_named(tmp_path):
    """Without a recorded size, the most processes any of the communicator's collectives
    was seen on stands for it (processes, not nodes: two ranks share each node here), so
    the process that stops is still one fewer, and the verdict says the size is not
    known."""
    mp = pytest.MonkeyPatch()
    mp.setattr(fleetgen, "BundleWriter", InferredStoppingWriter)
    try:
        fleet = fleetgen.make_fleet(tmp_path / "b", nodes=4, ranks_per_node=2, seconds=10,
                                    seed=3, retransmits=False)
    finally:
        mp.undo()
    merge_bundles(fleet.paths, tmp_path / "fleet.db")
    a = analyze_fleet(tmp_path / "fleet.db")
    assert [h["pid"] for h in a.hangs] == [1000 + STOP_RANK, 1000 + LATER_RANK], a.hangs
    h = a.hangs[0]
    assert h["node"] == "node-2" and h["size_inferred"] and h["nranks"] == 8
    assert (h["last_seq"], h["missed_seq"], h["peers_entered"]) == (STOP_SEQ, STOP_SEQ + 1, 7)
    assert "7 of its 8 ranks seen (its size is not known" in a.verdict, a.verdict
    # the merge's SQL path counts processes the same way as its C path
    merge_bundles(fleet.paths, tmp_path / "sql.db", accel=False)
    assert analyze_fleet(tmp_path / "sql.db").hangs == a.hangs
