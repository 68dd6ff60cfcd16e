"""Next commands: what an engineer runs to look further, exact and runnable as they are
(in the directory of the fleet.db): the ingero-export line for a straggler's window and
nodes (with a healthy peer to compare with), or for the last seconds of a rank that
stopped, and the ingero-query lines of the evidence the report cites.
"""

from __future__ import annotations

import datetime as _dt
import shlex

from ..merge.summaries import SYNC_WAIT_APIS
from ..merge.messages import SAME_CONNECTION_NS
from .evidence import window_clause
from .links import LINK_TRANSITS_SQL
from .sql import inline, one_line, shell_quote

#: The export covers the union of a straggler's windows when it is at most this long,
#: else the first EXPORT_CUT_NS of its longest window (enough to compare; a trace of
#: minutes is hard to open).
MAX_EXPORT_NS = 120_000_000_000
EXPORT_CUT_NS = 60_000_000_000
#: Seconds of a stopped rank's trace exported before its last collective.
HANG_LEAD_NS = 5_000_000_000

__all__ = ["next_commands"]


def _iso(ns: int, up: bool = False) -> str:
    """Fleet time to whole-second ISO 8601 UTC, rounded outwards."""
    sec = -(-ns // 1_000_000_000) if up else ns // 1_000_000_000
    return _dt.datetime.fromtimestamp(sec, tz=_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _export(fleet: str, start: int, end: int, nodes: list[str], out: str,
            ranks: list[int] | None = None) -> str:
    cmd = ["ingero-export", fleet, "--chrome-trace", "--from", _iso(start),
           "--to", _iso(end, up=True)]
    if ranks:
        cmd += ["--ranks", ",".join(map(str, ranks))]
    cmd += ["--nodes", ",".join(nodes), "-o", out]
    return " ".join(shlex.quote(c) for c in cmd)


def _query(fleet: str, sql: str) -> str:
    return f"ingero-query {shlex.quote(fleet)} {shell_quote(one_line(sql))}"


def _healthy_peer(a, exclude: set[str]) -> str | None:
    """The node with the median lateness among the others: a fair one to compare with."""
    rest = sorted((nl for nl in a.lateness if nl.name not in exclude and nl.collectives),
                  key=lambda nl: (nl.p90_ms, nl.name))
    return rest[len(rest) // 2].name if rest else None


def next_commands(a) -> list[dict]:
    """[{"what": why to run it, "command": the shell line}], most useful first."""
    out: list[dict] = []
    for h in a.hangs[:1]:
        peer = next((x for x in a.lateness if x.name != h["node"]), None)
        nodes = [h["node"]] + ([peer.name] if peer else [])
        out.append({"what": f"Trace of rank {h['rank']}'s node and a peer's around the "
                            f"hang (from {HANG_LEAD_NS // 10**9} s before its last "
                            "collective to the end of the capture)",
                    "command": _export(a.fleet, h["last_ns"] - HANG_LEAD_NS,
                                       max(a.end_ns or 0, h["peers_entered_ns"]) + 10**9,
                                       nodes, f"hang-rank{h['rank']}.json.gz")})
        for e in a.sql.get("hangs", []):
            if "cuda_events" in e["sql"] and "LIMIT" in e["sql"]:
                out.append({"what": f"Last CUDA calls of rank {h['rank']}, with their "
                                    "stacks", "command": _query(a.fleet, e["sql"])})
                break
    sts = list(a.stragglers)
    if not sts and a.straggler and a.windows:      # the network suspect
        sts = [a]
    for st in sts[:3]:
        node = st.straggler if st is a else st.node
        node_id = st.straggler_node_id if st is a else st.node_id
        if not st.windows:
            continue
        start, end = min(w.start_ns for w in st.windows), max(w.end_ns for w in st.windows)
        what = "its window" if len(st.windows) == 1 else "its windows"
        if end - start > MAX_EXPORT_NS:
            w = max(st.windows, key=lambda w: (w.end_ns - w.start_ns, -w.start_ns))
            start, end = w.start_ns, min(w.end_ns, w.start_ns + EXPORT_CUT_NS)
            what = (f"the first {(end - start) / 1e9:.0f} s of "
                    + ("its window" if len(st.windows) == 1 else "its longest window"))
        peer = _healthy_peer(a, {node})
        why = "a node of typical lateness"
        if st is a and a.link_suspect:
            # the other end of the link is the one to compare with
            s = a.link_suspect
            peer, why = (s["to"] if node == s["from"] else s["from"]), "the link's other end"
        nodes = [node] + ([peer] if peer else [])
        out.append({"what": f"Trace of {node} in {what}"
                            + (f", beside {peer} ({why})" if peer else ""),
                    "command": _export(a.fleet, start, end, nodes,
                                       f"{node}-window.json.gz")})
        if st is a and a.link_suspect:
            # nobody arrived late and nothing retransmitted: what named it is the transit
            out.append(_link_transits_command(a, a.link_suspect))
            continue
        if st is a and a.gpu_suspect:
            # nobody arrived late: what named it is its waits for its own GPU work
            apis = ", ".join(f"'{x}'" for x in SYNC_WAIT_APIS)
            out.append({"what": "Waits for their own GPU work (event and device "
                                "synchronizations) per process, every node, longest first "
                                "(mean and longest: SQLite has no median, which the "
                                "verdict quotes)",
                        "command": _query(a.fleet, (
                            "SELECT n.name AS node, c.pid, COUNT(*) AS waits, "
                            "ROUND(AVG(c.duration_ns) / 1e6, 3) AS mean_ms, "
                            "ROUND(MAX(c.duration_ns) / 1e6, 3) AS max_ms FROM cuda_events c "
                            "JOIN nodes n ON n.node_id = c.node_id WHERE c.duration_ns IS NOT "
                            f"NULL AND c.api IN ({apis}) GROUP BY n.name, c.pid "
                            "ORDER BY mean_ms DESC"))})
        else:
            w_sql, w_params = window_clause([(w.start_ns, w.end_ns) for w in st.windows],
                                            "e.timestamp_ns")
            out.append({"what": f"Latest arrivals of {node} in {what}: rank and ms after "
                                "the first rank entered",
                        "command": _query(a.fleet, inline(
                            "SELECT c.seq, c.op, e.rank, e.pid, (e.timestamp_ns - "
                            "c.first_entry_ns) / 1e6 AS after_first_ms FROM nccl_events e "
                            "JOIN collectives c ON c.comm_id_hash = e.comm_id_hash AND "
                            f"c.seq = e.seq WHERE e.node_id = ? AND {w_sql} ORDER BY "
                            "after_first_ms DESC LIMIT 20", [node_id] + w_params))})
        cited = [e for e in a.sql.get(f"evidence:{node_id}", []) if e["rows"]]
        for k, e in enumerate(cited, 1):
            out.append({"what": f"Evidence on {node} the report cites"
                                + (f" ({k} of {len(cited)})" if len(cited) > 1 else ""),
                        "command": _query(a.fleet, e["sql"])})
    if a.also_slow_link:
        out.append(_link_transits_command(a, a.also_slow_link))   # the second finding's
    return out


def _link_transits_command(a, s: dict) -> dict:
    """The per-link transits as the report paired them; where the link was slow in
    periods of the run only, the arrivals in those periods (the figures the verdict
    quotes, for every link)."""
    periods = " OR ".join(f"(t.arrival_ns >= {w['start_ns']} AND t.arrival_ns < {w['end_ns']})"
                          for w in s["windows"])
    n = len(s["windows"])
    return {"what": "Transit of the job's bytes per link, as the report paired them"
                    + (f", in the link's {'period' if n == 1 else f'{n} periods'}" if n else "")
                    + " (mean and longest: SQLite has no median, which the verdict quotes)",
            "command": _query(a.fleet, (
                "SELECT s.name AS sender, r.name AS receiver, COUNT(*) AS "
                "arrivals, ROUND(AVG(t.transit_ns) / 1e6, 3) AS mean_ms, "
                "ROUND(MAX(t.transit_ns) / 1e6, 3) AS max_ms FROM ("
                + inline(LINK_TRANSITS_SQL, {"same": SAME_CONNECTION_NS})
                + ") t JOIN nodes s ON s.node_id = t.sender JOIN nodes r ON "
                "r.node_id = t.receiver" + (f" WHERE {periods}" if periods else "")
                + " GROUP BY 1, 2 ORDER BY mean_ms DESC"))}
