"""Benchmark ingero-report on the issue's largest fleet: 64 nodes x 8 ranks x 2,000 steps.

Simulates the fleet (ingero-simulate, a CPU fault, NTP steps) and merges it, unless
DIR/fleet.db already exists (it is reused, whatever merge wrote it, and its version is
printed: building it takes minutes and ~5 GiB), then
runs `ingero-report DIR/fleet.db -o DIR/report.html` in a fresh process per run and
prints the seconds, the CPU time and peak RSS of that process, the page's size and the
load average. Targets (issue 19): <= 10 s and < 1 MB.

    nice -n 10 python bench/bench_report.py [--dir /tmp/bench-report-64] [--repeat 3]
        [--nodes 64 --ranks-per-node 8 --steps 2000] [--format html|text] [--src DIR ...]

With several --src (source trees: this checkout, a `git archive` of another version),
the runs alternate between them (A, B, A, B, ...), each figure under its tree: an A/B
on the same fleet, the same machine and the same minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_S = 10.0
TARGET_BYTES = 1_000_000


def build(d: Path, nodes: int, ranks: int, steps: int) -> Path:
    from ingero_forensics.merge import merge_bundles
    from ingero_forensics.simulate import FleetConfig, simulate_fleet

    db = d / "fleet.db"
    if db.exists():
        # a fleet.db of an older merge is reused as it is: the report then reads the raw
        # tables (version 3: no host_bins, job_block_io, sync_waits), which is slower
        import sqlite3
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        ver = con.execute("PRAGMA user_version").fetchone()[0]
        con.close()
        print(f"reusing {db} ({db.stat().st_size / 2**30:.2f} GiB, fleet.db version {ver})")
        return db
    d.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    simulate_fleet(d / "bundles", FleetConfig(nodes=nodes, ranks_per_node=ranks, steps=steps,
                                              fault="cpu", ntp_step=True, seed=1),
                   overwrite=True)
    print(f"simulated {nodes} x {ranks} x {steps} in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    tmp = d / "fleet.db.tmp"
    tmp.unlink(missing_ok=True)
    merge_bundles([d / "bundles"], tmp)
    os.replace(tmp, db)
    print(f"merged in {time.perf_counter() - t:.1f} s: {db.stat().st_size / 2**30:.2f} GiB")
    return db


def run_once(db: Path, out: Path, fmt: str, src: Path = ROOT) -> tuple[float, float, int]:
    """One report in a fresh process: wall s, its CPU s and its peak RSS (KiB; wait4 gives
    this child's own, not the largest of all children so far)."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "ingero_forensics.report.cli", str(db), "-o", str(out), "-q"]
    if fmt != "html":
        cmd += ["--format", fmt]
    # cwd and PYTHONPATH = src: "python -m" puts the working directory first on sys.path
    proc = subprocess.Popen(cmd, cwd=str(src), env=dict(os.environ, PYTHONPATH=str(src)))
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return time.perf_counter() - t, ru.ru_utime + ru.ru_stime, ru.ru_maxrss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/bench-report-64", type=Path)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--format", default="html", choices=["html", "text", "markdown"])
    ap.add_argument("--src", action="append", type=Path, default=None,
                    help="the ingero_forensics to run (PYTHONPATH; default this checkout); "
                         "give it twice or more to alternate between versions (an A/B)")
    args = ap.parse_args()
    srcs = [p.resolve() for p in args.src] if args.src else [ROOT]
    db = build(args.dir, args.nodes, args.ranks_per_node, args.steps)
    out = args.dir / ("report.html" if args.format == "html" else "report.txt")
    walls: dict[Path, list[float]] = {s: [] for s in srcs}
    sizes: dict[Path, int] = {}
    for i in range(args.repeat):
        for src in srcs:
            load = os.getloadavg()[0]
            wall, cpu, rss = run_once(db, out, args.format, src)
            walls[src].append(wall)
            size = sizes[src] = out.stat().st_size
            print(f"run {i + 1}{f' [{src}]' if len(srcs) > 1 else ''}: {wall:.2f} s wall, "
                  f"{cpu:.2f} s CPU, peak RSS {rss / 1024:.0f} MiB, page {size:,} bytes "
                  f"({size / 1e6:.3f} MB), load before {load:.1f}")
    for src in srcs:
        best, size = min(walls[src]), sizes[src]
        print(f"ingero-report {args.nodes} x {args.ranks_per_node} x {args.steps}"
              f"{f' [{src}]' if len(srcs) > 1 else ''}: best {best:.2f} s (target <= "
              f"{TARGET_S:.0f} s: {'met' if best <= TARGET_S else 'MISSED'}), page "
              f"{size / 1e6:.3f} MB (target < 1 MB: {'met' if size < TARGET_BYTES else 'MISSED'})")


if __name__ == "__main__":
    main()
