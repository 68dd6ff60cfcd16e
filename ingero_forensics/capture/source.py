"""The contract between ingero-capture and its sources (clock, host, and the eBPF probes).

One capture loop thread owns the BundleWriter. It calls every started source's ``poll``
about every 50 ms; sources turn what they collected since into rows through the
``RowSink`` they are given. A source never touches the writer directly, so rotation and
sealing happen between polls without locks.

A source that cannot run raises ``SourceUnavailable(reason, fix)`` from ``start``; the
capture records that in capture_log and on stderr and carries on with the others.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol


class SourceUnavailable(Exception):
    """This source cannot run here. ``reason`` says why, ``fix`` what would make it run."""

    def __init__(self, reason: str, fix: str | None = None):
        self.reason = reason
        self.fix = fix
        super().__init__(reason if not fix else f"{reason} (fix: {fix})")


@dataclass
class SourceStatus:
    name: str
    available: bool
    reason: str | None = None
    fix: str | None = None


class RowSink(Protocol):
    """Where sources put rows. Rows are tuples in schema data_columns order."""

    def add(self, table: str, row: tuple) -> None: ...
    def add_many(self, table: str, rows: Iterable[tuple]) -> None: ...
    def add_stack(self, frames: list[dict]) -> int: ...   # a list once passed stays as it is
    def log(self, level: str, source: str, event: str, message: str,
            count: int | None = None) -> None: ...


class Targets(Protocol):
    """The traced processes, maintained by the capture (``--pid``, ``--comm`` or auto)."""

    def pids(self) -> set[int]: ...
    def subscribe(self, on_new: Callable[[int], None],
                  on_exit: Callable[[int], None]) -> None: ...


@dataclass
class CaptureOptions:
    """Options the capture passes to every source."""
    lib_paths: list[str] = field(default_factory=list)   # --lib PATH (libnccl, libcudart, libcuda)
    sched_threshold_ns: int = 1_000_000                  # keep sched spans >= this as rows
    block: bool = True
    tcp_probe: bool = False                              # tcp:tcp_probe sampling (off by default)
    tcp_probe_interval_ms: int = 100                     # at most one tcp_probe row per connection per interval
    tcp_progress: bool = True                            # the job's TCP byte progress (tcp_progress)
    tcp_progress_interval_ms: int = 1000                 # at most one row per connection and kind per interval
    stacks: bool = True
    ring_pages: int = 256                                # per ring/perf buffer
    stats_interval_s: float = 1.0                        # event_stats aggregation interval
    launch_budget: int = 5000                            # launch traps/s before sampling (0: never)


@dataclass
class CaptureContext:
    node: str
    options: CaptureOptions
    targets: Targets


class Source(ABC):
    """A capture source. Subclasses set ``name`` (the capture_log source name)."""

    name: str = "source"

    def __init__(self) -> None:
        self.events = 0   # rows produced so far
        self.lost = 0     # events the kernel or a buffer dropped (reported, never silent)

    @classmethod
    def probe(cls) -> SourceStatus:
        """Could this source run on this machine? No side effects (for --check)."""
        return SourceStatus(cls.name, True)

    @abstractmethod
    def start(self, ctx: CaptureContext) -> None:
        """Attach / open. Raise SourceUnavailable to be turned off with a reason."""

    @abstractmethod
    def poll(self, sink: RowSink) -> None:
        """Move what was collected since the last call into rows. Must not block long."""

    def stop(self, sink: RowSink) -> None:
        """Final poll and detach. The default polls once more."""
        self.poll(sink)

    def drain(self, sink: RowSink) -> None:
        """The final rows, for the last seal; what takes long to let go of is kept for
        ``release``. The default is ``stop``."""
        self.stop(sink)

    def release(self) -> None:
        """Let go of what ``drain`` kept (eBPF probes), after the last seal."""

    def record_in_flight(self, sink: RowSink, why: str) -> None:
        """Record the calls open now (entered, not returned) in calls_in_flight; called
        before a segment is sealed (why="seal"). Sources that trace calls override it
        and do the same for why="stop" in ``stop``."""
