"""What the block source costs per request, with and without the request's task taken at
block_io_start (needs root, BCC: scripts/setup-ebpf.sh).

N direct (O_DIRECT) 4 KiB reads at random offsets of a 64 MiB file on the disk under
/var/tmp: one block request each, issued and completed while the reader waits. Timed
without a capture, with the block source as on a kernel without block_io_start (the task
current at issue) and as it runs here (block_io_start as well), alternating, median of
--repeats. A disk read takes tens of
microseconds and scatters by more than the probes cost, so the probes are also measured
in the kernel: the run time of the source's BPF programs (kernel.bpf_stats_enabled,
switched on for the bench and restored) per request.

Usage: python bench/bench_block.py [--reads N] [--repeats N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ingero_forensics.capture.ebpf import block  # noqa: E402
from ingero_forensics.capture.ebpf._bcc import tracepoint_exists  # noqa: E402
from ingero_forensics.capture.host import bpf_run_time_ns  # noqa: E402
from ingero_forensics.capture.source import CaptureOptions  # noqa: E402

from polled import Polled  # noqa: E402  (bench/polled.py)

FILE_SIZE = 64 << 20
READ = 4096


def reads(path: str, n: int, seed: int) -> float:
    """Seconds for n direct 4 KiB reads at random aligned offsets."""
    rng = random.Random(seed)
    offsets = [rng.randrange(FILE_SIZE // READ) * READ for _ in range(n)]
    buf = mmap.mmap(-1, READ)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for off in offsets:
            os.preadv(fd, [buf], off)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def one_run(path: str, n: int, capture: str | None, seed: int) -> tuple[float, int, int, int]:
    """(seconds, rows, rows of this process, BPF run time in ns); capture None, 'issue'
    (the task at issue) or 'start' (block_io_start)."""
    if capture is None:
        return reads(path, n, seed), 0, 0, 0
    opts = CaptureOptions()
    mine = []
    p = Polled(block.BlockSource(opts), opts,
               on_rows=lambda table, rows: mine.extend(r for r in rows if r[7] == os.getpid()))
    if capture == "start":
        exists = tracepoint_exists
    else:       # the source as it was: no block_io_start
        def exists(cat, ev):
            return ev != "block_io_start" and tracepoint_exists(cat, ev)
    with mock.patch.object(block, "tracepoint_exists", exists):
        p.__enter__()           # compiles the program, which looks for the tracepoint
    try:
        before = bpf_run_time_ns() or 0
        secs = reads(path, n, seed)
        ns = (bpf_run_time_ns() or 0) - before
        time.sleep(0.1)
    finally:
        p.__exit__(None, None, None)
    return secs, p.rows, len(mine), ns


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reads", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp", help="a directory on a block device")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_block: needs root")
    if not tracepoint_exists("block", "block_io_start"):
        sys.exit("bench_block: this kernel has no block:block_io_start (before 6.5)")
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    was = stats.read_text().strip()
    stats.write_text("1")
    try:
        with tempfile.NamedTemporaryFile(dir=a.dir) as f:
            f.write(os.urandom(FILE_SIZE))
            f.flush()
            os.fsync(f.fileno())
            run(a, f.name)
    finally:
        stats.write_text(was)


def run(a, path: str) -> None:
    print(f"block source cost on {os.uname().release}, {os.cpu_count()} CPUs, "
          f"{a.reads:,} direct 4 KiB reads per run; medians of {a.repeats}, alternating")
    times = {None: [], "issue": [], "start": []}
    bpf = {"issue": [], "start": []}
    rows = {"issue": [], "start": []}
    for rep in range(a.repeats):
        for cap in (None, "issue", "start"):
            secs, r, mine, ns = one_run(path, a.reads, cap, rep)
            times[cap].append(secs)
            if cap is not None:
                bpf[cap].append(ns / max(r, 1))
                rows[cap].append((r, mine))
    med = {k: statistics.median(v) for k, v in times.items()}
    per = {k: v / a.reads * 1e6 for k, v in med.items()}
    kern = {k: statistics.median(v) for k, v in bpf.items()}
    print(f"per read: no capture {per[None]:.1f} us (the floor); task at issue "
          f"{per['issue']:.1f} us; task at block_io_start {per['start']:.1f} us "
          f"({(med['start'] / med['issue'] - 1) * 100:+.1f} % against at issue, elapsed)")
    print(f"BPF run time per request: {kern['issue']:,.0f} ns at issue, "
          f"{kern['start']:,.0f} ns with block_io_start "
          f"({kern['start'] - kern['issue']:+,.0f} ns)")
    for cap in ("issue", "start"):
        r, mine = rows[cap][-1]
        print(f"rows of the last run ({cap}): {r:,}, of this process {mine:,}")


if __name__ == "__main__":
    main()
