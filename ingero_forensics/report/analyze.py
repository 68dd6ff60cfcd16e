"""Find the stragglers and their root causes in a fleet.db.

The method, in the order the report presents it (docs/report.md):

1. Lateness. For every collective seen on two or more nodes, each node's arrival is the
   latest entry of its ranks; its lateness is that arrival minus the median arrival of
   all nodes. The merge never estimates clocks from entry times, so lateness is a fair
   witness, accurate to the relative alignment uncertainty it reports per node.
2. Late cells. Collectives are binned in time; a (node, bin) cell is late when its mean
   lateness exceeds a threshold that grows with the number of cells tested (a
   Bonferroni bound on a robust spread of all cells, never under LATE_FLOOR_MS): the
   false-positive rate is controlled over the whole fleet and run, not per node.
3. Cost. The time the job waited for a node beyond the fleet's normal jitter: its
   excess lateness (lateness minus that jitter) over the collectives in time order,
   counting every rise and no fall. A node late by L through a whole step (every
   bucket, then the loss) costs L, once, as the step took L longer; a stall that comes
   back every step costs every time. A straggler is named only if it is late in at
   least MIN_LATE_BINS cells AND its cost is at least MIN_COST_SHARE of the run:
   isolated hiccups (a GC pause, a kworker) cost nothing worth a verdict. Every node
   that passes is named, each with its own windows, cause and cost.
4. Slow collectives without a late rank point at the network; the node whose own job
   connections retransmit is named.
5. Root cause per straggler (evidence.py, citing.py): its signals in its windows against the other
   nodes; the best cause must beat the others by a clear factor.
6. Clock trust. A straggler whose lateness is not well above its relative alignment
   uncertainty (clock_alignment) is still listed, but the report says that clock
   error cannot be ruled out and never names a cause with "clear" confidence.

Everything is computed from fleet.db with SQL plus small Python loops over aggregated
rows; nothing here depends on the simulator.
"""

from __future__ import annotations

import itertools
import json
import math
from array import array
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import apsw

from ..db import connect_readonly
from ..errors import IngeroError
from ..fleetfile import check_fleet_file
from ..merge.nodes import data_start
from ..merge.ranks import process_ranks
from ..merge.summaries import default_bin_s
from .commands import next_commands
from .host import host_view
from .hangs import find_hangs, hang_text
from .binned import HostBins
from .lateattach import inferred_communicators, unmatched_text
from .together import EarlyHalf, early_half_ref
from .lateness import (COST_FLOOR_MS, LATE_FLOOR_MS, MIN_LATE_BINS, Window, _cost_ns,
                       _join_bins, _later_in_most_bins, _straggler_windows, active_ns,
                       fleet_noise_ms, late_threshold_ms, rises_ns)
from .network import _network_suspect, retransmits_in, retransmits_towards, retransmits_unseen
from .gpuwait import (GPU_UNNAMED_FIELDS, SMALL_GPU_RATIO, SMALL_GPU_SCORE, gpu_suspect,
                      gpu_unnamed_text)
from .model import Analysis, NodeLateness, Straggler
from .links import (LINK_SIGNAL_PREFIX, SMALL_LINK_SCORE, link_evidence, link_finding, link_next_step,
                    link_series, link_transits, link_unsure_text, period_transfer, slow_link,
                    slow_link_windows, slow_outside, also_slow_link_text, unnamed_link_text)
from .victims import demote_victims
from .coverage import network_unsure_text, uncaptured_ranks, uncaptured_text
from .wording import (bins_limited_text, clock_unsure_text, ms_text, natural_key,
                      no_comparison_text, rank_text, verdict_text)
from .sql import Recorder
from .citing import cited_evidence, next_step
from .evidence import (CAUSE_TITLES, CAUSES, CLEAR_SCORE, OWN_RUNQ_NOTE, RUNQ_SIGNAL, SAMPLE,
                       TOWARDS_LATE_SIGNAL, WEAK_SCORE, Reservoir, Signal, late_ranks, median,
                       node_signals, quantile, table_exists, utc, window_seconds)
from .figures import (alignment_rows, capture_cost, capture_issues, cause_series, inventory,
                      slow_collectives)

#: Transfer times kept per time bin for its median.
TRANSFER_SAMPLE = 5_000
#: ... and the others must have waited for it at least this share of the run.
MIN_COST_SHARE = 0.01
#: A straggler's lateness must exceed this many times its relative alignment
#: uncertainty (plus its peers') before the clock is ruled out as its cause.
CLOCK_MARGIN = 3.0
#: A late node's GPU waits are the lossy link's symptom where the network suspect resent
#: at least this many segments towards it in its windows (its data came late); a clean
#: rig run retransmits a handful per node in all.
GPU_SYMPTOM_RETRANSMITS = 10
#: CPU contention is named with "clear" confidence only if it can account for the wait:
#: the straggler's run-queue delay in its windows beyond the other nodes' must be at
#: least this share of what the others waited for it. On a busy node the run queue
#: differs by tens of ms per s from its peers', which cannot explain stalls of hundreds
#: of ms (a peer's lossy link, a retransmit timeout of 200 ms, makes such stalls).
CPU_EXPLAINS_SHARE = 0.25

__all__ = ["Analysis", "CAUSES", "CAUSE_TITLES", "NodeLateness", "Signal", "Straggler",
           "Window", "analyze_fleet"]


def analyze_fleet(fleet_db, *, bin_s: float | None = None) -> Analysis:
    """Analyze a merged fleet.db; raise IngeroError if it is not one."""
    path = Path(fleet_db)
    check_fleet_file(path)
    try:
        con = connect_readonly(path)
        for t in ("nodes", "collectives", "nccl_events", "host_samples"):
            if not table_exists(con, t):
                raise IngeroError(f"{path}: not a fleet.db (table {t} missing); "
                                  "build one with ingero-merge")
    except IngeroError:
        raise
    except apsw.CorruptError as e:     # a damaged schema page: the file is one, damaged
        raise IngeroError(f"{path}: cannot read fleet.db ({e})") from None
    except Exception as e:  # apsw.NotADBError and friends
        raise IngeroError(f"{path}: not a SQLite fleet.db ({e})") from None
    rec = Recorder(con)
    try:
        a = _analyze(rec, path, bin_s)
        with rec.figure("title"):
            a.job_ids = sorted({j for (ids,) in rec.execute("SELECT job_ids FROM nodes")
                                for j in json.loads(ids or "[]") if j}
                               | {j for (j,) in rec.execute(
                                   "SELECT DISTINCT job_id FROM processes "
                                   "WHERE job_id IS NOT NULL")})
            a.capture_span = list(rec.execute(
                "SELECT MIN(first_utc_ns), MAX(last_utc_ns) FROM nodes").fetchone())
            a.data_start_ns = data_start(con)
        with rec.figure("hangs"):
            a.hangs = find_hangs(rec, lambda: process_ranks(con))
        with rec.figure("inferred_communicators"):
            a.inferred_communicators = inferred_communicators(rec)
    finally:
        con.close()
    if a.hangs:
        rest = a.verdict
        if rest.startswith("No straggler"):      # before the hang, that is
            rest = "Until then, no straggler" + rest[len("No straggler"):]
        a.verdict = hang_text(a.hangs, utc) + " " + rest
    unmatched = unmatched_text(a.inferred_communicators)
    if unmatched:
        a.verdict += " " + unmatched
    a.sql = rec.finish()
    a.commands = next_commands(a)
    return a


def _analyze(con, path: Path, bin_s: float | None) -> Analysis:
    nodes = {nid: (name, json.loads(ranks or "[]"))
             for nid, name, ranks in con.execute("SELECT node_id, name, ranks FROM nodes")}
    # One row per collective, its nodes' arrivals as a JSON array [[node_id, arrival],
    # ...]: grouped collective by collective (512 entries at 64 x 8 ranks, a sort that
    # stays in cache), not all entries at once (6 M at 64 x 8 x 2,000: a sort spilled
    # to disk, 10 s of the 14 s this statement took as one GROUP BY). Streamed: memory
    # stays flat whatever the fleet. A collective without entries is no comparison.
    with con.figure("lateness"):
        rows = (r for r in con.cursor().execute(
            "SELECT c.collective_id, c.first_entry_ns, c.last_node_id, c.completion_ns, "
            "       c.last_entry_ns, (SELECT json_group_array(json_array(node_id, arrival)) "
            "  FROM (SELECT e.node_id, MAX(e.timestamp_ns) AS arrival FROM nccl_events e "
            "        WHERE e.comm_id_hash = c.comm_id_hash AND e.seq = c.seq "
            "        GROUP BY e.node_id ORDER BY e.node_id)) "
            "FROM collectives c WHERE c.ranks_seen >= 2 ORDER BY c.collective_id")
            if r[5] != "[]")
        first_row = next(rows, None)
    with con.figure("span"):
        span = con.execute("SELECT MIN(first_entry_ns), MAX(last_entry_ns), COUNT(*) "
                           "FROM collectives").fetchone()
    n_coll = span[2]
    n_ranks = len({r for _, rk in nodes.values() for r in rk})
    if bin_s is None:
        bin_s = default_bin_s(span[0], span[1])   # the merge's host_bins use the same
    bin_ns = int(bin_s * 1e9)
    # the host figures from host_bins when this fleet.db has them (binned.py)
    hb = HostBins.open(con, span[0], bin_ns) if span[0] is not None else None
    a = Analysis(fleet=path.name, nodes=len(nodes), ranks=n_ranks, collectives=n_coll,
                 start_ns=span[0], end_ns=span[1], bin_ns=bin_ns, noise_ms=0.0)
    with con.figure("inventory"):
        a.inventory = inventory(con)
    with con.figure("alignment"):
        a.alignment = alignment_rows(con, nodes)
    with con.figure("capture_issues"):
        a.capture_issues = capture_issues(con, nodes)
    with con.figure("capture_cost"):
        a.capture_cost = capture_cost(con, nodes, bins=hb)
    # every per-node list the page and the text show goes in the order people count
    a.capture_cost = dict(sorted(a.capture_cost.items(), key=lambda kv: natural_key(kv[0])))
    a.alignment.sort(key=lambda r: natural_key(r["node"]))
    with con.figure("capture_bpf_cost"):
        a.capture_bpf_cost = capture_cost(con, nodes, "capture.bpf_cpu_pct", bins=hb)
    a.capture_bpf_cost = dict(sorted(a.capture_bpf_cost.items(),
                                     key=lambda kv: natural_key(kv[0])))
    if first_row is None or len(nodes) < 2:
        a.inconclusive = True
        a.cause_confidence = "none"
        if a.start_ns is None:
            with con.figure("span"):
                a.start_ns, a.end_ns = con.execute(
                    "SELECT MIN(first_utc_ns), MAX(last_utc_ns) FROM nodes").fetchone()
        a.host = host_view(con)
        a.verdict = no_comparison_text(a, nodes)
        return a

    # -- 1. lateness per (collective, node) ------------------------------------------
    t0 = span[0]
    # Lateness per node and transfer times per bin, in the order read; sampled once the
    # pass is done (Reservoir.extend: the same sample as adding them one by one).
    node_lates: dict[int, array] = defaultdict(lambda: array("d"))
    bins: dict[int, dict[int, list[float]]] = defaultdict(dict)   # b -> node -> [sum, n]
    transfers: dict[int, array] = defaultdict(lambda: array("d"))
    last_count: dict[int, int] = defaultdict(int)
    costly: dict[int, list[tuple[int, float]]] = defaultdict(list)   # node -> (t, late ms)
    early = EarlyHalf() if len(nodes) >= 3 else None     # nodes late together
    node_index: dict[int, array] = defaultdict(lambda: array("l"))   # for early
    times = array("q")
    transfer_total_ns = 0     # the collectives' time from the last arrival to completion
    for _, first, last_node, completion, last_entry, arrivals in itertools.chain([first_row],
                                                                                rows):
        arrivals = json.loads(arrivals)
        if len(arrivals) < 2:
            continue
        if len(arrivals) == 2:
            # two nodes: each against the other (the median, their midpoint, would show
            # half of what the early one waited)
            (n0, a0), (n1, a1) = arrivals
            ref = {n0: a1, n1: a0}
        else:
            ts = sorted(t for _, t in arrivals)
            med = median(ts)
            ref = None
        b = (first - t0) // bin_ns
        cells = bins[b]
        times.append(first)
        if early is not None:
            ci = early.add(b, first, 0.0 if ref else (med - early_half_ref(ts)) / 1e6)
        for nid, t in arrivals:
            late_ms = (t - (med if ref is None else ref[nid])) / 1e6
            node_lates[nid].append(late_ms)
            if early is not None:
                node_index[nid].append(ci)
            acc = cells.get(nid)
            if acc is None:
                cells[nid] = [late_ms, 1, late_ms]
            else:
                acc[0] += late_ms
                acc[1] += 1
                acc[2] = max(acc[2], late_ms)
            if late_ms > COST_FLOOR_MS:
                costly[nid].append((first, late_ms))
        last_count[last_node] += 1
        if completion is not None and completion >= last_entry:
            transfers[b].append((completion - last_entry) / 1e6)
            transfer_total_ns += completion - last_entry
    per_node = {nid: Reservoir(SAMPLE, seed=nid).extend(v) for nid, v in node_lates.items()}
    transfer = {b: Reservoir(TRANSFER_SAMPLE, seed=b).extend(v) for b, v in transfers.items()}
    del transfers

    # robust noise over all (bin, node) means; the threshold grows with their number
    cell = {(b, n): sv / k for b, per in bins.items() for n, (sv, k, _) in per.items()}
    counts = {(b, n): k for b, per in bins.items() for n, (_, k, _) in per.items()}
    mad, a.noise_basis = fleet_noise_ms(cell)
    a.noise_ms = round(mad, 3)
    threshold = late_threshold_ms(mad, len(cell))
    a.threshold_ms = round(threshold, 3)
    late_bins: dict[int, list[int]] = defaultdict(list)
    for (b, n), v in cell.items():
        if v > threshold:
            late_bins[n].append(b)
    # cost: what the others waited for a node beyond the normal jitter
    jitter_ms = max(COST_FLOOR_MS, 3.0 * mad)
    times = array("q", sorted(times))
    run_ns = active_ns(times, bin_ns)
    a.run_s = round(run_ns / 1e9, 3)
    cost = {nid: _cost_ns(pts, times, jitter_ms) for nid, pts in costly.items()}
    for nid, (name, ranks) in sorted(nodes.items(), key=lambda kv: natural_key(kv[1][0])):
        res = per_node.get(nid)
        lat = res.values if res else []
        c = cost.get(nid, 0)
        a.lateness.append(NodeLateness(
            nid, name, ranks, res.n if res else 0, round(median(lat), 3),
            round(quantile(lat, 0.9), 3),
            round(last_count.get(nid, 0) / max(1, n_coll), 3), len(late_bins.get(nid, [])),
            round(c / 1e9, 3), round(c / run_ns, 4)))

    # -- 2. stragglers: repeatedly late, and costly --------------------------------------
    n_bins = len(bins)
    min_bins = max(MIN_LATE_BINS, int(0.02 * n_bins))
    rel_unc = {r["node_id"]: r.get("relative_uncertainty_us") for r in a.alignment}
    clock_of = dict(con.execute("SELECT node_id, boot_id FROM nodes"))
    ranks_of = process_ranks(con)
    for nl in sorted(a.lateness, key=lambda x: -x.cost_s):
        if nl.late_bins < min_bins or nl.cost_share < MIN_COST_SHARE:
            continue
        windows, lat = _straggler_windows(late_bins[nl.node_id], t0, bin_ns, cell, nl.node_id,
                                          counts)
        a.stragglers.append(Straggler(
            node=nl.name, node_id=nl.node_id, ranks=nl.ranks,
            late_ranks=_late_ranks(con, nl.node_id, windows, ranks_of),
            windows=windows, lateness_ms=round(lat, 3), late_bins=nl.late_bins,
            peak_ms=round(median([bins[b][nl.node_id][2] for b in late_bins[nl.node_id]]), 3),
            cost_s=nl.cost_s, cost_share=nl.cost_share,
            relative_uncertainty_ms=_pair_uncertainty_ms(nl.node_id, rel_unc, clock_of),
            clock_caveat=False))
    if early is not None:
        # half the fleet or more late at the same collectives: the median was theirs
        together, spread = early.late_nodes(
            cell, node_lates, node_index, t0=t0, bin_ns=bin_ns,
            threshold_of=late_threshold_ms, min_bins=min_bins,
            min_cost_ns=MIN_COST_SHARE * run_ns, skip={st.node_id for st in a.stragglers},
            cost_of=rises_ns, cost_floor_ms=COST_FLOOR_MS)
        table = {nl.node_id: nl for nl in a.lateness}
        for lt in sorted(together, key=lambda x: -x.cost_ns):
            name, ranks = nodes[lt.node_id]
            windows, lat = _straggler_windows(lt.late_bins, t0, bin_ns, lt.cells, lt.node_id,
                                              lt.counts)
            nl = table[lt.node_id]    # the table shows the figures that named it
            nl.late_bins = len(lt.late_bins)
            nl.cost_s, nl.cost_share = round(lt.cost_ns / 1e9, 3), round(lt.cost_ns / run_ns, 4)
            a.stragglers.append(Straggler(
                node=name, node_id=lt.node_id, ranks=ranks,
                late_ranks=_late_ranks(con, lt.node_id, windows, ranks_of),
                windows=windows, lateness_ms=round(lat, 3), late_bins=nl.late_bins,
                peak_ms=round(lt.peak_ms, 3), cost_s=nl.cost_s, cost_share=nl.cost_share,
                relative_uncertainty_ms=_pair_uncertainty_ms(lt.node_id, rel_unc, clock_of),
                clock_caveat=False, reference="early_half", jitter_ms=round(spread, 3),
                late_with=sorted(nodes[o.node_id][0] for o in together if o is not lt)))
    del node_lates, node_index
    for st in a.stragglers:
        u = st.relative_uncertainty_ms
        st.clock_caveat = u is None or st.peak_ms <= CLOCK_MARGIN * u
    # Late by no more than the clocks are known to: the clock error alone could make
    # this node (or another) look that late, so not even which node was late is known.
    # Said, not named. (Two nodes, one GPU slowed, clocks 35-136 ms apart with no tight
    # sync point on the slow one: the healthy node looked 35 ms late and was named.)
    unsure = [st for st in a.stragglers if st.relative_uncertainty_ms is None
              or st.peak_ms <= st.relative_uncertainty_ms]
    if unsure:
        a.clock_unsure = [{"node": st.node, "ranks": st.late_ranks or st.ranks,
                           "peak_ms": st.peak_ms, "lateness_ms": st.lateness_ms,
                           "relative_uncertainty_ms": st.relative_uncertainty_ms}
                          for st in unsure]
        a.stragglers = [st for st in a.stragglers if st not in unsure]

    # -- 3. slow collectives with nobody late: the network --------------------------
    tr_med = {b: median(v.values) for b, v in transfer.items() if v.n}
    base = median(tr_med.values()) if tr_med else 0.0
    slow = sorted(b for b, v in tr_med.items() if v > max(3 * base, base + 5.0))
    a.slow_bins = len(slow)
    slow_coll = sum(transfer[b].n for b in slow)
    late_ids = {st.node_id for st in a.stragglers}
    # each late node with its windows: what is resent towards it while it is late is its
    # symptom (network.towards_late)
    late_windows = {st.node_id: [(w.start_ns, w.end_ns) for w in st.windows]
                    for st in a.stragglers}
    with con.figure("uncaptured_ranks"):
        a.uncaptured = uncaptured_ranks(con)
    with con.figure("network_suspect"):
        network_suspect, net_bins, a.network_basis = _network_suspect(
            con, list(nodes), t0, bin_ns, slow, n_bins, n_coll, slow_coll, late=late_windows)
        if network_suspect is not None and a.uncaptured:
            # Ranks went uncaptured: retransmits towards peers no bundle shows may be
            # their lossy NIC as much as the sender's. The suspect stands only if its
            # retransmits towards captured nodes name it too. (Not where the unseen
            # ones spread over several addresses: one uncaptured node may own them all,
            # two NICs or an IPv4 and an IPv6 address.) A review merged a fleet without
            # the lossy node's bundle: its upstream neighbour was named "network
            # retransmits, clear" for resending into it.
            total, unseen = retransmits_unseen(con, network_suspect, list(nodes))
            if unseen and _network_suspect(con, list(nodes), t0, bin_ns, slow, n_bins,
                                           n_coll, slow_coll, late=late_windows,
                                           seen_only=True)[0] != network_suspect:
                if not a.stragglers:
                    # (beside a straggler the suspect only sorts victims: none is sure)
                    a.network_unsure = {"node": nodes[network_suspect][0],
                                        "retransmits": total,
                                        "unseen": sum(unseen.values()),
                                        "unseen_addresses": len(unseen),
                                        "basis": a.network_basis}
                network_suspect, net_bins, a.network_basis = None, [], None
        towards_late = None
        if late_ids:
            # who would be the suspect if retransmits towards the late nodes counted
            towards_late, _, _ = _network_suspect(con, list(nodes), t0, bin_ns, slow,
                                                  n_bins, n_coll, slow_coll)
            if towards_late == network_suspect or towards_late in late_ids:
                towards_late = None
    for st in a.stragglers:
        # nodes late together are each compared with the healthy nodes, not each other
        peers = [n for n in nodes if nodes[n][0] not in st.late_with]
        _diagnose(con, st, peers, nodes, network=False, bins=hb,
                  late_peers={n: w for n, w in late_windows.items() if n != st.node_id})
        if towards_late is not None and st.cause_confidence != "clear":
            with con.figure(f"retransmits_towards:{st.node_id}"):
                n = retransmits_towards(con, towards_late, st.node_id)
            if n:
                st.retransmits_towards = {"node": nodes[towards_late][0], "retransmits": n}
    if network_suspect is None and len(a.stragglers) > 1:
        demote_victims(a)
    if network_suspect is not None and a.stragglers:
        # A lossy link delays the ranks downstream of it too: they start the next step
        # late and look late. Late nodes with no clear cause of their own are its
        # victims; a node with a clear cause of its own is a straggler of its own.
        # A node's waits for its own GPU work include the collectives the lossy link
        # stalls (device and event synchronizations wait for NCCL's kernels too): in bins
        # where the suspect retransmitted they are its symptom, not a cause of the node's
        # own. On the rig, the lossy link's downstream node, late in two bins of
        # retransmit timeouts, was named "GPU slowdown, clear" and the link went unnamed.
        kept = []
        suspect_name = nodes[network_suspect][0]
        for st in a.stragglers:
            gpu_symptom = st.cause == "gpu" and st.node_id != network_suspect and \
                retransmits_in(con, network_suspect, st.windows, st.node_id) >= \
                GPU_SYMPTOM_RETRANSMITS
            if suspect_name in st.late_with:     # late at the suspect's own collectives
                a.victims.append(st.node)
            elif st.node_id == network_suspect or (st.cause not in (None, "network")
                                                   and st.cause_confidence == "clear"
                                                   and not gpu_symptom):
                kept.append(st)
            else:
                a.victims.append(st.node)
                if gpu_symptom:
                    a.gpu_symptoms.append(st.node)
        a.stragglers = [st for st in kept if st.node_id != network_suspect]
    # the nodes a finding names so far (a lossy link's node too where stragglers of their
    # own displace it): a slow link at one of them is no second finding
    named_ids = {st.node_id for st in a.stragglers} | (
        {network_suspect} if network_suspect is not None else set())
    if a.stragglers:
        network_suspect = None
        a.network_basis = None
    with con.figure("links"):
        links = link_transits(con)
    a.links = [{"from": nodes[lk.sender][0], "to": nodes[lk.receiver][0],
                "transits": lk.transits, "median_ms": lk.median_ms, "p90_ms": lk.p90_ms}
               for lk in links if lk.sender in nodes and lk.receiver in nodes]
    link = link_period = small_link = None
    transfer_share = round(min(1.0, transfer_total_ns / run_ns), 4) if run_ns else 0.0
    if transfer_share >= MIN_COST_SHARE:
        # -- 3c. a link far slower than the others: named alone where nobody is late and
        # nothing retransmits, else a second finding away from the nodes named ----------
        measured = [lk for lk in links if lk.sender in nodes and lk.receiver in nodes]
        pair_ms = lambda s, r: _link_uncertainty_ms(s, r, rel_unc, clock_of)  # noqa: E731
        link = slow_link(measured, pair_ms, CLOCK_MARGIN)
        # slow in periods of the run only (the whole-run medians miss it, or one early
        # period carries them): named with its periods where enough of its arrivals lie
        # in them and the collectives' transfer in them cost the job a share of the run
        periods = slow_link_windows(measured, pair_ms, CLOCK_MARGIN, t0, bin_ns, min_bins,
                                    whole=link, end_ns=span[1])
        if periods is not None:
            # (a link the whole-run test found, slow in under half of its bins: these
            # periods decide for it too)
            link = None
            period = period_transfer(periods, tr_med, transfer, t0, bin_ns, run_ns)
            why = "thin" if periods.thin else (
                "costless" if period["period_cost_share"] < MIN_COST_SHARE else None)
            if why is None:
                link, link_period = periods, period
            elif not periods.clock_limited:
                # (within clock error as well: nothing about it is known, nothing said)
                a.link_unnamed = {**link_finding(periods, nodes, transfer_share,
                                                 period), "why": why}
        elif link is None and not a.stragglers and network_suspect is None:
            # slower than every other link over the run, but under the bar that names
            # one: said where the verdict would otherwise say that no link is slow (not
            # beside a finding: a lossy link's own transit is slow too; cleared below
            # where a GPU is named)
            small = slow_link(measured, pair_ms, CLOCK_MARGIN, min_score=SMALL_LINK_SCORE)
            if small is not None and not small.clock_limited:
                small_link = {**link_finding(small, nodes, transfer_share), "why": "small"}
    if link is not None:
        suspect = link_finding(link, nodes, transfer_share, link_period)
        ends = {n for s, r, _ in link.slow for n in (s, r)} | {link.suspect}
        if named_ids:
            # Beside a straggler (or a lossy link) already named: a second, separate
            # finding, only where none of its slow links touches a node named (a late
            # or starved node's own links are its own story). On the rig, a CPU hog on
            # one node and a shaped link between two others: the hog's node was named
            # and the link, 5.4 ms against 0.05 ms, went unsaid. That holds in the
            # named nodes' windows: a link slow over the whole run, and still the slow
            # one without its arrivals in the windows of the late nodes at its ends,
            # each with a clear cause of its own (not the link's victim), is a finding
            # of its own.
            touched = {st.node_id: st for st in a.stragglers if st.node_id in ends}
            spans = [(w.start_ns, w.end_ns) for st in touched.values() for w in st.windows]
            if ends & named_ids and (
                    link_period is not None or set(touched) != ends & named_ids
                    or any(st.cause_confidence != "clear" or st.cause in (None, "network")
                           for st in touched.values())
                    or not slow_outside(measured, link, spans, pair_ms, CLOCK_MARGIN)):
                pass
            elif link.clock_limited:
                a.link_unsure = suspect
            else:
                a.also_slow_link = {**suspect, "named_ends": sorted(
                    nodes[n][0] for n in touched)}
            link = None
        elif link.clock_limited:
            # its excess could be clock error between its two nodes: said, not named
            a.link_unsure, link = suspect, None
        else:
            a.network_basis, a.link_suspect = "slow_link", suspect
    gpu = one_sided = small_gpu = None
    late = []
    run_windows = _join_bins(sorted(bins), t0, bin_ns, cell, None)   # the run, its pauses out
    if not a.stragglers and network_suspect is None and link is None:
        one_sided = (_later_in_most_bins(cell, nodes, late_bins, min_bins)
                     if len(nodes) == 2 else None)
        late = sorted((nl for nl in a.lateness if nl.late_bins and
                       nl.cost_share >= MIN_COST_SHARE), key=lambda nl: -nl.cost_share)
        if one_sided is None and not (n_bins < min_bins and late):
            # -- 3b. nobody late and the network quiet: a GPU slower than its peers' ----
            # (not where lateness itself cannot be told: two nodes one of which is later
            # by as much as they vary, or a run too short for the bins rule)
            # (read once at the lower score: the cost and run-queue checks do not
            # depend on it; under WEAK_SCORE it is only said, in "No straggler")
            with con.figure("gpu_suspect"):
                found = gpu_suspect(con, list(nodes), run_ns, MIN_COST_SHARE,
                                    [(w.start_ns, w.end_ns) for w in run_windows],
                                    min_score=SMALL_GPU_SCORE)
            if found is not None and found.score >= WEAK_SCORE and found.reading == "gpu":
                gpu = found
            elif found is not None and found.wait_ms >= SMALL_GPU_RATIO * found.others_ms:
                # under the bar, or waits read as its threads' waits for a CPU, or that
                # cannot be told from them (a score >= 3 is 1.75 times the others' at
                # least: wait_floor): said, not named
                small_gpu = {"node": nodes[found.node_id][0],
                             "rank": ranks_of.get((found.node_id, found.pid)),
                             **{k: getattr(found, k) for k in GPU_UNNAMED_FIELDS}}
        if gpu is not None:
            a.gpu_suspect = asdict(gpu)
            a.gpu_suspect.update(
                same_work=gpu.same_work, same_syncs=gpu.same_syncs, clear=gpu.clear,
                reading=gpu.reading,
                min_bins=min_bins,
                rank=ranks_of.get((gpu.node_id, gpu.pid)),
                lateness_ms=next(nl.median_ms for nl in a.lateness
                                 if nl.node_id == gpu.node_id))
    primary = a.stragglers[0] if a.stragglers else None
    for b in sorted(bins):
        per = bins[b]
        row = {"t_s": round(b * bin_ns / 1e9, 3),
               "fleet_ms": round(median([sv / k for sv, k, _ in per.values()]), 3),
               "transfer_ms": round(tr_med.get(b, 0.0), 3)}
        if primary is not None and primary.node_id in per:
            row["suspect_ms"] = round(per[primary.node_id][0] / per[primary.node_id][1], 3)
        a.timeline.append(row)

    unc = sorted(v for v in rel_unc.values() if v is not None)
    worst = None if len(unc) < len(rel_unc) else (unc[-1] / 1e3 if unc else 0.0)
    # a clock error this large could hide (or fake) lateness of the fleet's own jitter:
    # "no straggler" (or "nobody arrives late") would claim more than the alignment knows
    clocks_loose = worst is None or worst > max(LATE_FLOOR_MS, a.noise_ms)
    if primary is None and network_suspect is None and gpu is None and link is None:
        if a.clock_unsure:
            a.clock_limited = True
            a.cause_confidence = "none"
            a.verdict = clock_unsure_text(a.clock_unsure)
            if a.link_unsure:
                a.verdict += " " + link_unsure_text(a.link_unsure)
            with con.figure("slow_collectives"):
                a.slow_collectives = slow_collectives(con)
            return a
        if clocks_loose:
            a.clock_limited = True
            a.cause_confidence = "none"
            a.verdict = (
                "Cannot tell whether a node is a straggler: the clocks could only be "
                "aligned to within " + ("an unbounded error" if worst is None else
                                       f"{worst:.2f} ms") + f" of each other ({_why_loose(a)}"
                f"), more than the fleet's jitter ({a.noise_ms:.2f} ms). The "
                "lateness table shows what each node's clock says; each node's clock bound is "
                "listed (the page's clock section, the text's caveats).")
            if a.link_unsure:
                a.verdict += " " + link_unsure_text(a.link_unsure)
            with con.figure("slow_collectives"):
                a.slow_collectives = slow_collectives(con)
            return a
        if one_sided is not None:
            # Two nodes only, one of them later nearly always, but by amounts that vary as
            # much as they are large: with no third node, that spread is all the "jitter"
            # there is to compare with, so neither "straggler" nor "no straggler" is known.
            a.pair_limited = one_sided
            a.cause_confidence = "none"
            a.verdict = (
                f"Cannot tell whether {one_sided['node']} is a straggler: it arrived after "
                f"the other node in {one_sided['later_bins']} of {one_sided['bins']} time "
                f"bins (by {one_sided['median_ms']:.1f} ms at the median), but by amounts "
                f"that vary as much as they are large ({a.noise_ms:.2f} ms), and with two "
                "nodes there is no third to tell the fleet's normal jitter from its "
                "lateness. The lateness table shows both nodes (its cost counts only "
                "lateness beyond that variation).")
            with con.figure("slow_collectives"):
                a.slow_collectives = slow_collectives(con)
            return a
        if n_bins < min_bins and late:
            # the bins rule cannot pass in a run this short: a node late in all of its bins
            # and costly is not "no straggler"
            a.bins_limited = {"nodes": [nl.name for nl in late], "bins": n_bins,
                              "min_bins": min_bins, "bin_s": bin_ns / 1e9}
        if not a.bins_limited and not a.uncaptured:
            # a link or a GPU under the bar that names one: said in "No straggler" only
            # (not under a verdict that cannot tell, where the JSON would hold what the
            # verdict does not say)
            a.link_unnamed = a.link_unnamed or small_link
            a.gpu_unnamed = small_gpu
        # rule 4c was asked (two links or more measured, a transfer worth a share): say so
        links_asked = len(a.links) >= 2 and transfer_share >= MIN_COST_SHARE
        # slow bins that named no one (no node's connections retransmitted enough): said
        # as they are, not as none (a link that queued for a third of the run: 2 bins)
        slow_said = ("no period of the run has collectives slow for everyone"
                     if not a.slow_bins else
                     f"the time from the last arrival to completion was over 3 times the "
                     f"run's median in {a.slow_bins} time bin{'s' if a.slow_bins != 1 else ''}"
                     " with no node's job connections retransmitting markedly")
        checked = [slow_said] + (
            [unnamed_link_text(a.link_unnamed) if a.link_unnamed else
             f"no link of the job is far slower than the others, over the run or in "
             f"{min_bins} of its time bins or more"]
            if links_asked and not a.link_unsure else [])
        if a.gpu_unnamed:
            checked.append(gpu_unnamed_text(a.gpu_unnamed))
        if len(a.links) < 2 and transfer_share >= MIN_COST_SHARE:
            # rule 4c could not run: not "no link is slow" by omission (a link queueing
            # over the whole run leaves no slow bin either, as the bins compare the run
            # with itself; a review's 3-node fleet without tcp_progress got a plain
            # "No straggler" while its transfer ran at twice a clean fleet's)
            a.links_unmeasured = True
            checked.append(
                ("no link's transit was measured (fleet.db has no tcp_progress rows of "
                 "the job's connections: a capture with --no-tcp-progress, an older one, "
                 "or NCCL over InfiniBand)" if not a.links else
                 "one link's transit alone was measured, with none to compare it with")
                + ", so a link slow over the whole run is not ruled out")
        a.verdict = ("No straggler: no node arrives late at collectives beyond the fleet's "
                     f"normal jitter ({a.noise_ms:.2f} ms; late means over "
                     f"{a.threshold_ms:.2f} ms in at least {min_bins} time bins and costing "
                     f"the others at least {MIN_COST_SHARE:.0%} of the run), "
                     + ", ".join(checked[:-1]) + (", and " if len(checked) > 1 else "and ")
                     + checked[-1] + ".")
        if a.bins_limited:
            nl = late[0]
            a.verdict = bins_limited_text(a, nl, span_s=run_ns / 1e9)
        elif a.uncaptured:
            a.verdict = ("Cannot tell whether a node is a straggler. "
                         + uncaptured_text(a.uncaptured, rank_text) + " No captured node "
                         "arrives late at collectives beyond the fleet's normal jitter "
                         f"({a.noise_ms:.2f} ms).")
            if a.network_unsure:
                a.verdict += " " + network_unsure_text(a.network_unsure)
        if a.bins_limited or a.uncaptured:
            a.links_unmeasured = False      # (set where the verdict says it)
        if a.link_unsure:
            a.verdict += " " + link_unsure_text(a.link_unsure)
        a.cause_confidence = "none"
        with con.figure("slow_collectives"):
            a.slow_collectives = slow_collectives(con)
        return a

    # -- 4. root cause, per straggler ------------------------------------------------
    if primary is None and gpu is not None:
        name, ranks = nodes[gpu.node_id]
        primary = Straggler(node=name, node_id=gpu.node_id, ranks=ranks, late_ranks=[],
                            windows=run_windows,
                            lateness_ms=0.0, peak_ms=0.0, late_bins=0, cost_s=gpu.extra_s,
                            cost_share=round(gpu.extra_s * 1e9 / run_ns, 4),
                            relative_uncertainty_ms=_pair_uncertainty_ms(
                                gpu.node_id, rel_unc, clock_of),
                            clock_caveat=False)
        _diagnose(con, primary, list(nodes), nodes, network=False, bins=hb)
        primary.evidence.insert(0, (
            "Waits for its own GPU work (event and device synchronizations of its slowest "
            f"process): {ms_text(gpu.wait_ms)} at the median against "
            f"{ms_text(gpu.others_ms)} on the other nodes (score {gpu.score:g})."))
        if primary.cause_confidence == "clear" and (primary.cause != "gpu" or
                                                    not gpu.clear or
                                                    gpu.same_work is not True):
            # more (or fewer) kernels or syncs than its peers: other work may explain the
            # waits; another cause: it was named for its GPU waits, which that cause does
            # not make; a weak whole-run score: what named it is weak
            primary.cause_confidence = "weak"
        if primary.cause is None:
            # its GPU waits named it (weakly): say so, rather than no cause at all
            primary.cause, primary.cause_confidence = "gpu", "weak"
        if clocks_loose:
            a.clock_limited = True
            a.gpu_suspect["clock_bound_ms"] = worst
    elif primary is None and link is not None:
        name, ranks = nodes[link.suspect]
        primary = Straggler(node=name, node_id=link.suspect, ranks=ranks, late_ranks=[],
                            windows=([Window(s, e, None) for s, e in link.windows]
                                     or run_windows),
                            lateness_ms=0.0, peak_ms=0.0, late_bins=0,
                            cost_s=0.0, cost_share=0.0,
                            relative_uncertainty_ms=_pair_uncertainty_ms(
                                link.suspect, rel_unc, clock_of),
                            clock_caveat=False)
        # its host signals over the run, for the table; the cause is the link's
        _diagnose(con, primary, list(nodes), nodes, network=True, bins=hb)
        primary.cause, primary.cause_confidence, primary.close_cause = "network", "clear", None
        s = a.link_suspect
        primary.signals.insert(0, Signal(
            "network", f"{LINK_SIGNAL_PREFIX} from {s['from']} to {s['to']} (ms, median over "
            "arrivals; beside it, the other links' median)",
            link.median_ms, link.others_ms, link.score))
        primary.evidence = link_evidence(a.link_suspect, a.links)
        primary.next_step = link_next_step(a.link_suspect)
        primary.top_offenders = []
    elif primary is None:
        windows = _join_bins(sorted(set(net_bins)), t0, bin_ns, cell, None)
        name, ranks = nodes[network_suspect]
        primary = Straggler(node=name, node_id=network_suspect, ranks=ranks, late_ranks=[],
                            windows=windows, lateness_ms=0.0, peak_ms=0.0, late_bins=0,
                            cost_s=0.0,
                            cost_share=0.0,
                            relative_uncertainty_ms=_pair_uncertainty_ms(
                                network_suspect, rel_unc, clock_of),
                            clock_caveat=False)
        _diagnose(con, primary, list(nodes), nodes, network=True, bins=hb)
        if a.victims:
            primary.evidence.append(
                ", ".join(a.victims) + (" arrived late too, with no cause of its own: "
                                        if len(a.victims) == 1 else
                                        " arrived late too, with no cause of their own: ")
                + f"waiting for {primary.node}'s lossy connections.")
        for name in a.gpu_symptoms:
            primary.evidence.append(
                f"{name}'s waits for its own GPU work were long in its windows, while "
                f"{primary.node} retransmitted: a collective the lossy link stalls "
                "lengthens every wait that includes it, so they are not counted as a cause "
                f"of {name}'s own.")
    a.straggler_node_id, a.straggler, a.straggler_ranks = primary.node_id, primary.node, primary.ranks
    a.late_ranks, a.windows = primary.late_ranks, primary.windows
    a.cause, a.cause_confidence, a.clock_caveat = (primary.cause, primary.cause_confidence,
                                                   primary.clock_caveat)
    a.close_cause = primary.close_cause
    a.signals, a.evidence, a.top_offenders = primary.signals, primary.evidence, primary.top_offenders
    a.evidence_facts = primary.evidence_facts
    a.next_step = primary.next_step
    with con.figure("cause_series"):
        a.cause_series = (link_series(links, link, t0, bin_ns) if link is not None else
                          cause_series(con, a.cause, primary.node_id, t0, bin_ns, hb,
                                       primary.signals) if a.cause else {})
    with con.figure("slow_collectives"):
        a.slow_collectives = slow_collectives(con)
    a.verdict = verdict_text(a, network_suspect is not None or link is not None, primary)
    if a.also_slow_link:
        a.verdict += " " + also_slow_link_text(a.also_slow_link)
    if a.link_unsure:       # (a GPU suspect or a straggler named beside it)
        a.verdict += " " + link_unsure_text(a.link_unsure)
    if a.clock_unsure:      # late beside the finding, by no more than the clocks allow
        a.verdict += " " + clock_unsure_text(a.clock_unsure, also=True)
    if a.uncaptured:
        a.verdict += " " + uncaptured_text(a.uncaptured, rank_text)
    if a.network_unsure:
        a.verdict += " " + network_unsure_text(a.network_unsure)
    return a


def _late_ranks(con, node_id, windows, ranks_of) -> list[int]:
    with con.figure(f"late_ranks:{node_id}"):
        return late_ranks(con, node_id, [(w.start_ns, w.end_ns) for w in windows], ranks_of)


def _link_uncertainty_ms(s: int, r: int, rel_unc, clock_of) -> float | None:
    """How far node s's clock may be from node r's (ms): 0 on one clock (one boot), the
    sum of their relative uncertainties, None where either is unbounded."""
    if clock_of.get(s) is not None and clock_of.get(s) == clock_of.get(r):
        return 0.0
    if rel_unc.get(s) is None or rel_unc.get(r) is None:
        return None
    return (rel_unc[s] + rel_unc[r]) / 1e3


def _pair_uncertainty_ms(node_id, rel_unc, clock_of=None) -> float | None:
    """How far the node's clock may be from its typical peer's (ms): the median over its
    peers of the pair's uncertainty, the sum of both nodes' relative uncertainties, or 0
    for a peer on the same clock (one boot: the merge aligns them as one clock). None when
    the node's is unknown and a peer has another clock, or when the median pair is
    unbounded (a peer whose own is unknown counts as an unbounded pair, not as none)."""
    clock_of = clock_of or {}
    mine = rel_unc.get(node_id)
    pairs = []
    for n, v in rel_unc.items():
        if n == node_id:
            continue
        if clock_of.get(n) is not None and clock_of.get(n) == clock_of.get(node_id):
            pairs.append(0.0)
        elif mine is None:
            return None
        else:
            pairs.append(math.inf if v is None else mine + v)
    if mine is None and not pairs:
        return None
    m = sorted(pairs)[(len(pairs) - 1) // 2: len(pairs) // 2 + 1] if pairs else [mine]
    if math.inf in m:
        return None
    return round(sum(m) / len(m) / 1e3, 3)


def _diagnose(con, st: Straggler, node_ids, nodes, network: bool, bins=None,
              late_peers=None) -> None:
    """Score every cause on the straggler in its windows; name the best if it is clear.
    late_peers: the other stragglers (node id -> windows), whose symptoms its retransmits
    towards them are (evidence.node_signals)."""
    windows = [(w.start_ns, w.end_ns) for w in st.windows]
    with con.figure(f"signals:{st.node_id}"):
        st.signals = node_signals(con, st.node_id, node_ids, windows, bins, late_peers)
    scores = {c: max((s.score for s in st.signals if s.cause == c), default=0.0)
              for c in CAUSES}
    if network:
        # slow for everyone with nobody late: only the network explains that pattern
        scores["network"] = max(scores["network"], CLEAR_SCORE)
    ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=True)
    best, best_score = ranked[0]
    second = ranked[1][1]
    if best_score >= CLEAR_SCORE and best_score >= 2 * max(second, 1.0):
        st.cause, st.cause_confidence = best, "clear"
    elif best_score >= WEAK_SCORE:
        st.cause, st.cause_confidence = best, "weak"
    else:
        st.cause_confidence = "none"
    if st.clock_caveat and st.cause_confidence == "clear":
        st.cause_confidence = "weak"
    short = _cpu_short_of_cost(st, window_seconds(windows))
    if short is not None and st.cause_confidence == "clear":
        st.cause_confidence = "weak"
    runner, runner_score = ranked[1]
    if st.cause_confidence == "weak" and runner_score >= WEAK_SCORE and \
            2 * runner_score >= best_score:
        st.close_cause = runner
    with con.figure(f"evidence:{st.node_id}"):
        st.evidence, st.top_offenders, st.evidence_facts = cited_evidence(
            con, st.cause, st.node_id, windows, nodes, bins)
    own = next((s for s in st.signals if s.name.startswith(RUNQ_SIGNAL + OWN_RUNQ_NOTE[:14])),
               None)
    if own is not None and st.cause != "cpu":
        st.evidence.append(
            f"Its traced threads waited for a CPU {own.suspect:,.0f} ms per s in the windows "
            f"against {own.others:,.0f} on the other nodes, mostly behind the job's own "
            "processes (its ranks, their loader workers): they kept each other waiting (more "
            "CPU work per step than its peers', or fewer CPUs: a cpuset, cpu.max), not "
            "another process, so CPU contention is not named.")
    if short is not None:
        st.evidence.append(short)
    towards = next((s for s in st.signals if s.name == TOWARDS_LATE_SIGNAL), None)
    if towards is not None and st.cause != "network":
        # the late nodes it resent towards (over the run: one query per late node)
        late = sorted((nodes[n][0] for n in late_peers
                       if retransmits_towards(con, st.node_id, n)), key=natural_key)
        whom = ", ".join(late) or "late nodes"
        clear = st.cause_confidence == "clear"
        st.evidence.append(
            f"Its job connections retransmitted {towards.suspect:g} segments per s towards "
            f"{whom} (late too) in the windows: not counted against it, as a sender waits "
            "for a late receiver" + ("." if clear else "; it may be " + (
                "that node's" if len(late) == 1 else "their") + " victim."))
        if not clear:     # a clear cause of its own: a straggler of its own, not a victim
            st.victim_of = late
    st.next_step = next_step(st.cause, st.node, st.top_offenders, st.evidence_facts)


def _cpu_short_of_cost(st: Straggler, secs: float) -> str | None:
    """Why CPU contention cannot account for the straggler's cost, or None when it can
    (or when the scheduler was not traced)."""
    if st.cause != "cpu" or st.cost_s <= 0:
        return None
    rq = next((s for s in st.signals if s.name == RUNQ_SIGNAL), None)
    if rq is None:
        return None
    extra_s = max(0.0, rq.suspect - rq.others) / 1e3 * secs
    if extra_s >= CPU_EXPLAINS_SHARE * st.cost_s:
        return None
    return (f"Its threads waited {extra_s:.2f} s longer for a CPU than the other nodes' in "
            f"the windows, while the others waited {st.cost_s:.2f} s for it: CPU "
            "contention cannot account for most of that wait.")


def _why_loose(a: Analysis) -> str:
    """Why the clocks are known only that loosely, from what the alignment recorded."""
    if any(r["rate_clamped"] for r in a.alignment):
        return ("clock rates beyond what a crystal does were bounded, so those lines "
                "cannot follow every observation")
    if not any(r["sync_points"] for r in a.alignment):
        return ("no sync observed a collective's completion tightly, and the clocks' own "
                "claims do not bound them")
    return "the observations that bound them leave that much room"


