"""What a killed rig leaves behind is cleared before the next one starts: its network
namespaces, and what still runs in them (its captures run for up to 15 minutes; their
probes and polling would load the next run's two cores)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from .conftest import skip_without_rig
from ingero_forensics.capture.procs import read_stat_starttime

from .rig import PREFIX, remove_stale_namespaces, run

pytestmark = [pytest.mark.ebpf]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_namespaces_and_their_processes_are_removed():
    skip_without_rig()
    stale = f"{PREFIX}{_dead_pid()}-0"
    # a rig whose pid a later process now has: its start time differs
    reused = f"{PREFIX}{os.getpid()}.{read_stat_starttime(os.getpid()) + 1}-0"
    live = f"{PREFIX}{os.getpid()}.{read_stat_starttime(os.getpid())}-cleanup"    # left alone
    procs = []
    try:
        for name in (stale, reused, live):
            run("ip", "netns", "add", name)
            procs.append(subprocess.Popen(["nsenter", f"--net=/run/netns/{name}",
                                           "sleep", "300"]))
        remove_stale_namespaces()
        assert procs[0].wait(timeout=10) == -signal.SIGKILL
        assert procs[1].wait(timeout=10) == -signal.SIGKILL
        assert procs[2].poll() is None
        names = {line.split()[0] for line in
                 run("ip", "netns", "list").stdout.splitlines() if line.strip()}
        assert stale not in names and reused not in names and live in names, names
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for name in (stale, reused, live):
            run("ip", "netns", "del", name, check=False)
