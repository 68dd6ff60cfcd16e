"""Keep freed heap memory in the process during heavy SQLite work (glibc only).

A merge allocates and frees the same few hundred MiB over and over: page caches of the
scratch databases it opens and closes, SQLite's sort buffers for every index build, the
sync-point sorts. glibc gives freed memory back to the kernel (trim above 128 KiB free at
the heap top, ``mmap`` for blocks from 128 KiB up, whose ``munmap`` returns them at
once), so each reuse faults in and zeroes fresh pages; on a VM that returns free pages to
its host this costs more still. Keeping them (``M_TRIM_THRESHOLD`` out of reach,
``M_MMAP_THRESHOLD`` at glibc's largest, 32 MiB on 64-bit) measured 5 % off a merge of
4 x 2 M events (10.1-10.5 s against 10.6-11.2 s, system time 3.0-3.4 s against
3.3-4.0 s, alternating; docs/performance.md) for 6 MiB more peak RSS. The process's
resident memory then stays near its peak until it exits, which suits the command-line
tools: they exit when done.
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_MMAP_MAX = 32 * 1024 * 1024
#: mallopt takes an int: the trim threshold saturates at 2 GiB, far above what a merge
#: frees at once
_TRIM_MAX = 2**31 - 1

_done = False


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (once per process). Returns
    whether it took effect (False elsewhere than glibc: nothing changes)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_MAX) == 1
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX) == 1 and ok
    _done = ok
    return ok
