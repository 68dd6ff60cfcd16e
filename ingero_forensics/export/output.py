"""Where the JSON goes: chunked sinks, spill files, the per-node part files written by
the workers, and the assembler that copies them into one (optionally gzip) file."""

from __future__ import annotations

import io
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass


from .options import CHUNK_EVENTS, ExportError, ExportStats


# -------------------------------------------------------------------------- writer

class Sink:
    """Chunked writer of the traceEvents array; counts and caps events."""

    def __init__(self, raw, max_events: int | None):
        self.raw = raw
        self.buf: list[str] = []
        self.first = True
        self.max_events = max_events
        self.events = 0
        self.bytes = 0

    def add(self, line: str, counted: bool = True) -> None:
        self.buf.append(line)
        if counted:
            self.events += 1
            if self.max_events is not None and self.events > self.max_events:
                raise ExportError(f"more than --max-events {self.max_events} events; narrow "
                                  "the export with --from/--to, --nodes, --ranks or --kinds, "
                                  "or raise --max-events")
        if len(self.buf) >= CHUNK_EVENTS:
            self.flush()

    def extend(self, lines: list[str]) -> None:
        """Add counted events in bulk (the hot path of the slice streams)."""
        self.flush()
        if not lines:
            return
        self.events += len(lines)
        if self.max_events is not None and self.events > self.max_events:
            raise ExportError(f"more than --max-events {self.max_events} events; narrow "
                              "the export with --from/--to, --nodes, --ranks or --kinds, "
                              "or raise --max-events")
        self.write(((",\n" if not self.first else "") + ",\n".join(lines)).encode())
        self.first = False

    def extend_joined(self, data: bytes, n: int) -> None:
        """``n`` counted events already joined by the C loops: exactly the bytes
        extend() writes for them (",\n" in front unless they start the section)."""
        self.flush()
        self.events += n
        if self.max_events is not None and self.events > self.max_events:
            raise ExportError(f"more than --max-events {self.max_events} events; narrow "
                              "the export with --from/--to, --nodes, --ranks or --kinds, "
                              "or raise --max-events")
        self.write(data)
        self.first = False

    def write(self, data: bytes) -> None:
        self.raw.write(data)
        self.bytes += len(data)

    def flush(self) -> None:
        if not self.buf:
            return
        text = ",\n".join(self.buf)
        self.write(((",\n" if not self.first else "") + text).encode())
        self.first = False
        self.buf.clear()


class Spill:
    """Chunks of joined events kept for a later section, in a temporary file (memory stays
    flat) shared by the sections of one process: ``holder`` is {"f": file} once created.
    Written in a forked worker, it is that worker's own file."""

    def __init__(self, holder: dict):
        self.holder = holder
        self.chunks: list[tuple[int, int, int]] = []     # (offset, length, events)

    def write(self, data: bytes, n: int) -> None:
        f = self.holder.get("f")
        if f is None:
            f = self.holder["f"] = tempfile.TemporaryFile(prefix="ingero-export-")
        offset = f.seek(0, os.SEEK_END)
        f.write(data)
        self.chunks.append((offset, len(data), n))

    def replay(self, sink: "Sink") -> int:
        """The chunks into ``sink`` as they were written: the bytes and chunking the C
        loop would have given the sink directly. Returns the number of events."""
        if not self.chunks:
            return 0
        f = self.holder["f"]
        f.flush()
        sink.flush()
        total = 0
        for offset, length, n in self.chunks:
            data = os.pread(f.fileno(), length, offset)
            if len(data) != length:
                raise ExportError(f"{f.name}: temporary file ended early")
            sink.extend_joined(data, n)
            total += n
        return total

    @staticmethod
    def close(holder: dict) -> None:
        f = holder.pop("f", None)
        if f is not None:
            f.close()


# ------------------------------------------------------------------- part files

@dataclass
class Part:
    """One section's events in a part file: bytes [offset, offset + length) hold the
    events joined by ",\n" (no separator before the first or after the last), as plain
    text or, for gzip, as a raw deflate fragment ending in a sync flush (byte aligned,
    not final, so fragments concatenate into one deflate stream)."""
    path: str
    offset: int
    length: int
    raw_length: int      # uncompressed bytes
    crc: int             # CRC-32 of the uncompressed bytes (gzip only)


@dataclass
class NodeResult:
    """A node's track allocator and counts, merged into the parent's."""
    node_id: int
    stats: ExportStats
    names: dict
    synthetic: dict
    next_tid: dict
    overflow: int
    overflowed_nccl: dict


class PartFile:
    """Sections written one after another into one file; each becomes a Part.

    A fresh compressor per section: a fragment's bytes depend only on its own events, so
    the output is the same whichever process wrote which section.
    """

    def __init__(self, path: str, gzip_level: int | None, max_events: int | None):
        self.path = path
        self.gzip_level = gzip_level
        self.f = open(path, "wb")
        self.sink = Sink(self, max_events)
        self._comp = None
        self._crc = 0
        self._n = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def section(self, fill) -> Part:
        offset = self.f.tell()
        self._crc, self._n = 0, 0
        self._comp = (zlib.compressobj(self.gzip_level, zlib.DEFLATED, -15)
                      if self.gzip_level is not None else None)
        self.sink.first = True
        fill(self.sink)
        self.sink.flush()
        if self._comp is not None and self._n:
            self.f.write(self._comp.flush(zlib.Z_SYNC_FLUSH))
        self.f.flush()          # copied from the file while it is still open
        return Part(self.path, offset, self.f.tell() - offset, self._n, self._crc)

    def write(self, data: bytes) -> None:
        self._n += len(data)
        if self._comp is None:
            self.f.write(data)
        else:
            self._crc = zlib.crc32(data, self._crc)
            self.f.write(self._comp.compress(data))


class InlineSections:
    """--jobs 1: sections written straight through an Assembler, byte for byte as the
    assembler would copy them from part files (separator fragment, then the section as
    its own fragment)."""

    def __init__(self, w: "Assembler", max_events: int | None):
        self.w = w
        self.sink = Sink(self, max_events)
        self._comp = None
        self._crc = 0
        self._n = 0

    def section(self, fill) -> None:
        level = self.w.gzip_level
        self._crc, self._n = 0, 0
        self._comp = zlib.compressobj(level, zlib.DEFLATED, -15) if level is not None else None
        self.sink.first = True
        fill(self.sink)
        self.sink.flush()
        if not self._n:
            return
        w = self.w
        if self._comp is not None:
            w.write(self._comp.flush(zlib.Z_SYNC_FLUSH))
            w.crc = crc32_combine(w.crc, self._crc, self._n)
        w.bytes += self._n

    def write(self, data: bytes) -> None:
        if not self._n:
            if self.w.any_event:
                self.w.raw(b",\n")
            self.w.any_event = True
        self._n += len(data)
        if self._comp is None:
            self.w.write(data)
        else:
            self._crc = zlib.crc32(data, self._crc)
            self.w.write(self._comp.compress(data))


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B) (zlib's crc32_combine, which Python's
    zlib does not expose): lets the parent seal fragments it never decompressed."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]   # one zero bit
    even = _gf2_square(odd)                             # two
    odd = _gf2_square(even)                             # four
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


class Assembler:
    """Writes the output: small pieces of its own, then parts copied from their files,
    ",\n" between non-empty parts. With gzip_level the output is one gzip member whose
    deflate stream is the concatenated fragments (as pigz does), sealed with a final empty
    block and the combined CRC."""

    def __init__(self, out, gzip_level: int | None):
        self.out = out
        self.gzip_level = gzip_level
        self.bytes = 0          # uncompressed
        self.crc = 0
        self.any_event = False
        try:
            self.fd = out.fileno() if isinstance(out, io.FileIO) else None
        except (OSError, ValueError):
            self.fd = None
        if isinstance(out, io.FileIO):
            self.write = self._write_all    # unbuffered: a write may be short
        else:
            self.write = out.write
        if gzip_level is not None:
            # RFC 1952 header as gzip.GzipFile(mtime=0, filename="") writes it.
            xfl = 4 if gzip_level == 1 else 2 if gzip_level == 9 else 0
            self.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00" + bytes([xfl]) + b"\xff")

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self.out.write(view):]

    def raw(self, data: bytes) -> None:
        if self.gzip_level is None:
            self.write(data)
        else:
            c = zlib.compressobj(self.gzip_level, zlib.DEFLATED, -15)
            self.write(c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH))
            self.crc = crc32_combine(self.crc, zlib.crc32(data), len(data))
        self.bytes += len(data)

    def part(self, p: Part | None) -> None:
        if p is None or not p.raw_length:
            return
        if self.any_event:
            self.raw(b",\n")
        self.any_event = True
        self._copy(p.path, p.offset, p.length)
        self.bytes += p.raw_length
        if self.gzip_level is not None:
            self.crc = crc32_combine(self.crc, p.crc, p.raw_length)

    def _copy(self, path: str, offset: int, length: int) -> None:
        with open(path, "rb") as src:
            if self.fd is not None:
                # In the kernel (no copy through Python) when both are files.
                while length:
                    try:
                        n = os.copy_file_range(src.fileno(), self.fd, length, offset)
                    except OSError:
                        break
                    if n == 0:
                        break
                    offset += n
                    length -= n
            src.seek(offset)
            while length:
                chunk = src.read(min(length, 1 << 20))
                if not chunk:
                    raise ExportError(f"{path}: part file ended early")
                self.write(chunk)
                length -= len(chunk)

    def finish(self) -> None:
        if self.gzip_level is not None:
            self.write(zlib.compressobj(self.gzip_level, zlib.DEFLATED, -15).flush())
            self.write(struct.pack("<II", self.crc, self.bytes & 0xFFFFFFFF))
