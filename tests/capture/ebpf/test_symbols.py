"""Stack addresses named from the ELF files a live process maps (capture/ebpf/symbols.py),
checked against the addresses the process itself reports for its functions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from ingero_forensics.capture.ebpf import symbols
from ingero_forensics.capture.ebpf.symbols import ProcessSymbols, demangle, elf_symbols

from .test_nccl import real_lib

#: loads the library argv[1] and prints {name: address} for argv[2:]: a function's own
#: address, or for "call:NAME" what NAME() returns; then waits for stdin to close
HOLDER = textwrap.dedent(r"""
    import ctypes, json, os, sys
    lib = ctypes.CDLL(sys.argv[1])
    out = {}
    for name in sys.argv[2:]:
        if name.startswith("call:"):
            fn = getattr(lib, name[5:])
            fn.restype = ctypes.c_void_p
            out[name] = fn()
        else:
            out[name] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    if os.environ.get("HOLDER_UNLINK"):
        os.unlink(sys.argv[1])
    print(json.dumps(out), flush=True)
    sys.stdin.read()
""")

LIB_C = r"""
static int hidden_helper(int x) { return x * 3 + 1; }
int visible_entry(int x) { return hidden_helper(x) + 2; }
void *where_is_hidden(void) { return (void *)hidden_helper; }
"""


@pytest.fixture
def holder():
    procs = []

    def start(lib, names, env=None):
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(lib), *names],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, **(env or {})))
        procs.append(p)
        return p, json.loads(p.stdout.readline())
    yield start
    for p in procs:
        p.stdin.close()
        p.wait(timeout=30)


@pytest.fixture(autouse=True)
def fresh_files():
    symbols._files.clear()          # each test reads its files anew
    yield
    symbols._files.clear()


def build_lib(tmp_path, strip=False, extra="", build_id=True):
    src = tmp_path / "lib.c"
    src.write_text(LIB_C + extra)
    lib = tmp_path / "libsym.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-g",
                    "-Wl,--build-id" if build_id else "-Wl,--build-id=none", "-o", str(lib),
                    str(src)], check=True)
    if strip:
        subprocess.run(["objcopy", "--only-keep-debug", str(lib), str(lib) + ".debug"],
                       check=True)
        subprocess.run(["strip", "--strip-all", str(lib)], check=True)
    return lib


def test_real_libnccl_functions_are_named_in_another_process(holder):
    lib = real_lib("nvidia-nccl-cu12", "libnccl.so.2")
    names = ["ncclAllReduce", "ncclCommInitRank", "ncclGetUniqueId", "ncclGroupEnd"]
    proc, addrs = holder(lib, names)
    table = ProcessSymbols(proc.pid)
    for name in names:
        for k in (0, 7):
            sym, off, module = table.resolve(addrs[name] + k)
            # the API name, not its pnccl* profiling alias
            assert (sym, off, os.path.realpath(module)) == (name, k, os.path.realpath(lib))


def test_a_process_gone_keeps_the_names_it_had(holder):
    """Its last calls' stacks are symbolized after it exited (a rank that crashed): the
    mappings are kept when they can no longer be read, and each mapping's symbols once
    read, though its files can no longer be opened through /proc."""
    lib = real_lib("nvidia-nccl-cu12", "libnccl.so.2")
    proc, addrs = holder(lib, ["ncclAllReduce", "ncclGroupEnd"])
    table = ProcessSymbols(proc.pid)
    assert table.resolve(addrs["ncclAllReduce"] + 3)[:2] == ("ncclAllReduce", 3)
    proc.stdin.close()
    proc.wait(timeout=30)
    assert not os.path.exists(f"/proc/{proc.pid}")
    table.refresh()                                    # the unknown frame's re-read
    assert table.maps
    sym, off, module = table.resolve(addrs["ncclGroupEnd"] + 9)   # not asked before
    assert (sym, off, os.path.realpath(module)) == ("ncclGroupEnd", 9, os.path.realpath(lib))


def test_a_zombie_keeps_its_mappings(holder):
    """Exited, not yet reaped (a crashed rank until its launcher waits for it): its maps
    file opens and reads empty, and must not empty what was read while it lived."""
    lib = real_lib("nvidia-nccl-cu12", "libnccl.so.2")
    proc, addrs = holder(lib, ["ncclAllReduce", "ncclGroupEnd"])
    table = ProcessSymbols(proc.pid)
    assert table.resolve(addrs["ncclGroupEnd"])[0] == "ncclGroupEnd"    # read while alive
    proc.stdin.close()
    deadline = time.monotonic() + 30
    while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the holder did not exit"
        time.sleep(0.01)                  # not reaped: no wait() until the fixture's end
    assert open(f"/proc/{proc.pid}/maps").read() == ""
    table.refresh()
    sym, off, _module = table.resolve(addrs["ncclAllReduce"] + 2)
    assert (sym, off) == ("ncclAllReduce", 2)


def test_a_static_function_and_a_deleted_library(tmp_path, holder):
    """.symtab names the static function; the library is read through
    /proc/PID/map_files, so it is named though its path is gone."""
    lib = build_lib(tmp_path)
    proc, addrs = holder(lib, ["visible_entry", "call:where_is_hidden"],
                         env={"HOLDER_UNLINK": "1"})
    assert not lib.exists()
    table = ProcessSymbols(proc.pid)
    assert table.resolve(addrs["visible_entry"] + 4) == ("visible_entry", 4, str(lib))
    assert table.resolve(addrs["call:where_is_hidden"] + 3) == ("hidden_helper", 3, str(lib))


def test_a_stripped_library_is_named_from_its_debug_file(tmp_path, holder, monkeypatch):
    """strip removes .symtab, the static function's only entry: its name comes from the
    separate debug file found by the build id, where distributions install them."""
    lib = build_lib(tmp_path, strip=True)
    proc, addrs = holder(lib, ["visible_entry", "call:where_is_hidden"])
    hidden = addrs["call:where_is_hidden"]
    monkeypatch.setattr(symbols, "DEBUG_DIR", str(tmp_path / "no-debug-files"))
    without = ProcessSymbols(proc.pid)
    assert without.resolve(addrs["visible_entry"] + 1)[:2] == ("visible_entry", 1)  # .dynsym
    assert without.resolve(hidden + 2)[0] != "hidden_helper"

    notes = subprocess.run(["readelf", "-n", str(lib)], capture_output=True, text=True,
                           check=True).stdout
    build_id = notes.split("Build ID: ")[1].split()[0]
    debug_dir = tmp_path / "debug"
    target = debug_dir / ".build-id" / build_id[:2] / (build_id[2:] + ".debug")
    target.parent.mkdir(parents=True)
    shutil.copy(str(lib) + ".debug", target)
    monkeypatch.setattr(symbols, "DEBUG_DIR", str(debug_dir))
    symbols._files.clear()
    assert ProcessSymbols(proc.pid).resolve(hidden + 2)[:2] == ("hidden_helper", 2)

    # another build's debug file at that path (a different library version) is not used
    (tmp_path / "other").mkdir()
    other = build_lib(tmp_path / "other", strip=True,
                      extra="int another_build(void) { return 7; }\n")
    shutil.copy(str(other) + ".debug", target)
    symbols._files.clear()
    assert ProcessSymbols(proc.pid).resolve(hidden + 2)[0] != "hidden_helper"


def test_a_debug_file_named_by_debuglink_must_match_its_crc(tmp_path, holder):
    """Without a build id, .gnu_debuglink names the debug file and its CRC32."""
    lib = build_lib(tmp_path, strip=True, build_id=False)
    debug = str(lib) + ".debug"
    subprocess.run(["objcopy", f"--add-gnu-debuglink={debug}", str(lib)], check=True,
                   cwd=tmp_path)
    proc, addrs = holder(lib, ["call:where_is_hidden"])
    hidden = addrs["call:where_is_hidden"]
    assert ProcessSymbols(proc.pid).resolve(hidden + 1)[:2] == ("hidden_helper", 1)
    with open(debug, "ab") as f:                  # no longer the file it names
        f.write(b"\0")
    symbols._files.clear()
    assert ProcessSymbols(proc.pid).resolve(hidden + 1)[0] != "hidden_helper"


def test_jit_code_is_named_from_the_perf_map(tmp_path):
    """An anonymous executable mapping (a JIT's code) is named by /tmp/perf-PID.map."""
    script = textwrap.dedent(r"""
        import mmap, ctypes, sys
        m = mmap.mmap(-1, 8192, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        print(addr, flush=True)
        sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    perf_map = f"/tmp/perf-{p.pid}.map"
    if os.path.lexists(perf_map):
        os.unlink(perf_map)     # a dead process's, whose pid this child reuses
    try:
        base = int(p.stdout.readline())
        table = ProcessSymbols(p.pid)
        assert table.resolve(base + 16) == (None, base + 16, None)
        # a FIFO where the map should be must not block the capture
        os.mkfifo(perf_map)
        table.refresh()
        assert table.resolve(base + 16) == (None, base + 16, None)
        os.unlink(perf_map)
        with open(perf_map, "w") as f:     # the last line is still being written
            f.write(f"{base:x} 40 jitted_step\n{base + 0x40:x} 20 [python] train_step\n"
                    f"{base + 0x60:x} 20")
        table.refresh()
        assert table.resolve(base + 16) == ("jitted_step", 16, perf_map)
        assert table.resolve(base + 0x45) == ("[python] train_step", 5, perf_map)
        assert table.resolve(base + 0x70)[0] is None
        os.chown(perf_map, 65534, 65534)   # another user's file in /tmp: not believed
        table.refresh()
        assert table.resolve(base + 16)[0] is None
    finally:
        p.stdin.close()
        p.wait(timeout=30)
        if os.path.exists(perf_map):
            os.unlink(perf_map)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "huge_table", "32-bit"])
def test_a_damaged_elf_file_gives_no_symbols_and_no_error(tmp_path, damage):
    lib = build_lib(tmp_path)
    data = bytearray(lib.read_bytes())
    if damage == "garbage":
        data = bytearray(os.urandom(4096))
    elif damage == "truncated":
        data = data[:len(data) // 3]              # the section headers are at the end
    elif damage == "huge_table":
        shoff = int.from_bytes(data[0x28:0x30], "little")
        for k in range(int.from_bytes(data[0x3C:0x3E], "little")):
            sh = shoff + k * 64
            if int.from_bytes(data[sh + 4:sh + 8], "little") in (2, 11):   # symbol tables
                data[sh + 32:sh + 40] = (1 << 40).to_bytes(8, "little")    # sh_size
    else:
        data[4] = 1                               # ELFCLASS32
    bad = tmp_path / "bad.so"
    bad.write_bytes(bytes(data))
    fds = len(os.listdir("/proc/self/fd"))
    assert elf_symbols(str(bad)) is None
    assert len(os.listdir("/proc/self/fd")) == fds


def test_names_of_cxx_functions_are_demangled():
    assert demangle(b"_ZN2at6native3addERKNS_6TensorES3_RKN3c106ScalarE") == \
        "at::native::add(at::Tensor const&, at::Tensor const&, c10::Scalar const&)"
    assert demangle(b"ncclAllReduce") == "ncclAllReduce"
    assert demangle(b"_Znot_mangled_at_all") == "_Znot_mangled_at_all"


def test_preload_reads_the_largest_mapped_files_before_any_stack(holder, monkeypatch):
    """What a capture does before its sources go on: the files are read then, so the
    first stacks of a running job find them parsed (no read at all). Each file once,
    however many processes map it."""
    lib = real_lib("nvidia-nccl-cu12", "libnccl.so.2")
    proc, _ = holder(lib, ["ncclAllReduce"])
    other, addrs = holder(lib, ["ncclAllReduce"])
    tables = [ProcessSymbols(proc.pid), ProcessSymbols(other.pid)]
    mapped = {os.path.realpath(path) for _lo, _hi, _off, path in tables[0].maps
              if path.startswith("/")}
    assert len(mapped) >= 3                 # python, libc, libnccl at least
    ident = {f: (os.stat(f).st_dev, os.stat(f).st_ino) for f in mapped}
    largest = sorted(mapped, key=os.path.getsize, reverse=True)
    parsed = []
    real_parse = symbols._parse
    monkeypatch.setattr(symbols, "_parse", lambda fd, size: parsed.append(size)
                        or real_parse(fd, size))
    assert symbols.preload(tables, limit=2) == 2
    assert {k[:2] for k in symbols._files} == {ident[f] for f in largest[:2]}
    assert os.path.realpath(lib) in largest[:2]       # over 100 MB
    assert len(parsed) == 2                           # not once per process
    parsed.clear()
    sym, off, _module = tables[1].resolve(addrs["ncclAllReduce"] + 5)
    assert (sym, off) == ("ncclAllReduce", 5) and parsed == []     # read before, not now
    assert symbols.preload(tables) == len(mapped)
