"""--jobs: per-node sections in worker processes, the same bytes whatever the count."""

import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import apsw
import pytest
from click.testing import CliRunner

from ingero_forensics.cliutil import EXIT_ERROR, EXIT_INTERRUPTED
from ingero_forensics.export.output import crc32_combine
from ingero_forensics.export.cli import main

from .fleetgen import build_fleet


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def fleet4(tmp_path_factory):
    """Four nodes: --jobs 2 and 3 split them unevenly across workers."""
    path = tmp_path_factory.mktemp("fleet4") / "fleet.db"
    build_fleet(path, nodes=4, ranks_per_node=2, steps=6)
    return path


def _export(path, out, *args):
    r = run(path, "--chrome-trace", "-o", out, "-q", *args)
    assert r.exit_code == 0, r.output
    return out.read_bytes()


def _leftovers(d: Path, keep: set) -> list:
    return sorted(p.name for p in d.iterdir() if p.name not in keep)


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_same_bytes_for_any_jobs(fleet4, tmp_path, name):
    outs = {j: _export(fleet4, tmp_path / f"{j}-{name}", "--jobs", j) for j in (1, 2, 3, 4)}
    assert outs[1] == outs[2] == outs[3] == outs[4]
    assert _leftovers(tmp_path, {f"{j}-{name}" for j in outs}) == []


@pytest.mark.parametrize("args", [
    ("--kinds", "nccl,host"),
    ("--from", "+20ms", "--to", "+70ms"),
    ("--ranks", "2-5", "--no-findings"),
    ("--nodes", "node-01,node-03", "--kinds", "cuda,sched,tcp,block"),
])
def test_same_bytes_for_any_jobs_with_filters(fleet4, tmp_path, args):
    one = _export(fleet4, tmp_path / "1.json", "--jobs", 1, *args)
    assert one == _export(fleet4, tmp_path / "3.json", "--jobs", 3, *args)
    assert one.startswith(b'{"traceEvents":[\n{')


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_max_events_keeps_parts_until_the_total_is_known(fleet4, tmp_path, name):
    """With --max-events the parent writes only once every part is in (a different
    path from the streaming one): the same bytes, and the limit exactly at the count
    passes."""
    plain = _export(fleet4, tmp_path / f"1-{name}", "--jobs", 1)
    opener = gzip.open if name.endswith(".gz") else open
    with opener(tmp_path / f"1-{name}", "rb") as f:
        count = json.loads(f.read())["metadata"]["counts"]["events"]
    for jobs in (2, 3):
        out = tmp_path / f"{jobs}-{name}"
        assert _export(fleet4, out, "--jobs", jobs, "--max-events", count) == plain
    r = run(fleet4, "--chrome-trace", "-o", tmp_path / "x.json", "--jobs", 2,
            "--max-events", count - 1)
    assert r.exit_code == EXIT_ERROR
    assert f"more than --max-events {count - 1}" in r.output
    assert _leftovers(tmp_path, {f"{j}-{name}" for j in (1, 2, 3)}) == []


def test_parts_are_removed_as_they_are_copied(fleet4, tmp_path, monkeypatch):
    """The parent copies each part as soon as it is in and removes it: when the last
    node section is copied, the earlier ones are gone."""
    from ingero_forensics.export import chrome_trace as ct
    seen = []
    real = ct.Assembler.part

    def part(self, p):
        if p is not None and os.path.basename(p.path).startswith("node-"):
            d = os.path.dirname(p.path)
            seen.append((os.path.basename(p.path),
                         sorted(n for n in os.listdir(d) if n.startswith("node-"))))
        return real(self, p)
    monkeypatch.setattr(ct.Assembler, "part", part)
    _export(fleet4, tmp_path / "t.json", "--jobs", 2)
    copied = [name for name, _ in seen]
    assert len(copied) == len(set(copied)) > 8
    for i, (name, present) in enumerate(seen):
        assert name in present
        assert not set(copied[:i]) & set(present)     # every earlier part already removed


def test_gzip_is_one_member_of_the_plain_bytes(fleet4, tmp_path):
    plain = _export(fleet4, tmp_path / "t.json", "--jobs", 2)
    packed = _export(fleet4, tmp_path / "t.json.gz", "--jobs", 2)
    assert gzip.decompress(packed) == plain
    d = zlib.decompressobj(wbits=31)           # one gzip member, nothing after it
    assert d.decompress(packed) == plain and d.eof and d.unused_data == b""
    assert packed[:10] == b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x04\xff"  # mtime 0, no name


def test_stdout_matches_file_with_workers(fleet4, tmp_path):
    r = CliRunner().invoke(main, [str(fleet4), "--chrome-trace", "--jobs", "3"])
    assert r.exit_code == 0
    assert r.stdout_bytes == _export(fleet4, tmp_path / "t.json", "--jobs", 1)


def test_crc32_combine_matches_zlib():
    rnd = random.Random(3)
    for _ in range(50):
        a = rnd.randbytes(rnd.randrange(0, 3000))
        b = rnd.randbytes(rnd.randrange(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_worker_error_is_one_line_and_leaves_nothing(fleet4, tmp_path):
    """Untrusted data that only a worker's query trips on: a BLOB where text belongs."""
    bad = tmp_path / "bad.db"
    shutil.copy(fleet4, bad)
    con = apsw.Connection(str(bad))
    con.execute("UPDATE cuda_events SET api = x'00ff' WHERE id = (SELECT MAX(id) FROM "
                "cuda_events WHERE node_id = (SELECT MAX(node_id) FROM nodes))")
    con.close()
    out = tmp_path / "t.json.gz"
    for jobs in (1, 2):
        r = run(bad, "--chrome-trace", "-o", out, "--jobs", jobs)
        assert r.exit_code == EXIT_ERROR
        assert r.output == (f"Error: {bad}: cannot read fleet.db "
                            "(JSON cannot hold BLOB values)\n")
        assert _leftovers(tmp_path, {"bad.db"}) == []


def test_analysis_error_in_its_process_is_the_same_line(fleet4, tmp_path):
    """With workers the findings analysis runs in a process of its own: its error is
    still the one line --jobs 1 gives, and nothing is left behind."""
    bad = tmp_path / "bad.db"
    shutil.copy(fleet4, bad)
    con = apsw.Connection(str(bad))
    con.execute("DROP TABLE host_samples")       # the analysis needs it; --kinds nccl not
    con.close()
    out = tmp_path / "t.json"
    for jobs in (1, 2):
        r = run(bad, "--chrome-trace", "-o", out, "--jobs", jobs, "--kinds", "nccl")
        assert r.exit_code == EXIT_ERROR
        assert r.output == (f"Error: {bad}: not a fleet.db (table host_samples missing); "
                            "build one with ingero-merge (ingero-report's analysis; "
                            "--no-findings exports without it)\n")
        assert _leftovers(tmp_path, {"bad.db"}) == []
    assert _export(bad, out, "--jobs", 2, "--kinds", "nccl", "--no-findings")


@pytest.fixture(scope="module")
def big_fleet(tmp_path_factory):
    """Big enough (about 0.3 M events) that an export can be interrupted mid-way."""
    path = tmp_path_factory.mktemp("big") / "big.db"
    build_fleet(path, nodes=2, ranks_per_node=4, steps=400, cuda_per_step=20)
    return path


def _start_and_wait_for_parts(fleet_db, tmp_path):
    """Start ingero-export --jobs 2 in its own process group; return once the workers
    are writing (their part files exist)."""
    exe = shutil.which("ingero-export", path=os.path.dirname(sys.executable))
    proc = subprocess.Popen([exe or "ingero-export", str(fleet_db), "--chrome-trace", "-o",
                             str(tmp_path / "t.json"), "--jobs", "2", "--no-findings"],
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith(".t.json.") and p.is_dir() and any(p.glob("node-*.part"))
               for p in tmp_path.iterdir()):
            break
        time.sleep(0.002)
    assert proc.poll() is None, "export finished before it could be interrupted"
    return proc


def test_ctrl_c_removes_parts_and_output(big_fleet, tmp_path):
    proc = _start_and_wait_for_parts(big_fleet, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)          # as a terminal's Ctrl-C does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED
    assert err.decode().strip().splitlines()[-1] == "Interrupted."
    assert _leftovers(tmp_path, set()) == []
    alive = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
    assert alive.stdout.strip() == ""           # no worker outlived the parent


def test_killed_worker_is_an_error_not_a_hang(big_fleet, tmp_path):
    proc = _start_and_wait_for_parts(big_fleet, tmp_path)
    kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    os.kill(int(kids.stdout.split()[0]), signal.SIGKILL)   # as the OOM killer would
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_ERROR
    assert re.fullmatch(rf"Error: {re.escape(str(big_fleet))}: the export worker for "
                        r"node-0[01] died \(killed by signal 9\)", err.decode().strip())
    assert _leftovers(tmp_path, set()) == []
    alive = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
    assert alive.stdout.strip() == ""
