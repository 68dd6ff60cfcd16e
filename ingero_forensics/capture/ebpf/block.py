"""Block I/O: block_rq_issue to block_rq_complete, per request, from tracepoint fields.

Requests are matched by (device, sector); a flush or passthrough request, which has no
sector, by (device, 0). The request's task is the one current where it was created from
a bio (block_io_start, kernel 6.5+): the submitter for direct I/O and page-fault reads,
so a request that kblockd issues later (its task slept under its plug, or a requeue)
stays the submitter's; a kworker for writeback and for stacked drivers (dm, md, loop)
that create their own. Where that was not seen (a kernel before 6.5, a flush sequence's
own request, a front merge), the task current at issue, kept across a requeue.
"""

from __future__ import annotations

import os
import struct

from ..source import CaptureContext, RowSink, SourceStatus
from ._bcc import require_tracepoint, tracepoint_exists
from .base import BccSource
from .sched import cstr

PROGRAM = r"""
struct rq_key { u32 dev; u32 pad; u64 sector; };
struct rq_start {
    u64 ts; u32 bytes; u32 pid; u32 tid; u32 requeued; char rwbs[12]; char comm[16];
};
BPF_HASH(inflight, struct rq_key, struct rq_start, 65536);

#ifdef OWNER_AT_START
/* The task that created each request, in its own context. LRU: the entry of a request
   whose start sector moved (a front merge) is never looked up again. */
struct owner { u32 pid; u32 tid; char comm[16]; };
BPF_TABLE("lru_hash", struct rq_key, struct owner, owners, 65536);

TRACEPOINT_PROBE(block, block_io_start) {
    struct rq_key k = {.dev = args->dev, .sector = args->sector};
    struct owner o = {};
    u64 id = bpf_get_current_pid_tgid();
    o.pid = id >> 32; o.tid = id;
    bpf_get_current_comm(o.comm, sizeof(o.comm));
    owners.update(&k, &o);
    return 0;
}
#endif

struct event {
    u64 ts; u64 dur; u64 sector; u32 dev; u32 bytes; u32 pid; u32 tid; s32 error;
    char rwbs[12]; char comm[16];
};

TRACEPOINT_PROBE(block, block_rq_issue) {
    struct rq_key k = {.dev = args->dev, .sector = args->sector};
    struct rq_start s = {};
    s.ts = bpf_ktime_get_ns(); s.bytes = args->bytes;
    bpf_probe_read_kernel(s.rwbs, 10, args->rwbs);
    /* the current task may be kblockd issuing someone else's request: its creator if
       known, else, for a requeued request issued again, the task of its first issue */
    struct rq_start *first = inflight.lookup(&k);
#ifdef OWNER_AT_START
    struct owner *o = owners.lookup(&k);
    if (o) {
        s.pid = o->pid; s.tid = o->tid;
        __builtin_memcpy(s.comm, o->comm, 16);
    } else
#endif
    if (first && first->requeued) {
        s.pid = first->pid; s.tid = first->tid;
        __builtin_memcpy(s.comm, first->comm, 16);
    } else {
        u64 id = bpf_get_current_pid_tgid();
        s.pid = id >> 32; s.tid = id;
        bpf_probe_read_kernel(s.comm, 16, args->comm);
    }
    inflight.update(&k, &s);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_requeue) {
    struct rq_key k = {.dev = args->dev, .sector = args->sector};
    struct rq_start *s = inflight.lookup(&k);
    if (s) s->requeued = 1;
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_complete) {
    /* the other events key on blk_rq_trace_sector(): 0 for a request without a sector
       (a flush, a passthrough command), which this one gives as -1 */
    u64 sector = args->sector == (u64)-1 ? 0 : args->sector;
    struct rq_key k = {.dev = args->dev, .sector = sector};
    struct rq_start *s = inflight.lookup(&k);
    if (!s) return 0;
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (e) {
        e->ts = s->ts; e->dur = bpf_ktime_get_ns() - s->ts; e->sector = args->sector;
        e->dev = args->dev; e->bytes = s->bytes; e->pid = s->pid; e->tid = s->tid;
        e->error = args->error;
        __builtin_memcpy(e->rwbs, s->rwbs, 12);
        __builtin_memcpy(e->comm, s->comm, 16);
        events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    } else {
        count_lost();
    }
    inflight.delete(&k);
#ifdef OWNER_AT_START
    owners.delete(&k);
#endif
    return 0;
}
"""

EVENT = struct.Struct("<3Q4Ii12s16s")
#: The sector of a request that has none (a flush, a passthrough command): (sector_t)-1.
NO_SECTOR = (1 << 64) - 1
MINORBITS = 20   # kernel-internal dev_t: major << 20 | minor


def block_op(rwbs: str) -> str:
    if "D" in rwbs:
        return "discard"
    if "W" in rwbs:
        return "write"
    if "R" in rwbs:
        return "read"
    if "F" in rwbs:
        return "flush"
    return "other"


class DeviceNames:
    """Kernel dev_t -> disk name through /sys/dev/block/MAJ:MIN, cached."""

    def __init__(self, sys_dir: str = "/sys/dev/block"):
        self.sys_dir = sys_dir
        self.cache: dict[int, str] = {}

    def name(self, dev: int) -> str:
        if dev not in self.cache:
            mm = f"{dev >> MINORBITS}:{dev & ((1 << MINORBITS) - 1)}"
            try:
                self.cache[dev] = os.path.basename(os.readlink(os.path.join(self.sys_dir, mm)))
            except OSError:
                self.cache[dev] = mm
        return self.cache[dev]


class BlockSource(BccSource):
    name = "block"
    probe_detail = ("block tracepoints (request issue and completion) of every disk, the "
                    "issuer recorded")

    def __init__(self, options):
        super().__init__(options)
        self.devices = DeviceNames()
        self.owner_at_start = False     # set by start(): the kernel has block_io_start

    @classmethod
    def probe(cls) -> SourceStatus:
        """--check: as every eBPF source, and whose requests it cannot attribute."""
        status = super().probe()
        if status.available and not tracepoint_exists("block", "block_io_start"):
            return SourceStatus(cls.name, True, "requests kblockd issues for a task are "
                                "recorded as kblockd's: no block:block_io_start tracepoint "
                                f"(kernel {os.uname().release}; 6.5 or newer has it)")
        return status

    def filter_targets(self, ctx: CaptureContext) -> bool:
        return False   # disks are shared by the node; the issuer is recorded instead

    def program(self, ctx: CaptureContext) -> str:
        # compiled before start(): the optional tracepoint is looked for here
        self.owner_at_start = tracepoint_exists("block", "block_io_start")
        if not self.owner_at_start:
            self.notes.append(("warning", "no block:block_io_start tracepoint (kernel "
                               "before 6.5): a request that kblockd issues for a task (a "
                               "plug flushed while the task slept in a page fault, a "
                               "requeue) is recorded as kblockd's"))
        return ("#define OWNER_AT_START\n" if self.owner_at_start else "") + PROGRAM

    def start(self, ctx: CaptureContext) -> None:
        for tp in ("block_rq_issue", "block_rq_complete", "block_rq_requeue"):
            require_tracepoint("block", tp)
        super().start(ctx)

    def attach(self, ctx: CaptureContext) -> None:
        self.attached.append("tracepoints block:block_rq_issue, block_rq_complete, "
                             "block_rq_requeue"
                             + (", block_io_start" if self.owner_at_start else ""))

    def handle(self, raw: list[bytes], sink: RowSink) -> None:
        rows = []
        for rec in raw:
            ts, dur, sector, dev, nbytes, pid, tid, error, rwbs, comm = EVENT.unpack(rec)
            flags = cstr(rwbs)
            rows.append((ts, dur, self.devices.name(dev),
                         None if sector == NO_SECTOR else sector, nbytes, block_op(flags),
                         flags, pid or None, tid or None, cstr(comm) or None, error))
        sink.add_many("block_events", rows)
        self.events += len(rows)
