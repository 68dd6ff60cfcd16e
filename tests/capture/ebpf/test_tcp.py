"""TCP retransmits on the real kernel: two network namespaces of our own joined by a
veth, a tbf qdisc with a tiny burst and queue on the sender side (this kernel has no
netem), and bulk transfers. One sender is traced (its retransmits are the job's), the
other is not (background, same namespace)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

from .conftest import Running, StaticTargets, options, wait_for
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
