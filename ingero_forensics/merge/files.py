"""The files of a merge: its inputs (files, directories, globs), the output's lock, the
scratch files a killed merge left, and an existing output that must be a fleet.db with
no -wal or journal beside it (docs/merge.md, "Inputs and outputs").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import re
import stat
from pathlib import Path

import apsw

from ..bundle.container import read_manifest
from ..db import harden
from ..errors import BundleError, IngeroError
from .fleet_schema import FLEET_APPLICATION_ID, FLEET_VERSION


class MergeError(IngeroError):
    """The merge cannot proceed (bad output, --strict with a skipped input)."""


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


def new_output(out: Path) -> bool:
    """Whether the merge makes a new fleet.db at out: nothing there, or an empty file
    (as `mktemp` leaves one), which holds nothing to keep or to refuse."""
    try:
        st = out.stat()
    except FileNotFoundError:
        return True
    except OSError:
        return False        # what is wrong with it is said by the open that follows
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


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


def lock_output(out: Path, tmpdir: Path | None = None) -> tuple[int, Path]:
    """An exclusive lock on ``.<name>.lock`` beside the output, held for the whole merge:
    a second merge into the same file refuses at once (two would each rename their own
    result into place and one's bundles would be lost). Under the lock, scratch files
    that merges killed earlier left beside the output are removed, and a -wal or hot
    journal beside an existing output is settled (settle_output)."""
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
        remove_stale_scratch(out, tmpdir)
        if not new_output(out):
            check_fleet(out)            # only a fleet.db is settled, nothing else touched
            settle_output(out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
        raise
    return fd, path


def remove_stale_scratch(out: Path, tmpdir: Path | None = None) -> None:
    """Files named ``.<name>.<pid>.*`` beside the output that a merge killed before its
    cleanup left (the temporary fleet.db, its journal, staging and scratch databases), and decompressed images
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


def settle_output(out: Path) -> None:
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


def fleet_sound(path) -> bool:
    """Whether the existing fleet.db passes quick_check: asked only after a merge into it
    met a malformed page, to say that the file was damaged before (not a bundle)."""
    try:
        con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            return [r[0] for r in con.execute("PRAGMA quick_check(1)")] == ["ok"]
        finally:
            con.close()
    except apsw.Error:
        return False
