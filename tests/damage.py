"""Damaged copies of a fleet.db, as a bad disk or a cut transfer leaves them: shared by
the command tests that check one-line errors and untouched inputs."""

import hashlib
import sqlite3


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def corrupt(path, table="collectives"):
    """8 bytes of 0xff over the first page of table's b-tree (the header is intact)."""
    c = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    root = c.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    page = c.execute("PRAGMA page_size").fetchone()[0]
    c.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page)
        f.write(b"\xff" * 8)
