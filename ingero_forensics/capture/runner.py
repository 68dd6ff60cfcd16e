"""The capture loop: ``run_capture(config)`` and ``check_sources(config)``.

One thread owns the live BundleWriter. Every ~50 ms it polls each source; once a second
it rescans the target processes, writes their rows, commits the open batch (so a crash
loses about a second) and checks rotation. Signals only set flags: SIGTERM/SIGINT stop
(seal, exit 0), SIGHUP rotates.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import apsw

from ..bundle.writer import BundleWriter, now_pair
from ..errors import DiskFullError, IngeroError
from .clock import ClockSource
from .distro import packages
from .host import HostSource
from .identity import ConfigError, host_facts, resolve_node_name
from .procs import TargetSet, is_kernel_thread, read_comm, read_stat_starttime, read_tgid
from .segments import (SPOOL_DIR, Sealer, check_bundle_dir, evict, lock_directory,
                       new_writer, next_index, remove_seal_temporaries,
                       recover_spools, sealed_bundles)
from .source import CaptureContext, CaptureOptions, Source, SourceStatus, SourceUnavailable
from .status import Reporter, status_text

POLL_S = 0.05
TICK_S = 1.0
#: Names under which eBPF sources report (the sources' own, and "ebpf" when none load).
EBPF_NAMES = frozenset({"ebpf", "nccl", "cuda", "tcp", "sched", "block"})


def ebpf_fix() -> str:
    pk = packages()
    return (f"run as root on a kernel with BPF and tracefs, with BCC ({pk.bcc}) and "
            f"kernel headers ({pk.headers})")


def sealing_error(err: BaseException) -> IngeroError:
    """What the capture stops with when sealing a segment (in the background, at a
    rotation) failed: a full file system, however it surfaced (OSError ENOSPC, or
    SQLite's FullError while the spool was copied), is the DiskFullError the capture
    reports as such ("file system full; capture stopped ..."); anything else says what
    failed."""
    if isinstance(err, DiskFullError):
        return err
    if isinstance(err, apsw.FullError) or (isinstance(err, OSError) and
                                           err.errno == errno.ENOSPC):
        return DiskFullError(f"sealing a segment: {err}")
    return IngeroError(f"sealing a segment failed: {type(err).__name__}: {err}")


@dataclass
class CaptureConfig:
    bundle_dir: Path
    node: str | None = None                 # --node
    config_file: Path | None = None         # --config
    pids: tuple[int, ...] = ()
    comms: tuple[str, ...] = ()
    duration: float | None = None
    segment_seconds: float = 300.0
    segment_size: int = 256 << 20
    max_disk: int | None = None
    clock_interval: float = 1.0
    host_interval: float = 0.1
    ebpf: bool = True
    options: CaptureOptions = field(default_factory=CaptureOptions)
    output: str = "plain"                   # tty | plain | quiet
    compression_level: int = 3
    env: dict | None = None                 # environment for INGERO_NODE (default os.environ)
    #: extra sources (tests, plugins) started like the built-in ones
    extra_sources: tuple[Source, ...] = ()
    #: --cmdline: how processes.cmdline is written (full, masked or none; procs.mask_cmdline)
    cmdline: str = "masked"
    #: --strict: stop at once (sealing what was recorded) when an eBPF source is off
    strict: bool = False
    #: --start-priority idle: compile the probes at the lowest CPU priority
    idle_start: bool = True


@dataclass
class CaptureSummary:
    node: str
    node_origin: str
    bundle_dir: str
    segments: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    sources_on: list[str] = field(default_factory=list)
    sources_off: dict[str, str] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    processes: int = 0
    seconds: float = 0.0
    stop_reason: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def ebpf_off(self) -> dict[str, str]:
        """The eBPF sources that are off, with the reason (``--strict`` fails on these)."""
        return {k: v for k, v in self.sources_off.items() if k in EBPF_NAMES}


def strict_failures(statuses: list[SourceStatus]) -> list[SourceStatus]:
    """What ``--check --strict`` fails on: an invalid node name or any eBPF source off."""
    return [s for s in statuses if not s.available and (s.name == "node" or s.name in EBPF_NAMES)]


class _Sink:
    """The RowSink handed to sources: always the current segment's writer."""

    def __init__(self, run: "_Run"):
        self.run = run

    def add(self, table, row):
        self.run.writer.add(table, row)

    def add_many(self, table, rows):
        self.run.writer.add_many(table, rows)

    def add_stack(self, frames):
        return self.run.writer.add_stack(frames)

    def log(self, level, source, event, message, count=None):
        self.run.log(level, source, event, message, count)


#: SCHED_IDLE gets a CPU almost only when it has nothing else to do (a weight of 3
#: against 1024 for each busy task): on a node whose job keeps every CPU busy a compile
#: at that priority takes minutes. After this long it goes on at nice 19 under the normal
#: policy (a weight of 15: about 1.5 % of a CPU against each busy task).
IDLE_STARVE_S = 30.0


@contextlib.contextmanager
def _as_is():
    yield _Priority()


@dataclass
class _Priority:
    raised: bool = False      # the block outlived IDLE_STARVE_S and went on at nice 19


@contextlib.contextmanager
def idle_priority(starve_s: float = IDLE_STARVE_S):
    """Run the block at the lowest CPU priority (SCHED_IDLE, nice 19) on this thread, then
    restore what it had; after ``starve_s`` at SCHED_IDLE it goes on at nice 19 under the
    normal policy (yields a _Priority that says so). Where the kernel refuses, the block
    runs as it is."""
    state = _Priority()
    tid = threading.get_native_id()

    def raise_priority():
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            state.raised = True
        except OSError:
            pass
    # started first: a thread inherits its creator's policy, and a timer at SCHED_IDLE
    # would itself wait for an idle CPU
    timer = threading.Timer(starve_s, raise_priority)
    timer.daemon = True
    try:
        policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        timer.start()
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (OSError, AttributeError):
        timer.cancel()
        yield state
        return
    try:
        yield state
    finally:
        timer.cancel()
        timer.join()
        try:
            os.sched_setscheduler(0, policy, param)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass


class _Run:
    def __init__(self, config: CaptureConfig, reporter: Reporter):
        self.cfg = config
        self.rep = reporter
        self.stop_flag = threading.Event()
        # set by the signal handlers; read by the loop at least every POLL_S
        self.stop_signalled = False
        self.stop_reason = ""
        self.rotate_flag = False
        self.writer: BundleWriter | None = None
        self.sink = _Sink(self)
        self.pending_log: list[tuple] = []   # logged before the first segment exists

    # -- logging: capture_log of the live segment, and stderr ----------------------
    def log(self, level, source, event, message, count=None, *, echo=True):
        if self.writer is not None:
            self.writer.log(level, source, event, message, count)
        else:
            self.pending_log.append((level, source, event, message, count,
                                     time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
        if echo:
            # a blind spot is said even with --quiet, like a source that is off
            self.rep.message(level, source, message, always=event == "nothing_seen")


def _resolve(config: CaptureConfig) -> tuple[str, str]:
    return resolve_node_name(config.node, config.config_file,
                             os.environ if config.env is None else config.env)


def _ebpf_sources(options: CaptureOptions) -> tuple[list[Source], SourceStatus | None]:
    """The eBPF sources, or the reason there are none."""
    try:
        from .ebpf import ebpf_sources
    except Exception as e:  # noqa: BLE001 - ImportError, or BCC failing at import time
        return [], SourceStatus("ebpf", False, f"eBPF sources cannot be loaded "
                                f"({type(e).__name__}: {e})", ebpf_fix())
    try:
        return list(ebpf_sources(options)), None
    except SourceUnavailable as e:
        return [], SourceStatus("ebpf", False, e.reason, e.fix or ebpf_fix())
    except Exception as e:  # noqa: BLE001
        return [], SourceStatus("ebpf", False, f"{type(e).__name__}: {e}", ebpf_fix())


def check_sources(config: CaptureConfig) -> list[SourceStatus]:
    """Which sources would work on this machine, and why not (``--check``)."""
    out: list[SourceStatus] = []
    try:
        node, origin = _resolve(config)
        out.append(SourceStatus("node", True, f"{node} (from {origin})"))
    except ConfigError as e:
        out.append(SourceStatus("node", False, str(e), "pass --node NAME"))
    clock = ClockSource(config.clock_interval)
    out.append(clock.probe())
    out += clock.sub_statuses()
    out.append(HostSource.probe())
    out.append(HostSource.probe_nvml())
    if not config.ebpf:
        out.append(SourceStatus("ebpf", False, "turned off with --no-ebpf", "drop --no-ebpf"))
    else:
        sources, why = _ebpf_sources(config.options)
        if why is not None:
            out.append(why)
        for s in sources:
            try:
                out.append(s.probe())
            except Exception as e:  # noqa: BLE001
                out.append(SourceStatus(getattr(s, "name", type(s).__name__), False,
                                        f"probe failed: {type(e).__name__}: {e}"))
    return out


def _check_pid(pid: int) -> None:
    """A --pid that names what the target scan can never trace is said at start, not
    found out from an empty bundle: a thread's id (/proc lists processes only) and a
    kernel thread (no user space to probe; its children would be every kernel thread)."""
    if pid <= 0 or read_stat_starttime(pid) is None:
        raise ConfigError(f"--pid {pid}: no such process")
    tgid = read_tgid(pid)
    if tgid is not None and tgid != pid:
        raise ConfigError(f"--pid {pid}: a thread of process {tgid}, not a process; "
                          f"pass --pid {tgid} (its threads are traced with it)")
    if is_kernel_thread(pid):
        raise ConfigError(f"--pid {pid}: a kernel thread ({read_comm(pid) or '?'}), not a "
                          "user process: nothing of it can be traced")


def run_capture(config: CaptureConfig, *, reporter: Reporter | None = None,
                stop_event: threading.Event | None = None) -> CaptureSummary:
    """Capture into config.bundle_dir until --duration, a signal or stop_event.

    Raises ConfigError for bad options, IngeroError when the directory is in use, and
    DiskFullError when the file system fills (sealed segments are kept intact; the open
    segment stays in the spool and is sealed by the next start).
    """
    rep = reporter or Reporter(config.output)
    node, origin = _resolve(config)
    for p in config.pids:
        _check_pid(p)
    if config.segment_seconds <= 0 or config.segment_size <= 0:
        raise ConfigError("--segment-seconds and --segment-size must be positive")
    bundle_dir = Path(config.bundle_dir)
    spool_dir = bundle_dir / SPOOL_DIR
    for d, what in ((bundle_dir, "bundle directory"), (spool_dir, "its spool directory")):
        try:
            # owner-only, whatever the umask of a program that calls run_capture (the
            # CLI sets 077 itself)
            d.mkdir(mode=0o700, parents=d == bundle_dir, exist_ok=True)
        except OSError as e:
            raise IngeroError(f"{d}: cannot create {what}: {e.strerror}") from None
        if d == bundle_dir:
            if not os.access(bundle_dir, os.W_OK):
                raise IngeroError(f"{bundle_dir}: not writable")
            check_bundle_dir(bundle_dir)     # before anything is created in it
    lock_fd = lock_directory(spool_dir)
    run = _Run(config, rep)
    if stop_event is not None:
        run.stop_flag = stop_event
    summary = CaptureSummary(node=node, node_origin=origin, bundle_dir=str(bundle_dir))
    try:
        return _capture(run, node, bundle_dir, spool_dir, summary)
    finally:
        os.close(lock_fd)


def _install_signals(run: _Run) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}

    # Plain attributes only: a handler runs between two bytecodes of the main thread,
    # which may be inside stop_flag.wait() holding the Event's lock, and Event.set()
    # here then waits for that lock forever (a capture hung on SIGTERM this way).
    def stop(signum, frame):
        run.stop_reason = signal.Signals(signum).name
        run.stop_signalled = True

    def rotate(signum, frame):
        run.rotate_flag = True

    old = {}
    for sig, fn in ((signal.SIGTERM, stop), (signal.SIGINT, stop), (signal.SIGHUP, rotate)):
        old[sig] = signal.signal(sig, fn)
    return old


def _capture(run: _Run, node: str, bundle_dir: Path, spool_dir: Path,
             summary: CaptureSummary) -> CaptureSummary:
    cfg, rep = run.cfg, run.rep
    t_start = time.monotonic()
    old_signals = _install_signals(run)
    try:
        # first: a killed seal's temporary holds a whole compressed segment, the space
        # that sealing what the spool kept may need (a review)
        for name in remove_seal_temporaries(bundle_dir):
            run.log("warning", "capture", "removed_seal_temporary",
                    f"removed {name}, left by a capture killed while it sealed a segment")
        for level, event, msg in recover_spools(spool_dir, bundle_dir,
                                                level=cfg.compression_level):
            run.log(level, "capture", event, msg)
            summary.recovered.append(msg)
        host = host_facts()
        index = next_index(bundle_dir, spool_dir, node)
        run.writer = new_writer(spool_dir, node, host, index)
        for level, source, event, msg, count, ts in run.pending_log:
            run.writer.log(level, source, event, msg, count, timestamp_ns=ts)
        run.pending_log.clear()
        run.log("info", "capture", "capture_start",
                f"node {node} (from {summary.node_origin}), segment {index}", echo=False)
        rep.message("info", "capture", f"capturing as node {node} into {bundle_dir}")
        loop = _Loop(run, node, host, bundle_dir, spool_dir, index, summary)
        loop.start_sources()
        if cfg.strict and summary.ebpf_off():
            run.stop_reason = "strict"
            run.stop_flag.set()
        try:
            # --duration counts from here: the bundle holds that long of every source,
            # however long BCC took to compile them (over 30 s at idle priority on a node
            # whose job keeps every CPU busy)
            loop.main(time.monotonic())
        except DiskFullError as e:
            loop.abandon()
            n = len([f for f in sealed_bundles(bundle_dir) if f.node == node])
            raise DiskFullError(f"{bundle_dir}: file system full; capture stopped ({e}). "
                                f"{n} sealed segment(s) kept intact; the open segment stays "
                                f"in {spool_dir} and is sealed by the next start") from None
        except BaseException:
            loop.abandon()
            raise
        summary.seconds = round(time.monotonic() - t_start, 3)
        summary.stop_reason = run.stop_reason
        return summary
    finally:
        for sig, fn in old_signals.items():
            signal.signal(sig, fn)
        rep.close()


class _Loop:
    def __init__(self, run: _Run, node, host, bundle_dir, spool_dir, index, summary):
        self.run, self.node, self.host = run, node, host
        self.bundle_dir, self.spool_dir = bundle_dir, spool_dir
        self.index = index
        self.summary = summary
        cfg = run.cfg
        self.targets = TargetSet(cfg.pids, cfg.comms, cmdline=cfg.cmdline)
        self.clock = ClockSource(cfg.clock_interval)
        self.sources: list[Source] = []
        self.sealer = Sealer(bundle_dir, cfg.compression_level)
        self.seg_started = time.monotonic()
        # rowids of this segment's processes/threads rows, keyed by the record
        self.proc_rows: dict[int, int] = {}      # id(ProcessInfo) -> rowid
        self.thread_rows: dict[tuple[int, int], int] = {}
        self.seg_start_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self.job_ids: list[str] = []
        #: source -> (level, message) of its source_off row, repeated in every segment
        self.off_log: dict[str, tuple[str, str]] = {}
        self._last_events: dict[str, int] = {}
        self._last_tick = time.monotonic()

    # -- sources --------------------------------------------------------------------
    def start_sources(self) -> None:
        run, cfg = self.run, self.run.cfg
        ctx = CaptureContext(self.node, cfg.options, self.targets)
        cands: list[Source] = [self.clock, HostSource(cfg.host_interval)]
        if cfg.ebpf:
            ebpf, why = _ebpf_sources(cfg.options)
            if why is not None:
                self._off(why.name, why.reason, why.fix)
            cands += ebpf
        else:
            run.log("info", "ebpf", "source_off", "eBPF sources turned off with --no-ebpf")
            self.summary.sources_off["ebpf"] = "turned off with --no-ebpf"
            self.off_log["ebpf"] = ("info", "eBPF sources turned off with --no-ebpf")
        cands += list(cfg.extra_sources)
        # The first scan before the eBPF sources start, so they see the targets.
        self.scan_targets()
        # Nothing reads the ring buffers until every source is on. So the uprobe sources,
        # the busiest (a job's every CUDA call), compile first and attach last: attached
        # first, they filled their buffers while the others compiled (seconds; tens of
        # seconds at idle priority on a busy node) and lost events. Their tracepoints the
        # others attach as they load.
        early = [s for s in cands if getattr(s, "compile_first", False)]
        for s in early:
            if not self._begin(s, lambda s=s: s.prepare(ctx), "compiling"):
                cands.remove(s)
        order = [s for s in cands if s not in early] + [s for s in cands if s in early]
        for s in order:
            if not self._begin(s, lambda s=s: s.start(ctx), "starting"):
                continue
            self.sources.append(s)
            detail = ""
            if isinstance(s, HostSource) and s.reader is not None and s.reader.jobs is not None:
                detail = f" ({s.reader.jobs.describe()})"    # where per-job figures come from
            run.log("info", s.name, "source_on", f"{s.name} source on{detail}", echo=False)
            if isinstance(s, HostSource):
                st = s.nvml_status
                if st is not None and not st.available:
                    # on stderr too, also with --quiet, like every source that is off: a
                    # GPU node whose container lacks the driver's libraries has no GPU
                    # metrics, and its operator must hear it at start
                    msg = f"NVML off: {st.reason}; fix: {st.fix}"
                    run.log("info", "nvml", "source_off", msg, echo=False)
                    self.off_log["nvml"] = ("info", msg)
                    run.rep.message("info", "nvml", msg, always=True)
                    self.summary.sources_off["nvml"] = st.reason
                for key, why in s.missing.items():
                    run.log("warning", "host", "warning", f"not sampled: {why}")
        self.sources.sort(key=cands.index)
        self.summary.sources_on += [s.name for s in self.sources]
        if self.clock.chrony_on:
            run.log("info", "clock", "source_on", "chrony tracking via chronyc", echo=False)
        self.clock.sample_now(run.sink)
        on = ", ".join(self.summary.sources_on)
        if run.cfg.strict and self.summary.ebpf_off():
            # not "sources on:": the job wrapper takes that line for a capture that runs
            run.rep.message("info", "capture", f"sources started: {on}; stopping at once "
                            "(--strict: an eBPF source is off)")
        else:
            run.rep.message("info", "capture", "sources on: " + on)

    def _begin(self, s: Source, step, what: str) -> bool:
        """Run a source's compile or start; False (and the source is off) if it failed."""
        run, cfg = self.run, self.run.cfg
        try:
            # BCC compiles each program (about a CPU-second each): at the lowest
            # priority, so a job already running barely notices
            with (idle_priority() if cfg.idle_start else _as_is()) as prio:
                step()
            if prio.raised:
                run.log("info", s.name, "slow_start", f"{s.name}: {what} took over "
                        f"{IDLE_STARVE_S:.0f} s at idle CPU priority (every CPU busy); "
                        "finished at nice 19")
        except SourceUnavailable as e:
            self._off(s.name, e.reason, e.fix)
            return False
        except Exception as e:  # noqa: BLE001 - a broken source must not stop capture
            self._off(s.name, f"failed to start ({type(e).__name__}: {e})", None,
                      level="error")
            return False
        return True

    def _off(self, name, reason, fix, level="warning") -> None:
        msg = f"{name} source off: {reason}" + (f"; fix: {fix}" if fix else "")
        self.run.log(level, name, "source_off", msg, echo=False)
        self.off_log[name] = (level, msg)
        self.run.rep.message(level, name, msg, always=True)
        self.summary.sources_off[name] = reason

    # -- main loop ------------------------------------------------------------------
    def main(self, t_on: float) -> None:
        """Poll until a stop: a signal, stop_event, or --duration after t_on (every
        source on)."""
        run, cfg = self.run, self.run.cfg
        deadline = t_on + cfg.duration if cfg.duration else None
        next_tick = time.monotonic() + TICK_S
        while not (run.stop_signalled or run.stop_flag.is_set()):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                run.stop_reason = "duration"
                break
            self.poll_sources()
            if self.sealer.error is not None:
                self._sealer_failed()
            if now >= next_tick:
                next_tick = max(next_tick + TICK_S, now)
                self.tick()
            if run.rotate_flag:
                run.rotate_flag = False
                self.rotate("SIGHUP")
            wake = min(now + POLL_S, next_tick, deadline or next_tick)
            run.stop_flag.wait(max(0.0, wake - time.monotonic()))
        self.finish()

    def poll_sources(self) -> None:
        for s in list(self.sources):
            try:
                s.poll(self.run.sink)
            except DiskFullError:
                raise
            except Exception as e:  # noqa: BLE001
                self.sources.remove(s)
                msg = f"{s.name} source stopped after an error: {type(e).__name__}: {e}"
                self.run.log("error", s.name, "source_off", msg)
                self.off_log[s.name] = ("error", msg)
                self.summary.sources_off[s.name] = f"error: {e}"

    def tick(self) -> None:
        run, cfg = self.run, self.run.cfg
        self.scan_targets()
        self._flush()
        self._collect_sealed()
        # at the tick nearest the segment's length: the ticks run a little ahead of the
        # segment's start (it began within a tick), so ">= length" would wait a tick more
        if time.monotonic() - self.seg_started >= cfg.segment_seconds - TICK_S / 2:
            self.rotate("segment-seconds")
        elif run.writer.size_bytes() >= cfg.segment_size:
            self.rotate("segment-size")
        self._status()

    def _flush(self) -> None:
        try:
            self.run.writer.flush()
        except apsw.FullError:
            raise DiskFullError(f"{self.run.writer.spool_path}: file system full") from None

    # -- processes and threads --------------------------------------------------------
    def scan_targets(self) -> None:
        new, gone = self.targets.scan()
        for pid in new:
            info = self.targets.known[pid]
            r = info.row()
            rank = f"rank {r[5]}" if r[5] is not None else "no rank in its environment"
            self.run.log("info", "capture", "target", f"tracing pid {pid} ({info.comm}), {rank}",
                         echo=False)
        self._write_process_rows()

    def _write_process_rows(self) -> None:
        """Insert this segment's new process/thread rows, update the others by rowid."""
        w = self.run.writer
        if w is None:
            return
        w.flush()  # keep capture_log etc. ordered before our direct statements
        con = w.con
        ins_p = ("INSERT INTO processes (pid, start_boottime_ns, comm, exe, cmdline, rank, "
                 "local_rank, world_size, local_world_size, node_rank, job_id, env, "
                 "first_seen_ns, last_seen_ns, exit_ns) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)")
        ins_t = ("INSERT INTO threads (pid, tid, comm, first_seen_ns, last_seen_ns) "
                 "VALUES (?,?,?,?,?)")
        upd_p, upd_t = [], []
        try:
            with con:
                for info in self.targets.records():
                    key = id(info)
                    if info.exit_ns is not None and info.exit_ns < self.seg_start_ns \
                            and key not in self.proc_rows:
                        continue  # exited before this segment began
                    rid = self.proc_rows.get(key)
                    if rid is None:
                        con.execute(ins_p, info.row())
                        self.proc_rows[key] = con.last_insert_rowid()
                        w.rows["processes"] += 1
                    else:
                        # all of it: a launcher that exec'd the trainer since the row was
                        # written has another exe, command line and rank environment
                        row = info.row()
                        upd_p.append(row[2:12] + row[13:15] + (rid,))
                    for tid, (comm, first, last) in info.threads.items():
                        tkey = (key, tid)
                        trid = self.thread_rows.get(tkey)
                        if trid is None:
                            con.execute(ins_t, (info.pid, tid, comm, first, last))
                            self.thread_rows[tkey] = con.last_insert_rowid()
                            w.rows["threads"] += 1
                        elif info.exit_ns is None:
                            upd_t.append((last, trid))
                if upd_p:
                    con.executemany("UPDATE processes SET comm = ?, exe = ?, cmdline = ?, "
                                    "rank = ?, local_rank = ?, world_size = ?, "
                                    "local_world_size = ?, node_rank = ?, job_id = ?, env = ?, "
                                    "last_seen_ns = ?, exit_ns = ? WHERE id = ?", upd_p)
                if upd_t:
                    con.executemany("UPDATE threads SET last_seen_ns = ? WHERE id = ?", upd_t)
                jobs = self.targets.job_ids()
                if jobs != self.job_ids:
                    import json
                    con.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('job_ids', ?)",
                                (json.dumps(jobs),))
                    self.job_ids = jobs
        except apsw.FullError:
            raise DiskFullError(f"{w.spool_path}: file system full") from None

    # -- segments ---------------------------------------------------------------------
    def rotate(self, why: str) -> None:
        run = self.run
        for s in self.sources:               # calls open at the seal: a hang's evidence
            try:
                s.record_in_flight(run.sink, "seal")
            except DiskFullError:
                raise
            except Exception as e:  # noqa: BLE001 - the seal must go on
                run.log("error", s.name, "warning", f"calls in flight not recorded: {e}")
        self.clock.sample_now(run.sink)      # a clock bracket at each segment edge
        self._write_process_rows()
        old = run.writer
        end = now_pair()
        self.index += 1
        self.sealer.wait()                   # one seal at a time; surfaces its error
        if self.sealer.error is not None:
            self._sealer_failed()
        run.writer = new_writer(self.spool_dir, self.node, self.host, self.index)
        self.seg_started = time.monotonic()
        self.seg_start_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self.proc_rows.clear()
        self.thread_rows.clear()
        self.job_ids = []
        old.flush()
        self.sealer.seal(old, end)
        run.log("info", "capture", "rotate", f"segment {self.index} started ({why})",
                echo=False)
        # every bundle says which sources ran (docs/bundle-format.md, the capture log):
        # the first segment may be evicted, or merged apart from the others
        for src in self.sources:
            run.log("info", src.name, "source_on", f"{src.name} source on (since the "
                    "capture started)", echo=False)
        for name, (level, msg) in self.off_log.items():
            run.log(level, name, "source_off", msg, echo=False)
        self.clock.sample_now(run.sink)
        self._write_process_rows()

    def _collect_sealed(self) -> None:
        for path in self.sealer.collect():
            self.summary.segments.append(str(path))
            self.run.log("info", "capture", "sealed", f"sealed {path.name}")
            self._evict()

    def _evict(self) -> None:
        cfg = self.run.cfg
        if cfg.max_disk is None:
            return
        in_use = self.run.writer.size_bytes() if self.run.writer else 0
        for path, size in evict(self.bundle_dir, self.node, cfg.max_disk, in_use=in_use):
            self.summary.evicted.append(str(path))
            self.run.log("info", "capture", "eviction",
                         f"evicted {path.name} ({size} bytes) to stay within --max-disk "
                         f"{cfg.max_disk} bytes", count=size)

    def _sealer_failed(self) -> None:
        err, self.sealer.error = self.sealer.error, None
        raise sealing_error(err)

    def finish(self) -> None:
        """Final polls, last process rows, seal synchronously; the sources let go of
        their probes only then (detaching them takes seconds: a SIGTERM's grace period
        should see the bundle sealed, not the kernel's detaches)."""
        try:
            self._finish()
        finally:
            for s in self.sources:
                try:
                    s.release()
                except Exception as e:  # noqa: BLE001 - the bundle is sealed; say it
                    self.run.rep.message("warning", s.name, f"{s.name} failed to detach: {e}")

    def _finish(self) -> None:
        run = self.run
        for s in self.sources:
            try:
                s.drain(run.sink)
            except DiskFullError:
                raise
            except Exception as e:  # noqa: BLE001
                run.log("error", s.name, "warning", f"{s.name} failed to stop cleanly: {e}")
        for s in self.sources:
            self.summary.events[s.name] = s.events
            if s.lost:
                self.summary.lost[s.name] = s.lost
                run.log("warning", s.name, "lost_events", f"{s.name} lost {s.lost} events",
                        count=s.lost)
        self.targets.scan()
        self._write_process_rows()
        self.summary.processes = len(self.targets.records())
        if not self.summary.processes:
            run.log("warning", "capture", "nothing_seen",
                    "no process was traced during the capture (none matched --pid or "
                    "--comm, or, without them, mapped libnccl or libcudart or had RANK in "
                    "its environment): the bundle holds host and clock samples only")
        run.log("info", "capture", "capture_stop",
                f"stopped ({run.stop_reason or 'requested'})", echo=False)
        self.sealer.wait()
        if self.sealer.error is not None:
            self._sealer_failed()
        self._collect_sealed()
        w, run.writer = run.writer, None
        try:
            path = w.seal(self.bundle_dir, level=run.cfg.compression_level)
        except OSError as e:
            # read-only remount, quota, EIO, a directory made immutable: one line, and the
            # segment is not lost (its spool is sealed by the next start)
            if e.errno == errno.ENOSPC:
                raise DiskFullError(f"{w.spool_path}: file system full") from None
            raise IngeroError(f"{self.bundle_dir}: cannot seal the last segment "
                              f"({e.strerror or e}); it stays in {w.spool_path.parent} and "
                              "the next start seals it") from None
        self.summary.segments.append(str(path))
        run.rep.message("info", "capture", f"sealed {path.name}")
        if run.cfg.max_disk is not None:
            for p, size in evict(self.bundle_dir, self.node, run.cfg.max_disk):
                # No next segment to log into: say it on stderr and in the summary.
                self.summary.evicted.append(str(p))
                run.rep.message("info", "capture", f"evicted {p.name} ({size} bytes)")

    def abandon(self) -> None:
        """After a fatal error: stop sources, keep the spool for the next start."""
        run = self.run
        for s in self.sources:
            try:
                s.stop(_NullSink())
            except Exception:  # noqa: BLE001
                pass
        self.sources.clear()
        self.sealer.wait()
        w, run.writer = run.writer, None
        if w is not None:
            try:
                w.con.close()  # uncommitted rows are dropped; committed ones survive
            except Exception:  # noqa: BLE001
                pass

    # -- status ---------------------------------------------------------------------
    def _status(self) -> None:
        now = time.monotonic()
        dt = max(1e-6, now - self._last_tick)
        self._last_tick = now
        rates, lost = {}, 0
        for s in self.sources:
            rates[s.name] = (s.events - self._last_events.get(s.name, 0)) / dt
            self._last_events[s.name] = s.events
            lost += s.lost
        w = self.run.writer
        disk = sum(f.size for f in sealed_bundles(self.bundle_dir) if f.node == self.node)
        self.run.rep.status(status_text(rates, lost, self.index, w.size_bytes(), disk))


class _NullSink:
    def add(self, table, row): pass
    def add_many(self, table, rows): pass
    def add_stack(self, frames): return 0
    def log(self, *a, **k): pass
