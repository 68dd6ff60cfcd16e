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
from ingero_forensics.capture.cgroups import (JobCgroups, MemorySample, Mount, cgroup_mounts,
                                              cgroups_of, parse_memory_stat)
from ingero_forensics.capture.host import PAGE_BYTES, Snapshot, host_rows

METRICS = {m for m, _, _ in HOST_METRICS}

HYBRID = """\
25 30 0:22 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/cpu rw,nosuid shared:11 - cgroup cgroup rw,cpu
28 25 0:25 / /sys/fs/cgroup/memory rw,nosuid shared:12 - cgroup cgroup rw,memory
"""
PURE_V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
CONTAINER_V1 = "40 35 0:25 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"

PSI = "some avg10=0.00 avg60=0.00 avg300=0.00 total={}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total={}\n"
V1_STAT = ("cache 100\npgmajfault 5\nworkingset_refault_file 9\ntotal_cache 100\n"
           "total_pgmajfault {maj}\ntotal_workingset_refault_anon 1\n"
           "total_workingset_refault_file {ref}\n")
V2_STAT = "anon 4096\nfile 8192\nworkingset_refault_anon {ref}\nworkingset_refault_file 0\npgmajfault {maj}\n"


def test_mounts_hybrid_and_pure_v2(tmp_path):
    (tmp_path / "hybrid").write_text(HYBRID)
    (tmp_path / "v2").write_text(PURE_V2)
    (tmp_path / "container").write_text(CONTAINER_V1)
    v2, v1 = cgroup_mounts(str(tmp_path / "hybrid"))
    assert (v2.point, v2.root, v1.point, v1.root) == (
        "/sys/fs/cgroup/unified", "/", "/sys/fs/cgroup/memory", "/")
    v2, v1 = cgroup_mounts(str(tmp_path / "v2"))
    assert (v2.point, v1) == ("/sys/fs/cgroup", None)
    assert cgroup_mounts(str(tmp_path / "none")) == (None, None)
    # a container's view of the host's v1 hierarchy: its mount shows its own cgroup
    _, v1 = cgroup_mounts(str(tmp_path / "container"))
    assert v1.root == "/docker/abc"
    assert v1.dir_of("/docker/abc") == "/sys/fs/cgroup/memory"
    assert v1.dir_of("/docker/abc/step") == "/sys/fs/cgroup/memory/step"
    assert v1.dir_of("/docker/abcd") is None and v1.dir_of("/other") is None


def test_paths_outside_the_mount_are_refused():
    m = Mount("/sys/fs/cgroup")
    assert m.dir_of("/job.scope") == "/sys/fs/cgroup/job.scope"
    # a process of another cgroup namespace shows its cgroup relative to ours
    assert m.dir_of("/../../other.slice") is None
    assert m.dir_of("relative") is None


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


def _tree(tmp_path, some, full, maj, ref, limit="25165824", v1_path="/job", v2_path="/job"):
    """A hybrid machine: pid 7 in v2 ``v2_path`` and v1 memory ``v1_path``, pid 8 in the
    root of both."""
    proc, v2, v1 = tmp_path / "proc", tmp_path / "unified", tmp_path / "memory"
    (proc / "7").mkdir(parents=True, exist_ok=True)
    (proc / "7" / "cgroup").write_text(f"4:memory:{v1_path}\n0::{v2_path}\n")
    (proc / "8").mkdir(parents=True, exist_ok=True)
    (proc / "8" / "cgroup").write_text("4:memory:/\n0::/\n")
    d2, d1 = v2 / v2_path.lstrip("/"), v1 / v1_path.lstrip("/")
    d2.mkdir(parents=True, exist_ok=True)
    d1.mkdir(parents=True, exist_ok=True)
    (d2 / "cgroup.type").write_text("domain\n")
    (d2 / "cgroup.procs").write_text("7\n")
    for res in ("cpu", "io", "memory"):
        (d2 / f"{res}.pressure").write_text(PSI.format(some, full))
        (v2 / f"{res}.pressure").write_text(PSI.format(some, full))   # the root's
    (d1 / "memory.usage_in_bytes").write_text("20971520\n")
    (d1 / "memory.limit_in_bytes").write_text(limit + "\n")
    (d1 / "memory.stat").write_text(V1_STAT.format(maj=maj, ref=ref))
    return proc, Mount(str(v2)), Mount(str(v1))


def test_sampler_rows_on_a_made_up_tree(tmp_path):
    proc, v2, v1 = _tree(tmp_path, some=1_000, full=500, maj=10, ref=100)
    jobs = JobCgroups(lambda: {7, 8}, proc=str(proc), mounts=(v2, v1))
    psi, mem = jobs.sample()
    # the root cgroup is /proc's own figure: left out
    assert list(psi) == ["/job"] and list(mem) == ["/job"]
    a = Snapshot(1_000_000_000, job_psi=psi, job_mem=mem)
    _tree(tmp_path, some=251_000, full=50_500, maj=60, ref=1_100)
    psi, mem = jobs.sample()        # the same descriptors, read again
    b = Snapshot(1_500_000_000, job_psi=psi, job_mem=mem)
    rows = host_rows(a, b)
    assert {m for _, m, _, _ in rows} <= METRICS
    got = {(m, d): v for _, m, d, v in rows}
    assert got[("psi.job.memory.some_pct", "/job")] == pytest.approx(50.0)
    assert got[("psi.job.io.full_pct", "/job")] == pytest.approx(10.0)
    assert ("psi.job.cpu.full_pct", "/job") not in got     # not in the catalogue
    # the v1 totals (anon 1 unchanged, file 100 -> 1,100 pages), in bytes per second
    assert got[("vm.job.refault_bytes_per_s", "/job")] == pytest.approx(2000.0 * PAGE_BYTES)
    assert got[("vm.job.pgmajfault_per_s", "/job")] == pytest.approx(100.0)
    assert got[("mem.job.usage_bytes", "/job")] == 20971520
    assert got[("mem.job.limit_bytes", "/job")] == 25165824
    jobs.close()
    # v1's "no limit" (2^63 rounded down to a page) writes no limit row
    _tree(tmp_path, some=1, full=1, maj=1, ref=1, limit="9223372036854771712")
    _, mem = JobCgroups(lambda: {7}, proc=str(proc), mounts=(v2, v1)).sample()
    assert mem["/job"].limit is None


def test_hybrid_slurm_node_names_each_hierarchy_apart(tmp_path):
    """On a hybrid Slurm node the job's v1 memory cgroup is its step's, its v2 cgroup
    systemd's: each row names the cgroup it was read from, and two steps stay two."""
    proc, v2, v1 = _tree(tmp_path, some=1, full=1, maj=1, ref=1,
                         v1_path="/slurm/uid_0/job_9/step_0", v2_path="/system.slice/slurmd.service")
    (proc / "9").mkdir()
    (proc / "9" / "cgroup").write_text(
        "4:memory:/slurm/uid_0/job_9/step_1\n0::/system.slice/slurmd.service\n")
    # slurmd's service holds slurmd and every job's processes: its pressure is not the job's
    (tmp_path / "unified" / "system.slice/slurmd.service" / "cgroup.procs").write_text(
        "1234\n7\n9\n")
    (tmp_path / "memory" / "slurm/uid_0/job_9/step_0" / "memory.stat").write_text(
        V1_STAT.format(maj=1, ref=1) + "hierarchical_memory_limit 4194304\n")
    step1 = tmp_path / "memory" / "slurm/uid_0/job_9/step_1"
    step1.mkdir(parents=True)
    (step1 / "memory.usage_in_bytes").write_text("1048576\n")
    (step1 / "memory.limit_in_bytes").write_text("2097152\n")
    (step1 / "memory.stat").write_text(V1_STAT.format(maj=1, ref=1))
    psi, mem = JobCgroups(lambda: {7, 9}, proc=str(proc), mounts=(v2, v1)).sample()
    assert psi == {}
    assert sorted(mem) == ["/slurm/uid_0/job_9/step_0", "/slurm/uid_0/job_9/step_1"]
    assert mem["/slurm/uid_0/job_9/step_1"].limit == 2097152
    # a limit on the job over its step (v1: hierarchical_memory_limit) is the step's too
    assert mem["/slurm/uid_0/job_9/step_0"].limit == 4194304
    rows = host_rows(None, Snapshot(1, job_psi=psi, job_mem=mem))
    assert not [r for r in rows if r[1].startswith("psi.job.")]
    assert {(m, d) for _, m, d, _ in rows if m.startswith("mem.job.")} == {
        ("mem.job.usage_bytes", "/slurm/uid_0/job_9/step_0"),
        ("mem.job.limit_bytes", "/slurm/uid_0/job_9/step_0"),
        ("mem.job.usage_bytes", "/slurm/uid_0/job_9/step_1"),
        ("mem.job.limit_bytes", "/slurm/uid_0/job_9/step_1")}


def test_v2_memory_controller_and_a_parents_limit(tmp_path):
    """A pure v2 machine (a Kubernetes pod, a Slurm cgroup/v2 step): the memory comes
    from the v2 cgroup, its limit the lowest of its own and its parents'; its pressure is
    read though a process not traced shares it (the pod's pause process)."""
    v2 = tmp_path / "cg"
    pod = v2 / "kubepods.slice" / "pod1"
    ctr = pod / "ctr"
    ctr.mkdir(parents=True)
    (v2 / "kubepods.slice" / "memory.max").write_text("max\n")
    (pod / "memory.max").write_text("8388608\n")
    for name, text in (("memory.current", "8000000\n"), ("memory.max", "max\n"),
                       ("memory.stat", V2_STAT.format(maj=1, ref=2)), ("cgroup.type", "domain\n"),
                       ("cgroup.procs", "7\n55\n")):
        (ctr / name).write_text(text)
    for res in ("cpu", "io", "memory"):
        (ctr / f"{res}.pressure").write_text(PSI.format(1, 1))
    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("0::/kubepods.slice/pod1/ctr\n")
    psi, mem = JobCgroups(lambda: {7}, proc=str(proc), mounts=(Mount(str(v2)), None)).sample()
    key = "/kubepods.slice/pod1/ctr"
    assert list(psi) == [key] and list(mem) == [key]
    assert mem[key].limit == 8388608 and mem[key].usage == 8000000
    assert mem[key].refault_bytes == 2 * PAGE_BYTES


def test_inside_a_cgroup_namespace_the_jobs_root_is_its_own(tmp_path):
    """In a private cgroup namespace (a container) the job's cgroup reads as "/": it is
    sampled, since the directory it maps to is no machine root (it has cgroup.type)."""
    proc, v2, v1 = _tree(tmp_path, some=1, full=1, maj=1, ref=1)
    (proc / "8" / "cgroup").write_text("0::/\n")
    psi, _ = JobCgroups(lambda: {8}, proc=str(proc), mounts=(v2, v1)).sample()
    assert psi == {}                                     # the machine's root
    ns_root = Mount(str(tmp_path / "unified" / "job"))   # that cgroup, seen from inside
    (tmp_path / "unified" / "job" / "cgroup.procs").write_text("8\n")
    psi, _ = JobCgroups(lambda: {8}, proc=str(proc), mounts=(ns_root, None)).sample()
    assert list(psi) == ["/"]


def test_no_cgroup_of_its_own_writes_nothing(tmp_path):
    proc, v2, v1 = _tree(tmp_path, some=1, full=1, maj=1, ref=1)
    jobs = JobCgroups(lambda: {8, 99}, proc=str(proc), mounts=(v2, v1))
    assert jobs.sample() == ({}, {})


def test_a_cgroup_that_went_away_is_dropped(tmp_path):
    proc, v2, v1 = _tree(tmp_path, some=1, full=1, maj=1, ref=1)
    jobs = JobCgroups(lambda: {7}, proc=str(proc), mounts=(v2, v1))
    psi, mem = jobs.sample()
    assert "/job" in psi and "/job" in mem
    (proc / "7" / "cgroup").unlink()          # the process is gone
    jobs._refreshed = -1e9
    assert jobs.sample() == ({}, {}) and not jobs._psi and not jobs._mem   # closed
    # a counter that went backwards (a new cgroup of the same name) writes no rate
    a = Snapshot(1, job_mem={"/job": MemorySample(1, None, 5, 500 * PAGE_BYTES)})
    b = Snapshot(2_000_000_001, job_mem={"/job": MemorySample(1, None, 6, 5 * PAGE_BYTES)})
    got = {r[1] for r in host_rows(a, b)}
    assert "vm.job.refault_bytes_per_s" not in got and "vm.job.pgmajfault_per_s" in got


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
    # (a killed run's cgroup may remain, and pids are reused)
    name = f"ingero-test-{os.getpid()}-{os.urandom(3).hex()}"
    made = []
    proc = subprocess.Popen([sys.executable, "-c", THRASH, str(data), "3"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        roots = [Path(v2.point)] + ([Path(v1_memory.point)] if v1_memory else [])
        for root in roots:
            (root / name).mkdir()
            made.append(root / name)
            (root / name / "cgroup.procs").write_text(f"{proc.pid}\n")
        if v1_memory:
            (Path(v1_memory.point) / name / "memory.limit_in_bytes").write_text(f"{16 << 20}\n")
        else:
            ctl = Path(v2.point) / "cgroup.subtree_control"
            if "memory" not in ctl.read_text().split():
                ctl.write_text("+memory\n")
            (Path(v2.point) / name / "memory.max").write_text(f"{16 << 20}\n")
        # its pages were cached (and charged) when the file was written: evict them
        fd = os.open(data, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        jobs = JobCgroups(lambda: {proc.pid})
        first = Snapshot(time.monotonic_ns(), **dict(zip(("job_psi", "job_mem"), jobs.sample())))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        # before it exits
        last = Snapshot(time.monotonic_ns(), **dict(zip(("job_psi", "job_mem"), jobs.sample())))
        jobs.close()
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
    assert list(first.job_psi) == [key] and list(first.job_mem) == [key], first
    got = {(m, d): v for _, m, d, v in host_rows(first, last)}
    assert got[("mem.job.limit_bytes", key)] == 16 << 20
    assert got[("mem.job.usage_bytes", key)] >= 0.75 * (16 << 20)
    assert got[("vm.job.refault_bytes_per_s", key)] > 200 * PAGE_BYTES, got   # read back
    assert got[("vm.job.pgmajfault_per_s", key)] > 200, got
    assert ("psi.job.io.some_pct", key) in got and ("psi.job.memory.some_pct", key) in got
    assert got[("psi.job.io.some_pct", key)] > 1.0, got      # it waited on its reads
