"""Fixtures for the export tests: a fleet.db on the real fleet schema and a real bundle."""

import pytest

from ingero_forensics.bundle import BundleWriter

from .fleetgen import build_fleet


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    path = tmp_path_factory.mktemp("fleet") / "fleet.db"
    truth = build_fleet(path)
    return path, truth


@pytest.fixture(scope="session")
def bundle_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("bundle")
    w = BundleWriter(d / "spool.db", node="node-07",
                     host={"hostname": "h7", "boot_id": "b7", "kernel_release": "6.1.0"},
                     capture_start=(1_736_000_000_000_000_000, 10 ** 9))
    for i in range(5):
        w.add("host_samples", (10 ** 9 + i * 10 ** 8, "cpu.busy_pct", None, 10.0 * i))
    w.log("warning", "capture", "warning", "something to see")
    return w.seal(d, capture_end=(1_736_000_001_000_000_000, 2 * 10 ** 9))
