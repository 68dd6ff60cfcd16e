"""A rank hung inside a collective, on real processes: the shim libnccl's ncclAllReduce
never returns on rank 1 (INGERO_SHIM_HANG), its peer waits in cudaStreamSynchronize.
ingero-capture (real eBPF) records both calls in calls_in_flight at every seal and at
the stop; the merge keeps one row per call; the report names rank 1 as the rank that
stopped, inside ALL_REDUCE at the seq it hung in."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time

import pytest

from ingero_forensics.bundle.reader import open_bundle
from ingero_forensics.capture.ebpf.hashing import hex_hash, unique_id_hash
from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.text import render_text

from ...bundle.specwriter import rewrite
from ...bundle.test_spec import DOC, extract_ddl
from .jobs import Job, make_ids
from .test_capture_e2e import capture_cmd

pytestmark = [pytest.mark.ebpf, pytest.mark.slow]

NRANKS, ITERS, HANG_AT = 2, 6, 3     # rank 1's 3rd ncclAllReduce (seq 3) never returns


def test_a_rank_hung_inside_a_collective_is_named(ebpf_ok, fixtures, tmp_path):
    ids = make_ids(tmp_path / "ids")
    job = Job(lambda r: [str(fixtures.rank_job), "full", str(r), str(NRANKS),
                         str(tmp_path / "ids"), str(ITERS)], NRANKS,
              env={"INGERO_SHIM_SYNC_US": "1000", "INGERO_SHIM_HANG": f"1:{HANG_AT}"})
    out = tmp_path / "bundles"
    # stopped by SIGTERM, not --duration: under load the probes' compilation can take
    # longer than a short duration, which then ends before the job starts
    cmd = [*capture_cmd(), "--bundle", str(out), "--node", "hang-node",
           "--segment-seconds", "3", "--lib", str(fixtures.libnccl),
           "--lib", str(fixtures.libcudart)]
    for pid in job.pids:
        cmd += ["--pid", str(pid)]
    cap = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in cap.stderr:
            seen.append(line)
            if "sources on:" in line:
                break
        for p in job.procs:           # release the ranks; they never print a result
            p.stdin.write("go\n")
            p.stdin.flush()
        time.sleep(8)                 # at least one seal while rank 1 hangs (every 3 s)
        cap.send_signal(signal.SIGTERM)
        _, err = cap.communicate(timeout=90)
        alive = [p.poll() is None for p in job.procs]
    finally:
        job.kill()
        if cap.poll() is None:
            cap.kill()
            cap.wait()
    assert cap.returncode == 0, "".join(seen) + err
    assert alive == [True, True]      # both ranks were still hung when the capture stopped
    world = hex_hash(unique_id_hash(ids[0]))
    bundles = sorted(glob.glob(os.path.join(out, "*.bundle")))
    assert len(bundles) >= 2          # sealed at least once while hung, and at the stop
    open_at = {}
    for path in bundles:
        with open_bundle(path) as b:
            for why, api, op, comm, seq, rank, pid, tid, stack in b.con.execute(
                    "SELECT why, api, op, comm_id_hash, seq, rank, pid, tid, stack_id "
                    "FROM calls_in_flight"):
                open_at.setdefault(why, set()).add((api, op, comm, seq, rank, pid))
                assert tid > 0
            # every bundle says which sources ran (the first may be evicted or merged alone)
            states = set(b.con.execute("SELECT source, event FROM capture_log WHERE event "
                                       "IN ('source_on', 'source_off')"))
            assert {("nccl", "source_on"), ("cuda", "source_on")} <= states, path
    hung, waiting = job.pids[1], job.pids[0]
    stuck = ("ncclAllReduce", "ALL_REDUCE", world, HANG_AT, 1, hung)
    sync = ("cudaStreamSynchronize", None, None, None, None, waiting)
    assert stuck in open_at["stop"] and sync in open_at["stop"], open_at
    assert stuck in open_at["seal"], open_at      # seen open at the seals too

    db = tmp_path / "fleet.db"
    merge_bundles(bundles, db)
    import apsw
    con = apsw.Connection(str(db))
    rows = list(con.execute("SELECT api, seq, why, pid FROM calls_in_flight "
                            "WHERE source = 'nccl'"))
    assert rows == [("ncclAllReduce", HANG_AT, "stop", hung)]   # one row per open call
    con.close()

    a = analyze_fleet(db)
    assert a.hangs and a.hangs[0]["pid"] == hung and a.hangs[0]["rank"] == 1, a.hangs
    h = a.hangs[0]
    assert (h["missed_op"], h["missed_seq"]) == ("ALL_REDUCE", HANG_AT)
    assert h["inside"]["missed"] and h["inside"]["api"] == "ncclAllReduce"
    assert a.verdict.startswith(f"The job hung: rank 1 (hang-node, pid {hung}) has been "
                                f"inside ALL_REDUCE seq {HANG_AT} of communicator {world} "
                                "since "), a.verdict
    assert "train_step" in " ".join(h["stack"])   # the stack of the call it hung in
    assert "inside it" in render_text(a)

    # conformance: the same events written again from the spec alone (shuffled rows, new
    # ids) merge and report exactly like the capture's own bundles
    spec_dir = tmp_path / "spec"
    spec_dir.mkdir()
    ddl = extract_ddl(DOC.read_text(encoding="utf-8"))
    again = [rewrite(p, str(spec_dir), ddl, seed=i) for i, p in enumerate(bundles)]
    merge_bundles(again, tmp_path / "spec.db", strict=True, integrity="full")
    b = analyze_fleet(tmp_path / "spec.db")
    assert b.verdict == a.verdict and b.hangs[0]["inside"] == h["inside"]
