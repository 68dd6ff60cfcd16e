"""Clock-skew alignment: map every node's CLOCK_MONOTONIC to one fleet time (UTC ns).

The model (docs/merge.md, shared with the simulator): true UTC is linear in a node's
monotonic clock, ``true = B + mono / (1 + d)``. So each node gets a line
``aligned = offset + mono + round(mono * slope)``, estimated in three steps:

1. Clock samples alone (per node): CLOCK_REALTIME - CLOCK_MONOTONIC is constant between
   NTP steps; split it into segments at steps and take a weighted median over samples,
   weighted by the node's own error estimate. Slope 0 (drift is not observable here:
   realtime and monotonic tick at the same rate).
2. Collectives (per component of nodes sharing communicators): *tight* observed
   completions of the same (comm_id_hash, seq) (syncpoints.py: nothing substantial was
   queued between the collective and the synchronization) are the same true instant on
   every rank, give or take the wake-up. For each edge of the node graph a robust line
   fit (bin medians) of the difference of observations against time gives a relative
   offset and rate; a weighted least-squares solve over the whole graph (edges checked
   against the solution, outliers down-weighted) gives every node's correction. Entry
   times never estimate anything.
3. The common mode of a component (one offset and one rate for all its nodes: collectives
   cannot see it) comes from all its nodes' clock samples (robust weighted fit), and the
   absolute uncertainty is the worst case over all lines consistent with the honest claims
   (adjtimex maxerror ...) of the component's samples. Claims that cannot all hold at
   once reveal a lying time service: the node with the largest excess is flagged and its
   claims dropped until the rest is consistent.
4. Causal bounds (causal.py): every entry into a full-dependency collective precedes
   every observation of its completion, tight or not. A line that breaks these
   inequalities is moved as little as needed; the room left on either side is the
   relative uncertainty of a node that no tight observation pins. A rate beyond
   DRIFT_BOUND_PPM is clamped and reported, never applied silently.

Pure Python on purpose: the systems are 2 x nodes in size.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .causal import CausalSystem, message_bounds, project_messages
from .fitting import (bin_constraints, error_bound, median, robust_line, solve_graph,
                      t_quantile, weighted_median)

#: A jump of CLOCK_REALTIME - CLOCK_MONOTONIC larger than this between consecutive
#: samples is an NTP step (slewing changes it by at most 500 ppm x the sample interval).
STEP_THRESHOLD_NS = 1_000_000
#: Unknown error of a sample with no claim (unsynchronized clock, no adjtimex data).
UNKNOWN_ERROR_NS = 1_000_000_000
#: Prior bound on any clock's rate error, for the worst-case uncertainty (crystals are
#: specified to about +-100 ppm; this leaves room).
DRIFT_BOUND_PPM = 200.0
#: Prior on the common-mode rate correction of a component (ppb) in the robust fit.
COMMON_RATE_PRIOR_PPB = 20_000.0
#: An edge needs this many shared observed completions to link two nodes.
MIN_EDGE_OBS = 3
#: Clock condition: an observed completion is at least this long after the last entry.
MIN_LATENCY_NS = 1_000
#: A node whose clock samples claim an error below this (ns: PTP) keeps its line inside
#: its message bounds; the others are centred in them (CausalSystem._centre).
CENTRE_CLAIM_NS = 50_000
#: A TCP send/receive pair that contradicts two lines the collectives placed by more
#: than their relative uncertainties plus this (ns) is refused (align._apply_messages).
MESSAGE_REFUSE_NS = 1_000_000
#: The confidence of a fit's precision (fit_precision_ns): 3 standard errors of a
#: normal, Student's t for the few sync points a short job has.
FIT_CONFIDENCE = 0.9973


@dataclass
class ClockSample:
    mid: int                 # bracket midpoint, CLOCK_MONOTONIC ns
    realtime: int            # CLOCK_REALTIME ns
    half_bracket: int        # read uncertainty / 2
    claim: int | None        # claimed max error of realtime (ns), None if none claimed
    est: int | None          # estimated error (ns), for weights


@dataclass
class NodeInput:
    node_id: int
    samples: list[ClockSample] = field(default_factory=list)
    #: (utc_ns, mono_ns) capture start/end pairs of the manifests: the last resort
    manifest_pairs: list[tuple[int, int]] = field(default_factory=list)
    #: nodes with the same clock key read one CLOCK_MONOTONIC (one kernel: the same
    #: boot_id, e.g. containers or network namespaces of one host) and get one line
    clock_key: object = None


@dataclass
class NodeAlignment:
    node_id: int
    method: str
    offset_ns: int
    slope: float
    drift_ppm: float
    uncertainty_ns: int | None
    relative_uncertainty_ns: int | None
    component: int | None
    sync_points: int
    sync_points_used: int
    residual_ns: int | None
    clock_samples: int
    steps: int
    claimed_error_ns: int | None
    max_correction_ns: int | None
    exceeds_claim: bool
    segments: list[dict]
    pre_offset_ns: int        # clock-sample-only offset (slope 0): violations_before
    violations_before: int = 0
    violations_after: int = 0
    #: how far the line could move earlier / later and still satisfy every causal
    #: constraint (others fixed); None: nothing bounds it on that side
    causal_early_ns: int | None = None
    causal_late_ns: int | None = None
    causal_moved_ns: int = 0      # how far the causal bounds moved it (0: not at all)
    message_pairs: int = 0        # TCP send/receive pairs with other clocks (messages.py)
    messages_refused: int = 0     # ... that contradicted its collectives: not used
    #: the collectives fit's relative uncertainty, before anything moved the line (not
    #: stored: what the causal step compares a node's room with)
    fit_relative_ns: int | None = None
    #: how far from the truth the noise of its sync points alone may leave the fit's
    #: line at the ends of their span (1 us plus FIT_CONFIDENCE's t quantile times the
    #: line's standard error there; not stored): a move by causality beyond it is more
    #: than that noise explains (_bound_by_messages)
    fit_precision_ns: float = math.inf
    rate_clamped: bool = False    # its fitted rate exceeded the bound and was clamped
    #: how far the clamped line leaves the fitted one at the ends of the node's data, from
    #: its middle (not stored): a bound found later among lines of the clamped rate, at
    #: the times its constraints hold, widens by twice that over the whole capture (the
    #: rate difference times the capture's length: the constraints may sit at one end)
    clamp_departure_ns: int = 0

    def aligned(self, mono: int) -> int:
        return self.offset_ns + mono + round(mono * self.slope)


# ------------------------------------------------------------------ step 1: one node

def sample_sigma(s: ClockSample) -> float:
    e = s.est if s.est is not None else s.claim
    if e is None:
        e = UNKNOWN_ERROR_NS
    return float(max(e, s.half_bracket, 1000))


def clock_segments(samples: list[ClockSample]) -> tuple[list[list[ClockSample]], int]:
    """Split samples (sorted by mid) into segments of constant realtime - mono.

    Steps are found on the tight samples only (bracket within 10x the tightest, e.g. the
    sub-us clock_gettime brackets): a wide one (a chronyc call of ~1 ms) would otherwise
    raise the threshold above the step it should reveal. Wide samples then join the
    segment they fall in, or, between two segments, the one whose offset they match."""
    if not samples:
        return [], 0
    tight_hb = 10 * max(min(s.half_bracket for s in samples), 1)
    tight = [s for s in samples if s.half_bracket <= tight_hb]
    thresh = max(STEP_THRESHOLD_NS, 10 * max(s.half_bracket for s in tight))
    segs = [[tight[0]]]
    for prev, s in zip(tight, tight[1:]):
        if abs((s.realtime - s.mid) - (prev.realtime - prev.mid)) > thresh:
            segs.append([s])
        else:
            segs[-1].append(s)
    if len(tight) < len(samples):
        for s in samples:
            if s.half_bracket <= tight_hb:
                continue
            k = 0
            while k + 1 < len(segs) and segs[k + 1][0].mid <= s.mid:
                k += 1
            if k + 1 < len(segs) and s.mid > segs[k][-1].mid:
                off = s.realtime - s.mid
                nxt = segs[k + 1][0].realtime - segs[k + 1][0].mid
                cur = segs[k][-1].realtime - segs[k][-1].mid
                if abs(off - nxt) < abs(off - cur):
                    k += 1
            segs[k].append(s)
        for seg in segs:
            seg.sort(key=lambda s: s.mid)
    return segs, len(segs) - 1


def fit_clock_samples(samples: list[ClockSample]) -> int | None:
    """The clock-sample-only offset: realtime - mono, weighted median (weights 1/sigma^2)."""
    if not samples:
        return None
    return round(weighted_median([(s.realtime - s.mid, 1.0 / sample_sigma(s) ** 2)
                                  for s in samples]))


def describe_segments(segs) -> list[dict]:
    out = []
    for seg in segs:
        claims = [s.claim for s in seg if s.claim is not None]
        out.append({"mono_start_ns": seg[0].mid, "mono_end_ns": seg[-1].mid,
                    "samples": len(seg),
                    "offset_ns": round(median([s.realtime - s.mid for s in seg])),
                    "claimed_error_ns": round(median(claims)) if claims else None})
    return out


# --------------------------------------------------------------------------- the solve

#: (collective key, full dependency?, [(node_id, latest entry, earliest observed
#: completion, earliest tight observation)]), raw CLOCK_MONOTONIC ns or None.
Groups = Callable[[], Iterable[tuple[object, bool, list[tuple[int, int | None, int | None,
                                                               int | None]]]]]


#: (connection, sending node, send raw ns, receiving node, receive raw ns) of TCP
#: messages (messages.message_pairs).
Messages = Iterable[tuple[int, int, int, int, int]]
#: connection -> (sending node, its establishment raw ns, receiving node, its raw ns,
#: whether each end's capture attached to the connection established: its time is then
#: when it first saw the connection, an upper bound on the establishment)
Connections = dict[int, tuple[int, int, int, int, bool, bool]]
#: Pairs per sending node, receiving node and time bin the causal steps keep (the
#: tightest of each), bins at most PAIR_BIN_MAX_S wide.
PAIR_BINS = 64
PAIR_BIN_MAX_S = 30.0


def align_fleet(nodes: dict[int, NodeInput], groups: Groups,
                min_latency_ns: int = MIN_LATENCY_NS, messages: Messages = (),
                connections: Connections | None = None) -> dict[int, NodeAlignment]:
    """Align every node. ``groups()`` yields one tuple per sampled collective (see
    Groups), freshly each call (it is streamed several times). ``messages`` and
    ``connections`` (messages.message_pairs): TCP sends each before its receive on
    another node, causal bounds like the collectives', usually far tighter.

    Nodes that share a clock (NodeInput.clock_key: one kernel, one CLOCK_MONOTONIC) are
    aligned as one clock: their samples pooled, their observations one clock's (the
    latest entry, the earliest observations), and each gets that clock's line. Their
    relative offset is exactly 0, which no estimate from collectives could match."""
    rep_of: dict[int, int] = {}
    first: dict[object, int] = {}
    for nid in sorted(nodes):
        key = nodes[nid].clock_key
        rep_of[nid] = nid if key is None else first.setdefault(key, nid)
    if all(r == n for n, r in rep_of.items()):
        return _align_clocks(nodes, groups, min_latency_ns, messages, connections or {})
    clocks = {r: NodeInput(r) for r in set(rep_of.values())}
    for nid, ni in nodes.items():
        clocks[rep_of[nid]].samples.extend(ni.samples)
        clocks[rep_of[nid]].manifest_pairs.extend(ni.manifest_pairs)

    def clock_groups():
        # per clock: the latest entry and the earliest observation (the causal bounds'
        # extremes), and the median of its nodes' tight observations: a node alone is
        # compared with the typical member of a group, not with its luckiest wake-up
        for key, full, obs in groups():
            per: dict[int, list] = {}
            for nid, e, sv, t in obs:
                c = per.setdefault(rep_of[nid], [None, None, []])
                if e is not None and (c[0] is None or e > c[0]):
                    c[0] = e
                if sv is not None and (c[1] is None or sv < c[1]):
                    c[1] = sv
                if t is not None:
                    c[2].append(t)
            yield key, full, [(r, e, sv, round(median(ts)) if ts else None)
                              for r, (e, sv, ts) in sorted(per.items())]

    # a message within one clock says nothing about clocks
    per_clock = _align_clocks(
        clocks, clock_groups, min_latency_ns,
        [(c, rep_of[i], s, rep_of[j], r) for c, i, s, j, r in messages
         if rep_of[i] != rep_of[j]],
        {c: (rep_of[i], si, rep_of[j], sj, *attached)
         for c, (i, si, j, sj, *attached) in (connections or {}).items()
         if rep_of[i] != rep_of[j]})
    out = {}
    for nid in nodes:
        a = per_clock[rep_of[nid]]
        out[nid] = dataclasses.replace(a, node_id=nid, segments=list(a.segments))
        if len(per_clock) == 1:
            # one clock for the whole fleet: relative to each other, exact
            out[nid].relative_uncertainty_ns = 0
            out[nid].causal_early_ns = out[nid].causal_late_ns = 0
    return out


def _align_clocks(nodes: dict[int, NodeInput], groups: Groups, min_latency_ns: int,
                  messages: Messages = (), connections: Connections | None = None
                  ) -> dict[int, NodeAlignment]:
    """align_fleet for distinct clocks (one node each)."""
    # Step 1 ------------------------------------------------------------------------
    pre: dict[int, int] = {}
    seg_info: dict[int, tuple[list[dict], int]] = {}
    method: dict[int, str] = {}
    for nid, ni in nodes.items():
        ni.samples.sort(key=lambda s: s.mid)
        segs, steps = clock_segments(ni.samples)
        seg_info[nid] = (describe_segments(segs), steps)
        off = fit_clock_samples(ni.samples)
        if off is not None:
            pre[nid] = off
            method[nid] = "clock_samples"
        elif ni.manifest_pairs:
            pre[nid] = round(median([u - m for u, m in ni.manifest_pairs]))
            method[nid] = "manifest"
        else:
            pre[nid] = 0
            method[nid] = "manifest"

    # Step 2: edges -------------------------------------------------------------------
    t_ref = None
    edges: dict[tuple[int, int], tuple[array, array]] = {}
    for _key, _full, obs in groups():
        per_node: dict[int, int] = {nid: t for nid, _e, _s, t in obs
                                    if t is not None and nid in pre}
        if len(per_node) < 2:
            continue
        ids = sorted(per_node)
        if t_ref is None:
            t_ref = per_node[ids[0]] + pre[ids[0]]
        # relative to t_ref before any float arithmetic: UTC ns do not fit a double exactly
        u = {nid: float(per_node[nid] + pre[nid] - t_ref) for nid in ids}
        # A ring over the members (a chain for two): O(k) edges per collective, every
        # member linked twice, no hub node.
        pairs = list(zip(ids, ids[1:]))
        if len(ids) > 2:
            pairs.append((ids[0], ids[-1]))
        for i, j in pairs:
            xs, ds = edges.setdefault((i, j), (array("d"), array("d")))
            xs.append(u[i] / 1e9)
            ds.append(u[i] - u[j])
    fits = {}
    for (i, j), (xs, ds) in edges.items():
        if len(xs) < MIN_EDGE_OBS:
            continue
        a, b, scale, used = robust_line(xs, ds)
        cx = sum(xs) / len(xs)
        sx = math.sqrt(sum((x - cx) ** 2 for x in xs) / len(xs)) if len(xs) > 1 else 0.0
        fits[(i, j)] = (a, b, max(scale, 100.0), used, cx, sx)
    edges.clear()

    # components (union-find over fitted edges)
    parent = {nid: nid for nid in nodes}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    for i, j in fits:
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    comps: dict[int, list[int]] = {}
    for nid in nodes:
        comps.setdefault(find(nid), []).append(nid)

    rel: dict[int, tuple[float, float]] = {nid: (0.0, 0.0) for nid in nodes}  # x ns, y ns/s
    comp_of: dict[int, int | None] = {nid: None for nid in nodes}
    for root, members in comps.items():
        if len(members) < 2:
            continue
        cedges = {e: f for e, f in fits.items() if e[0] in members}
        sol = solve_graph(sorted(members), cedges)
        for nid in members:
            rel[nid] = sol[nid]
            comp_of[nid] = min(members)
            method[nid] = "collectives"

    # Final pass over the observations: residuals, used flags, per-node statistics.
    def rel_time(nid, mono):
        u = mono + pre[nid] - (t_ref or 0)
        x, y = rel[nid]
        return u + x + y * u / 1e9

    node_res: dict[int, array] = {nid: array("d") for nid in nodes}
    span: dict[int, list[float]] = {}          # first and last tight observation, s
    for _key, _full, obs in groups():
        mem = [(nid, rel_time(nid, t)) for nid, _e, _s, t in obs
               if t is not None and comp_of.get(nid) is not None]
        for nid, t in mem:
            sp = span.setdefault(nid, [t / 1e9, t / 1e9])
            sp[0], sp[1] = min(sp[0], t / 1e9), max(sp[1], t / 1e9)
        comps_here = {comp_of[n] for n, _ in mem}
        for c in comps_here:
            vals = [(n, t) for n, t in mem if comp_of[n] == c]
            if len({n for n, _ in vals}) < 2:
                continue
            med = median([t for _, t in vals])
            for n, t in vals:
                node_res[n].append(t - med)

    # Step 3: common mode and bounds, per component ------------------------------------
    result: dict[int, NodeAlignment] = {}
    stats = {}
    for nid in nodes:
        r = node_res[nid]
        if len(r):
            s = 1.4826 * median([abs(v) for v in r])
            cut = max(5 * s, 20_000.0)
            used = sum(1 for v in r if abs(v) <= cut)
            stats[nid] = (len(r), used, s)
        else:
            stats[nid] = (0, 0, None)
    for root, members in comps.items():
        comp = comp_of[members[0]]
        rel_unc, precision = {}, {}
        for nid in members:
            n, used, s = stats[nid]
            if comp is None or not used:
                rel_unc[nid] = None
            else:
                rel_unc[nid] = 1000.0 + 3.0 * (s or 0.0) / math.sqrt(used) + 3.0 * (s or 0.0)
                # at the ends of its sync points, where a move is measured: a line's
                # standard error there is twice its middle's (points spread evenly);
                # Student's t, the spread being estimated from the same few residuals
                precision[nid] = math.inf if used <= 2 else 1000.0 + t_quantile(
                    FIT_CONFIDENCE, used - 2) * 2.0 * (s or 0.0) / math.sqrt(used)
        if comp is not None:
            _keep_consistent_priors(members, rel, rel_unc, span)
        common, bound, liars = _common_mode(members, nodes, pre, rel, t_ref, rel_unc)
        for nid in members:
            x, y = rel[nid]
            alpha, beta = common
            X, Y = x + alpha, (y + beta) * 1e-9
            tr = t_ref or 0
            offset_i = pre[nid] + round(X + Y * (pre[nid] - tr))
            slope = Y
            segs, steps = seg_info[nid]
            samples = nodes[nid].samples
            claims = [s.claim for s in samples if s.claim is not None]
            corr = [abs(s.realtime - (offset_i + s.mid + round(s.mid * slope))) for s in samples]
            n, used, sres = stats[nid]
            unc = None
            if bound is not None:
                unc = bound + (rel_unc[nid] or 0.0)
            if method[nid] == "manifest":
                unc = None
            result[nid] = NodeAlignment(
                node_id=nid, method=method[nid], offset_ns=offset_i, slope=slope,
                drift_ppm=((1.0 / (1.0 + slope)) - 1.0) * 1e6 if method[nid] == "collectives" else 0.0,
                uncertainty_ns=None if unc is None else math.ceil(unc),
                relative_uncertainty_ns=None if rel_unc[nid] is None else math.ceil(rel_unc[nid]),
                fit_precision_ns=precision.get(nid, math.inf),
                component=comp, sync_points=n, sync_points_used=used,
                residual_ns=None if sres is None else round(sres),
                clock_samples=len(samples), steps=steps,
                claimed_error_ns=round(median(claims)) if claims else None,
                max_correction_ns=max(corr) if corr else None,
                exceeds_claim=nid in liars, segments=segs, pre_offset_ns=pre[nid])
    _clamp_rates(result)
    for a in result.values():
        if a.method == "collectives":
            a.fit_relative_ns = a.relative_uncertainty_ns
            # (the first clamp's departure, in the bound above, is the precision's too)
            a.fit_precision_ns += a.clamp_departure_ns
    messages = _apply_messages(result, nodes, messages, connections or {}, min_latency_ns)
    # the messages' projection moves rates too, with no bound of its own
    _clamp_rates(result)
    _apply_causal(result, nodes, groups, min_latency_ns, messages)
    _bound_by_messages(result, nodes, messages, min_latency_ns)
    return result


def _keep_consistent_priors(members, rel, rel_unc, span) -> None:
    """The clock-sample line stays where the tight observations do not contradict it.

    The fit's corrections (rel: x ns, y ns/s, in an arbitrary common gauge) are
    re-gauged on their median, so one broken clock cannot shift the others; a node whose
    clock-sample line lies within its fit's uncertainty band at both ends of its data
    keeps that line (correction 0 in this gauge): nothing in the collectives says it is
    wrong, and its clock samples may be better than the observations (same-host
    clocks, PTP). A node outside its band is proven wrong and takes the fit. The common
    mode (step 3) then moves every line of the component alike."""
    mids = {n: rel[n][0] + rel[n][1] * (span[n][0] + span[n][1]) / 2
            for n in members if n in span}
    if len(mids) < 2:
        return
    g = -median(mids.values())
    for n in mids:
        x, y = rel[n]
        hw = rel_unc.get(n)
        if hw is None:
            continue
        if all(abs(x + g + y * t) <= hw for t in span[n]):
            rel[n] = (-g, 0.0)


def _clamp_rates(result: dict[int, NodeAlignment]) -> None:
    """A rate no crystal has (beyond DRIFT_BOUND_PPM) is a fit gone wrong: bound it,
    keeping the line where it is in the middle of the node's data, and say so. Lines
    the collectives fitted or the messages moved ("causal"); a clock-sample line's rate
    is the node's own clock's, as its time service measured it. The bounded line leaves
    the fitted one towards the ends of the data; the uncertainties widen by as much (the
    fit may have been right: a clock beyond the bound, or a simulated one)."""
    bound = DRIFT_BOUND_PPM * 1e-6
    for a in result.values():
        if abs(a.slope) <= bound or a.method not in ("collectives", "causal"):
            continue
        new = math.copysign(bound, a.slope)
        # keep aligned(m_c) at the centre m_c of the node's clock segments (its capture)
        segs = a.segments
        m_c = (segs[0]["mono_start_ns"] + segs[-1]["mono_end_ns"]) // 2 if segs else 0
        half = (segs[-1]["mono_end_ns"] - segs[0]["mono_start_ns"]) / 2 if segs else 0
        away = math.ceil(abs(a.slope - new) * half)
        if a.relative_uncertainty_ns is not None:
            a.relative_uncertainty_ns += away
        if a.uncertainty_ns is not None:
            a.uncertainty_ns += away
        if a.fit_relative_ns is not None:
            # (clamped again after the messages moved it: the causal step, which rebuilds
            # a moved line's bound from the fit's, keeps this departure too)
            a.fit_relative_ns += away
            a.fit_precision_ns += away
        a.offset_ns += round(m_c * a.slope) - round(m_c * new)
        a.slope = new
        a.drift_ppm = ((1.0 / (1.0 + new)) - 1.0) * 1e6
        a.rate_clamped = True
        a.clamp_departure_ns += away


def _apply_messages(result: dict[int, NodeAlignment], nodes, messages: Messages,
                    connections: Connections, min_latency_ns
                    ) -> list[tuple[int, int, int, int]]:
    """Step 4a (causal.project_messages): a small change of all lines at once that puts
    every TCP send before the receive of its bytes. Messages bound clocks tightly and in
    cycles (a ring), which the one-node-at-a-time placement of step 4 can turn into a
    contradiction; after this step they hold, and step 4 moves a line only where a
    collective still contradicts it.

    A connection is refused (all its pairs, counted in messages_refused) when one of its
    pairs, or its two ends' establishment times, contradict the lines by more than the
    nodes' uncertainties (relative, else vs UTC) plus MESSAGE_REFUSE_NS: a 4-tuple
    reused by a second connection, each end's capture having seen only one, looks like
    one connection with a clock offset of the time between them. If the pairs left
    contradict each other (no lines satisfy them all), none is used. Returns the pairs
    used, the tightest per sending node, receiving node and time bin, as (sending node,
    send raw ns, receiving node, receive raw ns)."""
    def room(a):
        u = a.relative_uncertainty_ns if a.relative_uncertainty_ns is not None \
            else a.uncertainty_ns
        return None if u is None else u + MESSAGE_REFUSE_NS

    def contradicts(a, b, send, recv):
        ua, ub = room(a), room(b)
        return ua is not None and ub is not None and send + min_latency_ns - recv > ua + ub

    refused = set()
    for cid, (i, sc, j, rc, s_attached, r_attached) in connections.items():
        a, b = result.get(i), result.get(j)
        if a is None or b is None:
            continue
        # the two ends were established within a round trip of each other; an end a
        # capture attached to was established before it was first seen, so the other
        # end's establishment cannot come after that (a 4-tuple reused, the attached
        # end having seen the older connection); two attached ends bound nothing
        if (not s_attached and contradicts(a, b, a.aligned(sc),
                                           b.aligned(rc) + MESSAGE_REFUSE_NS)) or \
                (not r_attached and contradicts(b, a, b.aligned(rc),
                                                a.aligned(sc) + MESSAGE_REFUSE_NS)):
            refused.add(cid)
    usable = []
    for cid, i, s, j, r in messages:
        a, b = result.get(i), result.get(j)
        if a is None or b is None or i == j:
            continue
        if contradicts(a, b, a.aligned(s), b.aligned(r)):
            refused.add(cid)
        usable.append((cid, i, s, j, r))
    for cid, i, _s, j, _r in usable:
        if cid in refused:
            result[i].messages_refused += 1
            result[j].messages_refused += 1
    kept = _tightest([(i, s, j, r) for cid, i, s, j, r in usable if cid not in refused],
                     result)
    if not kept:
        return []
    ref = result[kept[0][0]].aligned(kept[0][1])
    pairs = [(i, float(result[i].aligned(s) - ref), j, float(result[j].aligned(r) - ref))
             for i, s, j, r in kept]
    corr, (t0, t1), settled = project_messages(pairs, min_latency_ns)
    if not settled:
        # some pair is false (a count off, a connection not caught above): no bound from
        # pairs that contradict each other
        for i, _s, j, _r in kept:
            result[i].messages_refused += 1
            result[j].messages_refused += 1
        return []
    for nid, (p0, p1) in corr.items():
        moved = max(abs(p0), abs(p1))
        if moved < 1.0:
            continue
        cb = (p1 - p0) / (t1 - t0) if t1 > t0 else 0.0      # ns per second
        ca = p0 - cb * t0                                   # at the reference
        a = result[nid]
        # aligned_new(m) = aligned(m) + ca + cb * (aligned(m) - ref) / 1e9
        a.offset_ns += round(ca + cb * (a.offset_ns - ref) / 1e9)
        a.slope = (1.0 + a.slope) * (1.0 + cb / 1e9) - 1.0
        a.drift_ppm = ((1.0 / (1.0 + a.slope)) - 1.0) * 1e6
        if moved >= 1000:
            # the fit's own bound no longer describes this line: the causal room will
            a.method = "causal"
            a.causal_moved_ns = round(moved)
        samples = nodes[nid].samples
        if samples:
            a.max_correction_ns = max(abs(s.realtime - a.aligned(s.mid)) for s in samples)
    return kept


def _tightest(pairs, result) -> list[tuple[int, int, int, int]]:
    """The pair with the least slack per sending node, receiving node and time bin
    (PAIR_BINS over the receiver's span, at most PAIR_BIN_MAX_S wide)."""
    if not pairs:
        return []
    span: dict[int, list[int]] = {}
    for _i, _s, j, r in pairs:
        lo_hi = span.setdefault(j, [r, r])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], r), max(lo_hi[1], r)
    best: dict[tuple, tuple] = {}
    for i, s, j, r in pairs:
        lo, hi = span[j]
        width = max(min((hi - lo) / PAIR_BINS, PAIR_BIN_MAX_S * 1e9), 1.0)
        key = (i, j, int((r - lo) / width))
        slack = result[j].aligned(r) - result[i].aligned(s)
        if key not in best or slack < best[key][0]:
            best[key] = (slack, (i, s, j, r))
    return [p for _, p in sorted(best.values(), key=lambda v: v[1])]


def _bound_by_messages(result: dict[int, NodeAlignment], nodes, messages,
                       min_latency_ns) -> None:
    """Step 5: a node the messages tie to every other node, both ways, takes their bound
    (causal.message_bounds) as its relative uncertainty. Tight messages put nodes at the
    edges of their room with the others held fixed; that room says nothing of the
    others' own errors, this bound does."""
    pairs = [(i, result[i].aligned(s), j, result[j].aligned(r))
             for i, s, j, r in messages if i in result and j in result and i != j]
    if not pairs:
        return
    # relative to the first send before any float arithmetic (UTC ns do not fit a double)
    base = min(s for _, s, _, _ in pairs)
    pairs = [(i, float(s - base), j, float(r - base)) for i, s, j, r in pairs]
    # two lines' rates differ by at most twice the drift bound
    rate = 2 * DRIFT_BOUND_PPM * 1e3
    for nid, windows in message_bounds(pairs, min_latency_ns).items():
        # over the node's whole capture, not only while it exchanged messages
        a = result[nid]
        monos = [m for _u, m in nodes[nid].manifest_pairs if m is not None]
        ends = [(a.aligned(m) - base) / 1e9 for m in (min(monos), max(monos))] if monos \
            else [windows[0][0], windows[-1][0]]
        t0 = min(ends[0], windows[0][0])
        t1 = max(ends[1], windows[-1][0])
        worst = error_bound([(t, -b, b) for t, b in windows], t0, t1, rate)
        if worst is not None:
            old = a.relative_uncertainty_ns
            # (extended at rates within the drift bound: a clamped rate's line leaves
            # that by up to twice the clamp's departure over the capture)
            a.relative_uncertainty_ns = max(math.ceil(worst), 1) + 2 * a.clamp_departure_ns
            fitted = a.fit_relative_ns
            if fitted is not None and a.causal_moved_ns <= min(fitted, a.fit_precision_ns):
                # Tight sync points placed this line, and causality moved it no further
                # than their noise explains: nothing says that its sync points are
                # biased, and truth is within the fit's bound plus the move, as without
                # messages (step 4). The messages' bound can be far looser, extended from
                # a short job over a long capture (a 3-step run of 0.5 s in a 30 s
                # capture: 3.4 ms, against the fit's 10 us plus a 7 us move). A move
                # the noise does not explain says the sync points may be biased (the
                # rig's slow link: a fit 43-62 us off with a bound of 32 us and a
                # precision of 11 us, moved 31 us: stated 63 us, 68 us off); the
                # messages' bound, which no such bias enters, stands.
                a.relative_uncertainty_ns = min(a.relative_uncertainty_ns,
                                                math.ceil(fitted + a.causal_moved_ns))
            if a.uncertainty_ns is not None and old is not None:
                # vs UTC: the common-mode bound plus the relative one, as in step 3
                a.uncertainty_ns += max(a.relative_uncertainty_ns - old, 0)


def _apply_causal(result: dict[int, NodeAlignment], nodes, groups, min_latency_ns,
                  messages: Messages = ()) -> None:
    """Step 4 (causal.py): move lines that break the causal constraints (collectives and
    messages), minimally; record each node's room on both sides; nodes no tight
    observation pins take that room as their relative uncertainty, and every node the
    room where that is tighter than its fit."""
    ref = None
    rows = []
    for _key, full, obs in groups():
        if not full:
            continue
        row = []
        for nid, e, sv, _t in obs:
            a = result.get(nid)
            if a is None or (e is None and sv is None):
                continue
            if ref is None:
                ref = a.aligned(e if e is not None else sv)
            row.append((nid, None if e is None else float(a.aligned(e) - ref),
                        None if sv is None else float(a.aligned(sv) - ref)))
        if len(row) >= 2:
            rows.append(row)
    # a message is a two-member row: the send an entry, the receive an observation
    for i, s, j, r in messages:
        a, b = result.get(i), result.get(j)
        if a is None or b is None or i == j:
            continue
        if ref is None:
            ref = a.aligned(s)
        rows.append([(i, float(a.aligned(s) - ref), None), (j, None, float(b.aligned(r) - ref))])
        a.message_pairs += 1
        b.message_pairs += 1
    if not rows:
        return
    system = CausalSystem(rows, min_latency_ns)
    rate = {nid: max(0.0, DRIFT_BOUND_PPM * 1e3 - abs(a.slope) * 1e9)
            for nid, a in result.items()}
    # lines tied by tight observations first, then the clock-sample ones
    trust = {nid: 0 if a.method == "collectives" else 1 for nid, a in result.items()}
    # nodes the messages hold from both sides go to the middle of their room, unless
    # their own clock claims to be closer than that (PTP)
    centre = {nid: math.inf if a.fit_relative_ns is None else a.fit_relative_ns
              for nid, a in result.items() if a.message_pairs and (
                  a.claimed_error_ns is None or a.claimed_error_ns > CENTRE_CLAIM_NS)}
    info = system.enforce(trust, rate, centre)
    for nid, b in info.items():
        a = result[nid]
        # a line the tight observations placed keeps their bound, widened by how far
        # causality moved it: truth within u of the fit is within u + moved of the line
        # (the fit's bound from before the messages moved it, step 4a)
        fitted = a.fit_relative_ns if a.fit_relative_ns is not None else (
            a.relative_uncertainty_ns if a.method == "collectives" else None)
        ca, cb = system.corr.get(nid, (0.0, 0.0))
        if ca or cb:
            # sub-microsecond settling is rounding, not a broken clock
            # aligned_new(m) = aligned(m) + ca + cb * (aligned(m) - ref) / 1e9
            a.offset_ns += round(ca + cb * (a.offset_ns - ref) / 1e9)
            a.slope = (1.0 + a.slope) * (1.0 + cb / 1e9) - 1.0
            # the messages' move (step 4a) and this one add up
            if b.moved_ns >= 1000:
                a.method = "causal"
                a.causal_moved_ns += round(b.moved_ns)
            a.drift_ppm = ((1.0 / (1.0 + a.slope)) - 1.0) * 1e6
            samples = nodes[nid].samples
            if samples:
                a.max_correction_ns = max(abs(s.realtime - a.aligned(s.mid)) for s in samples)
        a.causal_early_ns = None if b.early_ns is None else round(b.early_ns)
        a.causal_late_ns = None if b.late_ns is None else round(b.late_ns)
        if a.method != "collectives":
            # nothing tight pins it: the causal room is all that bounds it relative to
            # the others (None when one side is unbounded)
            if b.early_ns is None or b.late_ns is None:
                a.relative_uncertainty_ns = None
            else:
                # (the room is among lines of the line's own rate, where its constraints
                # hold: where that rate was clamped, the fitted rate's line leaves them by
                # up to the rate difference times the capture, twice the departure;
                # 1,000 nodes with 500 ppm clocks: 2.6 ms off with a room of 0.4 ms)
                a.relative_uncertainty_ns = math.ceil(max(b.early_ns, b.late_ns)) + \
                    2 * a.clamp_departure_ns
            if fitted is not None and a.causal_moved_ns <= fitted:
                # (moved further than the fit's bound: that bound was wrong, drop it)
                room = a.relative_uncertainty_ns
                a.relative_uncertainty_ns = min(math.inf if room is None else room,
                                                fitted + a.causal_moved_ns)
            if a.method == "clock_samples" and a.uncertainty_ns is not None:
                # honest claims bound it too: two clocks within u of UTC are within 2u
                a.relative_uncertainty_ns = min(a.relative_uncertainty_ns or math.inf,
                                                2 * a.uncertainty_ns)
            if a.method == "causal" and a.uncertainty_ns is not None:
                a.uncertainty_ns = None if a.relative_uncertainty_ns is None else \
                    a.uncertainty_ns + a.relative_uncertainty_ns + a.causal_moved_ns



def _common_mode(members, nodes, pre, rel, t_ref, rel_unc):
    """Fit one offset and rate for the component from its clock samples (robust, weighted
    by each sample's own error estimate); bound the absolute error by the honest claims;
    flag nodes whose claims contradict the rest. Returns ((alpha, beta), bound, liars)."""
    tr = t_ref or 0
    rows = []  # (nid, tau_s, r = rel_aligned - realtime, sigma, claim, half_bracket)
    for nid in members:
        x, y = rel[nid]
        for s in nodes[nid].samples:
            u = s.mid + pre[nid] - tr
            r = (s.mid + pre[nid] - s.realtime) + x + y * u / 1e9
            rows.append((nid, u / 1e9, r, sample_sigma(s), s.claim, s.half_bracket))
    if not rows:
        return (0.0, 0.0), None, set()
    liars: set[int] = set()

    def constraints(exclude, alpha, beta):
        cons, t0, t1 = [], None, None
        for nid, tau, r, sig, claim, hb in rows:
            if nid in exclude:
                continue
            t0 = tau if t0 is None else min(t0, tau)
            t1 = tau if t1 is None else max(t1, tau)
            if claim is None:
                continue
            rr = r + alpha + beta * tau
            half = claim + hb + (rel_unc.get(nid) or 0.0)
            cons.append((tau, rr - half, rr + half))
        return cons, t0, t1

    def bound_of(exclude, alpha, beta):
        cons, t0, t1 = constraints(exclude, alpha, beta)
        if not cons:
            return None, False
        b = error_bound(bin_constraints(cons, t0, t1), t0, t1, DRIFT_BOUND_PPM * 1e3)
        return b, b is not None

    while True:
        alpha, beta = _fit_common([r for r in rows if r[0] not in liars])
        bound, ok = bound_of(liars, alpha, beta)
        if ok or not any(r[4] is not None for r in rows if r[0] not in liars):
            return (alpha, beta), bound, liars
        honest = [n for n in members if n not in liars]
        if len(honest) <= 1:
            return (alpha, beta), None, liars
        # The claims cannot all hold: find the node whose removal makes the rest
        # consistent (leave one out; the feasible set does not depend on alpha, beta).
        cand = [n for n in honest if bound_of(liars | {n}, alpha, beta)[1]]
        if len(cand) == 1:
            liars.add(cand[0])
            continue
        # Several or none: the node whose claims the consensus (median) exceeds most.
        ref = median([r[2] for r in rows if r[0] not in liars])
        excess = {}
        for nid, tau, r, sig, claim, hb in rows:
            if claim is None or nid in liars or (cand and nid not in cand):
                continue
            e = abs(r - ref) - claim - hb
            excess[nid] = max(excess.get(nid, -math.inf), e)
        if not excess:
            return (alpha, beta), None, liars
        liars.add(max(excess, key=excess.get))


def _fit_common(rows) -> tuple[float, float]:
    """Robust (IRLS) fit of alpha + beta tau = -r with weights 1/sigma^2 and a prior on
    beta; returns (alpha ns, beta ns/s)."""
    if not rows:
        return 0.0, 0.0
    w = [1.0 / r[3] ** 2 for r in rows]
    alpha = beta = 0.0
    for _ in range(6):
        s00 = s01 = s11 = b0 = b1 = 0.0
        for (nid, tau, r, sig, claim, hb), wk in zip(rows, w):
            s00 += wk
            s01 += wk * tau
            s11 += wk * tau * tau
            b0 += wk * -r
            b1 += wk * -r * tau
        s11 += 1.0 / COMMON_RATE_PRIOR_PPB ** 2
        det = s00 * s11 - s01 * s01
        if det <= 0:
            alpha, beta = b0 / s00, 0.0
        else:
            alpha = (b0 * s11 - b1 * s01) / det
            beta = (s00 * b1 - s01 * b0) / det
        # Huber-like reweighting on normalized residuals
        w = []
        for nid, tau, r, sig, claim, hb in rows:
            z = abs(r + alpha + beta * tau) / sig
            w.append((1.0 if z <= 3 else 3.0 / z) / sig ** 2)
    return alpha, beta
