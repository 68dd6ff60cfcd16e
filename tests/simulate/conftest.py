"""Small simulated fleets shared by the simulator tests (one per fault kind, cached)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from ingero_forensics.bundle import open_bundle
from ingero_forensics.simulate import FleetConfig, simulate_fleet

SMALL = dict(nodes=4, ranks_per_node=2, steps=60, workers=1)


class Fleet:
    """A simulated fleet on disk: truth.json plus the opened (verified) bundles."""

    def __init__(self, out_dir: Path):
        self.dir = out_dir
        self.truth = json.loads((out_dir / "truth.json").read_text())
        self.bundles = {}
        for p in sorted(out_dir.glob("*.bundle")):
            b = open_bundle(p)
            self.bundles[b.node] = b

    def close(self):
        for b in self.bundles.values():
            b.close()

    def q(self, node: str, sql: str, params=()):
        return self.bundles[node].con.execute(sql, params).fetchall()

    def node_truth(self, node: str) -> dict:
        return next(n for n in self.truth["nodes"] if n["name"] == node)

    def true_ns(self, node: str, mono: int) -> float:
        """True UTC of a monotonic reading, from truth.json's mapping."""
        m = self.node_truth(node)["clock"]["true_utc_of_mono"]
        return m["boot_utc_ns"] + mono * m["rate"]

    def entries(self):
        """{(comm_id_hash, seq): {rank: true entry ns}} over all bundles."""
        out = defaultdict(dict)
        for node in self.bundles:
            for ts, comm, seq, rank in self.q(
                    node, "SELECT timestamp_ns, comm_id_hash, seq, rank FROM nccl_events"):
                out[(comm, seq)][rank] = self.true_ns(node, ts)
        return out

    def lateness_ms(self, seqs=None) -> dict[int, float]:
        """Per global rank: mean (entry - median entry of the collective), in ms."""
        late = defaultdict(list)
        for (comm, seq), by_rank in self.entries().items():
            if seqs is not None and (comm, seq) not in seqs:
                continue
            med = statistics.median(by_rank.values())
            for rank, t in by_rank.items():
                late[rank].append((t - med) / 1e6)
        return {r: statistics.fmean(v) for r, v in late.items()}


_cache: dict = {}


@pytest.fixture(scope="session")
def make_fleet(tmp_path_factory):
    """make_fleet(**config) -> Fleet, cached per configuration for the session."""

    def make(**kw):
        cfg = dict(SMALL, **kw)
        key = tuple(sorted(cfg.items()))
        if key not in _cache:
            d = tmp_path_factory.mktemp("fleet")
            simulate_fleet(d, FleetConfig(**{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in cfg.items()}))
            _cache[key] = Fleet(d)
        return _cache[key]

    yield make
    for f in _cache.values():
        f.close()
    _cache.clear()
