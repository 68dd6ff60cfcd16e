"""ingero-kit: build the offline kit on a connected machine (thin layer over kit.build_kit)."""

from __future__ import annotations

import click

from .cliutil import EXIT_CODES_HELP, echo_json, handle_errors, human_bytes, version_option
from .kit import build_kit, native_target


@click.command(name="ingero-kit", epilog=EXIT_CODES_HELP,
               context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-o", "--output-dir", default=".", show_default=True,
              type=click.Path(file_okay=False), help="Where the archive is written.")
@click.option("--python", "python", metavar="X.Y",
              help=f"CPython version of the nodes [default: this one, {native_target().python}].")
@click.option("--platform", "platform", metavar="TAG",
              help="Wheel platform tag of the nodes, e.g. manylinux_2_28_x86_64 or "
                   "manylinux_2_28_aarch64 [default: this machine's for this Python; "
                   "manylinux_2_28 of this architecture with another --python].")
@click.option("--source", type=click.Path(file_okay=False),
              help="Source tree of ingero-forensics [default: the one this runs from].")
@click.option("--no-pyz", is_flag=True, help="Leave the one-file ingero-capture.pyz out.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@version_option("ingero-kit")
@handle_errors
def main(output_dir, python, platform, source, no_pyz, as_json, quiet):
    """Build, on a connected machine, the archive that installs the tools with no network.

    The archive holds the wheels of ingero-forensics and of all its dependencies for one
    target (CPython version and platform), the one-file capture ingero-capture.pyz, an
    install script for the nodes (pip install --no-index), the per-job wrapper
    ingero-job-capture.sh, the systemd unit ingero-capture.service, the runbook
    airgap.md, README.txt, kit.json and SHA256SUMS; a .sha256 file is written next to
    it. For a target other than this machine's Python and
    platform, the project wheel is built without its optional C accelerators. Needs pip
    and a package index (or a mirror) here; nothing on the nodes.

    \b
    Example:
      ingero-kit -o dist/
      ingero-kit -o dist/ --python 3.11 --platform manylinux_2_28_aarch64
      bash scripts/build-kit.sh -o dist/        # the same, from a clone
    """
    res = build_kit(output_dir, python=python, platform=platform, source=source,
                    pyz=not no_pyz)
    for w in res.warnings:
        click.echo(f"warning: {w}", err=True)
    if as_json:
        echo_json(res.to_dict())
    elif not quiet:
        import os
        click.echo(f"{res.archive} ({human_bytes(os.path.getsize(res.archive))}, "
                   f"{len(res.wheels)} wheels, glibc >= {res.min_glibc or 'any'}"
                   f"{', pure-Python project wheel' if res.pure else ''})\n"
                   f"sha256 {res.sha256}")


if __name__ == "__main__":
    main()
