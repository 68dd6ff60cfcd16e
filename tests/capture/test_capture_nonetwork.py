"""No network, provably: no non-UNIX socket is ever created, and capture works the same in
a network namespace that has no interfaces."""

import re
import os
import shutil
import subprocess
import sys

import pytest

from .conftest import capture_env, rows, run_capture

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")

_SOCKET_CALL = re.compile(r"\b(socket|socketpair)\((\w+)")


def non_unix_sockets(trace: str) -> list[str]:
    """socket()/socketpair() lines in an strace log whose family is not AF_UNIX."""
    bad = []
    for line in trace.splitlines():
        m = _SOCKET_CALL.search(line)
        if m and m.group(2) not in ("AF_UNIX", "AF_LOCAL"):
            bad.append(line)
    return bad


def strace(tmp_path, argv) -> str:
    log = tmp_path / "strace.log"
    r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=socket,socketpair", "-o", str(log),
                        *argv], capture_output=True, text=True, timeout=120, env=capture_env())
    trace = log.read_text()
    return r, trace


def test_checker_catches_an_inet_socket(tmp_path):
    # The detector itself must be able to fail: a process that opens AF_INET is flagged.
    r, trace = strace(tmp_path, [sys.executable, "-c", "import socket; socket.socket()"])
    assert r.returncode == 0
    assert len(non_unix_sockets(trace)) == 1 and "AF_INET" in non_unix_sockets(trace)[0]


@pytest.mark.parametrize("ebpf", [False, True], ids=["no-ebpf", "with-ebpf-if-available"])
def test_capture_creates_no_network_socket(tmp_path, open_all, ebpf):
    argv = [sys.executable, "-m", "ingero_forensics.capture", "--bundle", str(tmp_path / "b"),
            "--node", "nonet", "--duration", "2"] + ([] if ebpf else ["--no-ebpf"])
    r, trace = strace(tmp_path, argv)
    assert r.returncode == 0, r.stderr
    assert non_unix_sockets(trace) == []
    [b] = open_all(tmp_path / "b")
    assert rows(b, "SELECT COUNT(*) FROM clock_samples")[0][0] >= 2
    if ebpf and os.environ.get("INGERO_REQUIRE_EBPF") == "1":
        # in CI the probes must really have been loaded under strace, not turned off
        attached = {r[0] for r in rows(b, "SELECT source FROM capture_log WHERE event = 'attached'")}
        assert {"tcp", "sched", "block"} <= attached, attached


def _has_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_unshare(), reason="unshare -n not permitted here (needs root)")
def test_capture_in_empty_network_namespace_is_equivalent(tmp_path, open_all):
    ns = subprocess.run(["unshare", "-n", "cat", "/proc/net/dev"], capture_output=True, text=True)
    assert "eth" not in ns.stdout  # really no interfaces but a (down) loopback
    # One explicit target, so both runs trace the same process whatever else runs here.
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={"RANK": "0"})
    try:
        args = ("--node", "eq", "--no-ebpf", "--duration", "2", "--pid", target.pid)
        r1 = run_capture("--bundle", tmp_path / "host", *args)
        r2 = run_capture("--bundle", tmp_path / "ns", *args, prefix=("unshare", "-n"))
    finally:
        target.kill()
        target.wait()
    assert r1.returncode == 0, r1.stderr
    assert r2.returncode == 0, r2.stderr
    [a] = open_all(tmp_path / "host")
    [b] = open_all(tmp_path / "ns")

    def shape(x):
        return {
            "nonempty": {t for t, n in x.manifest["tables"].items() if n},
            # disk.await_ms exists only for intervals in which requests completed
            "metrics": {m for (m,) in rows(x, "SELECT DISTINCT metric FROM host_samples")}
            - {"disk.await_ms"},
            "log": {(s, e) for s, e in rows(x, "SELECT source, event FROM capture_log")},
            "clock": {s for (s,) in rows(x, "SELECT DISTINCT source FROM clock_samples")},
        }
    sa, sb = shape(a), shape(b)
    for key in sa:
        assert sa[key] == sb[key], key
    assert rows(b, "SELECT pid, rank FROM processes") == [(target.pid, 0)]
    assert b.manifest["host"] == a.manifest["host"]  # same identity without a network
    nics = {d for (d,) in rows(b, "SELECT DISTINCT device FROM host_samples "
                                  "WHERE metric LIKE 'net.%'")}
    assert nics == {"lo"}
