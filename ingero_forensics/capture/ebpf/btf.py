"""Struct member offsets from the running kernel's BTF (/sys/kernel/btf/vmlinux).

BCC compiles against the kernel headers it finds, and on a machine whose headers are not
the running kernel's (a distribution's headers package beside a newer kernel) a struct
read through them lands at the wrong offset. Tracepoint arguments do not have that
problem (BCC reads their layout from tracefs); a struct field that no tracepoint carries
is read by its offset, looked up here at capture start and compiled into the program as a
constant. Only what that lookup needs is parsed: the type section's records, walked by
kind (include/uapi/linux/btf.h), and the string section.
"""

from __future__ import annotations

import struct

VMLINUX = "/sys/kernel/btf/vmlinux"
_MAGIC = 0xEB9F
_HEADER = struct.Struct("<HBBIIIII")     # magic, version, flags, hdr_len, type/str off+len
_TYPE = struct.Struct("<III")            # name_off, info, size or type
_MEMBER = struct.Struct("<III")          # name_off, type, offset (bits, or bitfield form)

KIND_INT, KIND_PTR, KIND_STRUCT, KIND_UNION, KIND_TYPEDEF = 1, 2, 4, 5, 8
KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG = 9, 10, 11, 18
#: bytes that follow a type record, per kind: a fixed part, and a part per vlen item
_EXTRA = {1: (4, 0), 2: (0, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 7: (0, 0),
          8: (0, 0), 9: (0, 0), 10: (0, 0), 11: (0, 0), 12: (0, 0), 13: (0, 8),
          14: (4, 0), 15: (0, 12), 16: (0, 0), 17: (4, 0), 18: (0, 0), 19: (0, 12)}
_QUALIFIERS = (KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG)


class BtfError(Exception):
    """The BTF is missing, malformed, or lacks what was asked for."""


class Btf:
    """The types of one BTF blob: enough to find a struct member's offset and size."""

    def __init__(self, data: bytes):
        if len(data) < _HEADER.size:
            raise BtfError("too short for a BTF header")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = \
            _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise BtfError(f"bad magic {magic:#x} (not little-endian BTF)")
        types = data[hdr_len + type_off:hdr_len + type_off + type_len]
        self.strings = data[hdr_len + str_off:hdr_len + str_off + str_len]
        if len(types) != type_len or len(self.strings) != str_len:
            raise BtfError("type or string section runs past the end")
        #: type id -> (kind, name_off, size_or_type, kind_flag, vlen, offset of its items)
        self.types: list[tuple[int, int, int, int, int, int] | None] = [None]   # id 0: void
        pos = 0
        while pos < len(types):
            if pos + _TYPE.size > len(types):
                raise BtfError(f"truncated type record at {pos}")
            name_off, info, size_or_type = _TYPE.unpack_from(types, pos)
            kind, vlen, kind_flag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
            if kind not in _EXTRA:
                raise BtfError(f"unknown BTF kind {kind} at {pos}")
            fixed, per_item = _EXTRA[kind]
            pos += _TYPE.size
            self.types.append((kind, name_off, size_or_type, kind_flag, vlen, pos))
            pos += fixed + per_item * vlen
        if pos != len(types):
            raise BtfError("type section does not end on a record")
        self._types = types

    def name(self, off: int) -> str:
        end = self.strings.find(b"\0", off)
        return self.strings[off:end if end >= 0 else None].decode("utf-8", "replace")

    def struct_id(self, name: str) -> int:
        """The id of the (complete) struct of that name."""
        for tid, t in enumerate(self.types):
            if t and t[0] == KIND_STRUCT and t[2] and self.name(t[1]) == name:
                return tid
        raise BtfError(f"no struct {name}")

    def _resolve(self, tid: int) -> int:
        """Through typedefs and qualifiers to the type itself."""
        for _ in range(64):
            t = self.types[tid]
            if t is None or t[0] not in _QUALIFIERS:
                return tid
            tid = t[2]
        raise BtfError("typedef loop")

    def size(self, tid: int) -> int:
        t = self.types[self._resolve(tid)]
        if t is not None and t[0] == KIND_PTR:
            return 8                     # the vmlinux BTF read here is a 64-bit kernel's
        if t is None or t[0] not in (KIND_INT, KIND_STRUCT, KIND_UNION):
            raise BtfError(f"type {tid} has no plain size")
        return t[2]

    def offsets(self, struct_name: str, members: dict[str, int | None]) -> dict[str, int]:
        """Byte offsets of struct_name's members, each of which must be as many bytes
        wide as `members` says (None: any width)."""
        out = {}
        for member, size in members.items():
            offset, width = self.member(struct_name, member)
            if size is not None and width != size:
                raise BtfError(f"{struct_name}.{member} is {width} bytes, not {size}")
            out[member] = offset
        return out

    def member(self, struct_name: str, member: str) -> tuple[int, int]:
        """(byte offset, byte size) of a member of a struct, looking into anonymous
        structs and unions; bitfields are refused (they have no byte offset)."""
        found = self._member(self.struct_id(struct_name), member, 0)
        if found is None:
            raise BtfError(f"struct {struct_name} has no member {member}")
        return found

    def _member(self, tid: int, member: str, base_bits: int) -> tuple[int, int] | None:
        kind, _name_off, _size, kind_flag, vlen, items = self.types[tid]
        for i in range(vlen):
            name_off, mtype, offset = _MEMBER.unpack_from(self._types, items + 12 * i)
            bits, bitfield = (offset & 0xFFFFFF, offset >> 24) if kind_flag else (offset, 0)
            name = self.name(name_off) if name_off else ""
            if name == member:
                if bitfield or (base_bits + bits) % 8:
                    raise BtfError(f"member {member} is a bitfield")
                return (base_bits + bits) // 8, self.size(mtype)
            if not name:
                inner = self._resolve(mtype)
                if self.types[inner] and self.types[inner][0] in (KIND_STRUCT, KIND_UNION):
                    found = self._member(inner, member, base_bits + bits)
                    if found is not None:
                        return found
        return None


def load(path: str | None = None) -> Btf:
    """The running kernel's BTF (or the file at `path`); BtfError when it cannot be read
    or parsed."""
    path = path or VMLINUX
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BtfError(f"cannot read {path}: {e.strerror}") from None
    return Btf(data)


def member_offsets(struct_name: str, members: dict[str, int | None],
                   path: str | None = None) -> dict[str, int]:
    """Byte offsets of struct_name's members in the running kernel (Btf.offsets)."""
    return load(path).offsets(struct_name, members)
