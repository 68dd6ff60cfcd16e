"""The bundle schema, format version 1: every table, column, unit and meaning.

This catalogue is the one place the bundle tables are defined. The DDL is generated
from it, the reader validates bundles against it, the merge derives the fleet.db tables
from it, and docs/bundle-format.md carries a table section rendered from it (a test
keeps the two identical). Other modules never write CREATE or ALTER for bundle tables.

Clock domain: every ``*_ns`` timestamp in a bundle is CLOCK_MONOTONIC nanoseconds of the
node that wrote it (what ``bpf_ktime_get_ns()`` returns), valid within one boot
(``boot_id`` in the manifest). ``clock_samples`` maps it to UTC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FORMAT_VERSION = 1
#: PRAGMA application_id of a bundle database: ASCII "INGF".
APPLICATION_ID = 0x494E4746

NCCL_OPS = (
    "ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "BROADCAST",
    "REDUCE", "ALL_TO_ALL", "SEND", "RECV",
)
#: ncclDataType_t values (nccl.h order) and their byte sizes.
NCCL_DATATYPES = (
    ("int8", 1), ("uint8", 1), ("int32", 4), ("uint32", 4), ("int64", 8),
    ("uint64", 8), ("float16", 2), ("float32", 4), ("float64", 8), ("bfloat16", 2),
    ("float8e4m3", 1), ("float8e5m2", 1),
)
#: ncclRedOp_t values (nccl.h order); values >= 5 are user-defined PreMulSum ops.
NCCL_REDOPS = ("sum", "prod", "max", "min", "avg")
NCCL_COMM_APIS = (
    "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommInitRankScalable",
    "ncclCommInitAll", "ncclCommSplit", "ncclCommDestroy", "ncclCommAbort",
)
MEMCPY_KINDS = ("HtoH", "HtoD", "DtoH", "DtoD", "default")
TCP_EVENTS = ("tcp_retransmit_skb", "tcp_probe")
TCP_SCOPES = ("job", "background", "unknown")
TCP_DIRECTIONS = ("send", "recv", "arrive", "unsent")
SCHED_KINDS = ("runq_delay", "off_cpu")
BLOCK_OPS = ("read", "write", "discard", "flush", "other")
LOG_LEVELS = ("debug", "info", "warning", "error")
CLOCK_SOURCES = ("system", "chrony", "ptp")
STAT_SOURCES = ("nccl", "cuda", "sched", "block", "tcp")
IN_FLIGHT_WHY = ("seal", "stop")
#: Tables whose rows are not events: every count of "events" or "rows" (the simulator's,
#: a bundle's, a node's, the merge's total) leaves them out (stacks are shared by the
#: fleet, meta is facts about a segment).
NOT_EVENTS = ("meta", "stacks")


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # INTEGER, REAL or TEXT
    nullable: bool
    unit: str
    doc: str
    #: allowed values for TEXT enums (documented; validated by the merge)
    values: tuple[str, ...] | None = None
    #: False only for columns added after 1.0 within format version 1: readers treat a
    #: missing optional column as all NULL (see "Versioning" in the spec).
    required: bool = True


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    columns: tuple[Column, ...]
    indexes: tuple[tuple[str, ...], ...] = field(default=())
    #: False only for tables added after 1.0 within format version 1: a bundle may lack
    #: them (and their manifest count); readers take that as no rows.
    required: bool = True

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def data_columns(self) -> tuple[str, ...]:
        """Columns a writer supplies: all but the INTEGER PRIMARY KEY (the rowid)."""
        return tuple(c.name for c in self.columns[1:])


def C(name, type_, nullable, unit, doc, values=None):
    return Column(name, type_, nullable, unit, doc, tuple(values) if values else None)


def _id(doc="Row id, unique within this bundle (the SQLite rowid)."):
    return C("id", "INTEGER", False, "", doc)


_PID = C("pid", "INTEGER", False, "", "Process id (tgid) in the node's initial PID namespace.")
_TID = C("tid", "INTEGER", False, "", "Thread id in the node's initial PID namespace.")
_STACK = C("stack_id", "INTEGER", True, "",
           "User stack of the call: stacks.stack_id of this bundle; NULL when not captured.")
_TS = C("timestamp_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC",
        "Start of the event (for calls: entry).")

TABLES: tuple[Table, ...] = (
    Table("meta", "Key/value facts about the segment; mirrors the manifest so an unsealed "
          "spool can be sealed after a crash. Keys are listed in the spec.", (
        C("key", "TEXT", False, "", "Key (primary key)."),
        C("value", "TEXT", False, "", "Value; JSON for structured values."),
    )),
    Table("nccl_events", "One row per NCCL collective or point-to-point host call.", (
        _id(), _TS,
        C("duration_ns", "INTEGER", False, "ns",
          "Entry to return of the host call. NCCL calls are asynchronous: this is the "
          "enqueue time, the wait shows in a later synchronization (cuda_events)."),
        C("op", "TEXT", False, "", "Operation.", NCCL_OPS),
        C("rank", "INTEGER", True, "", "Rank of the caller in this row's communicator "
          "(comm_id_hash), never the global rank (that is processes.rank); NULL if the "
          "communicator was created before capture started or is a split child whose rank "
          "the writer could not read."),
        C("nranks", "INTEGER", True, "", "Communicator size; NULL as for rank."),
        C("comm_id_hash", "TEXT", True, "",
          "Communicator identity: 16 lowercase hex digits, the splitmix64 fold of the full "
          "128-byte ncclUniqueId (split children: derived from the parent hash, color and "
          "the split's ordinal on the parent; see the spec). Identical on every rank of the "
          "communicator; NULL if unknown."),
        C("seq", "INTEGER", True, "", "Per-communicator call counter on this rank, 1 for the "
          "first collective or p2p call after init. (comm_id_hash, seq) names the same "
          "collective on every rank. NULL when comm_id_hash is NULL."),
        C("count", "INTEGER", True, "elements", "Element count argument."),
        C("datatype", "TEXT", True, "", "ncclDataType_t as a name (numbers in the spec); "
          "NULL for a number not listed.",
          tuple(n for n, _ in NCCL_DATATYPES)),
        C("redop", "TEXT", True, "", "Reduction (ALL_REDUCE, REDUCE, REDUCE_SCATTER): "
          "ncclRedOp_t 0-4 as sum, prod, max, min, avg; N >= 5 (a user op from "
          "ncclRedOpCreatePreMulSum) as premul_sum:N; NULL on other ops and for a "
          "negative number."),
        C("peer", "INTEGER", True, "", "SEND/RECV peer rank, BROADCAST/REDUCE root; NULL otherwise."),
        C("stream", "INTEGER", True, "", "cudaStream_t handle value (0 = default stream)."),
        C("bytes", "INTEGER", True, "bytes", "count x datatype size: the caller's send size."),
        C("group_depth", "INTEGER", True, "", "ncclGroupStart nesting depth at the call "
          "(0 = not grouped); NULL if group calls were not traced."),
        C("return_code", "INTEGER", True, "", "ncclResult_t returned (0 = ncclSuccess)."),
        _PID, _TID, _STACK,
        Column("comm_handle", "INTEGER", True, "",
               "ncclComm_t pointer value in the process (as in nccl_comm_events); NULL "
               "when not recorded.", required=False),
        Column("handle_seq", "INTEGER", True, "",
               "Set only when comm_id_hash is NULL because the communicator was created "
               "before the capture attached: this process's call counter on comm_handle, "
               "1 for the first call the capture saw. It names nothing across ranks; the "
               "merge infers the communicator from the streams' shape and time "
               "(docs/merge.md, late attach). NULL otherwise.", required=False),
    ), indexes=(("comm_id_hash", "seq"), ("timestamp_ns",))),
    Table("nccl_comm_events", "Communicator lifecycle: init, split, destroy, abort.", (
        _id(), _TS,
        C("duration_ns", "INTEGER", False, "ns", "Entry to return of the call."),
        C("api", "TEXT", False, "", "The NCCL function.", NCCL_COMM_APIS),
        C("comm_id_hash", "TEXT", True, "", "Identity of the communicator (see nccl_events)."),
        C("parent_hash", "TEXT", True, "", "ncclCommSplit: the parent's comm_id_hash."),
        C("split_color", "INTEGER", True, "", "ncclCommSplit color."),
        C("split_key", "INTEGER", True, "", "ncclCommSplit key."),
        C("rank", "INTEGER", True, "", "Rank of the caller in the communicator comm_id_hash "
          "names (ncclCommSplit: the child's rank, not the parent's; never the global "
          "rank); NULL when unknown."),
        C("nranks", "INTEGER", True, "", "Size of the communicator comm_id_hash names "
          "(ncclCommSplit: the child's); NULL when unknown."),
        C("comm_handle", "INTEGER", True, "", "ncclComm_t pointer value in the process."),
        C("return_code", "INTEGER", True, "", "ncclResult_t returned."),
        _PID, _TID,
    )),
    Table("cuda_events", "CUDA runtime and driver API calls kept one by one "
          "(synchronizations, copies, allocations, graph launches, sampled launches).", (
        _id(), _TS,
        C("duration_ns", "INTEGER", True, "ns", "Entry to return; NULL for entry-only probes."),
        C("api", "TEXT", False, "", "Function name, e.g. cudaStreamSynchronize, cuMemcpyHtoD_v2."),
        C("layer", "TEXT", False, "", "runtime (libcudart) or driver (libcuda).",
          ("runtime", "driver")),
        C("stream", "INTEGER", True, "", "Stream handle argument, when the call has one."),
        C("bytes", "INTEGER", True, "bytes", "Size argument of copies and allocations."),
        C("memcpy_kind", "TEXT", True, "", "cudaMemcpyKind of copies.", MEMCPY_KINDS),
        C("kernel", "TEXT", True, "", "Kernel launched (symbolized host stub), when known."),
        C("device", "INTEGER", True, "", "CUDA device ordinal, when known."),
        C("return_code", "INTEGER", True, "", "cudaError_t / CUresult returned."),
        _PID, _TID, _STACK,
        Column("queued_ops", "INTEGER", True, "operations",
               "Synchronizations only: stream operations (kernel launches, async copies, "
               "graph launches; a runtime call and the driver call it makes may count "
               "twice) this thread enqueued after its last NCCL collective (or group end) "
               "or synchronization and before this one; 0 when none; NULL on other calls "
               "and when not recorded. Decides whether the synchronization's end may stand "
               "for the completion of the collective before it (docs/merge.md).",
               required=False),
        Column("queue_gap_ns", "INTEGER", True, "ns",
               "Synchronizations with queued_ops > 0: time from the entry of the last of "
               "those operations to the entry of this synchronization; NULL otherwise.",
               required=False),
    ), indexes=(("pid", "tid", "timestamp_ns"),)),
    Table("event_stats", "In-kernel aggregates for calls too frequent to keep one by one "
          "(cudaLaunchKernel, sched spans under the threshold): one row per interval and key.", (
        _id(),
        C("interval_start_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "Start of the interval."),
        C("interval_end_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "End of the interval."),
        C("source", "TEXT", False, "", "Probe family.", STAT_SOURCES),
        C("name", "TEXT", False, "", "API name (cuda, nccl) or span kind (sched, block)."),
        C("pid", "INTEGER", True, "", "Process, or NULL if aggregated over processes."),
        C("tid", "INTEGER", True, "", "Thread, or NULL if aggregated over threads."),
        C("stack_id", "INTEGER", True, "", "Stack, or NULL if aggregated over stacks."),
        C("count", "INTEGER", False, "calls", "Number of calls or spans."),
        C("total_ns", "INTEGER", True, "ns", "Sum of durations; NULL for entry-only counts."),
        C("max_ns", "INTEGER", True, "ns", "Longest duration."),
        C("hist_log2", "TEXT", True, "", "JSON array: element i counts durations in "
          "[2^i, 2^(i+1)) ns; trailing zeros omitted."),
        Column("observed_ns", "INTEGER", True, "ns",
               "How long within the interval the probes counted, when they were off for "
               "part of it (kernel launches above the capture's --launch-budget): 0 for an "
               "interval not counted at all (one row per API, count 0, which says nothing "
               "about the rate). NULL: counted throughout.", required=False),
    )),
    Table("tcp_events", "TCP retransmits (and optional tcp_probe samples) seen by the kernel.", (
        _id(), _TS,
        C("event", "TEXT", False, "", "Tracepoint name.", TCP_EVENTS),
        C("family", "INTEGER", False, "", "4 or 6."),
        C("saddr", "TEXT", False, "", "Source address as text (IPv4 dotted quad, IPv6 RFC 5952)."),
        C("daddr", "TEXT", False, "", "Destination address as text."),
        C("sport", "INTEGER", False, "", "Source port."),
        C("dport", "INTEGER", False, "", "Destination port."),
        C("state", "TEXT", True, "", "TCP state name without the TCP_ prefix, e.g. ESTABLISHED."),
        C("pid", "INTEGER", True, "", "Task current when the tracepoint fired. Unreliable "
          "(softirq context); use owner_pid for attribution."),
        C("netns", "INTEGER", True, "", "Network namespace inode of the socket, when known."),
        C("owner_pid", "INTEGER", True, "", "Traced process owning the connection (4-tuple "
          "found in its namespace's connection table); NULL for background traffic."),
        C("scope", "TEXT", False, "", "job: a connection of a traced process; background: "
          "anything else on the node (other jobs, ssh, containers); unknown: the writer "
          "cannot tell.", TCP_SCOPES),
        C("srtt_us", "INTEGER", True, "us", "Smoothed RTT (tcp_probe rows)."),
        C("snd_cwnd", "INTEGER", True, "segments", "Congestion window (tcp_probe rows)."),
    ), indexes=(("timestamp_ns",),)),
    Table("sched_events", "Scheduler spans of traced threads above the capture threshold.", (
        _id(),
        C("timestamp_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC",
          "Span start: wakeup (runq_delay) or switch-out (off_cpu)."),
        C("duration_ns", "INTEGER", False, "ns", "Span length."),
        C("kind", "TEXT", False, "", "runq_delay: runnable but waiting for a CPU; "
          "off_cpu: switched out until switched in again.", SCHED_KINDS),
        _PID, _TID,
        C("comm", "TEXT", True, "", "Thread name of the traced thread."),
        C("cpu", "INTEGER", True, "", "CPU the span ended on."),
        C("prev_state", "TEXT", True, "", "off_cpu: state at switch-out (R = preempted, "
          "S = sleeping, D = uninterruptible)."),
        C("other_pid", "INTEGER", True, "", "Process that held the CPU (runq_delay: the task "
          "switched out when this thread got the CPU)."),
        C("other_tid", "INTEGER", True, "", "Thread that held the CPU."),
        C("other_comm", "TEXT", True, "", "Name of the thread that held the CPU."),
    ), indexes=(("timestamp_ns",),)),
    Table("block_events", "Block I/O requests, issue to completion.", (
        _id(),
        C("timestamp_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "Issue to the device driver."),
        C("duration_ns", "INTEGER", False, "ns", "Issue to completion."),
        C("device", "TEXT", False, "", "Disk name (e.g. nvme0n1) or MAJOR:MINOR when unnamed."),
        C("sector", "INTEGER", True, "512-byte sectors", "Start sector; NULL for a "
          "request without one (a cache flush, a passthrough command)."),
        C("bytes", "INTEGER", False, "bytes", "Request size."),
        C("op", "TEXT", False, "", "Direction.", BLOCK_OPS),
        C("rwbs", "TEXT", True, "", "Kernel rwbs flags string, e.g. WS."),
        C("pid", "INTEGER", True, "", "Process whose request it is: the one current where "
          "the request was created (kernel 6.5+: the submitter of direct I/O and page-fault "
          "reads, a kworker for writeback); where that was not seen (an older kernel, a "
          "flush sequence's own request), the one current at issue."),
        C("tid", "INTEGER", True, "", "Thread whose request it is (as pid)."),
        C("comm", "TEXT", True, "", "Name of that thread."),
        C("error", "INTEGER", True, "", "Completion error (0 = success)."),
    ), indexes=(("timestamp_ns",),)),
    Table("host_samples", "Host and GPU counters in long form: one row per sample, metric "
          "and device. Metric names are listed in the spec; readers ignore unknown metrics.", (
        _id(), C("timestamp_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "Sample time."),
        C("metric", "TEXT", False, "", "Metric name, unit in the suffix (see the catalogue)."),
        C("device", "TEXT", True, "", "CPU (cpu3), disk, NIC or GPU index; NULL = whole node."),
        C("value", "REAL", False, "per metric", "Value in the metric's unit."),
    ), indexes=(("metric", "timestamp_ns"),)),
    Table("clock_samples", "Clock readings that map this node's CLOCK_MONOTONIC to UTC.", (
        _id(),
        C("source", "TEXT", False, "", "system: clock_gettime bracket + adjtimex; chrony: "
          "chronyd tracking; ptp: a PTP hardware clock read.", CLOCK_SOURCES),
        C("mono_before_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "Monotonic read before."),
        C("mono_after_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "Monotonic read after."),
        C("realtime_ns", "INTEGER", True, "ns since 1970 UTC", "CLOCK_REALTIME read inside the "
          "bracket (system, chrony, ptp rows)."),
        C("boottime_ns", "INTEGER", True, "ns", "CLOCK_BOOTTIME read inside the bracket."),
        C("tai_ns", "INTEGER", True, "ns", "CLOCK_TAI read inside the bracket."),
        C("uncertainty_ns", "INTEGER", False, "ns", "Read uncertainty: the bracket width."),
        C("synchronized", "INTEGER", True, "", "1 if the kernel says the clock is synchronized "
          "(adjtimex STA_UNSYNC clear and state != TIME_ERROR), 0 if it says it is not, "
          "NULL if the writer does not know (weighted like 0 by the merge)."),
        C("adj_offset_ns", "INTEGER", True, "ns", "adjtimex offset (remaining correction)."),
        C("adj_freq_ppb", "REAL", True, "ppb", "adjtimex frequency correction."),
        C("adj_maxerror_ns", "INTEGER", True, "ns", "adjtimex maxerror (claimed worst-case error)."),
        C("adj_esterror_ns", "INTEGER", True, "ns", "adjtimex esterror (estimated error)."),
        C("adj_status", "INTEGER", True, "", "adjtimex status bits (STA_*)."),
        C("adj_tai_s", "INTEGER", True, "s", "TAI - UTC offset the kernel knows."),
        C("ref_offset_ns", "INTEGER", True, "ns", "chrony: system time minus reference time "
          "(positive = system clock ahead); ptp: PHC minus CLOCK_REALTIME."),
        C("root_delay_ns", "INTEGER", True, "ns", "chrony root delay."),
        C("root_dispersion_ns", "INTEGER", True, "ns", "chrony root dispersion."),
        C("leap_status", "TEXT", True, "", "chrony leap status (Normal, Insert second, ...)."),
        C("device", "TEXT", True, "", "ptp: /dev/ptpN; chrony: reference id."),
    )),
    Table("processes", "Traced processes with their rank environment (allow-listed names only).", (
        _id(), _PID,
        C("start_boottime_ns", "INTEGER", True, "ns since boot",
          "Process start (/proc/PID/stat starttime); with pid it names the process uniquely."),
        C("comm", "TEXT", True, "", "Process name."),
        C("exe", "TEXT", True, "", "Executable path."),
        C("cmdline", "TEXT", True, "", "Command line as a JSON array of strings."),
        C("rank", "INTEGER", True, "", "Global rank (RANK, OMPI_COMM_WORLD_RANK, PMI_RANK or SLURM_PROCID)."),
        C("local_rank", "INTEGER", True, "", "Local rank (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID)."),
        C("world_size", "INTEGER", True, "", "WORLD_SIZE."),
        C("local_world_size", "INTEGER", True, "", "LOCAL_WORLD_SIZE."),
        C("node_rank", "INTEGER", True, "", "GROUP_RANK, NODE_RANK or SLURM_NODEID."),
        C("job_id", "TEXT", True, "", "TORCHELASTIC_RUN_ID or SLURM_JOB_ID."),
        C("env", "TEXT", False, "", "JSON object of the allow-listed environment variables found."),
        C("first_seen_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "First seen by the capture."),
        C("last_seen_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "Last seen alive."),
        C("exit_ns", "INTEGER", True, "ns, CLOCK_MONOTONIC", "Exit time when seen."),
    )),
    Table("threads", "Threads of traced processes.", (
        _id(), _PID, _TID,
        C("comm", "TEXT", True, "", "Thread name."),
        C("first_seen_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "First seen."),
        C("last_seen_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "Last seen."),
    )),
    Table("stacks", "Symbolized user stacks, stored once per distinct stack within the bundle.", (
        C("stack_id", "INTEGER", False, "", "Stack id, unique within this bundle (rowid)."),
        C("frames", "TEXT", False, "", "JSON array of frame objects, innermost first "
          "(see the spec for the frame keys)."),
    )),
    Table("capture_log", "What the capture did: sources on/off with reasons, lost events, "
          "warnings, evictions.", (
        _id(), _TS,
        C("level", "TEXT", False, "", "Severity.", LOG_LEVELS),
        C("source", "TEXT", False, "", "capture, clock, host, nccl, cuda, tcp, sched, block, ..."),
        C("event", "TEXT", False, "", "source_on, source_off, lost_events, nothing_seen (a "
          "source, or the whole capture, that found nothing to trace: level warning), "
          "warning, eviction, recovered_spool, ..."),
        C("message", "TEXT", False, "", "Human-readable text, with the fix when there is one."),
        C("count", "INTEGER", True, "", "Count for lost_events and similar."),
    )),
    Table("calls_in_flight", "NCCL and CUDA calls that had an entry but no return when the "
          "segment was sealed or the capture stopped (a rank hung inside a collective or a "
          "synchronization). Added in 1.1: optional table.", (
        _id(),
        C("timestamp_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "Entry of the call."),
        C("observed_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC",
          "When the capture saw the call still open (the seal or the stop)."),
        C("why", "TEXT", False, "", "seal: the segment was sealed while the call was open "
          "(it may return in the next segment); stop: the capture stopped.", IN_FLIGHT_WHY),
        C("source", "TEXT", False, "", "nccl: a collective, p2p or communicator call; cuda: "
          "a CUDA call kept one by one.", ("nccl", "cuda")),
        C("api", "TEXT", False, "", "Function name, e.g. ncclAllReduce, ncclCommInitRank, "
          "cudaStreamSynchronize (for a collective entered as ncclBcast: ncclBroadcast)."),
        C("op", "TEXT", True, "", "NCCL collective or p2p operation, as nccl_events.op; "
          "NULL for other calls.", NCCL_OPS),
        C("comm_id_hash", "TEXT", True, "", "Communicator, as in nccl_events (for an init: "
          "the one being created); NULL if unknown or not NCCL."),
        C("seq", "INTEGER", True, "", "The collective's seq, as in nccl_events: the call is "
          "(comm_id_hash, seq). NULL for other calls."),
        C("rank", "INTEGER", True, "", "Rank in comm_id_hash's communicator, as in "
          "nccl_events; NULL if unknown."),
        C("nranks", "INTEGER", True, "", "Communicator size; NULL if unknown."),
        C("count", "INTEGER", True, "elements", "Element count argument (collectives)."),
        C("datatype", "TEXT", True, "", "As nccl_events.datatype.",
          tuple(n for n, _ in NCCL_DATATYPES)),
        C("peer", "INTEGER", True, "", "As nccl_events.peer."),
        C("stream", "INTEGER", True, "", "Stream argument, when the call has one."),
        C("bytes", "INTEGER", True, "bytes", "As nccl_events.bytes or cuda_events.bytes."),
        C("device", "INTEGER", True, "", "CUDA device ordinal, when known."),
        _PID, _TID, _STACK,
        Column("comm_handle", "INTEGER", True, "",
               "NCCL calls: the ncclComm_t, as nccl_events.comm_handle.", required=False),
        Column("handle_seq", "INTEGER", True, "",
               "A collective on a communicator created before the capture attached "
               "(comm_id_hash NULL): its handle_seq, as in nccl_events; the merge gives it "
               "the inferred comm_id_hash and seq like the stream's other calls.",
               required=False),
    ), indexes=(("pid", "tid", "timestamp_ns"),), required=False),
    Table("tcp_progress", "How far the traced processes' TCP connections had got, sampled "
          "at send and receive calls: the byte position of a call in the connection's "
          "stream. A connection opened while the capture ran is counted from its "
          "establishment; one established before it (a capture attached to a running job) "
          "from its first segment after a traced call, where the kernel has BTF (rows "
          "attached), and not at all without BTF. Both ends of a connection "
          "count the same bytes, so a receive that returned byte N on one node happened "
          "after the send that began copying byte N on another, and after any instant "
          "the sender had not sent byte N yet: the merge uses these pairs to bound the "
          "nodes' clocks (docs/merge.md). Sampled in the kernel: a call or segment that "
          "starts a burst (after 50 us of quiet on that end) at most once per "
          "--tcp-progress-interval per connection and kind, any call after ten "
          "intervals, and the calls that reach a grid of stream positions both ends "
          "share (docs/ebpf.md). Added in 1.1: optional table.", (
        _id(),
        C("timestamp_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC",
          "send: when the call began copying its bytes into the socket (its first "
          "tcp:tcp_sendmsg_locked; a writer that did not see it writes no row: the call's "
          "return comes after its first bytes may have arrived); recv: the "
          "call's return, when the bytes were in the process; arrive: when the kernel "
          "queued in-order data for the reader (sock:sk_data_ready, at the packet's "
          "arrival or, when the socket was busy, just after, however long the reader "
          "then waits for a CPU); unsent: when the "
          "sender took in a segment (tcp:tcp_probe, an ACK as a rule) with the bytes from "
          "stream_offset on still not sent (snd_nxt), however long ago the application "
          "wrote them."),
        C("direction", "TEXT", False, "", "send, recv, arrive (the bytes from "
          "stream_offset on, `bytes` of them, had arrived by then: the first one the "
          "reader had not read, and where the kernel's BTF gives tcp_sock.rcv_nxt and "
          "copied_seq, the rest up to rcv_nxt; else bytes is 1) or unsent (added in 1.1 "
          "after the others: the bytes from stream_offset on had not left the sender by "
          "then; bytes is 1; readers that do not know it must skip those rows).",
          TCP_DIRECTIONS),
        C("family", "INTEGER", False, "", "4 or 6."),
        C("saddr", "TEXT", False, "", "Local address as text (IPv4 dotted quad, IPv6 RFC "
          "5952; an IPv4-mapped IPv6 address as IPv4)."),
        C("sport", "INTEGER", False, "", "Local port."),
        C("daddr", "TEXT", False, "", "Remote address as text."),
        C("dport", "INTEGER", False, "", "Remote port."),
        C("connected_ns", "INTEGER", False, "ns, CLOCK_MONOTONIC", "When the connection "
          "was established on this node (attached: when the capture first saw a traced "
          "process use it): with the 4-tuple, which connection of that 4-tuple the row "
          "belongs to."),
        C("stream_offset", "INTEGER", False, "bytes", "Bytes the connection had carried in "
          "this direction since it was established, before this call (attached: from the "
          "socket's own counts; a sending end that opened the connection may count its "
          "SYN, one byte high)."),
        C("bytes", "INTEGER", False, "bytes", "Bytes this call moved (> 0)."),
        _PID, _TID,
        Column("attached", "INTEGER", True, "",
               "1: the connection was established before the capture counted it (a "
               "capture attached to a running job): connected_ns is when it was first "
               "seen, not its establishment, and the two ends' connected_ns do not "
               "match; 0 or NULL: counted from its establishment.", required=False),
    ), required=False),
)

TABLES_BY_NAME = {t.name: t for t in TABLES}

#: host_samples metrics: (name, unit, meaning). Rates are computed by the sampler over the
#: interval since its previous sample (the first sample of a rate has no row). Readers must
#: ignore metrics they do not know; new metrics may appear within format version 1.
HOST_METRICS: tuple[tuple[str, str, str], ...] = (
    ("cpu.busy_pct", "%", "Non-idle CPU time share over the interval (user, nice, system, irq, "
     "softirq, steal); device NULL = all CPUs, cpuN = one CPU."),
    ("cpu.iowait_pct", "%", "iowait share over the interval; device as cpu.busy_pct."),
    ("load.avg1", "tasks", "1-minute load average (/proc/loadavg)."),
    ("load.runnable", "tasks", "Runnable tasks (procs_running in /proc/stat)."),
    ("psi.cpu.some_pct", "%", "Share of the interval with some tasks stalled on CPU (PSI)."),
    ("psi.io.some_pct", "%", "Share of the interval with some tasks stalled on I/O."),
    ("psi.io.full_pct", "%", "Share of the interval with all non-idle tasks stalled on I/O."),
    ("psi.memory.some_pct", "%", "Share of the interval with some tasks stalled on memory."),
    ("psi.memory.full_pct", "%", "Share of the interval with all non-idle tasks stalled on memory."),
    ("mem.total_bytes", "bytes", "MemTotal."),
    ("mem.available_bytes", "bytes", "MemAvailable."),
    ("mem.dirty_bytes", "bytes", "Dirty page cache."),
    ("mem.swap_used_bytes", "bytes", "SwapTotal - SwapFree."),
    ("vm.pgmajfault_per_s", "1/s", "Major page faults per second (/proc/vmstat pgmajfault)."),
    ("vm.pgscan_per_s", "pages/s", "Pages scanned for reclaim (kswapd + direct)."),
    ("vm.pgsteal_per_s", "pages/s", "Pages reclaimed (kswapd + direct)."),
    ("vm.allocstall_per_s", "1/s", "Direct reclaim stalls per second."),
    ("vm.refault_bytes_per_s", "bytes/s", "Pages evicted and read again, in bytes "
     "(/proc/vmstat workingset_refault_anon + _file, times the page size): memory too "
     "small for what is in use."),
    ("psi.job.cpu.some_pct", "%", "As psi.cpu.some_pct, for the tasks of one cgroup v2 "
     "that traced processes live in and that is the job's own: its memory controller "
     "enabled there, or every process in it traced (its cpu.pressure; never the machine's "
     "root cgroup); device = the cgroup's path, as in /proc/PID/cgroup. The job's own "
     "pressure where the machine is shared."),
    ("psi.job.io.some_pct", "%", "As psi.io.some_pct, for one traced processes' cgroup "
     "(io.pressure); device as psi.job.cpu.some_pct."),
    ("psi.job.io.full_pct", "%", "As psi.io.full_pct, for one traced processes' cgroup."),
    ("psi.job.memory.some_pct", "%", "As psi.memory.some_pct, for one traced processes' "
     "cgroup (memory.pressure: reclaim, and reading again pages it had to give up)."),
    ("psi.job.memory.full_pct", "%", "As psi.memory.full_pct, for one traced processes' "
     "cgroup."),
    ("mem.job.usage_bytes", "bytes", "Memory charged to one memory cgroup that traced "
     "processes live in (memory.current, or v1 memory.usage_in_bytes); device = that "
     "cgroup's path: its v2 path where the v2 memory controller is enabled there, else its "
     "path in the v1 memory hierarchy (on a hybrid machine it may differ from the v2 "
     "path of the psi.job rows)."),
    ("mem.job.limit_bytes", "bytes", "That cgroup's memory limit: the lowest of its own "
     "and its parents' (memory.max, or v1 memory.limit_in_bytes and "
     "hierarchical_memory_limit); no row when none of them has one."),
    ("vm.job.pgmajfault_per_s", "1/s", "Major page faults per second of that cgroup "
     "(memory.stat pgmajfault)."),
    ("vm.job.refault_bytes_per_s", "bytes/s", "Pages of that cgroup evicted and read "
     "again, in bytes (memory.stat workingset_refault_anon + _file, times the page size; "
     "v1 memory.stat has them from about kernel 5.13): its working set does not fit."),
    ("tcp.retrans_segs_per_s", "segments/s", "TCP RetransSegs rate (/proc/net/snmp)."),
    ("tcp.out_segs_per_s", "segments/s", "TCP OutSegs rate."),
    ("net.rx_bytes_per_s", "bytes/s", "Received bytes; device = interface."),
    ("net.tx_bytes_per_s", "bytes/s", "Transmitted bytes; device = interface."),
    ("net.drops_per_s", "packets/s", "rx + tx drops; device = interface."),
    ("disk.read_bytes_per_s", "bytes/s", "Bytes read; device = disk (/proc/diskstats)."),
    ("disk.write_bytes_per_s", "bytes/s", "Bytes written; device = disk."),
    ("disk.busy_pct", "%", "Share of the interval with I/O in flight (io_ticks); device = disk."),
    ("disk.await_ms", "ms", "Mean request latency over the interval; device = disk."),
    ("gpu.util_pct", "%", "NVML GPU utilization; device = GPU index."),
    ("gpu.mem_util_pct", "%", "NVML memory controller utilization."),
    ("gpu.mem_used_bytes", "bytes", "GPU memory used."),
    ("gpu.sm_clock_mhz", "MHz", "Current SM clock."),
    ("gpu.max_sm_clock_mhz", "MHz", "Maximum SM clock."),
    ("gpu.temp_c", "degC", "GPU temperature."),
    ("gpu.power_w", "W", "Power draw."),
    ("gpu.throttle_reasons", "bitmask", "nvmlClocksThrottleReasons bitmask (0 = none)."),
    ("gpu.pcie_rx_bytes_per_s", "bytes/s", "PCIe receive throughput."),
    ("gpu.pcie_tx_bytes_per_s", "bytes/s", "PCIe transmit throughput."),
    ("capture.cpu_pct", "%", "CPU time of the capture process itself over the interval "
     "(every thread, user + system), % of one CPU: what tracing cost the node, BPF "
     "programs' in-kernel run time excluded."),
    ("capture.bpf_cpu_pct", "%", "In-kernel run time of the capture's BPF programs over "
     "the interval (their run_time_ns), % of one CPU: the probes' cost, paid by the traced "
     "threads and the kernel, not in capture.cpu_pct. Only where kernel.bpf_stats_enabled "
     "is 1 (off by default)."),
)
#: Keys of the objects in stacks.frames: (key, JSON type, meaning). Every key is optional
#: in a frame; readers ignore keys they do not know.
STACK_FRAME_KEYS: tuple[tuple[str, str, str], ...] = (
    ("ip", "string", "Instruction address, \"0x\" + lowercase hex (for frames other than "
     "the innermost: the return address)."),
    ("module", "string", "Path of the mapped file that contains ip, as in /proc/PID/maps."),
    ("module_offset", "string", "ip minus the module's load bias, \"0x\" + lowercase hex: "
     "the same on every node that runs the same binary, usable for offline symbolization."),
    ("build_id", "string", "GNU build-id of the module, lowercase hex."),
    ("symbol", "string", "Function name, demangled."),
    ("symbol_offset", "integer", "ip minus the start of the symbol, bytes."),
    ("file", "string", "Source file, when debug information resolved it."),
    ("line", "integer", "Source line in file."),
    ("py_file", "string", "Python frame: the code object's file name."),
    ("py_func", "string", "Python frame: the function's qualified name."),
    ("py_line", "integer", "Python frame: the line number."),
    ("name", "string", "A function name whose kind (Python or native) the writer does not "
     "know; a frame with symbol or py_func does not need it. Readers show it as they show "
     "symbol."),
)

#: Rows of the meta table: (key, JSON type, required, meaning). Values are JSON text.
#: Every manifest key other than magic, tables and database is mirrored here with an equal
#: value, so the sha256-protected database vouches for the whole manifest.
META_FIELDS: tuple[tuple[str, str, bool, str], ...] = (
    ("format_version", "integer", True, "Bundle format version; equals the manifest's."),
    ("node", "string", True, "Node name; equals the manifest's."),
    ("host", "object", True, "Host facts; equals the manifest's host object."),
    ("segment", "object", True, "Equals the manifest's segment object. A live spool holds "
     "index and id only; sealing adds the rest."),
    ("capture", "object", True, "Equals the manifest's capture object. A live spool holds "
     "start_utc_ns and start_mono_ns only; sealing adds the end (estimated from the newest "
     "row when a crashed spool is recovered)."),
    ("created_by", "string", False, "Equals the manifest's created_by when that is present."),
    ("job_ids", "array", False, "Equals the manifest's job_ids when that is present."),
)

#: Tables whose rows carry a timestamp_ns in CLOCK_MONOTONIC (events, in the broad sense).
EVENT_TABLES = ("nccl_events", "nccl_comm_events", "cuda_events", "tcp_events",
                "sched_events", "block_events")
#: Tables whose row counts the manifest carries (all but meta).
MANIFEST_TABLES = tuple(t.name for t in TABLES if t.name != "meta")
#: Tables a version-1.0 bundle has (the others are optional: added within version 1).
REQUIRED_TABLES = tuple(t.name for t in TABLES if t.required)
#: Keys the meta table must hold (see the spec).
META_KEYS = tuple(k for k, _, required, _ in META_FIELDS if required)


def _column_ddl(table: Table, col: Column) -> str:
    if col is table.columns[0] and col.name in ("id", "stack_id"):
        return f"{col.name} INTEGER PRIMARY KEY"
    parts = [col.name, col.type]
    if not col.nullable:
        parts.append("NOT NULL")
    # Enumerated values are documented, not CHECKed: CHECK (x IN (...)) costs the writer
    # two thirds of its insert rate, and the merge validates enums on untrusted input.
    return " ".join(parts)


def table_ddl(table: Table) -> str:
    if table.name == "meta":
        return "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
    cols = ",\n  ".join(_column_ddl(table, c) for c in table.columns)
    return f"CREATE TABLE {table.name} (\n  {cols}\n)"


def bundle_ddl(with_indexes: bool = False) -> list[str]:
    """Statements that create an empty format-1 bundle database.

    Indexes are optional in a bundle (the spec allows them, the reader ignores them);
    the writer leaves them out so the live segment stays cheap to append to.
    """
    stmts = [f"PRAGMA application_id = {APPLICATION_ID}",
             f"PRAGMA user_version = {FORMAT_VERSION}"]
    stmts += [table_ddl(t) for t in TABLES]
    if with_indexes:
        for t in TABLES:
            for cols in t.indexes:
                stmts.append(f"CREATE INDEX {t.name}_{'_'.join(cols)} ON {t.name}({', '.join(cols)})")
    return stmts


def insert_sql(table: str, columns: tuple[str, ...] | None = None) -> str:
    t = TABLES_BY_NAME[table]
    cols = columns or t.data_columns
    return f"INSERT INTO {t.name} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
