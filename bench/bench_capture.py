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
    short = capture_cpu(2.0)
    long = capture_cpu(2.0 + a.seconds)
    share = (long - short) / a.seconds
    print(f"whole capture (--no-ebpf, 10 Hz host, 1 Hz clock, 1 Hz target scan): "
          f"{share * 100:.2f}% of one core steady state; start-up + seal {short:.2f} s CPU "
          f"for a 2 s run")


if __name__ == "__main__":
    main()
