"""Per-collective results of a merge, computed beside the bulk copy (docs/merge.md).

The merge stages, per node, every sync point and every collective entry (raw
CLOCK_MONOTONIC) in a scratch database. Once the alignment is known, a helper thread
computes from it, on a connection of its own, while the main thread copies the big
tables into fleet.db:

1. completions: per (comm_id_hash, seq), the trimmed mean of the aligned observed
   completions, into a file of its own (the nccl_events copy joins it);
2. the ``used`` flags of the sampled sync points;
3. the collectives (entries, last rank in), keyed like them in ``coll_agg``;
4. the clock-condition violations per node, before and after the alignment.

SQLite does it all (the GIL is released while a statement runs), so the two threads
really use two cores. The scratch files are private to the merge.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import apsw

from ..db import harden
from .syncpoints import attached

def aligned_sql(col: str) -> str:
    """SQL: the aligned value of a raw monotonic column, with node_params p joined."""
    return f"(p.off + {col} + CAST(ROUND({col} * p.slope) AS INTEGER))"


STAGING_DDL = (
    # every sync point (fleet.db keeps the alignment's sample of them)
    "CREATE TABLE IF NOT EXISTS sp (id INTEGER PRIMARY KEY, node_id INTEGER, "
    "bundle_id INTEGER, comm_id_hash TEXT, seq INTEGER, pid INTEGER, tid INTEGER, "
    "mono_ns INTEGER, wait_ns INTEGER, used INTEGER)",
    # collective entries exactly as they are (or will be) in fleet.db's nccl_events
    "CREATE TABLE IF NOT EXISTS ent (node_id INTEGER, comm_id_hash TEXT, seq INTEGER, "
    "rank INTEGER, mono_ns INTEGER, op TEXT, bytes INTEGER, nranks INTEGER)",
)


def open_scratch(path) -> apsw.Connection:
    con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READWRITE |
                          apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI)
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
                 ref: int, min_latency_ns: int, bundles: list[tuple], valid_nccl: str):
        self.staging_path = staging_path
        self.completion_path = completion_path
        self.params = params          # (node_id, offset_ns, slope, pre_offset_ns)
        self.every = every
        self.ref = ref
        self.min_latency_ns = min_latency_ns
        self.bundles = bundles        # (node_id, bundle_id, sync points file, image)
        self.valid_nccl = valid_nccl  # SQL: the nccl_events rows the merge copies (alias e)
        self.completions_ready = threading.Event()
        self.bundles_read = threading.Event()
        self._con = None
        self._lock = threading.Lock()
        self._stopped = False

    def interrupt(self) -> None:
        with self._lock:
            self._stopped = True
            if self._con is not None:
                self._con.interrupt()

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
        con.execute("CREATE TEMP TABLE node_params (node_id INTEGER PRIMARY KEY, "
                    "off INTEGER, slope REAL, pre INTEGER)")
        con.executemany("INSERT INTO temp.node_params VALUES (?, ?, ?, ?)", self.params)
        a_sp = aligned_sql("s.mono_ns")
        # Stage the new bundles' sync points (the helper threads' scratch files).
        for node_id, bundle_id, sync_path, _ in self.bundles:
            with attached(con, sync_path, "s"), con:
                con.execute("INSERT INTO sp (node_id, bundle_id, comm_id_hash, seq, pid, tid, "
                            "mono_ns, wait_ns, used) SELECT ?, ?, comm_id_hash, seq, pid, tid, "
                            "mono_ns, wait_ns, 0 FROM s.sp", (node_id, bundle_id))
        con.execute("ATTACH DATABASE ? AS cp", (str(self.completion_path),))
        con.execute("PRAGMA cp.journal_mode = OFF")
        con.execute("PRAGMA cp.synchronous = OFF")
        with con:
            # Sums run relative to ref (any time near the data) so they stay in 64 bits.
            con.execute("CREATE TABLE cp.completion (comm_id_hash TEXT, seq INTEGER, "
                        "completion_ns INTEGER, n INTEGER, spread INTEGER, "
                        "PRIMARY KEY (comm_id_hash, seq)) WITHOUT ROWID")
            con.execute(f"""
                INSERT INTO cp.completion (comm_id_hash, seq, completion_ns, n, spread)
                SELECT comm_id_hash, seq,
                       :ref + CAST(CASE WHEN COUNT(*) >= 3
                           THEN (SUM(a) - MIN(a) - MAX(a)) / (COUNT(*) - 2.0)
                           ELSE AVG(a) END AS INTEGER),
                       COUNT(*), MAX(a) - MIN(a)
                FROM (SELECT s.comm_id_hash, s.seq, {a_sp} - :ref AS a
                      FROM sp s JOIN temp.node_params p USING (node_id))
                GROUP BY comm_id_hash, seq""", {"ref": self.ref})
        with con:
            con.execute("UPDATE sp SET used = 0 WHERE used <> 0")
            con.execute(f"""
                UPDATE sp AS s SET used = 1 FROM temp.node_params p, cp.completion c
                 WHERE s.seq % :every = 0 AND p.node_id = s.node_id
                   AND c.comm_id_hash = s.comm_id_hash AND c.seq = s.seq
                   AND c.n > 1 AND abs({a_sp} - c.completion_ns) <= 50000""",
                        {"every": self.every})
        con.execute("DETACH DATABASE cp")
        self.completions_ready.set()
        # Stage the new bundles' collective entries: the rows nccl_events gets.
        for node_id, _, _, image in self.bundles:
            with attached(con, image, "b"), con:
                con.execute("INSERT INTO ent SELECT ?, comm_id_hash, seq, rank, timestamp_ns, "
                            "op, bytes, nranks FROM b.nccl_events e WHERE e.comm_id_hash IS NOT "
                            f"NULL AND e.seq IS NOT NULL AND {self.valid_nccl}", (node_id,))
        self.bundles_read.set()
        a_ent = aligned_sql("e.mono_ns")
        with con:
            con.execute("DROP TABLE IF EXISTS coll_agg")
            # Two grouped scans: the aggregates, and the last entry with its rank and node
            # (a bare-column MAX needs a query with no other min/max).
            con.execute("""
                CREATE TABLE coll_agg (comm_id_hash TEXT, seq INTEGER, op TEXT,
                    mismatch INTEGER, nranks INTEGER, ranks_seen INTEGER, bytes INTEGER,
                    first_entry INTEGER, last_pre INTEGER, last_entry INTEGER,
                    last_rank INTEGER, last_node INTEGER,
                    PRIMARY KEY (comm_id_hash, seq)) WITHOUT ROWID""")
            con.execute(f"""
                INSERT INTO coll_agg
                SELECT g.comm_id_hash, g.seq, g.op, g.mismatch, g.nranks, g.ranks_seen,
                       g.bytes, g.first_entry, g.last_pre, l.last_entry, l.rank, l.node_id
                FROM (SELECT e.comm_id_hash, e.seq, MIN(e.op) AS op,
                             (MIN(e.op) <> MAX(e.op) OR COALESCE(MIN(e.bytes) <> MAX(e.bytes), 0))
                                 AS mismatch,
                             MAX(e.nranks) AS nranks,
                             COUNT(DISTINCT COALESCE(e.rank, -1 - e.node_id)) AS ranks_seen,
                             MAX(e.bytes) AS bytes, MIN({a_ent}) AS first_entry,
                             MAX(e.mono_ns + p.pre) AS last_pre
                      FROM ent e JOIN temp.node_params p USING (node_id)
                      GROUP BY e.comm_id_hash, e.seq) g
                JOIN (SELECT e.comm_id_hash, e.seq, MAX({a_ent}) AS last_entry, e.rank,
                             e.node_id
                      FROM ent e JOIN temp.node_params p USING (node_id)
                      GROUP BY e.comm_id_hash, e.seq) l USING (comm_id_hash, seq)
                ORDER BY g.comm_id_hash, g.seq""")
        # Scalasca-style clock condition: an observed completion before the latest entry
        # (plus a minimum latency). Before: clock-sample offsets only; after: final.
        violations = {nid: (before, after) for nid, before, after in con.execute(
            f"SELECT s.node_id, SUM(s.mono_ns + p.pre < g.last_pre + :lat), "
            f"SUM({a_sp} < g.last_entry + :lat) "
            "FROM sp s JOIN temp.node_params p USING (node_id) "
            "JOIN coll_agg g USING (comm_id_hash, seq) GROUP BY s.node_id",
            {"lat": self.min_latency_ns})}
        return CollectiveResults(violations)
