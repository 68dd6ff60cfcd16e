"""Benchmark ingero-export --chrome-trace on a given (large) fleet.db.

Exports an existing fleet.db (for example one built by bench/bench_merge.py: 16 nodes x
2 M rows) in a fresh process per run and prints seconds, events/s, CPU user and system
time (parent and workers), peak RSS of the parent and of the largest worker, and the load
average before and after each run. The output file is fsync'd (as every export) and
removed after each run.

--per-kind also exports one node per kind (--kinds K --nodes NODE --no-findings
--jobs 1). --profile prints where the time goes: per section and node (in the worker
that ran it), the parent's flows, findings analysis, the copy of the part files and
fsync (wall seconds of each, from timers wrapped around the exporter's methods).

    python bench/bench_export_large.py --fleet /tmp/exp16/fleet.db [--jobs 1,2]
        [--repeat 2] [--gzip] [--per-kind] [--profile] [--out-dir DIR] [--kinds ...]
        [--no-findings] [--src DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, resource, sys, time
from ingero_forensics.export import chrome_trace as ct
db, out, jobs, kinds, nodes, findings, profile = sys.argv[1:8]
prof = []
if profile == "1":
    def wrap(owner, name, label=None):
        fn = getattr(owner, name)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                who = label or name
                self = a[0] if a else None
                node = getattr(self, "only_node", None)
                line = {"what": who, "node": node, "pid": os.getpid(),
                        "s": time.perf_counter() - t0}
                sys.stderr.write("PROF " + json.dumps(line) + "\n")
        setattr(owner, name, timed)
    for sec in ("nccl", "cuda", "cuda_instants", "sched", "block", "tcp", "host",
                "stats_rates", "flows", "windows", "findings", "metadata_events",
                "run_analysis"):
        wrap(ct._Exporter, sec)
    wrap(ct.Assembler, "part", "copy part")
    wrap(ct.os, "fsync", "fsync")
    if hasattr(ct, "Workers"):
        wrap(ct.Workers, "receive", "wait for workers")
def cpu():
    s, c = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return s.ru_utime + c.ru_utime, s.ru_stime + c.ru_stime
u0, s0 = cpu()
t0 = time.perf_counter()
opts = ct.ExportOptions(jobs=int(jobs), findings=findings == "1",
                        kinds=frozenset(kinds.split(",")),
                        nodes=tuple(n for n in nodes.split(",") if n))
stats = ct.export_chrome_trace(db, out, opts)
dt = time.perf_counter() - t0
u1, s1 = cpu()
print(json.dumps({"events": stats.events, "bytes": stats.bytes, "seconds": dt,
                  "user": u1 - u0, "sys": s1 - s0, "accelerated": stats.accelerated,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "worker_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""

KINDS = "nccl,cuda,tcp,sched,block,host"


def run_one(fleet, out, jobs, kinds, nodes="", findings=True, profile=False, src=ROOT):
    env = dict(os.environ, PYTHONPATH=str(src))
    load0 = os.getloadavg()[0]
    # cwd = src too: "python -c" puts the working directory first on sys.path
    res = subprocess.run([sys.executable, "-c", CHILD, str(fleet), str(out), str(jobs),
                          kinds, nodes, "1" if findings else "0", "1" if profile else "0"],
                         capture_output=True, text=True, env=env, cwd=str(src))
    Path(out).unlink(missing_ok=True)
    if res.returncode:
        sys.exit(f"export failed: {res.stderr.strip().splitlines()[-1:]}")
    r = json.loads(res.stdout)
    r["load_before"], r["load_after"] = load0, os.getloadavg()[0]
    r["profile"] = [json.loads(line[5:]) for line in res.stderr.splitlines()
                    if line.startswith("PROF ")]
    return r


def show(label, r):
    eps = r["events"] / r["seconds"]
    print(f"{label:<28} {r['events']:>11,} {r['bytes'] / 2**30:>7.2f} {r['seconds']:>7.2f} "
          f"{r['user']:>6.1f} {r['sys']:>6.1f} {eps / 1e6:>7.3f} "
          f"{r['peak_rss'] / 2**20:>6.0f}Mi {r['worker_rss'] / 2**20:>6.0f}Mi "
          f"{r['load_before']:>5.2f} {r['load_after']:>5.2f}", flush=True)


def show_profile(prof):
    by = {}
    for p in prof:
        key = p["what"]
        s, n, mx = by.get(key, (0.0, 0, 0.0))
        by[key] = (s + p["s"], n + 1, max(mx, p["s"]))
    print(f"  {'section':<18} {'total s':>8} {'calls':>6} {'max s':>7}")
    for key, (s, n, mx) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"  {key:<18} {s:>8.2f} {n:>6} {mx:>7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fleet", required=True, help="fleet.db to export (only read)")
    ap.add_argument("--jobs", default="2", help="comma-separated --jobs values (default 2)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per --jobs value")
    ap.add_argument("--gzip", action="store_true", help="write .json.gz")
    ap.add_argument("--kinds", default=KINDS, help=f"--kinds (default {KINDS})")
    ap.add_argument("--no-findings", action="store_true", help="leave the analysis out")
    ap.add_argument("--per-kind", action="store_true",
                    help="also one node per kind (--node), --jobs 1, no findings")
    ap.add_argument("--node", default=None, help="node for --per-kind (default: the 4th)")
    ap.add_argument("--profile", action="store_true", help="time sections and copies")
    ap.add_argument("--src", default=str(ROOT),
                    help="the ingero_forensics to run (PYTHONPATH; default this checkout): "
                         "an A/B against another version, e.g. a `git archive` of it with "
                         "its accelerator built in place")
    ap.add_argument("--out-dir", default=None,
                    help="directory for the output (a temporary directory is made in it; "
                         "default: the system's temp directory)")
    args = ap.parse_args()
    print("load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    with tempfile.TemporaryDirectory(prefix="bench-export-large-", dir=args.out_dir) as d:
        out = Path(d) / ("t.json.gz" if args.gzip else "t.json")
        print(f"{'run':<28} {'events':>11} {'GiB':>7} {'s':>7} {'user':>6} {'sys':>6} "
              f"{'M ev/s':>7} {'RSS':>8} {'worker':>8} {'load0':>5} {'load1':>5}")
        if args.per_kind:
            import apsw
            con = apsw.Connection(f"file:{args.fleet}?mode=ro", flags=apsw.SQLITE_OPEN_URI
                                  | apsw.SQLITE_OPEN_READONLY)
            names = [n for (n,) in con.execute("SELECT name FROM nodes ORDER BY name")]
            con.close()
            node = args.node or names[min(3, len(names) - 1)]
            for kind in ("cuda", "nccl", "sched", "host", "tcp,block"):
                r = run_one(args.fleet, out, 1, kind, node, False, args.profile, args.src)
                show(f"{node} {kind}", r)
                if args.profile:
                    show_profile(r["profile"])
        for jobs in (int(j) for j in args.jobs.split(",")):
            for _ in range(args.repeat):
                r = run_one(args.fleet, out, jobs, args.kinds, "", not args.no_findings,
                            args.profile, args.src)
                show(f"all --jobs {jobs}", r)
                if args.profile:
                    show_profile(r["profile"])
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
