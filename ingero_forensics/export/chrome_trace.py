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
used when built, and the Python loops of streams.py (SQLite's printf/json_quote build
the text), the fallback and the reference (INGERO_NO_ACCEL=1 or
ExportOptions(accel=False)).

Timestamps are microseconds with three decimals (nanoseconds) relative to ``origin``:
the start of the data, floored to a whole second of aligned fleet UTC (absolute UTC in
microseconds would exceed a double's 53 bits and lose the nanoseconds). The origin is in
the top-level metadata.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

import apsw
import orjson

from .. import __version__
from ..cliutil import sqlite_message
from ..errors import IngeroError
from ..merge.nodes import data_start
from .fleet import load_nodes, open_fleet, rank_ranges
from .options import (KINDS, NS, RANGED_TABLES, AccelUnsupported, ExportError, ExportOptions,
                      ExportStats, iso_utc, load_accel, parse_ranks, parse_time)
from .output import Assembler, InlineSections, NodeResult, PartFile, Sink, Spill
from .streams import EventStreams
from .tracks import Tracks
from .workers import Workers


class _Exporter(EventStreams):
    def __init__(self, con, opts: ExportOptions, path: str):
        self.con = con
        self.opts = opts
        self.path = path
        self.nodes_all = load_nodes(con)
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
        self.origin = self.data_start - self.data_start % NS
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
        """{table: {node_id: (min id, max id)}} for the RANGED_TABLES the export reads
        (None for a table with an index led by node_id: SQLite finds a node's rows).

        One scan of each table instead of one per node: a node's rows are all within
        its range, so the condition changes no result; merged tables hold each node's
        rows in one run of ids, so the range is about that node's rows alone.
        """
        if "done" in self._ranges:
            return self._ranges
        for table, kind in RANGED_TABLES.items():
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

        ``table``: a table without an index led by node_id (RANGED_TABLES); one node's
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

    # -- metadata -----------------------------------------------------------------
    def metadata_events(self, sink: Sink) -> None:
        used_pids = {p for p, _ in self.tracks.names}
        for node in self.nodes_all:
            if node.pid not in used_pids and node not in self.nodes:
                continue
            for line in (
                {"ph": "M", "pid": node.pid, "tid": 0, "name": "process_name",
                 "args": {"name": f"{node.name} ({rank_ranges(node.ranks)})"}},
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

    def _result(self) -> "NodeResult":
        t = self.tracks
        return NodeResult(self.only_node, self.stats, t.names, t._synthetic, t._next,
                          t.overflow, self._overflowed_nccl)

    def _run_direct(self, out, gzip_level: int | None, node_ids: list[int]) -> ExportStats:
        """--jobs 1: the same sections in the same order and fragments as the part files
        would hold, written straight to ``out`` (no temporary files, no copy)."""
        w = Assembler(out, gzip_level)
        w.raw(b'{"traceEvents":[\n')
        inline = InlineSections(w, self.opts.max_events)
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
        Spill.close(self._spill_file)
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
        own = PartFile(os.path.join(tmpdir, "global.part"), gzip_level, self.opts.max_events)
        w = Assembler(out, gzip_level)
        inline = InlineSections(w, None)
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
                workers = Workers(self, node_ids, tmpdir, gzip_level, jobs,
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
        Spill.close(self._spill_file)
        w.raw(b'\n],\n"displayTimeUnit":"ns",\n"metadata":'
              + orjson.dumps(self.metadata(), option=orjson.OPT_SORT_KEYS) + b"}\n")
        w.finish()
        self.stats.bytes = w.bytes
        return self.stats

    def _merge_tracks(self, r: "NodeResult") -> None:
        t = self.tracks
        t.names.update(r.names)
        t._synthetic.update(r.synthetic)
        t._next.update(r.next_tid)
        self._overflowed_nccl.update(r.overflowed_nccl)

    def _merge(self, r: "NodeResult") -> None:
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
        try:
            # reads the node table: a damaged schema page fails here
            exporter = _Exporter(con, opts, str(fleet_db))
            if output is None:
                out = stdout if stdout is not None else sys.stdout.buffer
                if exporter.accel is not None and not exporter.accel_fits():
                    exporter.accel = None    # nothing written yet: decide up front
                    exporter.stats.accelerated = False
                try:
                    stats = exporter.run(out, gzip_level=None, jobs=jobs, tmp_parent=None,
                                         tmp_prefix="ingero-export-")
                except AccelUnsupported as e:     # the check above should rule it out
                    raise ExportError(f"{fleet_db}: {e} (the output is incomplete; "
                                      "export again with INGERO_NO_ACCEL=1)") from None
                out.flush()
                stats.output = "-"
                return stats
            try:
                return _to_file(exporter, Path(output), opts, jobs)
            except AccelUnsupported:
                # Odd values the C loops leave to Python: the whole file again without
                # them (the temporary file is gone, the destination untouched).
                exporter = _Exporter(con, dataclasses.replace(opts, accel=False),
                                     str(fleet_db))
                return _to_file(exporter, Path(output), opts, jobs)
        except apsw.Error as e:
            raise ExportError(f"{fleet_db}: cannot read fleet.db ({sqlite_message(e)})"
                              ) from None
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
