"""ingero-simulate: a thin click layer over simulate.simulate_fleet."""

from __future__ import annotations

import click

from .. import cliutil
from .config import (FAULTS, MAX_RANKS_PER_NODE, FleetConfig, SimulateConfigError, parse_node,
                     parse_window)
from .fleet import simulate_fleet


def _bad(e: SimulateConfigError, param: str):
    return click.BadParameter(e.message, param_hint=f"'{param}'")


@click.command(name="ingero-simulate", context_settings={"help_option_names": ["-h", "--help"]},
               epilog=cliutil.EXIT_CODES_HELP)
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for the bundles and truth.json (created if missing).")
@click.option("--nodes", type=int, default=4, show_default=True, help="Number of nodes.")
@click.option("--ranks-per-node", type=int, default=8, show_default=True,
              help="GPUs (ranks) per node, 1 to "
                   f"{MAX_RANKS_PER_NODE}; node k hosts global ranks k*R .. k*R+R-1.")
@click.option("--steps", type=int, default=200, show_default=True, help="Training steps.")
@click.option("--fault", default="none", show_default=True, metavar="KIND",
              help=f"Injected fault: {', '.join(FAULTS)}.")
@click.option("--straggler", metavar="NODE",
              help="Node that suffers the fault: node-03 or 3 (default: chosen by the seed).")
@click.option("--fault-window", "fault_windows", multiple=True, metavar="START:END",
              help="Steps [START, END) during which the fault is active; repeat for an "
                   "intermittent fault (default: the whole run).")
@click.option("--max-offset-ms", type=float, default=50.0, show_default=True,
              help="Largest initial CLOCK_REALTIME error of a node.")
@click.option("--max-drift-ppm", type=float, default=50.0, show_default=True,
              help="Largest clock drift of a node.")
@click.option("--ntp-step", is_flag=True,
              help="Each node's NTP daemon steps its clock once mid-run.")
@click.option("--lying-clock", metavar="NODE",
              help="Make this node's adjtimex error claims dishonest (default: none).")
@click.option("--no-tcp-progress", "no_tcp_progress", is_flag=True,
              help="Write no tcp_progress rows (the ring's TCP byte positions, the merge's "
                   "tightest clock bounds), as a capture with --no-tcp-progress or on a "
                   "kernel before 6.3 writes none.")
@click.option("--seed", type=int, default=1, show_default=True,
              help="Random seed: the same seed gives the same fleet.")
@click.option("--workers", type=int, default=None,
              help="Worker processes (default: one per CPU). Does not change the output.")
@click.option("--force", is_flag=True, help="Replace a fleet already in the directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
@cliutil.version_option("ingero-simulate")
@cliutil.handle_errors
def main(out_dir, nodes, ranks_per_node, steps, fault, straggler, fault_windows,
         max_offset_ms, max_drift_ppm, ntp_step, lying_clock, no_tcp_progress, seed, workers,
         force, as_json, quiet):
    """Simulate a multi-node training fleet and write one real bundle per node.

    Each node gets a bundle (node-00, node-01, ...) written through the real bundle
    writer: NCCL collectives on two communicators, CUDA synchronizations, scheduler,
    block and TCP events, the ring's TCP byte progress, host and GPU samples, clock
    samples and processes. The injected fault, the straggler and every node's true
    clock offset, drift and NTP step are written to DIR/truth.json, beside the
    bundles, never inside them.

    \b
    Example:
      ingero-simulate -o fleet/ --nodes 8 --ranks-per-node 8 --steps 500 \\
          --fault cpu --straggler node-05 --fault-window 100:300 --ntp-step
    """
    try:
        if nodes is not None and nodes < 1:
            raise SimulateConfigError("--nodes", f"must be at least 1, got {nodes}")
        strag = parse_node(straggler, nodes) if straggler is not None else None
        liar = parse_node(lying_clock, nodes, "--lying-clock") if lying_clock else None
        windows = tuple(parse_window(w, steps) for w in fault_windows) if steps >= 1 else ()
        cfg = FleetConfig(nodes=nodes, ranks_per_node=ranks_per_node, steps=steps,
                          fault=fault, straggler=strag, fault_windows=windows,
                          max_offset_ms=max_offset_ms, max_drift_ppm=max_drift_ppm,
                          ntp_step=ntp_step, lying_clock=liar, seed=seed,
                          workers=workers, tcp_progress=not no_tcp_progress).validated()
    except SimulateConfigError as e:
        raise _bad(e, e.param) from None
    if workers is not None and workers < 1:
        raise click.BadParameter("must be at least 1", param_hint="'--workers'")
    with cliutil.progress(nodes, "Simulating nodes", enabled=not quiet) as update:
        result = simulate_fleet(out_dir, cfg, overwrite=force,
                                on_node_done=lambda _name: update(1))
    if as_json:
        cliutil.echo_json(result.summary())
    elif not quiet:
        f = result.truth["fault"]
        what = "clean run (no fault)" if f["kind"] == "none" else \
            f"fault {f['kind']} on {f['straggler']} (ranks {f['ranks'][0]}..{f['ranks'][-1]})"
        n = len(result.bundles)
        click.echo(f"Wrote {n} bundle{'' if n == 1 else 's'} and {result.truth_path.name} to "
                   f"{result.out_dir}: {what}; {result.events:,} events in "
                   f"{result.seconds:.1f} s ({result.events / result.seconds:,.0f}/s).")


if __name__ == "__main__":
    main()
