"""Shared test set-up. Area fixtures live in tests/<area>/conftest.py.

eBPF tests carry the ``ebpf`` marker and skip only where eBPF cannot run, saying why.
With INGERO_REQUIRE_EBPF=1 (scripts/test.sh sets it under CI) such a skip is turned into
a failure: a CI run that did not exercise the real kernel is not a green run.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


_SKIPS_FAILED = []


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
