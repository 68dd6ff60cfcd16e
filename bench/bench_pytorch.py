"""Capture a real PyTorch + NCCL training job (needs root, BCC, a CUDA GPU and PyTorch).

Where a GPU machine is at hand, this is the check that the probes see what a real job
does: PyTorch's own libnccl (ncclCommInitRankConfig, the gradient buckets' all-reduces
through DistributedDataParallel, a metric all-reduce), its own libcudart (kernel
launches, copies, ``loss.item()``'s synchronization), and what the job pays for it.

One process, one GPU, world size 1 (NCCL refuses two ranks on one GPU): the collectives
are real NCCL calls on a real communicator, but there is no peer to be late for, so the
report has nothing to compare; what is checked is the capture. Each configuration runs
three rounds of --seconds each:

* off: the job alone (the baseline step time);
* early: ``ingero-capture --pid`` started when the job has imported torch and before it
  creates its process group, so communicator init is seen;
* late: the capture attached --attach-after seconds into a running job (issue 17's live
  incident), nothing but ``--pid``: the libraries are found in the job's mappings. It is
  stopped --seconds after its sources are on, and the job runs on as long again: the
  same process's median step before, while the capture is on and after it stopped is
  the fairest measure of its cost (two processes of one job differ by up to 5 %).

Printed per round: median step time, and for the captured rounds the rise over the
baseline (steady state, the first second left out), the step time while the capture
started (launch until every source is on), and from the merged fleet.db what was
recorded: collectives by operation with communicator, rank and sequence, CUDA calls by
API, waiting synchronizations and how many record their queued work, lost events and
the capture's own CPU cost (capture_log). ``--json`` prints the same as one object.

Configurations: ``gpu`` (16 x 2048-wide layers, batch 256: the GPU's time dominates, as
in most training) and ``launch`` (16 x 256, batch 32: the host's launch loop dominates,
about 100 kernels a step; the worst case for per-call probes).

Usage: python bench/bench_pytorch.py [--seconds 12] [--attach-after 10] [--configs gpu,launch]
                                     [--out DIR] [--capture-ld-path DIR] [--json]

--capture-ld-path: a directory put in front of LD_LIBRARY_PATH for the capture alone,
for a BCC unpacked outside the system's library path (never for the job).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {"gpu": dict(width=2048, layers=16, batch=256),
           "launch": dict(width=256, layers=16, batch=32)}

# --------------------------------------------------------------------------- the job

def job(out: str, seconds: float, width: int, layers: int, batch: int) -> None:
    """The training loop: prints "ready" once torch and CUDA are up, waits for a line on
    stdin, then creates the NCCL process group and trains for `seconds`, writing one
    JSON line per step (CLOCK_MONOTONIC ns at its end, its length)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")                      # CUDA context, libcuda mapped
    libs = sorted({line.split()[-1] for line in open("/proc/self/maps")
                   if any(k in line for k in ("libnccl", "libcudart", "libcuda.so"))})
    print("ready " + json.dumps({"pid": os.getpid(), "libs": libs,
                                 "torch": torch.__version__,
                                 "nccl": str(torch.cuda.nccl.version()),
                                 "gpu": torch.cuda.get_device_name(0)}), flush=True)
    sys.stdin.readline()
    store = os.path.join(tempfile.mkdtemp(prefix="ingero-pg-"), "store")
    kw = dict(init_method=f"file://{store}", rank=0, world_size=1)
    try:
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0), **kw)
    except TypeError:                                 # torch < 2.3: lazy init
        dist.init_process_group("nccl", **kw)
    model = nn.Sequential(*[m for _ in range(layers)
                            for m in (nn.Linear(width, width), nn.ReLU())]).cuda()
    ddp = DDP(model, device_ids=[0])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device="cuda")
    stop = threading.Event()       # a second line on stdin (or its end) stops it early
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    with open(out, "w") as f:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not stop.is_set():
            t0 = time.monotonic_ns()
            loss = ddp(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            metric = loss.detach().clone()
            dist.all_reduce(metric)                   # a metric all-reduce, as jobs log
            metric.item()                             # the step's synchronization
            t1 = time.monotonic_ns()
            f.write(f'{{"end":{t1},"ns":{t1 - t0}}}\n')
    dist.destroy_process_group()
    shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)     # not a normal exit: the thread reading stdin is still in readline


# ------------------------------------------------------------------------ the driver

def cli(module: str) -> list[str]:
    return [sys.executable, "-c",
            f"import sys; sys.argv[0] = {module!r}; from {module} import main; main()"]


def start_job(work: Path, name: str, seconds: float, cfg: dict):
    steps = work / f"{name}.steps"
    # as torchrun does: the rank in the environment the process starts with
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    p = subprocess.Popen([sys.executable, __file__, "--job", str(steps), "--seconds",
                          str(seconds), *[f"--{k}={v}" for k, v in cfg.items()]],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    if not line.startswith("ready "):
        p.kill()
        raise SystemExit(f"job did not start: {line!r}")
    return p, json.loads(line[6:]), steps


def start_capture(work: Path, name: str, pid: int, ld_path: str | None):
    env = dict(os.environ)
    if ld_path:
        env["LD_LIBRARY_PATH"] = ld_path + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    log = work / f"{name}.capture.log"
    argv = [*cli("ingero_forensics.capture.cli"), "--bundle", str(work / name),
            "--node", f"gpu-{name}", "--pid", str(pid), "--duration", "600",
            "--start-priority", "normal"]
    err = open(log, "w")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env), log


def wait_on(cap, log: Path, timeout: float = 120) -> tuple[float, str]:
    """Seconds until the capture's "sources on:" line, and that line."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for line in log.read_text().splitlines():
            if "sources on:" in line:
                return time.monotonic() - t0, line.strip()
        if cap.poll() is not None:
            raise SystemExit(f"capture exited {cap.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    raise SystemExit(f"capture not on after {timeout} s:\n{log.read_text()[-3000:]}")


def stop_capture(cap, log: Path) -> int:
    cap.send_signal(signal.SIGTERM)
    try:
        return cap.wait(timeout=120)
    except subprocess.TimeoutExpired:
        cap.kill()
        raise SystemExit(f"capture did not stop:\n{log.read_text()[-3000:]}")


def steps_of(path: Path) -> list[tuple[int, int]]:
    return [(d["end"], d["ns"]) for d in map(json.loads, path.read_text().splitlines())]


def median_ms(steps, lo: int | None = None, hi: int | None = None) -> float | None:
    xs = [ns for end, ns in steps if (lo is None or end >= lo) and (hi is None or end < hi)]
    return round(statistics.median(xs) / 1e6, 4) if xs else None


def steady(steps) -> list:
    """Steps after the first second (warm-up: cuBLAS heuristics, allocator growth)."""
    return [s for s in steps if s[0] >= steps[0][0] + 1_000_000_000] if steps else []


def inspect_fleet(work: Path, name: str) -> dict:
    """Merge the round's bundles and read back what the capture recorded."""
    import apsw
    fleet = work / f"{name}.fleet.db"
    bundles = sorted(str(p) for p in (work / name).glob("*.bundle"))
    m = subprocess.run([*cli("ingero_forensics.merge.cli"), *bundles, "-o", str(fleet)],
                       capture_output=True, text=True)
    out = {"bundles": len(bundles), "merge_rc": m.returncode,
           "merge_stderr": m.stderr.strip()[-1500:]}
    if m.returncode:
        return out
    r = subprocess.run([*cli("ingero_forensics.report.cli"), str(fleet), "--json"],
                       capture_output=True, text=True)
    out["report_rc"] = r.returncode
    try:
        rep = json.loads(r.stdout)
        out["report"] = {k: rep.get(k) for k in ("verdict", "confidence", "straggler",
                                                  "cause", "gaps", "capture_cost")
                         if k in rep}
    except ValueError:
        out["report_stderr"] = r.stderr.strip()[-1500:]
    db = apsw.Connection(str(fleet), flags=apsw.SQLITE_OPEN_READONLY)
    q = lambda sql: [list(r) for r in db.execute(sql)]          # noqa: E731
    out["rows"] = {t: q(f"SELECT count(*) FROM {t}")[0][0]
                   for t in ("nccl_events", "nccl_comm_events", "cuda_events",
                             "host_samples", "sched_events", "block_events", "tcp_events")}
    out["collectives"] = q(
        "SELECT op, count(*), count(comm_id_hash), count(rank), count(seq), min(seq), max(seq),"
        " count(DISTINCT comm_id_hash), round(avg(duration_ns) / 1e3, 1) AS avg_us"
        " FROM nccl_events GROUP BY op ORDER BY 2 DESC")
    out["comm_events"] = q("SELECT api, rank, nranks, count(*) FROM nccl_comm_events"
                           " GROUP BY 1, 2, 3")
    out["cuda_calls"] = q("SELECT api, count(*), round(avg(duration_ns) / 1e3, 1)"
                          " FROM cuda_events GROUP BY api ORDER BY 2 DESC LIMIT 20")
    out["syncs"] = q("SELECT api, count(*), count(queued_ops), sum(duration_ns >= 20000)"
                     " FROM cuda_events WHERE api LIKE '%Synchronize' GROUP BY api")
    out["processes"] = q("SELECT pid, comm, exe, rank FROM processes")
    out["capture_log"] = q("SELECT level, event, count(*), max(substr(message, 1, 160))"
                           " FROM capture_log GROUP BY level, event ORDER BY 3 DESC")
    # when the losses happened, in seconds after the first source went on
    out["lost_at_s"] = q("SELECT round((timestamp_ns - (SELECT min(timestamp_ns) FROM capture_log"
                         " WHERE event = 'source_on')) / 1e9, 2), source, count FROM capture_log"
                         " WHERE event = 'lost_events' ORDER BY 1")
    out["preload"] = q("SELECT source, message FROM capture_log WHERE message LIKE 'symbols of %'")
    out["late_attach"] = q("SELECT count(handle_seq), count(comm_handle) FROM nccl_events")
    out["event_stats"] = q("SELECT source, name, sum(count), count(*), count(observed_ns)"
                           " FROM event_stats GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 15")
    return out


def run_config(work: Path, cname: str, cfg: dict, args) -> dict:
    res = {"config": cname, **cfg}
    # off
    p, info, path = start_job(work, f"{cname}-off", args.seconds, cfg)
    res["job"] = info
    p.stdin.write("go\n"); p.stdin.flush(); p.wait()
    off = steps_of(path)
    res["off"] = {"steps": len(off), "median_ms": median_ms(steady(off))}
    # early: capture on before the process group exists
    p, info, path = start_job(work, f"{cname}-early", args.seconds, cfg)
    cap, log = start_capture(work, f"{cname}-early", info["pid"], args.capture_ld_path)
    on_s, line = wait_on(cap, log)
    p.stdin.write("go\n"); p.stdin.flush(); p.wait()
    rc = stop_capture(cap, log)
    early = steps_of(path)
    res["early"] = {"steps": len(early), "median_ms": median_ms(steady(early)),
                    "sources_on_s": round(on_s, 2), "sources": line, "capture_rc": rc,
                    "capture_log": log.read_text()[-2500:]}
    # late: attach to a running job, stop the capture while it still runs: the same
    # process's steps before, while it is on, and after it stopped (A/B/A)
    on_for = args.seconds
    p, info, path = start_job(work, f"{cname}-late", 600, cfg)     # stopped below
    p.stdin.write("go\n"); p.stdin.flush()
    time.sleep(args.attach_after)
    t_launch = time.monotonic_ns()
    cap, log = start_capture(work, f"{cname}-late", info["pid"], args.capture_ld_path)
    on_s, line = wait_on(cap, log)
    t_on = time.monotonic_ns()
    time.sleep(on_for)
    t_stop = time.monotonic_ns()
    rc = stop_capture(cap, log)
    t_gone = time.monotonic_ns()
    time.sleep(on_for)
    p.stdin.write("stop\n"); p.stdin.flush()
    p.wait()
    late = steps_of(path)
    second = 1_000_000_000
    before = [s for s in steady(late) if s[0] < t_launch]
    res["late"] = {"steps": len(late), "median_before_ms": median_ms(before),
                   "median_starting_ms": median_ms(late, t_launch, t_on),
                   "median_on_ms": median_ms(late, t_on + second, t_stop),
                   "median_after_stop_ms": median_ms(late, t_gone + second // 2),
                   "sources_on_s": round(on_s, 2), "stop_s": round((t_gone - t_stop) / 1e9, 2),
                   "sources": line, "capture_rc": rc, "capture_log": log.read_text()[-2500:]}
    base = res["off"]["median_ms"]
    if base:
        res["early"]["rise_pct"] = round(100 * (res["early"]["median_ms"] / base - 1), 2)
    late_r = res["late"]
    off_same = [x for x in (late_r["median_before_ms"], late_r["median_after_stop_ms"]) if x]
    if off_same and late_r["median_on_ms"]:
        late_r["rise_same_process_pct"] = round(
            100 * (late_r["median_on_ms"] / statistics.mean(off_same) - 1), 2)
    res["early"]["fleet"] = inspect_fleet(work, f"{cname}-early")
    res["late"]["fleet"] = inspect_fleet(work, f"{cname}-late")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=2048, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=12.0, help="seconds per round")
    ap.add_argument("--attach-after", type=float, default=10.0,
                    help="seconds into the late round's job before the capture starts")
    ap.add_argument("--configs", default="gpu,launch")
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--capture-ld-path", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.job:
        job(args.job, args.seconds, args.width, args.layers, args.batch)
        return
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    work = Path(args.out or tempfile.mkdtemp(prefix="bench-pytorch-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for cname in args.configs.split(","):
        r = run_config(work, cname, CONFIGS[cname], args)
        results.append(r)
        if not args.json:
            print(json.dumps(r, indent=1, default=str), flush=True)
    if args.json:
        print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
