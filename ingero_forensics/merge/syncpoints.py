"""Sync points of one bundle: observed completions of collectives (docs/merge.md).

Per waiting synchronization (a sync API that lasted at least ``min_wait_ns``), the event
just before it in its thread's order, if that event is a collective: the sync's end is
an observation of that collective's completion.

This runs in the merge's helper threads, on a connection of their own, so it must be
SQL only: apsw releases the GIL while a statement runs, and Python per row would both
hold it and cost ~1 us a row. The thread's events are sorted once into a table whose
rowid is the position in thread order; a sync then meets its predecessor by rowid
(``rn - 1``). A window function with LAG gives the same rows at twice the time; a C loop
over the sorted stream (tried) took only 13% less, since the sort is most of the cost.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import apsw

from ..bundle.schema import NCCL_OPS
from ..db import harden

#: Synchronizations whose end observes completion of the collectives enqueued before.
SYNC_APIS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
             "cuEventSynchronize")

_OPS = ", ".join(f"'{o}'" for o in NCCL_OPS)
_APIS = ", ".join(f"'{a}'" for a in SYNC_APIS)

#: A bundle's collectives and synchronizations in thread order: (pid, tid, t, d, comm,
#: seq), comm NULL for a synchronization. is_sync orders a collective before a sync at
#: the same instant (enqueue first); the source id makes the order total.
EVENTS_SQL = f"""
    SELECT pid, tid, t, d, comm, seq FROM (
        SELECT pid, tid, timestamp_ns AS t, duration_ns AS d, 0 AS is_sync,
               comm_id_hash AS comm, seq, id
          FROM b.nccl_events
         WHERE comm_id_hash IS NOT NULL AND typeof(seq) = 'integer' AND op IN ({_OPS})
           AND typeof(timestamp_ns) = 'integer' AND typeof(duration_ns) = 'integer'
           AND typeof(pid) = 'integer' AND typeof(tid) = 'integer'
        UNION ALL
        SELECT pid, tid, timestamp_ns, duration_ns, 1, NULL, NULL, id
          FROM b.cuda_events
         WHERE api IN ({_APIS}) AND typeof(timestamp_ns) = 'integer'
           AND typeof(duration_ns) = 'integer' AND typeof(pid) = 'integer'
           AND typeof(tid) = 'integer')
    ORDER BY pid, tid, t, is_sync, id"""


def image_uri(db_path) -> str:
    """Read-only URI of a verified bundle image: immutable, so no locks and no journal
    lookups on a file nobody else writes."""
    return "file:" + str(Path(db_path).resolve()).replace("%", "%25").replace("?", "%3f") \
        .replace("#", "%23") + "?mode=ro&immutable=1"


@contextlib.contextmanager
def attached(con, path, name: str):
    """``path`` (a verified image or a scratch file) ATTACHed read-only as ``name``."""
    con.execute(f"ATTACH DATABASE ? AS {name}", (image_uri(path),))
    try:
        yield
    finally:
        con.execute(f"DETACH DATABASE {name}")


def extract_sync_points(image, out_path, min_wait_ns: int) -> int:
    """Write the sync points of the verified bundle image ``image`` into a new SQLite
    file ``out_path`` (table ``sp``: comm_id_hash, seq, pid, tid, mono_ns, wait_ns).
    Returns the number of distinct collectives observed. Raises apsw.Error on an
    unreadable image."""
    con = apsw.Connection(str(out_path), flags=apsw.SQLITE_OPEN_READWRITE |
                          apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI)
    try:
        harden(con)
        # A scratch file of this merge: nothing to recover after a crash.
        for pragma in ("PRAGMA journal_mode = OFF", "PRAGMA synchronous = OFF",
                       "PRAGMA temp_store = FILE", "PRAGMA cache_size = -8192"):
            con.execute(pragma)
        con.execute("ATTACH DATABASE ? AS b", (image_uri(image),))
        con.execute("BEGIN")
        con.execute("CREATE TABLE sp (comm_id_hash TEXT, seq INTEGER, pid INTEGER, "
                    "tid INTEGER, mono_ns INTEGER, wait_ns INTEGER)")
        con.execute("CREATE TABLE ev (rn INTEGER PRIMARY KEY, pid INTEGER, tid INTEGER, "
                    "t INTEGER, d INTEGER, comm TEXT, seq INTEGER)")
        con.execute(f"INSERT INTO ev (pid, tid, t, d, comm, seq) {EVENTS_SQL}")
        con.execute("""
            INSERT INTO sp SELECT c.comm, c.seq, s.pid, s.tid, s.t + s.d, s.d
              FROM ev s JOIN ev c ON c.rn = s.rn - 1
             WHERE s.comm IS NULL AND s.d >= :min_wait AND c.comm IS NOT NULL
               AND c.pid = s.pid AND c.tid = s.tid""", {"min_wait": min_wait_ns})
        con.execute("DROP TABLE ev")
        con.execute("COMMIT")
        return con.execute("SELECT COUNT(*) FROM (SELECT DISTINCT comm_id_hash, seq "
                           "FROM sp)").fetchone()[0]
    finally:
        con.close()


def extract_fleet_sync_points(con, min_wait_ns: int, max_bundle: int) -> None:
    """The sync points of rows already in fleet.db (bundle_id <= max_bundle), for an
    incremental merge: the same rule on nccl_events and cuda_events by their raw
    monotonic times, into st.sp (attached scratch database)."""
    con.execute("DROP TABLE IF EXISTS temp.fleet_ev")
    con.execute("CREATE TEMP TABLE fleet_ev (rn INTEGER PRIMARY KEY, node_id INTEGER, "
                "bundle_id INTEGER, pid INTEGER, tid INTEGER, t INTEGER, d INTEGER, "
                "comm TEXT, seq INTEGER)")
    con.execute(f"""
        INSERT INTO temp.fleet_ev (node_id, bundle_id, pid, tid, t, d, comm, seq)
        SELECT node_id, bundle_id, pid, tid, t, d, comm, seq FROM (
            SELECT node_id, bundle_id, pid, tid, mono_ns AS t, call_duration_ns AS d,
                   0 AS is_sync, comm_id_hash AS comm, seq, id
              FROM main.nccl_events
             WHERE bundle_id <= :maxb AND comm_id_hash IS NOT NULL AND seq IS NOT NULL
               AND op IN ({_OPS}) AND typeof(pid) = 'integer' AND typeof(tid) = 'integer'
            UNION ALL
            SELECT node_id, bundle_id, pid, tid, mono_ns, duration_ns, 1, NULL, NULL, id
              FROM main.cuda_events
             WHERE bundle_id <= :maxb AND api IN ({_APIS}) AND typeof(duration_ns) = 'integer'
               AND typeof(pid) = 'integer' AND typeof(tid) = 'integer')
        ORDER BY node_id, pid, tid, t, is_sync, id""", {"maxb": max_bundle})
    con.execute("""
        INSERT INTO st.sp (node_id, bundle_id, comm_id_hash, seq, pid, tid, mono_ns, wait_ns,
                           used)
        SELECT s.node_id, s.bundle_id, c.comm, c.seq, s.pid, s.tid, s.t + s.d, s.d, 0
          FROM temp.fleet_ev s JOIN temp.fleet_ev c ON c.rn = s.rn - 1
         WHERE s.comm IS NULL AND s.d >= :min_wait AND c.comm IS NOT NULL
           AND c.node_id = s.node_id AND c.pid = s.pid AND c.tid = s.tid""",
                {"min_wait": min_wait_ns})
    con.execute("DROP TABLE temp.fleet_ev")
