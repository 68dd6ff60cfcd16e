"""Read-only SQL over fleet.db or a bundle: the library behind ``ingero-query``.

Three independent locks keep a query from changing anything:

1. the database is opened with SQLITE_OPEN_READONLY (and hardened: no triggers, views,
   extensions or trusted schema, see ``db.harden``); a bundle is opened through
   ``bundle.open_bundle``, which verifies it first and queries a private temporary image;
2. before running, the statement is prepared and SQLite itself says whether it writes
   (``sqlite3_stmt_readonly`` via ``apsw.ext.query_info``); one that does is refused;
3. while running, an authorizer allows only reading actions (SELECT, reads, functions,
   recursive CTEs and a few informational PRAGMAs), so ATTACH, PRAGMA assignments and
   transactions, which SQLite counts as read-only, are refused too.
"""

from __future__ import annotations

import contextlib
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import apsw
import apsw.ext

from ..bundle.container import SKIPPABLE_MAGIC, SQLITE_MAGIC, open_regular
from ..bundle.reader import open_bundle
from ..bundle.schema import TABLES_BY_NAME as BUNDLE_TABLES
from ..cliutil import BadUsage
from ..db import connect_readonly
from ..errors import IngeroError

#: PRAGMAs that only report (called without a value).
READ_PRAGMAS = frozenset({
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
    "foreign_key_list", "user_version", "application_id", "page_count", "page_size",
    "freelist_count", "schema_version", "encoding", "compile_options", "function_list",
    "pragma_list", "collation_list", "database_list", "integrity_check", "quick_check",
})
_ALLOWED_ACTIONS = frozenset({
    apsw.SQLITE_SELECT, apsw.SQLITE_READ, apsw.SQLITE_FUNCTION, apsw.SQLITE_RECURSIVE,
})


class QueryRefused(IngeroError):
    """The statement would write or change the connection; nothing was run."""


@dataclass
class OpenedDatabase:
    path: Path
    kind: str            # "bundle" or "sqlite"
    con: apsw.Connection
    node: str | None = None


def _read(path, size: int, expected: str, *, regular: bool = False) -> bytes:
    """The first size bytes of path (-1: all); one-line IngeroError when it cannot be read.
    regular: only a regular file (a FIFO named like a database would block)."""
    try:
        with (open_regular(path) if regular else open(path, "rb")) as f:
            return f.read(size)
    except FileNotFoundError:
        raise IngeroError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise IngeroError(f"{path}: is a directory, not {expected}") from None
    except OSError as e:
        raise IngeroError(f"{path}: cannot read: {e.strerror or e}") from None


def detect_kind(path: Path) -> str:
    """'bundle' or 'sqlite' from the first bytes; IngeroError for anything else."""
    head = _read(path, 16, "a fleet.db or bundle", regular=True)
    if head == SQLITE_MAGIC:
        return "sqlite"
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == SKIPPABLE_MAGIC:
        return "bundle"
    raise IngeroError(f"{path}: neither a SQLite database (fleet.db) nor an ingero bundle")


@contextlib.contextmanager
def open_database(path, *, tmpdir=None) -> Iterator[OpenedDatabase]:
    """Open fleet.db (or any SQLite file) or a verified bundle, read-only."""
    path = Path(path)
    kind = detect_kind(path)
    if kind == "bundle":
        bundle = open_bundle(path, tmpdir=tmpdir)
        try:
            yield OpenedDatabase(path, kind, bundle.con, bundle.node)
        finally:
            bundle.close()
        return
    try:
        con = connect_readonly(path)
        con.execute("SELECT COUNT(*) FROM sqlite_schema").fetchall()
    except apsw.Error as e:
        raise IngeroError(f"{path}: cannot open database ({e})") from None
    try:
        yield OpenedDatabase(path, kind, con)
    finally:
        con.close()


def _authorizer(action, p1, p2, dbname, trigger):
    if action in _ALLOWED_ACTIONS:
        return apsw.SQLITE_OK
    if action == apsw.SQLITE_PRAGMA and (p1 or "").lower() in READ_PRAGMAS:
        # table_info(x) passes x as p2; a bare read passes None. Assignments of the
        # informational pragmas (user_version = 5) carry a value too, so refuse those.
        if p2 is None or (p1 or "").lower() in ("table_info", "table_xinfo", "index_list",
                                                "index_info", "index_xinfo",
                                                "foreign_key_list", "table_list",
                                                "integrity_check", "quick_check"):
            return apsw.SQLITE_OK
    return apsw.SQLITE_DENY


def _describe(a) -> str:
    name = a.action_name.removeprefix("SQLITE_")
    target = (a.table_name or a.file_name or a.pragma_name or a.operation or a.view_name
              or a.trigger_name or a.module_name or "")
    return f"{name} {target}".strip()


def check_readonly(con: apsw.Connection, sql: str, bindings=None, *, where: str = "query"
                   ) -> list[str]:
    """Raise QueryRefused unless sql is exactly one statement that only reads.

    Returns the statement's column names.
    """
    try:
        # without the bindings: a parameter they lack is said below, not a KeyError
        try:
            info = apsw.ext.query_info(con, sql, None, actions=True)
        except (TypeError, ValueError, AttributeError):
            # apsw.ext cannot describe some actions (REINDEX's index name): the statement
            # is judged without its action list, and the authorizer still runs with it
            info = apsw.ext.query_info(con, sql, None, actions=False)
    except apsw.Error as e:
        raise IngeroError(f"{where}: query failed: {_sql_error(e)}") from None
    if not info.first_query.strip():
        raise IngeroError(f"{where}: query is empty")
    rest = info.query_remaining or ""
    if rest.strip():
        try:
            # A trailing comment prepares to a statement with no columns and no actions.
            nxt = apsw.ext.query_info(con, rest, actions=True)
            more = bool(nxt.description or nxt.actions)
        except apsw.Error:
            more = True
        if more:
            raise QueryRefused(f"{where}: one statement per query: remove the text after the first ';'")
    writes = [a for a in (info.actions or ())
              if _authorizer(a.action, a.pragma_name, a.pragma_value, a.database_name, None)
              != apsw.SQLITE_OK]
    if not info.is_readonly or writes:
        what = _describe(writes[0]) if writes else "the statement writes"
        raise QueryRefused(f"{where}: statement refused: ingero-query only reads ({what})")
    check_parameters(info.bindings_names or (), bindings, where=where)
    return [d[0] for d in (info.description or ())]


class QueryParameterError(BadUsage):
    """The statement's parameters and the values given (-p NAME VALUE) do not match:
    a usage error (exit 2); nothing was run."""


def check_parameters(names, bindings, *, where: str = "query") -> None:
    """Raise QueryParameterError unless every parameter of the statement (names: as
    ``sqlite3_bind_parameter_name`` without its :, $ or @; None for ? and the gaps
    before ?N) has a value in the dict bindings (ingero-query's -p). Bindings given as a
    sequence (library callers) are left to SQLite to match."""
    if bindings is not None and not isinstance(bindings, dict):
        return
    given = bindings or {}
    if any(n is None or n.isdigit() for n in names):
        raise QueryParameterError(f"{where}: query parameters: ? and ?N cannot be given "
                                  "values; name them (:name) and use -p NAME VALUE")
    missing = list(dict.fromkeys(n for n in names if n not in given))
    if missing:
        what = ", ".join(f":{n}" for n in missing)
        hint = (f" (given: {', '.join(sorted(given))})" if given else "")
        raise QueryParameterError(
            f"{where}: query parameter{'s' if len(missing) > 1 else ''} {what} "
            f"{'have' if len(missing) > 1 else 'has'} no value: give "
            + " ".join(f"-p {n} VALUE" for n in missing) + hint)


def _sql_error(e: apsw.Error) -> str:
    msg = str(e)
    # apsw prefixes the class name ("SQLError: no such table: x"); keep SQLite's words.
    return msg.split(": ", 1)[1] if ": " in msg and msg.split(": ", 1)[0].endswith("Error") \
        else msg


@dataclass
class QueryResult:
    columns: list[str]
    rows: Iterator[tuple]


#: ingero-query's default --timeout (seconds): a statement that runs longer is stopped.
DEFAULT_TIMEOUT_S = 300.0


class QueryTimeout(IngeroError):
    """The statement ran longer than its timeout and was stopped."""


class QueryInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the statement (inside SQLite, where Python's handler cannot)."""


class Deadline:
    """Stops the connection's statement (SQLite's progress handler) once ``timeout_s``
    have passed (None or 0: never) or once ``interrupt()`` was called (a SIGINT
    handler calls it: SQLite's loop runs no Python code for the default handler)."""

    STEPS = 10_000      # virtual machine instructions between two looks at the clock

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s or None
        self.end = None if not timeout_s else time.monotonic() + timeout_s
        self.interrupted = False
        self.expired = False

    def interrupt(self) -> None:
        self.interrupted = True

    def __call__(self) -> int:
        if self.interrupted:
            return 1
        if self.end is not None and time.monotonic() > self.end:
            self.expired = True
            return 1
        return 0

    def error(self, where: str) -> BaseException | None:
        if self.interrupted:
            return QueryInterrupted()
        if self.expired:
            return QueryTimeout(f"{where}: query stopped after {self.timeout_s:g} s "
                                "(--timeout; 0 for no limit)")
        return None


def run_query(db: OpenedDatabase, sql: str, bindings=None, *,
              deadline: Deadline | None = None) -> QueryResult:
    """Check and start one read-only statement; rows stream from the returned iterator.
    deadline: stops the statement (timeout, Ctrl-C) with QueryTimeout/QueryInterrupted."""
    where = str(db.path)
    columns = check_readonly(db.con, sql, bindings, where=where)
    db.con.authorizer = _authorizer
    if deadline is not None:
        db.con.set_progress_handler(deadline, Deadline.STEPS)

    def failed(e):
        stop = deadline.error(where) if deadline is not None else None
        return stop or IngeroError(f"{where}: query failed: {_sql_error(e)}")

    cur = db.con.cursor()
    try:
        cur.execute(sql, bindings)
    except apsw.AuthError:
        raise QueryRefused(f"{where}: statement refused: ingero-query only reads") from None
    except apsw.BindingsError as e:
        raise IngeroError(f"{where}: query parameters: {e}") from None
    except apsw.Error as e:
        raise failed(e) from None

    def rows():
        n = 0
        try:
            for row in cur:
                yield row
                n += 1
        except apsw.Error as e:
            raise failed(e) from None
        except UnicodeDecodeError as e:
            raise IngeroError(f"{where}: query failed: row {n + 1} holds text that is not "
                              f"UTF-8 (byte {e.start}); select it as CAST(column AS BLOB)"
                              ) from None

    return QueryResult(columns, rows())


@dataclass
class TableInfo:
    name: str
    rows: int
    doc: str
    columns: list[str]


def fleet_table_docs() -> dict[str, str]:
    """Table docs from the fleet.db catalogue (merge/fleet_schema.py)."""
    from ..merge.fleet_schema import FLEET_TABLES  # noqa: PLC0415 (only --schema needs it)
    return {t.name: t.doc for t in FLEET_TABLES}


def list_tables(db: OpenedDatabase) -> list[TableInfo]:
    """Every table with its row count, columns and a line on what it holds."""
    docs = {name: t.doc for name, t in BUNDLE_TABLES.items()}
    if db.kind == "sqlite":
        docs.update(fleet_table_docs())
    out = []
    names = [r[0] for r in db.con.execute(
        "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "ORDER BY name")]
    for name in names:
        quoted = '"' + name.replace('"', '""') + '"'
        n = db.con.execute(f"SELECT COUNT(*) FROM {quoted}").fetchone()[0]
        cols = [r[1] for r in db.con.execute("SELECT * FROM pragma_table_info(?)", (name,))]
        out.append(TableInfo(name, n, docs.get(name, "(not in the ingero catalogue)"), cols))
    return out


# ------------------------------------------------------------------------- input

def read_sql(path) -> str:
    """The SQL text of a file (``-`` is stdin), as ``ingero-query -f FILE`` reads it."""
    import sys

    if str(path) == "-":
        data = sys.stdin.buffer.read()
        where = "stdin"
    else:
        where = str(path)
        data = _read(path, -1, "an SQL file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise IngeroError(f"{where}: SQL is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise IngeroError(f"{where}: no SQL in it")
    return text


def starts_with_sql_comment(arg: str) -> bool:
    """True for a command-line word that is SQL opening with a comment, not an option.

    ``-- find slow ...`` (two dashes then a space, tab or newline) can be no option name;
    a lone ``--`` stays the end-of-options marker.
    """
    return len(arg) > 2 and arg.startswith("--") and arg[2].isspace()


# ------------------------------------------------------------------------- output

FORMATS = ("table", "csv", "json")
#: The table format sizes its columns on this many first rows (or this much text), then
#: streams; a column is at most TABLE_MAX_WIDTH wide (longer values are not cut).
TABLE_HEAD_ROWS = 1000
TABLE_HEAD_BYTES = 1 << 20
TABLE_MAX_WIDTH = 120


def _text(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bytes):
        return v.hex()
    return str(v)


def _cell(v) -> str:
    """A table cell: control characters escaped as \\xNN, tab and newline too (they
    would break the row's layout)."""
    from ..cliutil import clean  # noqa: PLC0415
    return clean(_text(v)).replace("\t", "\\x09").replace("\n", "\\x0a")


def write_rows(result: QueryResult, fmt: str, out) -> int:
    """Write result to the binary stream out as table, csv or json; return the row count.

    Every format streams row by row (table after sizing its columns on the first rows).
    """
    import csv
    import io

    import orjson

    n = 0
    if fmt == "json":
        # One object per row, one row per line: streamable and still a JSON array.
        out.write(b"[")
        for row in result.rows:
            obj = {c: (v.hex() if isinstance(v, bytes) else v)
                   for c, v in zip(result.columns, row)}
            out.write(b"\n" if n == 0 else b",\n")
            out.write(orjson.dumps(obj))
            n += 1
        out.write(b"\n]\n" if n else b"]\n")
        return n
    if fmt == "csv":
        text = io.TextIOWrapper(out, encoding="utf-8", newline="", write_through=True)
        w = csv.writer(text, lineterminator="\n")
        w.writerow(result.columns)
        for row in result.rows:
            w.writerow([_text(v) for v in row])
            n += 1
        text.flush()
        text.detach()
        return n
    if fmt == "table":
        # For a terminal: control characters escaped; the columns sized on the first
        # rows (TABLE_HEAD_ROWS, or TABLE_HEAD_BYTES of text), the rest streamed.
        rows = iter(result.rows)
        head, size = [], 0
        for row in rows:
            cells = [_cell(v) for v in row]
            head.append(cells)
            size += sum(len(c) for c in cells)
            if len(head) >= TABLE_HEAD_ROWS or size >= TABLE_HEAD_BYTES:
                break
        widths = [len(c) for c in result.columns]
        for cells in head:
            for i, v in enumerate(cells):
                widths[i] = min(max(widths[i], len(v)), TABLE_MAX_WIDTH)

        def line(cells):
            return ("  ".join(v.ljust(w) for v, w in zip(cells, widths)).rstrip() + "\n"
                    ).encode("utf-8", "backslashreplace")
        out.write(line([_cell(c) for c in result.columns]))
        out.write(line(["-" * w for w in widths]))
        for cells in head:
            out.write(line(cells))
            n += 1
        del head
        for row in rows:
            out.write(line([_cell(v) for v in row]))
            n += 1
        return n
    raise ValueError(f"unknown format {fmt!r}")
