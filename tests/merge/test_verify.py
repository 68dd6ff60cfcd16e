"""ingero-merge --verify: every bad bundle of a hostile corpus is named with its reason,
the good ones pass, nothing is merged, and the exit code says whether all are good."""

import json
import sqlite3

import pytest
from click.testing import CliRunner

from ..bundle.conftest import modify_image, pack, split_bundle
from .fleetgen import make_fleet
from .test_corrupt import TABLE, _corrupt_first_leaf
from ingero_forensics.merge.cli import main
from ingero_forensics.merge.verify import verify_bundle, verify_bundles


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """3 good bundles and one of each kind of bad one, with the reason expected."""
    d = tmp_path_factory.mktemp("verify")
    good_dir = d / "good"
    fleet = make_fleet(good_dir, nodes=3, seconds=3, seed=21)
    bad_dir = d / "bad"
    bad_dir.mkdir()
    src = fleet.paths[0]
    data = src.read_bytes()
    manifest, image = split_bundle(src)
    bad = {}

    def put(name, content, reason):
        p = bad_dir / name
        p.write_bytes(content)
        bad[name] = reason
    put("truncated.bundle", data[: len(data) * 2 // 3], "truncated inside the compressed database")
    flipped = bytearray(data)
    flipped[-40] ^= 0x55
    put("corrupted.bundle", bytes(flipped), "")      # zstd or sha256 says which
    put("foreign.bundle", b"#!/bin/sh\necho this is not a bundle at all, just a script\n",
        "not an ingero bundle")
    sq = d / "plain.db"
    con = sqlite3.connect(sq)
    con.execute("CREATE TABLE t (a)")
    con.commit()
    con.close()
    put("sqlite.bundle", sq.read_bytes(), "plain SQLite database, not a bundle")
    put("schema.bundle", pack(manifest, modify_image(image, d, "DROP TABLE tcp_events;")),
        "table tcp_events is missing")
    counts = json.loads(json.dumps(manifest))
    counts["tables"]["host_samples"] += 1
    meta_fixed = modify_image(image, d, "UPDATE meta SET value = '" + json.dumps(
        counts["tables"]) + "' WHERE key = 'tables';")
    put("rowcount.bundle", pack(counts, meta_fixed), "table host_samples has")
    mismatch = json.loads(json.dumps(manifest))
    mismatch["host"]["hostname"] = "someone-else"
    put("manifest.bundle", pack(mismatch, image), "manifest host does not match meta host")
    put("leaf.bundle", pack(manifest, _corrupt_first_leaf(image, TABLE)), "quick_check failed")
    return fleet, good_dir, bad_dir, bad


def test_library_names_every_bad_bundle(corpus):
    fleet, good_dir, bad_dir, bad = corpus
    checks = verify_bundles([good_dir, bad_dir])
    by_name = {c.input.rsplit("/", 1)[-1]: c for c in checks}
    assert len(checks) == 3 + len(bad)
    for p, truth in zip(fleet.paths, fleet.nodes):
        c = by_name[p.name]
        assert c.ok and c.reason is None, c
        assert c.node == truth.name and c.host and c.rows > 0
        assert c.size == p.stat().st_size and c.end_utc_ns > c.start_utc_ns
    for name, reason in bad.items():
        c = by_name[name]
        assert not c.ok, name
        assert reason in c.reason, (name, c.reason)
    # a manifest that is still readable gives the node and host of a bad bundle
    assert by_name["truncated.bundle"].node == fleet.nodes[0].name
    assert by_name["foreign.bundle"].node is None


def test_corrupted_bundle_reason_is_the_checksum_or_frame(corpus):
    _, _, bad_dir, _ = corpus
    reason = verify_bundle(bad_dir / "corrupted.bundle").reason
    assert "sha256" in reason or "checksum" in reason or "corrupt" in reason, reason


def test_integrity_none_finds_the_malformed_record_by_its_text(corpus):
    """A bundle whose sha256 and counts are right: the quick_check finds it, and so does
    the UTF-8 screen of every TEXT column that runs whatever the integrity (issue 20)."""
    _, _, bad_dir, _ = corpus
    assert not verify_bundle(bad_dir / "leaf.bundle", integrity="none").ok
    assert not verify_bundle(bad_dir / "leaf.bundle").ok


def test_cli_table_and_exit_codes(corpus, tmp_path):
    fleet, good_dir, bad_dir, bad = corpus
    r = CliRunner().invoke(main, ["--verify", str(good_dir)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["bundle", "node", "host", "window", "(UTC)", "size", "rows",
                                "status"]
    assert len(lines) == 5 and lines[-1] == "3 of 3 bundle(s) OK"
    for p, truth in zip(fleet.paths, fleet.nodes):
        line = next(x for x in lines if x.startswith(str(p)))
        assert f" {truth.name} " in line and line.endswith("  OK")
    assert r.stderr == ""
    r = CliRunner().invoke(main, ["--verify", str(good_dir), str(bad_dir),
                                  str(tmp_path / "missing.bundle")])
    assert r.exit_code == 1
    assert r.stdout.splitlines()[-1] == f"3 of {4 + len(bad)} bundle(s) OK"
    err = r.stderr.splitlines()
    assert len(err) == len(bad) + 1
    for name in bad:
        assert any(e.startswith(f"Error: {bad_dir / name}: ") for e in err), name
    assert f"Error: {tmp_path / 'missing.bundle'}: no such file or directory" in err
    assert "Traceback" not in r.output
    assert not list(tmp_path.glob("*.db"))


def test_cli_json(corpus):
    _, good_dir, bad_dir, bad = corpus
    r = CliRunner().invoke(main, ["--verify", str(bad_dir / "schema.bundle"), str(good_dir),
                                  "--json"])
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    assert [c["ok"] for c in out] == [False, True, True, True]
    assert out[0]["reason"] == "table tcp_events is missing"
    assert set(out[0]) >= {"input", "node", "host", "start_utc_ns", "end_utc_ns", "size",
                           "rows", "reason"}


def test_cli_usage(corpus, tmp_path):
    _, good_dir, _, _ = corpus
    r = CliRunner().invoke(main, ["--verify", str(good_dir), "-o", str(tmp_path / "f.db")])
    assert r.exit_code == 2 and "--verify writes nothing" in r.stderr
    assert not (tmp_path / "f.db").exists()


def test_a_utc_window_stepped_back_is_shown_by_its_monotonic_length(corpus, tmp_path):
    """A clock stepped back during a short segment leaves its UTC end before its start:
    the bundle is sound, and --verify shows the window's real length (monotonic), not a
    negative or zero one."""
    from .hostile import reseal
    fleet = corpus[0]
    sql = ("UPDATE meta SET value = json_set(value, '$.end_utc_ns', "
           "json_extract(value, '$.start_utc_ns') - 5000000000) WHERE key = 'capture'")
    p = reseal(fleet.paths[0], tmp_path, sql, "stepped")
    (c,) = verify_bundles([p])
    assert c.ok, c.reason
    assert c.end_utc_ns < c.start_utc_ns
    m, _ = split_bundle(p)
    length = (m["capture"]["end_mono_ns"] - m["capture"]["start_mono_ns"]) / 1e9
    assert length >= 2 and c.seconds == length
    r = CliRunner().invoke(main, ["--verify", str(p)])
    assert r.exit_code == 0, r.output
    assert f" +{length:.0f}s " in r.output, r.output
