"""A bundle whose image matches its sha256 and row counts but holds a malformed record,
met only when pass 3 copies that table (integrity "none", the merge's default): the
bundle is skipped with the reason, as an upfront check would have, and every other
bundle is merged exactly as without it."""

import apsw
import pytest

from ..bundle.conftest import pack, split_bundle
from .fleetgen import make_fleet
from ingero_forensics.merge import MergeError, merge_bundles
from ingero_forensics.merge import core

TABLE = "host_samples"


def _varint_end(buf, p):
    while buf[p] & 0x80:
        p += 1
    return p + 1


def _corrupt_first_leaf(image: bytes, table: str) -> bytes:
    """Every record of the table's first leaf page gets a header-size byte beyond its
    payload. The page itself stays well formed (cell sizes, pointers, counts), so
    COUNT(*) and the sha256 pass; reading a column of those rows fails."""
    con = apsw.Connection(":memory:")
    con.deserialize("main", image)
    root = con.execute("SELECT rootpage FROM sqlite_schema WHERE name = ?",
                       (table,)).fetchone()[0]
    con.close()
    page_size = int.from_bytes(image[16:18], "big")
    buf = bytearray(image)
    pg = root
    while True:
        off = (pg - 1) * page_size
        hdr = off + (100 if pg == 1 else 0)
        if buf[hdr] == 0x0D:            # leaf table page
            break
        assert buf[hdr] == 0x05         # interior table page: follow the first child
        cell = off + int.from_bytes(buf[hdr + 12:hdr + 14], "big")
        pg = int.from_bytes(buf[cell:cell + 4], "big")
    ncells = int.from_bytes(buf[hdr + 3:hdr + 5], "big")
    assert ncells > 0
    for i in range(ncells):
        cell = off + int.from_bytes(buf[hdr + 8 + 2 * i:hdr + 10 + 2 * i], "big")
        assert buf[cell] < 0x7F         # a payload under 127 bytes: 0x7F is beyond it
        record = _varint_end(buf, _varint_end(buf, cell))
        buf[record] = 0x7F
    return bytes(buf)


@pytest.fixture
def fleet_with_corrupt(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=3, seed=21)
    manifest, image = split_bundle(fleet.paths[1])
    bad = tmp_path / "b" / "corrupt.bundle"
    bad.write_bytes(pack(manifest, _corrupt_first_leaf(image, TABLE)))
    good = [fleet.paths[0], fleet.paths[2]]
    return good, bad


def _table_counts(db):
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return {t: con.execute(f"SELECT COUNT(*), SUM(timestamp_ns % 1000003), MIN(timestamp_ns) FROM {t}").fetchone()
                for t in ("nccl_events", "cuda_events", "sched_events", TABLE)}
    finally:
        con.close()


def test_the_reader_meets_the_malformed_record_while_screening_text(fleet_with_corrupt):
    """sha256, schema and COUNT(*) pass; the UTF-8 screen of every TEXT column (issue 20)
    reads the table's records and names it, with integrity "none" too."""
    from ingero_forensics.bundle import open_bundle
    from ingero_forensics.errors import BundleError
    _, bad = fleet_with_corrupt
    with pytest.raises(BundleError, match=f"database is corrupt .*; table {TABLE}\\)"):
        open_bundle(bad, integrity="none").close()


@pytest.mark.parametrize("built_by", ["builder", "main"])
def test_corrupt_bundle_skipped_rest_merged(fleet_with_corrupt, tmp_path, monkeypatch,
                                            built_by):
    good, bad = fleet_with_corrupt
    want = tmp_path / "want.db"
    merge_bundles(good, want)
    # The table is copied by the builder thread or by the main thread, whichever the
    # split gives it: both find the malformed record.
    share = ["nccl_events", TABLE] if built_by == "builder" else ["nccl_events"]
    monkeypatch.setattr(core, "builder_share", lambda rows, move_cost=None: share)
    db = tmp_path / "f.db"
    res = merge_bundles([good[0], bad, good[1]], db)
    assert [s["input"] for s in res.skipped] == [str(bad)]
    reason = res.skipped[0]["reason"]
    assert reason.startswith("database is corrupt (CorruptError: ") and TABLE in reason, reason
    assert res.bundles_merged == 2
    assert _table_counts(db) == _table_counts(want)
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    logged = con.execute("SELECT input, message FROM merge_log WHERE event = "
                         "'skipped_input'").fetchall()
    con.close()
    assert [r[0] for r in logged] == [str(bad)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".f.db")]


def test_corrupt_bundle_with_strict_writes_nothing(fleet_with_corrupt, tmp_path):
    good, bad = fleet_with_corrupt
    db = tmp_path / "f.db"
    with pytest.raises(MergeError, match="--strict"):
        merge_bundles([good[0], bad], db, strict=True)
    assert not db.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".f.db")]


def test_quick_check_finds_it_before_copying(fleet_with_corrupt, tmp_path):
    good, bad = fleet_with_corrupt
    res = merge_bundles([good[0], bad], tmp_path / "f.db", integrity="quick")
    assert [s["input"] for s in res.skipped] == [str(bad)]
    assert res.bundles_merged == 1


def _break_root_page(db, table: str) -> None:
    """The table's root page gets a page type SQLite does not know: any read or insert of
    that table meets "database disk image is malformed"."""
    con = apsw.Connection(str(db))
    root = con.execute("SELECT rootpage FROM sqlite_schema WHERE name = ?",
                       (table,)).fetchone()[0]
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    con.close()
    with open(db, "r+b") as f:
        f.seek((root - 1) * page_size + (100 if root == 1 else 0))
        f.write(b"\x01")


def test_a_damaged_fleet_db_is_named_not_the_sound_bundles(tmp_path):
    """Merging sound bundles into a fleet.db damaged before: the malformed page is the
    output's, so the merge stops naming fleet.db, skips no bundle, logs nothing against
    them, and leaves the file as it was (exit 1, as report and export do)."""
    from click.testing import CliRunner
    from ingero_forensics.merge.cli import main as merge_cli
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=3, seed=22)
    db = tmp_path / "f.db"
    merge_bundles([fleet.paths[0]], db)
    _break_root_page(db, TABLE)
    before = db.read_bytes()
    with pytest.raises(MergeError, match=f"^{db}: the fleet.db is damaged .*table {TABLE}"):
        merge_bundles(fleet.paths[1:], db)
    assert db.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".f.db")]
    r = CliRunner().invoke(merge_cli, [*map(str, fleet.paths[1:]), "-o", str(db)])
    assert r.exit_code == 1, r.output
    assert r.output.count("\n") == 1 and "no bundle skipped" in r.output, r.output
    assert db.read_bytes() == before


@pytest.mark.parametrize("table", ["bundles", "clock_samples", "sync_points"])
def test_a_fleet_db_damaged_where_the_merge_reads_it_first_is_named(tmp_path, table):
    """The damage met before any copy (the merged bundles, the earlier clock samples and
    sync points the alignment reads again) is the fleet.db's too: the same line, not
    "merge failed (CorruptError ...)"."""
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=3, seed=22)
    db = tmp_path / "f.db"
    merge_bundles([fleet.paths[0]], db)
    _break_root_page(db, table)
    before = db.read_bytes()
    with pytest.raises(MergeError, match=f"^{db}: the fleet.db is damaged .*no bundle "
                                         "skipped"):
        merge_bundles(fleet.paths[1:], db)
    assert db.read_bytes() == before
