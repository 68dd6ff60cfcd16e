"""The capture log's minimal entries (docs/bundle-format.md, "The capture log"): a bundle
that does not say which sources ran, or a loss nobody counted, makes the report say
"unknown", never "every source was on and no events were lost"."""

import json

import apsw

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.render import render_html
from ingero_forensics.simulate import FleetConfig, simulate_fleet


def _fleet(d):
    simulate_fleet(d / "b", FleetConfig(nodes=2, ranks_per_node=1, steps=30, fault="none",
                                        seed=5))
    merge_bundles([d / "b"], d / "fleet.db")
    return d / "fleet.db"


def test_a_log_without_source_states_is_unknown(tmp_path):
    db = _fleet(tmp_path)
    assert analyze_fleet(db).capture_issues == []
    con = apsw.Connection(str(db))
    # node 1's log keeps only what says nothing of its sources (a writer that logged
    # warnings only)
    con.execute("DELETE FROM capture_log WHERE node_id = (SELECT MIN(node_id) FROM nodes) "
                "AND event IN ('source_on', 'source_off', 'lost_events')")
    con.close()
    a = analyze_fleet(db)
    first = json.dumps([(i["node"], i["event"]) for i in a.capture_issues])
    assert [i["event"] for i in a.capture_issues] == ["unknown"], first
    assert "which sources ran and whether events were lost is unknown" in \
        a.capture_issues[0]["message"]
    assert "Every source was on" not in render_html(a)


def test_an_uncounted_loss_is_unknown(tmp_path):
    db = _fleet(tmp_path)
    con = apsw.Connection(str(db))
    con.execute("INSERT INTO capture_log (node_id, bundle_id, timestamp_ns, mono_ns, level, "
                "source, event, message, count) SELECT node_id, bundle_id, timestamp_ns, "
                "mono_ns, 'warning', 'cuda', 'lost_events', 'lost, not counted', NULL "
                "FROM capture_log LIMIT 1")
    con.close()
    issues = analyze_fleet(db).capture_issues
    assert [(i["source"], i["event"], i["count"]) for i in issues] == [
        ("cuda", "unknown", None)]
    assert "how many is unknown" in issues[0]["message"]
