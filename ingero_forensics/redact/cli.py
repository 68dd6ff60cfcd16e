"""ingero-redact: a redacted copy of fleet.db (thin layer over redact.redact_fleet)."""

from __future__ import annotations

import click

from ..cliutil import EXIT_CODES_HELP, echo_json, handle_errors, version_option
from .core import redact_fleet


@click.command(name="ingero-redact", epilog=EXIT_CODES_HELP,
               context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("fleet_db", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The redacted fleet.db to write (replaced atomically when it is an "
                   "earlier redacted copy; never FLEET_DB, another fleet.db or a bundle).")
@click.option("--json", "as_json", is_flag=True, help="Print what was rewritten as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@version_option("ingero-redact")
@handle_errors
def main(fleet_db, output, as_json, quiet):
    """Write a copy of FLEET_DB that may leave the site.

    Host and node names become node ids (nodeid-3), IP addresses stable pseudonyms that
    keep the subnet structure (one random key per output: the same address gets the same
    pseudonym throughout this output, and a different one in another output), command
    lines, executables, stack frames and every path are reduced to base names, user
    names (home directories, URL user info, user@host, e-mail addresses) are removed,
    and other machines of the fleet's DNS domains become host.domain (names in any
    letter case). The unredacted working copy is made beside FLEET_DB (else in TMPDIR),
    never beside -o, which may be the medium that leaves the site. Timings, ranks,
    collectives, metrics and the clock alignment are kept, so ingero-report,
    ingero-export and ingero-query work on the copy as on the original. FLEET_DB is only
    read. See docs/airgap.md for what each output contains.

    \b
    Example:
      ingero-redact fleet.db -o fleet-redacted.db
      ingero-report fleet.db --redact -o report.html     # the same redaction, built in
      ingero-export fleet.db --chrome-trace --redact -o trace.json.gz
    """
    res = redact_fleet(fleet_db, output)
    if as_json:
        echo_json(res.to_dict())
    elif not quiet:
        cols = sum(res.columns_rewritten.values())
        click.echo(f"{res.output}: {res.nodes} node name(s), {res.addresses} address(es), "
                   f"{res.users} user name(s) replaced; {cols} distinct value(s) rewritten "
                   f"in {len(res.columns_rewritten)} column(s) ({res.elapsed_s:.1f}s)")


if __name__ == "__main__":
    main()
