"""Rows from bundle images into fleet.db: one INSERT ... SELECT per bundle and table with
aligned times and the untrusted-row screen (merge/screen.py), never row by row through
Python; and the table builder of a fresh merge, which builds a share of the big tables
in scratch databases beside the main thread (docs/merge.md, "How the work is split").
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import apsw

from ..bundle.reader import column_or_null
from ..bundle.schema import TABLES_BY_NAME as BUNDLE_TABLES
from ..db import harden
from . import align
from .fleet_schema import (COPIED_TABLES, FLEET_TABLES_BY_NAME, index_ddl, table_ddl,
                           time_point_columns)
from .ranks import COLLECTIVE_RANKS_SQL
from .screen import first_skipped, row_predicate
from .summaries import SUMMARY_OF, host_bin_window, write_summary
from .syncpoints import attached, image_uri

#: Tables copied in pass 1 (small, needed for the alignment) and pass 3 (the rest).
PASS1_TABLES = ("meta", "clock_samples")
PASS3_TABLES = tuple(t for t in COPIED_TABLES if t not in PASS1_TABLES)

#: Page size of a new fleet.db.
FLEET_PAGE_SIZE = int(os.environ.get("INGERO_FLEET_PAGE_SIZE", 16384))

#: Page cache of fleet.db (MiB); a larger one measured no faster, index builds included.
CACHE_MB = 32

#: SQLite's answers to a malformed database file.
CORRUPT_ERRORS = (apsw.CorruptError, apsw.NotADBError)


class CorruptBundle(Exception):
    """A bundle image found corrupt while pass 3 reads it (SQLite reports a malformed
    page; with integrity "none" nothing looked at those pages before). The merge is
    redone without that bundle, which is reported as skipped."""

    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = str(path), reason


def aligned_sql(col: str, p: str = "") -> str:
    """SQL for the aligned value of a raw monotonic column, parameters :off/:slope."""
    return f"(:off{p} + {col} + CAST(ROUND({col} * :slope{p}) AS INTEGER))"


def bundle_predicate(bundle, table: str) -> str:
    """The rows of one bundle's table that the merge copies and the collectives count
    (merge/screen.py)."""
    return row_predicate(table, bundle)


def release_bundles(bundles) -> None:
    for bundle in bundles:
        bundle.close()


def flush_file(path) -> None:
    """Write fleet.db's dirty pages out ahead of the final fsync (best effort: the
    final fsync is what makes the file durable)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


#: Costs per row and per index entry, relative to the main thread copying and indexing
#: a row of a table (fitted to merges of 16 x 2 M events on a 2-core VM): the builder
#: building one (it sorts without a helper thread) 1.2; an nccl_events row (24 columns,
#: the join on the completions) 1.65; the main thread moving a built row and its index
#: entries in (the transfer) 0.5.
_BUILDER_COST, _NCCL_COST, _TRANSFER_COST = 1.2, 1.65, 0.5


#: Tables the builder may take.
_BUILDABLE = ("nccl_events", "cuda_events", "sched_events", "tcp_events", "block_events",
              "host_samples")


def builder_share(rows: dict, move_cost: float = _TRANSFER_COST) -> list:
    """The tables TableBuilder builds, in the order they become ready: nccl_events
    (its rows wait for the completions, which the main thread's need not), then the
    subset of the others that ends the merge soonest, largest first. The main thread
    pays for moving every table in (move_cost per row and index entry: the transfer),
    and the last move cannot overlap
    anything, so it should be small. By row counts from the manifests; a handful of
    candidate tables, so every subset is tried."""
    def units(t):
        return rows[t] * (1 + len(FLEET_TABLES_BY_NAME[t].indexes))

    # Event tables only (the finish reads processes and nccl_comm_events while the
    # builder may still run), and none under 1% of the rows: not worth a scratch database.
    others = sorted((t for t in _BUILDABLE
                     if t != "nccl_events" and rows[t] * 100 >= sum(rows.values())),
                    key=lambda t: (-units(t), t))
    best = None
    for mask in range(1 << len(others)):
        share = [t for k, t in enumerate(others) if mask >> k & 1]
        built = ["nccl_events"] + share
        builder = _NCCL_COST * units("nccl_events") + _BUILDER_COST * sum(map(units, share))
        main = sum(units(t) for t in others if t not in share)
        moves = [move_cost * units(t) for t in built]
        end = max(builder, main + sum(moves[:-1])) + moves[-1]
        if best is None or (end, len(share)) < best[0]:
            best = ((end, len(share)), built)
    return best[1]


class TableBuilder:
    """Whole fleet tables of a fresh merge, built beside the main thread, each in a
    scratch database of its own (``<scratch_base>.<table>``). First the rows of every
    table: per bundle the same INSERT ... SELECT as copy_table, the others while the
    collectives thread computes the completions, nccl_events (which joins them) last.
    ``copies_done`` is then set: the bundle images are no longer needed here. Then the
    indexes, table by table in the given order, each table handed to the main thread by
    ``take_ready()`` as soon as it is complete; the main thread moves it into the still
    empty fleet table in one transfer. What the end of the merge reads from a table is
    read here beside it (``_derive``), as this thread ends before the main thread's
    transfers do. ``interrupt()`` stops it."""

    def __init__(self, scratch_base, tables, completion_path, job, pending, params,
                 stack_rows):
        self.tables = list(tables)
        self.paths = {t: Path(f"{scratch_base}.{t}") for t in self.tables}
        self.completion_path = completion_path
        self.job = job
        self.items = [(i["bundle"], i["node_id"], i["bundle_id"]) for i in pending]
        self.params = params
        self.stack_rows = stack_rows
        self.copies_done = threading.Event()
        self._lock = threading.Lock()
        self._ready = []
        self._ready_event = threading.Event()
        self._cons = {}
        self._stopped = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingero-build")
        self._future = None

    def start(self):
        self._future = self._pool.submit(self._run)

    def take_ready(self, wait: bool = False) -> list:
        """(table, scratch path, {bundle_id: (written, skipped)}, _derive()) of each table finished
        since the last call (with ``wait``, once there is one or the thread has ended);
        re-raises the thread's error."""
        while wait and not self._future.done():
            if self._ready_event.wait(0.05):
                break
        if self._future.done():
            self._future.result()
        with self._lock:
            ready, self._ready = self._ready, []
            self._ready_event.clear()
        return ready

    def ended(self) -> bool:
        """The thread has ended: every table is built, or it failed."""
        return self._future.done()

    def running(self) -> bool:
        """Started and not ended."""
        return self._future is not None and not self._future.done()

    def join(self):
        try:
            self._future.result()
        finally:
            self._pool.shutdown(wait=True)

    def interrupt(self):
        with self._lock:
            self._stopped = True
            for con in self._cons.values():
                con.interrupt()
        self._pool.shutdown(wait=True)

    def remove(self, table):
        for suffix in ("", "-journal"):
            Path(f"{self.paths[table]}{suffix}").unlink(missing_ok=True)

    def _run(self) -> None:
        try:
            counts = {}
            for table in self.tables[1:] + self.tables[:1]:
                counts[table] = self._copy(table)
            self.copies_done.set()
            for table in self.tables:
                con = self._cons[table]
                with con:
                    for stmt in index_ddl(FLEET_TABLES_BY_NAME[table]):
                        con.execute(stmt)
                    derived = self._derive(con, table)
                with self._lock:
                    del self._cons[table]
                con.close()
                with self._lock:
                    self._ready.append((table, image_uri(self.paths[table]), counts[table],
                                        derived))
                    self._ready_event.set()
        finally:
            with self._lock:
                cons, self._cons = list(self._cons.values()), {}
            for con in cons:
                con.close()

    def _derive(self, con, table) -> dict:
        """What the end of the merge reads from this table, read from it here: the
        distinct ranks of the collectives ("collective_ranks": merge/ranks.py), or its
        summary table written beside it ("summary": merge/summaries.py, moved in with
        the table)."""
        if table == "nccl_events":
            # read even when every process names its rank (then unused): the scan costs
            # this thread about 0.13 us a row, and the builder_share costs leave it out
            return {"collective_ranks": con.execute(COLLECTIVE_RANKS_SQL).fetchall()}
        summary = SUMMARY_OF.get(table)
        if summary is None:
            return {}
        window = None
        if summary == "host_bins":
            # its bins start at the first collective: known once the collectives thread
            # has aggregated them (long before, on the C path); if not yet, the main
            # thread writes host_bins at the end rather than this one waiting here
            if not self.job.aggregated.is_set():
                return {}
            window = host_bin_window(*self.job.entry_window)
        con.execute(table_ddl(FLEET_TABLES_BY_NAME[summary]))
        write_summary(con, summary, window)
        return {"summary": summary}

    def _copy(self, table) -> dict:
        self.remove(table)
        with self._lock:
            if self._stopped:       # before the file exists: none left after a Ctrl-C
                raise apsw.InterruptError("interrupted")
            # URI: the completions and the images are attached by URI (read-only,
            # immutable)
            con = apsw.Connection(str(self.paths[table]), flags=apsw.SQLITE_OPEN_READWRITE |
                                  apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI)
            self._cons[table] = con
        harden(con)
        # The journal in memory (a defensive connection refuses OFF): a new database's
        # pages are not journaled, so it holds a few pages per transaction.
        for pragma in ("PRAGMA journal_mode = MEMORY", "PRAGMA synchronous = OFF",
                       f"PRAGMA page_size = {FLEET_PAGE_SIZE}",
                       f"PRAGMA cache_size = -{CACHE_MB * 1024}",
                       "PRAGMA temp_store = FILE", "PRAGMA locking_mode = EXCLUSIVE"):
            con.execute(pragma)
        con.execute(table_ddl(FLEET_TABLES_BY_NAME[table]))
        stacks = "stack_id" in BUNDLE_TABLES[table].column_names
        if stacks:
            con.execute("CREATE TEMP TABLE stack_map_all (bundle_id INTEGER, "
                        "local_id INTEGER, fleet_id INTEGER, PRIMARY KEY (bundle_id, "
                        "local_id)) WITHOUT ROWID")
            con.execute("CREATE TEMP TABLE stack_map (local_id INTEGER PRIMARY KEY, "
                        "fleet_id INTEGER)")
            con.executemany("INSERT INTO temp.stack_map_all VALUES (?, ?, ?)",
                            self.stack_rows)
        if table == "nccl_events":
            while not self.job.completions_ready.wait(0.05):
                if self._stopped:
                    raise apsw.InterruptError("interrupted")
            con.execute("ATTACH DATABASE ? AS cp", (image_uri(self.completion_path),))
            con.execute("PRAGMA cp.cache_size = -32768")
        counts = {}
        for bundle, node_id, bundle_id in self.items:
            with attached(con, bundle.db_path, "b"), con:
                if stacks:
                    load_stack_map(con, bundle_id)
                counts[bundle_id] = copy_bundle_table(con, table, bundle, node_id,
                                                       bundle_id, self.params[node_id])
        if table == "nccl_events":
            con.execute("DETACH DATABASE cp")
        # Its pages are written: keep the memory of several open scratch databases down.
        con.execute("PRAGMA shrink_memory")
        return counts


class CorruptOutput(Exception):
    """A malformed page met while copying, in the database written to (an existing
    fleet.db that was damaged before this merge), not in the bundle: the merge stops
    and names fleet.db instead of skipping sound bundles."""


def copy_bundle_table(con, table, bundle, node_id, bundle_id, p) -> tuple[int, int]:
    """copy_table, a malformed page of the bundle raising CorruptBundle; one of the
    database written to, CorruptOutput."""
    try:
        return copy_table(con, table, bundle, node_id, bundle_id, p)
    except CORRUPT_ERRORS as e:
        why = f"{type(e).__name__}: {' '.join(str(e).split())}; table {table}"
        if not _image_sound(con, "b"):
            raise CorruptBundle(bundle.path, f"database is corrupt ({why})") from None
        if not _image_sound(con, "main"):
            raise CorruptOutput(why) from None
        raise       # neither side fails quick_check: the error as it came


def _image_sound(con, schema: str) -> bool:
    """Whether a database of con (the attached bundle image, or the one written to)
    passes SQLite's quick_check: only asked after a copy met a malformed page, to tell
    which side it was on."""
    try:
        return [r[0] for r in con.execute(f"PRAGMA {schema}.quick_check(1)")] == ["ok"]
    except (apsw.Error, ValueError):
        return False


def load_stack_map(con, bundle_id: int) -> None:
    con.execute("DELETE FROM temp.stack_map")
    con.execute("INSERT INTO temp.stack_map SELECT local_id, fleet_id FROM "
                "temp.stack_map_all WHERE bundle_id = ?", (bundle_id,))


def copy_table(con, table: str, bundle, node_id: int, bundle_id: int,
                p: align.NodeAlignment | None) -> tuple[int, int]:
    """INSERT ... SELECT one bundle table into main (fleet.db, or the scratch database
    of TableBuilder); returns (written, skipped)."""
    want = bundle.manifest["tables"].get(table)
    if table in getattr(bundle, "absent_tables", ()):
        return 0, 0             # an optional table (bundle format 1.1) this bundle lacks
    if table == "meta":
        con.execute("INSERT INTO meta (bundle_id, node_id, key, value) SELECT ?, ?, key, value "
                    "FROM b.meta WHERE key IS NOT NULL AND value IS NOT NULL",
                    (bundle_id, node_id))
        return con.changes(), 0
    bt = BUNDLE_TABLES[table]
    ft = FLEET_TABLES_BY_NAME[table]
    times = time_point_columns(table)
    data_cols = [c.name for c in bt.columns if c.name != "id"]
    sel = {}
    for c in data_cols:
        sel[c] = column_or_null(bundle, table, c)
    for c in times:
        if sel[c] != "NULL":
            sel[c] = aligned_sql(f"e.{c}")
    joins = ""
    if "stack_id" in data_cols:
        sel["stack_id"] = "sm.fleet_id"
        joins += " LEFT JOIN temp.stack_map sm ON sm.local_id = e.stack_id"
    extra = {"node_id": ":node", "bundle_id": ":bundle"}
    if times:
        extra["mono_ns"] = f"e.{times[0]}"
    if table == "nccl_events":
        a = aligned_sql("e.timestamp_ns")
        sel["duration_ns"] = (f"CASE WHEN c.completion_ns > {a} + e.duration_ns "
                              f"THEN c.completion_ns - {a} ELSE e.duration_ns END")
        extra["call_duration_ns"] = "e.duration_ns"
        extra["completion_ns"] = "c.completion_ns"
        joins += (" LEFT JOIN cp.completion c ON c.seq = e.seq "
                  "AND c.comm_id_hash = e.comm_id_hash")
    cols = list(sel) + list(extra)
    assert set(cols) <= set(ft.column_names), (table, set(cols) - set(ft.column_names))
    sql = (f"INSERT INTO main.{table} ({', '.join(cols)}) SELECT "
           f"{', '.join(list(sel.values()) + list(extra.values()))} "
           f"FROM b.{table} e{joins} WHERE {bundle_predicate(bundle, table)}")
    binds = {"node": node_id, "bundle": bundle_id}
    if times:
        binds.update(off=p.offset_ns, slope=p.slope)
    con.execute(sql, binds)
    written = con.changes()
    skipped = max((want or 0) - written, 0)
    if skipped and hasattr(bundle, "skip_reasons"):
        why = first_skipped(con, table, bundle)
        if why:
            bundle.skip_reasons[table] = why
    return written, skipped
