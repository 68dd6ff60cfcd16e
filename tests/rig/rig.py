"""A real-kernel multi-node rig on one machine: network namespaces as nodes.

Every node is a network namespace of our own (``ingero-rig-<pid>.<start>-<k>``: the rig
process's pid and start time) joined by a veth pair to a bridge that lives in a namespace
of its own (``ingero-rig-<pid>.<start>-br``), so no
address, route or packet of the rig ever touches the root namespace. Each node runs one
or two ranks of tests/fixtures/train_job.c (TCP ring all-reduce through the NCCL shim)
and one ``ingero-capture`` restricted to that node's ranks, with its own ``--node`` and
bundle directory. All namespaces share one kernel, hence one CLOCK_MONOTONIC: the true
clock skew between the nodes is 0, which makes every alignment checkable.

Processes enter a namespace with ``nsenter --net=/run/netns/NAME``, never ``ip netns
exec``: the latter remounts /sys, which hides tracefs from the capture.

Every node's ranks also live in a cgroup of their own (``ingero-rig-<pid>.<start>-<k>`` in the
cgroup v2 hierarchy), as a job does on its machine, so that each capture can tell its
node's pressure (PSI) from the shared kernel's; the "memory" fault limits the
straggler's (the v1 memory controller where it is bound there, else v2 ``memory.max``).

Order of a run: ranks start and stop at "ready"; the captures start and report
"sources on" (their uprobes are attached); the fault is switched on; "go" releases the
ranks, which only then create their communicator. After the job's JSON lines, the ranks
are kept alive a moment for stack symbolization, then released; SIGTERM makes every
capture seal its bundle. Whatever happens, ``Rig.close`` (also registered with atexit)
kills what the rig started and deletes its namespaces, which takes their veths, the
bridge and any qdisc with them.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ingero_forensics.capture.procs import read_stat_starttime

from ..fixtures.build import Fixtures, build_fixtures

PREFIX = "ingero-rig-"
SUBNET = "10.213.0"          # /24, only inside the rig's own namespaces
ROOT_PORT = 29500
SCENARIOS = ("none", "cpu", "io", "network", "gpu", "compute", "memory", "slowlink")
#: The cause the report should give, in its vocabulary; "compute" (the rank's own code
#: takes longer: no contention, I/O, network or GPU) has none the capture can see.
CAUSE = {"cpu": "cpu", "io": "io", "network": "network", "gpu": "gpu", "compute": None,
         "memory": "memory", "slowlink": "network"}
#: The loader's mode per scenario, on every node: "heavy" only on the straggler (O_DIRECT
#: reads and synced writes), "paged" on every node (random pages of a memory-mapped shard:
#: the same work everywhere, the straggler with too little memory for it)
LOADER = {"io": "heavy", "memory": "paged"}
#: "memory": the straggler's job may hold this much memory per rank (its cgroup's limit,
#: charged from "ready" on), under the 32 MiB shard each rank reads pages of at random:
#: evicted pages are read again (the kernel counts that time as memory stall)
MEMORY_LIMIT_PER_RANK = 12 << 20
#: Environment of the straggler's ranks per scenario: "gpu", a GPU four times slower
#: (the cudart shim's kernels: three times was enough while every shim kernel also paid its
#: thread's wake-up, about 100 us; with the shim's own timeline three times scored 4.1-7.1
#: against rule 4b's clear 5 in six runs, four times 7.2-9.6 in four); "compute", 8 ms
#: more collate CPU time per step.
FAULT_ENV = {"gpu": {"INGERO_SHIM_KERNEL_PCT": "400"},
             "compute": {"INGERO_JOB_COLLATE_EXTRA_US": "8000"}}
#: The CPU hog: a competing job of HOG_PROCS busy processes (one process group, in the
#: ranks' session: the scheduler's autogroups would otherwise give it only its own share),
#: all on the straggler's CPU at nice -10, so its ranks' host threads get a small share.
HOG_PROCS = 4
#: Busy until stopped, or until the rig's process (argv[1]) is gone.
HOG = """import os, sys
rig = "/proc/" + sys.argv[1]
for _ in range(int(sys.argv[2]) - 1):
    if os.fork() == 0:
        break
with open(sys.argv[3], "a") as f:      # each process's pid, for the tests to know it
    f.write(f"{os.getpid()}\\n")
while os.path.exists(rig):
    for _ in range(1_000_000):
        pass
"""
#: A capture outlives a killed test run by this much at most.
CAPTURE_MAX_S = 900
#: The capture's stderr line for a sealed segment (the last one on SIGTERM comes before
#: the probes' detaches).
SEALED = "capture: sealed "
#: tbf on the straggler's side of its link: a rate well under what the ring moves per
#: step, a burst of two packets and a 1 ms queue, so packets are dropped and TCP
#: retransmits (a 100 ms queue would only delay them).
TBF = ("rate", "300mbit", "burst", "3000", "latency", "1ms")
#: "slowlink": tbf with a 400 ms queue (10 MB at the rate) and a 64 KiB burst, at two
#: thirds of that rate: packets wait in the queue and none is dropped, as on a NIC that
#: negotiated a lower speed or a congested switch port (the ring's steps take 2.5 times
#: as long, its bytes 5-6 ms across that link; no retransmits)
TBF_SLOW = ("rate", "200mbit", "burst", "64kb", "latency", "400ms")
#: Milder faults (``Rig(severity="mild")``, bench/bench_rig_accuracy.py): what each
#: fault's knob is set to instead, so that the report's evidence is weaker and a verdict
#: may rightly be "cannot tell", never another node's. A single hog at nice 0 (about
#: half the CPU for the ranks' host threads), a sixth of the O_DIRECT reads, twice the
#: lossy link's rate and one and a half times the queueing link's, a memory limit
#: nearer the shard, a GPU twice as slow instead of four times.
MILD = {"hog": ("1", "0"), "env": {"io": {"INGERO_JOB_HEAVY_READ_BYTES": str(2 << 20)},
                                   "gpu": {"INGERO_SHIM_KERNEL_PCT": "200"}},
        "tbf": ("rate", "600mbit", "burst", "3000", "latency", "1ms"),
        "tbf_slow": ("rate", "300mbit", "burst", "64kb", "latency", "400ms"),
        "memory_limit_per_rank": 20 << 20}
#: the shaping switched off without a drop: a rate no veth reaches (its 12.5 MB queue
#: holds what TBF_SLOW's 10 MB held)
TBF_DRAIN = ("rate", "100gbit", "burst", "4mb", "latency", "1ms")


class RigError(RuntimeError):
    pass


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode:
        raise RigError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def missing_tools() -> list[str]:
    return [t for t in ("ip", "tc", "nsenter", "taskset") if shutil.which(t) is None]


def capture_cmd() -> list[str]:
    exe = shutil.which("ingero-capture")
    return [exe] if exe else [sys.executable, "-m", "ingero_forensics.capture"]


@dataclass(frozen=True)
class Truth:
    """What the rig did: the straggler node (None on the clean run), its global ranks
    and the cause, in the report's vocabulary (cpu, io, network, gpu; None on the clean
    run and for "compute", whose cause the capture cannot see)."""
    scenario: str
    node: str | None
    ranks: tuple[int, ...]
    cause: str | None
    nodes: tuple[str, ...] = ()     # every degraded node (node is the first)


@dataclass
class RunResult:
    scenario: str
    truth: Truth
    bundle_dirs: dict[str, Path]              # node name -> its capture's --bundle
    bundles: dict[str, list[Path]]            # node name -> sealed bundles
    results: dict[int, dict]                  # global rank -> the job's JSON line
    node_of_rank: dict[int, str]
    pids: dict[str, list[int]]                # node name -> its ranks' pids
    retransmits: dict[str, int]               # node name -> TCP RetransSegs during the job
    capture_stderr: dict[str, str]
    seconds: float                            # the whole run, set-up to sealed bundles
    capture_start_s: float = 0.0              # captures started until all sources on
    capture_stop_s: float = 0.0               # SIGTERM until every capture exited
    #: CLOCK_MONOTONIC ns: captures launched, every source on
    capture_window_ns: tuple[int, int] = (0, 0)
    #: CLOCK_MONOTONIC ns: the fault switched on and off, where it had a period
    fault_window_ns: tuple[int, ...] = ()
    #: the CPU hog's processes ("cpu"; empty otherwise)
    hog_pids: tuple[int, ...] = ()

    @property
    def step_ns(self) -> dict[int, list[int]]:
        return {r: res["step_ns"] for r, res in self.results.items()}

    def median_step_ms(self, ranks=None) -> float:
        vals = sorted(v for r, res in self.results.items() if ranks is None or r in ranks
                      for v in res["step_ns"])
        return vals[len(vals) // 2] / 1e6 if vals else 0.0

    def step_ends(self) -> dict[int, list[tuple[int, int]]]:
        """Per rank, (end of the step on CLOCK_MONOTONIC, its length) for every step: the
        job's steps are back to back from its start_mono_ns."""
        out = {}
        for r, res in self.results.items():
            t, ends = res["start_mono_ns"], []
            for d in res["step_ns"]:
                t += d
                ends.append((t, d))
            out[r] = ends
        return out

    def all_bundles(self) -> list[Path]:
        return [b for bs in self.bundles.values() for b in bs]


@dataclass
class Node:
    index: int
    name: str          # the capture's --node
    netns: str
    veth: str          # the node's end, inside its namespace
    peer: str          # the bridge's end, in the bridge namespace
    addr: str
    ranks: list[int] = field(default_factory=list)

    @property
    def nsenter(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--"]


class Rig:
    """Namespaces, veths and a bridge for ``nodes`` nodes of ``ranks_per_node`` ranks.

    ``straggler`` is the index of the node that scenarios other than "none" degrade, or a
    tuple of indices: those nodes all at once (one CPU hog shared by their ranks, each
    node's own loader or link). ``tensor_parallel``: each node's ranks also all-reduce on
    a communicator of their own (communicator-local ranks, as PyTorch's new_group).
    ``severity``: "strong" (the tests' faults) or "mild" (``MILD``).
    """

    def __init__(self, workdir: Path, nodes: int = 4, ranks_per_node: int = 1,
                 straggler: int | tuple[int, ...] = 2, fixtures: Fixtures | None = None,
                 tensor_parallel: bool = False, severity: str = "strong"):
        if severity not in ("strong", "mild"):
            raise ValueError(f"severity is strong or mild, not {severity!r}")
        self.severity = severity
        self.mild = severity == "mild"    # of the run under way (run_scenario)
        self.stragglers = straggler if isinstance(straggler, tuple) else (straggler,)
        if not 1 < nodes < 200 or not self.stragglers or \
                not all(0 <= k < nodes for k in self.stragglers):
            raise ValueError("need 2..199 nodes and the stragglers among them")
        self.workdir = Path(workdir)
        self.fixtures = fixtures or build_fixtures()
        self.ranks_per_node = ranks_per_node
        # each node's ranks also share a communicator of their own (train_job.c)
        self.tensor_parallel = tensor_parallel and ranks_per_node > 1
        self.straggler = self.stragglers[0]
        # the process's start time too: a pid alone may belong to another process by
        # the time a later run asks whether this rig is gone
        tag = f"{PREFIX}{os.getpid()}.{read_stat_starttime(os.getpid())}"
        short = f"ir{os.getpid() % 100000}"
        self.bridge_ns = f"{tag}-br"
        self.nodes = [Node(k, f"rig-node-{k}", f"{tag}-{k}", f"{short}n{k}", f"{short}b{k}",
                           f"{SUBNET}.{k + 1}") for k in range(nodes)]
        for n in self.nodes:
            n.ranks = [n.index * ranks_per_node + i for i in range(ranks_per_node)]
        self._procs: list[subprocess.Popen] = []
        #: captures that sealed and are detaching their probes: (node, process, log)
        self._exiting: list[tuple[str, subprocess.Popen, Path]] = []
        self._made: list[str] = []
        self.cgroups = Cgroups(tag)
        self._closed = False
        self._runs = 0
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- set-up and tear-down ---------------------------------------------------------
    def _build(self) -> None:
        remove_stale_namespaces()
        remove_stale_cgroups()
        run("ip", "netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        br = ["ip", "-n", self.bridge_ns]
        run(*br, "link", "add", "br0", "type", "bridge")
        run(*br, "link", "set", "br0", "up")
        for n in self.nodes:
            run("ip", "netns", "add", n.netns)
            self._made.append(n.netns)
            run("ip", "link", "add", n.veth, "netns", n.netns, "type", "veth",
                "peer", "name", n.peer, "netns", self.bridge_ns)
            run(*br, "link", "set", n.peer, "master", "br0")
            run(*br, "link", "set", n.peer, "up")
            ns = ["ip", "-n", n.netns]
            run(*ns, "addr", "add", f"{n.addr}/24", "dev", n.veth)
            run(*ns, "link", "set", n.veth, "up")
            run(*ns, "link", "set", "lo", "up")

    def close(self, check: bool = False) -> None:
        """Stop what is left and delete the namespaces; ``check``: the last scenario's
        captures must have exited 0 (RigError otherwise, once everything is gone)."""
        if self._closed:
            return
        self._closed = True
        error = None
        try:
            self.reap_captures()
        except RigError as e:
            error = e
        for p in self._procs:
            stop_process(p)
        self.cgroups.remove()
        for ns in reversed(self._made):
            run("ip", "netns", "del", ns, check=False)
        atexit.unregister(self.close)
        if check and error is not None:
            raise error

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(check=exc_type is None)

    def _spawn(self, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, **kw)
        self._procs.append(p)
        return p

    # -- layout -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node

    def straggler_cpu(self) -> int:
        """The CPU the straggler's ranks are pinned to in every scenario (and the hog
        in "cpu"); the other ranks are not pinned, so the clean run stays symmetric."""
        return sorted(os.sched_getaffinity(0))[-1]

    def device_cpus(self) -> list[int]:
        """Where the straggler's shim "GPU" threads run: the CPUs the hog leaves alone
        (a CPU hog on a host does not slow its GPU down)."""
        cpus = sorted(os.sched_getaffinity(0))
        return cpus[:-1] or cpus

    def truth(self, scenario: str) -> Truth:
        if scenario == "none":
            return Truth(scenario, None, (), None)
        node = self.nodes[self.straggler]
        return Truth(scenario, node.name, tuple(node.ranks), CAUSE.get(scenario),
                     tuple(self.nodes[k].name for k in self.stragglers))

    # -- one scenario --------------------------------------------------------------------
    def run_scenario(self, scenario: str, steps: int | str = 200, settle_s: float = 1.5,
                     capture_args: tuple[str, ...] = (), captures: bool = True,
                     attach_after_s: float | None = None,
                     slow_link: int | None = None,
                     fault_period_s: tuple[float, float] | None = None,
                     severity: str | None = None) -> RunResult:
        """Run the job once with ``scenario``'s fault on the straggler node, each node
        traced by its own capture (``captures=False``: no capture, for overhead figures).
        ``attach_after_s``: the captures start that long after the job did, as an operator
        attaches to a running job (``steps`` as "SECONDSs" keeps it running meanwhile).
        ``slow_link``: the index of a node whose link queues (``TBF_SLOW`` on its veth)
        beside the scenario's own fault: two faults at once, on different nodes.
        ``fault_period_s``: the fault is on only from that many seconds after the job
        started to the second figure (a congestion episode), its times kept in
        ``fault_window_ns``. ``severity``: this run's, instead of the rig's. Returns the
        bundles, the truth and the job's own timings."""
        if severity not in (None, "strong", "mild"):
            raise ValueError(f"severity is strong or mild, not {severity!r}")
        self.mild = (severity or self.severity) == "mild"
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; one of {', '.join(SCENARIOS)}")
        if slow_link is not None and not 0 <= slow_link < len(self.nodes):
            raise ValueError("the slow link's node must be one of the nodes")
        self.reap_captures()
        self._runs += 1
        out = self.workdir / f"{self._runs:02d}-{scenario}"
        out.mkdir(parents=True)
        self._out = out
        started = time.monotonic()
        local: list[subprocess.Popen] = []   # stopped whatever happens
        caps: dict[str, tuple[subprocess.Popen, Path]] = {}
        fault_off = None
        try:
            ranks = self._start_ranks(scenario, steps, out, local)

            def start_captures():
                t = time.monotonic_ns()
                if captures:
                    for n in self.nodes:
                        caps[n.name] = self._start_capture(
                            n, [ranks[r].pid for r in n.ranks], out, capture_args)
                        local.append(caps[n.name][0])
                    for cap, log in caps.values():
                        wait_sources_on(cap, log)
                return t, time.monotonic_ns()
            if attach_after_s is None:
                window = start_captures()
            switched: list[int] = []
            if fault_period_s is None:
                fault_off = self._fault_on(scenario, local, slow_link)
            before = {n.name: retrans_segs(ranks[n.ranks[0]].pid) for n in self.nodes}
            for p in ranks.values():
                p.stdin.write("go\n")
                p.stdin.flush()
            if fault_period_s is not None:
                fault_off = self._fault_in_period(scenario, local, fault_period_s, switched)
            if attach_after_s is not None:
                time.sleep(attach_after_s)
                window = start_captures()
            results = {}
            for r, p in ranks.items():
                line = p.stdout.readline()
                if not line:
                    raise RigError(f"rank {r} failed: {(out / f'rank-{r}.err').read_text()}")
                results[r] = json.loads(line)
            after = {n.name: retrans_segs(ranks[n.ranks[0]].pid) for n in self.nodes}
            off, fault_off = fault_off, None
            off()
            time.sleep(settle_s)   # the captures symbolize stacks while the ranks live
            for p in ranks.values():
                p.stdin.close()
            for r, p in ranks.items():
                if p.wait(timeout=30):
                    raise RigError(f"rank {r} exited {p.returncode}")
            t_stop = time.monotonic()
            stderr = self._stop_captures(caps)
            cap_stop = time.monotonic() - t_stop
        finally:
            if fault_off is not None:
                fault_off()
            detaching = [cap for _, cap, _ in self._exiting]
            for p in local:
                if p not in detaching:
                    stop_process(p)
            self._procs = [p for p in self._procs if p not in local or p in detaching]
        return RunResult(
            scenario=scenario, truth=self.truth(scenario),
            bundle_dirs={name: out / "bundles" / name for name in caps},
            bundles={name: sorted((out / "bundles" / name).glob("*.bundle")) for name in caps},
            results=results, node_of_rank={r: n.name for n in self.nodes for r in n.ranks},
            pids={n.name: [ranks[r].pid for r in n.ranks] for n in self.nodes},
            retransmits={k: after[k] - before[k] for k in after}, capture_stderr=stderr,
            seconds=round(time.monotonic() - started, 1),
            capture_start_s=round((window[1] - window[0]) / 1e9, 1),
            capture_stop_s=round(cap_stop, 1), capture_window_ns=window,
            fault_window_ns=tuple(switched),
            hog_pids=tuple(int(x) for x in (out / "hog-pids").read_text().split())
            if (out / "hog-pids").exists() else ())

    def _fault_in_period(self, scenario: str, local: list, period_s: tuple[float, float],
                         switched: list) -> Callable[[], None]:
        """The scenario's fault switched on period_s[0] seconds from now and off at
        period_s[1] (or when the returned function is called, if sooner), by a thread;
        the CLOCK_MONOTONIC times of both switches are appended to ``switched``."""
        stop = threading.Event()
        failed: list[BaseException] = []

        def period():
            try:
                if stop.wait(period_s[0]):
                    return
                off = self._fault_on(scenario, local)
                switched.append(time.monotonic_ns())
                try:
                    stop.wait(period_s[1] - period_s[0])
                finally:
                    off()
                    switched.append(time.monotonic_ns())
            except BaseException as e:       # raised in the run's thread, below
                failed.append(e)
        th = threading.Thread(target=period, name="rig-fault-period", daemon=True)
        th.start()

        def end():
            stop.set()
            th.join()
            if failed:
                raise failed[0]
        return end

    def _start_ranks(self, scenario: str, steps: int, out: Path,
                     local: list) -> dict[int, subprocess.Popen]:
        """Every rank, in its node's namespace, stopped at "ready"."""
        idfile = out / "nccl-id"
        # port in bytes 0-1, rank 0's address in bytes 2-5 (see shim_nccl.c)
        idfile.write_bytes(struct.pack("<H", ROOT_PORT + self._runs) +
                           bytes(int(x) for x in self.nodes[0].addr.split(".")) +
                           os.urandom(122))
        stragglers = [self.nodes[k] for k in self.stragglers]
        ranks: dict[int, subprocess.Popen] = {}
        for n in self.nodes:
            loader = out / "loader" / n.name
            loader.mkdir(parents=True)
            mode = LOADER.get(scenario)
            heavy = [mode] if mode and (n in stragglers or mode == "paged") else []
            for lr, r in enumerate(n.ranks):
                # (INGERO_SHIM_DEVICE_RT: every rank's "GPU" threads run SCHED_FIFO, so
                # that a busy CPU delays their completions no more than a real GPU's;
                # see shim_cudart.c)
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(self.world_size),
                           LOCAL_RANK=str(lr), LOCAL_WORLD_SIZE=str(self.ranks_per_node),
                           NODE_RANK=str(n.index), INGERO_SHIM_DEVICE_RT="1")
                if self.tensor_parallel:
                    # the node's own communicator: its first rank listens at the node's
                    # address (the world's at node 0's, see idfile)
                    tp_id = out / f"nccl-tp-id-{n.index}"
                    if not tp_id.exists():
                        tp_id.write_bytes(struct.pack("<H", ROOT_PORT + 500 + self._runs) +
                                          bytes(int(x) for x in n.addr.split(".")) +
                                          os.urandom(122))
                    env.update(INGERO_JOB_TP=str(self.ranks_per_node), INGERO_JOB_TP_ID=str(tp_id))
                if n in stragglers:
                    env.update(FAULT_ENV.get(scenario, {}))
                    if self.mild:
                        env.update(MILD["env"].get(scenario, {}))
                pin = []
                if n in stragglers and (scenario == "cpu" or len(stragglers) == 1):
                    # (several stragglers share the hog's CPU only when it is the fault)
                    # the host threads on the hog's CPU, the "GPU" threads off it
                    pin = ["taskset", "-c", str(self.straggler_cpu())]
                    env["INGERO_SHIM_DEVICE_CPUS"] = ",".join(map(str, self.device_cpus()))
                argv = [*n.nsenter, *pin, str(self.fixtures.train_job), str(r),
                        str(self.world_size), str(idfile), str(steps), str(loader), *heavy]
                with open(out / f"rank-{r}.err", "w") as err:
                    ranks[r] = self._spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=err, text=True, env=env)
                local.append(ranks[r])
        for r, p in ranks.items():
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RigError(f"rank {r} did not start: {line!r} "
                               f"{(out / f'rank-{r}.err').read_text()}")
        for n in self.nodes:
            self.cgroups.enter(n.netns, [ranks[r].pid for r in n.ranks])
        return ranks

    def _fault_on(self, scenario: str, local: list, slow_link: int | None = None):
        """Switch the scenario's fault on, and slow_link's queueing link if given; return
        the function that switches them off."""
        off = self._scenario_fault_on(scenario, local)
        if slow_link is None:
            return off
        tc, veth = ["tc", "-n", self.nodes[slow_link].netns, "qdisc"], \
            self.nodes[slow_link].veth
        try:
            run(*tc, "add", "dev", veth, "root", "tbf", *TBF_SLOW)
        except BaseException:
            off()
            raise

        def both_off():
            run(*tc, "del", "dev", veth, "root", check=False)
            off()
        return both_off

    def _scenario_fault_on(self, scenario: str, local: list):
        if scenario == "cpu":
            # at nice -10 (about ten times a rank's weight): the contention is then the
            # same on every run, whatever else the machine does and however the
            # scheduler credits a rank that sleeps in its syncs
            procs, nice = MILD["hog"] if self.mild else (str(HOG_PROCS), "-10")
            hog = self._spawn(["nice", "-n", nice, "taskset", "-c", str(self.straggler_cpu()),
                               sys.executable, "-c", HOG, str(os.getpid()), procs,
                               str(self._out / "hog-pids")], process_group=0)
            local.append(hog)
            return lambda: stop_process(hog)
        if scenario in ("network", "slowlink"):
            links = [(["tc", "-n", self.nodes[k].netns, "qdisc"], self.nodes[k].veth)
                     for k in self.stragglers]
            for tc, veth in links:
                if scenario == "network":
                    shape = MILD["tbf"] if self.mild else TBF
                else:
                    shape = MILD["tbf_slow"] if self.mild else TBF_SLOW
                run(*tc, "add", "dev", veth, "root", "tbf", *shape)

            def links_off():
                # mid-run, deleting a qdisc drops what it queues (TCP then retransmits):
                # its rate is raised first, which drains the queue, then it goes
                for tc, veth in links:
                    run(*tc, "change", "dev", veth, "root", "tbf", *TBF_DRAIN, check=False)
                time.sleep(0.05)
                for tc, veth in links:
                    run(*tc, "del", "dev", veth, "root", check=False)
            return links_off
        if scenario == "memory":
            for k in self.stragglers:
                n = self.nodes[k]
                per_rank = (MILD["memory_limit_per_rank"] if self.mild
                            else MEMORY_LIMIT_PER_RANK)
                self.cgroups.limit_memory(n.netns, per_rank * len(n.ranks))
                # the shards were written before the limit: their pages are charged
                # elsewhere and cached; evict them, so that what the ranks read is theirs
                for shard in (self._out / "loader" / n.name).glob("shard-*.bin"):
                    fd = os.open(shard, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
            # the node cgroups outlive the run: the next scenario must find no limit
            return lambda: [self.cgroups.unlimit_memory(self.nodes[k].netns)
                            for k in self.stragglers]
        return lambda: None   # none; io is the straggler's loader mode (heavy)

    def _stop_captures(self, caps) -> dict[str, str]:
        """SIGTERM: each capture seals its bundle, then detaches its probes (under a second
        with uprobe_multi links, seconds with perf events: docs/capture.md). Returns their stderr logs once every bundle
        is sealed; the processes finish their detaches meanwhile, and ``reap_captures``
        checks their exit codes before the next scenario starts."""
        sealed_before = {name: log.read_text().count(SEALED) for name, (_, log) in caps.items()}
        for cap, _log in caps.values():
            cap.send_signal(signal.SIGTERM)
        stderr = {}
        end = time.monotonic() + 120
        for name, (cap, log) in caps.items():
            while True:
                stderr[name] = log.read_text()
                if stderr[name].count(SEALED) > sealed_before[name] or cap.poll() is not None:
                    break
                if time.monotonic() > end:
                    raise RigError(f"capture of {name} did not seal in 120 s: "
                                   f"{stderr[name][-2000:]}")
                time.sleep(0.05)
            if cap.poll():
                raise RigError(f"capture of {name} exited {cap.returncode}: "
                               f"{stderr[name][-2000:]}")
            self._exiting.append((name, cap, log))
        return stderr

    def reap_captures(self) -> None:
        """Wait for the captures stopped by the last scenario; each must exit 0."""
        exiting, self._exiting = self._exiting, []
        for name, cap, log in exiting:
            try:
                rc = cap.wait(timeout=120)
            finally:
                self._procs = [p for p in self._procs if p is not cap]
            if rc:
                raise RigError(f"capture of {name} exited {rc}: {log.read_text()[-2000:]}")

    def _start_capture(self, n: Node, pids: list[int], out: Path,
                       extra: tuple[str, ...]) -> tuple[subprocess.Popen, Path]:
        log = out / f"capture-{n.name}.log"
        argv = [*n.nsenter, *capture_cmd(), "--bundle", str(out / "bundles" / n.name),
                "--node", n.name, "--lib", str(self.fixtures.libnccl),
                "--lib", str(self.fixtures.libcudart), "--duration", str(CAPTURE_MAX_S), *extra]
        for pid in pids:
            argv += ["--pid", str(pid)]
        with open(log, "w") as err:
            return self._spawn(argv, stdout=subprocess.DEVNULL, stderr=err), log


def wait_sources_on(cap: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    """Wait for the capture's "sources on:" line: by then its sources have started and
    its uprobes sit on the libraries the ranks have mapped. Every eBPF source must be on."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = log.read_text()
        m = re.search(r"sources on: (.*)", text)
        if m:
            on = {s.strip() for s in m.group(1).split(",")}
            missing = {"nccl", "cuda", "tcp", "sched", "block"} - on
            if missing:
                raise RigError(f"capture sources off: {sorted(missing)}\n{text[-3000:]}")
            return
        if cap.poll() is not None:
            raise RigError(f"capture exited {cap.returncode} before its sources were on:\n"
                           f"{text[-3000:]}")
        time.sleep(0.1)
    raise RigError(f"capture not ready after {timeout} s:\n{log.read_text()[-3000:]}")


def retrans_segs(pid: int) -> int:
    """TCP RetransSegs of the network namespace the process lives in."""
    with open(f"/proc/{pid}/net/snmp") as f:
        lines = [ln.split() for ln in f if ln.startswith("Tcp:")]
    return int(lines[1][lines[0].index("RetransSegs")])


def stop_process(p: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL; the whole process group at once when p leads one of its
    own (the hog and its forked children)."""
    try:
        if p.poll() is None and os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if p.poll() is not None:
            return
        try:
            p.send_signal(sig)
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue


#: a rig's namespace or cgroup name: PREFIX, the rig process's pid and start time (ns
#: since boot; before 2026-11-28 the pid alone), a suffix
_OWNED = re.compile(rf"({re.escape(PREFIX)}(\d+)(?:\.(\d+))?-\S+)")


def _owner_gone(m: re.Match) -> bool:
    """Whether the rig process that named it no longer exists (its pid gone, or now
    another process's)."""
    now = read_stat_starttime(int(m.group(2)))
    return now is None or (m.group(3) is not None and str(now) != m.group(3))


def remove_stale_namespaces() -> None:
    """Delete rig namespaces left by a rig process that no longer exists (a killed test
    run), first killing what still runs in them (its captures run up to 15 minutes, and
    their probes and polling would load the next run's two cores); those of live rigs
    are left alone."""
    listing = run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        m = _OWNED.match(line)
        if m and _owner_gone(m):
            for pid in run("ip", "netns", "pids", m.group(1), check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run("ip", "netns", "del", m.group(1), check=False)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, _src, sopts = (post.split() + ["", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((pre.split()[4], fstype, set(sopts.split(","))))
    return out


class Cgroups:
    """One cgroup per node, named ``TAG-k`` after its namespace's suffix: in the cgroup
    v2 hierarchy (each node's own PSI), and in the v1 memory hierarchy where the memory
    controller is bound there (its limit). Made on first use, removed by ``remove``."""

    def __init__(self, tag: str):
        self.tag = tag
        mounts = _mounts()
        self.v2 = next((Path(m) for m, t, _ in mounts if t == "cgroup2"), None)
        self.v1_memory = next((Path(m) for m, t, o in mounts
                               if t == "cgroup" and "memory" in o), None)
        self.made: list[Path] = []
        self._enabled_memory = False     # "+memory" written to the v2 root by limit_memory

    def _dir(self, root: Path, netns: str) -> Path:
        d = root / netns
        if not d.is_dir():
            d.mkdir()
            self.made.append(d)
        return d

    def enter(self, netns: str, pids: list[int]) -> None:
        """Move the node's processes (and their threads) into its cgroups (none where no
        hierarchy is mounted: the nodes then share the kernel's pressure figures)."""
        roots = [r for r in (self.v2, self.v1_memory) if r is not None]
        for root in roots:
            procs = self._dir(root, netns) / "cgroup.procs"
            for pid in pids:
                procs.write_text(f"{pid}\n")

    def limit_memory(self, netns: str, limit: int) -> None:
        if self.v1_memory is not None:
            (self._dir(self.v1_memory, netns) / "memory.limit_in_bytes").write_text(f"{limit}\n")
            return
        if self.v2 is None:
            raise RigError("the memory scenario needs a memory cgroup controller (v1 or v2)")
        ctl = (self.v2 / "cgroup.subtree_control")
        if "memory" not in ctl.read_text().split():
            ctl.write_text("+memory\n")
            self._enabled_memory = True
        (self._dir(self.v2, netns) / "memory.max").write_text(f"{limit}\n")

    def unlimit_memory(self, netns: str) -> None:
        if self.v1_memory is not None:
            (self.v1_memory / netns / "memory.limit_in_bytes").write_text("-1\n")
        elif self.v2 is not None and (self.v2 / netns / "memory.max").exists():
            (self.v2 / netns / "memory.max").write_text("max\n")

    def remove(self) -> None:
        """Remove the node cgroups (empty once their processes are gone: a few tries)."""
        for d in reversed(self.made):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self.made.clear()
        if self._enabled_memory:
            try:      # as it was; another user of the controller below the root keeps it
                (self.v2 / "cgroup.subtree_control").write_text("-memory\n")
            except OSError:
                pass
            self._enabled_memory = False


def remove_stale_cgroups() -> None:
    """Remove the node cgroups of rig processes that no longer exist (as namespaces)."""
    for mount, _t, _o in _mounts():
        try:
            names = os.listdir(mount)
        except OSError:
            continue
        for name in names:
            m = _OWNED.fullmatch(name)
            if m and _owner_gone(m):
                try:
                    os.rmdir(os.path.join(mount, name))
                except OSError:
                    pass
