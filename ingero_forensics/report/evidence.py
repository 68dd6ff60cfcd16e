"""Evidence for a verdict: per-cause signals on a suspect node against the other nodes
(node_signals), and the statistics and SQL helpers the report's modules share. The facts
a verdict cites are in citing.py, the page's other figures in figures.py.

Every figure is computed from fleet.db with SQL over the suspect's windows; signals of
I/O count the job's own processes only (a disk shared by several nodes' processes must
not make every node look the same), and retransmits count against the node whose own
job connections retransmitted.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import math
import random
from array import array
from collections import defaultdict
from dataclasses import dataclass
from operator import itemgetter, truediv

from ..merge.messages import LOCAL_ADDRESSES
from ..merge.summaries import JOB_BLOCK, SYNC_WAIT_APIS

CAUSES = ("cpu", "io", "memory", "network", "gpu")
CAUSE_TITLES = {
    "cpu": "CPU contention",
    "io": "block I/O",
    "memory": "memory pressure",
    "network": "network retransmits",
    "gpu": "GPU slowdown",
}
#: A cause is named when its best signal deviates this many robust spreads (or floors)
#: from the other nodes, and by twice as much as any other cause; WEAK_SCORE names it
#: with a warning.
CLEAR_SCORE = 5.0
WEAK_SCORE = 3.0
#: A rank's wait for its own GPU work is noticeably longer than its peers' when it
#: exceeds theirs by this many ms and by this share of theirs (a forward pass of a
#: millisecond on a healthy GPU, tens of ms where the host runs far ahead of its GPU),
#: and when it is as long as their waits at this quantile at a clear score
#: (wait_floor; report/gpuwait.py).
GPU_WAIT_FLOOR_MS = 0.25
GPU_WAIT_RELATIVE = 0.25
GPU_WAIT_QUANTILE = 0.9
#: values per process the pooled quantile is read from (of its Reservoir sample)
POOL_PER_PROCESS = 2_000
#: The CPU signal in time units: what the report weighs against a straggler's cost.
RUNQ_SIGNAL = "run-queue delay of traced threads (ms per s, summed over threads)"
#: Values kept per node or rank for medians and percentiles (a uniform sample beyond
#: that: memory stays flat however many rows the fleet holds).
SAMPLE = 20_000


@dataclass
class Signal:
    cause: str
    name: str          # what was measured, with its unit
    suspect: float     # value on the suspect node in the windows
    others: float      # median over the other nodes, same windows
    score: float       # how many times worse than the others (>= 1 means worse)



class Reservoir:
    """At most k values, a uniform sample of all added (seeded: the same input gives the
    same sample, so reports are reproducible); every value while fewer than k came."""

    def __init__(self, k: int, seed: int):
        self.k, self.n, self.values = k, 0, array("d")   # 8 bytes a value
        self._rng = random.Random(seed)

    def add(self, x: float) -> None:
        self.n += 1
        if len(self.values) < self.k:
            self.values.append(x)
        else:
            j = self._rng.randrange(self.n)
            if j < self.k:
                self.values[j] = x

    def extend(self, xs) -> "Reservoir":
        """add() every value of xs in turn (the same sample, the same random draws), in
        one call: the values that fit are appended at C speed, only the rest loop."""
        xs = iter(xs)
        room = self.k - len(self.values)
        if room > 0:
            before = len(self.values)
            self.values.extend(itertools.islice(xs, room))
            self.n += len(self.values) - before
        values, k, n = self.values, self.k, self.n
        if not _DRAW_INLINE:
            randrange = self._rng.randrange
            for x in xs:
                n += 1
                j = randrange(n)
                if j < k:
                    values[j] = x
        else:
            # randrange(n) as random.Random draws it (_randbelow_with_getrandbits), without
            # its two Python calls per value: 1.8 M draws at 64 nodes (the block I/O p95).
            getrandbits = self._rng.getrandbits
            for x in xs:
                n += 1
                bits = n.bit_length()
                j = getrandbits(bits)
                while j >= n:
                    j = getrandbits(bits)
                if j < k:
                    values[j] = x
        self.n = n
        return self


#: random.Random.randrange(n) draws getrandbits(n.bit_length()) until under n (CPython
#: 3.2 and later); extend() draws the same way inline when this Python still does (the
#: tests compare extend() with add()).
_DRAW_INLINE = (getattr(random.Random, "_randbelow", None)
                is getattr(random.Random, "_randbelow_with_getrandbits", object()))


def utc(ns) -> str:
    """A fleet time (ns since the epoch) as UTC to the millisecond; '-' for None."""
    if ns is None:
        return "-"
    t = _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d} UTC"


def table_exists(con, name: str) -> bool:
    return con.execute("SELECT 1 FROM sqlite_schema WHERE type='table' AND name=?",
                       (name,)).fetchone() is not None


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values):
    return quantile(list(values), 0.5)


def window_clause(windows, col="timestamp_ns"):
    if not windows:
        return "0", []
    parts, params = [], []
    for s, e in windows:
        parts.append(f"({col} >= ? AND {col} < ?)")
        params += [s, e]
    return "(" + " OR ".join(parts) + ")", params


def in_rowid_order(table: str, where: str, rowid: str = "id") -> str:
    """SQL: the rows of ``table`` that match ``where``, as ``id IN (SELECT id ... WHERE
    where)``, for a selective condition an index answers (one metric of host_samples,
    through its (metric, timestamp_ns) index; for most of a table, reading it whole
    costs less: _source).

    Why: fleet.db stores each node's rows together, so rows taken in an index's order
    (one metric, or one time range, across all nodes) are on a different page each
    time, and every row costs a page read. The IN list is the index's row ids, sorted:
    the table is then read forward, each page once (64 nodes x 8 GPUs: gpu.temp_c
    over the run in 4 s instead of 5.7 s; a node-wide metric in 0.8 s instead of
    2 s). Same rows, so the same sums; only their order differs, which the statements
    using this do not depend on (AVG and SUM, whose floating-point sums SQLite
    compensates, since 3.43).
    """
    return f"{rowid} IN (SELECT id FROM {table} WHERE {where})"


def late_ranks(con, node_id, windows, ranks_of) -> list[int]:
    """Global ranks of the straggler node whose own lateness stands out within the node
    (per process: nccl_events.rank is the rank in each call's communicator)."""
    where, params = window_clause(windows, "e.timestamp_ns")
    per_pid: dict[int, Reservoir] = {}
    lates: dict[int, array] = defaultdict(lambda: array("d"))
    for pid, ts, first in con.execute(
            "SELECT e.pid, e.timestamp_ns, c.first_entry_ns FROM nccl_events e "
            "JOIN collectives c ON c.comm_id_hash = e.comm_id_hash AND c.seq = e.seq "
            f"WHERE e.node_id = ? AND {where}", [node_id] + params):
        lates[pid].append((ts - first) / 1e6)
    for pid, v in lates.items():
        per_pid[pid] = Reservoir(SAMPLE, seed=pid if isinstance(pid, int) else 0).extend(v)
    # the mean, not the median: a rank late at one collective in ten is late
    mean = {p: sum(v.values) / len(v.values) for p, v in per_pid.items()
            if v.values and ranks_of.get((node_id, p)) is not None}
    if not mean:
        return []
    top = max(mean.values())
    # late ranks: within a factor of two of the latest one (a GPU fault slows one rank,
    # CPU or I/O contention on the host slows all of them)
    return sorted(ranks_of[(node_id, p)] for p, m in mean.items() if m >= 0.5 * top)


def window_seconds(windows) -> float:
    return sum(e - s for s, e in windows) / 1e9 or 1.0


GPU_WAIT_SIGNAL = "GPU work wait of the slowest rank (ms, median event/device sync)"
#: SQL: a tcp_events row of a connection that leaves its node. A connection to the node's
#: own address (ranks of one node over TCP: the rig with two ranks a node) or to loopback
#: never crosses a NIC, a cable or a switch: its retransmits say nothing of the network.
#: On the rig, three of them at the run's start named a node "network retransmits, weak".
LEAVES_NODE = ("(saddr <> daddr AND NOT (" + " OR ".join(
    f"daddr LIKE '{a}'" for a in LOCAL_ADDRESSES) + "))")
#: The signal that holds a straggler's job retransmits towards other late nodes: shown,
#: never scored (docs/report.md, rule 5).
TOWARDS_LATE_SIGNAL = ("job-connection retransmits towards late nodes (per s; not scored: "
                       "a late peer's symptom)")


def signal_score(target, others, per_node: dict[int, float], floor: float,
                 inverse: bool = False, relative: float = 0.0) -> float:
    """(target's value - the others' median) / max(their robust spread, floor, relative x
    their median): a node's score on one signal (node_signals)."""
    s = per_node.get(target, 0.0)
    vals = [per_node.get(n, 0.0) for n in others]
    med = median(vals) if vals else 0.0
    spread = 1.4826 * median([abs(v - med) for v in vals]) if vals else 0.0
    dev = (med - s) if inverse else (s - med)
    return dev / max(spread, floor, relative * abs(med))


def runq_ms_per_s(con, windows) -> dict[int, float]:
    """Per node, its traced threads' run-queue delay in the windows (ms per s)."""
    w, p = window_clause(windows)
    secs = window_seconds(windows)
    return {nid: (v or 0) / 1e6 / secs for nid, v in con.execute(
        f"SELECT node_id, SUM(duration_ns) FROM {_source(con, 'sched_events', windows)} "
        f"WHERE kind = 'runq_delay' AND {w} GROUP BY node_id", p)}


#: floor and relative floor of the run-queue signal (ms per s)
RUNQ_FLOOR, RUNQ_RELATIVE = 5.0, 0.1


def node_signals(con, target, node_ids, windows, bins=None,
                 late_peers=None) -> list[Signal]:
    """Per-cause signals on the suspect vs the other nodes over the same windows.

    The score is a robust deviation: (suspect - median of others) / max(spread of others,
    a per-signal floor). The floor is the smallest difference an operator would call
    noticeable, so a flat fleet (spread ~ 0) cannot turn noise into a verdict.
    bins: host_bins (binned.py), for the host metrics when they answer for windows.
    late_peers: the other late nodes, id -> their windows. Retransmits towards them
    while they were late (network.towards_late) are their symptom (a
    sender waits for a starved or stalled receiver, rule 4), so they count against no
    node: left out of the job-connection signal, shown apart (TOWARDS_LATE_SIGNAL); and
    where they are most of the suspect's job retransmits, the node-wide counter, which
    cannot be split by destination, is not scored either.
    """
    secs = window_seconds(windows)
    others = [n for n in node_ids if n != target]
    out: list[Signal] = []

    def add(cause, name, per_node: dict[int, float], floor: float, inverse=False,
            relative: float = 0.0):
        """relative: the smallest noticeable difference as a share of the others'
        median too (time per second: 90 ms/s more run-queue delay is noise where every
        node already waits 300 ms/s)."""
        s = per_node.get(target, 0.0)
        med = median([per_node.get(n, 0.0) for n in others]) if others else 0.0
        out.append(Signal(cause, name, round(s, 3), round(med, 3),
                          round(signal_score(target, others, per_node, floor, inverse,
                                             relative), 2)))

    w, p = window_clause(windows)
    wb = bins.clause(windows) if bins is not None else None

    def per_node(sql, params=()):
        return {nid: (v or 0.0) for nid, v in con.execute(sql, list(params))}

    towards = total_job = 0
    job_refaults = False
    not_late, late_params = "", []
    if late_peers:
        from .network import towards_late  # noqa: PLC0415 (it imports this module)
        to_late, late_params = towards_late(con, late_peers)
        not_late = f" AND NOT {to_late}"
        total_job, towards = con.execute(
            f"SELECT COUNT(*), COALESCE(SUM({to_late}), 0) FROM tcp_events WHERE "
            f"node_id = ? AND scope = 'job' AND event = 'tcp_retransmit_skb' AND "
            f"{LEAVES_NODE} AND {w}",
            late_params + [target] + p).fetchone()
    victim = towards > 0 and 2 * towards >= total_job

    add("cpu", RUNQ_SIGNAL, runq_ms_per_s(con, windows), RUNQ_FLOOR, relative=RUNQ_RELATIVE)
    for cause, metric, floor, inverse in (
            ("cpu", "psi.cpu.some_pct", 3.0, False),
            ("cpu", "cpu.busy_pct", 5.0, False),
            ("io", "psi.io.some_pct", 3.0, False),
            ("io", "disk.await_ms", 1.0, False),
            ("memory", "psi.memory.some_pct", 3.0, False),
            ("memory", "vm.pgmajfault_per_s", 20.0, False),
            ("memory", "vm.pgscan_per_s", 500.0, False),
            ("memory", "vm.refault_bytes_per_s", REFAULT_FLOOR, False),
            # the job's own cgroup: on a shared machine, the job's pressure alone
            ("io", "psi.job.io.some_pct", 3.0, False),
            ("memory", "psi.job.memory.some_pct", 3.0, False),
            ("memory", "vm.job.refault_bytes_per_s", REFAULT_FLOOR, False),
            ("network", "tcp.retrans_segs_per_s", 1.0, False),
            ("gpu", "gpu.sm_clock_mhz", 50.0, True),
            ("gpu", "gpu.temp_c", 3.0, False)):
        agg = "MIN" if inverse else "MAX"
        # per node: the worst device's mean over the windows (GPU: one GPU may be the culprit);
        # CPU metrics: the whole-node row only
        if wb is not None:
            vals = per_node(bins.signal_sql(agg, wb[0]), [metric] + wb[1])
        else:
            vals = per_node(
                f"SELECT node_id, {agg}(v) FROM (SELECT node_id, device, AVG(value) v "
                f"FROM host_samples WHERE "
                f"{in_rowid_order('host_samples', 'metric = ? AND ' + w)} "
                "AND (device IS NULL OR metric NOT LIKE 'cpu.%') GROUP BY node_id, device) "
                "GROUP BY node_id", [metric] + p)
        if metric == "vm.job.refault_bytes_per_s":
            job_refaults = target in vals     # the suspect's job cgroup was sampled
        if vals and metric in REFAULT_SIGNALS:    # read as MiB/s, not millions of bytes
            add(cause, REFAULT_SIGNALS[metric], {k: v / 2**20 for k, v in vals.items()},
                floor / 2**20, inverse)
        elif vals:
            add(cause, metric + (" (worst device)" if metric.startswith(("gpu.", "disk.")) else
                                 " (worst cgroup of the job)" if ".job." in metric else ""),
                vals, floor, inverse)
            if metric == "tcp.retrans_segs_per_s" and victim:
                out[-1].name += (" (not scored: most of this node's job retransmits went "
                                 "towards late nodes)")
                out[-1].score = 0.0
    if wb is not None:
        throttled = per_node(bins.throttled_sql(wb[0]), wb[1])
    else:
        throttled = per_node(
            "SELECT node_id, MAX(f) FROM (SELECT node_id, device, AVG(value > 0) f "
            "FROM host_samples WHERE "
            + in_rowid_order("host_samples", "metric = 'gpu.throttle_reasons' AND " + w)
            + " GROUP BY node_id, device) GROUP BY node_id", p)
    if throttled:
        add("gpu", "share of samples with clocks throttled (worst GPU)", throttled, 0.05)
    p95, total = _block_io(con, windows, w, p)
    add("io", "block I/O latency p95 of the job's processes (ms)", p95, 2.0)
    # a fast disk asked for far more (a cold shard, O_DIRECT reads, fsyncs) stalls the
    # job without any slow request: the time its requests took, per second
    add("io", "block I/O time of the job's processes (ms per s, summed over requests)",
        {k: v / 1e6 / secs for k, v in total.items()}, 5.0, relative=0.1)
    _reads_are_refaults(con, out, target, w, p, secs, job_refaults)
    add("network", "job-connection retransmits (per s)",
        {k: v / secs for k, v in per_node(
            f"SELECT node_id, COUNT(*) FROM tcp_events WHERE scope = 'job' "
            f"AND event = 'tcp_retransmit_skb' AND {LEAVES_NODE} AND {w}{not_late} "
            "GROUP BY node_id",
            p + late_params).items()}, 0.5)
    if towards:
        out.append(Signal("network", TOWARDS_LATE_SIGNAL, round(towards / secs, 3), 0.0, 0.0))
    waits = sync_wait_stats(con, w, p)
    add("gpu", GPU_WAIT_SIGNAL, {n: s.median_ms for n, s in waits.items()},
        wait_floor(target, waits))
    runq = next(s for s in out if s.name == RUNQ_SIGNAL)
    gpu_wait = next(s for s in out if s.name == GPU_WAIT_SIGNAL)
    if runq.score >= WEAK_SCORE and gpu_wait.score > 0:
        # a woken thread that waits for a CPU returns late from every sync: on a CPU-
        # starved node the GPU waits are the run queue's, counted there (the rig's CPU
        # hog: 72 here against 142 for the run queue, which then lost its clear verdict)
        gpu_wait.name += " (not scored: its threads waited for a CPU, which lengthens every wait)"
        gpu_wait.score = 0.0
    if runq.score >= WEAK_SCORE:
        own = _runq_behind_the_job(con, target, w, p)
        if own >= OWN_RUNQ_SHARE:
            # (after the GPU rule: its woken threads wait for a CPU all the same) the
            # node's CPU pressure and use are then the job's own load too
            runq.name += OWN_RUNQ_NOTE.format(share=own)
            runq.score = 0.0
            for s in out:
                if s.cause == "cpu" and s is not runq and s.score > 0:
                    s.name += " (not scored: the job's own processes kept the CPUs busy)"
                    s.score = 0.0
    return out


#: A node's run-queue delay is contention from outside the job only where less than this
#: share of it was behind the job's own processes (of any node on the same kernel).
OWN_RUNQ_SHARE = 0.5
#: ... else the signal is shown with this note and not scored. On the real-kernel rig
#: with two ranks a node, a rank whose own code takes 8 ms more CPU per step made its
#: node's threads wait for a CPU behind the job's own ranks, and the node was named with
#: "CPU contention (weak)" and a next step to move its own rank off the node.
OWN_RUNQ_NOTE = (" (not scored: {share:.0%} of it behind the job's own processes: its ranks "
                 "kept each other waiting, not another process)")


def _runq_behind_the_job(con, target, w, p) -> float:
    """The share of target's run-queue delay in the windows spent behind a process of the
    job: a traced process of any node on the same kernel (one boot; pids of other
    machines mean other processes)."""
    total, own = con.execute(
        "SELECT COALESCE(SUM(duration_ns), 0), COALESCE(SUM(CASE WHEN other_pid IN ("
        "SELECT p.pid FROM processes p JOIN nodes n ON n.node_id = p.node_id WHERE "
        "n.boot_id = (SELECT boot_id FROM nodes WHERE node_id = ?)) THEN duration_ns END), 0) "
        f"FROM sched_events WHERE node_id = ? AND kind = 'runq_delay' AND {w}",
        [target, target] + p).fetchone()
    return own / total if total else 0.0




#: The node-wide memory figures cited as evidence, and their units there.
NODE_MEMORY_UNITS = {"psi.memory.some_pct": "%", "vm.pgmajfault_per_s": "major faults/s",
                     "vm.pgscan_per_s": "pages scanned/s", "vm.refault_bytes_per_s": "MiB/s read back"}
#: Refault signals (pages evicted and read again): the job cgroup's, and the node's.
JOB_REFAULT_SIGNAL = ("evicted pages the job read back (MiB/s, worst memory cgroup; "
                      "vm.job.refault_bytes_per_s)")
NODE_REFAULT_SIGNAL = "evicted pages the node read back (MiB/s; vm.refault_bytes_per_s)"
REFAULT_SIGNALS = {"vm.job.refault_bytes_per_s": JOB_REFAULT_SIGNAL,
                   "vm.refault_bytes_per_s": NODE_REFAULT_SIGNAL}
#: bytes per second: the smallest refault rate worth noticing
REFAULT_FLOOR = 200 * 1024.0
#: the share of the job's block reads that refaults must cover to make them memory's:
#: readahead brings in pages that were not refaulted with those that were, and on the
#: rig's milder memory limit (20 MiB under a 32 MiB shard) refaults were 0.49-0.53 of
#: the job's reads; at a half, 1 run in 10 kept its I/O signals and 1 in 16 was named
#: "block I/O, clear" (bench/bench_rig_accuracy.py --severity mild)
REFAULT_SHARE = 0.4


def _reads_are_refaults(con, out: list[Signal], target, w, p, secs, job: bool) -> None:
    """A node whose working set does not fit its memory (a cgroup limit, other tenants)
    reads back the pages it had to give up: its block I/O rises, and so does every I/O
    signal, but the disk is not the cause. Where the suspect's refaults (a memory signal
    of score >= 3) add up to at least REFAULT_SHARE of the bytes its job's processes read
    from disk, its I/O signals are not scored: they are the memory signal's symptom. The job
    cgroup's refaults decide where the node has them (another tenant's must not hide a
    slow disk), the node's only where it has none. Seen on the real-kernel rig: a node
    whose job was limited to 12 MiB under a 32 MiB memory-mapped shard was named with
    block I/O, "clear", its refaults (about 18 MiB/s, its peers none) unread."""
    name, whose = (JOB_REFAULT_SIGNAL, "the job") if job else (NODE_REFAULT_SIGNAL, "the node")
    sig = next((s for s in out if s.name == name), None)
    if sig is None or sig.score < WEAK_SCORE:
        return
    read = con.execute(
        f"SELECT COALESCE(SUM(b.bytes), 0) FROM block_events b WHERE b.node_id = ? AND "
        f"b.op = 'read' AND {w.replace('timestamp_ns', 'b.timestamp_ns')} AND {JOB_BLOCK}",
        [target] + p).fetchone()[0] / secs
    refault = sig.suspect * 2**20      # the signal is in MiB/s
    if read <= 0 or refault < REFAULT_SHARE * read:
        return
    note = (f" (not scored: pages {whose} had evicted, read again, make "
            f"{min(100, round(100 * refault / read))}% of its job's block reads: memory's "
            "symptom)")
    for s in out:
        if s.cause == "io" and s.score > 0:
            s.name += note
            s.score = 0.0


def _source(con, table: str, windows, alias: str = "") -> str:
    """``table [alias]``, with NOT INDEXED when the windows cover a third or more of the
    table's time span: its rows fetched one by one in time order (the timestamp_ns
    index) are on a different page each time (fleet.db keeps each node's rows
    together), and reading the whole table in order costs less than that beyond about
    a third (64 nodes, a window over the whole run: block I/O time 1.7 s instead of
    3.1 s, its p95 below 2.9 s instead of about 5 s; run-queue delay 0.2 s instead of
    0.85 s)."""
    name = f"{table} {alias}".strip()
    lo, hi = con.execute(f"SELECT MIN(timestamp_ns), MAX(timestamp_ns) FROM {table}"
                         ).fetchone()
    if lo is None or hi <= lo:
        return name
    covered = sum(max(0, min(e, hi) - max(s, lo)) for s, e in windows)
    return f"{name} NOT INDEXED" if 3 * covered >= hi - lo else name


def _block_io(con, windows, w, p) -> tuple[dict[int, float], dict[int, int]]:
    """Per node, the p95 latency (ms) of block requests its job's processes issued (a
    traced process or one of its threads; writeback and other tenants do not count),
    and the sum of their durations (ns), from one read of the requests: the two
    figures need the same rows (3 M requests at 64 nodes: 1.8 s a pass)."""
    # The reservoir's sample depends on the order values come in: each node's in time
    # order (then row id), said in the ORDER BY, and fed node by node at C speed; ns to
    # ms as SQLite's duration_ns / 1e6 does it (the integer made a double, divided).
    # fleet.db 4 has these requests apart, in that order (merge/summaries.py).
    if table_exists(con, "job_block_io"):
        sql = ("SELECT node_id, duration_ns FROM job_block_io WHERE "
               f"{w} ORDER BY node_id, timestamp_ns, block_id")
    else:
        sql = (f"SELECT b.node_id, b.duration_ns FROM "
               f"{_source(con, 'block_events', windows, 'b')} WHERE "
               f"{w.replace('timestamp_ns', 'b.timestamp_ns')} AND {JOB_BLOCK} "
               "ORDER BY b.node_id, b.timestamp_ns, b.id")
    p95: dict[int, float] = {}
    total: dict[int, int] = {}
    for nid, rows in itertools.groupby(con.execute(sql, p), key=itemgetter(0)):
        ns = array("q", map(itemgetter(1), rows))
        total[nid] = sum(ns)
        p95[nid] = quantile(Reservoir(SAMPLE, seed=nid).extend(
            map(truediv, ns, itertools.repeat(1e6))).values, 0.95)
    return p95, total


@dataclass
class SyncWaits:
    """A node's waits for its own GPU work: those of its process with the longest
    median, and a sample of every process's (``pool``, for wait_floor)."""
    pid: int
    median_ms: float        # of a seeded sample (Reservoir), as every figure here
    count: int
    total_ms: float
    pool: list[float]


def wait_floor(target: int, waits: dict[int, SyncWaits]) -> float:
    """The smallest difference in the median wait for its own GPU work worth noticing
    on ``target``: 0.25 ms, a quarter of the other nodes' median, and a fifth of the way
    from that median to the other nodes' pooled waits at the 90th percentile, so that a
    clear score (5) needs a median wait longer than nine in ten of its peers' waits.
    Waits are skewed and many-modal on a busy host (a sync whose waker waited for a
    CPU): on the real-kernel rig with 8 ranks on 2 cores the peers' waits had a median of
    0.5 ms and a 90th percentile of 2.7 ms, and a rank slowed by its own code (no GPU
    fault) waited 1.4 ms at the median in its windows: a quarter of a millisecond
    would have made that a GPU slowdown."""
    others = [w for n, w in waits.items() if n != target]
    if not others:
        return GPU_WAIT_FLOOR_MS
    med = median([w.median_ms for w in others])
    pool = [v for w in others for v in w.pool]
    spread = (quantile(pool, GPU_WAIT_QUANTILE) - med) / CLEAR_SCORE if pool else 0.0
    return max(GPU_WAIT_FLOOR_MS, GPU_WAIT_RELATIVE * med, spread)


def sync_wait_stats(con, w, p) -> dict[int, SyncWaits]:
    """GPU slowdown shows as one rank's waits for its own GPU work (event and device
    synchronizations; stream synchronizations wait for collectives and are left out)
    taking longer than its peers'. Per node, the waits of its process whose median is
    longest."""
    # Read in row id order (the sample's order), grouped per process by the sort: each
    # process's waits are sampled at C speed. NOT INDEXED: the api filter leaves a
    # sixth of the table, read whole and in order (an index on node_id would fetch
    # those rows one by one).
    # fleet.db 4 has these waits apart, in that order (merge/summaries.py).
    if table_exists(con, "sync_waits"):
        sql = ("SELECT node_id, pid, duration_ns / 1e6 FROM sync_waits "
               f"WHERE {w} ORDER BY node_id, pid, cuda_id")
    else:
        sql = ("SELECT node_id, pid, duration_ns / 1e6 FROM cuda_events NOT INDEXED "
               "WHERE duration_ns IS NOT NULL AND api IN ("
               + ", ".join(f"'{a}'" for a in SYNC_WAIT_APIS) + f") AND {w} "
               "ORDER BY node_id, pid, id")
    out: dict[int, SyncWaits] = {}
    for (nid, pid), rows in itertools.groupby(con.execute(sql, p), key=itemgetter(0, 1)):
        ms = array("d", map(itemgetter(2), rows))
        sample = Reservoir(SAMPLE, seed=nid * 1_000_003 + pid).extend(ms).values
        waits = SyncWaits(pid, median(sample), len(ms), sum(ms), [])
        pool = out[nid].pool if nid in out else []
        # POOL_PER_PROCESS values at most, spread over the sample: under SAMPLE values
        # the Reservoir holds all of them in row order (a prefix is the run's start)
        k = min(len(sample), POOL_PER_PROCESS)
        pool.extend(sample[i * len(sample) // k] for i in range(k))
        if nid not in out or waits.median_ms > out[nid].median_ms:
            out[nid] = waits
        out[nid].pool = pool
    return out
