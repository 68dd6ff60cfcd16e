"""tcp_progress on the real kernel: the traced processes' TCP byte positions (sends,
receives, arrivals, and the bytes a sender still held at an incoming ACK), sampled by
time and on a grid of stream positions both ends share. Loopback, both ends traced, one
kernel and one clock: every bound the merge draws from these rows is checked here as a
fact (docs/ebpf.md, "TCP progress")."""

from __future__ import annotations

import random
import shutil
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from .conftest import Running, StaticTargets, options
from ingero_forensics.capture.ebpf.tcp import DIRECTIONS, TcpSource

pytestmark = pytest.mark.ebpf


# -- tcp_progress: byte positions of send and receive calls ---------------------------

# Non-blocking reads after poll, as NCCL's socket transport does them: a read that
# finds the socket empty (EAGAIN) lets the capture date the next data's arrival.
PROGRESS_RECEIVER = textwrap.dedent(r"""
    import select, socket, sys, threading
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    print(srv.getsockname()[1], flush=True)
    def drain(c):
        c.setblocking(False)
        n = 0
        while True:
            try:
                d = c.recv(1 << 16)
            except BlockingIOError:
                select.select([c], [], [])
                continue
            if not d:
                break
            n += len(d)
        c.setblocking(True)
        c.sendall(str(n).encode())
        c.close()
    while True:
        c, _ = srv.accept()
        threading.Thread(target=drain, args=(c,), daemon=True).start()
""")
# Bursts of CHUNK-byte sends with pauses between them, as a ring all-reduce's steps
# would be; 'early' connects before the capture starts, the others after.
PROGRESS_SENDER = textwrap.dedent(r"""
    import socket, sys, time
    port, rounds, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    early = socket.create_connection(("127.0.0.1", port))
    print(early.getsockname()[1], flush=True)
    sys.stdin.readline()
    s = socket.create_connection(("127.0.0.1", port))
    print(s.getsockname()[1], flush=True)
    for i in range(rounds):
        for k in range(3):
            s.sendall(b"x" * chunk)
            early.sendall(b"y" * chunk)
        time.sleep(0.004)
    for c in (s, early):
        c.shutdown(socket.SHUT_WR)
        print(c.recv(64).decode(), flush=True)
    sys.stdin.readline()
""")


def grid_positions(total: int) -> list[int]:
    """The stream positions below `total` that every end writes a row at (next_mark in
    progress.py): 0, then 32 per power of two, 64 KiB to 16 GiB apart."""
    out = [0]
    for g in range(1 << 16, total, 1 << 16):
        k = g.bit_length() - 1
        if g % (1 << min(max(k - 5, 16), 34)) == 0:
            out.append(g)
    return out


def test_tcp_progress_pairs_sends_with_receives(ebpf_ok, tmp_path):
    """Both ends of a loopback connection traced: every receive's bytes were sent by a
    send that began before it (one kernel, one clock: the claim the merge's clock
    bounds rest on), stream positions are exact, rows are sampled per interval, and an
    untraced process gives no rows. A connection opened before the capture (as the
    job's are when an operator attaches to it) is counted from the socket's own
    sequence numbers, marked attached: the same positions, the opener's one byte high."""
    (tmp_path / "grecv.py").write_text(PROGRESS_RECEIVER)
    (tmp_path / "gsend.py").write_text(PROGRESS_SENDER)
    rounds, chunk, interval_ms = 300, 40_000, 5
    procs = []
    try:
        recv = subprocess.Popen([sys.executable, str(tmp_path / "grecv.py")],
                                stdout=subprocess.PIPE, text=True)
        procs.append(recv)
        port = int(recv.stdout.readline())
        send = subprocess.Popen([sys.executable, str(tmp_path / "gsend.py"), str(port),
                                 str(rounds), str(chunk)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        other = subprocess.Popen([sys.executable, str(tmp_path / "gsend.py"), str(port),
                                  "50", str(chunk)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        procs += [send, other]
        early_port = int(send.stdout.readline())
        other_early = int(other.stdout.readline())
        opts = options(tcp_progress_interval_ms=interval_ms)
        source = TcpSource(opts)
        with Running(source, StaticTargets([send.pid, recv.pid]), opts) as run:
            attached = set(source.bpf.tracepoint_fds)
            for p in (send, other):
                p.stdin.write("go\n")
                p.stdin.flush()
            sport = int(send.stdout.readline())
            other_port = int(other.stdout.readline())
            got = [int(send.stdout.readline()) for _ in range(2)]
            for _ in range(2):
                other.stdout.readline()
            time.sleep(0.3)
        for p in (send, other):
            p.stdin.write("done\n")
            p.stdin.flush()
            p.wait(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert got == [rounds * 3 * chunk] * 2
    assert {b"sock:sock_send_length", b"sock:sock_recv_length",
            b"sock:inet_sock_set_state", b"tcp:tcp_sendmsg_locked",
            b"sock:sk_data_ready"} <= attached
    all_rows = run.sink.dicts("tcp_progress")
    early_rows = [r for r in all_rows if early_port in (r["sport"], r["dport"])]
    # the untraced sender's early connection: its traced reader's end only, attached
    other_rows = [r for r in all_rows if other_early in (r["sport"], r["dport"])]
    assert other_rows and {(r["direction"] in ("recv", "arrive"), r["attached"], r["pid"])
                           for r in other_rows} == {(True, 1, recv.pid)}
    rows = [r for r in all_rows if r not in early_rows and r not in other_rows]
    check_attached_connection(early_rows, early_port, port, send.pid, recv.pid,
                              rounds * 3 * chunk, chunk)
    assert {r["attached"] for r in rows} == {0}
    arrivals = sorted((r for r in rows if r["direction"] == "arrive"
                       and r["dport"] == sport), key=lambda r: r["stream_offset"])
    sends = sorted((r for r in rows if r["direction"] == "send"),
                   key=lambda r: r["stream_offset"])
    recvs = sorted((r for r in rows if r["direction"] == "recv"),
                   key=lambda r: r["stream_offset"])
    conn = ("127.0.0.1", sport, "127.0.0.1", port)
    assert sends and recvs, rows[:5]
    assert {(r["saddr"], r["sport"], r["daddr"], r["dport"], r["pid"]) for r in sends} == \
        {conn + (send.pid,)}
    # the receiver's end of the job's connection and of the untraced sender's: the
    # untraced process's own sends are not there, and neither is the early connection
    assert {(r["daddr"], r["dport"], r["saddr"], r["sport"], r["pid"]) for r in recvs} == \
        {conn + (recv.pid,), ("127.0.0.1", other_port, "127.0.0.1", port, recv.pid)}
    assert {r["direction"] for r in rows} == {"send", "recv", "arrive", "unsent"}
    recvs = [r for r in recvs if r["dport"] == sport]
    total = rounds * 3 * chunk
    for r in sends:
        # sendall of a chunk on a blocking socket: whole calls, or the rest of one
        assert r["family"] == 4 and 0 < r["bytes"] <= chunk, r
        assert r["stream_offset"] + r["bytes"] <= total
        if r["bytes"] == chunk:
            assert r["stream_offset"] % chunk == 0, r
    for r in recvs:
        assert 0 < r["bytes"] <= 1 << 16 and r["stream_offset"] + r["bytes"] <= total, r
    # one connection on each end: one establishment time each, before its first row
    for side in (sends, recvs):
        assert len({r["connected_ns"] for r in side}) == 1, side[:3]
        assert side[0]["connected_ns"] <= min(r["timestamp_ns"] for r in side)
    # sampled in the kernel, per connection and kind: by when a call returned (a
    # receive's and an arrival's own time; a send is dated by its start, so only
    # counted), at most once an interval, and at the calls that reach a grid position
    # (the same bytes on both ends: every row sooner than an interval after the one
    # before holds one)
    grid = grid_positions(total)
    for side in (recvs, arrivals):
        side = sorted(side, key=lambda r: r["timestamp_ns"])
        soon = [(a, b) for a, b in zip(side, side[1:])
                if b["timestamp_ns"] - a["timestamp_ns"] < interval_ms * 1_000_000]
        assert soon, "no row by the grid"
        for a, b in soon:
            assert any(a["stream_offset"] + a["bytes"] <= g < b["stream_offset"] + b["bytes"]
                       for g in grid), (a, b)
    seconds = (max(r["timestamp_ns"] for r in rows) - min(r["timestamp_ns"] for r in rows)) / 1e9
    assert len(sends) <= seconds * 1000 / interval_ms + len(grid) + 2, (len(sends), seconds)
    assert len(sends) < rounds * 3 / 2 and len(recvs) > 10, (len(sends), len(recvs))
    # causality on one clock: the send that began copying the last byte a receive
    # returned (or an earlier one) began before that receive returned
    offsets = [r["stream_offset"] for r in sends]
    slack = []
    for r in recvs:
        k = max((i for i, o in enumerate(offsets) if o < r["stream_offset"] + r["bytes"]),
                default=None)
        if k is not None:
            slack.append(r["timestamp_ns"] - sends[k]["timestamp_ns"])
    assert len(slack) > 10 and min(slack) > 0, sorted(slack)[:5]
    # arrivals: the bytes from stream_offset on, `bytes` of them, were queued for the
    # reader then: after the send that began copying the last of them, and no later
    # than the reads that returned them
    assert len(arrivals) > 10, len(arrivals)
    assert any(a["bytes"] > 1 for a in arrivals), arrivals[:5]     # extents, from BTF
    arrive_slack = []
    for a in arrivals:
        last = a["stream_offset"] + a["bytes"] - 1
        assert a["bytes"] >= 1 and last < total and a["pid"] == recv.pid, a
        k = max((i for i, o in enumerate(offsets) if o <= last), default=None)
        if k is not None:
            arrive_slack.append(a["timestamp_ns"] - sends[k]["timestamp_ns"])
        later = [r for r in recvs if r["stream_offset"] <= last
                 and a["stream_offset"] < r["stream_offset"] + r["bytes"]]
        assert all(r["timestamp_ns"] >= a["timestamp_ns"] for r in later), (a, later)
    assert arrive_slack and min(arrive_slack) > 0, sorted(arrive_slack)[:5]
    print("tcp_progress: %d sends, %d receives, %d arrivals; slack to the receive: min "
          "%.0f us, median %.0f us; to the arrival: min %.0f us, median %.0f us"
          % (len(sends), len(recvs), len(arrivals), min(slack) / 1e3,
             statistics.median(slack) / 1e3, min(arrive_slack) / 1e3,
             statistics.median(arrive_slack) / 1e3))


def check_attached_connection(rows, early_port, port, send_pid, recv_pid, total, chunk):
    """The rows of a connection established before the capture started, whose bytes
    all moved after it: attached, positions from the socket's sequence numbers (the
    receiver's exact, the sender's one byte high: it opened the connection, and its
    bytes_acked counts the SYN), and every receive, arrival and unsent row consistent
    with the sends on the one clock."""
    assert rows and {r["attached"] for r in rows} == {1}, rows[:3]
    by = {d: sorted((r for r in rows if r["direction"] == d),
                    key=lambda r: r["stream_offset"]) for d in DIRECTIONS}
    assert all(by[d] for d in DIRECTIONS), {d: len(v) for d, v in by.items()}
    for r in by["send"] + by["unsent"]:
        assert (r["sport"], r["dport"], r["pid"]) == (early_port, port, send_pid), r
    for r in by["recv"] + by["arrive"]:
        assert (r["sport"], r["dport"], r["pid"]) == (port, early_port, recv_pid), r
    # one first sighting per end, before its rows
    for end in (by["send"] + by["unsent"], by["recv"] + by["arrive"]):
        assert len({r["connected_ns"] for r in end}) == 1
        assert end[0]["connected_ns"] <= min(r["timestamp_ns"] for r in end)
    for r in by["send"]:
        assert 1 <= r["stream_offset"] and r["stream_offset"] + r["bytes"] <= total + 1, r
        if r["bytes"] == chunk:
            assert r["stream_offset"] % chunk == 1, r      # the SYN: one byte high
    for r in by["recv"] + by["arrive"]:
        assert r["stream_offset"] + r["bytes"] <= total, r  # the reader's: exact
    # ... and up to near the end (the grid is 1 MiB apart there)
    assert max(r["stream_offset"] + r["bytes"] for r in by["recv"]) > total - (2 << 20)
    for r in by["unsent"]:
        assert 1 <= r["stream_offset"] <= total + 1, r
    # on the one clock: the latest sender row below the bytes a receive returned or an
    # arrival brought was written before it
    senders = sorted(by["send"] + by["unsent"], key=lambda r: r["stream_offset"])
    checked = 0
    for r in by["recv"] + by["arrive"]:
        end = r["stream_offset"] + r["bytes"]
        before = [s for s in senders if s["stream_offset"] < end]
        if before:
            last = max(before, key=lambda s: (s["stream_offset"], s["timestamp_ns"]))
            assert last["timestamp_ns"] < r["timestamp_ns"], (last, r)
            checked += 1
    assert checked > 10, checked


def test_tcp_progress_that_cannot_load_keeps_the_rest(ebpf_ok, monkeypatch):
    # as for tcp_probe: a layout the program does not know turns only that part off
    from ingero_forensics.capture.ebpf import tcp
    monkeypatch.setattr(tcp, "PROGRESS_PROGRAM",
                        tcp.PROGRESS_PROGRAM.replace("args->sk,", "args->no_such_field,", 1))
    opts = options(tcp_probe=True)
    source = TcpSource(opts)
    with Running(source, StaticTargets(), opts) as run:
        attached = set(source.bpf.tracepoint_fds)
    assert {b"tcp:tcp_retransmit_skb", b"tcp:tcp_probe"} <= attached
    assert b"sock:sock_send_length" not in attached
    warnings = [log[3] for log in run.sink.logs if log[0] == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith("tcp_progress left off: "), warnings


# -- 'unsent' rows: bytes the sender still held, at tcp:tcp_probe ---------------------

# One process, both ends: K-byte requests answered by R-byte replies, a pause between
# rounds, so each end's sends are whole and every byte was acknowledged by the next
# round.
PINGPONG = textwrap.dedent(r"""
    import socket, sys, threading, time
    k, r, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    sys.stdin.readline()
    def take(c, n):
        got = 0
        while got < n:
            got += len(c.recv(n - got))
    def serve():
        c, _ = srv.accept()
        for _ in range(rounds):
            take(c, k)
            c.sendall(b"r" * r)
        c.recv(1)
    t = threading.Thread(target=serve)
    t.start()
    s = socket.create_connection(("127.0.0.1", srv.getsockname()[1]))
    print(s.getsockname()[1], flush=True)
    for _ in range(rounds):
        s.sendall(b"k" * k)
        take(s, r)
        time.sleep(0.01)
    s.close()
    t.join()
    print("done", flush=True)
""")


def _traced(script: str, args: list[str], opts, tmp_path, lines: int, inside=None):
    """Run one traced script under a TcpSource: it prints a port, waits for a line, then
    prints `lines` lines (inside(source) is called then, its maps still there). (the
    run, its pid, the port, those lines, tracepoints attached, the source)."""
    path = tmp_path / "traced.py"
    path.write_text(script)
    proc = subprocess.Popen([sys.executable, str(path), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        source = TcpSource(opts)
        with Running(source, StaticTargets([proc.pid]), opts) as run:
            attached = set(source.bpf.tracepoint_fds)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            printed = [proc.stdout.readline().strip() for _ in range(lines)]
            if inside is not None:
                inside(source)
            time.sleep(0.2)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return run, proc.pid, port, printed, attached, source


def _run_traced(script: str, args: list[str], opts, tmp_path):
    """_traced for a script that prints its client port and a last line: (the rows of
    that connection, its pid, the ports, the last line, tracepoints attached, the
    source, its warnings)."""
    run, pid, port, (client, last), attached, source = _traced(script, args, opts,
                                                                tmp_path, 2)
    client = int(client)
    rows = [r for r in run.sink.dicts("tcp_progress") if {r["sport"], r["dport"]} ==
            {port, client}]
    warnings = [log[3] for log in run.sink.logs if log[0] == "warning"]
    return rows, pid, port, client, last, attached, source, warnings


def test_unsent_positions_are_exact(ebpf_ok, tmp_path):
    """An 'unsent' row's position is the stream position of the first byte its end had
    not sent: after whole K-byte sends, a multiple of K on the client and of R on the
    server (tcp_sock.bytes_acked from BTF, plus snd_nxt - snd_una; a SYN counted in, or
    a wrong offset, would be off by one or wildly)."""
    k, r, rounds = 1000, 3000, 60
    opts = options(tcp_progress_interval_ms=5)
    rows, pid, port, client, last, attached, source, _warnings = _run_traced(
        PINGPONG, [str(k), str(r), str(rounds)], opts, tmp_path)
    assert last == "done"
    assert b"tcp:tcp_probe" in attached and source.progress_unsent
    assert any("bytes_acked at" in a for a in source.attached), source.attached
    unsent = [x for x in rows if x["direction"] == "unsent"]
    by_end = {client: [x for x in unsent if x["sport"] == client],
              port: [x for x in unsent if x["sport"] == port]}
    for end, size in ((client, k), (port, r)):
        got = by_end[end]
        assert len(got) >= rounds / 4, (end, len(got), rows[:5])
        assert all(x["bytes"] == 1 and x["pid"] == pid for x in got), got[:3]
        offsets = [x["stream_offset"] for x in got]
        assert all(o % size == 0 and size <= o <= rounds * size for o in offsets), \
            (end, size, offsets)
        # rounds are sequential: positions only grow
        assert offsets == sorted(offsets), offsets
    # and each matches how far that end had written: the send rows' own positions
    sends = {(x["sport"], x["stream_offset"] + x["bytes"]) for x in rows
             if x["direction"] == "send"}
    assert any((x["sport"], x["stream_offset"]) in sends for x in unsent), (unsent[:3], sends)


# A reader starved on purpose: a small receive buffer, a pause after every read; the
# sender's calls wait for the window, as a ring's do into a CPU-starved rank.
SLOW_READER = textwrap.dedent(r"""
    import select, socket, sys, threading, time
    total, chunk = int(sys.argv[1]), int(sys.argv[2])
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    sys.stdin.readline()
    def read_slowly():
        c, _ = srv.accept()
        c.setblocking(False)
        n = 0
        while n < total:
            try:
                n += len(c.recv(1 << 16))
            except BlockingIOError:
                select.select([c], [], [])
                continue
            time.sleep(0.012)           # busy elsewhere: the window closes meanwhile
    t = threading.Thread(target=read_slowly)
    t.start()
    s = socket.create_connection(("127.0.0.1", srv.getsockname()[1]))
    print(s.getsockname()[1], flush=True)
    for _ in range(total // chunk):
        s.sendall(b"x" * chunk)
    t.join()
    print("done", flush=True)
""")


def test_unsent_rows_bound_arrivals_where_sends_wait(ebpf_ok, tmp_path):
    """Into a starved reader, sends begin long before their bytes leave; 'unsent' rows
    are dated when the bytes were still on the sender, so every later arrival or
    receive of them comes after the row (one kernel, one clock), and they bound the
    arrivals far more tightly than the sends' starts."""
    total, chunk = 4_000_000, 200_000
    opts = options(tcp_progress_interval_ms=5)
    rows, pid, port, client, last, *_rest = _run_traced(
        SLOW_READER, [str(total), str(chunk)], opts, tmp_path)
    assert last == "done"
    out = [x for x in rows if x["sport"] == client]        # the sender's end
    inbound = [x for x in rows if x["sport"] == port]      # the reader's end
    unsent = sorted((x for x in out if x["direction"] == "unsent"),
                    key=lambda x: x["timestamp_ns"])
    sends = sorted((x for x in out if x["direction"] == "send"),
                   key=lambda x: x["timestamp_ns"])
    arrivals = [x for x in inbound if x["direction"] == "arrive"]
    recvs = [x for x in inbound if x["direction"] == "recv"]
    assert len(unsent) > 20 and sends and len(arrivals) > 20, \
        (len(unsent), len(sends), len(arrivals))
    assert all(0 <= x["stream_offset"] <= total for x in unsent), unsent[:3]
    # causality: a byte the sender had not sent at T reached the reader after T
    for u in unsent:
        t, n = u["timestamp_ns"], u["stream_offset"]
        early = [a for a in arrivals if a["stream_offset"] + a["bytes"] > n
                 and a["timestamp_ns"] <= t]
        early += [x for x in recvs if x["stream_offset"] + x["bytes"] > n
                  and x["timestamp_ns"] <= t]
        assert not early, (u, early[:3])

    def slack(rows_of_kind):
        got = []
        for a in arrivals:
            best = max((x["timestamp_ns"] for x in rows_of_kind
                        if x["stream_offset"] < a["stream_offset"] + a["bytes"]),
                       default=None)
            if best is not None:
                got.append(a["timestamp_ns"] - best)
        return got
    by_unsent, by_send = slack(unsent), slack(sends)
    assert by_unsent and by_send and min(by_unsent) > 0 and min(by_send) > 0
    print("arrival - bound: unsent rows median %.0f us (min %.0f), send starts median "
          "%.0f us (min %.0f); %d unsent rows, %d sends, %d arrivals"
          % (statistics.median(by_unsent) / 1e3, min(by_unsent) / 1e3,
             statistics.median(by_send) / 1e3, min(by_send) / 1e3, len(unsent),
             len(sends), len(arrivals)))
    assert statistics.median(by_unsent) * 10 < statistics.median(by_send), \
        (statistics.median(by_unsent), statistics.median(by_send))


def test_unsent_that_cannot_load_keeps_the_other_progress_rows(ebpf_ok, monkeypatch,
                                                              tmp_path):
    # a tcp_probe layout the 'unsent' part does not know costs only those rows
    from ingero_forensics.capture.ebpf import tcp
    monkeypatch.setattr(tcp, "UNSENT_PROGRAM",
                        tcp.UNSENT_PROGRAM.replace("args->snd_una", "args->no_such_field"))
    opts = options(tcp_progress_interval_ms=5)
    rows, *_rest, attached, source, warnings = _run_traced(
        PINGPONG, ["1000", "3000", "30"], opts, tmp_path)
    assert not source.progress_unsent and source.progress_on
    assert b"tcp:tcp_probe" not in attached and b"sock:sock_send_length" in attached
    kinds = {r["direction"] for r in rows}
    assert "unsent" not in kinds and {"send", "recv"} <= kinds, kinds
    assert len(warnings) == 1 and warnings[0].startswith("tcp_progress 'unsent' rows left "
                                                         "off: "), warnings


def test_no_btf_no_unsent_rows_and_one_byte_arrivals(ebpf_ok, monkeypatch, tmp_path):
    # a kernel without BTF (or without the members): the rest of the progress rows, as
    # before, and a warning that says what is lost
    from ingero_forensics.capture.ebpf import btf
    monkeypatch.setattr(btf, "VMLINUX", str(tmp_path / "no-such-btf"))
    opts = options(tcp_progress_interval_ms=5)
    rows, *_rest, attached, source, warnings = _run_traced(
        SLOW_READER, ["1000000", "200000"], opts, tmp_path)
    assert source.progress_on and not source.progress_unsent and b"tcp:tcp_probe" \
        not in attached
    arrivals = [r for r in rows if r["direction"] == "arrive"]
    assert arrivals and all(r["bytes"] == 1 for r in arrivals), arrivals[:3]
    assert "unsent" not in {r["direction"] for r in rows}
    assert len(warnings) == 1 and "BTF" in warnings[0] and "no-such-btf" in warnings[0], \
        warnings


# TCP Fast Open on loopback: the first connection fetches a cookie (its first 1000 bytes
# are written before it is established), the second carries them in the SYN; a third is
# an ordinary connect().
FASTOPEN = textwrap.dedent(r"""
    import socket, sys, threading, time
    addr = sys.argv[1]
    srv = socket.socket()
    srv.setsockopt(socket.IPPROTO_TCP, socket.TCP_FASTOPEN, 16)
    srv.bind((addr, 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    print(port, flush=True)
    sys.stdin.readline()
    def serve():
        for _ in range(3):
            c, _ = srv.accept()
            got = 0
            while got < 201000:
                got += len(c.recv(1 << 16))
            c.sendall(b"ok")
            c.close()
    t = threading.Thread(target=serve)
    t.start()
    ports = []
    for i in range(3):
        s = socket.socket()
        if i < 2:
            s.sendto(b"s" * 1000, socket.MSG_FASTOPEN, (addr, port))
        else:
            s.connect((addr, port))
            s.sendall(b"s" * 1000)
        ports.append(s.getsockname()[1])
        s.sendall(b"x" * 200000)
        s.recv(2)
        s.close()
        time.sleep(0.05)
    t.join()
    for p in ports:
        print(p, flush=True)
""")


def test_fast_open_connections_are_counted_from_the_sockets_own_counts(ebpf_ok, tmp_path):
    """Data written before establishment (Fast Open: in the SYN) is in one end's count
    from establishment and not in the other's: such a connection is not counted from its
    establishment. Its ends' calls are then counted as a connection attached to (from the
    sockets' sequence numbers, which hold those bytes on both ends): the client's
    200,000-byte send after its first 1,000 bytes at 1,001 (its SYN counted: one byte
    high), the server's reads exact. The first Fast Open connection to an address only
    asks for a cookie: its SYN carries no data and its bytes follow establishment, so it
    is counted from there, exactly. (CI once failed here: the test expected that first
    connection to carry data in its SYN, true only while the kernel still held a cookie
    for 127.0.0.1 from an earlier run; a freshly booted machine held none.)"""
    # an address of loopback's /8 the kernel holds no cookie for (it keeps one until the
    # entry is reclaimed or deleted, or the machine reboots), deleted too where iproute2 can
    addr = f"127.{random.randrange(1, 255)}.{random.randrange(256)}.{random.randrange(1, 255)}"
    if shutil.which("ip"):
        subprocess.run(["ip", "tcp_metrics", "delete", addr], capture_output=True)
    with open("/proc/sys/net/ipv4/tcp_fastopen") as f:
        saved = f.read().strip()
    with open("/proc/sys/net/ipv4/tcp_fastopen", "w") as f:
        f.write("3")                            # client and server
    try:
        run, _pid, port, printed, _attached, _source = _traced(
            FASTOPEN, [addr], options(tcp_progress_interval_ms=5), tmp_path, 3)
        cookie, fast, plain = (int(p) for p in printed)
    finally:
        with open("/proc/sys/net/ipv4/tcp_fastopen", "w") as f:
            f.write(saved)
    rows = run.sink.dicts("tcp_progress")
    ends = {(r["sport"], r["dport"]) for r in rows}
    assert (plain, port) in ends and (port, plain) in ends, ends

    def of(client):
        mine = [r for r in rows if client in (r["sport"], r["dport"])]
        sends = [(r["stream_offset"], r["bytes"]) for r in mine
                 if r["direction"] == "send" and r["sport"] == client]
        reads = [r for r in mine if r["direction"] == "recv" and r["dport"] == client]
        assert reads and max(r["stream_offset"] + r["bytes"] for r in reads) == 201000
        # the server's "ok" on its passive end: exact either way
        assert [(r["stream_offset"], r["bytes"]) for r in mine if r["direction"] == "send"
                and r["dport"] == client] == [(0, 2)]
        return {r["attached"] for r in mine}, sends

    # counted from establishment, exactly: the plain connection and the cookie request
    for client in (plain, cookie):
        assert of(client) == ({0}, [(0, 1000), (1000, 200000)]), (client, of(client))
    # the Fast Open one (the cookie just fetched): its 1,000 bytes went in the SYN
    assert of(fast) == ({1}, [(1001, 200000)])


def test_check_says_what_a_kernel_without_btf_costs(ebpf_ok, monkeypatch, tmp_path):
    # --check: the tcp source runs either way; without the kernel's BTF it says which
    # rows it will lack, before a capture finds out
    assert TcpSource.probe().reason == TcpSource.probe_detail   # what it traces
    from ingero_forensics.capture.ebpf import btf
    monkeypatch.setattr(btf, "VMLINUX", str(tmp_path / "no-such-btf"))
    status = TcpSource.probe()
    assert status.available and status.reason.startswith("no 'unsent' tcp_progress rows, "
                                                         "one-byte arrivals, no rows for "
                                                         "connections older than the "
                                                         "capture: cannot read ")
    assert "no-such-btf" in status.reason


# A connection established before the capture, whose peer sends and closes: its reader
# reads in CLOSE_WAIT (a traced call on a socket the map does not hold: a pending flow
# that never becomes ready) and then closes it.
READ_AFTER_FIN = textwrap.dedent(r"""
    import socket, sys, time
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    print(srv.getsockname()[1], flush=True)
    sys.stdin.readline()
    peer.sendall(b"z" * 100)
    peer.close()                 # FIN: cli is in CLOSE_WAIT before it reads
    time.sleep(0.1)
    assert len(cli.recv(100)) == 100
    cli.close()                  # LAST_ACK, then CLOSE
    time.sleep(0.1)
    print("done", flush=True)
    time.sleep(0.5)              # the test reads the flows map meanwhile
""")


def test_a_socket_read_after_its_fin_leaves_no_pending_flow(ebpf_ok, tmp_path):
    """A traced read on a socket no longer established puts in a pending flow that never
    gets its mappings; reaching TCP_CLOSE removes it, so no later socket at that address
    inherits it."""
    pending = []

    def look(source):
        pending.extend(leaf for _key, leaf in source.bpf[b"flows"].items()
                       if leaf.attached and not leaf.ready)
    _run, _pid, _port, printed, _attached, _source = _traced(
        READ_AFTER_FIN, [], options(tcp_progress_interval_ms=5), tmp_path, 1, inside=look)
    assert printed == ["done"]
    assert pending == [], [(p.tgid, p.wtgid) for p in pending]
