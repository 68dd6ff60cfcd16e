"""Straggler-window markers from ingero-report's analysis, on a simulated CPU fault."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ingero_forensics.export.chrome_trace import iso_utc
from ingero_forensics.export.cli import main
from ingero_forensics.report.analyze import CAUSE_TITLES, analyze_fleet

from .traceval import validate


def _cli(module, *args):
    code = f"import sys; from {module} import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def cpu_fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu")
    _cli("ingero_forensics.simulate.cli", "-o", d / "sim", "--nodes", 3, "--ranks-per-node", 2,
         "--steps", 60, "--fault", "cpu")
    _cli("ingero_forensics.merge.cli", d / "sim", "-o", d / "fleet.db")
    analysis = analyze_fleet(d / "fleet.db")
    assert analysis.straggler is not None and analysis.windows   # the premise of the tests
    return d / "fleet.db", analysis


def export(fleet_db, tmp_path, *args):
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, [str(fleet_db), "--chrome-trace", "-o", str(out), "-q",
                                  *map(str, args)])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_bytes())


def markers(doc):
    return [e for e in doc["traceEvents"] if e.get("cat") == "finding"]


def test_windows_marked_on_the_straggler_node(cpu_fleet, tmp_path):
    fleet_db, a = cpu_fleet
    doc = export(fleet_db, tmp_path)
    validate(doc)
    meta = doc["metadata"]
    origin = meta["origin_utc_ns"]
    pid = next(n["pid"] for n in meta["nodes"] if n["name"] == a.straggler)
    got = markers(doc)
    assert len(got) == len(a.windows)
    for e, w in zip(sorted(got, key=lambda e: e["ts"]), a.windows):
        assert e["ph"] == "X" and e["pid"] == pid
        assert e["name"] == f"straggler window: {CAUSE_TITLES[a.cause]}"
        assert round(e["ts"] * 1000) + origin == w.start_ns
        assert round(e["dur"] * 1000) == w.end_ns - w.start_ns
        assert e["args"]["late_ranks"] == a.late_ranks
        assert e["args"]["start_utc"] == iso_utc(w.start_ns)
    track = {(e["pid"], e["tid"]) for e in got}
    names = validate(doc)["names"]
    assert [names[(p, t, "thread_name")] for p, t in track] == ["ingero-report findings"]
    f = meta["findings"]
    assert (f["straggler"], f["straggler_pid"], f["late_ranks"], f["cause"]) == (
        a.straggler, pid, a.late_ranks, a.cause)
    assert [w["start_utc_ns"] for w in f["windows"]] == [w.start_ns for w in a.windows]
    assert f["verdict"] == a.verdict
    assert meta["counts"]["by_kind"]["findings"] == len(a.windows)


def test_a_slow_link_is_marked_as_one(tmp_path):
    """A slow link names the network as its cause, and nothing retransmitted: its
    windows say "slow network link" and which link, as the page and the text do."""
    _cli("ingero_forensics.simulate.cli", "-o", tmp_path / "sim", "--nodes", 4,
         "--ranks-per-node", 1, "--steps", 100, "--fault", "slowlink", "--seed", 3)
    _cli("ingero_forensics.merge.cli", tmp_path / "sim", "-o", tmp_path / "fleet.db")
    a = analyze_fleet(tmp_path / "fleet.db")
    assert a.link_suspect is not None and a.cause == "network", a.verdict
    got = markers(export(tmp_path / "fleet.db", tmp_path))
    assert got and {e["name"] for e in got} == {"straggler window: slow network link"}
    assert {tuple(e["args"]["link"]) for e in got} == {
        (a.link_suspect["from"], a.link_suspect["to"])}
    assert "retransmits" not in " ".join(e["name"] for e in got)


def test_no_findings_leaves_them_out(cpu_fleet, tmp_path):
    fleet_db, a = cpu_fleet
    with_, without = export(fleet_db, tmp_path), export(fleet_db, tmp_path, "--no-findings")
    assert markers(without) == [] and without["metadata"]["findings"] is None
    assert without["metadata"]["counts"]["events"] == (
        with_["metadata"]["counts"]["events"] - len(a.windows))


def test_markers_follow_the_selection(cpu_fleet, tmp_path):
    fleet_db, a = cpu_fleet
    others = [n for n in ("node-00", "node-01", "node-02") if n != a.straggler]
    doc = export(fleet_db, tmp_path, "--nodes", ",".join(others))
    assert markers(doc) == [] and doc["metadata"]["findings"]["straggler"] == a.straggler
    assert doc["metadata"]["findings"]["marked_windows"] == 0
    # a range inside the first window still shows it (overlap, not start, decides)
    w = a.windows[0]
    doc = export(fleet_db, tmp_path, "--from", iso_utc(w.start_ns + 1_000_000),
                 "--to", iso_utc(w.start_ns + 2_000_000), "--kinds", "host")
    assert len(markers(doc)) == 1


def test_max_events_counts_markers(cpu_fleet, tmp_path):
    fleet_db, a = cpu_fleet
    n = export(fleet_db, tmp_path)["metadata"]["counts"]["events"]
    out = tmp_path / "cap.json"
    r = CliRunner().invoke(main, [str(fleet_db), "--chrome-trace", "-o", str(out),
                                  "--max-events", str(n - 1)])
    assert r.exit_code != 0 and not out.exists()
    assert f"would hold {n} events" in r.output
    r = CliRunner().invoke(main, [str(fleet_db), "--chrome-trace", "-o", str(out),
                                  "--max-events", str(n - 1), "--no-findings"])
    assert r.exit_code == 0, r.output
