"""ingero-simulate's command line: results, --json, and one-line usage errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ingero_forensics.demo import main as demo_main
from ingero_forensics.simulate.cli import main

BASE = ["--nodes", "3", "--ranks-per-node", "2", "--steps", "20", "--workers", "1"]


def run(args):
    return CliRunner().invoke(main, args)


def test_writes_bundles_and_truth(tmp_path):
    res = run(["-o", str(tmp_path / "f"), *BASE, "--fault", "io", "--straggler", "node-01",
               "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert len(out["bundles"]) == 3 and out["fault"]["straggler"] == "node-01"
    # events: every table but meta and stacks (not events), as ingero-merge counts them
    assert out["events"] == sum(n for t, n in out["rows"].items()
                                if t not in ("meta", "stacks")) > 0
    assert out["rows"]["stacks"] > 0
    truth = json.loads((tmp_path / "f" / "truth.json").read_text())
    assert truth["fault"]["kind"] == "io" and truth["parameters"]["steps"] == 20
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == \
        sorted([n["bundle"] for n in truth["nodes"]] + ["truth.json"])


def test_straggler_by_index_and_summary_line(tmp_path):
    res = run(["-o", str(tmp_path / "f"), *BASE, "--fault", "cpu", "--straggler", "2"])
    assert res.exit_code == 0, res.output
    assert "fault cpu on node-02 (ranks 4..5)" in res.output


@pytest.mark.parametrize("args, message", [
    (["--fault", "disk"], "Error: Invalid value for '--fault': unknown fault 'disk' "
                          "(choose from none, cpu, io, network, gpu, memory, slowlink)"),
    (["--fault", "cpu", "--straggler", "node-07"], "Error: Invalid value for '--straggler': node-07 is "
                                 "outside the fleet (node-00 .. node-02)"),
    (["--fault", "cpu", "--straggler", "3"], "Error: Invalid value for '--straggler': 3 is outside the "
                           "fleet (node-00 .. node-02)"),
    (["--fault", "cpu", "--straggler", "gpu7"], "Error: Invalid value for '--straggler': 'gpu7' is not a "
                              "node name (node-03) or index"),
    (["--nodes", "0"], "Error: Invalid value for '--nodes': must be at least 1, got 0"),
    (["--steps", "0"], "Error: Invalid value for '--steps': must be at least 1, got 0"),
    (["--fault", "cpu", "--fault-window", "15:10"],
     "Error: Invalid value for '--fault-window': 15:10 is not a step range inside 0:20 "
     "with START < END"),
    (["--fault", "cpu", "--fault-window", "5:40"],
     "Error: Invalid value for '--fault-window': 5:40 is not a step range inside 0:20 "
     "with START < END"),
    (["--fault", "cpu", "--fault-window", "abc"],
     "Error: Invalid value for '--fault-window': 'abc' is not START:END (step numbers, "
     "e.g. 100:300)"),
    (["--fault", "cpu", "--fault-window", "2:10", "--fault-window", "8:12"],
     "Error: Invalid value for '--fault-window': windows overlap"),
    (["--straggler", "1"], "Error: Invalid value for '--straggler': a straggler needs a "
                           "fault (--fault cpu|io|network|gpu|memory|slowlink)"),
    (["--fault-window", "2:5"], "Error: Invalid value for '--fault-window': fault windows "
                                "need a fault (--fault cpu|io|network|gpu|memory|slowlink)"),
    (["--ranks-per-node", "0"], "Error: Invalid value for '--ranks-per-node': must be "
                                "between 1 and 16, got 0"),
])
def test_bad_arguments(tmp_path, args, message):
    out = tmp_path / "f"
    base = [a for a in BASE]
    res = run(["-o", str(out), *base, *args])
    assert res.exit_code == 2
    assert res.output.rstrip().splitlines()[-1] == message
    assert not out.exists()  # nothing written


def test_network_needs_two_nodes(tmp_path):
    res = run(["-o", str(tmp_path / "f"), "--nodes", "1", "--steps", "5", "--fault", "network"])
    assert res.exit_code == 2
    assert res.output.splitlines()[-1] == ("Error: Invalid value for '--fault': network "
                                           "needs at least 2 nodes (the straggler's ring "
                                           "neighbours)")


def test_slowlink_needs_three_nodes(tmp_path):
    res = run(["-o", str(tmp_path / "f"), "--nodes", "2", "--steps", "5", "--fault",
               "slowlink"])
    assert res.exit_code == 2
    assert res.output.splitlines()[-1] == ("Error: Invalid value for '--fault': slowlink "
                                           "needs at least 3 nodes (a link slower than the "
                                           "job's other links)")
    assert not (tmp_path / "f").exists()


def test_refuses_to_mix_fleets(tmp_path):
    out = tmp_path / "f"
    assert run(["-o", str(out), *BASE, "-q"]).exit_code == 0
    before = sorted(p.name for p in out.iterdir())
    res = run(["-o", str(out), *BASE, "--seed", "9"])
    assert res.exit_code == 1
    assert res.output.splitlines()[-1].startswith(f"Error: {out}: already holds a fleet (")
    assert sorted(p.name for p in out.iterdir()) == before
    res = run(["-o", str(out), *BASE, "--seed", "9", "--force", "-q"])
    assert res.exit_code == 0 and res.output == ""
    assert json.loads((out / "truth.json").read_text())["seed"] == 9
    assert len(list(out.glob("*.bundle"))) == 3


def test_out_is_a_file(tmp_path):
    p = tmp_path / "file"
    p.write_text("x")
    res = run(["-o", str(p), *BASE])
    assert res.exit_code == 2 and "is a file" in res.output


def test_help_and_version():
    res = run(["--help"])
    assert res.exit_code == 0
    assert "Example:" in res.output and "ingero-simulate -o fleet/" in res.output
    assert "Exit codes:" in res.output
    res = run(["--version"])
    assert res.exit_code == 0 and res.output.startswith("ingero-simulate ")


def test_demo_runs_steps_and_prints_outputs(tmp_path, monkeypatch):
    import ingero_forensics.demo as demo
    from ingero_forensics.simulate import FleetConfig
    small = FleetConfig(nodes=3, ranks_per_node=2, steps=30, fault="cpu", straggler=2,
                        fault_windows=((5, 20),), ntp_step=True, workers=1)
    monkeypatch.setattr(demo, "DEMO_CONFIG", small)
    res = CliRunner().invoke(demo_main, ["-o", str(tmp_path / "d"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    truth = json.loads(open(out["ground truth"]).read())
    assert truth["fault"]["straggler"] == "node-02" and truth["parameters"]["nodes"] == 3
    assert len(list((tmp_path / "d" / "fleet").glob("*.bundle"))) == 3
    assert demo.DEMO_CONFIG.nodes == 3 and demo.STEPS[0][0] == "simulate"
    # the next thing a first-time user types: where the commands are, where to run the
    # report's next commands (a review: "ingero-report: command not found", then
    # "fleet.db: no such file" from the clone's root)
    res = CliRunner().invoke(demo_main, ["-o", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    tail = res.stdout.splitlines()[-2:]
    assert tail[0].startswith("Next: the ingero-* commands are in ") and "activate" in tail[0]
    assert tail[1].strip() == f"cd {tmp_path / 'd'} && ingero-report fleet.db --format text"
    assert CliRunner().invoke(demo_main, ["-h"]).exit_code == 0


def test_demo_refuses_a_directory_that_holds_no_earlier_demo(tmp_path, monkeypatch):
    """An SRE's own fleet.db and bundles are never replaced by the demo without --force;
    an earlier demo's directory is reused as the help says."""
    import ingero_forensics.demo as demo
    from ingero_forensics.simulate import FleetConfig
    monkeypatch.setattr(demo, "DEMO_CONFIG", FleetConfig(nodes=2, ranks_per_node=1, steps=20,
                                                         fault="cpu", straggler=1, workers=1))
    mine = tmp_path / "work"
    (mine / "fleet").mkdir(parents=True)
    (mine / "fleet.db").write_bytes(b"the user's own fleet.db")
    (mine / "fleet" / "gpu-99+20250101T000000Z+000000.bundle").write_bytes(b"theirs")
    res = CliRunner().invoke(demo_main, ["-o", str(mine), "-q"])
    assert res.exit_code == 1, res.output
    assert "holds no earlier demo" in res.output and "--force" in res.output
    assert res.output.count("\n") == 1 and "Traceback" not in res.output
    assert (mine / "fleet.db").read_bytes() == b"the user's own fleet.db"
    assert (mine / "fleet" / "gpu-99+20250101T000000Z+000000.bundle").exists()
    # a directory of its own: run, then run again over it without --force
    own = tmp_path / "demo"
    for _ in range(2):
        res = CliRunner().invoke(demo_main, ["-o", str(own), "-q"])
        assert res.exit_code == 0, res.output
    assert len(list((own / "fleet").glob("*.bundle"))) == 2
    res = CliRunner().invoke(demo_main, ["-o", str(mine), "-q", "--force"])
    assert res.exit_code == 0, res.output
    assert (mine / "fleet.db").read_bytes() != b"the user's own fleet.db"


def test_demo_config_is_the_documented_fleet():
    from ingero_forensics.demo import DEMO_CONFIG
    cfg = DEMO_CONFIG.validated()
    assert (cfg.nodes, cfg.fault, cfg.straggler) == (8, "cpu", 5)


def test_failure_leaves_nothing_half_written(tmp_path, monkeypatch):
    import ingero_forensics.simulate.fleet as fleet
    from ingero_forensics.errors import DiskFullError

    real = fleet.generate_node

    def failing(task):
        if task[4] == 2:
            raise DiskFullError(f"{task[5]}/node-02.live.db: file system full")
        return real(task)

    monkeypatch.setattr(fleet, "generate_node", failing)
    out = tmp_path / "f"
    res = run(["-o", str(out), *BASE])
    assert res.exit_code == 1
    line = res.output.splitlines()[-1]
    assert line.startswith("Error: ") and line.endswith("node-02.live.db: file system full")
    assert list(out.iterdir()) == []  # no bundle, no truth.json, no staging directory
