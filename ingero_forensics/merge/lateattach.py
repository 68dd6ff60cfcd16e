"""Communicators of a capture that attached after ncclCommInitRank: inferred by matching.

A capture started on a running job never saw the communicators being created, so its
collectives carry no comm_id_hash and no seq. Per process it still counts the calls on
each ncclComm_t from the attach (nccl_events.comm_handle, handle_seq). Those counters name
nothing across ranks: one rank's call 1 is another's call 4,017. What is certain is that
every rank of a communicator makes the same collectives in the same order, so two
streams of one communicator show the same sequence of shapes (op, count, datatype,
redop, root) once shifted by the right offset, at about the same time.

The matching, per pair (a group's member whose calls overlap the candidate's longest,
a candidate stream; docs/merge.md, late attach, has the worked example):

1. shapes: every offset at which the candidate's calls, sampled over their common span,
   have the member's shapes (point-to-point calls compare without their peer). A loop
   repeats its shapes every step, so this leaves one offset per step.
2. causality: every rank entered a collective before any rank observed its completion
   (the return of its first synchronization after its own entry). For each offset the
   pairs bound the shift between the two nodes' clocks from both sides; the clock
   samples say the shift is 0 within their stated error. The offset is taken when it
   is the only one whose causal shifts reach within that error of 0; none: no match.
3. time, only when causality allows several (no synchronization recorded after one
   side's calls): the nearest in time, and only when it is near (a straggler late by
   more than half a step is nearer the previous step's call).
4. clocks that claim no synchronization: the most causal, nearest offset, marked as a
   choice.

A process joins a communicator once at a time. Each group gets an identity (16 hex
digits from its first stream, stable across incremental merges; or the real
comm_id_hash where a capture saw the communicator's init) and seq numbers that agree
across its ranks: 1 at the earliest call any of them saw when it was first inferred (a
stream merged later that attached earlier starts below 1). The images (the merge's own
decompressed copies) are rewritten before the sync points and the collectives are read
from them, so the rest of the merge treats the inferred collectives like any other.
fleet.db's ``inferred_comms`` says, per stream, what was inferred, on what basis, and
why a stream could not be matched; the report marks the communicators. Global ranks
come from the processes' environment (RANK, WORLD_SIZE): a group with one stream per
rank of WORLD_SIZE is the world communicator, unless another group has the same
processes (look-alike communicators in lockstep are matched as one).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import statistics
from array import array
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
#: Beyond the clocks' stated error, how far an offset's causal shifts may lie from the
#: clock samples' estimate (the 1 % trim and a wake-up's latency)
CAUSAL_SLACK_NS = 1_000_000
#: The clocks' error assumed for two nodes whose samples claim synchronization but
#: carry no maxerror.
DEFAULT_SYNC_ERROR_NS = 10_000_000
_P2P = ("SEND", "RECV")
#: Stream.observed where no synchronization followed the call
NO_OBS = -(1 << 63)


@dataclass
class Stream:
    """One process's calls on one ncclComm_t, numbered from the attach."""
    node_id: int
    pid: int
    handle: int
    bundle_ids: set = field(default_factory=set)
    # per call, in counter order; arrays of int64 and interned shape tuples: a fleet's
    # late calls are millions (32 bytes each here, about 260 as Python objects)
    seqs: array = field(default_factory=lambda: array("q"))   # handle_seq (or final seq)
    times: array = field(default_factory=lambda: array("q"))  # approximate common time, ns
    shapes: list = field(default_factory=list)
    old: tuple | None = None      # (comm_id_hash, seq_offset): numbered already (a
    #                               communicator whose init was seen, or an earlier merge)
    rank: int | None = None       # from the environment
    world_size: int | None = None
    nranks: int | None = None     # a communicator whose init was seen: its size
    #: per call, the return of the process's first synchronization that started after
    #: the call's entry (same common time; NO_OBS where none): it ended after the
    #: collective completed, so after every rank's entry into it
    observed: array = field(default_factory=lambda: array("q"))
    #: CLOCK_MONOTONIC of its first call (names the capture run: a second capture on the
    #: same process counts from 1 again) and the raw span of this merge's rows
    first_mono: int = 0
    rows_span: tuple = (0, 0)
    last_handle_seq: int = 0
    clock_err: int | None = 0     # what its clock samples claim (place())

    def __post_init__(self):
        # lists (tests, callers) become arrays; None: no observation
        self.seqs = array("q", self.seqs)
        self.times = array("q", self.times)
        self.observed = array("q", (NO_OBS if o is None else o for o in self.observed))

    @property
    def key(self):
        return (self.node_id, self.pid, self.handle, self.first_mono)


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


@functools.lru_cache(maxsize=1 << 16)
def shape(op, count, datatype, redop, peer):
    """What every rank of a communicator passes alike (a p2p call's peer differs)."""
    if op in _P2P:
        return ("P2P", count, datatype)
    return (op, count, datatype, redop, peer)


def identity(node_name: str, pid: int, handle: int) -> str:
    """A stable 16-hex-digit name for a group, from its first stream."""
    return hashlib.sha256(f"inferred:{node_name}:{pid}:{handle}".encode()).hexdigest()[:16]


# ------------------------------------------------------------------ the clocks, roughly

def approximate_clocks(con) -> dict:
    """Per node, its clock samples as (mono, realtime - mono, claimed error or None),
    sorted: the nodes of one boot share the first one's (CLOCK_MONOTONIC is one clock
    there), and their relative error is 0. From fleet.db's clock samples and nodes."""
    per: dict[int, list] = {}
    boots: dict[int, str] = {}
    for node, boot, mono, off, sync, maxerr in con.execute(
            "SELECT c.node_id, n.boot_id, (c.mono_before_ns + c.mono_after_ns) / 2, "
            "c.realtime_ns - (c.mono_before_ns + c.mono_after_ns) / 2, c.synchronized, "
            "c.adj_maxerror_ns FROM clock_samples c JOIN nodes n USING (node_id) "
            "WHERE typeof(c.realtime_ns) = 'integer'"):
        boots[node] = boot
        err = (maxerr if isinstance(maxerr, int) and maxerr >= 0 else DEFAULT_SYNC_ERROR_NS) \
            if sync == 1 else None
        per.setdefault(node, []).append((mono, off, err))
    first_of_boot: dict[str, int] = {}
    samples = {}
    for node in sorted(per):
        samples[node] = sorted(per[first_of_boot.setdefault(boots[node], node)])
    per_boot = {}
    for b in boots.values():
        per_boot[b] = per_boot.get(b, 0) + 1
    return {"samples": samples, "boot": boots,
            "shared_boot": {n: per_boot[b] > 1 for n, b in boots.items()}}


def place(s: "Stream", clocks: dict) -> None:
    """Move a stream's times (and observations) from its node's CLOCK_MONOTONIC to the
    common time of the clock samples by one constant: CLOCK_MONOTONIC is smooth, so the
    causal bounds between two streams stay a shift. The constant is the median of the
    samples over the stream's span, and the error it claims the largest claim there plus
    the spread of those samples (a clock stepped during the span is off by the step for
    part of it). Streams of one boot share one constant: their relative error is 0."""
    samples = clocks["samples"].get(s.node_id)
    if not samples:
        s.clock_err = None
        return
    if clocks.get("shared_boot", {}).get(s.node_id):
        span = samples          # one clock for the whole boot: one constant
    else:
        monos = [m for m, _, _ in samples]
        lo = bisect.bisect_left(monos, s.times[0])
        hi = bisect.bisect_right(monos, s.times[-1])
        span = samples[max(lo - 1, 0):hi + 1]
    offs = [o for _, o, _ in span]
    off = statistics.median_low(offs)
    errs = [e for _, _, e in span]
    s.clock_err = None if None in errs else max(errs) + (max(offs) - min(offs))
    s.times = array("q", (t + off for t in s.times))
    s.observed = array("q", (t if t == NO_OBS else t + off for t in s.observed))


def pair_error(clocks: dict, a: "Stream", b: "Stream") -> int | None:
    """The error between two streams' common times: 0 on one boot, else the sum of what
    their samples claim; None when either claims nothing."""
    boot = clocks["boot"]
    if a.node_id in boot and boot.get(a.node_id) == boot.get(b.node_id):
        return 0
    ea, eb = getattr(a, "clock_err", None), getattr(b, "clock_err", None)
    return None if ea is None or eb is None else ea + eb


# ------------------------------------------------------------------ matching

def _common_sample(ref: Stream, cand: Stream, offset: int, index=None,
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
        q = cand.seqs[i] + offset
        j = bisect.bisect_left(ref.seqs, q)
        j = j if j < len(ref.seqs) and ref.seqs[j] == q else None
        if j is not None:
            out.append((j, i))
    return out


def match(ref: Stream, cand: Stream, clocks: dict, index: dict | None = None):
    """(Match, None) or (None, why not): the offset that puts ``cand`` on ``ref``'s
    numbering."""
    if not ref.seqs or not cand.seqs:
        return None, "no calls"
    err = pair_error(clocks, ref, cand)
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
    # A first look at 16 calls per offset, shapes and causality: only offsets that pass
    # go on, the most causal and then nearest in time first, to the full check on 256.
    # An offset with too few calls in common can be neither ruled out nor in: it keeps a
    # match from being called unique by shape.
    first, sparse = [], 0
    for j in tries:
        offset = ref.seqs[j] - s0
        pairs = _common_sample(ref, cand, offset, index, PRECHECK_CALLS)
        if len(pairs) < MIN_COMMON_CALLS:
            sparse += 1
            continue
        if any(ref.shapes[r] != cand.shapes[c] for r, c in pairs):
            continue
        dt = statistics.median_low([cand.times[c] - ref.times[r] for r, c in pairs])
        first.append((_excess(_distance(ref, cand, pairs), err), abs(dt), offset))
    shaped = len(first)
    found = []          # (distance, |median dt|, offset, median dt, calls, interval)
    for _, _, offset in sorted(first)[:FULL_CHECKS]:
        pairs = _common_sample(ref, cand, offset, index)
        if len(pairs) < MIN_COMMON_CALLS:
            continue
        if any(ref.shapes[r] != cand.shapes[c] for r, c in pairs):
            continue
        dt = statistics.median_low([cand.times[c] - ref.times[r] for r, c in pairs])
        dist, interval = _distance(ref, cand, pairs, with_interval=True)
        found.append((_excess(dist, err), abs(dt), offset, dt, len(pairs), interval))
    if not found:
        return None, ("no offset gives the same sequence of collectives (op, count, "
                      "datatype) as the others" + (" within 30 s" if err is not None else ""))
    found.sort()
    best = found[0]
    if err is None:
        if len(found) == 1 and shaped == 1 and not sparse:
            return Match(best[2], "shape", f"the only offset with the same shapes "
                                           f"({best[4]} calls compared; {_why(best)})"), None
        detail = (f"same shapes at {shaped} offsets; {_why(best)}; {best[4]} calls "
                  "compared")
        return Match(best[2], "nearest in time (unsynchronized clocks)",
                     detail + "; the clocks claim no synchronization, so this is a choice"), None
    # The clock samples place the candidate within err of the reference: an offset is
    # plausible when some shift its causality allows lies within err of 0, and an
    # offset whose causal shifts all lie further is impossible, however unique.
    plausible = [f for f in found if f[0] <= CAUSAL_SLACK_NS]
    if not plausible:
        return None, (f"no offset is causal on these clocks: the nearest, {_why(best)}, "
                      f"lies {best[0] / 1e6:.3f} ms beyond the clock error "
                      f"({err / 1e6:.3f} ms)")
    if len(found) == 1:
        if shaped == 1 and not sparse:
            return Match(best[2], "shape", f"the only offset with the same shapes "
                                           f"({best[4]} calls compared; {_why(best)})"), None
        return None, (f"one offset fits, but {sparse + shaped - 1} others have too few "
                      "calls in common to be ruled out")
    second = (plausible + [f for f in found if f not in plausible])[1]
    detail = (f"same shapes at {shaped} offsets (the loop repeats); "
              f"{_why(best)}; next {_why(second)}; {best[4]} calls compared; clock error "
              f"{err / 1e6:.3f} ms")
    if len(plausible) == 1:
        return Match(best[2], "shape+causality", detail), None
    plausible.sort(key=lambda f: f[1])
    best, second = plausible[0], plausible[1]
    if best[1] + 2 * err < second[1] / 3:
        # causality allows both (no synchronization recorded after one side's calls):
        # the nearest in time, only when it is near. A straggler late by L at a loop
        # of period P has the wrong call P - L away: nearest-in-time is wrong from
        # L > P/2 and taken here only below P/4.
        return Match(best[2], "shape+time", detail + "; no synchronization bounds it, "
                     "nearest in time by far"), None
    return None, detail + ": causality and the clocks' error cannot tell them apart"


def _excess(dist: float, err: int | None) -> float:
    """How far beyond the clocks' stated error an offset's causal shifts lie (its
    distance from the estimate itself where the clocks claim nothing)."""
    return dist if err is None else max(dist - err, 0)


def _distance(ref: Stream, cand: Stream, pairs, with_interval: bool = False):
    """How far the causal shifts of a pairing lie from the clock samples' estimate (0):
    0 when it is among them, inf when none exists."""
    lo, hi = feasible_shift(ref, cand, pairs)
    # two crystals drift apart over the calls compared: bounds that cross by less
    # than that are one shift, give or take the drift
    span = cand.times[pairs[-1][1]] - cand.times[pairs[0][1]]
    if lo > hi and lo - hi <= span * DRIFT_BOUND_PPM * 1e-6:
        lo, hi = hi, lo
    dist = max(lo, -hi, 0) if lo <= hi else float("inf")
    return (dist, (lo, hi)) if with_interval else dist


def feasible_shift(ref: Stream, cand: Stream, pairs) -> tuple[float, float]:
    """The shifts x of the candidate's clock (its times minus x) under which the pairing
    breaks no causality: each rank entered a collective before the other observed its
    completion. Unbounded where neither recorded a synchronization after its calls. The
    outermost 1 % of the bounds on each side is left out: a synchronization that did
    not wait on the collective's stream would make one bound too tight."""
    lows, highs = [], []
    for r, c in pairs:
        if ref.observed[r] != NO_OBS:     # cand entered before ref observed the end
            lows.append(cand.times[c] - ref.observed[r])
        if cand.observed[c] != NO_OBS:    # ref entered before cand observed the end
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
    each stream left alone, why. A stream is tried only on groups that share one of its
    shapes (no quadratic search over unrelated streams), against the member whose calls
    overlap its own the longest (an earlier merge's stream may have ended long ago)."""
    groups: list[Group] = []
    by_hash: dict[str, Group] = {}
    by_shape: dict = {}         # shape -> {id(group): group} of the groups having it
    offsets: dict = {}          # member key -> its offset to the group's numbering

    def add(g: Group, s: Stream, off: int, m) -> None:
        g.members[s.key] = (s, off, m)
        offsets[s.key] = off
        for sh in set(s.shapes):
            by_shape.setdefault(sh, {})[id(g)] = g

    for s in sorted((s for s in streams if s.old), key=lambda s: s.old[0]):
        g = by_hash.get(s.old[0])
        if g is None:
            g = by_hash[s.old[0]] = Group(ref=s, comm_id_hash=s.old[0])
            groups.append(g)
        add(g, s, 0, None)
    why_not: dict = {}
    fresh = sorted((s for s in streams if not s.old),
                   key=lambda s: (-len(s.seqs), s.node_id, s.pid, s.handle))
    tried: dict = {}
    for s in fresh:
        reasons = []
        if len(s.seqs) < MIN_COMMON_CALLS:    # nothing to compare (and no work for it)
            reasons.append(f"{len(s.seqs)} calls: too few to compare")
        candidates = [] if reasons else _groups_sharing_a_shape(s, by_shape)
        for g in candidates:
            # a process joins a communicator once at a time (another capture run of it
            # may follow its first)
            if any((m.node_id, m.pid) == (s.node_id, s.pid) and _overlap(m, s) >= 0
                   for m, _, _ in g.members.values()):
                continue
            other = max((m for m, _, _ in g.members.values()),
                        key=lambda m: _overlap(m, s))
            m, why = match(other, s, clocks)
            if m is not None:
                add(g, s, m.offset + offsets[other.key], m)
                break
            reasons.append(why)
            tried.setdefault(g.ref.key, why)    # the reference's side of the story
        else:
            g = Group(ref=s)
            add(g, s, 0, None)
            groups.append(g)
            if reasons:
                why_not[s.key] = reasons[0]
    for g in groups:
        if len(g.members) == 1 and g.ref.key not in why_not and g.ref.key in tried:
            why_not[g.ref.key] = tried[g.ref.key]
    return groups, why_not


def _groups_sharing_a_shape(s: Stream, by_shape: dict) -> list:
    out, seen = [], set()
    for sh in dict.fromkeys(s.shapes):
        for gid, g in by_shape.get(sh, {}).items():
            if gid not in seen:
                seen.add(gid)
                out.append(g)
    return out


def _overlap(a: Stream, b: Stream) -> int:
    return min(a.times[-1], b.times[-1]) - max(a.times[0], b.times[0])


# ------------------------------------------------------------------ reading and writing

def _late_columns(bundle) -> bool:
    return all(column_or_null(bundle, "nccl_events", c) != "NULL"
               for c in ("comm_handle", "handle_seq"))


#: A bundle image with a collective row a late capture recorded (no communicator hash,
#: its handle and counter instead); those that have none are not read again here.
HAS_LATE_ROWS_SQL = ("SELECT EXISTS (SELECT 1 FROM {schema}.nccl_events e WHERE e.comm_id_hash "
                     "IS NULL AND typeof(e.handle_seq) = 'integer' AND "
                     "typeof(e.comm_handle) = 'integer')")


def has_late_rows(con, bundle, schema: str = "b") -> bool:
    """Whether the image (``schema`` of con) holds rows _read_streams may take (asked
    by the helper threads of pass 1, so that the main thread does not scan every
    bundle's collectives for the few captures that attached late)."""
    return _late_columns(bundle) and bool(
        con.execute(HAS_LATE_ROWS_SQL.format(schema=schema)).fetchone()[0])


def _read_streams(con, pending: list, known: dict) -> dict:
    """The late streams of the bundles being merged, from their images (times raw). A
    process's calls on one handle are one stream per capture run: in time order, its
    counter only rises; where it does not (a new capture counting from 1 again, or a
    damaged bundle) a new stream begins."""
    per_handle: dict = {}       # (node, pid, handle) -> (ts, hseq, shapes, observed, bid)
    env_of: dict = {}
    for item in pending:
        bundle = item["bundle"]
        if not getattr(bundle, "late_rows", True) or not _late_columns(bundle):
            continue
        node = item["node_id"]
        pred = row_predicate("nccl_events", bundle)
        with attached(con, bundle.db_path, "b"):
            rows = con.execute(
                "SELECT e.pid, e.comm_handle, e.handle_seq, e.timestamp_ns, e.op, e.count, "
                "e.datatype, e.redop, e.peer, e.tid FROM b.nccl_events e WHERE "
                "e.comm_id_hash IS NULL AND typeof(e.handle_seq) = 'integer' AND "
                f"typeof(e.comm_handle) = 'integer' AND {pred}").fetchall()
            if not rows:
                continue
            syncs = _syncs(con, bundle)
            for pid, rank, ws in con.execute(
                    "SELECT pid, rank, world_size FROM b.processes WHERE "
                    "typeof(pid) = 'integer'"):
                if isinstance(rank, int) and isinstance(ws, int) and 0 <= rank < ws:
                    env_of[(node, pid)] = (rank, ws)
        for pid, handle, hseq, ts, op, count, dtype, redop, peer, tid in rows:
            cols = per_handle.get((node, pid, handle))
            if cols is None:
                cols = per_handle[(node, pid, handle)] = (
                    array("q"), array("q"), [], array("q"), array("q"))
            cols[0].append(ts)
            cols[1].append(hseq)
            cols[2].append(shape(op, count, dtype, redop, peer))
            cols[3].append(_next_return(syncs.get((pid, tid)), ts))
            cols[4].append(item["bundle_id"])
        del rows
    streams: dict = {}
    for (node, pid, handle), (ts, hseq, shapes, obs, bids) in per_handle.items():
        order = sorted(range(len(ts)), key=lambda i: (ts[i], hseq[i]))
        cuts = [k for k in range(1, len(order)) if hseq[order[k]] <= hseq[order[k - 1]]]
        for lo, hi in zip([0] + cuts, cuts + [len(order)]):
            run = order[lo:hi]
            first, last = run[0], run[-1]
            s = Stream(node, pid, handle, first_mono=ts[first],
                       rows_span=(ts[first], ts[last]), last_handle_seq=hseq[last])
            s.rank, s.world_size = env_of.get((node, pid), (None, None))
            for rec in known.get((node, pid, handle), ()):
                # an earlier merge's stream this run continues: its numbering stays
                if hseq[first] > rec["last_handle_seq"] and ts[first] >= rec["last_mono_ns"]:
                    s.old = (rec["comm_id_hash"], rec["seq_offset"])
                    s.first_mono = rec["first_mono_ns"]
                    break
            s.seqs = array("q", (hseq[i] for i in run))
            s.times = array("q", (ts[i] for i in run))
            s.shapes = [shapes[i] for i in run]
            s.observed = array("q", (obs[i] for i in run))
            s.bundle_ids = {bids[i] for i in run}
            streams[s.key] = s
    return streams


def _read_old_groups(con, new_keys: set, known: dict) -> dict:
    """The rows of streams an earlier merge matched (fleet.db), numbered by their
    final seq, with their synchronizations: references for the new streams."""
    streams: dict = {}
    syncs_of: dict = {}
    apis = ", ".join(f"'{a}'" for a in SYNC_APIS)
    by_hash: dict = {}
    for recs in known.values():
        for rec in recs:
            by_hash.setdefault(rec["comm_id_hash"], []).append(rec)
    for h, recs in sorted(by_hash.items()):
        for node, pid, handle, seq, mono, op, count, dtype, redop, peer, tid in con.execute(
                "SELECT node_id, pid, comm_handle, seq, mono_ns, op, count, datatype, "
                "redop, peer, tid FROM nccl_events WHERE comm_id_hash = ? ORDER BY seq", (h,)):
            rec = next((r for r in recs if (r["node_id"], r["pid"], r["comm_handle"]) ==
                        (node, pid, handle) and r["first_mono_ns"] <= mono <= r["last_mono_ns"]),
                       None)
            if rec is None:
                continue
            key = (node, pid, handle, rec["first_mono_ns"])
            if key in new_keys:
                continue
            s = streams.get(key)
            if s is None:
                s = streams[key] = Stream(node, pid, handle, old=(h, 0),
                                          first_mono=rec["first_mono_ns"])
                s.rank, s.world_size = rec["env_rank"], rec["env_world_size"]
                syncs = syncs_of[(node, pid)] = syncs_of.get((node, pid)) or {}
                if not syncs:
                    for t, m, d in con.execute(
                            f"SELECT tid, mono_ns, duration_ns FROM cuda_events WHERE "
                            f"node_id = ? AND pid = ? AND api IN ({apis}) AND "
                            "typeof(duration_ns) = 'integer'", (node, pid)):
                        syncs.setdefault((pid, t), []).append((m, m + d))
                    for v in syncs.values():
                        v.sort()
            s.seqs.append(seq)
            s.times.append(mono)
            s.shapes.append(shape(op, count, dtype, redop, peer))
            s.observed.append(_next_return(syncs_of[(node, pid)].get((pid, tid)), mono))
    return streams


def _sync_rows(con, bundle, pid=None):
    """(pid, tid, entry, return) of the attached image's synchronizations."""
    pred = row_predicate("cuda_events", bundle)
    apis = ", ".join(f"'{a}'" for a in SYNC_APIS)
    for p, t, ts, dur in con.execute(
            "SELECT e.pid, e.tid, e.timestamp_ns, e.duration_ns FROM b.cuda_events e WHERE "
            f"e.api IN ({apis}) AND typeof(e.duration_ns) = 'integer' AND {pred}"
            + (" AND e.pid = ?" if pid is not None else ""),
            () if pid is None else (pid,)).fetchall():
        yield p, t, ts, ts + dur


def _syncs(con, bundle, pid=None) -> dict:
    """(pid, tid) -> sorted (entry, return) of the image's synchronizations."""
    out: dict = {}
    for p, t, ts, end in _sync_rows(con, bundle, pid):
        out.setdefault((p, t), []).append((ts, end))
    for v in out.values():
        v.sort()
    return out


def _next_return(syncs: list | None, entry: int) -> int:
    """The return of the first synchronization that started at or after ``entry``
    (NO_OBS where none did)."""
    if not syncs:
        return NO_OBS
    i = bisect.bisect_left(syncs, (entry,))
    return syncs[i][1] if i < len(syncs) else NO_OBS


def _read_known(con, pending: list) -> dict:
    """One stream per communicator whose init a capture saw (its rows carry the real
    comm_id_hash and seq): a late rank of it is numbered like its other ranks. The
    stream is one process's rows of it, from every bundle of this merge and from
    fleet.db (an earlier merge may hold them)."""
    chosen: dict = {}        # comm_id_hash -> (node_id, pid, nranks)
    for item in pending:
        pred = row_predicate("nccl_events", item["bundle"])
        with attached(con, item["bundle"].db_path, "b"):
            for h, pid, nranks in con.execute(
                    "SELECT e.comm_id_hash, MIN(e.pid), MAX(e.nranks) FROM b.nccl_events e "
                    "WHERE e.comm_id_hash IS NOT NULL AND typeof(e.seq) = 'integer' AND "
                    f"{pred} GROUP BY e.comm_id_hash"):
                chosen.setdefault(h, (item["node_id"], pid, nranks))
    inferred = {h for (h,) in con.execute("SELECT DISTINCT comm_id_hash FROM inferred_comms")}
    for h, node, pid, nranks in con.execute(
            "SELECT comm_id_hash, node_id, pid, nranks FROM nccl_events WHERE rowid IN "
            "(SELECT MIN(rowid) FROM nccl_events WHERE comm_id_hash IS NOT NULL "
            "GROUP BY comm_id_hash)"):
        if h not in inferred:
            chosen.setdefault(h, (node, pid, nranks))
    apis = ", ".join(f"'{a}'" for a in SYNC_APIS)
    refs: dict = {}
    for h, (node, pid, nranks) in chosen.items():
        calls = {}           # seq -> (raw time, shape, observed)
        syncs: dict = {}
        for t, m, d in con.execute(
                f"SELECT tid, mono_ns, duration_ns FROM cuda_events WHERE node_id = ? AND "
                f"pid = ? AND api IN ({apis}) AND typeof(duration_ns) = 'integer'",
                (node, pid)):
            syncs.setdefault((pid, t), []).append((m, m + d))
        fleet_rows = con.execute(
            "SELECT seq, mono_ns, op, count, datatype, redop, peer, tid FROM nccl_events "
            "WHERE comm_id_hash = ? AND node_id = ? AND pid = ?", (h, node, pid)).fetchall()
        image_rows = []
        for item in pending:
            if item["node_id"] != node:
                continue
            bundle = item["bundle"]
            pred = row_predicate("nccl_events", bundle)
            with attached(con, bundle.db_path, "b"):
                image_rows += con.execute(
                    "SELECT e.seq, e.timestamp_ns, e.op, e.count, e.datatype, e.redop, "
                    "e.peer, e.tid FROM b.nccl_events e WHERE e.comm_id_hash = ? AND "
                    f"e.pid = ? AND typeof(e.seq) = 'integer' AND {pred}", (h, pid)).fetchall()
                for p_, t, ts, end in _sync_rows(con, bundle, pid):
                    syncs.setdefault((p_, t), []).append((ts, end))
        for v in syncs.values():
            v.sort()
        for seq, ts, op, count, dtype, redop, peer, tid in fleet_rows + image_rows:
            if isinstance(seq, int) and seq not in calls:
                calls[seq] = (ts, shape(op, count, dtype, redop, peer),
                              _next_return(syncs.get((pid, tid)), ts))
        if not calls:
            continue
        s = Stream(node, pid, 0, old=(h, 0), first_mono=-1)
        s.handle = ("known", h)
        s.nranks = nranks
        for seq in sorted(calls):
            ts, sh, obs = calls[seq]
            s.seqs.append(seq)
            s.times.append(ts)
            s.shapes.append(sh)
            s.observed.append(obs)
        refs[s.key] = s
    return refs


def infer_late_attach(fl, pending: list) -> list[dict]:
    """Match the late streams of ``pending`` (bundles of this merge), rewrite their
    images with the inferred comm_id_hash, seq and (world communicator) rank, record the
    result in inferred_comms. Returns the pending items whose images changed (their sync
    points must be read again)."""
    con = fl.con
    known: dict = {}
    cols = ("comm_id_hash", "node_id", "pid", "comm_handle", "first_mono_ns", "last_mono_ns",
            "last_handle_seq", "seq_offset", "env_rank", "env_world_size")
    for row in con.execute(f"SELECT {', '.join(cols)} FROM inferred_comms"):
        rec = dict(zip(cols, row))
        known.setdefault((rec["node_id"], rec["pid"], rec["comm_handle"]), []).append(rec)
    streams = _read_streams(con, pending, known)
    if not streams:
        return []
    clocks = approximate_clocks(con)
    refs = _read_known(con, pending)
    refs.update(_read_old_groups(con, set(streams), known))
    for s in list(streams.values()) + list(refs.values()):
        place(s, clocks)
    # a stream an earlier merge placed keeps its offset: numbered as it was then
    for s in streams.values():
        if s.old is not None:
            s.seqs = array("q", (q + s.old[1] for q in s.seqs))
    groups, why_not = group_streams(list(refs.values()) + list(streams.values()), clocks)
    names = dict(con.execute("SELECT node_id, name FROM nodes"))
    # communicators whose calls look alike in lockstep (the data-parallel groups of a 2-D
    # layout) are matched as one, with one stream per process: two groups over the same
    # processes say so, and then neither is taken for the world communicator
    same_procs: dict = {}
    for g in groups:
        if len(g.members) > 1:
            same_procs.setdefault(frozenset(g.processes()), []).append(g)

    plan: dict = {}      # key -> (comm_id_hash, seq_offset, rank, nranks, rows span)
    records = []
    ranks_now = []       # an earlier merge's rows whose world communicator is now complete
    for g in groups:
        members = list(g.members.values())
        if g.comm_id_hash is None:
            g.comm_id_hash = identity(names.get(g.ref.node_id, str(g.ref.node_id)),
                                      g.ref.pid, g.ref.handle)
            base = min(s.seqs[0] + off for s, off, _ in members)
        else:
            base = 1        # an earlier merge's (or the init's) numbering stays
        seen_at_init = g.ref.nranks is not None
        late = [s for s, _, _ in members if s.nranks is None]
        twins = len(same_procs.get(frozenset(g.processes()), ())) > 1
        # the world communicator: one stream per rank of WORLD_SIZE (or a communicator
        # seen at init whose size is WORLD_SIZE), where the global rank is its rank
        size = g.ref.nranks if seen_at_init else len(members)
        world = (not twins and all(s.world_size == size and s.rank is not None for s in late)
                 and len({s.rank for s in late}) == len(late))
        for s, off, m in members:
            rank, nranks = (s.rank, size) if world else (None, None)
            if s.nranks is not None:
                continue        # a stream with its init: nothing to write
            if s.key not in streams:
                if world:       # an earlier merge's rows: only their ranks may change
                    ranks_now.append((rank, nranks, g.comm_id_hash) + s.key[:3])
                continue
            final = (s.old[1] if s.old else 0) + off - base + 1
            plan[s.key] = (g.comm_id_hash, final, rank, nranks, s.rows_span)
            if m is not None:
                basis, detail = m.basis, m.detail
                if seen_at_init:
                    detail = (f"joined communicator {g.comm_id_hash}, whose init a capture "
                              f"saw; " + detail)
            elif s.old is not None:
                basis, detail = "earlier merge", "matched when its first bundle was merged"
            elif len(members) > 1:
                basis, detail = "reference", "the stream the others were matched to"
            else:
                basis = "alone"
                detail = why_not.get(s.key) or "no other stream of this shape to match"
            if twins:
                detail += ("; another inferred communicator has the same processes (alike "
                           "calls in lockstep are matched as one): ranks not assigned")
            records.append({
                "comm_id_hash": g.comm_id_hash, "node_id": s.node_id, "pid": s.pid,
                "comm_handle": s.handle, "first_mono_ns": s.first_mono,
                "last_mono_ns": s.rows_span[1], "last_handle_seq": s.last_handle_seq,
                "seq_offset": final, "streams": len(late), "rank": rank, "nranks": nranks,
                "env_rank": s.rank, "env_world_size": s.world_size, "calls": len(s.seqs),
                "basis": basis, "detail": detail})
    with con:
        for r in records:
            con.execute("DELETE FROM inferred_comms WHERE node_id = ? AND pid = ? AND "
                        "comm_handle = ? AND first_mono_ns = ?",
                        (r["node_id"], r["pid"], r["comm_handle"], r["first_mono_ns"]))
        if records:
            names_ = ", ".join(records[0])
            marks = ", ".join(f":{k}" for k in records[0])
            con.executemany(f"INSERT INTO inferred_comms ({names_}) VALUES ({marks})", records)
        con.executemany("UPDATE nccl_events SET rank = ?, nranks = ? WHERE comm_id_hash = ? "
                        "AND node_id = ? AND pid = ? AND comm_handle = ?", ranks_now)
        con.executemany("UPDATE inferred_comms SET rank = ?, nranks = ? WHERE "
                        "comm_id_hash = ? AND node_id = ? AND pid = ? AND comm_handle = ?",
                        ranks_now)
        con.executemany("UPDATE inferred_comms SET streams = ? WHERE comm_id_hash = ?",
                        [(sum(1 for s, _, _ in g.members.values() if s.nranks is None),
                          g.comm_id_hash) for g in groups])
    changed = []
    for item in pending:
        mine = {k: v for k, v in plan.items()
                if k[0] == item["node_id"] and item["bundle_id"] in streams[k].bundle_ids}
        if mine:
            _rewrite_image(item["bundle"].db_path, mine,
                           in_flight="calls_in_flight" not in item["bundle"].absent_tables
                           and column_or_null(item["bundle"], "calls_in_flight",
                                              "handle_seq") != "NULL")
            changed.append(item)
    alone = sum(1 for r in records if r["basis"] == "alone")
    joined = {r["comm_id_hash"] for r in records if r["basis"] != "alone"}
    fl.log("info" if not alone else "warning", "late_attach",
           f"{len(records)} NCCL call streams seen without their communicator's init "
           f"(capture attached after it): {len(records) - alone} matched into "
           f"{len(joined)} communicators, {alone} left alone (inferred_comms says why)",
           count=len(records))
    return changed


def _rewrite_image(db_path, plan: dict, in_flight: bool = False) -> None:
    """Write the inferred identities into the merge's own copy of a bundle (hardened:
    no trigger stored in the file runs); with ``in_flight``, also into its calls still
    open at a seal or the stop (entered after the run's last completed call, so the span
    of a run reaches up to the next run's first call)."""
    import apsw

    from ..db import harden
    con = harden(apsw.Connection(str(db_path)))
    try:
        con.execute("PRAGMA journal_mode = OFF")
        con.execute("PRAGMA synchronous = OFF")
        with con:
            # one capture run of the handle: its rows' time span (another run of the same
            # process and handle counts from 1 again, at other times)
            con.executemany(
                "UPDATE nccl_events SET comm_id_hash = ?, seq = handle_seq + ?, rank = ?, "
                "nranks = ? WHERE pid = ? AND comm_handle = ? AND comm_id_hash IS NULL "
                "AND typeof(handle_seq) = 'integer' AND timestamp_ns BETWEEN ? AND ?",
                [(h, off, rank, nranks, pid, handle, lo, hi)
                 for (_, pid, handle, _), (h, off, rank, nranks, (lo, hi)) in plan.items()])
            if in_flight:
                starts: dict = {}
                for (_, pid, handle, _), (*_, (lo, _hi)) in plan.items():
                    starts.setdefault((pid, handle), []).append(lo)
                rows = []
                for (_, pid, handle, _), (h, off, rank, nranks, (lo, _hi)) in plan.items():
                    later = [x for x in starts[(pid, handle)] if x > lo]
                    rows.append((h, off, rank, nranks, pid, handle, lo,
                                 min(later) - 1 if later else (1 << 62)))
                con.executemany(
                    "UPDATE calls_in_flight SET comm_id_hash = ?, seq = handle_seq + ?, "
                    "rank = ?, nranks = ? WHERE pid = ? AND comm_handle = ? AND "
                    "comm_id_hash IS NULL AND typeof(handle_seq) = 'integer' AND "
                    "timestamp_ns BETWEEN ? AND ?", rows)
    finally:
        con.close()
