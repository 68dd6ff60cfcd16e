"""Hostile bundles for the tests: a valid bundle's image edited with trusted test SQL and
packed again with a manifest that mirrors it, so checksums, manifest and row counts are
all correct (what a re-seal as in tests/rig/skew.py gives, also for values seal_spool
itself would refuse to read). What is left is what the merge must
survive: values the schema does not promise."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from ..bundle.conftest import pack, split_bundle

#: name -> (SQL run on the image, what the skip reason names)
HOSTILE = {
    "realtime_min": (
        "UPDATE clock_samples SET realtime_ns = -9223372036854775808 WHERE id % 2 = 0",
        "clock_samples"),
    "deep_frames": (
        "UPDATE stacks SET frames = '" + "[" * 5000 + "]" * 5000 + "' "
        "WHERE stack_id = (SELECT MIN(stack_id) FROM stacks)",
        "stacks"),
    "comm_not_utf8": (
        "UPDATE nccl_events SET comm_id_hash = CAST(x'ff00' AS TEXT) "
        "WHERE id = (SELECT MIN(id) FROM nccl_events)",
        "nccl_events"),
    "meta_not_utf8": (
        "UPDATE meta SET value = CAST(x'22ff22' AS TEXT) WHERE key = 'created_by'",
        "meta"),
    "job_not_utf8": (
        "UPDATE processes SET job_id = CAST(x'ff00' AS TEXT)",
        "processes"),
    "segment_index_huge": (
        "UPDATE meta SET value = replace(value, '\"index\": 0', "
        "'\"index\": 9223372036854775808') WHERE key = 'segment'",
        "segment.index"),
}


def reseal(src, out_dir, sql: str, name: str = "hostile") -> Path:
    """A copy of the sealed bundle src with sql run on its database, packed again into
    out_dir/<name>.bundle with a manifest that mirrors the edited meta table and counts
    the edited tables (a valid seal, as the bundle writer's would be)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spool = out_dir / f".{name}-spool.db"
    manifest, image = split_bundle(src)
    spool.write_bytes(image)
    con = sqlite3.connect(spool)
    try:
        con.executescript(sql)
        con.commit()
        for key, value in con.execute("SELECT CAST(key AS TEXT), CAST(value AS BLOB) FROM meta"):
            if key in manifest and key not in ("magic", "tables", "database"):
                try:
                    manifest[key] = json.loads(bytes(value))
                except ValueError:
                    pass
        for t in manifest["tables"]:
            manifest["tables"][t] = con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
    finally:
        con.close()
    out = out_dir / f"{name}.bundle"
    out.write_bytes(pack(manifest, spool.read_bytes()))
    spool.unlink()
    return out
