"""A BCC source polled every 50 ms from a thread, as the capture does, writing into a
sink that only counts rows (the benches of one source: bench_tcp_progress, bench_block).
"""

from __future__ import annotations

import threading

from ingero_forensics.capture.source import CaptureContext


class Polled:
    """``with Polled(source, options, pids) as p:`` starts the source (compiling it) for the processes in the set ``pids`` (more may be added while it runs) and
    stops it on exit; ``p.rows`` counts the rows written, ``p.tables`` per table, and
    ``on_rows(table, rows)``, when given, sees each batch."""

    def __init__(self, source, options, pids=(), on_rows=None):
        self.source = source
        self.opts = options
        self.pids = set(pids)
        self.on_rows = on_rows
        self.rows = 0
        self.tables: dict[str, int] = {}
        self._stop = threading.Event()

    def __enter__(self):
        pids = self.pids

        class Targets:
            auto = False

            def pids(self_):
                return set(pids)

            def subscribe(self_, on_new, on_exit):
                pass
        self.source.start(CaptureContext("bench", self.opts, Targets()))   # compiles too
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def add_many(self, table, rows):
        self.rows += len(rows)
        self.tables[table] = self.tables.get(table, 0) + len(rows)
        if self.on_rows is not None:
            self.on_rows(table, rows)

    def add(self, table, row):
        self.add_many(table, [row])

    def add_stack(self, frames):
        return 1

    def log(self, *a, **k):
        pass

    def _loop(self):
        while not self._stop.wait(0.05):
            self.source.poll(self)

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self.source.stop(self)
