"""BundleWriter: append rows to a live segment (SQLite in WAL mode) and seal it.

Rows are buffered per table and written in one transaction per batch with prepared
statements (``executemany``). A crash loses at most the open batch: everything committed
is in the WAL and survives; ``seal_spool`` turns a crashed segment into a bundle.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import uuid
from pathlib import Path

import apsw

from .. import __version__
from ..db import connect_writable
from ..errors import DiskFullError, IngeroError
from .container import MANIFEST_MAGIC, bundle_filename, validate_node_name, write_bundle
from .schema import (EVENT_TABLES, FORMAT_VERSION, MANIFEST_TABLES, META_FIELDS, META_KEYS,
                     TABLES, TABLES_BY_NAME, bundle_ddl, insert_sql)


def now_pair() -> tuple[int, int]:
    """(UTC ns, CLOCK_MONOTONIC ns) read back to back."""
    return time.clock_gettime_ns(time.CLOCK_REALTIME), time.clock_gettime_ns(time.CLOCK_MONOTONIC)


#: frame lists add_stack keeps to know them again by identity, at most
STACK_LISTS = 8192


def canonical_frames(frames) -> str:
    """The stacks.frames text of a frame list: sorted keys, no whitespace, so that equal
    stacks are equal strings."""
    return json.dumps(frames, sort_keys=True, separators=(",", ":"))


@contextlib.contextmanager
def transaction(con):
    """BEGIN ... COMMIT, rolling back on error unless SQLite already did.

    apsw's own ``with con:`` issues ROLLBACK unconditionally, and after SQLITE_FULL
    SQLite has already rolled back, so that ROLLBACK fails and hides the real error.
    """
    con.execute("BEGIN")
    try:
        yield con
    except BaseException:
        if con.in_transaction:
            con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def local_host_facts() -> dict:
    """hostname, boot_id, kernel_release and machine of the running system."""
    u = os.uname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown"
    return {"hostname": u.nodename, "boot_id": boot_id, "kernel_release": u.release,
            "machine": u.machine}


#: meta keys the writer owns; extra_meta may not replace them.
_RESERVED_META = frozenset(k for k, *_ in META_FIELDS if k != "job_ids")
#: What a bad row raises from apsw: NOT NULL (ConstraintError), wrong width
#: (BindingsError), an unbindable value (TypeError) or an integer beyond 64 bits.
_ROW_ERRORS = (apsw.ConstraintError, apsw.BindingsError, TypeError, OverflowError,
               ValueError)


#: free space below which SQLite's "disk I/O error" on the spool is a full file system
FULL_BELOW_BYTES = 1 << 20


def write_error(path, err: apsw.IOError, tail: str = "", con=None) -> IngeroError:
    """What an I/O error writing the spool was. SQLite reports some writes into a full
    file system as a plain I/O error, not SQLITE_FULL (measured: a tmpfs with 16 KiB
    left, at the first commit). ENOSPC as the errno SQLite saw (``con.system_errno``)
    says so; otherwise the file system's free space decides, and another errno only
    words the message (it may be stale). A full disk gets the DiskFullError that the capture handles (eviction, exit 1
    with its documented line)."""
    seen = getattr(con, "system_errno", 0) if con is not None else 0
    if seen == errno.ENOSPC:
        return DiskFullError(f"{path}: file system full")
    # (an errno other than ENOSPC may be stale, left by an earlier call: it words the
    # message, the free space still decides)
    try:
        st = os.statvfs(os.path.dirname(os.fspath(path)) or ".")
        # root may use the blocks reserved for it; others may not
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    except OSError:
        free = None
    if free is not None and free < FULL_BELOW_BYTES:
        return DiskFullError(f"{path}: file system full ({free // 1024} KiB free)")
    why = f"{err}: {os.strerror(seen)}" if seen else f"{err}"
    return IngeroError(f"{path}: cannot write ({why}){tail}")


class BundleWriter:
    """Write one segment. Not thread-safe: one writer thread owns it.

    ``host`` holds hostname, boot_id, kernel_release (required, non-empty strings) and
    optionally machine; tool_version is added (``local_host_facts()`` reads them here).
    ``capture_start`` is (utc_ns, mono_ns); default now. A row that the database refuses
    (NULL in a NOT NULL column, wrong width, unbindable value) is dropped at flush and
    counted in ``rejected`` and in a capture_log ``rejected_rows`` row; the rest of its
    batch is kept.
    """

    def __init__(self, spool_path, *, node: str, host: dict,
                 capture_start: tuple[int, int] | None = None, segment_index: int = 0,
                 batch_rows: int = 200_000, extra_meta: dict | None = None):
        self.spool_path = Path(spool_path)
        self.node = validate_node_name(node)
        for key in ("hostname", "boot_id", "kernel_release"):
            if not isinstance(host.get(key), str) or not host[key]:
                raise ValueError(f"host[{key!r}] must be a non-empty string")
        clash = _RESERVED_META.intersection(extra_meta or ())
        if clash:
            raise ValueError(f"extra_meta may not set {', '.join(sorted(clash))}")
        jobs = (extra_meta or {}).get("job_ids", [])
        if not isinstance(jobs, list) or not all(isinstance(j, str) for j in jobs):
            raise ValueError("extra_meta['job_ids'] must be a list of strings")
        if self.spool_path.exists():
            raise IngeroError(f"{self.spool_path}: live segment already exists "
                              "(seal it with seal_spool first)")
        self.batch_rows = batch_rows
        self.capture_start = capture_start or now_pair()
        self.segment_index = segment_index
        self._buf: dict[str, list] = {t.name: [] for t in TABLES if t.name != "meta"}
        self._sql = {name: insert_sql(name) for name in self._buf}
        self._sql["stacks"] = "INSERT INTO stacks (stack_id, frames) VALUES (?, ?)"
        # Rows may leave out the optional columns a table gained within version 1 (they
        # come last): a writer of the 1.0 layout stays valid, those columns NULL.
        self._full = {t.name: len(t.data_columns) for t in TABLES
                      if t.name in self._buf and not all(c.required for c in t.columns)}
        self._pending = 0
        self._stacks: dict[str, int] = {}
        #: id(frames) -> (frames, stack_id): the symbolizer hands the same list for every
        #: call of a stack, which is then found without making its text (15 us for 20
        #: frames, per row: bench/bench_bundle.py)
        self._stack_lists: dict[int, tuple[list, int]] = {}
        self.rows = {name: 0 for name in self._buf}
        self.rejected = {name: 0 for name in self._buf}
        try:
            self.con = connect_writable(self.spool_path, wal=True)
        except apsw.FullError:
            raise DiskFullError(f"{self.spool_path}: file system full") from None
        except apsw.IOError as e:
            raise write_error(self.spool_path, e) from None
        host = dict(host, tool_version=host.get("tool_version", __version__))
        meta = {
            "format_version": FORMAT_VERSION,
            "node": node,
            "host": host,
            "segment": {"index": segment_index, "id": uuid.uuid4().hex},
            "capture": {"start_utc_ns": self.capture_start[0],
                        "start_mono_ns": self.capture_start[1]},
        }
        meta.update(extra_meta or {})
        try:
            with transaction(self.con):
                for stmt in bundle_ddl():
                    self.con.execute(stmt)
                self.con.executemany("INSERT INTO meta (key, value) VALUES (?, ?)",
                                     [(k, json.dumps(v)) for k, v in meta.items()])
        except apsw.FullError:
            raise DiskFullError(f"{self.spool_path}: file system full") from None
        except apsw.IOError as e:
            raise write_error(self.spool_path, e, con=self.con) from None

    # -- rows ---------------------------------------------------------------------
    def add(self, table: str, row: tuple) -> None:
        """Buffer one row: a tuple in the order of schema data_columns(table)."""
        try:
            self._buf[table].append(row)
        except KeyError:
            raise ValueError(f"no bundle table named {table!r}") from None
        self._pending += 1
        if self._pending >= self.batch_rows:
            self.flush()

    def add_many(self, table: str, rows) -> None:
        try:
            buf = self._buf[table]
        except KeyError:
            raise ValueError(f"no bundle table named {table!r}") from None
        n = len(buf)
        buf.extend(rows)
        self._pending += len(buf) - n
        if self._pending >= self.batch_rows:
            self.flush()

    def add_stack(self, frames: list[dict]) -> int:
        """Store a symbolized stack once per segment; return its stack_id. A list passed
        again is known by its identity: it must not be changed once passed."""
        hit = self._stack_lists.get(id(frames))
        if hit is not None and hit[0] is frames:
            return hit[1]
        key = canonical_frames(frames)
        sid = self._stacks.get(key)
        if sid is None:
            sid = self._stacks[key] = len(self._stacks) + 1
            self._buf["stacks"].append((sid, key))
            self._pending += 1
        if len(self._stack_lists) >= STACK_LISTS:
            self._stack_lists.clear()   # lists made anew for known stacks: bounded
        self._stack_lists[id(frames)] = (frames, sid)
        return sid

    def log(self, level: str, source: str, event: str, message: str,
            count: int | None = None, timestamp_ns: int | None = None) -> None:
        ts = time.clock_gettime_ns(time.CLOCK_MONOTONIC) if timestamp_ns is None else timestamp_ns
        self.add("capture_log", (ts, level, source, event, message, count))

    @property
    def pending(self) -> int:
        return self._pending

    def flush(self) -> int:
        """Commit the open batch in one transaction; return the rows written."""
        if not self._pending:
            return 0
        try:
            try:
                with transaction(self.con):
                    for name, rows in self._buf.items():
                        if rows:
                            self.con.executemany(self._sql[name], self._complete(name, rows))
                written = {name: len(rows) for name, rows in self._buf.items()}
            except _ROW_ERRORS:
                written = self._flush_row_by_row()
        except apsw.FullError:
            # The batch stays buffered: a later flush may succeed once space is freed.
            raise DiskFullError(f"{self.spool_path}: file system full") from None
        except apsw.IOError as e:
            # (a failing disk, a file system remounted read-only): what was committed
            # stays in the spool, which the next start seals
            raise write_error(self.spool_path, e, "; what was written stays in the "
                              "spool, sealed at the next start", con=self.con) from None
        for name, rows in self._buf.items():
            self.rows[name] += written.get(name, 0)
            rows.clear()
        self._pending = 0
        return sum(written.values())

    def _complete(self, name: str, rows: list) -> list:
        """rows with the optional trailing columns they leave out set to NULL."""
        n = self._full.get(name)
        if n is None:
            return rows
        return [r if len(r) >= n else tuple(r) + (None,) * (n - len(r)) for r in rows]

    def _flush_row_by_row(self) -> dict[str, int]:
        """Slow path after a bad row: commit the good rows, count and log the bad ones."""
        written: dict[str, int] = {}
        bad: dict[str, tuple[int, str]] = {}
        with transaction(self.con):
            for name, rows in self._buf.items():
                ok = 0
                for row in self._complete(name, rows):
                    try:
                        self.con.execute(self._sql[name], row)
                        ok += 1
                    except _ROW_ERRORS as e:
                        n, first = bad.get(name, (0, f"{type(e).__name__}: {e}"))
                        bad[name] = (n + 1, first)
                written[name] = ok
            for name, (n, first) in bad.items():
                self.rejected[name] += n
                self.con.execute(self._sql["capture_log"], (
                    time.clock_gettime_ns(time.CLOCK_MONOTONIC), "error", "capture",
                    "rejected_rows", f"{n} {name} row(s) refused by the database; "
                    f"first: {first[:300]}", n))
                written["capture_log"] = written.get("capture_log", 0) + 1
        return written

    def size_bytes(self) -> int:
        """Bytes the live segment occupies (database + WAL)."""
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.stat(f"{self.spool_path}{suffix}").st_size
            except FileNotFoundError:
                pass
        return total

    # -- sealing --------------------------------------------------------------------
    def seal(self, out_dir, *, capture_end: tuple[int, int] | None = None,
             level: int = 3) -> Path:
        """Flush, close and seal into out_dir; the spool files are removed. Returns the path."""
        self.flush()
        end = capture_end or now_pair()
        capture = {"start_utc_ns": self.capture_start[0], "start_mono_ns": self.capture_start[1],
                   "end_utc_ns": end[0], "end_mono_ns": max(end[1], self.capture_start[1])}
        with transaction(self.con):
            self.con.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('capture', ?)",
                             (json.dumps(capture),))
        self.con.close()
        return seal_spool(self.spool_path, out_dir, level=level)

    def abort(self) -> None:
        """Close without sealing (the spool stays for recovery)."""
        try:
            self.flush()
        finally:
            self.con.close()


def _meta(con) -> dict:
    return {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM meta")}


#: Manifest keys mirrored from meta (the rest: magic, tables, database).
_MIRRORED = ("format_version", "node", "host", "segment", "capture", "created_by", "job_ids")


def seal_spool(spool_path, out_dir, *, level: int = 3, recovered: bool = False) -> Path:
    """Seal a live or crashed segment database into ``out_dir/<name>.bundle``.

    Works on a database left by a killed writer: SQLite replays its WAL on open, the
    capture end is taken from the newest row when the writer did not record one. The
    final segment, capture and created_by values are written into meta first, so the
    manifest is a copy of what the checksummed database says.
    """
    spool_path, out_dir = Path(spool_path), Path(out_dir)
    if not spool_path.is_file():
        raise IngeroError(f"{spool_path}: no live segment to seal")
    con = None
    try:
        try:
            con = connect_writable(spool_path, wal=True)
            meta = _meta(con)
            for key in META_KEYS:
                if key not in meta:
                    raise KeyError(f"meta key {key} missing")
            capture = dict(meta["capture"])
            start_utc, start_mono = capture["start_utc_ns"], capture["start_mono_ns"]
        except (apsw.Error, KeyError, ValueError, TypeError) as e:
            raise IngeroError(f"{spool_path}: not a live bundle segment ({e})") from None
        if "end_mono_ns" not in capture:
            recovered = True
            last = start_mono
            for t in EVENT_TABLES + ("host_samples", "capture_log"):
                v = con.execute(f"SELECT MAX(timestamp_ns) FROM {t}").fetchone()[0]
                if isinstance(v, int):
                    last = max(last, v)
            v = con.execute("SELECT MAX(mono_after_ns) FROM clock_samples").fetchone()[0]
            if isinstance(v, int):
                last = max(last, v)
            capture.update(end_mono_ns=last, end_utc_ns=start_utc + (last - start_mono))
        meta["capture"] = capture
        meta["segment"] = dict(meta["segment"], recovered=recovered,
                               sealed_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        meta["created_by"] = f"ingero-forensics {__version__}"
        with transaction(con):
            con.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                            [(k, json.dumps(meta[k])) for k in ("capture", "segment",
                                                                "created_by")])
        counts = {t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                  for t in MANIFEST_TABLES}
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.execute("PRAGMA journal_mode = DELETE")
    except apsw.FullError:
        raise DiskFullError(f"{spool_path}: file system full while sealing") from None
    finally:
        if con is not None:
            con.close()
    manifest = {"magic": MANIFEST_MAGIC, "tables": counts}
    manifest.update((k, meta[k]) for k in _MIRRORED if k in meta)
    out = Path(out_dir) / bundle_filename(meta["node"], start_utc, meta["segment"]["index"])
    try:
        write_bundle(spool_path, out, manifest, level=level)
    except FileExistsError as e:
        if e.filename2 is None:     # the temporary file's open (O_EXCL), not the link
            raise IngeroError(f"{e.filename}: something is already there, at the sealing's "
                              f"temporary name (put there by another user of "
                              f"{out.parent}?); nothing was written through it, the spool "
                              f"{spool_path} is kept") from None
        raise IngeroError(f"{out}: a bundle with this name exists already; the spool "
                          f"{spool_path} is kept") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFullError(f"{out}: file system full while sealing") from None
        raise
    for suffix in ("", "-wal", "-shm", "-journal"):
        try:
            os.unlink(f"{spool_path}{suffix}")
        except FileNotFoundError:
            pass
    return out


__all__ = ["BundleWriter", "seal_spool", "now_pair", "canonical_frames", "local_host_facts",
           "TABLES_BY_NAME"]
