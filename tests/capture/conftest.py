"""Helpers for the capture tests: run the real CLI as a subprocess, open what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ingero_forensics.bundle import open_bundle
from ingero_forensics.capture.segments import sealed_bundles

CAPTURE = [sys.executable, "-m", "ingero_forensics.capture"]
ROOT = Path(__file__).resolve().parents[2]


def capture_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "INGERO_NODE"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def run_capture(*args, env=None, timeout=60, prefix=()) -> subprocess.CompletedProcess:
    """Run ingero-capture to completion; returns the CompletedProcess (text)."""
    return subprocess.run([*prefix, *CAPTURE, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env or capture_env(),
                          stdin=subprocess.DEVNULL)


def start_capture(*args, env=None, prefix=()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, *CAPTURE, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or capture_env(),
                            stdin=subprocess.DEVNULL)


def wait_for(pred, timeout=30.0, what="condition"):
    """Poll pred() until true (not a timed assertion: the timeout only bounds a hang)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def bundles(directory) -> list[Path]:
    if not Path(directory).is_dir():
        return []
    return [f.path for f in sealed_bundles(directory)]


def spool_has_rows(directory, table="clock_samples", n=1) -> bool:
    """True once the live segment in directory/.spool has committed n rows of table."""
    import apsw
    for p in Path(directory, ".spool").glob("segment-*.db"):
        try:
            con = apsw.Connection(str(p), flags=apsw.SQLITE_OPEN_READONLY)
            try:
                if con.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] >= n:
                    return True
            finally:
                con.close()
        except apsw.Error:
            pass
    return False


@pytest.fixture
def open_all(tmp_path):
    """open_all(dir) -> list of verified Bundle objects (closed at teardown)."""
    opened = []
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def _open(directory):
        out = [open_bundle(p, tmpdir=scratch) for p in bundles(directory)]
        opened.extend(out)
        return out

    yield _open
    for b in opened:
        b.close()


def rows(bundle, sql, *params):
    return list(bundle.con.execute(sql, params))
