"""Benchmark ingero-export --chrome-trace: events/s written and peak memory.

Builds fleet.db files of two sizes on the real fleet schema (tests/export/fleetgen.py),
exports each in a fresh process (so ru_maxrss is the export's own peak) and prints
events/s, MB/s, peak RSS, and the floor: a bare SQLite scan of the same event rows.
Flat memory shows as the same peak RSS for both sizes.

    python bench/bench_export.py [--steps 1500] [--gzip]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUILD = r"""
import sys
from tests.export.fleetgen import build_fleet
build_fleet(sys.argv[1], nodes=4, ranks_per_node=8, steps=int(sys.argv[2]), cuda_per_step=20)
"""

CHILD = r"""
import json, resource, sys, time
from ingero_forensics.export.chrome_trace import export_chrome_trace
from ingero_forensics.db import connect_readonly
db, out = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
stats = export_chrome_trace(db, out)
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
con = connect_readonly(db)
t1 = time.perf_counter(); rows = 0
for t in ("nccl_events", "nccl_comm_events", "cuda_events", "sched_events", "block_events",
          "tcp_events", "host_samples"):
    for _ in con.execute(f"SELECT * FROM {t}"):
        rows += 1
scan = time.perf_counter() - t1
print(json.dumps({"events": stats.events, "bytes": stats.bytes, "seconds": dt,
                  "peak_rss": rss, "scan_rows": rows, "scan_seconds": scan}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500, help="steps of the large fleet")
    ap.add_argument("--gzip", action="store_true", help="write .json.gz")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as d:
        print(f"{'steps':>6} {'events':>10} {'MB':>8} {'s':>7} {'events/s':>11} {'MB/s':>7} "
              f"{'peak RSS':>9} {'scan rows/s':>12} {'ratio':>6}")
        for steps in (max(1, args.steps // 4), args.steps):
            db = Path(d) / f"fleet-{steps}.db"
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            # Build in its own process: Linux keeps ru_maxrss across fork+exec, so a big
            # build here would show up as the export child's peak.
            subprocess.run([sys.executable, "-c", BUILD, str(db), str(steps)], env=env,
                           check=True)
            out = Path(d) / ("t.json.gz" if args.gzip else "t.json")
            res = subprocess.run([sys.executable, "-c", CHILD, str(db), str(out)],
                                 capture_output=True, text=True, env=env, check=True)
            r = json.loads(res.stdout)
            eps = r["events"] / r["seconds"]
            scan = r["scan_rows"] / r["scan_seconds"]
            print(f"{steps:>6} {r['events']:>10,} {r['bytes'] / 1e6:>8.1f} {r['seconds']:>7.2f} "
                  f"{eps:>11,.0f} {r['bytes'] / 1e6 / r['seconds']:>7.1f} "
                  f"{r['peak_rss'] / 2**20:>7.0f}Mi {scan:>12,.0f} {eps / scan:>6.2f}")
            db.unlink()


if __name__ == "__main__":
    main()
