"""Uprobes attached a library at a time: BPF uprobe_multi links, else one perf event each.

Why links: the kernel detaches a perf-event uprobe in about 0.1 s and one at a time (70
probes on the real libnccl: 7.7 s here), so a capture with the nccl and cuda sources
took 9-10 s to stop and each switch of the launch probes' duty cycle waited as long.
A uprobe_multi link (Linux 6.6) holds every offset of one program in one file and is
detached with one wait: the same 70 probes in 2 links, 0.08 s (``bench/bench_ebpf.py
--attach``). One link per offset would not do: 70 links took 3.8 s.

A link runs one program for all its offsets, so each family of entry probes is
generated twice (``dispatch_programs``): a program per symbol for perf events, and one
dispatcher that picks the symbol's code by the link's attach cookie (its index).
Return probes share one program per family already.

The mode is chosen at the first attach: links unless $INGERO_UPROBES is ``perf``, or the
kernel refuses them (older than 6.6, or a BCC that cannot load a program for them); then
perf events for the rest of the run, and the source's attach message says why.

Perf-event uprobes are made here too (``perf_uprobe``), not by BCC's attach_uprobe: BCC
releases up to at least 0.26 (Debian 12) declare libbcc's ``bpf_attach_uprobe`` with 6
of its 7 arguments, so each call passes whatever lies on the stack as the USDT
reference counter's file offset (0x6 on this VM, per dmesg). The kernel then refuses
every other tracer's uprobe on that function ("ref_ctr_offset mismatch": bpftrace, perf
probe, a second capture), and were the value to fall in a writable mapping of the
library, it would increment two bytes there in every traced process.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import struct
from dataclasses import dataclass

#: bpf(2) command and attach type (include/uapi/linux/bpf.h; Debian 12's copy predates
#: uprobe_multi, so the numbers are written here)
BPF_LINK_CREATE = 28
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
#: bpf(2) by architecture; elsewhere perf events only
SYS_BPF = {"x86_64": 321, "aarch64": 280}
#: bpf_get_attach_cookie by helper number: BCC releases before 0.22 do not declare it
COOKIE_C = r"""
#ifndef INGERO_ATTACH_COOKIE
#define INGERO_ATTACH_COOKIE
static u64 (*ingero_attach_cookie)(void *ctx) = (void *)174;
#endif
"""
#: libbcc's bpf_attach_uprobe(prog_fd, attach_type, ev_name, binary_path, offset, pid,
#: ref_ctr_offset): attach_type 0 entry, 1 return (libbcc >= 0.10)
_ATTACH_UPROBE_C = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_char_p,
                                    ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_int,
                                    ctypes.c_uint32)
#: errors that mean "this kernel cannot link uprobes": fall back to perf events
UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.E2BIG, errno.EPERM)


def dispatch_programs(prefix: str, calls: dict[int, str], dispatcher: str | None = None) -> str:
    """C of one family of entry probes: ``int {prefix}_{i}(ctx)`` returning ``calls[i]``
    for each i (perf-event uprobes, one symbol each), and ``int {dispatcher}(ctx)`` (by
    default ``{prefix}_multi``), which returns the call of its link's attach cookie."""
    out = [COOKIE_C]
    for i, call in calls.items():
        out.append(f"int {prefix}_{i}(struct pt_regs *ctx) {{ return {call}; }}\n")
    out.append(f"int {dispatcher or prefix + '_multi'}(struct pt_regs *ctx) {{\n"
               "    switch (ingero_attach_cookie(ctx)) {\n")
    for i, call in calls.items():
        out.append(f"    case {i}: return {call};\n")
    out.append("    }\n    return 0;\n}\n")
    return "".join(out)


@dataclass(frozen=True)
class Probe:
    """One probed function: its entry program (per symbol) and the dispatcher and cookie
    that stand for it in a link; its return program, shared by the family."""
    sym: str
    entry: str | None = None          # program for a perf-event uprobe
    dispatcher: str | None = None     # program of the link ...
    cookie: int = 0                   # ... and this symbol's case in it
    ret: str | None = None            # return program


class LinkUnsupported(Exception):
    pass


@functools.cache
def kernel_has_links(kallsyms: str = "/proc/kallsyms") -> bool:
    """Whether this kernel implements uprobe_multi links (read in the error path only:
    EINVAL also comes from a conflict with another tracer's uprobe)."""
    try:
        with open(kallsyms) as f:
            return any(line.rstrip().endswith(" bpf_uprobe_multi_link_attach") for line in f)
    except OSError:
        return False


class Uprobes:
    """The uprobes of one source: attach a library's probes, detach them all."""

    def __init__(self, bcc, bpf, env: dict | None = None) -> None:
        self.bcc, self.bpf = bcc, bpf
        env = os.environ if env is None else env
        self.mode: str | None = None       # "multi" or "perf", set by the first attach
        self.why_perf = ""
        if env.get("INGERO_UPROBES", "").lower() == "perf":
            self.mode, self.why_perf = "perf", "INGERO_UPROBES=perf"
        elif platform.machine() not in SYS_BPF:
            self.mode, self.why_perf = "perf", f"no uprobe_multi support here ({platform.machine()})"
        self._progs: dict[str, int] = {}   # program name -> fd, loaded for links
        self.links: list[int] = []
        self.notes: list[str] = []         # warnings for the source's capture_log
        self.perf_paths: list[str] = []    # libraries whose links were refused
        self._libc = ctypes.CDLL(None, use_errno=True)

    # -- programs ----------------------------------------------------------------------
    def _link_prog(self, name: str) -> int:
        """fd of ``name`` loaded for uprobe_multi links (BCC caches one load per name,
        and a program for links cannot be attached to a perf event: load it aside)."""
        if name not in self._progs:
            funcs = self.bpf.funcs
            cached = funcs.pop(name.encode(), None)
            try:
                fn = self.bpf.load_func(name.encode(), self.bcc.BPF.KPROBE,
                                        attach_type=BPF_TRACE_UPROBE_MULTI)
            except Exception as e:
                raise LinkUnsupported(f"program {name} not loadable for links: {e}") from None
            finally:
                funcs.pop(name.encode(), None)
                if cached is not None:
                    funcs[name.encode()] = cached
            self._progs[name] = fn.fd
        return self._progs[name]

    def load(self, names: list[str]) -> None:
        """Load the programs links will use now (one clear error, not one per library);
        a failure switches to perf events."""
        if self.mode == "perf":
            return
        try:
            for name in names:
                self._link_prog(name)
        except LinkUnsupported as e:
            self._fall_back(str(e))

    def _fall_back(self, why: str) -> None:
        self.mode, self.why_perf = "perf", why

    # -- links -------------------------------------------------------------------------
    def link(self, path: str, prog: str, offsets: list[int], cookies: list[int],
             ret: bool = False) -> int:
        """Create one uprobe_multi link; returns its fd (close it to detach)."""
        n = len(offsets)
        c_path = ctypes.create_string_buffer(os.fsencode(path))
        c_offs = (ctypes.c_uint64 * n)(*offsets)
        c_cookies = (ctypes.c_uint64 * n)(*cookies)
        attr = ctypes.create_string_buffer(128)
        # union bpf_attr.link_create: prog_fd, target_fd, attach_type, flags, then
        # uprobe_multi {path, offsets, ref_ctr_offsets, cookies, cnt, flags, pid}
        struct.pack_into("IIII", attr, 0, self._link_prog(prog), 0, BPF_TRACE_UPROBE_MULTI, 0)
        struct.pack_into("QQQQIII", attr, 16, ctypes.addressof(c_path), ctypes.addressof(c_offs),
                         0, ctypes.addressof(c_cookies), n,
                         BPF_F_UPROBE_MULTI_RETURN if ret else 0, 0)
        fd = self._libc.syscall(SYS_BPF[platform.machine()], BPF_LINK_CREATE, attr, len(attr))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.links.append(fd)
        return fd

    def unlink(self, fd: int) -> None:
        self.links.remove(fd)
        os.close(fd)

    def offset(self, path: str, sym: str) -> int:
        """File offset of ``sym`` in ``path`` (raises if absent), as perf uprobes take it."""
        return self.bcc.BPF._check_path_symbol(path.encode(), sym.encode(), None, -1)[1]

    # -- a library's probes ------------------------------------------------------------
    def attach(self, path: str, probes: list[Probe]) -> list[str]:
        """Attach every probe on ``path``; returns one entry per symbol that could not be
        attached, saying why ("ncclSend (not in the library)")."""
        if self.mode != "perf":
            try:
                missing = self._attach_links(path, probes)
                self.mode = "multi"
                return missing
            except LinkUnsupported as e:
                self._fall_back(str(e))
            except OSError as e:      # links work, but not on this file: perf events here
                self.perf_paths.append(path)
                self.notes.append(f"uprobe_multi link on {path} refused ({e.strerror}); its "
                                  "probes are attached one perf event each")
        return self._attach_perf(path, probes)

    def _attach_links(self, path: str, probes: list[Probe]) -> list[str]:
        missing, found = [], []
        for p in probes:
            try:
                found.append((p, self.offset(path, p.sym)))
            except Exception:
                missing.append(f"{p.sym} (not in the library)")
        groups: dict[tuple[str, bool], list[tuple[int, int]]] = {}
        for p, off in found:
            if p.dispatcher:
                groups.setdefault((p.dispatcher, False), []).append((off, p.cookie))
            if p.ret:
                groups.setdefault((p.ret, True), []).append((off, 0))
        made = []
        try:
            for (prog, ret), items in groups.items():
                made.append(self.link(path, prog, [o for o, _ in items], [c for _, c in items], ret))
        except OSError as e:
            for fd in made:
                self.unlink(fd)
            if self.mode is None and e.errno in UNSUPPORTED and not kernel_has_links():
                raise LinkUnsupported(f"this kernel has no uprobe_multi links ({e.strerror}; "
                                      "Linux 6.6 or later has them)") from None
            if e.errno == errno.EINVAL:
                # the kernel logs "ref_ctr_offset mismatch": another tracer (BCC's own
                # perf-event uprobes, for one) probes a function here
                raise OSError(e.errno, f"{e.strerror}: another tracer's uprobe on a function "
                              "of this library? (dmesg: ref_ctr_offset mismatch)") from None
            raise
        return missing

    # -- perf events -------------------------------------------------------------------
    def perf_uprobe(self, path: str, sym: str, fn_name: str, ret: bool = False) -> None:
        """One perf-event uprobe (``ret``: a return probe), as BCC's attach_uprobe makes
        it but with no reference counter (see the module's docstring); BCC's cleanup and
        detach_uprobe know it. Raises as BCC does when the kernel refuses it."""
        bcc, bpf = self.bcc, self.bpf
        try:
            c_attach = _ATTACH_UPROBE_C(ctypes.cast(bcc.libbcc.lib.bpf_attach_uprobe,
                                                    ctypes.c_void_p).value)
            path_b, addr = bcc.BPF._check_path_symbol(path.encode(), sym.encode(), None, -1)
            evname, add_fd = bpf._get_uprobe_evname, bpf._add_uprobe_fd
        except AttributeError:      # a BCC with other internals: its own call
            attach = bpf.attach_uretprobe if ret else bpf.attach_uprobe
            attach(name=path.encode(), sym=sym.encode(), fn_name=fn_name.encode())
            return
        if hasattr(bpf, "_check_probe_quota"):
            bpf._check_probe_quota(1)
        fn = bpf.load_func(fn_name.encode(), bcc.BPF.KPROBE)
        ev_name = evname(b"r" if ret else b"p", path_b, addr, -1)
        fd = c_attach(fn.fd, int(ret), ev_name, path_b, addr, -1, 0)
        if fd < 0:
            raise Exception(f"Failed to attach BPF to {'uretprobe' if ret else 'uprobe'}")
        add_fd(ev_name, fd)

    def _attach_perf(self, path: str, probes: list[Probe]) -> list[str]:
        missing = []
        for p in probes:
            try:
                if p.entry:
                    self.perf_uprobe(path, p.sym, p.entry)
                if p.ret:
                    self.perf_uprobe(path, p.sym, p.ret, ret=True)
            except Exception:
                try:
                    self.offset(path, p.sym)
                    missing.append(f"{p.sym} (the kernel refused the uprobe; dmesg may say why)")
                except Exception:
                    missing.append(f"{p.sym} (not in the library)")
        return missing

    def describe(self) -> str:
        """How the probes are attached, for the source's attach message."""
        if self.mode == "perf":
            return f"one perf event per uprobe ({self.why_perf})"
        out = [f"{len(self.links)} uprobe_multi links"] if self.links else []
        if self.perf_paths:
            out.append(f"one perf event per uprobe on {', '.join(self.perf_paths)}")
        return "; ".join(out)

    def close(self) -> None:
        """Detach every link and unload the programs loaded for them (BCC's cleanup
        does the perf events and its own programs)."""
        for fd in self.links:
            os.close(fd)
        self.links.clear()
        for fd in self._progs.values():
            os.close(fd)
        self._progs.clear()
