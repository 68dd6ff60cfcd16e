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
from dataclasses import dataclass

from .evidence import (CLEAR_SCORE, RUNQ_FLOOR, RUNQ_RELATIVE, WEAK_SCORE, median,
                       runq_ms_per_s, signal_score, sync_wait_stats, wait_floor)

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

    @property
    def clear(self) -> bool:
        return self.score >= CLEAR_SCORE

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


def gpu_suspect(con, node_ids, run_ns: int, min_cost_share: float,
                windows, min_score: float = WEAK_SCORE) -> GpuSuspect | None:
    """The node whose ranks wait for their own GPU work longer than every other
    node's (rule 5's GPU-wait score >= WEAK_SCORE; at CLEAR_SCORE a median wait beyond
    nine in ten of their waits, and 1.25 ms and 1.25 times their median above it at
    least) and long enough to matter (its extra wait at least ``min_cost_share`` of the
    run), or None; none where its run-queue delay is itself a signal over ``windows``
    (the run), as a woken thread that waits for a CPU returns late from every wait (rule
    5 leaves such waits unscored). ``min_score``: below WEAK_SCORE, for what is said
    but not named (SMALL_GPU_SCORE). Weak evidence names it too: on a busy host a slower GPU blurs into
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
    if signal_score(top, [n for n in stats if n != top], runq_ms_per_s(con, windows),
                    RUNQ_FLOOR, relative=RUNQ_RELATIVE) >= WEAK_SCORE:
        return None
    rates = launch_rates(con)
    peer_rates = [r for n, r in rates.items() if n != top and n in stats]
    return GpuSuspect(top, s.pid, round(s.median_ms, 3), round(med, 3), s.count,
                      median([w.count for n, w in stats.items() if n != top]),
                      round(extra_ms / 1e3, 3), round(score, 2),
                      round(rates[top], 1) if top in rates else None,
                      round(median(peer_rates), 1) if peer_rates else None)


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
    that names a GPU (Analysis.gpu_unnamed), in a clause of "No straggler"'s list."""
    who = s["node"] + (f" (rank {s['rank']})" if s.get("rank") is not None else "")
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
