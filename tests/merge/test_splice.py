"""Tables built in regions of fleet.db and spliced in by their pages (merge/_splice.c):
the result is an ordinary SQLite file (PRAGMA integrity_check) with exactly the rows and
indexes a row-by-row transfer gives, whatever the pages hold (interior pages, overflow
chains from table and index cells, the lock-byte page at 1 GiB), on a filesystem that
collapses ranges and on one that must copy."""

import hashlib
import os

import apsw
import pytest

from ingero_forensics.merge import core, merge_bundles

from .fleetgen import make_fleet

P = 16384
STRIDE = core.REGION_STRIDE

#: Tables with their indexes, and how a test fills them: interior pages everywhere,
#: overflow chains from table cells (b.big, up to 60 KB) and index cells (a.x, long text).
TABLES = {
    "a": ("CREATE TABLE a (id INTEGER PRIMARY KEY, x TEXT, y INTEGER)",
          ["CREATE INDEX a_y ON a(y)", "CREATE INDEX a_x ON a(x)"],
          "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < {n}) "
          "INSERT INTO a SELECT i, printf('%0*d', 20 + i * 13 % 6000, i), i * 7 % 1000 "
          "FROM r"),
    "b": ("CREATE TABLE b (id INTEGER PRIMARY KEY, big BLOB, t TEXT)",
          ["CREATE INDEX b_t ON b(t)"],
          "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < {n}) "
          "INSERT INTO b SELECT i, randomblob(i * 37 % 60000), 'v' || (i % 100) FROM r"),
}


@pytest.fixture(scope="module")
def sp(built_accel):
    return built_accel("merge._splice", "sqlite3_splice_init")


def _open(uri):
    con = apsw.Connection(uri, flags=apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE |
                          apsw.SQLITE_OPEN_URI)
    for pragma in ("PRAGMA journal_mode = MEMORY", f"PRAGMA page_size = {P}",
                   "PRAGMA locking_mode = EXCLUSIVE", "PRAGMA synchronous = OFF"):
        con.execute(pragma)
    return con


def _fill(con, table, n):
    ddl, indexes, insert = TABLES[table]
    con.execute(ddl)
    with con:
        con.execute(insert.format(n=n))
    for stmt in indexes:
        con.execute(stmt)


def _digest(con, table):
    h = hashlib.sha256()
    for row in con.execute(f"SELECT * FROM {table} ORDER BY id"):
        for v in row:
            h.update(v if isinstance(v, bytes) else repr(v).encode())
    return h.hexdigest()


def _fleet(path, fill_pages=0):
    """The 'main' database: every table and index, empty, plus a table of its own."""
    con = _open(str(path))
    with con:
        for ddl, indexes, _ in TABLES.values():
            con.execute(ddl)
            for stmt in indexes:
                con.execute(stmt)
        con.execute("CREATE TABLE own (k INTEGER, pad BLOB)")
        con.execute("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r "
                    "WHERE i < 5000) INSERT INTO own SELECT i, zeroblob(100) FROM r")
        if fill_pages:
            # one page per row: the fleet ends just short of the lock-byte page
            while con.execute("PRAGMA page_count").fetchone()[0] < fill_pages:
                con.execute("INSERT INTO own VALUES (-1, zeroblob(16000))")
    return con


def _splice(sp, path, sizes, collapse=True, fill_pages=0):
    """Build each table of ``sizes`` in a region, splice them all; returns the
    digests of the same rows built in an ordinary database, and splice()'s answer."""
    main = _fleet(path, fill_pages)
    fd = os.open(path, os.O_RDWR)
    regions, want = [], {}
    try:
        for k, (table, n) in enumerate(sizes.items()):
            offset = (k + 1) * STRIDE
            con = _open(f"file:{path}.{table}?vfs=ingero-region&fd={fd}&offset={offset}")
            _fill(con, table, n)
            roots = con.execute("SELECT name, rootpage FROM sqlite_schema").fetchall()
            want[table] = _digest(con, table)
            con.close()
            pages, pointers = sp.scan(fd, offset, [r for _, r in roots])
            assert pages > 1 and len(pointers) % 4 == 0
            regions.append((offset, pointers, roots))
        fleet_roots = dict(main.execute("SELECT name, rootpage FROM sqlite_schema"))
        main.close()
        out = sp.splice(fd, [(o, p, [(r, fleet_roots[n]) for n, r in roots])
                             for o, p, roots in regions], collapse)
    finally:
        os.close(fd)
    return want, out


def _check(path, want, pages):
    assert os.path.getsize(path) == pages * P       # the regions are gone from the file
    con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        for table, digest in want.items():
            assert _digest(con, table) == digest, table
        # the indexes answer (they are b-trees of their own, moved separately)
        if "a" in want:
            n = con.execute("SELECT COUNT(*) FROM a WHERE y = 7").fetchone()[0]
            assert n == con.execute("SELECT COUNT(*) FROM a NOT INDEXED WHERE y = 7"
                                    ).fetchone()[0] > 0
            assert "a_y" in " ".join(str(r) for r in con.execute(
                "EXPLAIN QUERY PLAN SELECT COUNT(*) FROM a WHERE y = 7"))
        if "b" in want:
            assert con.execute("SELECT COUNT(*) FROM b INDEXED BY b_t WHERE t = 'v5'"
                               ).fetchone()[0] == con.execute(
                "SELECT COUNT(*) FROM b NOT INDEXED WHERE t = 'v5'").fetchone()[0] > 0
        assert con.execute("SELECT COUNT(*) FROM own").fetchone()[0] >= 5000
        return con.execute("PRAGMA freelist_count").fetchone()[0]
    finally:
        con.close()


@pytest.mark.parametrize("collapse", [True, False])
def test_spliced_tables_are_intact(sp, tmp_path, collapse):
    path = tmp_path / "f.db"
    want, (pages, how) = _splice(sp, path, {"a": 20000, "b": 3000}, collapse)
    assert how == ("collapse" if collapse else "copy") or (collapse and how == "copy")
    free = _check(path, want, pages)
    # each region's page 1 and the places its roots left (a: 3 roots, b: 2)
    assert free == (1 + 3) + (1 + 2)


@pytest.fixture
def fleet_fd(sp, tmp_path):
    """(path, descriptor) of a 'main' database, regions to be written past its end."""
    path = tmp_path / "f.db"
    _fleet(path).close()
    fd = os.open(path, os.O_RDWR)
    yield path, fd
    os.close(fd)


def _region(fleet_fd, table, offset, extra=""):
    path, fd = fleet_fd
    return _open(f"file:{path}.{table}?vfs=ingero-region&fd={fd}&offset={offset}{extra}")


def test_scan_lists_the_pages_holding_page_numbers(sp, fleet_fd):
    con = _region(fleet_fd, "b", STRIDE)
    _fill(con, "b", 2000)
    roots = [r for _, r in con.execute("SELECT name, rootpage FROM sqlite_schema")]
    overflow = con.execute("SELECT COUNT(*) FROM b WHERE length(big) > ?",
                           (P - 35,)).fetchone()[0]
    con.close()
    pages, pointers = sp.scan(fleet_fd[1], STRIDE, roots)
    listed = [int.from_bytes(pointers[i:i + 4], "little") for i in range(0, len(pointers), 4)]
    # every overflow chain has a first page; b-tree pages are a few interior ones and the
    # leaves whose cells spill
    assert sum(1 for x in listed if x & 0x80000000) >= overflow > 100
    assert all(2 <= x & 0x7fffffff <= pages for x in listed)
    assert len(set(listed)) == len(listed)


def test_scan_refuses_what_it_cannot_move(sp, fleet_fd):
    fd = fleet_fd[1]
    con = _region(fleet_fd, "a", STRIDE)
    _fill(con, "a", 3000)
    roots = [r for _, r in con.execute("SELECT name, rootpage FROM sqlite_schema")]
    with pytest.raises(ValueError, match="use .* of the region's"):
        sp.scan(fd, STRIDE, roots[:1])              # an index's pages unaccounted for
    con.execute("DELETE FROM a WHERE id % 2 = 0")     # pages go to the freelist
    con.close()
    with pytest.raises(ValueError, match="free pages"):
        sp.scan(fd, STRIDE, roots)
    with pytest.raises(ValueError, match="not a SQLite database"):
        sp.scan(fd, STRIDE - 4 * P, roots)          # a hole: zeros


def test_splice_refuses_a_fleet_grown_into_a_region(sp, fleet_fd):
    fd = fleet_fd[1]
    con = _region(fleet_fd, "a", 4 * P)
    _fill(con, "a", 100)
    roots = con.execute("SELECT name, rootpage FROM sqlite_schema").fetchall()
    con.close()
    _, pointers = sp.scan(fd, 4 * P, [r for _, r in roots])
    with pytest.raises(OSError, match="reaches into a region"):
        sp.splice(fd, [(4 * P, pointers, [(r, r) for _, r in roots])], True)


def test_region_writes_stop_at_its_limit(sp, fleet_fd):
    con = _region(fleet_fd, "b", STRIDE, f"&limit={64 * P}")
    con.execute(TABLES["b"][0])
    with pytest.raises(apsw.FullError):
        con.execute(TABLES["b"][2].format(n=3000))
    con.close()


@pytest.mark.slow
def test_lock_byte_page(sp, tmp_path):
    """A region of more than 1 GiB: its own lock-byte page is a hole (freed in the
    fleet), and the region page that lands on the fleet's lock-byte page moves to the
    end. About 1.1 GiB written."""
    path = tmp_path / "f.db"
    lock = (1 << 30) // P + 1
    want, (pages, _) = _splice(sp, path, {"a": 2000, "b": 38000}, True)
    assert pages > lock + 100
    free = _check(path, want, pages)
    assert free == (1 + 3) + (1 + 2) + 1     # + region b's own lock-byte page


@pytest.mark.slow
def test_fleet_ending_just_before_the_lock_byte_page(sp, tmp_path):
    path = tmp_path / "f.db"
    lock = (1 << 30) // P + 1
    want, (pages, _) = _splice(sp, path, {"a": 20000}, True, fill_pages=lock - 5)
    assert _check(path, want, pages) == 1 + 3


# ------------------------------------------------------------------ in a merge

def _dump(db):
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        out = {}
        for (t,) in con.execute("SELECT name FROM sqlite_schema WHERE type = 'table' "
                                "AND name NOT IN ('merge_log', 'fleet_info') ORDER BY name"
                                ).fetchall():
            h = hashlib.sha256()
            cols = [r[1] for r in con.execute(f"PRAGMA table_info({t})")
                    if r[1] not in ("merged_utc",)]
            for row in con.execute(f"SELECT {', '.join(cols)} FROM {t} ORDER BY rowid"):
                h.update(repr(row).encode())
            out[t] = h.hexdigest()
        out["schema"] = con.execute("SELECT type, name, tbl_name, sql FROM sqlite_schema "
                                    "ORDER BY name").fetchall()
        out["log"] = con.execute("SELECT level, event, message FROM merge_log "
                                 "ORDER BY id").fetchall()
        return out
    finally:
        con.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("splice")
    return make_fleet(d / "b", nodes=3, ranks_per_node=2, seconds=4, seed=41)


def _merged(fleet, db, monkeypatch, **env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spliced = []
    real = core._splice_tables

    def spy(fl):
        spliced.extend(fl.spliced)
        real(fl)
    monkeypatch.setattr(core, "_splice_tables", spy)
    monkeypatch.setattr(core, "_builder_share", lambda rows, move_cost=None:
                        ["nccl_events", "host_samples", "sched_events"])
    res = merge_bundles(fleet.paths, db)
    assert not res.skipped
    assert sorted(p.name for p in db.parent.iterdir()) == [db.name]    # no scratch left
    return spliced


def test_merge_splices_and_equals_a_transfer(sp, fleet, tmp_path, monkeypatch):
    (tmp_path / "s").mkdir()
    (tmp_path / "t").mkdir()
    spliced = _merged(fleet, tmp_path / "s" / "f.db", monkeypatch)
    assert len(spliced) == 3
    _merged(fleet, tmp_path / "t" / "f.db", monkeypatch, INGERO_NO_SPLICE="1")
    a, b = _dump(tmp_path / "s" / "f.db"), _dump(tmp_path / "t" / "f.db")
    assert a == b
    assert not any(e == "table_transferred" for _, e, _ in a["log"])


def test_merge_transfers_what_scan_refuses(sp, fleet, tmp_path, monkeypatch):
    (tmp_path / "s").mkdir()
    (tmp_path / "t").mkdir()

    class Refusing:
        def __getattr__(self, name):
            return getattr(sp, name)

        def scan(self, fd, offset, roots):
            if offset == 2 * STRIDE:                   # the second table built
                raise ValueError("refused by the test")
            return sp.scan(fd, offset, roots)
    monkeypatch.setattr(core._accel, "load", lambda mod, entry, real=core._accel.load:
                        Refusing() if mod == "merge._splice" else real(mod, entry))
    spliced = _merged(fleet, tmp_path / "s" / "f.db", monkeypatch)
    assert len(spliced) == 2
    monkeypatch.undo()
    _merged(fleet, tmp_path / "t" / "f.db", monkeypatch, INGERO_NO_SPLICE="1")
    a, b = _dump(tmp_path / "s" / "f.db"), _dump(tmp_path / "t" / "f.db")
    transferred = [m for _, e, m in a.pop("log") if e == "table_transferred"]
    assert len(transferred) == 1 and "refused by the test" in transferred[0]
    b.pop("log")
    assert a == b


def test_no_regions_where_the_filesystem_cannot_hold_them(sp, fleet, tmp_path,
                                                          monkeypatch):
    monkeypatch.setattr(core, "_regions_supported", lambda path, count: False)
    (tmp_path / "s").mkdir()
    assert _merged(fleet, tmp_path / "s" / "f.db", monkeypatch) == []
    assert _dump(tmp_path / "s" / "f.db")["nccl_events"]


def test_merge_on_a_filesystem_that_copies(sp, fleet, tmp_path, tmpfs, monkeypatch):
    """tmpfs holds sparse files but cannot collapse a range: the regions are copied
    down, with the same result."""
    mnt = tmpfs("256m")
    (mnt / "s").mkdir()
    hows = []
    real = sp.splice

    class Spy:
        def __getattr__(self, name):
            return getattr(sp, name)

        def splice(self, fd, regions, collapse):
            hows.append(real(fd, regions, collapse)[1])
            return hows[-1]
    monkeypatch.setattr(core._accel, "load", lambda mod, entry, load=core._accel.load:
                        Spy() if mod == "merge._splice" else load(mod, entry))
    assert len(_merged(fleet, mnt / "s" / "f.db", monkeypatch)) == 3
    assert hows == ["copy"]
    monkeypatch.undo()
    (tmp_path / "t").mkdir()
    _merged(fleet, tmp_path / "t" / "f.db", monkeypatch, INGERO_NO_SPLICE="1")
    assert _dump(mnt / "s" / "f.db") == _dump(tmp_path / "t" / "f.db")


def test_spliced_tables_are_checked_before_the_rename(tmp_path, monkeypatch):
    """Issue 20: every spliced table passes PRAGMA quick_check(TABLE) before the rename;
    a splice that damaged one is never seen by a user: the merge is redone on the plain
    path, with a warning."""
    from ingero_forensics.merge import core, merge_bundles
    from .fleetgen import make_fleet
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=3, seed=44)
    checked = []
    real = core._verify_spliced

    def spy(fl):
        checked.extend(fl.spliced_tables)
        return real(fl)
    monkeypatch.setattr(core, "_verify_spliced", spy)
    res = merge_bundles(fleet.paths, tmp_path / "ok.db")
    if core._accel.load("merge._splice", "sqlite3_splice_init") is None:
        pytest.skip("the splice is not built")
    assert checked and not any("quick_check" in w for w in res.warnings)

    real_splice = core._splice_tables

    def damaging(fl):
        # spliced and checked; then a page of a spliced table is overwritten and the
        # check runs again, as if the splice had written it so
        real_splice(fl)
        con = apsw.Connection(str(fl.path))
        root = con.execute("SELECT rootpage FROM sqlite_schema WHERE name = ?",
                           (fl.spliced_tables[0],)).fetchone()[0]
        psize = con.execute("PRAGMA page_size").fetchone()[0]
        con.close()
        with open(fl.path, "r+b") as f:
            f.seek((root - 1) * psize)
            f.write(b"\x0d\x00\x00\xff\xff" + b"\xee" * 64)
        real(fl)
    monkeypatch.setattr(core, "_splice_tables", damaging)
    res = merge_bundles(fleet.paths, tmp_path / "f.db")
    assert any("spliced pages failed quick_check" in w for w in res.warnings), res.warnings
    con = apsw.Connection(str(tmp_path / "f.db"), flags=apsw.SQLITE_OPEN_READONLY)
    assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    con.close()
