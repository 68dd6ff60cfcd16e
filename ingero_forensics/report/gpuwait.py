"""A slow GPU that no late arrival shows (docs/report.md, rule 4b).

A rank's host enqueues kernels and collectives and goes on. On a node whose GPU runs
them slower, the collectives start late on the GPU, where the capture sees no arrival.
Its host calls NCCL on time, its peers wait inside every collective, and by entry times
no node is late. What the host does see is how long it waits for its own GPU work:
event and device synchronizations. Stream synchronizations are left out because they
wait for collectives too, which every rank waits for alike.

Seen on the real-kernel rig (tests/rig, scenario "gpu": the cudart shim's kernels three
times longer on one node). The node entered collectives 2.1 ms after the median, under
the 4.3 ms bar. The job's median step grew from 26 to 45 ms; the report said "No straggler".
Its forward pass's event synchronization waited 3.4 ms against 0.9 ms on the others.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from ..merge.summaries import SYNC_WAIT_APIS
from .evidence import (CLEAR_SCORE, RUNQ_FLOOR, RUNQ_RELATIVE, WEAK_SCORE, median,
                       runq_ms_per_s, signal_score, sync_wait_stats, table_exists,
                       wait_floor)

#: Kernel launches per second this far from the peers' median (either way) say that the
#: node's ranks run other work than their peers (a pipeline stage, extra evaluation):
#: then a slower GPU is only one reading of their longer waits.
SAME_WORK_RATIO = 1.25
#: Launch APIs counted in event_stats (capture/ebpf/cuda.py).
LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel")


@dataclass
class GpuSuspect:
    node_id: int
    pid: int                    # its process with the longest waits
    wait_ms: float              # that process's median wait for its own GPU work
    others_ms: float            # the median of the other nodes' (their slowest process)
    waits: int                  # how many waits that process made
    others_waits: float         # the median of the other nodes' (their slowest process)
    extra_s: float              # its waits beyond the others' median, summed
    score: float
    launches_per_s: float | None          # the node's kernel launches per second
    others_launches_per_s: float | None   # the other nodes' median
    #: the medians of all the waits with the waiting thread's run-queue delay inside
    #: each taken out (cpu_free_waits): what is left is waiting for the GPU
    free_ms: float = 0.0
    others_free_ms: float = 0.0
    #: its median wait over the others', over all the waits, with that delay (wait_ratio)
    #: and without it (free_ratio)
    wait_ratio: float = 1.0
    free_ratio: float = 1.0
    #: (free_ratio - 1) / (wait_ratio - 1): the share of its excess left without that
    #: delay; None where it cannot be told (most of the other nodes' waits were that
    #: delay too, or no excess at all)
    gpu_share: float | None = 1.0
    #: its traced threads' run-queue delay over the run (ms per s), the others' median,
    #: and whether that is a signal by itself (rule 5's score >= WEAK_SCORE)
    runq_ms_per_s: float = 0.0
    others_runq_ms_per_s: float = 0.0
    cpu_busy: bool = False

    @property
    def clear(self) -> bool:
        return self.score >= CLEAR_SCORE

    @property
    def reading(self) -> str:
        """"gpu": its longer waits are its GPU's; "cpu": its waiting threads' waits for a
        CPU inside them were most of the excess; "unsure": it cannot be told (its
        threads waited for a CPU far more than the others' over the run, though not
        inside these waits; or the measure could not separate: every node's waits were
        mostly that delay). Only "gpu" is named."""
        if self.gpu_share is not None and self.gpu_share < GPU_SHARE_LEFT:
            return "cpu"
        if self.cpu_busy or self.gpu_share is None:
            return "unsure"
        return "gpu"

    @property
    def same_syncs(self) -> bool:
        """Whether its slowest process waited about as often as its peers' (a rank that
        alone calls cudaDeviceSynchronize every step also waits for every all-reduce)."""
        return _within(self.waits, self.others_waits)

    @property
    def same_work(self) -> bool | None:
        """Whether the node launched about as many kernels as its peers and waited as
        often (None: launches not counted everywhere)."""
        if not self.same_syncs:
            return False
        if self.launches_per_s is None or not self.others_launches_per_s:
            return None
        return _within(self.launches_per_s, self.others_launches_per_s)


def _within(value: float, reference: float) -> bool:
    return reference > 0 and 1 / SAME_WORK_RATIO <= value / reference <= SAME_WORK_RATIO


#: the least score of a node said, not named, to wait longer for its own GPU work
#: than every other node where nothing else is found (the excess at least the wait
#: floor), and how many times the others' median wait it must be: on the rig a GPU
#: twice as slow waited 0.79-1.0 ms against 0.38-0.39 (score 1.6-2.2), the job 25 %
#: slower, and "No straggler" said nothing of it
SMALL_GPU_SCORE = 1.0
SMALL_GPU_RATIO = 1.5

#: The share of a node's excess wait for its own GPU work (its median over the others',
#: minus one) that must be left once the waiting threads' run-queue delay inside the
#: waits is taken out, for the waits to read as a slower GPU. A wait returns when the
#: GPU is done AND the waiting thread gets a CPU: on the real-kernel rig, ranks sharing
#: their cores with one busy process at nice 0 waited 1.0-1.2 ms against 0.33-0.41, and
#: -0.02-0.13 of that excess was left; GPUs twice and four times slower kept 0.53-0.98
#: (bench/bench_rig_accuracy.py).
GPU_SHARE_LEFT = 1 / 3
#: The least share of the other nodes' median wait left without their waiting threads'
#: run-queue delay for gpu_share to be told
FREE_LEFT = 0.5
#: What "No straggler" keeps of a GpuSuspect it says, not names (Analysis.gpu_unnamed)
GPU_UNNAMED_FIELDS = ("wait_ms", "others_ms", "score", "extra_s", "free_ms",
                      "others_free_ms", "wait_ratio", "free_ratio", "gpu_share",
                      "runq_ms_per_s", "others_runq_ms_per_s", "cpu_busy", "reading")
#: Other nodes whose CPU-free waits are read for their median (spread over the fleet):
#: each costs a read of its waits and its run-queue rows.
FREE_PEERS = 31


def gpu_suspect(con, node_ids, run_ns: int, min_cost_share: float,
                windows, min_score: float = WEAK_SCORE) -> GpuSuspect | None:
    """The node whose ranks wait for their own GPU work longer than every other
    node's (rule 5's GPU-wait score >= WEAK_SCORE; at CLEAR_SCORE a median wait beyond
    nine in ten of their waits, and 1.25 ms and 1.25 times their median above it at
    least) and long enough to matter (its extra wait at least ``min_cost_share`` of the
    run), or None. Where its longer waits read as a CPU's or cannot be told from one
    (``reading``: its waiting threads' run-queue delay inside the waits was most of the
    excess, or its threads' run-queue delay over ``windows``, the run, is a signal) it
    is returned to be said, not named. ``min_score``: below
    WEAK_SCORE, for what is said but not named (SMALL_GPU_SCORE). Weak evidence names it too: on a busy host a slower GPU blurs into
    the waits of ranks that wait for a CPU (the real-kernel rig with eight ranks on two
    cores and one GPU three times slower: score 3.4, the job 38 % slower, and "No
    straggler" said otherwise). Read over the whole run: a persistent
    slowdown leaves no contrast in time, only across nodes."""
    stats = {n: s for n, s in sync_wait_stats(con, "1", []).items() if n in node_ids}
    if len(stats) < 2 or run_ns <= 0:
        return None
    top = max(stats, key=lambda n: (stats[n].median_ms, -n))
    others = [s.median_ms for n, s in stats.items() if n != top]
    med = median(others)
    spread = 1.4826 * median([abs(v - med) for v in others])
    # the GPU signal's score (evidence.node_signals), over the whole run
    score = (stats[top].median_ms - med) / max(spread, wait_floor(top, stats))
    s = stats[top]
    extra_ms = max(0.0, s.total_ms - s.count * med)
    if score < min_score or extra_ms * 1e6 < min_cost_share * run_ns:
        return None
    runq = runq_ms_per_s(con, windows)
    busy = signal_score(top, [n for n in stats if n != top], runq, RUNQ_FLOOR,
                        relative=RUNQ_RELATIVE) >= WEAK_SCORE
    rates = launch_rates(con)
    peer_rates = [r for n, r in rates.items() if n != top and n in stats]
    peers = sorted(n for n in stats if n != top)
    if len(peers) > FREE_PEERS:
        peers = [peers[i * len(peers) // FREE_PEERS] for i in range(FREE_PEERS)]
    own_all, own_free = cpu_free_waits(con, top, s.pid)
    peer_waits = [cpu_free_waits(con, n, stats[n].pid) for n in peers]
    peers_all = median([w for w, _ in peer_waits])
    peers_free = median([f for _, f in peer_waits])
    wait_ratio = own_all / peers_all if peers_all > 0 else 1.0
    free_ratio = own_free / peers_free if peers_free > 0 else 1.0
    # (not where the other nodes' waits were mostly their threads' run-queue delay: the
    # ratio of what is left then measures that delay's noise)
    share = (round((free_ratio - 1.0) / (wait_ratio - 1.0), 3)
             if wait_ratio > 1.0 and peers_free >= FREE_LEFT * peers_all else None)
    return GpuSuspect(top, s.pid, round(s.median_ms, 3), round(med, 3), s.count,
                      median([w.count for n, w in stats.items() if n != top]),
                      round(extra_ms / 1e3, 3), round(score, 2),
                      round(rates[top], 1) if top in rates else None,
                      round(median(peer_rates), 1) if peer_rates else None,
                      round(own_free, 3), round(peers_free, 3), round(wait_ratio, 3),
                      round(free_ratio, 3), share, round(runq.get(top, 0.0), 1),
                      round(median([runq.get(n, 0.0) for n in stats if n != top]), 1), busy)


def cpu_free_waits(con, node_id: int, pid: int) -> tuple[float, float]:
    """The median of a process's waits for its own GPU work (ms, all of them), and the
    median of the same waits each with the waiting thread's own run-queue delay inside
    it taken out (its runq_delay spans in sched_events, clipped to the wait). A wait
    returns once the GPU is done and the waiting thread gets a CPU (it polls, or the
    driver's interrupt wakes it): what is left is the wait for the GPU. Other threads'
    delay is left in: theirs cannot hold the return (a review: a thread of every
    process busy 70 % of the time, on every node, took whole waits out of every node's
    and a GPU four times slower read as a CPU). Spans under the capture's threshold
    (1 ms) are counted, not placed in time, and stay in; without a sched source nothing
    is taken out."""
    if table_exists(con, "sync_waits"):
        # the waiting thread from the wait's row (sync_waits keeps its id)
        waits = con.execute("SELECT w.timestamp_ns, w.duration_ns, c.tid FROM sync_waits w "
                            "JOIN cuda_events c ON c.id = w.cuda_id "
                            "WHERE w.node_id = ? AND w.pid = ?", (node_id, pid)).fetchall()
    else:
        waits = con.execute(
            "SELECT timestamp_ns, duration_ns, tid FROM cuda_events WHERE node_id = ? AND "
            "pid = ? AND duration_ns IS NOT NULL AND api IN ("
            + ", ".join(f"'{a}'" for a in SYNC_WAIT_APIS) + ")", (node_id, pid)).fetchall()
    if not waits:
        return 0.0, 0.0
    whole = median([d / 1e6 for _, d, _ in waits])
    # each thread's run-queue spans in time order, merged where they touch
    spans: dict[int, tuple[list[int], list[int]]] = {}
    for tid, t, d in con.execute("SELECT tid, timestamp_ns, duration_ns FROM sched_events "
                                 "WHERE node_id = ? AND pid = ? AND kind = 'runq_delay' "
                                 "ORDER BY tid, timestamp_ns", (node_id, pid)):
        starts, ends = spans.setdefault(tid, ([], []))
        if ends and t <= ends[-1]:
            ends[-1] = max(ends[-1], t + d)
        else:
            starts.append(t)
            ends.append(t + d)
    if not spans:
        return whole, whole
    free = []
    for t, d, tid in waits:
        end, taken = t + d, 0
        starts, ends = spans.get(tid, ((), ()))
        i = bisect_right(ends, t)          # the first span ending after the wait starts
        while i < len(starts) and starts[i] < end:
            taken += min(ends[i], end) - max(starts[i], t)
            i += 1
        free.append((d - taken) / 1e6)
    return whole, median(free)


def launch_rates(con) -> dict[int, float]:
    """Kernel launches per second per node, over the intervals the capture counted them
    (event_stats; an interval not counted at all, observed_ns 0, says nothing)."""
    names = ", ".join(f"'{a}'" for a in LAUNCH_APIS)
    out: dict[int, list[float]] = {}
    for nid, count, ns in con.execute(
            "SELECT node_id, SUM(c), SUM(o) FROM (SELECT node_id, SUM(count) c, "
            "MAX(COALESCE(observed_ns, interval_end_ns - interval_start_ns)) o "
            f"FROM event_stats WHERE source = 'cuda' AND name IN ({names}) "
            "GROUP BY node_id, interval_start_ns, interval_end_ns) WHERE o > 0 "
            "GROUP BY node_id"):
        if ns and count is not None:
            out[nid] = count / (ns / 1e9)
    return out


def gpu_unnamed_text(s: dict) -> str:
    """A node waiting far longer for its own GPU work than every other, under the bar
    that names a GPU or for want of a CPU (Analysis.gpu_unnamed), in a clause of "No
    straggler"'s list."""
    who = s["node"] + (f" (rank {s['rank']})" if s.get("rank") is not None else "")
    lead = (f"{who} waited for its own GPU work longer than every other node "
            f"({s['wait_ms']:,.2f} ms at the median against {s['others_ms']:,.2f} ms, "
            f"{s['extra_s']:,.2f} s more over the run)")
    both = ("if the job ran slower than it should, check both its GPU (nvidia-smi: "
            "clocks, throttle reasons) and what else runs on its CPUs (top, its cgroup's "
            "cpu.stat)")
    if s.get("reading") == "cpu":
        return (f"{lead}, but its threads were waiting for a CPU: with the waiting "
                "thread's run-queue delay inside the waits taken out, they took "
                f"{s['free_ms']:,.2f} ms against {s['others_free_ms']:,.2f} ms at the "
                f"median ({s['free_ratio']:.1f} times the others', against "
                f"{s['wait_ratio']:.1f} times with it), so it is not named as a slower "
                "GPU; a CPU shared with other work shows so: if the job ran slower than it "
                "should, check what else runs on its CPUs (top, its cgroup's cpu.stat)")
    if s.get("reading") == "unsure" and s.get("cpu_busy"):
        inside = ("" if s.get("gpu_share") is None else
                  f", though not for long inside these waits ({s['free_ms']:,.2f} ms "
                  f"against {s['others_free_ms']:,.2f} ms without that delay)")
        return (f"{lead}, but its traced threads waited for a CPU far more than the other "
                f"nodes' over the run ({s['runq_ms_per_s']:,.0f} ms per s against a median "
                f"of {s['others_runq_ms_per_s']:,.0f} ms){inside}: a slower GPU cannot be "
                f"told from a CPU shared with other work, so it is not named; {both}")
    if s.get("reading") == "unsure":
        return (f"{lead}, but the other nodes' waits were mostly their waiting threads' "
                f"run-queue delay too ({s['others_free_ms']:,.2f} ms at the median "
                f"without it, against {s['others_ms']:,.2f} ms): how much of its excess "
                f"is its GPU's cannot be told, so it is not named; {both}")
    # rounded down: a score of 2.96 is not "3.0, under the 3"
    score = math.floor(s["score"] * 10) / 10
    return (f"{who} waited for its own GPU work longer than every other node "
            f"({s['wait_ms']:,.2f} ms at the median against {s['others_ms']:,.2f} ms, "
            f"{s['extra_s']:,.2f} s more over the run), but its score, {score:.1f}, is "
            f"under the {WEAK_SCORE:g} at which the GPU rule names a node, so it is not "
            "named: a GPU slower than its peers' shows so, and so do ranks whose threads "
            "wait for a CPU after each wait; if the job ran slower than it should, check "
            "its GPU (nvidia-smi: clocks, throttle reasons) and what else runs on its "
            "CPUs")
