"""What the tcp_progress probes cost a job's TCP calls (needs root, BCC: scripts/setup-ebpf.sh).

Two traced processes on loopback: a client sends N small messages and the server echoes
each (2 sends and 2 receives per round trip, the worst case: tiny calls back to back);
then a bulk transfer of 1 MiB sends to a non-blocking reader (calls of NCCL's size).
Each is timed without a capture, with the tcp source without tcp_progress
(--no-tcp-progress: retransmits only), with it (the default), and with it started after
the connection (counted as attached, from the sockets), alternating, median of
--repeats; the elapsed times of two Python processes ping-ponging on 2 cores scatter by
several percent, so the probes' own cost is measured in the kernel as well: the run time
of the source's BPF programs during the transfer (kernel.bpf_stats_enabled, switched on
for the bench and restored), per send or receive call.

Usage: python bench/bench_tcp_progress.py [--rounds N] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ingero_forensics.capture.ebpf.tcp import TcpSource  # noqa: E402
from ingero_forensics.capture.host import bpf_run_time_ns  # noqa: E402
from ingero_forensics.capture.source import CaptureOptions  # noqa: E402

from polled import Polled  # noqa: E402  (bench/polled.py)

SERVER = textwrap.dedent(r"""
    import select, socket, sys
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mode = sys.stdin.readline().strip()
    if mode == "echo":
        while True:
            d = c.recv(64)
            if not d:
                break
            c.sendall(d)
    else:                       # bulk: a non-blocking reader, as NCCL's proxy reads
        c.setblocking(False)
        n = 0
        while True:
            try:
                d = c.recv(1 << 20)
            except BlockingIOError:
                select.select([c], [], [])
                continue
            if not d:
                break
            n += len(d)
        c.setblocking(True)
        c.sendall(str(n).encode())
""")
CLIENT = textwrap.dedent(r"""
    import socket, sys, time
    port, mode, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print("connected", flush=True)
    sys.stdin.readline()
    t = time.perf_counter()
    calls = 0
    if mode == "echo":
        msg = b"x" * 64
        for _ in range(n):
            s.sendall(msg)
            s.recv(64)
        calls = 4 * n
    else:
        chunk = b"y" * (1 << 20)
        for _ in range(n):
            s.sendall(chunk)
        s.shutdown(socket.SHUT_WR)
        s.recv(64)
    print(time.perf_counter() - t, calls, flush=True)
""")


def one_run(tmp: Path, mode: str, n: int, capture: str | None
            ) -> tuple[float, int, int, int]:
    """(seconds, calls, rows written, BPF run time in ns) of one transfer; capture None,
    'off', 'on' or 'late' (on, started after the connection: counted as attached)."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    client = None
    try:
        cap = None

        def start_capture():
            opts = CaptureOptions(tcp_progress=capture != "off")
            c = Polled(TcpSource(opts), opts, [server.pid])
            c.__enter__()
            return c
        if capture in ("off", "on"):
            # the source starts before the connection: tcp_progress counts from the
            # establishment, as in a capture started before the job
            cap = start_capture()
        client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), mode, str(n)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if cap is not None:
            cap.pids.add(client.pid)
            cap.source.add_target(client.pid)
        assert client.stdout.readline().strip() == "connected"
        if capture == "late":
            # the connection predates the source, as a job's do when the capture is
            # attached to it: counted from the sockets' sequence numbers (attached)
            cap = start_capture()
            cap.pids.add(client.pid)
            cap.source.add_target(client.pid)
        server.stdin.write(mode + "\n")
        server.stdin.flush()
        bpf0 = bpf_run_time_ns() or 0
        client.stdin.write("go\n")
        client.stdin.flush()
        secs, calls = client.stdout.readline().split()
        bpf = (bpf_run_time_ns() or 0) - bpf0
        rows = 0
        if cap is not None:
            time.sleep(0.1)
            cap.__exit__(None, None, None)
            rows = cap.rows
        return float(secs), int(calls), rows, bpf
    finally:
        for p in (client, server):
            if p is not None:
                if p.stdin:
                    p.stdin.close()
                p.kill()
                p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20000, help="echo round trips (default "
                    "20000)")
    ap.add_argument("--mib", type=int, default=2000, help="MiB of the bulk transfer "
                    "(default 2000)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_tcp_progress: needs root")
    tmp = Path("/tmp")
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    was = stats.read_text().strip()
    stats.write_text("1")
    try:
        run(a, tmp)
    finally:
        stats.write_text(was)


def run(a, tmp: Path) -> None:
    print(f"tcp_progress cost on {os.uname().release}, {os.cpu_count()} CPUs; medians of "
          f"{a.repeats}, alternating")
    for mode, n in (("echo", a.rounds), ("bulk", a.mib)):
        times = {None: [], "off": [], "on": [], "late": []}
        bpf = {"off": [], "on": [], "late": []}
        rows, late_rows = [], []
        for _ in range(a.repeats):
            for cap in (None, "off", "on", "late"):
                secs, calls, r, ns = one_run(tmp, mode, n, cap)
                times[cap].append(secs)
                if cap is not None:
                    bpf[cap].append(ns)
                if cap == "on":
                    rows.append(r)
                if cap == "late":
                    late_rows.append(r)
        med = {k: statistics.median(v) for k, v in times.items()}
        kern = {k: statistics.median(v) for k, v in bpf.items()}
        if mode == "echo":
            calls = 4 * n
            per = {k: v / calls * 1e9 for k, v in med.items()}
            print(f"echo, {n:,} round trips of 64 bytes ({calls:,} send/recv calls): "
                  f"no capture {med[None]:.3f} s ({per[None]:,.0f} ns per call, the floor); "
                  f"tcp source without tcp_progress {med['off']:.3f} s; with it "
                  f"{med['on']:.3f} s: {(med['on'] - med['off']) / calls * 1e9:+,.0f} ns "
                  f"per call ({(med['on'] / med['off'] - 1) * 100:+.1f} %, elapsed); BPF run "
                  f"time per call: {kern['on'] / calls:,.0f} ns with tcp_progress, "
                  f"{kern['off'] / calls:,.0f} ns without; rows "
                  f"{statistics.median(rows):,.0f}; on a connection older than the "
                  f"capture (attached) {kern['late'] / calls:,.0f} ns per call, rows "
                  f"{statistics.median(late_rows):,.0f}")
        else:
            gbs = {k: n / 1024 / v for k, v in med.items()}
            print(f"bulk, {n:,} MiB in 1 MiB sends to a non-blocking reader: no capture "
                  f"{gbs[None]:.2f} GiB/s; tcp source without tcp_progress "
                  f"{gbs['off']:.2f} GiB/s; with it {gbs['on']:.2f} GiB/s "
                  f"({(med['on'] / med['off'] - 1) * 100:+.1f} % time); BPF run time "
                  f"{kern['on'] / 1e6:.1f} ms with tcp_progress ({kern['on'] / n / 1e3:.1f} us "
                  f"per MiB), {kern['off'] / 1e6:.1f} ms without; rows "
                  f"{statistics.median(rows):,.0f}; on a connection older than the "
                  f"capture (attached) {kern['late'] / n / 1e3:.1f} us per MiB, rows "
                  f"{statistics.median(late_rows):,.0f}")


if __name__ == "__main__":
    main()
