"""The clocks of a merge: the sample of sync points that align.py reads, its result
written to clock_alignment, and the rows an incremental merge realigns
(docs/merge.md, "Clock alignment").
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from . import align
from .causal import FULL_DEPENDENCY_OPS
from .copying import PASS3_TABLES, aligned_sql, bundle_predicate
from .fleet_schema import time_point_columns
from .messages import message_pairs, sample_progress
from .syncpoints import SORTED_OPS, WAKE_COLUMNS, attached, node_wakeups

if TYPE_CHECKING:
    from .core import MergeResult, _Fleet

#: Collectives (at most, about) the alignment looks at; more adds time, not accuracy.
ALIGN_SAMPLE = 5_000
#: Nodes whose late wake-ups are looked up at once (one core each).
WAKEUP_THREADS = 2


def clock_claim(source, synchronized, maxerr, ref_off, root_delay, root_disp):
    if source == "system":
        if synchronized != 1 or maxerr is None:    # NULL: not known to be synchronized
            return None
        return int(maxerr)
    if source == "chrony" and root_disp is not None and root_delay is not None:
        return int(abs(ref_off or 0) + root_disp + root_delay / 2)
    return None


def sample_sync_points(fl: _Fleet, pending: list) -> None:
    """temp.sample_sp: the sync points the alignment looks at."""
    con = fl.con
    # The estimator needs thousands of collectives, not millions: take every k-th seq of
    # each communicator (spread over the whole capture), at most ~ALIGN_SAMPLE in all.
    # Distinct collectives: the most any one node observed (nodes of one job see the same
    # ones), counted by the helper threads.
    n_coll = fl.collectives_seen
    every = max(1, -(-n_coll // ALIGN_SAMPLE))
    fl.sample_every = every

    # The sample: from each new bundle's sync points (helper threads' scratch files) and
    # from the rows of earlier merges (st.sp).
    # One row per collective row of a sampled seq: its entry and/or the completion it
    # observed (tight or not), op as its index in SORTED_OPS.
    con.execute("DROP TABLE IF EXISTS temp.sample_sp")
    con.execute("CREATE TEMP TABLE sample_sp (id INTEGER PRIMARY KEY, node_id INTEGER, "
                "comm_id_hash TEXT, seq INTEGER, mono_ns INTEGER, entry_ns INTEGER, "
                "tight INTEGER, op INTEGER, pid INTEGER, tid INTEGER, wait_ns INTEGER)")
    cols = "(node_id, comm_id_hash, seq, mono_ns, entry_ns, tight, op, pid, tid, wait_ns)"
    op_index = "CASE op " + " ".join(f"WHEN '{o}' THEN {k}" for k, o in
                                     enumerate(SORTED_OPS)) + " END"
    # rows of earlier merges (SQL path): their observations and their entries
    con.execute(f"INSERT INTO temp.sample_sp {cols} SELECT node_id, comm_id_hash, seq, "
                "mono_ns, NULL, tight, NULL, pid, tid, wait_ns FROM st.sp WHERE seq % ? = 0",
                (every,))
    con.execute(f"INSERT INTO temp.sample_sp {cols} SELECT node_id, comm_id_hash, seq, "
                f"NULL, mono_ns, 0, {op_index}, NULL, NULL, NULL FROM st.ent "
                "WHERE seq % ? = 0", (every,))
    insert = f"INSERT INTO temp.sample_sp {cols} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    runs = [(path, nid) for path, nid, _ in fl.old_runs] + \
        [(path, item["node_id"]) for item in pending for path in item["bundle"].run_paths]
    if runs:
        with con:
            for path, nid in runs:
                fl.fastcoll.sample_into(con.sqlite3_pointer(), str(path), every, insert, nid)
    for item in pending:
        if item["bundle"].sync_path is not None:
            with attached(con, item["bundle"].sync_path, "s"):
                con.execute(f"INSERT INTO temp.sample_sp {cols} SELECT ?, comm_id_hash, seq, "
                            "mono_ns, NULL, tight, NULL, pid, tid, wait_ns FROM s.sp "
                            "WHERE seq % ? = 0", (item["node_id"], every))
            with attached(con, item["bundle"].db_path, "b"):
                con.execute(f"INSERT INTO temp.sample_sp {cols} SELECT ?, e.comm_id_hash, "
                            f"e.seq, NULL, e.timestamp_ns, 0, {op_index.replace('op', 'e.op', 1)}, "
                            "NULL, NULL, NULL "
                            "FROM b.nccl_events e WHERE typeof(e.comm_id_hash) = 'text' AND "
                            f"typeof(e.seq) = 'integer' AND e.seq % ? = 0 AND "
                            f"{bundle_predicate(item['bundle'], 'nccl_events')}",
                            (item["node_id"], every))
    # TCP sends and receives of the same bytes on two nodes (messages.py)
    sample_progress(con, pending, bundle_predicate)
    # observations that a late wake-up delayed: back to the wake-up (syncpoints.py). Each
    # node's images are read on a connection of its own, two nodes at a time (their
    # sched_events scans release the GIL: this is time the other core would idle); the
    # moves are applied here.
    by_node: dict[int, list] = {}
    for item in pending:
        by_node.setdefault(item["node_id"], []).append(item)
    pool = ThreadPoolExecutor(max_workers=WAKEUP_THREADS, thread_name_prefix="ingero-wakeups")
    try:
        futures = {nid: pool.submit(node_wakeups, [i["bundle"].db_path for i in items], nid,
                                    con.execute(f"SELECT {WAKE_COLUMNS} FROM temp.sample_sp "
                                                "WHERE node_id = ? AND tid IS NOT NULL",
                                                (nid,)).fetchall())
                   for nid, items in by_node.items()}
        moves_of = {}       # bundle_id -> its moves
        for nid, items in by_node.items():
            for item, moves in zip(items, futures[nid].result()):
                moves_of[item["bundle_id"]] = moves
    finally:
        # an error or Ctrl-C: the nodes not begun are not read
        pool.shutdown(wait=True, cancel_futures=True)
    for item in pending:        # in input order, as the log has always been written
        moves = moves_of[item["bundle_id"]]
        with con:
            con.executemany("UPDATE temp.sample_sp SET mono_ns = mono_ns - ? WHERE id = ?",
                            [(m, i) for i, m in moves])
        if moves:
            fl.log("info", "late_wakeups", f"{len(moves)} sampled sync returns moved back to "
                   "their thread's wake-up (median "
                   f"{moves[len(moves) // 2][1] / 1e3:.0f} us of run-queue wait)",
                   input=item["shown"], node_id=item["node_id"], count=len(moves))


def align_nodes(fl: _Fleet, res: MergeResult) -> dict[int, align.NodeAlignment]:
    con = fl.con
    nodes = {nid: align.NodeInput(nid, clock_key=boot) for nid, boot in
             con.execute("SELECT node_id, boot_id FROM nodes")}
    for row in con.execute(
            "SELECT node_id, source, mono_before_ns, mono_after_ns, realtime_ns, "
            "synchronized, adj_maxerror_ns, adj_esterror_ns, ref_offset_ns, root_delay_ns, "
            "root_dispersion_ns FROM clock_samples WHERE realtime_ns IS NOT NULL "
            "AND typeof(realtime_ns) = 'integer' AND source IN ('system', 'chrony')"):
        nid, src, mb, ma, rt, sync, maxe, este, ref, rdel, rdisp = row
        if ma < mb:
            continue
        claim = clock_claim(src, sync, maxe, ref, rdel, rdisp)
        est = None
        if sync != 0 and isinstance(este, int):
            est = abs(este)
        elif claim is not None:
            est = claim
        nodes[nid].samples.append(align.ClockSample(
            mid=(mb + ma) // 2, realtime=rt, half_bracket=(ma - mb + 1) // 2, claim=claim,
            est=est))
    for nid, su, sm, eu, em in con.execute(
            "SELECT node_id, capture_start_utc_ns, capture_start_mono_ns, "
            "json_extract(manifest, '$.capture.end_utc_ns'), capture_end_mono_ns FROM bundles"):
        nodes[nid].manifest_pairs += [(su, sm), (eu, em)]

    full_ops = {k for k, o in enumerate(SORTED_OPS) if o in FULL_DEPENDENCY_OPS}

    def groups():
        """Per sampled collective, per node: the latest entry, the earliest observed
        completion and the earliest tight one (raw monotonic)."""
        cur = con.cursor()
        key, obs, full = None, [], True
        for comm, seq, nid, ent, obs_any, obs_tight, op_lo, op_hi in cur.execute(
                "SELECT comm_id_hash, seq, node_id, MAX(entry_ns), MIN(mono_ns), "
                "MIN(CASE WHEN tight THEN mono_ns END), MIN(op), MAX(op) "
                "FROM temp.sample_sp GROUP BY comm_id_hash, seq, node_id "
                "ORDER BY comm_id_hash, seq, node_id"):
            if (comm, seq) != key:
                if obs:
                    yield key, full, obs
                key, obs, full = (comm, seq), [], True
            if op_lo is not None and (op_lo != op_hi or op_lo not in full_ops):
                full = False
            obs.append((nid, ent, obs_any, obs_tight))
        if obs:
            yield key, full, obs

    pairs, conns, stats = message_pairs(con)
    if stats["connections"] or stats["left_out"]:
        fl.log("info", "message_pairs", f"{stats['connections']} TCP connections between "
               f"nodes (one direction each) paired by their byte positions ({len(pairs)} "
               f"tightest send/receive pairs kept); {stats['left_out']} left out (a 4-tuple "
               "seen on more than one node, reused, or between a node and itself)",
               count=len(pairs))
    params = align.align_fleet(nodes, groups, fl.min_latency_ns, messages=pairs,
                               connections=conns)
    names = dict(con.execute("SELECT node_id, name FROM nodes"))
    for a in params.values():
        if a.exceeds_claim:
            msg = (f"node {names[a.node_id]}: clock correction up to {a.max_correction_ns / 1e6:.3f}"
                   f" ms exceeds its claimed error bound ({(a.claimed_error_ns or 0) / 1e6:.3f} ms):"
                   " its time service is lying")
            fl.log("warning", "clock_claim_exceeded", msg, node_id=a.node_id)
            res.warnings.append(msg)
        if a.method == "manifest":
            msg = f"node {names[a.node_id]}: no usable clock samples; times rest on the manifest only"
            fl.log("warning", "no_clock_samples", msg, node_id=a.node_id)
            res.warnings.append(msg)
        if a.rate_clamped:
            msg = (f"node {names[a.node_id]}: the collectives or the TCP messages suggested "
                   f"a clock rate beyond {align.DRIFT_BOUND_PPM:.0f} ppm, which no crystal "
                   f"has; bounded to {a.drift_ppm:+.0f} ppm (the observations may be biased)")
            fl.log("warning", "rate_clamped", msg, node_id=a.node_id)
            res.warnings.append(msg)
        if a.causal_moved_ns:
            room = ("unbounded" if a.relative_uncertainty_ns is None
                    else f"{a.relative_uncertainty_ns / 1e6:.3f} ms")
            why = ("collective entries and completions, or of TCP sends and receives"
                   if a.message_pairs else "collective entries and completions")
            msg = (f"node {names[a.node_id]}: its clock line contradicted the order of "
                   f"{why}; moved by up to "
                   f"{a.causal_moved_ns / 1e6:.3f} ms to the nearest consistent line (a "
                   f"choice within the feasible band; relative uncertainty {room})")
            fl.log("warning", "clock_causal_move", msg, node_id=a.node_id)
            res.warnings.append(msg)
        if a.messages_refused:
            msg = (f"node {names[a.node_id]}: {a.messages_refused} TCP send/receive pairs "
                   "were not used: their connection contradicts the collectives or the "
                   "clocks' honest claims by more than their uncertainty (a 4-tuple reused "
                   "by another connection?), or the pairs contradict each other")
            fl.log("warning", "messages_refused", msg, node_id=a.node_id,
                   count=a.messages_refused)
            res.warnings.append(msg)
    return params


def warn_violations(fl, res, params) -> None:
    """A node whose aligned line still leaves completion observations before their
    collective's latest entry (a rate bounded to what crystals do, here or at a peer,
    leaves no line that honours them all): warned, with the count, not hidden."""
    names = dict(fl.con.execute("SELECT node_id, name FROM nodes"))
    for nid, a in params.items():
        if not a.violations_after:
            continue
        msg = (f"node {names.get(nid, nid)}: {a.violations_after} completion observations "
               "still come before their collective's latest entry after alignment (a clock "
               "rate bounded here or at a peer?): times between these nodes are uncertain "
               "by more than the lines say")
        fl.log("warning", "clock_violations", msg, node_id=nid, count=a.violations_after)
        res.warnings.append(msg)


def realign_existing(con, params, old_params, max_old_bundle) -> None:
    """Rows merged earlier: move their times from the old line to the new one (the raw
    value is mono_ns, or recovered exactly enough from the old line)."""
    for nid, (old_off, old_slope) in old_params.items():
        p = params.get(nid)
        if p is None or (p.offset_ns == old_off and p.slope == old_slope):
            continue
        b = {"off": p.offset_ns, "slope": p.slope, "ooff": old_off, "oslope": old_slope,
             "node": nid, "maxb": max_old_bundle}
        for table in PASS3_TABLES:
            times = time_point_columns(table)
            if not times:
                continue
            sets = []
            for c in times:
                raw = "mono_ns" if c == times[0] else \
                    f"CAST(ROUND(({c} - :ooff) / (1.0 + :oslope)) AS INTEGER)"
                sets.append(f"{c} = {aligned_sql(raw)}")
            con.execute(f"UPDATE {table} SET {', '.join(sets)} WHERE node_id = :node "
                        "AND bundle_id <= :maxb", b)
    # completion of old rows may change with the new observations and alignment
    con.execute("""UPDATE nccl_events SET
          completion_ns = (SELECT c.completion_ns FROM cp.completion c
                           WHERE c.comm_id_hash = nccl_events.comm_id_hash
                             AND c.seq = nccl_events.seq)
        WHERE bundle_id <= ?""", (max_old_bundle,))
    con.execute("""UPDATE nccl_events SET duration_ns = CASE
          WHEN completion_ns > timestamp_ns + call_duration_ns THEN completion_ns - timestamp_ns
          ELSE call_duration_ns END WHERE bundle_id <= ?""", (max_old_bundle,))


def write_alignment(con, params) -> None:
    con.execute("DELETE FROM clock_alignment")
    con.executemany(
        "INSERT INTO clock_alignment (node_id, method, offset_ns, slope, drift_ppm, "
        "uncertainty_ns, relative_uncertainty_ns, component, sync_points, sync_points_used, "
        "residual_ns, violations_before, violations_after, clock_samples, steps, "
        "claimed_error_ns, max_correction_ns, exceeds_claim, segments, causal_early_ns, "
        "causal_late_ns, causal_moved_ns, rate_clamped, message_pairs) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(a.node_id, a.method, a.offset_ns, a.slope, a.drift_ppm, a.uncertainty_ns,
          a.relative_uncertainty_ns, a.component, a.sync_points, a.sync_points_used,
          a.residual_ns, a.violations_before, a.violations_after, a.clock_samples, a.steps,
          a.claimed_error_ns, a.max_correction_ns, int(a.exceeds_claim),
          json.dumps(a.segments), a.causal_early_ns, a.causal_late_ns, a.causal_moved_ns,
          int(a.rate_clamped), a.message_pairs) for a in params.values()])
