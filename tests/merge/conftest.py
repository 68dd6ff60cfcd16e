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
