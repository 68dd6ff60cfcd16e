"""Traced processes: which ones (``--pid``, ``--comm`` or automatic), and their ranks.

The environment of a training process holds secrets (cloud keys, tokens). Rank facts
are read from /proc/PID/environ through an allow-list: the file is parsed in small
chunks and every pair whose name is not on the list is dropped as soon as it is
split off, so nothing else is kept, logged or written anywhere.

Command lines carry secrets too (``--api-key=sk-...``, ``HF_TOKEN=... python ...``,
``https://user:password@host/``). They are masked before they are written
(``mask_cmdline``; ``--cmdline full|masked|none``, default masked).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable

RANK_ENV_NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "ROLE_RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_NODEID", "SLURM_PROCID",
    "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK",
    "CUDA_VISIBLE_DEVICES",
)
_ALLOWED = frozenset(n.encode() for n in RANK_ENV_NAMES)
_MAX_VALUE = 256          # longer allow-listed values are cut (they are ids, not text)
_CHUNK = 4096
#: Libraries whose presence in a process's maps makes it a training process (auto mode).
AUTO_LIBS = ("libnccl", "libcudart")


def parse_environ_stream(read: Callable[[int], bytes]) -> dict[str, str]:
    """Allow-listed NAME=value pairs from a NUL-separated environ stream.

    ``read(n)`` returns the next bytes ('' at the end). Non-listed pairs are discarded
    chunk by chunk; an over-long entry is skipped without being accumulated.
    """
    out: dict[str, str] = {}
    tail = b""
    skipping = False  # inside an entry too long to be an allowed one
    limit = max(len(n) for n in _ALLOWED) + 1 + _MAX_VALUE
    while True:
        chunk = read(_CHUNK)
        if not chunk:
            break
        parts = chunk.split(b"\0")
        parts[0] = tail + parts[0]
        tail = parts.pop()   # unterminated remainder
        for entry in parts:
            if skipping:
                skipping = False
                continue
            _keep(entry, out)
        if skipping or len(tail) > limit:
            # An entry longer than any allowed one: drop what we have of it now.
            tail, skipping = b"", True
        del parts, chunk
    if tail and not skipping:
        _keep(tail, out)
    return out


def _keep(entry: bytes, out: dict) -> None:
    name, sep, value = entry.partition(b"=")
    if sep and name in _ALLOWED:
        out[name.decode()] = value[:_MAX_VALUE].decode("utf-8", "replace")


def read_rank_env(pid: int, proc: str = "/proc") -> dict[str, str] | None:
    """Allow-listed environment of a process; None if it cannot be read."""
    try:
        with open(f"{proc}/{pid}/environ", "rb", buffering=0) as f:
            return parse_environ_stream(f.read)
    except OSError:
        return None


def _int(env: dict, *names) -> int | None:
    for n in names:
        v = env.get(n)
        if v is not None:
            try:
                return int(v.strip())
            except ValueError:
                continue
    return None


def rank_fields(env: dict[str, str]) -> dict:
    """The processes-table rank columns derived from an allow-listed environment."""
    job = env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID")
    return {
        "rank": _int(env, "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"),
        "local_rank": _int(env, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"),
        "world_size": _int(env, "WORLD_SIZE"),
        "local_world_size": _int(env, "LOCAL_WORLD_SIZE"),
        "node_rank": _int(env, "GROUP_RANK", "NODE_RANK", "SLURM_NODEID"),
        "job_id": job or None,
    }


# ------------------------------------------------------------------ command lines

CMDLINE_MODES = ("full", "masked", "none")
MASK = "***"
#: A word of an option or variable name (split at - _ . and case changes) that makes its
#: value a secret; a word that ends with one of SECRET_SUFFIXES does too (apikey, hftoken).
SECRET_WORDS = frozenset({
    "key", "apikey", "token", "secret", "secrets", "password", "passwd", "pass", "pwd",
    "credential", "credentials", "creds", "auth", "authorization", "cookie", "passphrase",
    "signature", "sas", "bearer", "privatekey",
})
SECRET_SUFFIXES = ("key", "token", "secret", "password", "passwd", "credential",
                   "credentials", "passphrase")
#: Values that are secrets whatever option carries them (well-known token shapes).
_TOKEN_SHAPES = re.compile(
    r"(?:sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|hf_[A-Za-z0-9]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,}"
    r"|glpat-[A-Za-z0-9_-]{16,}|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})")
_URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):[^/\s@]*@")
_HEADER = re.compile(r"(?i)^((?:proxy-)?authorization|x-api-key|api-key|x-auth-token|"
                     r"cookie)\s*:\s*\S.*$")
_ENV_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


def _words(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return [w for w in re.split(r"[-_.\s]+", spaced.lower()) if w]


def is_secret_name(name: str) -> bool:
    """True for an option or variable name whose value should not be kept."""
    return any(w in SECRET_WORDS or w.endswith(SECRET_SUFFIXES) for w in _words(name))


def _mask_text(arg: str) -> str:
    arg = _URL_USERINFO.sub(lambda m: f"{m.group(1)}:{MASK}@", arg)
    m = _HEADER.match(arg)
    if m:
        arg = f"{m.group(1)}: {MASK}"
    return _TOKEN_SHAPES.sub(MASK, arg)


def mask_cmdline(argv: list[str] | None, mode: str = "masked") -> list[str] | None:
    """The command line as it may be written: whole ("full"), masked, or None ("none").

    Masked: the value of an option whose name looks secret (``--api-key=V``,
    ``--api-key V``, ``-password V``) and of a ``NAME=V`` word (``HF_TOKEN=V``) becomes
    ``***``; so do the password of a URL (``https://u:***@host``), an Authorization or
    API-key header's value and well-known token shapes anywhere (``sk-...``, ``ghp_...``,
    ``hf_...``, AWS access key ids, Slack and GitLab tokens, JWTs). Everything else,
    including the program and its paths, is kept (``ingero-redact`` reduces paths later).
    """
    if mode not in CMDLINE_MODES:
        raise ValueError(f"cmdline mode must be one of {', '.join(CMDLINE_MODES)}, not {mode!r}")
    if argv is None or mode == "none":
        return None
    if mode == "full":
        return list(argv)
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next and not arg.startswith("-"):
            out.append(MASK)
            mask_next = False
            continue
        mask_next = False
        if arg.startswith("-") and len(arg) > 1 and arg != "--":
            name, eq, _ = arg.lstrip("-").partition("=")
            if is_secret_name(name):
                if eq:
                    out.append(f"{arg.partition('=')[0]}={MASK}")
                else:
                    out.append(arg)
                    mask_next = True
                continue
        else:
            m = _ENV_ASSIGN.match(arg)
            if m and is_secret_name(m.group(1)):
                out.append(f"{m.group(1)}={MASK}")
                continue
        out.append(_mask_text(arg))
    return out


# ------------------------------------------------------------------ /proc readers

def _read(path: str, mode: str = "r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def read_stat_starttime(pid: int, proc: str = "/proc") -> int | None:
    """Process start in ns since boot (/proc/PID/stat field 22), None if gone."""
    raw = _read(f"{proc}/{pid}/stat", "rb")
    if not raw:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()
    try:
        ticks = int(rest[19])
    except (IndexError, ValueError):
        return None
    return ticks * 1_000_000_000 // _CLK_TCK


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def read_stat_ppid(pid: int, proc: str = "/proc") -> int | None:
    """The parent's pid (/proc/PID/stat field 4), None if gone."""
    raw = _read(f"{proc}/{pid}/stat", "rb")
    if not raw:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()
    try:
        return int(rest[1])
    except (IndexError, ValueError):
        return None


def read_tgid(pid: int, proc: str = "/proc") -> int | None:
    """The process a task id belongs to (``Tgid:`` in /proc/PID/status): the id itself
    for a process, another for one of its threads; None if gone."""
    raw = _read(f"{proc}/{pid}/status", "rb")
    for line in (raw or b"").splitlines():
        if line.startswith(b"Tgid:"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def read_comm(pid: int, proc: str = "/proc", tid: int | None = None) -> str | None:
    path = f"{proc}/{pid}/comm" if tid is None else f"{proc}/{pid}/task/{tid}/comm"
    raw = _read(path)
    return raw.rstrip("\n") if raw is not None else None


def read_cmdline(pid: int, proc: str = "/proc") -> list[str] | None:
    raw = _read(f"{proc}/{pid}/cmdline", "rb")
    if raw is None:
        return None
    return [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")] if raw else []


def read_exe(pid: int, proc: str = "/proc") -> str | None:
    try:
        return os.readlink(f"{proc}/{pid}/exe")
    except OSError:
        return None


def maps_libs(pid: int, proc: str = "/proc") -> bool:
    """True if the process maps one of AUTO_LIBS."""
    raw = _read(f"{proc}/{pid}/maps", "rb")
    return bool(raw) and any(lib.encode() in raw for lib in AUTO_LIBS)


def is_kernel_thread(pid: int, proc: str = "/proc") -> bool:
    raw = _read(f"{proc}/{pid}/stat", "rb")
    if not raw:
        return True
    rest = raw[raw.rfind(b")") + 2:].split()
    try:
        return bool(int(rest[6]) & 0x00200000)  # PF_KTHREAD
    except (IndexError, ValueError):
        return True


def list_pids(proc: str = "/proc") -> set[int]:
    return {int(n) for n in os.listdir(proc) if n.isdigit()}


def list_tids(pid: int, proc: str = "/proc") -> list[int]:
    try:
        return [int(n) for n in os.listdir(f"{proc}/{pid}/task") if n.isdigit()]
    except OSError:
        return []


# ------------------------------------------------------------------ the target set

@dataclass
class ProcessInfo:
    pid: int
    start_boottime_ns: int | None
    comm: str | None
    exe: str | None
    cmdline: list[str] | None
    env: dict[str, str]
    first_seen_ns: int
    last_seen_ns: int
    exit_ns: int | None = None
    threads: dict[int, list] = field(default_factory=dict)  # tid -> [comm, first, last]
    exec_seen: int = 0      # scans that saw a new exe with no command line yet (mid-exec)

    def row(self) -> tuple:
        r = rank_fields(self.env)
        return (self.pid, self.start_boottime_ns, self.comm, self.exe,
                json.dumps(self.cmdline) if self.cmdline is not None else None,
                r["rank"], r["local_rank"], r["world_size"], r["local_world_size"],
                r["node_rank"], r["job_id"], json.dumps(self.env, sort_keys=True),
                self.first_seen_ns, self.last_seen_ns, self.exit_ns)

    @property
    def job_id(self) -> str | None:
        return rank_fields(self.env)["job_id"]


class TargetSet:
    """The traced processes (implements source.Targets).

    ``scan()`` is called about once a second by the capture loop: it picks up new
    matching processes, refreshes threads and notices exits. Exited processes stay in
    ``known`` so their rows keep being written.
    """

    #: how often processes that did not match are looked at again (they may dlopen
    #: libnccl later, e.g. on `import torch`)
    RECHECK_S = 5.0

    def __init__(self, pids=(), comms=(), *, proc: str = "/proc", exclude=(),
                 cmdline: str = "masked"):
        mask_cmdline(None, cmdline)   # a bad mode fails here, not at the first process
        self.cmdline_mode = cmdline
        self.explicit_pids = set(pids)
        self.comms = set(comms)
        self.auto = not self.explicit_pids and not self.comms
        self.proc = proc
        self.exclude = set(exclude) | {os.getpid()}
        self.known: dict[int, ProcessInfo] = {}
        self.retired: list[ProcessInfo] = []  # exited records whose pid was reused
        self._rejected: dict[int, tuple[int | None, float]] = {}  # pid -> (start, checked)
        self._subs: list[tuple[Callable, Callable]] = []

    # source.Targets
    def pids(self) -> set[int]:
        return {p for p, info in self.known.items() if info.exit_ns is None}

    def subscribe(self, on_new, on_exit) -> None:
        self._subs.append((on_new, on_exit))

    def _matches(self, pid: int, now: float, live=frozenset()) -> bool:
        if pid in self.explicit_pids:
            return True
        if not self.auto and self._child_of(pid, live):
            return True
        if self.comms:
            return read_comm(pid, self.proc) in self.comms
        if not self.auto:
            # --pid given: those processes and their children, never whatever else
            # looks like a rank
            return False
        start = read_stat_starttime(pid, self.proc)
        prev = self._rejected.get(pid)
        if prev is not None and prev[0] == start and now - prev[1] < self.RECHECK_S:
            return False
        if prev is None and is_kernel_thread(pid, self.proc):
            self._rejected[pid] = (start, float("inf"))
            return False
        env = read_rank_env(pid, self.proc)
        hit = bool(env and "RANK" in env) or maps_libs(pid, self.proc)
        if not hit:
            self._rejected[pid] = (start, now)
        return hit

    def _child_of(self, pid: int, live) -> bool:
        """A child of a live target (a data loader's worker, a compile helper) is the
        job's own, and so is its I/O; a grandchild follows once its parent is in (in the
        same scan, or the next when its pid sorts first). One read of /proc/PID/stat
        per other process and scan, as --comm reads each one's name: no cache, so a
        reused pid or a parent found later is never missed."""
        return read_stat_ppid(pid, self.proc) in live

    def scan(self, mono_ns: int | None = None) -> tuple[list[int], list[int]]:
        """Refresh; return (new pids, exited pids)."""
        now_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC) if mono_ns is None else mono_ns
        now = now_ns / 1e9
        alive = list_pids(self.proc)
        new, gone = [], []
        for pid, info in self.known.items():
            if info.exit_ns is not None:
                continue
            if pid not in alive or read_stat_starttime(pid, self.proc) != info.start_boottime_ns:
                info.exit_ns = now_ns
                gone.append(pid)
            else:
                info.last_seen_ns = now_ns
                self._refresh_after_exec(info)
                self._scan_threads(info, now_ns)
        live = {p for p, i in self.known.items() if i.exit_ns is None}
        for pid in sorted(alive - live - self.exclude):
            if not self._matches(pid, now, live):
                continue
            info = self._describe(pid, now_ns)
            if info is None:
                continue
            self.known[pid] = info
            live.add(pid)
            self._scan_threads(info, now_ns)
            new.append(pid)
        # Forget rejections of processes that are gone (pids get reused).
        for pid in [p for p in self._rejected if p not in alive]:
            del self._rejected[pid]
        for pid in gone:
            for on_new, on_exit in self._subs:
                on_exit(pid)
        for pid in new:
            for on_new, on_exit in self._subs:
                on_new(pid)
        return new, gone

    def _describe(self, pid: int, now_ns: int) -> ProcessInfo | None:
        start = read_stat_starttime(pid, self.proc)
        if start is None:
            return None
        old = self.known.get(pid)
        if old is not None:  # pid reused: keep the exited process's record
            self.retired.append(old)
        return ProcessInfo(pid=pid, start_boottime_ns=start, comm=read_comm(pid, self.proc),
                           exe=read_exe(pid, self.proc),
                           cmdline=mask_cmdline(read_cmdline(pid, self.proc),
                                                self.cmdline_mode),
                           env=read_rank_env(pid, self.proc) or {},
                           first_seen_ns=now_ns, last_seen_ns=now_ns)

    #: scans a new exe with an empty command line waits for its arguments
    EXEC_SCANS = 3

    def _refresh_after_exec(self, info: ProcessInfo) -> None:
        """A launcher that execs the trainer (``sh -c 'exec python train.py'``) keeps its
        pid and start time: the record follows the program it runs now."""
        exe = read_exe(info.pid, self.proc)
        if exe is not None and exe != info.exe:
            argv = read_cmdline(info.pid, self.proc)
            # caught mid-exec, the new program's arguments are not in place yet: look
            # again at the next scan (a program that really has none, after three)
            info.exec_seen += 1
            if argv == [] and info.exec_seen < self.EXEC_SCANS:
                return
            info.exec_seen = 0
            info.exe = exe
            info.cmdline = mask_cmdline(argv, self.cmdline_mode)
            info.env = read_rank_env(info.pid, self.proc) or info.env
        comm = read_comm(info.pid, self.proc)
        if comm is not None:
            info.comm = comm

    def _scan_threads(self, info: ProcessInfo, now_ns: int) -> None:
        for tid in list_tids(info.pid, self.proc):
            t = info.threads.get(tid)
            if t is None:
                info.threads[tid] = [read_comm(info.pid, self.proc, tid), now_ns, now_ns]
            else:
                t[2] = now_ns

    def records(self) -> list[ProcessInfo]:
        """Every process seen, live or exited."""
        return self.retired + list(self.known.values())

    def missing_explicit(self) -> list[int]:
        alive = list_pids(self.proc)
        return sorted(p for p in self.explicit_pids if p not in alive)

    def job_ids(self) -> list[str]:
        return sorted({i.job_id for i in self.records() if i.job_id})
