"""What to simulate: the fleet shape, the fault, the clocks and the seed.

``FleetConfig`` is a plain dataclass; ``FleetConfig.validated()`` checks it and raises
``SimulateConfigError`` naming the parameter, which the CLI turns into a usage error.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

from ..errors import IngeroError

FAULTS = ("none", "cpu", "io", "network", "gpu", "memory", "slowlink")
MAX_NODES = 1024
MAX_RANKS_PER_NODE = 16


class SimulateConfigError(IngeroError):
    """A simulation parameter is invalid; ``param`` names it."""

    def __init__(self, param: str, message: str):
        self.param = param
        self.message = message
        super().__init__(f"{param}: {message}")


@dataclass(frozen=True)
class FleetConfig:
    nodes: int = 4
    ranks_per_node: int = 8
    steps: int = 200
    fault: str = "none"
    #: node index of the straggler; None = chosen from the seed (ignored for "none")
    straggler: int | None = None
    #: fault windows as half-open step ranges [start, end); empty = the whole run
    fault_windows: tuple[tuple[int, int], ...] = ()
    max_offset_ms: float = 50.0
    max_drift_ppm: float = 50.0
    ntp_step: bool = False
    #: node index whose adjtimex claims are dishonest (maxerror below the true error)
    lying_clock: int | None = None
    seed: int = 1
    #: worker processes; None = one per CPU (at most one per node). Output does not
    #: depend on it.
    workers: int | None = None
    #: zstd level used to seal the bundles
    zstd_level: int = 3
    #: write the ring's tcp_progress rows (False: as a capture with --no-tcp-progress,
    #: or one on a kernel before 6.3)
    tcp_progress: bool = True
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("workers")
        d.pop("extra")
        d["fault_windows"] = [list(w) for w in self.fault_windows]
        return d

    def validated(self) -> "FleetConfig":
        """Return self (windows normalised) or raise SimulateConfigError."""
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= MAX_NODES:
            raise SimulateConfigError("--nodes", f"must be between 1 and {MAX_NODES}, "
                                                 f"got {self.nodes}")
        if not 1 <= self.ranks_per_node <= MAX_RANKS_PER_NODE:
            raise SimulateConfigError("--ranks-per-node", f"must be between 1 and "
                                      f"{MAX_RANKS_PER_NODE}, got {self.ranks_per_node}")
        if self.steps < 1:
            raise SimulateConfigError("--steps", f"must be at least 1, got {self.steps}")
        if self.fault not in FAULTS:
            raise SimulateConfigError("--fault", f"unknown fault {self.fault!r} "
                                      f"(choose from {', '.join(FAULTS)})")
        if self.straggler is not None and not 0 <= self.straggler < self.nodes:
            raise SimulateConfigError("--straggler", f"node {self.straggler} is outside "
                                      f"the fleet (node-00 .. {node_name(self.nodes - 1)})")
        if self.fault == "none" and self.straggler is not None:
            raise SimulateConfigError("--straggler", "a straggler needs a fault "
                                      "(--fault cpu|io|network|gpu|memory|slowlink)")
        if self.fault == "none" and self.fault_windows:
            raise SimulateConfigError("--fault-window", "fault windows need a fault "
                                      "(--fault cpu|io|network|gpu|memory|slowlink)")
        if self.fault == "network" and self.nodes < 2:
            raise SimulateConfigError("--fault", "network needs at least 2 nodes "
                                      "(the straggler's ring neighbours)")
        if self.fault == "slowlink" and self.nodes < 3:
            raise SimulateConfigError("--fault", "slowlink needs at least 3 nodes (a link "
                                      "slower than the job's other links)")
        if self.lying_clock is not None and not 0 <= self.lying_clock < self.nodes:
            raise SimulateConfigError("--lying-clock", f"node {self.lying_clock} is "
                                      "outside the fleet")
        if not 0 <= self.max_offset_ms <= 10_000:
            raise SimulateConfigError("--max-offset-ms", "must be between 0 and 10000")
        if not 0 <= self.max_drift_ppm <= 500:
            raise SimulateConfigError("--max-drift-ppm", "must be between 0 and 500")
        if not 1 <= self.zstd_level <= 22:
            raise SimulateConfigError("--zstd-level", "must be between 1 and 22")
        wins = sorted(self.fault_windows)
        for a, b in wins:
            if not 0 <= a < b <= self.steps:
                raise SimulateConfigError("--fault-window", f"{a}:{b} is not a step range "
                                          f"inside 0:{self.steps} with START < END")
        for (_, b0), (a1, _) in zip(wins, wins[1:]):
            if a1 < b0:
                raise SimulateConfigError("--fault-window", "windows overlap")
        return replace(self, fault_windows=tuple(wins))

    @property
    def windows(self) -> tuple[tuple[int, int], ...]:
        """Fault windows as step ranges; the whole run when none were given."""
        if self.fault == "none":
            return ()
        return self.fault_windows or ((0, self.steps),)


def node_name(index: int) -> str:
    return f"node-{index:02d}"


_NODE_RE = re.compile(r"^node-(\d+)$")


def parse_node(text: str, nodes: int, param: str = "--straggler") -> int:
    """'node-03', '3' -> 3; raises SimulateConfigError if malformed or outside the fleet."""
    s = str(text).strip()
    m = _NODE_RE.match(s)
    if m:
        idx = int(m.group(1))
    elif s.isdigit():
        idx = int(s)
    else:
        raise SimulateConfigError(param, f"{text!r} is not a node name (node-03) or index")
    if not 0 <= idx < nodes:
        raise SimulateConfigError(param, f"{text} is outside the fleet "
                                  f"(node-00 .. {node_name(nodes - 1)})")
    return idx


def parse_window(text: str, steps: int) -> tuple[int, int]:
    """'100:300' -> (100, 300); 'START:' runs to the end, ':END' starts at 0."""
    m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", str(text))
    if not m or not (m.group(1) or m.group(2)):
        raise SimulateConfigError("--fault-window", f"{text!r} is not START:END "
                                  "(step numbers, e.g. 100:300)")
    a = int(m.group(1)) if m.group(1) else 0
    b = int(m.group(2)) if m.group(2) else steps
    if not 0 <= a < b <= steps:
        raise SimulateConfigError("--fault-window", f"{text} is not a step range inside "
                                  f"0:{steps} with START < END")
    return a, b
