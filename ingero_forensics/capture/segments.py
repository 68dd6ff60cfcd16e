"""Segments on disk: the live spool, rotation, sealing, crash recovery and eviction.

Layout under the bundle directory::

    <bundle-dir>/<node>+<UTC stamp>Z+<index>.bundle   sealed segments
    <bundle-dir>/.spool/segment-<index>.db (+ -wal)    the live segment (SQLite, WAL)
    <bundle-dir>/.spool/lock                           flock: one capture per directory

A segment is sealed in a background thread (compression takes seconds for a large
segment) while the next one is already recording, so rotation loses nothing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from ..bundle.container import BUNDLE_SUFFIX
from ..bundle.writer import BundleWriter, now_pair, seal_spool
from ..errors import DiskFullError, IngeroError

SPOOL_DIR = ".spool"
_BUNDLE_NAME = re.compile(r"^(?P<node>[A-Za-z0-9._-]{1,63})\+(?P<stamp>\d{8}T\d{6})Z\+"
                          r"(?P<index>\d{6,})" + re.escape(BUNDLE_SUFFIX) + "$")
_SPOOL_NAME = re.compile(r"^segment-(?P<index>\d+)\.db$")
#: a seal's temporary file (bundle/container.py: ``.<bundle name>.<pid>.<12 hex>.tmp``)
_SEAL_TEMP = re.compile(r"^\.(?P<bundle>[A-Za-z0-9._+-]+" + re.escape(BUNDLE_SUFFIX)
                        + r")\.\d+\.[0-9a-f]{12}\.tmp$")


@dataclass
class SealedFile:
    path: Path
    node: str
    stamp: str
    index: int
    size: int


def sealed_bundles(bundle_dir) -> list[SealedFile]:
    """Sealed segments in the directory, oldest first (by start time, then index)."""
    out = []
    for entry in os.scandir(bundle_dir):
        m = _BUNDLE_NAME.match(entry.name)
        if m and entry.is_file(follow_symlinks=False):
            out.append(SealedFile(Path(entry.path), m["node"], m["stamp"], int(m["index"]),
                                  entry.stat(follow_symlinks=False).st_size))
    out.sort(key=lambda f: (f.stamp, f.index, f.node))
    return out


def check_spool_dir(spool_dir: Path) -> None:
    """The spool directory is a real directory that no other user may write: the
    capture (often root) writes its pid into ``lock`` and its segments there, so a link
    or a file planted there by another user would have root write where they chose."""
    try:
        st = os.lstat(spool_dir)
    except OSError as e:
        raise IngeroError(f"{spool_dir}: cannot use as spool directory: "
                          f"{e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise IngeroError(f"{spool_dir}: not a directory (a symlink or a file); remove it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise IngeroError(f"{spool_dir}: writable by other users (mode "
                          f"{stat.S_IMODE(st.st_mode):o}); chmod go-w it")
    if st.st_uid != os.geteuid():
        raise IngeroError(f"{spool_dir}: owned by uid {st.st_uid}, not by this user "
                          f"(uid {os.geteuid()})")


def check_bundle_dir(bundle_dir: Path) -> None:
    """A bundle directory every user may write is refused: anyone could plant a file
    under a bundle's name for the operator to copy off and merge as this node's
    evidence, or (without the sticky bit) replace or delete the sealed ones. The
    capture creates its own directory owner-only (run_capture); a group-writable one is
    the administrator's choice of whom to trust."""
    try:
        st = os.stat(bundle_dir)
    except OSError as e:
        raise IngeroError(f"{bundle_dir}: cannot use as bundle directory: "
                          f"{e.strerror or e}") from None
    if st.st_mode & stat.S_IWOTH:
        raise IngeroError(f"{bundle_dir}: writable by every user (mode "
                          f"{stat.S_IMODE(st.st_mode):o}): another user could plant or "
                          "replace bundles; use a directory of its own, or chmod o-w it")


def remove_seal_temporaries(bundle_dir: Path) -> list[str]:
    """Remove the temporary files of seals that a killed capture left (SIGKILL or a
    power cut between its creation and its rename). Called under the directory's lock,
    so no seal of a live capture is in progress; the segment itself is either sealed
    already or still in the spool, which recover_spools seals. Only regular files of
    this user with the seal's exact name pattern are touched. Returns their names."""
    gone = []
    with os.scandir(bundle_dir) as entries:
        for entry in entries:
            if not _SEAL_TEMP.fullmatch(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    continue
                os.unlink(entry.path)
            except OSError:     # gone already, or not ours to remove (EPERM, EROFS)
                continue
            gone.append(entry.name)
    return sorted(gone)


def lock_directory(spool_dir: Path):
    """Hold an exclusive lock for the life of the capture; IngeroError if one runs.
    The lock file is opened without following a link (O_NOFOLLOW) and must be a
    regular file."""
    check_spool_dir(spool_dir)
    path = spool_dir / "lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise IngeroError(f"{path}: cannot open the lock file: {e.strerror or e}"
                          + (" (a symlink: remove it)" if os.path.islink(path) else "")
                          ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IngeroError(f"{path}: not a regular file; remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise IngeroError(f"{spool_dir.parent}: another ingero-capture (pid {other or '?'}) "
                          "is writing to this directory") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:
        os.close(fd)
        if e.errno == errno.ENOSPC:
            raise DiskFullError(f"{path}: file system full") from None
        raise IngeroError(f"{path}: cannot write ({e.strerror or e})") from None
    return fd


def recover_spools(spool_dir: Path, bundle_dir: Path, *, level: int = 3) -> list[tuple[str, str, str]]:
    """Seal every spool a killed capture left. Returns (level, event, message) log entries.

    A spool that cannot be sealed (e.g. killed before its tables existed) is renamed to
    ``*.db.unsealable`` so it is kept for inspection but not retried forever.
    """
    log = []
    for entry in sorted(os.scandir(spool_dir), key=lambda e: e.name):
        if not _SPOOL_NAME.match(entry.name):
            continue
        path = Path(entry.path)
        try:
            out = seal_spool(path, bundle_dir, level=level, recovered=True)
            log.append(("warning", "recovered_spool",
                        f"sealed {path.name} left by an earlier capture as {out.name}"))
        except DiskFullError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken spool must not stop the capture
            bad = path.with_name(path.name + ".unsealable")
            for suffix in ("", "-wal", "-shm"):
                src = Path(f"{path}{suffix}")
                if src.exists():
                    os.replace(src, Path(f"{bad}{suffix}"))
            log.append(("error", "recovered_spool",
                        f"cannot seal {path.name} ({type(e).__name__}: {e}); kept as {bad.name}"))
    return log


def next_index(bundle_dir: Path, spool_dir: Path, node: str) -> int:
    idx = [f.index for f in sealed_bundles(bundle_dir) if f.node == node]
    for entry in os.scandir(spool_dir):
        m = re.match(r"^segment-(\d+)\.db", entry.name)
        if m:
            idx.append(int(m.group(1)))
    return max(idx) + 1 if idx else 0     # docs/bundle-format.md: the first is 0


class Sealer:
    """Seals one segment at a time in a background thread."""

    def __init__(self, bundle_dir: Path, level: int):
        self.bundle_dir = bundle_dir
        self.level = level
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.done: list[Path] = []     # sealed paths not yet collected by the loop

    def seal(self, writer: BundleWriter, capture_end) -> None:
        self.wait()

        def work():
            try:
                self.done.append(writer.seal(self.bundle_dir, capture_end=capture_end,
                                             level=self.level))
            except BaseException as e:  # noqa: BLE001 - reported by the loop
                try:
                    writer.con.close()
                except Exception:  # noqa: BLE001
                    pass
                self.error = e

        self._thread = threading.Thread(target=work, name="ingero-sealer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def collect(self) -> list[Path]:
        out, self.done = self.done, []
        return out


def evict(bundle_dir: Path, node: str, max_disk: int, *, in_use: int = 0,
          keep: set[Path] = frozenset()) -> list[tuple[Path, int]]:
    """Delete this node's oldest sealed segments until they plus ``in_use`` fit in max_disk.

    The newest sealed segment is never deleted (a flight recorder keeps its last
    recording even when one segment alone exceeds the budget). Returns (path, size).
    """
    files = [f for f in sealed_bundles(bundle_dir) if f.node == node]
    total = in_use + sum(f.size for f in files)
    evicted = []
    for f in files[:-1]:
        if total <= max_disk:
            break
        if f.path in keep:
            continue
        try:
            f.path.unlink()
        except FileNotFoundError:
            pass
        total -= f.size
        evicted.append((f.path, f.size))
    return evicted


def new_writer(spool_dir: Path, node: str, host: dict, index: int, extra_meta=None) -> BundleWriter:
    return BundleWriter(spool_dir / f"segment-{index:06d}.db", node=node, host=host,
                        capture_start=now_pair(), segment_index=index, extra_meta=extra_meta)
