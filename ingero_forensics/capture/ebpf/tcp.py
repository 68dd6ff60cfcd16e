"""TCP retransmits from tcp:tcp_retransmit_skb, attributed to the job or the node.

The tracepoint fires in softirq or timer context for every socket on the machine, so its
pid says nothing and other network namespaces show up too. Each retransmit's 4-tuple is
looked up in the connection tables (/proc/PID/net/tcp and tcp6) of the traced processes'
own network namespaces, and the socket inode in their /proc/PID/fd: a match owned by a
traced process is scope 'job' with owner_pid; anything else is 'background', with the
network namespace it was found in when some process on the node shows it. Tables are
refreshed every second and at once (rate-limited) when an unknown tuple arrives;
entries are remembered a while after the connection is gone.

Addresses and ports come from the tracepoint's own fields (no struct sock reads).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time

from ..source import CaptureContext, RowSink, SourceUnavailable
from ._bcc import tracepoint_exists
from .base import BccSource

PROGRAM = r"""
struct event {
    u64 ts; u32 pid; s32 state; u16 sport; u16 dport; u16 family; u8 pad[2];
    u8 saddr[16]; u8 daddr[16];
};

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb) {
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) { count_lost(); return 0; }
    e->ts = bpf_ktime_get_ns();
    e->pid = bpf_get_current_pid_tgid() >> 32;
    e->state = args->state; e->sport = args->sport; e->dport = args->dport;
    e->family = args->family;
    if (args->family == 2) {   /* AF_INET */
        bpf_probe_read_kernel(e->saddr, 4, args->saddr);
        bpf_probe_read_kernel(e->daddr, 4, args->daddr);
    } else {
        bpf_probe_read_kernel(e->saddr, 16, args->saddr_v6);
        bpf_probe_read_kernel(e->daddr, 16, args->daddr_v6);
    }
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}
"""

EVENT = struct.Struct("<QIiHHH2x16s16s")
TCP_STATES = (None, "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2",
              "TIME_WAIT", "CLOSE", "CLOSE_WAIT", "LAST_ACK", "LISTEN", "CLOSING",
              "NEW_SYN_RECV")
AF_INET, AF_INET6 = 2, 10


def normalize(addr: ipaddress._BaseAddress) -> ipaddress._BaseAddress:
    """IPv4-mapped IPv6 (a v4 peer on a v6 socket) compares as the IPv4 address."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return addr.ipv4_mapped
    return addr


def parse_proc_addr(text: str) -> tuple[ipaddress._BaseAddress, int]:
    """'0100007F:1F90' (/proc/net/tcp: 32-bit words in host order) -> (address, port)."""
    hexaddr, hexport = text.split(":")
    raw = bytes.fromhex(hexaddr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # little-endian words
    return normalize(ipaddress.ip_address(raw)), int(hexport, 16)


def read_tcp_table(proc_pid_dir: str) -> list[tuple[tuple, int]]:
    """[(4-tuple, socket inode)] from PID/net/tcp and tcp6. 4-tuple = (local addr, local
    port, remote addr, remote port) with normalized addresses."""
    out = []
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_pid_dir, "net", name)) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            try:
                local, lport = parse_proc_addr(parts[1])
                remote, rport = parse_proc_addr(parts[2])
                out.append(((local, lport, remote, rport), int(parts[9])))
            except ValueError:
                continue
    return out


def netns_inode(pid: int, proc: str = "/proc") -> int | None:
    try:
        return os.stat(f"{proc}/{pid}/ns/net").st_ino
    except OSError:
        return None


def socket_inodes(pid: int, proc: str = "/proc") -> set[int]:
    out = set()
    fd_dir = f"{proc}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for n in names:
        try:
            link = os.readlink(f"{fd_dir}/{n}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


class ConnectionIndex:
    """4-tuple -> (netns inode, owning traced pid or None), with a memory of closed ones."""

    KEEP_S = 120.0          # remember a connection this long after it was last seen
    JOB_REFRESH_S = 1.0
    MISS_REFRESH_S = 0.2
    NODE_REFRESH_S = 2.0

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self.entries: dict[tuple, tuple[int | None, int | None, float]] = {}
        self.job_at = self.node_at = 0.0

    def refresh_job(self, pids, now: float) -> None:
        self.job_at = now
        seen_ns: set[int] = set()
        for pid in sorted(pids):
            ns = netns_inode(pid, self.proc)
            owned = socket_inodes(pid, self.proc)
            for tup, inode in read_tcp_table(f"{self.proc}/{pid}"):
                if inode and inode in owned:
                    self.entries[tup] = (ns, pid, now)
                elif ns not in seen_ns or tup not in self.entries:
                    prev = self.entries.get(tup)
                    owner = prev[1] if prev and prev[0] == ns else None
                    self.entries[tup] = (ns, owner, now)
            if ns is not None:
                seen_ns.add(ns)
        self._expire(now)

    def refresh_node(self, now: float) -> None:
        """One table per network namespace on the node, for background attribution."""
        self.node_at = now
        done: set[int] = set()
        try:
            pids = [int(n) for n in os.listdir(self.proc) if n.isdigit()]
        except OSError:
            return
        for pid in pids:
            ns = netns_inode(pid, self.proc)
            if ns is None or ns in done:
                continue
            done.add(ns)
            for tup, _inode in read_tcp_table(f"{self.proc}/{pid}"):
                if tup not in self.entries or self.entries[tup][1] is None:
                    self.entries[tup] = (ns, None, now)

    def _expire(self, now: float) -> None:
        old = [k for k, v in self.entries.items() if now - v[2] > self.KEEP_S]
        for k in old:
            del self.entries[k]

    def lookup(self, tup: tuple) -> tuple[int | None, int | None] | None:
        hit = self.entries.get(tup)
        return (hit[0], hit[1]) if hit else None


class TcpSource(BccSource):
    name = "tcp"

    def __init__(self, options):
        super().__init__(options)
        self.index = ConnectionIndex()

    def filter_targets(self, ctx: CaptureContext) -> bool:
        return False   # softirq context: the kernel cannot tell whose packet it is

    def program(self, ctx: CaptureContext) -> str:
        return PROGRAM

    def start(self, ctx: CaptureContext) -> None:
        if not tracepoint_exists("tcp", "tcp_retransmit_skb"):
            raise SourceUnavailable("tracepoint tcp:tcp_retransmit_skb not found (kernel < 4.15?)")
        super().start(ctx)
        self.index.refresh_job(ctx.targets.pids(), time.monotonic())

    def attach(self, ctx: CaptureContext) -> None:
        self.attached.append("tracepoint tcp:tcp_retransmit_skb; attribution from the "
                             "traced processes' connection tables")
        if self.options.tcp_probe:
            self.notes.append(("warning", "tcp_probe sampling is not implemented in this "
                               "version; only retransmits are recorded"))

    def housekeeping(self, sink: RowSink) -> None:
        now = time.monotonic()
        if now - self.index.job_at >= self.index.JOB_REFRESH_S:
            self.index.refresh_job(self.ctx.targets.pids(), now)

    def handle(self, raw: list[bytes], sink: RowSink) -> None:
        events = []
        for rec in raw:
            ts, pid, state, sport, dport, family, saddr, daddr = EVENT.unpack(rec)
            if family == AF_INET:
                src, dst = ipaddress.IPv4Address(saddr[:4]), ipaddress.IPv4Address(daddr[:4])
            else:
                src, dst = ipaddress.IPv6Address(saddr), ipaddress.IPv6Address(daddr)
            events.append((ts, pid, state, sport, dport, family, src, dst))
        now = time.monotonic()
        keys = [(normalize(e[6]), e[3], normalize(e[7]), e[4]) for e in events]
        if any(self.index.lookup(k) is None for k in keys) and \
                now - self.index.job_at >= self.index.MISS_REFRESH_S:
            self.index.refresh_job(self.ctx.targets.pids(), now)
        if any(self.index.lookup(k) is None for k in keys) and \
                now - self.index.node_at >= self.index.NODE_REFRESH_S:
            self.index.refresh_node(now)
        rows = []
        for (ts, pid, state, sport, dport, family, src, dst), key in zip(events, keys):
            netns, owner = self.index.lookup(key) or (None, None)
            rows.append((ts, "tcp_retransmit_skb", 4 if family == AF_INET else 6, str(src),
                         str(dst), sport, dport,
                         TCP_STATES[state] if 0 <= state < len(TCP_STATES) else None,
                         pid or None, netns, owner, "job" if owner else "background",
                         None, None))
        sink.add_many("tcp_events", rows)
        self.events += len(rows)
