"""What the large-fleet work changed, checked where the change could go wrong.

- host_samples, tcp_events and block_events have no index led by node_id: a node's
  rows are bounded by their rowid range (found in one scan). Nodes whose rows are
  interleaved must still export every row, and an index led by node_id (no range then)
  must give the same bytes.
- The C loop merges the collectives and the communicator events instead of SQLite
  sorting their UNION ALL: ties on (thread, start) must come out in the Python path's
  order.
- Host counters are written by the C loop: odd metric names and values.
- Collective windows are written by the C loop, their last_node named through a join.
"""

import json
import shutil

import apsw
import pytest
from click.testing import CliRunner

from ingero_forensics.export.chrome_trace import ExportOptions, export_chrome_trace
from ingero_forensics.export.cli import main

from .fleetgen import build_fleet
from .test_accel import BUILT, _both, needs_accel

ODD = ['quote " and back\\slash', "ctl \x01\x1f tab\t", "non-ASCII é 漢字 😀", ""]


def _cols(con, table):
    return [r[1] for r in con.execute(f"PRAGMA table_info({table})") if r[1] != "id"]


def _copy_rows(con, table, where, shift_ns=0, node_to=None):
    cols = _cols(con, table)
    sel = ", ".join(f"timestamp_ns + {shift_ns}" if c == "timestamp_ns" else
                    (str(node_to) if c == "node_id" and node_to is not None else c)
                    for c in cols)
    con.execute(f"INSERT INTO {table} ({', '.join(cols)}) SELECT {sel} FROM {table} "
                f"WHERE {where}")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Node rows interleaved in id order, ties between collectives and communicator
    events, odd host samples and node names."""
    path = tmp_path_factory.mktemp("mixed") / "fleet.db"
    build_fleet(path, nodes=3, ranks_per_node=2, steps=30, cuda_per_step=4)
    con = apsw.Connection(str(path))
    with con:
        x = con.execute
        # node 1's rows again after every other node's (ids past theirs), and node 3's
        # rows copied to node 1 in between: each node's id range now spans the others'
        for t in ("host_samples", "tcp_events", "block_events"):
            _copy_rows(con, t, "node_id = 1 AND id % 3 = 0", shift_ns=1234)
            _copy_rows(con, t, "node_id = 3 AND id % 4 = 1", shift_ns=777, node_to=1)
            _copy_rows(con, t, "node_id = 2 AND id % 5 = 2", shift_ns=555)
        # communicator events at exactly a collective's start on its thread
        x("INSERT INTO nccl_comm_events (timestamp_ns, duration_ns, api, comm_id_hash, "
          "rank, nranks, pid, tid, node_id, bundle_id, mono_ns) SELECT timestamp_ns, "
          "duration_ns / 2, 'ncclCommSplit', comm_id_hash, rank, nranks, pid, tid, "
          "node_id, bundle_id, mono_ns FROM nccl_events WHERE id % 7 = 1")
        # ... and a fractional start equal to a collective's (REAL against INTEGER)
        x("UPDATE nccl_comm_events SET timestamp_ns = timestamp_ns + 0.0 WHERE id % 2 = 0")
        x("UPDATE nccl_events SET timestamp_ns = timestamp_ns + 0.5 WHERE id % 11 = 3")
        x("INSERT INTO nccl_comm_events (timestamp_ns, duration_ns, api, pid, tid, "
          "node_id, bundle_id, mono_ns) SELECT timestamp_ns, 10, 'ncclCommInitRank', pid, "
          "tid, node_id, bundle_id, mono_ns FROM nccl_events WHERE id % 11 = 3")
        for i, s in enumerate(ODD):
            x("UPDATE host_samples SET metric = metric || ?, device = ? WHERE id % 9 = ?",
              (s, s or None, i))
        for i, v in enumerate((1e-320, -0.0, 1e299, 123456789012345678.0, 0.1 + 0.2,
                               -7.0, 2.5e-7)):
            x("UPDATE host_samples SET value = ? WHERE id % 13 = ?", (v, i))
        x("UPDATE nodes SET name = name || ' \"é\\' WHERE node_id = 2")
    con.close()
    return path


@needs_accel
@pytest.mark.parametrize("jobs", [1, 2])
def test_same_bytes_on_mixed_fleet(mixed, tmp_path, jobs):
    fast, slow = _both(mixed, tmp_path, jobs=jobs)
    assert fast == slow
    events = json.loads(fast)["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "host"}
    assert any("漢字" in n for n in names)
    comm = [e for e in events if e.get("args", {}).get("api") == "ncclCommSplit"]
    assert comm


def test_every_row_of_interleaved_nodes(mixed, tmp_path):
    """Counts per node against fleet.db (not against another export: both paths use
    the same ranges)."""
    export_chrome_trace(mixed, tmp_path / "t.json", ExportOptions(jobs=2, findings=False))
    doc = json.loads((tmp_path / "t.json").read_bytes())
    con = apsw.Connection(str(mixed), flags=apsw.SQLITE_OPEN_READONLY)
    pid_of = {name: pid for pid, name in enumerate(
        (n for (n,) in con.execute("SELECT name FROM nodes ORDER BY name, node_id")), 1)}
    node_pid = {nid: pid_of[name] for nid, name in con.execute("SELECT node_id, name FROM nodes")}
    events = doc["traceEvents"]
    for node_id, pid in node_pid.items():
        host = con.execute("SELECT COUNT(*) FROM host_samples WHERE node_id = ?",
                           (node_id,)).fetchone()[0]
        tcp = con.execute("SELECT COUNT(*) FROM tcp_events WHERE node_id = ?",
                          (node_id,)).fetchone()[0]
        block = con.execute("SELECT COUNT(*) FROM block_events WHERE node_id = ?",
                            (node_id,)).fetchone()[0]
        assert host and tcp and block
        assert sum(e["pid"] == pid and e.get("cat") == "host" for e in events) == host
        assert sum(e["pid"] == pid and e.get("cat") == "tcp" for e in events) == tcp
        assert sum(e["pid"] == pid and e.get("cat") == "block" for e in events) == block
    con.close()


@pytest.mark.parametrize("accel", [True, False])
def test_index_led_by_node_id_gives_the_same_bytes(mixed, tmp_path, accel):
    """Where fleet.db has an index led by node_id the range is not used (nor scanned)."""
    indexed = tmp_path / "indexed.db"
    shutil.copy(mixed, indexed)
    con = apsw.Connection(str(indexed))
    for t in ("host_samples", "tcp_events", "block_events"):
        con.execute(f"CREATE INDEX {t}_node ON {t}(node_id, timestamp_ns)")
    con.close()
    opts = ExportOptions(jobs=2, accel=accel)
    export_chrome_trace(mixed, tmp_path / "a.json", opts)
    export_chrome_trace(indexed, tmp_path / "b.json", opts)
    a, b = (tmp_path / "a.json").read_bytes(), (tmp_path / "b.json").read_bytes()
    # the metadata names the source file; everything before it must be the same
    assert a.split(b'"metadata":')[0] == b.split(b'"metadata":')[0]


@needs_accel
def test_windows_name_the_last_node(mixed, tmp_path):
    fast, slow = _both(mixed, tmp_path, name="w.json", kinds=frozenset({"nccl"}))
    assert fast == slow
    doc = json.loads(fast)
    con = apsw.Connection(str(mixed), flags=apsw.SQLITE_OPEN_READONLY)
    names = dict(con.execute("SELECT node_id, name FROM nodes"))
    expect = con.execute("SELECT last_node_id FROM collectives WHERE entry_spread_ns > 0 "
                         "ORDER BY comm_id_hash, first_entry_ns, seq").fetchall()
    con.close()
    windows = [e for e in doc["traceEvents"] if e.get("cat") == "straggler"]
    assert [e["args"]["last_node"] for e in windows] == [names[n] for (n,) in expect]
    assert any(' "é\\' in e["args"]["last_node"] for e in windows)


def test_json_summary_says_which_path_wrote_it(mixed, tmp_path, monkeypatch):
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, [str(mixed), "--chrome-trace", "-o", str(out), "--json",
                                  "--no-findings"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["accelerated"] is BUILT
    monkeypatch.setenv("INGERO_NO_ACCEL", "1")
    r = CliRunner().invoke(main, [str(mixed), "--chrome-trace", "-o", str(out), "--json",
                                  "--no-findings"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["accelerated"] is False
