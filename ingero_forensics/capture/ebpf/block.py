"""Block I/O: block_rq_issue to block_rq_complete, per request, from tracepoint fields.

Requests are matched by (device, sector). The issuing task is the one current at issue:
the submitter for direct and synchronous I/O, a kworker for writeback (its name says so).
"""

from __future__ import annotations

import os
import struct

from ..source import CaptureContext, RowSink
from ._bcc import require_tracepoint
from .base import BccSource
from .sched import cstr

PROGRAM = r"""
struct rq_key { u32 dev; u32 pad; u64 sector; };
struct rq_start { u64 ts; u32 bytes; u32 pid; u32 tid; char rwbs[12]; char comm[16]; };
BPF_HASH(inflight, struct rq_key, struct rq_start, 65536);

struct event {
    u64 ts; u64 dur; u64 sector; u32 dev; u32 bytes; u32 pid; u32 tid; s32 error;
    char rwbs[12]; char comm[16];
};

TRACEPOINT_PROBE(block, block_rq_issue) {
    struct rq_key k = {.dev = args->dev, .sector = args->sector};
    struct rq_start s = {};
    u64 id = bpf_get_current_pid_tgid();
    s.ts = bpf_ktime_get_ns(); s.bytes = args->bytes; s.pid = id >> 32; s.tid = id;
    bpf_probe_read_kernel(s.rwbs, 10, args->rwbs);
    bpf_probe_read_kernel(s.comm, 16, args->comm);
    inflight.update(&k, &s);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_complete) {
    struct rq_key k = {.dev = args->dev, .sector = args->sector};
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
    return 0;
}
"""

EVENT = struct.Struct("<3Q4Ii12s16s")
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

    def __init__(self, options):
        super().__init__(options)
        self.devices = DeviceNames()

    def filter_targets(self, ctx: CaptureContext) -> bool:
        return False   # disks are shared by the node; the issuer is recorded instead

    def program(self, ctx: CaptureContext) -> str:
        return PROGRAM

    def start(self, ctx: CaptureContext) -> None:
        for tp in ("block_rq_issue", "block_rq_complete"):
            require_tracepoint("block", tp)
        super().start(ctx)

    def attach(self, ctx: CaptureContext) -> None:
        self.attached.append("tracepoints block:block_rq_issue, block_rq_complete")

    def handle(self, raw: list[bytes], sink: RowSink) -> None:
        rows = []
        for rec in raw:
            ts, dur, sector, dev, nbytes, pid, tid, error, rwbs, comm = EVENT.unpack(rec)
            flags = cstr(rwbs)
            rows.append((ts, dur, self.devices.name(dev), sector, nbytes, block_op(flags),
                         flags, pid or None, tid or None, cstr(comm) or None, error))
        sink.add_many("block_events", rows)
        self.events += len(rows)
