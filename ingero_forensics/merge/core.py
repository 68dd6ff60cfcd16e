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
(collectives.py), and in a fresh merge another builds a share of the tables in scratch
databases that the main thread moves in by SQLite's transfer (TableBuilder); then the
indexes, the collectives and the node facts.
"""

from __future__ import annotations

import contextlib
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
from ..db import harden
from ..errors import BundleError
from ..interrupts import run_held, sweep_at_exit
from . import align
from .clocks import (align_nodes, realign_existing, sample_sync_points, warn_violations,
                     write_alignment)
from .collectives import STAGING_DDL, CollectiveJob, int_or_null as _int, open_scratch
from .copying import (CACHE_MB, CORRUPT_ERRORS, FLEET_PAGE_SIZE, PASS1_TABLES, PASS3_TABLES,
                      CorruptBundle, CorruptOutput, TableBuilder, builder_share, bundle_predicate,
                      copy_bundle_table, flush_file, load_stack_map, release_bundles)
from .files import (MergeError, check_fleet, expand_inputs, fleet_sound, lock_output,
                    new_output)
from .inflight import settle_in_flight
from .lateattach import infer_late_attach
from .summaries import write_summaries
from .fleet_schema import (FLEET_TABLES_BY_NAME, FLEET_VERSION, NOT_EVENTS, all_index_ddl,
                           fleet_ddl, index_ddl)
from .nodes import Conflict, fleet_jobs, node_summary, resolve_node, update_nodes
from .opening import extract_sync, prefetch
from .screen import row_predicate
from .stacks import canonical_stack, stack_hash
from .syncpoints import (SYNC_APIS, TIGHT_LAG_NS, TIGHT_MAX_OPS, attached,
                         extract_fleet_sync_points, image_uri, write_runs)

#: A synchronization shorter than this did not wait (the rank arrived after completion).
DEFAULT_MIN_WAIT_NS = 20_000
#: Clock condition: a completion cannot be observed before the last entry plus this.
DEFAULT_MIN_LATENCY_NS = 1_000


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


# ---------------------------------------------------------------------------- helpers

def _utc_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


#: Helper threads for fleet.db's sorts (index builds, GROUP BY): 2 cores, not 1.
SORT_THREADS = 2


class _Fleet:
    """The connection to the temporary fleet database and small caches."""

    def __init__(self, path: Path, fresh: bool):
        self.path, self.fresh = path, fresh
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
                       f"PRAGMA threads = {SORT_THREADS}"):
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
        self.stacks_added: list = []    # (hash key, stack_id) of the bundle being copied
        # read by the table builder beside the tables it built (copying.TableBuilder):
        # the collectives' distinct ranks (None: not read) and the summaries written
        self.collective_ranks = None
        self.summarized: set[str] = set()

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
    corrupt: dict[str, str] = {}
    lock, lock_path = lock_output(Path(out_path), Path(tmpdir) if tmpdir else None)

    def unlock():
        # removed while still held: a merge that opened it meanwhile finds, once it has
        # the lock, that the name is no longer its file and takes the new one
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        with contextlib.suppress(OSError):      # (closed already: a second try)
            os.close(lock)
    try:
        res = _merge_attempts(inputs, out_path, strict, progress, tmpdir, integrity,
                              min_wait_ns, min_latency_ns, fastcoll, corrupt)
    except BaseException:
        run_held(unlock)
        raise
    run_held(unlock, reraise=False)     # fleet.db is in place: a Ctrl-C now changes nothing
    return res


def _merge_attempts(inputs, out_path, strict, progress, tmpdir, integrity, min_wait_ns,
                    min_latency_ns, fastcoll, corrupt) -> MergeResult:
    notes = []
    while True:
        try:
            res = _merge_bundles(inputs, out_path, strict, progress, tmpdir, integrity,
                                 min_wait_ns, min_latency_ns, fastcoll, corrupt)
            res.warnings.extend(notes)
            return res
        except _too_large(fastcoll):
            # A collective with more rows than the C path holds at once (no real job has
            # that many ranks): the SQL path, whose memory stays bounded, does it again.
            fastcoll = None
            notes.append("a collective had more rows than the C accelerator holds at once; "
                         "the merge ran again on its SQL path")
        except CorruptBundle as e:
            # Nothing of this attempt was kept (the output is written only at the end):
            # again, with that bundle skipped for its reason from the start.
            corrupt[e.path] = e.reason
        progress = None     # the bar counted the first attempt


def _too_large(fastcoll):
    return fastcoll.TooLarge if fastcoll is not None else ()


def _merge_bundles(inputs, out_path, strict, progress, tmpdir, integrity, min_wait_ns,
                   min_latency_ns, fastcoll, corrupt) -> MergeResult:
    started = time.monotonic()
    out = Path(out_path)
    res = MergeResult(output=str(out), accelerated=fastcoll is not None)
    progress = progress or (lambda n=1: None)
    fresh = new_output(out)
    if not fresh:
        check_fleet(out)
    if not out.parent.exists():
        raise MergeError(f"{out}: directory {out.parent} does not exist")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    # this process's temporaries (images and their run files, named by bundle/reader;
    # the output's own) are also removed when it ends, should its cleanup not run
    sweep_at_exit(Path(tmpdir) if tmpdir else out.parent, f"ingero-{os.getpid()}-")
    sweep_at_exit(out.parent, f".{out.name}.{os.getpid()}.")
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
        scratch.extend(Path(f"{fl.scratch_base}.{t}") for t in PASS3_TABLES)
        try:
            entries = [(shown, path, corrupt.get(str(path), err))
                       for shown, path, err in expand_inputs(inputs)]
            _merge(fl, entries, res, strict, progress,
                   Path(tmpdir) if tmpdir else out.parent, integrity, min_wait_ns,
                   min_latency_ns, pending)
        finally:
            def cleanup():
                # the table builder first: stopped, it creates no scratch file after
                # the removal below (a Ctrl-C may have cut its interrupt() short)
                if fl.builder is not None and fl.builder.running():
                    fl.builder.interrupt()
                for b in pending:
                    b["bundle"].close()
                fl.con.close()
                if fl.flusher is not None:
                    fl.flusher.join()
                for f in scratch + [r[0] for r in fl.old_runs]:
                    f.unlink(missing_ok=True)
            run_held(cleanup)
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
        def remove_tmp():
            for suffix in ("", "-journal"):
                with contextlib.suppress(OSError):      # EROFS too: the error below matters
                    os.unlink(f"{tmp}{suffix}")
        run_held(remove_tmp)
        # The output side failed (disk full, an unwritable directory): one line, not a
        # traceback; the previous fleet.db is untouched.
        if isinstance(e, CorruptOutput) or (
                not fresh and isinstance(e, CORRUPT_ERRORS) and not fleet_sound(out)):
            raise MergeError(f"{out}: " + ("the fleet.db is damaged" if not fresh else
                                           "the new fleet.db was damaged while written") +
                             f" ({e}); nothing was written and no bundle skipped: merge the bundles "
                             "into a new fleet.db") from None
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
    # sha256 -> the file sizes it was merged from: a file naming a merged bundle is taken
    # as that bundle, unopened, only at one of those sizes (a truncated copy is verified,
    # and fails, like any new input)
    known_sha: dict[str, set] = {}
    for sha, size in con.execute("SELECT sha256, size FROM bundles"):
        known_sha.setdefault(sha, set()).add(size)
    max_old_bundle = con.execute("SELECT COALESCE(MAX(bundle_id), 0) FROM bundles").fetchone()[0]
    old_params = {r[0]: (r[1], r[2]) for r in
                  con.execute("SELECT node_id, offset_ns, slope FROM clock_alignment")}
    stack_rows_seen = 0
    new_stack_ids: set[int] = set()
    stacks_before = con.execute("SELECT COUNT(*) FROM stacks").fetchone()[0]

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
                                         row_predicate("nccl_events"), rows,
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
                        f"{_int('rank')}, mono_ns, op, {_int('bytes')}, {_int('nranks')}, "
                        f"{_int('pid')} "
                        "FROM main.nccl_events e WHERE typeof(comm_id_hash) = 'text' "
                        "AND typeof(seq) = 'integer'")
    # The next bundles are verified, decompressed and their sync points extracted by
    # helper threads while this one is recorded (zstd, sha256 and SQLite release the GIL).
    with contextlib.closing(prefetch(entries, known_sha, tmpdir, integrity,
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
            fl.stacks_added = []
            try:
                con.execute("BEGIN")
                node_id = resolve_node(fl, bundle.manifest, shown, res)
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
                        counts[t], skipped[t] = copy_bundle_table(con, t, bundle, node_id,
                                                                   bundle_id, None)
                    con.execute("COMMIT")
                finally:
                    if not con.getautocommit():
                        con.execute("ROLLBACK")
                    if attached:
                        con.execute("DETACH DATABASE b")
            except (apsw.Error, ValueError, Conflict, CorruptBundle) as e:
                if not con.getautocommit():
                    con.execute("ROLLBACK")
                # the stacks this bundle added are rolled back: forget them, or a later
                # bundle would map onto a stack id that a new stack then reuses
                for key, sid in fl.stacks_added:
                    fl.stacks.pop(key, None)
                    new_stack_ids.discard(sid)
                bundle.close()
                skip(shown, str(e) if isinstance(e, Conflict) else e.reason
                     if isinstance(e, CorruptBundle) else
                     f"cannot merge ({type(e).__name__}: {e})")
                progress(2)
                continue
            except BaseException:
                bundle.close()          # Ctrl-C here: its image is not left behind
                raise
            known_sha.setdefault(sha, set()).add(os.path.getsize(bundle.path))
            fl.collectives_seen = max(fl.collectives_seen, bundle.collectives_seen)
            pending.append({"bundle": bundle, "shown": shown, "node_id": node_id,
                            "bundle_id": bundle_id, "counts": counts, "skipped": skipped})
            progress(1)

    if not pending and not res.bundles_already:
        # (into an existing fleet.db too: nothing to add is an error, not a partial
        # success, and the file stays as it was)
        reasons = "; ".join(f"{s['input']}: {s['reason']}" for s in res.skipped[:3])
        more = len(res.skipped) - 3
        raise MergeError(f"{res.output}: no usable bundle among the {len(entries)} input"
                         f"{'s' if len(entries) != 1 else ''} ({reasons}"
                         f"{f'; and {more} more' if more > 0 else ''}); "
                         + ("nothing was written" if fl.fresh else "it is unchanged"))
    # collectives of captures attached after their communicators' init: inferred now that
    # every bundle is open, before anything reads sync points from the images
    for item in infer_late_attach(fl, pending):
        try:
            extract_sync(item["bundle"], min_wait_ns, fl.fastcoll)
        except (apsw.Error, RuntimeError) as e:
            raise MergeError(f"{item['shown']}: cannot read its events after the late-attach "
                             f"inference ({type(e).__name__}: {e})") from None
        fl.collectives_seen = max(fl.collectives_seen, item["bundle"].collectives_seen)
    # ---------------------------------------------------------------- pass 2: align
    sample_sync_points(fl, pending)
    con.execute("BEGIN")
    params = align_nodes(fl, res)
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
        """The collectives, sync points and alignment: they need the collectives
        thread's results but none of the big tables, so pass 3 runs this when the main
        thread would otherwise wait for the table builder. Not the node facts: a node's
        ranks may come from nccl_events, which the builder may still hold."""
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
                warn_violations(fl, res, params)
                write_alignment(con, params)
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
            update_nodes(con, fl.collective_ranks)     # every table is in: nccl_events too
            jobs = fleet_jobs(con)
            if len(jobs) > 1:
                msg = (f"this fleet.db now holds {len(jobs)} jobs ({', '.join(jobs[:4])}"
                       f"{', ...' if len(jobs) > 4 else ''}): ingero-report compares all "
                       "their nodes as one fleet; merge each job's bundles into a fleet.db "
                       "of its own")
                fl.log("warning", "several_jobs", msg)
                res.warnings.append(msg)
            settle_in_flight(con)
            # the report's host_bins..., from every table now in (or moved in with it)
            write_summaries(con, fl.summarized)
    except BaseException:
        def stop():
            job.interrupt()
            if fl.builder is not None:
                fl.builder.interrupt()
        run_held(stop)
        raise
    finally:
        run_held(lambda: pool.shutdown(wait=True))
    pending.clear()

    # ---------------------------------------------------------------- finish
    con.execute("BEGIN")
    total_stacks = con.execute("SELECT COUNT(*) FROM stacks").fetchone()[0]
    res.stacks = {"bundle_stacks": stack_rows_seen, "fleet_stacks_used": len(new_stack_ids),
                  "fleet_stacks_total": total_stacks,
                  "dedup_ratio": round(stack_rows_seen / len(new_stack_ids), 2)
                  if new_stack_ids else None}
    res.events = sum(n for t, n in res.rows.items() if t not in NOT_EVENTS)
    # the stacks this merge added to fleet.db (the bundles' own are the stacks line)
    res.rows["stacks"] = total_stacks - stacks_before
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
    res.nodes = node_summary(con)


def _nccl_predicates(pending: list):
    """bundle_id -> the nccl_events rows of that bundle the merge copies (valid and in
    its capture window): the collectives count the same entries on both paths."""
    preds = {i["bundle_id"]: bundle_predicate(i["bundle"], "nccl_events") for i in pending}
    return lambda bundle_id: preds.get(bundle_id, row_predicate("nccl_events"))


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
        raise CorruptBundle(mine[-1]["bundle"].path,
                             f"its clock readings give node {mine[-1]['bundle'].node} a "
                             f"line outside any clock (offset {a.offset_ns} ns, slope "
                             f"{a.slope:g}); not merged")


def _pass3(fl: _Fleet, res: MergeResult, pending: list, params: dict, job, future,
           progress, old_params, max_old_bundle, idle) -> None:
    """Copy the big tables with aligned times. nccl_events joins the completions, which
    the collectives thread computes meanwhile. In a fresh merge a thread of its own
    builds nccl_events and a share of the other tables, each with its indexes, in
    scratch databases while this one copies and indexes the rest, moving each built
    table in as soon as it is ready (TableBuilder)."""
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
                    realign_existing(con, params, old_params, max_old_bundle)
            for item in pending:
                _copy_tables(fl, item, ["nccl_events"], params)
        finally:
            con.execute("DETACH DATABASE cp")
    for item in pending:
        bundle, node_id, bundle_id = item["bundle"], item["node_id"], item["bundle_id"]
        skipped = {t: n for t, n in item["skipped"].items() if n}
        first = getattr(bundle, "skip_reasons", {})
        bundle.close()
        for t, n in skipped.items():
            why = (f"the first, {first[t]}" if first.get(t) else "a value of the wrong type "
                   "or out of range, an unknown enum value, NULL in a required column, or "
                   "a time outside the capture window")
            fl.log("warning", "skipped_rows", f"{n} rows of {t} not merged ({why})",
                   input=item["shown"], node_id=node_id, count=n)
            res.warnings.append(f"{item['shown']}: {n} invalid rows of {t} skipped"
                                + (f" (the first, {first[t]})" if first.get(t) else ""))
        con.execute("UPDATE bundles SET rows = ?, skipped_rows = ? WHERE bundle_id = ?",
                    (json.dumps(item["counts"], sort_keys=True),
                     json.dumps(item["skipped"], sort_keys=True), bundle_id))
        for t, n in item["counts"].items():
            res.rows[t] = res.rows.get(t, 0) + n
        res.bundles_merged += 1
        fl.log("info", "merged", "bundle merged", input=item["shown"], node_id=node_id,
               count=sum(n for t, n in item["counts"].items() if t not in NOT_EVENTS))
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
    built = builder_share(rows)
    stack_rows = con.execute("SELECT bundle_id, local_id, fleet_id FROM "
                             "temp.stack_map_all").fetchall()
    builder = TableBuilder(fl.scratch_base, built, fl.completion_path, job, pending,
                            params, stack_rows)
    fl.builder = builder
    builder.start()
    by_id = {i["bundle_id"]: i for i in pending}

    moved = []

    def move_in(ready):
        # Into an empty fleet table with the same schema and indexes: SQLite moves rows
        # and index entries as they are (its "transfer optimization"), without decoding a
        # row or sorting an index again.
        for table, source, counts, derived in ready:
            moved.append(table)
            if len(moved) == len(built):
                # The last table is in: the other core has nothing left to do; meanwhile
                # fleet.db's pages are written out, so the final fsync has less to do.
                fl.flusher = threading.Thread(target=flush_file, name="ingero-flush",
                                              args=(fl.path,))
                fl.flusher.start()
            with con:
                for stmt in index_ddl(FLEET_TABLES_BY_NAME[table]):
                    con.execute(stmt)
            con.execute("ATTACH DATABASE ? AS nb", (source,))
            try:
                with con:
                    con.execute(f"INSERT INTO main.{table} SELECT * FROM nb.{table}")
                    if "summary" in derived:
                        con.execute(f"INSERT INTO main.{derived['summary']} SELECT * "
                                    f"FROM nb.{derived['summary']}")
                        fl.summarized.add(derived["summary"])
            finally:
                con.execute("DETACH DATABASE nb")
            if "collective_ranks" in derived:
                fl.collective_ranks = derived["collective_ranks"]
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
            release = threading.Thread(target=release_bundles, name="ingero-release",
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
            # No sort helper thread while the builder keeps the other core busy: the
            # helper then only adds its overhead (a third to two-thirds more CPU for the
            # same index; merges of 16 x 2 M events 40.3-40.5 s against 41.4-42.7 s).
            con.execute(f"PRAGMA threads = {SORT_THREADS if builder.ended() else 0}")
            with con:
                for stmt in index_ddl(FLEET_TABLES_BY_NAME[t]):
                    con.execute(stmt)
            between_steps()
        con.execute(f"PRAGMA threads = {SORT_THREADS}")
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
            run_held(release.join)
    _wait_staged(job, future)


def _copy_tables(fl: _Fleet, item: dict, tables, params: dict) -> None:
    """INSERT ... SELECT the bundle's ``tables`` into fleet.db, one transaction."""
    node_id, bundle_id = item["node_id"], item["bundle_id"]
    with attached(fl.con, item["bundle"].db_path, "b"), fl.con:
        load_stack_map(fl.con, bundle_id)
        for t in tables:
            item["counts"][t], item["skipped"][t] = copy_bundle_table(
                fl.con, t, item["bundle"], node_id, bundle_id, params[node_id])


def _attach(con, db_path, name: str = "b") -> None:
    con.execute(f"ATTACH DATABASE ? AS {name}", (image_uri(db_path),))


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
            fl.stacks_added.append((key, sid))
        used.add(sid)
        rows.append((bundle_id, local_id, sid))
    con.executemany("INSERT OR REPLACE INTO temp.stack_map_all VALUES (?, ?, ?)", rows)
    if bad:
        fl.log("warning", "skipped_rows", f"{bad} stacks with frames that are not a JSON "
               "array; rows pointing at them get stack_id NULL", input=shown,
               node_id=node_id, count=bad)
    return n


# --------------------------------------------------------------------------- alignment


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
