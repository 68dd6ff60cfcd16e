"""bundle/_screen.c: its UTF-8 rule is Python's strict decoder, byte for byte, and the
reader refuses the same bundles with it as without it."""

from __future__ import annotations

import itertools
import random

import apsw
import pytest

from ingero_forensics import accel
from ingero_forensics.db import harden

screen = accel.screens()
pytestmark = pytest.mark.skipif(screen is None, reason="bundle/_screen.c not built")


def python_ok(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


EDGES = (0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF,
         0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF)


def test_every_two_byte_sequence():
    bad = [bytes(p) for p in itertools.product(range(256), repeat=2)
           if screen.utf8_valid(bytes(p)) != python_ok(bytes(p))]
    assert bad == []


def test_three_and_four_byte_sequences_around_every_boundary():
    bad = []
    for lead in range(0x80, 0x100):
        for rest in itertools.product(EDGES, repeat=3):
            for b in (bytes((lead,) + rest[:2]), bytes((lead,) + rest)):
                if screen.utf8_valid(b) != python_ok(b):
                    bad.append(b)
    assert bad == []


def test_random_text_with_ascii_runs():
    """Long ASCII runs take the 8-byte path: a bad byte at any offset after one is found."""
    rng = random.Random(7)
    pool = ["a", "é", "€", "𝄞", "\x00", "\x7f"]
    for _ in range(4000):
        s = "".join(rng.choice(pool) if rng.random() < 0.2 else "x"
                    for _ in range(rng.randrange(0, 40))).encode()
        if rng.random() < 0.5 and s:
            i = rng.randrange(len(s))
            s = s[:i] + bytes([rng.choice((0x80, 0xC0, 0xED, 0xF4, 0xFF))]) + s[i + 1:]
        assert screen.utf8_valid(s) == python_ok(s), s


def test_sql_function_checks_text_only_and_every_argument():
    con = harden(apsw.Connection(":memory:"))
    row = con.execute("SELECT ingero_utf8_ok('ok', 1, 2.5, x'ff', NULL), "
                      "ingero_utf8_ok('ok', CAST(x'ff' AS TEXT)), "
                      "ingero_utf8_ok(CAST(x'e282ac' AS TEXT))").fetchone()
    assert row == (1, 0, 1)


def test_functions_cannot_be_called_from_a_view():
    """DIRECTONLY: SQL stored in a file (a view, a trigger) may not call them."""
    con = harden(apsw.Connection(":memory:"))
    con.config(apsw.SQLITE_DBCONFIG_ENABLE_VIEW, 1)
    con.execute("CREATE VIEW v AS SELECT ingero_utf8_ok('x') AS ok")
    with pytest.raises(apsw.SQLError, match="unsafe use"):
        con.execute("SELECT * FROM v").fetchall()


@pytest.mark.parametrize("fast", [True, False], ids=["C", "SQL"])
def test_reader_names_the_same_row_and_column_either_way(tmp_path, monkeypatch, fast):
    from ingero_forensics.bundle import reader
    from ingero_forensics.errors import BundleError
    if not fast:
        monkeypatch.setattr(reader.accel, "screens", lambda: None)
    con = apsw.Connection(str(tmp_path / "t.db"))
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    con.execute("INSERT INTO meta VALUES ('a', 'plain'), ('b', 'caf\u00e9'), "
                "('c', CAST(x'22ff22' AS TEXT))")
    with pytest.raises(BundleError, match=r"table meta row key 'c': value is not UTF-8"):
        reader._check_text(tmp_path / "t.bundle", con)
    con.execute("DELETE FROM meta WHERE key = 'c'")
    reader._check_text(tmp_path / "t.bundle", con)
