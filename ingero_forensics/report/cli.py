"""ingero-report: the static straggler / root-cause report of a fleet.db."""

from __future__ import annotations

import shlex

import click

from ..cliutil import (EXIT_CODES_HELP, BadUsage, FiniteFloatRange, echo_json, handle_errors,
                       reading_database, refuse_output_over_evidence, refuse_output_over_input,
                       require_output_dir, version_option)
from ..fleetfile import check_fleet_file
from ..redact import redacted_input
from . import analyze_fleet, write_report
from .render import render_html, report_title, write_text
from .text import render_text


@click.command(epilog=EXIT_CODES_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("fleet_db", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output", default=None,
              type=click.Path(dir_okay=False),
              help="File to write the report to (--format), replaced atomically; never "
                   "FLEET_DB or another fleet.db or bundle, and not a .json name (the JSON is --json's, on stdout); "
                   "- for stdout [default: report.html; with --json or a text format "
                   "and no -o, nothing is written but stdout].")
@click.option("--format", "fmt", type=click.Choice(["html", "text", "markdown"]),
              default="html", show_default=True,
              help="html: the page with charts; text or markdown: the verdict, cost, "
                   "next steps and the per-node table, for an email body or a ticket.")
@click.option("--bin", "bin_s", type=FiniteFloatRange(min=0.01), default=None,
              help="Time bin for lateness, seconds (default: about 1/100 of the run, 0.25-10 s).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the analysis as JSON on stdout. Without -o that is all (no file; "
                   "a --format needs -o then); with -o the report goes to that file too. "
                   "To keep the JSON in a file: --json > analysis.json.")
@click.option("--title", default=None,
              help="Title of the page and the text form [default: the job id, node count "
                   "and time span].")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@click.option("--redact", is_flag=True,
              help="Report on a redacted copy of FLEET_DB (as ingero-redact writes it: node "
                   "ids for host names, address pseudonyms, base names, no user names), "
                   "made in a private directory beside FLEET_DB (else in TMPDIR), never "
                   "beside the output, and removed after.")
@version_option("ingero-report")
@handle_errors
def main(fleet_db, output, bin_s, as_json, quiet, redact, fmt, title):
    """Name the straggler of a merged fleet and its root cause, in one static HTML file.

    The report compares when each node arrives at collectives, finds the windows where
    one node is late (or where collectives are slow for everyone), and scores every
    candidate cause (CPU contention, block I/O, memory pressure, network retransmits,
    GPU slowdown) on that node against the other nodes over the same windows. Where
    nobody is late and nothing retransmits, a link whose bytes take far longer from
    sender to receiver than on the job's other links is named (a slow network link);
    beside a late node or a lossy link, such a link away from the nodes named (or slow
    all run, outside the windows of a node named at its end with a clear cause of its
    own) is reported as a second finding.
    The HTML has no scripts and loads nothing: it reads the same in a browser or a mail
    client.

    --json prints the analysis on stdout and -o takes the report in the --format chosen:
    "--json -o report.html" gives both; "--format text --json" without -o is refused
    (both would go to stdout), and so is an -o that names FLEET_DB.

    \b
    Example:
        ingero-merge node*.bundle -o fleet.db
        ingero-report fleet.db -o report.html
        ingero-report fleet.db --json > analysis.json
    """
    fmt_given = (click.get_current_context().get_parameter_source("fmt")
                 is click.core.ParameterSource.COMMANDLINE)
    output = check_outputs(fleet_db, output, fmt=fmt, as_json=as_json, fmt_given=fmt_given)
    check_fleet_file(fleet_db)      # before a --redact copy: the error names FLEET_DB
    require_output_dir(output)
    with reading_database(fleet_db):
        with redacted_input(fleet_db, redact) as source:
            analysis = analyze_fleet(source, bin_s=bin_s)
    # --json carries the title the page and the text show
    analysis.title = title or report_title(analysis)
    if redact and analysis.commands:
        # the commands read the redacted copy (its node ids are the page's), which is gone
        # with the run: say how to make it, without the input's path (a user's or a
        # host's name may be in it, and this page leaves the site)
        analysis.commands.insert(0, {
            "what": "The redacted copy that the commands below read: FLEET_DB is the "
                    "fleet.db this page was made from (a redacted page does not name it). "
                    "Node ids are as on this page; addresses get new pseudonyms in every "
                    "copy",
            "command": f"ingero-redact FLEET_DB -o {shlex.quote(analysis.fleet)}"})
    if output == "-":
        out = (render_html(analysis) if fmt == "html" else
               render_text(analysis, markdown=fmt == "markdown"))
        click.echo(out, nl=not out.endswith("\n"))
        return
    if fmt == "html" and output:
        write_report(analysis, output)
    elif fmt != "html":
        text = render_text(analysis, markdown=fmt == "markdown")
        if output:
            write_text(text, output)
        elif not as_json:
            click.echo(text)
    if as_json:
        echo_json(analysis.to_json())
    elif not quiet and output:
        if fmt == "html":
            click.echo(analysis.verdict)
        click.echo(f"Report written to {output}")


def check_outputs(fleet_db, output, *, fmt: str, as_json: bool, fmt_given: bool = False):
    """Where the report goes (None: stdout only), or BadUsage (exit 2) before any work.

    -o takes the report in ``fmt`` (default report.html for html without --json); --json
    always prints on stdout. Refused: --json with a --format given and no -o (both on
    stdout: one would be lost), an -o named .json (the report is not JSON: the
    analysis is --json's), an -o that is FLEET_DB itself. ``-o -`` is stdout (not with
    --json).
    """
    if output == "-":
        if as_json:
            raise BadUsage("-o - with --json: both would go to stdout; give the report a "
                           "file with -o, or leave out --json")
        return output
    if as_json and output is None and fmt_given:
        raise BadUsage(f"--format {fmt} with --json and no -o: --json prints only the "
                       f"analysis on stdout; give the {fmt} report a file with -o")
    if output is None and fmt == "html" and not as_json:
        output = "report.html"
    if output is not None and str(output).lower().endswith(".json"):
        raise BadUsage(f"{output}: -o writes the {fmt} report, not JSON; for the analysis "
                       f"as JSON use --json (on stdout: --json > {output})")
    refuse_output_over_input(output, fleet_db)
    refuse_output_over_evidence(output, "a report")
    return output



if __name__ == "__main__":
    main()
