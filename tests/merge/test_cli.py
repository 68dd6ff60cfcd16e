import json

import apsw
from click.testing import CliRunner

from .fleetgen import make_fleet
from ingero_forensics import __version__
from ingero_forensics.merge.cli import main


def test_help_and_version():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "Example:" in r.output and "Exit codes" in r.output
    r = CliRunner().invoke(main, ["--version"])
    assert r.output == f"ingero-merge {__version__}\n"


def test_merge_summary_and_json(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=51)
    r = CliRunner().invoke(main, [str(tmp_path / "b"), "-o", str(tmp_path / "f.db")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "2 bundles merged" in r.output and "node-1" in r.output
    r = CliRunner().invoke(main, [*map(str, fleet.paths), "-o", str(tmp_path / "f.db"),
                                  "--json"], catch_exceptions=False)
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["bundles_already"] == 2 and doc["bundles_merged"] == 0


def test_every_row_count_agrees(tmp_path):
    """--list, the node table, merge_log and the total count the same rows (every table
    but meta and stacks), and "rows written" lists the stacks fleet.db gained, not the
    bundles' copies of them."""
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=3, seed=52)
    listed = CliRunner().invoke(main, ["--list", *map(str, fleet.paths)])
    per_input = {line.split(": ", 1)[0]: int(line.split(" rows,")[0].rsplit(" ", 1)[1])
                 for line in listed.output.splitlines()}
    db = tmp_path / "f.db"
    r = CliRunner().invoke(main, [*map(str, fleet.paths), "-o", str(db), "--json"])
    doc = json.loads(r.stdout)
    con = apsw.Connection(str(db))
    logged = dict(con.execute("SELECT input, count FROM merge_log WHERE event = 'merged'"))
    stacks = con.execute("SELECT COUNT(*) FROM stacks").fetchone()[0]
    con.close()
    assert logged == per_input
    per_node = [sum(v for t, v in n["rows"].items() if t not in ("meta", "stacks"))
                for n in doc["nodes"]]
    assert sorted(per_node) == sorted(per_input.values())
    assert doc["events"] == sum(per_node)
    assert doc["rows"]["stacks"] == stacks < sum(n["rows"]["stacks"] for n in doc["nodes"])
    text = CliRunner().invoke(main, [*map(str, fleet.paths), "-o", str(tmp_path / "g.db")])
    assert f"; {doc['events']} rows in " in text.output
    assert all(f" {v} " in text.output for v in per_node)
    assert f"stacks {stacks}," in text.output.split("rows written: ")[1]


def test_summary_says_when_the_accelerators_are_not_used(tmp_path, monkeypatch):
    """A node image with a compiler but no SQLite headers once skipped the accelerators
    without a word, and its merge ran twice as slow: the summary now says so."""
    from ingero_forensics import accel
    make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=53)
    monkeypatch.delenv("INGERO_NO_ACCEL", raising=False)
    built = accel.load("merge._fastcoll", "sqlite3_fastcoll_init") is not None
    expected = {}
    for off in (False, True):
        if off:
            monkeypatch.setenv("INGERO_NO_ACCEL", "1")
        else:
            monkeypatch.delenv("INGERO_NO_ACCEL", raising=False)
        r = CliRunner().invoke(main, [str(tmp_path / "b"), "-o", str(tmp_path / f"{off}.db")],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        expected[off] = r.output
    assert ("C accelerators are not built (or do not load)" in expected[False]) == (not built)
    assert "C accelerators are off (INGERO_NO_ACCEL): this was the pure-Python path" \
        in expected[True]


def test_bad_input_exit_3_with_error_line(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=1, seconds=3, seed=52)
    bad = tmp_path / "x.bundle"
    bad.write_bytes(b"garbage!" * 4)
    r = CliRunner().invoke(main, [str(bad), str(fleet.paths[0]), "-o", str(tmp_path / "f.db"),
                                  "-q"])
    assert r.exit_code == 3
    assert r.stderr == f"Error: {bad}: not an ingero bundle (wrong magic bytes) (skipped)\n"
    con = apsw.Connection(str(tmp_path / "f.db"))
    assert con.execute("SELECT COUNT(*) FROM nodes").fetchone()[0] == 1


def test_nothing_usable_is_an_error(tmp_path):
    r = CliRunner().invoke(main, [str(tmp_path / "nope.bundle"), "-o", str(tmp_path / "f.db")])
    assert r.exit_code == 1
    assert r.stderr == (f"Error: {tmp_path / 'f.db'}: no usable bundle among the 1 input "
                        f"({tmp_path / 'nope.bundle'}: no such file or directory); nothing "
                        "was written\n")
    assert not (tmp_path / "f.db").exists()
    # more than three: three reasons, and how many more
    bad = [tmp_path / f"nope{k}.bundle" for k in range(5)]
    r = CliRunner().invoke(main, [*map(str, bad), "-o", str(tmp_path / "f.db")])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1
    assert "among the 5 inputs" in r.stderr and "; and 2 more); nothing was written" in r.stderr


def test_strict_error_line(tmp_path):
    bad = tmp_path / "x.bundle"
    bad.write_bytes(b"\x00" * 10)
    r = CliRunner().invoke(main, [str(bad), "-o", str(tmp_path / "f.db"), "--strict"])
    assert r.exit_code == 1
    assert r.stderr == (f"Error: {bad}: not an ingero bundle (wrong magic bytes) "
                        "(--strict: nothing was written)\n")
    assert not (tmp_path / "f.db").exists()


def test_output_required():
    r = CliRunner().invoke(main, ["a.bundle"])
    assert r.exit_code == 2 and "-o/--output is required" in r.output


def test_list(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=53)
    r = CliRunner().invoke(main, ["--list", str(tmp_path / "b")], catch_exceptions=False)
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "node node-0 host host-0 segment 0" in lines[0]
    r = CliRunner().invoke(main, ["--list", "--json", str(fleet.paths[1])])
    items = json.loads(r.stdout)
    assert items[0]["manifest"]["node"] == "node-1"


def test_list_with_a_bad_input_exits_3(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=53)
    bad = tmp_path / "b" / "zz-bad.bundle"
    bad.write_bytes(b"junk")
    for extra in ([], ["--json"], ["-q"]):
        r = CliRunner().invoke(main, ["--list", *extra, str(tmp_path / "b")])
        assert r.exit_code == 3, (extra, r.output)
        assert r.stderr == f"Error: {bad}: truncated: file is shorter than a bundle header\n"
    r = CliRunner().invoke(main, ["--list", str(fleet.paths[0]), str(tmp_path / "none.bundle")])
    assert r.exit_code == 3 and "none.bundle: ERROR no such file or directory" in r.stdout
    assert "exit 3 if any input is not a readable bundle" in " ".join(
        CliRunner().invoke(main, ["--help"]).stdout.split())


def test_output_that_is_an_input_is_refused(tmp_path):
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=54)
    target = fleet.paths[1]
    before = target.read_bytes()
    for inputs in ([str(tmp_path / "b")], [str(fleet.paths[0]), str(target)]):
        r = CliRunner().invoke(main, [*inputs, "-o", str(target)])
        assert r.exit_code == 2, r.output
        assert r.stderr == (f"Error: {target}: the output would replace an input ({target}); "
                            "choose another -o\n")
        assert target.read_bytes() == before
    r = CliRunner().invoke(main, [str(target), "-o", str(target)])
    assert r.exit_code == 2
    assert r.stderr == f"Error: {target}: the output would replace the input; choose another -o\n"
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(
        p.name for p in fleet.paths)


def test_output_dash_is_refused(tmp_path):
    """-o - is standard output elsewhere; fleet.db is a database file, never a file
    named "-"."""
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=55)
    r = CliRunner().invoke(main, [str(tmp_path / "b"), "-o", "-"])
    assert r.exit_code == 2, r.output
    assert r.stderr == ("Error: -o -: fleet.db is a database file, not a stream; give it a "
                        "file name (-o fleet.db)\n")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(
        p.name for p in fleet.paths)
    assert not (tmp_path / "-").exists()


def test_an_empty_output_file_becomes_the_fleet_db(tmp_path):
    """An empty file (as `mktemp` leaves one) holds nothing to keep: a new fleet.db is
    made there, as for a path that does not exist. A file with anything in it that is
    not a fleet.db is still refused."""
    fleet = make_fleet(tmp_path / "b", nodes=2, seconds=3, seed=56)
    out = tmp_path / "tmp.XXXX"
    out.write_bytes(b"")
    r = CliRunner().invoke(main, [*map(str, fleet.paths), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["bundles_merged"] == 2
    con = apsw.Connection(str(out), flags=apsw.SQLITE_OPEN_READONLY)
    assert con.execute("SELECT COUNT(*) FROM nodes").fetchone()[0] == 2
    con.close()
    text = tmp_path / "notes.txt"
    text.write_text("x")
    r = CliRunner().invoke(main, [*map(str, fleet.paths), "-o", str(text)])
    assert r.exit_code == 1 and text.read_text() == "x", r.output
