"""The traced processes' own cgroups: their pressure (PSI) and memory, per cgroup.

/proc/pressure and /proc/vmstat are the whole machine's. Where the job shares its machine
(other tenants, a Slurm node split between jobs, or in the tests several "nodes" on one
kernel) they cannot say whether *the job* stalled. The kernel keeps the same figures per
cgroup: ``cpu.pressure``, ``io.pressure`` and ``memory.pressure`` in every cgroup v2
directory, and the memory controller's use, limit and ``memory.stat`` (v2, or v1 where
the memory controller is bound to a v1 hierarchy, as on hybrid machines). The sampler
reads them for the cgroups the traced processes live in, each hierarchy on its own: on a
hybrid Slurm node a job's v1 memory cgroup (``/slurm/uid_0/job_9/step_0``) is not its v2
one (systemd's ``/system.slice/slurmd.service``), and each row names the cgroup it was
read from.

Pressure is read only from a v2 cgroup that is the job's own: its memory controller is
enabled there (a Slurm cgroup/v2 step, a Kubernetes pod), or every process in it is
traced. On a hybrid Slurm node the job's v2 cgroup is slurmd's service, shared with every
job on the node: its pressure is not the job's. The memory limit is the lowest of the
cgroup's own and its parents' (a limit set on the Slurm job over its step, on the pod
over its container). Never the root cgroup: its figures are /proc's own. Paths come from /proc/PID/cgroup and
are re-read every ``REFRESH_S`` (a job moved into its cgroup after the capture started, a
Slurm step, a container, is followed); at most ``MAX_CGROUPS`` of each kind are sampled.
Files are opened when their cgroup is first seen and re-read with pread at offset 0.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .host import PAGE_BYTES, parse_psi

REFRESH_S = 1.0
MAX_CGROUPS = 16
#: a limit at or above this is "no limit" (v1 writes 2^63 rounded down to a page)
NO_LIMIT = 1 << 62


@dataclass
class MemorySample:
    """One memory cgroup at one instant; counters are totals since it was made."""
    usage: int | None = None        # bytes charged now
    limit: int | None = None        # bytes, None when unlimited
    pgmajfault: int | None = None
    refault_bytes: int | None = None    # pages evicted and read again, in bytes


@dataclass
class Mount:
    """A cgroup hierarchy's mount: where it is, and which cgroup its directory is (not
    "/" where the mount shows a subtree: a container's view of the host's hierarchy)."""
    point: str
    root: str = "/"

    def dir_of(self, path: str) -> str | None:
        """The directory of cgroup ``path`` (as /proc/PID/cgroup gives it); None when it
        lies outside this mount ("/.." of another cgroup namespace) or is not a path."""
        if not path.startswith("/") or "/.." in path or "\x00" in path:
            return None
        if self.root != "/":
            if path != self.root and not path.startswith(self.root + "/"):
                return None
            path = path[len(self.root):] or "/"
        return self.point.rstrip("/") + path if path != "/" else self.point

    def is_host_root(self, path: str) -> bool:
        """Is cgroup ``path`` the machine's root cgroup (whose figures are /proc's)? Every
        cgroup v2 directory but the real root has ``cgroup.type``: inside a cgroup
        namespace the job's own cgroup reads as "/" and is not the root."""
        d = self.dir_of(path)
        return d is not None and path == "/" and not os.path.exists(f"{d}/cgroup.type")


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> tuple[Mount | None, Mount | None]:
    """(the cgroup v2 mount, the v1 memory controller's mount), either None. A mount of
    the whole hierarchy is preferred to one of a subtree."""
    v2: list[Mount] = []
    v1: list[Mount] = []
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        pre, _, post = line.partition(" - ")
        fields, rest = pre.split(), post.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        m = Mount(fields[4], fields[3])
        if rest[0] == "cgroup2":
            v2.append(m)
        elif rest[0] == "cgroup" and "memory" in rest[2].split(","):
            v1.append(m)

    def best(ms):
        return min(ms, key=lambda m: m.root != "/") if ms else None
    return best(v2), best(v1)


def cgroups_of(pid: int, proc: str = "/proc") -> tuple[str | None, str | None]:
    """(cgroup v2 path, v1 memory cgroup path) of a process, as /proc/PID/cgroup gives
    them ("/" for the root); None where it has none or is gone."""
    v2 = v1_memory = None
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1_memory = path
    return v2, v1_memory


def parse_memory_stat(raw: bytes) -> tuple[int | None, int | None]:
    """memory.stat (v2, or v1 with its hierarchical ``total_`` keys) -> (pgmajfault,
    workingset refaults in pages: anon + file, or the single counter of kernels before
    5.9; v1 has them since about 5.13, None before)."""
    vals: dict[bytes, int] = {}
    for line in raw.split(b"\n"):
        k, _, v = line.partition(b" ")
        if v:
            try:
                vals[k] = int(v)
            except ValueError:
                continue
    pre = b"total_" if b"total_pgmajfault" in vals else b""
    major = vals.get(pre + b"pgmajfault")
    parts = [vals[k] for k in (pre + b"workingset_refault_anon", pre + b"workingset_refault_file")
             if k in vals]
    refault = sum(parts) if parts else vals.get(pre + b"workingset_refault")
    return major, refault


def hierarchical_limit(raw: bytes) -> int | None:
    """v1 memory.stat's ``hierarchical_memory_limit``: the lowest limit on the cgroup and
    its parents."""
    for line in raw.split(b"\n"):
        if line.startswith(b"hierarchical_memory_limit "):
            return _int(line.partition(b" ")[2])
    return None


def _ancestors_limit(d: str, top: str) -> int | None:
    """The lowest v2 memory.max of the directories above ``d`` up to ``top`` (the
    mount: the root has none)."""
    low = None
    d = os.path.dirname(d.rstrip("/"))
    while len(d) > len(top.rstrip("/")) and d.startswith(top.rstrip("/")):
        try:
            with open(f"{d}/memory.max", "rb") as f:
                v = _int(f.read())
        except OSError:
            v = None
        if v is not None:
            low = v if low is None else min(low, v)
        d = os.path.dirname(d)
    return low


def _own_cgroup(d: str, pids: set[int]) -> bool:
    """Is the v2 cgroup in ``d`` the job's own: its memory controller enabled there, or
    every process in it traced?"""
    if os.path.exists(f"{d}/memory.current"):
        return True
    try:
        with open(f"{d}/cgroup.procs") as f:
            procs = {int(x) for x in f.read().split()}
    except (OSError, ValueError):
        return False
    return bool(procs) and procs <= pids


def _int(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None       # "max": no limit


class _Files:
    """Open-once files of one cgroup, re-read with pread; a file that cannot be opened
    or read (the cgroup went away) reads as None."""

    def __init__(self, base: str, names: tuple[str, ...]):
        self.fds: dict[str, int] = {}
        for name in names:
            try:
                self.fds[name] = os.open(f"{base}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass

    def read(self, name: str) -> bytes | None:
        fd = self.fds.get(name)
        if fd is None:
            return None
        try:
            return os.pread(fd, 1 << 16, 0)
        except OSError:
            return None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class JobCgroups:
    """Samples the cgroups of ``pids()``. ``sample()`` -> (PSI per v2 cgroup path:
    {resource: (some us, full us)}, MemorySample per memory cgroup path: the v2 path
    where the v2 memory controller is enabled there, else the v1 memory path)."""

    def __init__(self, pids, proc: str = "/proc",
                 mounts: tuple[Mount | None, Mount | None] | None = None):
        self.pids = pids
        self.proc = proc
        self.v2, self.v1_memory = mounts if mounts is not None else cgroup_mounts()
        self._psi: dict[str, _Files] = {}
        self._mem: dict[str, tuple[_Files, bool]] = {}     # path -> (files, is v2)
        self._parent_limit: dict[str, int | None] = {}     # v2 path -> its parents' lowest
        self._refreshed = -REFRESH_S

    def refresh(self) -> None:
        psi: dict[str, str] = {}         # path -> directory
        mem: dict[str, tuple[str, bool]] = {}
        pids = set(self.pids())
        own: dict[str, bool] = {}
        for pid in sorted(pids):
            v2, v1m = cgroups_of(pid, self.proc)
            v2_dir = None
            if v2 is not None and self.v2 is not None and not self.v2.is_host_root(v2):
                v2_dir = self.v2.dir_of(v2)
            if v2_dir is not None and v2 not in own:
                own[v2] = _own_cgroup(v2_dir, pids)
            if v2_dir is not None and own[v2] and len(psi) < MAX_CGROUPS:
                psi[v2] = v2_dir
            if v2_dir is not None and os.path.exists(f"{v2_dir}/memory.current"):
                if len(mem) < MAX_CGROUPS:
                    mem[v2] = (v2_dir, True)
            elif v1m not in (None, "/") and self.v1_memory is not None:
                d = self.v1_memory.dir_of(v1m)
                if d is not None and len(mem) < MAX_CGROUPS:
                    mem[v1m] = (d, False)
        for path in set(self._psi) - set(psi):
            self._psi.pop(path).close()
        for path in set(self._mem) - set(mem):
            self._mem.pop(path)[0].close()
        for path, d in psi.items():
            if path not in self._psi:
                self._psi[path] = _Files(d, ("cpu.pressure", "io.pressure", "memory.pressure"))
        self._parent_limit = {path: _ancestors_limit(d, self.v2.point)
                              for path, (d, v2) in mem.items() if v2}
        for path, (d, v2) in mem.items():
            if path not in self._mem:
                names = (("memory.current", "memory.max", "memory.stat") if v2 else
                         ("memory.usage_in_bytes", "memory.limit_in_bytes", "memory.stat"))
                self._mem[path] = (_Files(d, names), v2)

    def sample(self) -> tuple[dict[str, dict], dict[str, MemorySample]]:
        now = time.monotonic()
        if now - self._refreshed >= REFRESH_S:
            self._refreshed = now
            self.refresh()
        psi: dict[str, dict] = {}
        for path, files in self._psi.items():
            got = {}
            for res in ("cpu", "io", "memory"):
                raw = files.read(f"{res}.pressure")
                if raw is not None:
                    got[res] = parse_psi(raw)
            if got:
                psi[path] = got
        mem: dict[str, MemorySample] = {}
        for path, (files, v2) in self._mem.items():
            usage = _int(files.read("memory.current" if v2 else "memory.usage_in_bytes"))
            if usage is None:
                continue                 # gone
            limits = [_int(files.read("memory.max" if v2 else "memory.limit_in_bytes"))]
            if v2:
                limits.append(self._parent_limit.get(path))
            s = MemorySample(usage)
            if (raw := files.read("memory.stat")) is not None:
                s.pgmajfault, refault = parse_memory_stat(raw)
                s.refault_bytes = None if refault is None else refault * PAGE_BYTES
                if not v2:
                    limits.append(hierarchical_limit(raw))
            limits = [v for v in limits if v is not None and v < NO_LIMIT]
            s.limit = min(limits) if limits else None
            mem[path] = s
        return psi, mem

    def describe(self) -> str:
        """For --check and the capture's start: where the job cgroups are read from."""
        where = []
        if self.v2 is not None:
            where.append(f"cgroup v2 at {self.v2.point}")
        if self.v1_memory is not None:
            where.append(f"v1 memory at {self.v1_memory.point}")
        return ("the traced processes' cgroups: " + ", ".join(where) +
                " (per-job rows only for a job in a cgroup of its own)") if where else \
            "no cgroup hierarchy mounted: no per-job pressure or memory"

    def close(self) -> None:
        for files in self._psi.values():
            files.close()
        for files, _ in self._mem.values():
            files.close()
        self._psi.clear()
        self._mem.clear()
