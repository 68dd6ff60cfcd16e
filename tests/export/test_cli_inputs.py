"""ingero-export and ingero-query against what a new user types: an -o that is the input,
a rank the fleet does not have, a query parameter without a value, a damaged fleet.db."""

import json
import os
import shutil

import apsw
import pytest
from click.testing import CliRunner

from ingero_forensics.export.cli import main
from ingero_forensics.export.query_cli import main as query_main

from ..damage import corrupt, sha


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])



@pytest.fixture
def copy(fleet, tmp_path):
    """A private copy of the session fleet.db (old code would overwrite the input)."""
    dest = tmp_path / "fleet.db"
    shutil.copyfile(fleet[0], dest)
    return dest



def test_output_that_is_the_input_is_refused_before_any_work(copy, tmp_path):
    before = sha(copy)
    link = tmp_path / "link.db"
    link.symlink_to(copy)
    os.link(copy, tmp_path / "hard.db")
    other_spelling = tmp_path / "." / ".." / tmp_path.name / "fleet.db"
    for out in (copy, link, tmp_path / "hard.db", other_spelling):
        r = run(copy, "--chrome-trace", "-o", out)
        assert r.exit_code == 2, (out, r.output)
        assert r.stderr == f"Error: {out}: the output would replace the input; choose another -o\n"
        assert sha(copy) == before
    # and with --redact (the copy would be made first) and --json
    r = run(copy, "--chrome-trace", "--redact", "--json", "-o", copy)
    assert r.exit_code == 2 and r.stdout == "" and sha(copy) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db", "hard.db", "link.db"]
    # another file, and stdout, are fine
    r = run(copy, "--chrome-trace", "-q", "-o", tmp_path / "t.json")
    assert r.exit_code == 0, r.output
    assert run(copy, "--chrome-trace").exit_code == 0


def test_unknown_rank_is_an_error_like_an_unknown_node(copy, tmp_path):
    out = tmp_path / "t.json"
    out.write_text("previous")
    for ranks, missing in (("99", "rank 99"), ("2-9", "ranks 4-9"), ("0,5,7", "ranks 5,7")):
        r = run(copy, "--chrome-trace", "-o", out, "--ranks", ranks)
        assert r.exit_code == 1, (ranks, r.output)
        assert r.stderr == f"Error: {copy}: no {missing} (ranks: 0-3)\n"
        assert out.read_text() == "previous"
    r = run(copy, "--chrome-trace", "-o", out, "--nodes", "node-99")
    assert r.exit_code == 1
    assert r.stderr == f"Error: {copy}: no node named node-99 (nodes: node-00, node-01)\n"
    # the ranks the fleet has still select
    r = run(copy, "--chrome-trace", "-o", out, "--ranks", "2-3", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["events"] > 0
    assert json.loads(out.read_bytes())["traceEvents"]


@pytest.mark.parametrize("opt", ["--nodes", "--kinds", "--ranks"])
@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_selection_is_a_usage_error(copy, tmp_path, opt, value):
    """`--nodes "$NODES"` with NODES unset would otherwise export every node."""
    out = tmp_path / "t.json"
    r = run(copy, "--chrome-trace", "-o", out, opt, value)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for {opt}: names no {opt[2:-1]}" in r.stderr
    assert not out.exists()


def test_redact_selection_errors_name_the_users_file(copy, tmp_path):
    r = run(copy, "--chrome-trace", "--redact", "-o", tmp_path / "t.json", "--nodes", "node-99")
    assert r.exit_code == 1
    # with --redact the nodes are the redacted copy's; the error names FLEET_DB, not a
    # temporary copy, and comes before the copy is made
    assert r.stderr == f"Error: {copy}: no node named node-99 (nodes: nodeid-1, nodeid-2)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db"]
    r = run(copy, "--chrome-trace", "--redact", "-q", "-o", tmp_path / "t.json",
            "--nodes", "nodeid-2", "--ranks", "2")
    assert r.exit_code == 0, r.output


def test_redact_takes_a_node_s_own_name_for_its_node_id(copy, tmp_path):
    """The operator knows the nodes by name (a review: "no node named node-05" for a
    node the fleet has): with --redact its own name selects its node id, and the trace
    names only that."""
    con = apsw.Connection(str(copy))
    (nid,) = con.execute("SELECT node_id FROM nodes WHERE name = 'node-01'").fetchone()
    con.close()
    out = {}
    for name in ("node-01", f"nodeid-{nid}"):
        r = run(copy, "--chrome-trace", "--redact", "-q", "-o", tmp_path / "t.json",
                "--nodes", name)
        assert r.exit_code == 0, r.output
        out[name] = json.loads((tmp_path / "t.json").read_text())
    procs = {e["args"]["name"] for e in out["node-01"]["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    nodes = {p for p in procs if not p.startswith("fleet")}
    assert nodes and all(p.startswith(f"nodeid-{nid} ") for p in nodes), procs
    assert "node-01" not in json.dumps(out["node-01"])
    # the same events (each redacted copy has addresses of its own: not compared)
    shape = lambda t: [(e["ph"], e.get("pid"), e.get("tid"), e.get("ts"))  # noqa: E731
                       for e in t["traceEvents"]]
    assert shape(out["node-01"]) == shape(out[f"nodeid-{nid}"])


def test_damaged_fleet_db_is_one_line_and_leaves_nothing(copy, tmp_path):
    corrupt(copy)
    for extra in ((), ("--redact",)):
        r = run(copy, "--chrome-trace", "-o", tmp_path / "t.json", *extra)
        assert r.exit_code == 1, r.output
        assert r.stderr == (f"Error: {copy}: cannot read fleet.db (database disk image is "
                            "malformed)\n")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db"]


# ---------------------------------------------------------------------- ingero-query

def query(*args):
    return CliRunner().invoke(query_main, [str(a) for a in args])


@pytest.mark.parametrize("args, err", [
    (("SELECT :a", "-p", "b", "1"),
     "query parameter :a has no value: give -p a VALUE (given: b)"),
    (("SELECT :a",), "query parameter :a has no value: give -p a VALUE"),
    (("SELECT :a, $b, :a", "-p", "c", "1"),
     "query parameters :a, :b have no value: give -p a VALUE -p b VALUE (given: c)"),
    (("SELECT ?",), "query parameters: ? and ?N cannot be given values; name them (:name) "
                    "and use -p NAME VALUE"),
    (("SELECT ?2", "-p", "2", "x"), "query parameters: ? and ?N cannot be given values; "
                                    "name them (:name) and use -p NAME VALUE"),
])
def test_missing_query_parameter_is_a_usage_error(fleet, args, err):
    path, _ = fleet
    r = query(path, *args)
    assert r.exit_code == 2, r.output
    assert r.stderr == f"Error: {path}: {err}\n" and r.stdout == ""


def test_query_parameters_given_still_bind(fleet):
    path, _ = fleet
    r = query(path, "SELECT :a AS a, $b AS b, @c AS c", "-p", "a", "1", "-p", "b", "x",
              "-p", "c", "y", "-p", "unused", "z", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"a": "1", "b": "x", "c": "y"}]
    # a write is refused as before, whatever its parameters
    r = query(path, "DELETE FROM nodes WHERE name = :n")
    assert r.exit_code == 1 and "statement refused" in r.stderr


def test_library_still_binds_a_sequence(fleet):
    from ingero_forensics.export.query import open_database, run_query
    path, _ = fleet
    with open_database(path) as db:
        assert list(run_query(db, "SELECT ? + 1", (41,)).rows) == [(42,)]
