"""host_bins (merge/summaries.py) hold what host_samples hold, summed per node, metric,
device and report bin; job_block_io and sync_waits the rows of block_events and
cuda_events the report reads, in its order: checked against the raw rows of simulated
fleets, fresh and after bundles are added to a fleet.db."""

import json
import math
from collections import defaultdict

import pytest

from ingero_forensics.db import connect_readonly
from ingero_forensics.merge import merge_bundles
from ingero_forensics.merge.fleet_schema import FLEET_VERSION
from ingero_forensics.merge.summaries import (HOST_BIN_METRICS, JOB_BLOCK, SYNC_WAIT_APIS,
                                              default_bin_s)
from ingero_forensics.simulate import FleetConfig, simulate_fleet


def raw_bins(con, t0, bin_ns):
    """The summary recomputed in Python from host_samples, with the documented bins."""
    out = defaultdict(lambda: [0, [], 0, math.inf, -math.inf])
    for metric, nid, dev, ts, v in con.execute(
            "SELECT metric, node_id, device, timestamp_ns, value FROM host_samples"):
        if metric not in HOST_BIN_METRICS or (dev is not None and metric.startswith("cpu.")):
            continue
        b = (ts - t0) // bin_ns if ts >= t0 else -1 - (t0 - ts) // bin_ns
        acc = out[(metric, nid, dev, b)]
        acc[0] += 1
        acc[1].append(v)
        acc[2] += v > 0
        acc[3] = min(acc[3], v)
        acc[4] = max(acc[4], v)
    return {k: (n, math.fsum(vs), pos, lo, hi) for k, (n, vs, pos, lo, hi) in out.items()}


def check(db):
    con = connect_readonly(db)
    try:
        assert con.execute("PRAGMA user_version").fetchone()[0] == FLEET_VERSION
        p = json.loads(con.execute("SELECT value FROM fleet_info WHERE key = 'host_bins'"
                                   ).fetchone()[0])
        first, last = con.execute("SELECT MIN(first_entry_ns), MAX(last_entry_ns) "
                                  "FROM collectives").fetchone()
        # the report's default bins, from the collectives now in the file
        assert p == {"t0_ns": first, "bin_ns": int(default_bin_s(first, last) * 1e9)}
        want = raw_bins(con, p["t0_ns"], p["bin_ns"])
        got = {(m, n, d, b): (k, t, pos, lo, hi) for m, n, d, b, k, t, pos, lo, hi in
               con.execute("SELECT metric, node_id, device, bin, samples, total, positive, "
                           "lo, hi FROM host_bins")}
        # the projections: the same rows as the filters on the raw tables, stored in the
        # order the report samples them (read without ORDER BY: the key's order)
        blocks = con.execute("SELECT node_id, timestamp_ns, block_id, duration_ns "
                             "FROM job_block_io").fetchall()
        assert blocks == sorted(con.execute(
            "SELECT b.node_id, b.timestamp_ns, b.id, b.duration_ns FROM block_events b "
            f"WHERE {JOB_BLOCK}").fetchall())
        n_block = con.execute("SELECT COUNT(*) FROM block_events").fetchone()[0]
        assert 0 < len(blocks) < n_block      # other tenants' and writeback left out
        waits = con.execute("SELECT node_id, pid, cuda_id, timestamp_ns, duration_ns "
                            "FROM sync_waits").fetchall()
        apis = ", ".join("?" * len(SYNC_WAIT_APIS))
        assert waits and waits == sorted(con.execute(
            "SELECT node_id, pid, id, timestamp_ns, duration_ns FROM cuda_events "
            f"WHERE duration_ns IS NOT NULL AND api IN ({apis})", SYNC_WAIT_APIS).fetchall())
    finally:
        con.close()
    assert got.keys() == want.keys()
    # samples before t0 and bins on both sides of it, GPU devices and whole-node rows
    assert any(k[3] < 0 for k in got) and any(k[3] > 50 for k in got)
    assert any(k[2] is None for k in got) and any(k[0] == "gpu.temp_c" for k in got)
    for k, (n, total, pos, lo, hi) in want.items():
        g = got[k]
        assert (g[0], g[2], g[3], g[4]) == (n, pos, lo, hi), k
        assert math.isclose(g[1], total, rel_tol=1e-12, abs_tol=1e-9), (k, g[1], total)
    return p


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    d = tmp_path_factory.mktemp("summaries")
    simulate_fleet(d / "bundles", FleetConfig(nodes=4, ranks_per_node=2, steps=120,
                                              fault="gpu", seed=5), overwrite=True)
    return sorted((d / "bundles").glob("*.bundle")), d


def test_host_bins_equal_the_raw_samples(bundles):
    paths, d = bundles
    merge_bundles(paths, d / "fleet.db")
    check(d / "fleet.db")


def test_host_bins_rewritten_when_bundles_are_added(bundles):
    paths, d = bundles
    db = d / "grown.db"
    merge_bundles(paths[:2], db)
    check(db)
    merge_bundles(paths[2:], db)
    check(db)       # bins of the collectives of all four nodes, rows of all four
    con = connect_readonly(db)
    try:
        nodes = {n for (n,) in con.execute("SELECT DISTINCT node_id FROM host_bins")}
    finally:
        con.close()
    assert len(nodes) == 4
