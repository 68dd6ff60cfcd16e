"""What an export is asked for and what it reports: options, statistics, errors, the
time and rank arguments, the C accelerator's loader."""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass, field


from .. import accel
from ..errors import IngeroError


KINDS = ("nccl", "cuda", "tcp", "sched", "block", "host")
#: event_stats.source -> the --kinds name it belongs to
STAT_KIND = {"nccl": "nccl", "cuda": "cuda", "sched": "sched", "block": "block", "tcp": "tcp"}
CHUNK_EVENTS = 8192
#: Event args in output order (the accelerated SQL selects them in this order).
CUDA_ARGS = ("layer", "stream", "bytes", "memcpy_kind", "kernel", "device", "return_code")
NCCL_ARGS = ("op", "bytes", "comm", "seq", "rank", "nranks", "count", "datatype", "redop",
             "peer", "stream", "group_depth", "return_code", "call_duration_ns",
             "completion_utc_ns", "late_ns", "wait_ns", "entry_spread_ns", "ranks_seen",
             "last_to_arrive")
NCCL_COMM_ARGS = ("api", "comm", "parent", "split_color", "split_key", "rank", "nranks",
                  "return_code")
#: Synthetic track ids start above any Linux tid (pid_max <= 2^22) and stay below 2^31.
SYNTHETIC_TID = 1 << 30
#: Tables a node section reads that fleet.db does not index by node_id, with the kind
#: that reads them: one node's rows are bounded by their rowid range (where()).
RANGED_TABLES = {"host_samples": "host", "tcp_events": "tcp", "block_events": "block"}
NS = 1_000_000_000


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
    bytes: int = 0           # the JSON text (before gzip, for a .gz output)
    accelerated: bool = False  # the C loops (_fastslices) wrote the slice sections


# ----------------------------------------------------------------------------- time

_OFFSET_RE = re.compile(r"^\+(\d+(?:\.\d+)?)(ns|us|ms|s|m|h|d)$")
_UNIT_NS = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": NS, "m": 60 * NS,
            "h": 3600 * NS, "d": 86400 * NS}


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
            return data_start_ns + int(whole) * scale + int(frac.ljust(9, "0")[:9]) * scale // NS
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
    return int(t.timestamp()) * NS + frac_ns


def iso_utc(ns: int) -> str:
    sec, frac = divmod(ns, NS)
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

class AccelUnsupported(Exception):
    """The fleet holds a value the C loops leave to the Python path (a slice bound that
    is not a number): the export is redone without them."""


def load_accel():
    """The C accelerator module, ready, or None (not built, or INGERO_NO_ACCEL=1); see
    ingero_forensics/accel.py."""
    return accel.load("export._fastslices", "sqlite3_fastslices_init")
