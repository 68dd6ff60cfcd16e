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
tcp_progress rows read five tcp_sock fields and one of its inet_connection_sock, at the
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

#: Appended unless CaptureOptions.tcp_progress is off: each traced process's TCP bytes
#: counted per connection from its establishment (sock:inet_sock_set_state), in the
#: kernel, at every send and receive (sock:sock_send_length, sock:sock_recv_length);
#: tcp:tcp_sendmsg_locked marks when a send began copying. A record is written for a call
#: that starts a burst on its end of the connection (after PROGRESS_GAP_NS of quiet), at
#: most once per interval per connection and kind, for any call after ten intervals, and
#: for a call that reaches the kind's next position on the grid both ends share
#: (next_mark): the calls that pair tightly with the other node's (bundle table
#: tcp_progress). The flows map is keyed by the struct sock address; with the kernel's
#: BTF the socket's tcp_sock fields are read at their offsets (establishment, arrivals,
#: unsent rows).
PROGRESS_PROGRAM = r"""
struct flow {
    u64 connected; u64 sent; u64 rcvd; u64 last[4]; u64 emitted[4];  /* by row kind */
    u8 saddr[16]; u8 daddr[16]; u16 sport; u16 dport; u16 family; u16 pad;
    u32 tgid; u32 tid;             /* the traced process and thread that last read it */
    u32 wtgid; u32 wtid;           /* ... and that last wrote it */
    u64 acked0;                    /* tcp_sock.bytes_acked at establishment (unsent rows) */
    u64 mark[4];                   /* by row kind: the next grid position (next_mark) */
    u64 cand_ts; u64 cand_off;     /* unsent: the last instant the mark had not left */
};
struct progress {
    u64 ts; u64 offset; u64 connected; u32 bytes; u32 pid; u32 tid; u16 sport; u16 dport;
    u16 family; u8 dir; u8 pad; u8 saddr[16]; u8 daddr[16]; u32 pad2;
};
/* records are told from the retransmit source's (64 bytes) by their size */
_Static_assert(sizeof(struct progress) == 80, "struct progress is PROGRESS in tcp.py");
BPF_TABLE("lru_hash", u64, struct flow, flows, __PROGRESS_CONNS__);
BPF_TABLE("lru_hash", u32, u64, send_began, __PROGRESS_CONNS__);
/* 1 once every program below is attached (set by the capture): BCC attaches them one
   by one, and a connection counted while one end's counter was not yet on would have
   counts that disagree, so no flow starts before */
BPF_ARRAY(armed, u32, 1);

TRACEPOINT_PROBE(sock, inet_sock_set_state) {
    if (args->protocol != 6) return 0;          /* IPPROTO_TCP */
    u64 sk = (u64)args->skaddr;
    int zero = 0;
    u32 *on = armed.lookup(&zero);
    if (args->newstate == 1 && on && *on) {      /* TCP_ESTABLISHED: count from here */
        struct flow f = {};
        f.connected = bpf_ktime_get_ns();
        f.sport = args->sport; f.dport = args->dport; f.family = args->family;
        if (args->family == 2) {
            bpf_probe_read_kernel(f.saddr, 4, args->saddr);
            bpf_probe_read_kernel(f.daddr, 4, args->daddr);
        } else {
            bpf_probe_read_kernel(f.saddr, 16, args->saddr_v6);
            bpf_probe_read_kernel(f.daddr, 16, args->daddr_v6);
        }
#ifdef BYTES_ACKED_OFFSET
        /* an active open's SYN is counted in (its SYN-ACK acknowledged it), a passive
           one's is not: the stream starts from the count at establishment */
        bpf_probe_read_kernel(&f.acked0, sizeof(f.acked0), (void *)(sk + BYTES_ACKED_OFFSET));
        /* data that moved before establishment (TCP Fast Open: in the SYN, or sent by a
           server from SYN_RECV) is in one end's sequence space and not in the other's
           counts: such a connection is not counted at all (a client's SYN data shows in
           what its SYN-ACK acknowledged, more than the SYN's one) */
        u32 nxt = 0, una = 1, rnxt = 0, copied = 1;
        bpf_probe_read_kernel(&nxt, sizeof(nxt), (void *)(sk + SND_NXT_OFFSET));
        bpf_probe_read_kernel(&una, sizeof(una), (void *)(sk + SND_UNA_OFFSET));
        bpf_probe_read_kernel(&rnxt, sizeof(rnxt), (void *)(sk + RCV_NXT_OFFSET));
        bpf_probe_read_kernel(&copied, sizeof(copied), (void *)(sk + COPIED_SEQ_OFFSET));
        if (nxt != una || rnxt != copied || f.acked0 > 1) return 0;
#endif
        flows.update(&sk, &f);
    } else if (args->oldstate == 1) {            /* leaving ESTABLISHED: stop counting */
        flows.delete(&sk);
    }
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_sendmsg_locked) {
    u32 tid = bpf_get_current_pid_tgid();
    u64 now = bpf_ktime_get_ns();
    send_began.insert(&tid, &now);               /* the call's first copy only */
    return 0;
}

/* The grid both ends of a connection write rows at, whenever else they write them: 32
   positions per power of two of the stream position, 64 KiB to 16 GiB apart. Computed
   from the position alone, so the sender's row for the byte at a grid position and the
   receiver's row for the same byte are written however the two ends' time-based rows
   fall (a starved reader sees a burst late, and time-based rows on the two ends then
   pick different bursts). Returns the first grid position above `last`. */
static __always_inline u64 next_mark(u64 last) {
    u64 x = last | 1;
    int lg = 0;
    if (x >> 32) { lg += 32; x >>= 32; }
    if (x >> 16) { lg += 16; x >>= 16; }
    if (x >> 8) { lg += 8; x >>= 8; }
    if (x >> 4) { lg += 4; x >>= 4; }
    if (x >> 2) { lg += 2; x >>= 2; }
    if (x >> 1) { lg += 1; }
    int shift = lg - 5;
    if (shift < 16) shift = 16;
    if (shift > 34) shift = 34;
    return ((last >> shift) + 1) << shift;
}

/* A row is due at a call (or segment) that reaches the kind's next grid position, or by
   time: one that starts a burst (after GAP of quiet) at least an interval after the
   kind's last row, or any call ten intervals after it. */
static __always_inline int due(struct flow *f, int kind, u64 end, u64 now, u64 quiet) {
    u64 since = now - f->emitted[kind & 3];
    int marked = end > f->mark[kind & 3];
    if (marked) f->mark[kind & 3] = next_mark(end - 1);
    if (!marked) {
        if (since < __PROGRESS_INTERVAL_NS__ULL) return 0;
        if (quiet < __PROGRESS_GAP_NS__ULL && since < 10 * __PROGRESS_INTERVAL_NS__ULL)
            return 0;
    }
    f->emitted[kind & 3] = now;
    return 1;
}

static __always_inline void emit(struct flow *f, u64 ts, u64 offset, u32 bytes, u32 tgid,
                                 u32 tid, u8 dir) {
    struct progress *e = events.ringbuf_reserve(sizeof(struct progress));
    if (!e) { count_lost(); return; }
    e->ts = ts; e->offset = offset; e->bytes = bytes; e->pid = tgid; e->tid = tid;
    e->sport = f->sport; e->dport = f->dport; e->connected = f->connected;
    e->family = f->family; e->dir = dir; e->pad = 0; e->pad2 = 0;
    __builtin_memcpy(e->saddr, f->saddr, 16);
    __builtin_memcpy(e->daddr, f->daddr, 16);
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

static __always_inline int progress(u64 sk, int ret, u8 dir, u64 began) {
    struct flow *f = flows.lookup(&sk);
    if (!f) return 0;
    u64 now = bpf_ktime_get_ns();
    u64 offset = __sync_fetch_and_add(dir ? &f->rcvd : &f->sent, (u64)ret);
    /* a send is dated by its first copy: its return comes after its first bytes may
       have arrived on the other node, so a send whose start was not seen gets no row */
    if (!dir && !began) return 0;
    u64 start = dir ? now : began;
    u64 quiet = start - f->last[dir & 1];
    f->last[dir & 1] = now;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!is_target(tgid)) return 0;
    if (dir) { f->tgid = tgid; f->tid = bpf_get_current_pid_tgid(); }
    else { f->wtgid = tgid; f->wtid = bpf_get_current_pid_tgid(); }
    if (!due(f, dir & 1, offset + ret, now, quiet)) return 0;
    emit(f, start, offset, ret, tgid, bpf_get_current_pid_tgid(), dir);
    return 0;
}

TRACEPOINT_PROBE(sock, sock_send_length) {
    u32 tid = bpf_get_current_pid_tgid();
    u64 *b = send_began.lookup(&tid);
    u64 began = b ? *b : 0;
    if (b) send_began.delete(&tid);
    if (args->protocol != 6 || args->ret <= 0) return 0;
    return progress((u64)args->sk, args->ret, 0, began);
}

TRACEPOINT_PROBE(sock, sock_recv_length) {
    /* MSG_PEEK (2) leaves the bytes in the socket, MSG_ERRQUEUE (0x2000) reads the
       error queue: not the stream's bytes; MSG_OOB (1) reads the urgent byte before
       copied_seq passes it (left out, the count only falls behind: weaker claims) */
    if (args->protocol != 6 || args->ret <= 0 || (args->flags & 0x2003)) return 0;
    return progress((u64)args->sk, args->ret, 1, 0);
}

TRACEPOINT_PROBE(sock, sk_data_ready) {
    /* The kernel queued in-order data for the reader (softirq at the packet's arrival,
       or the owner's process context when the socket was busy): the bytes from the
       first one the reader has not read yet (f->rcvd) up to rcv_nxt have arrived by
       now; with the kernel's BTF the row says how many, else only the first. Unlike
       the read's return, this does not wait for the reader to get a CPU. Only
       connections a traced process reads. */
    if (args->protocol != 6) return 0;
    u64 sk = (u64)args->skaddr;
    struct flow *f = flows.lookup(&sk);
    if (!f || !f->tgid) return 0;
    u64 now = bpf_ktime_get_ns();
    u64 quiet = now - f->last[2];
    f->last[2] = now;
    u64 rcvd = f->rcvd;
    u32 extent = 1;
#ifdef RCV_NXT_OFFSET
    /* every byte up to rcv_nxt has arrived by now: rcv_nxt - copied_seq of them after
       the reader's count (a read in progress, or a splice or zero-copy read the count
       does not see, has taken more than f->rcvd says: fewer bytes claimed, never
       more). Sequence space is the stream's only without an upper-layer protocol
       (kernel TLS counts record headers and tags in it): then only the first byte. */
    u32 nxt = 0, copied = 0;
    u64 ulp = 1;
    if (bpf_probe_read_kernel(&nxt, sizeof(nxt), (void *)(sk + RCV_NXT_OFFSET)) ||
        bpf_probe_read_kernel(&copied, sizeof(copied), (void *)(sk + COPIED_SEQ_OFFSET)) ||
        bpf_probe_read_kernel(&ulp, sizeof(ulp), (void *)(sk + ICSK_ULP_OPS_OFFSET)))
        return 0;
    if (nxt - copied == 0 || nxt - copied >= (1u << 31)) return 0;   /* nothing queued */
    if (!ulp) extent = nxt - copied;
#endif
    if (!due(f, 2, rcvd + extent, now, quiet)) return 0;
    emit(f, now, rcvd, extent, f->tgid, f->tid, 2);
    return 0;
}
"""

#: Appended with the progress program where tcp:tcp_probe and the kernel's BTF are there:
#: 'unsent' rows. tcp:tcp_probe fires as an established socket takes in a segment (an
#: ACK, for a sender), before the kernel acts on it: snd_nxt is the first byte this end
#: has not sent yet, whatever the application already wrote. A send waiting for the
#: receiver's window (a reader starved of CPU) began long before its bytes left; the ACK
#: that opens the window is the instant they were still here, so "bytes from snd_nxt
#: on had not left at T" bounds the other node's arrival of them far more tightly than
#: the send's start. snd_nxt is a sequence number; tcp_sock.bytes_acked (the bytes
#: acknowledged since establishment, updated with snd_una under the socket lock) turns
#: it into the stream position the send and receive rows count. Its offset comes from
#: the running kernel's BTF (btf.py), not from headers that may be another kernel's.
UNSENT_PROGRAM = r"""
static __always_inline void unsent(u64 sk, u32 snd_nxt, u32 snd_una) {
    struct flow *f = flows.lookup(&sk);
    if (!f || !f->wtgid) return;               /* connections a traced process writes */
    u64 now = bpf_ktime_get_ns();
    u64 quiet = now - f->last[3];
    f->last[3] = now;
    u64 acked = 0;
    if (bpf_probe_read_kernel(&acked, sizeof(acked), (void *)(sk + BYTES_ACKED_OFFSET)))
        return;
    u64 first = acked - f->acked0 + (u32)(snd_nxt - snd_una);   /* not sent yet */
    u64 mark = f->mark[3];
    if (first > mark && f->cand_ts) {
        /* the grid byte left since the last segment: the row is the last instant it
           had not, which its arrival on the other node follows */
        f->mark[3] = next_mark(first - 1);
        if (f->emitted[3] != f->cand_ts) {     /* not written by time already */
            f->emitted[3] = f->cand_ts;
            emit(f, f->cand_ts, f->cand_off, 1, f->wtgid, f->wtid, 3);
        }
    } else if (due(f, 3, first, now, quiet)) {
        /* by time, or a first segment past the mark (no earlier instant known) */
        emit(f, now, first, 1, f->wtgid, f->wtid, 3);
    }
    f->cand_ts = now;
    f->cand_off = first;
}
#define PROGRESS_UNSENT() unsent((u64)args->skaddr, args->snd_nxt, args->snd_una)
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

#: A send or receive after this much quiet on its end of a connection starts a burst.
PROGRESS_GAP_NS = 50_000
PROGRESS_CONNS = 16384   # established connections counted at once (LRU)
PROGRESS = struct.Struct("<QQQIIIHHHBx16s16s4x")

KIND_RETRANSMIT, KIND_PROBE = 0, 1
EVENT_NAMES = ("tcp_retransmit_skb", "tcp_probe")
EVENT = struct.Struct("<QIiHHHBx16s16sII")
PROBE_CONNS = 16384   # connections whose last tcp_probe time is remembered (LRU)
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
                    "snd_una": 4}
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
                                    f"one-byte arrivals: {e}")
        return status

    def _find_sock_offsets(self) -> None:
        """'unsent' rows need tcp:tcp_probe and tcp_sock.bytes_acked, and the extent of
        an arrival rcv_nxt and copied_seq, at their offsets in the running kernel;
        without them the sends and the first unread byte still bound the clocks, loosely
        where sends wait for the receiver's window."""
        try:
            self.sock_offsets = self.sock_offsets_from_btf()
        except btf.BtfError as e:
            self.notes.append(("warning", f"no 'unsent' tcp_progress rows and arrivals of "
                               f"one byte: the kernel's BTF does not give tcp_sock's "
                               f"{', '.join(self.SOCK_MEMBERS | self.ICSK_MEMBERS)} "
                               f"({e}), so sends that wait "
                               f"for the receiver's window bound the clocks loosely"))
            return
        if tracepoint_exists("tcp", "tcp_probe"):
            self.progress_unsent = True
        else:
            self.notes.append(("warning", "tracepoint tcp:tcp_probe not found: no 'unsent' "
                               "tcp_progress rows, so sends that wait for the receiver's "
                               "window bound the clocks loosely"))

    #: (attribute, what the capture loses without it) of the optional parts, the
    #: cheapest to lose first
    OPTIONAL = (("probe_on", "tcp:tcp_probe left off: {why}; only retransmits are recorded"),
                ("progress_unsent", "tcp_progress 'unsent' rows left off: {why}; sends that "
                 "wait for the receiver's window bound the clocks loosely"),
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
             saddr, daddr) = PROGRESS.unpack(rec)
            if family == AF_INET:
                src, dst = ipaddress.IPv4Address(saddr[:4]), ipaddress.IPv4Address(daddr[:4])
            else:
                src, dst = (normalize(ipaddress.IPv6Address(saddr)),
                            normalize(ipaddress.IPv6Address(daddr)))
            if direction >= len(DIRECTIONS):
                continue
            rows.append((ts, DIRECTIONS[direction], 4 if family == AF_INET else 6,
                         str(src), sport, str(dst), dport, connected, offset, nbytes, pid,
                         tid))
        sink.add_many("tcp_progress", rows)
        self.progress_rows += len(rows)
        self.events += len(rows)
