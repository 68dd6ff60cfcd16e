"""The fleet.db schema, version 1: every table and column ingero-merge writes.

Derived from the bundle catalogue (``bundle/schema.py``): every bundle table keeps its
name and columns and gains ``node_id`` and ``bundle_id``; time points are rewritten to
aligned fleet time (UTC ns) with the raw CLOCK_MONOTONIC kept in ``mono_ns``. The
fleet-only tables (nodes, bundles, stacks, clock_alignment, sync_points, collectives,
merge_log, fleet_info) are declared here too. docs/fleet-db.md carries the section
rendered by ``render_markdown`` (a test keeps the two identical). Only the merge creates
or alters these tables; export and report read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bundle.schema import TABLES as BUNDLE_TABLES
from ..bundle.schema import NOT_EVENTS, Column, C

#: 2: clock_alignment causal bounds, collectives.completion_tight, sync_points.tight,
#: cuda_events queued work (bundle format 1.1). 3: calls_in_flight (bundle format 1.1).
#: 4: host_bins, job_block_io, sync_waits (merge/summaries.py), inferred_comms (late
#: attach). 5: event_stats.observed_ns (sampled launch counts). 6: tcp_progress (bundle
#: format 1.1), clock_alignment.message_pairs. 7: tcp_progress.attached (connections a
#: capture attached to). An older fleet.db is not extended: merge its bundles again.
FLEET_VERSION = 7
#: PRAGMA application_id of a fleet database: ASCII "INGM".
FLEET_APPLICATION_ID = 0x494E474D

#: Bundle columns whose unit is a CLOCK_MONOTONIC point in time are aligned in fleet.db,
#: except clock_samples, whose brackets are the raw input of the alignment.
MONO_UNIT = "ns, CLOCK_MONOTONIC"
RAW_TIME_TABLES = ("clock_samples",)
ALIGNED_UNIT = "ns since 1970 UTC, aligned"


@dataclass(frozen=True)
class FleetTable:
    name: str
    doc: str
    columns: tuple[Column, ...]
    #: indexes created after the bulk load (column tuples)
    indexes: tuple[tuple[str, ...], ...] = ()
    #: extra table constraints (UNIQUE, PRIMARY KEY) as DDL fragments
    constraints: tuple[str, ...] = ()
    #: True for tables copied from bundles (same name and columns as in a bundle)
    from_bundle: bool = False
    #: stored in its primary key's order (a WITHOUT ROWID table)
    without_rowid: bool = False

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)


def time_point_columns(table_name: str) -> tuple[str, ...]:
    """Bundle columns of this table that hold a CLOCK_MONOTONIC time point (aligned here)."""
    if table_name in RAW_TIME_TABLES:
        return ()
    t = next(t for t in BUNDLE_TABLES if t.name == table_name)
    return tuple(c.name for c in t.columns if c.unit == MONO_UNIT)


_NODE = C("node_id", "INTEGER", False, "", "The node the row came from (nodes.node_id).")
_BUNDLE = C("bundle_id", "INTEGER", False, "", "The bundle the row came from (bundles.bundle_id).")


def _fleet_column(table_name: str, col: Column, aligned: tuple[str, ...]) -> Column:
    if col.name == "id":
        return C("id", "INTEGER", False, "", "Row id, unique in fleet.db (a new rowid; the "
                 "bundle's local id is not kept).")
    if col.name == "stack_id" and table_name != "stacks":
        return C("stack_id", col.type, True, "",
                 "Fleet stack (stacks.stack_id); NULL when not captured.")
    if col.name in aligned:
        doc = col.doc.rstrip(".") + ". Aligned fleet time (see clock_alignment)"
        if col.name == aligned[0]:
            doc += "; the raw CLOCK_MONOTONIC value is in mono_ns"
        return Column(col.name, col.type, col.nullable, ALIGNED_UNIT, doc + ".", col.values)
    if table_name == "nccl_events" and col.name == "duration_ns":
        return C("duration_ns", "INTEGER", False, "ns",
                 "The collective as the rank experienced it: entry (timestamp_ns) to the "
                 "collective's observed completion (completion_ns) when that is known and "
                 "later than the call's return; otherwise the host call duration "
                 "(call_duration_ns).")
    return col


def _extras(table_name: str, aligned: tuple[str, ...]) -> tuple[Column, ...]:
    cols = [_NODE, _BUNDLE]
    if aligned:
        cols.append(C("mono_ns", "INTEGER", False,
                      MONO_UNIT, f"Raw {aligned[0]} as recorded by the node (CLOCK_MONOTONIC "
                      "of its boot), before alignment."))
    if table_name == "nccl_events":
        cols.append(C("call_duration_ns", "INTEGER", False, "ns",
                      "Entry to return of the host call, as in the bundle (the enqueue time)."))
        cols.append(C("completion_ns", "INTEGER", True, ALIGNED_UNIT,
                      "Observed completion of the collective (collectives.completion_ns for "
                      "its comm_id_hash and seq); NULL when no rank observed it."))
    if table_name == "clock_samples":
        cols.append(C("aligned_ns", "INTEGER", True, ALIGNED_UNIT,
                      "Aligned fleet time of the bracket midpoint "
                      "(mono_before_ns + mono_after_ns) / 2."))
        cols.append(C("clock_error_ns", "INTEGER", True, "ns",
                      "realtime_ns - aligned_ns: how far the node's CLOCK_REALTIME was from "
                      "fleet time by the merge's estimate; NULL without realtime_ns."))
    return tuple(cols)




#: Tables read as per-thread timelines, which get a (node_id, pid, tid, timestamp_ns) index.
THREAD_TIMELINES = ("nccl_events", "cuda_events", "sched_events")


def _bundle_derived() -> list[FleetTable]:
    out = []
    for t in BUNDLE_TABLES:
        if t.name == "stacks":
            continue  # the fleet has one content-addressed stacks table (below)
        if t.name == "meta":
            out.append(FleetTable("meta", "Key/value facts of every merged segment (the "
                                  "bundle's meta table), one set per bundle.", (
                _BUNDLE, _NODE,
                C("key", "TEXT", False, "", "Key."),
                C("value", "TEXT", False, "", "Value, JSON as in the bundle."),
            ), constraints=("PRIMARY KEY (bundle_id, key)",), from_bundle=True))
            continue
        aligned = time_point_columns(t.name)
        cols = tuple(_fleet_column(t.name, c, aligned) for c in t.columns) + _extras(t.name, aligned)
        # No plain node_id index on the big tables: a handful of distinct values does not
        # pay for an index over millions of rows (filters on node_id scan or use ix below).
        idx = [("node_id",)] if t.name in ("processes", "threads", "clock_samples",
                                            "capture_log", "nccl_comm_events") else []
        for ix in t.indexes:
            if t.name == "nccl_events" and ix == ("comm_id_hash", "seq"):
                # The report's lateness reads each collective's entries as (node, entry
                # time): from the index alone, not from every node's pages of the table
                # (64 nodes: 1.4 s instead of 3.5 s; the wider index builds in the same
                # time, 8-9 s there). It still serves (comm_id_hash, seq) lookups.
                ix = ix + ("node_id", "timestamp_ns")
            idx.append(("node_id",) + ix if "pid" in ix else ix)
        # Per-thread timelines, read node by node (ingero-export): without these, every
        # node's read scans the whole table (measured: 2.3x slower per node at 16 nodes).
        if t.name in THREAD_TIMELINES and ("node_id", "pid", "tid", "timestamp_ns") not in idx:
            idx.append(("node_id", "pid", "tid", "timestamp_ns"))
        out.append(FleetTable(t.name, t.doc, cols, tuple(idx), from_bundle=True))
    return out


FLEET_ONLY: tuple[FleetTable, ...] = (
    FleetTable("fleet_info", "Facts about the fleet database itself.", (
        C("key", "TEXT", False, "", "format_version, created_by, created_utc, updated_utc, "
          "alignment (JSON parameters of the last alignment, including sample_step: the k of "
          "sync_points), host_bins (JSON t0_ns and bin_ns of host_bins; absent without "
          "collectives)."),
        C("value", "TEXT", False, "", "Value; JSON for structured values."),
    ), constraints=("PRIMARY KEY (key)",)),
    FleetTable("nodes", "One row per node: a (claimed name, hostname, boot_id) triple. Two "
               "bundles claiming the same name from different hosts or boots are distinct "
               "nodes with distinct names.", (
        C("node_id", "INTEGER", False, "", "Node id (rowid)."),
        C("name", "TEXT", False, "", "Unique display name: the claimed name, suffixed #2, #3, "
          "... when another host or boot already holds it (a warning is logged)."),
        C("claimed_name", "TEXT", False, "", "The node name the bundles' manifests claim."),
        C("hostname", "TEXT", False, "", "host.hostname from the manifest."),
        C("boot_id", "TEXT", False, "", "host.boot_id: CLOCK_MONOTONIC is valid within it."),
        C("kernel_release", "TEXT", True, "", "host.kernel_release."),
        C("tool_version", "TEXT", True, "", "host.tool_version of the capture."),
        C("ranks", "TEXT", False, "", "JSON array of the node's global ranks, sorted: per "
          "traced process its rank environment (processes.rank) when captured, else its "
          "rank in the largest communicator it joined (split communicators' ranks are "
          "local to them and never listed here)."),
        C("job_ids", "TEXT", False, "", "JSON array of the distinct job ids (processes.job_id "
          "and manifest job_ids), sorted."),
        C("bundles", "INTEGER", False, "", "Number of bundles merged for this node."),
        C("first_utc_ns", "INTEGER", True, ALIGNED_UNIT, "Earliest capture start over its "
          "bundles, aligned."),
        C("last_utc_ns", "INTEGER", True, ALIGNED_UNIT, "Latest capture end, aligned."),
        C("first_mono_ns", "INTEGER", True, MONO_UNIT, "Earliest capture start, raw."),
        C("last_mono_ns", "INTEGER", True, MONO_UNIT, "Latest capture end, raw."),
    ), constraints=("UNIQUE (name)", "UNIQUE (claimed_name, hostname, boot_id)")),
    FleetTable("bundles", "One row per merged bundle (segment). A bundle whose database "
               "sha256 is already here is not merged again.", (
        C("bundle_id", "INTEGER", False, "", "Bundle id (rowid)."),
        C("node_id", "INTEGER", False, "", "Its node."),
        C("file_name", "TEXT", False, "", "Base name of the file it was merged from."),
        C("sha256", "TEXT", False, "", "database.sha256 of the manifest: the SQLite image's "
          "hash, verified on open; identity for idempotent merges."),
        C("segment_id", "TEXT", False, "", "segment.id (UUID hex)."),
        C("segment_index", "INTEGER", False, "", "segment.index: 0, 1, ... within a capture."),
        C("recovered", "INTEGER", False, "", "1 if the segment was sealed after a crash."),
        C("size", "INTEGER", False, "bytes", "Size of the .bundle file."),
        C("db_size", "INTEGER", False, "bytes", "Size of the SQLite image."),
        C("capture_start_mono_ns", "INTEGER", False, MONO_UNIT, "capture.start_mono_ns."),
        C("capture_end_mono_ns", "INTEGER", False, MONO_UNIT, "capture.end_mono_ns."),
        C("capture_start_utc_ns", "INTEGER", False, "ns since 1970 UTC, as claimed",
          "capture.start_utc_ns (the node's CLOCK_REALTIME, not aligned)."),
        C("merged_utc", "TEXT", False, "", "When it was merged (ISO 8601, UTC)."),
        C("rows", "TEXT", False, "", "JSON object: rows written to fleet.db per table; "
          "stacks: the bundle's stacks, each mapped to a fleet stack (fleet.db keeps one "
          "row per distinct stack)."),
        C("skipped_rows", "TEXT", False, "", "JSON object: rows not merged per table "
          "(invalid enum value, NULL in a required column, non-integer time); see merge_log."),
        C("manifest", "TEXT", False, "", "The bundle's manifest, JSON."),
    ), indexes=(("node_id",),), constraints=("UNIQUE (sha256)",)),
    FleetTable("stacks", "Symbolized user stacks, once per distinct canonical stack in the "
               "fleet (content-addressed).", (
        C("stack_id", "INTEGER", False, "", "Fleet stack id (rowid)."),
        C("hash", "TEXT", False, "", "sha256 (64 hex digits) of frames; on the (never yet "
          "seen) event of two different stacks with one hash, the second gets the suffix "
          "-2, -3, ...: stacks are compared by content before they are shared."),
        C("frames", "TEXT", False, "", "Canonical frames, JSON array innermost first, each "
          "an object with only module (base name), symbol, offset, file (base name), line "
          "where known; raw addresses and directories are dropped."),
        C("depth", "INTEGER", False, "", "Number of frames."),
    ), constraints=("UNIQUE (hash)",)),
    FleetTable("clock_alignment", "Per node: how its CLOCK_MONOTONIC maps to fleet time. "
               "aligned = offset_ns + mono + round(mono * slope). See docs/merge.md.", (
        C("node_id", "INTEGER", False, "", "The node (primary key)."),
        C("method", "TEXT", False, "", "collectives: clock samples plus cross-node tight "
          "completion observations; clock_samples: the node's own clock samples only "
          "(consistent with the causal bounds); causal: its line broke the causal bounds "
          "(an entry after an observed completion) and was moved to the nearest "
          "consistent line, a choice within the feasible band; manifest: only the "
          "capture start/end pairs of the manifests (no error bound).",
          ("collectives", "clock_samples", "causal", "manifest")),
        C("offset_ns", "INTEGER", False, ALIGNED_UNIT, "Fleet time of mono = 0."),
        C("slope", "REAL", False, "", "Rate correction: aligned advances 1 + slope ns per "
          "monotonic ns."),
        C("drift_ppm", "REAL", False, "ppm", "Estimated rate error of the node's monotonic "
          "clock against the fleet's time axis (not UTC: a rate error every node shares "
          "is not seen), (1 / (1 + slope) - 1) * 1e6: positive = it runs fast. 0 when "
          "not observable (method clock_samples or manifest)."),
        C("uncertainty_ns", "INTEGER", True, "ns", "Bound on |aligned - true UTC| over the "
          "node's capture: the common-mode bound the honest clock claims allow plus the "
          "node's relative uncertainty; NULL when nothing bounds it (method manifest)."),
        C("relative_uncertainty_ns", "INTEGER", True, "ns", "Bound on the node's error "
          "relative to the other nodes: for method collectives, from the spread of its "
          "tight completion residuals; otherwise the room the causal bounds leave it "
          "(the larger of causal_early_ns and causal_late_ns); for a node the TCP "
          "messages tie to every other node both ways (message_pairs), the bound they "
          "give (docs/merge.md, step 5); NULL when nothing bounds it on one side."),
        C("component", "INTEGER", True, "", "Nodes with the same component are linked by "
          "shared collectives (the smallest node_id of the component); NULL when alone."),
        C("sync_points", "INTEGER", False, "", "Observed completions of this node "
          "in the alignment's sample (every k-th seq) matched with another node."),
        C("sync_points_used", "INTEGER", False, "", "Of those, the ones within "
          "5 residual_ns (at least 20 us) of their collective's consensus."),
        C("residual_ns", "INTEGER", True, "ns", "Robust spread (1.4826 x MAD) of this node's "
          "completion residuals after alignment."),
        C("violations_before", "INTEGER", False, "", "Clock-condition violations with the "
          "clock-sample estimate alone: observed completions earlier than the collective's "
          "latest entry plus min_latency_ns (fleet_info alignment)."),
        C("violations_after", "INTEGER", False, "", "The same after the final alignment."),
        C("clock_samples", "INTEGER", False, "", "clock_samples rows used."),
        C("steps", "INTEGER", False, "", "Clock steps detected in CLOCK_REALTIME - "
          "CLOCK_MONOTONIC (NTP steps)."),
        C("claimed_error_ns", "INTEGER", True, "ns", "Median claimed error bound of the "
          "node's clock samples (adjtimex maxerror; chrony |offset| + root dispersion + "
          "root delay / 2); NULL when none is claimed."),
        C("max_correction_ns", "INTEGER", True, "ns", "Largest |realtime - aligned| over "
          "the node's clock samples (how much the merge moved the node's own clock)."),
        C("exceeds_claim", "INTEGER", False, "", "1 when the correction exceeds the node's "
          "own claimed bound by more than the fleet evidence allows: its time service is "
          "lying. Its claims are then not used for any uncertainty."),
        C("segments", "TEXT", False, "", "JSON array of the piecewise segments of "
          "CLOCK_REALTIME - CLOCK_MONOTONIC between steps: {mono_start_ns, mono_end_ns, "
          "samples, offset_ns (median realtime - mono), claimed_error_ns}."),
        C("causal_early_ns", "INTEGER", True, "ns", "How much earlier the node's line "
          "could be (at either end of its capture, the others fixed) and still have every "
          "entry into a full-dependency collective before every observed completion, and "
          "every TCP send before the receive of its bytes (message_pairs); NULL: nothing bounds it that way."),
        C("causal_late_ns", "INTEGER", True, "ns", "The same, later."),
        C("causal_moved_ns", "INTEGER", False, "ns", "How far the causal bounds moved the "
          "line (0: it satisfied them)."),
        C("rate_clamped", "INTEGER", False, "", "1 when the fitted rate exceeded the "
          "drift bound (fleet_info alignment drift_bound_ppm) and was clamped to it."),
        C("message_pairs", "INTEGER", False, "", "TCP send/receive pairs between this "
          "node's clock and another's among the causal bounds (tcp_progress: the tightest "
          "per node pair and time bin; 0 without such rows). They bound the line like the "
          "collectives do, usually far more tightly."),
    ), constraints=("PRIMARY KEY (node_id)",)),
    FleetTable("sync_points", "Observed completions in the alignment's sample: per waiting "
               "synchronization, the last collective the same thread enqueued before it, for "
               "the collectives whose seq is a multiple of the sampling step k (about 5000 "
               "collectives in all). Every observation, sampled or not, counts in "
               "collectives.completion_ns and in clock_alignment's violations; they are "
               "recomputed from nccl_events and cuda_events when bundles are added.", (
        C("id", "INTEGER", False, "", "Row id."),
        C("node_id", "INTEGER", False, "", "The node."),
        C("bundle_id", "INTEGER", False, "", "The bundle."),
        C("comm_id_hash", "TEXT", False, "", "Collective identity (with seq)."),
        C("seq", "INTEGER", False, "", "Collective identity (with comm_id_hash)."),
        C("pid", "INTEGER", False, "", "Process."),
        C("tid", "INTEGER", False, "", "Thread."),
        C("mono_ns", "INTEGER", False, MONO_UNIT, "End of the synchronization, raw (its "
          "aligned time: clock_alignment.offset_ns + mono_ns + round(mono_ns * slope) of "
          "the node)."),
        C("wait_ns", "INTEGER", False, "ns", "Duration of the synchronization."),
        C("used", "INTEGER", False, "", "1 if it is tight and agrees with the collective's "
          "completion within 50 us (and another tight observation exists)."),
        C("tight", "INTEGER", False, "", "1 if nothing substantial was queued between the "
          "collective and this synchronization (cuda_events.queued_ops), so its end "
          "stands for the completion; 0: it only bounds the completion from above."),
    ), indexes=(("comm_id_hash", "seq"),)),
    FleetTable("collectives", "One row per collective (comm_id_hash, seq) over all ranks: "
               "entries, the last rank in, and the observed completion.", (
        C("collective_id", "INTEGER", False, "", "Row id."),
        C("comm_id_hash", "TEXT", False, "", "Communicator."),
        C("seq", "INTEGER", False, "", "Call number in the communicator."),
        C("op", "TEXT", False, "", "Operation (the smallest name if ranks disagree; see op_mismatch).",
          None),
        C("op_mismatch", "INTEGER", False, "", "1 if ranks recorded different ops or sizes "
          "for this (comm_id_hash, seq)."),
        C("nranks", "INTEGER", True, "", "Communicator size (largest recorded)."),
        C("ranks_seen", "INTEGER", False, "", "Distinct ranks with an nccl_events row for it "
          "(distinct processes where rows have no rank: a communicator inferred after a "
          "late attach)."),
        C("bytes", "INTEGER", True, "bytes", "Largest bytes recorded."),
        C("first_entry_ns", "INTEGER", False, ALIGNED_UNIT, "Earliest entry over ranks."),
        C("last_entry_ns", "INTEGER", False, ALIGNED_UNIT, "Latest entry over ranks."),
        C("entry_spread_ns", "INTEGER", False, "ns", "last_entry_ns - first_entry_ns: how "
          "long the earliest rank waited for the last one to arrive."),
        C("last_rank", "INTEGER", True, "", "Rank of the last entry (the straggler)."),
        C("last_node_id", "INTEGER", False, "", "Node of the last entry."),
        C("completion_ns", "INTEGER", True, ALIGNED_UNIT, "Mean of the aligned tight "
          "observed completions (sync_points.tight) of this collective without the "
          "lowest and highest when there are 3 or more; without a tight one, the "
          "earliest observation (an upper bound: work queued after the collective "
          "delayed it); NULL if none was observed."),
        C("completion_observations", "INTEGER", False, "", "Number of observations "
          "completion_ns comes from (the tight ones, or all when none is tight)."),
        C("completion_tight", "INTEGER", False, "", "Number of tight observations (0: "
          "completion_ns is an upper bound)."),
        C("completion_spread_ns", "INTEGER", True, "ns", "Max - min of those aligned "
          "observations."),
    ), indexes=(("first_entry_ns",), ("last_node_id",)),
       constraints=("UNIQUE (comm_id_hash, seq)",)),
    FleetTable("host_bins", "host_samples summed per node, metric, device and time bin of "
               "the report (merge/summaries.py): the report's host figures read these "
               "instead of every sample. Bins: fleet_info key host_bins gives t0_ns (the "
               "first collective's entry) and bin_ns; a sample at t >= t0_ns is in bin "
               "(t - t0_ns) / bin_ns, one before t0_ns in bin -1 - (t0_ns - t) / bin_ns. "
               "Only the metrics the report reads, and of cpu.* metrics only the "
               "whole-node rows (device NULL). Rewritten by every merge.", (
        C("metric", "TEXT", False, "", "host_samples.metric."),
        C("node_id", "INTEGER", False, "", "The node."),
        C("device", "TEXT", True, "", "host_samples.device (NULL = whole node)."),
        C("bin", "INTEGER", False, "", "Time bin (see above)."),
        C("samples", "INTEGER", False, "", "Number of samples."),
        C("total", "REAL", False, "per metric", "SUM(value): the mean over bins i to j is "
          "SUM(total) / SUM(samples)."),
        C("positive", "INTEGER", False, "", "Samples with value > 0 (gpu.throttle_reasons: "
          "throttled)."),
        C("lo", "REAL", False, "per metric", "MIN(value)."),
        C("hi", "REAL", False, "per metric", "MAX(value)."),
    ), indexes=(("metric", "bin"),)),
    FleetTable("job_block_io", "The block requests of the job's own processes (issued by "
               "a traced process or one of its threads: processes, threads), in node and "
               "time order: the columns ingero-report's block I/O figures read "
               "(merge/summaries.py). Rewritten by every merge.", (
        C("node_id", "INTEGER", False, "", "The node."),
        C("timestamp_ns", "INTEGER", False, ALIGNED_UNIT, "block_events.timestamp_ns."),
        C("block_id", "INTEGER", False, "", "block_events.id."),
        C("duration_ns", "INTEGER", False, "ns", "block_events.duration_ns."),
    ), constraints=("PRIMARY KEY (node_id, timestamp_ns, block_id)",), without_rowid=True),
    FleetTable("sync_waits", "Waits of the traced processes for their own GPU work: the "
               "cuda_events rows of cudaEventSynchronize, cuEventSynchronize, "
               "cudaDeviceSynchronize and cuCtxSynchronize with a duration, per process in "
               "row order: the columns ingero-report's GPU wait figure reads "
               "(merge/summaries.py). Rewritten by every merge.", (
        C("node_id", "INTEGER", False, "", "The node."),
        C("pid", "INTEGER", False, "", "cuda_events.pid."),
        C("cuda_id", "INTEGER", False, "", "cuda_events.id."),
        C("timestamp_ns", "INTEGER", False, ALIGNED_UNIT, "cuda_events.timestamp_ns."),
        C("duration_ns", "INTEGER", False, "ns", "cuda_events.duration_ns."),
    ), constraints=("PRIMARY KEY (node_id, pid, cuda_id)",), without_rowid=True),
    FleetTable("merge_log", "What the merge did: inputs skipped and why, rows skipped, "
               "node name conflicts, already-merged bundles, liar clocks.", (
        C("id", "INTEGER", False, "", "Row id."),
        C("merged_utc", "TEXT", False, "", "When (ISO 8601, UTC)."),
        C("level", "TEXT", False, "", "Severity.", ("info", "warning", "error")),
        C("input", "TEXT", True, "", "The input file concerned, if any."),
        C("node_id", "INTEGER", True, "", "The node concerned, if any."),
        C("event", "TEXT", False, "", "skipped_input, skipped_rows, already_merged, "
          "node_name_conflict, several_jobs, clock_claim_exceeded, no_clock_samples, "
          "clock_causal_move, rate_clamped, late_wakeups, message_pairs, messages_refused, "
          "late_attach, merged."),
        C("message", "TEXT", False, "", "Human-readable text."),
        C("count", "INTEGER", True, "", "Rows concerned, when counting."),
    )),
    FleetTable("inferred_comms", "Per stream of NCCL calls a capture saw without its "
               "communicator's init (attached to a running job): the communicator the "
               "merge inferred for it by matching the streams of all ranks by shape and "
               "time (docs/merge.md, late attach). nccl_events rows of such a stream carry "
               "the inferred comm_id_hash and seq = handle_seq + seq_offset.", (
        C("comm_id_hash", "TEXT", False, "", "The inferred communicator: 16 hex digits "
          "derived from its first stream (no ncclUniqueId was seen)."),
        C("node_id", "INTEGER", False, "", "The stream's node."),
        C("pid", "INTEGER", False, "", "The stream's process."),
        C("comm_handle", "INTEGER", False, "", "The stream's ncclComm_t in that process."),
        C("first_mono_ns", "INTEGER", False, MONO_UNIT, "Its first call: with the three "
          "above it names the stream (a second capture run on the process counts from 1 "
          "again and is another stream)."),
        C("last_mono_ns", "INTEGER", False, MONO_UNIT, "Its last call merged so far."),
        C("last_handle_seq", "INTEGER", False, "", "Its last handle_seq merged so far: a "
          "later bundle whose counter goes on from here continues the stream."),
        C("seq_offset", "INTEGER", False, "", "seq = handle_seq + seq_offset. 1 is the "
          "earliest call any stream of the communicator saw when it was first inferred; a "
          "stream merged later that attached earlier starts below 1. For a communicator "
          "whose init another capture saw, its real seq."),
        C("streams", "INTEGER", False, "", "Late streams in this communicator (1 and "
          "basis alone: matched with nothing, compared with nothing)."),
        C("rank", "INTEGER", True, "", "Rank written on its rows: the process's RANK when "
          "the communicator has one stream per rank of WORLD_SIZE (the world "
          "communicator), else NULL."),
        C("nranks", "INTEGER", True, "", "Size written on its rows: WORLD_SIZE for the "
          "world communicator, else NULL (unknown: untraced ranks are not seen)."),
        C("env_rank", "INTEGER", True, "", "RANK in the process's environment, if seen."),
        C("env_world_size", "INTEGER", True, "", "WORLD_SIZE in its environment, if seen."),
        C("calls", "INTEGER", False, "calls", "Calls of the stream in this merge."),
        C("basis", "TEXT", False, "", "How it was placed: shape (the only offset with the "
          "same calls), shape+causality (the loop repeats; the only offset whose pairing "
          "the clocks and causality allow), shape+time (no synchronization bounds it; the "
          "nearest in time, by far), nearest in time (unsynchronized clocks) (a choice), "
          "reference (the stream the others were matched to), earlier merge, alone "
          "(matched with nothing)."),
        C("detail", "TEXT", False, "", "The numbers behind the basis, or why it was left alone."),
    ), constraints=("UNIQUE (node_id, pid, comm_handle, first_mono_ns)",)),
)

FLEET_TABLES: tuple[FleetTable, ...] = FLEET_ONLY + tuple(_bundle_derived())
FLEET_TABLES_BY_NAME = {t.name: t for t in FLEET_TABLES}
#: Fleet tables filled from bundle tables of the same name.
COPIED_TABLES = tuple(t.name for t in FLEET_TABLES if t.from_bundle)


def _column_ddl(table: FleetTable, col: Column) -> str:
    if col is table.columns[0] and col.name in ("id", "node_id", "stack_id", "bundle_id",
                                                 "collective_id") \
            and not any(c.startswith("PRIMARY KEY") for c in table.constraints):
        return f"{col.name} INTEGER PRIMARY KEY"
    return f"{col.name} {col.type}" + ("" if col.nullable else " NOT NULL")


def table_ddl(table: FleetTable) -> str:
    parts = [_column_ddl(table, c) for c in table.columns] + list(table.constraints)
    return (f"CREATE TABLE {table.name} (\n  " + ",\n  ".join(parts) + "\n)"
            + (" WITHOUT ROWID" if table.without_rowid else ""))


def index_ddl(table: FleetTable) -> list[str]:
    return [f"CREATE INDEX IF NOT EXISTS {table.name}_{'_'.join(cols)} "
            f"ON {table.name}({', '.join(cols)})" for cols in table.indexes]


def fleet_ddl() -> list[str]:
    """Statements creating an empty fleet.db (tables only; indexes come after the load)."""
    return [f"PRAGMA application_id = {FLEET_APPLICATION_ID}",
            f"PRAGMA user_version = {FLEET_VERSION}"] + [table_ddl(t) for t in FLEET_TABLES]


def all_index_ddl() -> list[str]:
    return [s for t in FLEET_TABLES for s in index_ddl(t)]


def render_markdown() -> str:
    """The table reference section of docs/fleet-db.md."""
    out = []
    for t in FLEET_TABLES:
        origin = "copied from bundles" if t.from_bundle else "fleet only"
        out.append(f"### `{t.name}` ({origin})\n\n{t.doc}\n")
        out.append("| column | type | null | unit | meaning |")
        out.append("|---|---|---|---|---|")
        for c in t.columns:
            doc = c.doc
            if c.values:
                doc += " Values: " + ", ".join(f"`{v}`" for v in c.values) + "."
            out.append(f"| `{c.name}` | {c.type} | {'yes' if c.nullable else 'no'} | "
                       f"{c.unit} | {doc.replace('|', '/')} |")
        extra = list(t.constraints) + [f"index ({', '.join(ix)})" for ix in t.indexes] \
            + (["WITHOUT ROWID"] if t.without_rowid else [])
        if extra:
            out.append("\nConstraints and indexes: " + "; ".join(extra) + ".")
        out.append("")
    return "\n".join(out)


__all__ = ["FLEET_VERSION", "FLEET_APPLICATION_ID", "FLEET_TABLES", "FLEET_TABLES_BY_NAME",
           "COPIED_TABLES", "fleet_ddl", "all_index_ddl", "index_ddl", "table_ddl",
           "time_point_columns", "render_markdown", "NOT_EVENTS"]
