"""merge/screen.py: the C rules (ingero_row_ok) keep exactly the rows the SQL rules keep,
on values of every kind the schema does not promise."""

from __future__ import annotations

import random
from types import SimpleNamespace

import apsw
import pytest

from ingero_forensics import accel
from ingero_forensics.bundle.schema import TABLES
from ingero_forensics.db import harden
from ingero_forensics.merge import screen
from ingero_forensics.merge.syncpoints import TIME_BOUND

pytestmark = pytest.mark.skipif(accel.screens() is None, reason="bundle/_screen.c not built")

START, END = 1_000_000_000, 4_000_000_000   # ids fit too (< 2^32)
UTC = 1_760_000_000_000_000_000
BUNDLE = SimpleNamespace(absent={}, manifest={"capture": {
    "start_mono_ns": START, "end_mono_ns": END, "start_utc_ns": UTC, "end_utc_ns": UTC + 4_000_000_000}})


def pool(col) -> list:
    vals = [None, 0, 1, -1, 4294967295, 4294967296, TIME_BOUND, TIME_BOUND + 1, -TIME_BOUND,
            -TIME_BOUND - 1, (1 << 63) - 1, -(1 << 63), 2.5, -0.0, "", "text", "0", b"\xff",
            b"", START - screen.WINDOW_MARGIN_NS, START - screen.WINDOW_MARGIN_NS - 1,
            END + screen.WINDOW_MARGIN_NS, END + screen.WINDOW_MARGIN_NS + 1, START,
            UTC, UTC - screen.REALTIME_MARGIN_NS - 1, "it's", "caf\u00e9"]
    vals += list(col.values or ())
    vals += [v.upper() for v in col.values or ()] + [v + " " for v in col.values or ()]
    return vals


def plausible(col) -> list:
    if col.values:
        return list(col.values)
    if col.name == "realtime_ns":
        return [UTC, UTC + 1]
    return {"INTEGER": [0, 1, 12345, START, END], "REAL": [2.5, 0.0, 3],
            "TEXT": ["text", "caf\u00e9"]}[col.type]


@pytest.mark.parametrize("table", [t for t in TABLES if t.name != "meta"], ids=lambda t: t.name)
def test_c_and_sql_keep_the_same_rows(table):
    rng = random.Random(table.name)
    con = harden(apsw.Connection(":memory:"))
    cols = [c.name for c in table.columns]
    con.execute(f"CREATE TABLE {table.name} ({', '.join(cols)})")   # no affinity: any value
    pools = {c.name: pool(c) for c in table.columns}
    good = {c.name: plausible(c) for c in table.columns}
    rows = []
    for i in range(3000):
        # mostly plausible rows with one or two odd values, so both outcomes are common
        row = [rng.choice(good[c]) for c in cols]
        for _ in range(rng.choice((0, 0, 1, 2))):
            k = rng.randrange(len(cols))
            row[k] = rng.choice(pools[cols[k]])
        if table.columns[0].name == "id":
            row[0] = i
        rows.append(row)
    con.executemany(f"INSERT INTO {table.name} VALUES ({', '.join('?' * len(cols))})", rows)
    kept = {}
    for fast in (False, True):
        pred = screen.row_predicate(table.name, BUNDLE, fast=fast)
        kept[fast] = con.execute(f"SELECT rowid FROM {table.name} e WHERE {pred}").fetchall()
    assert kept[True] == kept[False]
    n = len(kept[True])
    assert 0.2 * len(rows) < n < len(rows), (table.name, n)   # both outcomes tested


def test_absent_columns_are_left_out_of_both():
    b = SimpleNamespace(absent={"cuda_events": frozenset({"queued_ops", "queue_gap_ns"})},
                        manifest=BUNDLE.manifest)
    for fast in (False, True):
        pred = screen.row_predicate("cuda_events", b, fast=fast)
        assert "queued_ops" not in pred and "queue_gap_ns" not in pred


def test_a_malformed_spec_is_an_error_not_a_verdict():
    con = harden(apsw.Connection(":memory:"))
    with pytest.raises(apsw.SQLError, match="malformed spec"):
        con.execute("SELECT ingero_row_ok('x9', 1)").fetchall()
    with pytest.raises(apsw.SQLError, match="differ in number"):
        con.execute("SELECT ingero_row_ok('i1,', 1, 2)").fetchall()
