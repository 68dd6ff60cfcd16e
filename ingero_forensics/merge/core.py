"""merge_bundles: many node bundles -> one fleet.db (see docs/merge.md, docs/fleet-db.md).

The output is built in a temporary file next to it and renamed into place at the end, so
an error, Ctrl-C or kill leaves any previous fleet.db untouched; ``-o existing.db`` works
on a copy. Bundles are untrusted: each is verified by ``bundle.open_bundle`` and then
ATTACHed read-only to a hardened connection; rows move with INSERT ... SELECT, never
row by row through Python, and no SQL stored in a bundle is ever executed.

Three passes (docs/merge.md, "How the work is split"): (1) per bundle, two helper
threads verify, decompress and extract sync points ahead while the main thread resolves
the node and copies the small tables (meta, stacks, clock_samples); (2) align all nodes
on a sample of the sync points; (3) per bundle, copy the big tables with aligned times
while a thread of their own computes completions, collectives and violations
(collectives.py), and in a fresh merge another builds a share of the tables in regions
of the output file, spliced in by their pages at the end (_TableBuilder, _splice.c);
then the indexes, the collectives and the node facts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import re
import json
import math
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import apsw

from .. import __version__
from .. import accel as _accel
from ..bundle.container import read_manifest
from ..bundle.reader import column_or_null, open_bundle
from ..bundle.schema import TABLES_BY_NAME as BUNDLE_TABLES
from ..db import harden
from ..errors import BundleError, IngeroError
from . import align
from .inflight import settle_in_flight
from .fleet_schema import (COPIED_TABLES, FLEET_APPLICATION_ID, FLEET_TABLES_BY_NAME,
                           FLEET_VERSION, all_index_ddl, fleet_ddl, index_ddl, table_ddl,
                           time_point_columns)
from .stacks import canonical_stack, stack_hash
from .causal import FULL_DEPENDENCY_OPS
from .ranks import process_ranks
from .collectives import STAGING_DDL, CollectiveJob, int_or_null as _int, open_scratch
from .syncpoints import (SORTED_OPS, SYNC_APIS, TIGHT_LAG_NS, TIGHT_MAX_OPS, TIME_BOUND,
                         attached,
                         extract_fleet_sync_points, extract_sync_points, file_uri,
                         image_runs, image_uri, write_runs)
#: A synchronization shorter than this did not wait (the rank arrived after completion).
DEFAULT_MIN_WAIT_NS = 20_000
#: Clock condition: a completion cannot be observed before the last entry plus this.
DEFAULT_MIN_LATENCY_NS = 1_000
#: Collectives (at most, about) the alignment looks at; more adds time, not accuracy.
ALIGN_SAMPLE = 5_000
#: Page cache of fleet.db (MiB); a larger one measured no faster, index builds included.
CACHE_MB = 32
#: Page size of a new fleet.db.
FLEET_PAGE_SIZE = int(os.environ.get("INGERO_FLEET_PAGE_SIZE", 16384))
#: Threads that verify, decompress and extract sync points ahead of the copying thread
#: (zstd, sha256 and SQLite release the GIL, so they run on other cores).
PREFETCH_THREADS = 2
#: Where the table builder's databases start in the temporary fleet file when their pages
#: are spliced in (merge/_splice.c): region r at (r + 1) TiB, the file sparse between.
REGION_STRIDE = 1 << 40
#: Tables copied in pass 1 (small, needed for the alignment) and pass 3 (the rest).
PASS1_TABLES = ("meta", "clock_samples")
PASS3_TABLES = tuple(t for t in COPIED_TABLES if t not in PASS1_TABLES)
#: A row whose monotonic time point lies further than this outside its bundle's capture
#: window (manifest capture.start/end_mono_ns) is not merged: it is skipped and counted.
WINDOW_MARGIN_NS = 600 * 1_000_000_000
#: The same for a clock sample's realtime reading and the capture's UTC window; wider,
#: as a node's clock may be stepped during the capture (but not into another century).
REALTIME_MARGIN_NS = 86_400 * 1_000_000_000


class MergeError(IngeroError):
    """The merge cannot proceed (bad output, --strict with a skipped input)."""


class _CorruptBundle(Exception):
    """A bundle image found corrupt while pass 3 reads it (SQLite reports a malformed
    page; with integrity "none" nothing looked at those pages before). The merge is
    redone without that bundle, which is reported as skipped."""

    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = str(path), reason


#: SQLite's answers to a malformed database file.
_CORRUPT = (apsw.CorruptError, apsw.NotADBError)


@dataclass
class MergeResult:
    output: str
    bundles_merged: int = 0
    bundles_already: int = 0
    skipped: list[dict] = field(default_factory=list)       # {input, reason}
    warnings: list[str] = field(default_factory=list)
    nodes: list[dict] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)      # written this run, per table
    stacks: dict = field(default_factory=dict)
    events: int = 0
    elapsed_s: float = 0.0
    accelerated: bool = False    # the collectives ran in C (merge/_fastcoll.c)

    @property
    def events_per_s(self) -> float:
        return self.events / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["events_per_s"] = round(self.events_per_s)
        return d


# ---------------------------------------------------------------------------- inputs

def expand_inputs(inputs) -> list[tuple[str, Path | None, str | None]]:
    """Files, directories (every *.bundle inside) and globs -> [(shown, path, error)].
    Order is stable (sorted within a directory or glob); duplicates are dropped."""
    out, seen = [], set()

    def add(p: Path):
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            out.append((str(p), p, None))
    for item in inputs:
        item = str(item)
        p = Path(item)
        if p.is_dir():
            found = sorted(p.glob("*.bundle"))
            if not found:
                out.append((item, None, "directory holds no *.bundle files"))
            for f in found:
                add(f)
        elif p.exists():
            add(p)
        elif any(ch in item for ch in "*?["):
            found = sorted(glob.glob(item))
            if not found:
                out.append((item, None, "no file matches this pattern"))
            for f in found:
                add(Path(f))
        else:
            out.append((item, None, "no such file or directory"))
    return out


def list_bundles(inputs) -> list[dict]:
    """Each input's manifest, read without decompressing: {input, manifest} or
    {input, error}."""
    res = []
    for shown, path, err in expand_inputs(inputs):
        if err:
            res.append({"input": shown, "error": err})
            continue
        try:
            res.append({"input": shown, "manifest": read_manifest(path)})
        except BundleError as e:
            res.append({"input": shown, "error": e.reason})
    return res


# ---------------------------------------------------------------------------- helpers

def _utc_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _aligned(col: str, p: str = "") -> str:
    """SQL for the aligned value of a raw monotonic column, parameters :off/:slope."""
    return f"(:off{p} + {col} + CAST(ROUND({col} * :slope{p}) AS INTEGER))"


#: The storage classes a column of each declared type may hold (SQLite stores any value
#: in any column; the readers of fleet.db rely on these).
_STORAGE = {"INTEGER": "'integer'", "REAL": "'real', 'integer'", "TEXT": "'text'"}
#: Kernel and job identifiers: small non-negative integers (Linux pids stay below
#: 2^22, ranks below a job's size); outside [0, 2^32) a row is skipped, as the readers
#: compute with them (sort keys, track ids).
_ID_COLUMNS = ("pid", "tid", "owner_pid", "other_pid", "other_tid", "rank", "nranks",
               "local_rank", "world_size", "local_world_size", "node_rank", "cpu")


def _valid_predicate(table: str, alias: str = "e", absent=frozenset()) -> str:
    """Rows of an untrusted bundle that can be merged: enums known, NOT NULL columns set,
    every value of its column's type (text or a blob in an INTEGER column would fail
    export and query later), time points integers. The rest is skipped and counted.
    absent: optional columns the bundle lacks (format 1.0), not referred to."""
    t = BUNDLE_TABLES[table]
    conds = []
    times = set(time_point_columns(table)) | {"mono_before_ns", "mono_after_ns"}
    for c in t.columns[1:] if t.columns[0].name == "id" else t.columns:
        if c.name in absent:
            continue
        ref = f"{alias}.{c.name}"
        conds.append(f"typeof({ref}) IN ({_STORAGE[c.type]}, 'null')")
        if c.name in _ID_COLUMNS:
            conds.append(f"({ref} IS NULL OR {ref} BETWEEN 0 AND 4294967295)")
        if c.values:
            vals = ", ".join("'" + v.replace("'", "''") + "'" for v in c.values)
            conds.append(f"({ref} IN ({vals})" + (f" OR {ref} IS NULL)" if c.nullable else ")"))
        elif not c.nullable:
            conds.append(f"{ref} IS NOT NULL")
        if c.name in times or (c.name == "duration_ns" and table == "nccl_events"):
            conds.append(f"(typeof({ref}) = 'integer'" +
                         (f" OR {ref} IS NULL)" if c.nullable else ")"))
            # within syncpoints.TIME_BOUND (a duration not negative): both collective
            # paths count exactly these rows, and their sums fit in int64
            lo = 0 if c.name == "duration_ns" else -TIME_BOUND
            conds.append(f"({ref} IS NULL OR {ref} BETWEEN {lo} AND {TIME_BOUND})")
    return " AND ".join(conds) or "1"


def _bundle_predicate(bundle, table: str) -> str:
    """_valid_predicate for one bundle's table (its absent optional columns left out)
    and _in_window: the rows of it the merge copies and the collectives count."""
    absent = getattr(bundle, "absent", {}).get(table, frozenset())
    return _valid_predicate(table, absent=absent) + _in_window(bundle, table)


def _in_window(bundle, table: str, alias: str = "e") -> str:
    """SQL (`` AND ...``) keeping the rows whose time points lie in the bundle's capture
    window plus WINDOW_MARGIN_NS (REALTIME_MARGIN_NS for realtime readings): a time at
    int64 max or centuries away would otherwise become the fleet's start or jitter.
    The bounds are integers from the validated manifest."""
    cap = bundle.manifest["capture"]
    lo, hi = cap["start_mono_ns"] - WINDOW_MARGIN_NS, cap["end_mono_ns"] + WINDOW_MARGIN_NS
    cols = [c for c in time_point_columns(table) if column_or_null(bundle, table, c) != "NULL"]
    conds = [(c, lo, hi) for c in cols]
    if table == "clock_samples":
        conds += [(c, lo, hi) for c in ("mono_before_ns", "mono_after_ns")]
        conds.append(("realtime_ns", cap["start_utc_ns"] - REALTIME_MARGIN_NS,
                      cap["end_utc_ns"] + REALTIME_MARGIN_NS))
    return "".join(f" AND ({alias}.{c} IS NULL OR {alias}.{c} BETWEEN {max(a, -(1 << 63))} "
                   f"AND {min(b, (1 << 63) - 1)})" for c, a, b in conds)


def check_fleet(path: Path) -> None:
    try:
        con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            harden(con)
            app = con.execute("PRAGMA application_id").fetchone()[0]
            ver = con.execute("PRAGMA user_version").fetchone()[0]
        finally:
            con.close()
    except apsw.Error as e:
        raise MergeError(f"{path}: cannot open as a fleet.db ({e})") from None
    if app != FLEET_APPLICATION_ID:
        raise MergeError(f"{path}: exists and is not a fleet.db (application_id {app:#x}); "
                         "refusing to overwrite it")
    if ver > FLEET_VERSION:
        raise MergeError(f"{path}: fleet.db version {ver} is newer than this tool supports")
    if ver < FLEET_VERSION:
        raise MergeError(f"{path}: fleet.db version {ver} was made by an older ingero-merge; "
                         "merge its bundles into a new file instead of extending it")


class _Fleet:
    """The connection to the temporary fleet database and small caches."""

    def __init__(self, path: Path, fresh: bool):
        self.path = path
        self.con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READWRITE |
                                   apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI)
        harden(self.con)
        self.con.config(apsw.SQLITE_DBCONFIG_ENABLE_TRIGGER, 0)
        # The file is private until the final rename: durability is given by one fsync at
        # the end, not by syncing every commit. Memory stays bounded (CACHE_MB).
        # Sorts (index builds, GROUP BY) may use a helper thread: 2 cores, not 1. The
        # rollback journal stays on disk: in memory it held every page the whole-table
        # UPDATEs touch (792 MiB peak at 32 M rows), and ROLLBACK must keep working.
        for pragma in ("PRAGMA synchronous = OFF", f"PRAGMA cache_size = -{CACHE_MB * 1024}",
                       "PRAGMA temp_store = FILE", "PRAGMA locking_mode = EXCLUSIVE",
                       "PRAGMA threads = 2"):
            self.con.execute(pragma)
        if fresh:
            # Larger pages: fewer b-tree pages to split, link and write in the bulk load
            # and index builds (measured: index builds about a third faster than at 4 KiB).
            self.con.execute(f"PRAGMA page_size = {FLEET_PAGE_SIZE}")
            with self.con:
                for stmt in fleet_ddl():
                    self.con.execute(stmt)
        self.con.execute("CREATE TEMP TABLE stack_map (local_id INTEGER PRIMARY KEY, "
                         "fleet_id INTEGER)")
        self.stacks = {h: (sid, fr) for sid, h, fr in
                       self.con.execute("SELECT stack_id, hash, frames FROM stacks")}

    def log(self, level, event, message, *, input=None, node_id=None, count=None):
        self.con.execute("INSERT INTO merge_log (merged_utc, level, input, node_id, event, "
                         "message, count) VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (_utc_iso(), level, input, node_id, event, message, count))


# ------------------------------------------------------------------------------ merge

def merge_bundles(inputs, out_path, *, strict: bool = False, progress=None,
                  tmpdir=None, integrity: str = "none",
                  min_wait_ns: int = DEFAULT_MIN_WAIT_NS,
                  min_latency_ns: int = DEFAULT_MIN_LATENCY_NS,
                  accel: bool = True) -> MergeResult:
    """Merge bundles into out_path (created, or extended when it is a fleet.db).

    progress(n) is called after each bundle of each pass (2 x bundles in all).
    Raises MergeError (nothing written) on a bad output or, with strict, on the first
    skipped input. Returns a MergeResult (JSON-serializable with to_dict()).
    accel: the collectives in C (merge/_fastcoll.c) when it is built; the SQL path gives
    the same fleet.db (INGERO_NO_ACCEL=1 turns it off too).
    integrity: the SQLite check run on every image before its rows are read, "quick"
    (PRAGMA quick_check), "full" (integrity_check) or "none". Every image is verified
    byte for byte against its manifest's sha256 and row counts either way; with "none",
    a page SQLite finds malformed while copying skips the bundle as the check would
    have (the merge is redone without it), at no cost for the bundles that are sound.
    """
    fastcoll = _accel.load("merge._fastcoll", "sqlite3_fastcoll_init") if accel else None
    splice = _accel.load("merge._splice", "sqlite3_splice_init") \
        if accel and os.environ.get("INGERO_NO_SPLICE", "") in ("", "0") else None
    corrupt: dict[str, str] = {}
    lock, lock_path = _lock_output(Path(out_path), Path(tmpdir) if tmpdir else None)
    try:
        return _merge_attempts(inputs, out_path, strict, progress, tmpdir, integrity,
                               min_wait_ns, min_latency_ns, fastcoll, splice, corrupt)
    finally:
        # removed while still held: a merge that opened it meanwhile finds, once it has
        # the lock, that the name is no longer its file and takes the new one
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(lock)


def _lock_output(out: Path, tmpdir: Path | None = None) -> tuple[int, Path]:
    """An exclusive lock on ``.<name>.lock`` beside the output, held for the whole merge:
    a second merge into the same file refuses at once (two would each rename their own
    result into place and one's bundles would be lost). Under the lock, scratch files
    that merges killed earlier left beside the output are removed, and a -wal or hot
    journal beside an existing output is settled (_settle_output)."""
    if not out.parent.is_dir():
        raise MergeError(f"{out}: directory {out.parent} does not exist")
    path = out.with_name(f".{out.name}.lock")
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise MergeError(f"{out}: cannot write in {out.parent}: "
                             f"{e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise MergeError(f"{out}: another ingero-merge is writing it (lock "
                                 f"{path.name}); wait for it to finish") from None
            raise MergeError(f"{out}: cannot lock {path.name}: {e.strerror or e}") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            same = False
        if same:
            break
        os.close(fd)                    # its holder removed it as we opened it: again
    try:
        _remove_stale_scratch(out, tmpdir)
        if out.exists():
            check_fleet(out)            # only a fleet.db is settled, nothing else touched
            _settle_output(out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
        raise
    return fd, path


def _remove_stale_scratch(out: Path, tmpdir: Path | None = None) -> None:
    """Files named ``.<name>.<pid>.*`` beside the output that a merge killed before its
    cleanup left (the temporary fleet.db, sparse and of terabyte apparent size with the
    splice, its journal, staging and scratch databases), and decompressed images
    ``ingero-<pid>-*.db`` with their ``.sync`` and run files where images go (--tmpdir,
    else beside the output). Only under the output's lock, and only when that process
    is gone."""
    scratch = re.compile(re.escape(f".{out.name}.") + r"(\d+)\.[A-Za-z0-9_.-]+")
    image = re.compile(r"ingero-(\d+)-[A-Za-z0-9_]+\.db(\.[A-Za-z0-9_.-]+)?")
    found = [(f, scratch.fullmatch(f.name)) for f in out.parent.iterdir()]
    with contextlib.suppress(OSError):
        found += [(f, image.fullmatch(f.name)) for f in (tmpdir or out.parent).iterdir()]
    for f, m in found:
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue                    # alive (not a merge of this output: it holds no lock)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        with contextlib.suppress(OSError):
            if f.is_file() and not f.is_symlink():
                f.unlink()


def _settle_output(out: Path) -> None:
    """An existing output with a -wal (opened in WAL mode by a viewer) or a journal
    beside it: its content is checkpointed into it and the output returned to rollback
    mode, or the merge refuses. Never is a foreign -wal left beside the new file, where
    SQLite would replay it onto it."""
    side = [Path(f"{out}{s}") for s in ("-wal", "-journal")]
    if not out.exists() or not any(p.exists() for p in side):
        return
    try:
        con = apsw.Connection(str(out), flags=apsw.SQLITE_OPEN_READWRITE)
        try:
            con.execute("PRAGMA busy_timeout = 1000")
            mode = con.execute("PRAGMA journal_mode = DELETE").fetchone()[0]
        finally:
            con.close()
    except apsw.Error as e:
        mode = f"{type(e).__name__}: {e}"
    left = [p.name for p in side if p.exists() and p.stat().st_size]
    if str(mode).lower() != "delete" or left:
        raise MergeError(f"{out}: is open in another program ({', '.join(left) or mode} "
                         "could not be checkpointed); close it and merge again")
    for p in side:
        p.unlink(missing_ok=True)


def _merge_attempts(inputs, out_path, strict, progress, tmpdir, integrity, min_wait_ns,
                    min_latency_ns, fastcoll, splice, corrupt) -> MergeResult:
    notes = []
    while True:
        try:
            res = _merge_bundles(inputs, out_path, strict, progress, tmpdir, integrity,
                                 min_wait_ns, min_latency_ns, fastcoll, splice, corrupt)
            res.warnings.extend(notes)
            return res
        except _too_large(fastcoll):
            # A collective with more rows than the C path holds at once (no real job has
            # that many ranks): the SQL path, whose memory stays bounded, does it again.
            fastcoll = None
        except _SpliceFailed as e:
            # Never seen: the plain path (tables moved by SQLite) does it again.
            notes.append(f"spliced pages failed quick_check ({e}); merged again without "
                         "the splice")
            splice = None
        except _CorruptBundle as e:
            # Nothing of this attempt was kept (the output is written only at the end):
            # again, with that bundle skipped for its reason from the start.
            corrupt[e.path] = e.reason
        progress = None     # the bar counted the first attempt


def _too_large(fastcoll):
    return fastcoll.TooLarge if fastcoll is not None else ()


def _merge_bundles(inputs, out_path, strict, progress, tmpdir, integrity, min_wait_ns,
                   min_latency_ns, fastcoll, splice, corrupt) -> MergeResult:
    started = time.monotonic()
    out = Path(out_path)
    res = MergeResult(output=str(out), accelerated=fastcoll is not None)
    progress = progress or (lambda n=1: None)
    fresh = not out.exists()
    if not fresh:
        check_fleet(out)
    if not out.parent.exists():
        raise MergeError(f"{out}: directory {out.parent} does not exist")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    scratch = [out.with_name(f".{out.name}.{os.getpid()}.{x}") for x in ("staging", "completion")]
    pending = []
    try:
        if not fresh:
            shutil.copyfile(out, tmp)
        fl = _Fleet(tmp, fresh)
        fl.staging_path, fl.completion_path = scratch
        fl.fastcoll = fastcoll
        fl.scratch_base = out.with_name(f".{out.name}.{os.getpid()}")
        fl.old_runs = []
        fl.builder = None
        fl.flusher = None
        fl.splice = splice
        fl.region_fd = None     # regions in use (the builder writes into fleet.db itself)
        fl.spliced = []         # (offset, pointer pages, [(local root, fleet root)])
        fl.spliced_tables = []  # their names, checked after the splice (_verify_spliced)
        scratch.extend(Path(f"{fl.scratch_base}.{t}") for t in PASS3_TABLES)
        try:
            entries = [(shown, path, corrupt.get(str(path), err))
                       for shown, path, err in expand_inputs(inputs)]
            _merge(fl, entries, res, strict, progress,
                   Path(tmpdir) if tmpdir else out.parent, integrity, min_wait_ns,
                   min_latency_ns, pending)
        finally:
            for b in pending:
                b["bundle"].close()
            fl.con.close()
            if fl.region_fd is not None:
                os.close(fl.region_fd)   # after the connection: it would drop its lock
            if fl.flusher is not None:
                fl.flusher.join()
            for f in scratch + [r[0] for r in fl.old_runs]:
                f.unlink(missing_ok=True)
        if fl.region_fd is not None:
            # Nothing caches fleet.db's pages any more: the built tables' pages join it.
            _splice_tables(fl)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if os.path.exists(f"{out}-wal") and os.path.getsize(f"{out}-wal"):
            raise MergeError(f"{out}: another program opened it in WAL mode during the "
                             "merge; close it and merge again (nothing was written)")
        os.replace(tmp, out)
        try:
            fd = os.open(str(out.parent), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        except OSError:
            pass
    except BaseException as e:
        for suffix in ("", "-journal"):
            with contextlib.suppress(OSError):      # EROFS too: the error below matters
                os.unlink(f"{tmp}{suffix}")
        # The output side failed (disk full, an unwritable directory): one line, not a
        # traceback; the previous fleet.db is untouched.
        if isinstance(e, apsw.FullError) or (isinstance(e, OSError) and e.errno == 28):
            raise MergeError(f"{out}: the disk is full (nothing was written; free space "
                             "or use --tmpdir for the decompressed bundles)") from None
        if isinstance(e, apsw.Error):
            raise MergeError(f"{out}: merge failed ({type(e).__name__}: {e}); "
                             "nothing was written") from None
        if isinstance(e, OSError):
            raise MergeError(f"{out}: cannot write: {e.strerror or e}") from None
        raise
    res.elapsed_s = time.monotonic() - started
    return res


def _merge(fl: _Fleet, entries, res: MergeResult, strict, progress, tmpdir, integrity,
           min_wait_ns, min_latency_ns, pending) -> None:
    con = fl.con
    fl.min_latency_ns = min_latency_ns
    known_sha = {r[0] for r in con.execute("SELECT sha256 FROM bundles")}
    max_old_bundle = con.execute("SELECT COALESCE(MAX(bundle_id), 0) FROM bundles").fetchone()[0]
    old_params = {r[0]: (r[1], r[2]) for r in
                  con.execute("SELECT node_id, offset_ns, slope FROM clock_alignment")}
    stack_rows_seen = 0
    new_stack_ids: set[int] = set()

    def skip(shown, reason):
        if strict:
            raise MergeError(f"{shown}: {reason} (--strict: nothing was written)")
        res.skipped.append({"input": shown, "reason": reason})
        fl.log("error", "skipped_input", reason, input=shown)

    # ---------------------------------------------------------------- pass 1
    # The scratch database will hold every sync point and collective entry for the
    # thread that computes the collectives during pass 3 (collectives.py); that thread
    # fills it from the bundles. Rows merged by earlier runs are staged here.
    open_scratch(fl.staging_path).close()
    con.execute("ATTACH DATABASE ? AS st", (str(fl.staging_path),))
    con.execute("PRAGMA st.journal_mode = MEMORY")
    con.execute("PRAGMA st.synchronous = OFF")
    with con:
        for stmt in STAGING_DDL:
            con.execute(stmt.replace("EXISTS ", "EXISTS st.", 1))
        fl.collectives_seen = 0
        fl.old_runs = []
        if max_old_bundle and fl.fastcoll is not None:
            # incremental, C path: the rows merged before, one run per node
            for (nid,) in con.execute("SELECT node_id FROM nodes ORDER BY node_id").fetchall():
                rows = sum(con.execute(f"SELECT COUNT(*) FROM {t} WHERE node_id = ? AND "
                                       "bundle_id <= ?", (nid, max_old_bundle)).fetchone()[0]
                           for t in ("nccl_events", "cuda_events"))
                paths, seen = write_runs(fl.fastcoll, con, "fleet",
                                         _valid_predicate("nccl_events"), rows,
                                         fl.scratch_base.with_name(
                                             f"{fl.scratch_base.name}.old{nid}"),
                                         min_wait_ns, (nid, max_old_bundle))
                fl.old_runs += [(p, nid, -1) for p in paths]
                fl.collectives_seen = max(fl.collectives_seen, seen)
        elif max_old_bundle:     # incremental: the rows merged before count too
            extract_fleet_sync_points(con, min_wait_ns, max_old_bundle)
            fl.collectives_seen = con.execute(
                "SELECT COUNT(*) FROM (SELECT DISTINCT comm_id_hash, seq FROM st.sp)").fetchone()[0]
            con.execute("INSERT INTO st.ent SELECT node_id, bundle_id, id, comm_id_hash, seq, "
                        f"{_int('rank')}, mono_ns, op, {_int('bytes')}, {_int('nranks')} "
                        "FROM main.nccl_events e WHERE typeof(comm_id_hash) = 'text' "
                        "AND typeof(seq) = 'integer'")
    # The next bundles are verified, decompressed and their sync points extracted by
    # helper threads while this one is recorded (zstd, sha256 and SQLite release the GIL).
    with contextlib.closing(_prefetch(entries, known_sha, tmpdir, integrity,
                                      min_wait_ns, fl.fastcoll)) as stream:
        for shown, path, err, opened in stream:
            if err:
                skip(shown, err)
                progress(2)
                continue
            if isinstance(opened, BundleError):
                skip(shown, opened.reason)
                progress(2)
                continue
            sha, bundle = opened
            if sha in known_sha:
                if bundle is not None:
                    bundle.close()
                res.bundles_already += 1
                fl.log("info", "already_merged", "bundle already in fleet.db; nothing added",
                       input=shown)
                progress(2)
                continue
            try:
                con.execute("BEGIN")
                node_id = _resolve_node(fl, bundle.manifest, shown, res)
                bundle_id = _insert_bundle(fl, bundle, node_id, sha)
                attached = False
                try:
                    _attach(con, bundle.db_path)
                    attached = True
                    n_stacks = _copy_stacks(fl, shown, node_id, bundle_id, new_stack_ids)
                    stack_rows_seen += n_stacks
                    counts = {"stacks": n_stacks}
                    skipped = {}
                    for t in PASS1_TABLES:
                        counts[t], skipped[t] = _copy_table(con, t, bundle, node_id,
                                                            bundle_id, None)
                    con.execute("COMMIT")
                finally:
                    if not con.getautocommit():
                        con.execute("ROLLBACK")
                    if attached:
                        con.execute("DETACH DATABASE b")
            except (apsw.Error, ValueError, _Conflict) as e:
                if not con.getautocommit():
                    con.execute("ROLLBACK")
                bundle.close()
                skip(shown, str(e) if isinstance(e, _Conflict) else
                     f"cannot merge ({type(e).__name__}: {e})")
                progress(2)
                continue
            except BaseException:
                bundle.close()          # Ctrl-C here: its image is not left behind
                raise
            known_sha.add(sha)
            fl.collectives_seen = max(fl.collectives_seen, bundle.collectives_seen)
            pending.append({"bundle": bundle, "shown": shown, "node_id": node_id,
                            "bundle_id": bundle_id, "counts": counts, "skipped": skipped})
            progress(1)

    if not pending and not old_params and not res.bundles_already:
        reasons = "; ".join(f"{s['input']}: {s['reason']}" for s in res.skipped[:3])
        raise MergeError(f"no usable bundle among the inputs ({reasons})")
    # ---------------------------------------------------------------- pass 2: align
    _sample_sync_points(fl, pending)
    con.execute("BEGIN")
    params = _align(fl, res)
    _check_params(params, pending)
    param_rows = [(a.node_id, a.offset_ns, a.slope, a.pre_offset_ns) for a in params.values()]
    con.execute("CREATE TEMP TABLE node_params (node_id INTEGER PRIMARY KEY, off INTEGER, "
                "slope REAL, pre INTEGER)")
    con.executemany("INSERT INTO temp.node_params VALUES (?, ?, ?, ?)", param_rows)
    con.execute("COMMIT")
    con.execute("DETACH DATABASE st")
    ref = min([a.aligned(m) for a in params.values() for (m,) in con.execute(
        "SELECT MIN(capture_start_mono_ns) FROM bundles WHERE node_id = ?", (a.node_id,))
        if m is not None] or [0])
    job = CollectiveJob(fl.staging_path, fl.completion_path, param_rows, fl.sample_every,
                        ref, min_latency_ns,
                        [(i["node_id"], i["bundle_id"], i["bundle"].sync_path,
                          i["bundle"].db_path) for i in pending],
                        _nccl_predicates(pending), fastcoll=fl.fastcoll,
                        runs=fl.old_runs + [(p, i["node_id"], i["bundle_id"]) for i in pending
                                            for p in i["bundle"].run_paths])
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingero-collectives")
    finished = []

    def finish_collectives():
        """The collectives, sync points, alignment and node facts: they need the
        collectives thread's results but none of the big tables, so pass 3 runs this
        when the main thread would otherwise wait for the table builder."""
        if finished:
            return
        finished.append(True)
        results = future.result()
        con.execute("ATTACH DATABASE ? AS st", (image_uri(fl.staging_path),))
        con.execute("ATTACH DATABASE ? AS cp", (image_uri(fl.completion_path),))
        try:
            with con:
                con.execute("UPDATE clock_samples SET aligned_ns = (SELECT p.off + m + "
                            "CAST(ROUND(m * p.slope) AS INTEGER) FROM (SELECT "
                            "(clock_samples.mono_before_ns + clock_samples.mono_after_ns) / 2 "
                            "AS m), temp.node_params p WHERE p.node_id = clock_samples.node_id)")
                con.execute("UPDATE clock_samples SET clock_error_ns = realtime_ns - aligned_ns")
                _collectives(con, fl.sample_every)
                for nid, a in params.items():
                    a.violations_before, a.violations_after = results.violations.get(nid,
                                                                                     (0, 0))
                _write_alignment(con, params)
                _update_nodes(con)
        finally:
            con.execute("DETACH DATABASE st")
            con.execute("DETACH DATABASE cp")

    try:
        future = pool.submit(job.run)
        _pass3(fl, res, pending, params, job, future, progress, old_params, max_old_bundle,
               finish_collectives)
        finish_collectives()
        # The indexes of the small tables (the big ones have theirs).
        with con:
            for stmt in all_index_ddl():
                con.execute(stmt)
            settle_in_flight(con)
    except BaseException:
        job.interrupt()
        if fl.builder is not None:
            fl.builder.interrupt()
        raise
    finally:
        pool.shutdown(wait=True)
    pending.clear()

    # ---------------------------------------------------------------- finish
    con.execute("BEGIN")
    total_stacks = con.execute("SELECT COUNT(*) FROM stacks").fetchone()[0]
    res.stacks = {"bundle_stacks": stack_rows_seen, "fleet_stacks_used": len(new_stack_ids),
                  "fleet_stacks_total": total_stacks,
                  "dedup_ratio": round(stack_rows_seen / len(new_stack_ids), 2)
                  if new_stack_ids else None}
    res.events = sum(n for t, n in res.rows.items() if t not in ("meta", "stacks"))
    info = {"format_version": FLEET_VERSION, "created_by": f"ingero-forensics {__version__}",
            "updated_utc": _utc_iso(),
            "alignment": {"min_wait_ns": min_wait_ns, "min_latency_ns": min_latency_ns,
                          "sample_step": fl.sample_every,
                          "sync_apis": list(SYNC_APIS),
                          "step_threshold_ns": align.STEP_THRESHOLD_NS,
                          "drift_bound_ppm": align.DRIFT_BOUND_PPM,
                          "tight_max_ops": TIGHT_MAX_OPS, "tight_lag_ns": TIGHT_LAG_NS}}
    con.execute("INSERT OR IGNORE INTO fleet_info VALUES ('created_utc', ?)",
                (json.dumps(_utc_iso()),))
    con.executemany("INSERT OR REPLACE INTO fleet_info VALUES (?, ?)",
                    [(k, json.dumps(v)) for k, v in info.items()])
    con.execute("COMMIT")
    res.nodes = _node_summary(con)


def _nccl_predicates(pending: list):
    """bundle_id -> the nccl_events rows of that bundle the merge copies (valid and in
    its capture window): the collectives count the same entries on both paths."""
    preds = {i["bundle_id"]: _bundle_predicate(i["bundle"], "nccl_events") for i in pending}
    return lambda bundle_id: preds.get(bundle_id, _valid_predicate("nccl_events"))


def _check_params(params: dict, pending: list) -> None:
    """Every node's line fits the integers SQLite computes with: readings that give
    one that does not (an offset beyond int64, a slope that is no number) come from a
    bundle of that node merged now, which is skipped (the merge is redone without it)."""
    for a in params.values():
        values = (a.offset_ns, a.pre_offset_ns)
        if all(v is None or -(1 << 61) < v < (1 << 61) for v in values) and \
                math.isfinite(a.slope) and abs(a.slope) < 1:
            continue
        mine = [i for i in pending if i["node_id"] == a.node_id]
        if not mine:
            raise MergeError(f"node {a.node_id}: its alignment is outside any clock "
                             f"(offset {a.offset_ns} ns, slope {a.slope})")
        raise _CorruptBundle(mine[-1]["bundle"].path,
                             f"its clock readings give node {mine[-1]['bundle'].node} a "
                             f"line outside any clock (offset {a.offset_ns} ns, slope "
                             f"{a.slope:g}); not merged")


def _pass3(fl: _Fleet, res: MergeResult, pending: list, params: dict, job, future,
           progress, old_params, max_old_bundle, idle) -> None:
    """Copy the big tables with aligned times. nccl_events joins the completions, which
    the collectives thread computes meanwhile. In a fresh merge a thread of its own
    builds nccl_events and a share of the other tables, each with its indexes, in
    scratch databases while this one copies and indexes the rest, moving each built
    table in as soon as it is ready (_TableBuilder)."""
    con = fl.con
    if not max_old_bundle and pending:
        _pass3_fresh(fl, pending, params, job, future, idle)
    else:
        for item in pending:
            _copy_tables(fl, item, [t for t in PASS3_TABLES if t != "nccl_events"], params)
        _wait_staged(job, future)
        con.execute("ATTACH DATABASE ? AS cp", (image_uri(fl.completion_path),))
        # Every nccl_events row looks its collective up: keep the whole table cached.
        con.execute("PRAGMA cp.cache_size = -32768")
        try:
            if max_old_bundle:      # realign rows merged by earlier runs (incremental merge)
                with con:
                    _realign_existing(con, params, old_params, max_old_bundle)
            for item in pending:
                _copy_tables(fl, item, ["nccl_events"], params)
        finally:
            con.execute("DETACH DATABASE cp")
    for item in pending:
        bundle, node_id, bundle_id = item["bundle"], item["node_id"], item["bundle_id"]
        bundle.close()
        for t, n in item["skipped"].items():
            if n:
                fl.log("warning", "skipped_rows", f"{n} rows of {t} not merged (unknown "
                       "enum value, NULL in a required column, non-integer time or a "
                       "time outside the capture window)",
                       input=item["shown"], node_id=node_id, count=n)
                res.warnings.append(f"{item['shown']}: {n} invalid rows of {t} skipped")
        con.execute("UPDATE bundles SET rows = ?, skipped_rows = ? WHERE bundle_id = ?",
                    (json.dumps(item["counts"], sort_keys=True),
                     json.dumps(item["skipped"], sort_keys=True), bundle_id))
        for t, n in item["counts"].items():
            res.rows[t] = res.rows.get(t, 0) + n
        res.bundles_merged += 1
        fl.log("info", "merged", "bundle merged", input=item["shown"], node_id=node_id,
               count=sum(item["counts"].values()))
        progress(1)


def _wait_staged(job, future) -> None:
    """Until the collectives thread has written the completions and read every bundle
    (their images and scratch files are removed, by bundle.close, only after that)."""
    for ready in (job.completions_ready, job.bundles_read):
        while not ready.wait(0.05):
            if future.done():
                future.result()         # its error, raised here
                if ready.is_set():      # set, and the thread ended, after the wait
                    break
                raise MergeError("the collectives thread ended before its results")


def _pass3_fresh(fl: _Fleet, pending: list, params: dict, job, future, idle) -> None:
    con = fl.con
    rows = {t: sum(i["bundle"].manifest["tables"].get(t) or 0 for i in pending)
            for t in PASS3_TABLES}
    regions = fl.splice is not None and _regions_supported(fl.path, len(_BUILDABLE))
    built = _builder_share(rows, _SPLICE_COST if regions else _TRANSFER_COST)
    stack_rows = con.execute("SELECT bundle_id, local_id, fleet_id FROM "
                             "temp.stack_map_all").fetchall()
    if regions:
        fl.region_fd = os.open(fl.path, os.O_RDWR)
    builder = _TableBuilder(fl.scratch_base, built, fl.completion_path, job, pending,
                            params, stack_rows,
                            (fl.splice, fl.region_fd) if regions else None)
    fl.builder = builder
    builder.start()
    by_id = {i["bundle_id"]: i for i in pending}

    moved = []

    def move_in(ready):
        # A table built in a region of fleet.db gets its pages spliced in once this
        # connection is closed (_splice_tables): here only its empty twin's indexes, whose
        # root pages the built ones take. Otherwise, into an empty fleet table with the
        # same schema and indexes: SQLite moves rows and index entries as they are (its
        # "transfer optimization"), without decoding a row or sorting an index again.
        for table, source, counts, region in ready:
            moved.append(table)
            if len(moved) == len(built):
                # The last table is in: the other core has nothing left to do; meanwhile
                # fleet.db's pages are written out, so the final fsync has less to do.
                fl.flusher = threading.Thread(target=_flush, name="ingero-flush",
                                              args=(fl.path,))
                fl.flusher.start()
            with con:
                for stmt in index_ddl(FLEET_TABLES_BY_NAME[table]):
                    con.execute(stmt)
            # region: None (a scratch file), why scan() refused it, or what splice() needs
            why = region if isinstance(region, str) else None
            if isinstance(region, tuple):
                roots = dict(con.execute("SELECT name, rootpage FROM sqlite_schema "
                                         "WHERE tbl_name = ?", (table,)))
                offset, pointers, built_roots = region
                if set(roots) == {n for n, _ in built_roots}:
                    fl.spliced.append((offset, pointers,
                                       [(r, roots[n]) for n, r in built_roots]))
                    fl.spliced_tables.append(table)
                else:
                    why = f"its indexes differ from fleet.db's ({sorted(roots)})"
            if why:
                # A region splice() cannot move: row by row. Never expected; logged so
                # that the time it costs is explained.
                fl.log("warning", "table_transferred", f"{table}: built pages not spliced "
                       f"({why}); rows moved by INSERT ... SELECT instead")
            if region is None or why:
                con.execute("ATTACH DATABASE ? AS nb", (source,))
                try:
                    with con:
                        con.execute(f"INSERT INTO main.{table} SELECT * FROM nb.{table}")
                finally:
                    con.execute("DETACH DATABASE nb")
            builder.remove(table)
            for bundle_id, (written, skipped) in counts.items():
                by_id[bundle_id]["counts"][table] = written
                by_id[bundle_id]["skipped"][table] = skipped

    release = None
    copied = []         # this thread is done with the images
    sync_files = [p for i in pending
                  for p in i["bundle"].run_paths + [i["bundle"].sync_path] if p]

    def between_steps():
        nonlocal release
        # Files no thread reads any more go as soon as possible: their page cache is then
        # reused by the writes still to come instead of fresh memory (which costs more,
        # on a VM most of all). The run files (or sync-point files) are read until the
        # completions are written; the images until every table is copied.
        if sync_files and job.completions_ready.is_set():
            for p in sync_files:
                Path(p).unlink(missing_ok=True)
            sync_files.clear()
        if release is None and copied and builder.copies_done.is_set() and \
                job.bundles_read.is_set():
            release = threading.Thread(target=_release, name="ingero-release",
                                       args=([i["bundle"] for i in pending],))
            release.start()
        move_in(builder.take_ready())

    try:
        own = [t for t in PASS3_TABLES if t not in built]
        for item in pending:
            _copy_tables(fl, item, own, params)
            between_steps()
        copied.append(True)
        for t in own:
            with con:
                for stmt in index_ddl(FLEET_TABLES_BY_NAME[t]):
                    con.execute(stmt)
            between_steps()
        while True:
            between_steps()
            if builder.ended():
                break
            _wait_staged(job, future)
            idle()      # work that needs no builder table, instead of waiting
            move_in(builder.take_ready(wait=True))
        builder.join()
        move_in(builder.take_ready())
    finally:
        if release is not None:
            release.join()
    _wait_staged(job, future)


def _regions_supported(path: Path, count: int) -> bool:
    """Whether the filesystem of ``path`` holds a sparse file reaching past ``count``
    regions (ext4, xfs, btrfs, tmpfs do; FAT does not): tried on a probe file."""
    probe = path.with_name(f"{path.name}.probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, b"\0" * FLEET_PAGE_SIZE, (count + 1) * REGION_STRIDE)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def _splice_tables(fl: _Fleet) -> None:
    """The pages of the tables built in regions become fleet.db's (merge/_splice.c), and
    the file ends where the fleet database does (regions not spliced were transferred)."""
    fd = os.open(fl.path, os.O_RDWR)
    try:
        fl.splice.splice(fd, sorted(fl.spliced), True)
    finally:
        os.close(fd)
    _verify_spliced(fl)


class _SpliceFailed(Exception):
    """A spliced table failed its check: the merge is redone without the splice."""


def _verify_spliced(fl: _Fleet) -> None:
    """Every spliced table and its indexes pass SQLite's quick_check, scoped to them
    (PRAGMA quick_check(TABLE)), before the rename: a page the splice got wrong never
    reaches a user; the merge is then redone on the plain path (docs/merge.md)."""
    if not fl.spliced_tables:
        return
    con = apsw.Connection(str(fl.path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        for table in fl.spliced_tables:
            res = [r[0] for r in con.execute(f"PRAGMA quick_check({table})")]
            if res != ["ok"]:
                raise _SpliceFailed(f"{table}: {' '.join('; '.join(res).split())[:300]}")
    except apsw.Error as e:
        raise _SpliceFailed(f"{type(e).__name__}: {e}") from None
    finally:
        con.close()


def _release(bundles) -> None:
    for bundle in bundles:
        bundle.close()


def _flush(path) -> None:
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
#: entries in (the transfer) 0.5; with regions (merge/_splice.c), the builder listing a
#: table's pointer pages and the splice, together, 0.02.
_BUILDER_COST, _NCCL_COST, _TRANSFER_COST, _SPLICE_COST = 1.2, 1.65, 0.5, 0.02
#: Tables the builder may take.
_BUILDABLE = ("nccl_events", "cuda_events", "sched_events", "tcp_events", "block_events",
              "host_samples")


def _builder_share(rows: dict, move_cost: float = _TRANSFER_COST) -> list:
    """The tables _TableBuilder builds, in the order they become ready: nccl_events
    (its rows wait for the completions, which the main thread's need not), then the
    subset of the others that ends the merge soonest, largest first. The main thread
    pays for moving every table in (move_cost per row and index entry: a transfer, or
    next to nothing when the pages are spliced), and the last move cannot overlap
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


class _TableBuilder:
    """Whole fleet tables of a fresh merge, built beside the main thread, each in a
    scratch database of its own (``<scratch_base>.<table>``). First the rows of every
    table: per bundle the same INSERT ... SELECT as _copy_table, the others while the
    collectives thread computes the completions, nccl_events (which joins them) last.
    ``copies_done`` is then set: the bundle images are no longer needed here. Then the
    indexes, table by table in the given order, each table handed to the main thread by
    ``take_ready()`` as soon as it is complete; the main thread moves it into the still
    empty fleet table in one transfer. ``interrupt()`` stops it.

    With ``regions`` ((the _splice module, a descriptor of the temporary fleet.db)), each
    scratch database is a region of fleet.db itself instead (REGION_STRIDE apart, through
    the "ingero-region" VFS), and once built, its pages that hold page numbers are
    listed (scan) for the splice that moves it in when the main connection is closed."""

    def __init__(self, scratch_base, tables, completion_path, job, pending, params,
                 stack_rows, regions=None):
        self.tables = list(tables)
        self.paths = {t: Path(f"{scratch_base}.{t}") for t in self.tables}
        self.regions = regions
        self.offsets = {t: (k + 1) * REGION_STRIDE for k, t in enumerate(self.tables)}
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
        """(table, scratch path, {bundle_id: (written, skipped)}) of each table finished
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
        if self.regions is None:
            for suffix in ("", "-journal"):
                Path(f"{self.paths[table]}{suffix}").unlink(missing_ok=True)

    def _uri(self, table, size=None) -> str:
        """The scratch database of ``table``: a file, or a region of fleet.db (with its
        size: read-only, for a transfer)."""
        if self.regions is None:
            return str(self.paths[table])
        query = (f"vfs=ingero-region&fd={self.regions[1]}&offset={self.offsets[table]}"
                 f"&limit={REGION_STRIDE}")
        if size is not None:
            query += f"&size={size}&mode=ro&immutable=1"
        return file_uri(self.paths[table], query)

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
                region = source = None
                if self.regions is not None:
                    roots = con.execute("SELECT name, rootpage FROM sqlite_schema "
                                        "WHERE rootpage > 0").fetchall()
                    size = con.execute("PRAGMA page_count").fetchone()[0] * \
                        con.execute("PRAGMA page_size").fetchone()[0]
                    source = self._uri(table, size)
                with self._lock:
                    del self._cons[table]
                con.close()
                if self.regions is not None:
                    try:
                        _, pointers = self.regions[0].scan(self.regions[1],
                                                           self.offsets[table],
                                                           [r for _, r in roots])
                        region = (self.offsets[table], pointers, roots)
                    except ValueError as e:
                        region = str(e)
                else:
                    source = image_uri(self.paths[table])
                with self._lock:
                    self._ready.append((table, source, counts[table], region))
                    self._ready_event.set()
        finally:
            with self._lock:
                cons, self._cons = list(self._cons.values()), {}
            for con in cons:
                con.close()

    def _copy(self, table) -> dict:
        self.remove(table)
        con = apsw.Connection(self._uri(table), flags=apsw.SQLITE_OPEN_READWRITE |
                              apsw.SQLITE_OPEN_CREATE | apsw.SQLITE_OPEN_URI)
        with self._lock:
            if self._stopped:
                con.close()
                raise apsw.InterruptError("interrupted")
            self._cons[table] = con
        harden(con)
        # The journal in memory (a defensive connection refuses OFF): a new database's
        # pages are not journaled, so it holds a few pages per transaction. A region
        # must have no journal file (the VFS refuses one).
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
                    _load_stack_map(con, bundle_id)
                counts[bundle_id] = _copy_bundle_table(con, table, bundle, node_id,
                                                       bundle_id, self.params[node_id])
        if table == "nccl_events":
            con.execute("DETACH DATABASE cp")
        # Its pages are written: keep the memory of several open scratch databases down.
        con.execute("PRAGMA shrink_memory")
        return counts


def _copy_tables(fl: _Fleet, item: dict, tables, params: dict) -> None:
    """INSERT ... SELECT the bundle's ``tables`` into fleet.db, one transaction."""
    node_id, bundle_id = item["node_id"], item["bundle_id"]
    with attached(fl.con, item["bundle"].db_path, "b"), fl.con:
        _load_stack_map(fl.con, bundle_id)
        for t in tables:
            item["counts"][t], item["skipped"][t] = _copy_bundle_table(
                fl.con, t, item["bundle"], node_id, bundle_id, params[node_id])


def _copy_bundle_table(con, table, bundle, node_id, bundle_id, p) -> tuple[int, int]:
    """_copy_table, a malformed page of the bundle raising _CorruptBundle."""
    try:
        return _copy_table(con, table, bundle, node_id, bundle_id, p)
    except _CORRUPT as e:
        raise _CorruptBundle(bundle.path, f"database is corrupt ({type(e).__name__}: "
                                          f"{' '.join(str(e).split())}; table {table})") \
            from None


def _open_one(path, known_sha, tmpdir, integrity, min_wait_ns, fastcoll):
    """(sha, Bundle) or (sha, None) when already merged, or the BundleError. The Bundle
    carries its sync points: ``run_paths`` (the C path: run files of collective rows) or
    ``sync_path`` (the SQL path: a scratch database); close() removes them."""
    try:
        sha = read_manifest(path)["database"]["sha256"]
        if sha in known_sha:
            return sha, None
        bundle = open_bundle(path, tmpdir=tmpdir, integrity=integrity)
    except BundleError as e:
        return e
    bundle.con.close()
    bundle.con = None
    sync_path = Path(f"{bundle.db_path}.sync")
    owned = _owned_files(bundle)
    bundle.sync_path, bundle.run_paths = None, []
    try:
        if fastcoll is not None:
            tables = bundle.manifest["tables"]
            rows = (tables.get("nccl_events") or 0) + (tables.get("cuda_events") or 0)
            bundle.run_paths, bundle.collectives_seen = image_runs(
                fastcoll, bundle.db_path, bundle.db_path,
                _bundle_predicate(bundle, "nccl_events"),
                rows, min_wait_ns)
            owned.extend(bundle.run_paths)
        else:
            owned.append(sync_path)
            bundle.collectives_seen = extract_sync_points(bundle.db_path, sync_path,
                                                          min_wait_ns)
            bundle.sync_path = sync_path
    except (apsw.Error, RuntimeError) as e:
        bundle.close()
        return BundleError(path, f"cannot read its events ({type(e).__name__}: {e})")
    return sha, bundle


def _owned_files(bundle) -> list:
    """Scratch files removed with the bundle's image when it is closed."""
    if not hasattr(bundle, "scratch"):
        bundle.scratch = []
        close = bundle.close

        def close_all():
            close()
            for f in bundle.scratch:
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass
        bundle.close = close_all
    return bundle.scratch


def _prefetch(entries, known_sha, tmpdir, integrity, min_wait_ns, fastcoll):
    """Yield (shown, path, err, opened) in input order, with the next bundles opened in
    PREFETCH_THREADS helper threads. known_sha is read again by the caller: a bundle may
    repeat within one run. On exit (error, interrupt) bundles opened ahead are closed,
    removing their temporary files."""
    todo = list(entries)
    pool = ThreadPoolExecutor(max_workers=PREFETCH_THREADS, thread_name_prefix="ingero-open")
    futures = {}

    def submit(i):
        if i < len(todo) and not todo[i][2]:
            futures[i] = pool.submit(_open_one, todo[i][1], set(known_sha), tmpdir,
                                     integrity, min_wait_ns, fastcoll)
    try:
        for i in range(PREFETCH_THREADS):
            submit(i)
        for i, (shown, path, err) in enumerate(todo):
            fut = futures.pop(i, None)
            opened = fut.result() if fut is not None else None
            submit(i + PREFETCH_THREADS)
            yield shown, path, err, opened
    finally:
        for fut in futures.values():
            fut.cancel()
        pool.shutdown(wait=True)
        for fut in futures.values():
            if not fut.cancelled() and fut.exception() is None:
                r = fut.result()
                if isinstance(r, tuple) and r[1] is not None:
                    r[1].close()


def _attach(con, db_path, name: str = "b") -> None:
    con.execute(f"ATTACH DATABASE ? AS {name}", (image_uri(db_path),))


def _resolve_node(fl: _Fleet, m: dict, shown: str, res: MergeResult) -> int:
    con = fl.con
    h = m["host"]
    key = (m["node"], h["hostname"], h["boot_id"])
    row = con.execute("SELECT node_id FROM nodes WHERE claimed_name = ? AND hostname = ? "
                      "AND boot_id = ?", key).fetchone()
    if row:
        _check_same_boot(con, row[0], m)
        return row[0]
    name = m["node"]
    taken = {r[0] for r in con.execute("SELECT name FROM nodes WHERE name = ? OR name LIKE ?",
                                       (name, name + "#%"))}
    if name in taken:
        k = 2
        while f"{name}#{k}" in taken:
            k += 1
        new = f"{name}#{k}"
        other = con.execute("SELECT hostname, boot_id FROM nodes WHERE name = ?",
                            (name,)).fetchone()
        why = "another host" if other and other[0] != h["hostname"] else "another boot"
        msg = (f"node name {name!r} is already used by {why} (host {other[0] if other else '?'}"
               f"); this bundle (host {h['hostname']}, boot {h['boot_id'][:8]}) becomes "
               f"node {new!r}")
        fl.log("warning", "node_name_conflict", msg, input=shown)
        res.warnings.append(f"{shown}: {msg}")
        name = new
    con.execute("INSERT INTO nodes (name, claimed_name, hostname, boot_id, kernel_release, "
                "tool_version, ranks, job_ids, bundles) VALUES (?, ?, ?, ?, ?, ?, '[]', '[]', 0)",
                (name, m["node"], h["hostname"], h["boot_id"], h.get("kernel_release"),
                 h.get("tool_version")))
    return con.last_insert_rowid()


class _Conflict(Exception):
    """A bundle that claims a node, host and boot already merged but cannot be another
    segment of it: it is skipped with this reason."""


#: Segments of one capture follow each other; their windows may touch at a rotation.
OVERLAP_TOLERANCE_NS = 1_000_000_000


def _check_same_boot(con, node_id: int, m: dict) -> None:
    """A bundle of a node, host and boot already in fleet.db is one more segment of it
    only if it is not a version of a segment merged (same segment id, other data) and
    its capture window does not overlap one merged (one boot has one clock and one
    capture per node: an overlap is a second capture or altered data, which merged as
    one node made its alignment meaningless)."""
    seg = m["segment"]["id"]
    cap = m["capture"]
    row = con.execute("SELECT file_name FROM bundles WHERE node_id = ? AND segment_id = ?",
                      (node_id, seg)).fetchone()
    if row:
        raise _Conflict(f"segment {seg} of node {m['node']} (host {m['host']['hostname']}, "
                        f"same boot) is already merged from {row[0]} with other data: "
                        "altered or re-sealed; not merged")
    row = con.execute(
        "SELECT file_name, capture_start_mono_ns, capture_end_mono_ns FROM bundles "
        "WHERE node_id = ? AND capture_start_mono_ns < ? AND capture_end_mono_ns > ?",
        (node_id, cap["end_mono_ns"] - OVERLAP_TOLERANCE_NS,
         cap["start_mono_ns"] + OVERLAP_TOLERANCE_NS)).fetchone()
    if row:
        raise _Conflict(f"capture window overlaps {row[0]} of node {m['node']} (host "
                        f"{m['host']['hostname']}, same boot) by more than "
                        f"{OVERLAP_TOLERANCE_NS // 10**9} s: a second capture or altered "
                        "data, not another segment; not merged")


def _insert_bundle(fl: _Fleet, bundle, node_id: int, sha: str) -> int:
    m = bundle.manifest
    cap = m["capture"]
    fl.con.execute(
        "INSERT INTO bundles (node_id, file_name, sha256, segment_id, segment_index, "
        "recovered, size, db_size, capture_start_mono_ns, capture_end_mono_ns, "
        "capture_start_utc_ns, merged_utc, rows, skipped_rows, manifest) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '{}', '{}', ?)",
        (node_id, bundle.path.name, sha, m["segment"]["id"], m["segment"]["index"],
         1 if m["segment"].get("recovered") else 0, os.path.getsize(bundle.path),
         m["database"]["size"], cap["start_mono_ns"], cap["end_mono_ns"], cap["start_utc_ns"],
         _utc_iso(), json.dumps(m, sort_keys=True)))
    return fl.con.last_insert_rowid()


def _copy_stacks(fl: _Fleet, shown: str, node_id: int, bundle_id: int, used: set) -> int:
    """Map the bundle's stacks onto fleet stacks (content-addressed, verified by content).
    The map is stored in bundle_stack_map rows of temp.stack_map_all for pass 3."""
    con = fl.con
    con.execute("CREATE TEMP TABLE IF NOT EXISTS stack_map_all (bundle_id INTEGER, "
                "local_id INTEGER, fleet_id INTEGER, PRIMARY KEY (bundle_id, local_id)) "
                "WITHOUT ROWID")
    n = 0
    bad = 0
    rows = []
    for local_id, frames in con.execute("SELECT stack_id, frames FROM b.stacks").fetchall():
        n += 1
        try:
            canon = canonical_stack(frames)
        except (ValueError, TypeError):
            bad += 1
            continue
        h = stack_hash(canon)
        sid = None
        k = 1
        key = h
        while True:
            hit = fl.stacks.get(key)
            if hit is None:
                break
            if hit[1] == canon:  # content verified, not just the hash
                sid = hit[0]
                break
            k += 1
            key = f"{h}-{k}"
        if sid is None:
            depth = len(json.loads(canon))
            con.execute("INSERT INTO stacks (hash, frames, depth) VALUES (?, ?, ?)",
                        (key, canon, depth))
            sid = con.last_insert_rowid()
            fl.stacks[key] = (sid, canon)
        used.add(sid)
        rows.append((bundle_id, local_id, sid))
    con.executemany("INSERT OR REPLACE INTO temp.stack_map_all VALUES (?, ?, ?)", rows)
    if bad:
        fl.log("warning", "skipped_rows", f"{bad} stacks with frames that are not a JSON "
               "array; rows pointing at them get stack_id NULL", input=shown,
               node_id=node_id, count=bad)
    return n


def _load_stack_map(con, bundle_id: int) -> None:
    con.execute("DELETE FROM temp.stack_map")
    con.execute("INSERT INTO temp.stack_map SELECT local_id, fleet_id FROM "
                "temp.stack_map_all WHERE bundle_id = ?", (bundle_id,))


def _copy_table(con, table: str, bundle, node_id: int, bundle_id: int,
                p: align.NodeAlignment | None) -> tuple[int, int]:
    """INSERT ... SELECT one bundle table into main (fleet.db, or the scratch database
    of _TableBuilder); returns (written, skipped)."""
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
            sel[c] = _aligned(f"e.{c}")
    joins = ""
    if "stack_id" in data_cols:
        sel["stack_id"] = "sm.fleet_id"
        joins += " LEFT JOIN temp.stack_map sm ON sm.local_id = e.stack_id"
    extra = {"node_id": ":node", "bundle_id": ":bundle"}
    if times:
        extra["mono_ns"] = f"e.{times[0]}"
    if table == "nccl_events":
        a = _aligned("e.timestamp_ns")
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
           f"FROM b.{table} e{joins} WHERE {_bundle_predicate(bundle, table)}")
    binds = {"node": node_id, "bundle": bundle_id}
    if times:
        binds.update(off=p.offset_ns, slope=p.slope)
    con.execute(sql, binds)
    written = con.changes()
    return written, max((want or 0) - written, 0)


# --------------------------------------------------------------------------- alignment

def _claim(source, synchronized, maxerr, ref_off, root_delay, root_disp):
    if source == "system":
        if synchronized != 1 or maxerr is None:    # NULL: not known to be synchronized
            return None
        return int(maxerr)
    if source == "chrony" and root_disp is not None and root_delay is not None:
        return int(abs(ref_off or 0) + root_disp + root_delay / 2)
    return None


def _sample_sync_points(fl: _Fleet, pending: list) -> None:
    """temp.sample_sp: the sync points the alignment looks at."""
    con = fl.con
    # The estimator needs thousands of collectives, not millions: take every k-th seq of
    # each communicator (spread over the whole capture), at most ~ALIGN_SAMPLE in all.
    # Distinct collectives: the most any one node observed (nodes of one job see the same
    # ones), counted by the helper threads.
    n_coll = fl.collectives_seen
    every = max(1, -(-n_coll // ALIGN_SAMPLE))
    fl.sample_every = every

    # The sample: from each new bundle's sync points (helper threads' scratch files) and
    # from the rows of earlier merges (st.sp).
    # One row per collective row of a sampled seq: its entry and/or the completion it
    # observed (tight or not), op as its index in SORTED_OPS.
    con.execute("DROP TABLE IF EXISTS temp.sample_sp")
    con.execute("CREATE TEMP TABLE sample_sp (id INTEGER PRIMARY KEY, node_id INTEGER, "
                "comm_id_hash TEXT, seq INTEGER, mono_ns INTEGER, entry_ns INTEGER, "
                "tight INTEGER, op INTEGER)")
    cols = "(node_id, comm_id_hash, seq, mono_ns, entry_ns, tight, op)"
    op_index = "CASE op " + " ".join(f"WHEN '{o}' THEN {k}" for k, o in
                                     enumerate(SORTED_OPS)) + " END"
    # rows of earlier merges (SQL path): their observations and their entries
    con.execute(f"INSERT INTO temp.sample_sp {cols} SELECT node_id, comm_id_hash, seq, "
                "mono_ns, NULL, tight, NULL FROM st.sp WHERE seq % ? = 0", (every,))
    con.execute(f"INSERT INTO temp.sample_sp {cols} SELECT node_id, comm_id_hash, seq, "
                f"NULL, mono_ns, 0, {op_index} FROM st.ent WHERE seq % ? = 0", (every,))
    insert = f"INSERT INTO temp.sample_sp {cols} VALUES (?, ?, ?, ?, ?, ?, ?)"
    runs = [(path, nid) for path, nid, _ in fl.old_runs] + \
        [(path, item["node_id"]) for item in pending for path in item["bundle"].run_paths]
    if runs:
        with con:
            for path, nid in runs:
                fl.fastcoll.sample_into(con.sqlite3_pointer(), str(path), every, insert, nid)
    for item in pending:
        if item["bundle"].sync_path is not None:
            with attached(con, item["bundle"].sync_path, "s"):
                con.execute(f"INSERT INTO temp.sample_sp {cols} SELECT ?, comm_id_hash, seq, "
                            "mono_ns, NULL, tight, NULL FROM s.sp WHERE seq % ? = 0",
                            (item["node_id"], every))
            with attached(con, item["bundle"].db_path, "b"):
                con.execute(f"INSERT INTO temp.sample_sp {cols} SELECT ?, e.comm_id_hash, "
                            f"e.seq, NULL, e.timestamp_ns, 0, {op_index.replace('op', 'e.op', 1)} "
                            "FROM b.nccl_events e WHERE typeof(e.comm_id_hash) = 'text' AND "
                            f"typeof(e.seq) = 'integer' AND e.seq % ? = 0 AND "
                            f"{_bundle_predicate(item['bundle'], 'nccl_events')}",
                            (item["node_id"], every))


def _align(fl: _Fleet, res: MergeResult) -> dict[int, align.NodeAlignment]:
    con = fl.con
    nodes = {nid: align.NodeInput(nid, clock_key=boot) for nid, boot in
             con.execute("SELECT node_id, boot_id FROM nodes")}
    for row in con.execute(
            "SELECT node_id, source, mono_before_ns, mono_after_ns, realtime_ns, "
            "synchronized, adj_maxerror_ns, adj_esterror_ns, ref_offset_ns, root_delay_ns, "
            "root_dispersion_ns FROM clock_samples WHERE realtime_ns IS NOT NULL "
            "AND typeof(realtime_ns) = 'integer' AND source IN ('system', 'chrony')"):
        nid, src, mb, ma, rt, sync, maxe, este, ref, rdel, rdisp = row
        if ma < mb:
            continue
        claim = _claim(src, sync, maxe, ref, rdel, rdisp)
        est = None
        if sync != 0 and isinstance(este, int):
            est = abs(este)
        elif claim is not None:
            est = claim
        nodes[nid].samples.append(align.ClockSample(
            mid=(mb + ma) // 2, realtime=rt, half_bracket=(ma - mb + 1) // 2, claim=claim,
            est=est))
    for nid, su, sm, eu, em in con.execute(
            "SELECT node_id, capture_start_utc_ns, capture_start_mono_ns, "
            "json_extract(manifest, '$.capture.end_utc_ns'), capture_end_mono_ns FROM bundles"):
        nodes[nid].manifest_pairs += [(su, sm), (eu, em)]

    full_ops = {k for k, o in enumerate(SORTED_OPS) if o in FULL_DEPENDENCY_OPS}

    def groups():
        """Per sampled collective, per node: the latest entry, the earliest observed
        completion and the earliest tight one (raw monotonic)."""
        cur = con.cursor()
        key, obs, full = None, [], True
        for comm, seq, nid, ent, obs_any, obs_tight, op_lo, op_hi in cur.execute(
                "SELECT comm_id_hash, seq, node_id, MAX(entry_ns), MIN(mono_ns), "
                "MIN(CASE WHEN tight THEN mono_ns END), MIN(op), MAX(op) "
                "FROM temp.sample_sp GROUP BY comm_id_hash, seq, node_id "
                "ORDER BY comm_id_hash, seq, node_id"):
            if (comm, seq) != key:
                if obs:
                    yield key, full, obs
                key, obs, full = (comm, seq), [], True
            if op_lo is not None and (op_lo != op_hi or op_lo not in full_ops):
                full = False
            obs.append((nid, ent, obs_any, obs_tight))
        if obs:
            yield key, full, obs

    params = align.align_fleet(nodes, groups, fl.min_latency_ns)
    names = dict(con.execute("SELECT node_id, name FROM nodes"))
    for a in params.values():
        if a.exceeds_claim:
            msg = (f"node {names[a.node_id]}: clock correction up to {a.max_correction_ns / 1e6:.3f}"
                   f" ms exceeds its claimed error bound ({(a.claimed_error_ns or 0) / 1e6:.3f} ms):"
                   " its time service is lying")
            fl.log("warning", "clock_claim_exceeded", msg, node_id=a.node_id)
            res.warnings.append(msg)
        if a.method == "manifest":
            msg = f"node {names[a.node_id]}: no usable clock samples; times rest on the manifest only"
            fl.log("warning", "no_clock_samples", msg, node_id=a.node_id)
            res.warnings.append(msg)
        if a.rate_clamped:
            msg = (f"node {names[a.node_id]}: the collectives suggested a clock rate beyond "
                   f"{align.DRIFT_BOUND_PPM:.0f} ppm, which no crystal has; bounded to "
                   f"{a.drift_ppm:+.0f} ppm (the sync observations may be biased)")
            fl.log("warning", "rate_clamped", msg, node_id=a.node_id)
            res.warnings.append(msg)
        if a.causal_moved_ns:
            room = ("unbounded" if a.relative_uncertainty_ns is None
                    else f"{a.relative_uncertainty_ns / 1e6:.3f} ms")
            msg = (f"node {names[a.node_id]}: its clock line contradicted the order of "
                   f"collective entries and completions; moved by up to "
                   f"{a.causal_moved_ns / 1e6:.3f} ms to the nearest consistent line (a "
                   f"choice within the feasible band; relative uncertainty {room})")
            fl.log("warning", "clock_causal_move", msg, node_id=a.node_id)
            res.warnings.append(msg)
    return params


def _realign_existing(con, params, old_params, max_old_bundle) -> None:
    """Rows merged earlier: move their times from the old line to the new one (the raw
    value is mono_ns, or recovered exactly enough from the old line)."""
    for nid, (old_off, old_slope) in old_params.items():
        p = params.get(nid)
        if p is None or (p.offset_ns == old_off and p.slope == old_slope):
            continue
        b = {"off": p.offset_ns, "slope": p.slope, "ooff": old_off, "oslope": old_slope,
             "node": nid, "maxb": max_old_bundle}
        for table in PASS3_TABLES:
            times = time_point_columns(table)
            if not times:
                continue
            sets = []
            for c in times:
                raw = "mono_ns" if c == times[0] else \
                    f"CAST(ROUND(({c} - :ooff) / (1.0 + :oslope)) AS INTEGER)"
                sets.append(f"{c} = {_aligned(raw)}")
            con.execute(f"UPDATE {table} SET {', '.join(sets)} WHERE node_id = :node "
                        "AND bundle_id <= :maxb", b)
    # completion of old rows may change with the new observations and alignment
    con.execute("""UPDATE nccl_events SET
          completion_ns = (SELECT c.completion_ns FROM cp.completion c
                           WHERE c.comm_id_hash = nccl_events.comm_id_hash
                             AND c.seq = nccl_events.seq)
        WHERE bundle_id <= ?""", (max_old_bundle,))
    con.execute("""UPDATE nccl_events SET duration_ns = CASE
          WHEN completion_ns > timestamp_ns + call_duration_ns THEN completion_ns - timestamp_ns
          ELSE call_duration_ns END WHERE bundle_id <= ?""", (max_old_bundle,))


def _collectives(con, every: int) -> None:
    """One row per (comm_id_hash, seq), from the collectives thread's results (st) and
    the completions (cp); sync_points gets the alignment's sample of the observations."""
    con.execute("DELETE FROM collectives")
    con.execute("""
        INSERT INTO collectives (comm_id_hash, seq, op, op_mismatch, nranks, ranks_seen,
            bytes, first_entry_ns, last_entry_ns, entry_spread_ns, last_rank, last_node_id,
            completion_ns, completion_observations, completion_tight, completion_spread_ns)
        SELECT g.comm_id_hash, g.seq, g.op, g.mismatch, g.nranks, g.ranks_seen, g.bytes,
               g.first_entry, g.last_entry, g.last_entry - g.first_entry, g.last_rank,
               g.last_node, c.completion_ns, COALESCE(c.n, 0), COALESCE(c.tight, 0), c.spread
        FROM st.coll_agg g LEFT JOIN cp.completion c USING (comm_id_hash, seq)
        ORDER BY g.comm_id_hash, g.seq""")
    # fleet.db keeps the sync points of the alignment's sample (all are in st.sp).
    con.execute("DELETE FROM sync_points")
    con.execute("INSERT INTO sync_points (node_id, bundle_id, comm_id_hash, seq, pid, tid, "
                "mono_ns, wait_ns, used, tight) SELECT node_id, bundle_id, comm_id_hash, seq, "
                "pid, tid, mono_ns, wait_ns, used, tight FROM st.sp WHERE seq % ? = 0 "
                "ORDER BY comm_id_hash, seq, node_id, bundle_id, pid, tid, mono_ns, id", (every,))


def _write_alignment(con, params) -> None:
    con.execute("DELETE FROM clock_alignment")
    con.executemany(
        "INSERT INTO clock_alignment (node_id, method, offset_ns, slope, drift_ppm, "
        "uncertainty_ns, relative_uncertainty_ns, component, sync_points, sync_points_used, "
        "residual_ns, violations_before, violations_after, clock_samples, steps, "
        "claimed_error_ns, max_correction_ns, exceeds_claim, segments, causal_early_ns, "
        "causal_late_ns, causal_moved_ns, rate_clamped) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(a.node_id, a.method, a.offset_ns, a.slope, a.drift_ppm, a.uncertainty_ns,
          a.relative_uncertainty_ns, a.component, a.sync_points, a.sync_points_used,
          a.residual_ns, a.violations_before, a.violations_after, a.clock_samples, a.steps,
          a.claimed_error_ns, a.max_correction_ns, int(a.exceeds_claim),
          json.dumps(a.segments), a.causal_early_ns, a.causal_late_ns, a.causal_moved_ns,
          int(a.rate_clamped)) for a in params.values()])


def _update_nodes(con) -> None:
    for (nid,) in con.execute("SELECT node_id FROM nodes").fetchall():
        ranks = sorted(set(process_ranks(con, nid).values()))
        jobs = sorted({j for (j,) in con.execute(
            "SELECT DISTINCT job_id FROM processes WHERE node_id = ? AND job_id IS NOT NULL",
            (nid,)) if isinstance(j, str)})
        for (mj,) in con.execute("SELECT json_extract(manifest, '$.job_ids') FROM bundles "
                                 "WHERE node_id = ?", (nid,)):
            try:
                jobs = sorted(set(jobs) | {str(j) for j in json.loads(mj or "[]")})
            except (ValueError, TypeError):
                pass
        con.execute("""UPDATE nodes SET ranks = ?, job_ids = ?,
              bundles = (SELECT COUNT(*) FROM bundles WHERE node_id = ?),
              first_mono_ns = (SELECT MIN(capture_start_mono_ns) FROM bundles WHERE node_id = ?),
              last_mono_ns = (SELECT MAX(capture_end_mono_ns) FROM bundles WHERE node_id = ?)
            WHERE node_id = ?""", (json.dumps(ranks), json.dumps(jobs), nid, nid, nid, nid))
    con.execute("""UPDATE nodes SET
          first_utc_ns = (SELECT a.offset_ns + nodes.first_mono_ns +
                          CAST(ROUND(nodes.first_mono_ns * a.slope) AS INTEGER)
                          FROM clock_alignment a WHERE a.node_id = nodes.node_id),
          last_utc_ns = (SELECT a.offset_ns + nodes.last_mono_ns +
                         CAST(ROUND(nodes.last_mono_ns * a.slope) AS INTEGER)
                         FROM clock_alignment a WHERE a.node_id = nodes.node_id)""")


def _node_summary(con) -> list[dict]:
    out = []
    rows = con.execute("SELECT n.node_id, n.name, n.hostname, n.ranks, n.bundles, a.method, "
                       "a.offset_ns, a.drift_ppm, a.uncertainty_ns, a.sync_points_used, "
                       "a.violations_before, a.violations_after, a.exceeds_claim, a.steps "
                       "FROM nodes n LEFT JOIN clock_alignment a USING (node_id) "
                       "ORDER BY n.node_id").fetchall()
    per_node_rows: dict[int, dict] = {}
    for nid, rows_json in con.execute("SELECT node_id, rows FROM bundles"):
        for t, n in json.loads(rows_json).items():
            d = per_node_rows.setdefault(nid, {})
            d[t] = d.get(t, 0) + n
    for (nid, name, host, ranks, nb, method, off, drift, unc, used, vb, va, exc,
         steps) in rows:
        out.append({"node_id": nid, "name": name, "hostname": host, "ranks": json.loads(ranks),
                    "bundles": nb, "rows": per_node_rows.get(nid, {}),
                    "alignment": {"method": method, "offset_ns": off, "drift_ppm": drift,
                                  "uncertainty_ns": unc, "sync_points_used": used,
                                  "violations_before": vb, "violations_after": va,
                                  "exceeds_claim": bool(exc), "steps": steps}})
    return out
