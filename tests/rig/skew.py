"""Rewrite a node's bundles as if that machine's clock had been offset and drifting.

A real oscillator that runs fast moves CLOCK_MONOTONIC and CLOCK_REALTIME together (no
time service corrects it: the rig's clock samples already say unsynchronized), so every
CLOCK_MONOTONIC time point of every table, the clock samples' brackets, and the realtime,
boottime and TAI readings move by the same amount at each instant, and realtime - mono
stays what the kernel had. The node also gets its own boot_id: a clock of its own is a
machine of its own (the merge aligns nodes of one boot as one clock). The mapping is

    skewed(m) = m + offset_ns + (m - anchor_ns) * ppm / 1e6

Durations the node measured grow with its rate, so an interval's end is the skewed
end. ``SkewMap.true`` inverts the mapping, so a test can put every aligned event back on
the true clock. The rewritten database is resealed with the bundle writer's ``seal_spool``: its
manifest is rebuilt from meta, sha256 and row counts included, and the result passes
``ingero-merge --integrity full`` like any sealed bundle.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from ingero_forensics.bundle.reader import open_bundle
from ingero_forensics.bundle.schema import TABLES
from ingero_forensics.bundle.writer import seal_spool, transaction
from ingero_forensics.db import connect_writable

MONO_UNIT = "ns, CLOCK_MONOTONIC"
MID = "(mono_before_ns + mono_after_ns) / 2"
#: columns that are not CLOCK_MONOTONIC but read the same oscillator at the same instant
#: as a row's monotonic time: (table, column, the row's monotonic time, sign of the shift)
COUPLED = (
    ("clock_samples", "realtime_ns", MID, 1),
    ("clock_samples", "boottime_ns", MID, 1),
    ("clock_samples", "tai_ns", MID, 1),
    ("processes", "start_boottime_ns", "start_boottime_ns", 1),   # boottime ~ mono here
)
#: clock_samples.ref_offset_ns: chrony's is system minus reference (the system clock
#: moved: +shift), ptp's is PHC minus CLOCK_REALTIME (-shift)
REF_OFFSETS = (("chrony", 1), ("ptp", -1))
#: intervals the node measured with the same clock: (table, column, the interval's start,
#: its end); a fast clock makes them longer too, so a span's end stays skewed(end) and the
#: spans that end at one instant (a sched switch-in's off_cpu and runq_delay) still do
DURATIONS = (
    ("nccl_events", "duration_ns", "timestamp_ns", "timestamp_ns + duration_ns"),
    ("nccl_comm_events", "duration_ns", "timestamp_ns", "timestamp_ns + duration_ns"),
    ("cuda_events", "duration_ns", "timestamp_ns", "timestamp_ns + duration_ns"),
    ("cuda_events", "queue_gap_ns", "timestamp_ns - queue_gap_ns", "timestamp_ns"),
    ("sched_events", "duration_ns", "timestamp_ns", "timestamp_ns + duration_ns"),
    ("block_events", "duration_ns", "timestamp_ns", "timestamp_ns + duration_ns"),
)


@dataclass(frozen=True)
class SkewMap:
    offset_ns: int
    ppm: float
    anchor_ns: int

    def skewed(self, m: int) -> int:
        return m + self.offset_ns + round((m - self.anchor_ns) * self.ppm / 1e6)

    def true(self, m: int) -> int:
        """The true CLOCK_MONOTONIC of a skewed reading."""
        return self.anchor_ns + round((m - self.offset_ns - self.anchor_ns) / (1 + self.ppm / 1e6))

    def sql(self, col: str) -> str:
        """skewed(col) in SQL (integer arithmetic, exact to a nanosecond)."""
        return self.sql_delta(col, col)

    def sql_delta(self, col: str, ref: str, sign: int = 1) -> str:
        """col shifted by sign * (skewed(ref) - ref)."""
        delta = (f"({self.offset_ns} + CAST(ROUND((({ref}) - {self.anchor_ns}) * "
                 f"{self.ppm!r} / 1e6) AS INTEGER))")
        return f"{col} + {sign} * {delta}"


def mono_columns() -> dict[str, list[str]]:
    """Every CLOCK_MONOTONIC column of every bundle table (clock samples included)."""
    return {t.name: [c.name for c in t.columns if c.unit == MONO_UNIT] for t in TABLES}


def skew_bundle(src, out_dir, skew: SkewMap) -> Path:
    """Write a skewed copy of one sealed bundle into out_dir; return its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spool = out_dir / ".skew-spool.db"
    with open_bundle(src, integrity="full") as b:
        shutil.copyfile(b.db_path, spool)
    con = connect_writable(spool, wal=False)
    try:
        with transaction(con):
            # readings coupled to a row's monotonic time first, while it is still true
            for table, col, ref, sign in COUPLED:
                con.execute(f"UPDATE {table} SET {col} = {skew.sql_delta(col, ref, sign)} "
                            f"WHERE {col} IS NOT NULL")
            for table, col, start, end in DURATIONS:
                if col not in {r[1] for r in con.execute(f"PRAGMA table_xinfo({table})")}:
                    continue
                grow = f"({skew.sql_delta('0', end)}) - ({skew.sql_delta('0', start)})"
                con.execute(f"UPDATE {table} SET {col} = {col} + {grow} "
                            f"WHERE {col} IS NOT NULL AND timestamp_ns IS NOT NULL")
            for source, sign in REF_OFFSETS:
                con.execute(f"UPDATE clock_samples SET ref_offset_ns = "
                            f"{skew.sql_delta('ref_offset_ns', MID, sign)} "
                            f"WHERE source = ? AND ref_offset_ns IS NOT NULL", (source,))
            for table, cols in mono_columns().items():
                for col in cols:
                    con.execute(f"UPDATE {table} SET {col} = {skew.sql(col)} "
                                f"WHERE {col} IS NOT NULL")
            meta = {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM meta")}
            cap = dict(meta["capture"])
            for side in ("start", "end"):
                mono = cap[f"{side}_mono_ns"]
                cap[f"{side}_mono_ns"] = skew.skewed(mono)
                cap[f"{side}_utc_ns"] += cap[f"{side}_mono_ns"] - mono
            con.execute("UPDATE meta SET value = ? WHERE key = 'capture'", (json.dumps(cap),))
            # another clock is another machine: another boot (the merge aligns the
            # nodes of one boot as one clock)
            host = dict(meta["host"])
            host["boot_id"] = str(uuid.uuid5(uuid.NAMESPACE_OID, f"{host['boot_id']}/{skew}"))
            con.execute("UPDATE meta SET value = ? WHERE key = 'host'", (json.dumps(host),))
    finally:
        con.close()
    return seal_spool(spool, out_dir)


def skew_node(bundles, out_dir, offset_ns: int, ppm: float = 50.0) -> tuple[list[Path], SkewMap]:
    """Skew every bundle of one node with one mapping anchored at its first capture start.
    Returns the new bundles and the mapping."""
    bundles = sorted(Path(b) for b in bundles)
    with open_bundle(bundles[0]) as b:
        anchor = b.manifest["capture"]["start_mono_ns"]
    skew = SkewMap(offset_ns, ppm, anchor)
    return [skew_bundle(b, out_dir, skew) for b in bundles], skew
