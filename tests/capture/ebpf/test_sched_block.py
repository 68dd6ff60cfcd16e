"""Scheduler and block I/O tracepoints on the real kernel."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import Running, StaticTargets, options, wait_for
from ingero_forensics.capture.ebpf._bcc import tracepoint_exists
from ingero_forensics.capture.ebpf import block
from ingero_forensics.capture.ebpf.block import BlockSource, DeviceNames, block_op
from ingero_forensics.capture.ebpf.sched import SchedSource, state_letter

pytestmark = pytest.mark.ebpf

SLEEPER = textwrap.dedent(r"""
    import os, sys, time
    open("/proc/self/comm", "w").write("ingero-sleeper")
    os.sched_setaffinity(0, {int(sys.argv[1])})
    os.nice(19)   # lighter than the hog: it waits for the hog's slice to end
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(200):
        time.sleep(0.002)          # wakes up to find the hog on its CPU
    print("done", flush=True)
    sys.stdin.readline()
""")
HOG = textwrap.dedent(r"""
    import os, sys
    open("/proc/self/comm", "w").write("ingero-hog")
    os.sched_setaffinity(0, {int(sys.argv[1])})
    print("ready", flush=True)
    while True:
        pass
""")


def test_runq_delay_names_the_hog(ebpf_ok, tmp_path):
    cpu = max(os.sched_getaffinity(0))
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "hog.py").write_text(HOG)
    sleeper = subprocess.Popen([sys.executable, str(tmp_path / "sleeper.py"), str(cpu)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    hog = subprocess.Popen([sys.executable, str(tmp_path / "hog.py"), str(cpu)],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "ready"
        assert hog.stdout.readline().strip() == "ready"
        opts = options(sched_threshold_ns=20_000, stats_interval_s=0.2)
        with Running(SchedSource(opts), StaticTargets([sleeper.pid]), opts) as run:
            sleeper.stdin.write("go\n")
            sleeper.stdin.flush()
            assert sleeper.stdout.readline().strip() == "done"
            wait_for(lambda: run.sink.dicts("event_stats"), timeout=5)
        # the hog first: at nice 19 beside it, the sleeper gets about 1.5 % of its CPU,
        # and the interpreter's exit took over 10 s on a loaded machine
        hog.kill()
        hog.wait()
        sleeper.stdin.close()
        sleeper.wait(timeout=10)
    finally:
        for p in (sleeper, hog):
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = run.sink.dicts("sched_events")
    assert rows and {r["pid"] for r in rows} == {sleeper.pid}   # only the traced process
    runq = [r for r in rows if r["kind"] == "runq_delay"]
    held_by_hog = [r for r in runq if r["other_pid"] == hog.pid]
    assert held_by_hog, f"no runqueue delay attributed to the hog: {runq[:5]}"
    assert all(r["other_comm"] == "ingero-hog" and r["other_tid"] == hog.pid for r in held_by_hog)
    assert all(r["comm"] == "ingero-sleeper" and r["cpu"] == cpu for r in held_by_hog)
    assert all(r["duration_ns"] >= 20_000 for r in rows)
    offs = [r for r in rows if r["kind"] == "off_cpu"]
    # the 2 ms sleeps show as off-CPU spans in state S of at least the sleep
    assert sum(1 for r in offs if r["prev_state"] == "S" and r["duration_ns"] >= 2_000_000) >= 100
    stats = run.sink.dicts("event_stats")
    assert {s["source"] for s in stats} == {"sched"}
    assert all(s["max_ns"] < 20_000 and s["pid"] == sleeper.pid for s in stats)
    for s in stats:
        assert sum(json.loads(s["hist_log2"])) == s["count"]


def test_state_letters():
    assert [state_letter(s) for s in (0, 0x100, 1, 2, 0x80, -1)] == ["R", "R", "S", "D", "I", None]


def test_block_op_from_rwbs():
    assert [block_op(f) for f in ("WS", "R", "RA", "FWS", "DS", "F", "N")] == \
        ["write", "read", "read", "write", "discard", "flush", "other"]


def test_device_names_fall_back_to_major_minor(tmp_path):
    (tmp_path / "8:0").symlink_to("../../devices/pci0000:00/block/sda")
    names = DeviceNames(str(tmp_path))
    assert names.name(8 << 20) == "sda"
    assert names.name((259 << 20) | 3) == "259:3"


def backing_disk(path: str) -> str | None:
    st = os.stat(path)
    mm = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        dev = os.path.realpath(f"/sys/dev/block/{mm}")
        # block events name the disk, not a partition of it (vda for vda1)
        if os.path.exists(os.path.join(dev, "partition")):
            dev = os.path.dirname(dev)
        return os.path.basename(dev) if os.path.exists(dev) else None
    except OSError:
        return None


def test_block_direct_writes(ebpf_ok):
    workdir = os.path.dirname(os.path.abspath(__file__))
    disk = backing_disk(workdir)
    if disk is None:
        pytest.skip(f"{workdir} is not on a block device")
    opts = options()
    size, count = 64 * 1024, 16
    buf = mmap.mmap(-1, size)            # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(size))
    with tempfile.NamedTemporaryFile(dir=workdir) as f:
        try:
            fd = os.open(f.name, os.O_WRONLY | os.O_DIRECT)
        except OSError as e:
            pytest.skip(f"O_DIRECT not supported here: {e}")
        with Running(BlockSource(opts), StaticTargets(), opts) as run:
            for i in range(count):
                os.pwrite(fd, buf, i * size)
            os.fsync(fd)
            os.close(fd)
            wait_for(lambda: len([r for r in run.sink.dicts("block_events")
                                  if r["pid"] == os.getpid()]) >= 1)
    mine = [r for r in run.sink.dicts("block_events") if r["pid"] == os.getpid()]
    writes = [r for r in mine if r["op"] == "write"]
    assert writes, mine
    assert sum(r["bytes"] for r in writes) >= size * count
    assert all(r["device"] == disk and r["duration_ns"] > 0 and r["error"] == 0 for r in writes)
    assert all(r["comm"] and r["tid"] and "W" in r["rwbs"] for r in writes)
    assert all(r["sector"] is not None for r in writes)


def _direct_write_from_a_cold_mapping(owner_at_start: bool, size: int = 8 << 20):
    """An O_DIRECT write of `size` bytes whose source is a file mapping not in memory:
    the task faults the pages in (reads) while its first write requests wait in its
    plug, which is flushed as it sleeps, so kblockd issues them. The block source looks
    for block_io_start only where owner_at_start. Returns the block rows."""
    workdir = os.path.dirname(os.path.abspath(__file__))
    if backing_disk(workdir) is None:
        pytest.skip(f"{workdir} is not on a block device")
    opts = options()
    exists = block.tracepoint_exists
    with tempfile.NamedTemporaryFile(dir=workdir) as src, \
            tempfile.NamedTemporaryFile(dir=workdir) as dst, \
            pytest.MonkeyPatch.context() as mp:
        if not owner_at_start:
            mp.setattr(block, "tracepoint_exists", lambda cat, ev: ev != "block_io_start"
                       and exists(cat, ev))
        src.write(os.urandom(size))
        src.flush()
        os.fsync(src.fileno())
        os.posix_fadvise(src.fileno(), 0, size, os.POSIX_FADV_DONTNEED)
        cold = mmap.mmap(src.fileno(), size, prot=mmap.PROT_READ)
        try:
            fd = os.open(dst.name, os.O_WRONLY | os.O_DIRECT)
        except OSError as e:
            pytest.skip(f"O_DIRECT not supported here: {e}")
        try:
            with Running(BlockSource(opts), StaticTargets(), opts) as run:
                assert os.pwrite(fd, cold, 0) == size
                os.fsync(fd)
                # where the owner is known, wait for this process's own writes: the
                # total also counts others' (the journal's 4 KiB once ended the wait
                # with this process's last request still in flight)
                me = os.getpid() if owner_at_start else None
                wait_for(lambda: sum(r["bytes"] for r in run.sink.dicts("block_events")
                                     if r["op"] == "write"
                                     and me in (None, r["pid"])) >= size)
        finally:
            os.close(fd)
            cold.close()
    return run


def test_block_requests_kblockd_issues_stay_the_submitters(ebpf_ok):
    """The request's task is the one that created it (block_io_start), not kblockd,
    which issues these: taken at issue (the control run, as before this change), all
    but 4 KiB of the 8 MiB written were kblockd's, and 6-7 MiB of the fault's reads."""
    if not tracepoint_exists("block", "block_io_start"):
        pytest.skip("no block:block_io_start tracepoint (kernel before 6.5)")
    size = 8 << 20
    # the control (taken at issue) shows that kblockd does issue such requests here;
    # whether it does depends on plugging and on the disk's queue, so it is tried up to
    # three times; the attribution below is checked either way, and a run where kblockd
    # issued nothing ends as an expected failure
    for _ in range(3):
        control = _direct_write_from_a_cold_mapping(False, size).sink.dicts("block_events")
        by_kblockd = sum(r["bytes"] for r in control if r["op"] == "write" and
                         r["pid"] != os.getpid() and (r["comm"] or "").startswith("kworker"))
        if by_kblockd:
            break
    print(f"control, taken at issue: {by_kblockd} of {size} bytes kblockd's")
    run = _direct_write_from_a_cold_mapping(True, size)
    mine = [r for r in run.sink.dicts("block_events") if r["pid"] == os.getpid()]
    assert sum(r["bytes"] for r in mine if r["op"] == "write") >= size
    assert sum(r["bytes"] for r in mine if r["op"] == "read") >= size   # the faults
    assert all(r["tid"] and r["comm"] for r in mine)
    assert any("block_io_start" in log[3] for log in run.sink.logs), run.sink.logs
    if not by_kblockd:
        # the attribution held, but the case it exists for did not occur: say so (an
        # expected failure, not a skip or a pass)
        pytest.xfail("kblockd issued none of the control's requests in three tries: "
                     "the submitter issued them itself, so nothing was re-attributed")


def test_block_flushes_are_recorded(ebpf_ok):
    """A cache flush (fdatasync on a disk with a write-back cache) is a request without a
    sector: its completion gives the sector as -1, the issue as 0; matched, it is a row
    (op flush, sector NULL) of the task that asked for it. Before, none was recorded.
    Flushes asked for together share one request (the kernel's flush sequence), so the
    rows may be fewer than the calls when other tasks flush meanwhile."""
    workdir = os.path.dirname(os.path.abspath(__file__))
    disk = backing_disk(workdir)
    if disk is None:
        pytest.skip(f"{workdir} is not on a block device")
    try:
        cache = Path(f"/sys/block/{disk}/queue/write_cache").read_text().strip()
    except OSError:
        cache = ""
    if cache != "write back":
        pytest.skip(f"{disk} has no write-back cache to flush ({cache or 'unknown'})")
    opts = options()
    with tempfile.NamedTemporaryFile(dir=workdir) as f:
        f.write(os.urandom(4096))
        f.flush()
        os.fsync(f.fileno())
        with Running(BlockSource(opts), StaticTargets(), opts) as run:
            for _ in range(5):
                os.pwrite(f.fileno(), os.urandom(4096), 0)
                os.fdatasync(f.fileno())
            wait_for(lambda: any(r["op"] == "flush" and r["pid"] == os.getpid()
                                 for r in run.sink.dicts("block_events")))
    flushes = [r for r in run.sink.dicts("block_events") if r["op"] == "flush"]
    assert any(r["pid"] == os.getpid() for r in flushes), run.sink.dicts("block_events")
    # NULL: the flush sequence's own request; 0: a flush request made from a bio
    assert all(r["sector"] in (None, 0) and r["duration_ns"] > 0 and "F" in r["rwbs"]
               for r in flushes)
    assert any(r["sector"] is None and r["device"] == disk for r in flushes)


def test_block_without_io_start_warns(ebpf_ok, monkeypatch):
    """On a kernel without block_io_start the capture still records every request (by
    the task current at its issue) and says in capture_log what it cannot attribute."""
    workdir = os.path.dirname(os.path.abspath(__file__))
    if backing_disk(workdir) is None:
        pytest.skip(f"{workdir} is not on a block device")
    exists = block.tracepoint_exists
    monkeypatch.setattr(block, "tracepoint_exists",
                        lambda cat, ev: ev != "block_io_start" and exists(cat, ev))
    opts = options()
    size = 64 * 1024
    buf = mmap.mmap(-1, size)
    buf.write(os.urandom(size))
    with tempfile.NamedTemporaryFile(dir=workdir) as f:
        try:
            fd = os.open(f.name, os.O_WRONLY | os.O_DIRECT)
        except OSError as e:
            pytest.skip(f"O_DIRECT not supported here: {e}")
        with Running(BlockSource(opts), StaticTargets(), opts) as run:
            os.pwrite(fd, buf, 0)
            os.fsync(fd)
            os.close(fd)
            wait_for(lambda: any(r["op"] == "write" and r["pid"] == os.getpid()
                                 for r in run.sink.dicts("block_events")))
    assert any(r["op"] == "write" and r["bytes"] > 0 and r["pid"] == os.getpid()
               for r in run.sink.dicts("block_events"))
    warnings = [m for level, _, _, m, _ in run.sink.logs if level == "warning"]
    assert any("block_io_start" in m and "kblockd" in m for m in warnings), run.sink.logs


def test_check_says_whose_requests_a_kernel_without_io_start_misattributes(ebpf_ok,
                                                                          monkeypatch):
    # --check: the block source runs either way; without block_io_start it says so
    # (with it, the line says what the source traces)
    assert BlockSource.probe().available and BlockSource.probe().reason == BlockSource.probe_detail
    exists = block.tracepoint_exists
    monkeypatch.setattr(block, "tracepoint_exists",
                        lambda cat, ev: ev != "block_io_start" and exists(cat, ev))
    status = BlockSource.probe()
    assert status.available
    assert status.reason.startswith("requests kblockd issues for a task are recorded as "
                                    "kblockd's: no block:block_io_start")


def test_capture_bpf_run_time_is_recorded_when_the_kernel_keeps_it(ebpf_ok):
    """capture.bpf_cpu_pct: the in-kernel run time of the capture's own BPF programs
    (fdinfo run_time_ns), only while kernel.bpf_stats_enabled is 1; a real program on
    sched_switch (which fires all the time) gives a positive share, and with the
    sysctl off no row is written rather than a 0 that would claim the probes are free."""
    from ingero_forensics.capture.ebpf._bcc import import_bcc
    from ingero_forensics.capture.host import Snapshot, bpf_run_time_ns, host_rows
    sysctl = Path("/proc/sys/kernel/bpf_stats_enabled")
    before = sysctl.read_text().strip()
    BPF = import_bcc().BPF
    b = BPF(text=b"TRACEPOINT_PROBE(sched, sched_switch) { return 0; }")
    try:
        sysctl.write_text("0\n")
        assert bpf_run_time_ns() is None
        sysctl.write_text("1\n")
        prev = Snapshot(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
        prev.bpf_run_ns = bpf_run_time_ns()
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            time.sleep(0.001)           # context switches: the program runs
        cur = Snapshot(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
        cur.bpf_run_ns = bpf_run_time_ns()
        assert prev.bpf_run_ns is not None and cur.bpf_run_ns > prev.bpf_run_ns
        pct = [v for _, m, _, v in host_rows(prev, cur) if m == "capture.bpf_cpu_pct"]
        assert len(pct) == 1 and 0 < pct[0] < 100
        cur.bpf_run_ns = None
        assert not [m for _, m, _, _ in host_rows(prev, cur) if m == "capture.bpf_cpu_pct"]
    finally:
        sysctl.write_text(before + "\n")
        b.cleanup()
