"""Conformance: bundles written from the spec alone (tests/bundle/specwriter.py, no
import of the project's writer) merge and report exactly like the project's own bundles
of the same events; and the spec's rules that a writer must compute (the NCCL number
tables, the communicator hash and its worked example) agree with the code."""

from __future__ import annotations

import re
import struct

import apsw
import pytest

from ingero_forensics.bundle.schema import NCCL_DATATYPES, NCCL_REDOPS
from ingero_forensics.capture.ebpf.hashing import hex_hash, split_hash, unique_id_hash
from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.text import render_text
from ingero_forensics.simulate import FleetConfig, simulate_fleet

from .specwriter import rewrite
from .test_spec import DOC, extract_ddl

MASK = (1 << 64) - 1


def _spec_splitmix64(z):
    """splitmix64 exactly as section 14 of the spec writes it."""
    z = (z + 0x9e3779b97f4a7c15) & MASK
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & MASK
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & MASK
    return z ^ (z >> 31)


def test_communicator_hash_worked_example():
    text = DOC.read_text(encoding="utf-8")
    m = re.search(r"0, 1, 2, \.\.\., 127 hashes to `([0-9a-f]{16})`; its first split with "
                  r"color 1 gives\s+`([0-9a-f]{16})`, with color 0 `([0-9a-f]{16})`; a "
                  r"second split with color 1 gives\s+`([0-9a-f]{16})`", text)
    assert m, "the worked example is gone from section 14"
    words = struct.unpack("<16Q", bytes(range(128)))
    h = 0
    for w in words:
        h = _spec_splitmix64(h ^ w)
    child = lambda p, color, n: _spec_splitmix64(  # noqa: E731
        _spec_splitmix64(_spec_splitmix64(p) ^ (color & 0xFFFFFFFF)) ^ n)
    spec = [f"{v:016x}" for v in (h, child(h, 1, 1), child(h, 0, 1), child(h, 1, 2))]
    assert list(m.groups()) == spec
    # and the capture computes the same (its kernel hash is tested against hashing.py)
    code = unique_id_hash(bytes(range(128)))
    assert [hex_hash(code), hex_hash(split_hash(code, 1, 1)), hex_hash(split_hash(code, 0, 1)),
            hex_hash(split_hash(code, 1, 2))] == spec


def test_nccl_number_tables_match_the_code():
    text = DOC.read_text(encoding="utf-8")
    rows = re.findall(r"^  \| (\d+) \| `(\w+)`[^|]*\| (\d+) \| (`[\w:]+`|\.\.\.)? ?\|",
                      text, re.M)
    assert [(int(n), name, int(size)) for n, name, size, _ in rows] == [
        (i, name, size) for i, (name, size) in enumerate(NCCL_DATATYPES)]
    redops = [r.strip("`") for _, _, _, r in rows if r and r.startswith("`")]
    assert redops[:5] == list(NCCL_REDOPS) and redops[5:] == ["premul_sum:5", "premul_sum:6"]


@pytest.fixture(scope="module")
def two_fleets(tmp_path_factory):
    """The same simulated events merged twice: from the project's bundles, and from the
    spec-only writer's rewrite of them (shuffled rows, new ids)."""
    d = tmp_path_factory.mktemp("conf")
    simulate_fleet(d / "own", FleetConfig(nodes=3, ranks_per_node=2, steps=60, fault="cpu",
                                          straggler=1, seed=11))
    own = sorted((d / "own").glob("*.bundle"))
    (d / "spec").mkdir()
    ddl = extract_ddl(DOC.read_text(encoding="utf-8"))
    spec = [rewrite(p, str(d / "spec"), ddl, seed=i) for i, p in enumerate(own)]
    res_own = merge_bundles(own, d / "own.db", strict=True)
    res_spec = merge_bundles(spec, d / "spec.db", strict=True, integrity="full")
    return d, res_own, res_spec


def test_spec_bundles_merge_like_ours(two_fleets):
    d, res_own, res_spec = two_fleets
    assert res_spec.skipped == [] and len(res_spec.warnings) == len(res_own.warnings)
    assert res_spec.rows == res_own.rows
    queries = [
        "SELECT comm_id_hash, seq, op, nranks, ranks_seen, first_entry_ns, last_entry_ns, "
        "completion_ns FROM collectives ORDER BY 1, 2",
        "SELECT name, ranks FROM nodes ORDER BY name",
        "SELECT node_id, offset_ns FROM clock_alignment ORDER BY 1",
        "SELECT node_id, pid, tid, timestamp_ns, duration_ns, op, seq FROM nccl_events "
        "ORDER BY 1, 2, 3, 4",
        "SELECT node_id, pid, tid, timestamp_ns, duration_ns, api, queued_ops FROM cuda_events "
        "ORDER BY 1, 2, 3, 4, 6",
    ]
    a, b = (apsw.Connection(str(d / f"{x}.db")) for x in ("own", "spec"))
    try:
        for q in queries:
            assert list(a.execute(q)) == list(b.execute(q)), q
    finally:
        a.close()
        b.close()


def test_spec_bundles_report_like_ours(two_fleets):
    d, _, _ = two_fleets
    own, spec = analyze_fleet(d / "own.db"), analyze_fleet(d / "spec.db")
    assert own.straggler and spec.verdict == own.verdict
    assert spec.capture_issues == own.capture_issues
    strip = lambda t: re.sub(r"\S*(own|spec)\.db\S*", "", t)  # noqa: E731
    assert strip(render_text(spec)) == strip(render_text(own))
