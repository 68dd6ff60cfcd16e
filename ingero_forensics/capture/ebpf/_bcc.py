"""Importing BCC and checking that this machine can load BPF programs.

BCC's Python module comes with the distribution, for the distribution's own Python, in a
directory that a virtualenv, pyenv or zipapp interpreter does not see:

* Debian, Ubuntu: /usr/lib/python3/dist-packages/bcc (python3-bpfcc);
* RHEL, Rocky, Alma, Oracle, CentOS Stream, Fedora, SUSE:
  /usr/lib/python3.X/site-packages/bcc or /usr/lib64/... (python3-bcc);
* a BCC built from source: /usr/local/lib/python3.X/{dist,site}-packages/bcc;
* anywhere else: the directory holding ``bcc/`` in $INGERO_BCC_PATH.

The module is pure Python over libbcc.so (ctypes), so one made for the system's Python
3.X loads in another Python 3. It is loaded from its directory as the package ``bcc``
alone: that directory is not added to sys.path, so none of the other system packages
beside it can shadow or leak into the environment. The PyPI package called ``bcc`` is
unrelated to BCC; it is detected and refused. Fix messages name the packages of the
node's distribution family (capture/distro.py).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import importlib
import importlib.util
import os
import platform
import struct
import sys

from ..distro import packages
from ..source import SourceUnavailable

TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
#: Where distributions install BCC's Python package, relative to the root; globs are
#: expanded with this interpreter's own version first, then the newest.
BCC_DIRS = (
    "usr/lib/python3/dist-packages",                       # Debian, Ubuntu
    "usr/lib/python3.*/site-packages",                     # RHEL family, Fedora, SUSE
    "usr/lib64/python3.*/site-packages",
    "usr/local/lib/python3.*/dist-packages",               # built from source
    "usr/local/lib/python3.*/site-packages",
    "usr/lib/python3.*/dist-packages",
)


def _version_key(path: str) -> tuple:
    """This interpreter's python3.X first, then newer versions before older ones."""
    own = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    part = next((p for p in path.split(os.sep) if p.startswith("python3")), "")
    try:
        minor = int(part.split(".", 1)[1])
    except (IndexError, ValueError):
        minor = -1
    return (part != own, -minor)


def bcc_search_dirs(root: str = "/", env: dict | None = None) -> list[str]:
    """Directories that hold a ``bcc`` package, in the order they are tried."""
    env = os.environ if env is None else env
    out = []
    extra = env.get("INGERO_BCC_PATH")
    if extra:
        out += [d for d in extra.split(os.pathsep) if d]
    for pattern in BCC_DIRS:
        found = glob.glob(os.path.join(root, pattern))
        out += sorted(found, key=_version_key)
    seen, dirs = set(), []
    for d in out:
        if d not in seen and os.path.isfile(os.path.join(d, "bcc", "__init__.py")):
            seen.add(d)
            dirs.append(d)
    return dirs


def _load_from(directory: str):
    """Import the package bcc from directory without adding it to sys.path."""
    init = os.path.join(directory, "bcc", "__init__.py")
    spec = importlib.util.spec_from_file_location(
        "bcc", init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["bcc"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == "bcc" or n.startswith("bcc.")]:
            del sys.modules[name]
        raise
    return module


def import_bcc(root: str = "/", env: dict | None = None):
    """Return BCC's ``bcc`` module or raise SourceUnavailable saying how to get it."""
    fix = packages(os.path.join(root, "etc/os-release")).bcc
    try:
        bcc = importlib.import_module("bcc")
    except ImportError:
        bcc = None
        errors = []
        for d in bcc_search_dirs(root, env):
            try:
                bcc = _load_from(d)
                break
            except Exception as e:  # noqa: BLE001 - a broken install: try the next one
                errors.append(f"{d}: {type(e).__name__}: {e}")
        if bcc is None:
            why = ("; ".join(errors) if errors else
                   "not in this Python's path nor in the distribution's directories")
            raise SourceUnavailable(f"BCC's Python module is not installed ({why})",
                                    f"{fix} (or set INGERO_BCC_PATH to the directory "
                                    "holding bcc/)") from None
    if not hasattr(bcc, "BPF"):
        raise SourceUnavailable(f"the 'bcc' module at {getattr(bcc, '__file__', '?')} is not "
                                "BCC (PyPI's unrelated 'bcc' package?)",
                                f"pip uninstall bcc; {fix}")
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
    refused = bpf_refused()
    if refused:
        return (f"this process may not use BPF (bpf(): {refused}): root without "
                "CAP_BPF or CAP_SYS_ADMIN, as in an unprivileged container or a service "
                "with a capability bounding set",
                "give the capture CAP_BPF, CAP_PERFMON and CAP_SYS_RESOURCE, or CAP_SYS_ADMIN "
                "(docker run --cap-add or --privileged; systemd AmbientCapabilities= and "
                "CapabilityBoundingSet=)")
    if tracefs_dir() is None:
        return TRACEFS_HIDDEN
    release = os.uname().release
    build = f"/lib/modules/{release}/build/include"
    if not os.path.isdir(build) and not os.path.exists("/sys/kernel/kheaders.tar.xz"):
        return (f"no kernel headers for {release} (BCC compiles its programs at start)",
                f"{packages().headers.replace('$(uname -r)', release)}; without such "
                "a package, scripts/setup-ebpf.sh links the distribution's generic headers")
    return None


def bpf_refused() -> str | None:
    """Why the kernel refuses this process a BPF map (strerror), None if it grants one.
    Being root is not enough: without CAP_BPF/CAP_SYS_ADMIN every source failed at load
    with advice about kernel headers while --check said ok."""
    from .uprobes import SYS_BPF
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        return None                       # not checked here: BCC will say
    libc = ctypes.CDLL(None, use_errno=True)
    # union bpf_attr.map_create: map_type, key_size, value_size, max_entries
    attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1), 64)  # an array
    fd = libc.syscall(nr, 0, attr, len(attr))                                 # BPF_MAP_CREATE
    if fd >= 0:
        os.close(fd)
        return None
    err = ctypes.get_errno()
    return os.strerror(err) if err in (errno.EPERM, errno.EACCES) else None


def check_environment() -> None:
    problem = environment_problem()
    if problem:
        raise SourceUnavailable(*problem)


def tracepoint_exists(category: str, event: str) -> bool:
    d = tracefs_dir()
    return d is not None and os.path.isdir(os.path.join(d, "events", category, event))


#: Why a tracepoint source sees no tracefs, and what to do: the common cause is a
#: capture started with `ip netns exec`, which mounts a fresh /sys without tracefs.
TRACEFS_HIDDEN = ("tracefs is not visible here (/sys/kernel/tracing has no events: "
                  "`ip netns exec` remounts /sys without it)",
                  "start the capture with `nsenter --net=/run/netns/NAME ingero-capture ...` "
                  "instead of `ip netns exec`, or mount -t tracefs nodev /sys/kernel/tracing")


def require_tracepoint(category: str, event: str) -> None:
    """Raise SourceUnavailable with the true reason a tracepoint cannot be used: tracefs
    not visible in this mount namespace, or the kernel has no such tracepoint."""
    if tracefs_dir() is None:
        raise SourceUnavailable(*TRACEFS_HIDDEN)
    if not tracepoint_exists(category, event):
        raise SourceUnavailable(f"tracepoint {category}:{event} does not exist in this "
                                f"kernel ({os.uname().release}; tracefs at {tracefs_dir()})",
                                "a kernel built with that tracepoint (4.15 or newer for "
                                "tcp, any for sched and block)")
