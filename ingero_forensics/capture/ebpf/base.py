"""What every BCC source shares: compile and load, ring buffer reading, lost-event
accounting, in-kernel statistics, and user-stack symbolization.

Each source's C program starts with ``PRELUDE``: a ring buffer ``events``, a per-CPU
``lost`` counter bumped whenever the ring buffer is full, and the ``stat_add`` helper
that keeps a count, sum, max and log2 histogram per key in the ``stats`` hash. User
space drains ``stats`` every stats interval (lookup-and-delete, so no update is counted
twice) into event_stats rows. Records are submitted with BPF_RB_NO_WAKEUP: the reader
drains the ring buffer on its poll timer and never sleeps on it, so a wakeup would be
wasted work in the traced thread.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
import weakref
from abc import abstractmethod

from ..source import CaptureContext, RowSink, Source, SourceStatus, SourceUnavailable
from ..procs import read_stat_starttime
from ._bcc import check_environment, environment_problem, import_bcc
from .symbols import ProcessSymbols
from .symbols import preload as preload_symbols
from .uprobes import Probe, Uprobes

HIST_SLOTS = 40   # 2^40 ns is 18 minutes: anything longer lands in the last slot

PRELUDE = r"""
#include <uapi/linux/ptrace.h>
#define HIST_SLOTS __HIST_SLOTS__
BPF_RINGBUF_OUTPUT(events, __RING_PAGES__);
BPF_PERCPU_ARRAY(lost, u64, 1);
BPF_HASH(targets, u32, u8, 65536);

static __always_inline void count_lost(void) {
    int zero = 0;
    u64 *n = lost.lookup(&zero);
    if (n) (*n)++;   /* per-CPU slot: no atomics needed */
}

static __always_inline int is_target(u32 tgid) {
#if __FILTER_TARGETS__
    return targets.lookup(&tgid) != 0;
#else
    return 1;
#endif
}

#if __STATS_MAP__
/* caller: return address at a uprobe (the frame the stack walk misses), else 0 */
struct stat_key { u32 pid; u32 tid; s32 stack_id; u32 name; u64 caller; };
struct stat_val { u64 count; u64 total; u64 max; u64 hist[HIST_SLOTS]; };
BPF_HASH(stats, struct stat_key, struct stat_val, 16384);

static __always_inline void stat_add(struct stat_key *k, u64 d) {
    struct stat_val zero = {};
    struct stat_val *v = stats.lookup_or_try_init(k, &zero);
    if (!v) { count_lost(); return; }
    __sync_fetch_and_add(&v->count, 1);
    __sync_fetch_and_add(&v->total, d);
    if (d > v->max) v->max = d;
    /* slot i counts [2^i, 2^(i+1)) ns; bpf_log2l(d) is floor(log2 d) + 1 for d > 0 */
    u32 slot = d > 1 ? bpf_log2l(d) - 1 : 0;
    if (slot >= HIST_SLOTS) slot = HIST_SLOTS - 1;
    __sync_fetch_and_add(&v->hist[slot], 1);
}
#endif
"""


#: User stacks walked once per call site, for the NCCL and CUDA programs (a user-stack
#: walk costs about 0.9 us per call on the development VM, several times the rest of a
#: probe). A site is (process, return address, the caller's own return address read
#: through the frame pointer); its stack is the first one seen there, and calls from the
#: same two innermost sites but different outer callers share it. The map is LRU, so
#: garbage read where the caller keeps no frame pointer cannot fill it.
SITE_STACKS = r"""
BPF_STACK_TRACE(stacks, __STACK_ENTRIES__);
struct site { u64 ret; u64 up; u32 tgid; u32 pad; };
BPF_TABLE("lru_hash", struct site, s32, sites, __STACK_ENTRIES__);

/* A caller's frame lies above sp in the same stack: frame pointers further than this
 * are not frame pointers. */
#define FRAME_WINDOW (256 * 1024)

/* at a function's first instruction: [sp] = return address */
static __always_inline void read_ret(struct pt_regs *ctx, struct site *s) {
    bpf_probe_read_user(&s->ret, sizeof(s->ret), (void *)PT_REGS_SP(ctx));
}

/* A return address follows a call: e8 rel32, or ff /2 (through a register or memory,
 * 2 to 7 bytes with its operand). */
static __always_inline int after_call(u64 addr) {
    u8 c[8];
    if (bpf_probe_read_user(c, sizeof(c), (void *)(addr - 8)))
        return 0;
    if (c[3] == 0xe8) return 1;
    if (c[6] == 0xff && ((c[7] >> 3) & 7) == 2) return 1;
    if (c[5] == 0xff && ((c[6] >> 3) & 7) == 2) return 1;
    if (c[4] == 0xff && ((c[5] >> 3) & 7) == 2) return 1;
    if (c[2] == 0xff && ((c[3] >> 3) & 7) == 2) return 1;
    if (c[1] == 0xff && ((c[2] >> 3) & 7) == 2) return 1;
    return 0;
}

/* [bp + 8] = the caller's return address, bp being still the caller's frame pointer.
 * Code built without frame pointers (PyTorch's libraries) keeps other values in bp,
 * and a word read through one would make every call a new site: bp must point a little
 * above sp, name a frame that links to one further up, and the word must follow a call. */
static __always_inline void read_up(struct pt_regs *ctx, struct site *s) {
    u64 sp = PT_REGS_SP(ctx), bp = PT_REGS_FP(ctx);
    if (bp <= sp || bp - sp > FRAME_WINDOW || (bp & 7))
        return;
    u64 frame[2];    /* the caller's saved bp, its return address */
    if (bpf_probe_read_user(frame, sizeof(frame), (void *)bp))
        return;
    if (frame[0] <= bp || frame[0] - bp > FRAME_WINDOW || !after_call(frame[1]))
        return;
    s->up = frame[1];
}

static __always_inline void read_site(struct pt_regs *ctx, struct site *s) {
    read_ret(ctx, s);
    read_up(ctx, s);
}

static __always_inline s32 site_stack(struct pt_regs *ctx, struct site *s) {
    s32 *known = sites.lookup(s);
    if (known) return *known;
    s32 id = stacks.get_stackid(ctx, BPF_F_USER_STACK);
    if (id >= 0) sites.update(s, &id);   /* failures (map full) are retried, not cached */
    return id;
}
"""


#: BPF C: ARG(n), the n-th integer argument of a uprobed x86-64 SysV function: registers
#: for the first six, the caller's stack for the rest (read at entry, before the callee
#: touches its frame).
UPROBE_ARG_C = r"""
#define ARG(n) arg(ctx, n)
static __always_inline u64 arg(struct pt_regs *ctx, int n) {
    u64 v = 0;
    switch (n) {
    case 1: return PT_REGS_PARM1(ctx);
    case 2: return PT_REGS_PARM2(ctx);
    case 3: return PT_REGS_PARM3(ctx);
    case 4: return PT_REGS_PARM4(ctx);
    case 5: return PT_REGS_PARM5(ctx);
    case 6: return PT_REGS_PARM6(ctx);
    }
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n - 6)));
    return v;
}
"""


def mono_ns() -> int:
    """CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns()."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def hist_json(hist) -> str:
    vals = list(hist)
    while vals and vals[-1] == 0:
        vals.pop()
    return json.dumps(vals, separators=(",", ":"))


def drain(table) -> list:
    """Every (key, value) of a BPF hash, removed from it (so nothing is counted twice)."""
    try:
        return list(table.items_lookup_and_delete_batch())
    except Exception:   # kernels without batch ops: read, then delete what was read
        items = list(table.items())
        for k, _ in items:
            try:
                del table[k]
            except KeyError:
                pass
        return items


def signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


class Symbolizer:
    """User stacks from a BPF_STACK_TRACE map, symbolized on this node (symbols.py: not
    with BCC's symbol caches, which close a stray descriptor in libbcc before 0.33).

    At a uprobe on a function's first instruction the frame-pointer walk starts from the
    caller's frame, so on kernels before 6.11 the immediate caller is missing; the
    programs pass the return address read from the stack pointer and it is put back as
    frame 1 when the kernel did not already include it. A process that exited before
    its stacks were read cannot be symbolized: those stacks are left out (NULL).

    An address in no mapping the process's table knows is either in a library mapped
    since (dlopen: the mappings are re-read) or garbage from a walk through code built
    without frame pointers, as PyTorch's libraries are, which yields such addresses in
    most of its stacks. So a process's mappings are re-read at most once per REFRESH_S,
    and a frame still unknown after that stays in its stack with no module until the
    next re-read is due. A library's symbols are read once for every process mapping it.
    """

    REFRESH_S = 10.0
    #: how long a process's mappings are kept after its exit was seen: its last calls'
    #: events may still wait in the ring buffers (read at 20 Hz; the exit is seen by the
    #: targets' 1 Hz rescan, or by ``sweep``)
    GONE_GRACE_S = 5.0
    #: how often ``sweep`` looks for processes gone or pids reused (s)
    SWEEP_S = 1.0
    #: tgid -> its mappings; tgid -> when they were read; tgid -> when its exit was
    #: seen. Shared by every source, as is ``sweep``'s last time.
    processes: dict[int, ProcessSymbols] = {}
    refreshed: dict[int, float] = {}
    gone: dict[int, float] = {}
    swept = 0.0
    #: every source's symbolizer: a process dropped leaves none of their caches
    instances: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, table):
        self.instances.add(self)
        self.table = table
        #: (tgid, stack id, return address) -> (frames, None when every frame is known,
        #: else when the process's mappings were read for them: resolved again once re-read)
        self.cache: dict[tuple[int, int, int], tuple[list[dict], float | None]] = {}
        self.failed = 0   # stacks not stored (map full, collision) or not symbolizable

    def frames(self, tgid: int, stack_id: int, ret_addr: int = 0) -> list[dict] | None:
        if stack_id < 0:
            self.failed += 1
            return None
        key = (tgid, stack_id, ret_addr)
        hit = self.cache.get(key)
        if hit is not None and (hit[1] is None or (hit[1] == self.refreshed.get(tgid)
                                                   and not self._due(tgid))):
            return hit[0]
        if tgid not in self.processes and not os.path.exists(f"/proc/{tgid}"):
            if hit:                 # what was read while it lived
                return hit[0]
            self.failed += 1
            return None   # gone (and forgotten): addresses alone mean nothing off this node
        try:
            addrs = list(self.table.walk(stack_id))
        except KeyError:
            return hit[0] if hit else None
        if ret_addr and addrs and (len(addrs) < 2 or addrs[1] != ret_addr):
            addrs.insert(1, ret_addr)
        frames = [self._frame(tgid, a) for a in addrs]
        unknown = any(f["module"] is None for f in frames)
        if unknown and self._refresh(tgid):
            frames = [self._frame(tgid, a) for a in addrs]
            unknown = any(f["module"] is None for f in frames)
        if not any(f["module"] for f in frames):
            self.failed += 1
            return None   # process gone: addresses alone mean nothing off this node
        if hit and frames == hit[0]:
            frames = hit[0]     # the same list: the bundle writer knows it by identity
        self.cache[key] = (frames, self.refreshed.get(tgid) if unknown else None)
        return frames

    def _process(self, tgid: int) -> ProcessSymbols:
        proc = self.processes.get(tgid)
        if proc is None:
            proc = self.processes[tgid] = ProcessSymbols(tgid)
            self.refreshed[tgid] = time.monotonic()
        return proc

    def _frame(self, tgid: int, addr: int) -> dict:
        try:
            name, offset, module = self._process(tgid).resolve(addr)
        except Exception:   # noqa: BLE001 - a file no reader foresaw: an unknown frame
            name, offset, module = None, addr, None
        return {"module": os.path.basename(module) if module else None,
                "symbol": name, "offset": offset}

    def _due(self, tgid: int) -> bool:
        return time.monotonic() - self.refreshed.get(tgid, 0.0) >= self.REFRESH_S

    def _refresh(self, tgid: int) -> bool:
        """Re-read the process's mappings, unless that was done within REFRESH_S."""
        if not self._due(tgid):
            return False
        self.refreshed[tgid] = time.monotonic()
        self._process(tgid).refresh()
        return True

    @classmethod
    def preload(cls, pids) -> str | None:
        """Read the mappings of the running targets and the symbols of the files they map
        (symbols.preload), before any source is on: not at the first stacks, while
        events arrive. What was done, for capture_log, or None when no process was new
        (the mappings are shared by every source: the first source to compile reads
        them)."""
        t, new = time.monotonic(), []
        for pid in sorted(pids):
            if pid not in cls.processes and os.path.exists(f"/proc/{pid}"):
                new.append(ProcessSymbols(pid))
                cls.processes[pid] = new[-1]
                # as if never read: a library it maps by the first stacks is found then
                cls.refreshed[pid] = 0.0
        if not new:
            return None
        files = preload_symbols(new)
        return (f"symbols of {files} mapped files of {len(new)} running process(es) read "
                f"before the sources went on, in {time.monotonic() - t:.1f} s")

    @classmethod
    def forget(cls, tgid: int) -> None:
        """The process is gone: its mappings are dropped GONE_GRACE_S later, so that the
        events it made before it exited are still named."""
        cls.gone.setdefault(tgid, time.monotonic())
        cls._drop_gone()

    @classmethod
    def sweep(cls) -> None:
        """At most every SWEEP_S: processes known here that are gone are forgotten (also
        those no target scan follows: without --pid or --comm every process's calls are
        traced), and a pid that is another process's by now is dropped at once."""
        now = time.monotonic()
        if now - cls.swept < cls.SWEEP_S:
            return
        cls.swept = now
        for tgid, proc in list(cls.processes.items()):
            if tgid in cls.gone:
                continue
            started = read_stat_starttime(tgid)
            if started is None:
                cls.gone[tgid] = now
            elif proc.started is not None and started != proc.started:
                cls.discard(tgid)
        cls._drop_gone()

    @classmethod
    def _drop_gone(cls) -> None:
        now = time.monotonic()
        for tgid in [t for t, at in cls.gone.items() if now - at >= cls.GONE_GRACE_S]:
            cls.discard(tgid)

    @classmethod
    def discard(cls, tgid: int) -> None:
        """Drop what is known of the process at once, in every source's symbolizer: it
        is gone for long, or its pid is another process's (whose mappings and stacks
        are not its)."""
        cls.gone.pop(tgid, None)
        cls.refreshed.pop(tgid, None)
        cls.processes.pop(tgid, None)
        for sym in list(cls.instances):
            for key in [k for k in sym.cache if k[0] == tgid]:
                del sym.cache[key]


class BccSource(Source):
    """A source backed by one BPF program. Subclasses supply the program, attach it,
    and turn raw ring buffer records into rows."""

    #: event_stats.source value and the names of its stat keys (index = key.name)
    stat_source: str | None = None
    #: uprobe sources: the library kinds whose probes are this source's records (a
    #: capture that never found one says so at the stop)
    LIBRARIES: tuple[str, ...] = ()
    #: the program's probes are attached by ``attach`` (uprobes), not when it is loaded
    #: (tracepoints): the capture compiles it before the other sources and starts it
    #: after them (``prepare``)
    compile_first = False
    #: whether the program includes SITE_STACKS (its ``sites`` map is pruned at exit)
    uses_sites = False
    stat_names: tuple[str, ...] = ()
    #: how the ``calls`` map (calls between entry and return) is keyed: "tid",
    #: "tid_layer" (tid << 1 | layer), or None when the program has none
    open_call_map: str | None = None

    def __init__(self, options) -> None:
        super().__init__()
        self.options = options
        self.bcc = None
        self.bpf = None
        self.ctx: CaptureContext | None = None
        self.symbolizer: Symbolizer | None = None
        self.uprobes: Uprobes | None = None
        self._perf_programs: list[str] = []
        self._raw: list[bytes] = []
        self._lost_reported = 0
        self._stats_start = 0
        self._announced = False
        self.attached: list[str] = []       # what is attached, for the source_on message
        self.notes: list[tuple[str, str]] = []  # (level, message) queued for capture_log

    # -- contract -------------------------------------------------------------------
    #: what --check says the source would trace, where it can
    probe_detail = ""

    @classmethod
    def probe(cls) -> SourceStatus:
        problem = environment_problem()
        if problem is None:
            try:
                import_bcc()
            except SourceUnavailable as e:
                problem = (e.reason, e.fix)
        if problem:
            return SourceStatus(cls.name, False, *problem)
        return SourceStatus(cls.name, True, cls.probe_detail)

    def prepare(self, ctx: CaptureContext) -> None:
        """Compile and load the program (about a CPU-second). For a source whose probes
        are attached by ``attach`` (uprobes), nothing fires yet: the capture compiles
        these first and attaches them last, right before it starts reading, so that
        their ring buffers do not fill while the other sources compile. Those sources
        symbolize stacks, and the files the running targets map are read here too: no
        source is on yet, so no buffer fills meanwhile (Symbolizer.preload)."""
        self.bcc = import_bcc()
        check_environment()
        self.ctx = ctx
        text = self.program_text(ctx)
        try:
            self.bpf = self.bcc.BPF(text=text.encode())
        except Exception as e:   # BCC raises bare Exception; clang's errors went to stderr
            raise SourceUnavailable(f"{self.name}: BPF program failed to compile or load: {e}",
                                    "check kernel headers (scripts/setup-ebpf.sh) and dmesg") from None
        if self.compile_first and self.options.stacks:
            done = Symbolizer.preload(ctx.targets.pids())
            if done:
                self.notes.append(("info", done))

    def start(self, ctx: CaptureContext) -> None:
        if self.bpf is None:
            self.prepare(ctx)
        try:
            self.attach(ctx)
            self.bpf[b"events"].open_ring_buffer(self._on_record)
        except SourceUnavailable:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise SourceUnavailable(f"{self.name}: attaching failed: {e}") from None
        if self.filter_targets(ctx):
            for pid in ctx.targets.pids():
                self.add_target(pid)
            ctx.targets.subscribe(self.on_new_target, self.on_exit_target)
        self._stats_start = mono_ns()

    def poll(self, sink: RowSink) -> None:
        if self.bpf is None:
            return
        if not self._announced:
            self._announced = True
            # the capture logs source_on itself; this says what exactly got attached
            how = self.uprobes.describe() if self.uprobes else ""
            sink.log("info", self.name, "attached",
                     "; ".join(self.attached + ([how] if how else [])) or "attached")
        self.bpf.ring_buffer_consume()
        raw, self._raw = self._raw, []
        if raw:
            self.handle(raw, sink)
        if self.symbolizer:
            Symbolizer.sweep()      # after the events read: a process's last are named
        self.housekeeping(sink)
        for level, msg in self.notes:
            sink.log(level, self.name, "warning" if level == "warning" else "info", msg)
        self.notes.clear()
        self._report_lost(sink)
        now = mono_ns()
        if self.stat_source and now - self._stats_start >= self.options.stats_interval_s * 1e9:
            self.flush_stats(sink, now)

    def stop(self, sink: RowSink) -> None:
        self.drain(sink)
        self.release()

    def drain(self, sink: RowSink) -> None:
        if self.bpf is None:
            return
        self.poll(sink)
        if self.stat_source:
            self.flush_stats(sink, mono_ns())
        self.record_in_flight(sink, "stop")
        libs, want = getattr(self, "libs", None), self.LIBRARIES
        if libs is not None and want and not libs.kinds_seen & set(want):
            # waited the whole capture: say so as a gap, not as "0 rows"
            names = " or ".join(f"lib{k}" for k in want)
            sink.log("warning", self.name, "nothing_seen",
                     f"no traced process mapped {names} during the capture, so nothing was "
                     "probed: check that the training processes were traced (--pid, "
                     "--comm, or their RANK environment) or give the library with --lib")
        msg = f"{self.events} rows, {self.lost} events lost"
        if self.symbolizer and self.symbolizer.failed:
            msg += (f", {self.symbolizer.failed} stacks not recorded (stack map full or "
                    "process gone before symbolization)")
        sink.log("info", self.name, "source_off", msg)

    def release(self) -> None:
        # Detaching waits for the kernel: one wait per uprobe_multi link, but about 0.1 s
        # per probe, one at a time, for perf-event uprobes (9-10 s for the nccl and cuda
        # sources' 70-odd probes): the runner seals the last segment first, releases after.
        self.close()

    def record_in_flight(self, sink: RowSink, why: str) -> None:
        """Rows in calls_in_flight for the calls open now (sources with a ``calls`` map
        of calls between entry and return: nccl, cuda); ``why``: seal or stop."""
        if self.bpf is None or not self.open_call_map:
            return
        rows = self.in_flight_rows(sink, mono_ns(), why)
        if rows:
            sink.add_many("calls_in_flight", rows)
            sink.log("info", self.name, "in_flight", f"{len(rows)} calls open at the {why} "
                     "(calls_in_flight)", count=len(rows))

    def open_calls(self) -> list[tuple[int, object]]:
        """(tid, entry) for each entry of the ``calls`` map whose thread still exists;
        an entry left by a thread that died inside a call is removed."""
        table = self.bpf[b"calls"]
        out = []
        for k, v in list(table.items()):
            tid = k.value >> 1 if self.open_call_map == "tid_layer" else k.value
            if os.path.exists(f"/proc/{v.tgid}/task/{tid}"):
                out.append((tid, v))
                continue
            try:
                del table[k]
            except KeyError:
                pass
        return out

    def in_flight_rows(self, sink: RowSink, now: int, why: str) -> list[tuple]:
        """calls_in_flight rows for open_calls()."""
        return []

    # -- for subclasses ---------------------------------------------------------------
    @abstractmethod
    def program(self, ctx: CaptureContext) -> str:
        """The source's C, appended to PRELUDE."""

    @abstractmethod
    def attach(self, ctx: CaptureContext) -> None:
        """Attach the probes; raise SourceUnavailable when nothing could be attached."""

    @abstractmethod
    def handle(self, raw: list[bytes], sink: RowSink) -> None:
        """Turn raw ring buffer records into rows."""

    def housekeeping(self, sink: RowSink) -> None:
        """Called every poll after the records (new libraries, table refreshes)."""

    def filter_targets(self, ctx: CaptureContext) -> bool:
        """Whether the kernel side keeps only target processes (the ``targets`` map)."""
        return True

    # -- shared machinery ------------------------------------------------------------
    def program_text(self, ctx: CaptureContext) -> str:
        pages = 1 << max(0, int(self.options.ring_pages) - 1).bit_length()  # power of two
        text = PRELUDE + self.program(ctx)
        # the stats map (5 MiB) only where stat_add is used: flush_stats drains it
        stats_map = self.stat_source is not None and type(self).flush_stats is BccSource.flush_stats
        return (text.replace("__HIST_SLOTS__", str(HIST_SLOTS))
                    .replace("__STATS_MAP__", "1" if stats_map else "0")
                    .replace("__RING_PAGES__", str(pages))
                    .replace("__FILTER_TARGETS__", "1" if self.filter_targets(ctx) else "0"))

    def load_functions(self, names: list[str]) -> None:
        """Load (verify) every program now, so a verifier rejection is one clear error
        rather than a failed attach per symbol."""
        for fn in names:
            try:
                self.bpf.load_func(fn.encode(), self.bcc.BPF.KPROBE)
            except Exception as e:
                raise SourceUnavailable(f"{self.name}: the kernel rejected BPF program {fn}: {e}",
                                        "see the verifier log above; report it with the kernel "
                                        "version") from None

    def attach_libraries(self, ctx: CaptureContext, perf_programs: list[str],
                         link_programs: list[str], waiting: str) -> None:
        """Uprobe sources: load the programs, then attach to the libraries the targets map
        now (``_attach_new``; later ones as processes appear). ``link_programs`` are what
        uprobe_multi links run, ``perf_programs`` what one perf event per probe runs
        (uprobes.py); ``waiting`` is the attach note while no target maps the library."""
        self.uprobes = Uprobes(self.bcc, self.bpf)
        self.uprobes.load(link_programs)
        self._perf_programs = perf_programs
        if self.uprobes.mode == "perf":
            self.load_functions(perf_programs)
        self.symbolizer = Symbolizer(self.bpf[b"stacks"]) if self.options.stacks else None
        self._attach_new(ctx.targets.pids())
        if not self.attached:
            self.attached.append(waiting)

    def note_attached(self, path: str, what: str, total: int, missing: list[str]) -> None:
        """Say what attached on a library: in the source's on-message, in capture_log once
        the source is on, and as a warning when nothing did (a file named like the
        library that is not it: nothing would be recorded from it, silently)."""
        msg = f"{what} on {path}: {total - len(missing)} functions"
        if missing:
            msg += f" (not attached: {'; '.join(missing)})"
        self.attached.append(msg)
        if total and len(missing) == total:
            self.notes.append(("warning", f"none of the {total} functions probed is in "
                                          f"{path}: nothing is recorded from it (is it the "
                                          "library its name says?)"))
        elif self._announced:
            self.notes.append(("info", msg))

    def attach_probes(self, path: str, probes: list[Probe]) -> list[str]:
        """Attach ``probes`` on the library at ``path``; returns those not attached, with why."""
        was = self.uprobes.mode
        missing = self.uprobes.attach(path, probes)
        if self.uprobes.mode == "perf" and was != "perf":
            self.load_functions(self._perf_programs)    # verified before the first attach
        for note in self.uprobes.notes:
            self.notes.append(("warning", note))
        self.uprobes.notes.clear()
        return missing

    def _on_record(self, _ctx, data, size) -> None:
        self._raw.append(ctypes.string_at(data, size))

    def add_target(self, pid: int) -> None:
        if self.bpf is not None:
            t = self.bpf[b"targets"]
            t[t.Key(pid)] = t.Leaf(1)

    def on_new_target(self, pid: int) -> None:
        if self.symbolizer:
            self.symbolizer.discard(pid)      # a pid reused: nothing of the old process
        self.add_target(pid)

    def on_exit_target(self, pid: int) -> None:
        if self.bpf is not None:
            t = self.bpf[b"targets"]
            try:
                del t[t.Key(pid)]
            except KeyError:
                pass
        if self.symbolizer:
            self.symbolizer.forget(pid)
        if self.uses_sites and self.options.stacks and self.bpf is not None:
            # a later process reusing the pid must not inherit this one's call sites
            sites = self.bpf[b"sites"]
            for k in [k for k in sites.keys() if k.tgid == pid]:
                try:
                    del sites[k]
                except KeyError:
                    pass

    def _report_lost(self, sink: RowSink) -> None:
        total = int(self.bpf[b"lost"].sum(0).value)
        if total > self._lost_reported:
            n = total - self._lost_reported
            self._lost_reported = total
            self.lost += n
            sink.log("warning", self.name, "lost_events",
                     f"{n} events dropped in the kernel (ring buffer or map full); "
                     f"raise --ring-pages", count=n)

    def flush_stats(self, sink: RowSink, now: int) -> None:
        rows = []
        for k, v in drain(self.bpf[b"stats"]):
            stack_id = None
            if k.stack_id >= 0 and self.symbolizer:
                frames = self.symbolizer.frames(k.pid, k.stack_id, k.caller)
                stack_id = sink.add_stack(frames) if frames else None
            rows.append(self.stat_row(self._stats_start, now, k, v, stack_id))
        if rows:
            sink.add_many("event_stats", rows)
            self.events += len(rows)
        self._stats_start = now

    def stat_row(self, start: int, end: int, k, v, stack_id) -> tuple:
        return (start, end, self.stat_source, self.stat_names[k.name], k.pid or None,
                k.tid or None, stack_id, int(v.count), int(v.total), int(v.max),
                hist_json(v.hist))

    def stack_row_id(self, sink: RowSink, tgid: int, stack_id: int, ret_addr: int = 0):
        if self.symbolizer is None:
            return None
        frames = self.symbolizer.frames(tgid, stack_id, ret_addr)
        return sink.add_stack(frames) if frames else None

    def close(self) -> None:
        if self.uprobes is not None:
            self.uprobes.close()
            self.uprobes = None
        if self.bpf is not None:
            try:
                self.bpf.cleanup()
            finally:
                self.bpf = None
