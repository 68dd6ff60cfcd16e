"""The host sampler: /proc counters (and NVML when present) as host_samples rows.

Metric names and units are exactly bundle.schema.HOST_METRICS. Gauges are written
as read; rates and shares are computed over the interval since the previous sample,
so the first sample of a rate writes no row. Counter resets (negative deltas) write
no row either.

Cost: the /proc files are opened once and re-read with pread at offset 0 (procfs
regenerates them on every read), and parsing looks only at the fields it needs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ..bundle.schema import HOST_METRICS
from .source import CaptureContext, RowSink, Source, SourceStatus

METRIC_NAMES = frozenset(m for m, _, _ in HOST_METRICS)
#: the kernel counts refaults in pages; rows give bytes (4 KiB or 64 KiB pages alike)
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

PROC_FILES = {
    "stat": "/proc/stat", "loadavg": "/proc/loadavg", "meminfo": "/proc/meminfo",
    "vmstat": "/proc/vmstat", "snmp": "/proc/net/snmp", "netdev": "/proc/net/dev",
    "diskstats": "/proc/diskstats", "psi_cpu": "/proc/pressure/cpu",
    "psi_io": "/proc/pressure/io", "psi_memory": "/proc/pressure/memory",
}


# ----------------------------------------------------------------------- parsers

def bpf_run_time_ns(pid: str = "self") -> int | None:
    """In-kernel run time of the BPF programs this process holds, so far: the sum of
    run_time_ns in /proc/PID/fdinfo of each program descriptor. None when the kernel
    keeps no run time (kernel.bpf_stats_enabled is 0, its default: counting costs every
    program run a clock read) or the process holds no program."""
    try:
        with open("/proc/sys/kernel/bpf_stats_enabled", "rb") as f:
            if f.read().strip() != b"1":
                return None
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    total, found = 0, False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:bpf-prog":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
                info = f.read()
        except OSError:
            continue        # closed meanwhile
        for line in info.split(b"\n"):
            if line.startswith(b"run_time_ns:"):
                total += int(line.split()[1])
                found = True
    return total if found else None


def parse_stat(raw: bytes) -> tuple[dict[str | None, tuple[int, int, int]], int | None]:
    """/proc/stat -> ({None or 'cpuN': (busy, iowait, total) jiffies}, procs_running)."""
    cpus: dict[str | None, tuple[int, int, int]] = {}
    running = None
    for line in raw.split(b"\n"):
        if line.startswith(b"cpu"):
            f = line.split()
            v = [int(x) for x in f[1:9]]
            v += [0] * (8 - len(v))
            user, nice, system, idle, iowait, irq, softirq, steal = v
            busy = user + nice + system + irq + softirq + steal
            name = f[0].decode()
            cpus[None if name == "cpu" else name] = (busy, iowait, busy + idle + iowait)
        elif line.startswith(b"procs_running"):
            running = int(line.split()[1])
    return cpus, running


def parse_loadavg(raw: bytes) -> float:
    return float(raw.split()[0])


def parse_psi(raw: bytes) -> tuple[int | None, int | None]:
    """/proc/pressure/* -> (some total us, full total us or None)."""
    some = full = None
    for line in raw.split(b"\n"):
        f = line.split()
        if not f:
            continue
        total = int(f[-1].partition(b"=")[2])
        if f[0] == b"some":
            some = total
        elif f[0] == b"full":
            full = total
    return some, full


_MEM_KEYS = {b"MemTotal:": "total", b"MemAvailable:": "available", b"Dirty:": "dirty",
             b"SwapTotal:": "swap_total", b"SwapFree:": "swap_free"}


def parse_meminfo(raw: bytes) -> dict[str, int]:
    out = {}
    for line in raw.split(b"\n"):
        key = _MEM_KEYS.get(line[:line.find(b":") + 1])
        if key:
            out[key] = int(line.split()[1]) * 1024  # kB
    return out


def parse_vmstat(raw: bytes) -> dict[str, int]:
    """pgmajfault, pgscan/pgsteal (kswapd + direct), allocstall (all zones) and
    workingset refaults (anon + file; one counter before kernel 5.9)."""
    out = {"pgmajfault": 0, "pgscan": 0, "pgsteal": 0, "allocstall": 0, "refault": 0}
    for line in raw.split(b"\n"):
        name, _, val = line.partition(b" ")
        if name == b"pgmajfault":
            out["pgmajfault"] = int(val)
        elif name in (b"workingset_refault", b"workingset_refault_anon",
                      b"workingset_refault_file"):
            out["refault"] += int(val)
        elif name in (b"pgscan_kswapd", b"pgscan_direct"):
            out["pgscan"] += int(val)
        elif name in (b"pgsteal_kswapd", b"pgsteal_direct"):
            out["pgsteal"] += int(val)
        elif name.startswith(b"allocstall"):
            out["allocstall"] += int(val)
    out["refault_bytes"] = out["refault"] * PAGE_BYTES
    return out


def parse_snmp_tcp(raw: bytes) -> dict[str, int]:
    head = vals = None
    for line in raw.split(b"\n"):
        if line.startswith(b"Tcp:"):
            if head is None:
                head = line.split()[1:]
            else:
                vals = line.split()[1:]
    if not head or not vals:
        return {}
    d = dict(zip(head, vals))
    return {"retrans": int(d.get(b"RetransSegs", 0)), "out": int(d.get(b"OutSegs", 0))}


def parse_net_dev(raw: bytes) -> dict[str, tuple[int, int, int]]:
    """/proc/net/dev -> {iface: (rx_bytes, tx_bytes, rx_drop + tx_drop)}."""
    out = {}
    for line in raw.split(b"\n")[2:]:
        name, sep, rest = line.partition(b":")
        if not sep:
            continue
        f = rest.split()
        out[name.strip().decode()] = (int(f[0]), int(f[8]), int(f[3]) + int(f[11]))
    return out


def parse_diskstats(raw: bytes, keep=lambda name: True) -> dict[str, tuple[int, ...]]:
    """/proc/diskstats -> {disk: (read_bytes, write_bytes, io_ticks_ms, ios, io_ms)}."""
    out = {}
    for line in raw.split(b"\n"):
        f = line.split()
        if len(f) < 14:
            continue
        name = f[2].decode()
        if not keep(name):
            continue
        reads, rsect, rms, writes, wsect, wms, ticks = (
            int(f[3]), int(f[5]), int(f[6]), int(f[7]), int(f[9]), int(f[10]), int(f[12]))
        if reads + writes == 0:
            continue  # never used: no rows for idle loop devices and the like
        out[name] = (rsect * 512, wsect * 512, ticks, reads + writes, rms + wms)
    return out


def whole_disk(name: str, sys_block: str = "/sys/class/block") -> bool:
    """Whole disks only: partitions would count the same bytes twice."""
    if name.startswith(("loop", "ram", "zram")):
        return False
    return not os.path.exists(f"{sys_block}/{name}/partition")


# ----------------------------------------------------------------------- snapshot

@dataclass
class Snapshot:
    t_ns: int
    cpus: dict = field(default_factory=dict)
    running: int | None = None
    load1: float | None = None
    psi: dict = field(default_factory=dict)       # resource -> (some, full)
    mem: dict = field(default_factory=dict)
    vm: dict = field(default_factory=dict)
    tcp: dict = field(default_factory=dict)
    net: dict = field(default_factory=dict)
    disks: dict = field(default_factory=dict)
    gpus: dict = field(default_factory=dict)      # index -> {metric: value}
    #: the traced processes' cgroups (cgroups.JobCgroups): v2 path -> {resource:
    #: (some, full)}, memory cgroup path -> cgroups.MemorySample
    job_psi: dict = field(default_factory=dict)
    job_mem: dict = field(default_factory=dict)
    #: CPU time of this process (the capture itself: every thread, user + system)
    self_cpu_ns: int | None = None
    #: in-kernel run time of its BPF programs (None: not kept by the kernel)
    bpf_run_ns: int | None = None


def host_rows(prev: Snapshot | None, cur: Snapshot) -> list[tuple]:
    """host_samples rows (timestamp_ns, metric, device, value) for one sample."""
    t = cur.t_ns
    rows = []
    add = rows.append
    if cur.load1 is not None:
        add((t, "load.avg1", None, cur.load1))
    if cur.running is not None:
        add((t, "load.runnable", None, float(cur.running)))
    m = cur.mem
    for key, metric in (("total", "mem.total_bytes"), ("available", "mem.available_bytes"),
                        ("dirty", "mem.dirty_bytes")):
        if key in m:
            add((t, metric, None, float(m[key])))
    if "swap_total" in m and "swap_free" in m:
        add((t, "mem.swap_used_bytes", None, float(m["swap_total"] - m["swap_free"])))
    for gpu, g in cur.gpus.items():
        for metric, value in g.items():
            if metric in METRIC_NAMES:
                add((t, metric, gpu, float(value)))
    for path, j in cur.job_mem.items():
        add((t, "mem.job.usage_bytes", path, float(j.usage)))
        if j.limit is not None:
            add((t, "mem.job.limit_bytes", path, float(j.limit)))
    if prev is None:
        return rows
    dt_ns = t - prev.t_ns
    if dt_ns <= 0:
        return rows
    dt = dt_ns / 1e9
    if cur.self_cpu_ns is not None and prev.self_cpu_ns is not None and \
            cur.self_cpu_ns >= prev.self_cpu_ns:
        add((t, "capture.cpu_pct", None, 100.0 * (cur.self_cpu_ns - prev.self_cpu_ns) / dt_ns))
    if cur.bpf_run_ns is not None and prev.bpf_run_ns is not None and \
            cur.bpf_run_ns >= prev.bpf_run_ns:
        add((t, "capture.bpf_cpu_pct", None,
             100.0 * (cur.bpf_run_ns - prev.bpf_run_ns) / dt_ns))
    for cpu, (busy, iowait, total) in cur.cpus.items():
        p = prev.cpus.get(cpu)
        if p is None or total <= p[2]:
            continue
        dtot = total - p[2]
        if busy >= p[0] and iowait >= p[1]:
            add((t, "cpu.busy_pct", cpu, 100.0 * (busy - p[0]) / dtot))
            add((t, "cpu.iowait_pct", cpu, 100.0 * (iowait - p[1]) / dtot))
    dt_us = dt_ns / 1000
    for res, (some, full) in cur.psi.items():
        p = prev.psi.get(res)
        if p is None:
            continue
        if some is not None and p[0] is not None and some >= p[0]:
            add((t, f"psi.{res}.some_pct", None, min(100.0, 100.0 * (some - p[0]) / dt_us)))
        if res != "cpu" and full is not None and p[1] is not None and full >= p[1]:
            add((t, f"psi.{res}.full_pct", None, min(100.0, 100.0 * (full - p[1]) / dt_us)))

    def rate(metric, device, a, b):
        if a is not None and b is not None and b >= a:
            add((t, metric, device, (b - a) / dt))

    for path, psi in cur.job_psi.items():
        for res, (some, full) in psi.items():
            p = prev.job_psi.get(path, {}).get(res)
            if p is None:
                continue
            if some is not None and p[0] is not None and some >= p[0]:
                add((t, f"psi.job.{res}.some_pct", path,
                     min(100.0, 100.0 * (some - p[0]) / dt_us)))
            if res != "cpu" and full is not None and p[1] is not None and full >= p[1]:
                add((t, f"psi.job.{res}.full_pct", path,
                     min(100.0, 100.0 * (full - p[1]) / dt_us)))
    for path, j in cur.job_mem.items():
        pj = prev.job_mem.get(path)
        if pj is not None:
            rate("vm.job.pgmajfault_per_s", path, pj.pgmajfault, j.pgmajfault)
            rate("vm.job.refault_bytes_per_s", path, pj.refault_bytes, j.refault_bytes)

    for key, metric in (("pgmajfault", "vm.pgmajfault_per_s"), ("pgscan", "vm.pgscan_per_s"),
                        ("pgsteal", "vm.pgsteal_per_s"), ("allocstall", "vm.allocstall_per_s"),
                        ("refault_bytes", "vm.refault_bytes_per_s")):
        rate(metric, None, prev.vm.get(key), cur.vm.get(key))
    rate("tcp.retrans_segs_per_s", None, prev.tcp.get("retrans"), cur.tcp.get("retrans"))
    rate("tcp.out_segs_per_s", None, prev.tcp.get("out"), cur.tcp.get("out"))
    for nic, (rx, tx, drops) in cur.net.items():
        p = prev.net.get(nic)
        if p:
            rate("net.rx_bytes_per_s", nic, p[0], rx)
            rate("net.tx_bytes_per_s", nic, p[1], tx)
            rate("net.drops_per_s", nic, p[2], drops)
    dt_ms = dt_ns / 1e6
    for disk, (rb, wb, ticks, ios, io_ms) in cur.disks.items():
        p = prev.disks.get(disk)
        if not p:
            continue
        rate("disk.read_bytes_per_s", disk, p[0], rb)
        rate("disk.write_bytes_per_s", disk, p[1], wb)
        if ticks >= p[2]:
            add((t, "disk.busy_pct", disk, min(100.0, 100.0 * (ticks - p[2]) / dt_ms)))
        if ios > p[3] and io_ms >= p[4]:
            add((t, "disk.await_ms", disk, (io_ms - p[4]) / (ios - p[3])))
    for gpu, g in cur.gpus.items():
        p = prev.gpus.get(gpu, {})
        rate("gpu.pcie_tx_bytes_per_s", gpu, p.get("pcie_tx"), g.get("pcie_tx"))
        rate("gpu.pcie_rx_bytes_per_s", gpu, p.get("pcie_rx"), g.get("pcie_rx"))
    return rows


# ----------------------------------------------------------------------- reader

class ProcReader:
    """Open /proc files once; ``snapshot()`` re-reads them all."""

    def __init__(self, files: dict[str, str] | None = None, nvml=None,
                 sys_block: str = "/sys/class/block", jobs=None):
        self.paths = dict(PROC_FILES if files is None else files)
        self.fds: dict[str, int] = {}
        self.missing: dict[str, str] = {}
        for key, path in self.paths.items():
            try:
                self.fds[key] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                self.missing[key] = f"{path}: {e.strerror}"
        self.nvml = nvml
        self.jobs = jobs          # cgroups.JobCgroups of the traced processes, or None
        self.sys_block = sys_block
        self._disk_kind: dict[str, bool] = {}

    def _keep_disk(self, name: str) -> bool:
        k = self._disk_kind.get(name)
        if k is None:
            k = self._disk_kind[name] = whole_disk(name, self.sys_block)
        return k

    def read(self, key: str) -> bytes | None:
        fd = self.fds.get(key)
        if fd is None:
            return None
        size = 1 << 16
        while True:
            try:
                raw = os.pread(fd, size, 0)
            except OSError:
                return None
            if len(raw) < size:
                return raw
            size *= 4  # a big machine's /proc/stat: read again with room to spare

    def snapshot(self) -> Snapshot:
        s = Snapshot(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
        s.self_cpu_ns = time.process_time_ns()
        s.bpf_run_ns = bpf_run_time_ns()
        r = self.read
        if (raw := r("stat")) is not None:
            s.cpus, s.running = parse_stat(raw)
        if (raw := r("loadavg")) is not None:
            s.load1 = parse_loadavg(raw)
        for res in ("cpu", "io", "memory"):
            if (raw := r(f"psi_{res}")) is not None:
                s.psi[res] = parse_psi(raw)
        if (raw := r("meminfo")) is not None:
            s.mem = parse_meminfo(raw)
        if (raw := r("vmstat")) is not None:
            s.vm = parse_vmstat(raw)
        if (raw := r("snmp")) is not None:
            s.tcp = parse_snmp_tcp(raw)
        if (raw := r("netdev")) is not None:
            s.net = parse_net_dev(raw)
        if (raw := r("diskstats")) is not None:
            s.disks = parse_diskstats(raw, self._keep_disk)
        if self.nvml is not None:
            s.gpus = self.nvml.sample()
        if self.jobs is not None:
            s.job_psi, s.job_mem = self.jobs.sample()
        return s

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        if self.nvml is not None:
            self.nvml.shutdown()
        if self.jobs is not None:
            self.jobs.close()


class HostSource(Source):
    """Samples the host every ``interval`` seconds (default 0.1 s = 10 Hz)."""

    name = "host"

    def __init__(self, interval: float = 0.1, *, nvml_library: str | None = None,
                 files: dict[str, str] | None = None):
        super().__init__()
        self.interval = interval
        self.nvml_library = nvml_library
        self.files = files
        self.reader: ProcReader | None = None
        self.prev: Snapshot | None = None
        self._next = 0.0
        self.nvml_status: SourceStatus | None = None

    @classmethod
    def probe(cls) -> SourceStatus:
        from .cgroups import JobCgroups
        return SourceStatus(cls.name, True, "/proc counters; " +
                            JobCgroups(lambda: set()).describe())

    @staticmethod
    def probe_nvml(library: str | None = None) -> SourceStatus:
        from .nvml import LIBRARY, Nvml, NvmlUnavailable
        try:
            nv = Nvml(library or LIBRARY)
        except NvmlUnavailable as e:
            return SourceStatus("host.nvml", False, str(e),
                                "install the NVIDIA driver (provides libnvidia-ml.so.1)")
        n = len(nv.handles)
        nv.shutdown()
        return SourceStatus("host.nvml", True, f"{n} GPU(s)")

    def start(self, ctx: CaptureContext | None) -> None:
        from .nvml import LIBRARY, Nvml, NvmlUnavailable
        nvml = None
        try:
            nvml = Nvml(self.nvml_library or LIBRARY)
            self.nvml_status = SourceStatus("host.nvml", True, f"{len(nvml.handles)} GPU(s)")
        except NvmlUnavailable as e:
            self.nvml_status = SourceStatus(
                "host.nvml", False, str(e), "install the NVIDIA driver (provides libnvidia-ml.so.1)")
        from .cgroups import JobCgroups
        # the traced processes' own cgroups (their PSI and memory); not with test files
        jobs = JobCgroups(ctx.targets.pids) if ctx is not None and self.files is None else None
        self.reader = ProcReader(self.files, nvml, jobs=jobs)
        self.prev = None
        self._next = 0.0

    @property
    def missing(self) -> dict[str, str]:
        return self.reader.missing if self.reader else {}

    def sample(self, sink: RowSink) -> None:
        cur = self.reader.snapshot()
        rows = host_rows(self.prev, cur)
        self.prev = cur
        sink.add_many("host_samples", rows)
        self.events += len(rows)

    def poll(self, sink: RowSink) -> None:
        from .clock import due
        if due(self, time.monotonic()):
            self.sample(sink)

    def stop(self, sink: RowSink) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
