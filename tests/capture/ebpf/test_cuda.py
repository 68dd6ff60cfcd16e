"""CUDA probes on the real kernel: the shim libcudart.so.12/libcuda.so.1 (synchronize
calls sleep a configured time) and the real libcudart.so.12 from the wheel via ctypes."""

from __future__ import annotations

import shutil
import textwrap
import threading
import time
from collections import Counter

import pytest

from .conftest import Running, StaticTargets, options, run_real_library, wait_for
from ingero_forensics.capture.ebpf.cuda import CudaSource
from .jobs import Job, make_ids
from .test_nccl import real_lib

pytestmark = pytest.mark.ebpf

NRANKS = 2
ITERS = 5
SYNC_US = 3000
STREAM = 0x5157


@pytest.fixture(scope="module")
def cuda_run(ebpf_ok, tmp_path_factory, fixtures):
    idfile = tmp_path_factory.mktemp("cuda") / "ids"
    make_ids(idfile)
    job = Job(lambda r: [str(fixtures.rank_job), "full", str(r), str(NRANKS), str(idfile),
                         str(ITERS)], NRANKS, env={"INGERO_SHIM_SYNC_US": str(SYNC_US)})
    opts = options(lib_paths=[str(fixtures.libcudart), str(fixtures.libcuda)],
                   stats_interval_s=0.2)
    try:
        with Running(CudaSource(opts), StaticTargets(job.pids), opts) as run:
            job.go()
            wait_for(lambda: len(run.sink.dicts("cuda_events")) >= NRANKS * (ITERS + 11))
            wait_for(lambda: sum(r["count"] for r in run.sink.dicts("event_stats"))
                     >= NRANKS * (ITERS + 1))
        job.finish()
    finally:
        job.kill()
    return dict(sink=run.sink, pids=job.pids)


def test_kept_calls_per_rank(cuda_run):
    rows = cuda_run["sink"].dicts("cuda_events")
    for pid in cuda_run["pids"]:
        mine = [r for r in rows if r["pid"] == pid]
        # cudaMemcpyAsync and cudaMemcpyPeer call cudaMemcpy inside the shim: not counted
        assert Counter(r["api"] for r in mine) == {
            "cudaStreamSynchronize": ITERS, "cudaMalloc": 1, "cudaMemcpy": 1,
            "cudaMemcpyAsync": 1, "cudaMemcpy2D": 1, "cudaMemcpyPeer": 1, "cudaFree": 1,
            "cudaDeviceSynchronize": 1, "cudaEventSynchronize": 1, "cudaGraphLaunch": 1,
            "cuMemcpyHtoD_v2": 1, "cuStreamSynchronize": 1}
        one = {r["api"]: r for r in mine}
        pick = lambda api: (one[api]["bytes"], one[api]["memcpy_kind"], one[api]["stream"],  # noqa: E731
                            one[api]["device"], one[api]["layer"])
        assert pick("cudaMemcpy") == (4096, "HtoD", None, None, "runtime")
        assert pick("cudaMemcpyAsync") == (2048, "DtoH", STREAM, None, "runtime")
        assert pick("cudaMemcpy2D") == (32 * 8, "DtoD", None, None, "runtime")
        assert pick("cudaMemcpyPeer") == (512, "DtoD", None, 1, "runtime")
        assert pick("cudaMalloc") == (1 << 20, None, None, None, "runtime")
        assert pick("cudaGraphLaunch") == (None, None, STREAM, None, "runtime")
        assert pick("cuMemcpyHtoD_v2") == (1000, "HtoD", None, None, "driver")
        assert pick("cuStreamSynchronize")[2:] == (STREAM, None, "driver")
        assert {r["return_code"] for r in mine} == {0}


def test_syncs_record_the_work_queued_before_them(cuda_run):
    """queued_ops counts the stream operations a thread enqueued after its last NCCL
    collective or synchronization: nothing between train_step's AllReduce and its sync;
    the async copy before cudaDeviceSynchronize; the graph launch and cuLaunchKernel
    before cuStreamSynchronize. Calls other than syncs carry no count."""
    rows = cuda_run["sink"].dicts("cuda_events")
    for pid in cuda_run["pids"]:
        mine = sorted((r for r in rows if r["pid"] == pid), key=lambda r: r["timestamp_ns"])
        steps = [r for r in mine if r["api"] == "cudaStreamSynchronize"]
        assert [(r["queued_ops"], r["queue_gap_ns"]) for r in steps] == [(0, None)] * ITERS
        one = {r["api"]: r for r in mine}
        assert one["cudaDeviceSynchronize"]["queued_ops"] == 1
        copy = one["cudaMemcpyAsync"]
        gap = one["cudaDeviceSynchronize"]["timestamp_ns"] - copy["timestamp_ns"]
        assert 0 < one["cudaDeviceSynchronize"]["queue_gap_ns"] <= gap
        assert (one["cudaEventSynchronize"]["queued_ops"],
                one["cudaEventSynchronize"]["queue_gap_ns"]) == (0, None)
        assert one["cuStreamSynchronize"]["queued_ops"] == 2
        assert one["cuStreamSynchronize"]["queue_gap_ns"] > 0
        assert all(r["queued_ops"] is None and r["queue_gap_ns"] is None for r in mine
                   if not r["api"].endswith("Synchronize"))


def test_sync_durations_cover_the_sleep(cuda_run):
    rows = cuda_run["sink"].dicts("cuda_events")
    syncs = [r for r in rows if r["api"].endswith("Synchronize")]
    assert len(syncs) == NRANKS * (ITERS + 3)
    assert all(r["duration_ns"] >= SYNC_US * 1000 for r in syncs)
    # copies and allocations do not sleep in the shim: far below the sleep
    quick = [r for r in rows if r["api"] in ("cudaMalloc", "cudaFree", "cudaMemcpy")]
    assert quick and all(r["duration_ns"] < SYNC_US * 1000 for r in quick)


def test_sync_stacks_name_the_caller(cuda_run):
    sink = cuda_run["sink"]
    for r in sink.dicts("cuda_events"):
        if r["api"] == "cudaStreamSynchronize":
            symbols = [f["symbol"] for f in sink.stack(r["stack_id"])]
            assert symbols[:2] == ["cudaStreamSynchronize", "train_step"], symbols
        if r["api"] == "cudaMalloc":
            assert r["stack_id"] is None   # allocations: no stack by design


def test_launches_aggregated_in_kernel(cuda_run):
    sink = cuda_run["sink"]
    stats = sink.dicts("event_stats")
    assert {s["source"] for s in stats} == {"cuda"}
    assert not [r for r in sink.dicts("cuda_events") if "Launch" in r["api"]
                and r["api"] != "cudaGraphLaunch"]
    for pid in cuda_run["pids"]:
        mine = [s for s in stats if s["pid"] == pid]
        counts = Counter()
        for s in mine:
            counts[s["name"]] += s["count"]
            # entry-only probes: a count, no duration
            assert (s["total_ns"], s["max_ns"], s["hist_log2"]) == (None, None, None)
            assert s["interval_end_ns"] > s["interval_start_ns"]
            assert s["tid"] == pid
        assert counts == {"cudaLaunchKernel": ITERS, "cuLaunchKernel": 1}
        launch = next(s for s in mine if s["name"] == "cudaLaunchKernel")
        symbols = [f["symbol"] for f in sink.stack(launch["stack_id"])]
        assert symbols[:3] == ["cudaLaunchKernel", "launch_step_kernel", "train_step"], symbols


REAL_CUDART_SCRIPT = textwrap.dedent(r"""
    import ctypes, json, sys
    rt = ctypes.CDLL(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()
    ptr = ctypes.c_void_p()
    out = {"malloc": rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(4 << 20)),
           "memcpy": rt.cudaMemcpy(None, None, ctypes.c_size_t(777), 2),
           "sync": rt.cudaStreamSynchronize(ctypes.c_void_p(0x99))}
    print(json.dumps(out), flush=True)
    sys.stdin.readline()
""")


def test_real_libcudart_arguments(ebpf_ok, tmp_path):
    lib = real_lib("nvidia-cuda-runtime-cu12", "libcudart.so.12")
    out, sink, pid = run_real_library(CudaSource, REAL_CUDART_SCRIPT, lib, tmp_path,
                                      "cuda_events", 3)
    rows = sorted(sink.dicts("cuda_events"), key=lambda r: r["timestamp_ns"])
    got = [(r["api"], r["bytes"], r["memcpy_kind"], r["stream"], r["return_code"], r["pid"])
           for r in rows]
    assert got == [("cudaMalloc", 4 << 20, None, None, out["malloc"], pid),
                   ("cudaMemcpy", 777, "DtoH", None, out["memcpy"], pid),
                   ("cudaStreamSynchronize", None, None, 0x99, out["sync"], pid)]
    assert out["malloc"] != 0   # no GPU: the calls failed after entry


# -- kernel launches above --launch-budget --------------------------------------------------

#: train_job's launches per step: 4 forward, 6 backward, 8 optimizer kernels
TRAIN_LAUNCHES = 18


def test_launches_sampled_above_the_budget(ebpf_ok, tmp_path, fixtures):
    """train_job makes about 700 launches/s; with a budget of 100/s the launch probes are
    detached for most stats intervals. The intervals that count give the true rate; the
    others are marked (observed_ns 0, count 0); a synchronization whose queued work the
    capture could not see (its step crossed a switch) says NULL, and every one that
    gives a count gives the true one: 4 before the forward pass's event sync, 8 before
    the optimizer's sync, 1 (the loss copy) before loss.item()'s."""
    idfile = tmp_path / "ids"
    make_ids(idfile)
    job = Job(lambda r: [str(fixtures.train_job), "0", "1", str(idfile), "6s", str(tmp_path)],
              1)
    opts = options(lib_paths=[str(fixtures.libcudart), str(fixtures.libnccl)],
                   stats_interval_s=0.25, launch_budget=100)
    try:
        with Running(CudaSource(opts), StaticTargets(job.pids), opts) as run:
            (result,) = job.go()
            time.sleep(0.3)
        job.finish()
    finally:
        job.kill()
    sink = run.sink
    stats = [s for s in sink.dicts("event_stats") if s["name"] == "cudaLaunchKernel"]
    off = [s for s in stats if s["observed_ns"] == 0]
    counted = [s for s in stats if s["observed_ns"] != 0]
    assert off and counted, stats
    assert all(s["count"] == 0 and s["pid"] is None for s in off)
    # an interval whose probes came back on during it counted from then on (observed_ns)
    seen_ns = {(s["interval_start_ns"], s["interval_end_ns"]):
               s["observed_ns"] or s["interval_end_ns"] - s["interval_start_ns"]
               for s in counted}
    intervals = set(seen_ns)
    assert all(0 < v <= b - a for (a, b), v in seen_ns.items()), seen_ns
    job_start, job_end = result["start_mono_ns"], result["end_mono_ns"]
    inside = {iv for iv in intervals if job_start <= iv[0] and iv[1] <= job_end}
    assert inside, (intervals, job_start, job_end)
    # probes attached again after a switch count (attached through a path that stays valid)
    assert any(s["observed_ns"] and s["count"] > 0 for s in counted), counted
    rate = sum(s["count"] for s in counted if (s["interval_start_ns"], s["interval_end_ns"])
               in inside) / (sum(seen_ns[iv] for iv in inside) / 1e9)
    true_rate = result["steps"] * TRAIN_LAUNCHES / ((job_end - job_start) / 1e9)
    assert 0.7 * true_rate <= rate <= 1.3 * true_rate, (rate, true_rate)
    # most intervals are off: at most the budget's share, plus the first one
    assert len(intervals) <= len(off) / 2 + 2, (len(intervals), len(off))
    expect = {"forward": 4, "optimizer_step": 8, "report_loss": 1}
    seen = {"known": 0, "unknown": 0}
    for r in sink.dicts("cuda_events"):
        if not r["api"].endswith("Synchronize"):
            continue
        caller = [f["symbol"] for f in sink.stack(r["stack_id"])][1]
        if r["queued_ops"] is None:
            seen["unknown"] += 1
            assert r["queue_gap_ns"] is None
        else:
            seen["known"] += 1
            assert r["queued_ops"] == expect[caller], (caller, r)
    assert seen["known"] >= 3 and seen["unknown"] >= 3, seen
    assert any("launch probes on for" in m for _l, _s, _e, m, _c in sink.logs), sink.logs


def _sampled_train_job(fixtures, tmp_path, job_dir, during=None):
    """train_job from job_dir (its shims beside it) for 6 s under a CudaSource with a
    budget of 100 launches/s and 0.25 s intervals; ``during(source)`` runs once the job
    is going. Returns the sink."""
    idfile = tmp_path / "ids"
    make_ids(idfile)
    job = Job(lambda r: [str(job_dir / "train_job"), "0", "1", str(idfile), "6s",
                         str(tmp_path)], 1)
    opts = options(lib_paths=[str(job_dir / "libcudart.so.12"), str(job_dir / "libnccl.so.2")],
                   stats_interval_s=0.25, launch_budget=100)
    source = CudaSource(opts)
    try:
        with Running(source, StaticTargets(job.pids), opts) as run:
            if during:
                threading.Thread(target=during, args=(source,), daemon=True).start()
            job.go()
            time.sleep(0.3)
        job.finish()
    finally:
        job.kill()
    return run.sink


def _copy_job(fixtures, to):
    to.mkdir()
    for f in (fixtures.train_job, fixtures.libcudart, fixtures.libnccl, fixtures.libcuda):
        shutil.copy2(f, to / f.name)
    return to


@pytest.mark.parametrize("uprobes", ["multi", "perf"])
def test_launch_probes_come_back_after_their_library_path_is_gone(ebpf_ok, tmp_path, fixtures,
                                                                   uprobes, monkeypatch):
    """The probes are attached again through a descriptor the source holds, not through
    the path the library was found by: renamed away (or the /proc/PID/root path of a
    process that exited), the launches are still counted after every switch. Both ways
    of attaching: uprobe_multi links and one perf event per probe."""
    monkeypatch.setenv("INGERO_UPROBES", uprobes)
    job_dir = _copy_job(fixtures, tmp_path / "a")
    sink = _sampled_train_job(fixtures, tmp_path, job_dir,
                              during=lambda _s: (time.sleep(0.5),
                                                 job_dir.rename(tmp_path / "b")))
    assert any(m.endswith("uprobe_multi links") if uprobes == "multi" else "one perf event" in m
               for _l, _s, e, m, _c in sink.logs if e == "attached"), sink.logs
    stats = [s for s in sink.dicts("event_stats") if s["name"] == "cudaLaunchKernel"]
    first_off = min(s["interval_start_ns"] for s in stats if s["observed_ns"] == 0)
    later = [s for s in stats if s["interval_start_ns"] > first_off and s["count"] > 0]
    assert later and all(s["observed_ns"] != 0 for s in later), stats
    assert not [m for _l, _s, _e, m, _c in sink.logs if "could not be attached" in m]


@pytest.mark.parametrize("uprobes", ["multi", "perf"])
def test_a_launch_probe_that_cannot_come_back_leaves_launches_unknown(ebpf_ok, tmp_path,
                                                                      fixtures, uprobes,
                                                                      monkeypatch):
    """If a launch probe cannot be attached again, the capture says so, marks every
    interval after as not counted, and no synchronization after the switch claims to
    know what was queued before it. The kernel's refusal is made where the source meets
    the kernel: the uprobe_multi link, or the perf-event attach."""
    monkeypatch.setenv("INGERO_UPROBES", uprobes)

    def break_attach(source):
        real_link, real_attach = source.uprobes.link, source.uprobes.perf_uprobe
        launch_fns = {f"api_{i}" for p in source.launch_probes for i, _s, _o in p.launches}

        def link(path, prog, *a, **kw):
            if prog == "launch_multi":
                raise OSError(22, "uprobe_multi link: Invalid argument")
            return real_link(path, prog, *a, **kw)

        def attach(path, sym, fn_name, *a, **kw):
            if fn_name in launch_fns:
                raise Exception("Failed to attach BPF to uprobe")
            return real_attach(path, sym, fn_name, *a, **kw)
        source.uprobes.link = link
        source.uprobes.perf_uprobe = attach

    sink = _sampled_train_job(fixtures, tmp_path, fixtures.build, during=break_attach)
    stats = [s for s in sink.dicts("event_stats") if s["name"] == "cudaLaunchKernel"]
    first_off = min(s["interval_start_ns"] for s in stats if s["observed_ns"] == 0)
    assert all(s["observed_ns"] == 0 for s in stats if s["interval_start_ns"] > first_off)
    # the switcher thread detaches just after the interval turns off (until then the
    # probes still count, and a sync may know its queue); give it half a second
    syncs = [r for r in sink.dicts("cuda_events") if r["api"].endswith("Synchronize")
             and r["timestamp_ns"] > first_off + 500_000_000]
    assert syncs and all(r["queued_ops"] is None for r in syncs), [
        (r["timestamp_ns"] - first_off, r["queued_ops"]) for r in syncs if r["queued_ops"]]
    assert [m for _l, _s, _e, m, _c in sink.logs if "could not be attached again" in m]


def test_callers_without_frame_pointers(ebpf_ok, fixtures):
    """PyTorch's libraries are built without frame pointers: at a probe, rbp holds
    whatever the caller keeps there. rank_job nofp calls cudaLaunchKernel and
    cudaMemcpyAsync with rbp pointing at stack words that change with every call. Every
    launch is still counted (more than the launch map holds, were each call a new site),
    every copy kept, nothing lost, and their stacks are a handful, not one per call."""
    iters = 40_000
    job = Job(lambda r: [str(fixtures.rank_job), "nofp", str(iters)], 1)
    opts = options(lib_paths=[str(fixtures.libcudart)], stats_interval_s=0.5,
                   launch_budget=0)
    source = CudaSource(opts)
    try:
        with Running(source, StaticTargets(job.pids), opts) as run:
            (result,) = job.go()
            wait_for(lambda: len(run.sink.dicts("cuda_events")) >= iters, timeout=30)
            time.sleep(0.6)                  # one more stats interval: the last counts
        job.finish()
    finally:
        job.kill()
    assert result == {"calls": 2 * iters}
    assert source.lost == 0, run.sink.logs
    launches = [s for s in run.sink.dicts("event_stats") if s["name"] == "cudaLaunchKernel"]
    assert sum(s["count"] for s in launches) == iters
    copies = [r for r in run.sink.dicts("cuda_events") if r["api"] == "cudaMemcpyAsync"]
    assert len(copies) == iters
    assert len({s["stack_id"] for s in launches}) <= 3
    assert len({r["stack_id"] for r in copies}) <= 3


def test_symbolizer_refreshes_rarely_and_frees_its_caches():
    """Stacks walked through code without frame pointers end in addresses no mapping
    holds. Each used to replace the process's symbol cache, re-reading its libraries
    and keeping the old cache's file descriptors open: a capture of a PyTorch job ran out
    of descriptors. Now the mappings are re-read in place at most once per REFRESH_S for
    every source together; a stack with an unknown frame is resolved again once that
    time has passed (a library loaded since); a finished process is forgotten and not
    read again; no descriptor stays open."""
    import ctypes
    import os
    import subprocess

    from ingero_forensics.capture.ebpf import symbols
    from ingero_forensics.capture.ebpf.base import Symbolizer

    libc = ctypes.CDLL(None)
    known = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    garbage = 0x10   # in no mapping

    class Walks:     # stack id -> addresses, as a BPF_STACK_TRACE table gives them
        def walk(self, stack_id):
            return [known, garbage + stack_id]

    pid = os.getpid()
    refreshes = []
    real_refresh = symbols.ProcessSymbols.refresh
    sym, other = Symbolizer(Walks()), Symbolizer(Walks())   # two sources
    try:
        symbols.ProcessSymbols.refresh = lambda self: (refreshes.append(self.pid),
                                                       real_refresh(self))
        fds = len(os.listdir("/proc/self/fd"))
        stacks = [sym.frames(pid, 0)]     # the mappings are read: fresh, not refreshed
        refreshes.clear()
        stacks += [sym.frames(pid, i) for i in range(1, 3000)]
        stacks += [other.frames(pid, i) for i in range(3000, 3010)]
        assert refreshes == []
        sym.refreshed[pid] -= Symbolizer.REFRESH_S          # as if that long had passed
        stacks.append(sym.frames(pid, 5))    # seen before: resolved again, one re-read
        stacks += [other.frames(pid, i) for i in range(3010, 3100)]
    finally:
        symbols.ProcessSymbols.refresh = real_refresh
    assert refreshes == [pid]
    # resolved again to the same frames: the same list (the bundle writer knows it so)
    assert stacks[-91] is stacks[5]
    assert all(s[0]["symbol"] == "getpid" and s[0]["module"].startswith("libc")
               and s[1]["module"] is None for s in stacks)
    assert len(os.listdir("/proc/self/fd")) == fds
    sym.forget(pid)
    assert pid in Symbolizer.processes      # kept a while: its last events may wait
    Symbolizer.gone[pid] -= Symbolizer.GONE_GRACE_S          # as if that long had passed
    sym._drop_gone()
    assert pid not in Symbolizer.processes and pid not in Symbolizer.gone
    # in every source's cache too
    assert not [k for s in (sym, other) for k in s.cache if k[0] == pid]
    assert sym.frames(pid, 7)[0]["module"].startswith("libc")   # alive: read again
    Symbolizer.processes.pop(pid, None)
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert sym.frames(gone.pid, 1) is None and gone.pid not in Symbolizer.processes


def test_symbolizer_sweep_forgets_processes_gone_and_pids_reused():
    """Without --pid or --comm no target scan reports exits: the sweep finds them. A
    process gone is kept GONE_GRACE_S (its last events may wait in the buffers); a pid
    that another process has by now is dropped at once."""
    import os
    import subprocess
    import sys

    from ingero_forensics.capture.ebpf.base import Symbolizer

    class Walks:
        def walk(self, stack_id):
            return [stack_id]

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    sym = Symbolizer(Walks())
    try:
        sym._process(child.pid)
        sym._process(os.getpid())
        sym.cache[(child.pid, 1, 0)] = ([{"module": "x"}], None)
        child.stdin.close()
        child.wait(timeout=30)
        Symbolizer.swept = 0.0
        Symbolizer.sweep()
        assert child.pid in Symbolizer.gone and child.pid in Symbolizer.processes
        Symbolizer.gone[child.pid] -= Symbolizer.GONE_GRACE_S
        Symbolizer.swept = 0.0
        Symbolizer.sweep()
        assert child.pid not in Symbolizer.processes and not sym.cache
        assert os.getpid() in Symbolizer.processes         # alive: kept
        Symbolizer.processes[os.getpid()].started -= 1     # as if the pid were reused
        Symbolizer.swept = 0.0
        Symbolizer.sweep()
        assert os.getpid() not in Symbolizer.processes
    finally:
        for pid in (child.pid, os.getpid()):
            Symbolizer.discard(pid)
