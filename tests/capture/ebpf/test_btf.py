"""Struct member offsets from BTF: a blob built here (every case the lookup walks), and
the running kernel's own, whose offsets the TCP tests then prove by reading them."""

from __future__ import annotations

import struct

import pytest

from ingero_forensics.capture.ebpf import btf


def blob(types: list[bytes], names: list[str]) -> bytes:
    strings = b"\0" + b"".join(n.encode() + b"\0" for n in names)
    body = b"".join(types)
    return struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(body), len(body),
                       len(strings)) + body + strings


def name_off(names: list[str], name: str) -> int:
    return 1 + sum(len(n) + 1 for n in names[:names.index(name)])


def record(kind: int, vlen: int, size_or_type: int, name: int = 0, kind_flag: int = 0,
           items: bytes = b"") -> bytes:
    return struct.pack("<III", name, (kind_flag << 31) | (kind << 24) | vlen,
                       size_or_type) + items


NAMES = ["u64", "u32", "acked", "nxt", "flags", "inner", "outer", "ptr_t", "s_fwd"]


def sample() -> bytes:
    n = lambda s: name_off(NAMES, s)   # noqa: E731
    members = lambda *m: b"".join(struct.pack("<III", *x) for x in m)   # noqa: E731
    types = [
        record(1, 0, 8, n("u64"), items=struct.pack("<I", 64)),            # 1 INT u64
        record(1, 0, 4, n("u32"), items=struct.pack("<I", 32)),            # 2 INT u32
        record(8, 0, 2, n("ptr_t")),                                       # 3 typedef u32
        record(10, 0, 1),                                                  # 4 const u64
        record(13, 1, 0, items=struct.pack("<II", 0, 1)),                  # 5 FUNC_PROTO
        record(5, 2, 8, 0, items=members((n("acked"), 4, 0),               # 6 anon union
                                         (n("nxt"), 3, 0))),
        record(4, 1, 8, n("inner"), kind_flag=1,                           # 7 bitfields
               items=members((n("flags"), 2, (3 << 24) | 5))),
        record(7, 0, 0, n("s_fwd")),                                       # 8 FWD
        record(4, 3, 32, n("outer"),
               items=members((n("u32"), 2, 0), (0, 6, 64), (n("inner"), 7, 128))),
    ]
    return blob(types, NAMES)


def test_member_offsets_through_anonymous_unions_and_typedefs(tmp_path):
    types = btf.Btf(sample())
    assert types.member("outer", "u32") == (0, 4)
    # inside the anonymous union at bit 64: through const to u64, through typedef to u32
    assert types.member("outer", "acked") == (8, 8)
    assert types.member("outer", "nxt") == (8, 4)
    assert types.member("outer", "inner") == (16, 8)
    path = tmp_path / "vmlinux"
    path.write_bytes(sample())
    # offsets, checked against the widths asked for
    assert btf.member_offsets("outer", {"acked": 8, "nxt": 4}, str(path)) == \
        {"acked": 8, "nxt": 8}


@pytest.mark.parametrize("ask,why", [
    (("outer", {"missing": 8}), "struct outer has no member missing"),
    (("nostruct", {"acked": 8}), "no struct nostruct"),
    (("outer", {"acked": 4}), "outer.acked is 8 bytes, not 4"),
    (("inner", {"flags": 4}), "member flags is a bitfield"),
])
def test_what_is_not_there_is_an_error_that_says_so(tmp_path, ask, why):
    path = tmp_path / "vmlinux"
    path.write_bytes(sample())
    with pytest.raises(btf.BtfError, match=why):
        btf.member_offsets(*ask, str(path))


@pytest.mark.parametrize("damage,why", [
    (lambda b: b[:10], "too short"),
    (lambda b: b"\x00\x00" + b[2:], "bad magic"),
    (lambda b: b[:-3], "runs past the end"),
    (lambda b: b[:24] + b[24:28] + bytes([0, 0, 0, 30]) + b[32:], "unknown BTF kind 30"),
])
def test_damaged_btf_is_refused(tmp_path, damage, why):
    with pytest.raises(btf.BtfError, match=why):
        btf.Btf(damage(sample()))
    path = tmp_path / "missing"
    with pytest.raises(btf.BtfError, match="cannot read .*missing"):
        btf.member_offsets("outer", {"acked": 8}, str(path))


@pytest.mark.ebpf
def test_the_running_kernel_has_what_tcp_progress_reads():
    # the TCP tests prove the values read at these offsets (exact stream positions)
    got = btf.member_offsets("tcp_sock", {"bytes_acked": 8, "rcv_nxt": 4, "copied_seq": 4})
    assert len(set(got.values())) == 3 and all(0 < o < 8192 for o in got.values()), got
