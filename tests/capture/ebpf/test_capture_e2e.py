"""End to end through the real CLI: ingero-capture traces the shim job with the eBPF
sources and seals a bundle; the rows are read back with the bundle reader."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ingero_forensics.bundle.reader import open_bundle
from ingero_forensics.capture.ebpf.hashing import hex_hash, unique_id_hash
from ...fixtures.build import rank_job_with_many_symbols
from .jobs import Job, make_ids

pytestmark = [pytest.mark.ebpf, pytest.mark.slow]

NRANKS, ITERS = 2, 4


def capture_cmd() -> list[str]:
    exe = shutil.which("ingero-capture")
    return [exe] if exe else [sys.executable, "-m", "ingero_forensics.capture"]


def sources_on(cap) -> list[str]:
    """The capture's stderr lines up to the one that says its sources are on."""
    seen = []
    for line in cap.stderr:
        seen.append(line)
        if "sources on:" in line:
            break
    return seen


def stop_all(job, cap) -> None:
    """Kill what a failed test left running."""
    job.kill()
    if cap is not None and cap.poll() is None:
        cap.kill()
        cap.wait()


def test_capture_cli_writes_ebpf_rows(ebpf_ok, fixtures, tmp_path):
    ids = make_ids(tmp_path / "ids")
    job = Job(lambda r: [str(fixtures.rank_job), "full", str(r), str(NRANKS),
                         str(tmp_path / "ids"), str(ITERS)], NRANKS,
              env={"INGERO_SHIM_SYNC_US": "1000"})
    out = tmp_path / "bundles"
    cmd = [*capture_cmd(), "--bundle", str(out), "--node", "e2e-node", "--duration", "8",
           "--lib", str(fixtures.libnccl), "--lib", str(fixtures.libcudart)]
    for pid in job.pids:
        cmd += ["--pid", str(pid)]
    cap = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        seen = sources_on(cap)
        assert any("nccl" in line for line in seen if "sources on:" in line), "".join(seen)
        job.go()
        # Stacks are symbolized while the process lives: give the capture's 50 ms poll
        # loop time to read them before the ranks exit (not a timing assertion).
        time.sleep(1.5)
        job.finish()
        _, err = cap.communicate(timeout=60)
    finally:
        stop_all(job, cap)
    assert cap.returncode == 0, "".join(seen) + err
    bundles = glob.glob(os.path.join(out, "*.bundle"))
    assert len(bundles) == 1
    with open_bundle(bundles[0]) as b:
        q = lambda sql: list(b.con.execute(sql))  # noqa: E731
        world = hex_hash(unique_id_hash(ids[0]))
        rows = q("SELECT pid, rank, nranks, seq FROM nccl_events WHERE op = 'ALL_REDUCE' "
                 f"AND comm_id_hash = '{world}' ORDER BY pid, seq")
        assert sorted({(pid, rank) for pid, rank, _n, _s in rows}) == \
            sorted(zip(job.pids, range(NRANKS)))
        assert [s for _p, _r, _n, s in rows] == list(range(1, ITERS + 1)) * NRANKS
        syncs = q("SELECT count(*), min(duration_ns) FROM cuda_events "
                  "WHERE api = 'cudaStreamSynchronize'")
        assert syncs[0][0] == NRANKS * ITERS and syncs[0][1] >= 1_000_000
        frames = q("SELECT s.frames FROM nccl_events e JOIN stacks s USING (stack_id) "
                   "WHERE e.op = 'ALL_REDUCE' LIMIT 1")
        assert '"train_step"' in frames[0][0]
        assert q("SELECT count(*) FROM nccl_comm_events WHERE api = 'ncclCommInitRank'") == \
            [(NRANKS,)]
        logs = q("SELECT source, event FROM capture_log WHERE source IN "
                 "('nccl', 'cuda', 'tcp', 'sched', 'block')")
        assert ("nccl", "attached") in logs and ("cuda", "source_off") in logs


def test_sources_off_say_why_even_with_quiet(ebpf_ok, tmp_path):
    """Under `ip netns exec` (a fresh /sys without tracefs) every eBPF source is off: each
    says so on stderr with the real reason and the fix, also with --quiet, which hides
    progress, never a blind spot; the bundle's capture_log has the same lines."""
    ns = f"ingero-tfs-{os.getpid()}-{os.urandom(3).hex()}"   # pids are reused
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        out = tmp_path / "b"
        r = subprocess.run(["ip", "netns", "exec", ns, *capture_cmd(), "--bundle", str(out),
                            "--node", "tfs", "--quiet", "--duration", "1"],
                           capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    assert r.returncode == 0, r.stderr
    off = [line for line in r.stderr.splitlines() if "source off" in line]
    assert {line.split()[2].rstrip(":") for line in off} == {"nccl", "cuda", "tcp", "sched",
                                                             "block"}, r.stderr
    assert all("tracefs is not visible" in line and "nsenter --net" in line for line in off)
    assert "kernel < 4.15" not in r.stderr and "not found in tracefs" not in r.stderr
    (bundle,) = out.glob("*.bundle")
    with open_bundle(bundle) as b:
        logged = b.con.execute("SELECT source FROM capture_log WHERE event = 'source_off' "
                               "AND message LIKE '%nsenter --net%'").fetchall()
    assert len(logged) == 5


def test_a_capture_that_never_found_the_libraries_says_so(ebpf_ok, tmp_path):
    """A traced process that maps no libnccl or libcudart: the nccl and cuda sources wait
    the whole capture. That is a gap (a warning on stderr and in capture_log, which the
    report lists), not "0 rows" at level info."""
    target = subprocess.Popen(["sleep", "60"])
    try:
        r = subprocess.run([*capture_cmd(), "--bundle", str(tmp_path / "b"), "--node", "nolib",
                            "--pid", str(target.pid), "--duration", "2", "--quiet"],
                           capture_output=True, text=True, timeout=180)
    finally:
        target.kill()
        target.wait()
    assert r.returncode == 0, r.stderr
    for source, lib in (("nccl", "libnccl"), ("cuda", "libcudart or libcuda")):
        assert f"{source}: no traced process mapped {lib} during the capture" in r.stderr, \
            r.stderr
    (bundle,) = (tmp_path / "b").glob("*.bundle")
    with open_bundle(bundle) as b:
        warned = {s for (s,) in b.con.execute(
            "SELECT source FROM capture_log WHERE level = 'warning' AND message LIKE "
            "'no traced process mapped %'")}
    assert warned == {"nccl", "cuda"}


def attach_to_busy_job(tmp_path, rank_job, libcudart):
    """Start a capture on a running rank_job making about 25,000 kept CUDA calls per
    second (a copy per loop; a 1 MiB ring holds about 10,000), stop it 2 s after its
    sources are on: (copies recorded, lost_events rows, sources in the order they came
    on, capture_log messages, the copies' callers as named in their stacks)."""
    job = Job(lambda r: [str(rank_job), "nofp", "1000000"], 1)
    out = tmp_path / "bundles"
    cap = None
    try:
        job.procs[0].stdin.write("go\n")
        job.procs[0].stdin.flush()
        time.sleep(0.5)
        cap = subprocess.Popen([*capture_cmd(), "--bundle", str(out), "--node", "busy",
                                "--start-priority", "normal", "--lib", str(libcudart),
                                "--pid", str(job.pids[0])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seen = sources_on(cap)
        time.sleep(2)
        cap.send_signal(signal.SIGTERM)
        _, err = cap.communicate(timeout=120)
        assert job.procs[0].poll() is None, "the job ended before the capture did"
    finally:
        stop_all(job, cap)
    assert cap.returncode == 0, "".join(seen) + err
    assert "cuda" in "".join(seen), "".join(seen)
    (bundle,) = out.glob("*.bundle")
    with open_bundle(bundle) as b:
        copies = b.con.execute("SELECT count(*) FROM cuda_events "
                               "WHERE api = 'cudaMemcpyAsync'").fetchone()[0]
        lost = b.con.execute("SELECT source, message FROM capture_log "
                             "WHERE event = 'lost_events'").fetchall()
        order = [s for (s,) in b.con.execute(
            "SELECT source FROM capture_log WHERE event = 'source_on' ORDER BY id")]
        messages = [m for (m,) in b.con.execute("SELECT message FROM capture_log")]
        callers = {json.loads(f)[1]["symbol"] for (f,) in b.con.execute(
            "SELECT s.frames FROM cuda_events e JOIN stacks s USING (stack_id) "
            "WHERE e.api = 'cudaMemcpyAsync'")}
    return copies, lost, order, messages, callers


#: symbols added to the job's program: reading them takes the capture about 2 s per
#: 400,000 on this VM; read at the first stack, 20,517 and 20,917 events were lost
N_SYMBOLS = 800_000


def test_attached_to_a_busy_job_loses_nothing_while_it_starts(ebpf_ok, fixtures, tmp_path):
    """Nothing reads the ring buffers until every source is on. The uprobe sources used
    to be attached first, and a running job's CUDA calls filled their buffers while the
    tracepoint sources compiled: a real PyTorch job lost 8,000-28,000 events in each
    capture's first seconds. Now they are compiled first and attached last."""
    copies, lost, order, _messages, _callers = attach_to_busy_job(tmp_path, fixtures.rank_job,
                                                        fixtures.libcudart)
    assert copies > 10_000, copies
    assert lost == [], lost
    # the uprobe sources came on last
    assert order.index("cuda") > order.index("sched") and order.index("nccl") > order.index("tcp")


def test_a_running_jobs_large_files_are_read_before_the_sources_go_on(ebpf_ok, fixtures,
                                                                        tmp_path):
    """The first stacks of a job the capture attaches to name functions in its libraries,
    and PyTorch's are large (libtorch_cpu.so: 356,000 function symbols, 1.4 s to read on
    an H200 machine). Read then, in the loop that empties the ring buffers, a running
    job's calls filled them meanwhile: a capture attached to a real PyTorch job lost
    6,053 and 11,179 CUDA events (docs/performance.md). Now the running targets' files
    are read before any source is on. Here the job's own program holds N_SYMBOLS more
    symbols, and frame 1 of every recorded call is in it. (The probed libraries' symbols
    are read anyway, to attach.)"""
    rank_job = rank_job_with_many_symbols(tmp_path / "big", N_SYMBOLS)
    copies, lost, _order, messages, callers = attach_to_busy_job(tmp_path, rank_job,
                                                                 fixtures.libcudart)
    assert copies > 10_000, copies
    assert lost == [], lost
    assert any("read before the sources went on" in m for m in messages), messages
    assert callers == {"copy_nofp"}, callers       # named from the large program


def test_a_process_s_last_calls_keep_their_stacks_after_it_exited(ebpf_ok, fixtures,
                                                                  tmp_path):
    """A rank that crashes, or a job's teardown: its last calls come from call sites new
    to the capture, and their stacks are symbolized after the process is gone, when its
    files can no longer be opened through /proc. The symbols each mapping had are kept
    with it, and the process's mappings GONE_GRACE_S past its exit. (On a GPU machine,
    35-175 calls a run lost their stacks at the job's exit.)"""
    job = Job(lambda r: [str(fixtures.rank_job), "lastcall", "2000"], 1)
    out = tmp_path / "bundles"
    cap = subprocess.Popen([*capture_cmd(), "--bundle", str(out), "--node", "last",
                            "--start-priority", "normal", "--lib", str(fixtures.libcudart),
                            "--pid", str(job.pids[0])],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = sources_on(cap)
        job.procs[0].stdin.write("go\n")
        job.procs[0].stdin.flush()
        assert job.procs[0].wait(timeout=30) == 0
        time.sleep(1.5)
        cap.send_signal(signal.SIGTERM)
        _, err = cap.communicate(timeout=120)
    finally:
        stop_all(job, cap)
    assert cap.returncode == 0, "".join(seen) + err
    (bundle,) = out.glob("*.bundle")
    with open_bundle(bundle) as b:
        (frames,), = b.con.execute(
            "SELECT s.frames FROM cuda_events e JOIN stacks s USING (stack_id) "
            "WHERE e.api = 'cudaStreamSynchronize'").fetchall()
        copies = b.con.execute("SELECT count(*), count(stack_id) FROM cuda_events "
                               "WHERE api = 'cudaMemcpyAsync'").fetchone()
    assert copies == (2000, 2000), copies
    named = [(f["module"], f["symbol"]) for f in json.loads(frames)[:3]]
    assert named[:2] == [("libcudart.so.12", "cudaStreamSynchronize"),
                         ("rank_job", "last_sync")], named
