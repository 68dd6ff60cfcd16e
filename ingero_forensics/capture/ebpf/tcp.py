"""TCP retransmits from tcp:tcp_retransmit_skb, attributed to the job or the node.

The tracepoint fires in softirq or timer context for every socket on the machine, so its
pid says nothing and other network namespaces show up too. Each retransmit's 4-tuple is
looked up in the connection tables (/proc/PID/net/tcp and tcp6) of the traced processes'
own network namespaces, and the socket inode in their /proc/PID/fd: a match owned by a
traced process is scope 'job' with owner_pid; anything else is 'background', with the
network namespace it was found in when some process on the node shows it. Tables are
refreshed every second and at once (rate-limited) when an unknown tuple arrives;
entries are remembered a while after the connection is gone.

With ``CaptureOptions.tcp_probe``, tcp:tcp_probe (fired for each segment an established
socket receives) is attached too and sampled in the kernel: at most one row per 4-tuple
per ``tcp_probe_interval_ms``, the last emission time kept in an LRU hash, so a busy
socket costs a map lookup per segment and not a ring buffer record. Its rows carry
srtt_us and snd_cwnd and are attributed exactly like retransmits.

Addresses and ports come from the tracepoints' own fields (no struct sock reads). The
tcp_progress rows read seven tcp_sock fields and one of its inet_connection_sock, at the
offsets the running kernel's BTF gives (btf.py), never through compiled-in headers.
"""

from __future__ import annotations

import ipaddress
import os
import struct
import time

from ...bundle.schema import TCP_DIRECTIONS as DIRECTIONS
from ..source import CaptureContext, RowSink, SourceStatus, SourceUnavailable
from . import btf
from ._bcc import require_tracepoint, tracepoint_exists
from .base import BccSource
from .progress import (PROGRESS, PROGRESS_CONNS, PROGRESS_GAP_NS,
                       PROGRESS_PROGRAM, UNSENT_PROGRAM)

PROGRAM = r"""
struct event {
    u64 ts; u32 pid; s32 state; u16 sport; u16 dport; u16 family; u8 kind; u8 pad;
    u8 saddr[16]; u8 daddr[16]; u32 srtt_us; u32 snd_cwnd;
};

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb) {
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) { count_lost(); return 0; }
    e->ts = bpf_ktime_get_ns();
    e->pid = bpf_get_current_pid_tgid() >> 32;
    e->state = args->state; e->sport = args->sport; e->dport = args->dport;
    e->family = args->family; e->kind = KIND_RETRANSMIT;
    if (args->family == 2) {   /* AF_INET */
        bpf_probe_read_kernel(e->saddr, 4, args->saddr);
        bpf_probe_read_kernel(e->daddr, 4, args->daddr);
    } else {
        bpf_probe_read_kernel(e->saddr, 16, args->saddr_v6);
        bpf_probe_read_kernel(e->daddr, 16, args->daddr_v6);
    }
    e->srtt_us = 0; e->snd_cwnd = 0;
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}
"""

#: Appended only with CaptureOptions.tcp_probe: BCC attaches every TRACEPOINT_PROBE in
#: the text, so leaving it out is what keeps the tracepoint detached by default.
PROBE_PROGRAM = r"""
struct conn { u8 saddr[16]; u8 daddr[16]; u16 sport; u16 dport; u16 family; u16 pad; };
BPF_TABLE("lru_hash", struct conn, u64, probe_last, __PROBE_CONNS__);

/* saddr/daddr are struct sockaddr_in or sockaddr_in6 (by family); ports are host order */
static __always_inline void probe_sample(const u8 *saddr, const u8 *daddr, u16 sport,
                                         u16 dport, u16 family, u32 srtt, u32 snd_cwnd) {
    struct conn c = {};
    c.sport = sport; c.dport = dport; c.family = family;
    if (family == 2) {         /* sockaddr_in: sin_addr at offset 4 */
        bpf_probe_read_kernel(c.saddr, 4, saddr + 4);
        bpf_probe_read_kernel(c.daddr, 4, daddr + 4);
    } else {                   /* sockaddr_in6: sin6_addr at offset 8 */
        bpf_probe_read_kernel(c.saddr, 16, saddr + 8);
        bpf_probe_read_kernel(c.daddr, 16, daddr + 8);
    }
    u64 now = bpf_ktime_get_ns();
    u64 *last = probe_last.lookup(&c);
    if (last && now - *last < __PROBE_INTERVAL_NS__ULL) return;
    probe_last.update(&c, &now);
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) { count_lost(); return; }
    e->ts = now;
    e->pid = bpf_get_current_pid_tgid() >> 32;
    e->state = -1;             /* the tracepoint has no state field */
    e->sport = c.sport; e->dport = c.dport; e->family = c.family; e->kind = KIND_PROBE;
    __builtin_memcpy(e->saddr, c.saddr, 16);
    __builtin_memcpy(e->daddr, c.daddr, 16);
    e->srtt_us = srtt;         /* the kernel stores tp->srtt_us >> 3: microseconds */
    e->snd_cwnd = snd_cwnd;
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}
#define PROBE_SAMPLE() probe_sample(args->saddr, args->daddr, args->sport, args->dport, \
                                    args->family, args->srtt, args->snd_cwnd)
"""

#: One handler for tcp:tcp_probe, whatever uses it (a program text holds one per
#: tracepoint): the parts' macros are defined only when their part is in the text.
TCP_PROBE_HANDLER = r"""
TRACEPOINT_PROBE(tcp, tcp_probe) {
#ifdef PROBE_SAMPLE
    PROBE_SAMPLE();
#endif
#ifdef PROGRESS_UNSENT
    PROGRESS_UNSENT();
#endif
    return 0;
}
"""


KIND_RETRANSMIT, KIND_PROBE = 0, 1
EVENT_NAMES = ("tcp_retransmit_skb", "tcp_probe")
EVENT = struct.Struct("<QIiHHHBx16s16sII")
PROBE_CONNS = 16384   # connections whose last tcp_probe time is remembered (LRU)
TCP_STATES = (None, "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2",
              "TIME_WAIT", "CLOSE", "CLOSE_WAIT", "LAST_ACK", "LISTEN", "CLOSING",
              "NEW_SYN_RECV")
AF_INET, AF_INET6 = 2, 10
#: stream positions at or above this are no stream's (the merge screens at 2^60 too)
MAX_POSITION = 1 << 60


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
    probe_detail = ("tcp tracepoints: retransmits, and the job's TCP progress")

    def __init__(self, options):
        super().__init__(options)
        self.index = ConnectionIndex()
        self.probe_on = False   # tcp:tcp_probe compiled in and attached
        self.progress_on = False       # the tcp_progress probes compiled in and attached
        self.progress_began = False    # ... with tcp:tcp_sendmsg_locked (send starts)
        self.progress_arrivals = False  # ... with sock:sk_data_ready (arrivals)
        self.progress_unsent = False   # ... with tcp:tcp_probe (bytes not sent yet)
        self.sock_offsets: dict[str, int] | None = None   # tcp_sock members, from BTF
        self.progress_rows = 0

    def filter_targets(self, ctx: CaptureContext) -> bool:
        # Retransmits fire in softirq context, where the kernel cannot tell whose packet
        # it is: they never ask. The progress probes run in the calling process and keep
        # only the traced ones (the targets map is filled only when this is true).
        return self.progress_on

    def program(self, ctx: CaptureContext) -> str:
        text = f"#define KIND_RETRANSMIT {KIND_RETRANSMIT}\n#define KIND_PROBE {KIND_PROBE}\n"
        text += PROGRAM
        if self.probe_on:
            interval_ns = int(self.options.tcp_probe_interval_ms) * 1_000_000
            text += (PROBE_PROGRAM.replace("__PROBE_CONNS__", str(PROBE_CONNS))
                                  .replace("__PROBE_INTERVAL_NS__", str(interval_ns)))
        if self.progress_on:
            interval_ns = int(self.options.tcp_progress_interval_ms) * 1_000_000
            prog = PROGRESS_PROGRAM
            if self.sock_offsets:
                prog = "".join(f"#define {name.upper()}_OFFSET {offset}\n"
                               for name, offset in self.sock_offsets.items()) + prog
            if self.progress_unsent:
                # connections established before the capture: their mappings are read
                # at their first segment in (tcp:tcp_probe), with the kernel's BTF
                prog = "#define PROGRESS_ATTACH 1\n" + prog
            if not self.progress_arrivals:
                # no arrival rows: receives are bounded by their returns only
                prog = prog[:prog.index("TRACEPOINT_PROBE(sock, sk_data_ready)")]
            if self.progress_unsent:
                prog += UNSENT_PROGRAM
            text += (prog.replace("__PROGRESS_CONNS__", str(PROGRESS_CONNS))
                         .replace("__PROGRESS_INTERVAL_NS__", str(interval_ns))
                         .replace("__PROGRESS_GAP_NS__", str(PROGRESS_GAP_NS)))
        if self.probe_on or (self.progress_on and self.progress_unsent):
            text += TCP_PROBE_HANDLER
        return text

    def start(self, ctx: CaptureContext) -> None:
        require_tracepoint("tcp", "tcp_retransmit_skb")
        if self.options.tcp_probe:
            if int(self.options.tcp_probe_interval_ms) <= 0:
                raise SourceUnavailable(f"tcp_probe interval must be > 0 ms, not "
                                        f"{self.options.tcp_probe_interval_ms}")
            self.probe_on = tracepoint_exists("tcp", "tcp_probe")
            if not self.probe_on:
                self.notes.append(("warning", "tracepoint tcp:tcp_probe not found (kernel < "
                                   "4.16?); only retransmits are recorded"))
        if self.options.tcp_progress:
            if int(self.options.tcp_progress_interval_ms) <= 0:
                raise SourceUnavailable(f"tcp_progress interval must be > 0 ms, not "
                                        f"{self.options.tcp_progress_interval_ms}")
            missing = [f"sock:{n}" for n in ("inet_sock_set_state", "sock_send_length",
                                             "sock_recv_length")
                       if not tracepoint_exists("sock", n)]
            if not tracepoint_exists("tcp", "tcp_sendmsg_locked"):
                # a send is dated by its first copy; its return is too late to pair
                missing.append("tcp:tcp_sendmsg_locked")
            self.progress_on = not missing
            self.progress_began = self.progress_on
            self.progress_arrivals = self.progress_on and tracepoint_exists("sock",
                                                                            "sk_data_ready")
            if self.progress_on:
                self._find_sock_offsets()
            if missing:
                self.notes.append(("warning", f"tracepoint {', '.join(missing)} not found "
                                   "(kernel < 6.3?): no tcp_progress rows, so the merge "
                                   "cannot bound this node's clock by its TCP messages"))
        self._start_leaving_off(ctx)
        self.index.refresh_job(ctx.targets.pids(), time.monotonic())

    #: tcp_sock members the progress program reads by offset (btf.py), and their widths
    SOCK_MEMBERS = {"bytes_acked": 8, "rcv_nxt": 4, "copied_seq": 4, "snd_nxt": 4,
                    "snd_una": 4, "bytes_received": 8, "write_seq": 4}
    #: ... and of inet_connection_sock, which a tcp_sock begins with
    ICSK_MEMBERS = {"icsk_ulp_ops": 8}

    @classmethod
    def sock_offsets_from_btf(cls) -> dict[str, int]:
        """Offsets of SOCK_MEMBERS and ICSK_MEMBERS in the running kernel; BtfError."""
        types = btf.load()
        offsets = types.offsets("tcp_sock", cls.SOCK_MEMBERS)
        offsets.update(types.offsets("inet_connection_sock", cls.ICSK_MEMBERS))
        if types.offsets("tcp_sock", {"inet_conn": None}) != {"inet_conn": 0}:
            raise btf.BtfError("tcp_sock does not begin with its inet_connection_sock")
        return offsets

    @classmethod
    def probe(cls) -> SourceStatus:
        """--check: as every eBPF source, and what the tcp_progress rows would lack."""
        status = super().probe()
        if status.available:
            try:
                cls.sock_offsets_from_btf()
            except btf.BtfError as e:
                return SourceStatus(cls.name, True, f"no 'unsent' tcp_progress rows, "
                                    f"one-byte arrivals, no rows for connections older "
                                    f"than the capture: {e}")
        return status

    def _find_sock_offsets(self) -> None:
        """'unsent' rows and the connections older than the capture need tcp:tcp_probe
        and tcp_sock's counts and sequence numbers, and the extent of an arrival rcv_nxt
        and copied_seq, at their offsets in the running kernel; without them the sends
        and the first unread byte of connections the capture saw established still bound
        the clocks, loosely where sends wait for the receiver's window."""
        try:
            self.sock_offsets = self.sock_offsets_from_btf()
        except btf.BtfError as e:
            self.notes.append(("warning", f"no 'unsent' tcp_progress rows and arrivals of "
                               f"one byte: the kernel's BTF does not give tcp_sock's "
                               f"{', '.join(self.SOCK_MEMBERS | self.ICSK_MEMBERS)} "
                               f"({e}), so sends that wait "
                               f"for the receiver's window bound the clocks loosely and "
                               f"connections established before the capture (all of a "
                               f"job it attached to) get no rows"))
            return
        if tracepoint_exists("tcp", "tcp_probe"):
            self.progress_unsent = True
        else:
            self.notes.append(("warning", "tracepoint tcp:tcp_probe not found: no 'unsent' "
                               "tcp_progress rows, so sends that wait for the receiver's "
                               "window bound the clocks loosely, and connections "
                               "established before the capture (all of a job it attached "
                               "to) get no rows"))

    #: (attribute, what the capture loses without it) of the optional parts, the
    #: cheapest to lose first
    OPTIONAL = (("probe_on", "tcp:tcp_probe left off: {why}; only retransmits are recorded"),
                ("progress_unsent", "tcp_progress 'unsent' rows left off: {why}; sends that "
                 "wait for the receiver's window bound the clocks loosely, and connections "
                 "established before the capture get no rows"),
                ("progress_on", "tcp_progress left off: {why}; the merge cannot bound this "
                 "node's clock by its TCP messages"))

    def _start_leaving_off(self, ctx: CaptureContext) -> None:
        """Start; an optional part whose layout this program does not know must not cost
        the retransmits: find the part that fails (each left off alone, then all), leave
        it off and say so."""
        try:
            super().start(ctx)
            return
        except SourceUnavailable as e:
            first = e
        on = [(attr, note) for attr, note in self.OPTIONAL if getattr(self, attr)]
        if not on:
            raise first
        tries = [[part] for part in on] + ([on] if len(on) > 1 else [])
        began, arrivals, unsent = (self.progress_began, self.progress_arrivals,
                                   self.progress_unsent)
        for off in tries:
            for attr, _ in off:
                setattr(self, attr, False)
            self.progress_began = self.progress_began and self.progress_on
            self.progress_arrivals = self.progress_arrivals and self.progress_on
            self.progress_unsent = self.progress_unsent and self.progress_on
            self.attached.clear()
            try:
                super().start(ctx)
            except SourceUnavailable:
                if off is tries[-1]:
                    raise first from None
                for attr, _ in off:
                    setattr(self, attr, True)
                self.progress_began, self.progress_arrivals = began, arrivals
                self.progress_unsent = unsent
                continue
            for _, note in off:
                self.notes.append(("warning", note.format(why=first.reason)))
            return

    def attach(self, ctx: CaptureContext) -> None:
        # BCC attached the TRACEPOINT_PROBEs when it loaded the program
        self.attached.append("tracepoint tcp:tcp_retransmit_skb; attribution from the "
                             "traced processes' connection tables")
        if self.probe_on:
            self.attached.append(f"tracepoint tcp:tcp_probe sampled at most once per "
                                 f"connection per {self.options.tcp_probe_interval_ms} ms")
        if self.progress_on:
            began = ", tcp:tcp_sendmsg_locked" if self.progress_began else ""
            began += ", sock:sk_data_ready" if self.progress_arrivals else ""
            began += (", tcp:tcp_probe (bytes not sent yet)" if self.progress_unsent
                      else "")
            if self.sock_offsets:
                began += (" (tcp_sock " + ", ".join(f"{name} at {offset}" for name, offset
                                                    in self.sock_offsets.items())
                          + ", from the kernel's BTF)")
            self.attached.append(
                f"tracepoints sock:inet_sock_set_state, sock:sock_send_length, "
                f"sock:sock_recv_length{began}: the traced processes' TCP byte progress, "
                f"at grid positions of each stream and at most once per connection and "
                f"kind per "
                f"{self.options.tcp_progress_interval_ms} ms")
            # every program is attached (BCC did it on load): connections may be counted
            armed = self.bpf[b"armed"]
            armed[armed.Key(0)] = armed.Leaf(1)

    def housekeeping(self, sink: RowSink) -> None:
        now = time.monotonic()
        if now - self.index.job_at >= self.index.JOB_REFRESH_S:
            self.index.refresh_job(self.ctx.targets.pids(), now)

    def handle(self, raw: list[bytes], sink: RowSink) -> None:
        progress = [rec for rec in raw if len(rec) == PROGRESS.size]
        if progress:
            raw = [rec for rec in raw if len(rec) != PROGRESS.size]
            self.handle_progress(progress, sink)
        events = []
        for rec in raw:
            (ts, pid, state, sport, dport, family, kind, saddr, daddr, srtt_us,
             snd_cwnd) = EVENT.unpack(rec)
            if family == AF_INET:
                src, dst = ipaddress.IPv4Address(saddr[:4]), ipaddress.IPv4Address(daddr[:4])
            else:
                src, dst = ipaddress.IPv6Address(saddr), ipaddress.IPv6Address(daddr)
            probe = kind == KIND_PROBE
            events.append((ts, EVENT_NAMES[kind], pid, state, sport, dport, family, src, dst,
                           srtt_us if probe else None, snd_cwnd if probe else None))
        now = time.monotonic()
        keys = [(normalize(e[7]), e[4], normalize(e[8]), e[5]) for e in events]
        if any(self.index.lookup(k) is None for k in keys) and \
                now - self.index.job_at >= self.index.MISS_REFRESH_S:
            self.index.refresh_job(self.ctx.targets.pids(), now)
        if any(self.index.lookup(k) is None for k in keys) and \
                now - self.index.node_at >= self.index.NODE_REFRESH_S:
            self.index.refresh_node(now)
        rows = []
        for (ts, event, pid, state, sport, dport, family, src, dst, srtt_us, snd_cwnd), key \
                in zip(events, keys):
            netns, owner = self.index.lookup(key) or (None, None)
            rows.append((ts, event, 4 if family == AF_INET else 6, str(src), str(dst), sport,
                         dport, TCP_STATES[state] if 0 <= state < len(TCP_STATES) else None,
                         pid or None, netns, owner, "job" if owner else "background",
                         srtt_us, snd_cwnd))
        sink.add_many("tcp_events", rows)
        self.events += len(rows)

    def handle_progress(self, raw: list[bytes], sink: RowSink) -> None:
        rows = []
        for rec in raw:
            (ts, offset, connected, nbytes, pid, tid, sport, dport, family, direction,
             attached, saddr, daddr) = PROGRESS.unpack(rec)
            if family not in (AF_INET, AF_INET6) or offset + nbytes >= MAX_POSITION:
                # a connection attached to whose 4-tuple another CPU had not seen yet
                # when the row was written (no ordering between map fields), or a
                # position no stream reaches: not a row to pair
                continue
            if family == AF_INET:
                src, dst = ipaddress.IPv4Address(saddr[:4]), ipaddress.IPv4Address(daddr[:4])
            else:
                src, dst = (normalize(ipaddress.IPv6Address(saddr)),
                            normalize(ipaddress.IPv6Address(daddr)))
            if direction >= len(DIRECTIONS):
                continue
            rows.append((ts, DIRECTIONS[direction], 4 if family == AF_INET else 6,
                         str(src), sport, str(dst), dport, connected, offset, nbytes, pid,
                         tid, attached))
        sink.add_many("tcp_progress", rows)
        self.progress_rows += len(rows)
        self.events += len(rows)
