"""Opening a fleet.db for export, and its nodes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import apsw
import orjson

from ..db import harden
from ..fleetfile import check_fleet_file
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
    check_fleet_file(path, ExportError)
    try:
        return connect_fleet(path)
    except apsw.Error as e:
        raise ExportError(f"{path}: cannot open database ({e})") from None


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
