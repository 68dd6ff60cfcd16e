"""A stall: every rank entered the last collective and none came out, each waiting in a
call that was still open when the capture stopped (calls_in_flight). No rank stopped
before it, so the report names the collective and the waiting ranks; a run whose ranks
were briefly inside a call at the stop is no hang."""

import pytest

from ingero_forensics.bundle import BundleWriter
from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.render import render_html

from .test_report_sql import check_page_sql

HOST = {"hostname": "h", "boot_id": "b0", "kernel_release": "6.1"}
UTC0, MONO0, MS, S = 1_700_000_000_000_000_000, 1_000_000_000, 1_000_000, 1_000_000_000
COMM, LAST = "aaaaaaaaaaaaaaaa", 20


def _fleet(tmp_path, open_for_ns):
    paths = []
    for node in range(2):
        w = BundleWriter(tmp_path / f"n{node}.spool", node=f"n{node}", host=HOST,
                         capture_start=(UTC0, MONO0))
        pid = 100 + node
        w.add("processes", (pid, 1, "python3", None, None, node, 0, 2, 1, node, None,
                            '{"RANK": "%d"}' % node, MONO0, MONO0 + 10 * S, None))
        w.add("clock_samples", ("system", MONO0, MONO0 + 1000, UTC0 + 500, None, None, 1000,
                                1, 0, 0.0, 5_000, 1_000, 0, 37, None, None, None, None, None))
        for seq in range(1, LAST + 1):
            t = MONO0 + seq * 100 * MS + node * 10_000
            w.add("nccl_events", (t, 20_000, "ALL_REDUCE", node, 2, COMM, seq, 1024,
                                  "float32", "sum", None, 7, 4096, 0, 0, pid, pid, None))
            if seq < LAST:
                w.add("cuda_events", (t + 30_000, 5 * MS, "cudaStreamSynchronize", "runtime",
                                      7, None, None, None, None, 0, pid, pid, None, 0, None))
        end = MONO0 + 10 * S
        since = end - open_for_ns
        w.add("calls_in_flight", (since, end, "stop", "cuda", "cudaStreamSynchronize", None,
                                  None, None, None, None, None, None, None, 7, None, None,
                                  pid, pid, None))
        w.log("info", "cuda", "source_on", "cuda source on", None, MONO0)
        paths.append(w.seal(tmp_path, capture_end=(UTC0 + 10 * S, end)))
    merge_bundles(paths, tmp_path / "f.db")
    return analyze_fleet(tmp_path / "f.db")


def test_every_rank_waiting_inside_the_last_collective_is_a_stall(tmp_path):
    # the syncs after seq LAST opened right after it (at about 2 s) and never returned
    a = _fleet(tmp_path, 10 * S - (LAST * 100 * MS + 100_000))
    assert [h["rank"] for h in a.hangs] == [0, 1], a.hangs
    h = a.hangs[0]
    assert h["stall"] and (h["missed_op"], h["missed_seq"]) == ("ALL_REDUCE", LAST)
    assert h["open_api"] == "cudaStreamSynchronize" and h["last_calls"][0]["in_flight"]
    assert a.verdict.startswith(f"The job hung inside ALL_REDUCE seq {LAST} of communicator "
                                f"{COMM}: all 2 ranks entered it from "), a.verdict
    assert "ranks 0, 1 still had a call open when the capture stopped" in a.verdict
    page = render_html(a)
    assert "Hang: ranks that stopped" in page
    check_page_sql(tmp_path / "f.db", page, min_blocks=5)   # the page's SQL runs as shown


@pytest.mark.parametrize("open_for_ns", [3 * MS])
def test_a_call_briefly_open_at_the_stop_is_no_hang(tmp_path, open_for_ns):
    assert _fleet(tmp_path, open_for_ns).hangs == []


def test_a_wait_shorter_than_the_jobs_rhythm_is_no_stall(tmp_path):
    """Open 1.5 s at the stop, beyond HANG_MARGIN_NS, but the collectives came every
    100 ms with one 0.3 s gap: under STALL_FACTOR (10) times that gap, no stall."""
    from ingero_forensics.report import hangs
    assert hangs.STALL_FACTOR * 300 * MS > 3 * S // 2 > hangs.HANG_MARGIN_NS
    # a 300 ms gap: the last collective 200 ms late on both ranks
    orig = BundleWriter.add

    def add(self, table, row):
        if table == "nccl_events" and row[6] == LAST:
            row = (row[0] + 200 * MS,) + row[1:]
        return orig(self, table, row)
    mp = pytest.MonkeyPatch()
    mp.setattr(BundleWriter, "add", add)
    try:
        assert _fleet(tmp_path, 3 * S // 2).hangs == []
    finally:
        mp.undo()
