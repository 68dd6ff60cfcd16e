"""Signals that stop or rotate a capture act from any point of the main loop."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import ROOT

#: The main loop sleeps in stop_flag.wait(), which holds the Event's lock for a few
#: bytecodes; a SIGTERM handled there once called Event.set() and waited for that lock
#: forever (a capture that never stopped). Here the signal arrives with the lock held.
IN_THE_WAIT = r"""
import json, signal, threading
from ingero_forensics.capture import runner

class Run:
    stop_flag = threading.Event()
    stop_signalled = False
    stop_reason = ""
    rotate_flag = False

run = Run()
old = runner._install_signals(run)
with run.stop_flag._cond:                 # the lock Event.wait holds between bytecodes
    signal.raise_signal(signal.SIGTERM)
    signal.raise_signal(signal.SIGHUP)
for sig, fn in old.items():
    signal.signal(sig, fn)
print(json.dumps([run.stop_reason, run.stop_signalled, run.rotate_flag]))
"""


def test_a_signal_inside_the_loops_wait_stops_the_capture():
    r = subprocess.run([sys.executable, "-c", IN_THE_WAIT], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["SIGTERM", True, True]
