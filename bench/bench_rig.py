"""Benchmark the capture on the real-kernel multi-node rig (tests/rig; needs root, BCC,
kernel headers, iproute2: scripts/setup-ebpf.sh).

Four network-namespace nodes of two ranks each run the PyTorch-like training loop
(tests/fixtures/train_job.c: TCP ring all-reduce through the NCCL shim, a cudart shim
whose kernels take real time). Rounds alternate a run without captures and a run with one
ingero-capture per node (all eBPF sources, restricted to the node's ranks), so slow
drifts of a shared machine hit both alike.

Prints, per scenario: the job's median step time without and with the captures (the
capture overhead), and per node the rows captured and the lost events (capture_log
lost_events), which should be 0.

With --attach-after S (the live-incident case, issue 17) the job runs --steps steps (every
rank the same number: a ring whose ranks stop apart fails its last collective) and the
captures start S seconds after it: printed are the job's median step before the
captures were launched, while they started (launch until every source is on: BCC
compiling, probes attaching) and after, and the rise while they started, against the
same time windows of a run without captures.

Usage: python bench/bench_rig.py [--steps N] [--rounds N] [--scenario none|cpu|io|network|gpu|compute|memory]
       python bench/bench_rig.py --attach-after 5 --steps 700 [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ingero_forensics.bundle.reader import open_bundle  # noqa: E402
from tests.rig.rig import SCENARIOS, Rig  # noqa: E402


def node_figures(run) -> dict[str, dict]:
    out = {}
    for node, bundles in sorted(run.bundles.items()):
        rows, lost = 0, {}
        for path in bundles:
            with open_bundle(path) as b:
                rows += sum(n for t, n in b.manifest["tables"].items()
                            if t not in ("capture_log", "stacks", "host_samples"))
                for source, n in b.con.execute(
                        "SELECT source, SUM(count) FROM capture_log "
                        "WHERE event = 'lost_events' GROUP BY source"):
                    lost[source] = lost.get(source, 0) + n
        out[node] = {"event_rows": rows, "lost_events": sum(lost.values()),
                     "lost_by_source": lost}
    return out


def _median(vals) -> float:
    return statistics.median(vals) / 1e6 if vals else float("nan")


def windows(run, window) -> dict[str, float]:
    """Median step (ms) over all ranks: steps ending before the window (after a 1 s
    warm-up), inside it, and after it."""
    lo, hi = window
    parts = {"before": [], "starting": [], "after": []}
    for ends in run.step_ends().values():
        t0 = ends[0][0] - ends[0][1]
        for end, d in ends:
            if end < lo:
                if end - t0 > 1e9:
                    parts["before"].append(d)
            elif end <= hi:
                parts["starting"].append(d)
            else:
                parts["after"].append(d)
    return {k: round(_median(v), 2) for k, v in parts.items()}


def attach_main(args) -> None:
    """Captures started on a running job: the step time while they start."""
    rise = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-rig-") as tmp, \
            Rig(Path(tmp), nodes=args.nodes, ranks_per_node=args.ranks_per_node) as rig:
        for rnd in range(args.rounds):
            on = rig.run_scenario(args.scenario, steps=args.steps,
                                  attach_after_s=args.attach_after)
            w = on.capture_window_ns
            job_start = min(r["start_mono_ns"] for r in on.results.values())
            off = rig.run_scenario(args.scenario, steps=args.steps, captures=False,
                                   attach_after_s=args.attach_after)
            off_start = min(r["start_mono_ns"] for r in off.results.values())
            # the same windows, relative to the job's start
            w_off = (off_start + w[0] - job_start, off_start + w[1] - job_start)
            for mode, run, win in (("on", on, w), ("off", off, w_off)):
                m = windows(run, win)
                pct = round(100 * (m["starting"] - m["before"]) / m["before"], 1)
                rise[mode].append(pct)
                print(f"round {rnd + 1} captures {mode:<3}: median step before "
                      f"{m['before']} ms, while starting {m['starting']} ms, after "
                      f"{m['after']} ms: {pct:+} % while starting (window "
                      f"{(win[0] - (job_start if mode == 'on' else off_start)) / 1e9:.1f}-"
                      f"{(win[1] - (job_start if mode == 'on' else off_start)) / 1e9:.1f} s "
                      "after the job's start)", flush=True)
    print(json.dumps({"scenario": args.scenario, "nodes": args.nodes,
                      "ranks_per_node": args.ranks_per_node, "steps": args.steps,
                      "attach_after_s": args.attach_after,
                      "step_rise_while_starting_pct": rise}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--scenario", default="none", choices=SCENARIOS)
    ap.add_argument("--attach-after", type=float, default=None,
                    help="start the captures this many seconds after the job (live incident)")
    args = ap.parse_args()
    if args.attach_after is not None:
        attach_main(args)
        return
    steps = {"off": [], "on": []}
    nodes: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-rig-") as tmp, \
            Rig(Path(tmp), nodes=args.nodes, ranks_per_node=args.ranks_per_node) as rig:
        for rnd in range(args.rounds):
            for mode in ("off", "on"):
                run = rig.run_scenario(args.scenario, steps=args.steps, captures=mode == "on")
                med = run.median_step_ms()
                steps[mode].append(med)
                print(f"round {rnd + 1} captures {mode:<3}: median step {med:.2f} ms "
                      f"({run.seconds} s; captures on in {run.capture_start_s} s, "
                      f"stopped in {run.capture_stop_s} s)", flush=True)
                if mode == "on":
                    nodes.append(node_figures(run))
    off, on = statistics.median(steps["off"]), statistics.median(steps["on"])
    result = {
        "scenario": args.scenario, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
        "steps": args.steps, "rounds": args.rounds,
        "median_step_ms_without_capture": round(off, 2),
        "median_step_ms_with_capture": round(on, 2),
        "capture_overhead_pct": round(100 * (on - off) / off, 1),
        "per_round_ms": steps, "per_node": nodes,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
