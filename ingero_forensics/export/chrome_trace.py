"""fleet.db -> Chrome Trace Event Format JSON (opens in Perfetto and chrome://tracing).

Layout: one process per node (pid = 1 + its index among all nodes ordered by name, so a
node keeps its pid whatever --nodes selects) and one process for the fleet-wide
collective windows. Per traced thread: its own track (CUDA calls), an NCCL track
(collectives, entry to observed completion, and communicator lifecycle) and a sched
track. Per node: a TCP track (instants), a track per disk (block I/O) and counter tracks
(host samples, in-kernel call rates).

Slices on one track must nest (Perfetto spills or drops partial overlaps). Every slice
stream is therefore ordered by (track, start) and placed by a small lane allocator: a
slice that would partially overlap goes to an overflow track "<track> (overlap N)".

Streaming: rows are stepped one by one and written in chunks. Memory is bounded by the
number of tracks and threads, never by the number of events. Output is deterministic:
every query has a total order and the metadata holds no wall-clock time. The per-event
loops have two implementations writing the same bytes: the C accelerator (_fastslices.c:
it steps the SQL on this connection's own SQLite and builds the text from raw columns),
used when built, and the Python loops below (SQLite's printf/json_quote build the text),
the fallback and the reference (INGERO_NO_ACCEL=1 or ExportOptions(accel=False)).

Timestamps are microseconds with three decimals (nanoseconds) relative to ``origin``:
the start of the data, floored to a whole second of aligned fleet UTC (absolute UTC in
microseconds would exceed a double's 53 bits and lose the nanoseconds). The origin is in
the top-level metadata.
"""

from __future__ import annotations

import datetime as _dt
import contextlib
import copy
import dataclasses
import io
import os
import re
import shutil
import signal
import struct
import sys
import tempfile
import zlib
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import apsw
import orjson

from .. import __version__, accel
from ..db import harden
from ..errors import IngeroError
from ..merge.fleet_schema import FLEET_APPLICATION_ID, FLEET_VERSION

KINDS = ("nccl", "cuda", "tcp", "sched", "block", "host")
#: event_stats.source -> the --kinds name it belongs to
_STAT_KIND = {"nccl": "nccl", "cuda": "cuda", "sched": "sched", "block": "block", "tcp": "tcp"}
_CHUNK_EVENTS = 8192
#: Event args in output order (the accelerated SQL selects them in this order).
_CUDA_ARGS = ("layer", "stream", "bytes", "memcpy_kind", "kernel", "device", "return_code")
_NCCL_ARGS = ("op", "bytes", "comm", "seq", "rank", "nranks", "count", "datatype", "redop",
              "peer", "stream", "group_depth", "return_code", "call_duration_ns",
              "completion_utc_ns", "late_ns", "wait_ns", "entry_spread_ns", "ranks_seen",
              "last_to_arrive")
_NCCL_COMM_ARGS = ("api", "comm", "parent", "split_color", "split_key", "rank", "nranks",
                   "return_code")
#: Synthetic track ids start above any Linux tid (pid_max <= 2^22) and stay below 2^31.
_SYNTHETIC_TID = 1 << 30
#: Tables a node section reads that fleet.db does not index by node_id, with the kind
#: that reads them: one node's rows are bounded by their rowid range (where()).
_RANGED_TABLES = {"host_samples": "host", "tcp_events": "tcp", "block_events": "block"}
_NS = 1_000_000_000


class ExportError(IngeroError):
    pass


@dataclass
class ExportOptions:
    start: str | None = None           # --from: ISO 8601 UTC or +offset from the data start
    end: str | None = None             # --to
    nodes: tuple[str, ...] = ()        # node names; empty = all
    ranks: frozenset[int] | None = None
    kinds: frozenset[str] = frozenset(KINDS)
    max_events: int | None = None
    gzip_level: int = 1
    findings: bool = True              # mark ingero-report's straggler windows
    jobs: int | None = None            # worker processes; None: os.cpu_count()
    accel: bool = True                 # the C loops when built (INGERO_NO_ACCEL=1: off)


@dataclass
class ExportStats:
    events: int = 0          # everything but metadata (M) events
    slices: int = 0          # X
    instants: int = 0        # i
    counters: int = 0        # C
    flows: int = 0           # flow arrows (each an s and an f event)
    metadata_events: int = 0
    overflow_tracks: int = 0
    by_kind: dict = field(default_factory=dict)
    origin_ns: int = 0
    output: str = "-"
    bytes: int = 0
    accelerated: bool = False  # the C loops (_fastslices) wrote the slice sections


# ----------------------------------------------------------------------------- time

_OFFSET_RE = re.compile(r"^\+(\d+(?:\.\d+)?)(ns|us|ms|s|m|h|d)$")
_UNIT_NS = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": _NS, "m": 60 * _NS,
            "h": 3600 * _NS, "d": 86400 * _NS}


def parse_time(text: str, data_start_ns: int) -> int:
    """'+30s', '+2m', '+1.5h' (from the start of the data) or ISO 8601 UTC -> ns UTC.

    Never relative to the current time. An ISO time without an offset is taken as UTC.
    """
    s = text.strip()
    m = _OFFSET_RE.match(s)
    if m:
        num, unit = m.groups()
        if "." in num:
            whole, frac = num.split(".")
            scale = _UNIT_NS[unit]
            return data_start_ns + int(whole) * scale + int(frac.ljust(9, "0")[:9]) * scale // _NS
        return data_start_ns + int(num) * _UNIT_NS[unit]
    if s.startswith("+") or s.startswith("-"):
        raise ExportError(f"time {text!r}: offsets look like +30s, +2m, +1.5h "
                          "(units ns, us, ms, s, m, h, d)")
    iso = s[:-1] + "+00:00" if s.endswith(("Z", "z")) else s
    # Keep nanoseconds: datetime only holds microseconds, so split the fraction off.
    frac_ns = 0
    fm = re.search(r"\.(\d+)", iso)
    if fm:
        frac_ns = int(fm.group(1).ljust(9, "0")[:9])
        iso = iso[:fm.start()] + iso[fm.end():]
    try:
        t = _dt.datetime.fromisoformat(iso)
    except ValueError:
        raise ExportError(f"time {text!r}: not ISO 8601 UTC (2025-01-31T12:00:00Z) nor an "
                          "offset from the start of the data (+30s, +2m)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return int(t.timestamp()) * _NS + frac_ns


def data_start(con) -> int:
    """Where --from/--to offsets count from: the first node's first UTC time, else the
    earliest event."""
    v = con.execute("SELECT MIN(first_utc_ns) FROM nodes").fetchone()[0]
    if v is None:
        lows = [con.execute(f"SELECT MIN(timestamp_ns) FROM {t}").fetchone()[0]
                for t in ("nccl_events", "cuda_events", "sched_events", "block_events",
                          "tcp_events", "host_samples")]
        lows = [x for x in lows if x is not None]
        v = min(lows) if lows else 0
    return v


def iso_utc(ns: int) -> str:
    sec, frac = divmod(ns, _NS)
    base = _dt.datetime.fromtimestamp(sec, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{base}.{frac:09d}Z"


def parse_ranks(text: str) -> frozenset[int]:
    """'0-7,12' -> {0..7, 12}."""
    out = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ExportError(f"ranks {text!r}: use numbers and ranges, e.g. 0-7,12")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo or hi - lo > 1_000_000:
            raise ExportError(f"ranks {text!r}: bad range {part}")
        out.update(range(lo, hi + 1))
    return frozenset(out)


# -------------------------------------------------------------------- accelerator

class _AccelUnsupported(Exception):
    """The fleet holds a value the C loops leave to the Python path (a slice bound that
    is not a number): the export is redone without them."""


def load_accel():
    """The C accelerator module, ready, or None (not built, or INGERO_NO_ACCEL=1); see
    ingero_forensics/accel.py."""
    return accel.load("export._fastslices", "sqlite3_fastslices_init")


# ------------------------------------------------------------------------ the fleet

def connect_fleet(path) -> apsw.Connection:
    """db.connect_readonly without SQLite's per-connection mutex: an export connection is
    only ever used by one thread, and the C loops read columns a dozen times per row
    (each read would lock and unlock it)."""
    return harden(apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY
                                  | apsw.SQLITE_OPEN_NOMUTEX))


def open_fleet(path) -> apsw.Connection:
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise ExportError(f"{path}: cannot read: {e.strerror or e}") from None
    if head != b"SQLite format 3\x00":
        raise ExportError(f"{path}: not a fleet.db (not a SQLite database; bundles are "
                          "merged first with ingero-merge)")
    try:
        con = connect_fleet(path)
        app = con.execute("PRAGMA application_id").fetchone()[0]
        ver = con.execute("PRAGMA user_version").fetchone()[0]
    except apsw.Error as e:
        raise ExportError(f"{path}: cannot open database ({e})") from None
    if app != FLEET_APPLICATION_ID:
        con.close()
        raise ExportError(f"{path}: not a fleet.db (application_id {app:#x}; a bundle "
                          "database or another SQLite file?)")
    if ver > FLEET_VERSION:
        con.close()
        raise ExportError(f"{path}: fleet.db version {ver} is newer than this tool "
                          f"supports ({FLEET_VERSION}); upgrade ingero-forensics")
    return con


@dataclass
class Node:
    node_id: int
    name: str
    pid: int
    ranks: list


def _load_nodes(con) -> list[Node]:
    nodes = []
    for i, (node_id, name, ranks) in enumerate(con.execute(
            "SELECT node_id, name, ranks FROM nodes ORDER BY name, node_id")):
        try:
            rk = sorted(r for r in orjson.loads(ranks or "[]") if isinstance(r, int))
        except orjson.JSONDecodeError:
            rk = []
        nodes.append(Node(node_id, name, i + 1, rk))
    return nodes


def _ranges(ranks: list[int]) -> str:
    if not ranks:
        return "no ranks"
    parts, lo, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(lo) if lo == prev else f"{lo}-{prev}")
        if r is not None:
            lo = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


# ------------------------------------------------------------------------- tracks

class Tracks:
    """Chrome (pid, tid) per logical track, with overflow lanes and their names."""

    def __init__(self, nodes: list[Node], proc_rank: dict, thread_comm: dict):
        self.by_node = {n.node_id: n for n in nodes}
        self.proc_rank = proc_rank        # (node_id, os pid) -> global rank
        self.thread_comm = thread_comm    # (node_id, os tid) -> thread name
        self.names: dict[tuple[int, int], tuple[int, str]] = {}   # (pid, tid) -> (sort, name)
        self._next = {}                   # chrome pid -> next synthetic tid
        self._synthetic: dict[tuple, int] = {}
        self.overflow = 0

    def synthetic(self, chrome_pid: int, key: tuple, sort: int, name: str) -> int:
        tid = self._synthetic.get((chrome_pid,) + key)
        if tid is None:
            tid = self._next.get(chrome_pid, _SYNTHETIC_TID)
            self._next[chrome_pid] = tid + 1
            self._synthetic[(chrome_pid,) + key] = tid
            self.names[(chrome_pid, tid)] = (sort, name)
        return tid

    def thread_label(self, node_id: int, pid: int, tid: int) -> tuple[int, str]:
        rank = self.proc_rank.get((node_id, pid))
        comm = self.thread_comm.get((node_id, tid)) or "?"
        who = f"rank {rank}" if rank is not None else f"pid {pid}"
        sort = (rank if rank is not None else 1_000_000 + pid) * 16
        return sort, f"{who} · {comm} (tid {tid})"

    def thread(self, node_id: int, pid: int, tid: int) -> tuple[int, int]:
        chrome_pid = self.by_node[node_id].pid
        if (chrome_pid, tid) not in self.names:
            self.names[(chrome_pid, tid)] = self.thread_label(node_id, pid, tid)
        return chrome_pid, tid

    def family(self, node_id: int, pid: int, tid: int, family: str, order: int) -> tuple[int, int]:
        chrome_pid = self.by_node[node_id].pid
        sort, label = self.thread_label(node_id, pid, tid)
        return chrome_pid, self.synthetic(chrome_pid, (family, pid, tid), sort + order,
                                          f"{label} · {family}")

    def lane(self, chrome_pid: int, base_tid: int, lane: int) -> int:
        sort, name = self.names[(chrome_pid, base_tid)]
        key = ("lane", base_tid, lane)
        if (chrome_pid,) + key not in self._synthetic:
            self.overflow += 1
        return self.synthetic(chrome_pid, key, sort + 1, f"{name} (overlap {lane})")


def _place(lanes: list[list[int]], start: int, end: int) -> int:
    """First lane where [start, end) nests or follows; a new lane if none."""
    for i, stack in enumerate(lanes):
        while stack and stack[-1] <= start:
            stack.pop()
        if not stack or end <= stack[-1]:
            stack.append(end)
            return i
    lanes.append([end])
    return len(lanes) - 1


# -------------------------------------------------------------------------- writer

class _Sink:
    """Chunked writer of the traceEvents array; counts and caps events."""

    def __init__(self, raw, max_events: int | None):
        self.raw = raw
        self.buf: list[str] = []
        self.first = True
        self.max_events = max_events
        self.events = 0
        self.bytes = 0

    def add(self, line: str, counted: bool = True) -> None:
        self.buf.append(line)
        if counted:
            self.events += 1
            if self.max_events is not None and self.events > self.max_events:
                raise ExportError(f"more than --max-events {self.max_events} events; narrow "
                                  "the export with --from/--to, --nodes, --ranks or --kinds, "
                                  "or raise --max-events")
        if len(self.buf) >= _CHUNK_EVENTS:
            self.flush()

    def extend(self, lines: list[str]) -> None:
        """Add counted events in bulk (the hot path of the slice streams)."""
        self.flush()
        if not lines:
            return
        self.events += len(lines)
        if self.max_events is not None and self.events > self.max_events:
            raise ExportError(f"more than --max-events {self.max_events} events; narrow "
                              "the export with --from/--to, --nodes, --ranks or --kinds, "
                              "or raise --max-events")
        self.write(((",\n" if not self.first else "") + ",\n".join(lines)).encode())
        self.first = False

    def extend_joined(self, data: bytes, n: int) -> None:
        """``n`` counted events already joined by the C loops: exactly the bytes
        extend() writes for them (",\n" in front unless they start the section)."""
        self.flush()
        self.events += n
        if self.max_events is not None and self.events > self.max_events:
            raise ExportError(f"more than --max-events {self.max_events} events; narrow "
                              "the export with --from/--to, --nodes, --ranks or --kinds, "
                              "or raise --max-events")
        self.write(data)
        self.first = False

    def write(self, data: bytes) -> None:
        self.raw.write(data)
        self.bytes += len(data)

    def flush(self) -> None:
        if not self.buf:
            return
        text = ",\n".join(self.buf)
        self.write(((",\n" if not self.first else "") + text).encode())
        self.first = False
        self.buf.clear()


class _Spill:
    """Chunks of joined events kept for a later section, in a temporary file (memory stays
    flat) shared by the sections of one process: ``holder`` is {"f": file} once created.
    Written in a forked worker, it is that worker's own file."""

    def __init__(self, holder: dict):
        self.holder = holder
        self.chunks: list[tuple[int, int, int]] = []     # (offset, length, events)

    def write(self, data: bytes, n: int) -> None:
        f = self.holder.get("f")
        if f is None:
            f = self.holder["f"] = tempfile.TemporaryFile(prefix="ingero-export-")
        offset = f.seek(0, os.SEEK_END)
        f.write(data)
        self.chunks.append((offset, len(data), n))

    def replay(self, sink: "_Sink") -> int:
        """The chunks into ``sink`` as they were written: the bytes and chunking the C
        loop would have given the sink directly. Returns the number of events."""
        if not self.chunks:
            return 0
        f = self.holder["f"]
        f.flush()
        sink.flush()
        total = 0
        for offset, length, n in self.chunks:
            data = os.pread(f.fileno(), length, offset)
            if len(data) != length:
                raise ExportError(f"{f.name}: temporary file ended early")
            sink.extend_joined(data, n)
            total += n
        return total

    @staticmethod
    def close(holder: dict) -> None:
        f = holder.pop("f", None)
        if f is not None:
            f.close()


# ------------------------------------------------------------------- part files

@dataclass
class _Part:
    """One section's events in a part file: bytes [offset, offset + length) hold the
    events joined by ",\n" (no separator before the first or after the last), as plain
    text or, for gzip, as a raw deflate fragment ending in a sync flush (byte aligned,
    not final, so fragments concatenate into one deflate stream)."""
    path: str
    offset: int
    length: int
    raw_length: int      # uncompressed bytes
    crc: int             # CRC-32 of the uncompressed bytes (gzip only)


@dataclass
class _NodeResult:
    """A node's track allocator and counts, merged into the parent's."""
    node_id: int
    stats: ExportStats
    names: dict
    synthetic: dict
    next_tid: dict
    overflow: int
    overflowed_nccl: dict


class _PartFile:
    """Sections written one after another into one file; each becomes a _Part.

    A fresh compressor per section: a fragment's bytes depend only on its own events, so
    the output is the same whichever process wrote which section.
    """

    def __init__(self, path: str, gzip_level: int | None, max_events: int | None):
        self.path = path
        self.gzip_level = gzip_level
        self.f = open(path, "wb")
        self.sink = _Sink(self, max_events)
        self._comp = None
        self._crc = 0
        self._n = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def section(self, fill) -> _Part:
        offset = self.f.tell()
        self._crc, self._n = 0, 0
        self._comp = (zlib.compressobj(self.gzip_level, zlib.DEFLATED, -15)
                      if self.gzip_level is not None else None)
        self.sink.first = True
        fill(self.sink)
        self.sink.flush()
        if self._comp is not None and self._n:
            self.f.write(self._comp.flush(zlib.Z_SYNC_FLUSH))
        self.f.flush()          # copied from the file while it is still open
        return _Part(self.path, offset, self.f.tell() - offset, self._n, self._crc)

    def write(self, data: bytes) -> None:
        self._n += len(data)
        if self._comp is None:
            self.f.write(data)
        else:
            self._crc = zlib.crc32(data, self._crc)
            self.f.write(self._comp.compress(data))


class _InlineSections:
    """--jobs 1: sections written straight through an _Assembler, byte for byte as the
    assembler would copy them from part files (separator fragment, then the section as
    its own fragment)."""

    def __init__(self, w: "_Assembler", max_events: int | None):
        self.w = w
        self.sink = _Sink(self, max_events)
        self._comp = None
        self._crc = 0
        self._n = 0

    def section(self, fill) -> None:
        level = self.w.gzip_level
        self._crc, self._n = 0, 0
        self._comp = zlib.compressobj(level, zlib.DEFLATED, -15) if level is not None else None
        self.sink.first = True
        fill(self.sink)
        self.sink.flush()
        if not self._n:
            return
        w = self.w
        if self._comp is not None:
            w.write(self._comp.flush(zlib.Z_SYNC_FLUSH))
            w.crc = crc32_combine(w.crc, self._crc, self._n)
        w.bytes += self._n

    def write(self, data: bytes) -> None:
        if not self._n:
            if self.w.any_event:
                self.w.raw(b",\n")
            self.w.any_event = True
        self._n += len(data)
        if self._comp is None:
            self.w.write(data)
        else:
            self._crc = zlib.crc32(data, self._crc)
            self.w.write(self._comp.compress(data))


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B) (zlib's crc32_combine, which Python's
    zlib does not expose): lets the parent seal fragments it never decompressed."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]   # one zero bit
    even = _gf2_square(odd)                             # two
    odd = _gf2_square(even)                             # four
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


class _Assembler:
    """Writes the output: small pieces of its own, then parts copied from their files,
    ",\n" between non-empty parts. With gzip_level the output is one gzip member whose
    deflate stream is the concatenated fragments (as pigz does), sealed with a final empty
    block and the combined CRC."""

    def __init__(self, out, gzip_level: int | None):
        self.out = out
        self.gzip_level = gzip_level
        self.bytes = 0          # uncompressed
        self.crc = 0
        self.any_event = False
        try:
            self.fd = out.fileno() if isinstance(out, io.FileIO) else None
        except (OSError, ValueError):
            self.fd = None
        if isinstance(out, io.FileIO):
            self.write = self._write_all    # unbuffered: a write may be short
        else:
            self.write = out.write
        if gzip_level is not None:
            # RFC 1952 header as gzip.GzipFile(mtime=0, filename="") writes it.
            xfl = 4 if gzip_level == 1 else 2 if gzip_level == 9 else 0
            self.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00" + bytes([xfl]) + b"\xff")

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self.out.write(view):]

    def raw(self, data: bytes) -> None:
        if self.gzip_level is None:
            self.write(data)
        else:
            c = zlib.compressobj(self.gzip_level, zlib.DEFLATED, -15)
            self.write(c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH))
            self.crc = crc32_combine(self.crc, zlib.crc32(data), len(data))
        self.bytes += len(data)

    def part(self, p: _Part | None) -> None:
        if p is None or not p.raw_length:
            return
        if self.any_event:
            self.raw(b",\n")
        self.any_event = True
        self._copy(p.path, p.offset, p.length)
        self.bytes += p.raw_length
        if self.gzip_level is not None:
            self.crc = crc32_combine(self.crc, p.crc, p.raw_length)

    def _copy(self, path: str, offset: int, length: int) -> None:
        with open(path, "rb") as src:
            if self.fd is not None:
                # In the kernel (no copy through Python) when both are files.
                while length:
                    try:
                        n = os.copy_file_range(src.fileno(), self.fd, length, offset)
                    except OSError:
                        break
                    if n == 0:
                        break
                    offset += n
                    length -= n
            src.seek(offset)
            while length:
                chunk = src.read(min(length, 1 << 20))
                if not chunk:
                    raise ExportError(f"{path}: part file ended early")
                self.write(chunk)
                length -= len(chunk)

    def finish(self) -> None:
        if self.gzip_level is not None:
            self.write(zlib.compressobj(self.gzip_level, zlib.DEFLATED, -15).flush())
            self.write(struct.pack("<II", self.crc, self.bytes & 0xFFFFFFFF))


# ---------------------------------------------------------------------- workers

def _worker_main(exporter, node_ids, tmpdir, gzip_level, conn) -> None:
    """A forked worker: its nodes' sections, section by section (every node's NCCL, then
    every node's CUDA, ...), each into its own part file, announced as soon as it is
    written so that the parent copies it while the rest is being written:
    ("part", node_id, section, _Part, events, tracks after NCCL or None), then
    ("done", [_NodeResult]); ("error", message or _AccelUnsupported) on failure."""
    # Ctrl-C goes to the whole process group: the parent alone handles it (it terminates
    # the workers and removes the part files). SIGINT was blocked across the fork.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    path = None
    try:
        con = connect_fleet(exporter.path)   # never the parent's connection across fork
        try:
            # A fresh Tracks per node: a node's synthetic tids then depend only on its
            # own rows, never on which worker ran it or what it ran before.
            subs = [exporter._node_exporter(nid, con) for nid in node_ids]
            for name in exporter.node_sections():
                for sub in subs:
                    path = os.path.join(tmpdir, f"node-{sub.only_node}.{name}.part")
                    with _PartFile(path, gzip_level, exporter.opts.max_events) as pf:
                        part = pf.section(getattr(sub, name))
                    # the flows need every node's NCCL tracks (and nothing later)
                    tracks = sub._result() if name == "nccl" else None
                    conn.send(("part", sub.only_node, name, part, pf.sink.events, tracks))
            out = [sub._result() for sub in subs]
        finally:
            _Spill.close(exporter._spill_file)
            con.close()
        conn.send(("done", out))
    except _AccelUnsupported as e:
        conn.send(("error", e))
    except apsw.Error as e:
        conn.send(("error", f"{exporter.path}: cannot read fleet.db ({e})"))
    except OSError as e:
        conn.send(("error", f"{path}: cannot write: {e.strerror or e}"))
    except ExportError as e:
        conn.send(("error", str(e)))
    except BaseException as e:  # a bug: still one line, naming the worker's node
        conn.send(("error", f"{exporter.path}: export worker failed: {type(e).__name__}: {e}"))


def _analysis_main(exporter, conn) -> None:
    """A forked process running the findings analysis: ("analysis", Analysis) back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        exporter.run_analysis()
        conn.send(("analysis", exporter.analysis))
    except ExportError as e:
        conn.send(("error", str(e)))
    except BaseException as e:  # a bug: still one line
        conn.send(("error", f"{exporter.path}: findings analysis failed: "
                            f"{type(e).__name__}: {e}"))


class _Workers:
    """Per-node sections in ``jobs`` forked processes (node i to worker i % jobs), and,
    with ``analysis``, the findings analysis in one more (it is a third of the CPU time of
    a large export and only needed at the end); their messages in arrival order. On any
    error or Ctrl-C in the parent, close() terminates every one."""

    def __init__(self, exporter, node_ids, tmpdir, gzip_level, jobs, analysis=False):
        import multiprocessing
        ctx = multiprocessing.get_context("fork")
        self.names = {n.node_id: n.name for n in exporter.nodes_all}
        self.path = exporter.path
        self.procs = []
        self.waiting = {}
        # Ctrl-C held back while forking: a worker must not die of it before it ignores
        # it, nor be started without being in procs (and so never terminated).
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            tasks = [(_worker_main, node_ids[w::jobs]) for w in range(jobs)]
            if analysis:
                tasks.append((_analysis_main, None))
            for target, mine in tasks:
                recv, send = ctx.Pipe(duplex=False)
                args = ((exporter, mine, tmpdir, gzip_level, send) if mine is not None
                        else (exporter, send))
                proc = ctx.Process(target=target, args=args, daemon=True)
                self.procs.append((proc, recv))
                self.waiting[recv] = (proc, mine)
                proc.start()
                send.close()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def receive(self) -> list:
        """The next messages ("part", ...) and ("done", ...); [] once all are done."""
        from multiprocessing.connection import wait
        if not self.waiting:
            return []
        out = []
        for recv in wait(list(self.waiting)):
            proc, mine = self.waiting[recv]
            try:
                msg = recv.recv()
            except EOFError:
                proc.join()
                code = proc.exitcode
                why = f"killed by signal {-code}" if code and code < 0 else f"exit {code}"
                what = ("the findings analysis" if mine is None else "the export worker for "
                        + ", ".join(self.names[n] for n in mine))
                raise ExportError(f"{self.path}: {what} died ({why})") from None
            if msg[0] == "error":
                if isinstance(msg[1], _AccelUnsupported):
                    raise msg[1]
                raise ExportError(msg[1])
            if msg[0] in ("done", "analysis"):
                del self.waiting[recv]
            out.append(msg)
        return out

    def close(self) -> None:
        for proc, recv in self.procs:
            if proc.pid is not None:       # started
                if proc.is_alive():
                    proc.terminate()
                proc.join()
            recv.close()


def _ts(col: str) -> str:
    """SQL: a ns time point as microseconds relative to the origin (:origin), 3 decimals."""
    return f"printf('%.3f', ({col} - :origin) / 1000.0)"


def _dur(col: str) -> str:
    return f"printf('%.3f', ({col}) / 1000.0)"


def _head(cat: str, ts: str, dur: str | None, name: str) -> str:
    """SQL: the fixed part of an event, '"ts":…,"dur":…,"name":…,"cat":…,"args":', in one
    printf (a chain of || over separate printf calls costs about 15% more per row)."""
    if dur is None:
        return (f"""printf('"ts":%.3f,"s":"t","name":%s,"cat":"{cat}","args":', """
                f"({ts} - :origin) / 1000.0, json_quote({name}))")
    return (f"""printf('"ts":%.3f,"dur":%.3f,"name":%s,"cat":"{cat}","args":', """
            f"({ts} - :origin) / 1000.0, ({dur}) / 1000.0, json_quote({name}))")


def _args(*pairs: str) -> str:
    """SQL: a JSON object of the non-NULL args, built by concatenation.

    (json_patch('{}', json_object(...)) would drop NULLs too, at a third of the speed.)
    """
    parts = []
    for key, col in zip(pairs[::2], pairs[1::2]):
        k = key.strip("'")
        parts.append(f"""iif(({col}) IS NULL, '', ',"{k}":' || json_quote({col}))""")
    return "('{' || substr(" + " || ".join(parts) + ", 2) || '}')"


class _Exporter:
    def __init__(self, con, opts: ExportOptions, path: str):
        self.con = con
        self.opts = opts
        self.path = path
        self.nodes_all = _load_nodes(con)
        if not self.nodes_all:
            raise ExportError(f"{path}: fleet.db has no nodes (nothing was merged)")
        names = {n.name: n for n in self.nodes_all}
        if opts.nodes:
            unknown = [n for n in opts.nodes if n not in names]
            if unknown:
                raise ExportError(f"{path}: no node named {', '.join(unknown)} (nodes: "
                                  f"{', '.join(sorted(names))})")
            self.nodes = [names[n] for n in sorted(set(opts.nodes))]
        else:
            self.nodes = list(self.nodes_all)
        self.proc_rank = {}
        for node_id, pid, rank in con.execute(
                "SELECT node_id, pid, rank FROM processes WHERE rank IS NOT NULL "
                "ORDER BY node_id, pid, id"):
            self.proc_rank.setdefault((node_id, pid), rank)
        thread_comm = {}
        for node_id, tid, comm in con.execute(
                "SELECT node_id, tid, comm FROM threads WHERE comm IS NOT NULL "
                "ORDER BY node_id, tid, id"):
            thread_comm.setdefault((node_id, tid), comm)
        if opts.ranks is not None:
            keep = {nid for (nid, _), r in self.proc_rank.items() if r in opts.ranks}
            keep |= {n.node_id for n in self.nodes if set(n.ranks) & opts.ranks}
            self.nodes = [n for n in self.nodes if n.node_id in keep]
            self.pids = sorted((nid, pid) for (nid, pid), r in self.proc_rank.items()
                               if r in opts.ranks and nid in keep)
        self.tracks = Tracks(self.nodes_all, self.proc_rank, thread_comm)
        self.fleet_pid = len(self.nodes_all) + 1
        self.data_start = self._data_start()
        self.origin = self.data_start - self.data_start % _NS
        self.t_from = parse_time(opts.start, self.data_start) if opts.start else None
        self.t_to = parse_time(opts.end, self.data_start) if opts.end else None
        if self.t_from is not None and self.t_to is not None and self.t_to <= self.t_from:
            raise ExportError(f"--to ({iso_utc(self.t_to)}) is not after --from "
                              f"({iso_utc(self.t_from)})")
        self.stats = ExportStats(origin_ns=self.origin)
        self.only_node = None      # a node's worker: its rows only
        self._overflowed_nccl = {}
        self.analysis = None       # run_analysis(): while the workers work, if any
        self.accel = load_accel() if opts.accel else None
        self._spill_file = {}      # {"f": temporary file} once something spills
        self._cuda_instants = None
        self.stats.accelerated = self.accel is not None
        self._ranges = {}          # shared by the per-node copies: table -> ranges

    def node_id_ranges(self) -> dict:
        """{table: {node_id: (min id, max id)}} for the _RANGED_TABLES the export reads
        (None for a table with an index led by node_id: SQLite finds a node's rows).

        One scan of each table instead of one per node: a node's rows are all within
        its range, so the condition changes no result; merged tables hold each node's
        rows in one run of ids, so the range is about that node's rows alone.
        """
        if "done" in self._ranges:
            return self._ranges
        for table, kind in _RANGED_TABLES.items():
            if kind not in self.opts.kinds:
                continue
            led = False
            for _, index, _, _, partial in self.con.execute(f"PRAGMA index_list({table})"):
                cols = list(self.con.execute(f"PRAGMA index_info({index})"))
                led = led or (not partial and cols and cols[0][2] == "node_id")
            if led:
                self._ranges[table] = None
            elif self.accel is not None:
                self._ranges[table] = self._c(self.accel.id_ranges,
                                              f"SELECT node_id, id FROM {table}")
            else:
                self._ranges[table] = {nid: (lo, hi) for nid, lo, hi in self.con.execute(
                    f"SELECT node_id, min(id), max(id) FROM {table} GROUP BY node_id")}
        self._ranges["done"] = True
        return self._ranges

    def _id_range(self, table: str) -> str:
        ranges = self.node_id_ranges()[table]
        if ranges is None:
            return "1"
        r = ranges.get(self.only_node)
        if r is None or not all(type(x) is int for x in r):
            return "0" if r is None else "1"
        return f"id BETWEEN {r[0]} AND {r[1]}"

    def run_analysis(self) -> None:
        if self.opts.findings and self.analysis is None:
            # The same analysis as ingero-report (a separate read-only connection).
            from ..report.analyze import analyze_fleet
            try:
                self.analysis = analyze_fleet(self.path)
            except IngeroError as e:
                raise ExportError(f"{e} (ingero-report's analysis; --no-findings "
                                  "exports without it)") from None

    def _data_start(self) -> int:
        return data_start(self.con)

    # -- filters ------------------------------------------------------------------
    def where(self, alias: str = "", ts: str = "timestamp_ns", per_process: bool = True,
              node_col: str = "node_id", table: str | None = None) -> str:
        """SQL conditions for the selected nodes, ranks and time range (params :t_from, :t_to).

        ``table``: a table without an index led by node_id (_RANGED_TABLES); one node's
        rows are then also bounded by their rowid range, so SQLite reads only that range
        instead of the whole table once per node.
        """
        a = f"{alias}." if alias else ""
        conds = []
        if self.only_node is not None:
            conds.append(f"{a}{node_col} = {self.only_node}")
            if table is not None:
                conds.append(self._id_range(table))
        elif len(self.nodes) != len(self.nodes_all):
            conds.append(f"{a}{node_col} IN ({', '.join(str(n.node_id) for n in self.nodes) or 'NULL'})")
        if self.opts.ranks is not None and per_process:
            pairs = " OR ".join(f"({a}node_id = {nid} AND {a}pid = {pid})"
                                for nid, pid in self.pids) or "0"
            conds.append(f"({pairs})")
        if self.t_from is not None:
            conds.append(f"{a}{ts} >= :t_from")
        if self.t_to is not None:
            conds.append(f"{a}{ts} < :t_to")
        return " AND ".join(conds) or "1"

    @property
    def params(self):
        return {"origin": self.origin, "t_from": self.t_from, "t_to": self.t_to}

    def count(self, kind: str, n: int = 1) -> None:
        self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + n

    # -- slice streams ------------------------------------------------------------
    def _slices(self, sink: _Sink, sql: str, kind: str, resolve, overflowed=None,
                fast=None) -> None:
        """Rows (node_id, k1, k2, start, end, body): body is JSON after pid/tid.

        resolve(node_id, k1, k2) -> (chrome pid, base tid) of the track. Slices placed on
        an overflow lane are recorded in ``overflowed`` when given. With the accelerator,
        ``fast`` (raw-column SQL, layouts) goes to the C loop instead (_events); the loop
        below is the reference.
        """
        if self.accel is not None:
            n = self._events(sink, "X", fast[0], fast[1], resolve, overflowed, *fast[2:])
            self.stats.slices += n
            self.count(kind, n)
            return
        cur_key = (None, None, None)
        lanes = None        # lane stacks, only while something overlaps
        max_end = 0         # latest end on the track so far
        pid = base = 0
        pre = ""
        n = 0
        rows = self.con.execute(sql, self.params)
        # Hot loop (one iteration per slice): locals only, the chunk size bounds the loop
        # so no length check per row.
        while True:
            buf = []
            append = buf.append
            for node_id, k1, k2, start, end, body in islice(rows, _CHUNK_EVENTS):
                if k2 != cur_key[2] or k1 != cur_key[1] or node_id != cur_key[0]:
                    cur_key, lanes, max_end = (node_id, k1, k2), None, start
                    pid, base = resolve(node_id, k1, k2)
                    pre = f'{{"ph":"X","pid":{pid},"tid":{base},'
                if start >= max_end:
                    # Fast path: everything earlier has ended, lane 0 is free.
                    lanes, max_end = None, end
                    append(pre + body)
                    continue
                if lanes is None:
                    lanes = [[max_end]]     # only the last fast-path slice is open
                lane = _place(lanes, start, end)
                if end > max_end:
                    max_end = end
                if lane == 0:
                    append(pre + body)
                else:
                    tid = self.tracks.lane(pid, base, lane)
                    if overflowed is not None:
                        overflowed[cur_key + (start, end)] = tid
                    append(f'{{"ph":"X","pid":{pid},"tid":{tid},{body}')
            if not buf:
                break
            sink.extend(buf)
            n += len(buf)
        self.stats.slices += n
        self.count(kind, n)

    def _events(self, sink: _Sink, ph: str, sql: str, layouts: tuple, resolve,
                overflowed=None, sql2: str | None = None) -> int:
        """The C loop (_fastslices.events) over raw-column rows ``(k0, k1, k2, start, end,
        ts, dur, name, layout, args...)``: the text the SQL of the Python path builds,
        built in C. layouts: ((cat, arg keys, kinds, first arg column), ...), picked by the
        layout column; kinds 'q' json_quote, 'b' integer as true/false. ``sql2``: a second
        stream of the same columns and order, merged in (at equal keys and start, after
        the first's rows)."""
        sink.flush()
        return self._c(self.accel.events, sql, sink.extend_joined, sink.first, ph,
                       self.origin, layouts, resolve, self.tracks.lane, overflowed, None,
                       sql2)

    def _c(self, fn, sql: str, *args):
        """A C loop over ``sql`` on this exporter's connection; its errors as the Python
        path's would be (SQLite's become ExportError, like apsw.Error)."""
        try:
            return fn(self.con.sqlite3_pointer(), sql, self.params, *args)
        except self.accel.Unsupported as e:
            raise _AccelUnsupported(str(e)) from None
        except RuntimeError as e:      # SQLite's error, as apsw would raise it
            raise ExportError(f"{self.path}: cannot read fleet.db ({e})") from None

    def cuda(self, sink: _Sink) -> None:
        """CUDA calls on their thread's own track (tid = OS tid).

        The hottest section (most events): one node at a time, so SQLite writes the whole
        line, pid and tid included, and Python only handles track changes and overlaps.
        """
        node_id = self.only_node
        cp = self.tracks.by_node[node_id].pid
        head = (f"""printf('{{"ph":"X","pid":{cp},"tid":%d,"ts":%.3f,"dur":%.3f,"name":%s,"""
                f""""cat":"cuda","args":', tid, (timestamp_ns - :origin) / 1000.0, """
                "duration_ns / 1000.0, json_quote(api))")
        line = (f"""{head} ||
                 {_args("'layer'", 'layer', "'stream'", 'stream', "'bytes'", 'bytes',
                        "'memcpy_kind'", 'memcpy_kind', "'kernel'", 'kernel',
                        "'device'", 'device', "'return_code'", 'return_code')} || '}}'""")
        sql = (f"SELECT pid, tid, timestamp_ns, timestamp_ns + duration_ns, {line} "
               f"FROM cuda_events WHERE duration_ns IS NOT NULL AND {self.where()} "
               "ORDER BY node_id, pid, tid, timestamp_ns")
        tracks = self.tracks
        if self.accel is not None:
            # One pass over the node's calls: the entry-only ones (instants, a later
            # section) go to a spill file, replayed by cuda_instants. The id tiebreak is
            # the index's own order, which both Python queries get.
            raw = ("SELECT node_id, pid, tid, timestamp_ns, timestamp_ns + duration_ns, "
                   "timestamp_ns, duration_ns, api, duration_ns IS NULL, layer, stream, "
                   "bytes, memcpy_kind, kernel, device, return_code FROM cuda_events "
                   f"WHERE {self.where()} ORDER BY node_id, pid, tid, timestamp_ns, id")
            spill = _Spill(self._spill_file)
            sink.flush()
            n = self._c(self.accel.events, raw, sink.extend_joined, sink.first, "X",
                        self.origin, (("cuda", _CUDA_ARGS, "q" * 7, 9),
                                      ("cuda", ("layer", "stream"), "qq", 9)),
                        tracks.thread, tracks.lane, None, spill.write)
            self._cuda_instants = spill
            self.stats.slices += n
            self.count("cuda", n)
            return
        cur_pid = cur_tid = None
        lanes = None        # lane stacks, only while something overlaps
        max_end = 0         # latest end on the track so far
        skip = 0            # length of the lane-0 prefix '{"ph":"X","pid":…,"tid":…,'
        n = 0
        rows = self.con.execute(sql, self.params)
        while True:
            buf = []
            append = buf.append
            for pid, tid, start, end, text in islice(rows, _CHUNK_EVENTS):
                if tid != cur_tid or pid != cur_pid:
                    cur_pid, cur_tid, lanes, max_end = pid, tid, None, start
                    tracks.thread(node_id, pid, tid)
                    skip = len(f'{{"ph":"X","pid":{cp},"tid":{tid},')
                if start >= max_end:
                    # Fast path: everything earlier has ended, lane 0 is free.
                    lanes = None
                    max_end = end
                    append(text)
                    continue
                if lanes is None:
                    lanes = [[max_end]]     # only the last fast-path slice is open
                lane = _place(lanes, start, end)
                if end > max_end:
                    max_end = end
                if lane == 0:
                    append(text)
                else:
                    lt = tracks.lane(cp, tid, lane)
                    append(f'{{"ph":"X","pid":{cp},"tid":{lt},' + text[skip:])
            if not buf:
                break
            sink.extend(buf)
            n += len(buf)
        self.stats.slices += n
        self.count("cuda", n)

    def cuda_instants(self, sink: _Sink) -> None:
        # Entry-only probes (no duration) are instants on the thread's track.
        sql = (f"SELECT node_id, pid, tid, '\"ts\":' || {_ts('timestamp_ns')} || "
               "',\"s\":\"t\",\"name\":' || json_quote(api) || ',\"cat\":\"cuda\",\"args\":' || "
               f"{_args(chr(39) + 'layer' + chr(39), 'layer', chr(39) + 'stream' + chr(39), 'stream')} || '}}' "
               f"FROM cuda_events WHERE duration_ns IS NULL AND {self.where()} "
               "ORDER BY node_id, pid, tid, timestamp_ns, id")
        if self._cuda_instants is not None:      # written by the accelerated cuda()
            n = self._cuda_instants.replay(sink)
            self._cuda_instants = None
            self.stats.instants += n
            self.count("cuda", n)
            return
        n = 0
        for node_id, pid, tid, body in self.con.execute(sql, self.params):
            cp, ct = self.tracks.thread(node_id, pid, tid)
            sink.add(f'{{"ph":"i","pid":{cp},"tid":{ct},{body}')
            n += 1
        self.stats.instants += n
        self.count("cuda", n)

    def nccl(self, sink: _Sink) -> None:
        coll = (f"""{_head('nccl', 'e.timestamp_ns', 'e.duration_ns', 'e.op')} ||
                 {_args("'op'", 'e.op', "'bytes'", 'e.bytes', "'comm'", 'e.comm_id_hash',
                        "'seq'", 'e.seq', "'rank'", 'e.rank', "'nranks'", 'e.nranks',
                        "'count'", 'e.count', "'datatype'", 'e.datatype', "'redop'", 'e.redop',
                        "'peer'", 'e.peer', "'stream'", 'e.stream',
                        "'group_depth'", 'e.group_depth', "'return_code'", 'e.return_code',
                        "'call_duration_ns'", 'e.call_duration_ns',
                        "'completion_utc_ns'", 'e.completion_ns',
                        "'late_ns'", 'e.timestamp_ns - c.first_entry_ns',
                        "'wait_ns'", 'max(0, c.last_entry_ns - e.timestamp_ns)',
                        "'entry_spread_ns'", 'c.entry_spread_ns',
                        "'ranks_seen'", 'c.ranks_seen',
                        "'last_to_arrive'",
                        "CASE WHEN c.collective_id IS NULL THEN NULL WHEN c.last_node_id = "
                        "e.node_id AND c.last_rank IS e.rank THEN json('true') ELSE "
                        "json('false') END")} || '}}'""")
        comm = (f"""{_head('nccl', 'timestamp_ns', 'duration_ns', 'api')} ||
                 {_args("'api'", 'api', "'comm'", 'comm_id_hash', "'parent'", 'parent_hash',
                        "'split_color'", 'split_color', "'split_key'", 'split_key',
                        "'rank'", 'rank', "'nranks'", 'nranks',
                        "'return_code'", 'return_code')} || '}}'""")
        sql = (f"SELECT node_id, pid, tid, ts, te, body FROM ("
               f"SELECT e.node_id, e.pid, e.tid, e.timestamp_ns AS ts, "
               f"e.timestamp_ns + e.duration_ns AS te, 0 AS src, e.id, {coll} AS body "
               f"FROM nccl_events e LEFT JOIN collectives c "
               f"ON c.comm_id_hash = e.comm_id_hash AND c.seq = e.seq WHERE {self.where('e')} "
               f"UNION ALL SELECT node_id, pid, tid, timestamp_ns, timestamp_ns + duration_ns, "
               f"1, id, {comm} FROM nccl_comm_events WHERE {self.where()}) "
               "ORDER BY node_id, pid, tid, ts, src, id")
        fast = None
        if self.accel is not None:
            coll_args = ("e.op, e.bytes, e.comm_id_hash, e.seq, e.rank, e.nranks, e.count, "
                         "e.datatype, e.redop, e.peer, e.stream, e.group_depth, "
                         "e.return_code, e.call_duration_ns, e.completion_ns, "
                         "e.timestamp_ns - c.first_entry_ns, "
                         "max(0, c.last_entry_ns - e.timestamp_ns), c.entry_spread_ns, "
                         "c.ranks_seen, CASE WHEN c.collective_id IS NULL THEN NULL WHEN "
                         "c.last_node_id = e.node_id AND c.last_rank IS e.rank THEN 1 "
                         "ELSE 0 END")
            # Two statements merged by the C loop (the UNION ALL above has SQLite sort
            # every wide row): the collectives in the index's (node, pid, tid, ts, id)
            # order, the communicator events (few) sorted the same way; at equal
            # (node, pid, tid, ts) the collective first, as src orders them above.
            outer = "SELECT node_id, pid, tid, ts, te, ts, dur, name, src, * FROM ("
            order = ") ORDER BY node_id, pid, tid, ts, id"
            raw = (f"{outer}SELECT e.node_id, e.pid, e.tid, e.timestamp_ns AS ts, "
                   f"e.timestamp_ns + e.duration_ns AS te, e.duration_ns AS dur, "
                   f"e.op AS name, 0 AS src, e.id, {coll_args}, {', '.join(['NULL'] * 8)} "
                   f"FROM nccl_events e LEFT JOIN collectives c "
                   f"ON c.comm_id_hash = e.comm_id_hash AND c.seq = e.seq "
                   f"WHERE {self.where('e')}{order}")
            raw_comm = (f"{outer}SELECT node_id, pid, tid, timestamp_ns AS ts, "
                        f"timestamp_ns + duration_ns AS te, duration_ns AS dur, api AS name, "
                        f"1 AS src, id, {', '.join(['NULL'] * 20)}, api, comm_id_hash, "
                        f"parent_hash, split_color, split_key, rank, nranks, return_code "
                        f"FROM nccl_comm_events WHERE {self.where()}{order}")
            # '*' puts the subquery's 9 leading columns again at 9..17: args from 18
            fast = (raw, (("nccl", _NCCL_ARGS, "q" * 19 + "b", 18),
                          ("nccl", _NCCL_COMM_ARGS, "q" * 8, 38)), raw_comm)
        self._slices(sink, sql, "nccl",
                     lambda nid, pid, tid: self.tracks.family(nid, pid, tid, "nccl", 1),
                     self._overflowed_nccl, fast)

    def flows(self, sink: _Sink) -> None:
        """Arrows chaining each collective's slices in arrival order across its ranks."""
        sql = (f"SELECT e.comm_id_hash, e.seq, e.node_id, e.pid, e.tid, "
               f"{_ts('e.timestamp_ns')}, e.timestamp_ns, e.duration_ns "
               f"FROM nccl_events e WHERE e.comm_id_hash IS NOT NULL AND e.seq IS NOT NULL "
               f"AND {self.where('e')} ORDER BY e.comm_id_hash, e.seq, e.timestamp_ns, "
               "e.node_id, e.rank, e.id")
        # The slice's track: lane 0 of its thread's nccl track, unless it overflowed, in
        # which case it sits on a lane track; rerun the placement to find which.
        lane_of = self._overflowed_nccl
        family = {}         # (node_id, pid, tid) -> (cp, tid): the first call allocates

        def track(node_id, pid, tid):
            t = family.get((node_id, pid, tid))
            if t is None:
                t = family[(node_id, pid, tid)] = self.tracks.family(node_id, pid, tid,
                                                                     "nccl", 1)
            return t
        if self.accel is not None:
            raw = ("SELECT e.comm_id_hash, e.seq, e.node_id, e.pid, e.tid, e.timestamp_ns, "
                   "e.duration_ns FROM nccl_events e WHERE e.comm_id_hash IS NOT NULL AND "
                   f"e.seq IS NOT NULL AND {self.where('e')} ORDER BY e.comm_id_hash, e.seq, "
                   "e.timestamp_ns, e.node_id, e.rank, e.id")
            sink.flush()
            flow_id = self._c(self.accel.flows, raw, sink.extend_joined, sink.first,
                              self.origin, track, lane_of)
            self.stats.flows += flow_id
            self.count("nccl", 2 * flow_id)
            return
        prev = None
        key_prev = None
        flow_id = 0
        add = sink.add
        for comm, seq, node_id, pid, tid, ts, ts_ns, dur in self.con.execute(sql, self.params):
            cp, ct = track(node_id, pid, tid)
            if lane_of:
                ct = lane_of.get((node_id, pid, tid, ts_ns, ts_ns + dur), ct)
            if key_prev == (comm, seq):
                flow_id += 1
                add(f'{{"ph":"s","id":{flow_id},"pid":{prev[0]},"tid":{prev[1]},'
                    f'"ts":{prev[2]},"name":"collective","cat":"nccl"}}')
                add(f'{{"ph":"f","bp":"e","id":{flow_id},"pid":{cp},"tid":{ct},'
                    f'"ts":{ts},"name":"collective","cat":"nccl"}}')
            key_prev, prev = (comm, seq), (cp, ct, ts)
        self.stats.flows += flow_id
        self.count("nccl", 2 * flow_id)

    def sched(self, sink: _Sink) -> None:
        body = (f"""{_head('sched', 'timestamp_ns', 'duration_ns', "kind || CASE WHEN prev_state IS NOT NULL THEN ' (' || prev_state || ')' ELSE '' END")} ||
                 {_args("'kind'", 'kind', "'cpu'", 'cpu', "'prev_state'", 'prev_state',
                        "'other_pid'", 'other_pid', "'other_tid'", 'other_tid',
                        "'other_comm'", 'other_comm')} || '}}'""")
        sql = (f"SELECT node_id, pid, tid, timestamp_ns, timestamp_ns + duration_ns, {body} "
               f"FROM sched_events WHERE {self.where()} ORDER BY node_id, pid, tid, "
               "timestamp_ns, id")
        fast = None
        if self.accel is not None:
            fast = ("SELECT node_id, pid, tid, timestamp_ns, timestamp_ns + duration_ns, "
                    "timestamp_ns, duration_ns, kind || CASE WHEN prev_state IS NOT NULL "
                    "THEN ' (' || prev_state || ')' ELSE '' END, 0, kind, cpu, prev_state, "
                    f"other_pid, other_tid, other_comm FROM sched_events WHERE {self.where()} "
                    "ORDER BY node_id, pid, tid, timestamp_ns, id",
                    (("sched", ("kind", "cpu", "prev_state", "other_pid", "other_tid",
                                "other_comm"), "q" * 6, 9),))
        self._slices(sink, sql, "sched",
                     lambda nid, pid, tid: self.tracks.family(nid, pid, tid, "sched", 8),
                     fast=fast)

    def block(self, sink: _Sink) -> None:
        body = (f"""{_head('block', 'timestamp_ns', 'duration_ns', 'op')} ||
                 {_args("'device'", 'device', "'bytes'", 'bytes', "'sector'", 'sector',
                        "'rwbs'", 'rwbs', "'pid'", 'pid', "'tid'", 'tid', "'comm'", 'comm',
                        "'error'", 'error')} || '}}'""")
        sql = (f"SELECT node_id, device, NULL, timestamp_ns, timestamp_ns + duration_ns, {body} "
               f"FROM block_events WHERE {self.where(per_process=False, table='block_events')} "
               "ORDER BY node_id, device, timestamp_ns, id")

        def resolve(nid, device, _):
            cp = self.tracks.by_node[nid].pid
            return cp, self.tracks.synthetic(cp, ("block", device), 3_000_000_000,
                                             f"block I/O · {device}")
        fast = None
        if self.accel is not None:
            fast = ("SELECT node_id, device, NULL, timestamp_ns, timestamp_ns + duration_ns, "
                    "timestamp_ns, duration_ns, op, 0, device, bytes, sector, rwbs, pid, tid, "
                    "comm, error FROM block_events WHERE "
                    f"{self.where(per_process=False, table='block_events')} "
                    "ORDER BY node_id, device, timestamp_ns, id",
                    (("block", ("device", "bytes", "sector", "rwbs", "pid", "tid", "comm",
                                "error"), "q" * 8, 9),))
        self._slices(sink, sql, "block", resolve, fast=fast)

    def tcp(self, sink: _Sink) -> None:
        body = (f"""{_head('tcp', 'timestamp_ns', None, "CASE event WHEN 'tcp_retransmit_skb' THEN 'retransmit' ELSE event END || ' ' || saddr || ':' || sport || ' > ' || daddr || ':' || dport")} ||
                 {_args("'event'", 'event', "'saddr'", 'saddr', "'sport'", 'sport',
                        "'daddr'", 'daddr', "'dport'", 'dport', "'state'", 'state',
                        "'scope'", 'scope', "'owner_pid'", 'owner_pid',
                        "'srtt_us'", 'srtt_us', "'snd_cwnd'", 'snd_cwnd')} || '}}'""")
        sql = (f"SELECT node_id, scope, {body} FROM tcp_events "
               f"WHERE {self.where(per_process=False, table='tcp_events')} "
               "ORDER BY node_id, timestamp_ns, id")
        if self.accel is not None:
            def resolve(nid, scope, _):
                cp = self.tracks.by_node[nid].pid
                return cp, self.tracks.synthetic(cp, ("tcp", scope), 2_000_000_000
                                                 + (scope != "job"), f"TCP · {scope} connections")
            raw = ("SELECT node_id, scope, NULL, NULL, NULL, timestamp_ns, NULL, CASE event "
                   "WHEN 'tcp_retransmit_skb' THEN 'retransmit' ELSE event END || ' ' || "
                   "saddr || ':' || sport || ' > ' || daddr || ':' || dport, 0, event, saddr, "
                   "sport, daddr, dport, state, scope, owner_pid, srtt_us, snd_cwnd "
                   f"FROM tcp_events WHERE {self.where(per_process=False, table='tcp_events')} "
                   "ORDER BY node_id, timestamp_ns, id")
            n = self._events(sink, "i", raw, (("tcp", ("event", "saddr", "sport", "daddr",
                                                        "dport", "state", "scope", "owner_pid",
                                                        "srtt_us", "snd_cwnd"), "q" * 10, 9),),
                             resolve)
            self.stats.instants += n
            self.count("tcp", n)
            return
        n = 0
        for node_id, scope, body in self.con.execute(sql, self.params):
            cp = self.tracks.by_node[node_id].pid
            ct = self.tracks.synthetic(cp, ("tcp", scope), 2_000_000_000 + (scope != "job"),
                                       f"TCP · {scope} connections")
            sink.add(f'{{"ph":"i","pid":{cp},"tid":{ct},{body}')
            n += 1
        self.stats.instants += n
        self.count("tcp", n)

    def host(self, sink: _Sink) -> None:
        sql = (f"SELECT node_id, '{{\"ph\":\"C\",\"tid\":0,\"ts\":' || {_ts('timestamp_ns')} || "
               "',\"name\":' || json_quote(metric || CASE WHEN device IS NOT NULL THEN ' ' || "
               "device ELSE '' END) || ',\"cat\":\"host\",\"args\":{\"value\":' || "
               "CASE WHEN value = value THEN printf('%!.15g', value) ELSE 'null' END || '}}' "
               f"FROM host_samples WHERE {self.where(per_process=False, table='host_samples')} "
               "AND value IS NOT NULL AND abs(value) < 1e300 "
               "ORDER BY node_id, metric, device, timestamp_ns, id")
        n = 0
        pid_of = {n_.node_id: n_.pid for n_ in self.nodes_all}
        if self.accel is not None and self.only_node is not None:
            raw = ("SELECT timestamp_ns, metric || CASE WHEN device IS NOT NULL THEN ' ' || "
                   "device ELSE '' END, CASE WHEN value = value THEN printf('%!.15g', value) "
                   "ELSE 'null' END FROM host_samples "
                   f"WHERE {self.where(per_process=False, table='host_samples')} "
                   "AND value IS NOT NULL AND abs(value) < 1e300 "
                   "ORDER BY node_id, metric, device, timestamp_ns, id")
            sink.flush()
            n = self._c(self.accel.counters, raw, sink.extend_joined, sink.first, self.origin,
                        f'{{"pid":{pid_of[self.only_node]},"ph":"C","tid":0,')
        else:
            for node_id, body in self.con.execute(sql, self.params):
                sink.add(f'{{"pid":{pid_of[node_id]},{body[1:]}')
                n += 1
        self.stats.counters += n
        self.count("host", n)

    def stats_rates(self, sink: _Sink) -> None:
        """event_stats as per-node rate counters: calls/s of each API or span kind."""
        groups = self.stats_sql(self.opts.kinds)
        if groups is None:
            return
        # sampled launch counts (event_stats.observed_ns, fleet.db 5): a rate over the
        # time they counted; an interval not counted at all gives no sample
        span = "interval_end_ns - interval_start_ns"
        having = ""
        if "observed_ns" in {r[1] for r in self.con.execute("PRAGMA table_info(event_stats)")}:
            span = f"COALESCE(MAX(observed_ns), {span})"
            having = " HAVING COALESCE(MAX(observed_ns), 1) > 0"
        sql = (f"SELECT node_id, source, '\"ts\":' || {_ts('interval_start_ns')} || "
               "',\"name\":' || json_quote(source || ' ' || name || ' calls/s') || "
               "',\"cat\":\"' || source || '\",\"args\":{\"value\":' || "
               f"printf('%!.15g', SUM(count) * 1e9 / max(1, {span})) "
               "|| '}}' "
               f"{groups}{having} ORDER BY node_id, source, name, interval_start_ns, "
               "interval_end_ns")
        pid_of = {n_.node_id: n_.pid for n_ in self.nodes_all}
        for node_id, source, body in self.con.execute(sql, self.params):
            sink.add(f'{{"ph":"C","pid":{pid_of[node_id]},"tid":0,{body}')
            self.stats.counters += 1
            self.count(_STAT_KIND[source], 1)

    def window_conds(self) -> list[str]:
        conds = ["entry_spread_ns > 0"]
        if len(self.nodes) != len(self.nodes_all):
            conds.append(f"last_node_id IN ({', '.join(str(n.node_id) for n in self.nodes)})")
        if self.opts.ranks is not None:
            conds.append(f"last_rank IN ({', '.join(map(str, sorted(self.opts.ranks)))})")
        if self.t_from is not None:
            conds.append("first_entry_ns >= :t_from")
        if self.t_to is not None:
            conds.append("first_entry_ns < :t_to")
        return conds

    def stats_sql(self, kinds) -> str | None:
        sources = [s for s, k in _STAT_KIND.items() if k in kinds]
        if not sources:
            return None
        src = ", ".join(f"'{s}'" for s in sources)
        return (f"FROM event_stats WHERE source IN ({src}) AND "
                f"{self.where(ts='interval_start_ns', per_process=False)} "
                "GROUP BY node_id, source, name, interval_start_ns, interval_end_ns")

    def windows(self, sink: _Sink) -> None:
        """What fleet.db proves about stragglers: per collective, first to last entry."""
        conds = self.window_conds()
        # The last node's name (its id when fleet.db has no such node) as the last arg.
        last_node = ("CASE WHEN n.node_id IS NULL THEN CAST(c.last_node_id AS TEXT) "
                     "ELSE n.name END")
        name = ("c.op || ' #' || c.seq || ': waiting for ' || CASE WHEN c.last_rank IS NULL "
                "THEN 'node' ELSE 'rank ' || c.last_rank END")
        args = ("'comm'", 'c.comm_id_hash', "'seq'", 'c.seq', "'op'", 'c.op',
                "'bytes'", 'c.bytes', "'last_rank'", 'c.last_rank',
                "'last_node_id'", 'c.last_node_id', "'entry_spread_ns'", 'c.entry_spread_ns',
                "'ranks_seen'", 'c.ranks_seen', "'nranks'", 'c.nranks',
                "'completion_utc_ns'", 'c.completion_ns', "'op_mismatch'", 'c.op_mismatch',
                "'last_node'", last_node)
        body = (f"""{_head('straggler', 'c.first_entry_ns', 'c.entry_spread_ns', name)} ||
                 {_args(*args)} || '}}'""")
        where = " AND ".join(f"c.{x}" for x in conds)
        fp = self.fleet_pid

        def resolve(_, comm, __):
            return fp, self.tracks.synthetic(fp, ("comm", comm), 0,
                                             f"communicator {comm} · waits for the last rank")
        fast = None
        if self.accel is not None:
            fast = (f"SELECT 0, c.comm_id_hash, NULL, c.first_entry_ns, c.last_entry_ns, "
                    f"c.first_entry_ns, c.entry_spread_ns, {name}, 0, {', '.join(args[1::2])} "
                    f"FROM collectives c LEFT JOIN nodes n ON n.node_id = c.last_node_id "
                    f"WHERE {where} ORDER BY c.comm_id_hash, c.first_entry_ns, c.seq",
                    (("straggler", tuple(k.strip("'") for k in args[::2]), "q" * 12, 9),))
        sql = (f"SELECT 0, c.comm_id_hash, NULL, c.first_entry_ns, c.last_entry_ns, {body} "
               f"FROM collectives c LEFT JOIN nodes n ON n.node_id = c.last_node_id "
               f"WHERE {where} ORDER BY c.comm_id_hash, c.first_entry_ns, c.seq")
        self._slices(sink, sql, "nccl", resolve, fast=fast)

    def finding_windows(self) -> list:
        """The report's windows to mark: on an exported straggler node, overlapping the
        --from/--to range (a window is long; one that starts before --from still matters)."""
        a = self.analysis
        if a is None or a.straggler_node_id is None:
            return []
        if a.straggler_node_id not in {n.node_id for n in self.nodes}:
            return []
        return [w for w in a.windows
                if (self.t_to is None or w.start_ns < self.t_to)
                and (self.t_from is None or w.end_ns > self.t_from)]

    def findings(self, sink: _Sink) -> None:
        """ingero-report's straggler windows as slices on the straggler node's process."""
        from ..report.analyze import CAUSE_TITLES
        a = self.analysis
        windows = self.finding_windows()
        if not windows:
            return
        cp = self.tracks.by_node[a.straggler_node_id].pid
        tid = self.tracks.synthetic(cp, ("findings",), -1, "ingero-report findings")
        cause = CAUSE_TITLES.get(a.cause, a.cause) if a.cause else "cause not determined"
        if a.cause and a.cause_confidence == "weak":
            cause += " (weak evidence)"
        for w in windows:
            rest = orjson.dumps({
                "name": f"straggler window: {cause}", "cat": "finding",
                "args": {"straggler": a.straggler, "late_ranks": a.late_ranks,
                         "lateness_ms": w.lateness_ms, "cause": a.cause,
                         "cause_confidence": a.cause_confidence,
                         "start_utc": iso_utc(w.start_ns), "end_utc": iso_utc(w.end_ns),
                         "verdict": a.verdict}}).decode()
            # ts/dur formatted as SQLite's printf('%.3f') formats every other event
            sink.add(f'{{"ph":"X","pid":{cp},"tid":{tid},'
                     f'"ts":{(w.start_ns - self.origin) / 1000.0:.3f},'
                     f'"dur":{(w.end_ns - w.start_ns) / 1000.0:.3f},{rest[1:]}')
        self.stats.slices += len(windows)
        self.count("findings", len(windows))

    def findings_metadata(self):
        a = self.analysis
        if a is None:
            return None
        return {"by": "ingero-report analysis (ingero_forensics.report.analyze_fleet)",
                "straggler": a.straggler, "straggler_node_id": a.straggler_node_id,
                "straggler_pid": (self.tracks.by_node[a.straggler_node_id].pid
                                  if a.straggler_node_id is not None else None),
                "straggler_ranks": a.straggler_ranks, "late_ranks": a.late_ranks,
                "cause": a.cause, "cause_confidence": a.cause_confidence,
                "verdict": a.verdict,
                "windows": [{"start_utc_ns": w.start_ns, "end_utc_ns": w.end_ns,
                             "start_utc": iso_utc(w.start_ns), "end_utc": iso_utc(w.end_ns),
                             "lateness_ms": w.lateness_ms} for w in a.windows],
                "marked_windows": len(self.finding_windows())}

    # -- metadata -----------------------------------------------------------------
    def metadata_events(self, sink: _Sink) -> None:
        used_pids = {p for p, _ in self.tracks.names}
        for node in self.nodes_all:
            if node.pid not in used_pids and node not in self.nodes:
                continue
            for line in (
                {"ph": "M", "pid": node.pid, "tid": 0, "name": "process_name",
                 "args": {"name": f"{node.name} ({_ranges(node.ranks)})"}},
                {"ph": "M", "pid": node.pid, "tid": 0, "name": "process_sort_index",
                 "args": {"sort_index": node.pid}}):
                sink.add(orjson.dumps(line).decode(), counted=False)
                self.stats.metadata_events += 1
        if self.fleet_pid in used_pids:
            for line in (
                {"ph": "M", "pid": self.fleet_pid, "tid": 0, "name": "process_name",
                 "args": {"name": "fleet · collective waits"}},
                {"ph": "M", "pid": self.fleet_pid, "tid": 0, "name": "process_sort_index",
                 "args": {"sort_index": 0}}):
                sink.add(orjson.dumps(line).decode(), counted=False)
                self.stats.metadata_events += 1
        for (pid, tid), (sort, name) in sorted(self.tracks.names.items()):
            for line in (
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                 "args": {"name": name}},
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                 "args": {"sort_index": sort}}):
                sink.add(orjson.dumps(line).decode(), counted=False)
                self.stats.metadata_events += 1

    def metadata(self) -> dict:
        align = {}
        for row in self.con.execute(
                "SELECT node_id, method, offset_ns, drift_ppm, uncertainty_ns, "
                "relative_uncertainty_ns, residual_ns FROM clock_alignment ORDER BY node_id"):
            align[row[0]] = dict(zip(("method", "offset_ns", "drift_ppm", "uncertainty_ns",
                                      "relative_uncertainty_ns", "residual_ns"), row[1:]))
        nodes = []
        for n in self.nodes_all:
            nodes.append({"name": n.name, "pid": n.pid, "ranks": n.ranks,
                          "exported": n in self.nodes,
                          "clock_alignment": align.get(n.node_id)})
        info = {k: _json_or_text(v) for k, v in self.con.execute(
            "SELECT key, value FROM fleet_info WHERE key IN ('format_version', 'created_by', "
            "'created_utc', 'updated_utc') ORDER BY key")}
        s = self.stats
        return {
            "tool": f"ingero-export {__version__}",
            "source": os.path.basename(self.path),
            "fleet_info": info,
            "clock": "aligned fleet UTC; ts = microseconds since origin",
            "origin_utc_ns": self.origin,
            "origin_utc": iso_utc(self.origin),
            "data_start_utc": iso_utc(self.data_start),
            "from_utc": iso_utc(self.t_from) if self.t_from is not None else None,
            "to_utc": iso_utc(self.t_to) if self.t_to is not None else None,
            "kinds": sorted(self.opts.kinds),
            "nodes": nodes,
            "findings": self.findings_metadata(),
            "counts": {"events": s.events, "slices": s.slices, "instants": s.instants,
                       "counters": s.counters, "flows": s.flows,
                       "overflow_tracks": s.overflow_tracks, "by_kind": s.by_kind},
        }

    # -- all ----------------------------------------------------------------------
    def node_sections(self) -> list[str]:
        """The sections that depend on one node's rows, in output order."""
        k = self.opts.kinds
        out = [name for name, kind in (("nccl", "nccl"), ("cuda", "cuda"),
                                       ("cuda_instants", "cuda"), ("sched", "sched"),
                                       ("block", "block"), ("tcp", "tcp"), ("host", "host"))
               if kind in k]
        return out + (["stats_rates"] if self.stats_sql(k) is not None else [])

    def _node_exporter(self, node_id: int, con=None) -> "_Exporter":
        sub = copy.copy(self)
        sub.con = con if con is not None else self.con
        sub.only_node = node_id
        sub.tracks = Tracks(self.nodes_all, self.proc_rank, self.tracks.thread_comm)
        sub.stats = ExportStats(origin_ns=self.origin, accelerated=self.accel is not None)
        sub._cuda_instants = None
        sub._overflowed_nccl = {}
        return sub

    def _result(self) -> "_NodeResult":
        t = self.tracks
        return _NodeResult(self.only_node, self.stats, t.names, t._synthetic, t._next,
                           t.overflow, self._overflowed_nccl)

    def _run_direct(self, out, gzip_level: int | None, node_ids: list[int]) -> ExportStats:
        """--jobs 1: the same sections in the same order and fragments as the part files
        would hold, written straight to ``out`` (no temporary files, no copy)."""
        w = _Assembler(out, gzip_level)
        w.raw(b'{"traceEvents":[\n')
        inline = _InlineSections(w, self.opts.max_events)
        self.run_analysis()
        subs = [self._node_exporter(nid) for nid in node_ids]
        for name in self.node_sections():
            for sub in subs:
                inline.section(getattr(sub, name))
            if name == "nccl":
                for sub in subs:       # the flows need every node's nccl tracks
                    self._merge_tracks(sub._result())
                inline.section(self.flows)
                inline.section(self.windows)
        for sub in subs:
            self._merge(sub._result())
        inline.section(self.findings)
        self.stats.events = inline.sink.events
        self.stats.overflow_tracks = self.tracks.overflow
        inline.sink.max_events = None      # M events are not counted
        inline.section(self.metadata_events)
        _Spill.close(self._spill_file)
        w.raw(b'\n],\n"displayTimeUnit":"ns",\n"metadata":'
              + orjson.dumps(self.metadata(), option=orjson.OPT_SORT_KEYS) + b"}\n")
        w.finish()
        self.stats.bytes = w.bytes
        return self.stats

    def run(self, out, *, gzip_level: int | None, jobs: int, tmp_parent: str | None,
            tmp_prefix: str) -> ExportStats:
        """Write the trace to ``out`` (binary; raw gzip bytes when gzip_level is set).

        With jobs > 1, per-node sections go to part files in a temporary directory (in
        ``tmp_parent``; the system's when None) written by worker processes; this process
        writes the global sections (flows, collective windows, findings, metadata) and
        concatenates everything in a fixed order. With jobs 1 the same sections go
        straight to ``out`` in the same order. The bytes do not depend on ``jobs``.
        """
        if self.opts.max_events is not None:
            self.run_analysis()            # its windows count toward the estimate
            est = self.estimate()
            if est > self.opts.max_events:
                raise ExportError(f"{self.path}: the export would hold {est} events, more "
                                  f"than --max-events {self.opts.max_events}; narrow it with "
                                  "--from/--to, --nodes, --ranks or --kinds, or raise "
                                  "--max-events")
        node_ids = sorted(n.node_id for n in self.nodes)
        jobs = max(1, min(jobs, len(node_ids)))
        self.node_id_ranges()      # once here, not once per node (nor per worker)
        if jobs == 1:
            return self._run_direct(out, gzip_level, node_ids)
        with _tempdir(tmp_parent, tmp_prefix) as tmpdir:
            return self._run_parts(out, gzip_level, jobs, node_ids, tmpdir)

    def _run_parts(self, out, gzip_level, jobs, node_ids, tmpdir) -> ExportStats:
        """Workers write the per-node sections, section by section, each into its own
        part file; this process writes the output in order as the parts arrive (copied
        in the kernel, then removed: the parts never pile up in the page cache), the
        flows as soon as every node's NCCL section is in; the findings analysis runs in
        a process of its own meanwhile. With --max-events (the analysis already ran for
        the estimate), nothing is written before the total is known (the parts are kept
        until then)."""
        kinds = self.opts.kinds
        deferred = self.opts.max_events is not None
        order = []
        for name in self.node_sections():
            order += [(name, nid) for nid in node_ids]
            if name == "nccl":
                order += [("flows", None), ("windows", None)]
        own = _PartFile(os.path.join(tmpdir, "global.part"), gzip_level, self.opts.max_events)
        w = _Assembler(out, gzip_level)
        inline = _InlineSections(w, None)
        kept = []               # deferred: what to copy, in order, once the total is known
        events = 0
        parts, finals, nccl_tracks = {}, [], {}
        workers = None

        def emit(part):
            if deferred:
                kept.append(part)
            elif part is not None:
                w.part(part)
                if part.path != own.path:
                    os.unlink(part.path)

        def own_section(fill):
            """A section of this process, straight to the output (not deferred)."""
            nonlocal events
            inline.sink.events = 0
            inline.section(fill)
            events += inline.sink.events

        with own:
            try:
                workers = _Workers(self, node_ids, tmpdir, gzip_level, jobs,
                                   analysis=self.opts.findings and self.analysis is None)
                if not deferred:
                    w.raw(b'{"traceEvents":[\n')
                windows = own.section(self.windows) if "nccl" in kinds else None
                events += own.sink.events
                for item in order:
                    while item not in parts and item[0] not in ("flows", "windows"):
                        if not workers.waiting:
                            raise ExportError(f"{self.path}: the workers left out {item}")
                        for msg in workers.receive():
                            if msg[0] == "part":
                                _, nid, name, part, n, tracks = msg
                                parts[(name, nid)] = part
                                events += n
                                if tracks is not None:
                                    nccl_tracks[nid] = tracks
                            elif msg[0] == "analysis":
                                self.analysis = msg[1]
                            else:
                                finals += msg[1]
                    if item[0] == "windows":
                        emit(windows)
                    elif item[0] == "flows":
                        if deferred:
                            continue          # after the total is checked (below)
                        for nid in node_ids:
                            self._merge_tracks(nccl_tracks[nid])
                        own_section(self.flows)
                    else:
                        emit(parts.pop(item))
                while workers.waiting:
                    for msg in workers.receive():
                        if msg[0] == "analysis":
                            self.analysis = msg[1]
                        elif msg[0] == "done":
                            finals += msg[1]
            finally:
                if workers is not None:
                    workers.close()
            self.run_analysis()
            finals.sort(key=lambda r: r.node_id)
            for r in finals:
                self._merge(r)
            if deferred:
                if events > self.opts.max_events:
                    raise ExportError(f"more than --max-events {self.opts.max_events} "
                                      "events; narrow the export with --from/--to, --nodes, "
                                      "--ranks or --kinds, or raise --max-events")
                w.raw(b'{"traceEvents":[\n')
                flows_at = len(node_ids) if "nccl" in kinds else None
                for i, part in enumerate(kept):
                    if i == flows_at:
                        # the flows, counted on from every other event (as --jobs 1)
                        own.sink.events = events
                        flows = own.section(self.flows)
                        events = own.sink.events
                        w.part(flows)
                    w.part(part)
                own.sink.events = events
                w.part(own.section(self.findings))
                events = own.sink.events
            else:
                own_section(self.findings)
            self.stats.events = events
            self.stats.overflow_tracks = self.tracks.overflow
            inline.sink.max_events = own.sink.max_events = None   # M events are not counted
            if deferred:
                w.part(own.section(self.metadata_events))
            else:
                inline.section(self.metadata_events)
        _Spill.close(self._spill_file)
        w.raw(b'\n],\n"displayTimeUnit":"ns",\n"metadata":'
              + orjson.dumps(self.metadata(), option=orjson.OPT_SORT_KEYS) + b"}\n")
        w.finish()
        self.stats.bytes = w.bytes
        return self.stats

    def _merge_tracks(self, r: "_NodeResult") -> None:
        t = self.tracks
        t.names.update(r.names)
        t._synthetic.update(r.synthetic)
        t._next.update(r.next_tid)
        self._overflowed_nccl.update(r.overflowed_nccl)

    def _merge(self, r: "_NodeResult") -> None:
        self._merge_tracks(r)
        self.tracks.overflow += r.overflow
        s = self.stats
        s.slices += r.stats.slices
        s.instants += r.stats.instants
        s.counters += r.stats.counters
        for k, v in r.stats.by_kind.items():
            self.count(k, v)

    def accel_fits(self) -> bool:
        """Whether the C loops can write every selected slice (every bound a number, CUDA
        pids and tids integers). A scan of the tables: used only where a failure midway
        could not be redone (stdout); file exports redo the file instead."""
        num = "IN ('integer', 'real')"
        checks = {
            "cuda": [("cuda_events", "NOT (typeof(pid) = 'integer' AND typeof(tid) = "
                      "'integer') OR (duration_ns IS NOT NULL AND NOT (typeof(timestamp_ns) "
                      f"{num} AND typeof(timestamp_ns + duration_ns) {num}))")],
            "nccl": [(t, f"NOT (typeof(timestamp_ns) {num} AND "
                         f"typeof(timestamp_ns + duration_ns) {num})")
                     for t in ("nccl_events", "nccl_comm_events")],
            "sched": [("sched_events", f"NOT (typeof(timestamp_ns) {num} AND "
                                       f"typeof(timestamp_ns + duration_ns) {num})")],
            "block": [("block_events", f"NOT (typeof(timestamp_ns) {num} AND "
                                       f"typeof(timestamp_ns + duration_ns) {num})")],
        }
        for kind, tables in checks.items():
            if kind not in self.opts.kinds:
                continue
            for table, odd in tables:
                per = table != "block_events"
                if self.con.execute(f"SELECT EXISTS (SELECT 1 FROM {table} WHERE ({odd}) AND "
                                    f"{self.where(per_process=per)})",
                                    self.params).fetchone()[0]:
                    return False
        return True

    def estimate(self) -> int:
        """Events the export will hold (for --max-events, before writing anything)."""
        k = self.opts.kinds
        n = 0
        q = lambda sql: self.con.execute(sql, self.params).fetchone()[0] or 0  # noqa: E731
        if "nccl" in k:
            n += q(f"SELECT COUNT(*) FROM nccl_events WHERE {self.where()}")
            n += q(f"SELECT COUNT(*) FROM nccl_comm_events WHERE {self.where()}")
            n += q(f"SELECT COUNT(*) FROM collectives WHERE {' AND '.join(self.window_conds())}")
            n += 2 * q(f"SELECT COUNT(*) - COUNT(DISTINCT comm_id_hash || ':' || seq) FROM "
                       f"nccl_events WHERE comm_id_hash IS NOT NULL AND seq IS NOT NULL AND "
                       f"{self.where()}")
        if "cuda" in k:
            n += q(f"SELECT COUNT(*) FROM cuda_events WHERE {self.where()}")
        if "sched" in k:
            n += q(f"SELECT COUNT(*) FROM sched_events WHERE {self.where()}")
        if "block" in k:
            n += q(f"SELECT COUNT(*) FROM block_events WHERE {self.where(per_process=False)}")
        if "tcp" in k:
            n += q(f"SELECT COUNT(*) FROM tcp_events WHERE {self.where(per_process=False)}")
        if "host" in k:
            n += q(f"SELECT COUNT(*) FROM host_samples WHERE {self.where(per_process=False)}")
        groups = self.stats_sql(k)
        if groups is not None:
            n += q(f"SELECT COUNT(*) FROM (SELECT 1 {groups})")
        return n + len(self.finding_windows())


def _json_or_text(v):
    try:
        return orjson.loads(v)
    except (orjson.JSONDecodeError, TypeError):
        return v


# --------------------------------------------------------------------------- entry

def export_chrome_trace(fleet_db, output=None, options: ExportOptions | None = None,
                        *, stdout=None) -> ExportStats:
    """Write fleet_db as Chrome Trace Event Format JSON.

    output: a path (``.gz`` suffix: gzip) or None for stdout (``stdout``, a binary
    stream, default sys.stdout.buffer). A file is built as a temporary file next to it and
    renamed into place only when complete: on any error the destination is untouched.
    Per-node sections are written by ``options.jobs`` worker processes into part files in
    a temporary directory (next to the output; the system's temp directory for stdout),
    removed whatever happens.
    """
    opts = options or ExportOptions()
    bad = set(opts.kinds) - set(KINDS)
    if bad:
        raise ExportError(f"unknown kind(s) {', '.join(sorted(bad))} (kinds: {', '.join(KINDS)})")
    if opts.jobs is not None and opts.jobs < 1:
        raise ExportError(f"jobs {opts.jobs}: must be at least 1")
    jobs = opts.jobs or os.cpu_count() or 1
    con = open_fleet(fleet_db)
    try:
        exporter = _Exporter(con, opts, str(fleet_db))
        try:
            if output is None:
                out = stdout if stdout is not None else sys.stdout.buffer
                if exporter.accel is not None and not exporter.accel_fits():
                    exporter.accel = None    # nothing written yet: decide up front
                    exporter.stats.accelerated = False
                try:
                    stats = exporter.run(out, gzip_level=None, jobs=jobs, tmp_parent=None,
                                         tmp_prefix="ingero-export-")
                except _AccelUnsupported as e:     # the check above should rule it out
                    raise ExportError(f"{fleet_db}: {e} (the output is incomplete; "
                                      "export again with INGERO_NO_ACCEL=1)") from None
                out.flush()
                stats.output = "-"
                return stats
            try:
                return _to_file(exporter, Path(output), opts, jobs)
            except _AccelUnsupported:
                # Odd values the C loops leave to Python: the whole file again without
                # them (the temporary file is gone, the destination untouched).
                exporter = _Exporter(con, dataclasses.replace(opts, accel=False),
                                     str(fleet_db))
                return _to_file(exporter, Path(output), opts, jobs)
        except apsw.Error as e:
            raise ExportError(f"{fleet_db}: cannot read fleet.db ({e})") from None
    finally:
        con.close()


class _tempdir:
    """A temporary directory removed on exit, whatever happened (Ctrl-C included)."""

    def __init__(self, parent, prefix: str):
        self.parent, self.prefix = parent, prefix

    def __enter__(self) -> str:
        try:
            self.path = tempfile.mkdtemp(prefix=self.prefix, dir=self.parent)
        except OSError as e:
            where = self.parent or tempfile.gettempdir()
            raise ExportError(f"{where}: cannot create a temporary directory: "
                              f"{e.strerror or e}") from None
        return self.path

    def __exit__(self, *exc):
        shutil.rmtree(self.path, ignore_errors=True)


def _to_file(exporter: _Exporter, out_path: Path, opts: ExportOptions,
             jobs: int) -> ExportStats:
    if out_path.is_dir():
        raise ExportError(f"{out_path}: is a directory")
    parent = out_path.parent
    if not parent.is_dir():
        raise ExportError(f"{out_path}: directory {parent} does not exist")
    tmp = parent / f".{out_path.name}.{os.getpid()}.tmp"
    level = opts.gzip_level if out_path.name.endswith(".gz") else None
    try:
        # Unbuffered: the parts are copied in the kernel straight into its descriptor (the
        # direct path of --jobs 1 writes whole chunks anyway).
        with open(tmp, "wb", buffering=0) as f:
            stats = exporter.run(f, gzip_level=level, jobs=jobs, tmp_parent=str(parent),
                                 tmp_prefix=f".{out_path.name}.{os.getpid()}.parts-")
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except OSError as e:
        with contextlib.suppress(OSError):      # a read-only file system refuses this too
            tmp.unlink(missing_ok=True)
        raise ExportError(f"{out_path}: cannot write: {e.strerror or e}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    stats.output = str(out_path)
    return stats


__all__ = ["ExportOptions", "ExportStats", "ExportError", "KINDS", "export_chrome_trace",
           "parse_time", "parse_ranks", "iso_utc"]
