"""The timing model: node clocks, one rank's step timeline, and the fleet-wide schedule.

All times here are *true* time as float ns relative to the job launch ``T0`` (true UTC);
a node turns them into its own CLOCK_MONOTONIC and CLOCK_REALTIME with ``NodeClock``.
Relative floats keep ns precision (an absolute UTC ns count does not fit a double).

Coupling between ranks goes only through collective completion (docs/simulator.md):

    C(comm, seq) = max(max over ranks of entry time, C of the previous op on the stream)
                   + transfer(bytes, nranks) (+ jitter, + network fault)

and a rank leaves a blocking synchronization at max(sync start, C of the last collective
it enqueued) + wake-up latency. ``compute_schedule`` walks all ranks step by step and
keeps only the completions (a few floats per step), so memory does not grow with the
fleet; each node's worker replays its own ranks' ``RankTimeline`` with the same seeds
and the same completions, producing bit-identical timings.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from .config import FleetConfig

MS = 1_000_000.0
US = 1_000.0
S = 1_000_000_000.0

#: 2025-06-02T08:00:00Z, the base of the simulated job start (plus a seeded offset).
EPOCH_BASE_NS = 1_748_851_200_000_000_000

# Step phases of one rank (nominal true durations).
FWD_HOST_NS = 14 * MS        # host launches the forward kernels
FWD_GPU_NS = 42 * MS         # GPU forward time (the host waits for it in a sync)
BWD_NS = 86 * MS             # backward; gradient buckets become ready along it
OPT_NS = 11 * MS             # optimizer step (host launch of fused kernels)
OPT_GPU_NS = 4 * MS          # GPU time of the optimizer kernels
OPT_TAIL_NS = 300 * US       # GPU time of the last optimizer kernels after their launch
STEP_GAP_NS = 70 * US        # python between steps
#: DDP gradient buckets: bytes (bf16 grads, 1 MiB first bucket as DDP does) and the
#: fraction of the backward pass at which each becomes ready.
BUCKET_BYTES = (1 << 20, 25 << 20, 25 << 20, 25 << 20, 20_656_128)
BUCKET_READY = (0.05, 0.31, 0.56, 0.80, 0.985)
N_BUCKETS = len(BUCKET_BYTES)
#: kernels launched per step in each phase (cudaLaunchKernel aggregates)
LAUNCHES = (940, 1620, 180)


def subseed(seed: int, *parts) -> int:
    """A 64-bit seed derived from the run seed and labels (stable across processes)."""
    h = hashlib.sha256(repr((seed,) + parts).encode()).digest()
    return int.from_bytes(h[:8], "little")


def rng_for(seed: int, *parts) -> random.Random:
    return random.Random(subseed(seed, *parts))


def tri(r: random.Random, lo: float, mode: float, hi: float) -> float:
    """Triangular draw (inverse CDF; cheaper than random.triangular)."""
    u = r.random()
    span = hi - lo
    if u * span < mode - lo:
        return lo + math.sqrt(u * span * (mode - lo))
    return hi - math.sqrt((1.0 - u) * span * (hi - mode))


def jit(r: random.Random, sigma: float) -> float:
    """1 + noise with standard deviation sigma (sum of three uniforms: cheap, bounded)."""
    return 1.0 + sigma * 2.0 * (r.random() + r.random() + r.random() - 1.5)


def poisson(r: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    limit, k, p = math.exp(-mean), 0, r.random()
    while p > limit:
        k += 1
        p *= r.random()
    return k


# ---------------------------------------------------------------------------- clocks

@dataclass(frozen=True)
class NodeClock:
    """Clock truth of one node (see docs/simulator.md, "Clocks").

    mono(T)     = (T - boot_utc_ns) * (1 + drift)
    realtime(T) = T + e(T), e(T) = offset + drift*(T - T0) before the NTP step at
                  step_rel (true, relative to T0), residual + drift*(T - step) after.
    """
    t0_utc_ns: int
    boot_utc_ns: int
    drift: float              # d, dimensionless (ppm * 1e-6)
    offset_ns: int            # o
    step_rel_ns: float | None  # S - T0, or None
    residual_ns: int           # r (0 when no step)
    honest: bool
    chrony_reference_error_ns: int | None  # None: node runs no chrony
    freq_ppb: float            # what adjtimex reports as frequency correction

    @property
    def rate(self) -> float:
        return 1.0 + self.drift

    @property
    def mono_at_t0(self) -> float:
        return (self.t0_utc_ns - self.boot_utc_ns) * (1.0 + self.drift)

    def mono(self, t: float) -> int:
        return int(self.mono_at_t0 + t * (1.0 + self.drift))

    def error_ns(self, t: float) -> float:
        if self.step_rel_ns is not None and t >= self.step_rel_ns:
            return self.residual_ns + self.drift * (t - self.step_rel_ns)
        return self.offset_ns + self.drift * t

    def realtime(self, t: float) -> int:
        return self.t0_utc_ns + int(round(t + self.error_ns(t)))

    def truth(self) -> dict:
        step = None
        if self.step_rel_ns is not None:
            step = {"true_utc_ns": self.t0_utc_ns + int(round(self.step_rel_ns)),
                    "mono_ns": self.mono(self.step_rel_ns),
                    "residual_ns": self.residual_ns}
        return {
            "boot_utc_ns": self.boot_utc_ns,
            "drift_ppm": self.drift * 1e6,
            "offset_ns": self.offset_ns,
            "step": step,
            "claims_honest": self.honest,
            "chrony_reference_error_ns": self.chrony_reference_error_ns,
            "true_utc_of_mono": {"boot_utc_ns": self.boot_utc_ns,
                                 "rate": 1.0 / (1.0 + self.drift)},
        }


def job_start_ns(seed: int) -> int:
    r = rng_for(seed, "job")
    return EPOCH_BASE_NS + r.randrange(0, 86_400) * 1_000_000_000 + r.randrange(1_000_000_000)


def nominal_step_ns() -> float:
    return FWD_GPU_NS + BWD_NS + OPT_NS + 6 * MS


def make_clocks(cfg: FleetConfig) -> list[NodeClock]:
    t0 = job_start_ns(cfg.seed)
    est_job = 5 * S + cfg.steps * nominal_step_ns()
    clocks = []
    for k in range(cfg.nodes):
        r = rng_for(cfg.seed, "clock", k)
        boot = t0 - int(r.uniform(3 * 3600, 40 * 24 * 3600) * S)
        drift = r.uniform(-1.0, 1.0) * cfg.max_drift_ppm * 1e-6
        offset = int(r.uniform(-1.0, 1.0) * cfg.max_offset_ms * MS)
        step_rel, residual = None, 0
        if cfg.ntp_step:
            step_rel = est_job * r.uniform(0.25, 0.75)
            residual = int(r.uniform(-1.0, 1.0) * 0.8 * MS)
        liar = cfg.lying_clock == k
        if liar and abs(offset) < 0.5 * cfg.max_offset_ms * MS:
            # a dishonest claim only matters when the true error is large
            offset = int(math.copysign(r.uniform(0.6, 1.0) * cfg.max_offset_ms * MS,
                                       offset or 1))
        chrony = int(r.uniform(-2.0, 2.0) * MS) if k % 3 == 1 else None
        freq = round(r.uniform(-40_000, 40_000) * 65.536) / 65.536  # adjtimex quantum
        clocks.append(NodeClock(t0, boot, drift, offset, step_rel, residual, not liar,
                                chrony, freq))
    return clocks


# ----------------------------------------------------------------------- fault plan

@dataclass(frozen=True)
class FaultPlan:
    kind: str                       # none, cpu, io, network, gpu, memory, slowlink
    node: int | None                # straggler node index
    windows: tuple[tuple[int, int], ...]
    gpu_local_rank: int | None      # gpu fault: the slow GPU on the straggler
    gpu_slowdown: float             # gpu fault: kernel time factor while throttled
    competitor: tuple[str, int] | None  # cpu fault: (comm, pid) of the competing task

    def active(self, step: int) -> bool:
        for a, b in self.windows:
            if a <= step < b:
                return True
        return False


COMPETITORS = ("rsync", "clamscan", "ffmpeg", "7z", "updatedb.plocate", "java")


def make_fault_plan(cfg: FleetConfig) -> FaultPlan:
    r = rng_for(cfg.seed, "fault")
    if cfg.fault == "none":
        return FaultPlan("none", None, (), None, 1.0, None)
    node = cfg.straggler if cfg.straggler is not None else r.randrange(cfg.nodes)
    gpu_lr = r.randrange(cfg.ranks_per_node)
    slow = r.uniform(1.35, 1.6)
    comp = (r.choice(COMPETITORS), r.randrange(20_000, 59_000))  # below the rank pids
    return FaultPlan(cfg.fault, node, cfg.windows,
                     gpu_lr if cfg.fault == "gpu" else None,
                     slow if cfg.fault == "gpu" else 1.0,
                     comp if cfg.fault == "cpu" else None)


def rank_fault(plan: FaultPlan, node: int, local_rank: int) -> str:
    """The fault this rank suffers when a window is active ('' = none)."""
    if plan.node != node or plan.kind in ("none", "network", "slowlink"):
        return ""
    if plan.kind == "gpu" and local_rank != plan.gpu_local_rank:
        return ""
    return plan.kind


# -------------------------------------------------------------------- rank timeline

class RankStep:
    """True times of one rank in one step (float ns relative to T0)."""
    __slots__ = ("step", "start", "data_wait", "h2d", "h2d_dur", "fwd", "fsync",
                 "fsync_end", "bwd", "bwd_end", "entries", "device", "nccl_durs", "bsync",
                 "bsync_end",
                 "opt", "opt_end",
                 "loss_entry", "loss_dur", "d2h", "d2h_dur", "lsync", "lsync_end",
                 "stalls", "faulty")


class RankInit:
    __slots__ = ("proc_start", "init_call", "init_end", "split_call", "split_end",
                 "first_step")


# stall kinds: visible ones leave sched_events rows
RUNQ_COMPETITOR, RUNQ_BENIGN, DSTATE, RECLAIM, GC, DATA_WAIT = range(6)


class RankTimeline:
    """Replayable timeline of one global rank (deterministic given seed and rank)."""

    def __init__(self, cfg: FleetConfig, plan: FaultPlan, global_rank: int):
        self.rank = global_rank
        self.node = global_rank // cfg.ranks_per_node
        self.local_rank = global_rank % cfg.ranks_per_node
        self.r = rng_for(cfg.seed, "rank", global_rank)
        self.fault = rank_fault(plan, self.node, self.local_rank)
        self.plan = plan
        self.intensity = self.r.uniform(0.7, 1.3)  # how hard the fault hits this rank
        self.next_start = 0.0
        self._cur: RankStep | None = None

    # -- init: process start, communicator init (world, then a split) ---------------
    def init_calls(self) -> RankInit:
        r = self.r
        ri = RankInit()
        ri.proc_start = r.uniform(0.05, 0.6) * S
        ri.init_call = ri.proc_start + r.uniform(2.2, 3.4) * S
        return ri

    def init_finish(self, ri: RankInit, world_done: float, split_done: float | None = None):
        r = self.r
        if split_done is None:
            ri.init_end = world_done + r.uniform(20, 400) * US
            ri.split_call = ri.init_end + r.uniform(4, 25) * MS
            return ri
        ri.split_end = split_done + r.uniform(20, 300) * US
        # DDP's constructor broadcasts the model from rank 0 (not traced as a step
        # collective here): every rank leaves it together and starts step 0
        ri.first_step = split_done + 310 * MS + r.uniform(0.1, 1.5) * MS
        self.next_start = ri.first_step
        return ri

    # -- one step, in three phases around the two completions -----------------------
    # Hot path (runs for every rank in the parent and again in the node's worker):
    # cheap skewed draws lo + span*u1*u2 instead of random.triangular.
    def phase_backward(self, step: int) -> RankStep:
        """Up to the gradient bucket enqueues; returns the step record."""
        rnd = self.r.random
        st = RankStep()
        st.step = step
        faulty = self.fault if (self.fault and self.plan.active(step)) else ""
        st.faulty = faulty
        stalls = []
        t = self.next_start
        st.start = t
        wait = 40 * US + 360 * US * rnd() * rnd()  # dequeue the prefetched batch
        if faulty == "io" and rnd() < 0.65:
            wait += tri(self.r, 12, 45, 380) * MS * self.intensity
        if wait > 1 * MS:
            stalls.append((DATA_WAIT, t + 30 * US, wait - 30 * US))
        st.data_wait = wait
        st.h2d = t + wait
        st.h2d_dur = 7 * US + 23 * US * rnd() * rnd()
        st.fwd = fwd = st.h2d + st.h2d_dur + 20 * US + 60 * US * rnd() * rnd()
        slow = 1.0
        if faulty == "gpu":
            slow = self.plan.gpu_slowdown * (1.0 + 0.08 * (rnd() + rnd() - 1.0))
        # forward: host launch (stalls delay it), GPU runs behind, a sync waits for it
        work = FWD_HOST_NS * (1.0 + 0.06 * (rnd() + rnd() + rnd() - 1.5))
        extra = self._stalls(faulty, 0, fwd, work, stalls, None) \
            if (faulty or rnd() < 0.015) else 0.0
        st.fsync = fwd + work + extra
        gpu_done = fwd + FWD_GPU_NS * (1.0 + 0.03 * (rnd() + rnd() + rnd() - 1.5)) * slow
        st.fsync_end = max(st.fsync, gpu_done) + self._wake(rnd)
        # backward: buckets become ready along it; stalls push later buckets out. The
        # host's autograd pass launches the kernels and enqueues each bucket's
        # all-reduce without waiting for the GPU (as PyTorch's DDP does), so a slow GPU
        # does not delay the entries: its all-reduces start late on the GPU (`device`),
        # where no capture sees them, and every rank's completion waits for that
        st.bwd = b0 = st.fsync_end + 25 * US + 95 * US * rnd() * rnd()
        work = BWD_NS * (1.0 + 0.03 * (rnd() + rnd() + rnd() - 1.5))
        if faulty or rnd() < 0.015:
            before = [0.0] * N_BUCKETS
            extra = self._stalls(faulty, 1, b0, work, stalls, before)
            st.entries = [b0 + work * f + before[j] for j, f in enumerate(BUCKET_READY)]
        else:
            extra = 0.0
            st.entries = [b0 + work * f for f in BUCKET_READY]
        st.device = [max(e, b0 + work * slow * f) for e, f in zip(st.entries, BUCKET_READY)]
        st.nccl_durs = [9 * US + 36 * US * rnd() * rnd() for _ in BUCKET_READY]
        st.bwd_end = b0 + work + extra
        st.stalls = stalls
        self._cur = st
        return st

    def phase_optimizer(self, buckets_done: float) -> float:
        """The optimizer's kernels are launched right after the last gradient bucket is
        enqueued, then the gradient sync waits for them (PyTorch: the sync is
        ``loss.item()`` or the next step's first host read): on the GPU they run once
        the buckets are reduced, so the sync ends when the later of the two is done,
        late on a rank whose host launched them late. Returns the loss all-reduce entry
        time."""
        rnd, st = self.r.random, self._cur
        st.opt = o0 = st.bwd_end + 20 * US + 70 * US * rnd() * rnd()
        slow = self.plan.gpu_slowdown if st.faulty == "gpu" else 1.0
        work = OPT_NS * (1.0 + 0.06 * (rnd() + rnd() + rnd() - 1.5)) * slow
        extra = self._stalls(st.faulty, 2, o0, work, st.stalls, None) \
            if (st.faulty or rnd() < 0.015) else 0.0
        st.opt_end = o0 + work + extra
        st.bsync = st.opt_end + 20 * US + 80 * US * rnd() * rnd()
        gpu_done = max(buckets_done + OPT_GPU_NS * slow * (1.0 + 0.04 * (rnd() - 0.5)),
                       st.opt_end + OPT_TAIL_NS * slow)
        st.bsync_end = max(st.bsync, gpu_done) + self._wake(rnd)
        st.loss_entry = st.bsync_end + 25 * US + 95 * US * rnd() * rnd()
        st.loss_dur = 9 * US + 31 * US * rnd() * rnd()
        return st.loss_entry

    def phase_end(self, loss_done: float) -> RankStep:
        rnd, st = self.r.random, self._cur
        st.d2h = st.loss_entry + st.loss_dur + 6 * US + 24 * US * rnd() * rnd()
        st.d2h_dur = 5 * US + 15 * US * rnd() * rnd()
        st.lsync = st.d2h + st.d2h_dur + 2 * US + 10 * US * rnd() * rnd()
        st.lsync_end = max(st.lsync, loss_done) + self._wake(rnd)
        self.next_start = st.lsync_end + STEP_GAP_NS * (0.6 + 0.8 * rnd())
        if rnd() < 0.003:  # python GC between steps: benign, random rank
            gc = tri(self.r, 4, 9, 30) * MS
            st.stalls.append((GC, self.next_start, gc))
            self.next_start += gc
        self._cur = None
        return st

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _wake(rnd) -> float:
        """Wake-up latency of a blocking sync after the GPU work it waits for is done."""
        u = rnd()
        w = 2 * US + 7 * US * u * rnd()
        if u > 0.99:
            w += 15 * US + 45 * US * rnd()
        return w

    # mean stall counts per phase (fwd, bwd, opt) and duration (ms: lo, mode, hi)
    _FAULT_STALLS = {
        "cpu": ((2.5, 4.0, 1.5), (0.8, 3.0, 10.0)),
        "memory": ((1.2, 1.8, 0.8), (2.0, 7.0, 40.0)),
    }

    def _stalls(self, faulty, phase, t0, work, out, before) -> float:
        """Add stalls for one phase to ``out``; return their total duration.

        ``before[j]`` (backward) gets the stall time preceding bucket j's readiness.
        """
        r = self.r
        picks = []
        # A kworker or ksoftirqd takes the CPU briefly: benign. A healthy phase gets here
        # in 1.5 % of cases (the caller's draw), and then it is such a hiccup.
        if not faulty or r.random() < 0.015:
            picks.append((r.random(), RUNQ_BENIGN, tri(r, 1.0, 1.3, 2.6) * MS))
        spec = self._FAULT_STALLS.get(faulty)
        if spec:
            means, (lo, mode, hi) = spec
            for _ in range(poisson(r, means[phase] * self.intensity)):
                if faulty == "cpu":
                    kind = RUNQ_COMPETITOR
                else:
                    kind = DSTATE if r.random() < 0.6 else RECLAIM
                picks.append((r.random(), kind, tri(r, lo, mode, hi) * MS))
        if not picks:
            return 0.0
        picks.sort()
        total = 0.0
        for u, kind, dur in picks:
            out.append((kind, t0 + work * u + total, dur))
            if before is not None:
                for j, f in enumerate(BUCKET_READY):
                    if u < f:
                        before[j] += dur
            total += dur
        return total


# --------------------------------------------------------------------- fleet schedule

def transfer_ns(nbytes: int, nranks: int, nodes: int) -> float:
    """Ring all-reduce time: bandwidth term plus a log-depth latency term."""
    bw = 42.0 if nodes > 1 else 160.0  # bytes/ns: 400G NIC busbw vs NVLink
    lat = (2 * math.ceil(math.log2(max(nranks, 2))) * 7.0 + 15.0) * US
    return 2.0 * (nranks - 1) / max(nranks, 1) * nbytes / bw + lat


@dataclass
class Schedule:
    """Fleet-wide facts every node needs, in true ns relative to T0."""
    world_init_done: float
    split_done: float
    #: per step: N_BUCKETS gradient all-reduce completions, then the loss all-reduce
    completions: list[list[float]]
    step_start: list[float]    # earliest rank's step start
    step_end: list[float]      # latest rank's loss-sync end
    #: per step: factor the network fault applied to transfers (1.0 = none)
    net_factor: list[float]
    #: per step, per gradient bucket: (start, flow_ns, rto_ns, stall_at, queue_ns): the
    #: ring's bytes move from ``start`` for ``flow_ns``, a retransmission timeout of
    #: ``rto_ns`` (0: none) stalling them at fraction ``stall_at`` of the bytes; the
    #: slowlink fault's hop queues its last byte ``queue_ns`` (simulate/progress.py)
    transfers: list[list[tuple[float, float, float, float, float]]]

    @property
    def job_end(self) -> float:
        return self.step_end[-1]


def compute_schedule(cfg: FleetConfig, plan: FaultPlan) -> Schedule:
    """Walk every rank through every step, keeping only the completions."""
    nranks = cfg.nodes * cfg.ranks_per_node
    ranks = [RankTimeline(cfg, plan, g) for g in range(nranks)]
    fr = rng_for(cfg.seed, "fleet")
    inits = [tl.init_calls() for tl in ranks]
    world_done = max(i.init_call for i in inits) + fr.uniform(0.6, 1.4) * S
    for tl, ri in zip(ranks, inits):
        tl.init_finish(ri, world_done)
    split_done = max(i.split_call for i in inits) + fr.uniform(30, 90) * MS
    for tl, ri in zip(ranks, inits):
        tl.init_finish(ri, world_done, split_done)
    xfer = [transfer_ns(b, nranks, cfg.nodes) for b in BUCKET_BYTES]
    loss_xfer = transfer_ns(4, nranks, cfg.nodes)
    net_node = plan.node if plan.kind == "network" else None
    # a link that queues (a shaper, a NIC at a lower speed): the ring moves at its rate,
    # and its queue holds each transfer's bytes longer, the last ones longest; nothing
    # is lost, nobody is late
    slow_node = plan.node if plan.kind == "slowlink" else None
    stalls = rng_for(cfg.seed, "stall")    # its own draws: the fleet's stay as they were
    completions, starts, ends, factors, transfers = [], [], [], [], []
    for step in range(cfg.steps):
        recs = [tl.phase_backward(step) for tl in ranks]
        factor, queue = 1.0, 0.0
        if net_node is not None and plan.active(step):
            factor = fr.uniform(3.0, 6.5)
        slow = slow_node is not None and plan.active(step)
        if slow:
            factor, queue = fr.uniform(2.0, 4.0), fr.uniform(4.0, 12.0) * MS
        done, prev, moves = [], 0.0, []
        for j in range(N_BUCKETS):
            arrive = max(rec.device[j] for rec in recs)
            x = xfer[j] * jit(fr, 0.04) * factor
            rto = 0.0
            if factor > 1.0 and not slow and fr.random() < 0.12:
                rto = fr.uniform(200, 230) * MS  # a TCP retransmission timeout
            start = max(arrive, prev)
            moves.append((start, x, rto, stalls.random() if rto else 0.0, queue))
            prev = start + (x + rto) + queue
            done.append(prev)
        loss_arrive = max(tl.phase_optimizer(prev) for tl in ranks)
        loss_done = loss_arrive + loss_xfer * jit(fr, 0.05) * (factor if factor > 1 else 1.0) \
            + (fr.uniform(0.3, 1.0) * queue if slow else 0.0)
        done.append(loss_done)
        ends.append(max(tl.phase_end(loss_done).lsync_end for tl in ranks))
        starts.append(min(rec.start for rec in recs))
        completions.append(done)
        factors.append(factor)
        transfers.append(moves)
    return Schedule(world_done, split_done, completions, starts, ends, factors, transfers)
