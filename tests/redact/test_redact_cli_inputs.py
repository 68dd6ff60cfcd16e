"""ingero-redact against what a new user types: an -o that is the input (however spelt),
a damaged fleet.db."""

import os
import shutil

import pytest
from click.testing import CliRunner

from ingero_forensics.cliutil import EXIT_USAGE
from ingero_forensics.redact import redact_fleet
from ingero_forensics.redact.cli import main
from ingero_forensics.redact.core import RedactError

from ..damage import corrupt, sha


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])



@pytest.fixture
def copy(sensitive_fleet, tmp_path):
    dest = tmp_path / "fleet.db"
    shutil.copyfile(sensitive_fleet, dest)
    return dest



def test_output_that_is_the_input_is_a_usage_error(copy, tmp_path):
    before = sha(copy)
    (tmp_path / "link.db").symlink_to(copy)
    os.link(copy, tmp_path / "hard.db")
    for out in (copy, tmp_path / "link.db", tmp_path / "hard.db"):
        r = run(copy, "-o", out)
        assert r.exit_code == 2, r.output
        assert r.stderr == f"Error: {out}: the output would replace the input; choose another -o\n"
        assert sha(copy) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db", "hard.db", "link.db"]
    # the library says so too, with an error the CLIs map to exit 2
    with pytest.raises(RedactError) as e:
        redact_fleet(copy, tmp_path / "hard.db")
    assert e.value.exit_code == EXIT_USAGE


def test_damaged_fleet_db_is_one_line_and_leaves_nothing(copy, tmp_path):
    corrupt(copy)
    out = tmp_path / "red.db"
    r = run(copy, "-o", out)
    assert r.exit_code == 1, r.output
    assert r.stderr == f"Error: {copy}: cannot read fleet.db (database disk image is malformed)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db"]   # no output, no copy
    # a previous output stays as it was
    out.write_text("previous")
    assert run(copy, "-o", out).exit_code == 1 and out.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db", "red.db"]


def test_nothing_unredacted_is_ever_written_beside_the_output(sensitive_fleet, tmp_path,
                                                                monkeypatch):
    """-o may name the medium that leaves the site: while the copy is being redacted
    (the moment a kill would leave it behind), the output's directory holds nothing,
    and the unredacted working copy sits beside the source."""
    import ingero_forensics.redact.core as core
    site, carrier = tmp_path / "site", tmp_path / "carrier"
    site.mkdir()
    carrier.mkdir()
    src = site / "fleet.db"
    shutil.copyfile(sensitive_fleet, src)
    seen = {}
    real = core._redact

    def spy(con, key):
        seen["carrier"] = sorted(os.listdir(carrier))
        seen["work"] = con.db_filename("main")
        return real(con, key)
    monkeypatch.setattr(core, "_redact", spy)
    r = run(src, "-o", carrier / "red.db")
    assert r.exit_code == 0, r.output
    assert seen["carrier"] == []
    assert os.path.dirname(os.path.dirname(seen["work"])) == str(site)
    assert sorted(os.listdir(carrier)) == ["red.db"] and sorted(os.listdir(site)) == ["fleet.db"]
    # --redact on report and export: the same
    from ingero_forensics.report.cli import main as report_main
    seen.clear()
    r = CliRunner().invoke(report_main, [str(src), "--redact", "-o", str(carrier / "r.html")])
    assert r.exit_code == 0, r.output
    assert seen["carrier"] == ["red.db"]
    assert sorted(os.listdir(site)) == ["fleet.db"]


@pytest.mark.parametrize("out", ["", "newdir/"])
def test_an_output_that_is_no_file_name_is_one_line(copy, tmp_path, monkeypatch, out):
    """An empty -o, or one ending in a slash (a directory not made yet), once became a
    traceback or a file named like the directory."""
    monkeypatch.chdir(tmp_path)
    r = run(copy, "-o", out)
    assert r.exit_code == 1, r.output
    assert "-o needs a file name, not a directory" in r.stderr and r.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db"]


def test_redact_option_with_a_missing_output_directory_is_one_line(copy, tmp_path):
    from ingero_forensics.export.cli import main as export_main
    from ingero_forensics.report.cli import main as report_main
    for cli, args in ((report_main, ["--redact", "-o", str(tmp_path / "no" / "r.html")]),
                      (export_main, ["--chrome-trace", "--redact",
                                     "-o", str(tmp_path / "no" / "t.json.gz")])):
        r = CliRunner().invoke(cli, [str(copy), *args])
        assert r.exit_code == 1, r.output
        assert r.stderr == (f"Error: {args[-1]}: directory {tmp_path / 'no'} does not "
                            "exist\n"), r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db"]


@pytest.fixture(scope="module")
def simulated_fleet(tmp_path_factory):
    """A simulated fleet.db of some megabytes (VACUUM INTO journals its target there)."""
    from ingero_forensics.merge import merge_bundles
    from ingero_forensics.simulate import FleetConfig, simulate_fleet
    d = tmp_path_factory.mktemp("simfleet")
    simulate_fleet(d, FleetConfig(nodes=4, ranks_per_node=2, steps=60, workers=1))
    merge_bundles(sorted(d.glob("*.bundle")), d / "fleet.db")
    return d / "fleet.db"


@pytest.mark.parametrize("share", [0.08, 0.3, 0.7])
def test_a_full_disk_is_one_error_line_and_leaves_nothing(simulated_fleet, tmpfs, share):
    """The output on a medium too small for it (the one that leaves the site, as a
    rule): one line naming it, exit 1, and no temporary file or its journal left."""
    small = tmpfs(f"{int(os.path.getsize(simulated_fleet) * share) // 4096 * 4096}")
    out = small / "r.db"
    r = run(simulated_fleet, "-o", out, "-q")
    assert r.exit_code == 1, r.output
    assert r.stderr == f"Error: {out}: file system full\n"
    assert list(small.iterdir()) == []


def test_evidence_is_never_replaced_an_earlier_redacted_copy_is(copy, sensitive_fleet, tmp_path):
    """-o naming a bundle or a fleet.db that is not redacted is refused before any work
    (exit 2, the file as it was); an earlier redacted copy is replaced, as a second run
    of the same command does; -o - is refused (a database file, not a stream)."""
    other = tmp_path / "other.db"
    shutil.copyfile(sensitive_fleet, other)
    before = sha(other)
    r = run(copy, "-o", other)
    assert r.exit_code == 2, r.output
    assert r.stderr == (f"Error: {other}: is a fleet.db that is not redacted; refusing to "
                        "replace it with a redacted copy (remove it first, or choose "
                        "another -o)\n")
    assert sha(other) == before
    out = tmp_path / "red.db"
    assert run(copy, "-o", out, "-q").exit_code == 0
    first = os.stat(out).st_ino
    r = run(copy, "-o", out, "-q")
    assert r.exit_code == 0, r.output
    assert os.stat(out).st_ino != first         # a new copy moved into its place
    r = run(copy, "-o", "-")
    assert r.exit_code == 2
    assert r.stderr.startswith("Error: -o -: the redacted copy is a database file")
    assert not os.path.exists("-")
