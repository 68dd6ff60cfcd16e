"""ingero-query against hostile input and runaway statements (issue 20): REINDEX and
other statements give one line, --timeout stops a statement, Ctrl-C stops it (exit 130),
the table format streams and escapes control characters."""

import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from ingero_forensics.export.query import (Deadline, QueryResult, open_database, run_query,
                                           write_rows)
from ingero_forensics.export.query_cli import main

FOREVER = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
           "SELECT COUNT(*) FROM c")


@pytest.mark.parametrize("sql", ["REINDEX", "REINDEX nodes", "VACUUM", "ANALYZE",
                                 "SAVEPOINT a", "PRAGMA optimize",
                                 "SELECT * FROM pragma_journal_mode", "PRAGMA wal_checkpoint"])
def test_every_refused_statement_is_one_line(fleet, sql):
    path, _ = fleet
    r = CliRunner().invoke(main, [str(path), sql], catch_exceptions=False)
    assert r.exit_code == 1
    assert r.stderr.startswith(f"Error: {path}: statement refused: ingero-query only reads")
    assert r.stderr.count("\n") == 1


def test_timeout_stops_a_runaway_statement(fleet):
    path, _ = fleet
    t = time.monotonic()
    r = CliRunner().invoke(main, [str(path), FOREVER, "--timeout", "0.5"],
                           catch_exceptions=False)
    assert time.monotonic() - t < 10
    assert r.exit_code == 1
    assert r.stderr == (f"Error: {path}: query stopped after 0.5 s (--timeout; 0 for no "
                        "limit)\n")


def test_the_default_timeout_is_set():
    opt = next(p for p in main.params if p.name == "timeout")
    assert 0 < opt.default <= 3600


def test_ctrl_c_stops_the_statement(fleet):
    path, _ = fleet
    p = subprocess.Popen([sys.executable, "-c",
                          "from ingero_forensics.export.query_cli import main; main()",
                          str(path), FOREVER, "--timeout", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(1.5)
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("Ctrl-C did not stop the statement")
    assert p.returncode == 130
    assert err == b"Interrupted.\n"


def test_table_streams_after_sizing_its_columns(monkeypatch):
    import io
    from ingero_forensics.export import query
    monkeypatch.setattr(query, "TABLE_HEAD_ROWS", 10)
    out = io.BytesIO()
    seen = []

    def rows():
        for i in range(100):
            if i == 50:     # rows before the 50th are written before it is produced
                seen.append(out.getvalue().count(b"\n"))
            yield (i, "x" * (i % 7))
    n = write_rows(QueryResult(["i", "s"], rows()), "table", out)
    assert n == 100 and seen and seen[0] >= 2 + 49


def test_table_escapes_control_characters(fleet):
    import io
    out = io.BytesIO()
    rows = iter([("a\x1b]0;title\x07b", 1), ("\x9b2J", 2)])
    write_rows(QueryResult(["name\x1b", "n"], rows), "table", out)
    text = out.getvalue().decode()
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert "a\\x1b]0;title\\x07b" in text and "name\\x1b" in text


def test_library_deadline_interrupt(fleet):
    path, _ = fleet
    d = Deadline(None)
    d.interrupt()
    with open_database(path) as db:
        with pytest.raises(KeyboardInterrupt):
            list(run_query(db, FOREVER, deadline=d).rows)
