"""The traced processes' own cgroups (capture/cgroups.py): paths, parsers, the sampler on
a made-up tree, the rows it gives, and the real kernel: a process thrashing under a real
memory limit, in a real cgroup."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ingero_forensics.bundle.schema import HOST_METRICS
from ingero_forensics.capture.cgroups import (CgroupSample, JobCgroups, cgroup_mounts,
                                              cgroups_of, parse_memory_stat)
from ingero_forensics.capture.host import Snapshot, host_rows

METRICS = {m for m, _, _ in HOST_METRICS}

HYBRID = """\
25 30 0:22 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/cpu rw,nosuid shared:11 - cgroup cgroup rw,cpu
28 25 0:25 / /sys/fs/cgroup/memory rw,nosuid shared:12 - cgroup cgroup rw,memory
"""
PURE_V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"

PSI = "some avg10=0.00 avg60=0.00 avg300=0.00 total={}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total={}\n"
V1_STAT = ("cache 100\npgmajfault 5\nworkingset_refault_file 9\ntotal_cache 100\n"
           "total_pgmajfault {maj}\ntotal_workingset_refault_anon 1\n"
           "total_workingset_refault_file {ref}\n")
V2_STAT = "anon 4096\nfile 8192\nworkingset_refault_anon {ref}\nworkingset_refault_file 0\npgmajfault {maj}\n"


def test_mounts_hybrid_and_pure_v2(tmp_path):
    (tmp_path / "hybrid").write_text(HYBRID)
    (tmp_path / "v2").write_text(PURE_V2)
    assert cgroup_mounts(str(tmp_path / "hybrid")) == ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory")
    assert cgroup_mounts(str(tmp_path / "v2")) == ("/sys/fs/cgroup", None)
    assert cgroup_mounts(str(tmp_path / "none")) == (None, None)


def test_paths_of_a_process(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text(
        "12:cpu,cpuacct:/slurm/uid_0/job_9\n4:memory:/slurm/uid_0/job_9/step_0\n0::/job.scope\n")
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "cgroup").write_text("0::/\n")
    assert cgroups_of(7, str(tmp_path)) == ("/job.scope", "/slurm/uid_0/job_9/step_0")
    assert cgroups_of(8, str(tmp_path)) == ("/", None)
    assert cgroups_of(9, str(tmp_path)) == (None, None)       # gone


def test_memory_stat_v1_v2_and_old_kernels():
    # v1: the hierarchical totals, not the cgroup's own
    assert parse_memory_stat(V1_STAT.format(maj=50, ref=20).encode()) == (50, 21)
    assert parse_memory_stat(V2_STAT.format(maj=3, ref=4).encode()) == (3, 4)
    assert parse_memory_stat(b"pgmajfault 2\nworkingset_refault 6\n") == (2, 6)
    assert parse_memory_stat(b"cache 1\n") == (None, None)


def _tree(tmp_path, some, full, maj, ref, limit="25165824"):
    """A hybrid machine: pid 7 in /job (v2 and v1 memory), pid 8 in the root."""
    proc, v2, v1 = tmp_path / "proc", tmp_path / "unified", tmp_path / "memory"
    for pid, path in ((7, "/job"), (8, "/")):
        (proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (proc / str(pid) / "cgroup").write_text(f"4:memory:{path}\n0::{path}\n")
    (v2 / "job").mkdir(parents=True, exist_ok=True)
    (v1 / "job").mkdir(parents=True, exist_ok=True)
    for res in ("cpu", "io", "memory"):
        (v2 / "job" / f"{res}.pressure").write_text(PSI.format(some, full))
    (v1 / "job" / "memory.usage_in_bytes").write_text("20971520\n")
    (v1 / "job" / "memory.limit_in_bytes").write_text(limit + "\n")
    (v1 / "job" / "memory.stat").write_text(V1_STAT.format(maj=maj, ref=ref))
    return proc, v2, v1


def test_sampler_rows_on_a_made_up_tree(tmp_path):
    proc, v2, v1 = _tree(tmp_path, some=1_000, full=500, maj=10, ref=100)
    jobs = JobCgroups(lambda: {7, 8}, proc=str(proc), mounts=(str(v2), str(v1)))
    a = Snapshot(1_000_000_000, jobs=jobs.sample())
    assert list(a.jobs) == ["/job"]          # the root cgroup is /proc's own figure: left out
    _tree(tmp_path, some=251_000, full=50_500, maj=60, ref=1_100)
    b = Snapshot(1_500_000_000, jobs=jobs.sample())
    rows = host_rows(a, b)
    assert {m for _, m, _, _ in rows} <= METRICS
    got = {(m, d): v for _, m, d, v in rows}
    assert got[("psi.job.memory.some_pct", "/job")] == pytest.approx(50.0)
    assert got[("psi.job.io.full_pct", "/job")] == pytest.approx(10.0)
    assert ("psi.job.cpu.full_pct", "/job") not in got     # not in the catalogue
    assert got[("vm.job.refault_per_s", "/job")] == pytest.approx(2000.0)   # the v1 totals
    assert got[("vm.job.pgmajfault_per_s", "/job")] == pytest.approx(100.0)
    assert got[("mem.job.usage_bytes", "/job")] == 20971520
    assert got[("mem.job.limit_bytes", "/job")] == 25165824
    # v1's "no limit" (2^63 rounded down to a page) writes no limit row
    _tree(tmp_path, some=1, full=1, maj=1, ref=1, limit="9223372036854771712")
    assert JobCgroups(lambda: {7}, proc=str(proc), mounts=(str(v2), str(v1))).sample()["/job"].limit is None


def test_no_cgroup_of_its_own_writes_nothing(tmp_path):
    proc, v2, v1 = _tree(tmp_path, some=1, full=1, maj=1, ref=1)
    jobs = JobCgroups(lambda: {8, 99}, proc=str(proc), mounts=(str(v2), str(v1)))
    assert jobs.sample() == {}
    assert not [r for r in host_rows(Snapshot(1, jobs={}), Snapshot(2, jobs={}))
                if ".job." in r[1]]


def test_a_cgroup_that_went_away_is_dropped(tmp_path):
    proc, v2, v1 = _tree(tmp_path, some=1, full=1, maj=1, ref=1)
    jobs = JobCgroups(lambda: {7}, proc=str(proc), mounts=(str(v2), str(v1)))
    assert "/job" in jobs.sample()
    for d in (v2 / "job", v1 / "job"):
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    jobs._refreshed = -1e9
    assert jobs.sample() == {}
    # a counter that went backwards (a new cgroup of the same name) writes no rate
    a = Snapshot(1, jobs={"/job": CgroupSample(refault=500)})
    b = Snapshot(2_000_000_001, jobs={"/job": CgroupSample(refault=5)})
    assert not [r for r in host_rows(a, b) if r[1] == "vm.job.refault_per_s"]


# -- the real kernel -------------------------------------------------------------------

THRASH = """
import mmap, os, random, sys, time
f = open(sys.argv[1], 'rb')
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
m.madvise(mmap.MADV_RANDOM)
n = len(m) // 4096
print("ready", flush=True)
sys.stdin.readline()
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    m[random.randrange(n) * 4096]
print("done", flush=True)
sys.stdin.readline()
"""


@pytest.mark.ebpf
def test_a_job_short_of_memory_on_the_real_kernel(tmp_path):
    """A process reading random pages of a 48 MiB file under a 16 MiB limit, in a cgroup
    of its own: the sampler finds its cgroup from /proc, and the kernel's own counters
    show the limit, its use at the limit and the pages it reads back."""
    if os.geteuid() != 0:
        pytest.skip("needs root (cgroups)")
    v2, v1_memory = cgroup_mounts()
    if v2 is None:
        pytest.skip("no cgroup v2 hierarchy mounted")
    data = tmp_path / "data.bin"
    with open(data, "wb") as f:
        for _ in range(48):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())      # clean pages: posix_fadvise below can drop them
    name = f"ingero-test-{os.getpid()}"
    made = []
    proc = subprocess.Popen([sys.executable, "-c", THRASH, str(data), "3"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        roots = [Path(v2)] + ([Path(v1_memory)] if v1_memory else [])
        for root in roots:
            (root / name).mkdir()
            made.append(root / name)
            (root / name / "cgroup.procs").write_text(f"{proc.pid}\n")
        if v1_memory:
            (Path(v1_memory) / name / "memory.limit_in_bytes").write_text(f"{16 << 20}\n")
        else:
            ctl = Path(v2) / "cgroup.subtree_control"
            if "memory" not in ctl.read_text().split():
                ctl.write_text("+memory\n")
            (Path(v2) / name / "memory.max").write_text(f"{16 << 20}\n")
        # its pages were cached (and charged) when the file was written: evict them
        fd = os.open(data, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        jobs = JobCgroups(lambda: {proc.pid})
        first = Snapshot(time.monotonic_ns(), jobs=jobs.sample())
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        last = Snapshot(time.monotonic_ns(), jobs=jobs.sample())    # before it exits
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for d in reversed(made):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
    key = f"/{name}"
    assert list(first.jobs) == [key], first.jobs
    got = {(m, d): v for _, m, d, v in host_rows(first, last)}
    assert got[("mem.job.limit_bytes", key)] == 16 << 20
    assert got[("mem.job.usage_bytes", key)] >= 0.75 * (16 << 20)
    assert got[("vm.job.refault_per_s", key)] > 200, got     # pages read back, per second
    assert got[("vm.job.pgmajfault_per_s", key)] > 200, got
    assert ("psi.job.io.some_pct", key) in got and ("psi.job.memory.some_pct", key) in got
    assert got[("psi.job.io.some_pct", key)] > 1.0, got      # it waited on its reads
