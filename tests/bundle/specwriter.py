"""A bundle writer written from docs/bundle-format.md alone: it imports nothing from
ingero_forensics (only sqlite3, zstandard, json, struct, hashlib, os, random, time).

``rewrite`` takes the events of a bundle (read through the container layout of the
spec's section 1, not through the project's reader) and writes them again as a writer in
another language would: the DDL taken from the spec text, rows in shuffled order with
new ids (section 3: row order is unspecified; section 5: ids have no meaning), stacks
renumbered, the meta mirror and manifest of sections 2 and 6, the container of section
1, the file name of section 9.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sqlite3
import struct
import time

import zstandard

SKIPPABLE_MAGIC = 0x184D2A5E


def read_container(path) -> tuple[dict, bytes]:
    """(manifest, database image) of a bundle, by section 1."""
    with open(path, "rb") as f:
        magic, n = struct.unpack("<II", f.read(8))
        assert magic == SKIPPABLE_MAGIC
        manifest = json.loads(f.read(n).decode("utf-8"))
        image = zstandard.ZstdDecompressor().decompress(f.read())
    return manifest, image


def _columns(con, table) -> list[str]:
    return [r[1] for r in con.execute(f"PRAGMA table_info({table})")]


def rewrite(src, out_dir, ddl: str, seed: int) -> str:
    """Write the events of bundle ``src`` as a new bundle in ``out_dir``; its path."""
    rng = random.Random(seed)
    manifest, image = read_container(src)
    src_db = os.path.join(out_dir, f".src-{seed}.db")
    dst_db = os.path.join(out_dir, f".image-{seed}.db")
    with open(src_db, "wb") as f:
        f.write(image)
    old = sqlite3.connect(src_db)
    con = sqlite3.connect(dst_db)
    con.executescript(ddl)
    tables = [r[0] for r in con.execute(
        "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT IN ('meta', 'stacks')")]
    have = {r[0] for r in old.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    # stacks: new ids, in another order
    stacks = list(old.execute("SELECT stack_id, frames FROM stacks"))
    rng.shuffle(stacks)
    new_id = {}
    for i, (sid, frames) in enumerate(stacks):
        new_id[sid] = 1000 + 7 * i
        con.execute("INSERT INTO stacks (stack_id, frames) VALUES (?, ?)", (new_id[sid], frames))
    for t in tables:
        if t not in have:
            continue
        cols = [c for c in _columns(con, t) if c != "id" and c in _columns(old, t)]
        rows = [list(r) for r in old.execute(f"SELECT {', '.join(cols)} FROM {t}")]
        rng.shuffle(rows)
        if "stack_id" in cols:
            k = cols.index("stack_id")
            for r in rows:
                r[k] = new_id.get(r[k]) if r[k] is not None else None
        con.executemany(f"INSERT INTO {t} ({', '.join(cols)}) VALUES "
                        f"({', '.join('?' * len(cols))})", rows)
    old.close()
    os.unlink(src_db)
    # section 6: every manifest key but magic, tables and database, JSON-encoded
    out = {k: v for k, v in manifest.items() if k not in ("tables", "database")}
    out["created_by"] = "spec-only conformance writer"
    for key, value in out.items():
        if key != "magic":
            con.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))
    names = [r[0] for r in con.execute(
        "SELECT name FROM sqlite_schema WHERE type = 'table' AND name != 'meta'")]
    out["tables"] = {t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in names}
    con.commit()
    con.close()
    with open(dst_db, "rb") as f:
        image = f.read()
    os.unlink(dst_db)
    out["database"] = {"size": len(image), "sha256": hashlib.sha256(image).hexdigest(),
                       "compression": "zstd"}
    raw = json.dumps(out).encode("utf-8")
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True,
                                     write_content_size=True).compress(image)
    # section 9: <node>+<YYYYmmddTHHMMSS>Z+<index>.bundle (the name is not read back)
    start = time.strftime("%Y%m%dT%H%M%S", time.gmtime(out["capture"]["start_utc_ns"] // 10**9))
    name = os.path.join(out_dir, f"{out['node']}+{start}Z+{out['segment']['index']:06d}.bundle")
    tmp = os.path.join(out_dir, f".{os.path.basename(name)}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<II", SKIPPABLE_MAGIC, len(raw)) + raw + frame)
        f.flush()
        os.fsync(f.fileno())
    os.link(tmp, name)
    os.unlink(tmp)
    return name
