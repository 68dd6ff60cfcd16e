"""Clock-sync samples: the rows that map this node's CLOCK_MONOTONIC to UTC.

Three kinds of row, each named by ``source``:

* ``system`` - CLOCK_MONOTONIC read before and after CLOCK_REALTIME, CLOCK_BOOTTIME and
  CLOCK_TAI (best of three brackets), plus the kernel's NTP state from a read-only
  ``adjtimex`` (modes = 0 changes nothing and needs no privilege).
* ``chrony`` - ``chronyc -c -n -h /run/chrony/chronyd.sock tracking``: chronyc talks to
  chronyd over that local UNIX socket only (``-h`` with a path stops it from falling
  back to UDP on 127.0.0.1, ``-n`` from resolving names).
* ``ptp`` - each /dev/ptpN read with PTP_SYS_OFFSET_EXTENDED (or PRECISE).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import glob
import os
import shutil
import struct
import subprocess
import time

from .distro import packages
from .source import CaptureContext, RowSink, Source, SourceStatus

MONO, REAL = time.CLOCK_MONOTONIC, time.CLOCK_REALTIME
BOOT = getattr(time, "CLOCK_BOOTTIME", 7)
TAI = getattr(time, "CLOCK_TAI", 11)
_gt = time.clock_gettime_ns

CHRONY_SOCKET = "/run/chrony/chronyd.sock"

# adjtimex status bits and states (linux/timex.h)
STA_UNSYNC = 0x0040
STA_NANO = 0x2000
TIME_ERROR = 5


class Timex(ctypes.Structure):
    """struct timex (linux/timex.h, glibc layout)."""
    _fields_ = [
        ("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
        ("constant", ctypes.c_long), ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long), ("time_sec", ctypes.c_long),
        ("time_usec", ctypes.c_long), ("tick", ctypes.c_long), ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long), ("shift", ctypes.c_int), ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long), ("calcnt", ctypes.c_long), ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long), ("tai", ctypes.c_int), ("_pad", ctypes.c_int * 11),
    ]


_libc = None


def _adjtimex_fn():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc.adjtimex


def read_adjtimex() -> dict | None:
    """The kernel NTP state, read only (modes = 0). None if the call fails."""
    tx = Timex()
    tx.modes = 0
    state = _adjtimex_fn()(ctypes.byref(tx))
    if state < 0:
        return None
    return adjtimex_fields(state, tx.status, tx.offset, tx.freq, tx.maxerror,
                           tx.esterror, tx.tai)


def adjtimex_fields(state: int, status: int, offset: int, freq: int, maxerror: int,
                    esterror: int, tai: int) -> dict:
    """Convert raw adjtimex values to the clock_samples units."""
    return {
        "synchronized": int(not (status & STA_UNSYNC) and state != TIME_ERROR),
        # offset is in us unless STA_NANO; freq is ppm with a 16-bit binary fraction.
        "adj_offset_ns": offset if status & STA_NANO else offset * 1000,
        "adj_freq_ppb": freq / 65536.0 * 1000.0,
        "adj_maxerror_ns": maxerror * 1000,
        "adj_esterror_ns": esterror * 1000,
        "adj_status": status,
        "adj_tai_s": tai,
    }


def bracket(tries: int = 3) -> tuple[int, int, int, int, int]:
    """(mono_before, realtime, boottime, tai, mono_after): the narrowest of ``tries``."""
    best = None
    for _ in range(tries):
        m0 = _gt(MONO)
        r = _gt(REAL)
        b = _gt(BOOT)
        t = _gt(TAI)
        m1 = _gt(MONO)
        if best is None or m1 - m0 < best[4] - best[0]:
            best = (m0, r, b, t, m1)
    return best


def _row(source, m0, m1, realtime=None, boottime=None, tai=None, adj=None, ref_offset=None,
         root_delay=None, root_disp=None, leap=None, device=None) -> tuple:
    adj = adj or {}
    return (source, m0, m1, realtime, boottime, tai, m1 - m0, adj.get("synchronized"),
            adj.get("adj_offset_ns"), adj.get("adj_freq_ppb"), adj.get("adj_maxerror_ns"),
            adj.get("adj_esterror_ns"), adj.get("adj_status"), adj.get("adj_tai_s"),
            ref_offset, root_delay, root_disp, leap, device)


def system_row() -> tuple:
    m0, r, b, t, m1 = bracket()
    return _row("system", m0, m1, r, b, t, read_adjtimex())


# -------------------------------------------------------------------------- chrony

def chronyc_command(chronyc: str, socket_path: str = CHRONY_SOCKET) -> list[str]:
    return [chronyc, "-c", "-n", "-h", socket_path, "tracking"]


def parse_chrony_tracking(line: str) -> dict:
    """Fields of one ``chronyc -c tracking`` CSV line.

    Columns: ref id (hex), ref name/IP, stratum, ref time, system time (s; positive =
    system clock slow of true time, as chronyc prints "slow"), last offset, RMS offset,
    frequency, residual freq, skew, root delay (s), root dispersion (s), update
    interval, leap status. Raises ValueError on anything else.
    """
    f = line.strip().split(",")
    if len(f) < 14:
        raise ValueError(f"chronyc tracking: expected 14 fields, got {len(f)}")
    correction = float(f[4])
    return {
        "ref_id": f[0],
        "ref_offset_ns": -round(correction * 1e9),  # system minus reference
        "root_delay_ns": round(float(f[10]) * 1e9),
        "root_dispersion_ns": round(float(f[11]) * 1e9),
        "leap_status": f[13],
    }


def chrony_row(chronyc: str, socket_path: str = CHRONY_SOCKET, timeout: float = 2.0) -> tuple:
    """Query chronyd; raise OSError/ValueError/subprocess errors on failure."""
    m0 = _gt(MONO)
    out = subprocess.run(chronyc_command(chronyc, socket_path), capture_output=True,
                         text=True, timeout=timeout, check=True, stdin=subprocess.DEVNULL).stdout
    r = _gt(REAL)
    m1 = _gt(MONO)
    t = parse_chrony_tracking(out.splitlines()[0] if out else "")
    return _row("chrony", m0, m1, r, ref_offset=t["ref_offset_ns"],
                root_delay=t["root_delay_ns"], root_disp=t["root_dispersion_ns"],
                leap=t["leap_status"], device=t["ref_id"])


# ----------------------------------------------------------------------------- PTP

_IOC_WRITE, _IOC_READ = 1, 2


def _iowr(type_: str, nr: int, size: int) -> int:
    return ((_IOC_READ | _IOC_WRITE) << 30) | (size << 16) | (ord(type_) << 8) | nr


PTP_MAX_SAMPLES = 25
_PTP_TIME = struct.Struct("<qII")            # struct ptp_clock_time
_EXT_SIZE = 16 + PTP_MAX_SAMPLES * 3 * _PTP_TIME.size
_PRECISE_SIZE = 3 * _PTP_TIME.size + 16
PTP_SYS_OFFSET_EXTENDED = _iowr("=", 9, _EXT_SIZE)
PTP_SYS_OFFSET_PRECISE = _iowr("=", 8, _PRECISE_SIZE)
PTP_SAMPLES = 5


def _ns(buf: bytes, off: int) -> int:
    sec, nsec, _ = _PTP_TIME.unpack_from(buf, off)
    return sec * 1_000_000_000 + nsec


def parse_ptp_extended(buf: bytes, n: int) -> tuple[int, int, int]:
    """From a filled ptp_sys_offset_extended: (realtime_mid, phc, window) of the
    sample with the narrowest system-time window."""
    best = None
    for i in range(n):
        base = 16 + i * 3 * _PTP_TIME.size
        s0, phc, s1 = (_ns(buf, base + k * _PTP_TIME.size) for k in range(3))
        if best is None or s1 - s0 < best[2]:
            best = ((s0 + s1) // 2, phc, s1 - s0)
    return best


def ptp_row(path: str) -> tuple:
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(_EXT_SIZE)
        struct.pack_into("<I", buf, 0, PTP_SAMPLES)
        m0 = _gt(MONO)
        try:
            fcntl.ioctl(fd, PTP_SYS_OFFSET_EXTENDED, buf, True)
            m1 = _gt(MONO)
            real, phc, _ = parse_ptp_extended(bytes(buf), PTP_SAMPLES)
        except OSError:
            pbuf = bytearray(_PRECISE_SIZE)
            m0 = _gt(MONO)
            fcntl.ioctl(fd, PTP_SYS_OFFSET_PRECISE, pbuf, True)
            m1 = _gt(MONO)
            phc, real = _ns(bytes(pbuf), 0), _ns(bytes(pbuf), _PTP_TIME.size)
    finally:
        os.close(fd)
    return _row("ptp", m0, m1, real, ref_offset=phc - real, device=path)


# --------------------------------------------------------------------------- source

def due(src, now: float) -> bool:
    """Fixed-rate schedule on ``src._next``/``src.interval``; skips missed ticks."""
    if now < src._next:
        return False
    src._next = (src._next or now) + src.interval
    if src._next <= now:
        src._next = now + src.interval
    return True


class ClockSource(Source):
    """Writes clock_samples every ``interval`` seconds (and on demand at segment edges)."""

    name = "clock"

    def __init__(self, interval: float = 1.0, *, chronyc: str | None = None,
                 chrony_socket: str = CHRONY_SOCKET, ptp_glob: str = "/dev/ptp*"):
        super().__init__()
        self.interval = interval
        self.chronyc = chronyc if chronyc is not None else shutil.which("chronyc")
        self.chrony_socket = chrony_socket
        self.ptp_paths = sorted(glob.glob(ptp_glob))
        self.chrony_on = False
        self._next = 0.0
        self._failed: set[str] = set()

    @classmethod
    def probe(cls) -> SourceStatus:
        return SourceStatus(cls.name, True, "clock_gettime brackets + adjtimex")

    def sub_statuses(self) -> list[SourceStatus]:
        """What the optional parts (chrony, PTP) would do here."""
        out = []
        if not self.chronyc:
            out.append(SourceStatus("clock.chrony", False, "chronyc not installed",
                                    f"{packages().chrony} and run chronyd"))
        elif not os.path.exists(self.chrony_socket):
            out.append(SourceStatus("clock.chrony", False,
                                    f"chronyd socket {self.chrony_socket} not found",
                                    "start chronyd"))
        else:
            out.append(SourceStatus("clock.chrony", True, f"{self.chronyc} via {self.chrony_socket}"))
        if self.ptp_paths:
            out.append(SourceStatus("clock.ptp", True, ", ".join(self.ptp_paths)))
        else:
            out.append(SourceStatus("clock.ptp", False, "no /dev/ptp* device",
                                    "only NICs with a PTP hardware clock provide one"))
        return out

    def start(self, ctx: CaptureContext) -> None:
        self.chrony_on = bool(self.chronyc) and os.path.exists(self.chrony_socket)
        self._next = 0.0

    def sample_now(self, sink: RowSink) -> None:
        rows = [system_row()]
        if self.chrony_on:
            self._try(sink, "chrony", lambda: chrony_row(self.chronyc, self.chrony_socket), rows)
        for path in self.ptp_paths:
            self._try(sink, path, lambda p=path: ptp_row(p), rows)
        sink.add_many("clock_samples", rows)
        self.events += len(rows)

    def _try(self, sink, what, fn, rows) -> None:
        try:
            rows.append(fn())
            self._failed.discard(what)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            if what not in self._failed:  # say it once per failure streak, not every second
                self._failed.add(what)
                sink.log("warning", "clock", "warning", f"{what} read failed: {e}")

    def poll(self, sink: RowSink) -> None:
        if due(self, time.monotonic()):
            self.sample_now(sink)

    def stop(self, sink: RowSink) -> None:
        self.sample_now(sink)
