"""Benchmark ingero-export --chrome-trace: events/s written and peak memory.

Builds fleet.db files of two sizes on the real fleet schema (tests/export/fleetgen.py),
exports each in a fresh process (so ru_maxrss is the export's own peak) and prints
events/s, MB/s, peak RSS of the parent and of the largest worker (RUSAGE_CHILDREN), and
the floor: a bare single-threaded SQLite scan of the same event rows. Flat memory shows
as the same peak RSS for both sizes. Each size is exported once per --jobs value and
--accel value: "on" is the C accelerator (ingero_forensics.export._fastslices), "off" the
pure-Python path (INGERO_NO_ACCEL=1). CPU s is the export's user + system time, parent
and workers together. The load average is printed before and after: the figures only
mean something next to it.

    python bench/bench_export.py [--steps 1500] [--gzip] [--jobs 1,2] [--accel on,off]
                                 [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from itertools import product
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
from ingero_forensics.export.chrome_trace import ExportOptions
db, out, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
def cpu():
    s, c = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
c0 = cpu()
t0 = time.perf_counter()
stats = export_chrome_trace(db, out, ExportOptions(jobs=jobs))
dt = time.perf_counter() - t0
cpu_s = cpu() - c0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
worker_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
con = connect_readonly(db)
t1 = time.perf_counter(); rows = 0
for t in ("nccl_events", "nccl_comm_events", "cuda_events", "sched_events", "block_events",
          "tcp_events", "host_samples"):
    for _ in con.execute(f"SELECT * FROM {t}"):
        rows += 1
scan = time.perf_counter() - t1
print(json.dumps({"events": stats.events, "bytes": stats.bytes, "seconds": dt, "cpu": cpu_s,
                  "accelerated": stats.accelerated,
                  "peak_rss": rss, "worker_rss": worker_rss, "scan_rows": rows,
                  "scan_seconds": scan}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500, help="steps of the large fleet")
    ap.add_argument("--gzip", action="store_true", help="write .json.gz")
    ap.add_argument("--jobs", default="1,2", help="comma-separated --jobs values (default 1,2)")
    ap.add_argument("--accel", default="on,off",
                    help="on (C accelerator), off (Python path), or both (default on,off)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size and --jobs value")
    args = ap.parse_args()
    jobs_values = [int(j) for j in args.jobs.split(",")]
    accel_values = [a.strip() for a in args.accel.split(",")]
    if set(accel_values) - {"on", "off"}:
        ap.error("--accel: on, off or on,off")
    print("load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    with tempfile.TemporaryDirectory(prefix="bench-export-") as d:
        print(f"{'steps':>6} {'jobs':>4} {'accel':>5} {'events':>10} {'MB':>8} {'s':>7} "
              f"{'CPU s':>6} {'events/s':>11} {'MB/s':>7} {'RSS parent':>10} {'worker':>7} "
              f"{'scan rows/s':>12} {'ratio':>6}")
        for steps in (max(1, args.steps // 4), args.steps):
            db = Path(d) / f"fleet-{steps}.db"
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            # Build in its own process: Linux keeps ru_maxrss across fork+exec, so a big
            # build here would show up as the export child's peak.
            subprocess.run([sys.executable, "-c", BUILD, str(db), str(steps)], env=env,
                           check=True)
            os.sync()   # the build's dirty pages would be written back during the export
            out = Path(d) / ("t.json.gz" if args.gzip else "t.json")
            for jobs, accel in product(jobs_values, accel_values):
                run_env = dict(env, INGERO_NO_ACCEL="1" if accel == "off" else "0")
                for _ in range(args.repeat):
                    res = subprocess.run([sys.executable, "-c", CHILD, str(db), str(out),
                                          str(jobs)],
                                         capture_output=True, text=True, env=run_env,
                                         check=True)
                    r = json.loads(res.stdout)
                    if r["accelerated"] != (accel == "on"):
                        sys.exit("--accel on: the C accelerator is not built "
                                 "(pip install -e . with gcc)")
                    eps = r["events"] / r["seconds"]
                    scan = r["scan_rows"] / r["scan_seconds"]
                    wr = f"{r['worker_rss'] / 2**20:>5.0f}Mi" if jobs > 1 else f"{'-':>7}"
                    print(f"{steps:>6} {jobs:>4} {accel:>5} {r['events']:>10,} "
                          f"{r['bytes'] / 1e6:>8.1f} {r['seconds']:>7.2f} {r['cpu']:>6.2f} "
                          f"{eps:>11,.0f} {r['bytes'] / 1e6 / r['seconds']:>7.1f} "
                          f"{r['peak_rss'] / 2**20:>8.0f}Mi {wr} {scan:>12,.0f} "
                          f"{eps / scan:>6.2f}", flush=True)
            db.unlink()
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
