"""Parts of the eBPF sources that need no kernel: source list, environment checks, the
generated C, the identity hash mirror and record layouts."""

from __future__ import annotations

import re
import struct

import pytest

from ingero_forensics.capture import ebpf
from ingero_forensics.capture.ebpf import _bcc, block, cuda, hashing, nccl, sched, tcp
from ingero_forensics.capture.ebpf.base import PRELUDE, hist_json
from ingero_forensics.capture.ebpf.libs import lib_kind, libs_in_maps
from ingero_forensics.capture.source import CaptureContext, CaptureOptions


class NoTargets:
    auto = False

    def pids(self):
        return set()

    def subscribe(self, on_new, on_exit):
        pass


def test_ebpf_sources_follow_options():
    names = [s.name for s in ebpf.ebpf_sources(CaptureOptions())]
    assert names == ["nccl", "cuda", "tcp", "sched", "block"]
    assert "block" not in [s.name for s in ebpf.ebpf_sources(CaptureOptions(block=False))]


def test_environment_problem_names_root(monkeypatch):
    monkeypatch.setattr(_bcc.os, "geteuid", lambda: 1000)
    reason, fix = _bcc.environment_problem()
    assert "root" in reason and "root" in fix
    status = nccl.NcclSource.probe()
    assert (status.name, status.available) == ("nccl", False) and "root" in status.reason


def test_environment_problem_names_missing_headers(monkeypatch):
    monkeypatch.setattr(_bcc.os, "geteuid", lambda: 0)
    monkeypatch.setattr(_bcc, "tracefs_dir", lambda: "/sys/kernel/tracing")
    real_isdir, real_exists = _bcc.os.path.isdir, _bcc.os.path.exists
    monkeypatch.setattr(_bcc.os.path, "isdir",
                        lambda p: False if p.startswith("/lib/modules/") else real_isdir(p))
    monkeypatch.setattr(_bcc.os.path, "exists",
                        lambda p: False if "kheaders" in p else real_exists(p))
    reason, fix = _bcc.environment_problem()
    assert "no kernel headers" in reason and "setup-ebpf.sh" in fix


@pytest.mark.parametrize("cls", [nccl.NcclSource, cuda.CudaSource, tcp.TcpSource,
                                 sched.SchedSource, block.BlockSource])
def test_generated_c_has_no_placeholders_left(cls):
    opts = CaptureOptions(ring_pages=100, sched_threshold_ns=12345)
    src = cls(opts)
    text = src.program_text(CaptureContext("n", opts, NoTargets()))
    assert not re.findall(r"__[A-Z_]+__", text), re.findall(r"__[A-Z_]+__", text)
    assert "BPF_RINGBUF_OUTPUT(events, 128);" in text   # rounded up to a power of two
    if cls is sched.SchedSource:
        assert "#define THRESHOLD 12345ULL" in text


def test_prelude_is_the_shared_part():
    assert "stat_add" in PRELUDE and "count_lost" in PRELUDE


def test_unique_id_hash_uses_every_byte():
    base = bytes(range(128))
    seen = {hashing.unique_id_hash(base)}
    for i in (0, 63, 120, 127):
        changed = bytearray(base)
        changed[i] ^= 1
        seen.add(hashing.unique_id_hash(bytes(changed)))
    assert len(seen) == 5
    with pytest.raises(ValueError):
        hashing.unique_id_hash(b"short")


def test_split_hash_depends_on_parent_color_and_ordinal():
    p = hashing.unique_id_hash(bytes(128))
    hs = {hashing.split_hash(p, c, n) for c in (0, 1) for n in (1, 2)}
    hs.add(hashing.split_hash(p + 1, 0, 1))
    assert len(hs) == 5
    assert hashing.hex_hash(0xAB) == "00000000000000ab"


def test_splitmix64_known_value():
    # first output of splitmix64 seeded with 0 (Vigna's reference implementation)
    assert hashing.splitmix64(0) == 0xE220A8397B1DCDAF


def test_record_layouts_match_the_c_structs():
    assert nccl.EVENT.size == 128
    assert cuda.EVENT.size == 80
    assert sched.EVENT.size == 80
    assert block.EVENT.size == 72
    assert tcp.EVENT.size == 64


def test_hist_json_trims_trailing_zeros():
    assert hist_json([0, 2, 1, 0, 0]) == "[0,2,1]"
    assert hist_json([0, 0]) == "[]"


def test_nccl_rows_from_a_packed_record():
    class Sink:
        rows = {}

        def add_many(self, table, rows):
            self.rows.setdefault(table, []).extend(rows)

    src = nccl.NcclSource(CaptureOptions(stacks=False))
    rec = nccl.EVENT.pack(100, 50, 0xABC, 0, 1000, 7, 0x1000, 3, 0, 11, 12, -1, 0, 1, 4,
                          7, 4, -1, -1, -1, 0, 0, nccl.NCCL_OPS.index("REDUCE_SCATTER"), 1)
    src.handle([rec], Sink())
    (row,) = Sink.rows["nccl_events"]
    assert row[:15] == (100, 50, "REDUCE_SCATTER", 1, 4, "0000000000000abc", 3, 1000,
                        "float32", "avg", None, 7, 1000 * 4 * 4, 0, 0)
    # pid, tid, stack; the ncclComm_t; no handle_seq for a communicator whose init was seen
    assert row[15:] == (11, 12, None, 0x1000, None)
    # known = 2: a communicator first seen at a collective (the capture attached after its
    # init): no hash, seq or rank; the per-handle counter goes to handle_seq
    late = nccl.EVENT.pack(100, 50, 0, 0, 1000, 7, 0x2000, 5, 0, 11, 12, -1, 0, -1, -1,
                           7, 4, -1, -1, -1, 0, 0, nccl.NCCL_OPS.index("ALL_REDUCE"), 2)
    src.handle([late], Sink())
    row = Sink.rows["nccl_events"][-1]
    assert (row[3], row[4], row[5], row[6]) == (None, None, None, None)
    assert row[-2:] == (0x2000, 5)


def test_redop_names():
    assert [nccl.redop_name(v) for v in (-1, 0, 4, 7)] == [None, "sum", "avg", "premul_sum:7"]


def test_library_discovery(tmp_path):
    lib = tmp_path / "site-packages" / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    pid_dir = tmp_path / "proc" / "77"
    pid_dir.mkdir(parents=True)
    (pid_dir / "maps").write_text(
        f"7f00-7f10 r-xp 00000000 fe:00 1 {lib / 'libnccl.so.2'}\n"
        "7f10-7f20 r-xp 00000000 fe:00 2 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 fe:00 3 /gone/libcudart.so.12 (deleted)\n")
    assert libs_in_maps(77, str(tmp_path / "proc")) == [str(lib / "libnccl.so.2")]
    assert [lib_kind(p) for p in ("/x/libcuda.so.1", "/x/libcudart.so.12", "/x/libc.so.6")] == \
        ["cuda", "cudart", None]


def test_tcp_event_unpacks_ipv4():
    rec = tcp.EVENT.pack(5, 0, 1, 40000, 5201, 2, tcp.KIND_RETRANSMIT,
                         bytes([10, 0, 0, 1]) + bytes(12), bytes([10, 0, 0, 2]) + bytes(12),
                         0, 0)
    assert struct.unpack_from("<Q", rec)[0] == 5
    assert tcp.TCP_STATES[1] == "ESTABLISHED"


def test_launch_duty_cycles_above_the_budget():
    """--launch-budget: under it every interval counts; above it, cycles of at least ten
    intervals count the first share (budget / rate, one at least, 2 % at the least) and
    skip the rest; a rate back under the budget counts everything again at once."""
    def run(duty, rate, n):
        out, was_on = [], True
        for _ in range(n):
            was_on = duty.next_on(int(rate) if was_on else 0, 1.0, was_on)
            out.append(was_on)
        return out

    assert all(run(cuda.LaunchDuty(0), 1e6, 30))                  # 0: no budget
    assert all(run(cuda.LaunchDuty(5000), 4000, 30))
    # the interval that measured the rate (on) opens the first cycle
    ten = run(cuda.LaunchDuty(5000), 50_000, 40)                   # share 10 %
    assert ten[:10] == [False] * 9 + [True] and sum(ten) == 4, ten
    half = run(cuda.LaunchDuty(5000), 10_000, 20)
    assert half[:10] == [True] * 4 + [False] * 5 + [True] and sum(half) == 10, half
    tiny = cuda.LaunchDuty(100)
    assert sum(run(tiny, 1e7, 100)) == 2 and tiny.share == cuda.MIN_LAUNCH_SHARE
    back = cuda.LaunchDuty(5000)
    run(back, 50_000, 3)
    assert back.next_on(1000, 1.0, True) and back.share == 1.0
    assert all(run(back, 1000, 10))
