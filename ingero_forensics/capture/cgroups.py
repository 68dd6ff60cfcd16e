"""The traced processes' own cgroups: their pressure (PSI) and memory, per cgroup.

/proc/pressure and /proc/vmstat are the whole machine's. Where the job shares its machine
(other tenants, a Slurm node split between jobs, or in the tests several "nodes" on one
kernel) they cannot say whether *the job* stalled. The kernel keeps the same figures per
cgroup: ``cpu.pressure``, ``io.pressure`` and ``memory.pressure`` in every cgroup v2
directory, and the memory controller's usage, limit and ``memory.stat`` (v2, or v1 where
the memory controller is bound to a v1 hierarchy). The sampler reads them for the
cgroups the traced processes live in (never the root: that is /proc's own figure).

Paths come from /proc/PID/cgroup and are re-read every ``REFRESH_S``: a job moved into
its cgroup after the capture started (a Slurm step, a container) is followed. At most
``MAX_CGROUPS`` cgroups are sampled (a job's processes share a few).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .host import parse_psi

REFRESH_S = 1.0
MAX_CGROUPS = 16
#: a limit at or above this is "no limit" (v1 writes 2^63 rounded down to a page)
NO_LIMIT = 1 << 62


@dataclass
class CgroupSample:
    """One cgroup at one instant; counters are totals since the cgroup was made."""
    psi: dict = field(default_factory=dict)   # resource -> (some us, full us or None)
    usage: int | None = None                  # bytes charged now
    limit: int | None = None                  # bytes, None when unlimited
    pgmajfault: int | None = None
    refault: int | None = None                # pages evicted and read again (workingset)


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> tuple[str | None, str | None]:
    """(the cgroup v2 mount point, the v1 memory controller's mount point), either None."""
    v2 = v1_memory = None
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
        if rest[0] == "cgroup2" and v2 is None:
            v2 = fields[4]
        elif rest[0] == "cgroup" and "memory" in rest[2].split(",") and v1_memory is None:
            v1_memory = fields[4]
    return v2, v1_memory


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


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _int(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None       # "max": no limit


def parse_memory_stat(raw: bytes) -> tuple[int | None, int | None]:
    """memory.stat (v2, or v1 with its hierarchical ``total_`` keys) -> (pgmajfault,
    workingset refaults: anon + file, or the single counter of older kernels)."""
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


class JobCgroups:
    """Samples the cgroups of ``pids()``; ``sample()`` -> {device: CgroupSample}, where
    the device is the cgroup's path (v2 for pressure, the v1 memory path for memory where
    that controller is v1; both are the same name on a machine that names them alike)."""

    def __init__(self, pids, proc: str = "/proc", mounts: tuple[str | None, str | None] | None = None):
        self.pids = pids
        self.proc = proc
        self.v2, self.v1_memory = mounts if mounts is not None else cgroup_mounts()
        self._paths: list[tuple[str | None, str | None]] = []
        self._refreshed = -REFRESH_S

    def refresh(self) -> None:
        found: list[tuple[str | None, str | None]] = []
        for pid in sorted(self.pids()):
            v2, v1m = cgroups_of(pid, self.proc)
            key = (v2 if v2 not in (None, "/") else None,
                   v1m if v1m not in (None, "/") else None)
            if key != (None, None) and key not in found:
                found.append(key)
                if len(found) >= MAX_CGROUPS:
                    break
        self._paths = found

    def sample(self) -> dict[str, CgroupSample]:
        now = time.monotonic()
        if now - self._refreshed >= REFRESH_S:
            self._refreshed = now
            self.refresh()
        out: dict[str, CgroupSample] = {}
        for v2, v1m in self._paths:
            s = CgroupSample()
            if v2 is not None and self.v2 is not None:
                base = self.v2 + v2
                for res in ("cpu", "io", "memory"):
                    raw = _read(f"{base}/{res}.pressure")
                    if raw is not None:
                        s.psi[res] = parse_psi(raw)
                # the v2 memory controller, where it is enabled for this cgroup
                if os.path.exists(f"{base}/memory.current"):
                    s.usage = _int(_read(f"{base}/memory.current"))
                    s.limit = _int(_read(f"{base}/memory.max"))
                    if (raw := _read(f"{base}/memory.stat")) is not None:
                        s.pgmajfault, s.refault = parse_memory_stat(raw)
            if s.usage is None and v1m is not None and self.v1_memory is not None:
                base = self.v1_memory + v1m
                s.usage = _int(_read(f"{base}/memory.usage_in_bytes"))
                s.limit = _int(_read(f"{base}/memory.limit_in_bytes"))
                if (raw := _read(f"{base}/memory.stat")) is not None:
                    s.pgmajfault, s.refault = parse_memory_stat(raw)
            if s.limit is not None and s.limit >= NO_LIMIT:
                s.limit = None
            if s.psi or s.usage is not None:
                out[v2 or v1m] = s
        return out
