"""Open a bundle read-only after verifying it end to end.

The database image is decompressed to a temporary file (never into memory whole), then
checked: SQLite header, integrity, application_id and user_version, no views, triggers,
virtual tables or generated columns, every table and column of the format present with
its declared type, the meta table equal to the manifest (which has no checksum of its
own) and the row counts equal to the manifest's. Only then is it handed out, on a hardened
read-only connection that executes no SQL stored in the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import apsw

from .. import accel
from ..db import connect_untrusted
from ..errors import BundleError
from .container import SQLITE_MAGIC, decompress_db, read_manifest
from .schema import APPLICATION_ID, MANIFEST_TABLES, META_KEYS, REQUIRED_TABLES, TABLES


class Bundle:
    """A verified bundle: ``manifest``, ``db_path`` (temporary image), ``con`` (read-only)."""

    def __init__(self, path: Path, manifest: dict, db_path: Path, con: apsw.Connection):
        self.path = path
        self.manifest = manifest
        self.db_path = db_path
        self.con = con
        #: table -> optional columns (added within version 1) this bundle lacks: readers
        #: take them as NULL
        self.absent = absent_columns(con)
        #: optional tables (added within version 1) this bundle lacks: readers take them
        #: as empty
        self.absent_tables = absent_tables(con)
        #: table -> the first row a reader skipped and why (set by the merge's copies,
        #: while the image is still there to be read)
        self.skip_reasons: dict[str, str] = {}

    @property
    def node(self) -> str:
        return self.manifest["node"]

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            self.con = None
        try:
            os.unlink(self.db_path)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_bundle(path, *, tmpdir=None, limit: int | None = None,
                integrity: str = "quick") -> Bundle:
    """Verify and open a bundle. Raises BundleError naming the file and the reason.

    integrity: "quick" (PRAGMA quick_check), "full" (integrity_check) or "none".
    """
    path = Path(path)
    # the pid in the name: a merge killed before its cleanup leaves images that the
    # next merge removes once that process is gone (merge/files.py remove_stale_scratch)
    fd, tmp = tempfile.mkstemp(prefix=f"ingero-{os.getpid()}-", suffix=".db", dir=tmpdir)
    os.close(fd)
    tmp = Path(tmp)
    con = None
    try:
        manifest = decompress_db(path, tmp, limit=limit)
        con = verify_database(path, tmp, manifest, integrity=integrity)
        return Bundle(path, manifest, tmp, con)
    except BaseException:
        if con is not None:
            con.close()
        tmp.unlink(missing_ok=True)
        raise


def absent_tables(con) -> frozenset[str]:
    """The optional catalogue tables a (verified) bundle database lacks."""
    have = {r[0] for r in con.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    return frozenset(t.name for t in TABLES if not t.required and t.name not in have)


def absent_columns(con) -> dict[str, frozenset[str]]:
    """Per table, the optional catalogue columns a (verified) bundle database lacks."""
    out = {}
    for t in TABLES:
        have = {row[1] for row in con.execute(f"PRAGMA table_xinfo({t.name})")}
        if not have:
            continue   # an optional table the bundle lacks
        gone = frozenset(c.name for c in t.columns if not c.required and c.name not in have)
        if gone:
            out[t.name] = gone
    return out


def column_or_null(bundle, table: str, column: str, alias: str = "e") -> str:
    """SQL for ``alias.column`` of a bundle table, or NULL where the bundle predates it."""
    return "NULL" if column in bundle.absent.get(table, ()) else f"{alias}.{column}"


def verify_database(path, db_path, manifest: dict, *, integrity: str = "quick") -> apsw.Connection:
    """Check a decompressed image (our own temporary copy) and open it read-only."""
    with open(db_path, "r+b") as f:
        head = f.read(100)
        if head[:16] != SQLITE_MAGIC:
            raise BundleError(path, "database image is not SQLite")
        if len(head) == 100 and head[18:20] == b"\x02\x02":
            # An image sealed in WAL mode would make a read-only open look for a -wal
            # file next to our temporary copy; its content is complete without one
            # (the sha256 was verified), so mark the copy as rollback-journal mode.
            f.seek(18)
            f.write(b"\x01\x01")
    try:
        con = connect_untrusted(db_path)
    except apsw.Error as e:
        raise BundleError(path, f"database cannot be opened ({e})") from None
    try:
        _verify(path, con, manifest, integrity)
    except UnicodeDecodeError as e:     # the schema's SQL text, say: not screened
        con.close()
        raise BundleError(path, f"database holds text that is not UTF-8 where it is "
                                f"read (byte {e.start})") from None
    except apsw.Error as e:
        con.close()
        raise BundleError(path, f"database is corrupt ({type(e).__name__}: "
                                f"{' '.join(str(e).split())})") from None
    except BaseException:
        con.close()
        raise
    return con


#: Manifest keys that are not mirrored in meta: they are verified directly.
UNMIRRORED_MANIFEST_KEYS = frozenset({"magic", "tables", "database"})


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _verify(path, con, manifest, integrity):
    if integrity != "none":
        pragma = "integrity_check" if integrity == "full" else "quick_check"
        res = [r[0] for r in con.execute(f"PRAGMA {pragma}(5)")]
        if res != ["ok"]:
            # one line: SQLite's report spans lines ("*** in database main ***\n...")
            text = " ".join("; ".join(str(r) for r in res).split())
            raise BundleError(path, f"SQLite {pragma} failed: {text[:300]}")
    app_id = con.execute("PRAGMA application_id").fetchone()[0]
    if app_id != APPLICATION_ID:
        raise BundleError(path, f"database application_id is {app_id:#x}, not a bundle "
                                f"database ({APPLICATION_ID:#x})")
    # The merge ATTACHes images to a UTF-8 fleet.db, and SQLite attaches only
    # databases of the main one's text encoding.
    encoding = con.execute("PRAGMA encoding").fetchone()[0]
    if encoding != "UTF-8":
        raise BundleError(path, f"database text encoding is {encoding}, not UTF-8")
    user_version = con.execute("PRAGMA user_version").fetchone()[0]
    if user_version != manifest["format_version"]:
        raise BundleError(path, f"database user_version {user_version} does not match the "
                                f"manifest format_version {manifest['format_version']}")
    objects = {}
    for typ, name, rootpage, sql in con.execute(
            "SELECT type, name, rootpage, sql FROM sqlite_schema"):
        if typ in ("trigger", "view"):
            raise BundleError(path, f"database contains a {typ} ({name}); bundles may not "
                                    "carry executable SQL")
        # A virtual table has no b-tree (rootpage 0); its module would run on access.
        if typ == "table" and (not rootpage or (
                isinstance(sql, str) and sql.lstrip().upper().startswith("CREATE VIRTUAL"))):
            raise BundleError(path, f"database contains a virtual table ({name})")
        objects[name] = typ
    for t in TABLES:
        if not t.required and t.name not in objects:
            continue   # an optional table (added within version 1): no rows
        if objects.get(t.name) != "table":
            raise BundleError(path, f"table {t.name} is missing")
        cols = {}
        for row in con.execute(f"PRAGMA table_xinfo({t.name})"):
            if row[6] in (2, 3):  # hidden: 2 = virtual, 3 = stored generated column
                raise BundleError(path, f"table {t.name} has a generated column ({row[1]}); "
                                        "bundles may not carry executable SQL")
            cols[row[1]] = (row[2] or "").upper()
        missing = [c.name for c in t.columns if c.required and c.name not in cols]
        if missing:
            raise BundleError(path, f"table {t.name} lacks column(s) {', '.join(missing)}")
        for c in t.columns:
            if c.name in cols and cols[c.name] != c.type:
                raise BundleError(path, f"column {t.name}.{c.name} is declared "
                                        f"{cols[c.name] or 'without a type'}, not {c.type}")
    _check_text(path, con)
    meta = {}
    for k, v in con.execute("SELECT key, value FROM meta"):
        try:
            meta[k] = json.loads(v)
        except (TypeError, ValueError, RecursionError):
            raise BundleError(path, f"meta value for {k!r} is not JSON") from None
    for key in META_KEYS:
        if key not in meta:
            raise BundleError(path, f"meta key {key!r} is missing")
    # The manifest sits outside the sha256; its mirror in meta sits inside.
    for key, value in manifest.items():
        if key in UNMIRRORED_MANIFEST_KEYS:
            continue
        if key not in meta:
            raise BundleError(path, f"manifest key {key!r} has no meta row")
        if _canonical(meta[key]) != _canonical(value):
            raise BundleError(path, f"manifest {key} does not match meta {key} in the "
                                    "database")
    for t in MANIFEST_TABLES:
        if t not in objects and t not in REQUIRED_TABLES:
            if manifest["tables"].get(t, 0) != 0:
                raise BundleError(path, f"table {t} is missing but the manifest says "
                                        f"{manifest['tables'][t]} rows")
            continue
        if t not in manifest["tables"]:
            raise BundleError(path, f"manifest field tables.{t} missing or not a count")
        n = con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
        if n != manifest["tables"][t]:
            raise BundleError(path, f"table {t} has {n} rows but the manifest says "
                                    f"{manifest['tables'][t]}")


def _utf8_ok(b) -> int:
    try:
        bytes(b).decode("utf-8")
    except UnicodeDecodeError:
        return 0
    return 1


#: A text value that is not only printable ASCII.
_NOT_ASCII = "[^ -~]"
#: Tables small enough that every column is screened (in the others, text in a column
#: that is not TEXT, or an enum column, never reaches a reader: the merge skips such a
#: row by its type or value, merge/screen.py).
_SMALL_TABLES = frozenset({"meta", "nccl_comm_events", "event_stats", "clock_samples",
                           "processes", "threads", "stacks", "capture_log"})


def _check_text(path, con) -> None:
    """Every text value a reader will decode is valid UTF-8: one that is not would fail
    whichever reader meets it first (merge, export, query), so the bundle is refused
    here, naming the table, row and column. With the C screen (bundle/_screen.c,
    registered by db.harden) one call per row checks every column; without it, a value
    of printable ASCII only passes at SQLite's speed (GLOB reads any byte from 0x80 as a
    character beyond '~'; length() would not do: a lone lead byte counts as one
    character) and only the others are decoded in Python. Cost: docs/performance.md."""
    screens = accel.screens()
    fast = screens is not None
    if fast:
        screens.register(con.sqlite3pointer())     # done by db.harden too; idempotent
    else:
        con.create_scalar_function("ingero_utf8_ok", _utf8_ok, 1, deterministic=True)
    for t in TABLES:
        present = {r[1] for r in con.execute(f"PRAGMA table_info({t.name})")}
        cols = [c.name for c in t.columns if c.name in present and (
            t.name in _SMALL_TABLES or (c.type == "TEXT" and not c.values))]
        if not cols:
            continue
        key = t.columns[0].name
        if fast:
            bad = f"NOT ingero_utf8_ok({', '.join(cols)})"
        else:
            bad = " OR ".join(f"(typeof({c}) = 'text' AND {c} GLOB '*{_NOT_ASCII}*' AND NOT "
                              f"ingero_utf8_ok(CAST({c} AS BLOB)))" for c in cols)
        cast = ", ".join(f"CAST({c} AS BLOB)" for c in cols)
        try:
            row = con.execute(f"SELECT CAST({key} AS BLOB), {cast} FROM {t.name} "
                              f"WHERE {bad} LIMIT 1").fetchone()
        except apsw.Error as e:
            raise BundleError(path, f"database is corrupt ({type(e).__name__}: "
                                    f"{' '.join(str(e).split())}; table {t.name})") from None
        if row is not None:
            col = next(c for c, v in zip(cols, row[1:]) if v is not None and not _utf8_ok(v))
            where = bytes(row[0]).decode("utf-8", "backslashreplace")
            raise BundleError(path, f"table {t.name} row {key} {where[:40]!r}: {col} is "
                                    "not UTF-8 text")


__all__ = ["Bundle", "absent_columns", "absent_tables", "column_or_null", "open_bundle",
           "read_manifest", "verify_database"]
