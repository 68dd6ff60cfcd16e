"""The next commands of the report run as they are, in the directory of the fleet.db: the
ingero-export line writes a trace of the straggler's window (or the stopped rank's last
seconds) on the nodes it names, and every ingero-query line returns rows."""

import gzip
import json
import shlex
import shutil
import subprocess

import pytest

from ingero_forensics.report import analyze_fleet

from .test_hangs import STOP_RANK, hung_fleet  # noqa: F401 (a fixture)


def run_commands(db, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(db, work / "fleet.db")
    a = analyze_fleet(work / "fleet.db")
    assert a.commands
    for c in a.commands:
        argv = shlex.split(c["command"])
        r = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (c["command"], r.stderr)
        if argv[0] == "ingero-export":
            out = work / argv[argv.index("-o") + 1]
            trace = json.loads(gzip.decompress(out.read_bytes()))
            names = {e["args"]["name"] for e in trace["traceEvents"]
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
            nodes = argv[argv.index("--nodes") + 1].split(",")
            assert all(any(n in p for p in names) for n in nodes), names
            assert sum(1 for e in trace["traceEvents"] if e.get("ph") == "X") > 10
        else:
            assert argv[0] == "ingero-query"
            assert len(r.stdout.strip().splitlines()) >= 3, (c["command"], r.stdout)
    return a


@pytest.mark.parametrize("fault", ["cpu", "network"])
def test_straggler_commands_run(fleets, tmp_path, fault):
    db, truth = fleets(fault)
    a = run_commands(db, tmp_path)
    straggler = truth["fault"]["straggler"]
    export = a.commands[0]["command"]
    assert export.startswith("ingero-export fleet.db --chrome-trace --from ")
    assert f"--nodes {straggler}," in export
    table = {"cpu": "sched_events", "network": "tcp_events"}[fault]
    assert any(table in c["command"] for c in a.commands)


def test_hang_commands_run(hung_fleet, tmp_path):  # noqa: F811
    a = run_commands(hung_fleet, tmp_path)
    assert f"hang-rank{STOP_RANK}" in a.commands[0]["command"]
    assert any("cuda_events" in c["command"] for c in a.commands)
