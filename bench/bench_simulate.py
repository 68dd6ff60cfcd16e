"""Benchmark ingero-simulate: events (rows of every table) generated per second.

    python bench/bench_simulate.py                 # 16 nodes x 8 ranks x 500 steps
    python bench/bench_simulate.py --nodes 64 --steps 2000   # the issue's largest fleet

Prints wall-clock and CPU rates, peak memory of a worker, and the floor: how fast this
machine inserts simple rows into a WAL SQLite file with apsw executemany in one process
(the cost of writing alone, without generating anything), times the workers used.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ingero_forensics.db import connect_writable  # noqa: E402
from ingero_forensics.simulate import FleetConfig, simulate_fleet  # noqa: E402


def sqlite_floor(tmp: Path, n: int = 400_000) -> float:
    """Rows/s for executemany of host_samples-shaped rows into a WAL database."""
    con = connect_writable(tmp / "floor.db", wal=True)
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, ts INTEGER NOT NULL, "
                "metric TEXT NOT NULL, device TEXT, value REAL NOT NULL)")
    rows = [(1_000_000 + i, "cpu.busy_pct", None, 1.5 * i) for i in range(n)]
    t = time.perf_counter()
    for i in range(0, n, 100_000):
        with con:
            con.executemany("INSERT INTO t (ts, metric, device, value) VALUES (?, ?, ?, ?)",
                            rows[i:i + 100_000])
    dt = time.perf_counter() - t
    con.close()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--fault", default="cpu")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="bench-simulate-"))
    try:
        floor = sqlite_floor(tmp)
        cfg = FleetConfig(nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                          steps=args.steps, fault=args.fault, ntp_step=True,
                          workers=args.workers)
        workers = max(1, min(cfg.workers or os.cpu_count() or 1, cfg.nodes))
        c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        res = simulate_fleet(tmp / "fleet", cfg, overwrite=True)
        c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = sum(b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime for a, b in zip(c0, c1))
        size = sum(p.stat().st_size for p in res.bundles)
        rate = res.events / res.seconds
        print(f"fleet            {args.nodes} nodes x {args.ranks_per_node} ranks x "
              f"{args.steps} steps, fault {args.fault}, {workers} worker(s), "
              f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}")
        print(f"events           {res.events:,} rows in {len(res.bundles)} bundles "
              f"({size / 2**20:.1f} MiB compressed)")
        print(f"wall             {res.seconds:.2f} s  -> {rate:,.0f} events/s")
        print(f"cpu              {cpu:.2f} s  -> {res.events / cpu:,.0f} events per CPU-second")
        print(f"peak RSS         parent {c1[0].ru_maxrss / 1024:.0f} MiB, largest worker "
              f"{c1[1].ru_maxrss / 1024:.0f} MiB")
        print(f"floor            sqlite executemany {floor:,.0f} rows/s per process; "
              f"x{workers} workers = {floor * workers:,.0f} rows/s; "
              f"simulate/floor = {rate / (floor * workers):.2f}")
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
