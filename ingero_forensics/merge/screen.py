"""Which rows of an untrusted bundle the merge takes: one rule per column, as SQL.

A row is merged when every value is of its column's declared type (text or a blob in an
INTEGER column would fail export and query later), its enum value is known, its NOT NULL
columns are set, its identifiers are small non-negative integers and its time points lie
within syncpoints.TIME_BOUND and the bundle's capture window plus a margin (a time at
int64 max or centuries away would otherwise become the fleet's start or jitter). The
rest is skipped and counted.

The rules are data (``column_rules``); ``row_predicate`` writes them either as plain SQL
(the reference) or as one call of ``ingero_row_ok(spec, ...)``, the same rules in C
(bundle/_screen.c, about three times faster: docs/performance.md), registered on every
connection by db.harden when the extension is built. Tests compare the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .. import accel
from ..bundle.reader import column_or_null
from ..bundle.schema import TABLES_BY_NAME as BUNDLE_TABLES
from .fleet_schema import time_point_columns
from .syncpoints import TIME_BOUND

#: A row whose monotonic time point lies further than this outside its bundle's capture
#: window (manifest capture.start/end_mono_ns) is not merged: it is skipped and counted.
WINDOW_MARGIN_NS = 600 * 1_000_000_000
#: The same for a clock sample's realtime reading and the capture's UTC window; wider,
#: as a node's clock may be stepped during the capture (but not into another century).
REALTIME_MARGIN_NS = 86_400 * 1_000_000_000
#: Kernel and job identifiers: small non-negative integers (Linux pids stay below
#: 2^22, ranks below a job's size); outside [0, 2^32) a row is skipped, as the readers
#: compute with them (sort keys, track ids).
ID_COLUMNS = ("pid", "tid", "owner_pid", "other_pid", "other_tid", "rank", "nranks",
              "local_rank", "world_size", "local_world_size", "node_rank", "cpu")
_I64 = (-(1 << 63), (1 << 63) - 1)
#: nccl_events.handle_seq counts calls from 1; beyond this (centuries of calls) a row is
#: skipped, so the late-attach offsets computed from it cannot overflow
HANDLE_SEQ_MAX = 1 << 48
#: tcp_progress byte positions: below 2^60 (an exabyte), so offset + bytes stays in int64
STREAM_MAX = 1 << 60
#: The storage classes a column of each declared type may hold (SQLite stores any value
#: in any column; the readers of fleet.db rely on these).
_STORAGE = {"INTEGER": "'integer'", "REAL": "'real', 'integer'", "TEXT": "'text'"}
_KIND = {"INTEGER": "i", "REAL": "r", "TEXT": "t"}


@dataclass
class ColumnRule:
    name: str
    type: str                 # declared type: INTEGER, REAL or TEXT
    nullable: bool
    lo: int | None = None     # inclusive range for an integer value
    hi: int | None = None
    values: tuple = ()        # the text values allowed (an enum column)

    def narrow(self, lo: int, hi: int) -> None:
        self.lo = lo if self.lo is None else max(self.lo, lo)
        self.hi = hi if self.hi is None else min(self.hi, hi)


def column_rules(table: str, bundle=None) -> list[ColumnRule]:
    """The rule of every column of ``table`` that the bundle has (all columns when
    ``bundle`` is None: the window is then left out)."""
    t = BUNDLE_TABLES[table]
    absent = getattr(bundle, "absent", {}).get(table, frozenset()) if bundle else frozenset()
    times = set(time_point_columns(table)) | {"mono_before_ns", "mono_after_ns"}
    rules = {}
    for c in t.columns[1:] if t.columns[0].name == "id" else t.columns:
        if c.name in absent:
            continue
        r = rules[c.name] = ColumnRule(c.name, c.type, c.nullable, values=tuple(c.values or ()))
        if c.name in ID_COLUMNS:
            r.narrow(0, 4294967295)
        if c.name == "handle_seq":      # a call counter from 1: offsets stay in int64
            r.narrow(1, HANDLE_SEQ_MAX)
        if table == "tcp_progress" and c.name in ("stream_offset", "bytes"):
            # byte positions: the pairing adds them, and a call moves at least a byte
            r.narrow(1 if c.name == "bytes" else 0, STREAM_MAX)
        if c.name in times or (c.name == "duration_ns" and table == "nccl_events"):
            assert c.type == "INTEGER", (table, c.name)
            # within TIME_BOUND (a duration not negative): both collective paths count
            # exactly these rows, and their sums fit in int64
            r.narrow(0 if c.name == "duration_ns" else -TIME_BOUND, TIME_BOUND)
    if bundle is not None:
        cap = bundle.manifest["capture"]
        window = (cap["start_mono_ns"] - WINDOW_MARGIN_NS, cap["end_mono_ns"] + WINDOW_MARGIN_NS)
        cols = [c for c in time_point_columns(table)
                if c in rules and column_or_null(bundle, table, c) != "NULL"]
        if table == "clock_samples":
            cols += ["mono_before_ns", "mono_after_ns"]
            rules["realtime_ns"].narrow(
                max(cap["start_utc_ns"] - REALTIME_MARGIN_NS, _I64[0]),
                min(cap["end_utc_ns"] + REALTIME_MARGIN_NS, _I64[1]))
        for c in cols:
            rules[c].narrow(max(window[0], _I64[0]), min(window[1], _I64[1]))
    return list(rules.values())


def rules_sql(rules: list[ColumnRule], alias: str = "e") -> str:
    """The rules as plain SQL: the reference."""
    conds = []
    for r in rules:
        ref = f"{alias}.{r.name}"
        conds.append(f"typeof({ref}) IN ({_STORAGE[r.type]}, 'null')")
        if r.lo is not None:
            conds.append(f"({ref} IS NULL OR {ref} BETWEEN {r.lo} AND {r.hi})")
        if r.values:
            vals = ", ".join("'" + v.replace("'", "''") + "'" for v in r.values)
            conds.append(f"({ref} IN ({vals})" + (f" OR {ref} IS NULL)" if r.nullable else ")"))
        elif not r.nullable:
            conds.append(f"{ref} IS NOT NULL")
    return " AND ".join(conds) or "1"


def rules_spec(rules: list[ColumnRule]) -> str:
    """The rules in ingero_row_ok's notation (bundle/_screen.c)."""
    toks = []
    for r in rules:
        assert all(v and not set(v) & set(";|='\\") for v in r.values), r.values
        rng = f"{r.lo},{r.hi}" if r.lo is not None else ","
        toks.append(f"{_KIND[r.type]}{int(r.nullable)}{rng}" +
                    ("=" + "|".join(r.values) if r.values else ""))
    return ";".join(toks)


def rules_call(rules: list[ColumnRule], alias: str = "e") -> str:
    if not rules:
        return "1"
    cols = ", ".join(f"{alias}.{r.name}" for r in rules)
    return f"ingero_row_ok('{rules_spec(rules)}', {cols})"


def first_skipped(con, table: str, bundle, schema: str = "b") -> str | None:
    """Why the merge skips rows of ``table`` of ``bundle`` (attached as ``schema``):
    the first such row's id and the first rule it breaks, e.g. ``id 3: op 'ALLREDUCE'
    is not a known value``, so that a writer can be fixed; None if no row fails. Read
    only when rows were skipped: it may scan the table."""
    rules = column_rules(table, bundle)
    if not rules:
        return None
    key = "e.id" if BUNDLE_TABLES[table].columns[0].name == "id" else "e.rowid"
    # text comes back as bytes: a value that is not UTF-8 (in a column the reader does
    # not screen, an INTEGER or enum one) must be shown, not fail the decode
    cols = ", ".join(f"CASE WHEN typeof(e.{r.name}) = 'text' THEN CAST(e.{r.name} AS BLOB) "
                     f"ELSE e.{r.name} END, typeof(e.{r.name})" for r in rules)
    row = con.execute(f"SELECT CAST({key} AS BLOB), typeof({key}), {cols} FROM "
                      f"{schema}.{table} e WHERE NOT ({row_predicate(table, bundle)}) "
                      "LIMIT 1").fetchone()
    if row is None:
        return None
    values = [_value(row[k], row[k + 1]) for k in range(0, len(row), 2)]
    times = set(time_point_columns(table)) | {"mono_before_ns", "mono_after_ns"}
    for rule, value in zip(rules, values[1:]):
        why = rule_broken(rule, value, in_window=rule.name in times)
        if why:
            return f"id {_shown(values[0])}: {why}"
    return None


def _value(raw, storage: str):
    """A value read back as bytes (text) or as itself, as Python would hold it: text
    decoded with its undecodable bytes kept as surrogates (_shown writes them \\xNN)."""
    if storage == "text":
        return bytes(raw).decode("utf-8", "surrogateescape")
    if storage == "integer" and isinstance(raw, bytes):      # the key, cast to a blob
        return int(raw)
    return raw


_TYPE_OF = {int: "an integer", float: "a real", str: "text", bytes: "a blob"}


def _shown(value) -> str:
    """A bundle's value in a message: repr (control characters escaped, a byte that is
    not UTF-8 as \\xNN), cut short."""
    text = re.sub(r"\\udc([89a-f][0-9a-f])", r"\\x\1", repr(value))
    return text if len(text) <= 40 else text[:37] + "..."


def rule_broken(rule: ColumnRule, value, in_window: bool = False) -> str | None:
    """How ``value`` breaks ``rule``, in words (None if it does not): the same rules
    as rules_sql, one at a time."""
    if value is None:
        return None if rule.nullable else f"{rule.name} is NULL"
    want = {"INTEGER": (int,), "REAL": (int, float), "TEXT": (str,)}[rule.type]
    if type(value) not in want:
        return (f"{rule.name} holds {_TYPE_OF.get(type(value), type(value).__name__)} "
                f"{_shown(value)}, not {_TYPE_OF[want[-1]]}")
    if rule.lo is not None and not rule.lo <= value <= rule.hi:
        if in_window:
            return (f"{rule.name} {value} lies outside the capture window (manifest "
                    f"capture, +-{WINDOW_MARGIN_NS // 1_000_000_000} s)")
        if rule.name == "realtime_ns":
            return (f"realtime_ns {value} lies outside the capture's UTC window "
                    f"(+-{REALTIME_MARGIN_NS // 1_000_000_000} s)")
        if value < rule.lo == 0:
            return f"{rule.name} {value} is negative"
        return f"{rule.name} {value} is outside [{rule.lo}, {rule.hi}]"
    if rule.values and value not in rule.values:
        known = ", ".join(rule.values[:8]) + (", ..." if len(rule.values) > 8 else "")
        return f"{rule.name} {_shown(value)} is not a known value ({known})"
    return None


def row_predicate(table: str, bundle=None, alias: str = "e", fast: bool | None = None) -> str:
    """SQL true for the rows of ``table`` (of ``bundle``: its absent optional columns left
    out, its capture window applied) that the merge copies and the collectives count.
    fast: the C function (default: when it is built and not disabled)."""
    rules = column_rules(table, bundle)
    if fast is None:
        fast = accel.screens() is not None
    return rules_call(rules, alias) if fast else rules_sql(rules, alias)
