"""The trace's event streams, one method per kind of event: the SQL that turns
fleet.db rows into Chrome Trace Event JSON, stepped by the C accelerator or in Python
(chrome_trace.py runs them; _Exporter holds the state they share)."""

from __future__ import annotations

from itertools import islice

import orjson

from .options import (CHUNK_EVENTS, CUDA_ARGS, NCCL_ARGS, NCCL_COMM_ARGS, STAT_KIND,
                      AccelUnsupported, ExportError, iso_utc)
from .output import Sink, Spill
from .tracks import place_lane


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


def _endpoint(addr: str, port: str) -> str:
    """SQL: addr:port, or [addr]:port for an IPv6 address."""
    return (f"(CASE WHEN instr({addr}, ':') THEN '[' || {addr} || ']' ELSE {addr} END "
            f"|| ':' || {port})")


def _args(*pairs: str) -> str:
    """SQL: a JSON object of the non-NULL args, built by concatenation.

    (json_patch('{}', json_object(...)) would drop NULLs too, at a third of the speed.)
    """
    parts = []
    for key, col in zip(pairs[::2], pairs[1::2]):
        k = key.strip("'")
        parts.append(f"""iif(({col}) IS NULL, '', ',"{k}":' || json_quote({col}))""")
    return "('{' || substr(" + " || ".join(parts) + ", 2) || '}')"


class EventStreams:
    """The per-kind sections of _Exporter (a mixin: the state is the exporter's)."""

    # -- slice streams ------------------------------------------------------------
    def _slices(self, sink: Sink, sql: str, kind: str, resolve, overflowed=None,
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
            for node_id, k1, k2, start, end, body in islice(rows, CHUNK_EVENTS):
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
                lane = place_lane(lanes, start, end)
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

    def _events(self, sink: Sink, ph: str, sql: str, layouts: tuple, resolve,
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
            raise AccelUnsupported(str(e)) from None
        except RuntimeError as e:      # SQLite's error, as apsw would raise it
            raise ExportError(f"{self.path}: cannot read fleet.db ({e})") from None

    def cuda(self, sink: Sink) -> None:
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
            spill = Spill(self._spill_file)
            sink.flush()
            n = self._c(self.accel.events, raw, sink.extend_joined, sink.first, "X",
                        self.origin, (("cuda", CUDA_ARGS, "q" * 7, 9),
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
            for pid, tid, start, end, text in islice(rows, CHUNK_EVENTS):
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
                lane = place_lane(lanes, start, end)
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

    def cuda_instants(self, sink: Sink) -> None:
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

    def nccl(self, sink: Sink) -> None:
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
            fast = (raw, (("nccl", NCCL_ARGS, "q" * 19 + "b", 18),
                          ("nccl", NCCL_COMM_ARGS, "q" * 8, 38)), raw_comm)
        self._slices(sink, sql, "nccl",
                     lambda nid, pid, tid: self.tracks.family(nid, pid, tid, "nccl", 1),
                     self._overflowed_nccl, fast)

    def flows(self, sink: Sink) -> None:
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

    def sched(self, sink: Sink) -> None:
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

    def block(self, sink: Sink) -> None:
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

    def tcp(self, sink: Sink) -> None:
        # an IPv6 endpoint is [addr]:port, as in a URL (fd00::1:22 would be ambiguous)
        name = ("CASE event WHEN 'tcp_retransmit_skb' THEN 'retransmit' ELSE event END || ' ' "
                f"|| {_endpoint('saddr', 'sport')} || ' > ' || {_endpoint('daddr', 'dport')}")
        body = (f"""{_head('tcp', 'timestamp_ns', None, name)} ||
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
            raw = (f"SELECT node_id, scope, NULL, NULL, NULL, timestamp_ns, NULL, {name}, "
                   "0, event, saddr, sport, daddr, dport, state, scope, owner_pid, srtt_us, "
                   "snd_cwnd "
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

    def host(self, sink: Sink) -> None:
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

    def stats_rates(self, sink: Sink) -> None:
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
            self.count(STAT_KIND[source], 1)

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
        sources = [s for s, k in STAT_KIND.items() if k in kinds]
        if not sources:
            return None
        src = ", ".join(f"'{s}'" for s in sources)
        return (f"FROM event_stats WHERE source IN ({src}) AND "
                f"{self.where(ts='interval_start_ns', per_process=False)} "
                "GROUP BY node_id, source, name, interval_start_ns, interval_end_ns")

    def windows(self, sink: Sink) -> None:
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

    def findings(self, sink: Sink) -> None:
        """ingero-report's straggler windows as slices on the straggler node's process."""
        from ..report.analyze import CAUSE_TITLES
        from ..report.links import LINK_CAUSE_TITLE
        a = self.analysis
        windows = self.finding_windows()
        if not windows:
            return
        cp = self.tracks.by_node[a.straggler_node_id].pid
        tid = self.tracks.synthetic(cp, ("findings",), -1, "ingero-report findings")
        # a slow link names the network as its cause, but nothing was retransmitted: its
        # own title, as the page and the text say it
        cause = (LINK_CAUSE_TITLE if a.link_suspect else
                 CAUSE_TITLES.get(a.cause, a.cause) if a.cause else "cause not determined")
        if a.cause and a.cause_confidence == "weak":
            cause += " (weak evidence)"
        for w in windows:
            rest = orjson.dumps({
                "name": f"straggler window: {cause}", "cat": "finding",
                "args": {"straggler": a.straggler, "late_ranks": a.late_ranks,
                         "lateness_ms": w.lateness_ms, "cause": a.cause,
                         "cause_confidence": a.cause_confidence,
                         **({"link": [a.link_suspect["from"], a.link_suspect["to"]]}
                            if a.link_suspect else {}),
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
