"""Message bounds (merge/messages.py): TCP sends and the receives of their bytes on
other nodes, paired by stream position, bound the clocks far more tightly than the
collectives; rows that could pair across connections are never paired."""

from __future__ import annotations

import apsw
import pytest

from .fleetgen import make_fleet
from .test_align import alignment, errors_at_true_times
from ingero_forensics.merge import merge_bundles


def relative_errors(fleet, db, seconds) -> dict[int, int]:
    """Per node, its median (aligned - true) minus the median node's, ns."""
    errs = errors_at_true_times(fleet, alignment(db), seconds)
    med = {nid: e[len(e) // 2] for nid, e in errs.items()}
    common = sorted(med.values())[len(med) // 2]
    return {nid: m - common for nid, m in med.items()}


def log_of(db, event):
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return con.execute("SELECT message, count FROM merge_log WHERE event = ?",
                           (event,)).fetchall()
    finally:
        con.close()


@pytest.mark.parametrize("messages", [False, True])
def test_messages_place_clocks_collectives_cannot(tmp_path, messages):
    """Unsynchronized clocks, and every synchronization waits on kernels queued after
    its collective (queued=8), so no completion is observed tightly: the collectives
    alone bound each node only loosely (milliseconds). The ring's TCP messages (15-60 us
    from a send to the receive of its bytes) put every node within 100 us of the
    truth, and the stated relative uncertainty covers the true error."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=20, seed=5,
                       claims=False, ntp_step=False, retransmits=False, queued=8,
                       messages=messages)
    merge_bundles(fleet.paths, tmp_path / "f.db")
    rel = relative_errors(fleet, tmp_path / "f.db", 20)
    al = alignment(tmp_path / "f.db")
    stated = {n: a["relative_uncertainty_ns"] for n, a in al.items()}
    print(f"messages={messages}: relative errors (us) "
          f"{ {n: round(v / 1e3) for n, v in rel.items()} }; stated (us) "
          f"{ {n: None if v is None else v // 1000 for n, v in stated.items()} }; pairs "
          f"{ {n: a['message_pairs'] for n, a in al.items()} }")
    for nid in al:
        assert stated[nid] is not None and abs(rel[nid]) <= stated[nid] + 1_000, \
            (nid, rel, stated)
    if not messages:
        # what the messages improve on: milliseconds of stated room
        assert max(stated.values()) >= 1_000_000, stated
        assert all(a["message_pairs"] == 0 for a in al.values())
        assert not log_of(tmp_path / "f.db", "message_pairs")
        return
    assert max(abs(v) for v in rel.values()) <= 100_000, rel
    assert max(stated.values()) <= 200_000, stated
    assert all(a["message_pairs"] > 0 for a in al.values()), al
    ((msg, count),) = log_of(tmp_path / "f.db", "message_pairs")
    assert msg.startswith("4 TCP connections between nodes (one direction each) paired") \
        and count > 0, msg


def test_ipv4_mapped_addresses_pair_with_plain_ones(tmp_path):
    """Half the nodes write their tcp_progress addresses IPv4-mapped (::ffff:10.0.0.2,
    family 6), as a writer following the spec's general rule for IP addresses would, the
    others plain IPv4: the two ends of each connection are still the same addresses, so
    every node is paired and placed within 100 us."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=20, seed=5,
                       claims=False, ntp_step=False, retransmits=False, queued=8,
                       messages=True, mapped_addresses=True)
    merge_bundles(fleet.paths, tmp_path / "f.db")
    al = alignment(tmp_path / "f.db")
    assert all(a["message_pairs"] > 0 for a in al.values()), al
    rel = relative_errors(fleet, tmp_path / "f.db", 20)
    assert max(abs(v) for v in rel.values()) <= 100_000, rel


def test_connections_that_cannot_be_told_apart_are_not_used(tmp_path):
    """A loopback 4-tuple on every node, a 4-tuple two nodes send on, and one reused by
    a second connection that each end's capture saw only one of: each, paired, would
    say a send came milliseconds or seconds after its receive and move a clock that
    far. The first is never a candidate, the second is left out (one 4-tuple, two
    senders), the third looks like one connection with a 10 s clock offset and is
    refused because the collectives place both nodes far better than that. The ring
    still places every node within 100 us."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=20, seed=7,
                       claims=False, ntp_step=False, retransmits=False, messages=True,
                       message_traps=True)
    res = merge_bundles(fleet.paths, tmp_path / "f.db")
    assert res.skipped == [], res.skipped
    rel = relative_errors(fleet, tmp_path / "f.db", 20)
    assert max(abs(v) for v in rel.values()) <= 100_000, rel
    ((msg, _count),) = log_of(tmp_path / "f.db", "message_pairs")
    assert msg.startswith("5 TCP connections between nodes (one direction each) paired"), msg
    assert "; 1 left out" in msg, msg
    refused = log_of(tmp_path / "f.db", "messages_refused")
    assert [m.split(":")[0] for m, _ in refused] == ["node node-0", "node node-1"], refused
    assert all(n > 0 for _, n in refused)
    con = apsw.Connection(str(tmp_path / "f.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        kept = con.execute("SELECT COUNT(*), COUNT(DISTINCT node_id) FROM tcp_progress "
                           "WHERE saddr LIKE '127.%'").fetchone()
    finally:
        con.close()
    assert kept[0] > 0 and kept[1] == 4    # the rows themselves are merged, not lost


@pytest.mark.parametrize("unsent", [False, True])
def test_unsent_rows_place_a_node_whose_sends_wait(tmp_path, unsent):
    """Sends into node 2 wait 5-50 ms for its reader's window, so each began long before
    its bytes left: they bound node 2's clock from one side only by milliseconds. The
    senders' 'unsent' rows (the ACK that opened the window, microseconds before the
    bytes left) bound it as tightly as a quiet link's sends do; a row of either kind is
    never paired with a receive of bytes below its position."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=20, seed=5,
                       claims=False, ntp_step=False, retransmits=False, queued=8,
                       messages=True, held_into=2, unsent_rows=unsent)
    merge_bundles(fleet.paths, tmp_path / "f.db")
    rel = relative_errors(fleet, tmp_path / "f.db", 20)
    al = alignment(tmp_path / "f.db")
    stated = {n: a["relative_uncertainty_ns"] for n, a in al.items()}
    print(f"unsent={unsent}: relative errors (us) "
          f"{ {n: round(v / 1e3) for n, v in rel.items()} }; stated (us) "
          f"{ {n: None if v is None else v // 1000 for n, v in stated.items()} }")
    held = 3                                          # node-2: node ids count from 1
    for nid in al:
        assert stated[nid] is not None and abs(rel[nid]) <= stated[nid] + 1_000, \
            (nid, rel, stated)
    if not unsent:
        assert stated[held] >= 1_000_000, stated      # what the unsent rows improve on
        return
    assert max(abs(v) for v in rel.values()) <= 100_000, rel
    assert max(stated.values()) <= 200_000, stated


@pytest.mark.parametrize("marked", [True, False])
def test_connections_a_capture_attached_to_place_clocks(tmp_path, marked, monkeypatch):
    """Captures attached to a running job, each at its own time (0, 4, 8 and 12 s in):
    the ring's connections were established before any of them, so each end's
    connected_ns is when its capture first saw it, seconds from the other end's. Marked
    attached, the pairs place every node within 100 us, as with establishment times;
    unmarked, the two ends' times contradict the clocks (synchronized, as they claim) by
    seconds and every connection is refused: what a 4-tuple reused looks like."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=20, seed=5,
                       claims=True, ntp_step=False, retransmits=False, queued=8,
                       messages=True, progress_attached={0: 0.0, 1: 4.0, 2: 8.0, 3: 12.0})
    if not marked:
        from ingero_forensics.merge import clocks
        monkeypatch.setattr(clocks, "sample_progress", _unmarked(clocks.sample_progress))
    merge_bundles(fleet.paths, tmp_path / "f.db")
    al = alignment(tmp_path / "f.db")
    con = apsw.Connection(str(tmp_path / "f.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        flags = con.execute("SELECT DISTINCT attached FROM tcp_progress").fetchall()
    finally:
        con.close()
    assert flags == [(1,)]                         # kept in fleet.db
    if not marked:
        assert all(a["message_pairs"] == 0 for a in al.values()), al
        assert log_of(tmp_path / "f.db", "messages_refused")
        return
    assert all(a["message_pairs"] > 0 for a in al.values()), al
    rel = relative_errors(fleet, tmp_path / "f.db", 20)
    assert max(abs(v) for v in rel.values()) <= 100_000, rel


def _unmarked(sample_progress):
    """sample_progress, then every row taken as counted from establishment."""
    def wrapped(con, *a, **k):
        n = sample_progress(con, *a, **k)
        con.execute("UPDATE temp.flow_sp SET attached = 0")
        return n
    return wrapped


def test_a_reused_4_tuple_with_an_attached_end_is_refused(tmp_path):
    """message_traps' reused 4-tuple, its receiving end (node 1) attached from the start:
    node 1 saw the first connection and counts from when it first saw it, node 0 sent
    on the second, established half way. With no establishment time on node 1's end,
    the one-sided test still holds: node 0's connection was established after node 1
    first saw the 4-tuple, so they are not one connection. The ring, node 1's end
    attached too, still places every node within 100 us."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=20, seed=7,
                       claims=False, ntp_step=False, retransmits=False, messages=True,
                       message_traps=True, progress_attached={1: 0.0})
    res = merge_bundles(fleet.paths, tmp_path / "f.db")
    assert res.skipped == [], res.skipped
    refused = log_of(tmp_path / "f.db", "messages_refused")
    assert [m.split(":")[0] for m, _ in refused] == ["node node-0", "node node-1"], refused
    rel = relative_errors(fleet, tmp_path / "f.db", 20)
    assert max(abs(v) for v in rel.values()) <= 100_000, rel


@pytest.mark.parametrize("attached", [False, True])
def test_messages_within_one_clock_are_not_used(tmp_path, attached):
    """Four namespaces of one kernel (one boot: one clock, as the rig's nodes): the ring's
    messages say nothing about clocks that are one, counted from establishment or
    attached to; the merge still pairs and logs them, and places nothing by them."""
    fleet = make_fleet(tmp_path / "b", nodes=4, ranks_per_node=1, seconds=10, seed=5,
                       one_host=True, retransmits=False, messages=True,
                       progress_attached={0: 0.0, 2: 3.0} if attached else None)
    res = merge_bundles(fleet.paths, tmp_path / "f.db")
    assert res.skipped == [], res.skipped
    al = alignment(tmp_path / "f.db")
    assert all(a["message_pairs"] == 0 for a in al.values()), al
    ((msg, _count),) = log_of(tmp_path / "f.db", "message_pairs")
    assert msg.startswith("4 TCP connections between nodes"), msg
