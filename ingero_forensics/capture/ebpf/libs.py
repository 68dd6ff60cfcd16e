"""Finding the NCCL and CUDA libraries the traced processes use.

Uprobes attach to a file (an inode), not to a process: once a library file is probed,
every process mapping it is covered. Libraries are found in /proc/PID/maps of the
target processes (pip wheels put them under site-packages/nvidia/*/lib) and given
explicitly with ``--lib PATH``. A path seen inside a container's mount namespace is
reached through /proc/PID/root.
"""

from __future__ import annotations

import os

#: library kind -> file name prefix
KINDS = {"nccl": "libnccl.so", "cudart": "libcudart.so", "cuda": "libcuda.so"}


def lib_kind(path: str) -> str | None:
    base = os.path.basename(path)
    for kind, prefix in KINDS.items():
        if base.startswith(prefix):
            return kind
    return None


def probed_functions(kind: str) -> set[str]:
    """The functions of a library kind that the capture puts uprobes on."""
    if kind == "nccl":
        from .nccl import probes  # noqa: PLC0415 (those modules import this one)
        return {p.sym for p in probes()}
    from .cuda import APIS  # noqa: PLC0415
    return {sym for sym, lib, *_rest in APIS if lib == kind}


def not_the_library(path: str) -> str | None:
    """Why the file at path, named as a library of some kind, cannot be probed as one
    (not readable, not ELF, or none of the functions probed in it), else None: a
    --lib that is not the library would attach nothing and record nothing."""
    from .symbols import UNREADABLE, elf_symbols  # noqa: PLC0415
    kind = lib_kind(path)
    syms = elf_symbols(path)
    if syms is UNREADABLE:
        return "cannot be read as a regular file"
    if syms is None:
        return "is not an ELF shared library"
    wanted = probed_functions(kind)
    if not wanted & syms.function_names():
        return (f"has none of the {KINDS[kind]} functions the capture probes (such as "
                f"{min(wanted)}): not that library?")
    return None


def libs_in_maps(pid: int, proc: str = "/proc") -> list[str]:
    """Paths of NCCL/CUDA libraries mapped by pid, reachable from this mount namespace."""
    try:
        with open(f"{proc}/{pid}/maps", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    found = []
    for line in raw.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or b"lib" not in parts[5]:
            continue
        path = parts[5].decode(errors="replace").strip()
        if path.endswith(" (deleted)") or lib_kind(path) is None or path in found:
            continue
        found.append(path)
    out = []
    for path in found:
        reach = path if os.path.exists(path) else f"{proc}/{pid}/root{path}"
        if os.path.exists(reach):
            out.append(reach)
    return out


def file_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class LibraryTracker:
    """Remembers which library files are probed and finds new ones among the targets."""

    RESCAN_S = 1.0

    def __init__(self, kinds: tuple[str, ...], lib_paths: list[str]):
        self.kinds = kinds
        self.explicit = [p for p in lib_paths if lib_kind(p) in kinds]
        self.seen: set[tuple[int, int]] = set()
        self.kinds_seen: set[str] = set()   # kinds of the libraries probed
        self.last_scan = 0.0

    def new_libraries(self, pids) -> list[tuple[str, str]]:
        """(kind, path) of libraries not probed yet: explicit ones, then the targets'."""
        out = []
        for path in [*self.explicit, *(p for pid in sorted(pids) for p in libs_in_maps(pid))]:
            kind = lib_kind(path)
            ident = file_identity(path)
            if kind not in self.kinds or ident is None or ident in self.seen:
                continue
            self.seen.add(ident)
            self.kinds_seen.add(kind)
            out.append((kind, path))
        return out
