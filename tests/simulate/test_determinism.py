"""The same seed gives the same fleet, whatever the number of worker processes."""

from __future__ import annotations

import json

from ingero_forensics.bundle import open_bundle
from ingero_forensics.bundle.schema import TABLES
from ingero_forensics.simulate import FleetConfig, simulate_fleet


def _contents(out_dir):
    """Every table's rows per node; meta without the per-seal segment id and time."""
    result = {}
    for p in sorted(out_dir.glob("*.bundle")):
        with open_bundle(p) as b:
            tables = {}
            for t in TABLES:
                tables[t.name] = b.con.execute(f"SELECT * FROM {t.name} ORDER BY 1").fetchall()
            tables["meta"] = [(k, v) for k, v in tables["meta"] if k != "segment"]
            result[(p.name, b.node)] = tables
    return result


def _truth(out_dir):
    return json.loads((out_dir / "truth.json").read_text())


def test_same_seed_same_fleet(tmp_path):
    cfg = FleetConfig(nodes=3, ranks_per_node=2, steps=40, fault="memory", ntp_step=True,
                      seed=7, workers=1)
    a = simulate_fleet(tmp_path / "a", cfg)
    b = simulate_fleet(tmp_path / "b", FleetConfig(**{**cfg.__dict__, "workers": 2}))
    ca, cb = _contents(tmp_path / "a"), _contents(tmp_path / "b")
    assert ca == cb
    # events: every table's rows but meta and stacks, as the merge counts them
    assert sum(len(rows) for t in ca.values() for name, rows in t.items()
               if name not in ("meta", "stacks")) == a.events
    assert all(t["stacks"] for t in ca.values())    # there, and left out of the count
    assert _truth(tmp_path / "a") == _truth(tmp_path / "b")
    assert a.rows == b.rows


def test_other_seed_other_fleet(tmp_path):
    base = dict(nodes=2, ranks_per_node=2, steps=20, fault="cpu", workers=1)
    simulate_fleet(tmp_path / "a", FleetConfig(seed=1, **base))
    simulate_fleet(tmp_path / "b", FleetConfig(seed=2, **base))
    ta, tb = _truth(tmp_path / "a"), _truth(tmp_path / "b")
    assert ta["nodes"][0]["clock"] != tb["nodes"][0]["clock"]
    ca, cb = _contents(tmp_path / "a"), _contents(tmp_path / "b")
    assert list(ca.values())[0]["nccl_events"] != list(cb.values())[0]["nccl_events"]
