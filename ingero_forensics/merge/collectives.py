"""Per-collective results of a merge, computed beside the bulk copy (docs/merge.md).

The merge stages, per node, every sync point and every collective entry (raw
CLOCK_MONOTONIC) in a scratch database. Once the alignment is known, a helper thread
computes from it, on a connection of its own, while the main thread copies the big
tables into fleet.db:

1. completions: per (comm_id_hash, seq), the trimmed mean of the aligned tight
   observations (syncpoints.py), or without any the earliest observation (an upper
   bound), into a file of its own (the nccl_events copy joins it);
2. the ``used`` flags of the sampled sync points;
3. the collectives (entries, last rank in), keyed like them in ``coll_agg``;
4. the clock-condition violations per node, before and after the alignment.

SQLite does it all (the GIL is released while a statement runs), so the two threads
really use two cores. The scratch files are private to the merge.

With the C accelerator (merge/_fastcoll.c) the thread stages nothing: one k-way merge of
the bundles' run files (syncpoints.py), one collective at a time, writes the same
completions, collectives and sampled sync points and counts the same violations. Both
paths define the last rank in the same way: the latest aligned entry, ties to the lowest
(node_id, bundle_id, row id); a rank, bytes or nranks that is not an integer counts as
missing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import apsw

from ..db import harden
from .syncpoints import SORTED_OPS, attached

#: Rows of one collective the C path holds at once (ranks x repeats); beyond it the merge
#: runs its SQL path instead (core.merge_bundles).
MAX_GROUP_ROWS = 1 << 20

def aligned_sql(col: str) -> str:
    """SQL: the aligned value of a raw monotonic column, with node_params p joined."""
    return f"(p.off + {col} + CAST(ROUND({col} * p.slope) AS INTEGER))"


STAGING_DDL = (
    # every sync point (fleet.db keeps the alignment's sample of them)
    "CREATE TABLE IF NOT EXISTS sp (id INTEGER PRIMARY KEY, node_id INTEGER, "
    "bundle_id INTEGER, comm_id_hash TEXT, seq INTEGER, pid INTEGER, tid INTEGER, "
    "mono_ns INTEGER, wait_ns INTEGER, used INTEGER, tight INTEGER)",
    # collective entries as they are (or will be) in fleet.db's nccl_events; rank, bytes
    # and nranks NULL unless integers
    "CREATE TABLE IF NOT EXISTS ent (node_id INTEGER, bundle_id INTEGER, id INTEGER, "
    "comm_id_hash TEXT, seq INTEGER, rank INTEGER, mono_ns INTEGER, op TEXT, bytes INTEGER, "
    "nranks INTEGER, pid INTEGER)",
)


def open_scratch(path) -> apsw.Connection:
    # Used by one thread (sqlite3_interrupt from another is safe without the mutex): no
    # mutex around each of _fastcoll's per-row sqlite3 calls.
    con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READWRITE |
                          apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI |
                          apsw.SQLITE_OPEN_NOMUTEX)
    harden(con)
    for pragma in ("PRAGMA journal_mode = OFF", "PRAGMA synchronous = OFF",
                   "PRAGMA cache_size = -16384", "PRAGMA temp_store = FILE"):
        con.execute(pragma)
    return con


@dataclass
class CollectiveResults:
    violations: dict          # node_id -> (before, after)


class CollectiveJob:
    """The helper thread's work; ``completions_ready`` is set once the completion file
    is complete and closed, ``bundles_read`` once it no longer reads the bundles' files.
    ``interrupt()`` stops it (Ctrl-C, an error elsewhere)."""

    def __init__(self, staging_path, completion_path, params: list[tuple], every: int,
                 ref: int, min_latency_ns: int, bundles: list[tuple], valid_nccl: str,
                 fastcoll=None, runs: list[tuple] = ()):
        self.staging_path = staging_path
        self.completion_path = completion_path
        self.params = params          # (node_id, offset_ns, slope, pre_offset_ns)
        self.every = every
        self.ref = ref
        self.min_latency_ns = min_latency_ns
        self.bundles = bundles        # (node_id, bundle_id, sync points file, image)
        # SQL: the nccl_events rows the merge copies (alias e); or a function of the
        # bundle_id giving it (each bundle's own capture window)
        self.valid_nccl = valid_nccl
        self.fastcoll = fastcoll      # the C path, or None
        self.runs = list(runs)        # C path: (run file, node_id, bundle_id or -1)
        self._stop = bytearray(1)     # set to stop the C path between two collectives
        self.completions_ready = threading.Event()
        self.bundles_read = threading.Event()
        # set once the collectives are aggregated: entry_window is then (first, last)
        # aligned entry over all of them (None, None without any)
        self.aggregated = threading.Event()
        self.entry_window = (None, None)
        self._con = None
        self._lock = threading.Lock()
        self._stopped = False

    def interrupt(self) -> None:
        with self._lock:
            self._stopped = True
            self._stop[0] = 1
            if self._con is not None:
                self._con.interrupt()

    def valid_for(self, bundle_id: int) -> str:
        return self.valid_nccl(bundle_id) if callable(self.valid_nccl) else self.valid_nccl

    def run(self) -> CollectiveResults:
        con = open_scratch(self.staging_path)
        with self._lock:
            if self._stopped:
                con.close()
                raise apsw.InterruptError("interrupted")
            self._con = con
        try:
            return self._run(con)
        finally:
            with self._lock:
                self._con = None
            con.close()

    def _run(self, con) -> CollectiveResults:
        if self.fastcoll is not None:
            return self._run_c(con)
        con.execute("CREATE TEMP TABLE node_params (node_id INTEGER PRIMARY KEY, "
                    "off INTEGER, slope REAL, pre INTEGER)")
        con.executemany("INSERT INTO temp.node_params VALUES (?, ?, ?, ?)", self.params)
        a_sp = aligned_sql("s.mono_ns")
        # Stage the new bundles' sync points (the helper threads' scratch files).
        for node_id, bundle_id, sync_path, _ in self.bundles:
            with attached(con, sync_path, "s"), con:
                con.execute("INSERT INTO sp (node_id, bundle_id, comm_id_hash, seq, pid, tid, "
                            "mono_ns, wait_ns, used, tight) SELECT ?, ?, comm_id_hash, seq, "
                            "pid, tid, mono_ns, wait_ns, 0, tight FROM s.sp",
                            (node_id, bundle_id))
        self._attach_completion(con)
        with con:
            # Sums run relative to ref (any time near the data) so they stay in 64 bits.
            con.execute(COMPLETION_DDL)
            # The tight observations' trimmed mean, else the earliest observation (the
            # C path's rule, to the nanosecond).
            con.execute(f"""
                INSERT INTO cp.completion (comm_id_hash, seq, completion_ns, n, spread, tight)
                SELECT comm_id_hash, seq,
                       :ref + CASE WHEN nt = 0 THEN omin ELSE CAST(CASE WHEN nt >= 3
                           THEN (st - tmin - tmax) / (nt - 2.0)
                           ELSE st * 1.0 / nt END AS INTEGER) END,
                       CASE WHEN nt = 0 THEN n ELSE nt END,
                       CASE WHEN nt = 0 THEN omax - omin ELSE tmax - tmin END, nt
                FROM (SELECT comm_id_hash, seq, COUNT(*) AS n, MIN(a) AS omin, MAX(a) AS omax,
                             SUM(tight) AS nt, SUM(CASE WHEN tight THEN a END) AS st,
                             MIN(CASE WHEN tight THEN a END) AS tmin,
                             MAX(CASE WHEN tight THEN a END) AS tmax
                      FROM (SELECT s.comm_id_hash, s.seq, {a_sp} - :ref AS a, s.tight
                            FROM sp s JOIN temp.node_params p USING (node_id))
                      GROUP BY comm_id_hash, seq)""", {"ref": self.ref})
        with con:
            con.execute("UPDATE sp SET used = 0 WHERE used <> 0")
            con.execute(f"""
                UPDATE sp AS s SET used = 1 FROM temp.node_params p, cp.completion c
                 WHERE s.seq % :every = 0 AND p.node_id = s.node_id AND s.tight
                   AND c.comm_id_hash = s.comm_id_hash AND c.seq = s.seq
                   AND c.tight > 1 AND abs({a_sp} - c.completion_ns) <= 50000""",
                        {"every": self.every})
        con.execute("DETACH DATABASE cp")
        self.completions_ready.set()
        # Stage the new bundles' collective entries: the rows nccl_events gets.
        for node_id, bundle_id, _, image in self.bundles:
            with attached(con, image, "b"), con:
                con.execute("INSERT INTO ent SELECT ?, ?, id, comm_id_hash, seq, "
                            f"{int_or_null('rank')}, "
                            f"timestamp_ns, op, {int_or_null('bytes')}, {int_or_null('nranks')}, "
                            f"{int_or_null('pid')} "
                            "FROM b.nccl_events e WHERE typeof(e.comm_id_hash) = 'text' AND "
                            f"typeof(e.seq) = 'integer' AND {self.valid_for(bundle_id)}",
                            (node_id, bundle_id))
        self.bundles_read.set()
        a_ent = aligned_sql("e.mono_ns")
        with con:
            con.execute("DROP TABLE IF EXISTS coll_agg")
            # Two grouped scans: the aggregates, and the last entry with its rank and node
            # (ties: the lowest node_id, bundle_id, row id).
            con.execute(COLL_AGG_DDL)
            con.execute(f"""
                INSERT INTO coll_agg
                SELECT g.comm_id_hash, g.seq, g.op, g.mismatch, g.nranks, g.ranks_seen,
                       g.bytes, g.first_entry, g.last_pre, l.last_entry, l.rank, l.node_id
                FROM (SELECT e.comm_id_hash, e.seq, MIN(e.op) AS op,
                             (MIN(e.op) <> MAX(e.op) OR COALESCE(MIN(e.bytes) <> MAX(e.bytes), 0))
                                 AS mismatch,
                             MAX(e.nranks) AS nranks,
                             COUNT(DISTINCT COALESCE(e.rank, -1 - (e.node_id * 4294967296
                                   + (COALESCE(e.pid, 0) & 4294967295)))) AS ranks_seen,
                             MAX(e.bytes) AS bytes, MIN({a_ent}) AS first_entry,
                             MAX(e.mono_ns + p.pre) AS last_pre
                      FROM ent e JOIN temp.node_params p USING (node_id)
                      GROUP BY e.comm_id_hash, e.seq) g
                JOIN (SELECT comm_id_hash, seq, a AS last_entry, rank, node_id FROM (
                          SELECT e.comm_id_hash, e.seq, {a_ent} AS a, e.rank, e.node_id,
                                 ROW_NUMBER() OVER (PARTITION BY e.comm_id_hash, e.seq
                                     ORDER BY {a_ent} DESC, e.node_id, e.bundle_id, e.id) AS k
                          FROM ent e JOIN temp.node_params p USING (node_id))
                      WHERE k = 1) l USING (comm_id_hash, seq)
                ORDER BY g.comm_id_hash, g.seq""")
        self._aggregated(con)
        # Scalasca-style clock condition: an observed completion before the latest entry
        # (plus a minimum latency). Before: clock-sample offsets only; after: final.
        violations = {nid: (before, after) for nid, before, after in con.execute(
            f"SELECT s.node_id, SUM(s.mono_ns + p.pre < g.last_pre + :lat), "
            f"SUM({a_sp} < g.last_entry + :lat) "
            "FROM sp s JOIN temp.node_params p USING (node_id) "
            "JOIN coll_agg g USING (comm_id_hash, seq) GROUP BY s.node_id",
            {"lat": self.min_latency_ns})}
        return CollectiveResults(violations)

    def _aggregated(self, con) -> None:
        self.entry_window = tuple(con.execute("SELECT MIN(first_entry), MAX(last_entry) "
                                              "FROM coll_agg").fetchone())
        self.aggregated.set()

    def _attach_completion(self, con) -> None:
        con.execute("ATTACH DATABASE ? AS cp", (str(self.completion_path),))
        con.execute("PRAGMA cp.journal_mode = OFF")
        con.execute("PRAGMA cp.synchronous = OFF")

    def _run_c(self, con) -> CollectiveResults:
        """The C path: one merge of the run files does it all (see the module doc)."""
        self.bundles_read.set()     # it reads run files only, never the images
        params = {nid: (off, slope, pre) for nid, off, slope, pre in self.params}
        specs = [(str(path), nid, bid, *params[nid]) for path, nid, bid in self.runs]
        self._attach_completion(con)
        with con:
            con.execute(COMPLETION_DDL)
            con.execute("DROP TABLE IF EXISTS coll_agg")
            con.execute(COLL_AGG_DDL)
            con.execute("DELETE FROM sp")       # it keeps the sampled sync points only
            counts = self.fastcoll.aggregate(
                specs, self.every, self.ref, self.min_latency_ns, con.sqlite3_pointer(),
                "INSERT INTO cp.completion (comm_id_hash, seq, completion_ns, n, spread, "
                "tight) VALUES (?, ?, ?, ?, ?, ?)",
                "INSERT INTO coll_agg VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                "INSERT INTO sp (node_id, bundle_id, comm_id_hash, seq, pid, tid, mono_ns, "
                "wait_ns, used, tight) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                SORTED_OPS, self._stop, MAX_GROUP_ROWS)
        con.execute("DETACH DATABASE cp")
        self.completions_ready.set()
        self._aggregated(con)
        violations: dict = {}
        for nid, before, after in counts:
            b, a = violations.get(nid, (0, 0))
            violations[nid] = (b + before, a + after)
        return CollectiveResults(violations)


def int_or_null(col: str) -> str:
    """SQL: column e.col when it holds an integer, else NULL."""
    return f"CASE WHEN typeof(e.{col}) = 'integer' THEN e.{col} END"


#: Keyed by seq first: every nccl_events row copied looks its collective up here, and an
#: integer comparison settles most steps of the search, where comm_id_hash first needs a
#: string comparison at every step (measured: 110 ns less per row copied).
COMPLETION_DDL = ("CREATE TABLE cp.completion (seq INTEGER, comm_id_hash TEXT, "
                  "completion_ns INTEGER, n INTEGER, spread INTEGER, tight INTEGER, "
                  "PRIMARY KEY (seq, comm_id_hash)) WITHOUT ROWID")

COLL_AGG_DDL = """
    CREATE TABLE coll_agg (comm_id_hash TEXT, seq INTEGER, op TEXT,
        mismatch INTEGER, nranks INTEGER, ranks_seen INTEGER, bytes INTEGER,
        first_entry INTEGER, last_pre INTEGER, last_entry INTEGER,
        last_rank INTEGER, last_node INTEGER,
        PRIMARY KEY (comm_id_hash, seq)) WITHOUT ROWID"""
