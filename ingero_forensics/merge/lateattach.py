"""Communicators of a capture that attached after ncclCommInitRank: inferred by matching.

A capture started on a running job never saw the communicators being created, so its
collectives carry no comm_id_hash and no seq. Per process it still counts the calls on
each ncclComm_t from the attach (nccl_events.comm_handle, handle_seq). Those counters name
nothing across ranks: one rank's call 1 is another's call 4,017. What is certain is that
every rank of a communicator makes the same collectives in the same order, so two
streams of one communicator show the same sequence of shapes (op, count, datatype,
redop, root) once shifted by the right offset, at about the same time.

The matching, per pair (a group's reference stream, a candidate stream):

1. shapes: every offset at which the candidate's calls, sampled over their common span,
   have the reference's shapes (point-to-point calls compare without their peer);
2. time: of those offsets, the one whose calls come closest in time (median of the
   differences), on clocks placed by their clock samples (nodes of one boot share
   CLOCK_MONOTONIC exactly). A training loop repeats its shapes every step, so shapes
   alone leave one candidate per step; the nearest wins when it stays the nearest
   whatever the clocks' stated error (the next is further by more than twice it). The
   nearest is not required to be near: a straggler enters its collectives late, by up
   to half a step before the next step's call is nearer (it cannot be a whole step
   late: the others' next step waits for its collective to complete). On clocks that
   claim no synchronization the nearest is taken and marked as a choice.

A process joins a communicator at most once. Each matched group gets an identity (16
hex digits derived from its first stream, stable across incremental merges) and seq
numbers that agree across its ranks, 1 at the earliest call any of them saw. The images
(the merge's own decompressed copies) are rewritten before the sync points and the
collectives are read from them, so the rest of the merge treats the inferred collectives
like any other. fleet.db's ``inferred_comms`` says, per stream, what was inferred, on
what basis, and why a stream could not be matched; the report marks the communicators.
Global ranks come from the processes' environment (RANK, WORLD_SIZE): a group with a
member per rank of WORLD_SIZE is the world communicator, whose ranks are the global ones.
"""

from __future__ import annotations

import bisect
import hashlib
import statistics
from dataclasses import dataclass, field

from ..bundle.reader import column_or_null
from .align import DRIFT_BOUND_PPM
from .screen import row_predicate
from .syncpoints import SYNC_APIS, attached

#: Calls compared per candidate offset (evenly spaced over the common span).
SAMPLE_CALLS = 256
#: A candidate offset needs this many calls in common with the reference, all of the
#: same shape (a ring-buffer loss leaves a gap in handle_seq, never a wrong shape).
MIN_COMMON_CALLS = 4
#: On clocks with a stated error, offsets whose anchor call lies this far in time from
#: the candidate's are not tried.
SEARCH_WINDOW_NS = 30 * 1_000_000_000
#: Offsets tried per pair at most, nearest in time first; each on PRECHECK_CALLS calls,
#: the FULL_CHECKS nearest in time that pass on SAMPLE_CALLS.
MAX_TRIES = 2000
PRECHECK_CALLS = 16
FULL_CHECKS = 8
#: The clocks' error assumed for two nodes whose samples claim synchronization but
#: carry no maxerror.
DEFAULT_SYNC_ERROR_NS = 10_000_000
_P2P = ("SEND", "RECV")


@dataclass
class Stream:
    """One process's calls on one ncclComm_t, numbered from the attach."""
    node_id: int
    pid: int
    handle: int
    bundle_ids: set = field(default_factory=set)
    seqs: list = field(default_factory=list)     # handle_seq (or final seq, if old)
    times: list = field(default_factory=list)    # approximate common time, ns
    shapes: list = field(default_factory=list)
    old: tuple | None = None      # (comm_id_hash, seq_offset): numbered already (a
    #                               communicator whose init was seen, or an earlier merge)
    rank: int | None = None       # from the environment
    world_size: int | None = None
    nranks: int | None = None     # a communicator whose init was seen: its size
    #: per call, the return of the process's first synchronization that started after
    #: the call's entry (same common time; None where none): it ended after the
    #: collective completed, so after every rank's entry into it
    observed: list = field(default_factory=list)

    @property
    def key(self):
        return (self.node_id, self.pid, self.handle)


@dataclass
class Match:
    offset: int          # candidate handle_seq + offset = reference numbering
    basis: str           # 'shape', 'shape+time', 'nearest in time (unsynchronized clocks)'
    detail: str


@dataclass
class Group:
    ref: Stream
    members: dict = field(default_factory=dict)   # key -> (Stream, offset, Match | None)
    comm_id_hash: str | None = None

    def processes(self):
        return {(s.node_id, s.pid) for s, _, _ in self.members.values()}


def shape(op, count, datatype, redop, peer):
    """What every rank of a communicator passes alike (a p2p call's peer differs)."""
    if op in _P2P:
        return ("P2P", count, datatype)
    return (op, count, datatype, redop, peer)


def identity(node_name: str, pid: int, handle: int) -> str:
    """A stable 16-hex-digit name for a group, from its first stream."""
    return hashlib.sha256(f"inferred:{node_name}:{pid}:{handle}".encode()).hexdigest()[:16]


# ------------------------------------------------------------------ the clocks, roughly

def approximate_clocks(con) -> tuple[dict, dict]:
    """Per node: (offset to add to CLOCK_MONOTONIC for a common time, and the error
    that time claims: 0 between nodes of one boot, maxerror where synchronized, None
    where the clock claims nothing). From fleet.db's clock samples and nodes."""
    offsets, errors, boots = {}, {}, {}
    rows = con.execute(
        "SELECT c.node_id, n.boot_id, c.realtime_ns - (c.mono_before_ns + c.mono_after_ns) / 2, "
        "c.synchronized, c.adj_maxerror_ns FROM clock_samples c JOIN nodes n USING (node_id) "
        "WHERE typeof(c.realtime_ns) = 'integer'").fetchall()
    per: dict[int, list] = {}
    for node, boot, off, sync, maxerr in rows:
        boots[node] = boot
        per.setdefault(node, []).append((off, sync, maxerr))
    by_boot: dict[str, int] = {}
    for node in sorted(per):
        samples = per[node]
        first = by_boot.setdefault(boots[node], node)
        offsets[node] = statistics.median_low([o for o, _, _ in per[first]])
        synced = [m for _, s, m in samples if s == 1]
        if len(synced) * 2 > len(samples):
            errs = [m for m in synced if isinstance(m, int) and m >= 0]
            errors[node] = (statistics.median_low(errs) if errs else DEFAULT_SYNC_ERROR_NS)
        else:
            errors[node] = None
    return offsets, {"error": errors, "boot": boots}


def pair_error(clocks: dict, a: int, b: int) -> int | None:
    """The error between two nodes' approximate times: None when either claims nothing."""
    boot = clocks["boot"]
    if a in boot and boot.get(a) == boot.get(b):
        return 0
    ea, eb = clocks["error"].get(a), clocks["error"].get(b)
    return None if ea is None or eb is None else ea + eb


# ------------------------------------------------------------------ matching

def _common_sample(ref: Stream, cand: Stream, offset: int, index: dict,
                   limit: int = SAMPLE_CALLS):
    """(reference index, candidate index) pairs of calls in common at ``offset``,
    evenly spaced, at most ``limit``."""
    lo = bisect.bisect_left(cand.seqs, ref.seqs[0] - offset)
    hi = bisect.bisect_right(cand.seqs, ref.seqs[-1] - offset)
    if hi - lo <= 0:
        return []
    step = max(1, (hi - lo) // limit)
    out = []
    for i in range(lo, hi, step):
        j = index.get(cand.seqs[i] + offset)
        if j is not None:
            out.append((j, i))
    return out


def match(ref: Stream, cand: Stream, clocks: dict, index: dict | None = None):
    """(Match, None) or (None, why not): the offset that puts ``cand`` on ``ref``'s
    numbering."""
    index = index if index is not None else {s: i for i, s in enumerate(ref.seqs)}
    if not ref.seqs or not cand.seqs:
        return None, "no calls"
    err = pair_error(clocks, ref.node_id, cand.node_id)
    # the anchor: a candidate call in the middle of the span both streams cover in time;
    # clocks that claim nothing may be seconds apart: then any time is tried, nearest first
    lo_t, hi_t = max(ref.times[0], cand.times[0]), min(ref.times[-1], cand.times[-1])
    if lo_t > hi_t and err is not None:
        return None, "its calls do not overlap in time with the others'"
    mid = (lo_t + hi_t) // 2 if lo_t <= hi_t else (cand.times[0] + cand.times[-1]) // 2
    a = min(bisect.bisect_left(cand.times, mid), len(cand.times) - 1)
    t0, s0, shape0 = cand.times[a], cand.seqs[a], cand.shapes[a]
    if err is None:
        window = range(len(ref.seqs))
    else:
        window = range(bisect.bisect_left(ref.times, t0 - SEARCH_WINDOW_NS),
                       bisect.bisect_right(ref.times, t0 + SEARCH_WINDOW_NS))
    tries = sorted((j for j in window if ref.shapes[j] == shape0),
                   key=lambda j: abs(ref.times[j] - t0))[:MAX_TRIES]
    # a first look at 16 calls each: a loop repeats its shapes every step, and of the
    # offsets that pass, the true one lies within a step or so of the nearest in time
    # (a rank is never a whole step late), so the nearest few get the full check
    first = []
    for j in tries:
        offset = ref.seqs[j] - s0
        pairs = _common_sample(ref, cand, offset, index, PRECHECK_CALLS)
        if len(pairs) < MIN_COMMON_CALLS or any(ref.shapes[r] != cand.shapes[c]
                                                for r, c in pairs):
            continue
        dt = statistics.median_low([cand.times[c] - ref.times[r] for r, c in pairs])
        first.append((abs(dt), offset))
    shaped = len(first)
    found = []          # (distance, |median dt|, offset, median dt, calls, interval)
    for _, offset in sorted(first)[:FULL_CHECKS]:
        pairs = _common_sample(ref, cand, offset, index)
        if len(pairs) < MIN_COMMON_CALLS:
            continue
        if any(ref.shapes[r] != cand.shapes[c] for r, c in pairs):
            continue
        dt = statistics.median_low([cand.times[c] - ref.times[r] for r, c in pairs])
        lo, hi = feasible_shift(ref, cand, pairs)
        # two crystals drift apart over the calls compared: bounds that cross by less
        # than that are one shift, give or take the drift
        span = cand.times[pairs[-1][1]] - cand.times[pairs[0][1]]
        if lo > hi and lo - hi <= span * DRIFT_BOUND_PPM * 1e-6:
            lo, hi = hi, lo
        dist = max(lo, -hi, 0) if lo <= hi else float("inf")
        found.append((dist, abs(dt), offset, dt, len(pairs), (lo, hi)))
    if not found:
        return None, ("no offset gives the same sequence of collectives (op, count, "
                      "datatype) as the others" + (" within 30 s" if err is not None else ""))
    found.sort()
    best = found[0]
    if len(found) == 1:
        return Match(best[2], "shape", f"the only offset with the same shapes "
                                       f"({best[4]} calls compared)"), None
    second = found[1]
    detail = (f"same shapes at {shaped} offsets (the loop repeats); "
              f"{_why(best)}; next {_why(second)}; {best[4]} calls compared")
    if err is None:
        return Match(best[2], "nearest in time (unsynchronized clocks)",
                     detail + "; the clocks claim no synchronization, so this is a choice"), None
    if second[0] - best[0] > 2 * err:
        return Match(best[2], "shape+causality", detail + f"; clock error "
                                                           f"{err / 1e6:.3f} ms"), None
    if best[0] == second[0] == 0 and best[1] + 2 * err < second[1] / 3:
        # causality allows both (no synchronization recorded after one side's calls):
        # the nearest in time, only when it is near. A straggler late by L at a loop
        # of period P has the wrong call P - L away: nearest-in-time is wrong from
        # L > P/2 and taken here only below P/4.
        return Match(best[2], "shape+time", detail + f"; clock error {err / 1e6:.3f} ms; "
                     "no synchronization bounds it, nearest in time by far"), None
    return None, (detail + f": causality and the clocks' error ({err / 1e6:.3f} ms) "
                           "cannot tell them apart")


def feasible_shift(ref: Stream, cand: Stream, pairs) -> tuple[float, float]:
    """The shifts x of the candidate's clock (its times minus x) under which the pairing
    breaks no causality: each rank entered a collective before the other observed its
    completion. Unbounded where neither recorded a synchronization after its calls. The
    outermost 1 % of the bounds on each side is left out: a synchronization that did
    not wait on the collective's stream would make one bound too tight."""
    lows, highs = [], []
    for r, c in pairs:
        if ref.observed[r] is not None:     # cand entered before ref observed the end
            lows.append(cand.times[c] - ref.observed[r])
        if cand.observed[c] is not None:    # ref entered before cand observed the end
            highs.append(cand.observed[c] - ref.times[r])
    lows.sort()
    highs.sort()
    trim = len(pairs) // 100
    lo = lows[-1 - min(trim, len(lows) - 1)] if lows else float("-inf")
    hi = highs[min(trim, len(highs) - 1)] if highs else float("inf")
    return lo, hi


def _why(cand) -> str:
    dist, _, _, dt, _, (lo, hi) = cand
    span = ("any shift" if lo == float("-inf") and hi == float("inf") else
            "no shift" if lo > hi else f"shifts {lo / 1e6:+.3f}..{hi / 1e6:+.3f} ms")
    return f"median entry gap {dt / 1e6:+.3f} ms, causal for {span}"


def group_streams(streams: list[Stream], clocks: dict) -> tuple[list[Group], dict]:
    """Groups of matched streams (earlier merges' groups first, as they were) and, for
    each stream left alone, why."""
    groups: list[Group] = []
    by_hash: dict[str, Group] = {}
    for s in sorted((s for s in streams if s.old), key=lambda s: s.old[0]):
        g = by_hash.get(s.old[0])
        if g is None:
            g = by_hash[s.old[0]] = Group(ref=s, comm_id_hash=s.old[0])
            groups.append(g)
        g.members[s.key] = (s, 0, None)
    why_not: dict = {}
    fresh = sorted((s for s in streams if not s.old),
                   key=lambda s: (-len(s.seqs), s.node_id, s.pid, s.handle))
    indexes = {}
    tried: dict = {}
    for s in fresh:
        reasons = []
        if len(s.seqs) < MIN_COMMON_CALLS:    # nothing to compare (and no work for it)
            reasons.append(f"{len(s.seqs)} calls: too few to compare")
        for g in groups if not reasons else ():
            if (s.node_id, s.pid) in g.processes():
                continue
            index = indexes.setdefault(g.ref.key, {q: i for i, q in enumerate(g.ref.seqs)})
            m, why = match(g.ref, s, clocks, index)
            if m is not None:
                g.members[s.key] = (s, m.offset, m)
                break
            reasons.append(why)
            tried.setdefault(g.ref.key, why)    # the reference's side of the story
        else:
            g = Group(ref=s)
            g.members[s.key] = (s, 0, None)
            groups.append(g)
            if reasons:
                why_not[s.key] = reasons[0]
    for g in groups:
        if len(g.members) == 1 and g.ref.key not in why_not and g.ref.key in tried:
            why_not[g.ref.key] = tried[g.ref.key]
    return groups, why_not


# ------------------------------------------------------------------ reading and writing

def _late_columns(bundle) -> bool:
    return all(column_or_null(bundle, "nccl_events", c) != "NULL"
               for c in ("comm_handle", "handle_seq"))


def _read_streams(con, pending: list, known: dict) -> dict:
    """The late streams of the bundles being merged, from their images (times raw)."""
    streams: dict = {}
    for item in pending:
        bundle = item["bundle"]
        if not _late_columns(bundle):
            continue
        node = item["node_id"]
        pred = row_predicate("nccl_events", bundle)
        with attached(con, bundle.db_path, "b"):
            rows = con.execute(
                "SELECT e.pid, e.comm_handle, e.handle_seq, e.timestamp_ns, e.op, e.count, "
                "e.datatype, e.redop, e.peer, e.tid FROM b.nccl_events e WHERE "
                "e.comm_id_hash IS NULL AND typeof(e.handle_seq) = 'integer' AND "
                f"typeof(e.comm_handle) = 'integer' AND {pred} "
                "ORDER BY e.pid, e.comm_handle, e.handle_seq").fetchall()
            syncs = _syncs(con, bundle)
            env = {pid: (rank, ws) for pid, rank, ws in con.execute(
                "SELECT pid, rank, world_size FROM b.processes WHERE typeof(pid) = 'integer'")
                if rank is None or (isinstance(rank, int) and isinstance(ws, int)
                                    and 0 <= rank < ws)}
        for pid, handle, hseq, ts, op, count, dtype, redop, peer, tid in rows:
            key = (node, pid, handle)
            s = streams.get(key)
            if s is None:
                s = streams[key] = Stream(node, pid, handle)
                s.old = known[key][:2] if key in known else None
                s.rank, s.world_size = env.get(pid, (None, None))
            s.bundle_ids.add(item["bundle_id"])
            if s.seqs and hseq == s.seqs[-1]:
                continue            # a duplicate counter: keep the first
            s.seqs.append(hseq)
            s.times.append(ts)
            s.shapes.append(shape(op, count, dtype, redop, peer))
            s.observed.append(_next_return(syncs.get((pid, tid)), ts))
    # segments of one capture come in any order: keep every stream sorted by its counter
    for s in streams.values():
        if any(b < a for a, b in zip(s.seqs, s.seqs[1:])):
            order = sorted(range(len(s.seqs)), key=s.seqs.__getitem__)
            s.seqs = [s.seqs[i] for i in order]
            s.times = [s.times[i] for i in order]
            s.shapes = [s.shapes[i] for i in order]
            s.observed = [s.observed[i] for i in order]
    return streams


def _read_old_groups(con, new_keys: set, known: dict) -> dict:
    """The rows of streams an earlier merge matched (fleet.db), numbered by their
    final seq, with their synchronizations: references for the new streams."""
    streams: dict = {}
    syncs_of: dict = {}
    apis = ", ".join(f"'{a}'" for a in SYNC_APIS)
    for h in sorted({v[0] for v in known.values()}):
        for node, pid, handle, seq, mono, op, count, dtype, redop, peer, tid in con.execute(
                "SELECT node_id, pid, comm_handle, seq, mono_ns, op, count, datatype, "
                "redop, peer, tid FROM nccl_events WHERE comm_id_hash = ? ORDER BY seq", (h,)):
            key = (node, pid, handle)
            if key in new_keys or key not in known:
                continue
            s = streams.get(key)
            if s is None:
                s = streams[key] = Stream(node, pid, handle, old=(h, 0))
                s.rank, s.world_size = known[key][2:4]
                syncs = syncs_of[key] = {}
                for t, m, d in con.execute(
                        f"SELECT tid, mono_ns, duration_ns FROM cuda_events WHERE node_id = ? "
                        f"AND pid = ? AND api IN ({apis}) AND typeof(duration_ns) = 'integer'",
                        (node, pid)):
                    syncs.setdefault((pid, t), []).append((m, m + d))
                for v in syncs.values():
                    v.sort()
            s.seqs.append(seq)
            s.times.append(mono)
            s.shapes.append(shape(op, count, dtype, redop, peer))
            s.observed.append(_next_return(syncs_of[key].get((pid, tid)), mono))
    return streams


def _syncs(con, bundle, pid=None) -> dict:
    """(pid, tid) -> sorted (entry, return) of the image's synchronizations."""
    pred = row_predicate("cuda_events", bundle)
    apis = ", ".join(f"'{a}'" for a in SYNC_APIS)
    out: dict = {}
    for p, t, ts, dur in con.execute(
            "SELECT e.pid, e.tid, e.timestamp_ns, e.duration_ns FROM b.cuda_events e WHERE "
            f"e.api IN ({apis}) AND typeof(e.duration_ns) = 'integer' AND {pred}"
            + (" AND e.pid = ?" if pid is not None else ""),
            () if pid is None else (pid,)):
        out.setdefault((p, t), []).append((ts, ts + dur))
    for v in out.values():
        v.sort()
    return out


def _next_return(syncs: list | None, entry: int) -> int | None:
    """The return of the first synchronization that started at or after ``entry``."""
    if not syncs:
        return None
    i = bisect.bisect_left(syncs, (entry,))
    return syncs[i][1] if i < len(syncs) else None


def _read_known(con, pending: list) -> dict:
    """One stream per communicator whose init a capture saw (its rows carry the real
    comm_id_hash and seq): a late rank of it is numbered like its other ranks."""
    refs: dict = {}
    for item in pending:
        bundle = item["bundle"]
        pred = row_predicate("nccl_events", bundle)
        with attached(con, bundle.db_path, "b"):
            comms = con.execute(
                "SELECT e.comm_id_hash, MIN(e.pid), MAX(e.nranks) FROM b.nccl_events e WHERE "
                f"e.comm_id_hash IS NOT NULL AND typeof(e.seq) = 'integer' AND {pred} "
                "GROUP BY e.comm_id_hash").fetchall()
            for h, pid, nranks in comms:
                if h in refs:
                    continue
                s = refs[h] = Stream(item["node_id"], pid, 0, old=(h, 0))
                s.nranks = nranks
                syncs = _syncs(con, bundle, pid)
                for seq, ts, op, count, dtype, redop, peer, tid in con.execute(
                        "SELECT e.seq, e.timestamp_ns, e.op, e.count, e.datatype, e.redop, "
                        "e.peer, e.tid FROM b.nccl_events e WHERE e.comm_id_hash = ? AND "
                        f"e.pid = ? AND typeof(e.seq) = 'integer' AND {pred} ORDER BY e.seq",
                        (h, pid)):
                    if not s.seqs or seq != s.seqs[-1]:
                        s.seqs.append(seq)
                        s.times.append(ts)
                        s.shapes.append(shape(op, count, dtype, redop, peer))
                        s.observed.append(_next_return(syncs.get((pid, tid)), ts))
    return {(s.node_id, s.pid, ("known", h)): s for h, s in refs.items()}


def infer_late_attach(fl, pending: list) -> list[dict]:
    """Match the late streams of ``pending`` (bundles of this merge), rewrite their
    images with the inferred comm_id_hash, seq and (world communicator) rank, record the
    result in inferred_comms. Returns the pending items whose images changed (their sync
    points must be read again)."""
    con = fl.con
    known = {(n, p, h): (c, o, r, w) for n, p, h, c, o, r, w in con.execute(
        "SELECT node_id, pid, comm_handle, comm_id_hash, seq_offset, env_rank, "
        "env_world_size FROM inferred_comms")}
    streams = _read_streams(con, pending, known)
    if not streams:
        return []
    offsets, clocks = approximate_clocks(con)
    refs = _read_known(con, pending)
    for s in list(streams.values()) + list(refs.values()):
        off = offsets.get(s.node_id, 0)
        s.times = [t + off for t in s.times]
        s.observed = [None if t is None else t + off for t in s.observed]
    old = _read_old_groups(con, set(streams), known)
    for s in old.values():
        off = offsets.get(s.node_id, 0)
        s.times = [t + off for t in s.times]
        s.observed = [None if t is None else t + off for t in s.observed]
    refs.update(old)
    # a stream an earlier merge placed keeps its offset: numbered as it was then
    for s in streams.values():
        if s.old is not None:
            s.seqs = [q + s.old[1] for q in s.seqs]
    everything = list(refs.values()) + list(streams.values())
    groups, why_not = group_streams(everything, clocks)
    names = dict(con.execute("SELECT node_id, name FROM nodes"))

    plan: dict = {}      # key -> (comm_id_hash, seq_offset, rank, nranks)
    records = []
    ranks_now = []       # an earlier merge's rows whose world communicator is now complete
    for g in groups:
        members = list(g.members.values())
        if g.comm_id_hash is None:
            g.comm_id_hash = identity(names.get(g.ref.node_id, str(g.ref.node_id)),
                                      g.ref.pid, g.ref.handle)
            base = min(s.seqs[0] + off for s, off, _ in members)
        else:
            base = 1        # an earlier merge's numbering stays
        # the world communicator: one stream per rank of WORLD_SIZE (or a communicator
        # seen at init whose size is WORLD_SIZE), where the global rank is its rank
        late = [s for s, _, _ in members if s.nranks is None]
        size = g.ref.nranks or len(members)
        world = (all(s.world_size == size and s.rank is not None for s in late)
                 and len({s.rank for s in late}) == len(late)
                 and (g.ref.nranks is not None or len(members) == size))
        for s, off, m in members:
            rank, nranks = (s.rank, size) if world else (None, None)
            if s.nranks is not None:
                continue        # a stream with its init: nothing to write
            if s.key not in streams:
                if world:       # an earlier merge's rows: only their ranks may change
                    ranks_now.append((rank, nranks, g.comm_id_hash) + s.key)
                continue
            final = (s.old[1] if s.old else 0) + off - base + 1
            plan[s.key] = (g.comm_id_hash, final, rank, nranks)
            if m is not None:
                basis, detail = m.basis, m.detail
            elif s.old is not None:
                basis, detail = "earlier merge", "matched when its first bundle was merged"
            elif len(members) > 1:
                basis, detail = "reference", "the stream the others were matched to"
            else:
                basis = "alone"
                detail = why_not.get(s.key) or "no other stream of this shape to match"
            records.append((g.comm_id_hash, s.node_id, s.pid, s.handle, final, len(members),
                            rank, nranks, s.rank, s.world_size, len(s.seqs), basis, detail))
    with con:
        con.execute("DELETE FROM inferred_comms WHERE (node_id, pid, comm_handle) IN "
                    "(SELECT value ->> 0, value ->> 1, value ->> 2 FROM json_each(?))",
                    (_json_keys(plan),))
        con.executemany(
            "INSERT INTO inferred_comms (comm_id_hash, node_id, pid, comm_handle, seq_offset, "
            "streams, rank, nranks, env_rank, env_world_size, calls, basis, detail) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", records)
        con.executemany("UPDATE nccl_events SET rank = ?, nranks = ? WHERE comm_id_hash = ? "
                        "AND node_id = ? AND pid = ? AND comm_handle = ?", ranks_now)
        con.executemany("UPDATE inferred_comms SET rank = ?, nranks = ? WHERE "
                        "comm_id_hash = ? AND node_id = ? AND pid = ? AND comm_handle = ?",
                        ranks_now)
        groups_of = {}
        for g in groups:
            groups_of[g.comm_id_hash] = len(g.members)
        con.executemany("UPDATE inferred_comms SET streams = ? WHERE comm_id_hash = ?",
                        list((n, h) for h, n in groups_of.items()))
    changed = []
    for item in pending:
        node = item["node_id"]
        mine = {k: v for k, v in plan.items() if k[0] == node
                and item["bundle_id"] in streams[k].bundle_ids}
        if mine:
            _rewrite_image(item["bundle"].db_path, mine)
            changed.append(item)
    matched = sum(1 for r in records if r[5] > 1)
    fl.log("info" if matched == len(records) else "warning", "late_attach",
           f"{len(records)} NCCL call streams seen without their communicator's init "
           f"(capture attached after it): {matched} matched into "
           f"{len({r[0] for r in records if r[5] > 1})} inferred communicators, "
           f"{len(records) - matched} left alone (inferred_comms says why)",
           count=len(records))
    return changed


def _json_keys(plan: dict) -> str:
    import json
    return json.dumps([list(k) for k in plan])


def _rewrite_image(db_path, plan: dict) -> None:
    """Write the inferred identities into the merge's own copy of a bundle (hardened:
    no trigger stored in the file runs)."""
    import apsw

    from ..db import harden
    con = harden(apsw.Connection(str(db_path)))
    try:
        con.execute("PRAGMA journal_mode = OFF")
        con.execute("PRAGMA synchronous = OFF")
        with con:
            con.executemany(
                "UPDATE nccl_events SET comm_id_hash = ?, seq = handle_seq + ?, rank = ?, "
                "nranks = ? WHERE pid = ? AND comm_handle = ? AND comm_id_hash IS NULL "
                "AND typeof(handle_seq) = 'integer'",
                [(h, off, rank, nranks, pid, handle)
                 for (_, pid, handle), (h, off, rank, nranks) in plan.items()])
    finally:
        con.close()
