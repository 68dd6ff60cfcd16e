"""Symbols for user stack addresses, read from the ELF files a process maps.

Why not BCC's symbol caches (``bcc_symcache_new``): libbcc before 0.33 (Debian 12 ships
0.26) closes an uninitialised file descriptor each time it builds or re-reads one
(``ProcSyms::ModulePath``; bcc pull request 5193). That number can be any descriptor of
the capture: the open bundle's database, a ring buffer, the spool lock. A test run lost
pytest's own stderr to it. So the mappings are read from /proc/PID/maps and the symbols
from each file's ``.symtab`` and ``.dynsym`` here, in Python: a file is read once for
every process that maps it (BCC read it once per process).

Files are opened through /proc/PID/map_files (the very file mapped, even if deleted or in
another mount namespace), else /proc/PID/root. ELF64 little-endian only (x86_64, aarch64).
A stripped file's symbols are looked for in its separate debug file (build id, then
``.gnu_debuglink``) under /usr/lib/debug. JIT code is named from /tmp/perf-PID.map.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import os
import stat
import struct
import zlib
from array import array
from collections import OrderedDict

from ..procs import read_stat_starttime

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
PT_LOAD, PT_NOTE = 1, 4
SHT_SYMTAB, SHT_NOTE, SHT_DYNSYM = 2, 7, 11
STT_FUNC, STT_GNU_IFUNC = 2, 10
NT_GNU_BUILD_ID = 3
DEBUG_DIR = "/usr/lib/debug"
#: symbol table entries read per file at most, all tables together (a hostile or broken
#: header must not exhaust memory: libtorch's largest has about a million entries)
MAX_SYMBOLS = 4_000_000
#: a perf map read at most (JIT maps are a line per compiled function)
MAX_PERF_MAP = 64 << 20
#: parsed files kept (by identity: device, inode, size, mtime), least recently used out
FILE_CACHE = 128
#: files a process maps that ``ProcessSymbols.preload`` reads at most, the largest first
#: (the cache must still hold them when the stacks come)
PRELOAD_FILES = FILE_CACHE // 2
#: elf_symbols: the file could not be opened as a regular file (not: it is not ELF)
UNREADABLE = object()


class ElfSymbols:
    """The function symbols of one ELF file, by address, and its loadable segments (to
    turn an offset in the file into an address)."""

    def __init__(self, segments, values, sizes, names, strtabs) -> None:
        self.segments = segments          # [(file offset, address, size in file)]
        self.values, self.sizes = values, sizes
        self.names = names                # (strtab index << 32 | offset in it)
        self.strtabs = strtabs

    def address(self, file_offset: int) -> int | None:
        for off, vaddr, size in self.segments:
            if off <= file_offset < off + size:
                return file_offset - off + vaddr
        return None

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        """(name, offset into the function) of the function holding ``vaddr``."""
        i = bisect.bisect_right(self.values, vaddr) - 1
        for k in range(i, max(i - 8, -1), -1):       # nested or aliased symbols
            start, size = self.values[k], self.sizes[k]
            if vaddr < start + size or (size == 0 and k == i):
                return self._name(k), vaddr - start
        return None

    def function_names(self) -> set[str]:
        return {self._name(k) for k in range(len(self.values))}

    def _name(self, k: int) -> str:
        ref = self.names[k]
        tab = self.strtabs[ref >> 32]
        start = ref & 0xFFFFFFFF
        end = tab.find(b"\0", start)
        return demangle(tab[start:end if end >= 0 else len(tab)])


def _read(fd: int, off: int, size: int, file_size: int) -> bytes:
    if off < 0 or size < 0 or off + size > file_size:
        raise ValueError("section beyond the end of the file")
    data = os.pread(fd, size, off)
    if len(data) != size:
        raise ValueError("short read")
    return data


def _parse(fd: int, file_size: int):
    """(segments, symbol tables as (section type, symbols, strings), build id,
    debuglink)."""
    head = _read(fd, 0, _EHDR.size, file_size)
    (ident, _type, _mach, _ver, _entry, phoff, shoff, _flags, _ehsize, phentsize, phnum,
     shentsize, shnum, _shstrndx) = _EHDR.unpack(head)
    if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    segments, build_id, debuglink, tables = [], None, None, []
    if phnum and phentsize == _PHDR.size:
        raw = _read(fd, phoff, phnum * _PHDR.size, file_size)
        for p_type, _f, p_off, p_vaddr, _pa, p_filesz, _m, _al in _PHDR.iter_unpack(raw):
            if p_type == PT_LOAD:
                segments.append((p_off, p_vaddr, p_filesz))
    if not shnum or shentsize != _SHDR.size:
        return segments, tables, build_id, debuglink
    shdrs = list(_SHDR.iter_unpack(_read(fd, shoff, shnum * _SHDR.size, file_size)))
    names = b""
    if 0 <= _shstrndx < shnum:
        s = shdrs[_shstrndx]
        names = _read(fd, s[4], s[5], file_size)
    entries = 0
    for sh_name, sh_type, _fl, _addr, sh_off, sh_size, sh_link, _info, _al, _es in shdrs:
        name = names[sh_name:names.find(b"\0", sh_name)] if sh_name < len(names) else b""
        if sh_type in (SHT_SYMTAB, SHT_DYNSYM) and 0 <= sh_link < shnum:
            entries += sh_size // _SYM.size
            if entries > MAX_SYMBOLS:
                raise ValueError("symbol tables too large")
            link = shdrs[sh_link]
            tables.append((sh_type, _read(fd, sh_off, sh_size - sh_size % _SYM.size,
                                          file_size), _read(fd, link[4], link[5], file_size)))
        elif sh_type == SHT_NOTE and name == b".note.gnu.build-id" and sh_size <= 4096:
            note = _read(fd, sh_off, sh_size, file_size)
            if len(note) >= 12:
                namesz, descsz, ntype = struct.unpack_from("<III", note)
                start = 12 + (namesz + 3) // 4 * 4
                if ntype == NT_GNU_BUILD_ID and start + descsz <= len(note):
                    build_id = note[start:start + descsz].hex()
        elif name == b".gnu_debuglink" and sh_size <= 4096:
            link = _read(fd, sh_off, sh_size, file_size)
            end = link.find(b"\0")
            at = (end + 4) // 4 * 4                   # the CRC32 follows, 4-aligned
            if end > 0 and at + 4 <= len(link):
                debuglink = (link[:end].decode("utf-8", "replace"),
                             struct.unpack_from("<I", link, at)[0])
    return segments, tables, build_id, debuglink


def _symbols(tables) -> tuple[array, array, array, list[bytes]]:
    rows = []
    strtabs = []
    for k, (_kind, syms, strtab) in enumerate(tables):
        strtabs.append(strtab)
        for st_name, st_info, _other, shndx, value, size in _SYM.iter_unpack(syms):
            if value and shndx and (st_info & 0xF) in (STT_FUNC, STT_GNU_IFUNC) \
                    and st_name < len(strtab):
                rows.append((value, size, st_info >> 4, k << 32 | st_name))
    rows.sort()
    values, sizes, names = array("Q"), array("Q"), array("Q")
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and rows[j][:2] == rows[i][:2]:
            j += 1
        ref = rows[i][3] if j == i + 1 else min(rows[i:j], key=lambda r: _alias_rank(
            r, strtabs))[3]
        values.append(rows[i][0])
        sizes.append(rows[i][1])
        names.append(ref)
        i = j
    return values, sizes, names, strtabs


def _alias_rank(row, strtabs) -> tuple:
    """Of the names of one function (printf and _IO_printf, ncclAllReduce and
    pncclAllReduce, one symbol in both tables), the one a person calls it by: the
    fewest leading underscores, the shortest, global before weak before local."""
    _v, _s, bind, ref = row
    tab, start = strtabs[ref >> 32], ref & 0xFFFFFFFF
    end = tab.find(b"\0", start)
    name = tab[start:end if end >= 0 else len(tab)]
    return (len(name) - len(name.lstrip(b"_")), len(name), {1: 0, 2: 1}.get(bind, 2), name)


_files: OrderedDict = OrderedDict()


def _debug_file(root: str, path: str, build_id: str | None, debuglink):
    """A separate debug file for a stripped ELF file, as distributions install them,
    seen from the process's root (a container's own), and only one that belongs to it:
    the same build id, or without one the CRC32 its .gnu_debuglink names."""
    candidates = []
    if build_id and len(build_id) > 2:
        candidates.append(f"{DEBUG_DIR}/.build-id/{build_id[:2]}/{build_id[2:]}.debug")
    if debuglink and "/" not in debuglink[0]:
        d, name = os.path.dirname(path), debuglink[0]
        candidates += [f"{d}/{name}", f"{d}/.debug/{name}", f"{DEBUG_DIR}{d}/{name}"]
    for c in candidates:
        fd = _open_regular(root + c)
        if fd is None:
            continue
        try:
            size = os.fstat(fd).st_size
            if build_id:
                if _parse(fd, size)[2] != build_id:
                    continue
            elif _crc32(fd) != debuglink[1]:
                continue
            return _parse(fd, size)[1]
        except (ValueError, struct.error, OSError):
            continue
        finally:
            os.close(fd)
    return []


def _crc32(fd: int) -> int:
    crc, off = 0, 0
    while chunk := os.pread(fd, 1 << 20, off):
        crc = zlib.crc32(chunk, crc)
        off += len(chunk)
    return crc


def _open_regular(path: str) -> int | None:
    """A descriptor of ``path`` if it is a regular file, else None: never blocks (a FIFO
    placed where a file was expected)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def elf_symbols(path: str, root: str = "", logical: str = "") -> ElfSymbols | None:
    """The symbols of the ELF file at ``path`` (None when it is not one, UNREADABLE when
    it cannot be opened as a regular file), shared by every process that maps the same
    file. ``root``: the process's /proc/PID/root, where its debug files are;
    ``logical``: the file's path as the process sees it (for .gnu_debuglink)."""
    fd = _open_regular(path)
    if fd is None:
        return UNREADABLE
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        hit = _files.get(key, False)
        if hit is not False:
            _files.move_to_end(key)
            return hit
        try:
            segments, tables, build_id, debuglink = _parse(fd, st.st_size)
            if not any(kind == SHT_SYMTAB and syms for kind, syms, _s in tables):
                tables = tables + _debug_file(root, logical or path, build_id, debuglink)
            found = ElfSymbols(segments, *_symbols(tables))
        except (ValueError, struct.error, OSError):
            found = None
    finally:
        os.close(fd)
    _files[key] = found
    if len(_files) > FILE_CACHE:
        _files.popitem(last=False)
    return found


def preload(processes, limit: int = PRELOAD_FILES) -> int:
    """Read the symbols of the files the processes map executable: the ``limit`` largest,
    each file once however many map it; the number read. A capture does this before its
    probes go on. Read at the first stacks instead, while a running job's calls arrive,
    PyTorch's libraries (libtorch_cpu.so: 356,000 function symbols) hold the loop that
    empties the ring buffers for seconds, and they fill meanwhile. The smallest are read
    first, so that the largest, the dearest to read again, are the cache's newest."""
    chosen: dict[tuple[int, int], tuple[int, ProcessSymbols, int]] = {}
    for proc in processes:
        for size, ident, lo in proc.mapped_files():
            chosen.setdefault(ident, (size, proc, lo))
    picked = sorted(chosen.values(), key=lambda c: c[0], reverse=True)[:limit]
    for _size, proc, lo in reversed(picked):
        try:
            proc.resolve(lo)
        except Exception:   # noqa: BLE001 - as in a stack: that file stays unnamed
            pass
    return len(picked)


@functools.lru_cache(maxsize=1)
def _cxa_demangle():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    fn = lib.__cxa_demangle
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_int)]
    libc.free.argtypes = [ctypes.c_void_p]
    return fn, libc.free


def demangle(raw: bytes) -> str:
    """A C++ name as a person reads it (libstdc++'s demangler, as BCC did); others as
    they are."""
    if raw.startswith(b"_Z") and (cxa := _cxa_demangle()) is not None:
        fn, free = cxa
        status = ctypes.c_int(0)
        out = fn(raw, None, None, ctypes.byref(status))
        if out:
            try:
                if status.value == 0:
                    return ctypes.string_at(out).decode("utf-8", "replace")
            finally:
                free(out)
    return raw.decode("utf-8", "replace")


class ProcessSymbols:
    """The executable mappings of one process, read from /proc/PID/maps at creation and
    on ``refresh``; ``resolve`` names an address. A mapping's symbols, once read, are
    kept with it: the process's last stacks are still named after it exited (its files
    can then no longer be opened through /proc), and a frame costs no open()."""

    def __init__(self, pid: int, proc: str = "/proc") -> None:
        self.pid = pid
        self.proc = proc
        #: when the process started (ns since boot): the same pid later is another one
        self.started = read_stat_starttime(pid, proc)
        self.maps: list[tuple[int, int, int, str]] = []   # (start, end, offset, path)
        self.starts: list[int] = []
        self._perf_map: tuple[list[int], list[tuple[int, int, str]], str] | None = None
        #: mapping (start, end, offset, path) -> its file's symbols (None: not ELF)
        self._elf: dict[tuple[int, int, int, str], ElfSymbols | None] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the mappings again; a process gone keeps the ones it had (its maps file
        cannot be opened once reaped, and reads empty while it is a zombie)."""
        maps = []
        try:
            with open(f"{self.proc}/{self.pid}/maps", "rb") as f:
                lines = f.read().splitlines()
        except OSError:
            return
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 6 or b"x" not in parts[1]:
                continue
            try:
                lo, hi = (int(x, 16) for x in parts[0].split(b"-"))
                off = int(parts[2], 16)
            except ValueError:
                continue
            path = parts[5].decode("utf-8", "replace")
            maps.append((lo, hi, off, path))
        if not maps:
            return
        maps.sort()
        self.maps = maps
        self.starts = [m[0] for m in maps]
        self._perf_map = None
        kept = set(maps)
        self._elf = {m: e for m, e in self._elf.items() if m in kept}

    def resolve(self, addr: int) -> tuple[str | None, int, str | None]:
        """(symbol, offset, module path): offset into the symbol, or into the module
        when the symbol is unknown; (None, addr, None) outside every known mapping."""
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0 or addr >= self.maps[i][1]:
            return self._jit(addr)
        lo, hi, off, path = self.maps[i]
        if not path.startswith("/") or path.startswith("/memfd:"):
            jit = self._jit(addr)                         # anonymous: a JIT's code
            if jit[0] is not None or not path:
                return jit
            return None, addr - lo, path                  # [vdso], a memfd
        deleted = path.endswith(" (deleted)")
        shown = path[:-len(" (deleted)")] if deleted else path
        elf = self._elf.get(self.maps[i], UNREADABLE)
        if elf is UNREADABLE:
            root = f"{self.proc}/{self.pid}/root"
            elf = elf_symbols(f"{self.proc}/{self.pid}/map_files/{lo:x}-{hi:x}", root, shown)
            if elf is UNREADABLE and not deleted:
                # map_files needs CAP_SYS_ADMIN; the path may name another file by now, so
                # only when the very file could not be opened, and never for a deleted one
                elf = elf_symbols(root + shown, root, shown)
            if elf is not UNREADABLE:
                self._elf[self.maps[i]] = elf
        file_offset = addr - lo + off
        if elf is None or elf is UNREADABLE:              # not ELF: /dev/zero, for one
            jit = self._jit(addr)
            return jit if jit[0] is not None else (None, file_offset, shown)
        vaddr = elf.address(file_offset)
        if vaddr is None:
            return None, file_offset, shown
        hit = elf.lookup(vaddr)
        if hit is None:
            return None, vaddr, shown
        return hit[0], hit[1], shown

    def mapped_files(self) -> list[tuple[int, tuple[int, int], int]]:
        """(size, (device, inode), start address of a mapping) of each file this process
        maps executable, found as ``resolve`` opens it: the very file mapped, else (no
        CAP_SYS_ADMIN) its path in the process's root when it was not deleted."""
        first: dict[str, int] = {}
        for lo, hi, _off, path in self.maps:
            if path.startswith("/") and not path.startswith("/memfd:"):
                first.setdefault(path, (lo, hi))
        out = []
        for path, (lo, hi) in first.items():
            try:
                st = os.stat(f"{self.proc}/{self.pid}/map_files/{lo:x}-{hi:x}")
            except OSError:
                if path.endswith(" (deleted)"):
                    continue
                try:
                    st = os.stat(f"{self.proc}/{self.pid}/root{path}")
                except OSError:
                    continue                      # gone: read at its first stack, if any
            if stat.S_ISREG(st.st_mode):
                out.append((st.st_size, (st.st_dev, st.st_ino), lo))
        return out

    def _jit(self, addr: int) -> tuple[str | None, int, str | None]:
        """Code a JIT described in /tmp/perf-PID.map (perf's convention; PID as the
        process knows itself, in its own pid namespace)."""
        if self._perf_map is None:
            self._perf_map = self._read_perf_map()
        starts, entries, shown = self._perf_map
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < entries[i][0] + entries[i][1]:
            return entries[i][2], addr - entries[i][0], shown
        return None, addr, None

    def _read_perf_map(self):
        nspid, uid = self.pid, None
        try:
            with open(f"{self.proc}/{self.pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"NStgid:"):
                        nspid = int(line.split()[-1])
                    elif line.startswith(b"Uid:"):
                        uid = int(line.split()[2])          # effective
        except (OSError, ValueError, IndexError):
            pass
        shown = f"/tmp/perf-{nspid}.map"
        entries = []
        # /tmp is anyone's: a regular file of the process's user (or root) only, read
        # without blocking and up to MAX_PERF_MAP
        fd = _open_regular(f"{self.proc}/{self.pid}/root{shown}")
        if fd is not None:
            try:
                st = os.fstat(fd)
                if st.st_uid in (0, uid):
                    data = os.pread(fd, MAX_PERF_MAP, 0)
                    for line in data.splitlines():
                        parts = line.split(None, 2)
                        if len(parts) < 3:
                            continue              # a line the JIT is still writing
                        try:
                            start, size = int(parts[0], 16), int(parts[1], 16)
                        except ValueError:
                            continue
                        entries.append((start, size, parts[2].strip().decode("utf-8",
                                                                             "replace")))
            except OSError:
                pass
            finally:
                os.close(fd)
        entries.sort()
        return [e[0] for e in entries], entries, shown
