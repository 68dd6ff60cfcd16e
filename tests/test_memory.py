"""ingero_forensics.memory: freed blocks stay in the process after keep_freed_memory()."""

import platform
import subprocess
import sys
import textwrap

import pytest

# A 24 MiB block, touched, freed: where does the resident memory go?
_PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, os, sys
    from ingero_forensics.memory import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    def rss_kib():
        pages = int(open("/proc/self/statm").read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") // 1024
    size = 24 << 20
    before = rss_kib()
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    touched = rss_kib()
    libc.free(p)
    print(before, touched, rss_kib())
""")


def _probe(mode: str) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], check=True,
                         capture_output=True, text=True).stdout
    return tuple(map(int, out.split()))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_memory_is_kept_only_when_asked():
    before, touched, after = _probe("default")
    assert touched - before >= 20 << 10
    assert touched - after >= 20 << 10          # glibc gave the block back at once
    before, touched, after = _probe("keep")
    assert touched - before >= 20 << 10
    assert touched - after < 4 << 10            # kept for the next allocation
