"""Find the straggler and its root cause in a fleet.db.

The method, in the order the report presents it:

1. Lateness. For every collective seen on two or more nodes, each node's arrival is the
   latest entry of its ranks; its lateness is that arrival minus the median arrival of all
   nodes. Entry times are exactly what the merge refuses to align on, so they are a fair
   witness here.
2. Windows. Collectives are binned in time; a node is late in a bin when its mean
   lateness exceeds a noise floor estimated robustly from the whole fleet (MAD). The
   straggler is the node with the largest excess lateness; its late bins, joined, are
   the fault windows.
3. Slow collectives without a late rank. Bins where the time from the last arrival to the
   observed completion is far above the run's baseline point at the network; the node
   whose job connections retransmit in those bins is named.
4. Root cause. In the windows, each candidate cause's signals on the suspect node are
   compared with the median of the other nodes over the same windows (a ratio, with a
   floor per signal so noise near zero cannot win). The best cause must beat the others
   by a clear factor; otherwise the report says it cannot tell, and shows the scores.

Everything is computed from fleet.db with SQL plus small Python loops over aggregated
rows; nothing here depends on the simulator.
"""

from __future__ import annotations

import itertools
import json
from array import array
import math
import random
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..db import connect_readonly
from ..errors import IngeroError

CAUSES = ("cpu", "io", "memory", "network", "gpu")
#: A cause is named when its best signal deviates this many robust spreads (or floors)
#: from the other nodes, and by twice as much as any other cause; WEAK_SCORE names it
#: with a warning.
CLEAR_SCORE = 5.0
WEAK_SCORE = 3.0
#: Lateness values kept per node for its median and 90th percentile (a uniform sample
#: beyond that: memory stays flat however many collectives the fleet holds).
LATENESS_SAMPLE = 20_000
#: Transfer times kept per time bin for its median.
TRANSFER_SAMPLE = 5_000
#: A node must be late in at least this many time bins to be called a straggler.
MIN_LATE_BINS = 3
CAUSE_TITLES = {
    "cpu": "CPU contention",
    "io": "block I/O",
    "memory": "memory pressure",
    "network": "network retransmits",
    "gpu": "GPU slowdown",
}


@dataclass
class Signal:
    cause: str
    name: str          # what was measured, with its unit
    suspect: float     # value on the suspect node in the windows
    others: float      # median over the other nodes, same windows
    score: float       # how many times worse than the others (>= 1 means worse)


@dataclass
class Window:
    start_ns: int
    end_ns: int
    lateness_ms: float  # mean lateness of the straggler in the window


@dataclass
class NodeLateness:
    node_id: int
    name: str
    ranks: list[int]
    collectives: int
    median_ms: float
    p90_ms: float
    last_share: float   # share of the collectives in which this node arrived last
    late_bins: int


@dataclass
class Analysis:
    fleet: str
    nodes: int
    ranks: int
    collectives: int
    start_ns: int | None
    end_ns: int | None
    bin_ns: int
    noise_ms: float
    straggler: str | None = None
    straggler_node_id: int | None = None
    straggler_ranks: list[int] = field(default_factory=list)
    late_ranks: list[int] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    cause: str | None = None
    cause_confidence: str | None = None   # clear / weak / none
    verdict: str = ""
    evidence: list[str] = field(default_factory=list)
    signals: list[Signal] = field(default_factory=list)
    lateness: list[NodeLateness] = field(default_factory=list)
    slow_bins: int = 0
    timeline: list[dict] = field(default_factory=list)   # per bin: t, suspect_ms, fleet_ms, transfer_ms
    cause_series: dict = field(default_factory=dict)     # metric over time, suspect vs others
    top_offenders: list[dict] = field(default_factory=list)
    slow_collectives: list[dict] = field(default_factory=list)
    alignment: list[dict] = field(default_factory=list)
    capture_issues: list[dict] = field(default_factory=list)
    inventory: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


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


def _groups(rows):
    """Consecutive rows with the same first column, as lists."""
    group, key = [], object()
    for r in rows:
        if r[0] != key:
            if group:
                yield group
            group, key = [], r[0]
        group.append(r)
    if group:
        yield group


def _q(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _median(values):
    return _q(list(values), 0.5)


def _table_exists(con, name: str) -> bool:
    return con.execute("SELECT 1 FROM sqlite_schema WHERE type='table' AND name=?",
                       (name,)).fetchone() is not None


def analyze_fleet(fleet_db, *, bin_s: float | None = None) -> Analysis:
    """Analyze a merged fleet.db; raise IngeroError if it is not one."""
    path = Path(fleet_db)
    if not path.is_file():
        raise IngeroError(f"{path}: no such file")
    try:
        con = connect_readonly(path)
        for t in ("nodes", "collectives", "nccl_events", "host_samples"):
            if not _table_exists(con, t):
                raise IngeroError(f"{path}: not a fleet.db (table {t} missing); "
                                  "build one with ingero-merge")
    except IngeroError:
        raise
    except Exception as e:  # apsw.NotADBError and friends
        raise IngeroError(f"{path}: not a SQLite fleet.db ({e})") from None
    try:
        return _analyze(con, path, bin_s)
    finally:
        con.close()


def _analyze(con, path: Path, bin_s: float | None) -> Analysis:
    nodes = {nid: (name, json.loads(ranks or "[]"))
             for nid, name, ranks in con.execute("SELECT node_id, name, ranks FROM nodes")}
    # Streamed (one collective's rows at a time): memory stays flat whatever the fleet.
    rows = con.cursor().execute(
        "SELECT c.collective_id, c.first_entry_ns, c.last_node_id, c.completion_ns, "
        "       c.last_entry_ns, e.node_id, MAX(e.timestamp_ns) "
        "FROM collectives c JOIN nccl_events e "
        "  ON e.comm_id_hash = c.comm_id_hash AND e.seq = c.seq "
        "WHERE c.ranks_seen >= 2 "
        "GROUP BY c.collective_id, e.node_id ORDER BY c.collective_id")
    first_row = next(rows, None)
    span = con.execute("SELECT MIN(first_entry_ns), MAX(last_entry_ns) FROM collectives").fetchone()
    n_coll = con.execute("SELECT COUNT(*) FROM collectives").fetchone()[0]
    n_ranks = len({r for _, rk in nodes.values() for r in rk})
    if bin_s is None:
        # about 100 bins over the run, between 0.25 s and 10 s each
        dur_s = ((span[1] or 0) - (span[0] or 0)) / 1e9
        bin_s = min(10.0, max(0.25, dur_s / 100)) if dur_s > 0 else 1.0
    bin_ns = int(bin_s * 1e9)
    a = Analysis(fleet=path.name, nodes=len(nodes), ranks=n_ranks, collectives=n_coll,
                 start_ns=span[0], end_ns=span[1], bin_ns=bin_ns, noise_ms=0.0)
    a.inventory = _inventory(con)
    a.alignment = _alignment(con, nodes)
    a.capture_issues = _capture_issues(con, nodes)
    if first_row is None or len(nodes) < 2:
        a.verdict = ("Not enough data to compare nodes: need collectives seen on at least "
                     "two nodes." if nodes else "The fleet database holds no nodes.")
        return a

    # -- 1. lateness per (collective, node) ------------------------------------------
    t0 = span[0]
    per_node: dict[int, Reservoir] = {}
    bins: dict[int, dict[int, list[float]]] = defaultdict(dict)   # b -> node -> [sum, n]
    transfer: dict[int, Reservoir] = {}
    last_count: dict[int, int] = defaultdict(int)
    for group in _groups(itertools.chain([first_row], rows)):
        if len(group) < 2:
            continue
        first, last_node, completion, last_entry = group[0][1], group[0][2], group[0][3], group[0][4]
        med = _median([g[6] for g in group])
        b = (first - t0) // bin_ns
        cells = bins[b]
        for g in group:
            late_ms = (g[6] - med) / 1e6
            nid = g[5]
            if nid not in per_node:
                per_node[nid] = Reservoir(LATENESS_SAMPLE, seed=nid)
            per_node[nid].add(late_ms)
            acc = cells.get(nid)
            if acc is None:
                cells[nid] = [late_ms, 1]
            else:
                acc[0] += late_ms
                acc[1] += 1
        last_count[last_node] += 1
        if completion is not None and completion >= last_entry:
            if b not in transfer:
                transfer[b] = Reservoir(TRANSFER_SAMPLE, seed=b)
            transfer[b].add((completion - last_entry) / 1e6)

    # robust noise floor over all (bin, node) means
    cell = {(b, n): sv / k for b, per in bins.items() for n, (sv, k) in per.items()}
    vals = list(cell.values())
    med_all = _median(vals)
    mad = _median([abs(v - med_all) for v in vals]) * 1.4826
    a.noise_ms = round(mad, 3)
    threshold = max(1.0, 6 * mad)
    late_bins: dict[int, list[int]] = defaultdict(list)
    excess: dict[int, float] = defaultdict(float)
    for (b, n), v in cell.items():
        if v > threshold:
            late_bins[n].append(b)
            excess[n] += v - threshold
    for nid, (name, ranks) in sorted(nodes.items(), key=lambda kv: kv[1][0]):
        res = per_node.get(nid)
        lat = res.values if res else []
        a.lateness.append(NodeLateness(
            nid, name, ranks, res.n if res else 0, round(_median(lat), 3),
            round(_q(lat, 0.9), 3),
            round(last_count.get(nid, 0) / max(1, n_coll), 3), len(late_bins.get(nid, []))))

    # -- 2. straggler and windows ---------------------------------------------------
    n_bins = len(bins)
    suspect = None
    if excess:
        cand = max(excess, key=excess.get)
        # a straggler is late repeatedly: isolated hiccups happen on healthy nodes too
        if len(late_bins[cand]) >= max(MIN_LATE_BINS, int(0.02 * n_bins)):
            suspect = cand
    # -- 3. slow collectives with nobody late: the network --------------------------
    tr_med = {b: _median(v.values) for b, v in transfer.items() if v.n}
    base = _median(tr_med.values()) if tr_med else 0.0
    slow = sorted(b for b, v in tr_med.items() if v > max(3 * base, base + 5.0))
    a.slow_bins = len(slow)
    network_suspect, retrans_bins = None, []
    if suspect is None:
        network_suspect, retrans_bins = _retransmit_suspect(con, list(nodes), t0, bin_ns)
        if network_suspect is None and len(slow) >= max(2, int(0.02 * n_bins)):
            counts = _per_node_in_bins(con, "SELECT node_id, timestamp_ns FROM tcp_events "
                                       "WHERE scope = 'job' AND event = 'tcp_retransmit_skb'",
                                       slow, t0, bin_ns)
            if counts:
                network_suspect = max(counts, key=counts.get)
    if suspect is not None:
        window_bins = sorted(late_bins[suspect])
    else:
        window_bins = sorted(set(slow) | set(retrans_bins))
    a.windows = _join_bins(window_bins, t0, bin_ns, cell, suspect)
    if suspect is not None and a.windows:
        # a short blip far weaker than the fault itself is a hiccup, not a window;
        # repeated short stalls of similar size are all kept
        peak = max(w.lateness_ms for w in a.windows)
        a.windows = [w for w in a.windows
                     if w.end_ns - w.start_ns >= 3 * bin_ns or w.lateness_ms >= 0.5 * peak]

    for b in sorted(bins):
        per = bins[b]
        row = {"t_s": round(b * bin_ns / 1e9, 3),
               "fleet_ms": round(_median([sv / k for sv, k in per.values()]), 3),
               "transfer_ms": round(tr_med.get(b, 0.0), 3)}
        if suspect is not None and suspect in per:
            row["suspect_ms"] = round(per[suspect][0] / per[suspect][1], 3)
        a.timeline.append(row)

    target = suspect if suspect is not None else network_suspect
    if target is None:
        a.verdict = ("No straggler: no node arrives late at collectives beyond the fleet's "
                     f"normal jitter ({a.noise_ms:.2f} ms), and collectives are not slow "
                     "for everyone.")
        a.cause_confidence = "none"
        a.slow_collectives = _slow_collectives(con)
        return a

    a.straggler_node_id = target
    a.straggler, a.straggler_ranks = nodes[target][0], nodes[target][1]
    windows = [(w.start_ns, w.end_ns) for w in a.windows]
    if suspect is not None:
        a.late_ranks = _late_ranks(con, target, windows)

    # -- 4. root cause ---------------------------------------------------------------
    a.signals = _signals(con, target, list(nodes), windows)
    scores = {c: max((s.score for s in a.signals if s.cause == c), default=0.0) for c in CAUSES}
    if network_suspect is not None:
        # slow for everyone with nobody late: only the network explains that pattern
        scores["network"] = max(scores["network"], CLEAR_SCORE)
    ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=True)
    best, best_score = ranked[0]
    second = ranked[1][1]
    if best_score >= CLEAR_SCORE and best_score >= 2 * max(second, 1.0):
        a.cause, a.cause_confidence = best, "clear"
    elif best_score >= WEAK_SCORE:
        a.cause, a.cause_confidence = best, "weak"
    else:
        a.cause_confidence = "none"
    a.evidence, a.top_offenders = _evidence(con, a.cause, target, windows, nodes)
    a.cause_series = _cause_series(con, a.cause, target, t0, bin_ns) if a.cause else {}
    a.slow_collectives = _slow_collectives(con)
    a.verdict = _verdict(a, suspect is not None)
    return a


def _retransmit_suspect(con, node_ids, t0, bin_ns) -> tuple[int | None, list[int]]:
    """A node whose job connections retransmit far more than the others' (a persistent
    network fault leaves no slow-vs-normal contrast in time, but it does across nodes)."""
    per: dict[int, set[int]] = defaultdict(set)       # bins with retransmits
    count: dict[int, int] = defaultdict(int)
    for nid, b, n in con.execute(
            "SELECT node_id, (timestamp_ns - ?) / ?, COUNT(*) FROM tcp_events "
            "WHERE scope = 'job' AND event = 'tcp_retransmit_skb' GROUP BY 1, 2", (t0, bin_ns)):
        per[nid].add(b)
        count[nid] += n
    if not per:
        return None, []
    counts = {n: count.get(n, 0) for n in node_ids}
    top = max(counts, key=counts.get)
    rest = [c for n, c in counts.items() if n != top]
    med = _median(rest) if rest else 0.0
    spread = 1.4826 * _median([abs(c - med) for c in rest]) if rest else 0.0
    if counts[top] >= 10 and (counts[top] - med) / max(spread, 3.0) >= CLEAR_SCORE:
        return top, sorted(set(per[top]))
    return None, []


def _join_bins(bins_: list[int], t0: int, bin_ns: int, cell, node) -> list[Window]:
    out: list[Window] = []
    run: list[int] = []
    for b in bins_ + [None]:
        if run and (b is None or b - run[-1] > 2):   # bridge gaps of one bin
            lat = [cell.get((x, node), 0.0) for x in run] if node is not None else [0.0]
            out.append(Window(t0 + run[0] * bin_ns, t0 + (run[-1] + 1) * bin_ns,
                              round(sum(lat) / len(lat), 3)))
            run = []
        if b is not None:
            run.append(b)
    return out


def _per_node_in_bins(con, sql, bins_, t0, bin_ns) -> dict[int, int]:
    wanted = set(bins_)
    out: dict[int, int] = defaultdict(int)
    for nid, ts in con.execute(sql):
        if (ts - t0) // bin_ns in wanted:
            out[nid] += 1
    return dict(out)


def _window_clause(windows, col="timestamp_ns"):
    if not windows:
        return "0", []
    parts, params = [], []
    for s, e in windows:
        parts.append(f"({col} >= ? AND {col} < ?)")
        params += [s, e]
    return "(" + " OR ".join(parts) + ")", params


def _late_ranks(con, node_id, windows) -> list[int]:
    """Ranks of the straggler node whose own lateness stands out within the node."""
    where, params = _window_clause(windows, "e.timestamp_ns")
    per_rank: dict[int, Reservoir] = {}
    for rank, ts, first in con.execute(
            "SELECT e.rank, e.timestamp_ns, c.first_entry_ns FROM nccl_events e "
            "JOIN collectives c ON c.comm_id_hash = e.comm_id_hash AND c.seq = e.seq "
            f"WHERE e.node_id = ? AND e.rank IS NOT NULL AND {where}", [node_id] + params):
        if rank not in per_rank:
            per_rank[rank] = Reservoir(LATENESS_SAMPLE, seed=rank)
        per_rank[rank].add((ts - first) / 1e6)
    if not per_rank:
        return []
    med = {r: _median(v.values) for r, v in per_rank.items()}
    top = max(med.values())
    # late ranks: within a factor of two of the latest one (a GPU fault slows one rank,
    # CPU or I/O contention on the host slows all of them)
    return sorted(r for r, m in med.items() if m >= 0.5 * top)


def _seconds(windows) -> float:
    return sum(e - s for s, e in windows) / 1e9 or 1.0


def _signals(con, target, node_ids, windows) -> list[Signal]:
    """Per-cause signals on the suspect vs the other nodes over the same windows.

    The score is a robust deviation: (suspect - median of others) / max(spread of others,
    a per-signal floor). The floor is the smallest difference an operator would call
    noticeable, so a flat fleet (spread ~ 0) cannot turn noise into a verdict.
    """
    secs = _seconds(windows)
    others = [n for n in node_ids if n != target]
    out: list[Signal] = []

    def add(cause, name, per_node: dict[int, float], floor: float, inverse=False):
        s = per_node.get(target, 0.0)
        vals = [per_node.get(n, 0.0) for n in others]
        med = _median(vals) if vals else 0.0
        spread = 1.4826 * _median([abs(v - med) for v in vals]) if vals else 0.0
        dev = (med - s) if inverse else (s - med)
        out.append(Signal(cause, name, round(s, 3), round(med, 3),
                          round(dev / max(spread, floor), 2)))

    w, p = _window_clause(windows)

    def per_node(sql, params=()):
        return {nid: (v or 0.0) for nid, v in con.execute(sql, list(params))}

    add("cpu", "run-queue delay of traced threads (ms per s)",
        {k: v / 1e6 / secs for k, v in per_node(
            f"SELECT node_id, SUM(duration_ns) FROM sched_events WHERE kind = 'runq_delay' "
            f"AND {w} GROUP BY node_id", p).items()}, 5.0)
    for cause, metric, floor, inverse in (
            ("cpu", "psi.cpu.some_pct", 3.0, False),
            ("cpu", "cpu.busy_pct", 5.0, False),
            ("io", "psi.io.some_pct", 3.0, False),
            ("io", "disk.await_ms", 1.0, False),
            ("memory", "psi.memory.some_pct", 3.0, False),
            ("memory", "vm.pgmajfault_per_s", 20.0, False),
            ("memory", "vm.pgscan_per_s", 500.0, False),
            ("network", "tcp.retrans_segs_per_s", 1.0, False),
            ("gpu", "gpu.sm_clock_mhz", 50.0, True),
            ("gpu", "gpu.temp_c", 3.0, False)):
        agg = "MIN" if inverse else "MAX"
        # per node: the worst device's mean over the windows (GPU: one GPU may be the culprit);
        # CPU metrics: the whole-node row only
        vals = per_node(
            f"SELECT node_id, {agg}(v) FROM (SELECT node_id, device, AVG(value) v "
            f"FROM host_samples WHERE metric = ? AND (device IS NULL OR metric NOT LIKE 'cpu.%') "
            f"AND {w} GROUP BY node_id, device) GROUP BY node_id", [metric] + p)
        if vals:
            add(cause, metric + (" (worst device)" if metric.startswith(("gpu.", "disk.")) else ""),
                vals, floor, inverse)
    throttled = per_node(
        f"SELECT node_id, MAX(f) FROM (SELECT node_id, device, AVG(value > 0) f FROM host_samples "
        f"WHERE metric = 'gpu.throttle_reasons' AND {w} GROUP BY node_id, device) GROUP BY node_id", p)
    if throttled:
        add("gpu", "share of samples with clocks throttled (worst GPU)", throttled, 0.05)
    add("io", "block I/O latency p95 (ms)", _block_p95(con, w, p), 2.0)
    add("network", "job-connection retransmits (per s)",
        {k: v / secs for k, v in per_node(
            f"SELECT node_id, COUNT(*) FROM tcp_events WHERE scope = 'job' "
            f"AND event = 'tcp_retransmit_skb' AND {w} GROUP BY node_id", p).items()}, 0.5)
    add("gpu", "GPU work wait of the slowest rank (ms, median event/device sync)",
        _sync_wait(con, w, p), 2.0)
    return out


def _block_p95(con, w, p) -> dict[int, float]:
    per: dict[int, Reservoir] = {}
    for nid, d in con.execute(f"SELECT node_id, duration_ns FROM block_events WHERE {w}", p):
        if nid not in per:
            per[nid] = Reservoir(LATENESS_SAMPLE, seed=nid)
        per[nid].add(d / 1e6)
    return {n: _q(v.values, 0.95) for n, v in per.items()}


def _sync_wait(con, w, p) -> dict[int, float]:
    """GPU slowdown shows as one rank's waits for its own GPU work (event and device
    synchronizations; stream synchronizations wait for collectives and are left out)
    taking longer than its peers'."""
    per: dict[tuple[int, int], Reservoir] = {}
    for nid, pid, d in con.execute(
            f"SELECT node_id, pid, duration_ns FROM cuda_events WHERE duration_ns IS NOT NULL "
            f"AND api IN ('cudaEventSynchronize', 'cuEventSynchronize', 'cudaDeviceSynchronize', "
            f"'cuCtxSynchronize') AND {w}", p):
        if (nid, pid) not in per:
            per[(nid, pid)] = Reservoir(LATENESS_SAMPLE, seed=nid * 1_000_003 + pid)
        per[(nid, pid)].add(d / 1e6)
    out: dict[int, float] = {}
    for (nid, _), v in per.items():
        out[nid] = max(out.get(nid, 0.0), _median(v.values))
    return out


def _evidence(con, cause, target, windows, nodes) -> tuple[list[str], list[dict]]:
    w, p = _window_clause(windows)
    secs = _seconds(windows)
    ev: list[str] = []
    top: list[dict] = []
    if cause == "cpu":
        for comm, opid, n, tot in con.execute(
                f"SELECT other_comm, other_pid, COUNT(*), SUM(duration_ns) FROM sched_events "
                f"WHERE node_id = ? AND kind = 'runq_delay' AND {w} "
                f"GROUP BY other_comm, other_pid ORDER BY SUM(duration_ns) DESC LIMIT 5",
                [target] + p):
            top.append({"task": comm or "?", "pid": opid, "spans": n, "total_ms": round(tot / 1e6, 1)})
        if top:
            total_s = sum(t["total_ms"] for t in top) / 1e3
            ev.append(f"Its traced threads waited {total_s:,.1f} s in the run queue during the "
                      f"windows (summed over threads), most of it behind {top[0]['task']} "
                      f"(pid {top[0]['pid']}).")
    elif cause == "io":
        for dev, n, mx, avg in con.execute(
                f"SELECT device, COUNT(*), MAX(duration_ns), AVG(duration_ns) FROM block_events "
                f"WHERE node_id = ? AND {w} GROUP BY device ORDER BY MAX(duration_ns) DESC LIMIT 5",
                [target] + p):
            top.append({"device": dev, "requests": n, "max_ms": round(mx / 1e6, 1),
                        "mean_ms": round(avg / 1e6, 2)})
        if top:
            ev.append(f"Block I/O on {top[0]['device']} took up to {top[0]['max_ms']} ms per "
                      f"request in the windows (mean {top[0]['mean_ms']} ms).")
    elif cause == "network":
        for sa, da, dp, n in con.execute(
                f"SELECT saddr, daddr, dport, COUNT(*) FROM tcp_events WHERE node_id = ? "
                f"AND scope = 'job' AND event = 'tcp_retransmit_skb' AND {w} "
                f"GROUP BY saddr, daddr, dport ORDER BY COUNT(*) DESC LIMIT 5", [target] + p):
            top.append({"from": sa, "to": da, "port": dp, "retransmits": n})
        if top:
            total = sum(t["retransmits"] for t in top)
            ev.append(f"{total} TCP retransmits on the job's own connections from "
                      f"{top[0]['from']} ({total / secs:.1f}/s in the windows), to "
                      + ", ".join(sorted({t['to'] for t in top})) + ".")
        bg = con.execute(f"SELECT COUNT(*) FROM tcp_events WHERE scope = 'background' AND {w}",
                         p).fetchone()[0]
        if bg:
            ev.append(f"{bg} other retransmits in the windows belong to background traffic "
                      "(not the job's connections) and are not counted.")
    elif cause == "memory":
        for metric, mx in con.execute(
                f"SELECT metric, MAX(value) FROM host_samples WHERE node_id = ? AND metric IN "
                f"('psi.memory.some_pct', 'vm.pgmajfault_per_s', 'vm.pgscan_per_s') AND {w} "
                f"GROUP BY metric ORDER BY metric", [target] + p):
            top.append({"metric": metric, "peak": round(mx, 1)})
        if top:
            ev.append("Memory pressure on the node: " + ", ".join(
                f"{t['metric']} peaked at {t['peak']}" for t in top) + ".")
    elif cause == "gpu":
        for dev, clk, temp in con.execute(
                f"SELECT device, AVG(CASE WHEN metric = 'gpu.sm_clock_mhz' THEN value END), "
                f"AVG(CASE WHEN metric = 'gpu.temp_c' THEN value END) FROM host_samples "
                f"WHERE node_id = ? AND metric IN ('gpu.sm_clock_mhz', 'gpu.temp_c') AND {w} "
                f"GROUP BY device ORDER BY 2 ASC LIMIT 3", [target] + p):
            top.append({"gpu": dev, "sm_clock_mhz": round(clk or 0), "temp_c": round(temp or 0, 1)})
        if top:
            ev.append(f"GPU {top[0]['gpu']} ran at {top[0]['sm_clock_mhz']} MHz SM clock, "
                      f"{top[0]['temp_c']} °C, in the windows.")
    return ev, top


def _cause_series(con, cause, target, t0, bin_ns) -> dict:
    """The cause's main metric over time: the suspect node vs the other nodes' median."""
    metric = {"cpu": "psi.cpu.some_pct", "io": "psi.io.some_pct",
              "memory": "psi.memory.some_pct", "network": "tcp.retrans_segs_per_s",
              "gpu": "gpu.sm_clock_mhz"}[cause]
    agg = "MIN" if cause == "gpu" else "MAX"
    per: dict[int, dict[int, float]] = defaultdict(dict)
    for nid, b, v in con.execute(
            f"SELECT node_id, (timestamp_ns - ?) / ?, {agg}(v) FROM (SELECT node_id, "
            f"timestamp_ns, device, value v FROM host_samples WHERE metric = ?) "
            f"GROUP BY node_id, (timestamp_ns - ?) / ?", [t0, bin_ns, metric, t0, bin_ns]):
        if b is not None and b >= 0:
            per[b][nid] = v
    series = []
    for b in sorted(per):
        vals = per[b]
        others = [v for n, v in vals.items() if n != target]
        series.append({"t_s": round(b * bin_ns / 1e9, 3), "suspect": round(vals.get(target, 0.0), 3),
                       "others": round(_median(others), 3) if others else 0.0})
    return {"metric": metric, "points": series}


def _slow_collectives(con) -> list[dict]:
    """The seed article's question: slowest AllReduces and the retransmits in their window."""
    out = []
    for rank, node, ms, n in con.execute(
            "WITH slow AS (SELECT timestamp_ns, duration_ns, rank, node_id FROM nccl_events "
            "  WHERE op = 'ALL_REDUCE' AND duration_ns > 50000000 "
            "  ORDER BY duration_ns DESC LIMIT 10) "
            "SELECT s.rank, nd.name, s.duration_ns / 1e6, "
            "  (SELECT COUNT(*) FROM tcp_events t WHERE t.event = 'tcp_retransmit_skb' "
            "   AND t.timestamp_ns BETWEEN s.timestamp_ns AND s.timestamp_ns + s.duration_ns) "
            "FROM slow s JOIN nodes nd USING (node_id) ORDER BY s.duration_ns DESC"):
        out.append({"rank": rank, "node": node, "ms": round(ms, 1), "retransmits": n})
    return out


def _alignment(con, nodes) -> list[dict]:
    if not _table_exists(con, "clock_alignment"):
        return []
    out = []
    for row in con.execute(
            "SELECT node_id, method, drift_ppm, uncertainty_ns, relative_uncertainty_ns, "
            "sync_points, violations_before, violations_after, steps, exceeds_claim "
            "FROM clock_alignment ORDER BY node_id"):
        nid, method, drift, unc, rel, sp, vb, va, steps, liar = row
        out.append({"node": nodes.get(nid, ("?",))[0], "method": method,
                    "drift_ppm": round(drift or 0.0, 2),
                    "uncertainty_us": None if unc is None else round(unc / 1e3, 1),
                    "relative_uncertainty_us": None if rel is None else round(rel / 1e3, 1),
                    "sync_points": sp, "violations_before": vb, "violations_after": va,
                    "steps": steps, "exceeds_claim": bool(liar)})
    return out


def _capture_issues(con, nodes) -> list[dict]:
    """Sources that were off or lost events: the report must say what it could not see."""
    out = []
    for nid, source, event, n, msg in con.execute(
            "SELECT node_id, source, event, SUM(COALESCE(count, 1)), MAX(message) FROM capture_log "
            "WHERE event IN ('source_off', 'lost_events') OR level IN ('warning', 'error') "
            "GROUP BY node_id, source, event ORDER BY node_id, source"):
        out.append({"node": nodes.get(nid, ("?",))[0], "source": source, "event": event,
                    "count": n, "message": msg})
    return out


def _inventory(con) -> dict:
    inv = {}
    for t in ("nccl_events", "cuda_events", "tcp_events", "sched_events", "block_events",
              "host_samples", "clock_samples", "stacks"):
        if _table_exists(con, t):
            inv[t] = con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
    inv["bundles"] = con.execute("SELECT COUNT(*) FROM bundles").fetchone()[0] \
        if _table_exists(con, "bundles") else 0
    return inv


def _windows_text(windows) -> str:
    return "1 window" if len(windows) == 1 else f"{len(windows)} windows"


def _verdict(a: Analysis, late: bool) -> str:
    ranks = a.late_ranks or a.straggler_ranks
    rank_text = (f"rank {ranks[0]}" if len(ranks) == 1 else
                 f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1))
                 else "ranks " + ", ".join(map(str, ranks))) if ranks else "its ranks"
    secs = sum(w.end_ns - w.start_ns for w in a.windows) / 1e9
    if late:
        lat = sum(w.lateness_ms * (w.end_ns - w.start_ns) for w in a.windows) / max(secs * 1e9, 1)
        lead = (f"{a.straggler} ({rank_text}) is the straggler: it arrived at collectives "
                f"{lat:.1f} ms after the median node, on average, in {_windows_text(a.windows)} "
                f"totalling {secs:.0f} s (fleet jitter {a.noise_ms:.2f} ms).")
    else:
        lead = (f"Collectives were slow for every rank in {_windows_text(a.windows)} totalling "
                f"{secs:.0f} s while no rank arrived markedly late; {a.straggler}'s network is "
                "the suspect.")
    if a.cause and a.cause_confidence == "clear":
        return f"{lead} Root cause: {CAUSE_TITLES[a.cause]}."
    if a.cause:
        return f"{lead} Most likely cause: {CAUSE_TITLES[a.cause]} (weak evidence)."
    return f"{lead} The captured signals do not single out a cause; see the scores below."
