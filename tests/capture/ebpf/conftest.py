"""Fixtures for the eBPF source tests: skip (saying why) where eBPF cannot run, an
in-memory RowSink, a Targets set the test controls, the C shims, and a poller thread
that plays the capture loop."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from ingero_forensics.bundle.schema import TABLES_BY_NAME
from ingero_forensics.capture.source import CaptureContext, CaptureOptions

from ...fixtures.build import build_fixtures


def ebpf_skip_reason() -> str | None:
    from ingero_forensics.capture.ebpf._bcc import environment_problem, import_bcc
    from ingero_forensics.capture.source import SourceUnavailable
    problem = environment_problem()
    if problem:
        return f"eBPF unavailable: {problem[0]} (fix: {problem[1]})"
    try:
        import_bcc()
    except SourceUnavailable as e:
        return f"eBPF unavailable: {e}"
    return None


@pytest.fixture(scope="session")
def ebpf_ok():
    reason = ebpf_skip_reason()
    if reason:
        pytest.skip(reason)


class ListSink:
    """RowSink that keeps rows in memory and checks them against the schema."""

    def __init__(self):
        self.rows: dict[str, list[tuple]] = {}
        self.stacks: list[list[dict]] = []
        self._stack_ids: dict[str, int] = {}
        self.logs: list[tuple] = []
        self.lock = threading.Lock()

    def add(self, table, row):
        t = TABLES_BY_NAME[table]
        cols = t.data_columns
        # like the bundle writer: optional trailing columns (added within format 1) may
        # be left out, and are NULL
        optional = {c.name for c in t.columns if not c.required}
        if len(row) < len(cols) and set(cols[len(row):]) <= optional:
            row = tuple(row) + (None,) * (len(cols) - len(row))
        assert len(row) == len(cols), f"{table}: {len(row)} values for {len(cols)} columns"
        with self.lock:
            self.rows.setdefault(table, []).append(row)

    def add_many(self, table, rows):
        for r in rows:
            self.add(table, r)

    def add_stack(self, frames):
        key = json.dumps(frames, sort_keys=True)
        with self.lock:
            if key not in self._stack_ids:
                self.stacks.append(frames)
                self._stack_ids[key] = len(self.stacks)
            return self._stack_ids[key]

    def log(self, level, source, event, message, count=None):
        with self.lock:
            self.logs.append((level, source, event, message, count))

    def dicts(self, table):
        cols = TABLES_BY_NAME[table].data_columns
        with self.lock:
            return [dict(zip(cols, r)) for r in self.rows.get(table, [])]

    def stack(self, stack_id):
        return self.stacks[stack_id - 1]


class StaticTargets:
    """source.Targets for tests: the test adds pids; subscribers hear about them."""

    auto = False

    def __init__(self, pids=()):
        self._pids = set(pids)
        self._subs = []

    def pids(self):
        return set(self._pids)

    def subscribe(self, on_new, on_exit):
        self._subs.append((on_new, on_exit))

    def add(self, pid):
        self._pids.add(pid)
        for on_new, _ in self._subs:
            on_new(pid)

    def remove(self, pid):
        self._pids.discard(pid)
        for _, on_exit in self._subs:
            on_exit(pid)


class Running:
    """Starts a source and polls it from a thread every 50 ms, like the capture loop."""

    def __init__(self, source, targets, options):
        self.source = source
        self.sink = ListSink()
        self.ctx = CaptureContext("testnode", options, targets)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.error = None

    def __enter__(self):
        self.source.start(self.ctx)
        self._thread.start()
        return self

    def _loop(self):
        try:
            while not self._stop.wait(0.05):
                self.source.poll(self.sink)
        except Exception as e:  # surfaced by stop()
            self.error = e

    def stop(self):
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.source.stop(self.sink)
        if self.error:
            raise self.error
        return self.sink

    def __exit__(self, *exc):
        self.stop()


@pytest.fixture
def run_source():
    return Running


@pytest.fixture(scope="session")
def fixtures():
    return build_fixtures()


def options(**kw) -> CaptureOptions:
    return CaptureOptions(**kw)


def wait_for(pred, timeout=10.0, step=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def run_real_library(make_source, script_text: str, lib: str, tmp_path, table: str,
                     min_rows: int):
    """Trace a Python process that loads the real library ``lib`` (found through its
    /proc/PID/maps: no --lib). The script prints "ready", waits for "go", makes its calls,
    prints their results as one JSON line and exits when stdin closes.
    Returns (the script's JSON, the source's sink, the process's pid)."""
    import subprocess
    script = tmp_path / "real_library.py"
    script.write_text(script_text)
    proc = subprocess.Popen([sys.executable, str(script), lib], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        opts = options()
        with Running(make_source(opts), StaticTargets([proc.pid]), opts) as run:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = json.loads(proc.stdout.readline())
            wait_for(lambda: len(run.sink.dicts(table)) >= min_rows)
            proc.stdin.close()
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out, run.sink, proc.pid
