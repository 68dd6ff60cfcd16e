import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from .fleetgen import make_fleet  # noqa: E402

from ingero_forensics.merge import merge_bundles  # noqa: E402


@pytest.fixture(scope="session")
def fleet4(tmp_path_factory):
    """4 nodes x 2 ranks, 20 s, rank 3 late every 10th step, NTP steps; merged."""
    d = tmp_path_factory.mktemp("fleet4")
    fleet = make_fleet(d / "bundles", nodes=4, seconds=20, straggler_rank=3, seed=11)
    res = merge_bundles(fleet.paths, d / "fleet.db")
    return fleet, res, d / "fleet.db"


@pytest.fixture(scope="session")
def built_accel():
    """built_accel(module, entry): a C accelerator, loaded. CI builds them (scripts/test.sh
    installs gcc and the SQLite headers): there a missing one fails; elsewhere the test
    skips (no compiler at install time)."""
    from ingero_forensics import accel

    def load(module, entry):
        mod = accel.load(module, entry)
        if mod is None:
            assert not os.environ.get("CI"), f"{module} is not built"
            pytest.skip("the C accelerator is not built (no compiler at install time)")
        return mod
    return load


