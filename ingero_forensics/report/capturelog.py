"""What a fleet's capture logs do not say (docs/bundle-format.md, "The capture log").

A bundle states which sources ran with a ``source_on`` or ``source_off`` row per source,
and counts what each lost in ``lost_events`` rows. A bundle with no such source row says
nothing about what was seen or lost: the report lists its node as unknown, never as
complete. A ``lost_events`` row without a count is a loss of unknown size.
"""

from __future__ import annotations

__all__ = ["unknown_coverage"]


def unknown_coverage(con, nodes) -> list[dict]:
    """capture_issues entries (event ``unknown``) for nodes whose bundles record no
    source states, or record losses they did not count. ``nodes``: node_id -> (name,)."""
    out = []
    for nid, name, silent, total in con.execute(
            "SELECT nd.node_id, nd.name, SUM(NOT EXISTS (SELECT 1 FROM capture_log l WHERE "
            "l.bundle_id = b.bundle_id AND l.event IN ('source_on', 'source_off'))), "
            "COUNT(*) FROM nodes nd JOIN bundles b USING (node_id) GROUP BY nd.node_id "
            "ORDER BY nd.name"):
        if not silent:
            continue
        which = "its bundles record" if silent == total else \
            f"{silent} of its {total} bundles record"
        out.append({"node": name, "source": "capture", "event": "unknown", "count": None,
                    "message": f"{which} no capture log of sources on or off: which "
                               "sources ran and whether events were lost is unknown"
                               + ("" if silent == total else " for them")})
    for nid, source in con.execute(
            "SELECT DISTINCT node_id, source FROM capture_log WHERE event = 'lost_events' "
            "AND count IS NULL ORDER BY node_id, source"):
        out.append({"node": nodes.get(nid, ("?",))[0], "source": source, "event": "unknown",
                    "count": None, "message": "events were lost and not counted: how "
                                              "many is unknown"})
    return out
