"""Shared test set-up. Area fixtures live in tests/<area>/conftest.py.

eBPF tests carry the ``ebpf`` marker and skip only where eBPF cannot run, saying why.
With INGERO_REQUIRE_EBPF=1 (scripts/test.sh sets it under CI) such a skip is turned into
a failure: a CI run that did not exercise the real kernel is not a green run.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


_SKIPS_FAILED = []

#: pytest's own file descriptors (its output capture), as the session started
_RUNNER_FDS: dict[int, str] = {}


def _open_fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass                            # the listing's own descriptor
    return out


def pytest_sessionstart(session):
    # 0-2 move with the capture's state; the descriptors above them stay put
    _RUNNER_FDS.update((fd, t) for fd, t in _open_fds().items() if fd > 2)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # A double close in the code under test once closed one of pytest's descriptors,
    # and every later test failed with EBADF far from the cause: name the test.
    try:
        return (yield)
    finally:
        now = _open_fds()
        gone = {fd: was for fd, was in _RUNNER_FDS.items() if now.get(fd) != was}
        if gone:
            for fd, was in gone.items():    # a stand-in, so that pytest can report it
                twin = next((f for f, t in now.items() if t == was), None)
                if twin is not None:
                    os.dup2(twin, fd)
                elif was == os.devnull or was.endswith("(deleted)"):   # capture files
                    with tempfile.TemporaryFile() if was != os.devnull else \
                            open(os.devnull, "rb") as stand_in:
                        os.dup2(stand_in.fileno(), fd)
            after = _open_fds()             # said once, not by every later test
            for fd in gone:
                if fd in after:
                    _RUNNER_FDS[fd] = after[fd]
                else:
                    del _RUNNER_FDS[fd]
            raise AssertionError(
                "this test closed or replaced descriptors pytest held since the start "
                f"(a close of a descriptor the code did not own): {gone}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # an expected failure (xfail) reports as skipped too: it is not an eBPF skip
    if (report.skipped and not hasattr(report, "wasxfail")
            and os.environ.get("INGERO_REQUIRE_EBPF") == "1"
            and item.get_closest_marker("ebpf") is not None):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"eBPF test skipped but INGERO_REQUIRE_EBPF=1: {reason}"
        _SKIPS_FAILED.append(item.nodeid)


def pytest_sessionfinish(session, exitstatus):
    # the failures made of skips above must fail the run's exit status too
    if _SKIPS_FAILED and session.exitstatus == 0:
        session.exitstatus = 1


@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(size): a real tmpfs of that size, mounted under tmp_path and unmounted
    after the test. CI runs as root: there it must mount, not skip."""
    mounts = []

    def mount(size):
        if os.geteuid() != 0:
            assert not os.environ.get("CI"), "mounting a tmpfs needs root in CI"
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / f"tmpfs{len(mounts)}"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       check=True)
        mounts.append(mnt)
        return mnt
    yield mount
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
