"""Fixtures of the real-kernel rig: one set of namespaces for the whole module, each
scenario run (captured, merged and reported) once, on first use."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..capture.ebpf.conftest import ebpf_skip_reason
from .rig import Rig, RunResult, missing_tools

#: steps per scenario: about 6 s of job at 30-40 ms a step (twice that under tbf)
STEPS = 150
#: under the CPU hog a step takes about 250 ms: 45 of them are 11 s of job (45 time
#: bins), the node late at every one (150 would add 26 s to the rig's CI time for nothing
#: more to see); a step through the slow link takes about 65 ms: 50 of them are 3 s;
#: through the lossy one about 60 ms: 100 of them are 6 s, a few thousand retransmits;
#: the clean run, O_DIRECT reads, memory pressure and the slow GPU (26-45 ms a step) at
#: 100 steps are 3-5 s of job, 12-18 time bins, their stragglers late in most
STEPS_OF = {"cpu": 45, "slowlink": 50, "network": 100, "none": 100, "io": 100,
            "memory": 100, "gpu": 100}


@dataclass
class Outcome:
    run: RunResult
    fleet_db: Path
    report: dict


def merge_and_report(bundle_paths, out: Path) -> tuple[Path, dict]:
    """ingero-merge (full integrity check) then ingero-report --json, as a user would."""
    out.mkdir(parents=True, exist_ok=True)
    fleet = out / "fleet.db"
    subprocess.run(["ingero-merge", *map(str, bundle_paths), "-o", str(fleet),
                    "--integrity", "full", "--strict", "-q"], check=True)
    rep = subprocess.run(["ingero-report", str(fleet), "-o", str(out / "report.html"),
                          "--json", "-q"], check=True, capture_output=True, text=True)
    return fleet, json.loads(rep.stdout)


class Runs:
    def __init__(self, rig: Rig):
        self.rig = rig
        self._done: dict[str, Outcome] = {}

    def get(self, scenario: str) -> Outcome:
        if scenario not in self._done:
            run = self.rig.run_scenario(scenario, steps=STEPS_OF.get(scenario, STEPS))
            out = self.rig.workdir / f"merged-{scenario}"
            fleet, report = merge_and_report(run.all_bundles(), out)
            self._done[scenario] = Outcome(run, fleet, report)
        return self._done[scenario]


def scenario_runs(rig: Rig, steps: int, steps_of: dict | None = None,
                  slow_link_of: dict | None = None):
    """get(scenario) -> Outcome, each scenario run once on ``rig`` (``steps``, or
    ``steps_of[scenario]`` where it has one; with the queueing link of node
    ``slow_link_of[scenario]`` beside its fault where it has one), its captures started
    at normal priority (the idle-priority start is measured by bench_rig; this keeps the
    rig's CI time down), merged and reported."""
    done: dict[str, Outcome] = {}

    def get(scenario: str) -> Outcome:
        if scenario not in done:
            run = rig.run_scenario(scenario, steps=(steps_of or {}).get(scenario, steps),
                                   capture_args=("--start-priority", "normal"),
                                   slow_link=(slow_link_of or {}).get(scenario))
            fleet, report = merge_and_report(run.all_bundles(),
                                             rig.workdir / f"merged-{scenario}")
            done[scenario] = Outcome(run, fleet, report)
        return done[scenario]
    return get


def skip_without_rig() -> None:
    """pytest.skip unless this machine can run the rig (eBPF, root, iproute2)."""
    reason = ebpf_skip_reason()
    if reason:
        pytest.skip(reason)
    if os.geteuid() != 0:
        pytest.skip("the rig needs root (network namespaces, tc)")
    if missing_tools():
        pytest.skip(f"the rig needs {', '.join(missing_tools())} (apt install iproute2 util-linux)")


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    skip_without_rig()
    with Rig(tmp_path_factory.mktemp("rig")) as r:
        yield r


@pytest.fixture(scope="module")
def runs(rig):
    return Runs(rig)
