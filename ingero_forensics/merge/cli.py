"""ingero-merge: a thin click layer over merge.merge_bundles and merge.list_bundles."""

from __future__ import annotations

import sys

import click

from .. import accel as _accel
from .. import cliutil
from ..memory import keep_freed_memory
from .core import merge_bundles
from .fleet_schema import NOT_EVENTS
from .files import expand_inputs, list_bundles
from .verify import verify_bundles

HELP = f"""Merge node bundles into one queryable fleet.db.

BUNDLES are .bundle files, directories (every *.bundle inside) or globs. Segments of
the same node join that node; nodes are aligned to one fleet time axis (UTC ns) from
their clock samples and the collectives they share. An existing fleet.db given with -o
is extended (bundles already in it are recognized by sha256 and not added twice) and
realigned; an -o that is one of the inputs is refused (exit 2). The output is written
to a temporary file and renamed at the end, so an error or Ctrl-C leaves the previous
fleet.db as it was.

A corrupt, truncated or foreign input is skipped with a one-line reason and the rest is
merged (exit code 3); with no usable input at all, exit code 1 and nothing is written
(an existing fleet.db stays as it was); --strict aborts instead and writes nothing.

--list prints each bundle's manifest as read from its header, without decompressing:
ERROR and the reason for an input that is no readable bundle (also named on stderr);
exit code 3 when any is, as for a merge that skips inputs.

--verify checks every bundle as the merge would (container, manifest, sha256, SQLite
image, schema, row counts) without merging and prints one line per bundle: node, host,
capture window, size, rows and OK or the reason. Exit code 0 when every bundle is good,
1 when any is not (each also named on stderr).

{cliutil.MERGE_EXIT_CODES_HELP}

\b
Example:
  ingero-merge node*.bundle -o fleet.db
  ingero-merge bundles/ -o fleet.db --json > summary.json
  ingero-merge --list bundles/
  ingero-merge --verify bundles/
"""


@click.command(help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("bundles", nargs=-1, required=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="fleet.db to create (a new path, or an empty file) or extend "
                   "(required unless --list or --verify).")
@click.option("--list", "list_", is_flag=True,
              help="Print each bundle's manifest (no decompression) and exit; exit 3 if "
                   "any input is not a readable bundle.")
@click.option("--verify", is_flag=True,
              help="Check every bundle fully (--integrity quick unless given) without "
                   "merging; exit 1 if any is bad.")
@click.option("--strict", is_flag=True, help="Abort on the first unusable input, writing nothing.")
@click.option("--integrity", type=click.Choice(["quick", "full", "none"]), default="none",
              show_default=True,
              help="SQLite check of every bundle image before its rows are read: quick_check, "
                   "integrity_check or none. Images are always verified against their "
                   "sha256 and row counts, and a malformed page met while copying skips "
                   "the bundle all the same; a check only finds it sooner, at about 0.2 s "
                   "per 100 MiB image.")
@click.option("--tmpdir", type=click.Path(file_okay=False), default=None,
              help="Where bundle images are decompressed (default: next to the output).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
@cliutil.version_option("ingero-merge")
@cliutil.handle_errors
def main(bundles, output, list_, verify, strict, integrity, tmpdir, as_json, quiet):
    if verify:
        if list_ or output:
            raise click.UsageError("--verify writes nothing: give it neither -o nor --list")
        if (click.get_current_context().get_parameter_source("integrity")
                is not click.core.ParameterSource.COMMANDLINE):
            integrity = "quick"
        _verify(bundles, integrity, tmpdir, as_json, quiet)
    if list_:
        items = list_bundles(bundles)
        if as_json:
            cliutil.echo_json(items)
        elif not quiet:
            for it in items:
                click.echo(_list_line(it))
        bad = [it for it in items if "error" in it]
        for it in bad:
            click.echo(f"Error: {it['input']}: {it['error']}", err=True)
        sys.exit(cliutil.EXIT_PARTIAL if bad else cliutil.EXIT_OK)
    if not output:
        raise click.UsageError("-o/--output is required (or use --list or --verify)")
    if output == "-":
        raise cliutil.BadUsage("-o -: fleet.db is a database file, not a stream; give it a "
                               "file name (-o fleet.db)")
    inputs = expand_inputs(bundles)
    cliutil.refuse_output_over_input(output, *(str(p) for _, p, _ in inputs if p is not None))
    n_inputs = len(inputs)
    keep_freed_memory()     # the merge reuses what it frees (ingero_forensics/memory.py)
    with cliutil.progress(2 * n_inputs, "Merging", enabled=not quiet) as update:
        res = merge_bundles(bundles, output, strict=strict, progress=update, tmpdir=tmpdir,
                            integrity=integrity)
    for s in res.skipped:
        click.echo(f"Error: {s['input']}: {s['reason']} (skipped)", err=True)
    if as_json:
        cliutil.echo_json(res.to_dict())
    elif not quiet:
        for w in res.warnings:
            click.echo(f"Warning: {w}", err=True)
        click.echo(format_summary(res))
    sys.exit(cliutil.EXIT_PARTIAL if res.skipped else cliutil.EXIT_OK)


def _verify(bundles, integrity, tmpdir, as_json, quiet):
    n_inputs = len(expand_inputs(bundles))
    with cliutil.progress(n_inputs, "Verifying", enabled=not quiet) as update:
        checks = verify_bundles(bundles, tmpdir=tmpdir, integrity=integrity, progress=update)
    if as_json:
        cliutil.echo_json([c.to_dict() for c in checks])
    elif not quiet:
        click.echo(format_verify_table(checks))
    bad = [c for c in checks if not c.ok]
    for c in bad:
        click.echo(f"Error: {c.input}: {c.reason}", err=True)
    sys.exit(cliutil.EXIT_ERROR if bad else cliutil.EXIT_OK)


def _utc(ns: int) -> str:
    import time
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns // 1_000_000_000))


def format_verify_table(checks) -> str:
    """One line per bundle: node, host, window, size, rows, OK or the reason."""
    head = ("bundle", "node", "host", "window (UTC)", "size", "rows", "status")
    rows = []
    for c in checks:
        window = ("-" if c.start_utc_ns is None else
                  f"{_utc(c.start_utc_ns)} +{c.seconds:.0f}s")
        rows.append((c.input, c.node or "-", c.host or "-", window,
                     "-" if c.size is None else cliutil.human_bytes(c.size),
                     "-" if c.rows is None else str(c.rows),
                     "OK" if c.ok else f"BAD: {c.reason}"))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    lines = ["  ".join(v.ljust(w) if i != 5 else v.rjust(w) for i, (v, w) in
                       enumerate(zip(r, widths))) + "  " + r[-1] for r in [head, *rows]]
    good = sum(c.ok for c in checks)
    lines.append(f"{good} of {len(checks)} bundle(s) OK")
    return "\n".join(lines)


def _list_line(it) -> str:
    if "error" in it:
        return f"{it['input']}: ERROR {it['error']}"
    m = it["manifest"]
    cap = m["capture"]
    rows = sum(n or 0 for t, n in m["tables"].items() if t not in NOT_EVENTS)
    dur = (cap["end_mono_ns"] - cap["start_mono_ns"]) / 1e9
    return (f"{it['input']}: node {m['node']} host {m['host']['hostname']} segment "
            f"{m['segment']['index']} {dur:.1f}s {rows} rows, image "
            f"{cliutil.human_bytes(m['database']['size'])} sha256 {m['database']['sha256'][:12]}")


def ranks_text(ranks, width: int) -> str:
    """Ranks as runs (``0-7,16``) in at most width characters, never cut inside a
    number: what does not fit is counted (``0,2,4,+5``)."""
    runs = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    items = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    text = ",".join(items)
    if len(text) <= width:
        return text
    for k in range(len(items) - 1, -1, -1):
        rest = sum(b - a + 1 for a, b in runs[k:])
        cut = ",".join(items[:k] + [f"+{rest}"])
        if len(cut) <= width:
            return cut
    return f"+{len(set(ranks))}"


def format_summary(res) -> str:
    lines = [f"{res.output}: {res.bundles_merged} bundles merged, {res.bundles_already} "
             f"already present, {len(res.skipped)} skipped; {res.events} rows in "
             f"{res.elapsed_s:.1f}s ({res.events_per_s:,.0f}/s)"]
    if not res.accelerated and res.bundles_merged:
        if _accel.disabled():
            lines.append("note: the C accelerators are off (INGERO_NO_ACCEL): this was the "
                         "pure-Python path, about 2x slower")
        elif _accel.load("merge._fastcoll", "sqlite3_fastcoll_init") is None:
            lines.append("note: the C accelerators are not built (or do not load): this was "
                         "the pure-Python path, about 2x slower (pip install with a C compiler "
                         "and the Python headers builds them; from an offline kit, a kit built "
                         "for this machine's Python and platform on a machine that has them: "
                         "docs/airgap.md)")
        # else the C path gave up on a collective too large for it: a warning says so
    if res.stacks.get("dedup_ratio"):
        lines.append(f"stacks: {res.stacks['bundle_stacks']} in bundles -> "
                     f"{res.stacks['fleet_stacks_used']} distinct (dedup {res.stacks['dedup_ratio']}x)")
    lines.append(f"{'node':<20} {'ranks':<10} {'bundles':>7} {'rows':>10} {'method':<13} "
                 f"{'uncert':>10} {'viol b/a':>10}")
    for n in res.nodes:
        a = n["alignment"]
        ranks = ranks_text(n["ranks"], 10)
        unc = "-" if a["uncertainty_ns"] is None else f"{a['uncertainty_ns'] / 1e3:.0f}us"
        flag = " LIAR" if a["exceeds_claim"] else ""
        lines.append(f"{n['name'][:20]:<20} {ranks:<10} {n['bundles']:>7} "
                     f"{sum(v for k, v in n['rows'].items() if k not in NOT_EVENTS):>10} "
                     f"{a['method'] or '-':<13} {unc:>10} "
                     f"{a['violations_before']}/{a['violations_after']:<5}{flag}")
    if any(res.rows.values()):
        lines.append("rows written: " + ", ".join(f"{t} {n}" for t, n in sorted(res.rows.items())
                                                  if n))
    return "\n".join(lines)
