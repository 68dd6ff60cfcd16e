"""Benchmark ingero-merge: N nodes x E events per node, end to end.

Prints events/s, peak RSS of the merge process, and the ratio to a floor: plain
``sqlite3`` (the standard library module) ATTACH + INSERT ... SELECT of the same rows
from the already decompressed bundle images into one database.

The bundles are real: written by BundleWriter (rows generated inside SQLite with a
recursive CTE so the set-up takes seconds, not minutes) and sealed with zstd. The rows
follow the shared model closely enough to exercise every part of the merge: collectives
with (comm_id_hash, seq) on every node, a waiting cudaStreamSynchronize after each,
clock samples every second with an NTP step, TCP, sched, block and host rows.

Usage: python bench/bench_merge.py [--nodes 16] [--events 2000000] [--dir DIR] [--keep]
                                   [--repeat N]
       python bench/bench_merge.py --bundles DIR   (merge existing bundles, e.g. a simulator fleet)

--repeat N merges N times, each in a fresh process, and prints the median, the best and
the worst. On a VM the spread is wide (docs/performance.md, "Merge"): report the median.

Besides events/s it prints CPU seconds, the load average and when each phase ended.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ingero_forensics.bundle import BundleWriter, open_bundle  # noqa: E402
from ingero_forensics.bundle.schema import MANIFEST_TABLES  # noqa: E402

T_JOB = 1_760_000_000_000_000_000
#: share of the events per table (collectives and syncs are half the cuda rows)
MIX = {"nccl_events": 0.20, "cuda_events": 0.30, "sched_events": 0.20, "tcp_events": 0.05,
       "host_samples": 0.20, "block_events": 0.05}


#: The merge, in a child process (its own peak RSS and CPU), with the end of each phase
#: printed: pass 1 (verify, decompress, sync points; small tables), alignment, the copy
#: (pass 3) beside the collectives thread, index builds and the rest.
CHILD = r"""
import sys, time
from ingero_forensics.merge import core
from ingero_forensics.memory import keep_freed_memory
keep_freed_memory()     # as ingero-merge does
t0 = time.perf_counter()
marks = []
def wrap(name, label):
    f = getattr(core, name)
    def g(*a, **k):
        marks.append(f"{label} {time.perf_counter() - t0:.1f}")
        return f(*a, **k)
    setattr(core, name, g)
wrap("sample_sync_points", "pass1-end")
wrap("_pass3", "align-end")
wrap("_collectives", "copy+indexes-end")
run = core.CollectiveJob.run
def job(self):
    try:
        return run(self)
    finally:
        marks.append(f"collectives-thread-end {time.perf_counter() - t0:.1f}")
core.CollectiveJob.run = job
r = core.merge_bundles(sys.argv[1:-1], sys.argv[-1])
marks.append(f"end {time.perf_counter() - t0:.1f}")
for m in marks:
    print(m)
print(r.events, r.elapsed_s, r.stacks.get("dedup_ratio"), len(r.skipped))
"""


def make_bundle(out_dir: Path, node: int, events: int) -> Path:
    boot = T_JOB - (node + 1) * 3_600_000_000_000          # true UTC of boot
    err = (node * 7919 % 100 - 50) * 1_000_000              # +-50 ms realtime error
    spool = out_dir / f".bench-{node}.spool"
    w = BundleWriter(spool, node=f"bench-{node:02d}",
                     host={"hostname": f"gpu{node:02d}", "boot_id": f"boot-{node}",
                           "kernel_release": "6.1.0-bench"},
                     capture_start=(T_JOB + err, T_JOB - boot))
    con = w.con
    n = {t: int(events * f) for t, f in MIX.items()}
    step = 100_000  # one collective per 100 us of (true) time per node
    m0 = T_JOB - boot  # monotonic at job start
    p = {"m0": m0, "node": node, "step": step}
    with con:
        con.execute(f"""WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c
                        WHERE i < {n['nccl_events'] - 1})
            INSERT INTO nccl_events (timestamp_ns, duration_ns, op, rank, nranks, comm_id_hash,
                seq, count, datatype, redop, peer, stream, bytes, group_depth, return_code,
                pid, tid, stack_id)
            SELECT :m0 + i * :step + (i * 7 + :node * 13) % 3000, 15000, 'ALL_REDUCE', :node,
                   16, 'c0ffee00c0ffee00', i + 1, 1048576, 'float32', 'sum', NULL, 7, 4194304,
                   0, 0, 1000 + :node, 1000 + :node, 1 FROM c""", p)
        con.execute(f"""WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c
                        WHERE i < {n['cuda_events'] - 1})
            INSERT INTO cuda_events (timestamp_ns, duration_ns, api, layer, stream, bytes,
                memcpy_kind, kernel, device, return_code, pid, tid, stack_id, queued_ops)
            SELECT CASE WHEN i < {n['nccl_events']}
                        THEN :m0 + i * :step + (i * 7 + :node * 13) % 3000 + 20000
                        ELSE :m0 + (i - {n['nccl_events']}) * :step + 60000 END,
                   CASE WHEN i < {n['nccl_events']}
                        THEN 3000 + 40000 - (i * 7 + :node * 13) % 3000 ELSE 2000 END,
                   CASE WHEN i < {n['nccl_events']} THEN 'cudaStreamSynchronize'
                        ELSE 'cudaMemcpyAsync' END, 'runtime', 7,
                   CASE WHEN i < {n['nccl_events']} THEN NULL ELSE 65536 END,
                   CASE WHEN i < {n['nccl_events']} THEN NULL ELSE 'HtoD' END, NULL, 0, 0,
                   1000 + :node, 1000 + :node, 2,
                   CASE WHEN i < {n['nccl_events']} THEN 0 END FROM c""", p)
        con.execute(f"""WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c
                        WHERE i < {n['sched_events'] - 1})
            INSERT INTO sched_events (timestamp_ns, duration_ns, kind, pid, tid, comm, cpu,
                prev_state, other_pid, other_tid, other_comm)
            SELECT :m0 + i * 97000, 1200000, CASE i % 2 WHEN 0 THEN 'runq_delay'
                   ELSE 'off_cpu' END, 1000 + :node, 1000 + :node + i % 4, 'python3', i % 64,
                   'S', 42, 42, 'kworker/0:1' FROM c""", p)
        con.execute(f"""WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c
                        WHERE i < {n['tcp_events'] - 1})
            INSERT INTO tcp_events (timestamp_ns, event, family, saddr, daddr, sport, dport,
                state, pid, netns, owner_pid, scope, srtt_us, snd_cwnd)
            SELECT :m0 + i * 389000, 'tcp_retransmit_skb', 4, '10.0.0.' || :node,
                   '10.0.1.' || (i % 16), 40000 + i % 100, 29500, 'ESTABLISHED', NULL,
                   4026531840, 1000 + :node, 'job', NULL, NULL FROM c""", p)
        con.execute(f"""WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c
                        WHERE i < {n['host_samples'] - 1})
            INSERT INTO host_samples (timestamp_ns, metric, device, value)
            SELECT :m0 + (i / 8) * 1000000, CASE i % 8 WHEN 0 THEN 'cpu.busy_pct'
                   WHEN 1 THEN 'load.avg1' WHEN 2 THEN 'gpu.util_pct' WHEN 3 THEN 'gpu.power_w'
                   WHEN 4 THEN 'net.rx_bytes_per_s' WHEN 5 THEN 'net.tx_bytes_per_s'
                   WHEN 6 THEN 'mem.available_bytes' ELSE 'disk.busy_pct' END,
                   CASE WHEN i % 8 IN (2, 3) THEN '0' ELSE NULL END, (i % 1000) / 10.0 FROM c""", p)
        con.execute(f"""WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c
                        WHERE i < {n['block_events'] - 1})
            INSERT INTO block_events (timestamp_ns, duration_ns, device, sector, bytes, op,
                rwbs, pid, tid, comm, error)
            SELECT :m0 + i * 389000, 250000, 'nvme0n1', i * 8, 4096,
                   CASE i % 3 WHEN 0 THEN 'read' ELSE 'write' END, 'WS', 1000 + :node,
                   1000 + :node, 'python3', 0 FROM c""", p)
        span_s = (n["nccl_events"] * step) // 1_000_000_000 + 2
        step_at = span_s // 2
        con.execute(f"""WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c
                        WHERE i < {span_s})
            INSERT INTO clock_samples (source, mono_before_ns, mono_after_ns, realtime_ns,
                uncertainty_ns, synchronized, adj_maxerror_ns, adj_esterror_ns)
            SELECT 'system', :m0 + i * 1000000000, :m0 + i * 1000000000 + 2000,
                   :m0 + i * 1000000000 + 1000 + {boot} +
                   CASE WHEN i < {step_at} THEN {err} ELSE 200000 END, 2000, 1,
                   CASE WHEN i < {step_at} THEN {abs(err) * 2 + 100000} ELSE 500000 END,
                   CASE WHEN i < {step_at} THEN {abs(err)} ELSE 200000 END FROM c""", p)
    w.add_stack([{"module": "/opt/x/libnccl.so.2", "symbol": "ncclAllReduce",
                  "symbol_offset": 16, "ip": f"0x{0x7f00000 + node:x}"}])
    w.add_stack([{"module": f"/usr/local/cuda-12.{node}/lib/libcudart.so.12",
                  "symbol": "cudaStreamSynchronize", "symbol_offset": 0}])
    end_m = m0 + n["nccl_events"] * step + 1_000_000_000
    return w.seal(out_dir, capture_end=(T_JOB + err + end_m - m0, end_m), level=3)


def floor_sqlite3(paths, work: Path) -> tuple[float, int]:
    """Plain sqlite3: ATTACH each decompressed image and INSERT ... SELECT every table."""
    images = []
    for pth in paths:
        b = open_bundle(pth, tmpdir=work, integrity="none")
        b.con.close()
        b.con = None
        images.append(b)
    out = work / "floor.db"
    rows = 0
    try:
        t0 = time.perf_counter()
        con = sqlite3.connect(out, isolation_level=None)
        con.execute("PRAGMA synchronous = OFF")
        first = True
        for b in images:
            con.execute("ATTACH DATABASE ? AS b", (str(b.db_path),))
            con.execute("BEGIN")
            for t in MANIFEST_TABLES:
                if t in b.absent_tables:
                    continue        # an optional table (format 1.1) these bundles lack
                if first:
                    con.execute(f"CREATE TABLE main.{t} AS SELECT * FROM b.{t} WHERE 0")
                cur = con.execute(f"INSERT INTO main.{t} SELECT * FROM b.{t}")
                if t not in ("stacks", "capture_log"):
                    rows += cur.rowcount
            con.execute("COMMIT")
            con.execute("DETACH DATABASE b")
            first = False
        con.close()
        elapsed = time.perf_counter() - t0
    finally:
        for b in images:
            b.close()
        out.unlink(missing_ok=True)
    return elapsed, rows


def merge_once(paths, out: Path) -> tuple[int, float]:
    """One merge in a fresh process; prints its figures, returns (events, seconds)."""
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, paths), str(out)],
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss = ru.ru_maxrss / 1024  # KiB -> MiB (the largest child so far)
    lines = proc.stdout.splitlines()
    events, elapsed, dedup, skipped = lines[-1].split()
    events, elapsed = int(events), float(elapsed)
    print(f"merge: {events:,} events in {elapsed:.1f}s = {events / elapsed:,.0f} events/s "
          f"(process wall {wall:.1f}s, CPU {ru.ru_utime - before.ru_utime:.1f}s user + "
          f"{ru.ru_stime - before.ru_stime:.1f}s system); peak RSS {rss:.0f} MiB; stack "
          f"dedup {dedup}x; skipped {skipped}; fleet.db {out.stat().st_size / 2**20:.0f} "
          f"MiB; load average before {load_before}, after "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print("phases (s from the start): " + "; ".join(lines[:-1]), flush=True)
    return events, elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--events", type=int, default=2_000_000, help="events per node")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep bundles and fleet.db")
    ap.add_argument("--repeat", type=int, default=1,
                    help="merges to run (each in a fresh process); prints the median")
    ap.add_argument("--bundles", default=None,
                    help="merge the *.bundle files of this directory instead (e.g. an "
                         "ingero-simulate fleet)")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-merge-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.bundles:
        paths = sorted(Path(args.bundles).glob("*.bundle"))
        what = f"{len(paths)} bundles from {args.bundles}"
    else:
        bdir = work / "bundles"
        bdir.mkdir(exist_ok=True)
        paths = sorted(bdir.glob("*.bundle"))
        if len(paths) != args.nodes:
            for p in paths:
                p.unlink()
            paths = [make_bundle(bdir, i, args.events) for i in range(args.nodes)]
        what = f"{args.nodes} bundles, {args.events:,} events each"
    gen = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in paths)
    print(f"input: {what}, {size / 2**20:.0f} MiB compressed (ready in {gen:.0f}s)")
    out = work / "fleet.db"
    times = []
    for _ in range(max(1, args.repeat)):
        out.unlink(missing_ok=True)
        events, elapsed = merge_once(paths, out)
        times.append(elapsed)
    if len(times) > 1:
        times.sort()
        med = statistics.median(times)
        print(f"median of {len(times)}: {med:.1f}s = {events / med:,.0f} events/s (best "
              f"{times[0]:.1f}s = {events / times[0]:,.0f}, worst {times[-1]:.1f}s = "
              f"{events / times[-1]:,.0f})")
    fl_s, fl_rows = floor_sqlite3(paths, work)
    print(f"floor: plain sqlite3 ATTACH + INSERT ... SELECT of {fl_rows:,} rows "
          f"(already decompressed): {fl_s:.1f}s = {fl_rows / fl_s:,.0f} rows/s")
    elapsed = statistics.median(times)
    print(f"ratio: merge takes {elapsed / fl_s:.2f}x the floor's time "
          f"(it also verifies, decompresses, aligns, indexes and builds collectives)")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
