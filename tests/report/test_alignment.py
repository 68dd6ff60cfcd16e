"""The report's clock section on a fleet whose nodes exchanged TCP messages."""

from __future__ import annotations

import apsw

from ..merge.fleetgen import make_fleet
from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.render import render_html


def test_message_pairs_shown_with_their_bound(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=10, seed=3,
                       claims=False, ntp_step=False, retransmits=False, queued=8,
                       messages=True)
    merge_bundles(fleet.paths, tmp_path / "f.db")
    a = analyze_fleet(tmp_path / "f.db")
    con = apsw.Connection(str(tmp_path / "f.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        stored = dict(con.execute("SELECT node_id, message_pairs FROM clock_alignment"))
    finally:
        con.close()
    assert {r["node_id"]: r["message_pairs"] for r in a.alignment} == stored
    assert all(n > 0 for n in stored.values())
    page = render_html(a)
    assert "<th>TCP send/receive pairs</th>" in page
    assert "TCP send/receive pairs: a send on one node" in page
    for n in stored.values():
        assert f'<td class="num">{n}</td>' in page


def test_a_fleet_without_messages_says_nothing_of_them(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=3, ranks_per_node=1, seconds=5, seed=3)
    merge_bundles(fleet.paths, tmp_path / "f.db")
    a = analyze_fleet(tmp_path / "f.db")
    assert [r["message_pairs"] for r in a.alignment] == [0, 0, 0]
    assert "TCP send/receive pairs: a send on one node" not in render_html(a)
