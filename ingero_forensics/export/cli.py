"""ingero-export: fleet.db -> Chrome Trace Event Format (thin layer over chrome_trace)."""

from __future__ import annotations

import os

import apsw
import click

from ..cliutil import (EXIT_CODES_HELP, BadUsage, echo_json, handle_errors, human_bytes,
                       refuse_output_over_evidence, refuse_output_over_input, require_output_dir,
                       sqlite_message, version_option)
from ..errors import IngeroError
from ..merge.nodes import data_start
from ..redact import redacted_input
from ..redact.core import NODE_PREFIX
from .chrome_trace import export_chrome_trace
from .fleet import load_nodes, open_fleet, rank_ranges
from .options import KINDS, ExportError, ExportOptions, iso_utc, parse_ranks, parse_time


def _split(values) -> tuple[str, ...]:
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())


@click.command(name="ingero-export", epilog=EXIT_CODES_HELP,
               context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("fleet_db", type=click.Path(dir_okay=False))
@click.option("--chrome-trace", "chrome_trace", is_flag=True, required=True,
              help="Write Chrome Trace Event Format JSON (Perfetto, chrome://tracing; "
                   "offline viewing without ui.perfetto.dev: docs/airgap.md). "
                   "Required: the format is named so that others can be added.")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Output file (never FLEET_DB, another fleet.db or a bundle); a name "
                   "ending in .gz is gzip-compressed. "
                   "Default, or -: stdout.")
@click.option("--from", "start", metavar="TIME",
              help="Only events starting at or after TIME: ISO 8601 UTC "
                   "(2025-01-31T12:00:05Z) or an offset from the start of the data "
                   "(+30s, +2m, +1.5h). Never relative to the current time.")
@click.option("--to", "end", metavar="TIME", help="Only events starting before TIME "
              "(same forms as --from).")
@click.option("--nodes", multiple=True, metavar="NAMES",
              help="Only these nodes (comma-separated or repeated).")
@click.option("--ranks", metavar="LIST", help="Only these global ranks, e.g. 0-7,12 "
              "(their threads, plus the node-wide tracks of their nodes); each must be a "
              "rank of the fleet, as each --nodes name must be one of its nodes.")
@click.option("--kinds", multiple=True, metavar="KINDS",
              help=f"Only these kinds (comma-separated or repeated): {', '.join(KINDS)}. "
                   "Default: all.")
@click.option("--max-events", type=click.IntRange(min=1), metavar="N",
              help="Refuse (writing nothing) if the trace would hold more than N events "
                   "(slices, instants, counter samples, flow s/f events and finding "
                   "markers; not the M metadata events that name tracks).")
@click.option("--no-findings", is_flag=True,
              help="Do not run ingero-report's analysis: no straggler-window markers and "
                   "metadata.findings is null.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), metavar="N",
              help="Worker processes writing the per-node sections (NCCL, CUDA, sched, "
                   "block, TCP, counters) in parallel; at most one per exported node. "
                   "Default: the number of CPUs. --jobs 1 works in this process alone. "
                   "The output is the same bytes whatever N.")
@click.option("--json", "json_", is_flag=True,
              help="With -o: print a JSON summary (counts per kind, origin, bytes: the "
                   "file's size, json_bytes: the JSON text before gzip, and accelerated: "
                   "whether the C loops wrote it) on stdout. Refused without -o (or "
                   "with -o -): stdout holds the trace then.")
@click.option("-q", "--quiet", is_flag=True, help="No summary line.")
@click.option("--redact", is_flag=True,
              help="Export a redacted copy of FLEET_DB (as ingero-redact writes it), made "
                   "in a private directory beside FLEET_DB (else in TMPDIR), never beside "
                   "the output, and removed after. --nodes then takes the node ids "
                   "(nodeid-N), or the nodes' own names, which select their node ids.")
@version_option("ingero-export")
@handle_errors
def main(fleet_db, chrome_trace, output, start, end, nodes, ranks, kinds, max_events,
         no_findings, jobs, json_, quiet, redact):
    """Write the merged fleet FLEET_DB as a Chrome Trace Event Format timeline.

    One process per node (named like "node-05 (ranks 40-47)"), one track per traced
    thread with its CUDA calls, an NCCL track per thread (collectives from entry to
    observed completion, with op, bytes, communicator, seq, wait and lateness; flow
    arrows link each collective across its ranks in arrival order), a sched track per
    thread, TCP retransmits as instants, block I/O per disk, and host samples as counter
    tracks. A "fleet" process shows, per communicator, each collective's window from the
    first rank's entry to the last one's, named after the rank everybody waited for.

    Findings (unless --no-findings): ingero-report's analysis runs on FLEET_DB and its
    straggler windows become slices on the straggler node's process, track
    "ingero-report findings", named like "straggler window: CPU contention"; the
    straggler, its late ranks, the cause and the verdict go in metadata.findings. A
    window is marked when it overlaps --from/--to and its node is exported, whatever
    --kinds selects.

    Timestamps are aligned fleet time, in microseconds with nanosecond fractions since
    the origin written in the top-level metadata (with nodes, clock alignment and tool
    version). The file is written to a temporary name and renamed when complete.

    Each node's sections are written by a worker process (--jobs) into part files in a
    temporary directory next to the output (the system temp directory for stdout); this
    process copies each part into place as soon as it is written (then removes it),
    writes the cross-rank flows, the collective windows, findings and metadata, in a
    fixed order (gzip: one stream, compressed by the workers). The findings analysis
    runs in a process of its own meanwhile.

    \b
    Example:
      ingero-export fleet.db --chrome-trace -o trace.json.gz
      ingero-export fleet.db --chrome-trace --from +30s --to +45s --kinds nccl,cuda \\
          --nodes node-05 -o window.json
      ingero-export fleet.db --chrome-trace --ranks 40-47 | gzip > ranks.json.gz
    """
    if nodes and not _split(nodes):
        # an empty --nodes (a shell variable that was not set) would export every node
        raise click.BadParameter("names no node", param_hint="--nodes")
    if kinds and not _split(kinds):
        raise click.BadParameter("names no kind", param_hint="--kinds")
    if ranks is not None and not _split([ranks]):
        raise click.BadParameter("names no rank", param_hint="--ranks")
    kind_set = frozenset(_split(kinds)) if kinds else frozenset(KINDS)
    bad = sorted(kind_set - set(KINDS))
    if bad:
        raise click.BadParameter(f"unknown kind {', '.join(bad)} (choose from "
                                 f"{', '.join(KINDS)})", param_hint="--kinds")
    try:
        rank_set = parse_ranks(ranks) if ranks else None
    except Exception as e:  # ExportError: a usage problem here
        raise click.BadParameter(str(e), param_hint="--ranks") from None
    if output == "-":
        output = None       # stdout, as - means elsewhere (ingero-query -f -)
    if json_ and output is None:
        raise BadUsage("--json prints the summary of a trace written to a file: with no "
                       "-o (or -o -) stdout holds the trace itself; give the trace a file "
                       "with -o")
    refuse_output_over_input(output, fleet_db)
    refuse_output_over_evidence(output, "a trace")
    chosen = check_selection(fleet_db, start=start, end=end, nodes=_split(nodes),
                             ranks=rank_set, redact=redact)
    opts = ExportOptions(start=start, end=end, nodes=chosen, ranks=rank_set,
                         kinds=kind_set, max_events=max_events, findings=not no_findings,
                         jobs=jobs)
    require_output_dir(output)
    with redacted_input(fleet_db, redact) as source:
        stats = export_chrome_trace(source, output, opts)
    if stats.events == 0 or (stats.events == stats.instants and opts.findings and
                             stats.slices + stats.counters + stats.flows == 0):
        # (--nodes and --ranks that share nothing, an empty --kinds, a window between runs)
        click.echo("warning: the selection leaves no event: the trace is empty", err=True)
    if output is None:
        return  # stdout holds the trace; nothing else goes there
    file_bytes = os.path.getsize(stats.output)
    if json_:
        echo_json({"output": stats.output, "bytes": file_bytes, "json_bytes": stats.bytes,
                   "events": stats.events,
                   "slices": stats.slices, "instants": stats.instants,
                   "counters": stats.counters, "flows": stats.flows,
                   "metadata_events": stats.metadata_events,
                   "overflow_tracks": stats.overflow_tracks, "by_kind": stats.by_kind,
                   "origin_utc_ns": stats.origin_ns, "accelerated": stats.accelerated})
    elif not quiet:
        click.echo(f"{stats.output}: {stats.events} events ({stats.slices} slices, "
                   f"{stats.flows} flows ({2 * stats.flows} events: start and end), "
                   f"{stats.counters} counter samples, "
                   f"{stats.instants} instants), {human_bytes(file_bytes)}"
                   + (f" ({human_bytes(stats.bytes)} of JSON, gzipped)"
                      if file_bytes != stats.bytes else ""), err=True)


def check_selection(fleet_db, *, start=None, end=None, nodes=(), ranks=None,
                    redact=False) -> tuple:
    """The options that select data, checked against FLEET_DB before any work (and
    before a --redact copy is made, so that errors name FLEET_DB):

    * --from/--to that are not times, or --to not after --from: BadUsage (exit 2);
    * a --nodes name or a --ranks rank the fleet does not have: IngeroError (exit 1),
      ``FLEET_DB: no node named node-99 (nodes: ...)``, ``FLEET_DB: no rank 99 (ranks:
      0-7)``. With redact the nodes are named as in the redacted copy (nodeid-N),
      and a node's own name stands for its node id.

    Returns the nodes to select, as the (redacted, with redact) copy names them. A file
    that is no fleet.db is left to export_chrome_trace, which says so.
    """
    for option, text in (("--from", start), ("--to", end)):
        if text:
            try:
                parse_time(text, 0)
            except ExportError as e:
                raise BadUsage(f"{option}: {e}") from None
    if not (nodes or ranks is not None or (start and end)):
        return tuple(nodes)
    con = open_fleet(fleet_db)
    try:
        try:
            all_nodes = load_nodes(con)
            if not all_nodes:
                return tuple(nodes)          # export_chrome_trace: "has no nodes"
            names = ([f"{NODE_PREFIX}{i}" for i in sorted(n.node_id for n in all_nodes)]
                     if redact else sorted(n.name for n in all_nodes))
            if redact:
                # a node's own name selects its node id (the redacted copy's name for it)
                own = {n.name: f"{NODE_PREFIX}{n.node_id}" for n in all_nodes}
                nodes = tuple(dict.fromkeys(n if n in names else own.get(n, n)
                                            for n in nodes))
            unknown = [n for n in nodes if n not in names]
            if unknown:
                raise IngeroError(f"{fleet_db}: no node named {', '.join(unknown)} "
                                  f"(nodes: {', '.join(names)})")
            if ranks is not None:
                known = {r for n in all_nodes for r in n.ranks}
                known.update(r for (r,) in con.execute(
                    "SELECT DISTINCT rank FROM processes WHERE rank IS NOT NULL"))
                missing = sorted(set(ranks) - known)
                if missing:
                    have = (rank_ranges(sorted(known)).split(" ", 1)[1] if known
                            else "none recorded")
                    raise IngeroError(f"{fleet_db}: no {rank_ranges(missing)} (ranks: {have})")
            if start and end:
                t0 = data_start(con)
                t_from, t_to = parse_time(start, t0), parse_time(end, t0)
                if t_to <= t_from:
                    raise BadUsage(f"--to ({iso_utc(t_to)}) is not after --from "
                                   f"({iso_utc(t_from)})")
        except apsw.Error as e:      # as export_chrome_trace words it
            raise IngeroError(f"{fleet_db}: cannot read fleet.db ({sqlite_message(e)})"
                              ) from None
    finally:
        con.close()
    return tuple(nodes)
