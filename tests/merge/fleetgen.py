"""A small fleet of real bundles written with BundleWriter, following the shared clock and
completion model (docs/fleet-db.md), with the truth kept for the tests.

Not a fake of anything the merge reads: real SQLite images, real zstd containers; only the
GPU side (when a collective completes) is modelled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from ingero_forensics.bundle import BundleWriter

T_JOB = 1_760_000_000_000_000_000  # true UTC of the job start


@dataclass
class NodeTruth:
    name: str
    boot_utc_ns: int
    drift: float            # d_i
    offset_ns: int          # o_i
    step_utc_ns: int | None
    residual_ns: int
    liar: bool = False

    def mono(self, t: int) -> int:
        return round((t - self.boot_utc_ns) * (1 + self.drift))

    def true_of_mono(self, m: int) -> float:
        return self.boot_utc_ns + m / (1 + self.drift)

    def clock_error(self, t: int) -> int:
        if self.step_utc_ns is not None and t >= self.step_utc_ns:
            return round(self.residual_ns + self.drift * (t - self.step_utc_ns))
        return round(self.offset_ns + self.drift * (t - T_JOB))


@dataclass
class Fleet:
    nodes: list[NodeTruth]
    paths: list[Path] = field(default_factory=list)
    #: (comm, seq) -> true completion
    completions: dict = field(default_factory=dict)


def make_fleet(out_dir, *, nodes=4, ranks_per_node=2, seconds=20.0, step_ms=100,
               max_offset_ms=50.0, max_drift_ppm=50.0, ntp_step=True, liar=None,
               seed=1, straggler_rank=None, retransmits=True, segments=1,
               host_of=None, stacks=True, comm="00c0ffee00c0ffee",
               name_prefix="node", queued=0, claims=True, straggler_every=10,
               straggler_late_ns=60_000_000, one_host=False, late_wakeups=None,
               wakeup_rows=True, late_attach=None, shapes=1, late_in_flight=False,
               rank_env=True, messages=False, message_traps=False, held_into=None,
               unsent_rows=False, mapped_addresses=False, together=False,
               progress_attached=None) -> Fleet:
    """straggler_rank: a rank (or a tuple of ranks, each late at other collectives; at the
    same ones with together=True) that arrives straggler_late_ns late (a tuple: each
    straggler's) at every straggler_every-th collective. queued: what each sync records as
    queued after the collective (0: a tight observation; 8: kernels, it only bounds the
    completion). claims=False: clocks that say they are unsynchronized. one_host: every
    node is a namespace of one kernel (one clock, one boot_id). late_wakeups: a node
    index whose sync threads, woken by each completion, wait 1.5-3 ms for a CPU before
    they return (a CPU-starved node); wakeup_rows: whether its bundle records those waits
    (sched_events, as the capture does above its threshold). late_attach: node index ->
    seconds into the job when its capture attached, after the communicator's init: its
    collectives carry no comm_id_hash, seq or rank, only comm_handle and handle_seq
    counted from the attach, as the capture writes them. shapes: the collectives cycle
    through this many element counts (a training step's buckets). late_in_flight: each
    late process's last segment also records an ncclAllReduce still open at the stop,
    entered 50 ms after its last call (its handle_seq the next one). rank_env=False: the
    processes carry no rank environment (RANK, WORLD_SIZE, ...): their ranks are only in
    the collectives. messages: a TCP ring beside the collectives, each node sending a
    chunk to the next after each collective's entry, recorded as the capture does
    (tcp_progress: send rows at the copy's start, receive rows at the return, 15-60 us
    later, 1.5-3 ms later on the late_wakeups node, stream positions counted from the
    connection's establishment; mapped_addresses: odd nodes write their tcp_progress
    addresses IPv4-mapped, family 6, as another writer may). message_traps: rows the merge must never pair, as each
    would place a clock seconds or milliseconds wrong: a loopback connection on every
    node with the same 4-tuple, a 4-tuple reused by a second connection between nodes 0
    and 1, and a 4-tuple two nodes send on (containers with the same private
    addresses). held_into: a node index whose reader the ring's sends into it wait for
    (a full receive window): each such send starts 5-50 ms before its bytes leave.
    unsent_rows: the sending ends also record, as the capture does at the ACK that
    opens the window, an 'unsent' row 5-20 us before the bytes leave.
    progress_attached: node index -> seconds into the job when its capture attached to
    the ring's connections, already established: its tcp_progress rows start there,
    marked attached, each end's connected_ns its first row's time, the stream positions
    as the capture reads them from the socket (a sending end's one byte high: it opened
    the connection and its count holds the SYN)."""
    stragglers = () if straggler_rank is None else (
        straggler_rank if isinstance(straggler_rank, tuple) else (straggler_rank,))
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    truths = []
    for i in range(nodes):
        step = T_JOB + int(rng.uniform(0.3, 0.7) * seconds * 1e9) if ntp_step else None
        truths.append(NodeTruth(
            name=f"{name_prefix}-{i}", boot_utc_ns=T_JOB - int(rng.uniform(1, 50) * 3600e9),
            drift=rng.uniform(-max_drift_ppm, max_drift_ppm) * 1e-6,
            offset_ns=int(rng.uniform(-max_offset_ms, max_offset_ms) * 1e6),
            step_utc_ns=step, residual_ns=int(rng.uniform(-1, 1) * 1e6), liar=(liar == i)))
    if one_host:
        truths = [NodeTruth(**{**truths[0].__dict__, "name": t.name}) for t in truths]
    nranks = nodes * ranks_per_node
    end = T_JOB + int(seconds * 1e9)
    per_node_rows: list[dict[str, list]] = [
        {"nccl_events": [], "cuda_events": [], "tcp_events": [], "sched_events": [],
         "tcp_progress": []} for _ in truths]
    ring = {ni: [0, None, None] for ni in range(nodes)}   # bytes, connected (s, r) true
    chunk = 1 << 20
    fleet = Fleet(truths)
    t = T_JOB + 200_000_000
    seq = 0
    while t < end - 200_000_000:
        seq += 1
        entries = {}
        for r in range(nranks):
            late = 0
            k = stragglers.index(r) if r in stragglers else -1
            if k >= 0 and seq % straggler_every == (0 if together else 5 * k) % straggler_every:
                # a slow AllReduce for everybody else
                late = straggler_late_ns[k] if isinstance(straggler_late_ns, tuple) \
                    else straggler_late_ns
            entries[r] = t + rng.randint(0, 3_000_000) + late
        nbytes = (64 << 20) + ((seq % shapes) << 12)
        completion = max(entries.values()) + 1_500_000 + rng.randint(0, 20_000)
        fleet.completions[(comm, seq)] = completion
        for r, entry in entries.items():
            ni = r // ranks_per_node
            tr = truths[ni]
            pid, tid = 1000 + r, 1000 + r
            call = rng.randint(8_000, 30_000)
            # sometimes two collectives before one sync: only the last is pinned
            per_node_rows[ni]["nccl_events"].append(
                (tr.mono(entry), call, "ALL_REDUCE", r, nranks, comm, seq, nbytes // 4,
                 "float32", "sum", None, 7, nbytes, 0, 0, pid, tid, None))
            sync_start = entry + call + rng.randint(2_000, 8_000)
            sync_end = max(sync_start, completion) + rng.randint(2_000, 6_000)
            if ni == late_wakeups and completion > sync_start + 1_200_000:
                # slept in the sync, woken by the completion, then waited for a CPU
                wake = completion + rng.randint(2_000, 6_000)
                runq = rng.randint(1_500_000, 3_000_000)
                sync_end = wake + runq + rng.randint(5_000, 30_000)
                if wakeup_rows:
                    off = tr.mono(sync_start + 1_000)
                    on = tr.mono(wake + runq)
                    per_node_rows[ni]["sched_events"] += [
                        (off, on - off, "off_cpu", pid, tid, "python3", 0, "S", None, 4242,
                         "hog"),
                        (tr.mono(wake), on - tr.mono(wake), "runq_delay", pid, tid, "python3",
                         0, None, 4242, 4242, "hog")]
            if seq % 7 == 0:
                continue  # no sync after this one: the next sync pins the next collective
            per_node_rows[ni]["cuda_events"].append(
                (tr.mono(sync_start), tr.mono(sync_end) - tr.mono(sync_start),
                 "cudaStreamSynchronize", "runtime", 7, None, None, None, 0, 0, pid, tid, None,
                 queued, 3_000 if queued else None))
            if retransmits and rng.random() < 0.05:
                rt = entry + rng.randint(0, 1_000_000)
                per_node_rows[ni]["tcp_events"].append(
                    (tr.mono(rt), "tcp_retransmit_skb", 4, "10.0.0.1", "10.0.0.2", 40000,
                     5000, "ESTABLISHED", None, None, pid, "job", None, None))
        if messages and nodes > 1:
            for ni in range(nodes):
                nj = (ni + 1) % nodes
                src, dst = truths[ni], truths[nj]
                conn = ring[ni]
                if conn[1] is None:       # established just before the first message
                    conn[1], conn[2] = t - 50_000_000, t - 49_990_000
                last = max(entries[r] for r in range(ni * ranks_per_node,
                                                     (ni + 1) * ranks_per_node))
                t_send = last + rng.randint(100_000, 300_000)
                t_leave = t_send
                if nj == held_into:       # the bytes wait for the reader's window
                    t_send -= rng.randint(5_000_000, 50_000_000)
                lag = rng.randint(15_000, 60_000)
                if nj == late_wakeups:
                    lag += rng.randint(1_500_000, 3_000_000)   # its receiver wakes late
                pid = 1000 + ni * ranks_per_node
                pid_r = 1000 + nj * ranks_per_node
                def addr(node, of):     # node's way of writing of's address
                    if mapped_addresses and node % 2:
                        return 6, f"::ffff:10.0.0.{of + 1}"
                    return 4, f"10.0.0.{of + 1}"

                fam, a_src = addr(ni, ni)
                per_node_rows[ni]["tcp_progress"].append(
                    (src.mono(t_send), "send", fam, a_src, 40000 + ni,
                     addr(ni, nj)[1], 6000, src.mono(conn[1]), conn[0], chunk, pid, pid))
                if unsent_rows:
                    per_node_rows[ni]["tcp_progress"].append(
                        (src.mono(t_leave - rng.randint(5_000, 20_000)), "unsent", 4,
                         f"10.0.0.{ni + 1}", 40000 + ni, f"10.0.0.{nj + 1}", 6000,
                         src.mono(conn[1]), conn[0], 1, pid, pid))
                fam, a_dst = addr(nj, nj)
                per_node_rows[nj]["tcp_progress"].append(
                    (dst.mono(t_leave + lag), "recv", fam, a_dst, 6000,
                     addr(nj, ni)[1], 40000 + ni, dst.mono(conn[2]), conn[0], chunk,
                     pid_r, pid_r))
                conn[0] += chunk
            if message_traps and nodes > 3:
                _trap_rows(per_node_rows, truths, t, seq, chunk, seconds, step_ms * 1_000_000)
        t += step_ms * 1_000_000
    for ni, since in (progress_attached or {}).items():
        tr, first, kept = truths[ni], {}, []
        for row in per_node_rows[ni]["tcp_progress"]:
            if _true(tr, row[0]) < T_JOB + since * 1e9:
                continue
            sending = row[1] in ("send", "unsent")
            end = (sending,) + row[3:7]
            first.setdefault(end, row[0])
            kept.append(row[:7] + (first[end], row[8] + sending) + row[9:] + (1,))
        per_node_rows[ni]["tcp_progress"] = kept
    late_seen: dict = {}
    for ni, tr in enumerate(truths):
        seg_bounds = [T_JOB + int(k * seconds * 1e9 / segments) for k in range(segments + 1)]
        for k in range(segments):
            lo, hi = seg_bounds[k], seg_bounds[k + 1]
            host = {"hostname": (host_of or {}).get(ni, f"host-{ni}"),
                    "boot_id": f"{0 if one_host else ni:08d}-0000-4000-8000-{seed:012d}",
                    "kernel_release": "6.1.0-test"}
            spool = out_dir / f".{tr.name}-{k}.spool"
            w = BundleWriter(spool, node=tr.name, host=host,
                             capture_start=(lo + tr.clock_error(lo), tr.mono(lo)),
                             segment_index=k)
            sid = None
            if stacks:
                sid = w.add_stack([{"ip": f"0x{0x7f0000001000 + ni * 4096:x}",
                                    "module": f"/opt/env{ni}/lib/libnccl.so.2",
                                    "symbol": "ncclAllReduce", "symbol_offset": 16},
                                   {"ip": f"0x{0x5500000 + ni:x}", "module": "/usr/bin/python3",
                                    "symbol": "main", "symbol_offset": 4}])
            sync_sid = None
            if stacks:
                sync_sid = w.add_stack([{"ip": f"0x{0x7f0000200000 + ni:x}",
                                         "module": f"/usr/local/cuda-12.{ni}/lib/libcudart.so.12",
                                         "symbol": "cudaStreamSynchronize", "symbol_offset": 0}])
            for table, rows in per_node_rows[ni].items():
                sel = [row for row in rows if lo <= _true(tr, row[0]) < hi]
                if table == "nccl_events" and sid is not None:
                    sel = [row[:-1] + (sid,) for row in sel]
                if table == "cuda_events" and sync_sid is not None:
                    sel = [row[:12] + (sync_sid,) + row[13:] for row in sel]
                if table in ("nccl_events", "cuda_events") and ni in (late_attach or {}):
                    sel = [row for row in sel
                           if _true(tr, row[0]) >= T_JOB + late_attach[ni] * 1e9]
                if table == "nccl_events" and ni in (late_attach or {}):
                    sel = [_late_row(row, late_seen) for row in sel]
                    if late_in_flight and k == segments - 1:
                        for pid in sorted({row[15] for row in sel}):
                            last = max(row for row in sel if row[15] == pid)
                            w.add("calls_in_flight", (
                                last[0] + 50_000_000, tr.mono(hi) - 1, "stop", "nccl",
                                "ncclAllReduce", "ALL_REDUCE", None, None, None, None,
                                last[7], "float32", None, 7, last[12], None, pid, pid, None,
                                last[-2], late_seen[pid] + 1))
                w.add_many(table, sel)
            for r in range(ranks_per_node):
                rank = ni * ranks_per_node + r
                env = (rank, r, nranks, ranks_per_node, ni) if rank_env else (None,) * 5
                w.add("processes", (1000 + rank, 12345, "python3", "/usr/bin/python3",
                                    '["python3","train.py"]', *env, "job-42", "{}",
                                    tr.mono(lo), tr.mono(hi - 1), None))
            ts = lo
            while ts < hi:
                e = tr.clock_error(ts)
                w_ns = rng.randint(1_000, 4_000)
                claim = 50_000 if tr.liar else abs(e) + abs(e) // 2 + 200_000
                w.add("clock_samples", ("system", tr.mono(ts), tr.mono(ts + w_ns),
                                        ts + w_ns // 2 + e, None, None, w_ns, int(claims), 0,
                                        0.0, claim if claims else 16_000_000_000,
                                        (20_000 if tr.liar else abs(e) + 100_000) if claims
                                        else 16_000_000_000, 0, 37,
                                        None, None, None, None, None))
                ts += 1_000_000_000
            w.add("host_samples", (tr.mono(lo), "load.avg1", None, 1.5))
            path = w.seal(out_dir, capture_end=(hi + tr.clock_error(hi), tr.mono(hi)))
            fleet.paths.append(path)
    return fleet


def _trap_rows(per_node_rows, truths, t, seq, chunk, seconds, step_ns) -> None:
    """One collective step's rows of the three connections messages.py must not pair
    (make_fleet's message_traps). Paired, each says a send came after its receive."""
    pos = (seq - 1) * chunk
    for ni, tr in enumerate(truths):      # loopback: the same 4-tuple on every node
        lo = (4, "127.0.0.1", 45000, "127.0.0.1", 7000, tr.mono(T_JOB), pos, chunk, 1, 1)
        skew = 5_000_000 * (ni + 1)
        per_node_rows[ni]["tcp_progress"] += [
            (tr.mono(t + skew), "send") + lo,
            (tr.mono(t - skew), "recv", 4, "127.0.0.1", 7000, "127.0.0.1", 45000) + lo[5:]]
    # a 4-tuple reused between nodes 0 and 1: node 1 received on the first connection
    # in the first half; the second, established half way, counts from 0 again and node
    # 0 sends on it in the second half, seconds after node 1's receives of those positions
    half = T_JOB + int(seconds * 1e9 / 2)
    n0, n1 = truths[0], truths[1]
    if t < half:
        per_node_rows[1]["tcp_progress"].append(
            (n1.mono(t + 40_000), "recv", 4, "10.0.0.2", 6100, "10.0.0.1", 41000,
             n1.mono(T_JOB), pos, chunk, 1, 1))
    else:
        k = (t - half) // step_ns
        per_node_rows[0]["tcp_progress"].append(
            (n0.mono(t), "send", 4, "10.0.0.1", 41000, "10.0.0.2", 6100, n0.mono(half),
             k * chunk, chunk, 1, 1))
    # two nodes send on one 4-tuple (both are "172.17.0.2"); node 3 receives 10 ms
    # before node 2 sent
    for ni in (2, 0):
        per_node_rows[ni]["tcp_progress"].append(
            (truths[ni].mono(t + 10_000_000), "send", 4, "172.17.0.2", 42000, "172.17.0.3",
             6200, truths[ni].mono(T_JOB), pos, chunk, 1, 1))
    per_node_rows[3]["tcp_progress"].append(
        (truths[3].mono(t), "recv", 4, "172.17.0.3", 6200, "172.17.0.2", 42000,
         truths[3].mono(T_JOB), pos, chunk, 1, 1))


def _late_row(row: tuple, seen: dict) -> tuple:
    """A collective as a capture attached after the init writes it: comm_id_hash, seq,
    rank and nranks unknown; its ncclComm_t and a per-process counter instead."""
    pid = row[15]
    seen[pid] = seen.get(pid, 0) + 1
    return row[:3] + (None, None, None, None) + row[7:] + (0x55AA0000 + pid, seen[pid])


def _true(tr: NodeTruth, mono: int) -> float:
    return tr.true_of_mono(mono)
