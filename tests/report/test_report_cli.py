"""ingero-report end to end: the HTML in a real browser, errors, JSON."""

import json
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from ingero_forensics.report.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]


def test_report_renders_in_chromium_without_scripts_or_network(fleets, tmp_path):
    db, truth = fleets("cpu")
    out = tmp_path / "report.html"
    r = CliRunner().invoke(main, [str(db), "-o", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    html = out.read_text()
    assert "<script" not in html.lower()
    # self-contained: no attribute loads anything (the SVG namespace is an identifier)
    assert not re.search(r'\b(src|href)\s*=', html)
    assert "@import" not in html and "url(" not in html
    if CHROMIUM is None:
        pytest.fail("chromium is not installed (scripts/test.sh installs it)")
    dom = subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                          "--dump-dom", out.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    text = re.sub(r"<[^>]+>", " ", dom)
    assert f"{truth['fault']['straggler']}" in text
    assert "is a straggler" in text and "Root cause: CPU contention" in text
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={tmp_path / 'profile2'}",
                    f"--screenshot={shot}", "--window-size=1000,1400", out.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.stat().st_size > 10_000   # a real rendering, not a blank page


def test_json_output(fleets, tmp_path):
    db, truth = fleets("memory")
    r = CliRunner().invoke(main, [str(db), "-o", str(tmp_path / "r.html"), "--json"])
    assert r.exit_code == 0
    data = json.loads(r.output)
    assert data["straggler"] == truth["fault"]["straggler"]
    assert data["cause"] == "memory"
    assert {s["cause"] for s in data["signals"]} == {"cpu", "io", "memory", "network", "gpu"}


def test_missing_file(tmp_path):
    out = tmp_path / "r.html"
    r = CliRunner().invoke(main, [str(tmp_path / "nope.db"), "-o", str(out)])
    assert r.exit_code == 1
    assert r.output == f"Error: {tmp_path / 'nope.db'}: no such file\n"
    assert not out.exists()


@pytest.mark.parametrize("content", [b"hello, not sqlite", b""])
def test_not_a_fleet_db(tmp_path, content):
    bad = tmp_path / "bad.db"
    bad.write_bytes(content)
    out = tmp_path / "r.html"
    r = CliRunner().invoke(main, [str(bad), "-o", str(out)])
    assert r.exit_code == 1
    assert r.output.startswith(f"Error: {bad}: not a" if content else
                               f"Error: {bad}: an empty file, not a fleet.db")
    assert r.output.count("\n") == 1 and "Traceback" not in r.output
    assert not out.exists()


def test_existing_report_untouched_on_error(tmp_path):
    out = tmp_path / "r.html"
    out.write_text("previous report")
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"x" * 100)
    r = CliRunner().invoke(main, [str(bad), "-o", str(out)])
    assert r.exit_code == 1
    assert out.read_text() == "previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.db", "r.html"]  # no temp left


def test_json_writes_only_json_and_text_fits_an_email(fleets, tmp_path, monkeypatch):
    db, truth = fleets("cpu")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, [str(db), "--json"], catch_exceptions=False)
    assert r.exit_code == 0
    assert json.loads(r.output)["straggler"] == truth["fault"]["straggler"]
    assert list(tmp_path.iterdir()) == []          # no report.html behind the user's back
    r = CliRunner().invoke(main, [str(db), "--format", "text"], catch_exceptions=False)
    assert r.exit_code == 0 and list(tmp_path.iterdir()) == []
    text = r.output
    flat = " ".join(text.split())
    assert truth["fault"]["straggler"] in text and "Root cause: CPU contention" in flat
    assert "Next step:" in flat and "others waited" in text
    # an email body: every line within 78 characters (test_next_commands: the commands)
    assert max(len(line) for line in text.splitlines()) <= 78
    # where the next commands run, and the evidence the verdict's next step rests on
    assert f"Runnable as they are in the directory of {db.name}." in flat
    a = json.loads(CliRunner().invoke(main, [str(db), "--json"]).output)
    for line in a["stragglers"][0]["evidence"]:
        assert " ".join(line.split()) in flat, line
    # the summary line says what "% of the run" is a share of
    assert re.search(r"collectives over [\d.]+ s of run \(what the shares of the run",
                     flat)
    r = CliRunner().invoke(main, [str(db), "--format", "markdown", "-o", "r.md"],
                           catch_exceptions=False)
    assert r.exit_code == 0 and (tmp_path / "r.md").read_text().startswith("# Straggler report")


def test_dash_output_is_stdout(fleets, tmp_path, monkeypatch):
    """-o - writes the report to stdout (as ingero-export's does), not to a file named
    '-'; with --json both would go there, which is refused."""
    db, truth = fleets("cpu")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, [str(db), "-o", "-"], catch_exceptions=False)
    assert r.exit_code == 0 and r.output.startswith("<!DOCTYPE html>")
    assert r.output.rstrip().endswith("</html>") and "Report written" not in r.output
    r = CliRunner().invoke(main, [str(db), "-o", "-", "--format", "text"],
                           catch_exceptions=False)
    assert r.exit_code == 0 and r.output.startswith("Straggler report: ")
    assert truth["fault"]["straggler"] in r.output
    r = CliRunner().invoke(main, [str(db), "-o", "-", "--json"])
    assert r.exit_code == 2 and "both would go to stdout" in r.output
    assert list(tmp_path.iterdir()) == []
