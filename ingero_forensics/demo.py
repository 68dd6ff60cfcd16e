"""The demo: an 8-node fleet with a CPU-contention straggler, then each analysis step.

    python -m ingero_forensics.demo -o DIR

Steps run in order and share a context dict; each returns the outputs it produced as
(label, path) pairs, which are printed at the end. Adding a step (merge, export,
report) means appending one function to ``STEPS``.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from . import cliutil
from .errors import IngeroError
from .simulate import FleetConfig, simulate_fleet

#: The demo fleet: 8 nodes x 8 ranks, node-05 slowed by a competing CPU-bound task
#: during steps 100-300, clocks skewed and stepped by NTP mid-run.
DEMO_CONFIG = FleetConfig(nodes=8, ranks_per_node=8, steps=400, fault="cpu", straggler=5,
                          fault_windows=((100, 300),), ntp_step=True, seed=2024)


def step_simulate(ctx: dict) -> list[tuple[str, Path]]:
    fleet_dir = ctx["out"] / "fleet"
    result = simulate_fleet(fleet_dir, ctx["config"], overwrite=True)
    ctx["fleet"] = result
    ctx["bundles"] = result.bundles
    f = result.truth["fault"]
    ctx["log"](f"simulated {len(result.bundles)} nodes, {result.events:,} events in "
               f"{result.seconds:.1f} s; injected: {f['kind']} on {f['straggler']}")
    return [("bundles", fleet_dir), ("ground truth", result.truth_path)]


def step_merge(ctx: dict) -> list[tuple[str, Path]]:
    from .merge import merge_bundles
    fleet_db = ctx["out"] / "fleet.db"
    fleet_db.unlink(missing_ok=True)
    result = merge_bundles(ctx["bundles"], fleet_db)
    ctx["fleet_db"] = fleet_db
    ctx["log"](f"merged {result.bundles_merged} bundles, {result.events:,} rows in "
               f"{result.elapsed_s:.1f} s; clocks aligned across nodes")
    return [("fleet.db", fleet_db)]


def step_export(ctx: dict) -> list[tuple[str, Path]]:
    from .export.chrome_trace import export_chrome_trace
    trace = ctx["out"] / "trace.json.gz"
    stats = export_chrome_trace(ctx["fleet_db"], trace)
    ctx["log"](f"exported {stats.events:,} trace events (open in Perfetto or chrome://tracing; "
               "offline: docs/airgap.md)")
    return [("Perfetto trace", trace)]


def step_report(ctx: dict) -> list[tuple[str, Path]]:
    from .report import build_report
    report = ctx["out"] / "report.html"
    analysis = build_report(ctx["fleet_db"], report)
    ctx["analysis"] = analysis
    ctx["log"](f"report: {analysis.verdict}")
    return [("report", report)]


#: (name, function) in order; each function takes the context and returns outputs.
STEPS = [("simulate", step_simulate), ("merge", step_merge), ("export", step_export),
         ("report", step_report)]


#: Written into the output directory: a later demo may replace what this one wrote.
MARKER = ".ingero-demo"


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse a directory holding anything but an earlier demo (its fleet.db and bundles
    would be replaced without a word), unless force."""
    if out.exists() and not out.is_dir():
        raise IngeroError(f"{out}: exists and is not a directory")
    if force or not out.exists() or (out / MARKER).exists():
        return
    other = sorted(p.name for p in out.iterdir())
    if other:
        raise IngeroError(f"{out}: is not empty and holds no earlier demo ({other[0]}"
                          f"{', ...' if len(other) > 1 else ''}); the demo would replace "
                          "its fleet.db, fleet/ bundles, trace.json.gz and report.html: "
                          "choose another directory or pass --force")


def run_demo(out_dir, *, config: FleetConfig | None = None, log=print,
             force: bool = False) -> list[tuple[str, Path]]:
    """Run every demo step into out_dir (default fleet: DEMO_CONFIG); return the outputs.
    out_dir must be new, empty or an earlier demo's, unless force."""
    ctx = {"out": Path(out_dir), "config": config or DEMO_CONFIG, "log": log}
    check_out_dir(ctx["out"], force)
    ctx["out"].mkdir(parents=True, exist_ok=True)
    (ctx["out"] / MARKER).write_text("written by python -m ingero_forensics.demo\n")
    outputs = []
    for name, fn in STEPS:
        outputs += fn(ctx)
    return outputs


@click.command(name="python -m ingero_forensics.demo",
               epilog=cliutil.EXIT_CODES_HELP,
               context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Output directory (created if missing). An earlier demo there (one "
                   "that left its .ingero-demo marker) is replaced; any other directory "
                   "that is not empty is refused.")
@click.option("--force", is_flag=True,
              help="Use a directory that is not empty and holds no earlier demo: the "
                   "demo's own outputs there (fleet/, fleet.db, trace.json.gz, "
                   "report.html) are replaced, nothing else is touched.")
@click.option("--json", "as_json", is_flag=True, help="Print the outputs as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the outputs.")
@cliutil.version_option("ingero-demo")
@cliutil.handle_errors
def main(out_dir, force, as_json, quiet):
    """Simulate an 8-node fleet with a CPU-contention straggler and analyse it.

    Runs the whole workstation chain on it: ingero-merge (fleet.db), ingero-export
    (a Perfetto trace) and ingero-report (report.html), and prints where each output is.

    \b
    Example:
      python -m ingero_forensics.demo -o demo/
    """
    log = (lambda _msg: None) if (quiet or as_json) else (lambda msg: click.echo(msg, err=True))
    outputs = run_demo(out_dir, log=log, force=force)
    if as_json:
        cliutil.echo_json({label: str(path) for label, path in outputs})
        return
    click.echo("Outputs:")
    for label, path in outputs:
        click.echo(f"  {label:<14} {path}")
    if not quiet:
        # the next things a user types: the commands live in the venv, and the report's
        # next commands run in the directory of fleet.db
        bindir = Path(sys.executable).parent
        click.echo(f"Next: the ingero-* commands are in {bindir} (. {bindir}/activate); the "
                   f"report's next commands run as they are in {Path(out_dir)}:\n"
                   f"  cd {shlex.quote(str(out_dir))} && ingero-report fleet.db --format text")


if __name__ == "__main__":
    main()
