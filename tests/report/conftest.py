"""Fleets for report tests: real simulator bundles through the real merge."""

import json
import subprocess
import sys

import pytest

BIN = [sys.executable, "-m"]


def build_fleet(root, fault, *, seed=11, nodes=6, ranks=2, steps=120, extra=()):
    out = root / fault
    cmd = ["ingero-simulate", "-o", str(out / "bundles"), "--nodes", str(nodes),
           "--ranks-per-node", str(ranks), "--steps", str(steps), "--fault", fault,
           "--seed", str(seed), *extra]
    subprocess.run(cmd, check=True, capture_output=True)
    subprocess.run(["ingero-merge", str(out / "bundles"), "-o", str(out / "fleet.db"), "-q"],
                   check=True, capture_output=True)
    truth = json.loads((out / "bundles" / "truth.json").read_text())
    return out / "fleet.db", truth


@pytest.fixture(scope="session")
def fleets(tmp_path_factory):
    """fault kind -> (fleet.db path, truth); built once per test session, lazily."""
    root = tmp_path_factory.mktemp("report-fleets")
    cache = {}

    def get(fault, **kw):
        key = (fault, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = build_fleet(root / f"{len(cache)}", fault, **kw)
        return cache[key]

    return get
