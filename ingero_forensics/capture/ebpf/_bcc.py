"""Importing BCC and checking that this machine can load BPF programs.

Debian ships BCC's Python module in /usr/lib/python3/dist-packages (python3-bpfcc),
which a virtualenv or pyenv interpreter does not see. We append that directory at the
END of sys.path, so nothing installed in the environment is shadowed. The PyPI package
called ``bcc`` is unrelated to BCC; it is detected and refused.
"""

from __future__ import annotations

import importlib
import os
import sys

from ..source import SourceUnavailable

DEBIAN_DIST = "/usr/lib/python3/dist-packages"
TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


def import_bcc():
    """Return BCC's ``bcc`` module or raise SourceUnavailable saying how to get it."""
    try:
        bcc = importlib.import_module("bcc")
    except ImportError:
        if DEBIAN_DIST not in sys.path and os.path.isdir(DEBIAN_DIST):
            sys.path.append(DEBIAN_DIST)
        try:
            bcc = importlib.import_module("bcc")
        except ImportError as e:
            raise SourceUnavailable(f"BCC's Python module is not installed ({e})",
                                    "apt install python3-bpfcc bpfcc-tools") from None
    if not hasattr(bcc, "BPF"):
        raise SourceUnavailable(f"the 'bcc' module at {getattr(bcc, '__file__', '?')} is not "
                                "BCC (PyPI's unrelated 'bcc' package?)",
                                "pip uninstall bcc; apt install python3-bpfcc")
    return bcc


def tracefs_dir() -> str | None:
    for d in TRACEFS:
        if os.path.isdir(os.path.join(d, "events")):
            return d
    return None


def environment_problem() -> tuple[str, str] | None:
    """(reason, fix) when BPF programs cannot be loaded here; None when they can."""
    if os.geteuid() != 0:
        return ("eBPF needs root (or CAP_BPF + CAP_PERFMON + CAP_SYS_RESOURCE)",
                "run ingero-capture as root")
    if tracefs_dir() is None:
        return ("tracefs is not mounted", "mount -t tracefs nodev /sys/kernel/tracing "
                "(scripts/setup-ebpf.sh does it)")
    release = os.uname().release
    build = f"/lib/modules/{release}/build/include"
    if not os.path.isdir(build) and not os.path.exists("/sys/kernel/kheaders.tar.xz"):
        return (f"no kernel headers for {release} (BCC compiles its programs at start)",
                f"apt install linux-headers-{release}; without such a package, "
                "scripts/setup-ebpf.sh links the distribution's generic headers")
    return None


def check_environment() -> None:
    problem = environment_problem()
    if problem:
        raise SourceUnavailable(*problem)


def tracepoint_exists(category: str, event: str) -> bool:
    d = tracefs_dir()
    return d is not None and os.path.isdir(os.path.join(d, "events", category, event))
