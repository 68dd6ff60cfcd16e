"""Scheduler: runqueue delay and off-CPU time of the traced threads, from the
sched_switch / sched_wakeup / sched_wakeup_new tracepoints (no kernel struct reads).

A traced thread switching out is remembered with the time and its state. A wakeup of a
remembered thread starts its runqueue wait; a thread preempted while runnable waits from
the switch-out. When it switches in again, off-CPU time = now - switch-out, runqueue
delay = now - wakeup, and the task switching out at that moment is the one that held
the CPU. Spans at or above the threshold leave the kernel as rows; shorter ones are
summed in the kernel into event_stats.
"""

from __future__ import annotations

import struct

from ..source import CaptureContext, RowSink
from ._bcc import require_tracepoint
from .base import BccSource

KINDS = ("runq_delay", "off_cpu")

PROGRAM = r"""
#define TASK_REPORT_MAX 0x100   /* prev_state value for a preempted task (since 4.14) */
#define THRESHOLD __THRESHOLD__ULL

struct off {
    u64 ts; u64 wake_ts; s64 state; u32 tgid; u32 other_tid;
    char comm[16]; char other_comm[16];
};
BPF_HASH(offcpu, u32, struct off, 65536);

struct event {
    u64 ts; u64 dur; s64 state; u32 pid; u32 tid; u32 cpu; u32 other_pid; u32 other_tid;
    u8 kind; u8 pad[3]; char comm[16]; char other_comm[16];
};

static __always_inline void span(u8 kind, u64 start, u64 now, struct off *o,
                                 u32 tid, u32 other_pid, u32 other_tid, const char *other_comm) {
    u64 dur = now - start;
    if (dur < THRESHOLD) {
        struct stat_key k = {.pid = o->tgid, .tid = tid, .stack_id = -1, .name = kind};
        stat_add(&k, dur);
        return;
    }
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) { count_lost(); return; }
    e->ts = start; e->dur = dur; e->state = o->state; e->pid = o->tgid; e->tid = tid;
    e->cpu = bpf_get_smp_processor_id(); e->other_pid = other_pid; e->other_tid = other_tid;
    e->kind = kind;
    __builtin_memcpy(e->comm, o->comm, 16);
    bpf_probe_read_kernel(e->other_comm, 16, other_comm);
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();
    u32 prev_tgid = bpf_get_current_pid_tgid() >> 32;   /* current is still prev */
    u32 prev_tid = args->prev_pid, next_tid = args->next_pid;
    if (prev_tid && is_target(prev_tgid)) {
        struct off o = {};
        o.ts = now; o.state = args->prev_state; o.tgid = prev_tgid; o.other_tid = next_tid;
        if (o.state == 0 || (o.state & TASK_REPORT_MAX)) o.wake_ts = now;  /* still runnable */
        bpf_probe_read_kernel(o.comm, 16, args->prev_comm);
        bpf_probe_read_kernel(o.other_comm, 16, args->next_comm);
        offcpu.update(&prev_tid, &o);
    }
    struct off *o = offcpu.lookup(&next_tid);
    if (!o) return 0;
    if (o->state >= 0)
        span(1, o->ts, now, o, next_tid, 0, o->other_tid, o->other_comm);
    if (o->wake_ts)
        span(0, o->wake_ts, now, o, next_tid, prev_tgid, prev_tid, args->prev_comm);
    offcpu.delete(&next_tid);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup) {
    u32 tid = args->pid;
    struct off *o = offcpu.lookup(&tid);
    if (o && !o->wake_ts) o->wake_ts = bpf_ktime_get_ns();
    return 0;
}

/* A new thread of a traced process: runs in the parent's context, so the parent's tgid
 * decides; the new thread waits on the runqueue from here. */
TRACEPOINT_PROBE(sched, sched_wakeup_new) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32, tid = args->pid;
    if (!is_target(tgid)) return 0;
    struct off o = {};
    o.ts = o.wake_ts = bpf_ktime_get_ns(); o.state = -1; o.tgid = tgid;
    bpf_probe_read_kernel(o.comm, 16, args->comm);
    offcpu.update(&tid, &o);
    return 0;
}
"""

EVENT = struct.Struct("<2Qq5IB3x16s16s")
_STATES = ((1, "S"), (2, "D"), (4, "T"), (8, "t"), (16, "X"), (32, "Z"), (64, "P"), (128, "I"))


def state_letter(state: int) -> str | None:
    if state < 0:
        return None
    if state == 0 or state & 0x100:
        return "R"
    for bit, letter in _STATES:
        if state & bit:
            return letter
    return None


def cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


class SchedSource(BccSource):
    name = "sched"
    probe_detail = ("sched tracepoints (switch, wakeup) of the traced threads")
    stat_source = "sched"
    stat_names = KINDS

    def program(self, ctx: CaptureContext) -> str:
        return PROGRAM.replace("__THRESHOLD__", str(int(self.options.sched_threshold_ns)))

    def start(self, ctx: CaptureContext) -> None:
        for tp in ("sched_switch", "sched_wakeup", "sched_wakeup_new"):
            require_tracepoint("sched", tp)
        super().start(ctx)

    def attach(self, ctx: CaptureContext) -> None:
        # TRACEPOINT_PROBE programs are attached by BCC when it loads them.
        self.attached.append("tracepoints sched:sched_switch, sched_wakeup, sched_wakeup_new; "
                             f"spans >= {self.options.sched_threshold_ns} ns kept as rows")

    def handle(self, raw: list[bytes], sink: RowSink) -> None:
        rows = []
        for rec in raw:
            (ts, dur, state, pid, tid, cpu, other_pid, other_tid, kind, comm,
             other_comm) = EVENT.unpack(rec)
            rows.append((ts, dur, KINDS[kind], pid, tid, cstr(comm), cpu,
                         state_letter(state) if kind == 1 else None,
                         other_pid or None, other_tid or None, cstr(other_comm) or None))
        sink.add_many("sched_events", rows)
        self.events += len(rows)
