"""SIGTERM seals the bundle before the probes are detached. The kernel takes about 0.1 s
to detach one perf-event uprobe, one at a time: the nccl and cuda sources' 70-odd probes
took 9 to 10 s here, and sealing after them kept an operator's bundle (or a pod's, whose
grace period is 30 s by default, shared by four captures on a loaded node) at risk for
all that time. Where the kernel has uprobe_multi links (6.6), a library's probes are one
link, detached with one wait. Real eBPF, the real ingero-capture."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from .test_capture_e2e import capture_cmd

pytestmark = [pytest.mark.ebpf, pytest.mark.slow]


def fds_of_kind(pid: int, kind: str = "anon_inode:[perf_event]") -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == kind
        except OSError:
            pass
    return n


def perf_event_fds(pid: int) -> int:
    return fds_of_kind(pid)


def start_capture(fixtures, tmp_path, uprobes: str | None = None):
    target = subprocess.Popen(["sleep", "300"])
    env = dict(os.environ)
    if uprobes:
        env["INGERO_UPROBES"] = uprobes
    cap = subprocess.Popen(
        [*capture_cmd(), "--bundle", str(tmp_path / "bundles"), "--node", "stop-node", "--pid",
         str(target.pid), "--lib", str(fixtures.libnccl), "--lib", str(fixtures.libcudart),
         "--start-priority", "normal"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    return target, cap


def test_sigterm_seals_before_the_probes_are_detached(ebpf_ok, fixtures, tmp_path):
    """With one perf event per uprobe (older kernels; INGERO_UPROBES=perf here)."""
    target, cap = start_capture(fixtures, tmp_path, "perf")
    out = tmp_path / "bundles"
    try:
        for line in cap.stderr:
            if "sources on:" in line:
                break
        attached = perf_event_fds(cap.pid)
        assert attached >= 40, attached      # nccl and cuda uprobes, one fd each
        cap.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not list(out.glob("*.bundle")) and time.monotonic() < deadline:
            time.sleep(0.01)
        sealed_at = time.monotonic()
        still_attached = perf_event_fds(cap.pid) if cap.poll() is None else 0
        err = cap.stderr.read()
        assert cap.wait(timeout=120) == 0, err
        exited_at = time.monotonic()
    finally:
        target.kill()
        if cap.poll() is None:
            cap.kill()
    assert len(list(out.glob("*.bundle"))) == 1, err
    # sealed while most probes were still attached: the detaches came after
    assert still_attached >= attached // 2, (still_attached, attached,
                                             round(exited_at - sealed_at, 2))

