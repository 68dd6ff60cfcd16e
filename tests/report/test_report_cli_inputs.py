"""ingero-report against what a new user types: an -o that is the input, a damaged
fleet.db, --json together with -o or --format."""

import json
import shlex
import shutil

import pytest
from click.testing import CliRunner

from ingero_forensics.export.query_cli import main as query_main
from ingero_forensics.redact.cli import main as redact_main
from ingero_forensics.report.cli import main

from ..damage import corrupt, sha


def run(*args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


@pytest.fixture
def copy(fleets, tmp_path):
    """A private copy of a simulated fleet.db (old code overwrote the input)."""
    dest = tmp_path / "fleet.db"
    shutil.copyfile(fleets("cpu")[0], dest)
    return dest


@pytest.mark.parametrize("extra", [(), ("--format", "text"), ("--format", "markdown"),
                                   ("--json",), ("--redact",)])
def test_output_that_is_the_input_is_refused(copy, tmp_path, extra):
    before = sha(copy)
    link = tmp_path / "link.db"
    link.symlink_to(copy)
    for out in (copy, link):
        r = run(copy, "-o", out, *extra)
        assert r.exit_code == 2, (out, r.output)
        assert r.stderr == f"Error: {out}: the output would replace the input; choose another -o\n"
        assert r.stdout == ""
        assert sha(copy) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db", "link.db"]


def test_default_output_that_is_the_input_is_refused(copy, tmp_path, monkeypatch):
    page = tmp_path / "report.html"          # a fleet.db named as the default page
    copy.rename(page)
    monkeypatch.chdir(tmp_path)
    before = sha(page)
    r = run("report.html")
    assert r.exit_code == 2 and "the output would replace the input" in r.stderr
    assert sha(page) == before


@pytest.mark.parametrize("extra", [("--format", "text"), ("-o", "r.html"), ("--json",),
                                   ("--redact", "--format", "text")])
def test_damaged_fleet_db_is_one_line_and_leaves_nothing(copy, tmp_path, monkeypatch, extra):
    corrupt(copy)
    monkeypatch.chdir(tmp_path)
    r = run(copy, *extra)
    assert r.exit_code == 1, r.output
    assert r.stderr == f"Error: {copy}: cannot read fleet.db (database disk image is malformed)\n"
    assert r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db"]   # no output, no temp


def test_json_goes_to_stdout_and_o_takes_the_report(copy, tmp_path):
    # -o named .json would get the page: refused, with what to type instead
    out = tmp_path / "r.json"
    for extra in (("--json",), (), ("--format", "text", "--json")):
        r = run(copy, "-o", out, *extra)
        assert r.exit_code == 2, (extra, r.output)
        assert r.stderr.startswith(f"Error: {out}: -o writes the ")
        assert f"--json > {out}" in r.stderr and r.stderr.count("\n") == 1
        assert not out.exists()
    # a --format with --json and no -o: both would be on stdout; refused
    for fmt in ("text", "markdown", "html"):
        r = run(copy, "--format", fmt, "--json")
        assert r.exit_code == 2, r.output
        assert r.stderr == (f"Error: --format {fmt} with --json and no -o: --json prints only "
                            f"the analysis on stdout; give the {fmt} report a file with -o\n")
    # with -o, the file gets the --format and stdout the JSON
    txt = tmp_path / "r.txt"
    r = run(copy, "--format", "text", "--json", "-o", txt)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["straggler"]
    assert txt.read_text().startswith("Straggler report")
    html = tmp_path / "r.html"
    r = run(copy, "--json", "-o", html)
    assert r.exit_code == 0 and json.loads(r.stdout)["straggler"]
    assert html.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("fmt", ["html", "markdown", "text"])
def test_a_redacted_report_does_not_name_its_input(fleets, tmp_path, fmt):
    """The path the operator typed may hold a user's or a host's name; a --redact page
    leaves the site, so neither the path nor the file's name is on it."""
    where = tmp_path / "home" / "alice" / "gpu-17-incident"
    where.mkdir(parents=True)
    src = where / "gpu-17-fleet.db"
    shutil.copyfile(fleets("cpu")[0], src)
    out = tmp_path / ("r.html" if fmt == "html" else "r.txt")
    r = run(src, "--redact", "--format", fmt, "-o", out)
    assert r.exit_code == 0, r.output
    page = out.read_text()
    for secret in ("alice", "gpu-17", str(tmp_path)):
        assert secret not in page, (secret, fmt)
    assert "ingero-redact FLEET_DB -o" in page


def test_redacted_report_says_how_to_make_the_copy_its_commands_read(copy, tmp_path,
                                                                     monkeypatch):
    """With --redact the next commands read a redacted copy that is gone with the run:
    the first command makes it, and the commands after it then run as they are."""
    monkeypatch.chdir(tmp_path)
    r = run(copy, "--redact", "--json")
    assert r.exit_code == 0, r.output
    cmds = [c["command"] for c in json.loads(r.stdout)["commands"]]
    make = shlex.split(cmds[0])
    assert make[0] == "ingero-redact" and make[1] == "FLEET_DB", cmds[0]
    made = CliRunner().invoke(redact_main, [str(copy)] + make[2:])
    assert made.exit_code == 0, made.output
    queries = [shlex.split(c) for c in cmds[1:] if c.startswith("ingero-query ")]
    assert queries and all(q[1] == make[-1] for q in queries)
    for q in queries:
        out = CliRunner().invoke(query_main, q[1:])
        assert out.exit_code == 0 and out.stdout.strip(), (q, out.output)
