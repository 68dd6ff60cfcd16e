"""Rules docs/bundle-format.md states for values a writer may not know (version 1.1):
tcp scope unknown, the name frame key, synchronized NULL, required values written by
the documented fallbacks, calls in flight settled against later returns. Each bundle is
written by the project's writer, merged for real, and read back."""

import json

import apsw

from ingero_forensics.bundle import BundleWriter
from ingero_forensics.merge import merge_bundles
from ingero_forensics.merge.clocks import clock_claim as _claim
from ingero_forensics.merge.stacks import canonical_frame
from ingero_forensics.report.hangs import _frames

HOST = {"hostname": "h", "boot_id": "b0", "kernel_release": "6.1"}
UTC0, MONO0 = 1_700_000_000_000_000_000, 1_000_000_000


def _bundle(tmp_path, name, index, rows, start_s=0, end_s=10):
    w = BundleWriter(tmp_path / f"{name}{index}.spool", node=name, host=HOST,
                     capture_start=(UTC0 + start_s * 10**9, MONO0 + start_s * 10**9),
                     segment_index=index)
    for table, rs in rows.items():
        w.add_many(table, rs)
    return w.seal(tmp_path, capture_end=(UTC0 + end_s * 10**9, MONO0 + end_s * 10**9))


def _q(db, sql):
    con = apsw.Connection(str(db))
    try:
        return list(con.execute(sql))
    finally:
        con.close()


def test_fallback_values_and_unknowns_merge_without_a_skip(tmp_path):
    frames = [{"name": "train_step", "module_offset": "0x1f00"}, {"py_func": "main",
              "py_file": "/x/train.py", "py_line": 7}]
    w_rows = {
        # only the return seen: return time, duration 0 (section 5)
        "nccl_comm_events": [(MONO0 + 5, 0, "ncclCommInitRank", "aaaaaaaaaaaaaaaa", None, None,
                              None, 0, 1, None, 0, 10, 10)],
        # seen once: first = last (section 5)
        "processes": [(10, None, "python3", None, None, None, None, None, None, None, None,
                       "{}", MONO0 + 7, MONO0 + 7, None)],
        "threads": [(10, 10, None, MONO0 + 7, MONO0 + 7)],
        "tcp_events": [(MONO0 + 9, "tcp_retransmit_skb", 4, "10.0.0.1", "10.0.0.2", 1, 2,
                        None, None, None, None, "unknown", None, None)],
        "clock_samples": [("system", MONO0, MONO0 + 1000, UTC0 + 500, None, None, 1000, None,
                           0, 0.0, 5_000, 1_000, 0, 37, None, None, None, None, None)],
    }
    w = BundleWriter(tmp_path / "a.spool", node="n0", host=HOST, capture_start=(UTC0, MONO0))
    sid = w.add_stack(frames)
    w_rows["nccl_events"] = [(MONO0 + 100, 0, "ALL_REDUCE", 0, 1, "aaaaaaaaaaaaaaaa", 1, 4,
                              None, "sum", None, 0, None, 0, 0, 10, 10, sid)]
    for t, rs in w_rows.items():
        w.add_many(t, rs)
    path = w.seal(tmp_path, capture_end=(UTC0 + 10**10, MONO0 + 10**10))
    res = merge_bundles([path], tmp_path / "f.db", strict=True)
    assert res.skipped == [] and not any("skipped" in x for x in res.warnings), res.warnings
    assert {t: res.rows.get(t) for t in ("tcp_events", "processes", "nccl_comm_events")} == \
        {"tcp_events": 1, "processes": 1, "nccl_comm_events": 1}
    (stack,) = _q(tmp_path / "f.db", "SELECT frames FROM stacks")
    kept = json.loads(stack[0])
    assert kept[0] == {"name": "train_step"}          # kept, and it replaces the offset
    assert _frames(stack[0]) == ["train_step (?)", "main (train.py:7)"]
    assert canonical_frame({"name": "f", "module_offset": "0x1"}) == {"name": "f"}


def test_synchronized_null_is_no_claim():
    # adjtimex says nothing (NULL): its maxerror is not a claim, as for 0 (section 4)
    assert _claim("system", None, 5_000, None, None, None) is None
    assert _claim("system", 0, 5_000, None, None, None) is None
    assert _claim("system", 1, 5_000, None, None, None) == 5_000


def test_calls_in_flight_are_settled(tmp_path):
    """A call open at a seal that returns in the next segment leaves no in-flight row;
    one open at two seals and at the stop leaves one row, the last observation."""
    seg0 = {"calls_in_flight": [
        (MONO0 + 2 * 10**9, MONO0 + 3 * 10**9, "seal", "cuda", "cudaStreamSynchronize", None, None,
         None, None, None, None, None, None, 7, None, None, 10, 11, None),
        (MONO0 + 2 * 10**9, MONO0 + 3 * 10**9, "seal", "nccl", "ncclAllReduce", "ALL_REDUCE",
         "aaaaaaaaaaaaaaaa", 9, 1, 2, 8, "float32", None, 7, 32, None, 10, 10, None)]}
    seg1 = {
        "cuda_events": [(MONO0 + 2 * 10**9, 2 * 10**9, "cudaStreamSynchronize", "runtime", 7,
                         None, None, None, None, 0, 10, 11, None, 0, None)],
        "calls_in_flight": [(MONO0 + 2 * 10**9, MONO0 + 6 * 10**9, "seal", "nccl",
                             "ncclAllReduce", "ALL_REDUCE", "aaaaaaaaaaaaaaaa", 9, 1, 2, 8,
                             "float32", None, 7, 32, None, 10, 10, None)]}
    seg2 = {"calls_in_flight": [(MONO0 + 2 * 10**9, MONO0 + 9 * 10**9, "stop", "nccl",
                                 "ncclAllReduce", "ALL_REDUCE", "aaaaaaaaaaaaaaaa", 9, 1, 2,
                                 8, "float32", None, 7, 32, None, 10, 10, None)]}
    paths = [_bundle(tmp_path, "n0", 0, seg0, 0, 3), _bundle(tmp_path, "n0", 1, seg1, 3, 6)]
    merge_bundles(paths, tmp_path / "f.db")
    rows = _q(tmp_path / "f.db", "SELECT source, api, why FROM calls_in_flight")
    # the sync returned in segment 1; the collective is open at both seals: one row
    assert rows == [("nccl", "ncclAllReduce", "seal")]
    # an incremental merge brings the stop: still one row, the latest
    merge_bundles([_bundle(tmp_path, "n0", 2, seg2, 6, 9)], tmp_path / "f.db")
    assert _q(tmp_path / "f.db", "SELECT api, seq, why FROM calls_in_flight") == [
        ("ncclAllReduce", 9, "stop")]
