"""Generate one node's bundle: replay its ranks' timelines and write every table.

Runs in a worker process. Steps are processed in chunks; each chunk's rows are sorted
by time and handed to the BundleWriter with ``add_many``, so memory stays bounded by
the chunk, not the run. Everything random comes from RNGs seeded by (seed, node, ...),
never from the global ``random`` state or the clock, so output is reproducible.
"""

from __future__ import annotations

import json
import uuid
from operator import itemgetter
from pathlib import Path

from ..bundle.writer import BundleWriter
from . import catalog
from .config import FleetConfig, node_name
from .model import (BUCKET_BYTES, DATA_WAIT, DSTATE, LAUNCHES, MS, N_BUCKETS, RUNQ_BENIGN,
                    RUNQ_COMPETITOR, S, US, FaultPlan, NodeClock, RankTimeline, Schedule,
                    rng_for, subseed, tri)
from .progress import NCCL_PORT_BASE, hop_ends, hop_ports

CHUNK_STEPS = 48
HOST_TICK_NS = 100 * MS        # host_samples at 10 Hz
CLOCK_TICK_NS = 1 * S          # clock_samples (system) at 1 Hz
CHRONY_TICK_NS = 8 * S
STATS_NS = 1 * S               # event_stats interval (mono)
DISK = "nvme0n1"
DATA_NIC = "ens108np0"
MGMT_NIC = "eno1"
NCPUS = 192
INIT_NETNS = 4026531840        # inode of the initial network namespace
STA_PLL, STA_NANO = 0x0001, 0x2000
GIB = 1 << 30


def node_addresses(seed: int, nodes: int) -> list[dict]:
    r = rng_for(seed, "addresses")
    net = r.randrange(16, 200)
    return [{"data": f"10.{net}.{k // 200}.{k % 200 + 11}",
             "mgmt": f"172.20.{k // 200}.{k % 200 + 11}",
             "data_nic": DATA_NIC, "mgmt_nic": MGMT_NIC} for k in range(nodes)]


def comm_hashes(seed: int) -> tuple[str, str]:
    """(world, split child) comm_id_hash: splitmix64 folds as the capture computes them."""
    r = rng_for(seed, "ncclUniqueId")
    unique_id = r.randbytes(128)
    h = 0
    for i in range(0, 128, 8):
        h = _splitmix64(h ^ int.from_bytes(unique_id[i:i + 8], "little"))
    child = _splitmix64(h ^ _splitmix64(0x5EED0000 + 0))  # color 0
    return f"{h:016x}", f"{child:016x}"


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def rank_pids(seed: int, node: int, ranks_per_node: int) -> list[int]:
    r = rng_for(seed, "pids", node)
    base = r.randrange(60_000, 3_000_000)
    pids, p = [], base
    for _ in range(ranks_per_node):
        pids.append(p)
        p += r.randrange(60, 140)  # above the rank's thread ids (pid + 38 ..)
    return pids


def window_times(plan: FaultPlan, sched: Schedule) -> list[tuple[float, float]]:
    """Fault windows in true time (relative to T0): [start of first step, end of last)."""
    out = []
    for a, b in plan.windows:
        end = sched.step_start[b] if b < len(sched.step_start) else sched.job_end
        out.append((sched.step_start[a], end))
    return out


class NodeGenerator:
    def __init__(self, cfg: FleetConfig, plan: FaultPlan, clocks: list[NodeClock],
                 sched: Schedule, node: int):
        self.cfg, self.plan, self.sched, self.node = cfg, plan, sched, node
        self.clock = clock = clocks[node]
        self.m0, self.k = clock.mono_at_t0, clock.rate
        self.name = node_name(node)
        self.r = rng_for(cfg.seed, "node", node)
        self.progress_rng = rng_for(cfg.seed, "progress", node)
        R = cfg.ranks_per_node
        self.R = R
        self.world = cfg.nodes * R
        self.pids = rank_pids(cfg.seed, node, R)
        self.addrs = node_addresses(cfg.seed, cfg.nodes)
        self.world_hash, self.split_hash = comm_hashes(cfg.seed)
        self.windows = window_times(plan, sched)
        self.straggler = plan.node == node
        self.neighbours = sorted({(node - 1) % cfg.nodes, (node + 1) % cfg.nodes} - {node})
        self.net_neighbour = (plan.kind == "network" and plan.node in self.neighbours)
        r = self.r
        # capture runs from before the job launch until after the processes exit
        self.cap_start = -r.uniform(8, 25) * S
        self.cap_end = sched.job_end + r.uniform(3.5, 8) * S
        self.threads = []  # (pid, tid, comm) per rank: main, pin, worker0, worker1, ...
        for pid in self.pids:
            tids = [pid] + [pid + 38 + i for i in range(len(catalog.RANK_THREADS) - 1)]
            self.threads.append(list(zip([pid] * len(tids), tids, catalog.RANK_THREADS)))
        self.streams = [0x7F00_0000_0000 + r.randrange(1 << 28) * 16 for _ in range(R)]
        self.nccl_streams = [s + 0x1A0 for s in self.streams]
        self.comm_handles = [0x5600_0000_0000 + r.randrange(1 << 28) * 16 for _ in range(R)]

    # -- clock helpers -------------------------------------------------------------------
    def mono(self, t: float) -> int:
        return int(self.m0 + t * self.k)

    def fault_at(self, t: float) -> bool:
        for a, b in self.windows:
            if a <= t < b:
                return True
        return False

    # -- driver -------------------------------------------------------------------------
    def run(self, spool_dir: Path, out_dir: Path) -> tuple[Path, dict]:
        cfg, clock = self.cfg, self.clock
        host = {"hostname": self.name,
                "boot_id": str(uuid.UUID(int=subseed(cfg.seed, "boot", self.node) << 64
                                         | subseed(cfg.seed, "boot2", self.node), version=4)),
                "kernel_release": "5.15.0-119-generic", "machine": "x86_64"}
        spool = spool_dir / f"{self.name}.live.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{spool}{suffix}").unlink(missing_ok=True)
        start = (clock.realtime(self.cap_start), self.mono(self.cap_start))
        end = (clock.realtime(self.cap_end), self.mono(self.cap_end))
        w = BundleWriter(spool, node=self.name, host=host, capture_start=start,
                         batch_rows=100_000,
                         extra_meta={"job_ids": [self.job_id]})
        try:
            self._write(w)
            path = w.seal(out_dir, capture_end=end, level=cfg.zstd_level)
        except BaseException:
            try:
                w.abort()
            finally:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{spool}{suffix}").unlink(missing_ok=True)
            raise
        return path, dict(w.rows)

    @property
    def job_id(self) -> str:
        return f"pretrain-{subseed(self.cfg.seed, 'job_id') & 0xFFFFFF:06x}"

    def _write(self, w: BundleWriter) -> None:
        cfg, sched = self.cfg, self.sched
        self.stack = {k: w.add_stack(v) for k, v in catalog.STACKS.items()}
        tls = [RankTimeline(cfg, self.plan, self.node * self.R + lr) for lr in range(self.R)]
        inits = [tl.init_calls() for tl in tls]
        for tl, ri in zip(tls, inits):
            tl.init_finish(ri, sched.world_init_done)
        for tl, ri in zip(tls, inits):
            tl.init_finish(ri, sched.world_init_done, sched.split_done)
        self._static_rows(w, inits)
        self._host_next = self.cap_start + self.r.uniform(0, HOST_TICK_NS)
        self._clock_next = self.cap_start + self.r.uniform(0.05, 0.95) * S
        self._chrony_next = self.cap_start + self.r.uniform(0.5, 7.5) * S
        self._tcp_bg_next = self.cap_start + self.r.expovariate(1 / (25 * S))
        self._tcp_job_next = self.cap_start
        self._wb_next = self.cap_start + self.r.expovariate(3 / S)
        self._stats_k = 0
        self._launches: dict[int, list[int]] = {}
        self._host_state = None
        hops = hop_ends(self)
        t_lo = self.cap_start
        steps = cfg.steps
        for c0 in range(0, steps, CHUNK_STEPS):
            c1 = min(steps, c0 + CHUNK_STEPS)
            rows = {n: [] for n in ("nccl_events", "cuda_events", "sched_events",
                                    "block_events", "tcp_progress")}
            for step in range(c0, c1):
                done = sched.completions[step]
                for tl in tls:
                    tl.phase_backward(step)
                for tl in tls:
                    tl.phase_optimizer(done[N_BUCKETS - 1])
                for lr, tl in enumerate(tls):
                    self._rank_step_rows(lr, tl.phase_end(done[N_BUCKETS]), rows)
                for hop in hops:
                    hop.rows(step, rows["tcp_progress"])
            t_hi = sched.step_start[c1] if c1 < steps else self.cap_end
            if c1 >= steps:
                self._teardown_rows(tls, rows)
            self._time_rows(w, t_lo, t_hi, rows)
            for table, lst in rows.items():
                if lst:
                    lst.sort(key=itemgetter(0))
                    w.add_many(table, lst)
            t_lo = t_hi
        self._final_rows(w)

    # -- rows per rank step ---------------------------------------------------------------
    def _rank_step_rows(self, lr: int, st, rows: dict) -> None:
        m0, k = self.m0, self.k
        pid = self.pids[lr]
        threads = self.threads[lr]
        r = self.r
        stack = self.stack
        nccl = rows["nccl_events"]
        world, wh = self.world, self.world_hash
        grank = self.node * self.R + lr
        nstream = self.nccl_streams[lr]
        seq0 = st.step * N_BUCKETS
        for j in range(N_BUCKETS):
            t = st.entries[j]
            ts = int(m0 + t * k)
            nbytes = BUCKET_BYTES[j]
            nccl.append((ts, int(m0 + (t + st.nccl_durs[j]) * k) - ts, "ALL_REDUCE", grank,
                         world, wh, seq0 + j + 1, nbytes // 2, "bfloat16", "sum", None,
                         nstream, nbytes, 0, 0, pid, pid, stack["bucket_allreduce"]))
        t = st.loss_entry
        ts = int(m0 + t * k)
        nccl.append((ts, int(m0 + (t + st.loss_dur) * k) - ts, "ALL_REDUCE", grank, world,
                     self.split_hash, st.step + 1, 1, "float32", "avg", None,
                     self.nccl_streams[lr] + 0x40, 4, 0, 0, pid, pid,
                     stack["loss_allreduce"]))
        cuda = rows["cuda_events"]
        stream = self.streams[lr]

        def call(t0, t1, api, strm, nbytes, kind, kernel, sk, queued=None, last_queued=None):
            a = int(m0 + t0 * k)
            gap = None if not queued else a - int(m0 + last_queued * k)
            cuda.append((a, int(m0 + t1 * k) - a, api, "runtime", strm, nbytes, kind, kernel,
                         lr, 0, pid, pid, stack[sk], queued, gap))

        call(st.h2d, st.h2d + st.h2d_dur, "cudaMemcpyAsync", stream, 50_331_648, "HtoD",
             None, "h2d")
        # one sampled kernel launch per step (the capture samples 1 in ~2500 launches)
        sk = "launch_gemm" if st.step % 3 else "launch_attn"
        lt = st.fwd + r.random() * (st.fsync - st.fwd) * 0.8
        call(lt, lt + (2.5 + 6.5 * r.random() * r.random()) * US, "cudaLaunchKernel", stream, None, None,
             catalog.KERNELS[sk], sk)
        # What each sync queued since the previous collective or sync (bundle 1.1): the
        # forward kernels (and the sampled launch), the optimizer's after the last bucket,
        # the loss value's copy
        call(st.fsync, st.fsync_end, "cudaEventSynchronize", None, None, None, None,
             "fwd_sync", LAUNCHES[0] + 1, st.fsync - 40 * US)
        call(st.bsync, st.bsync_end, "cudaStreamSynchronize", stream, None, None, None,
             "bwd_sync", LAUNCHES[2], st.opt_end)
        call(st.d2h, st.d2h + st.d2h_dur, "cudaMemcpyAsync", stream, 4, "DtoH", None, "d2h")
        call(st.lsync, st.lsync_end, "cudaStreamSynchronize", stream, None, None, None,
             "loss_sync", 1, st.d2h)
        # kernel launches by phase, for the cudaLaunchKernel aggregates
        launches = self._launches
        cap_m = self._cap_mono
        for t, n in ((st.fwd, LAUNCHES[0]), (st.bwd, LAUNCHES[1]), (st.opt, LAUNCHES[2])):
            key = int((m0 + t * k - cap_m) // STATS_NS)
            lst = launches.get(key)
            if lst is None:
                lst = launches[key] = [0] * self.R
            lst[lr] += n
        self._sched_rows(lr, st, threads, rows["sched_events"])
        self._block_rows(lr, st, threads, rows["block_events"], rows["sched_events"])

    def _sched_rows(self, lr, st, threads, out) -> None:
        m0, k, r = self.m0, self.k, self.r
        pid, _, comm = threads[0]
        for kind, t, dur in st.stalls:
            ts = int(m0 + t * k)
            d = int(m0 + (t + dur) * k) - ts
            if kind == RUNQ_COMPETITOR:
                cname, cpid = self.plan.competitor
                out.append((ts, d, "runq_delay", pid, pid, comm, int(r.random() * NCPUS), None,
                            cpid, cpid + 1 + int(r.random() * 23), cname))
            elif kind == RUNQ_BENIGN:
                cpu = int(r.random() * NCPUS)
                task = r.choice(catalog.KERNEL_TASKS).format(cpu=cpu)
                kpid = 100 + (subseed(0, task) % 2000)
                out.append((ts, d, "runq_delay", pid, pid, comm, cpu, None, kpid, kpid, task))
            elif kind == DSTATE:
                out.append((ts, d, "off_cpu", pid, pid, comm, int(r.random() * NCPUS), "D",
                            None, None, None))
            elif kind == DATA_WAIT:
                out.append((ts, d, "off_cpu", pid, pid, comm, int(r.random() * NCPUS), "S",
                            None, None, None))
        # loader workers sleep between batches (off-CPU, S), every step
        faulty = st.faulty
        step_len = st.lsync_end - st.start
        for wi in (2, 3):
            _, tid, wcomm = threads[wi]
            sleep = st.start + r.uniform(0.35, 0.6) * step_len
            # within this step: the next step's spans must not start inside it
            sleep_end = min(sleep + step_len * r.uniform(0.25, 0.45),
                            st.start + 0.98 * step_len)
            ts = int(m0 + sleep * k)
            out.append((ts, int(m0 + sleep_end * k) - ts, "off_cpu", pid, tid, wcomm,
                        int(r.random() * NCPUS), "S", None, None, None))
            if faulty == "cpu":
                # waits for a CPU happen while the worker is runnable: one after another,
                # never while it sleeps (a real scheduler cannot produce overlaps)
                free = st.start
                for t in sorted(st.start + r.random() * step_len
                                for _ in range(r.randrange(1, 4))):
                    d = tri(r, 1, 3, 9) * MS
                    t = max(t, free)
                    if t < sleep_end and t + d > sleep:
                        t = sleep_end
                    if t + d > st.start + step_len:
                        break
                    free = t + d + 20 * US
                    ts = int(m0 + t * k)
                    cname, cpid = self.plan.competitor
                    out.append((ts, int(m0 + (t + d) * k) - ts, "runq_delay", pid, tid,
                                wcomm, int(r.random() * NCPUS), None, cpid,
                                cpid + 1 + int(r.random() * 23), cname))

    def _block_rows(self, lr, st, threads, out, sched_out) -> None:
        m0, k, r = self.m0, self.k, self.r
        pid = threads[0][0]
        step_len = st.lsync_end - st.start
        io_fault = self.straggler and self.plan.kind == "io" and self.plan.active(st.step)
        for i in range(r.randrange(2, 5)):
            _, tid, comm = threads[2 + (i & 1)]
            t = st.start + r.random() * step_len
            if io_fault and r.random() < 0.7:
                dur = tri(r, 6, 35, 420) * MS
            else:
                u = r.random()  # NVMe read latency: ~100 us, long tail
                dur = (60 + 90 * u + 750 * u ** 6) * US
            ts = int(m0 + t * k)
            out.append((ts, int(m0 + (t + dur) * k) - ts, DISK,
                        (2048 + int(r.random() * 7_400_000_000)) & ~7, 131072 * (1 + int(r.random() * 8)),
                        "read", "R", pid, tid, comm, 0))
            if dur > 20 * MS:  # the loader sleeps in D state on the slow read
                sched_out.append((ts + 4000, out[-1][1] - 3000, "off_cpu", pid, tid, comm,
                                  int(r.random() * NCPUS), "D", None, None, None))

    def _teardown_rows(self, tls, rows) -> None:
        m0, k, r = self.m0, self.k, self.r
        out = self._comm_rows
        for lr, tl in enumerate(tls):
            pid = self.pids[lr]
            t = tl.next_start + r.uniform(5, 40) * MS
            for h in (self.split_hash, self.world_hash):
                d = r.uniform(2, 30) * MS
                ts = int(m0 + t * k)
                out.append((ts, int(m0 + (t + d) * k) - ts, "ncclCommDestroy", h, None, None,
                            None, tl.rank, self.world, self.comm_handles[lr] +
                            (0x200 if h == self.split_hash else 0), 0, pid, pid))
                t += d + r.uniform(0.1, 2) * MS
            self._exit[lr] = t + r.uniform(0.4, 2.0) * S

    # -- rows that are not tied to steps ---------------------------------------------------
    def _static_rows(self, w: BundleWriter, inits) -> None:
        """Comm init rows and bookkeeping for processes/threads (written at the end)."""
        k, r = self.k, self.r
        self._cap_mono = self.mono(self.cap_start)
        self._comm_rows = out = []
        self._inits = inits
        self._exit = [None] * self.R
        cuda = []
        for lr, ri in enumerate(inits):
            pid = self.pids[lr]
            grank = self.node * self.R + lr
            ts = self.mono(ri.init_call)
            out.append((ts, self.mono(ri.init_end) - ts, "ncclCommInitRankConfig",
                        self.world_hash, None, None, None, grank, self.world,
                        self.comm_handles[lr], 0, pid, pid))
            ts = self.mono(ri.split_call)
            out.append((ts, self.mono(ri.split_end) - ts, "ncclCommSplit", self.split_hash,
                        self.world_hash, 0, grank, grank, self.world,
                        self.comm_handles[lr] + 0x200, 0, pid, pid))
            # CUDA context and model allocation before the communicator
            t = ri.proc_start + r.uniform(0.8, 1.4) * S
            d = r.uniform(180, 420) * MS
            cuda.append((self.mono(t), int(d * k), "cuModuleLoadData", "driver", None, None,
                         None, None, lr, 0, pid, pid, self.stack["module_load"]))
            t += d + r.uniform(50, 300) * MS
            for nbytes in (24 * GIB, 2 * GIB, 512 << 20):
                d = r.uniform(0.3, 4) * MS
                cuda.append((self.mono(t), int(d * k), "cudaMalloc", "runtime", None, nbytes,
                             None, None, lr, 0, pid, pid, self.stack["malloc"]))
                t += d + r.uniform(1, 30) * MS
        cuda.sort(key=itemgetter(0))
        w.add_many("cuda_events", cuda)
        sources = (
            ("clock", "clock_gettime brackets at 1 Hz, adjtimex; chronyd tracking"
             if self.clock.chrony_reference_error_ns is not None else
             "clock_gettime brackets at 1 Hz, adjtimex (no chronyd socket)"),
            ("host", "/proc and NVML counters at 10 Hz"),
            ("nccl", f"uprobes on {catalog.LIBNCCL} (27 functions)"),
            ("cuda", f"uprobes on {catalog.LIBCUDART} and {catalog.LIBCUDA}; "
                     "cudaLaunchKernel aggregated in kernel"),
            ("tcp", "tracepoint tcp:tcp_retransmit_skb" + (
                "; job connections' progress: sock:sock_send_length, sock:sock_recv_length, "
                "sock:sk_data_ready, tcp:tcp_sendmsg_locked" if self.cfg.tcp_progress else "")),
            ("sched", "tracepoints sched:sched_wakeup, sched:sched_switch; spans >= 1 ms kept"),
            ("block", "tracepoints block:block_rq_issue, block:block_rq_complete"),
        )
        t = self.cap_start
        for i, (src, msg) in enumerate(sources):
            w.log("info", src, "source_on", msg, None, self.mono(t + (i + 1) * 23 * MS))

    def _time_rows(self, w: BundleWriter, t_lo: float, t_hi: float, rows: dict) -> None:
        self._host_rows(w, t_hi)
        self._clock_rows(w, t_hi)
        self._tcp_rows(w, t_hi)
        self._writeback_rows(t_hi, rows["block_events"])
        self._stats_rows(w, t_hi)

    def _phase(self, t: float) -> str:
        if t < self._inits[0].proc_start:
            return "idle"
        if t > self.sched.job_end + 2 * S:
            return "idle"
        return "train"

    def _host_rows(self, w: BundleWriter, t_hi: float) -> None:
        r, m0, k = self.r, self.m0, self.k
        out = []
        R = self.R
        kind = self.plan.kind if self.straggler else ""
        net_hit = self.plan.kind == "network" and (self.straggler or self.net_neighbour)
        gpu_lr = self.plan.gpu_local_rank
        st = self._host_state
        if st is None:
            st = self._host_state = {"first": True, "load1": 3.0, "temp": [48.0] * R,
                                     "mem_used": 0.0}
        t = self._host_next
        gpus = [str(i) for i in range(R)]
        while t < t_hi:
            ts = int(m0 + t * k)
            train = self._phase(t) == "train"
            fault = bool(kind) and self.fault_at(t)
            first = st["first"]
            st["first"] = False
            busy = (R * 1.6 + 6) / NCPUS * 100 if train else 1.5
            runnable = R * 1.3 + 2 if train else 1
            psi_cpu = 0.4
            iowait, psi_io_s, psi_io_f, await_ms, dbusy = 0.2, 0.1, 0.0, 0.15, 4.0
            psi_m_s = psi_m_f = 0.0
            majf, pgscan, alloc = 0.5, 0.0, 0.0
            avail = 0.82
            retrans, drops = 0.3, 0.0
            if fault and kind == "cpu":
                busy, runnable, psi_cpu = 97.5, NCPUS * 1.4, 55.0
            elif fault and kind == "io":
                iowait, psi_io_s, psi_io_f, await_ms, dbusy = 9.0, 48.0, 14.0, 55.0, 99.0
            elif fault and kind == "memory":
                psi_m_s, psi_m_f, majf, pgscan, alloc, avail = 42.0, 13.0, 6500.0, 2.1e5, 180.0, 0.018
            if net_hit and self.fault_at(t):
                retrans, drops = (900.0 if self.straggler else 180.0), (40.0 if self.straggler else 2.0)
            n = r.random
            st["load1"] += (runnable - st["load1"]) * 0.0016
            rows = [
                (ts, "cpu.busy_pct", None, min(100.0, busy * (0.93 + 0.14 * n()))),
                (ts, "cpu.iowait_pct", None, iowait * (0.6 + 0.8 * n())),
                (ts, "load.avg1", None, round(st["load1"], 2)),
                # the capture's own CPU: 2-3.5 % of a core (no draw: the fleet's random
                # streams stay as they were)
                (ts, "capture.cpu_pct", None, 2.0 + 1.5 * ((ts // 100_000_000) % 7) / 7),
                (ts, "load.runnable", None, float(max(1, int(runnable * (0.8 + 0.4 * n()))))),
                (ts, "psi.cpu.some_pct", None, psi_cpu * (0.6 + 0.8 * n())),
                (ts, "psi.io.some_pct", None, psi_io_s * (0.6 + 0.8 * n())),
                (ts, "psi.io.full_pct", None, psi_io_f * (0.6 + 0.8 * n())),
                (ts, "psi.memory.some_pct", None, psi_m_s * (0.6 + 0.8 * n())),
                (ts, "psi.memory.full_pct", None, psi_m_f * (0.6 + 0.8 * n())),
                (ts, "mem.total_bytes", None, 2_164_194_172_928.0),
                (ts, "mem.available_bytes", None,
                 float(int(2_164_194_172_928 * avail * (0.995 + 0.01 * n())) & ~4095)),
                (ts, "mem.dirty_bytes", None, float(int(
                    (9e8 if kind == "io" and fault else 4e7) * (0.5 + n())) & ~4095)),
                (ts, "mem.swap_used_bytes", None, 0.0 if kind != "memory" else
                 float(int(3.1e10 * (0.9 + 0.2 * n())) & ~4095) if fault else 0.0),
                (ts, "disk.busy_pct", DISK, min(100.0, dbusy * (0.7 + 0.6 * n()))),
            ]
            if not first:
                txb = 5.2e9 if train else 2e4
                majf_v = round(majf * (0.5 + n())) * 10.0   # the list's first draw, as before
                rows += [
                    (ts, "vm.pgmajfault_per_s", None, majf_v),
                    # most major faults of a node short of memory read back what it gave
                    # up (no draw of its own: the fleet's random streams stay as they were)
                    (ts, "vm.refault_bytes_per_s", None, round(majf_v * 0.7) * 4096.0),
                    (ts, "vm.pgscan_per_s", None, round(pgscan * (0.5 + n()))),
                    (ts, "vm.pgsteal_per_s", None, round(pgscan * 0.8 * (0.5 + n()))),
                    (ts, "vm.allocstall_per_s", None, round(alloc * (0.5 + n())) * 10.0),
                    (ts, "tcp.retrans_segs_per_s", None,
                     10.0 * (1 if n() < retrans / 10 else 0) if retrans < 10
                     else round(retrans * (0.5 + n())) * 10.0),
                    (ts, "tcp.out_segs_per_s", None, round(txb / 8948 * (0.9 + 0.2 * n())) * 10.0),
                    (ts, "net.rx_bytes_per_s", DATA_NIC, txb * (0.9 + 0.2 * n())),
                    (ts, "net.tx_bytes_per_s", DATA_NIC, txb * (0.9 + 0.2 * n())),
                    (ts, "net.drops_per_s", DATA_NIC, round(drops * (0.5 + n())) * 10.0),
                    (ts, "disk.read_bytes_per_s", DISK, (3.1e8 if train else 0) * (0.6 + 0.8 * n())),
                    (ts, "disk.write_bytes_per_s", DISK, (4.8e8 if kind == "io" and fault
                                                          else 2.2e6) * (0.3 + 1.4 * n())),
                    (ts, "disk.await_ms", DISK, await_ms * (0.6 + 0.8 * n())),
                ]
            temps = st["temp"]
            for i in range(R):
                dev = gpus[i]
                hot = fault and kind == "gpu" and i == gpu_lr
                target = (89.0 if hot else 66.0 + (i % 3)) if train else 41.0
                temps[i] += (target - temps[i]) * 0.02 + (n() - 0.5) * 0.4
                clk = 1980.0
                thr = 0.0
                if hot:
                    clk = float(1980 * 0.66 + int(n() * 8) * 15)
                    thr = float(0x20 | (0x40 if n() < 0.4 else 0))
                elif train and n() < 0.004:
                    clk, thr = 1845.0, 4.0  # brief power cap: benign
                util = (94.0 + 5 * n()) if train else 0.0
                rows += [
                    (ts, "gpu.util_pct", dev, float(int(util))),
                    (ts, "gpu.mem_util_pct", dev, float(int(util * 0.41))),
                    (ts, "gpu.mem_used_bytes", dev, float((62 if train else 0.5) * GIB)),
                    (ts, "gpu.sm_clock_mhz", dev, clk if train else 345.0),
                    (ts, "gpu.max_sm_clock_mhz", dev, 1980.0),
                    (ts, "gpu.temp_c", dev, float(int(temps[i]))),
                    (ts, "gpu.power_w", dev, round((610 if train else 72) *
                                                   (0.66 if hot else 1.0) * (0.9 + 0.2 * n()), 1)),
                    (ts, "gpu.throttle_reasons", dev, thr if train else 1.0),
                ]
                if not first:
                    rows += [
                        (ts, "gpu.pcie_rx_bytes_per_s", dev, (3.4e8 if train else 1e5) * (0.8 + 0.4 * n())),
                        (ts, "gpu.pcie_tx_bytes_per_s", dev, (1.1e8 if train else 1e5) * (0.8 + 0.4 * n())),
                    ]
            out += rows
            t += HOST_TICK_NS + (n() - 0.5) * 0.6 * MS
        self._host_next = t
        w.add_many("host_samples", out)

    def _clock_rows(self, w: BundleWriter, t_hi: float) -> None:
        c, r = self.clock, self.r
        out = []
        t = self._clock_next
        while t < t_hi:
            width = 180 + 720 * r.random() ** 4
            mb = self.mono(t)
            ma = self.mono(t + width)
            mid = t + width * r.uniform(0.35, 0.65)
            real = c.realtime(mid)
            err = abs(c.error_ns(mid))
            if c.honest:
                est = err * r.uniform(0.6, 1.8) + 20 * US
                maxe = err * r.uniform(1.6, 3.0) + r.uniform(1.5, 12) * MS
            else:
                est = r.uniform(150, 400) * US
                maxe = r.uniform(0.9, 1.6) * MS
            out.append(("system", mb, ma, real, self.mono(mid), real + 37 * 1_000_000_000,
                        ma - mb, 1, int(r.uniform(-3, 3) * US), c.freq_ppb,
                        int(maxe // 1000) * 1000, int(est // 1000) * 1000,
                        STA_PLL | STA_NANO, 37, None, None, None, None, None))
            t += CLOCK_TICK_NS + r.uniform(-0.3, 0.3) * MS
        self._clock_next = t
        if c.chrony_reference_error_ns is not None:
            t = self._chrony_next
            refid = "0A%02X0001" % (int(self.addrs[0]["data"].split(".")[1]) & 0xFF)
            while t < t_hi:
                width = r.uniform(0.6, 2.5) * MS
                mid = t + width * r.uniform(0.3, 0.9)
                mb, ma = self.mono(t), self.mono(t + width)
                ref_off = int(c.error_ns(mid) - c.chrony_reference_error_ns +
                              r.uniform(-40, 40) * US)
                out.append(("chrony", mb, ma, c.realtime(mid), None, None, ma - mb, None, None,
                            None, None, None, None, None, ref_off,
                            int(r.uniform(180, 260) * US), int(r.uniform(0.4, 3) * MS),
                            "Normal", refid))
                t += CHRONY_TICK_NS + r.uniform(-20, 20) * MS
            self._chrony_next = t
        w.add_many("clock_samples", out)

    def _tcp_rows(self, w: BundleWriter, t_hi: float) -> None:
        r, m0, k = self.r, self.m0, self.k
        me = self.addrs[self.node]
        out = []
        # background: an admin ssh session and a metrics scrape on the management NIC
        t = self._tcp_bg_next
        while t < t_hi:
            if r.random() < 0.6:
                row = (me["mgmt"], "172.20.255.10", 22, r.randrange(40000, 60999))
            else:
                row = (me["mgmt"], "172.20.255.20", 9100, r.randrange(40000, 60999))
            for i in range(r.randrange(1, 4)):
                ti = t + i * r.uniform(0.2, 0.6) * S  # backed-off retransmits
                if ti >= self.cap_end:
                    break
                out.append((int(m0 + ti * k),
                            "tcp_retransmit_skb", 4, row[0], row[1], row[2], row[3],
                            "ESTABLISHED", r.choice((0, 0, r.randrange(1000, 60000))),
                            INIT_NETNS, None, "background", None, None))
            t += r.expovariate(1 / (25 * S))
        self._tcp_bg_next = t
        # job connections (NCCL sockets): rare on a healthy network, bursts under the fault
        net = self.plan.kind == "network" and (self.straggler or self.net_neighbour)
        t = max(self._tcp_job_next, self.cap_start)
        while t < t_hi:
            hit = net and self.fault_at(t)
            rate = (260.0 if self.straggler else 35.0) if hit else 0.004
            t_next = t + r.expovariate(rate / S)
            if not hit and net:
                # the rate changes at a window start: restart the process there
                nxt = min((a for a, _ in self.windows if a > t), default=None)
                if nxt is not None and t_next > nxt:
                    t = nxt
                    continue
            t = t_next
            if t >= t_hi:
                break
            if not hit and self._phase(t) != "train":
                continue
            if self.straggler or not hit:
                peer = r.choice(self.neighbours) if self.neighbours else self.node
            else:
                peer = self.plan.node
            lr = int(r.random() * self.R)
            sock = int(r.random() * 4)
            peer_addr = self.addrs[peer]["data"]
            # ports the same on every node (the addresses tell them apart): under 65536
            # in a fleet of 1,024 nodes; towards the next node, the ring's own hop (the
            # connection tcp_progress counts)
            sport, dport = NCCL_PORT_BASE + lr * 4 + sock, NCCL_PORT_BASE + 100 + lr * 4 + sock
            if peer == (self.node + 1) % self.cfg.nodes and self.cfg.nodes > 1:
                lr = self.R - 1
                sport, dport = hop_ports(self.R)
            out.append((int(m0 + t * k), "tcp_retransmit_skb", 4, me["data"], peer_addr,
                        sport, dport, "ESTABLISHED",
                        r.choice((0, self.pids[lr], self.pids[lr] + 40)), INIT_NETNS,
                        self.pids[lr], "job", None, None))
        self._tcp_job_next = t
        out.sort(key=itemgetter(0))
        w.add_many("tcp_events", out)

    def _writeback_rows(self, t_hi: float, out: list) -> None:
        r, m0, k = self.r, self.m0, self.k
        t = self._wb_next
        kind = self.plan.kind if self.straggler else ""
        while t < t_hi:
            storm = kind == "io" and self.fault_at(t)
            if storm:
                dur = tri(r, 4, 30, 250) * MS
                nbytes = 4096 * r.randrange(64, 257)
            else:
                dur = (25 + 375 * r.random() ** 4) * US
                nbytes = 4096 * r.randrange(1, 33)
            ts = int(m0 + t * k)
            if r.random() < 0.2 and not storm:
                out.append((ts, int(m0 + (t + dur) * k) - ts, DISK,
                            (2048 + int(r.random() * 7_400_000_000)) & ~7, nbytes, "write", "WS",
                            612, 612, "jbd2/nvme0n1p2-", 0))
            else:
                out.append((ts, int(m0 + (t + dur) * k) - ts, DISK,
                            (2048 + int(r.random() * 7_400_000_000)) & ~7, nbytes, "write", "W",
                            None, None, None, 0))
            t += r.expovariate((180.0 if storm else 3.0) / S)
        self._wb_next = t

    def _stats_rows(self, w: BundleWriter, t_hi: float, final: bool = False) -> None:
        r = self.r
        cap_m = self._cap_mono
        k_hi = int((self.mono(t_hi) - cap_m) // STATS_NS)
        out = []
        cpu_fault = self.straggler and self.plan.kind == "cpu"
        for key in sorted(x for x in self._launches if x < k_hi or final):
            counts = self._launches.pop(key)
            a = int(cap_m + key * STATS_NS)
            b = min(int(a + STATS_NS), self.mono(self.cap_end))  # last one is partial
            t_mid = (a + STATS_NS / 2 - self.m0) / self.k
            hot = cpu_fault and self.fault_at(t_mid)
            for lr, n in enumerate(counts):
                if not n:
                    continue
                pid = self.pids[lr]
                hist = [0] * 11
                hist += [int(n * 0.07), int(n * 0.61), int(n * 0.27)]
                slow = int(n * (0.09 if hot else 0.04))
                hist += [slow, int(slow * 0.15), int(slow * 0.03) + (1 if hot else 0)]
                hist[12] += n - sum(hist)
                while hist and not hist[-1]:
                    hist.pop()
                total = int(n * (5400 if hot else 4300) * (0.95 + 0.1 * r.random()))
                mx = (1 << (len(hist) - 1)) + r.randrange(1 << (len(hist) - 1))
                out.append((a, b, "cuda", "cudaLaunchKernel", pid, pid, None, n, total, mx,
                            json.dumps(hist, separators=(",", ":"))))
                # runqueue waits under the 1 ms row threshold, aggregated in the kernel
                rq = int((900 if hot else 60) * (0.7 + 0.6 * r.random()))
                h = [0] * 10 + [int(rq * 0.3), int(rq * 0.35), int(rq * 0.2), int(rq * 0.1)]
                h += [int(rq * 0.05), int(rq * (0.05 if hot else 0.0))] + ([int(rq * 0.08)] * 4
                                                                          if hot else [])
                h[10] += rq - sum(h)
                while h and not h[-1]:
                    h.pop()
                out.append((a, b, "sched", "runq_delay", pid, pid, None, rq,
                            int(rq * (210_000 if hot else 6_000) * (0.8 + 0.4 * r.random())),
                            (1 << (len(h) - 1)) + r.randrange(1 << (len(h) - 1)),
                            json.dumps(h, separators=(",", ":"))))
        w.add_many("event_stats", out)

    def _final_rows(self, w: BundleWriter) -> None:
        m0, k = self.m0, self.k
        self._stats_rows(w, self.cap_end, final=True)
        self._comm_rows.sort(key=itemgetter(0))
        w.add_many("nccl_comm_events", self._comm_rows)
        env_common = {"WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(self.R),
                      "GROUP_RANK": str(self.node),
                      "TORCHELASTIC_RUN_ID": self.job_id}
        procs, threads = [], []
        for lr, ri in enumerate(self._inits):
            pid = self.pids[lr]
            grank = self.node * self.R + lr
            env = dict(env_common, RANK=str(grank), LOCAL_RANK=str(lr), ROLE_RANK=str(grank),
                       CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(self.R)))
            start = self.mono(ri.proc_start)
            exit_t = self._exit[lr]
            procs.append((pid, start, "python3", "/usr/bin/python3.10", json.dumps(
                ["/opt/train/venv/bin/python3", "-u", "/opt/train/app/train.py",
                 "--config", "configs/llm-7b.yaml", f"--local-rank={lr}"]),
                grank, lr, self.world, self.R, self.node, self.job_id,
                json.dumps(env, sort_keys=True), start + 1_800_000, self.mono(exit_t),
                self.mono(exit_t)))
            for i, (p, tid, comm) in enumerate(self.threads[lr]):
                first = ri.proc_start + (0 if i == 0 else 1.5 + i * 0.2) * S
                threads.append((p, tid, comm, self.mono(first) + 1_800_000, self.mono(exit_t)))
        w.add_many("processes", procs)
        w.add_many("threads", threads)
        t = self.cap_end - 0.2 * S
        for i, src in enumerate(("clock", "host", "nccl", "cuda", "tcp", "sched", "block")):
            w.log("info", src, "source_off", "capture stopped (SIGTERM)", None,
                  int(m0 + (t + i * 3 * MS) * k))


def generate_node(args) -> tuple[str, dict]:
    """Worker entry point: (cfg, plan, clocks, schedule, node, spool_dir, out_dir)."""
    cfg, plan, clocks, sched, node, spool_dir, out_dir = args
    path, rows = NodeGenerator(cfg, plan, clocks, sched, node).run(Path(spool_dir),
                                                                   Path(out_dir))
    return str(path), rows


__all__ = ["generate_node", "node_addresses", "comm_hashes", "rank_pids", "window_times"]
