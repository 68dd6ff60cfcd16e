"""Every command that reads a fleet.db says the same thing about a file that is not one."""

import apsw
import pytest
from click.testing import CliRunner

from .merge.fleetgen import make_fleet
from ingero_forensics.export.cli import main as export_cli
from ingero_forensics.fleetfile import check_fleet_file
from ingero_forensics.merge import merge_bundles
from ingero_forensics.redact.cli import main as redact_cli
from ingero_forensics.report.cli import main as report_cli


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleetfile")
    fleet = make_fleet(d / "b", nodes=2, seconds=2, seed=61)
    merge_bundles(fleet.paths, d / "fleet.db")
    (d / "empty.db").write_bytes(b"")
    (d / "text.db").write_text("node-00,node-01\n")
    con = apsw.Connection(str(d / "other.db"))
    con.execute("CREATE TABLE t (a)")
    con.close()
    newer = d / "newer.db"
    newer.write_bytes((d / "fleet.db").read_bytes())
    con = apsw.Connection(str(newer))
    con.execute("PRAGMA user_version = 999")
    con.close()
    # a fleet.db whose schema page is damaged (the header still says fleet.db): every
    # statement fails to prepare, the first one too
    schema = d / "schema.db"
    data = bytearray((d / "fleet.db").read_bytes())
    page = int.from_bytes(data[16:18], "big") or 65536
    data[page - 3000:page] = b"\xff" * 3000
    schema.write_bytes(bytes(data))
    return {"fleet": d / "fleet.db", "empty": d / "empty.db", "text": d / "text.db",
            "other": d / "other.db", "bundle": fleet.paths[0], "newer": newer,
            "missing": d / "missing.db", "directory": d / "b", "schema": schema}


WANT = {
    "empty": "an empty file, not a fleet.db; merge first",
    "text": "not a fleet.db (not a SQLite database); merge first",
    "other": "not a fleet.db (a SQLite database with application_id 0x0, not ingero-merge's)",
    "bundle": "is a bundle, not a fleet.db: merge first (ingero-merge BUNDLES -o fleet.db)",
    "newer": "fleet.db version 999 is newer than this tool supports",
    "missing": "no such file",
    "schema": "cannot read fleet.db (database disk image is malformed)",
}


@pytest.mark.parametrize("kind", sorted(WANT))
def test_report_export_and_redact_say_the_same(inputs, kind, tmp_path):
    path = inputs[kind]
    runs = {
        "report": CliRunner().invoke(report_cli, [str(path), "-o", str(tmp_path / "r.html")]),
        "export": CliRunner().invoke(export_cli, [str(path), "--chrome-trace",
                                                  "-o", str(tmp_path / "t.json")]),
        "redact": CliRunner().invoke(redact_cli, [str(path), "-o", str(tmp_path / "x.db")]),
    }
    lines = {name: r.stderr for name, r in runs.items()}
    assert all(r.exit_code == 1 for r in runs.values()), lines
    assert len(set(lines.values())) == 1, lines
    line = lines["report"]
    assert line.startswith(f"Error: {path}: {WANT[kind]}") and line.count("\n") == 1, line
    assert list(tmp_path.iterdir()) == []


def test_a_directory_is_a_usage_error_everywhere(inputs, tmp_path):
    d = str(inputs["directory"])
    for cli, args in ((report_cli, [d]), (export_cli, [d, "--chrome-trace"]),
                      (redact_cli, [d, "-o", str(tmp_path / "x.db")])):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2 and "is a directory" in r.stderr, r.output
    with pytest.raises(Exception, match="Is a directory"):
        check_fleet_file(inputs["directory"])


def test_a_fleet_db_passes_and_gives_its_version(inputs):
    from ingero_forensics.merge.fleet_schema import FLEET_VERSION
    assert check_fleet_file(inputs["fleet"]) == FLEET_VERSION


def test_the_caller_chooses_the_error_class(inputs):
    from ingero_forensics.export.options import ExportError
    with pytest.raises(ExportError, match="an empty file"):
        check_fleet_file(inputs["empty"], ExportError)
