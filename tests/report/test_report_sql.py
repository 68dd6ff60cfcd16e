"""Every figure and table of the page shows the SQL that computed it, runnable as it is:
each statement is taken out of the rendered page and run with ingero-query and sqlite3
against the fleet.db, and returns the rows it returned when the report ran."""

import html
import json
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from ingero_forensics.export.query_cli import main as query_main
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.render import render_html
from ingero_forensics.report.sql import inline, literal, pretty, shell_quote


def test_literals_are_safe():
    assert literal(None) == "NULL" and literal(True) == "1" and literal(-3) == "-3"
    assert literal(0.5) == "0.5" and literal(b"\x01\xff") == "X'01ff'"
    assert literal("it's") == "'it''s'"
    with pytest.raises(ValueError):
        literal(float("nan"))
    # placeholders inside strings and comments are left alone; quotes in values doubled
    sql = "SELECT '?', \"a?\" FROM t -- why?\nWHERE x = ? AND y = ?"
    assert inline(sql, [1, "o'brien"]) == (
        "SELECT '?', \"a?\" FROM t -- why?\nWHERE x = 1 AND y = 'o''brien'")
    assert inline("SELECT :a, ':a'", {"a": "x"}) == "SELECT 'x', ':a'"
    with pytest.raises(ValueError):
        inline("SELECT ?", [1, 2])
    assert pretty("SELECT a  FROM t WHERE b = ' FROM '") == "SELECT a\nFROM t\nWHERE b = ' FROM ';"
    assert shell_quote("SELECT 'a'") == "\"SELECT 'a'\""
    assert shell_quote('SELECT "$x"') == "'SELECT \"$x\"'"


def page_sql(page: str) -> list[list[tuple[int, str]]]:
    """Per <details class="sql"> block of a page: (rows when the report ran, statement)."""
    blocks = re.findall(r'<details class="sql">(.*?)</details>', page, re.S)
    out = []
    for b in blocks:
        stmts = []
        for pre in re.findall(r"<pre\b[^>]*>(.*?)</pre>", b, re.S):
            text = html.unescape(pre)
            m = re.match(r"-- ([\d,]+) rows? when the report ran\n", text)
            assert m, text[:80]
            stmts.append((int(m.group(1).replace(",", "")), text))
        out.append(stmts)
    return out


def run_query(db, sql) -> list:
    r = CliRunner().invoke(query_main, [str(db), "--json", sql], catch_exceptions=False)
    assert r.exit_code == 0, (sql, r.output)
    return json.loads(r.stdout)


def check_page_sql(db, page, min_blocks):
    blocks = page_sql(page)
    assert len(blocks) >= min_blocks
    sqlite3 = shutil.which("sqlite3")
    for stmts in blocks:
        assert stmts, "an empty SQL block"
        # every block returns rows: the figure above it is not made of nothing
        assert any(n for n, _ in stmts), stmts
        for n, sql in stmts:
            assert len(run_query(db, sql)) == n, sql
            if sqlite3:
                r = subprocess.run([sqlite3, "-readonly", "-batch", "-json", str(db)],
                                   input=sql, capture_output=True, text=True, timeout=60)
                assert r.returncode == 0 and not r.stderr, (sql, r.stderr)
                assert len(json.loads(r.stdout or "[]")) == n, sql
    return blocks


@pytest.mark.parametrize("fault, min_blocks", [("cpu", 9), ("network", 9), ("none", 4)])
def test_every_figure_has_runnable_sql(fleets, fault, min_blocks):
    db, truth = fleets(fault)
    a = analyze_fleet(db)
    page = render_html(a)
    blocks = check_page_sql(db, page, min_blocks=min_blocks)
    if fault != "cpu":
        return
    # under the stragglers' table, the windows, the cause chart, the evidence, every
    # signal, the lateness table, the transfer chart, the seed query, clocks, inventory
    text = "\n".join(s for b in blocks for _, s in b)
    for table in ("nccl_events", "sched_events", "host_samples", "clock_alignment",
                  "tcp_events", "block_events", "cuda_events"):
        assert table in text
