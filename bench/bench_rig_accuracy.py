"""How often the report is right on the real-kernel rig (tests/rig; needs root, BCC,
kernel headers, iproute2: scripts/setup-ebpf.sh).

bench/bench_accuracy.py counts right verdicts on simulated fleets, which share the
analysis's own assumptions. This runs the real thing: network-namespace nodes, the
training loop over a real TCP ring, one ingero-capture per node, a real fault on one
node (a CPU hog, O_DIRECT reads, a lossy or a queueing link, a cgroup too small for the
job's pages, a slower "GPU"), then ingero-merge and ingero-report --json as a user runs
them. The fault moves over every node in turn (``--positions``), so that a verdict
which only holds for the ring position the tests use (node 2) shows.

Each run is one of:

- right: the degraded node, alone, with the fault's cause (counted by confidence);
- node only: the right node, alone, with no cause ("cannot tell") or another one;
- said: no node named, but the verdict says the degraded node's link or GPU under
  the bar that names one (link_unnamed, gpu_unnamed), or, for the CPU hog, its waits
  for its GPU work as its threads' waits for a CPU (gpu_unnamed.reading "cpu", or
  "unsure": either); "said
  (other)" where it says another node's or another reading;
- cannot tell: no node named or said where one was degraded;
- wrong: another node named (beside the right one, or instead of it), with its
  confidence: a wrong node said "clear" is the failure the report must not have;
- a clean run naming anyone is a false positive; one saying a link or a GPU under the
  bar is "said (clean)".

Usage: python bench/bench_rig_accuracy.py [--nodes 4] [--ranks-per-node 1]
           [--positions 0,1,2,3] [--scenarios none,cpu,io,network,slowlink,memory,gpu]
           [--repeat 1] [--severity strong|mild] [--json FILE] [--keep DIR [--keep-all]]
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.rig import measure, verdict  # noqa: E402
from tests.rig.conftest import STEPS_OF, merge_and_report  # noqa: E402
from tests.rig.rig import SCENARIOS, Rig  # noqa: E402


#: scenarios whose fault is the straggler's link (its sending side)
LINK_FAULTS = ("network", "slowlink")


def said(report: dict) -> list[tuple[str, str]]:
    """What a "No straggler" verdict says without naming it: ("link", its sender) and
    ("gpu", its node)."""
    if not (report.get("verdict") or "").startswith("No straggler"):
        return []
    out = []
    if report.get("link_unnamed"):
        out.append(("link", report["link_unnamed"]["from"]))
    if report.get("gpu_unnamed"):
        # long waits for its own GPU work, said as a GPU's, as its threads' waits for a
        # CPU, or as either (reading "unsure")
        g = report["gpu_unnamed"]
        reading = g.get("reading", "gpu")
        out.extend((r, g["node"]) for r in ("cpu", "gpu") if reading in (r, "unsure"))
    return out


def classify(truth, named: list, report: dict) -> tuple[str, str | None]:
    """(outcome, confidence of what decided it)."""
    told = said(report)
    if truth.node is None:
        if named:
            return "false positive", named[0].confidence
        return ("said (clean)", None) if told else ("right", None)
    if not named:
        # the degraded node's own link for a link fault, its waits said as a CPU's for
        # the CPU hog, its GPU waits otherwise
        want = ("link" if truth.scenario in LINK_FAULTS else
                "cpu" if truth.scenario == "cpu" else "gpu", truth.node)
        if told:
            return ("said", None) if want in told else ("said (other)", None)
        return "cannot tell", None
    others = [s for s in named if s.node != truth.node]
    if others:
        return "wrong", others[0].confidence
    if named[0].cause == truth.cause:
        return "right", named[0].confidence
    return "node only", named[0].confidence


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--positions", default=None,
                    help="the degraded node's indices, comma-separated [every node]")
    ap.add_argument("--scenarios", default="none,cpu,io,network,slowlink,memory,gpu")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--severity", choices=("strong", "mild"), default="strong",
                    help="the tests' faults, or milder ones (tests/rig/rig.py MILD)")
    ap.add_argument("--json", dest="json_out", default=None,
                    help="write every run's truth, verdict and timings here")
    ap.add_argument("--keep", default=None,
                    help="move the bundles of every run not right into this directory")
    ap.add_argument("--keep-all", action="store_true",
                    help="with --keep: keep the bundles of the runs that were right too")
    args = ap.parse_args()
    scenarios = args.scenarios.split(",")
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s}; one of {', '.join(SCENARIOS)}")
    positions = ([int(p) for p in args.positions.split(",")] if args.positions
                 else list(range(args.nodes)))
    runs = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-rig-acc-") as tmp:
        for pos in positions:
            workdir = Path(tmp) / f"pos{pos}"
            with Rig(workdir, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                     straggler=pos, severity=args.severity) as rig:
                for rep in range(args.repeat):
                    for scenario in scenarios:
                        if scenario == "none" and pos != positions[0]:
                            continue        # the clean run has no position
                        t0 = time.monotonic()
                        run = rig.run_scenario(scenario,
                                               steps=STEPS_OF.get(scenario, 100),
                                               capture_args=("--start-priority", "normal"))
                        out = workdir / f"merged-{scenario}-{rep}"
                        fleet, report = merge_and_report(run.all_bundles(), out)
                        named = verdict.stragglers(report)
                        outcome, confidence = classify(run.truth, named, report)
                        late = measure.true_lateness(fleet)
                        row = {
                            "scenario": scenario, "position": pos, "repeat": rep,
                            "truth": {"node": run.truth.node, "cause": run.truth.cause},
                            "named": [{"node": s.node, "cause": s.cause,
                                       "confidence": s.confidence, "ranks": s.ranks}
                                      for s in named],
                            "outcome": outcome, "confidence": confidence,
                            "true_lateness_ms": {k: round(v, 2) for k, v in late.items()},
                            "alignment_error_us": measure.alignment_errors(fleet),
                            "median_step_ms": round(run.median_step_ms(), 2),
                            "retransmits": run.retransmits,
                            "verdict": report.get("verdict"),
                            "link_unnamed": report.get("link_unnamed"),
                            "gpu_unnamed": report.get("gpu_unnamed"),
                            "seconds": round(time.monotonic() - t0, 1),
                        }
                        runs.append(row)
                        said = ", ".join(f"{s.node} {s.cause or '-'} {s.confidence or '-'}"
                                         for s in named) or "nobody"
                        print(f"{scenario:<9} on node {pos}  {outcome:<15} "
                              f"{confidence or '':<6} named: {said}  "
                              f"({row['seconds']} s)", flush=True)
                        bundles = run.bundle_dirs[next(iter(run.bundle_dirs))].parent
                        if args.keep and (outcome != "right" or args.keep_all):
                            kept = Path(args.keep) / f"{scenario}-node{pos}-{rep}"
                            shutil.move(str(bundles), str(kept))
                            row["kept"] = str(kept)
                        shutil.rmtree(bundles, ignore_errors=True)
                        shutil.rmtree(out, ignore_errors=True)
    table = collections.defaultdict(collections.Counter)
    for r in runs:
        key = r["outcome"] + (f" ({r['confidence']})" if r["confidence"] else "")
        table[r["scenario"]][key] += 1
    print(f"\n{len(runs)} runs in {time.monotonic() - started:.0f} s, "
          f"{args.nodes} nodes x {args.ranks_per_node} ranks, positions {positions}, "
          f"{args.severity} faults")
    for scenario in scenarios:
        counts = table[scenario]
        print(f"  {scenario:<9} {sum(counts.values()):>3} runs: "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    worst = max((max(r["alignment_error_us"].values()) for r in runs
                 if r["alignment_error_us"]), default=float("nan"))
    print(f"  largest alignment error: {worst:.1f} us")
    sure_and_wrong = [r for r in runs if r["outcome"] in ("wrong", "false positive")
                      and r["confidence"] == "clear"]
    print(f"  wrong and clear: {len(sure_and_wrong)}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(runs, indent=1, default=str))


if __name__ == "__main__":
    main()
