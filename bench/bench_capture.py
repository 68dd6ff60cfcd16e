"""Capture overhead: host sampler CPU per sample and the whole no-eBPF capture's CPU share.

    python bench/bench_capture.py [--samples 3000] [--seconds 20]

1. Host sampler: ``--samples`` samples back to back (as fast as possible), each read,
   parsed, turned into rows and written through a real BundleWriter (committed every
   10 samples, as the capture does about once a second). CPU time per sample, and the
   share of one core that is at 10 Hz. Floor: only re-reading the same /proc files
   (pread at offset 0), no parsing and no SQLite.
2. Whole capture: ``ingero-capture --no-ebpf`` run for 2 s and for 2 + ``--seconds`` s;
   the difference of their CPU times (user + system, from wait4) divided by
   ``--seconds`` is the steady-state share of one core (start-up and sealing cancel).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ingero_forensics.bundle.writer import BundleWriter  # noqa: E402
from ingero_forensics.capture.host import HostSource, ProcReader  # noqa: E402
from ingero_forensics.capture.identity import host_facts  # noqa: E402


class _Sink:
    def __init__(self, w):
        self.w = w

    def add_many(self, table, rows):
        self.w.add_many(table, rows)


def bench_sampler(n: int) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as d:
        w = BundleWriter(Path(d) / "s.db", node="bench", host=host_facts())
        src = HostSource()
        src.start(None)
        sink = _Sink(w)
        src.sample(sink)
        t0 = time.process_time()
        for i in range(n):
            src.sample(sink)
            if i % 10 == 9:
                w.flush()
        w.flush()
        per_sample = (time.process_time() - t0) / n
        rows_per_sample = w.rows["host_samples"] / (n + 1)
        src.stop(sink)
        w.abort()
        reader = ProcReader()
        t0 = time.process_time()
        for _ in range(n):
            for key in reader.fds:
                reader.read(key)
        floor = (time.process_time() - t0) / n
        reader.close()
    return per_sample, floor, rows_per_sample


def bench_job_cgroups(n: int, k: int) -> tuple[float, float, int] | None:
    """CPU per sample of the traced processes' cgroups (capture/cgroups.py): k cgroups
    made for the bench (one sleeping process each: in v2 and the v1 memory hierarchy
    where bound), sampled n times, refreshes included; the floor is a pread of the same
    files. None without root or a cgroup v2 hierarchy."""
    from ingero_forensics.capture.cgroups import JobCgroups, cgroup_mounts
    v2, v1 = cgroup_mounts()
    if os.geteuid() != 0 or v2 is None:
        return None
    roots = [Path(v2.point)] + ([Path(v1.point)] if v1 else [])
    made, procs = [], []
    try:
        for i in range(k):
            p = subprocess.Popen(["sleep", "600"])
            procs.append(p)
            for root in roots:
                d = root / f"ingero-bench-{os.getpid()}-{i}"
                d.mkdir()
                made.append(d)
                (d / "cgroup.procs").write_text(f"{p.pid}\n")
        jobs = JobCgroups(lambda: {p.pid for p in procs})
        psi, mem = jobs.sample()
        t0 = time.process_time()
        for _ in range(n):
            jobs.sample()
        per = (time.process_time() - t0) / n
        files = [f for files in jobs._psi.values() for f in files.fds] + \
            [f for files, _ in jobs._mem.values() for f in files.fds]
        fds = [fd for files in jobs._psi.values() for fd in files.fds.values()] + \
            [fd for files, _ in jobs._mem.values() for fd in files.fds.values()]
        t0 = time.process_time()
        for _ in range(n):
            for fd in fds:
                os.pread(fd, 1 << 16, 0)
        floor = (time.process_time() - t0) / n
        jobs.close()
        return per, floor, len(files)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for d in reversed(made):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


def capture_cpu(seconds: float) -> float:
    with tempfile.TemporaryDirectory() as d:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-m", "ingero_forensics.capture", "--bundle", d,
                        "--node", "bench", "--no-ebpf", "--quiet", "--duration", str(seconds)],
                       check=True, cwd=ROOT)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    per, floor, rows = bench_sampler(a.samples)
    print(f"host sampler: {per * 1e6:.0f} us CPU per sample ({rows:.0f} rows), "
          f"{per * 10 * 100:.2f}% of one core at 10 Hz; "
          f"floor (pread only) {floor * 1e6:.0f} us, ratio {per / floor:.1f}x; "
          f"{os.cpu_count()} CPUs")
    for k in (1, 16):
        got = bench_job_cgroups(a.samples, k)
        if got is None:
            print("job cgroups: not measured (needs root and a cgroup v2 hierarchy)")
            break
        per_j, floor_j, files = got
        print(f"job cgroups, {k} cgroup(s): {per_j * 1e6:.0f} us CPU per sample ({files} "
              f"files), {per_j * 10 * 100:.2f}% of one core at 10 Hz; floor (pread only) "
              f"{floor_j * 1e6:.0f} us, ratio {per_j / floor_j:.1f}x")
    short = capture_cpu(2.0)
    long = capture_cpu(2.0 + a.seconds)
    share = (long - short) / a.seconds
    print(f"whole capture (--no-ebpf, 10 Hz host, 1 Hz clock, 1 Hz target scan): "
          f"{share * 100:.2f}% of one core steady state; start-up + seal {short:.2f} s CPU "
          f"for a 2 s run")


if __name__ == "__main__":
    main()
