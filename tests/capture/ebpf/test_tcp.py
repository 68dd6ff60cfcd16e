"""TCP on the real kernel.

Retransmits: two network namespaces of our own joined by a veth, a tbf qdisc with a
tiny burst and queue on the sender side (this kernel has no netem), and bulk transfers.
One sender is traced (its retransmits are the job's), the other is not (background,
same namespace). tcp_probe: a paced loopback transfer between a traced sender and an
untraced receiver, with the sampling on and off. The tcp_progress rows:
test_tcp_progress.py."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from .conftest import Running, StaticTargets, options, wait_for
from ingero_forensics.capture.source import CaptureContext, SourceUnavailable
from ingero_forensics.capture.ebpf.tcp import ConnectionIndex, TcpSource, parse_proc_addr

pytestmark = pytest.mark.ebpf

RECEIVER = textwrap.dedent(r"""
    import socket, sys, threading
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], int(sys.argv[2])))
    srv.listen(8)
    print("ready", flush=True)
    def drain(c):
        while c.recv(1 << 16):
            pass
        c.close()
    while True:
        c, _ = srv.accept()
        threading.Thread(target=drain, args=(c,), daemon=True).start()
""")
SENDER = textwrap.dedent(r"""
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
    print(s.getsockname()[1], flush=True)
    sys.stdin.readline()
    s.sendall(b"x" * int(sys.argv[3]))
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    print("sent", flush=True)
    sys.stdin.readline()
""")


def test_parse_proc_addr():
    assert parse_proc_addr("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    # IPv4-mapped in tcp6 compares as IPv4
    assert parse_proc_addr("0000000000000000FFFF00000100007F:0016") == \
        (ipaddress.ip_address("127.0.0.1"), 22)
    assert parse_proc_addr("B80D0120000000000000000001000000:01BB") == \
        (ipaddress.ip_address("2001:db8::1"), 443)


def test_connection_index_attributes_owned_sockets(tmp_path):
    # a fake /proc with one traced pid owning one of two connections of its namespace
    pid_dir = tmp_path / "42"
    (pid_dir / "net").mkdir(parents=True)
    (pid_dir / "ns").mkdir()
    (pid_dir / "ns" / "net").write_text("")
    (pid_dir / "fd").mkdir()
    os.symlink("socket:[1111]", pid_dir / "fd" / "3")
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    row = "   {n}: {l} {r} 01 00000000:00000000 00:00000000 00000000     0        0 {ino} 1\n"
    (pid_dir / "net" / "tcp").write_text(
        header + row.format(n=0, l="0100007F:1F90", r="0100007F:A000", ino=1111)
        + row.format(n=1, l="0100007F:0016", r="0100007F:B000", ino=2222))
    (pid_dir / "net" / "tcp6").write_text(header)
    idx = ConnectionIndex(proc=str(tmp_path))
    idx.refresh_job({42}, 1.0)
    lo = ipaddress.ip_address("127.0.0.1")
    ns = os.stat(pid_dir / "ns" / "net").st_ino
    assert idx.lookup((lo, 8080, lo, 0xA000)) == (ns, 42)
    assert idx.lookup((lo, 22, lo, 0xB000)) == (ns, None)
    assert idx.lookup((lo, 1, lo, 2)) is None


def ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@pytest.fixture
def netns_pair(ebpf_ok):
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("iproute2 (ip, tc) not installed")
    tag = uuid.uuid4().hex[:6]
    a, b = f"ingero-a-{tag}", f"ingero-b-{tag}"
    subnet = 200 + int(tag[:2], 16) % 50
    addr_a, addr_b = f"10.231.{subnet}.1", f"10.231.{subnet}.2"
    try:
        ip("netns", "add", a)
        ip("netns", "add", b)
        ip("link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}",
           "netns", b)
        for ns, dev, addr in ((a, f"va{tag}", addr_a), (b, f"vb{tag}", addr_b)):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        # a tiny bucket and queue: bursts overflow, segments drop, TCP retransmits
        subprocess.run(["ip", "netns", "exec", a, "tc", "qdisc", "add", "dev", f"va{tag}",
                        "root", "tbf", "rate", "8mbit", "burst", "3000", "limit", "6000"],
                       check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        ip("netns", "del", a, check=False)
        ip("netns", "del", b, check=False)
        pytest.skip(f"cannot build the test network: {e.stderr.strip()}")
    try:
        yield a, b, addr_a, addr_b
    finally:
        ip("netns", "del", a, check=False)   # removes the veth pair with it
        ip("netns", "del", b, check=False)


def test_retransmits_attributed(netns_pair, tmp_path):
    ns_a, ns_b, addr_a, addr_b = netns_pair
    (tmp_path / "recv.py").write_text(RECEIVER)
    (tmp_path / "send.py").write_text(SENDER)
    port = 5201
    procs = []

    def spawn(ns, *argv):
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *argv],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        return p

    try:
        recv = spawn(ns_b, str(tmp_path / "recv.py"), addr_b, str(port))
        assert recv.stdout.readline().strip() == "ready"
        job = spawn(ns_a, str(tmp_path / "send.py"), addr_b, str(port), str(1 << 20))
        other = spawn(ns_a, str(tmp_path / "send.py"), addr_b, str(port), str(1 << 20))
        job_port = int(job.stdout.readline())
        other_port = int(other.stdout.readline())
        opts = options()
        with Running(TcpSource(opts), StaticTargets([job.pid]), opts) as run:
            for p in (job, other):
                p.stdin.write("go\n")
                p.stdin.flush()
            for p in (job, other):
                assert p.stdout.readline().strip() == "sent"   # all bytes acknowledged
            wait_for(lambda: {r["sport"] for r in run.sink.dicts("tcp_events")}
                     >= {job_port, other_port}, timeout=5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = [r for r in run.sink.dicts("tcp_events") if r["daddr"] == addr_b]
    ns_inode = os.stat(f"/run/netns/{ns_a}").st_ino
    job_rows = [r for r in rows if r["sport"] == job_port]
    bg_rows = [r for r in rows if r["sport"] == other_port]
    assert job_rows and bg_rows, rows[:5]
    for r in job_rows:
        assert (r["event"], r["family"], r["saddr"], r["dport"], r["scope"], r["owner_pid"],
                r["netns"]) == ("tcp_retransmit_skb", 4, addr_a, port, "job", job.pid, ns_inode)
    for r in bg_rows:
        assert (r["saddr"], r["dport"], r["scope"], r["owner_pid"], r["netns"]) == \
            (addr_a, port, "background", None, ns_inode)
    assert {r["state"] for r in rows} <= {"ESTABLISHED", "FIN_WAIT1", "FIN_WAIT2", "CLOSING",
                                           "LAST_ACK", "CLOSE_WAIT"}


# -- tcp:tcp_probe sampling ------------------------------------------------------------

PROBE_RECEIVER = textwrap.dedent(r"""
    import socket
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    c, _ = srv.accept()
    while c.recv(1 << 16):
        pass
""")
# Paced small writes for a fixed number of rounds, so the sender's socket receives many
# ACKs (tcp_probe fires per received segment). TCP_INFO is sampled as it goes:
# tcpi_rtt is the kernel's srtt_us >> 3 (microseconds), segs_in the segments received.
PROBE_SENDER = textwrap.dedent(r"""
    import json, socket, struct, sys, time
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print(s.getsockname()[1], flush=True)
    sys.stdin.readline()
    TCP_INFO = struct.Struct("<8x24I4Q2I")   # up to tcpi_segs_out, tcpi_segs_in
    rtts = []
    for i in range(int(sys.argv[2])):
        s.send(b"x" * 1000)
        if i % 20 == 0:
            rtts.append(TCP_INFO.unpack_from(s.getsockopt(socket.IPPROTO_TCP,
                                                          socket.TCP_INFO, 256))[15])
        time.sleep(0.001)
    info = TCP_INFO.unpack_from(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256))
    print(json.dumps({"rtts": rtts, "segs_in": info[-1]}), flush=True)
    sys.stdin.readline()
""")


def loopback_transfer(tmp_path, opts, rounds=1500):
    """Run a traced sender and an untraced receiver over loopback under a TcpSource.
    Returns (rows of the connection, sender pid, ports, sender's TCP_INFO, source, seconds
    the source ran, tracepoints attached while it ran)."""
    (tmp_path / "precv.py").write_text(PROBE_RECEIVER)
    (tmp_path / "psend.py").write_text(PROBE_SENDER)
    procs = []
    try:
        recv = subprocess.Popen([sys.executable, str(tmp_path / "precv.py")],
                                stdout=subprocess.PIPE, text=True)
        procs.append(recv)
        port = int(recv.stdout.readline())
        send = subprocess.Popen([sys.executable, str(tmp_path / "psend.py"), str(port),
                                 str(rounds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        procs.append(send)
        sport = int(send.stdout.readline())
        source = TcpSource(opts)
        with Running(source, StaticTargets([send.pid]), opts) as run:
            attached = set(source.bpf.tracepoint_fds)
            t0 = time.monotonic()
            send.stdin.write("go\n")
            send.stdin.flush()
            info = json.loads(send.stdout.readline())
            seconds = time.monotonic() - t0
            wait_for(lambda: any(r["sport"] == sport for r in run.sink.dicts("tcp_events")),
                     timeout=2)
        send.stdin.write("done\n")
        send.stdin.flush()
        send.wait(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = [r for r in run.sink.dicts("tcp_events")
            if {r["sport"], r["dport"]} == {sport, port} and r["saddr"] == "127.0.0.1"]
    return rows, send.pid, (sport, port), info, run.sink, seconds, attached


def test_tcp_probe_samples_rate_limited(ebpf_ok, tmp_path):
    interval_ms = 50
    opts = options(tcp_probe=True, tcp_probe_interval_ms=interval_ms)
    rows, sender, (sport, dport), info, sink, seconds, attached = \
        loopback_transfer(tmp_path, opts)
    assert {b"tcp:tcp_probe", b"tcp:tcp_retransmit_skb"} <= attached
    probes = [r for r in rows if r["event"] == "tcp_probe"]
    ns = os.stat("/proc/self/ns/net").st_ino
    # both ends' sockets receive segments: the sender's (ACKs) and the receiver's (data)
    out = [r for r in probes if (r["sport"], r["dport"]) == (sport, dport)]
    back = [r for r in probes if (r["sport"], r["dport"]) == (dport, sport)]
    assert out and back, probes[:5]
    for r in out:
        assert (r["family"], r["daddr"], r["state"], r["scope"], r["owner_pid"], r["netns"]) \
            == (4, "127.0.0.1", None, "job", sender, ns)
    for r in back:
        assert (r["scope"], r["owner_pid"], r["netns"]) == ("background", None, ns)
    for r in probes:
        assert 0 < r["srtt_us"] < 1_000_000 and 0 < r["snd_cwnd"] < 1_000_000, r
    # srtt_us is in microseconds like TCP_INFO's tcpi_rtt (both srtt_us >> 3): an
    # unshifted value would be 8 times larger
    probe_rtt = statistics.median(r["srtt_us"] for r in out)
    info_rtt = statistics.median(info["rtts"])
    assert info_rtt / 3 <= probe_rtt <= info_rtt * 3, (probe_rtt, info["rtts"])
    # sampled in the kernel: consecutive rows of one connection are an interval apart,
    # however many segments the socket received
    for conn in (out, back):
        ts = sorted(r["timestamp_ns"] for r in conn)
        assert all(b - a >= interval_ms * 1_000_000 for a, b in zip(ts, ts[1:])), ts
        assert len(conn) <= seconds * 1000 / interval_ms + 2
    assert info["segs_in"] > 3 * len(out), (info["segs_in"], len(out))


def test_tcp_probe_off_by_default(ebpf_ok, tmp_path):
    # no tcp_probe rows in tcp_events; the tracepoint itself is on for the progress
    # rows' 'unsent' kind, and off with them
    opts = options()
    assert opts.tcp_probe is False
    rows, *_rest, sink, _seconds, attached = loopback_transfer(tmp_path, opts, rounds=300)
    assert {b"tcp:tcp_retransmit_skb", b"tcp:tcp_probe"} <= attached
    assert not [r for r in sink.dicts("tcp_events") if r["event"] == "tcp_probe"]
    assert not any("tcp_probe" in log[3] for log in sink.logs if log[0] == "warning"), \
        sink.logs
    opts = options(tcp_progress=False)
    rows, *_rest, sink, _seconds, attached = loopback_transfer(tmp_path, opts, rounds=300)
    assert b"tcp:tcp_retransmit_skb" in attached and b"tcp:tcp_probe" not in attached
    assert not any("tcp_probe" in log[3] for log in sink.logs), sink.logs


def test_tcp_probe_interval_must_be_positive(ebpf_ok):
    opts = options(tcp_probe=True, tcp_probe_interval_ms=0)
    with pytest.raises(SourceUnavailable, match="interval must be > 0"):
        TcpSource(opts).start(CaptureContext("n", opts, StaticTargets()))


def test_cli_tcp_probe_options(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from ingero_forensics.capture import cli
    seen = []

    def fake_run_capture(config, reporter=None):
        seen.append(config.options)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "run_capture", fake_run_capture)
    runner = CliRunner()
    res = runner.invoke(cli.main, ["--help"])
    assert res.exit_code == 0 and "--tcp-probe-interval MS" in res.output
    res = runner.invoke(cli.main, ["--bundle", str(tmp_path), "--tcp-probe",
                                   "--tcp-probe-interval", "250"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli.main, ["--bundle", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert [(o.tcp_probe, o.tcp_probe_interval_ms) for o in seen] == [(True, 250),
                                                                        (False, 100)]
    res = runner.invoke(cli.main, ["--bundle", str(tmp_path), "--tcp-probe-interval", "50"])
    assert res.exit_code == 2
    assert res.output.splitlines()[-1] == "Error: --tcp-probe-interval needs --tcp-probe"
    seen.clear()
    for argv in (["--no-tcp-progress"], ["--tcp-progress-interval", "7"]):
        res = runner.invoke(cli.main, ["--bundle", str(tmp_path), *argv])
        assert res.exit_code == 0, res.output
    assert [(o.tcp_progress, o.tcp_progress_interval_ms) for o in seen] == [(False, 1000),
                                                                            (True, 7)]
    res = runner.invoke(cli.main, ["--bundle", str(tmp_path), "--no-tcp-progress",
                                   "--tcp-progress-interval", "7"])
    assert res.exit_code == 2 and "contradicts --no-tcp-progress" in res.output


def test_tcp_probe_that_cannot_load_keeps_retransmits(ebpf_ok, monkeypatch):
    # a tracepoint layout the program does not know (here: a field it lacks) turns only
    # the sampling off, with a warning
    from ingero_forensics.capture.ebpf import tcp
    monkeypatch.setattr(tcp, "PROBE_PROGRAM",
                        tcp.PROBE_PROGRAM.replace("args->snd_cwnd", "args->no_such_field"))
    opts = options(tcp_probe=True, tcp_progress=False)
    source = TcpSource(opts)
    with Running(source, StaticTargets(), opts) as run:
        attached = set(source.bpf.tracepoint_fds)
    assert b"tcp:tcp_retransmit_skb" in attached and b"tcp:tcp_probe" not in attached
    warnings = [log for log in run.sink.logs if log[0] == "warning"]
    assert len(warnings) == 1 and warnings[0][3].startswith("tcp:tcp_probe left off: "), warnings
    assert not any("tcp_probe" in log[3] for log in run.sink.logs if log[2] == "attached")


def test_tcp_progress_off(ebpf_ok, tmp_path):
    opts = options(tcp_progress=False)
    rows, *_rest, sink, _seconds, attached = loopback_transfer(tmp_path, opts, rounds=300)
    assert b"tcp:tcp_retransmit_skb" in attached
    assert not attached & {b"sock:sock_send_length", b"sock:sock_recv_length",
                           b"sock:inet_sock_set_state", b"tcp:tcp_sendmsg_locked"}
    assert not sink.dicts("tcp_progress")
