"""Launching the shim rank job (tests/fixtures/rank_job.c) for the probe tests."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_ids(path) -> tuple[bytes, bytes]:
    """Two ncclUniqueIds for the shim: same rendezvous port and first 120 bytes, the
    last 8 bytes differ. Address bytes 2-5 are zero: rank 0 listens on loopback."""
    first = struct.pack("<H", free_port()) + bytes(4) + os.urandom(122)
    second = first[:120] + bytes(b ^ 0xFF for b in first[120:])
    with open(path, "wb") as f:
        f.write(first + second)
    return first, second


class Job:
    """N rank processes started and stopped at "ready", released together by go()."""

    def __init__(self, argv_for_rank, nranks, env=None):
        full_env = dict(os.environ, **(env or {}))
        self.procs = [subprocess.Popen(argv_for_rank(r), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=full_env) for r in range(nranks)]
        for p in self.procs:
            line = p.stdout.readline().strip()
            if line != "ready":
                self.kill()
                raise RuntimeError(f"rank job did not start: {line!r} {p.stderr.read()}")

    @property
    def pids(self):
        return [p.pid for p in self.procs]

    def go(self):
        """Release the ranks; return each rank's JSON result line. They stay alive."""
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in self.procs:
            line = p.stdout.readline()
            if not line:
                self.kill()
                raise RuntimeError(f"rank {p.pid} failed: {p.stderr.read()}")
            results.append(json.loads(line))
        return results

    def finish(self, timeout=30):
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            if p.wait(timeout=timeout):
                raise RuntimeError(f"rank {p.pid} exited {p.returncode}: {p.stderr.read()}")

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
