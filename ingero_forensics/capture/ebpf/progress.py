"""The TCP progress programs of the tcp source (tcp.py): the traced processes' byte
positions per connection, counted in the kernel from each connection's establishment or
read from the socket of one established before the capture (docs/ebpf.md, "TCP
progress"), and the record they write (bundle table tcp_progress). Kept apart from the
retransmit program and the connection attribution, which need none of it.
"""

from __future__ import annotations

import struct

#: A send or receive after this much quiet on its end of a connection starts a burst.
PROGRESS_GAP_NS = 50_000
PROGRESS_CONNS = 16384   # established connections counted at once (LRU)
PROGRESS = struct.Struct("<QQQIIIHHHBB16s16s4x")

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
#: unsent rows, connections established before the capture).
PROGRESS_PROGRAM = r"""
struct flow {
    u64 connected; u64 sent; u64 rcvd; u64 last[4]; u64 emitted[4];  /* by row kind */
    u8 saddr[16]; u8 daddr[16]; u16 sport; u16 dport; u16 family; u16 pad;
    u32 tgid; u32 tid;             /* the traced process and thread that last read it */
    u32 wtgid; u32 wtid;           /* ... and that last wrote it */
    u64 acked0;                    /* tcp_sock.bytes_acked at establishment (unsent rows) */
    u64 mark[4];                   /* by row kind: the next grid position (next_mark) */
    u64 cand_ts; u64 cand_off;     /* unsent: the last instant the mark had not left */
    /* a connection established before the capture counted it (attach_pending): its
       positions come from the socket's sequence numbers, not from counts. Per way, the
       mapping (position - sequence number, mod 2^32) << 32 | 1 once tcp:tcp_probe has
       read it (attach_ready): one aligned 64-bit word, so a reader on another CPU sees
       all of it or none (no ordering to rely on, on any architecture) */
    u32 attached; u32 ready;
    u64 map_s; u64 map_r;
};
struct progress {
    u64 ts; u64 offset; u64 connected; u32 bytes; u32 pid; u32 tid; u16 sport; u16 dport;
    u16 family; u8 dir; u8 attached; u8 saddr[16]; u8 daddr[16]; u32 pad2;
};
/* records are told from the retransmit source's (64 bytes) by their size */
_Static_assert(sizeof(struct progress) == 80, "struct progress is PROGRESS in progress.py");
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
    } else if (args->oldstate == 1 || args->newstate == 7) {
        /* leaving ESTABLISHED: stop counting; reaching TCP_CLOSE: also a pending flow
           of a socket read after it left ESTABLISHED (never ready), whose address a
           new socket could otherwise inherit it with */
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
    e->family = f->family; e->dir = dir; e->attached = f->attached; e->pad2 = 0;
    __builtin_memcpy(e->saddr, f->saddr, 16);
    __builtin_memcpy(e->daddr, f->daddr, 16);
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

#ifdef PROGRESS_ATTACH
/* A traced process's call on a connection the map does not hold (established before
   the capture, or before every program was attached): a flow waiting for its first
   tcp:tcp_probe (attach_ready), which reads the socket's mappings under its lock. */
static __always_inline void attach_pending(u64 sk, u8 dir) {
    int zero = 0;
    u32 *on = armed.lookup(&zero);
    if (!on || !*on) return;
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32)) return;
    struct flow f = {};
    f.attached = 1;
    f.connected = bpf_ktime_get_ns();   /* first seen: its establishment is unknown */
    if (dir) { f.tgid = id >> 32; f.tid = id; } else { f.wtgid = id >> 32; f.wtid = id; }
    flows.insert(&sk, &f);
}

/* The position of a sequence number's byte: near + the signed 32-bit distance (near
   is the socket's own count of the same way, read now: bytes_acked for a byte at or
   after snd_una, bytes_received for one at or before rcv_nxt, each within a socket
   buffer of it, far inside 2 GiB) */
static __always_inline u64 at_seq(u64 near, u32 pos) {
    return near + (u64)(s64)(s32)(pos - (u32)near);
}

/* A socket with an upper-layer protocol (kernel TLS) counts record headers and tags in
   its sequence space, and a send's bytes may not have reached it yet: no rows. */
static __always_inline int has_ulp(u64 sk) {
    u64 ulp = 1;
    bpf_probe_read_kernel(&ulp, sizeof(ulp), (void *)(sk + ICSK_ULP_OPS_OFFSET));
    return ulp != 0;
}
#endif

static __always_inline int progress(u64 sk, int ret, u8 dir, u64 began) {
    struct flow *f = flows.lookup(&sk);
    if (!f) {
#ifdef PROGRESS_ATTACH
        attach_pending(sk, dir);
#endif
        return 0;
    }
    u64 now = bpf_ktime_get_ns();
    u64 offset;
#ifdef PROGRESS_ATTACH
    if (f->attached) {
        u64 id = bpf_get_current_pid_tgid();
        u64 map = dir ? *(volatile u64 *)&f->map_r : *(volatile u64 *)&f->map_s;
        if (!(map & 1)) {                 /* no mapping yet: who uses it, no row */
            if (!is_target(id >> 32)) return 0;
            if (dir) { f->tgid = id >> 32; f->tid = id; }
            else { f->wtgid = id >> 32; f->wtid = id; }
            return 0;
        }
        /* the caller's end of the stream after its call: write_seq (the bytes written
           so far; another writer's only make it higher, the claim weaker) or copied_seq
           (read so far: one reader at a time, as for every count here), and the way's
           own count to unwrap it against */
        u32 seq = 0;
        u64 count = 0;
        if (bpf_probe_read_kernel(&seq, sizeof(seq), (void *)(sk + (dir ? COPIED_SEQ_OFFSET
                                                                   : WRITE_SEQ_OFFSET))) ||
            bpf_probe_read_kernel(&count, sizeof(count),
                                  (void *)(sk + (dir ? BYTES_RECEIVED_OFFSET
                                                     : BYTES_ACKED_OFFSET))) ||
            has_ulp(sk))
            return 0;
        if (dir) now = bpf_ktime_get_ns();   /* after the read: no later byte claimed */
        u64 end = at_seq(count, seq + (u32)(map >> 32));
        if (end < (u64)ret) return 0;
        offset = end - ret;
    } else
#endif
    offset = __sync_fetch_and_add(dir ? &f->rcvd : &f->sent, (u64)ret);
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
    if (!f || !f->tgid || (f->attached && !f->ready)) return 0;   /* (under the lock) */
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
#ifdef PROGRESS_ATTACH
    if (f->attached) {
        u64 count = 0;
        if (ulp || bpf_probe_read_kernel(&count, sizeof(count),
                                         (void *)(sk + BYTES_RECEIVED_OFFSET)))
            return 0;
        rcvd = at_seq(count, copied + (u32)(f->map_r >> 32));
    }
#endif
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
/* A connection attached to (attach_pending) takes its two mappings from position to
   sequence number at its first segment in, under the socket's lock (tcp_probe fires in
   tcp_rcv_established): bytes_acked and snd_una move together there, and so do
   bytes_received and rcv_nxt, so each difference is read whole. The sending way's
   bytes_acked counts an active opener's SYN: its positions are then one byte high,
   which makes every claim on its bytes weaker, never stronger. */
static __always_inline void attach_ready(struct flow *f, u64 sk, const u8 *saddr,
                                         const u8 *daddr, u16 sport, u16 dport,
                                         u16 family, u32 snd_una) {
    u64 acked = 0, rcvd = 0;
    u32 rnxt = 0;
    if (bpf_probe_read_kernel(&acked, sizeof(acked), (void *)(sk + BYTES_ACKED_OFFSET)) ||
        bpf_probe_read_kernel(&rcvd, sizeof(rcvd), (void *)(sk + BYTES_RECEIVED_OFFSET)) ||
        bpf_probe_read_kernel(&rnxt, sizeof(rnxt), (void *)(sk + RCV_NXT_OFFSET)) ||
        has_ulp(sk))
        return;
    f->sport = sport; f->dport = dport; f->family = family;
    if (family == 2) {         /* sockaddr_in: sin_addr at offset 4 */
        bpf_probe_read_kernel(f->saddr, 4, saddr + 4);
        bpf_probe_read_kernel(f->daddr, 4, daddr + 4);
    } else {                   /* sockaddr_in6: sin6_addr at offset 8 */
        bpf_probe_read_kernel(f->saddr, 16, saddr + 8);
        bpf_probe_read_kernel(f->daddr, 16, daddr + 8);
    }
    f->acked0 = 0;
    /* each mapping and its "read" bit in one 64-bit store (progress() reads them
       without the lock); `ready` is for the handlers that run under it */
    *(volatile u64 *)&f->map_s = (u64)((u32)acked - snd_una) << 32 | 1;
    *(volatile u64 *)&f->map_r = (u64)((u32)rcvd - rnxt) << 32 | 1;
    f->ready = 1;
}

/* Every segment an established socket takes in, on every socket of the node: one flow
   lookup, then a connection attached to gets its mappings, and one a traced process
   writes its 'unsent' row when due. */
static __always_inline void unsent(u64 sk, u32 snd_nxt, u32 snd_una, const u8 *saddr,
                                   const u8 *daddr, u16 sport, u16 dport, u16 family) {
    struct flow *f = flows.lookup(&sk);
    if (!f) return;
    if (f->attached && !f->ready) {
        attach_ready(f, sk, saddr, daddr, sport, dport, family, snd_una);
        if (!f->ready) return;
    }
    if (!f->wtgid) return;                     /* connections a traced process writes */
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
#define PROGRESS_UNSENT() unsent((u64)args->skaddr, args->snd_nxt, args->snd_una, \
                                 args->saddr, args->daddr, args->sport, args->dport, \
                                 args->family)
"""
