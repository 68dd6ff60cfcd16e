"""The report on a fleet whose captures attached after the communicators' init: the
inferred communicators are shown and marked, the straggler is still named, and streams
the merge could not match are said to be left out of the comparison."""

from __future__ import annotations

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.render import render_html
from ingero_forensics.report.text import render_text

from ..merge.fleetgen import make_fleet
from .test_report_sql import check_page_sql


def test_inferred_communicator_shown_and_straggler_named(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=2, seconds=20, seed=11,
                       shapes=5, straggler_rank=5, straggler_every=2,
                       late_attach={0: 2.0, 1: 3.5, 2: 5.0, 3: 2.7}, retransmits=False)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    a = analyze_fleet(db)
    (c,) = a.inferred_communicators
    assert c["matched"] and c["streams"] == 8 and c["ranks"] == list(range(8)), c
    assert c["nodes"] == [f"node-{k}" for k in range(4)] and not c["choice"]
    assert [s.node for s in a.stragglers] == ["node-2"], a.verdict
    assert "could not be matched" not in a.verdict
    page = render_html(a)
    assert "Communicators inferred" in page and c["comm_id_hash"] in page
    check_page_sql(db, page, min_blocks=5)
    assert f"communicator {c['comm_id_hash']} inferred" in render_text(a)


def test_streams_left_alone_are_said_to_be_left_out(tmp_path):
    """Clocks too loose to tell one step from the next: nothing matched, and the
    verdict says which ranks are not compared instead of a verdict on nothing."""
    fleet = make_fleet(tmp_path / "b", nodes=3, ranks_per_node=1, seconds=8, seed=7,
                       shapes=1, max_offset_ms=80, ntp_step=False,
                       late_attach={0: 1.0, 1: 2.0, 2: 1.5}, retransmits=False)
    db = tmp_path / "f.db"
    merge_bundles(fleet.paths, db)
    a = analyze_fleet(db)
    assert len(a.inferred_communicators) == 3
    assert all(not c["matched"] and "cannot tell them apart" in c["why_alone"]
               for c in a.inferred_communicators)
    assert "3 streams of NCCL calls (ranks 0, 1, 2 on node-0, node-1, node-2) could not " \
        "be matched" in a.verdict, a.verdict
    assert a.stragglers == []
    page = render_html(a)
    assert "matched with nothing" in page
