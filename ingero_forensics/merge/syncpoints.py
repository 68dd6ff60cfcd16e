"""Sync points of one bundle: observed completions of collectives (docs/merge.md).

Per waiting synchronization (a sync API that lasted at least ``min_wait_ns``), the event
just before it in its thread's order (collectives and synchronizations only), if that
event is a collective: the sync's end is an observation of that collective's completion.
It is certainly no earlier than the completion, which is what the alignment's causal
bounds use. It is *tight* (the completion itself, give or take the wake-up) only when
the thread queued no stream work between the collective and the sync, or at most
TIGHT_MAX_OPS operations (``loss.item()``'s copy) all enqueued within TIGHT_LAG_NS of the
collective's return (``cuda_events.queued_ops``, ``queue_gap_ns``): kernels launched
after the collective, the optimizer's after the last gradient bucket in PyTorch, make
the sync end when they end, late on a rank whose CPU is starved. Only tight
observations estimate offsets; bundles that do not record queued work have none.

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
#: A sync observation stays tight with at most this many operations queued after the
#: collective (a runtime copy and the driver call it makes count two) ...
TIGHT_MAX_OPS = 2
#: ... all enqueued within this long after the collective's host call returned. Such
#: work then reached the GPU before the collective completed (a rank that arrives last
#: still waits for the transfer), so the sync ends after the completion by that work's
#: GPU time (microseconds for a small copy) plus the wake-up.
TIGHT_LAG_NS = 50_000

_OPS = ", ".join(f"'{o}'" for o in NCCL_OPS)
_APIS = ", ".join(f"'{a}'" for a in SYNC_APIS)
#: Times and durations the sync-point rule uses lie within +-2^61 ns and a duration is
#: not negative: so t + d, t - gap and every aligned time (off within +-2^61,
#: merge/core.py _check_params; |slope| < 1) fit in int64, in SQL and in
#: merge/_fastcoll.c alike, and both paths give the same result for any bundle. A
#: manifest's monotonic capture window lies within +-2^60 (bundle/container.py), so
#: every row the merge's window check keeps is within this bound.
TIME_BOUND = 1 << 61


def bounded(t: str, d: str, g: str | None = None) -> str:
    """SQL: the row's time t, duration d (and queue gap g) are within TIME_BOUND."""
    sql = f" AND {t} BETWEEN -{TIME_BOUND} AND {TIME_BOUND} AND {d} BETWEEN 0 AND {TIME_BOUND}"
    if g:
        sql += f" AND ({g} IS NULL OR {g} BETWEEN -{TIME_BOUND} AND {TIME_BOUND})"
    return sql

def queued_columns(has_columns: bool, alias: str = "") -> str:
    """SQL for a synchronization's (queued_ops, queue_gap_ns), NULLs where the source
    predates them (bundle format 1.0)."""
    if not has_columns:
        return "NULL, NULL"
    return f"{alias}queued_ops, {alias}queue_gap_ns"


def events_sql(has_queued: bool) -> str:
    """A bundle's collectives and synchronizations in thread order: (pid, tid, t, d, comm,
    seq, queued, gap), comm NULL for a synchronization. is_sync orders a collective
    before a sync at the same instant (enqueue first); the source id makes the order
    total."""
    return f"""
    SELECT pid, tid, t, d, comm, seq, q, g FROM (
        SELECT pid, tid, timestamp_ns AS t, duration_ns AS d, 0 AS is_sync,
               comm_id_hash AS comm, seq, NULL AS q, NULL AS g, id
          FROM b.nccl_events
         WHERE typeof(comm_id_hash) = 'text' AND typeof(seq) = 'integer' AND op IN ({_OPS})
           AND typeof(timestamp_ns) = 'integer' AND typeof(duration_ns) = 'integer'
           AND typeof(pid) = 'integer' AND typeof(tid) = 'integer'
           {bounded("timestamp_ns", "duration_ns")}
        UNION ALL
        SELECT pid, tid, timestamp_ns, duration_ns, 1, NULL, NULL, {queued_columns(has_queued)},
               id
          FROM b.cuda_events
         WHERE api IN ({_APIS}) AND typeof(timestamp_ns) = 'integer'
           AND typeof(duration_ns) = 'integer' AND typeof(pid) = 'integer'
           AND typeof(tid) = 'integer'
           {bounded("timestamp_ns", "duration_ns", "queue_gap_ns" if has_queued else None)})
    ORDER BY pid, tid, t, is_sync, id"""


#: SQL: whether sync s observes collective c (the event before it) tightly, with binds
#: :maxops and :lag; as the C path (merge/_fastcoll.c) decides it.
TIGHT_SQL = ("(CASE WHEN typeof(s.q) <> 'integer' THEN 0 WHEN s.q = 0 THEN 1 "
             "WHEN s.q > 0 AND s.q <= :maxops AND typeof(s.g) = 'integer' "
             "AND (s.t - s.g) - (c.t + c.d) <= :lag THEN 1 ELSE 0 END)")


def file_uri(db_path, query: str) -> str:
    """A SQLite URI for db_path (absolute, its %, ? and # escaped) with ``query``."""
    return "file:" + str(Path(db_path).resolve()).replace("%", "%25").replace("?", "%3f") \
        .replace("#", "%23") + "?" + query


def image_uri(db_path) -> str:
    """Read-only URI of a verified bundle image: immutable, so no locks and no journal
    lookups on a file nobody else writes."""
    return file_uri(db_path, "mode=ro&immutable=1")


@contextlib.contextmanager
def attached(con, path, name: str):
    """``path`` (a verified image or a scratch file) ATTACHed read-only as ``name``."""
    con.execute(f"ATTACH DATABASE ? AS {name}", (image_uri(path),))
    try:
        yield
    finally:
        con.execute(f"DETACH DATABASE {name}")


def image_has_queued(con, schema: str = "b") -> bool:
    """Whether the attached image's cuda_events records queued work (format 1.1)."""
    cols = {r[1] for r in con.execute(f"PRAGMA {schema}.table_xinfo(cuda_events)")}
    return {"queued_ops", "queue_gap_ns"} <= cols


def extract_sync_points(image, out_path, min_wait_ns: int) -> int:
    """Write the sync points of the verified bundle image ``image`` into a new SQLite
    file ``out_path`` (table ``sp``: comm_id_hash, seq, pid, tid, mono_ns, wait_ns,
    tight). Returns the number of distinct collectives observed. Raises apsw.Error on
    an unreadable image."""
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
                    "tid INTEGER, mono_ns INTEGER, wait_ns INTEGER, tight INTEGER)")
        con.execute("CREATE TABLE ev (rn INTEGER PRIMARY KEY, pid INTEGER, tid INTEGER, "
                    "t INTEGER, d INTEGER, comm TEXT, seq INTEGER, q INTEGER, g INTEGER)")
        con.execute(f"INSERT INTO ev (pid, tid, t, d, comm, seq, q, g) "
                    f"{events_sql(image_has_queued(con))}")
        con.execute(f"""
            INSERT INTO sp SELECT c.comm, c.seq, s.pid, s.tid, s.t + s.d, s.d, {TIGHT_SQL}
              FROM ev s JOIN ev c ON c.rn = s.rn - 1
             WHERE s.comm IS NULL AND s.d >= :min_wait AND c.comm IS NOT NULL
               AND c.pid = s.pid AND c.tid = s.tid""",
                    {"min_wait": min_wait_ns, "maxops": TIGHT_MAX_OPS, "lag": TIGHT_LAG_NS})
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
                "comm TEXT, seq INTEGER, q INTEGER, g INTEGER)")
    con.execute(f"""
        INSERT INTO temp.fleet_ev (node_id, bundle_id, pid, tid, t, d, comm, seq, q, g)
        SELECT node_id, bundle_id, pid, tid, t, d, comm, seq, q, g FROM (
            SELECT node_id, bundle_id, pid, tid, mono_ns AS t, call_duration_ns AS d,
                   0 AS is_sync, comm_id_hash AS comm, seq, NULL AS q, NULL AS g, id
              FROM main.nccl_events
             WHERE bundle_id <= :maxb AND typeof(comm_id_hash) = 'text'
               AND typeof(seq) = 'integer'
               AND op IN ({_OPS}) AND typeof(pid) = 'integer' AND typeof(tid) = 'integer'
               {bounded("mono_ns", "call_duration_ns")}
            UNION ALL
            SELECT node_id, bundle_id, pid, tid, mono_ns, duration_ns, 1, NULL, NULL,
                   queued_ops, queue_gap_ns, id
              FROM main.cuda_events
             WHERE bundle_id <= :maxb AND api IN ({_APIS}) AND typeof(duration_ns) = 'integer'
               AND typeof(pid) = 'integer' AND typeof(tid) = 'integer'
               {bounded("mono_ns", "duration_ns", "queue_gap_ns")})
        ORDER BY node_id, pid, tid, t, is_sync, id""", {"maxb": max_bundle})
    con.execute(f"""
        INSERT INTO st.sp (node_id, bundle_id, comm_id_hash, seq, pid, tid, mono_ns, wait_ns,
                           used, tight)
        SELECT s.node_id, s.bundle_id, c.comm, c.seq, s.pid, s.tid, s.t + s.d, s.d, 0,
               {TIGHT_SQL}
          FROM temp.fleet_ev s JOIN temp.fleet_ev c ON c.rn = s.rn - 1
         WHERE s.comm IS NULL AND s.d >= :min_wait AND c.comm IS NOT NULL
           AND c.node_id = s.node_id AND c.pid = s.pid AND c.tid = s.tid""",
                {"min_wait": min_wait_ns, "maxops": TIGHT_MAX_OPS, "lag": TIGHT_LAG_NS})
    con.execute("DROP TABLE temp.fleet_ev")


# ------------------------------------------------------------------- the C path
#
# merge/_fastcoll.c applies the same rule in one read of the rows: it sorts a bundle's
# collectives and synchronizations into thread order in memory, pairs them, and writes a
# "run": every collective row (its entry, and the completion it observed if any) sorted
# by (comm_id_hash, seq). The collectives thread merges all runs (collectives.py).

#: Collective rows and synchronizations one runs() call holds (about 100 bytes each);
#: a larger bundle is split into partitions by thread, one run each.
RUN_ROWS = 1_500_000

#: NCCL ops in SQLite's text order: the C code keeps an op as its index here.
SORTED_OPS = tuple(sorted(NCCL_OPS))

def _part(alias: str, p: int, k: int) -> str:
    """Rows of partition k of p, by thread (a thread's rows all land in one)."""
    if p <= 1:
        return ""
    return (f" AND (((({alias}.pid % {p}) + ({alias}.tid % {p})) % {p}) + {p}) % {p} = {k}")


def run_sources(source: str, valid_nccl: str, p: int = 1, k: int = 0,
                has_queued: bool = True) -> tuple[str, str]:
    """(collective rows SQL, synchronizations SQL) for _fastcoll.runs(): ``image`` reads
    the ATTACHed bundle image ``b``, ``fleet`` the rows earlier merges put in fleet.db
    for one node (binds ?1 node_id, ?2 the last old bundle_id). The C code applies the
    rest of events_sql()'s filter (known op, integer pid, tid and times) itself.
    ``has_queued``: the source records queued work (cuda_events.queued_ops)."""
    if source == "image":
        t, d, tab, cuda, ent, where, bundle = ("timestamp_ns", "duration_ns", "b.nccl_events",
                                               "b.cuda_events", valid_nccl, "", "0")
    else:
        t, d, tab, cuda, ent, bundle = ("mono_ns", "call_duration_ns", "main.nccl_events",
                                        "main.cuda_events", "1", "e.bundle_id")
        where = " AND e.node_id = ?1 AND e.bundle_id <= ?2"
    coll = (f"SELECT e.id, e.pid, e.tid, e.{t}, e.{d}, e.comm_id_hash, e.seq, e.rank, e.op, "
            f"e.bytes, e.nranks, ({ent}), {bundle} FROM {tab} e "
            "WHERE typeof(e.comm_id_hash) = 'text' AND typeof(e.seq) = 'integer'"
            f" AND (typeof(e.{t}) <> 'integer' OR typeof(e.{d}) <> 'integer' OR "
            f"(1{bounded(f'e.{t}', f'e.{d}')}))"
            f"{where}{_part('e', p, k)} ORDER BY e.id")
    sync = (f"SELECT s.pid, s.tid, s.{t}, s.duration_ns, {queued_columns(has_queued, 's.')} "
            f"FROM {cuda} s "
            f"WHERE s.api IN ({_APIS}) AND typeof(s.{t}) = 'integer' "
            "AND typeof(s.duration_ns) = 'integer' AND typeof(s.pid) = 'integer' "
            f"AND typeof(s.tid) = 'integer'"
            f"{bounded(f's.{t}', 's.duration_ns', 's.queue_gap_ns' if has_queued else None)}"
            f"{where.replace('e.', 's.')}{_part('s', p, k)} "
            "ORDER BY s.id")
    return coll, sync


def write_runs(fastcoll, con, source: str, valid_nccl: str, rows: int, out_base,
               min_wait_ns: int, binds: tuple = (),
               has_queued: bool = True) -> tuple[list[Path], int]:
    """Run files for one source (see run_sources), as many partitions as ``rows`` (the
    collective and CUDA rows it may read) needs. Returns (paths, distinct collectives
    observed). Raises apsw.Error or RuntimeError on an unreadable source."""
    parts = max(1, -(-rows // RUN_ROWS))
    paths, distinct = [], 0
    try:
        for k in range(parts):
            path = Path(f"{out_base}.run{k}")
            paths.append(path)
            coll, sync = run_sources(source, valid_nccl, parts, k, has_queued)
            _, distinct = fastcoll.runs(con.sqlite3_pointer(), coll, sync, tuple(binds),
                                        SORTED_OPS, min_wait_ns, TIGHT_MAX_OPS, TIGHT_LAG_NS,
                                        str(path))
        if parts > 1:       # a collective seen by several threads is counted once
            distinct = fastcoll.distinct([(str(p), 0, -1, 0, 0.0, 0) for p in paths])
    except BaseException:
        for p in paths:
            p.unlink(missing_ok=True)
        raise
    return paths, distinct


def image_runs(fastcoll, image, out_base, valid_nccl: str, rows: int,
               min_wait_ns: int) -> tuple[list[Path], int]:
    """write_runs() for a verified bundle image, on a hardened connection of its own."""
    # One thread uses this connection: no mutex around each of the C code's
    # sqlite3_column_*() calls (13 per row).
    con = apsw.Connection(":memory:", flags=apsw.SQLITE_OPEN_READWRITE |
                          apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI |
                          apsw.SQLITE_OPEN_NOMUTEX)
    try:
        harden(con)
        con.execute("ATTACH DATABASE ? AS b", (image_uri(image),))
        return write_runs(fastcoll, con, "image", valid_nccl, rows, out_base, min_wait_ns,
                          has_queued=image_has_queued(con))
    finally:
        con.close()


#: A sync's return this close after the thread got its CPU back is that wake-up's return.
WAKE_RETURN_NS = 200_000


def correct_wakeups(con, node_id: int, schema: str = "b") -> list[tuple[int, int]]:
    """Move the sampled observations of one node (temp.sample_sp, raw monotonic) back from
    the sync's return to the moment its thread was woken, where the bundle recorded that
    wake-up's run-queue wait (sched_events, at or above the capture's threshold).

    A thread sleeping in a sync is woken by the completion; on a CPU-starved node it
    then waits for a CPU, and its return says the completion came that much later. The
    alignment would read that as the node's clock being ahead and move the straggler
    back by its own lateness (docs/merge.md, "Late wake-ups"). The wait is taken only
    when the thread slept (an off_cpu span in state S or D ending at the same instant:
    a thread preempted while spinning was not woken by the completion) and was woken
    during the sync, and the return came within WAKE_RETURN_NS of getting the CPU.
    Returns the moves made, (temp.sample_sp id, ns), smallest first."""
    # One pass over the node's sched_events: the wake-ups of sampled threads that ended a
    # sleep (the off_cpu and runq_delay spans of one switch-in end at the same instant),
    # indexed by (tid, end) for the lookups below.
    tids = "(SELECT DISTINCT tid FROM temp.sample_sp WHERE node_id = :node AND tid IS NOT NULL)"
    for stmt in (
            "DROP TABLE IF EXISTS temp.wake_fix", "DROP TABLE IF EXISTS temp.slept",
            "DROP TABLE IF EXISTS temp.woke",
            f"""CREATE TEMP TABLE slept AS SELECT pid, tid, timestamp_ns + duration_ns AS e
                  FROM {schema}.sched_events WHERE kind = 'off_cpu'
                   AND prev_state IN ('S', 'D') AND tid IN {tids}
                   AND typeof(timestamp_ns) = 'integer' AND typeof(duration_ns) = 'integer'""",
            "CREATE INDEX temp.slept_end ON slept (tid, e)",
            f"""CREATE TEMP TABLE woke AS SELECT r.pid, r.tid, r.timestamp_ns AS w,
                       r.timestamp_ns + r.duration_ns AS e, r.duration_ns AS move
                  FROM {schema}.sched_events r WHERE r.kind = 'runq_delay'
                   AND r.tid IN {tids} AND typeof(r.timestamp_ns) = 'integer'
                   AND typeof(r.duration_ns) = 'integer' AND r.duration_ns > 0
                   AND EXISTS (SELECT 1 FROM temp.slept s WHERE s.tid = r.tid
                                  AND s.e = r.timestamp_ns + r.duration_ns AND s.pid = r.pid)""",
            "CREATE INDEX temp.woke_end ON woke (tid, e)",
            f"""CREATE TEMP TABLE wake_fix AS
                SELECT o.id, (SELECT k.move FROM temp.woke k
                               WHERE k.tid = o.tid AND k.e BETWEEN o.mono_ns - {WAKE_RETURN_NS}
                                     AND o.mono_ns
                                 AND k.pid = o.pid AND k.w >= o.mono_ns - o.wait_ns
                               ORDER BY k.e DESC LIMIT 1) AS move
                  FROM temp.sample_sp o
                 WHERE o.node_id = :node AND o.mono_ns IS NOT NULL AND o.wait_ns > 0
                   AND o.tid IS NOT NULL"""):
        con.execute(stmt, {"node": node_id} if ":node" in stmt else None)
    con.execute("DELETE FROM temp.wake_fix WHERE move IS NULL")
    con.execute("UPDATE temp.sample_sp SET mono_ns = mono_ns - (SELECT move FROM "
                "temp.wake_fix w WHERE w.id = sample_sp.id) WHERE id IN "
                "(SELECT id FROM temp.wake_fix)")
    moves = con.execute("SELECT id, move FROM temp.wake_fix ORDER BY move, id").fetchall()
    for t in ("wake_fix", "slept", "woke"):
        con.execute(f"DROP TABLE temp.{t}")
    return moves


#: The columns of temp.sample_sp that correct_wakeups reads.
WAKE_COLUMNS = "id, node_id, pid, tid, mono_ns, wait_ns"


def node_wakeups(images, node_id: int, rows) -> list[list[tuple[int, int]]]:
    """correct_wakeups() of one node's images, in order, on a connection of its own
    whose temp.sample_sp holds ``rows`` (WAKE_COLUMNS of the node's sampled
    observations), so that several nodes' sched_events are scanned at once. Returns
    each image's moves; a later image sees the earlier ones' (as on one connection)."""
    con = apsw.Connection(":memory:", flags=apsw.SQLITE_OPEN_READWRITE |
                          apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI |
                          apsw.SQLITE_OPEN_NOMUTEX)
    try:
        harden(con)
        con.execute("CREATE TEMP TABLE sample_sp (id INTEGER PRIMARY KEY, node_id INTEGER, "
                    "pid INTEGER, tid INTEGER, mono_ns INTEGER, wait_ns INTEGER)")
        with con:
            con.executemany("INSERT INTO temp.sample_sp VALUES (?, ?, ?, ?, ?, ?)", rows)
        out = []
        for image in images:
            with attached(con, image, "b"):
                out.append(correct_wakeups(con, node_id))
        return out
    finally:
        con.close()
