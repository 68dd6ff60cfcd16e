"""Hangs and desyncs: ranks of a communicator that never entered a collective their peers
entered, and what each was doing instead.

A collective (comm_id_hash, seq) seen on fewer ranks than the communicator's size and
than the collective before it is where a rank stopped: the ranks seen at seq N-1 and
never again at N or later are named (a rank that misses N but comes back lost events,
it did not stop), with the NCCL call they were inside when the capture stopped
(calls_in_flight: "rank 1 has been inside ALL_REDUCE seq 3 since ..." when that call is N
itself), their last collective, their last CUDA calls
(those without a return were still in flight when the capture stopped), where they were
off CPU, and the stacks of those calls, in the spirit of PyTorch's Flight Recorder
analysis by sequence id, from the eBPF data alone. A node whose capture ended before its
peers entered seq N (HANG_MARGIN_NS) is the capture's edge, not a hang.

When no rank stopped that way, a communicator whose last collective every rank entered,
with ranks still inside a call for HANG_MARGIN_NS or more at the capture's stop
(calls_in_flight), is a stall: the collective itself never completed (_stalls).
"""

from __future__ import annotations

import json

#: A rank is only said to have stopped if its node's capture went on this long after its
#: peers entered the collective it never entered.
HANG_MARGIN_NS = 1_000_000_000
#: A call open at the stop is a stall only if it was open this many times the longest gap
#: between two collectives of its communicator (and HANG_MARGIN_NS).
STALL_FACTOR = 10
#: Stopped ranks described in full (the others are counted).
MAX_DETAILED = 8
#: Last CUDA calls shown per stopped rank.
LAST_CALLS = 5

#: SQL: the size of collective c's communicator. Recorded at init; for a communicator
#: inferred from captures attached later (docs/merge.md, late attach) only its world
#: communicator has one, so for the others it is the most processes any of its
#: collectives was seen on: a process that stops entering is then still one fewer.
SIZE_SQL = ("COALESCE(c.nranks, (SELECT MAX(x.ranks_seen) FROM collectives x "
            "WHERE x.comm_id_hash = c.comm_id_hash))")

__all__ = ["HANG_MARGIN_NS", "find_hangs", "hang_text"]


def _frames(raw, depth=8) -> list[str]:
    try:
        frames = json.loads(raw or "[]")
    except ValueError:
        return []
    out = []
    for f in frames[:depth]:
        if f.get("symbol") or f.get("name"):    # name: kind unknown (spec, section 7)
            out.append(f"{f.get('symbol') or f['name']} "
                       f"({f.get('module', '?').rsplit('/', 1)[-1]})")
        elif f.get("py_func"):
            out.append(f"{f['py_func']} ({f.get('py_file', '?').rsplit('/', 1)[-1]}:"
                       f"{f.get('py_line', '?')})")
        elif f.get("file"):
            out.append(f"{f['file']}:{f.get('line', '?')}")
        else:
            out.append(f.get("ip", "?"))
    return out


def find_hangs(con, ranks_of) -> list[dict]:
    """One dict per rank that stopped, earliest first. ``ranks_of``: a function giving
    (node_id, pid) -> global rank (merge.ranks.process_ranks; called only if a rank
    stopped: it reads every nccl_events row)."""
    starts = con.execute(
        f"SELECT c.comm_id_hash, c.seq, c.op, {SIZE_SQL}, c.nranks IS NULL, c.ranks_seen, "
        "c.first_entry_ns, "
        "(SELECT MAX(x.seq) FROM collectives x WHERE x.comm_id_hash = c.comm_id_hash), "
        "(SELECT MAX(x.last_entry_ns) FROM collectives x "
        "WHERE x.comm_id_hash = c.comm_id_hash), (SELECT MAX(last_utc_ns) FROM nodes) "
        "FROM collectives c JOIN collectives p ON p.comm_id_hash = c.comm_id_hash "
        f"AND p.seq = c.seq - 1 WHERE c.ranks_seen < {SIZE_SQL} "
        "AND c.ranks_seen < p.ranks_seen ORDER BY c.first_entry_ns").fetchall()
    out: list[dict] = []
    global_rank: dict | None = None
    for comm, seq, op, nranks, inferred, seen, first, max_seq, last_entry, capture_end in starts:
        for nid, node, pid, rank, last_ts, last_op in con.execute(
                "SELECT p.node_id, nd.name, p.pid, p.rank, p.timestamp_ns, p.op "
                "FROM nccl_events p JOIN nodes nd USING (node_id) "
                "WHERE p.comm_id_hash = ? AND p.seq = ? AND nd.last_utc_ns >= ? "
                "AND NOT EXISTS (SELECT 1 FROM nccl_events q WHERE q.comm_id_hash = "
                "p.comm_id_hash AND q.seq >= ? AND q.node_id = p.node_id AND q.pid = p.pid) "
                "GROUP BY p.node_id, p.pid ORDER BY p.rank",
                (comm, seq - 1, first + HANG_MARGIN_NS, seq)).fetchall():
            if global_rank is None:
                global_rank = ranks_of()
            out.append({"node": node, "node_id": nid, "pid": pid,
                        "rank": global_rank.get((nid, pid), rank), "comm_rank": rank,
                        "comm_id_hash": comm, "nranks": nranks,
                        "size_inferred": bool(inferred), "missed_seq": seq,
                        "missed_op": op, "peers_entered": seen,
                        "peers_entered_ns": first, "peers_last_seq": max_seq,
                        "quiet_s": round(max(0, (capture_end or 0) - last_entry) / 1e9, 1),
                        "last_seq": seq - 1, "last_op": last_op, "last_ns": last_ts,
                        "last_calls": [], "in_flight": 0, "off_cpu": None, "stack": [],
                        "inside": None, "stall": False})
    if not out:
        out = _stalls(con, ranks_of)
    for h in out[:MAX_DETAILED]:
        _doing(con, h)
    return out


def _stalls(con, ranks_of) -> list[dict]:
    """When no rank stopped before a collective: communicators whose last collective N
    every rank entered and that, at the capture's stop, had ranks still inside an NCCL
    or CUDA call for HANG_MARGIN_NS, and STALL_FACTOR times the longest gap between two
    of its collectives, or more (calls_in_flight): a long evaluation or checkpoint
    between steps is no stall. The collective itself
    never completed (a GPU-side or network hang, or a rank that died inside it): each
    waiting rank is named, inside what and since when."""
    out: list[dict] = []
    global_rank: dict | None = None
    for comm, seq, op, nranks, inferred, seen, first, capture_end, gap in con.execute(
            f"SELECT c.comm_id_hash, c.seq, c.op, {SIZE_SQL}, c.nranks IS NULL, c.ranks_seen, "
            "c.first_entry_ns, "
            "(SELECT MAX(last_utc_ns) FROM nodes), (SELECT MAX(g) FROM (SELECT "
            "x.first_entry_ns - LAG(x.first_entry_ns) OVER (ORDER BY x.seq) AS g "
            "FROM collectives x WHERE x.comm_id_hash = c.comm_id_hash)) "
            f"FROM collectives c WHERE c.ranks_seen = {SIZE_SQL} "
            "AND c.seq = (SELECT MAX(x.seq) FROM collectives x "
            "WHERE x.comm_id_hash = c.comm_id_hash) ORDER BY c.first_entry_ns").fetchall():
        for nid, node, pid, rank, last_ts, api, since in con.execute(
                "SELECT p.node_id, nd.name, p.pid, p.rank, p.timestamp_ns, f.api, "
                "MIN(f.timestamp_ns) FROM nccl_events p "
                "JOIN nodes nd USING (node_id) JOIN calls_in_flight f ON f.node_id = "
                "p.node_id AND f.pid = p.pid AND f.why = 'stop' AND f.timestamp_ns >= "
                "p.timestamp_ns AND f.observed_ns - f.timestamp_ns >= ? "
                "WHERE p.comm_id_hash = ? AND p.seq = ? GROUP BY p.node_id, p.pid "
                "ORDER BY p.rank", (max(HANG_MARGIN_NS, STALL_FACTOR * (gap or 0)), comm,
                                    seq)).fetchall():
            if global_rank is None:
                global_rank = ranks_of()
            out.append({"node": node, "node_id": nid, "pid": pid,
                        "rank": global_rank.get((nid, pid), rank), "comm_rank": rank,
                        "comm_id_hash": comm, "nranks": nranks,
                        "size_inferred": bool(inferred), "missed_seq": seq,
                        "missed_op": op, "peers_entered": seen, "peers_entered_ns": first,
                        "peers_last_seq": seq,
                        "quiet_s": round(max(0, (capture_end or 0) - since) / 1e9, 1),
                        "last_seq": seq, "last_op": op, "last_ns": last_ts,
                        "last_calls": [], "in_flight": 0, "off_cpu": None, "stack": [],
                        "inside": None, "stall": True, "open_api": api,
                        "open_since_ns": since})
    return out


def _doing(con, h: dict) -> None:
    """What the stopped rank was doing: the NCCL call it was inside (calls_in_flight),
    its last CUDA calls (in flight: recorded open at the capture's stop, or no return
    seen), its longest off-CPU span after its last collective, the stack of its last
    call."""
    key = (h["node_id"], h["pid"])
    row = con.execute(
        "SELECT f.api, f.op, f.comm_id_hash, f.seq, f.timestamp_ns, f.observed_ns, s.frames "
        "FROM calls_in_flight f LEFT JOIN stacks s USING (stack_id) WHERE f.node_id = ? "
        "AND f.pid = ? AND f.source = 'nccl' ORDER BY f.timestamp_ns DESC, f.id LIMIT 1",
        key).fetchone()
    if row:
        api, op, comm, seq, since, seen, frames = row
        h["inside"] = {"api": api, "op": op, "comm_id_hash": comm, "seq": seq,
                       "since_ns": since, "observed_ns": seen,
                       "missed": comm == h["comm_id_hash"] and seq == h["missed_seq"]}
        h["stack"] = _frames(frames)
    for ts, api, dur, frames in con.execute(
            "SELECT * FROM (SELECT e.timestamp_ns, e.api, e.duration_ns, s.frames "
            "FROM cuda_events e LEFT JOIN stacks s USING (stack_id) WHERE e.node_id = ? "
            "AND e.pid = ? ORDER BY e.timestamp_ns DESC LIMIT ?) UNION ALL "
            "SELECT f.timestamp_ns, f.api, NULL, s.frames FROM calls_in_flight f "
            "LEFT JOIN stacks s USING (stack_id) WHERE f.node_id = ? AND f.pid = ? "
            "AND f.source = 'cuda' ORDER BY 1 DESC LIMIT ?",
            key + (LAST_CALLS,) + key + (LAST_CALLS,)):
        h["last_calls"].append({"ns": ts, "api": api,
                                "ms": None if dur is None else round(dur / 1e6, 3),
                                "in_flight": dur is None})
        if not h["stack"]:
            h["stack"] = _frames(frames)
    h["in_flight"] = con.execute(
        "SELECT (SELECT COUNT(*) FROM cuda_events WHERE node_id = ? AND pid = ? "
        "AND duration_ns IS NULL) + (SELECT COUNT(*) FROM calls_in_flight WHERE "
        "node_id = ? AND pid = ? AND source = 'cuda')", key + key).fetchone()[0]
    row = con.execute(
        "SELECT comm, prev_state, timestamp_ns, duration_ns FROM sched_events "
        "WHERE node_id = ? AND pid = ? AND kind = 'off_cpu' AND timestamp_ns >= ? "
        "ORDER BY duration_ns DESC LIMIT 1", key + (h["last_ns"],)).fetchone()
    if row:
        h["off_cpu"] = {"thread": row[0], "state": row[1], "ns": row[2],
                        "ms": round(row[3] / 1e6, 1)}
    if not h["stack"]:
        (frames,) = con.execute(
            "SELECT s.frames FROM nccl_events e JOIN stacks s USING (stack_id) "
            "WHERE e.node_id = ? AND e.pid = ? AND e.comm_id_hash = ? AND e.seq = ?",
            key + (h["comm_id_hash"], h["last_seq"])).fetchone() or (None,)
        h["stack"] = _frames(frames)


def _ranks(h: dict) -> str:
    """The communicator's ranks in words: an inferred one's size is the most seen."""
    if h.get("size_inferred"):
        return (f"{h['nranks']} ranks seen (its size is not known: a communicator inferred "
                "from captures attached after its init)")
    return f"{h['nranks']} ranks"


def hang_text(hangs: list[dict], utc) -> str:
    """The verdict's lead for a hang; ``utc`` formats a fleet time."""
    h = hangs[0]
    ranks = sorted({x["rank"] for x in hangs if x["missed_seq"] == h["missed_seq"]
                    and x["comm_id_hash"] == h["comm_id_hash"]})
    who = (f"rank {h['rank']} ({h['node']}, pid {h['pid']})" if len(ranks) == 1 else
           f"ranks {', '.join(map(str, ranks))} (first: {h['node']}, pid {h['pid']})")
    inside = h.get("inside")
    if h.get("stall"):
        stalled = sorted({x["rank"] for x in hangs if x["comm_id_hash"] == h["comm_id_hash"]})
        return (f"The job hung inside {h['missed_op']} seq {h['missed_seq']} of communicator "
                f"{h['comm_id_hash']}: all {_ranks(h)} entered it from "
                f"{utc(h['peers_entered_ns'])} and no collective of it started after; "
                f"{'rank' if len(stalled) == 1 else 'ranks'} "
                f"{', '.join(map(str, stalled))} still had a call open when the capture "
                f"stopped (rank {h['rank']}, {h['node']}, pid {h['pid']}: {h['open_api']} since "
                f"{utc(h['open_since_ns'])}, {h['quiet_s']:,.1f} s). No rank stopped before "
                "it: the collective itself did not complete (a GPU-side or network hang, or a "
                "rank that died inside it).")
    if inside and inside["missed"]:
        # the Flight Recorder answer: the rank entered the collective and never returned
        text = (f"The job hung: {who} has been inside {h['missed_op']} seq {h['missed_seq']} "
                f"of communicator {h['comm_id_hash']} since {utc(inside['since_ns'])} "
                f"(its {inside['api']} call had not returned when the capture last saw it, "
                f"at {utc(inside['observed_ns'])}); {h['peers_entered']} of its "
                f"{_ranks(h)} returned from that collective from "
                f"{utc(h['peers_entered_ns'])}, then no collective of it started for "
                f"{h['quiet_s']:,.1f} s. Its last completed collective was {h['last_op']} "
                f"seq {h['last_seq']} at {utc(h['last_ns'])}")
    else:
        text = (f"The job hung: {who} never entered {h['missed_op']} seq {h['missed_seq']} "
                f"of communicator {h['comm_id_hash']}, which {h['peers_entered']} of its "
                f"{_ranks(h)} entered from {utc(h['peers_entered_ns'])} (they went "
                f"on to seq {h['peers_last_seq']}, then no collective of it started for "
                f"{h['quiet_s']:,.1f} s until the capture stopped). Its last collective was "
                f"{h['last_op']} seq {h['last_seq']} at {utc(h['last_ns'])}")
        if inside:
            text += (f"; it was inside {inside['api']} from {utc(inside['since_ns'])}, "
                     "which had not returned when the capture stopped")
    if h["last_calls"]:
        c = h["last_calls"][0]
        text += (f"; its last CUDA call, {c['api']} at {utc(c['ns'])}, "
                 + ("was still in flight when the capture stopped" if c["in_flight"]
                    else f"returned after {c['ms']:,.1f} ms"))
    if h["stack"]:
        text += f", in {h['stack'][0]}"
    text += "."
    others = len(hangs) - len(ranks)
    if others > 0:
        text += f" {others} more rank(s) stopped elsewhere (see the hang section)."
    return text
