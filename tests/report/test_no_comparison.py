"""A single node, or no NCCL at all: no straggler can be named, the verdict says what is
missing and how to get it (never styled as a healthy verdict), and the page shows what
the capture has: host signals, where the traced processes waited, who held their CPUs."""

import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.render import render_html
from ingero_forensics.report.text import render_text
from ingero_forensics.simulate import FleetConfig, simulate_fleet
from ingero_forensics.simulate import node as sim_node

from .test_report_sql import check_page_sql


class NoNcclWriter(sim_node.BundleWriter):
    """A capture that never saw NCCL (uprobes off, or a job without NCCL)."""

    def add_many(self, table, rows):
        if table.startswith("nccl_"):
            return None
        return super().add_many(table, rows)


def _fleet(d, nodes, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr(sim_node, "BundleWriter", NoNcclWriter)
    simulate_fleet(d / "b", FleetConfig(nodes=nodes, ranks_per_node=2, steps=40, seed=6,
                                        workers=1))
    merge_bundles([d / "b"], d / "fleet.db")
    return d / "fleet.db"


def _check(db, lead):
    a = analyze_fleet(db)
    assert a.inconclusive and a.straggler is None and a.stragglers == []
    assert a.verdict.startswith(lead), a.verdict
    assert a.start_ns and a.end_ns and a.end_ns > a.start_ns
    titles = [t["title"] for t in a.host]
    assert "Host signals" in titles and "Where the traced processes waited off CPU" in titles
    page = render_html(a)
    assert 'class="verdict unsure"' in page and "from - to -" not in page
    assert "Lateness at collectives" not in page
    check_page_sql(db, page, min_blocks=4)
    # the text form shows what the page shows (it said "below" and showed none of it),
    # and no per-node lateness table without lateness
    text = render_text(a)
    for t in a.host:
        assert t["title"] in text
        first = t["rows"][0][t["cols"][0][0]]
        assert str(first) in text
    assert "Every node" not in text
    # identifiers as they are, to paste into ps or kill; quantities grouped
    runq = next(t for t in a.host if t["title"] == "Who held their CPUs")
    pids = [r["pid"] for r in runq["rows"] if r["pid"] is not None]
    assert pids and any(p >= 1000 for p in pids), runq["rows"]
    lines = text.splitlines()
    for r in runq["rows"]:
        if r["pid"] is not None:
            assert any(line.split()[:3] == [r["node"], r["task"], str(r["pid"])]
                       for line in lines), (r, text)
    return a


def test_single_node(tmp_path):
    a = _check(_fleet(tmp_path, 1), "Not enough data to name a straggler: one node, node-00")
    assert "ingero-merge" in a.verdict


def test_no_nccl(tmp_path, monkeypatch):
    a = _check(_fleet(tmp_path, 2, monkeypatch),
               "Not enough data to name a straggler: no NCCL collectives were captured")
    assert "ingero-capture --check" in a.verdict


@pytest.mark.parametrize("fault", ["cpu"])
def test_comparable_fleet_has_no_host_section(fleets, fault):
    db, _ = fleets(fault)
    a = analyze_fleet(db)
    assert not a.inconclusive and a.host == []
