"""Write every table through BundleWriter, seal, open, read back equal."""

import json
import os

from ingero_forensics.bundle import (BundleWriter, TABLES, bundle_filename, open_bundle,
                                     read_manifest)
from ingero_forensics.bundle.schema import MANIFEST_TABLES, TABLES_BY_NAME

from .conftest import END, FRAMES_A, FRAMES_B, HOST, START, table_rows, write_sample_bundle


def test_every_table_round_trips(tmp_path):
    path, rows = write_sample_bundle(tmp_path)
    assert set(rows) | {"meta", "stacks"} == {t.name for t in TABLES}
    with open_bundle(path, integrity="full") as b:
        for table, written in rows.items():
            assert table_rows(b.con, table) == written, table
            # NULLs survive as NULL, not as 0 or ''
            nulls = sum(v is None for r in written for v in r)
            got = b.con.execute(
                f"SELECT {' + '.join(f'({c} IS NULL)' for c in TABLES_BY_NAME[table].data_columns)}"
                f" FROM {table}").fetchall()
            assert sum(g[0] for g in got) == nulls, table
        stacks = dict(b.con.execute("SELECT stack_id, frames FROM stacks"))
        assert [json.loads(v) for v in stacks.values()] == [FRAMES_A, FRAMES_B]
        # references resolve inside the bundle
        refs = b.con.execute("SELECT DISTINCT stack_id FROM nccl_events WHERE stack_id IS NOT "
                             "NULL UNION SELECT stack_id FROM cuda_events WHERE stack_id IS "
                             "NOT NULL").fetchall()
        assert {r[0] for r in refs} <= set(stacks)
        assert b.node == "gpu-node-07"


def test_manifest_describes_the_bundle(tmp_path):
    path, rows = write_sample_bundle(tmp_path)
    m = read_manifest(path)
    assert m["node"] == "gpu-node-07" and m["format_version"] == 1
    assert m["host"] == dict(HOST, tool_version=m["host"]["tool_version"])
    assert m["capture"] == {"start_utc_ns": START[0], "start_mono_ns": START[1],
                            "end_utc_ns": END[0], "end_mono_ns": END[1]}
    expected = {t: len(rows.get(t, ())) for t in MANIFEST_TABLES}
    expected["stacks"] = 2
    assert m["tables"] == expected
    assert m["segment"]["index"] == 0 and m["segment"]["recovered"] is False
    assert path.name == bundle_filename("gpu-node-07", START[0], 0)
    assert path.name == "gpu-node-07+20260301T120000Z+000000.bundle"
    with open_bundle(path) as b:
        assert b.manifest == m
        assert os.path.getsize(b.db_path) == m["database"]["size"]


def test_open_leaves_no_temporary_file(tmp_path):
    path, _ = write_sample_bundle(tmp_path / "b")
    tmpdir = tmp_path / "t"
    tmpdir.mkdir()
    b = open_bundle(path, tmpdir=tmpdir)
    assert len(list(tmpdir.iterdir())) == 1
    b.close()
    assert list(tmpdir.iterdir()) == []


def test_stacks_are_stored_once(tmp_path):
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    ids = [w.add_stack(FRAMES_A), w.add_stack(FRAMES_B),
           w.add_stack([dict(reversed(list(f.items()))) for f in FRAMES_A])]
    assert ids[0] == ids[2] != ids[1]
    w.flush()
    assert w.add_stack(FRAMES_A) == ids[0]
    path = w.seal(tmp_path, capture_end=END)
    with open_bundle(path) as b:
        assert b.con.execute("SELECT COUNT(*) FROM stacks").fetchone()[0] == 2


def test_a_stack_list_passed_again_is_known_without_its_text(tmp_path, monkeypatch):
    """The symbolizer hands the same list for every call of a stack: its text (15 us for
    20 frames) is made once, and the ids stay right when the lists known are dropped."""
    from ingero_forensics.bundle import writer
    made = []
    real = writer.canonical_frames
    monkeypatch.setattr(writer, "canonical_frames", lambda f: made.append(1) or real(f))
    monkeypatch.setattr(writer, "STACK_LISTS", 3)
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    a, b = w.add_stack(FRAMES_A), w.add_stack(FRAMES_B)
    assert [w.add_stack(FRAMES_A) for _ in range(100)] == [a] * 100 and len(made) == 2
    copies = [[dict(f) for f in FRAMES_B] for _ in range(5)]     # equal lists, made anew
    assert [w.add_stack(c) for c in copies] == [b] * 5 and len(made) == 7
    assert len(w._stack_lists) <= 3                              # bounded
    assert w.add_stack(FRAMES_A) == a and w.add_stack(FRAMES_B) == b
    path = w.seal(tmp_path, capture_end=END)
    with open_bundle(path) as bundle:
        assert bundle.con.execute("SELECT COUNT(*) FROM stacks").fetchone()[0] == 2


def test_segments_of_one_node_sort_by_time(tmp_path):
    names = [bundle_filename("node-1", START[0] + i * 3_600_000_000_000, i) for i in range(3)]
    names += [bundle_filename("node-1.a", START[0], 0)]
    assert sorted(names)[:3] == names[:3]


def test_extra_meta_job_ids_reach_the_manifest(tmp_path):
    path, _ = write_sample_bundle(tmp_path, extra_meta={"job_ids": ["tr-1234"],
                                                        "capture_options": {"stacks": True}})
    assert read_manifest(path)["job_ids"] == ["tr-1234"]
    with open_bundle(path) as b:
        meta = dict(b.con.execute("SELECT key, value FROM meta"))
        assert json.loads(meta["capture_options"]) == {"stacks": True}
        assert "capture_options" not in b.manifest
