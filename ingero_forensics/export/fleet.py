"""Opening a fleet.db for export, and its nodes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import apsw
import orjson

from ..db import harden
from ..merge.fleet_schema import FLEET_APPLICATION_ID, FLEET_VERSION
from .options import ExportError


# ------------------------------------------------------------------------ the fleet

def connect_fleet(path) -> apsw.Connection:
    """db.connect_readonly without SQLite's per-connection mutex: an export connection is
    only ever used by one thread, and the C loops read columns a dozen times per row
    (each read would lock and unlock it)."""
    return harden(apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY
                                  | apsw.SQLITE_OPEN_NOMUTEX))


def open_fleet(path) -> apsw.Connection:
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise ExportError(f"{path}: cannot read: {e.strerror or e}") from None
    if head != b"SQLite format 3\x00":
        raise ExportError(f"{path}: not a fleet.db (not a SQLite database; bundles are "
                          "merged first with ingero-merge)")
    try:
        con = connect_fleet(path)
        app = con.execute("PRAGMA application_id").fetchone()[0]
        ver = con.execute("PRAGMA user_version").fetchone()[0]
    except apsw.Error as e:
        raise ExportError(f"{path}: cannot open database ({e})") from None
    if app != FLEET_APPLICATION_ID:
        con.close()
        raise ExportError(f"{path}: not a fleet.db (application_id {app:#x}; a bundle "
                          "database or another SQLite file?)")
    if ver > FLEET_VERSION:
        con.close()
        raise ExportError(f"{path}: fleet.db version {ver} is newer than this tool "
                          f"supports ({FLEET_VERSION}); upgrade ingero-forensics")
    return con


@dataclass
class Node:
    node_id: int
    name: str
    pid: int
    ranks: list


def load_nodes(con) -> list[Node]:
    nodes = []
    for i, (node_id, name, ranks) in enumerate(con.execute(
            "SELECT node_id, name, ranks FROM nodes ORDER BY name, node_id")):
        try:
            rk = sorted(r for r in orjson.loads(ranks or "[]") if isinstance(r, int))
        except orjson.JSONDecodeError:
            rk = []
        nodes.append(Node(node_id, name, i + 1, rk))
    return nodes


def rank_ranges(ranks: list[int]) -> str:
    if not ranks:
        return "no ranks"
    parts, lo, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(lo) if lo == prev else f"{lo}-{prev}")
        if r is not None:
            lo = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)
