"""Bad input behind the checksum: consistent bundles around images that are wrong in
one way each, built by re-wrapping a modified copy of a real image."""

import dataclasses
import json

import apsw
import pytest

from ingero_forensics.bundle import open_bundle, reader, schema
from ingero_forensics.bundle.schema import Column

from .conftest import modify_image, pack, reason_of, sample_rows, split_bundle, table_rows

#: rows of calls_in_flight the sample bundle holds
IN_FLIGHT_ROWS = len(sample_rows(None, None)["calls_in_flight"])

EXEC = "; bundles may not carry executable SQL"


def _rewrap(tmp_path, sample_bundle, sql=None, *, manifest_edit=None, image=None):
    m, img = split_bundle(sample_bundle)
    if sql:
        img = modify_image(img, tmp_path, sql)
    if image is not None:
        img = image
    if manifest_edit:
        manifest_edit(m)
    p = tmp_path / "re.bundle"
    p.write_bytes(pack(m, img))
    return p


@pytest.mark.parametrize("sql, reason", [
    ("CREATE TRIGGER t1 AFTER INSERT ON threads BEGIN DELETE FROM threads; END",
     "database contains a trigger (t1)" + EXEC),
    ("CREATE VIEW v1 AS SELECT * FROM nccl_events", "database contains a view (v1)" + EXEC),
    ("CREATE VIRTUAL TABLE f USING rtree(id, x0, x1)", "database contains a virtual table (f)"),
    ("ALTER TABLE host_samples ADD COLUMN doubled REAL GENERATED ALWAYS AS (value * 2) VIRTUAL",
     "table host_samples has a generated column (doubled)" + EXEC),
    ("DROP TABLE threads", "table threads is missing"),
    ("ALTER TABLE tcp_events DROP COLUMN scope", "table tcp_events lacks column(s) scope"),
    ("DROP TABLE threads; CREATE TABLE threads (id INTEGER PRIMARY KEY, pid INTEGER NOT NULL, "
     "tid INTEGER NOT NULL, comm INTEGER, first_seen_ns INTEGER NOT NULL, "
     "last_seen_ns INTEGER NOT NULL)", "column threads.comm is declared INTEGER, not TEXT"),
    ("PRAGMA application_id = 0", "database application_id is 0x0, not a bundle database "
                                  "(0x494e4746)"),
    ("PRAGMA user_version = 2", "database user_version 2 does not match the manifest "
                                "format_version 1"),
    ("UPDATE meta SET value = '{bad' WHERE key = 'host'", "meta value for 'host' is not JSON"),
    ("DELETE FROM meta WHERE key = 'capture'", "meta key 'capture' is missing"),
    ("UPDATE meta SET value = '\"gpu-node-08\"' WHERE key = 'node'",
     "manifest node does not match meta node in the database"),
    ("DELETE FROM meta WHERE key = 'created_by'", "manifest key 'created_by' has no meta row"),
    ("DELETE FROM block_events WHERE op = 'flush'",
     "table block_events has 1 rows but the manifest says 2"),
])
def test_bad_database(tmp_path, sample_bundle, sql, reason):
    assert reason_of(_rewrap(tmp_path, sample_bundle, sql)) == reason


def test_utf16_image_is_refused(tmp_path, sample_bundle):
    """The merge attaches images to a UTF-8 fleet.db, which SQLite refuses for another
    text encoding: such a bundle is refused when opened (--verify), not mid-merge."""
    _, img = split_bundle(sample_bundle)
    src = tmp_path / "src.db"
    src.write_bytes(img)
    dst = tmp_path / "utf16.db"
    old = apsw.Connection(str(src))
    con = apsw.Connection(str(dst))
    con.execute("PRAGMA encoding = 'UTF-16le'")
    with con:
        for sql, in old.execute("SELECT sql FROM sqlite_schema WHERE sql IS NOT NULL"):
            con.execute(sql)
        for name, in old.execute("SELECT name FROM sqlite_schema WHERE type = 'table'"):
            rows = old.execute(f"SELECT * FROM {name}").fetchall()
            if rows:
                con.executemany(f"INSERT INTO {name} VALUES "
                                f"({', '.join('?' * len(rows[0]))})", rows)
    for pragma in ("application_id", "user_version"):
        con.execute(f"PRAGMA {pragma} = {old.execute(f'PRAGMA {pragma}').fetchone()[0]}")
    old.close()
    assert con.execute("PRAGMA encoding").fetchone()[0] == "UTF-16le"
    con.close()
    p = _rewrap(tmp_path, sample_bundle, image=dst.read_bytes())
    assert reason_of(p) == "database text encoding is UTF-16le, not UTF-8"


def test_virtual_table_in_place_of_a_format_table(tmp_path, sample_bundle):
    p = _rewrap(tmp_path, sample_bundle, "DROP TABLE threads; "
                "CREATE VIRTUAL TABLE threads USING rtree(id, a, b)")
    assert reason_of(p) == "database contains a virtual table (threads)"


def test_manifest_that_disagrees_with_meta(tmp_path, sample_bundle):
    def later_end(m):
        m["capture"]["end_utc_ns"] += 1
    p = _rewrap(tmp_path, sample_bundle, manifest_edit=later_end)
    assert reason_of(p) == "manifest capture does not match meta capture in the database"

    def flipped_flag(m):
        m["segment"]["recovered"] = not m["segment"]["recovered"]
    p = _rewrap(tmp_path, sample_bundle, manifest_edit=flipped_flag)
    assert reason_of(p) == "manifest segment does not match meta segment in the database"

    def int_for_bool(m):        # caught by its type before the comparison with meta
        m["segment"]["recovered"] = 0
    p = _rewrap(tmp_path, sample_bundle, manifest_edit=int_for_bool)
    assert reason_of(p) == "manifest field segment.recovered is not a boolean"


def test_manifest_row_count_lies(tmp_path, sample_bundle):
    def more(m):
        m["tables"]["nccl_events"] += 1
    p = _rewrap(tmp_path, sample_bundle, manifest_edit=more)
    assert reason_of(p) == "table nccl_events has 3 rows but the manifest says 4"


def test_image_that_is_not_sqlite(tmp_path, sample_bundle):
    p = _rewrap(tmp_path, sample_bundle, image=b"not a database".ljust(4096, b"\0"))
    assert reason_of(p) == "database image is not SQLite"


def test_corrupt_btree_behind_a_valid_checksum(tmp_path, sample_bundle):
    _, img = split_bundle(sample_bundle)
    page = 4096
    assert len(img) % page == 0
    bad = bytearray(img)
    # wreck every data page after the schema page, as a disk error would
    for off in range(page, len(bad), page):
        bad[off + 8:off + 64] = b"\xee" * 56
    r = reason_of(_rewrap(tmp_path, sample_bundle, image=bytes(bad)))
    assert r.startswith(("SQLite quick_check failed: ", "database is corrupt (")), r
    r = reason_of(_rewrap(tmp_path, sample_bundle, image=bytes(bad)), integrity="full")
    assert r.startswith(("SQLite integrity_check failed: ", "database is corrupt (")), r


def test_integrity_report_is_one_line(tmp_path, sample_bundle):
    _, img = split_bundle(sample_bundle)
    bad = bytearray(img)
    bad[36:40] = (5).to_bytes(4, "big")   # header: freelist page count
    r = reason_of(_rewrap(tmp_path, sample_bundle, image=bytes(bad)))
    assert r == ("SQLite quick_check failed: *** in database main *** Freelist: size is 0 "
                 "but should be 5")


def test_wal_mode_image_is_read(tmp_path, sample_bundle):
    p = _rewrap(tmp_path, sample_bundle, "PRAGMA journal_mode = WAL")
    _, img = split_bundle(p)
    assert img[18:20] == b"\x02\x02"
    with open_bundle(p, tmpdir=tmp_path) as b:
        assert b.con.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0] == 3
    assert not list(tmp_path.glob("ingero-*"))


def test_unknown_tables_columns_indexes_and_meta_are_ignored(tmp_path, sample_bundle):
    p = _rewrap(tmp_path, sample_bundle, """
        CREATE TABLE gpu_kernels (id INTEGER PRIMARY KEY, name TEXT);
        ALTER TABLE nccl_events ADD COLUMN algo TEXT;
        CREATE INDEX nccl_seq ON nccl_events(comm_id_hash, seq);
        INSERT INTO meta VALUES ('capture_options', '{"stacks": true}');
    """)
    with open_bundle(p) as b:
        assert b.con.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0] == 3


def test_optional_columns_may_be_absent(tmp_path, sample_bundle, monkeypatch):
    """A column added within version 1 (required=False) is allowed to be missing."""
    t = schema.TABLES_BY_NAME["threads"]
    newer = dataclasses.replace(t, columns=t.columns + (
        Column("cgroup_id", "INTEGER", True, "", "added in 1.1", required=False),))
    monkeypatch.setattr(reader, "TABLES",
                        tuple(newer if x.name == "threads" else x for x in schema.TABLES))
    with open_bundle(sample_bundle) as b:
        assert table_rows(b.con, "threads")
    required = dataclasses.replace(newer, columns=t.columns + (
        Column("cgroup_id", "INTEGER", True, "", "x"),))
    monkeypatch.setattr(reader, "TABLES",
                        tuple(required if x.name == "threads" else x for x in schema.TABLES))
    assert reason_of(sample_bundle) == "table threads lacks column(s) cgroup_id"


def test_connection_runs_no_stored_sql(sample_bundle):
    with open_bundle(sample_bundle) as b:
        assert b.con.config(apsw.SQLITE_DBCONFIG_ENABLE_TRIGGER, -1) == 0
        assert b.con.config(apsw.SQLITE_DBCONFIG_ENABLE_VIEW, -1) == 0
        assert b.con.config(apsw.SQLITE_DBCONFIG_TRUSTED_SCHEMA, -1) == 0
        assert b.con.config(apsw.SQLITE_DBCONFIG_DEFENSIVE, -1) == 1
        with pytest.raises(apsw.ReadOnlyError):
            b.con.execute("DELETE FROM threads")


def test_meta_values_are_json(sample_bundle):
    with open_bundle(sample_bundle) as b:
        meta = {k: json.loads(v) for k, v in b.con.execute("SELECT key, value FROM meta")}
    for key, value in b.manifest.items():
        if key not in ("magic", "tables", "database"):
            assert meta[key] == value


V10 = ("DROP TABLE calls_in_flight; DROP TABLE tcp_progress; ALTER TABLE cuda_events DROP COLUMN queue_gap_ns; "
       "ALTER TABLE cuda_events DROP COLUMN queued_ops")


def test_a_version_1_0_bundle_opens_and_merges(tmp_path, sample_bundle):
    """Readers accept 1.0 (no 1.1 table or column) and 1.1 alike."""
    from ingero_forensics.merge import merge_bundles
    def edit(m):
        m["tables"].pop("calls_in_flight")
        m["tables"].pop("tcp_progress")
    p = _rewrap(tmp_path, sample_bundle, V10, manifest_edit=edit)
    with open_bundle(p) as b:
        assert b.absent_tables == {"calls_in_flight", "tcp_progress"}
        assert b.absent["cuda_events"] == {"queued_ops", "queue_gap_ns"}
    with open_bundle(sample_bundle) as b:         # the 1.1 original
        assert b.absent_tables == frozenset() and "cuda_events" not in b.absent
    for src, name in ((p, "v10"), (sample_bundle, "v11")):
        res = merge_bundles([src], tmp_path / f"{name}.db", strict=True)
        assert res.skipped == [], res.skipped
    con = apsw.Connection(str(tmp_path / "v10.db"))
    assert con.execute("SELECT COUNT(*) FROM calls_in_flight").fetchone()[0] == 0
    assert con.execute("SELECT COUNT(*), COUNT(queued_ops) FROM cuda_events").fetchone()[1] == 0
    con.close()
    con = apsw.Connection(str(tmp_path / "v11.db"))
    assert con.execute("SELECT COUNT(*) FROM calls_in_flight").fetchone()[0] == IN_FLIGHT_ROWS
    con.close()


def test_a_bundle_without_tcp_progress_attached_opens_and_merges(tmp_path, sample_bundle):
    """A 1.1 bundle written before tcp_progress.attached: its rows count from their
    connections' establishment, the column NULL in fleet.db."""
    from ingero_forensics.merge import merge_bundles
    p = _rewrap(tmp_path, sample_bundle, "ALTER TABLE tcp_progress DROP COLUMN attached")
    with open_bundle(p) as b:
        assert b.absent["tcp_progress"] == {"attached"}
    res = merge_bundles([p], tmp_path / "f.db", strict=True)
    assert res.skipped == [], res.skipped
    con = apsw.Connection(str(tmp_path / "f.db"))
    assert con.execute("SELECT COUNT(*), COUNT(attached) FROM tcp_progress").fetchone() == \
        (3, 0)
    con.close()


def test_optional_table_and_its_manifest_count_go_together(tmp_path, sample_bundle):
    gone = _rewrap(tmp_path, sample_bundle, "DROP TABLE calls_in_flight")
    assert reason_of(gone) == ("table calls_in_flight is missing but the manifest says "
                               f"{IN_FLIGHT_ROWS} rows")
    uncounted = _rewrap(tmp_path, sample_bundle,
                        manifest_edit=lambda m: m["tables"].pop("calls_in_flight"))
    assert reason_of(uncounted) == "manifest field tables.calls_in_flight missing or not a count"
