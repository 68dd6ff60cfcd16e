"""Benchmark the report's link transits (report/links.py, rule 4c of docs/report.md) on a
large tcp_progress table: NODES nodes in a ring, CONNS job connections per link (NCCL
opens several sockets per peer), SECONDS of run with one row per second per kind on
each end plus the stream grid's rows (as the capture samples: docs/ebpf.md).

Prints the rows, the time link_transits takes reading every row and as the report reads
them (one second in every k above LINK_ROWS_READ rows), and the floor: the same rows
read by plain sqlite3 in the order the pairing needs (a scan and a sort by connection and
position), with the ratio to it.

Usage: python bench/bench_links.py [--nodes 64] [--conns 8] [--seconds 3600]
"""

from __future__ import annotations

import argparse
import random
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import apsw  # noqa: E402

from ingero_forensics.report.links import link_transits  # noqa: E402

SCHEMA = ("CREATE TABLE tcp_progress (id INTEGER PRIMARY KEY, timestamp_ns INTEGER NOT NULL, "
          "direction TEXT NOT NULL, family INTEGER NOT NULL, saddr TEXT NOT NULL, "
          "sport INTEGER NOT NULL, daddr TEXT NOT NULL, dport INTEGER NOT NULL, "
          "connected_ns INTEGER NOT NULL, stream_offset INTEGER NOT NULL, "
          "bytes INTEGER NOT NULL, pid INTEGER NOT NULL, tid INTEGER NOT NULL, "
          "node_id INTEGER NOT NULL, bundle_id INTEGER NOT NULL, mono_ns INTEGER NOT NULL)")


def build(path: Path, nodes: int, conns: int, seconds: int, seed: int = 1) -> int:
    """tcp_progress of a ring: per connection and second a send, an unsent and an arrive
    row (the time rule), the rows in time order per node as a merge writes them."""
    rng = random.Random(seed)
    con = sqlite3.connect(path)
    con.execute(SCHEMA)
    rows = 0
    t0 = 1_700_000_000_000_000_000
    for s in range(nodes):
        r = (s + 1) % nodes
        batch = []
        for c in range(conns):
            port = 40000 + c
            pos = 0
            for sec in range(seconds):
                t = t0 + sec * 1_000_000_000 + rng.randrange(1_000_000)
                pos += rng.randrange(1 << 20, 1 << 24)
                sa, da = f"10.0.{s // 250}.{s % 250 + 1}", f"10.0.{r // 250}.{r % 250 + 1}"
                batch.append((t - 50_000, "send", sa, port, da, 29500, pos, 1 << 20, s + 1))
                batch.append((t, "unsent", sa, port, da, 29500, pos, 1, s + 1))
                batch.append((t + rng.randrange(15_000, 60_000), "arrive", da, 29500, sa, port,
                              pos - 4096, 8192, r + 1))
        con.executemany(
            "INSERT INTO tcp_progress (timestamp_ns, direction, family, saddr, sport, daddr, "
            "dport, connected_ns, stream_offset, bytes, pid, tid, node_id, bundle_id, "
            "mono_ns) VALUES (?, ?, 4, ?, ?, ?, ?, 0, ?, ?, 1, 1, ?, 1, 0)", batch)
        rows += len(batch)
    con.commit()
    con.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=3600)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-links-") as tmp:
        db = Path(tmp) / "fleet.db"
        t = time.perf_counter()
        rows = build(db, args.nodes, args.conns, args.seconds)
        print(f"built {rows:,} tcp_progress rows ({db.stat().st_size / 2**20:,.0f} MiB) in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
        figures = {}
        for what, max_rows in (("every row", rows + 1), ("as the report reads it", None)):
            t, c = time.perf_counter(), time.process_time()
            links = link_transits(con, max_rows=max_rows)
            figures[what] = (time.perf_counter() - t, time.process_time() - c,
                             sum(lk.transits for lk in links))
            assert len(links) == args.nodes, len(links)
        con.close()
        # the floor: the same rows, read and sorted as the window function needs them
        floor_sql = ("SELECT COUNT(*) FROM (SELECT saddr, sport, daddr, dport, stream_offset, "
                     "timestamp_ns FROM tcp_progress WHERE direction IN ('send', 'unsent', "
                     "'arrive') ORDER BY 1, 2, 3, 4, 5)")
        t = time.perf_counter()
        subprocess.run(["sqlite3", str(db), floor_sql], check=True, capture_output=True)
        floor = time.perf_counter() - t
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        for what, (wall, cpu, n) in figures.items():
            print(f"link_transits, {what}: {wall:.2f} s ({cpu:.2f} s CPU), "
                  f"{rows / wall / 1e6:.2f} M rows/s, {n:,} arrivals paired; floor (sqlite3 "
                  f"scan and sort of every row) {floor:.2f} s: {wall / floor:.2f}x")
        print(f"peak RSS {rss:,.0f} MiB")


if __name__ == "__main__":
    main()
