"""Bundle benchmark: writer rows/s, sealing MB/s, bytes per event.

    python bench/bench_bundle.py [--rows N] [--seal-rows N] [--batch N]

Prints, for a realistic mix of event rows (stated below):
  * BundleWriter rows/s into the live segment (add() per row, and add_many() per source
    batch), against the floor: the raw sqlite3 module's executemany of rows already
    grouped per table, into the same schema with the same journal settings and
    transaction size (the writer's timing includes its own buffering);
  * sealing MB/s of database image (seal_spool: counts, checkpoint, sha256, zstd -3 on
    all cores, fsync, link), against the floor: the zstd CLI (`zstd -3 -T0`) on the same
    image;
  * verify-and-open MB/s (open_bundle), for reference;
  * bytes per event in the database image and in the sealed bundle;
  * add_stack per call (a row's stack, stored once per segment), for the symbolizer's own
    lists (the same list for every call of a stack: known by identity) and for equal
    lists made anew (the JSON text is made to find it). No floor: the cost per call is
    the figure (``--stacks-only`` runs this part alone).

Figures depend on the machine; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ingero_forensics.bundle import BundleWriter, open_bundle  # noqa: E402
from ingero_forensics.bundle.schema import bundle_ddl, insert_sql  # noqa: E402

#: Rows per 100 of the mix: what a busy 8-GPU training node produces per second,
#: roughly (NCCL and CUDA calls dominate; host counters in long form come next).
MIX = {"nccl_events": 30, "cuda_events": 25, "host_samples": 25, "sched_events": 10,
       "block_events": 5, "event_stats": 3, "tcp_events": 1, "clock_samples": 1}

HOST = {"hostname": "bench-node", "boot_id": "00000000-0000-4000-8000-000000000000",
        "kernel_release": os.uname().release}
T0 = 10_000_000_000_000
NCCL_OPS = ["ALL_REDUCE"] * 6 + ["ALL_GATHER", "REDUCE_SCATTER", "BROADCAST", "SEND", "RECV"]
CUDA_APIS = [("cudaStreamSynchronize", None, None), ("cudaMemcpyAsync", 8_388_608, "HtoD"),
             ("cudaEventSynchronize", None, None), ("cudaMalloc", 268_435_456, None),
             ("cudaMemcpyAsync", 4096, "DtoH"), ("cudaGraphLaunch", None, None)]
METRICS = [("cpu.busy_pct", None), ("cpu.busy_pct", "cpu3"), ("psi.cpu.some_pct", None),
           ("mem.available_bytes", None), ("net.rx_bytes_per_s", "ib0"),
           ("gpu.util_pct", "0"), ("gpu.sm_clock_mhz", "0"), ("gpu.power_w", "0")]


def make_rows(n: int, seed: int = 1) -> list[tuple[str, tuple]]:
    """n (table, row) pairs in the MIX proportions, in time order, with realistic values."""
    rnd = random.Random(seed)
    tables = [t for t, k in MIX.items() for _ in range(k)]
    seq = {h: 0 for h in ("9f86d081884c7d65", "2c26b46b68ffc68f")}
    out = []
    ts = T0
    for i in range(n):
        ts += rnd.randint(2_000, 60_000)
        t = tables[i % 100] if i % 100 < len(tables) else "nccl_events"
        tid = 4250 + rnd.randint(0, 7)
        if t == "nccl_events":
            comm = "9f86d081884c7d65" if rnd.random() < 0.8 else "2c26b46b68ffc68f"
            seq[comm] += 1
            op = rnd.choice(NCCL_OPS)
            count = rnd.choice((262_144, 1_048_576, 33_554_432))
            row = (ts, int(rnd.lognormvariate(10, 1)), op, 3, 8, comm, seq[comm], count,
                   "bfloat16", "sum" if op in ("ALL_REDUCE", "REDUCE_SCATTER") else None,
                   4 if op in ("SEND", "RECV") else None, 140_234_112 + 1024 * (tid % 2),
                   count * 2, 0, 0, 4242, tid, rnd.randint(1, 200))
        elif t == "cuda_events":
            api, size, kind = rnd.choice(CUDA_APIS)
            row = (ts, int(rnd.lognormvariate(9, 2)), api, "runtime", 140_234_112, size, kind,
                   None, 0, 0, 4242, tid, rnd.randint(1, 200))
        elif t == "host_samples":
            metric, dev = rnd.choice(METRICS)
            row = (ts, metric, dev, round(rnd.uniform(0, 100), 2))
        elif t == "sched_events":
            kind = rnd.choice(("runq_delay", "off_cpu"))
            row = (ts, int(rnd.lognormvariate(14, 1)), kind, 4242, tid, "pt_main_thread",
                   rnd.randint(0, 31), "S" if kind == "off_cpu" else None,
                   913 if kind == "runq_delay" else None, 913 if kind == "runq_delay" else None,
                   "kworker/17:1" if kind == "runq_delay" else None)
        elif t == "block_events":
            row = (ts, int(rnd.lognormvariate(13, 1)), "nvme0n1", rnd.randint(0, 1 << 30),
                   131_072, "read", "RA", 4242, 4260, "dataloader", 0)
        elif t == "event_stats":
            row = (ts - 1_000_000_000, ts, "cuda", "cudaLaunchKernel", 4242, tid, None,
                   rnd.randint(500, 3000), rnd.randint(5_000_000, 20_000_000),
                   rnd.randint(20_000, 90_000), "[0,0,0,0,0,0,0,0,0,0,0,12,1700,118]")
        elif t == "tcp_events":
            row = (ts, "tcp_retransmit_skb", 4, "10.0.0.7", "10.0.0.9", 43512, 29500,
                   "ESTABLISHED", 0, 4026531840, 4242, "job", None, None)
        else:
            row = ("system", ts, ts + 420, UTC_OFFSET + ts + 210, None, None, 420, 1, -1200,
                   12.3, 16_000_000, 2000, 0x2001, 37, None, None, None, None, None)
        out.append((t, row))
    return out


UTC_OFFSET = 1_772_000_000_000_000_000


def by_source(rows, chunk: int) -> list[tuple[str, list[tuple]]]:
    """Group rows into per-table lists of up to chunk rows, as sources hand them over."""
    out, cur = [], {}
    for t, r in rows:
        lst = cur.setdefault(t, [])
        lst.append(r)
        if len(lst) >= chunk:
            out.append((t, lst))
            cur[t] = []
    out += [(t, lst) for t, lst in cur.items() if lst]
    return out


def bench_writer(rows, tmp: Path, batch: int, *, per_row: bool) -> tuple[float, BundleWriter]:
    spool = tmp / f"w{int(per_row)}.db"
    w = BundleWriter(spool, node="bench-node", host=HOST, capture_start=(UTC_OFFSET + T0, T0),
                     batch_rows=batch)
    for i in range(200):
        w.add_stack([{"ip": f"0x7f00{i:08x}", "symbol": f"fn{i}"}])
    w.flush()
    if per_row:
        add = w.add
        t = time.perf_counter()
        for table, row in rows:
            add(table, row)
        w.flush()
    else:
        groups = by_source(rows, 1000)
        t = time.perf_counter()
        for table, lst in groups:
            w.add_many(table, lst)
        w.flush()
    return len(rows) / (time.perf_counter() - t), w


def bench_floor(rows, tmp: Path, batch: int) -> float:
    db = tmp / "floor.db"
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("PRAGMA synchronous = NORMAL")
    for stmt in bundle_ddl():
        con.execute(stmt)
    sql = {t: insert_sql(t) for t in MIX}
    # grouped before the clock starts: the floor is the insert cost alone
    batches = []
    for start in range(0, len(rows), batch):
        buf: dict[str, list] = {}
        for table, row in rows[start:start + batch]:
            buf.setdefault(table, []).append(row)
        batches.append(buf)
    t = time.perf_counter()
    for buf in batches:
        con.execute("BEGIN")
        for table, lst in buf.items():
            con.executemany(sql[table], lst)
        con.execute("COMMIT")
    rate = len(rows) / (time.perf_counter() - t)
    con.close()
    return rate


def bench_stacks(tmp: Path, calls: int, stacks: int = 200, depth: int = 20) -> None:
    """add_stack per call: ``stacks`` distinct stacks of ``depth`` frames (as PyTorch's),
    cycled ``calls`` times."""
    made = [[{"module": "libtorch_cpu.so", "symbol": f"at::native::fn_{s}_{d}",
              "offset": 16 * d + s} for d in range(depth)] for s in range(stacks)]
    for same, label in ((True, "the symbolizer's lists"), (False, "equal lists anew")):
        w = BundleWriter(tmp / f"stacks{int(same)}.db", node="bench", host=HOST,
                         batch_rows=1 << 30)
        inputs = made if same else [[dict(f) for f in fr] for fr in made]
        t = time.perf_counter()
        for i in range(calls):
            fr = inputs[i % stacks]
            w.add_stack(fr if same else list(fr))
        dt = time.perf_counter() - t
        w.abort()
        print(f"add_stack:          {dt / calls * 1e6:>10.2f} us a call ({label}; {calls:,} "
              f"calls over {stacks} stacks of {depth} frames)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows for the writer runs")
    ap.add_argument("--seal-rows", type=int, default=2_000_000,
                    help="rows in the segment that is sealed")
    ap.add_argument("--batch", type=int, default=200_000, help="writer batch_rows")
    ap.add_argument("--repeat", type=int, default=3, help="best of N for the rates")
    ap.add_argument("--stacks-only", action="store_true", help="only the add_stack figures")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-bundle-", dir=os.environ.get("TMPDIR")))
    try:
        bench_stacks(tmp, 300_000)
        if args.stacks_only:
            return
        print(f"mix per 100 rows: {', '.join(f'{t} {k}' for t, k in MIX.items())}")
        rows = make_rows(args.rows)
        best = {"add": 0.0, "add_many": 0.0, "floor": 0.0}
        for _ in range(args.repeat):
            for per_row, key in ((True, "add"), (False, "add_many")):
                rate, w = bench_writer(rows, tmp, args.batch, per_row=per_row)
                w.abort()
                for f in tmp.glob("w*.db*"):
                    f.unlink()
                best[key] = max(best[key], rate)
            best["floor"] = max(best["floor"], bench_floor(rows, tmp, args.batch))
            for f in tmp.glob("floor.db*"):
                f.unlink()
        print(f"writer add():       {best['add']:>10,.0f} rows/s  "
              f"({best['add'] / best['floor']:.2f}x raw sqlite3 executemany)")
        print(f"writer add_many():  {best['add_many']:>10,.0f} rows/s  "
              f"({best['add_many'] / best['floor']:.2f}x raw sqlite3 executemany)")
        print(f"floor sqlite3:      {best['floor']:>10,.0f} rows/s  "
              f"(executemany, WAL, synchronous=NORMAL, {args.batch} rows per transaction)")

        seal_rows = make_rows(args.seal_rows, seed=2)
        seal_s = float("inf")
        for k in range(args.repeat):
            _, w = bench_writer(seal_rows, tmp, args.batch, per_row=False)
            out = tmp / f"out{k}"
            out.mkdir()
            t = time.perf_counter()
            path = w.seal(out)
            seal_s = min(seal_s, time.perf_counter() - t)
        bundle_bytes = path.stat().st_size
        t = time.perf_counter()
        b = open_bundle(path, tmpdir=tmp)
        open_s = time.perf_counter() - t
        image = tmp / "image.db"
        shutil.copyfile(b.db_path, image)
        size = image.stat().st_size
        b.close()
        zst = tmp / "image.db.zst"
        best_z = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            subprocess.run(["zstd", "-3", "-T0", "-q", "-f", str(image), "-o", str(zst)],
                           check=True)
            best_z = min(best_z, time.perf_counter() - t)
        mb = size / 1e6
        print(f"seal_spool:         {mb / seal_s:>10,.0f} MB/s of image  "
              f"({mb:.0f} MB image in {seal_s:.2f} s; {(mb / seal_s) / (mb / best_z):.2f}x "
              f"zstd -3 -T0 CLI)")
        print(f"floor zstd -3 -T0:  {mb / best_z:>10,.0f} MB/s  "
              f"({zst.stat().st_size / 1e6:.1f} MB out)")
        print(f"open_bundle:        {mb / open_s:>10,.0f} MB/s of image  "
              f"(verify + decompress + quick_check + counts)")
        events = len(seal_rows)
        print(f"bytes per event:    {bundle_bytes / events:>10.1f} in the bundle, "
              f"{size / events:.1f} in the image ({size / bundle_bytes:.1f}:1), "
              f"{events:,} rows of the mix")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
