"""The nodes of a fleet.db: which node a bundle belongs to (its claimed name, host and
boot; a name that another host or boot holds gets a suffix), whether a bundle of a node
already merged is another segment of its capture, and the node facts (ranks, jobs,
capture span) written once every table is in."""

from __future__ import annotations

import json

from .ranks import process_ranks


def resolve_node(fl, m: dict, shown: str, res) -> int:
    """node_id of the bundle whose manifest is ``m``: the node of the same claimed name,
    host and boot (Conflict if the bundle cannot be another segment of it), else a new
    node, renamed with a suffix (#2, #3, ...) when another host or boot has the name, with
    a warning in fl's log and res.warnings."""
    con = fl.con
    h = m["host"]
    key = (m["node"], h["hostname"], h["boot_id"])
    row = con.execute("SELECT node_id FROM nodes WHERE claimed_name = ? AND hostname = ? "
                      "AND boot_id = ?", key).fetchone()
    if row:
        check_same_boot(con, row[0], m)
        return row[0]
    name = m["node"]
    taken = {r[0] for r in con.execute("SELECT name FROM nodes WHERE name = ? OR name LIKE ?",
                                       (name, name + "#%"))}
    if name in taken:
        k = 2
        while f"{name}#{k}" in taken:
            k += 1
        new = f"{name}#{k}"
        other = con.execute("SELECT hostname, boot_id FROM nodes WHERE name = ?",
                            (name,)).fetchone()
        why = "another host" if other and other[0] != h["hostname"] else "another boot"
        msg = (f"node name {name!r} is already used by {why} (host {other[0] if other else '?'}"
               f"); this bundle (host {h['hostname']}, boot {h['boot_id'][:8]}) becomes "
               f"node {new!r}")
        fl.log("warning", "node_name_conflict", msg, input=shown)
        res.warnings.append(f"{shown}: {msg}")
        name = new
    con.execute("INSERT INTO nodes (name, claimed_name, hostname, boot_id, kernel_release, "
                "tool_version, ranks, job_ids, bundles) VALUES (?, ?, ?, ?, ?, ?, '[]', '[]', 0)",
                (name, m["node"], h["hostname"], h["boot_id"], h.get("kernel_release"),
                 h.get("tool_version")))
    return con.last_insert_rowid()


class Conflict(Exception):
    """A bundle that claims a node, host and boot already merged but cannot be another
    segment of it: it is skipped with this reason."""


#: Segments of one capture follow each other; their windows may touch at a rotation.
OVERLAP_TOLERANCE_NS = 1_000_000_000


def check_same_boot(con, node_id: int, m: dict) -> None:
    """A bundle of a node, host and boot already in fleet.db is one more segment of it
    only if it is not a version of a segment merged (same segment id, other data) and
    its capture window does not overlap one merged (one boot has one clock and one
    capture per node: an overlap is a second capture or altered data, which merged as
    one node made its alignment meaningless)."""
    seg = m["segment"]["id"]
    cap = m["capture"]
    row = con.execute("SELECT file_name FROM bundles WHERE node_id = ? AND segment_id = ?",
                      (node_id, seg)).fetchone()
    if row:
        raise Conflict(f"segment {seg} of node {m['node']} (host {m['host']['hostname']}, "
                        f"same boot) is already merged from {row[0]} with other data: "
                        "altered or re-sealed; not merged")
    row = con.execute(
        "SELECT file_name, capture_start_mono_ns, capture_end_mono_ns FROM bundles "
        "WHERE node_id = ? AND capture_start_mono_ns < ? AND capture_end_mono_ns > ?",
        (node_id, cap["end_mono_ns"] - OVERLAP_TOLERANCE_NS,
         cap["start_mono_ns"] + OVERLAP_TOLERANCE_NS)).fetchone()
    if row:
        raise Conflict(f"capture window overlaps {row[0]} of node {m['node']} (host "
                        f"{m['host']['hostname']}, same boot) by more than "
                        f"{OVERLAP_TOLERANCE_NS // 10**9} s: a second capture or altered "
                        "data, not another segment; not merged")


def update_nodes(con, collective_ranks=None) -> None:
    """The nodes' facts from every table now in. collective_ranks: the collectives'
    distinct ranks when they were read already (ranks.process_ranks)."""
    for (nid,) in con.execute("SELECT node_id FROM nodes").fetchall():
        ranks = sorted(set(process_ranks(con, nid, collective_ranks).values()))
        jobs = sorted({j for (j,) in con.execute(
            "SELECT DISTINCT job_id FROM processes WHERE node_id = ? AND job_id IS NOT NULL",
            (nid,)) if isinstance(j, str)})
        for (mj,) in con.execute("SELECT json_extract(manifest, '$.job_ids') FROM bundles "
                                 "WHERE node_id = ?", (nid,)):
            try:
                jobs = sorted(set(jobs) | {str(j) for j in json.loads(mj or "[]")})
            except (ValueError, TypeError):
                pass
        con.execute("""UPDATE nodes SET ranks = ?, job_ids = ?,
              bundles = (SELECT COUNT(*) FROM bundles WHERE node_id = ?),
              first_mono_ns = (SELECT MIN(capture_start_mono_ns) FROM bundles WHERE node_id = ?),
              last_mono_ns = (SELECT MAX(capture_end_mono_ns) FROM bundles WHERE node_id = ?)
            WHERE node_id = ?""", (json.dumps(ranks), json.dumps(jobs), nid, nid, nid, nid))
    con.execute("""UPDATE nodes SET
          first_utc_ns = (SELECT a.offset_ns + nodes.first_mono_ns +
                          CAST(ROUND(nodes.first_mono_ns * a.slope) AS INTEGER)
                          FROM clock_alignment a WHERE a.node_id = nodes.node_id),
          last_utc_ns = (SELECT a.offset_ns + nodes.last_mono_ns +
                         CAST(ROUND(nodes.last_mono_ns * a.slope) AS INTEGER)
                         FROM clock_alignment a WHERE a.node_id = nodes.node_id)""")


def fleet_jobs(con) -> list[str]:
    """The job ids of every node (nodes.job_ids), sorted."""
    jobs = set()
    for (ids,) in con.execute("SELECT job_ids FROM nodes"):
        try:
            jobs |= {str(j) for j in json.loads(ids or "[]") if j}
        except (ValueError, TypeError):
            pass
    return sorted(jobs)


def node_summary(con) -> list[dict]:
    out = []
    rows = con.execute("SELECT n.node_id, n.name, n.hostname, n.ranks, n.bundles, a.method, "
                       "a.offset_ns, a.drift_ppm, a.uncertainty_ns, a.sync_points_used, "
                       "a.violations_before, a.violations_after, a.exceeds_claim, a.steps "
                       "FROM nodes n LEFT JOIN clock_alignment a USING (node_id) "
                       "ORDER BY n.node_id").fetchall()
    per_node_rows: dict[int, dict] = {}
    for nid, rows_json in con.execute("SELECT node_id, rows FROM bundles"):
        for t, n in json.loads(rows_json).items():
            d = per_node_rows.setdefault(nid, {})
            d[t] = d.get(t, 0) + n
    for (nid, name, host, ranks, nb, method, off, drift, unc, used, vb, va, exc,
         steps) in rows:
        out.append({"node_id": nid, "name": name, "hostname": host, "ranks": json.loads(ranks),
                    "bundles": nb, "rows": per_node_rows.get(nid, {}),
                    "alignment": {"method": method, "offset_ns": off, "drift_ppm": drift,
                                  "uncertainty_ns": unc, "sync_points_used": used,
                                  "violations_before": vb, "violations_after": va,
                                  "exceeds_claim": bool(exc), "steps": steps}})
    return out


def data_start(con) -> int:
    """The start of the data: where ingero-export's --from/--to offsets and the report's
    "seconds from the start of the data" count from. The first node's first UTC time
    (its capture's start), else the earliest event."""
    v = con.execute("SELECT MIN(first_utc_ns) FROM nodes").fetchone()[0]
    if v is None:
        lows = [con.execute(f"SELECT MIN(timestamp_ns) FROM {t}").fetchone()[0]
                for t in ("nccl_events", "cuda_events", "sched_events", "block_events",
                          "tcp_events", "host_samples")]
        lows = [x for x in lows if x is not None]
        v = min(lows) if lows else 0
    return v
