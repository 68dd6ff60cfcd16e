"""CUDA: uprobes on libcudart (runtime) and libcuda (driver).

Synchronizations, copies, allocations and graph launches are kept one row each, with
their duration and (for syncs and copies) the user stack. Kernel launches are far too
frequent for that: an entry-only probe (one trap, no return probe) counts them in the
kernel per (process, thread, stack, API), drained into event_stats every stats interval
with total_ns and the histogram NULL. A launch's host-side duration is not worth a second
trap per call; a slow launch shows up as the time before the next call anyway.

Synchronizations also say what the thread queued before them: the number of stream
operations (launches, async copies, graph launches) it enqueued since its last NCCL
collective or synchronization, and how long before the synchronization the last one was
enqueued (``queued_ops``, ``queue_gap_ns``). The merge uses a synchronization's end as a
collective's completion only when nothing, or only a trivial copy enqueued right after
the collective, sits between them: kernels launched after the last gradient bucket (the
optimizer, in PyTorch) make the sync end when they end, late on a CPU-starved rank. A
return probe on libnccl's collectives (and ncclGroupEnd) resets the thread's count; it
shares the breakpoint the NCCL source already placed there.

Arguments come from registers and, past the sixth, from the stack (ARG(n), as in
nccl.py). cudaLaunchKernel's two dim3 arguments are 12-byte structs passed in two
registers each, which moves sharedMem and stream onto the stack.
"""

from __future__ import annotations

import math
import os
import queue
import struct
import threading
import time

from ...bundle.schema import MEMCPY_KINDS
from ..source import CaptureContext, RowSink
from .base import SITE_STACKS, UPROBE_ARG_C, BccSource, drain, mono_ns, signed64
from .libs import LibraryTracker
from .uprobes import Probe, dispatch_programs

# (symbol, library kind, kept one by one?, stack?, stream, bytes, memcpy kind, device)
# C expressions; None = the call has no such argument.
APIS = (
    ("cudaLaunchKernel", "cudart", False, True, "ARG(8)", None, None, None),
    ("cudaMemcpy", "cudart", True, True, None, "ARG(3)", "ARG(4)", None),
    ("cudaMemcpyAsync", "cudart", True, True, "ARG(5)", "ARG(3)", "ARG(4)", None),
    ("cudaMemcpy2D", "cudart", True, True, None, "ARG(5) * ARG(6)", "ARG(7)", None),
    ("cudaMemcpy2DAsync", "cudart", True, True, "ARG(8)", "ARG(5) * ARG(6)", "ARG(7)", None),
    ("cudaMemcpyPeer", "cudart", True, True, None, "ARG(5)", "3", "ARG(2)"),
    ("cudaMemcpyPeerAsync", "cudart", True, True, "ARG(6)", "ARG(5)", "3", "ARG(2)"),
    ("cudaStreamSynchronize", "cudart", True, True, "ARG(1)", None, None, None),
    ("cudaEventSynchronize", "cudart", True, True, None, None, None, None),
    ("cudaDeviceSynchronize", "cudart", True, True, None, None, None, None),
    ("cudaMalloc", "cudart", True, False, None, "ARG(2)", None, None),
    ("cudaFree", "cudart", True, False, None, None, None, None),
    ("cudaGraphLaunch", "cudart", True, True, "ARG(2)", None, None, None),
    ("cuLaunchKernel", "cuda", False, True, "ARG(9)", None, None, None),
    ("cuMemcpy", "cuda", True, True, None, "ARG(3)", "4", None),
    ("cuMemcpyAsync", "cuda", True, True, "ARG(4)", "ARG(3)", "4", None),
    ("cuMemcpyHtoD_v2", "cuda", True, True, None, "ARG(3)", "1", None),
    ("cuMemcpyDtoH_v2", "cuda", True, True, None, "ARG(3)", "2", None),
    ("cuMemcpyDtoD_v2", "cuda", True, True, None, "ARG(3)", "3", None),
    ("cuMemcpyHtoDAsync_v2", "cuda", True, True, "ARG(4)", "ARG(3)", "1", None),
    ("cuMemcpyDtoHAsync_v2", "cuda", True, True, "ARG(4)", "ARG(3)", "2", None),
    ("cuMemcpyDtoDAsync_v2", "cuda", True, True, "ARG(4)", "ARG(3)", "3", None),
    ("cuStreamSynchronize", "cuda", True, True, "ARG(1)", None, None, None),
    ("cuEventSynchronize", "cuda", True, True, None, None, None, None),
    ("cuCtxSynchronize", "cuda", True, True, None, None, None, None),
    ("cuMemAlloc_v2", "cuda", True, False, None, "ARG(2)", None, None),
    ("cuMemFree_v2", "cuda", True, False, None, None, None, None),
)
API_NAMES = tuple(a[0] for a in APIS)
#: Calls that put work on a stream (counted as queued before the next synchronization).
QUEUEING = ("cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "cudaMemcpy2DAsync",
            "cudaMemcpyPeerAsync", "cudaGraphLaunch", "cuMemcpyAsync", "cuMemcpyHtoDAsync_v2",
            "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoDAsync_v2")
#: Calls that wait for stream work: they read and reset the thread's queued count.
SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
         "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")
#: libnccl functions after whose return the count restarts (a collective enqueued; a
#: group end launches the grouped ones).
NCCL_MARKS = ("ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast",
              "ncclBcast", "ncclReduce", "ncclAlltoAll", "ncclSend", "ncclRecv", "ncclGroupEnd")
LAYER = {"cudart": 0, "cuda": 1}
LAYER_NAMES = ("runtime", "driver")
HAS_STREAM, HAS_BYTES, HAS_KIND, HAS_DEVICE, HAS_QUEUED = 1, 2, 4, 8, 16

PROGRAM = UPROBE_ARG_C + r"""

__SITE_STACKS__
/* Launch counts per (thread, API, return address); the stack id is taken when a key is
 * first seen. A hit is one map lookup: the target check is only needed on a miss, since
 * a key carries its process. The caller's return address is left out of the key (only
 * the stack's site has it), so the keys are bounded by the launch sites even where a
 * caller without frame pointers fools read_up. */
struct launch_key { struct site site; u32 tid; u32 api; };
struct launch_val { u64 count; s32 stack_id; u32 pad; };
BPF_HASH(launches, struct launch_key, struct launch_val, 16384);

/* In flight per (thread, layer): a runtime call may enter the driver. nest counts calls
 * of the same layer made inside the traced one; only the outermost is recorded. */
struct call {
    u64 ts; u64 stream; u64 bytes; u64 ret_addr; u64 qgap;
    s32 stack_id; s32 device; u32 api; u32 nest; u32 qops; u32 tgid; u8 kind; u8 has;
    u8 layer;
};
BPF_HASH(calls, u64, struct call, 65536);

struct event {
    u64 ts; u64 dur; u64 stream; u64 bytes; u64 ret_addr; u64 qgap;
    u32 pid; u32 tid; s32 stack_id; s32 ret; s32 device; u32 api; u32 qops;
    u8 kind; u8 has; u8 layer; u8 pad[1];
};

/* The launch probes are detached for whole stats intervals above --launch-budget. User
 * space bumps launch_gen[0] at every switch, odd while they are off: a thread whose
 * count restarted in another generation, or that counts while they are off, may have
 * launched unseen, so its next sync's queued work is unknown. */
BPF_ARRAY(launch_gen, u32, 1);

static __always_inline u32 launch_generation(void) {
    int zero = 0;
    u32 *g = launch_gen.lookup(&zero);
    return g ? *g : 0;
}

/* Stream work a thread enqueued since its last collective or synchronization, and the
 * launch generation it started counting in. While the probes were never switched
 * (generation 0) a restart deletes the entry, so a thread with none has queued nothing;
 * after that a restart keeps one per thread (removed when its process exits), and a
 * thread with none (or whose insert failed) is unknown. */
struct queued { u64 last_ts; u32 ops; u32 gen; u32 tgid; u32 pad; };
BPF_HASH(queued, u32, struct queued, 65536);

static __always_inline void note_queued(u64 id, u64 ts) {
    u32 tid = id;
    struct queued *q = queued.lookup(&tid);
    if (q) { q->ops++; q->last_ts = ts; return; }
    struct queued nq = {.last_ts = ts, .ops = 1, .gen = launch_generation(), .tgid = id >> 32};
    queued.update(&tid, &nq);
}

static __always_inline void restart_count(u64 id, u32 gen) {
    u32 tid = id;
    if (gen == 0) { queued.delete(&tid); return; }
    struct queued nq = {.gen = gen, .tgid = id >> 32};
    queued.update(&tid, &nq);
}

/* return of a libnccl collective or group end: counting restarts */
int mark_nccl(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32)) return 0;
    restart_count(id, launch_generation());
    return 0;
}

static __always_inline int count_launch(struct pt_regs *ctx, u64 id, u32 api) {
    if (is_target(id >> 32)) note_queued(id, bpf_ktime_get_ns());
    struct launch_key k = {.tid = id, .api = api};
    k.site.tgid = id >> 32;
#if __STACKS__
    read_ret(ctx, &k.site);
#endif
    struct launch_val *v = launches.lookup(&k);
    if (v) { v->count++; return 0; }   /* the key's own thread is its only writer */
    if (!is_target(id >> 32)) return 0;
    struct launch_val nv = {.count = 1, .stack_id = -1};
#if __STACKS__
    struct site s = k.site;
    read_up(ctx, &s);
    nv.stack_id = site_stack(ctx, &s);
#endif
    if (launches.insert(&k, &nv)) count_lost();
    return 0;
}

/* a call kept one by one: its arguments and start, until the return probe */
static __always_inline int entry(struct pt_regs *ctx, u32 api, u8 layer, u8 stack,
                                 u8 has, u64 stream, u64 bytes, u64 kind, u64 device,
                                 u8 role) {
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32)) return 0;
    u64 key = ((id & 0xffffffff) << 1) | layer;
    struct call c = {};
    c.ts = bpf_ktime_get_ns();
    u32 tid = id;
    u8 known = 0;
    if (role == ROLE_QUEUE) {
        note_queued(id, c.ts);
    } else if (role == ROLE_SYNC) {
        u32 gen = launch_generation();
        struct queued *q = queued.lookup(&tid);
        if (q) {
            known = q->gen == gen && !(gen & 1);
            if (known && q->ops) { c.qops = q->ops; c.qgap = c.ts - q->last_ts; }
        } else {
            known = gen == 0;     /* never switched: no entry is nothing queued */
        }
        restart_count(id, gen);
    }
    c.api = api; c.layer = layer; c.has = has | (known ? HAS_QUEUED : 0);
    c.stream = stream; c.bytes = bytes; c.kind = kind; c.device = device;
    c.tgid = id >> 32;    /* read from user space for a call still open (in_flight) */
    c.stack_id = -1;
#if __STACKS__
    if (stack) {
        struct site s = {.tgid = id >> 32};
        read_site(ctx, &s);
        c.ret_addr = s.ret;
        c.stack_id = site_stack(ctx, &s);
    }
#endif
    if (calls.insert(&key, &c)) {   /* already in a call of this layer: nested */
        struct call *prev = calls.lookup(&key);
        if (prev) prev->nest++;
    }
    return 0;
}

static __always_inline int ret(struct pt_regs *ctx, u8 layer) {
    u64 id = bpf_get_current_pid_tgid();
    u64 key = ((id & 0xffffffff) << 1) | layer;
    struct call *c = calls.lookup(&key);
    if (!c) return 0;
    if (c->nest) { c->nest--; return 0; }
    u64 dur = bpf_ktime_get_ns() - c->ts;
    {
        struct event *e = events.ringbuf_reserve(sizeof(struct event));
        if (e) {
            e->ts = c->ts; e->dur = dur; e->stream = c->stream; e->bytes = c->bytes;
            e->ret_addr = c->ret_addr; e->pid = id >> 32; e->tid = id;
            e->qops = c->qops; e->qgap = c->qgap;
            e->stack_id = c->stack_id; e->ret = PT_REGS_RC(ctx); e->device = c->device;
            e->api = c->api; e->kind = c->kind; e->has = c->has; e->layer = c->layer;
            events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
        } else {
            count_lost();
        }
    }
    calls.delete(&key);
    return 0;
}
int ret_runtime(struct pt_regs *ctx) { return ret(ctx, 0); }
int ret_driver(struct pt_regs *ctx) { return ret(ctx, 1); }
"""

EVENT = struct.Struct("<6Q2I3i2I3Bx")
ROLE_OTHER, ROLE_QUEUE, ROLE_SYNC = 0, 1, 2


def entry_calls() -> tuple[dict[int, str], dict[int, str]]:
    """The entry probes' C calls by API index (the attach cookie of a link): the calls
    kept one by one, and the kernel launches (counted in the kernel)."""
    kept, launches = {}, {}
    for i, (sym, lib, keep, stack, stream, nbytes, kind, device) in enumerate(APIS):
        if not keep:   # a launch: no argument is read, each would be a user-memory access
            launches[i] = f"count_launch(ctx, bpf_get_current_pid_tgid(), {i})"
            continue
        has = ((HAS_STREAM if stream else 0) | (HAS_BYTES if nbytes else 0)
               | (HAS_KIND if kind else 0) | (HAS_DEVICE if device else 0))
        role = ROLE_QUEUE if sym in QUEUEING else ROLE_SYNC if sym in SYNCS else ROLE_OTHER
        kept[i] = (f"entry(ctx, {i}, {LAYER[lib]}, {int(stack)}, {has}, {stream or 0}, "
                   f"{nbytes or 0}, {kind or 0}, {device or 0}, {role})")
    return kept, launches


def entry_functions() -> str:
    """``api_{i}`` per API (perf-event uprobes), ``api_multi`` and ``launch_multi`` for
    links (uprobes.py)."""
    kept, launches = entry_calls()
    return dispatch_programs("api", kept) + dispatch_programs("api", launches, "launch_multi")


class LaunchProbes:
    """The launch probes of one library, switched on and off together by the duty cycle:
    one uprobe_multi link, or (perf mode) one perf event each. ``path`` stays valid
    (/proc/self/fd/N of a descriptor the source holds: the /proc/<pid>/root path a
    library was found by goes with that process)."""

    def __init__(self, source, path: str, launches: list[tuple[int, str, int | None]]):
        self.source, self.path = source, path
        self.launches = launches                # (API index, symbol, file offset)
        self.fd: int | None = None
        self.perf = False        # the link was refused here (another tracer's uprobe)
        self.label = ", ".join(sym for _i, sym, _o in launches)

    def attach(self) -> None:
        up = self.source.uprobes
        if up.mode == "multi" and not self.perf:
            try:
                self.fd = up.link(self.path, "launch_multi",
                                  [o for _i, _s, o in self.launches],
                                  [i for i, _s, _o in self.launches])
                return
            except OSError as e:
                self.perf = True
                up.notes.append(f"launch probes ({self.label}): uprobe_multi link refused "
                                f"({e.strerror}); one perf event each")
        done = []
        try:
            for i, sym, _o in self.launches:
                up.perf_uprobe(self.path, sym, f"api_{i}")
                done.append(sym)
        except Exception:
            for sym in done:
                self.source.bpf.detach_uprobe(name=self.path.encode(), sym=sym.encode())
            raise

    def detach(self) -> None:
        if self.fd is not None:
            self.source.uprobes.unlink(self.fd)
            self.fd = None
            return
        for _i, sym, _o in self.launches:
            self.source.bpf.detach_uprobe(name=self.path.encode(), sym=sym.encode())


#: Launch probes stay on for at least this share of the stats intervals, however high
#: the rate: the counts and the tight synchronizations (docs/merge.md) keep a sample.
MIN_LAUNCH_SHARE = 0.02
#: Stats intervals per on/off cycle, at least: a switch costs the traced processes a
#: little (the kernel rewrites the probed code page in each), so they are kept rare.
MIN_CYCLE_INTERVALS = 10


class LaunchDuty:
    """Which stats intervals count kernel launches (--launch-budget).

    A launch costs the job one uprobe trap (about 0.65 us on a VM), the one cost the
    capture cannot shrink by doing less in the probe. Above ``budget`` launches/s (all
    traced processes together, as measured in the last interval that counted), the launch
    probes are detached for whole stats intervals: in each cycle of at least
    MIN_CYCLE_INTERVALS they are on for the first ``share = budget / rate`` of them (one
    at least) and off for the rest. Whole intervals, so that a training step seen while
    they are on is seen whole: its synchronization's queued work is known, and the merge
    can use it as a tight observation."""

    def __init__(self, budget: float):
        self.budget = budget
        self.share = 1.0
        self._plan: list[bool] = []

    def next_on(self, counted: int, seconds: float, was_on: bool) -> bool:
        """Whether the next interval counts, given this one's count (if it counted)."""
        if self.budget <= 0:
            return True
        if was_on and seconds > 0:
            rate = counted / seconds
            self.share = 1.0 if rate <= self.budget else max(MIN_LAUNCH_SHARE,
                                                             self.budget / rate)
            if self.share >= 1.0:
                self._plan = []
        if self._plan:
            return self._plan.pop(0)
        if self.share >= 1.0:
            return True
        cycle = max(MIN_CYCLE_INTERVALS, math.ceil(1.0 / self.share))
        on = max(1, round(self.share * cycle))
        self._plan = [True] * on + [False] * (cycle - on)
        if was_on:          # the interval that just counted opens the cycle
            self._plan.pop(0)
        return self._plan.pop(0)


class CudaSource(BccSource):
    compile_first = True
    name = "cuda"
    probe_detail = ("uprobes on the libcudart and libcuda each traced process maps (found in "
                    "its memory maps at run time; --lib PATH adds one)")
    LIBRARIES = ("cudart", "cuda")
    stat_source = "cuda"
    stat_names = API_NAMES
    uses_sites = True
    open_call_map = "tid_layer"

    def __init__(self, options):
        super().__init__(options)
        self.libs = LibraryTracker(("cudart", "cuda", "nccl"), options.lib_paths)
        self._last_scan = 0.0
        self.duty = LaunchDuty(getattr(options, "launch_budget", 0))
        # Launch probes, per library; those attached now; the descriptors their paths hold
        self.launch_probes: list[LaunchProbes] = []
        self._launch_attached: set[LaunchProbes] = set()
        self._launch_fds: list[int] = []
        self._probe_lock = threading.Lock()   # launch_probes, _launch_attached, the uprobes
        self.launches_on = True               # wanted by the duty cycle (poll thread)
        # since when every launch probe has counted (mono ns; 0: from the start), None
        # while they are not all on; set by the switcher
        self._on_since: int | None = 0
        self._generation = 0
        self._off_names: set[str] = set()    # launch APIs seen: rows for an interval off
        self.intervals_off = 0
        self._stopping = False
        self._switcher: threading.Thread | None = None
        self._switches: queue.SimpleQueue | None = None
        self._switch_notes: queue.SimpleQueue = queue.SimpleQueue()

    def program(self, ctx: CaptureContext) -> str:
        consts = (f"#define ROLE_QUEUE {ROLE_QUEUE}\n#define ROLE_SYNC {ROLE_SYNC}\n"
                  f"#define HAS_QUEUED {HAS_QUEUED}\n")
        return ((consts + PROGRAM + entry_functions()).replace("__SITE_STACKS__", SITE_STACKS)
                .replace("__STACK_ENTRIES__", "16384")
                .replace("__STACKS__", "1" if self.options.stacks else "0"))

    def filter_targets(self, ctx: CaptureContext) -> bool:
        return not getattr(ctx.targets, "auto", False)

    def attach(self, ctx: CaptureContext) -> None:
        self.attach_libraries(
            ctx, [f"api_{i}" for i in range(len(APIS))] + ["ret_runtime", "ret_driver", "mark_nccl"],
            ["api_multi", "launch_multi", "ret_runtime", "ret_driver", "mark_nccl"],
            "no libcudart/libcuda yet: waiting for target processes to map them")

    def _attach_new(self, pids) -> None:
        for kind, path in self.libs.new_libraries(pids):
            if kind == "nccl":
                self._attach_marks(path)
                continue
            ret_fn = "ret_runtime" if kind == "cudart" else "ret_driver"
            # kept one by one: duration needs the return
            kept = [Probe(sym, f"api_{i}", "api_multi", i, ret_fn)
                    for i, (sym, lib, keep, *_r) in enumerate(APIS) if lib == kind and keep]
            launches = [(i, sym) for i, (sym, lib, keep, *_r) in enumerate(APIS)
                        if lib == kind and not keep]
            missing = self.attach_probes(path, kept) + self._add_launch_probes(path, launches)
            self.note_attached(path, "uprobes", len(kept) + len(launches), missing)

    def _attach_marks(self, path: str) -> None:
        """Return probes on libnccl that restart each thread's queued count."""
        missing = self.attach_probes(path, [Probe(sym, ret="mark_nccl") for sym in NCCL_MARKS])
        self.note_attached(path, "queued-work marks", len(NCCL_MARKS), missing)

    def housekeeping(self, sink: RowSink) -> None:
        now = time.monotonic()
        if now - self._last_scan >= self.libs.RESCAN_S:
            self._last_scan = now
            self._attach_new(self.ctx.targets.pids())

    def _add_launch_probes(self, path: str, launches: list[tuple[int, str]]) -> list[str]:
        """Attach a library's launch probes through a path that stays valid; left
        attached only if the probes are counting now. Returns those not attached, with why."""
        if not launches:
            return []
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        stable = f"/proc/self/fd/{fd}"
        found, missing = [], []
        for i, sym in launches:
            try:
                found.append((i, sym, self.uprobes.offset(stable, sym)))
            except Exception:
                missing.append(f"{sym} (not in the library)")
        probes = LaunchProbes(self, stable, found)
        with self._probe_lock:
            try:
                if not found:
                    raise OSError("no launch symbol")
                probes.attach()
            except Exception as e:
                os.close(fd)
                return missing + [f"{sym} (launch probe refused: {e})" for _i, sym, _o in found]
            for note in self.uprobes.notes:
                self.notes.append(("warning", note))
            self.uprobes.notes.clear()
            self._launch_fds.append(fd)
            self.launch_probes.append(probes)
            self._launch_attached.add(probes)
            if self._on_since is None:     # off now: the next switch on attaches it
                self._detach(probes)
        return missing

    def _detach(self, probes: LaunchProbes) -> bool:
        try:
            probes.detach()
        except Exception as e:
            self._switch_notes.put(("warning", f"launch probes {probes.label}: cannot "
                                    f"detach ({e}); they keep counting, unused"))
            return False
        self._launch_attached.discard(probes)
        return True

    def _switch_launches(self, on: bool) -> None:
        """Attach or detach every launch probe, on the switcher thread: a detach waits
        for the kernel's RCU grace period (about 0.1 s here, under 1 ms of CPU), which
        would stall the ring buffer's polling."""
        if on == self.launches_on:
            return
        self.launches_on = on
        if not on:
            self._on_since = None     # the next interval is off, however long the detach
        if self._switcher is None:
            self._switches = queue.SimpleQueue()
            self._switcher = threading.Thread(target=self._switch_loop, daemon=True,
                                              name="ingero-launch-probes")
            self._switcher.start()
        self._switches.put(on)

    def _switch_loop(self) -> None:
        # The generation goes odd before the first detach and even only once every probe
        # is attached again: a count that spans a gap, or runs inside one, or any count
        # while a probe could not be attached, is unknown (see PROGRAM).
        while (on := self._switches.get()) is not None:
            with self._probe_lock:
                if not on:
                    self._on_since = None
                    if self._generation % 2 == 0:
                        self._bump_generation()
                    for probe in list(self._launch_attached):
                        self._detach(probe)
                    continue
                failed = []
                for probe in self.launch_probes:
                    if probe in self._launch_attached:
                        continue
                    try:
                        probe.attach()
                        self._launch_attached.add(probe)
                    except Exception as e:
                        failed.append(f"{probe.label} ({e})")
                if failed:
                    # not counting: intervals stay marked off, syncs unknown; the next
                    # cycle tries again
                    self._switch_notes.put(("warning", "launch probes could not be attached "
                                            "again: " + "; ".join(failed) + "; launches are "
                                            "not counted until they can be"))
                    continue
                self._bump_generation()
                self._on_since = mono_ns()

    def close(self) -> None:
        if self._switcher is not None:
            self._switches.put(None)
            self._switcher.join()
            self._switcher = None
        super().close()
        for fd in self._launch_fds:
            os.close(fd)
        self._launch_fds.clear()

    def on_exit_target(self, pid: int) -> None:
        super().on_exit_target(pid)
        if self.bpf is not None and self._generation:
            # entries are kept per thread once the probes have switched: drop the
            # process's own, so that thread churn cannot fill the map
            q = self.bpf[b"queued"]
            for k in [k for k, v in q.items() if v.tgid == pid]:
                try:
                    del q[k]
                except KeyError:
                    pass

    def _bump_generation(self) -> None:
        """Odd while the launch probes are off, even while on (see PROGRAM)."""
        self._generation = (self._generation + 1) & 0xFFFFFFFF
        gen = self.bpf[b"launch_gen"]
        gen[gen.Key(0)] = gen.Leaf(self._generation)

    def flush_stats(self, sink: RowSink, now: int) -> None:
        """Drain the launch counts into event_stats (entry-only: a count, no duration),
        then decide whether the next interval counts launches (LaunchDuty). An interval
        that did not count gets a row per launch API with count 0 and observed_ns 0."""
        rows = []
        counted = 0
        while not self._switch_notes.empty():
            self.notes.append(self._switch_notes.get())
        on_since = self._on_since
        was_on = on_since is not None
        # probes that came on during the interval counted only since then
        observed = now - on_since if was_on and on_since > self._stats_start else None
        if not was_on:
            for name in sorted(self._off_names):
                rows.append((self._stats_start, now, self.stat_source, name, None, None,
                             None, 0, None, None, None, 0))
            self.intervals_off += 1
        for k, v in drain(self.bpf[b"launches"]):
            if not was_on:
                continue        # calls in the microseconds before the detach: no sample
            stack_id = None
            if v.stack_id >= 0 and self.symbolizer:
                frames = self.symbolizer.frames(k.site.tgid, v.stack_id, k.site.ret)
                stack_id = sink.add_stack(frames) if frames else None
            elif v.stack_id < 0 and self.symbolizer:
                self.symbolizer.failed += 1
            rows.append((self._stats_start, now, self.stat_source, API_NAMES[k.api],
                         k.site.tgid or None, k.tid or None, stack_id, int(v.count),
                         None, None, None, observed))
            counted += int(v.count)
            self._off_names.add(API_NAMES[k.api])
        if rows:
            sink.add_many("event_stats", rows)
            self.events += len(rows)
        share = self.duty.share
        seconds = (observed if observed is not None else now - self._stats_start) / 1e9
        on = self.duty.next_on(counted, seconds, was_on)
        if self.duty.share != share and (self.duty.share == 1.0 or share == 1.0):
            self.notes.append(("info", (
                f"kernel launches: {counted / max(seconds, 1e-9):,.0f}"
                f"/s, above --launch-budget {self.duty.budget:,.0f}/s: launch probes on for "
                f"{self.duty.share:.0%} of the stats intervals (event_stats.observed_ns 0 "
                "marks the others)") if self.duty.share < 1.0 else
                "kernel launches back under --launch-budget: launch probes on throughout"))
        if on != self.launches_on and self.launch_probes and not self._stopping:
            self._switch_launches(on)
        self._stats_start = now

    def drain(self, sink: RowSink) -> None:
        self._stopping = True
        super().drain(sink)

    def handle(self, raw: list[bytes], sink: RowSink) -> None:
        rows = []
        for rec in raw:
            (ts, dur, stream, nbytes, ret_addr, qgap, pid, tid, stack_id, rc, device, api, qops,
             kind, has, layer) = EVENT.unpack(rec)
            rows.append((
                ts, dur, API_NAMES[api], LAYER_NAMES[layer],
                signed64(stream) if has & HAS_STREAM else None,
                nbytes if has & HAS_BYTES else None,
                (MEMCPY_KINDS[kind] if kind < len(MEMCPY_KINDS) else None) if has & HAS_KIND else None,
                None, device if has & HAS_DEVICE else None, rc, pid, tid,
                self.stack_row_id(sink, pid, stack_id, ret_addr),
                qops if has & HAS_QUEUED else None,
                (qgap if qops else None) if has & HAS_QUEUED else None))
        sink.add_many("cuda_events", rows)
        self.events += len(rows)

    def in_flight_rows(self, sink: RowSink, now: int, why: str) -> list[tuple]:
        """The calls kept one by one that are open now (entry seen, no return)."""
        rows = []
        for tid, c in self.open_calls():
            rows.append((c.ts, now, why, "cuda", API_NAMES[c.api], None, None, None, None,
                         None, None, None, None,
                         signed64(c.stream) if c.has & HAS_STREAM else None,
                         c.bytes if c.has & HAS_BYTES else None,
                         c.device if c.has & HAS_DEVICE else None, c.tgid, tid,
                         self.stack_row_id(sink, c.tgid, c.stack_id, c.ret_addr)))
        return rows
