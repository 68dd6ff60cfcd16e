"""Benchmark the late-attach inference (merge/lateattach.py): how long matching the
call streams of a job whose captures attached after ncclCommInitRank takes.

Builds STREAMS synthetic streams of CALLS collectives each (four shapes per 270 ms
step, attach points spread over 50 steps, one rank 100 ms late, synchronizations
after each step, 8 ranks per node on clocks with 1 ms error) and times group_streams,
the matching itself (reading the rows is the merge's ordinary cost). No floor exists;
the figure is the time per stream.

    python bench/bench_lateattach.py [--streams 512] [--calls 5000]
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ingero_forensics.merge.lateattach import Stream, group_streams, shape  # noqa: E402

MS = 1_000_000
PER_STEP, STEP_NS = 4, 270 * MS


def streams(n: int, calls: int, seed: int = 1) -> list[Stream]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        start = rng.randint(0, 50) * PER_STEP
        late = 100 * MS if k == 7 else 0
        s = Stream(k // 8 + 1, 1000 + k, 1)
        for i in range(calls):
            step, pos = divmod(start + i, PER_STEP)
            s.seqs.append(i + 1)
            s.times.append(step * STEP_NS + pos * 20 * MS + rng.randint(0, 2 * MS) + late)
            s.shapes.append(shape("ALL_REDUCE", 100 + pos, "float32", "sum", None))
            s.observed.append(step * STEP_NS + 170 * MS)
        out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=512)
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    data = streams(args.streams, args.calls)
    nodes = {s.node_id for s in data}
    for s in data:
        s.clock_err = MS            # synchronized clocks claiming 1 ms
    clocks = {"samples": {}, "boot": {n: str(n) for n in nodes}}
    t = time.perf_counter()
    groups, why = group_streams(data, clocks)
    wall = time.perf_counter() - t
    sizes = sorted((len(g.members) for g in groups), reverse=True)
    print(f"late-attach matching: {args.streams} streams x {args.calls:,} calls in "
          f"{wall:.2f} s ({wall / args.streams * 1e3:.1f} ms per stream); groups "
          f"{sizes[:4]}{' ...' if len(sizes) > 4 else ''}, left alone {len(why)}; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB (the "
          "streams built in memory included)")
    if sizes != [args.streams]:
        sys.exit("not one communicator: the matching is wrong")


if __name__ == "__main__":
    main()
