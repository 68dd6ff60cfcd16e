"""A bundle written from docs/bundle-format.md alone is accepted.

``write_from_spec`` uses only sqlite3, zstandard, json, struct, hashlib and os, the DDL
extracted from the spec, and the spec's rules; it imports nothing from ingero_forensics.
"""

import hashlib
import json
import os
import sqlite3
import struct

import zstandard

from ingero_forensics.bundle import open_bundle, read_manifest

from .test_spec import DOC, extract_ddl

NODE = "spec-node-3"
MONO0 = 5_000_000_000_000
UTC0 = 1_780_000_000_000_000_000


def write_from_spec(out_dir, ddl: str) -> str:
    db = os.path.join(out_dir, "image.db")
    con = sqlite3.connect(db)
    con.executescript(ddl)
    frames = json.dumps([{"ip": "0x7f0000001000", "symbol": "ncclAllReduce"},
                         {"py_file": "train.py", "py_func": "step", "py_line": 10}],
                        sort_keys=True, separators=(",", ":"))
    con.execute("INSERT INTO stacks (stack_id, frames) VALUES (1, ?)", (frames,))
    for i in range(4):
        con.execute("INSERT INTO nccl_events (timestamp_ns, duration_ns, op, rank, nranks, "
                    "comm_id_hash, seq, count, datatype, redop, peer, stream, bytes, "
                    "group_depth, return_code, pid, tid, stack_id) "
                    "VALUES (?, ?, 'ALL_REDUCE', 1, 2, '0123456789abcdef', ?, 1024, "
                    "'float32', 'sum', NULL, 0, 4096, 0, 0, 77, 78, 1)",
                    (MONO0 + 1_000_000 * (i + 1), 50_000, i + 1))
    con.execute("INSERT INTO clock_samples (source, mono_before_ns, mono_after_ns, "
                "realtime_ns, uncertainty_ns, synchronized) VALUES ('system', ?, ?, ?, 400, 1)",
                (MONO0 + 100, MONO0 + 500, UTC0 + 300))
    con.execute("INSERT INTO host_samples (timestamp_ns, metric, device, value) "
                "VALUES (?, 'cpu.busy_pct', NULL, 42.0)", (MONO0 + 2_000_000,))
    con.execute("INSERT INTO processes (pid, comm, rank, world_size, env, first_seen_ns, "
                "last_seen_ns) VALUES (77, 'python3', 1, 2, '{\"RANK\": \"1\"}', ?, ?)",
                (MONO0, MONO0 + 9_000_000))
    con.execute("INSERT INTO capture_log (timestamp_ns, level, source, event, message) "
                "VALUES (?, 'info', 'nccl', 'source_on', 'written by a spec-only writer')",
                (MONO0,))
    manifest = {
        "magic": "ingero-forensics-bundle",
        "format_version": 1,
        "node": NODE,
        "host": {"hostname": "spec-host", "boot_id": "0f0e0d0c-0b0a-0908-0706-050403020100",
                 "kernel_release": "6.1.0-spec", "tool_version": "spec-writer 1"},
        "segment": {"index": 0, "id": "specsegment0001"},
        "capture": {"start_utc_ns": UTC0, "end_utc_ns": UTC0 + 10_000_000,
                    "start_mono_ns": MONO0, "end_mono_ns": MONO0 + 10_000_000},
        "created_by": "spec-only test writer",
    }
    # every manifest key but magic, tables and database is mirrored in meta
    for key, value in manifest.items():
        if key != "magic":
            con.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))
    tables = [r[0] for r in con.execute(
        "SELECT name FROM sqlite_schema WHERE type = 'table' AND name != 'meta'")]
    manifest["tables"] = {t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                          for t in tables}
    con.commit()
    con.close()
    with open(db, "rb") as f:
        image = f.read()
    manifest["database"] = {"size": len(image), "sha256": hashlib.sha256(image).hexdigest(),
                            "compression": "zstd"}
    raw = json.dumps(manifest).encode("utf-8")
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True,
                                     write_content_size=True).compress(image)
    name = os.path.join(out_dir, f"{NODE}+20260528T201320Z+000000.bundle")
    tmp = name + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<II", 0x184D2A5E, len(raw)))
        f.write(raw)
        f.write(frame)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, name)
    os.unlink(db)
    return name


def test_reader_accepts_a_spec_only_bundle(tmp_path):
    path = write_from_spec(str(tmp_path), extract_ddl(DOC.read_text(encoding="utf-8")))
    assert read_manifest(path)["node"] == NODE
    with open_bundle(path, integrity="full") as b:
        assert b.node == NODE
        assert b.con.execute("SELECT COUNT(*), MAX(seq) FROM nccl_events").fetchone() == (4, 4)
        assert b.manifest["tables"]["nccl_events"] == 4


def test_merge_accepts_a_spec_only_bundle(tmp_path):
    from ingero_forensics.merge import merge_bundles
    path = write_from_spec(str(tmp_path), extract_ddl(DOC.read_text(encoding="utf-8")))
    out = tmp_path / "fleet.db"
    res = merge_bundles([path], out, strict=True)
    assert res.bundles_merged == 1 and res.skipped == []
    assert res.rows.get("nccl_events") == 4
    con = sqlite3.connect(out)
    assert con.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0] == 4
    con.close()


def test_zstd_cli_frame_is_accepted(tmp_path):
    """Step 3 of the spec's recipe allows `zstd -3 --check` on the image file."""
    import shutil
    import subprocess
    if shutil.which("zstd") is None:
        import pytest
        pytest.skip("zstd CLI not installed")
    path = write_from_spec(str(tmp_path), extract_ddl(DOC.read_text(encoding="utf-8")))
    with open(path, "rb") as f:
        n = struct.unpack("<II", f.read(8))[1]
        raw = f.read(n)
        image = zstandard.ZstdDecompressor().decompress(f.read())
    (tmp_path / "image.db").write_bytes(image)
    subprocess.run(["zstd", "-3", "--check", "-q", "-f", str(tmp_path / "image.db"), "-o",
                    str(tmp_path / "image.db.zst")], check=True)
    cli = tmp_path / "cli.bundle"
    cli.write_bytes(struct.pack("<II", 0x184D2A5E, n) + raw
                    + (tmp_path / "image.db.zst").read_bytes())
    with open_bundle(cli) as b:
        assert b.con.execute("SELECT COUNT(*) FROM nccl_events").fetchone()[0] == 4
