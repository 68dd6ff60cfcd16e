"""Pass 1 of a merge, per bundle: read its manifest, verify and decompress its image
(bundle.open_bundle) and read what the collectives need from it (run files of collective
rows on the C path, a scratch database on the SQL path), the next bundles ahead of the
main thread in helper threads (docs/merge.md, "How the work is split")."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import apsw

from ..bundle.container import read_manifest
from ..bundle.reader import open_bundle
from ..errors import BundleError
from ..interrupts import run_held
from .copying import bundle_predicate
from .lateattach import has_late_rows
from .syncpoints import extract_sync_points, image_runs

#: Threads that verify, decompress and extract sync points ahead of the copying thread
#: (zstd, sha256 and SQLite release the GIL, so they run on other cores).
PREFETCH_THREADS = 2


def open_one(path, known_sha, tmpdir, integrity, min_wait_ns, fastcoll):
    """(sha, Bundle) or (sha, None) when already merged, or the BundleError. The Bundle
    carries its sync points: ``run_paths`` (the C path: run files of collective rows) or
    ``sync_path`` (the SQL path: a scratch database); close() removes them.
    known_sha: {sha256: file sizes} of the bundles merged; a file whose manifest names
    one of them is not opened again only at one of those sizes."""
    try:
        sha = read_manifest(path)["database"]["sha256"]
        if sha in known_sha and os.path.getsize(path) in known_sha[sha]:
            return sha, None
        bundle = open_bundle(path, tmpdir=tmpdir, integrity=integrity)
    except BundleError as e:
        return e
    try:
        bundle.late_rows = has_late_rows(bundle.con, bundle, "main")
        bundle.con.close()
        bundle.con = None
        bundle.sync_path, bundle.run_paths = None, []
        extract_sync(bundle, min_wait_ns, fastcoll)
    except (apsw.Error, RuntimeError) as e:
        bundle.close()
        return BundleError(path, f"cannot read its events ({type(e).__name__}: {e})")
    except BaseException:
        bundle.close()          # (out of memory, say): its image is not left behind
        raise
    return sha, bundle


def extract_sync(bundle, min_wait_ns, fastcoll) -> None:
    """Read the image's sync points and collective entries (again, after the late-attach
    inference rewrote it: the files of an earlier read are removed first)."""
    owned = owned_files(bundle)
    for f in bundle.run_paths + ([bundle.sync_path] if bundle.sync_path else []):
        owned.remove(f)
        Path(f).unlink(missing_ok=True)
    bundle.sync_path, bundle.run_paths = None, []
    if fastcoll is not None:
        tables = bundle.manifest["tables"]
        rows = (tables.get("nccl_events") or 0) + (tables.get("cuda_events") or 0)
        bundle.run_paths, bundle.collectives_seen = image_runs(
            fastcoll, bundle.db_path, bundle.db_path,
            bundle_predicate(bundle, "nccl_events"),
            rows, min_wait_ns)
        owned.extend(bundle.run_paths)
    else:
        sync_path = Path(f"{bundle.db_path}.sync")
        owned.append(sync_path)
        bundle.collectives_seen = extract_sync_points(bundle.db_path, sync_path, min_wait_ns)
        bundle.sync_path = sync_path


def owned_files(bundle) -> list:
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


def prefetch(entries, known_sha, tmpdir, integrity, min_wait_ns, fastcoll):
    """Yield (shown, path, err, opened) in input order, with the next bundles opened in
    PREFETCH_THREADS helper threads. known_sha is read again by the caller: a bundle may
    repeat within one run. On exit (error, interrupt) bundles opened ahead are closed,
    removing their temporary files, and so is the one last yielded (the caller may not
    have taken it into its own cleanup yet; closing twice is harmless)."""
    todo = list(entries)
    prefix = f"ingero-open-{id(entries):x}"
    pool = ThreadPoolExecutor(max_workers=PREFETCH_THREADS, thread_name_prefix=prefix)
    futures = {}
    # Bundles opened and not yet let go by the caller, under a lock shared with the
    # helpers: a Ctrl-C may land anywhere in this thread (between a future's result and
    # the bookkeeping, in the pool's shutdown), so the images are tracked where they are
    # made. Once abandoned, a helper that finishes closes its own bundle.
    lock = threading.Lock()
    live: set = set()
    abandoned = False

    def opener(*args):
        r = open_one(*args)
        if isinstance(r, tuple) and r[1] is not None:
            with lock:
                if abandoned:
                    r[1].close()
                else:
                    live.add(r[1])
        return r

    def submit(i):
        if i < len(todo) and not todo[i][2]:
            known = {sha: set(sizes) for sha, sizes in known_sha.items()}
            futures[i] = pool.submit(opener, todo[i][1], known, tmpdir, integrity,
                                     min_wait_ns, fastcoll)
    try:
        for i in range(PREFETCH_THREADS):
            submit(i)
        for i, (shown, path, err) in enumerate(todo):
            fut = futures.pop(i, None)
            opened = fut.result() if fut is not None else None
            submit(i + PREFETCH_THREADS)
            yield shown, path, err, opened
            # the caller asks for the next one: it has taken this one (merged, closed)
            if isinstance(opened, tuple) and opened[1] is not None:
                with lock:
                    live.discard(opened[1])
    finally:
        def cleanup():
            nonlocal abandoned
            with lock:
                abandoned = True
                left = list(live)
            for bundle in left:         # (run again after an interrupt: idempotent)
                bundle.close()
                live.discard(bundle)
            for fut in futures.values():
                fut.cancel()
            pool.shutdown(wait=True)
            # a Ctrl-C inside pool.submit() can land after a worker started and before
            # the pool counted it: shutdown() does not wait for that one (it opens a
            # bundle it was given, and closes it, abandoned, when done)
            for t in threading.enumerate():
                if t.name.startswith(f"{prefix}_"):
                    t.join()
        run_held(cleanup)
