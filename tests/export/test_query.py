import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ingero_forensics.export.query import open_database, run_query, QueryRefused
from ingero_forensics.export.query_cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_json_rows_match_fleet(fleet):
    path, truth = fleet
    r = run(path, "SELECT node_id, COUNT(*) AS n FROM nccl_events GROUP BY node_id "
                  "ORDER BY node_id", "--format", "json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert sum(x["n"] for x in rows) == truth["nccl"]
    assert [x["node_id"] for x in rows] == list(range(1, truth["nodes"] + 1))


def test_csv_and_table(fleet):
    path, truth = fleet
    r = run(path, "SELECT name, ranks FROM nodes ORDER BY name", "--format", "csv")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0] == "name,ranks"
    assert len(lines) == truth["nodes"] + 1 and lines[1].startswith('node-00,"[0,')
    r = run(path, "SELECT name FROM nodes ORDER BY name")
    assert r.stdout.splitlines()[:3] == ["name", "-------", "node-00"]
    assert f"({truth['nodes']} rows)" in r.stderr


def test_params_and_empty_result_keeps_header(fleet):
    path, _ = fleet
    r = run(path, "SELECT op, seq FROM nccl_events WHERE seq = :s AND rank = 0", "-p", "s", "2",
            "--json")
    assert json.loads(r.stdout) == [{"op": "ALL_REDUCE", "seq": 2}]
    r = run(path, "SELECT op, seq FROM nccl_events WHERE seq = -1", "--format", "csv")
    assert r.stdout == "op,seq\n"


@pytest.mark.parametrize("sql, what", [
    ("INSERT INTO nodes (name) VALUES ('x')", "INSERT nodes"),
    ("DELETE FROM cuda_events", "DELETE cuda_events"),
    ("UPDATE nodes SET name = 'x'", "UPDATE nodes"),
    ("DROP TABLE nodes", "DELETE sqlite_master"),
    ("CREATE TEMP TABLE x (a)", "INSERT sqlite_temp_master"),
    ("ATTACH 'other.db' AS o", "ATTACH other.db"),
    ("PRAGMA user_version = 9", "PRAGMA user_version"),
    ("BEGIN", "TRANSACTION BEGIN"),
])
def test_writes_are_refused(fleet, sql, what):
    path, _ = fleet
    before = sha(path)
    r = run(path, sql)
    assert r.exit_code == 1
    assert r.stderr == f"Error: {path}: statement refused: ingero-query only reads ({what})\n"
    assert sha(path) == before


def test_second_statement_refused_but_trailing_comment_allowed(fleet):
    path, _ = fleet
    r = run(path, "SELECT 1; DELETE FROM nodes")
    assert r.exit_code == 1
    assert r.stderr == (f"Error: {path}: one statement per query: remove the text after "
                        "the first ';'\n")
    r = run(path, "SELECT 41 + 1 AS x; -- why", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == [{"x": 42}]


def test_read_pragmas_allowed(fleet):
    path, _ = fleet
    r = run(path, "PRAGMA table_info(collectives)", "--json")
    assert r.exit_code == 0
    assert "last_rank" in {c["name"] for c in json.loads(r.stdout)}
    # the check an SRE runs on a suspect fleet.db, with or without a limit
    for sql in ("PRAGMA integrity_check", "PRAGMA quick_check(5)"):
        r = run(path, sql, "--json")
        assert r.exit_code == 0, r.output
        assert [list(row.values()) for row in json.loads(r.stdout)] == [["ok"]]


def test_library_refuses_even_without_the_cli(fleet):
    path, _ = fleet
    with open_database(path) as db:
        with pytest.raises(QueryRefused):
            run_query(db, "DELETE FROM nodes")
        # the connection itself is read-only: the authorizer is a second lock, not the only one
        assert db.con.readonly("main")


def test_sql_error_is_one_line(fleet):
    path, _ = fleet
    r = run(path, "SELECT * FROM no_such_table")
    assert r.exit_code == 1
    assert r.stderr == f"Error: {path}: query failed: no such table: no_such_table\n"


def test_schema_lists_tables_with_docs(fleet):
    path, truth = fleet
    r = run(path, "--schema", "--json")
    assert r.exit_code == 0
    tables = {t["table"]: t for t in json.loads(r.stdout)}
    assert tables["nccl_events"]["rows"] == truth["nccl"]
    assert tables["collectives"]["doc"].startswith("One row per collective")
    assert "comm_id_hash" in tables["collectives"]["columns"]
    r = run(path, "--schema")
    line = next(x for x in r.stdout.splitlines() if x.startswith("clock_alignment"))
    assert "how its CLOCK_MONOTONIC maps to fleet time" in line


def test_bundle_is_queried_after_verification(bundle_path):
    r = run(bundle_path, "SELECT COUNT(*) AS n, MAX(value) AS top FROM host_samples", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"n": 5, "top": 40.0}]
    r = run(bundle_path, "--schema")
    assert any(x.startswith("capture_log") and "What the capture did" in x
               for x in r.stdout.splitlines())
    before = sha(bundle_path)
    r = run(bundle_path, "DELETE FROM host_samples")
    assert r.exit_code == 1 and "statement refused" in r.stderr
    assert sha(bundle_path) == before


def test_corrupt_bundle_named_in_error(bundle_path, tmp_path):
    bad = tmp_path / "bad.bundle"
    data = bytearray(bundle_path.read_bytes())
    data[-10] ^= 0xFF
    bad.write_bytes(bytes(data))
    r = run(bad, "SELECT 1")
    assert r.exit_code == 1
    assert r.stderr.startswith(f"Error: {bad}: ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.output


def test_missing_and_foreign_files(tmp_path):
    r = run(tmp_path / "nope.db", "SELECT 1")
    assert r.exit_code == 1 and r.stderr == f"Error: {tmp_path / 'nope.db'}: no such file\n"
    junk = tmp_path / "junk.txt"
    junk.write_text("hello, not a database at all")
    r = run(junk, "SELECT 1")
    assert r.stderr == (f"Error: {junk}: neither a SQLite database (fleet.db) nor an ingero "
                        "bundle\n")


def test_usage_errors(fleet):
    path, _ = fleet
    r = run(path)
    assert r.exit_code == 2 and "missing SQL" in r.stderr
    r = run(path, "SELECT 1", "--schema")
    assert r.exit_code == 2


def test_help_and_version():
    r = run("--help")
    assert r.exit_code == 0 and "Example:" in r.stdout and "Exit codes" in r.stdout
    r = run("--version")
    assert r.exit_code == 0 and r.stdout.startswith("ingero-query ")


# ------------------------------------------------ the article's query, verbatim (issue 21)

ARTICLE_SQL = (Path(__file__).parent / "article_query.sql").read_text()


@pytest.fixture(scope="module")
def slow_fleet(tmp_path_factory):
    """A fleet.db where two ALL_REDUCE calls are slower than the query's 50 ms."""
    import apsw
    from .fleetgen import build_fleet
    path = tmp_path_factory.mktemp("slow") / "fleet.db"
    build_fleet(path)
    con = apsw.Connection(str(path))
    con.execute("UPDATE nccl_events SET duration_ns = 120000000 WHERE rank = 3 AND seq = 1")
    con.execute("UPDATE nccl_events SET duration_ns = 80000000 WHERE rank = 0 AND seq = 2")
    expected = [list(r) for r in con.execute(ARTICLE_SQL)]
    con.close()
    assert len(expected) == 2 and all(r[2] > 0 for r in expected)
    return path, expected


def _rows(stdout):
    return [[r["rank"], r["ms"], r["retransmits_in_window"]] for r in json.loads(stdout)]


def test_article_query_starts_with_a_comment():
    assert ARTICLE_SQL.startswith("-- find slow ncclAllReduce calls")


def test_article_query_as_argument(slow_fleet):
    path, expected = slow_fleet
    r = run(path, ARTICLE_SQL, "--json")
    assert r.exit_code == 0, r.output
    assert _rows(r.stdout) == expected
    # options before the SQL too, and the table format
    r = run("--format", "csv", path, ARTICLE_SQL)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == "rank,ms,retransmits_in_window"
    assert len(r.stdout.splitlines()) == 3


def test_article_query_from_file_and_stdin(slow_fleet, tmp_path):
    path, expected = slow_fleet
    f = tmp_path / "query.sql"
    f.write_text(ARTICLE_SQL)
    r = run(path, "-f", f, "--json")
    assert r.exit_code == 0, r.output
    assert _rows(r.stdout) == expected
    r = CliRunner().invoke(main, [str(path), "--json"], input=ARTICLE_SQL)
    assert r.exit_code == 0, r.output
    assert _rows(r.stdout) == expected
    r = CliRunner().invoke(main, [str(path), "--json", "-f", "-"], input=ARTICLE_SQL)
    assert r.exit_code == 0, r.output
    assert _rows(r.stdout) == expected


def test_article_query_through_the_console_script(slow_fleet, tmp_path):
    """The shell forms of the issue: "$(cat query.sql)", -f query.sql and < query.sql."""
    import shutil
    import subprocess
    exe = shutil.which("ingero-query")
    assert exe, "ingero-query is not on PATH"
    path, expected = slow_fleet
    f = tmp_path / "query.sql"
    f.write_text(ARTICLE_SQL)
    for cmd, stdin in ((f'"{exe}" "{path}" "$(cat "{f}")" --json', None),
                       (f'"{exe}" "{path}" -f "{f}" --json', None),
                       (f'"{exe}" "{path}" --json < "{f}"', None)):
        p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, stdin=stdin)
        assert p.returncode == 0, (cmd, p.stderr)
        assert _rows(p.stdout) == expected, cmd


def test_sql_sources_conflict_and_bad_file(fleet, tmp_path):
    path, _ = fleet
    f = tmp_path / "q.sql"
    f.write_text("SELECT 1")
    r = run(path, "SELECT 1", "-f", f)
    assert r.exit_code == 2 and "not both" in r.stderr
    r = run(path, "-f", tmp_path / "missing.sql")
    assert r.exit_code == 1 and r.stderr == f"Error: {tmp_path / 'missing.sql'}: no such file\n"
    empty = tmp_path / "empty.sql"
    empty.write_text("  \n")
    r = run(path, "-f", empty)
    assert r.exit_code == 1 and r.stderr == f"Error: {empty}: no SQL in it\n"
    r = CliRunner().invoke(main, [str(path)], input="  \n")
    assert r.exit_code == 2 and "stdin is empty" in r.stderr
    for blank in ("", "  \n"):     # given, but blank: missing SQL as well, exit 2 (was 1)
        r = CliRunner().invoke(main, [str(path), blank], input="SELECT 1")
        assert r.exit_code == 2 and "the SQL given is blank" in r.stderr, r.stderr
    # a lone "--" still ends the options as usual
    r = run(path, "--json", "--", "-- a comment\nSELECT 7 AS x")
    assert r.exit_code == 0 and json.loads(r.stdout) == [{"x": 7}]


def test_table_escapes_tab_and_newline(fleet):
    """docs/export.md: the table escapes control characters as \\xNN; tab and newline
    passed through and broke the row's layout (a review)."""
    path, _ = fleet
    r = run(path, "SELECT 'a' || char(9) || 'b' || char(13) || 'c' || char(10) || 'd' AS v")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == ["v", "-" * len("a\\x09b\\x0dc\\x0ad"),
                                     "a\\x09b\\x0dc\\x0ad"]
