"""Benchmark the eBPF sources (needs root, BCC, kernel headers: scripts/setup-ebpf.sh).

Floor: the cost of EMPTY BPF programs (return 0) on the same shim functions, at the
    loop's top speed: entry-only uprobes, uprobe+uretprobe pairs, and the capture's own
    pattern (a pair on ncclAllReduce, entry-only on cudaLaunchKernel). That is the trap
    cost no probe body can remove; the capture's overhead is reported against it.
(a) Overhead on the traced job: the shim rank_job loop (tests/fixtures) calls
    cudaLaunchKernel (1 or 19 times) + ncclAllReduce with calibrated CPU work in between,
    at 10k and 100k calls/s (all calls), capture off vs empty probes on every call (floor)
    vs on (NCCL + CUDA sources), counting every launch (--launch-budget 0) and with the
    default --launch-budget (launch probes on for a share of the stats intervals);
    ratios of elapsed times, and of the calling thread's CPU time (a trap is spent in
    that thread; the elapsed time also holds waits for a CPU that the capture's own
    threads took, which a 2-core VM has and a GPU node's many cores mostly have not). Runs last at least 5 s (--seconds; two on/off cycles of the
    bench's 0.25 s intervals, --stats-interval) so the sampled state shows.
(b) The highest sustained NCCL event rate (one ring buffer record per ncclAllReduce) with
    zero lost events, from the loop with no work between calls and rising poll load.
(c) CPU of the capture side (ring buffer read, unpack, rows) at about 10k events/s.
(d) --attach: attaching and detaching uprobes, one perf event each (BCC) against
    uprobe_multi links (capture/ebpf/uprobes.py): entry + return probes on every exported
    nccl* function of the real libnccl.so.2 (the nvidia-nccl-cu12 wheel in .venv; the shim
    if absent), then the NCCL and CUDA sources' own release (detach) in both modes.

Rows go to a counting sink here, not to a bundle: (c) is the eBPF sources' own cost; the
bundle writer's is measured by the capture's benchmark.

Usage: python bench/bench_ebpf.py [--quick] [--no-stacks] [--overhead-only] [--attach]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ingero_forensics.capture.ebpf.cuda import CudaSource  # noqa: E402
from ingero_forensics.capture.ebpf.nccl import NcclSource  # noqa: E402
from ingero_forensics.capture.source import CaptureContext, CaptureOptions  # noqa: E402
from tests.fixtures.build import build_fixtures  # noqa: E402


class CountingSink:
    def __init__(self):
        self.rows = 0
        self.lost = 0

    def add(self, table, row):
        self.rows += 1

    def add_many(self, table, rows):
        self.rows += len(rows)

    def add_stack(self, frames):
        return 1

    def log(self, level, source, event, message, count=None):
        if event == "lost_events":
            self.lost += count or 0


class Targets:
    auto = False

    def __init__(self):
        self._pids = set()
        self._subs = []

    def pids(self):
        return set(self._pids)

    def subscribe(self, on_new, on_exit):
        self._subs.append(on_new)

    def add(self, pid):
        self._pids.add(pid)
        for on_new in self._subs:
            on_new(pid)


class Capture:
    """NCCL + CUDA sources polled every 50 ms from a thread, like ingero-capture.
    ``budget``: --launch-budget (launches/s before sampling; 0 counts every one). Stats
    intervals are 0.25 s here (1 s in the capture) so that a run of a few seconds shows
    the sampled steady state; the switches then cost four times what they would."""

    stacks = True
    STATS_INTERVAL_S = 0.25

    def __init__(self, fx, budget: int = CaptureOptions.launch_budget):
        self.opts = CaptureOptions(lib_paths=[str(fx.libnccl), str(fx.libcudart)],
                                   stacks=self.stacks, launch_budget=budget,
                                   stats_interval_s=self.STATS_INTERVAL_S)
        self.targets = Targets()
        self.sources = [NcclSource(self.opts), CudaSource(self.opts)]
        self.sink = CountingSink()
        self.stop_flag = threading.Event()

    def __enter__(self):
        ctx = CaptureContext("bench", self.opts, self.targets)
        for s in self.sources:
            s.start(ctx)
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()
        return self

    def loop(self):
        while not self.stop_flag.wait(0.05):
            for s in self.sources:
                s.poll(self.sink)

    def __exit__(self, *exc):
        self.stop_flag.set()
        self.thread.join()
        for s in self.sources:
            s.stop(self.sink)


class EmptyProbes:
    """Empty BPF programs where the capture puts its probes: the floor of the overhead."""

    PATTERNS = {   # (uretprobe on ncclAllReduce?, uretprobe on cudaLaunchKernel?)
        "entry": (False, False), "pair": (True, True), "capture": (True, False)}

    def __init__(self, fx, pattern: str):
        self.fx, self.pattern = fx, pattern

    def __enter__(self):
        from ingero_forensics.capture.ebpf._bcc import import_bcc
        self.bpf = import_bcc().BPF(text=b"int empty(void *ctx) { return 0; }")
        nccl_ret, cuda_ret = self.PATTERNS[self.pattern]
        for lib, sym, ret in ((self.fx.libnccl, b"ncclAllReduce", nccl_ret),
                              (self.fx.libcudart, b"cudaLaunchKernel", cuda_ret)):
            self.bpf.attach_uprobe(name=str(lib).encode(), sym=sym, fn_name=b"empty")
            if ret:
                self.bpf.attach_uretprobe(name=str(lib).encode(), sym=sym, fn_name=b"empty")
        return self

    def __exit__(self, *exc):
        self.bpf.cleanup()


def run_loop(fx, iters: int, units: int, capture: Capture | None = None,
             launches: int = 1) -> float:
    """Seconds the traced loop took (its own clock, from go to done); each iteration is
    ``launches`` cudaLaunchKernel calls and one ncclAllReduce."""
    return run_loop_times(fx, iters, units, capture, launches)[0]


def run_loop_times(fx, iters: int, units: int, capture: Capture | None = None,
                   launches: int = 1) -> tuple[float, float]:
    """(elapsed, CPU) seconds of the loop's calling thread: the probes' traps are spent
    in it; waits for a CPU that another process took are in the elapsed time only."""
    p = subprocess.Popen([str(fx.rank_job), "loop", str(iters), str(units), str(launches)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    if capture is not None:
        capture.targets.add(p.pid)
    p.stdin.write("go\n")
    p.stdin.flush()
    res = json.loads(p.stdout.readline())
    p.stdin.close()
    p.wait()
    return res["elapsed_ns"] / 1e9, res["cpu_ns"] / 1e9


def calibrate(fx, calls_per_s: float, iters: int, launches: int = 1) -> int:
    """Spin units per iteration giving calls_per_s (launches + 1 calls per iteration)
    untraced."""
    units = 1000
    for _ in range(6):
        t = min(run_loop(fx, iters, units, launches=launches) for _ in range(2))
        rate = (launches + 1) * iters / t
        units = max(0, int(units * rate / calls_per_s))
    return units


def floor(fx, iters: int, repeats: int) -> dict:
    """Microseconds per loop iteration (2 calls) added by empty probes, at top speed."""
    runs = {"off": [], **{p: [] for p in EmptyProbes.PATTERNS}}
    for _ in range(repeats):
        runs["off"].append(run_loop(fx, iters, 0))
        for pattern in EmptyProbes.PATTERNS:
            with EmptyProbes(fx, pattern):
                runs[pattern].append(run_loop(fx, iters, 0))
        with Capture(fx, budget=0) as cap:
            runs.setdefault("capture_on", []).append(run_loop(fx, iters, 0, cap))
    base = min(runs["off"])
    return {k: {"best_us": (min(v) - base) / iters * 1e6,
                "worst_us": (max(v) - base) / iters * 1e6} for k, v in runs.items() if k != "off"}


def overhead(fx, calls_per_s: float, seconds: float, repeats: int, launches: int = 1) -> dict:
    """Elapsed time of the loop off, under empty probes (the floor), under the capture
    with every launch counted (--launch-budget 0) and with the default budget."""
    per_iter = launches + 1
    iters = int(calls_per_s * seconds / per_iter)
    units = calibrate(fx, calls_per_s, max(1000, iters // 5), launches)
    runs = {"off": [], "empty": [], "all": [], "budget": []}
    cpu = {k: [] for k in runs}
    for _ in range(repeats):   # interleaved so drifting machine load hits all alike
        for k in runs:
            if k == "off":
                t = run_loop_times(fx, iters, units, launches=launches)
            elif k == "empty":
                with EmptyProbes(fx, "capture"):
                    t = run_loop_times(fx, iters, units, launches=launches)
            else:
                with Capture(fx, budget=0 if k == "all" else CaptureOptions.launch_budget) as cap:
                    t = run_loop_times(fx, iters, units, cap, launches)
                if k == "budget":
                    cuda = cap.sources[1]
            runs[k].append(t[0])
            cpu[k].append(t[1])
    t = {k: statistics.median(v) for k, v in runs.items()}
    c = {k: statistics.median(v) for k, v in cpu.items()}
    pct = lambda d, k: [100 * (b / a - 1) for a, b in zip(d["off"], d[k])]  # noqa: E731
    return {"target_calls_per_s": calls_per_s, "launches_per_collective": launches,
            "calls": per_iter * iters, "rate_off": per_iter * iters / t["off"],
            "elapsed_s": t, "floor_pct": 100 * (t["empty"] / t["off"] - 1),
            "all_pct": 100 * (t["all"] / t["off"] - 1), "all_pct_rounds": pct(runs, "all"),
            "budget_pct": 100 * (t["budget"] / t["off"] - 1),
            "budget_pct_rounds": pct(runs, "budget"),
            # the calling thread's CPU time: what the traps cost it, without the waits
            # for a CPU that the capture's own threads took on a small machine
            "cpu_s": c, "cpu_floor_pct": 100 * (c["empty"] / c["off"] - 1),
            "cpu_all_pct": 100 * (c["all"] / c["off"] - 1),
            "cpu_budget_pct": 100 * (c["budget"] / c["off"] - 1),
            "cpu_budget_pct_rounds": pct(cpu, "budget"),
            "launch_share": cuda.duty.share, "intervals_off": cuda.intervals_off}


def max_rate(fx, seconds: float) -> dict:
    """Loss-free NCCL event rate: raise the rate until the kernel reports losses."""
    best = None
    for target in (20_000, 50_000, 100_000, 200_000, 300_000, 400_000):
        iters = int(target * seconds / 2)
        units = calibrate(fx, target, max(1000, iters // 5)) if target < 400_000 else 0
        with Capture(fx, budget=0) as cap:
            t = run_loop(fx, iters, units, cap)
        nccl = cap.sources[0]
        rate = iters / t   # one NCCL record per iteration
        row = {"target_calls_per_s": target, "nccl_events_per_s": rate, "lost": nccl.lost}
        print("  rate step:", json.dumps(row), flush=True)
        if nccl.lost:
            break
        best = row
    return best or {}


def capture_cpu(fx, seconds: float) -> dict:
    """Capture-side CPU while the loop makes ~10k NCCL events/s (20k calls/s)."""
    iters = int(10_000 * seconds)
    units = calibrate(fx, 20_000, max(1000, iters // 5))
    with Capture(fx, budget=0) as cap:
        c0, w0 = time.process_time(), time.monotonic()
        t = run_loop(fx, iters, units, cap)
        c1, w1 = time.process_time(), time.monotonic()
    return {"nccl_events_per_s": iters / t, "capture_cpu_pct": 100 * (c1 - c0) / (w1 - w0),
            "rows": cap.sink.rows, "lost": cap.sink.lost}


def real_or_shim_nccl(fx) -> Path:
    wheel = list((ROOT / ".venv").glob("lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"))
    return wheel[0] if wheel else Path(fx.libnccl)


def attach_times(fx) -> dict:
    """(d): seconds to attach and detach the same uprobes both ways."""
    from ingero_forensics.capture.ebpf._bcc import import_bcc
    from ingero_forensics.capture.ebpf.uprobes import Uprobes, dispatch_programs
    bcc = import_bcc()
    lib = real_or_shim_nccl(fx)
    syms = sorted({line.split()[-1] for line in subprocess.run(
        ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
        check=True).stdout.splitlines() if line.split()[-1].startswith("nccl")})
    calls = {i: "0" for i in range(len(syms))}
    bpf = bcc.BPF(text=(dispatch_programs("e", calls) + "int r(struct pt_regs *ctx) { return 0; }").encode())
    out = {"library": str(lib), "functions": len(syms), "probes": 2 * len(syms)}
    t0 = time.perf_counter()
    for i, sym in enumerate(syms):
        bpf.attach_uprobe(name=str(lib).encode(), sym=sym.encode(), fn_name=f"e_{i}".encode())
        bpf.attach_uretprobe(name=str(lib).encode(), sym=sym.encode(), fn_name=b"r")
    t1 = time.perf_counter()
    for sym in syms:
        bpf.detach_uprobe(name=str(lib).encode(), sym=sym.encode())
        bpf.detach_uretprobe(name=str(lib).encode(), sym=sym.encode())
    t2 = time.perf_counter()
    up = Uprobes(bcc, bpf, env={})
    offs = [up.offset(str(lib), s) for s in syms]
    t3 = time.perf_counter()
    up.link(str(lib), "e_multi", offs, list(range(len(syms))))
    up.link(str(lib), "r", offs, [0] * len(syms), ret=True)
    t4 = time.perf_counter()
    up.close()
    t5 = time.perf_counter()
    bpf.cleanup()
    out.update(perf_attach_s=t1 - t0, perf_detach_s=t2 - t1, links_attach_s=t4 - t3,
               links_detach_s=t5 - t4)
    for mode in ("perf", "multi"):
        os.environ["INGERO_UPROBES"] = mode
        try:
            with Capture(fx) as cap:
                time.sleep(0.2)
                cap.stop_flag.set()
                cap.thread.join()
                for src in cap.sources:
                    src.drain(cap.sink)
                t0 = time.perf_counter()
                for src in cap.sources:
                    src.release()
                out[f"sources_release_{mode}_s"] = time.perf_counter() - t0
                cap.sources = []
        finally:
            os.environ.pop("INGERO_UPROBES", None)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer repeats")
    ap.add_argument("--no-stacks", action="store_true", help="capture without user stacks")
    ap.add_argument("--overhead-only", action="store_true", help="only (a)")
    ap.add_argument("--attach", action="store_true", help="only (d): attach and detach times")
    ap.add_argument("--uprobes", choices=["multi", "perf"], default=None,
                    help="how the captures attach their uprobes (INGERO_UPROBES; default: "
                         "uprobe_multi links where the kernel has them)")
    ap.add_argument("--rates", default="10000,100000",
                    help="(a): calls/s to measure, comma-separated (default 10000,100000)")
    ap.add_argument("--launches", default="1,19",
                    help="(a): launches per collective, comma-separated (default 1,19)")
    ap.add_argument("--no-floor", action="store_true", help="skip the top-speed floor")
    ap.add_argument("--stats-interval", type=float, default=Capture.STATS_INTERVAL_S,
                    help="(a): the captures' stats interval, s (default 0.25; the capture's "
                         "own is 1.0, which needs runs of 20 s or more: --seconds)")
    ap.add_argument("--seconds", type=float, default=5.0,
                    help="(a): length of each run, at least (default 5)")
    a = ap.parse_args()
    Capture.stacks = not a.no_stacks
    if a.uprobes:
        os.environ["INGERO_UPROBES"] = a.uprobes
    Capture.STATS_INTERVAL_S = a.stats_interval
    if os.geteuid() != 0:
        sys.exit("bench_ebpf: needs root")
    fx = build_fixtures()
    if a.attach:
        d = attach_times(fx)
        print(f"(d) {d['probes']} uprobes (entry + return on {d['functions']} nccl* functions of "
              f"{d['library']}): one perf event each: attach {d['perf_attach_s']:.3f} s, "
              f"detach {d['perf_detach_s']:.3f} s; 2 uprobe_multi links: attach "
              f"{d['links_attach_s']:.3f} s, detach {d['links_detach_s']:.3f} s "
              f"({d['perf_detach_s'] / max(d['links_detach_s'], 1e-9):.0f}x faster)")
        print(f"(d) NCCL + CUDA sources on the shims, release (detach) after the drain: perf "
              f"events {d['sources_release_perf_s']:.2f} s, links {d['sources_release_multi_s']:.2f} s")
        return
    secs, reps = (1.0, 3) if a.quick else (3.0, 5)
    print(f"eBPF bench on {os.uname().release}, {os.cpu_count()} CPUs; medians of {reps}"
          f"{'; stacks off' if a.no_stacks else ''}; stats interval {a.stats_interval} s; "
          f"uprobes {a.uprobes or 'default'}")
    if not a.no_floor:
        print_floor(fx, 100_000 if a.quick else 200_000, reps)
    budget = CaptureOptions.launch_budget
    for launches in map(int, a.launches.split(",")):
        mix = f"{launches} launch{'es' if launches > 1 else ''} per collective"
        for rate in map(int, a.rates.split(",")):
            r = overhead(fx, rate, max(secs, a.seconds), reps, launches)
            rounds = lambda k: ", ".join(f"{p:+.1f}" for p in r[k])  # noqa: E731
            e = r["elapsed_s"]
            print(f"(a) {rate:>7,} calls/s, {mix}: off {e['off']:.3f} s; empty probes on "
                  f"every call (floor) {r['floor_pct']:+.2f} %; capture counting every launch "
                  f"{r['all_pct']:+.2f} % (rounds {rounds('all_pct_rounds')}); capture with "
                  f"--launch-budget {budget} {r['budget_pct']:+.2f} % (rounds "
                  f"{rounds('budget_pct_rounds')}; launch probes on for "
                  f"{r['launch_share']:.0%} of the intervals, {r['intervals_off']} off)",
                  flush=True)
            print(f"    the calling thread's CPU time: floor {r['cpu_floor_pct']:+.2f} %; every "
                  f"launch {r['cpu_all_pct']:+.2f} %; --launch-budget {budget} "
                  f"{r['cpu_budget_pct']:+.2f} % (rounds {rounds('cpu_budget_pct_rounds')})",
                  flush=True)
    if a.overhead_only:
        return
    m = max_rate(fx, secs)
    print(f"(b) highest loss-free NCCL event rate tested: {m.get('nccl_events_per_s', 0):,.0f}/s "
          f"(target step {m.get('target_calls_per_s')})")
    c = capture_cpu(fx, secs * 2)
    print(f"(c) capture CPU at {c['nccl_events_per_s']:,.0f} NCCL events/s: "
          f"{c['capture_cpu_pct']:.1f} % of one CPU ({c['rows']} rows, {c['lost']} lost)")


def print_floor(fx, iters: int, reps: int) -> None:
    f = floor(fx, iters, reps)
    for k, label in (("entry", "empty uprobe on both (2 traps)"),
                     ("pair", "empty uprobe+uretprobe on both (4 traps)"),
                     ("capture", "empty probes, capture's pattern (3 traps)"),
                     ("capture_on", "the capture itself (same 3 traps)")):
        print(f"floor: {label:44s} {f[k]['best_us']:5.2f} us per iteration "
              f"(worst run {f[k]['worst_us']:.2f}); 2 calls per iteration")
    floor_10k = f["capture"]["best_us"] * 5_000 / 1e4   # % of a second at 5k iterations/s
    print(f"floor at 10k calls/s: {floor_10k:.2f} % of the traced thread; "
          f"capture at top speed = {f['capture_on']['best_us'] / f['capture']['best_us']:.2f} x floor")


if __name__ == "__main__":
    main()
