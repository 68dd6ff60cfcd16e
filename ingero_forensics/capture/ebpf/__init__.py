"""eBPF sources (BCC): NCCL, CUDA, TCP retransmits, scheduler and block I/O.

``ebpf_sources(options)`` returns the sources for ingero-capture; each compiles and
attaches in ``start`` and raises SourceUnavailable with a reason and a fix when it
cannot run (no root, no BCC, no kernel headers, no tracefs, missing tracepoint).
See docs/ebpf.md.
"""

from __future__ import annotations

from ..source import CaptureOptions, Source


def ebpf_sources(options: CaptureOptions) -> list[Source]:
    from .block import BlockSource
    from .cuda import CudaSource
    from .nccl import NcclSource
    from .sched import SchedSource
    from .tcp import TcpSource

    sources: list[Source] = [NcclSource(options), CudaSource(options), TcpSource(options),
                             SchedSource(options)]
    if options.block:
        sources.append(BlockSource(options))
    return sources


__all__ = ["ebpf_sources"]
