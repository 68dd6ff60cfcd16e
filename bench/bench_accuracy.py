"""Accuracy sweep: how often the report is right, by fleet size (not a timed test).

For every size (nodes x ranks per node), every fault kind and clean runs, several seeds:
simulate, merge, report (--json). Prints, per size: straggler right, cause right (of the
faulty runs), false positives (clean runs that name a straggler or say anything but "No
straggler"), and the alignment error against the simulator's truth (per node: median
aligned - true of its collectives, relative to the fleet's common error) next to the
relative uncertainty the merge states (a node counts as over when its error exceeds its
stated uncertainty plus the fleet's median one, or none is stated); then the worst
cases.

Bundles and fleet.db files are kept under --dir and reused (a report change re-runs in
seconds: --report-only), so the sweep stays cheap to repeat.

Usage: python bench/bench_accuracy.py [--sizes 8x2,16x4,32x4,64x2] [--seeds 3]
                                      [--clean-seeds 20] [--steps 300] [--dir DIR]
                                      [--faults cpu,io,...] [--report-only] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import apsw  # noqa: E402

from ingero_forensics.merge import merge_bundles  # noqa: E402
from ingero_forensics.report import analyze_fleet  # noqa: E402
from ingero_forensics.simulate import FleetConfig, simulate_fleet  # noqa: E402

FAULTS = ("cpu", "io", "network", "gpu", "memory", "slowlink")
#: the cause the report names for a fault kind, where the two names differ (a slow link
#: is a network cause: rule 4c, docs/report.md), and what it must name besides
CAUSE_OF = {"slowlink": "network"}


def alignment_errors(truth: dict, db: Path) -> list[tuple[str, float, float | None]]:
    """(node, |relative error| us, stated relative uncertainty us or None) per node."""
    clocks = {n["name"]: n["clock"]["true_utc_of_mono"] for n in truth["nodes"]}
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        med, unc = {}, {}
        for nid, name, rel in con.execute(
                "SELECT n.node_id, n.name, a.relative_uncertainty_ns FROM nodes n "
                "JOIN clock_alignment a USING (node_id)").fetchall():
            c = clocks[name]
            errs = [e for (e,) in con.execute(
                "SELECT (timestamp_ns - :boot) - mono_ns * :rate FROM nccl_events "
                "WHERE node_id = :node AND id % 7 = 0", {"boot": c["boot_utc_ns"],
                                                          "rate": c["rate"], "node": nid})]
            med[name] = statistics.median(errs)
            unc[name] = rel
    finally:
        con.close()
    common = statistics.median(med.values())
    return [(n, abs(m - common) / 1e3, None if unc[n] is None else unc[n] / 1e3)
            for n, m in med.items()]


def run_case(root: Path, nodes: int, rpn: int, fault: str, seed: int, steps: int,
             report_only: bool, ntp_step: bool = False, window=None) -> dict:
    window = window if fault != "none" else None
    d = root / (f"{nodes}x{rpn}-{fault}-{seed}{'-ntp' if ntp_step else ''}"
                + (f"-w{window[0]}-{window[1]}" if window else ""))
    db = d / "fleet.db"
    if not report_only or not db.exists():
        if d.exists():
            import shutil
            shutil.rmtree(d)
        simulate_fleet(d / "b", FleetConfig(nodes=nodes, ranks_per_node=rpn, steps=steps,
                                            fault=fault, seed=seed, ntp_step=ntp_step,
                                            fault_windows=(window,) if window else ()))
        merge_bundles([d / "b"], db)
    truth = json.loads((d / "b" / "truth.json").read_text())
    a = analyze_fleet(db)
    want = truth["fault"]["straggler"]
    link_right = fault != "slowlink" or (
        a.link_suspect is not None and
        [a.link_suspect["from"], a.link_suspect["to"]] == truth["fault"]["detail"]["link"])
    return {"nodes": nodes, "rpn": rpn, "fault": fault, "seed": seed,
            "truth": want, "said": a.straggler, "cause": a.cause,
            "confidence": a.cause_confidence, "stragglers": [s.node for s in a.stragglers],
            "straggler_right": a.straggler == want and (want is None or
                                                        len(a.stragglers) <= 1),
            "cause_right": fault == "none" or (a.cause == CAUSE_OF.get(fault, fault)
                                               and a.cause_confidence == "clear"
                                               and link_right),
            "false_positive": fault == "none" and not a.verdict.startswith("No straggler"),
            "alignment": alignment_errors(truth, db), "verdict": a.verdict}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8x2,16x4,32x4,64x2")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per fault kind and size")
    ap.add_argument("--clean-seeds", type=int, default=20, help="clean runs per size")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ingero-accuracy"))
    ap.add_argument("--report-only", action="store_true",
                    help="reuse the fleet.db files already under --dir")
    ap.add_argument("--ntp-step", action="store_true",
                    help="every node's clock is stepped once mid-run (ingero-simulate "
                         "--ntp-step); fleets kept apart from the unstepped ones")
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help="fault kinds to run (comma-separated; default: all)")
    ap.add_argument("--fault-window", metavar="START:END",
                    help="every fault only in steps [START, END) (ingero-simulate "
                         "--fault-window); fleets kept apart from the whole-run ones")
    ap.add_argument("--json", type=Path, help="write every case as JSON here")
    args = ap.parse_args()
    window = None
    if args.fault_window:
        try:
            window = tuple(int(x) for x in args.fault_window.split(":"))
            assert len(window) == 2 and 0 <= window[0] < window[1] <= args.steps
        except (ValueError, AssertionError):
            ap.error(f"--fault-window: START:END within the {args.steps} steps")
    faults = [f for f in args.faults.split(",") if f]
    if set(faults) - set(FAULTS):
        ap.error(f"--faults: unknown {', '.join(sorted(set(faults) - set(FAULTS)))}")
    args.dir.mkdir(parents=True, exist_ok=True)
    cases = []
    t0 = time.perf_counter()
    for size in args.sizes.split(","):
        nodes, rpn = (int(x) for x in size.split("x"))
        plan = [(f, 100 + k) for f in faults for k in range(args.seeds)]
        plan += [("none", 200 + k) for k in range(args.clean_seeds)]
        for fault, seed in plan:
            c = run_case(args.dir, nodes, rpn, fault, seed, args.steps, args.report_only,
                         args.ntp_step, window)
            cases.append(c)
            print(f"  {nodes}x{rpn} {fault:<8} seed {seed}: truth {c['truth']}, said "
                  f"{c['said']} {c['cause']} ({c['confidence']})", flush=True)
    print(f"\n{len(cases)} runs in {time.perf_counter() - t0:.0f} s\n")
    print(f"{'size':>7} {'faulty':>6} {'straggler ok':>12} {'cause ok':>9} {'clean':>6} "
          f"{'false +':>8} {'align err us (median/max)':>26} {'err > stated':>12}")
    for size in args.sizes.split(","):
        nodes, rpn = (int(x) for x in size.split("x"))
        mine = [c for c in cases if (c["nodes"], c["rpn"]) == (nodes, rpn)]
        faulty = [c for c in mine if c["fault"] != "none"]
        clean = [c for c in mine if c["fault"] == "none"]
        errs = [e for c in mine for _, e, _ in c["alignment"]]
        # a node's error is relative to the fleet's median node, whose own error counts
        # too: compare with its stated uncertainty plus the fleet's median one (the
        # pair uncertainty the report uses)
        over = 0
        for c in mine:
            us = [u for _, _, u in c["alignment"] if u is not None]
            typical = statistics.median(us) if us else 0.0
            over += sum(1 for _, e, u in c["alignment"] if u is None or e > u + typical)
        print(f"{size:>7} {len(faulty):>6} "
              f"{sum(c['straggler_right'] for c in faulty) / max(len(faulty), 1):>12.0%} "
              f"{sum(c['cause_right'] for c in faulty) / max(len(faulty), 1):>9.0%} "
              f"{len(clean):>6} {sum(c['false_positive'] for c in clean):>8} "
              f"{statistics.median(errs):>12.1f} / {max(errs):>10.1f} {over:>12}")
    worst = [c for c in cases if not (c["straggler_right"] and c["cause_right"])
             or c["false_positive"]]
    if worst:
        print("\nwrong:")
        for c in worst:
            print(f"  {c['nodes']}x{c['rpn']} {c['fault']} seed {c['seed']}: {c['verdict'][:200]}")
    if args.json:
        args.json.write_text(json.dumps(cases, indent=1))


if __name__ == "__main__":
    main()
