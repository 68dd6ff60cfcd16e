"""The communicator identity hash, mirrored from the BPF program (nccl.py).

comm_id_hash = fold of the 128-byte ncclUniqueId as 16 little-endian 64-bit words:
``h = 0; for w in words: h = splitmix64(h ^ w)``. Every byte reaches the result, so ids
that share their first bytes still get distinct hashes.

A communicator made by ncclCommSplit has no unique id. Its hash is
``splitmix64(splitmix64(splitmix64(parent) ^ color) ^ n)`` where n counts the splits of
that parent on this rank (1 for the first). ncclCommSplit is collective over the parent,
so n and color are the same on every rank of the child. The split key is NOT folded in,
although the issue suggested it: keys differ from rank to rank (PyTorch passes the
parent rank), which would give each rank of one child a different hash.
"""

from __future__ import annotations

import struct

MASK = (1 << 64) - 1


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def unique_id_hash(raw: bytes) -> int:
    if len(raw) != 128:
        raise ValueError(f"ncclUniqueId is 128 bytes, got {len(raw)}")
    h = 0
    for w in struct.unpack("<16Q", raw):
        h = splitmix64(h ^ w)
    return h


def split_hash(parent: int, color: int, nth: int) -> int:
    h = splitmix64(splitmix64(parent) ^ (color & 0xFFFFFFFF))
    return splitmix64(h ^ nth)


def hex_hash(h: int) -> str:
    return f"{h:016x}"
