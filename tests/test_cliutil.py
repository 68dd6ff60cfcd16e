"""cliutil: what every command does with a standard output it cannot write, and with an
-o that names evidence."""

import os
import shutil
import subprocess
import sys

import pytest

from ingero_forensics.cliutil import evidence_kind
from ingero_forensics.merge import merge_bundles
from ingero_forensics.simulate import FleetConfig, simulate_fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("cliutil")
    simulate_fleet(d / "b", FleetConfig(nodes=3, ranks_per_node=1, steps=20, workers=1))
    merge_bundles(sorted((d / "b").glob("*.bundle")), d / "fleet.db")
    return d


def _cli(name):
    return shutil.which(name, path=os.path.dirname(sys.executable)) or name


@pytest.mark.parametrize("argv", [
    ["ingero-query", "{db}", "SELECT * FROM nodes"],
    ["ingero-query", "{db}", "--json", "SELECT 1"],
    ["ingero-report", "{db}", "--json"],
    ["ingero-report", "{db}", "--format", "text", "-o", "-"],
    ["ingero-export", "{db}", "--chrome-trace", "-j", "1", "-o", "-"],
    ["ingero-merge", "--list", "{b}"],
])
def test_a_full_standard_output_is_one_error_line(fleet, argv):
    """`--json > /mnt/usb/out.json` onto a full transfer medium: one line, exit 1, no
    traceback (/dev/full fails every write with ENOSPC)."""
    args = [_cli(argv[0])] + [a.format(db=fleet / "fleet.db", b=fleet / "b") for a in argv[1:]]
    with open("/dev/full", "w") as full:
        p = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stderr == "Error: <stdout>: cannot write: No space left on device\n", p.stderr


@pytest.mark.parametrize("argv", [
    ["ingero-query", "{db}", "SELECT * FROM nodes"],
    ["ingero-report", "{db}", "--json"],
    ["ingero-merge", "--list", "{b}"],
])
def test_a_closed_standard_output_is_one_error_line(fleet, argv):
    """Started with standard output closed (`>&-`), a command that prints says so in one
    line; one that writes only its -o file is not disturbed."""
    args = [_cli(argv[0])] + [a.format(db=fleet / "fleet.db", b=fleet / "b") for a in argv[1:]]
    p = subprocess.run(args, stderr=subprocess.PIPE, text=True, timeout=120,
                       preexec_fn=lambda: os.close(1))
    assert p.returncode == 1, p.stderr
    assert p.stderr == "Error: <stdout>: cannot write: standard output is closed\n"


def test_an_output_file_needs_no_standard_output(fleet, tmp_path):
    p = subprocess.run([_cli("ingero-report"), str(fleet / "fleet.db"), "-o",
                        str(tmp_path / "r.html"), "-q"], stderr=subprocess.PIPE, text=True,
                       timeout=120, preexec_fn=lambda: os.close(1))
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert (tmp_path / "r.html").stat().st_size > 1000


@pytest.mark.parametrize("cmd", ["ingero-simulate", "ingero-redact", "ingero-merge",
                                 "ingero-capture"])
@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_onto_a_full_disk(cmd, flag):
    """What click prints itself, onto a full medium: the same one line."""
    with open("/dev/full", "w") as full:
        p = subprocess.run([_cli(cmd), flag], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stderr == "Error: <stdout>: cannot write: No space left on device\n"


def test_evidence_kind_reads_the_first_bytes(fleet, tmp_path):
    bundle = next((fleet / "b").glob("*.bundle"))
    assert evidence_kind(fleet / "fleet.db") == "a fleet.db"
    assert evidence_kind(bundle) == "a bundle"
    (tmp_path / "report.html").write_text("<html></html>")
    assert evidence_kind(tmp_path / "report.html") is None
    assert evidence_kind(tmp_path / "missing") is None
    assert evidence_kind(tmp_path) is None


@pytest.mark.parametrize("argv, what", [
    (["ingero-report", "{db}", "-o", "{out}"], "a report"),
    (["ingero-report", "{db}", "--format", "text", "-o", "{out}"], "a report"),
    (["ingero-export", "{db}", "--chrome-trace", "-o", "{out}"], "a trace"),
])
@pytest.mark.parametrize("victim", ["fleet.db", "bundle"])
def test_report_and_export_never_replace_evidence(fleet, tmp_path, argv, what, victim):
    """An -o that names another fleet.db or a bundle (a slip of the shell's history) is
    refused before any work, and the file is left as it was; other files are replaced."""
    src = fleet / "fleet.db" if victim == "fleet.db" else next((fleet / "b").glob("*.bundle"))
    out = tmp_path / ("old.db" if victim == "fleet.db" else "n.bundle")
    shutil.copyfile(src, out)
    before = out.read_bytes()
    args = [_cli(argv[0])] + [a.format(db=fleet / "fleet.db", out=out) for a in argv[1:]]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    kind = "a fleet.db" if victim == "fleet.db" else "a bundle"
    assert p.stderr == (f"Error: {out}: is {kind}; refusing to replace it with {what} "
                        "(remove it first, or choose another -o)\n")
    assert out.read_bytes() == before
    other = tmp_path / "earlier-output"
    other.write_text("an earlier report or trace")
    args = [a if a != str(out) else str(other) for a in args]
    assert subprocess.run(args, capture_output=True, timeout=120).returncode == 0
    assert other.read_bytes() != b"an earlier report or trace"
