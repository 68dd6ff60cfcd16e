"""Fixtures for the bundle tests: realistic rows for every table, bundle builders and a
re-wrapper that builds bundles around a modified database image with a consistent
manifest (so that checks behind the sha256 can be reached)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import struct
from pathlib import Path

import pytest
import zstandard

from ingero_forensics.bundle import BundleWriter, open_bundle
from ingero_forensics.bundle.container import SKIPPABLE_MAGIC, _read_header
from ingero_forensics.bundle.schema import TABLES_BY_NAME

HOST = {"hostname": "gpu-node-07.cluster", "boot_id": "5c1e2f0a-8d1b-4f7e-9a55-0f1c2d3e4b5a",
        "kernel_release": "6.1.0-18-amd64", "machine": "x86_64"}
START = (1_772_366_400_000_000_000, 81_234_000_000_000)   # (utc_ns, mono_ns)
END = (1_772_366_460_000_000_000, 81_294_000_000_000)
T0 = START[1]

FRAMES_A = [{"ip": "0x7f3a1c2b4d10", "module": "/usr/lib/x86_64-linux-gnu/libnccl.so.2",
             "module_offset": "0x4d10", "symbol": "ncclAllReduce", "symbol_offset": 16},
            {"py_file": "/opt/train/train.py", "py_func": "Trainer.step", "py_line": 212}]
FRAMES_B = [{"ip": "0x7f3a1d000a00", "module": "/usr/local/cuda/lib64/libcudart.so.12",
             "symbol": "cudaStreamSynchronize", "file": "cudart.cpp", "line": 88}]


def sample_rows(stack_a: int | None, stack_b: int | None) -> dict[str, list[tuple]]:
    """Two or more rows for every data table, in data_columns order, with NULLs where the
    column allows them."""
    ms = 1_000_000
    return {
        "nccl_events": [
            (T0 + 5 * ms, 41_000, "ALL_REDUCE", 3, 8, "9f86d081884c7d65", 1, 33_554_432,
             "bfloat16", "sum", None, 140_234_112, 67_108_864, 0, 0, 4242, 4250, stack_a,
             94_558_208_000, None),
            # a communicator created before the capture attached (1.1): counted from attach
            (T0 + 9 * ms, 12_500, "SEND", None, None, None, None, 1024, "float32", None, 4,
             0, 4096, 1, None, 4242, 4251, None, 94_558_300_160, 7),
            (T0 + 11 * ms, 9_000, "ALL_TO_ALL", 3, 8, "9f86d081884c7d65", 2, 2048, "int8",
             None, None, 140_234_112, 2048, None, 0, 4242, 4250, stack_a, 94_558_208_000,
             None),
        ],
        "nccl_comm_events": [
            (T0 + 1 * ms, 2_500_000, "ncclCommInitRank", "9f86d081884c7d65", None, None, None,
             3, 8, 94_558_208_000, 0, 4242, 4250),
            (T0 + 2 * ms, 900_000, "ncclCommSplit", "2c26b46b68ffc68f", "9f86d081884c7d65",
             1, 3, 1, 4, 94_558_209_024, 0, 4242, 4250),
        ],
        "cuda_events": [
            (T0 + 6 * ms, 35_000_000, "cudaStreamSynchronize", "runtime", 140_234_112, None,
             None, None, 0, 0, 4242, 4250, stack_b, 3, 12_000),
            (T0 + 7 * ms, None, "cuMemcpyHtoDAsync_v2", "driver", 0, 8_388_608, "HtoD", None,
             None, None, 4242, 4252, None, None, None),
        ],
        "event_stats": [
            (T0, T0 + 1000 * ms, "cuda", "cudaLaunchKernel", 4242, 4250, stack_b, 1830,
             9_150_000, 61_000, json.dumps([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 1700, 118]),
             None),
            (T0, T0 + 1000 * ms, "sched", "runq_delay", None, None, None, 40, None, None, None,
             None),
            # launches counted part of the time (--launch-budget), then an interval off
            (T0 + 1000 * ms, T0 + 2000 * ms, "cuda", "cuLaunchKernel", 4242, 4250, None, 77,
             None, None, None, 250 * ms),
            (T0 + 2000 * ms, T0 + 3000 * ms, "cuda", "cuLaunchKernel", None, None, None, 0,
             None, None, None, 0),
        ],
        "tcp_events": [
            (T0 + 20 * ms, "tcp_retransmit_skb", 4, "10.0.0.7", "10.0.0.9", 43512, 29500,
             "ESTABLISHED", 0, 4026531840, 4242, "job", None, None),
            (T0 + 21 * ms, "tcp_probe", 6, "fd00::7", "fd00::9", 22, 51000, None, None, None,
             None, "background", 180, 10),
        ],
        "sched_events": [
            (T0 + 30 * ms, 4_200_000, "runq_delay", 4242, 4250, "pt_main_thread", 17, None,
             913, 913, "kworker/17:1"),
            (T0 + 31 * ms, 12_000_000, "off_cpu", 4242, 4251, None, None, "D", None, None,
             None),
        ],
        "block_events": [
            (T0 + 40 * ms, 850_000, "nvme0n1", 123_456_789, 131_072, "read", "RA", 4242, 4260,
             "dataloader", 0),
            (T0 + 41 * ms, 3_100_000, "259:0", None, 4096, "flush", None, None, None, None,
             None),
        ],
        "host_samples": [
            (T0 + 1000 * ms, "cpu.busy_pct", None, 87.5),
            (T0 + 1000 * ms, "cpu.busy_pct", "cpu3", 99.25),
            (T0 + 1000 * ms, "gpu.sm_clock_mhz", "0", 1410.0),
        ],
        "clock_samples": [
            ("system", T0 + 10_000, T0 + 10_480, START[0] + 10_240, T0 + 10_300, None, 480, 1,
             -1_200, 12.345, 16_000_000, 2_000, 0x2001, 37, None, None, None, None, None),
            ("chrony", T0 + 50_000, T0 + 50_700, START[0] + 50_350, None, None, 700, None,
             None, None, None, None, None, None, -31_000, 120_000, 45_000, "Normal",
             "A29FC87B"),
        ],
        "processes": [
            (4242, 81_000_000_000_000, "python3", "/usr/bin/python3.11",
             json.dumps(["python3", "train.py", "--lr", "3e-4"]), 3, 3, 8, 8, 0,
             "tr-1234", json.dumps({"RANK": "3", "WORLD_SIZE": "8"}), T0 + 1, T0 + 60_000 * ms,
             None),
            (5151, None, None, None, None, None, None, None, None, None, None, "{}", T0 + 2,
             T0 + 3, T0 + 3),
        ],
        "threads": [
            (4242, 4250, "pt_main_thread", T0 + 1, T0 + 60_000 * ms),
            (4242, 4251, None, T0 + 2, T0 + 50),
        ],
        "capture_log": [
            (T0 + 1, "info", "nccl", "source_on", "attached 14 uprobes to libnccl.so.2", None),
            (T0 + 2, "warning", "cuda", "lost_events", "ring buffer full; raise --ring-pages",
             311),
        ],
        "calls_in_flight": [
            (T0 + 900, T0 + 60_000 * ms, "stop", "nccl", "ncclAllReduce", "ALL_REDUCE",
             "0123456789abcdef", 601, 3, 8, 1024, "float32", None, 0, 4096, None, 4242, 4250,
             stack_a, 94_558_208_000, None),
            (T0 + 950, T0 + 60_000 * ms, "seal", "cuda", "cudaStreamSynchronize", None, None,
             None, None, None, None, None, None, 7, None, 0, 4242, 4251, None, None, None),
            # a collective on a communicator created before the capture attached
            (T0 + 990, T0 + 60_000 * ms, "stop", "nccl", "ncclAllReduce", "ALL_REDUCE",
             None, None, None, None, 1024, "float32", None, 0, 4096, None, 4242, 4252, None,
             94_558_300_160, 8),
        ],
        "tcp_progress": [
            (T0 + 400, "send", 4, "10.0.0.7", 41234, "10.0.0.8", 29500, T0 + 300, 0, 65536,
             4242, 4250, 0),
            (T0 + 500, "recv", 4, "10.0.0.7", 41236, "10.0.0.6", 29500, T0 + 301, 131072, 4096,
             4242, 4250, None),
            # a connection established before the capture attached
            (T0 + 600, "send", 6, "fd00::7", 41240, "fd00::8", 29501, T0 + 302, 1 << 33, 1,
             4242, 4251, 1),
        ],
    }


def write_sample_bundle(out_dir: Path, *, node: str = "gpu-node-07", spool_name="spool.db",
                        **kw) -> tuple[Path, dict[str, list[tuple]]]:
    """Write one row set into every table through BundleWriter; return (bundle, rows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    w = BundleWriter(out_dir / spool_name, node=node, host=HOST, capture_start=START, **kw)
    sa, sb = w.add_stack(FRAMES_A), w.add_stack(FRAMES_B)
    rows = sample_rows(sa, sb)
    for table, rs in rows.items():
        w.add_many(table, rs)
    path = w.seal(out_dir, capture_end=END)
    return path, rows


@pytest.fixture
def sample_bundle(tmp_path) -> Path:
    path, _ = write_sample_bundle(tmp_path / "b")
    return path


# ------------------------------------------------------------------------- rewrapping

def split_bundle(path) -> tuple[dict, bytes]:
    """(manifest, database image) of a valid bundle."""
    with open(path, "rb") as f:
        manifest, off = _read_header(path, f)
        f.seek(off)
        image = zstandard.ZstdDecompressor().decompress(f.read())
    return manifest, image


def pack(manifest: dict, image: bytes, *, fix: bool = True, **zargs) -> bytes:
    """A bundle of manifest and image; with fix, database.size and sha256 are set."""
    manifest = json.loads(json.dumps(manifest))
    if fix:
        manifest["database"]["size"] = len(image)
        manifest["database"]["sha256"] = hashlib.sha256(image).hexdigest()
    raw = json.dumps(manifest).encode()
    args = {"write_checksum": True, "write_content_size": True, **zargs}
    frame = zstandard.ZstdCompressor(level=3, **args).compress(image)
    return struct.pack("<II", SKIPPABLE_MAGIC, len(raw)) + raw + frame


def modify_image(image: bytes, tmp_dir: Path, sql: str) -> bytes:
    """Run trusted test SQL on a copy of an image (plain sqlite3) and return the result."""
    db = tmp_dir / "modify.db"
    db.write_bytes(image)
    con = sqlite3.connect(db)
    con.executescript(sql)
    con.commit()
    con.close()
    return db.read_bytes()


def table_rows(con, table: str) -> list[tuple]:
    cols = TABLES_BY_NAME[table].data_columns
    return [tuple(r) for r in con.execute(
        f"SELECT {', '.join(cols)} FROM {table} ORDER BY rowid")]


def reason_of(path, **kw) -> str:
    """The BundleError reason open_bundle gives for path (fails if it opens)."""
    from ingero_forensics.errors import BundleError
    with pytest.raises(BundleError) as ei:
        b = open_bundle(path, **kw)
        b.close()
    assert ei.value.path == str(path)
    return ei.value.reason
