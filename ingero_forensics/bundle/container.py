"""The .bundle container: a JSON manifest in a zstd skippable frame, then one zstd frame
holding the SQLite database image.

    offset 0   u32 LE 0x184D2A5E        skippable-frame magic (bytes 5E 2A 4D 18)
    offset 4   u32 LE N                 manifest length, 2 <= N <= 1 MiB
    offset 8   N bytes                  manifest, UTF-8 JSON object
    offset 8+N one zstd frame           content size and XXH64 content checksum present;
                                        content = the SQLite database image; nothing follows

The manifest can be read with two small reads and no decompression (``read_manifest``).
docs/bundle-format.md is the specification; MANIFEST_FIELDS below is rendered into it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat
import struct
from pathlib import Path

import zstandard

from ..errors import BundleError
from .schema import FORMAT_VERSION, MANIFEST_TABLES, REQUIRED_TABLES

SKIPPABLE_MAGIC = 0x184D2A5E
ZSTD_MAGIC = 0xFD2FB528
SQLITE_MAGIC = b"SQLite format 3\x00"
MANIFEST_MAGIC = "ingero-forensics-bundle"
MAX_MANIFEST_BYTES = 1 << 20
#: Default ceiling on a declared database size; a larger claim is refused before any
#: decompression (decompression-bomb guard). Override with INGERO_MAX_DB_BYTES.
DEFAULT_MAX_DB_BYTES = 64 << 30
BUNDLE_SUFFIX = ".bundle"
#: A name never starts with "-" (its bundle file would read as an option: `-o+2025...`)
#: nor "." (a dotfile that `*.bundle` does not match).
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,62}$")
NODE_NAME_RULE = "1-63 characters of A-Z a-z 0-9 . _ -, not starting with - or ."
_CHUNK = 1 << 20


def validate_node_name(name: str) -> str:
    if not isinstance(name, str) or not NODE_NAME_RE.match(name):
        raise ValueError(
            f"invalid node name {name!r}: use {NODE_NAME_RULE}")
    return name


def bundle_filename(node: str, start_utc_ns: int, index: int) -> str:
    """Name a sealed segment so that sorting names sorts by node, then time.

    '+' sorts below every character a node name may contain, so one node's files stay
    contiguous even when another node's name extends it (node-1 vs node-1.a).
    """
    import time as _time
    stamp = _time.strftime("%Y%m%dT%H%M%S", _time.gmtime(start_utc_ns // 1_000_000_000))
    return f"{validate_node_name(node)}+{stamp}Z+{index:06d}{BUNDLE_SUFFIX}"


def max_db_bytes() -> int:
    try:
        return int(os.environ.get("INGERO_MAX_DB_BYTES", DEFAULT_MAX_DB_BYTES))
    except ValueError:
        return DEFAULT_MAX_DB_BYTES


# --------------------------------------------------------------------------- manifest

#: Every manifest field: (path, JSON type, required, meaning). check_manifest enforces
#: the required ones; readers ignore keys not listed here.
MANIFEST_FIELDS: tuple[tuple[str, str, bool, str], ...] = (
    ("magic", "string", True, f'Exactly "{MANIFEST_MAGIC}".'),
    ("format_version", "integer", True, f"Bundle format version, >= 1; this spec is "
     f"version {FORMAT_VERSION}. A reader refuses a version newer than it knows."),
    ("node", "string", True, "Node name: 1-63 characters of A-Z a-z 0-9 . _ -, not "
     "starting with - or . (regex ^[A-Za-z0-9_][A-Za-z0-9._-]{0,62}$). Unique within a fleet; the merge namespaces rows by it."),
    ("host", "object", True, "Facts about the machine that captured."),
    ("host.hostname", "string", True, "Host name (uname -n), non-empty."),
    ("host.boot_id", "string", True, "/proc/sys/kernel/random/boot_id of the boot the "
     "capture ran in, non-empty; every CLOCK_MONOTONIC value in the bundle belongs to it."),
    ("host.kernel_release", "string", True, "uname -r, non-empty."),
    ("host.tool_version", "string", True, "Version of the program that wrote the bundle, "
     "non-empty."),
    ("host.machine", "string", False, "uname -m, e.g. x86_64."),
    ("segment", "object", True, "Which part of a capture this bundle is."),
    ("segment.index", "integer", True, ">= 0: 0 for the first segment written into a "
     "bundle directory, then +1 per rotation; a later capture into the same directory "
     "goes on from the highest index there."),
    ("segment.id", "string", True, "Non-empty identifier unique to this segment (the "
     "writer uses 32 lowercase hex digits of a random UUID)."),
    ("segment.recovered", "boolean", False, "true if the segment was sealed from a spool "
     "left by a crashed writer; the capture end is then the newest timestamp found."),
    ("segment.sealed_utc", "string", False, "UTC time of sealing, YYYY-MM-DDTHH:MM:SSZ."),
    ("capture", "object", True, "The capture window of this segment."),
    ("capture.start_utc_ns", "integer", True, "Start, ns since 1970-01-01 UTC "
     "(CLOCK_REALTIME read next to start_mono_ns)."),
    ("capture.end_utc_ns", "integer", True, "End, ns since 1970-01-01 UTC."),
    ("capture.start_mono_ns", "integer", True, "Start, CLOCK_MONOTONIC ns, within "
     "+-2^60."),
    ("capture.end_mono_ns", "integer", True, "End, CLOCK_MONOTONIC ns; >= start_mono_ns, "
     "within +-2^60."),
    ("tables", "object", True, "Row counts: one key per table of the format except meta ("
     + ", ".join(MANIFEST_TABLES) + "), each a non-negative integer equal to SELECT "
     "COUNT(*) of that table. The key of an optional table ("
     + ", ".join(t for t in MANIFEST_TABLES if t not in REQUIRED_TABLES) + ") is present "
     "exactly when the database has that table (readers also accept 0 for a table the "
     "database lacks). Keys for tables a reader does not know are ignored."),
    ("database", "object", True, "The compressed database image that follows."),
    ("database.size", "integer", True, "Bytes of the uncompressed SQLite image, >= 512; "
     "equal to the zstd frame's content size."),
    ("database.sha256", "string", True, "SHA-256 of the uncompressed image, 64 lowercase "
     "hex digits."),
    ("database.compression", "string", True, 'Exactly "zstd".'),
    ("created_by", "string", False, "Free text naming the writing program."),
    ("job_ids", "array", False, "Job identifiers (strings) seen on the node."),
)

_REQUIRED = {
    "magic": str, "format_version": int, "node": str, "host": dict, "segment": dict,
    "capture": dict, "tables": dict, "database": dict,
}
_HOST_KEYS = ("hostname", "boot_id", "kernel_release", "tool_version")
_CAPTURE_KEYS = ("start_utc_ns", "end_utc_ns", "start_mono_ns", "end_mono_ns")


def check_manifest(path, m) -> dict:
    """Validate a parsed manifest's structure; raise BundleError naming what is wrong."""
    if not isinstance(m, dict):
        raise BundleError(path, "manifest is not a JSON object")
    if m.get("magic") != MANIFEST_MAGIC:
        raise BundleError(path, "not an ingero bundle (manifest magic missing)")
    ver = m.get("format_version")
    if not _is_int(ver) or ver < 1:
        raise BundleError(path, f"invalid format_version {ver!r}")
    if ver > FORMAT_VERSION:
        raise BundleError(path, f"bundle format version {ver} is newer than this tool "
                                f"supports ({FORMAT_VERSION}); upgrade ingero-forensics")
    for key, typ in _REQUIRED.items():
        if not isinstance(m.get(key), typ) or isinstance(m.get(key), bool):
            raise BundleError(path, f"manifest field {key!r} missing or not a {typ.__name__}")
    try:
        validate_node_name(m["node"])
    except ValueError as e:
        raise BundleError(path, f"manifest: {e}") from None
    for key in _HOST_KEYS:
        if not isinstance(m["host"].get(key), str) or not m["host"][key]:
            raise BundleError(path, f"manifest field host.{key} missing or not a non-empty string")
    for key in _CAPTURE_KEYS:
        if not _is_int(m["capture"].get(key)):
            raise BundleError(path, f"manifest field capture.{key} missing or not an integer")
    cap = m["capture"]
    for key in ("start_mono_ns", "end_mono_ns"):
        if not -(1 << 60) <= cap[key] <= 1 << 60:
            raise BundleError(path, f"manifest field capture.{key} is beyond any uptime "
                                    "(over 36 years)")
    if cap["end_mono_ns"] < cap["start_mono_ns"]:
        raise BundleError(path, "manifest capture window ends before it starts")
    seg = m["segment"]
    if not _is_int(seg.get("index")) or seg["index"] < 0:
        raise BundleError(path, "manifest field segment.index missing, negative or not a "
                                "64-bit integer")
    if not isinstance(seg.get("id"), str) or not seg["id"]:
        raise BundleError(path, "manifest field segment.id missing or not a string")
    db = m["database"]
    if not _is_int(db.get("size")) or db["size"] < 512:
        raise BundleError(path, "manifest field database.size missing or too small")
    sha = db.get("sha256")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise BundleError(path, "manifest field database.sha256 missing or not 64 hex digits")
    if db.get("compression") != "zstd":
        raise BundleError(path, "manifest field database.compression missing or not \"zstd\"")
    for t in MANIFEST_TABLES:
        if t not in REQUIRED_TABLES and t not in m["tables"]:
            continue   # an optional table (added within version 1) the bundle lacks
        if not _is_int(m["tables"].get(t)) or m["tables"][t] < 0:
            raise BundleError(path, f"manifest field tables.{t} missing or not a count")
    jobs = m.get("job_ids", [])
    if not isinstance(jobs, list) or not all(isinstance(j, str) for j in jobs):
        raise BundleError(path, "manifest field job_ids is not a list of strings")
    _check_optional_fields(path, m)
    return m


#: JSON types of MANIFEST_FIELDS, as Python types (bool is not an integer here).
_JSON_TYPES = {"string": str, "integer": int, "boolean": bool, "object": dict,
               "array": list}
_SEALED_UTC_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def _check_optional_fields(path, m) -> None:
    """An optional field, when present, has its documented type: the merge stores
    and reads them (a "no" in segment.recovered would read as true)."""
    for name, typ, required, _ in MANIFEST_FIELDS:
        if required:
            continue
        *parents, key = name.split(".")
        obj = m
        for part in parents:
            obj = obj.get(part) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or key not in obj:
            continue
        value = obj[key]
        want = _JSON_TYPES[typ]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)) or (
                want is int and not _is_int(value)):
            raise BundleError(path, f"manifest field {name} is not a{'n' if typ[0] in 'aio' else ''} "
                                    f"{typ}")
    sealed = m["segment"].get("sealed_utc")
    if sealed is not None and not _SEALED_UTC_RE.fullmatch(sealed):
        raise BundleError(path, "manifest field segment.sealed_utc is not "
                                "YYYY-MM-DDTHH:MM:SSZ")


def _is_int(v) -> bool:
    """An integer SQLite can hold (a signed 64-bit one): a larger one in a manifest would
    fail whichever reader stores it."""
    return isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63)


def open_regular(path):
    """path opened for binary reading, only if it is a regular file: a FIFO named
    ``p.bundle`` would block the reader forever, a device read endlessly. The open does
    not block (O_NONBLOCK) and the type is checked on the opened file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise BundleError(path, "not a regular file (a FIFO, socket or device)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_manifest(path) -> dict:
    """Read and validate a bundle's manifest without touching the compressed database."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            m, _ = _read_header(path, f)
    except OSError as e:
        raise BundleError(path, f"cannot read: {e.strerror or e}") from None
    return m


def _read_header(path, f) -> tuple[dict, int]:
    head = f.read(8)
    if len(head) < 8:
        raise BundleError(path, "truncated: file is shorter than a bundle header")
    magic, n = struct.unpack("<II", head)
    if magic != SKIPPABLE_MAGIC:
        if head[:4] == SQLITE_MAGIC[:4] and (head + f.read(8))[:16] == SQLITE_MAGIC:
            raise BundleError(path, "plain SQLite database, not a bundle (no manifest frame)")
        if magic == ZSTD_MAGIC:
            raise BundleError(path, "plain zstd file, not a bundle (no manifest frame)")
        raise BundleError(path, "not an ingero bundle (wrong magic bytes)")
    if not 2 <= n <= MAX_MANIFEST_BYTES:
        raise BundleError(path, f"manifest length {n} out of range")
    raw = f.read(n)
    if len(raw) < n:
        raise BundleError(path, "truncated inside the manifest")
    try:
        m = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys,
                       parse_constant=_no_constant)
    except _DuplicateKey as e:
        raise BundleError(path, f"manifest has duplicate key {e.args[0]!r}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BundleError(path, "manifest is not valid UTF-8 JSON") from None
    return check_manifest(path, m), 8 + n


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs):
    # Two readers could otherwise disagree on which of two "node" values counts.
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise _DuplicateKey(k)
        obj[k] = v
    return obj


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def encode_header(manifest: dict) -> bytes:
    raw = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError("manifest exceeds 1 MiB")
    return struct.pack("<II", SKIPPABLE_MAGIC, len(raw)) + raw


# ------------------------------------------------------------------------ seal / open

def file_sha256(path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def fsync_dir(path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bundle(db_path, out_path, manifest: dict, *, level: int = 3) -> Path:
    """Seal a closed SQLite file into out_path atomically (temp file, fsync, link).

    manifest gets its database.size and database.sha256 filled in here. The image is
    read once: it is hashed while it is compressed, and the header, written first with a
    placeholder digest of the same length, is rewritten in place at the end. An existing
    out_path is never replaced (FileExistsError). On any error the temporary file is
    removed and out_path is untouched.
    """
    db_path, out_path = Path(db_path), Path(out_path)
    size = os.stat(db_path).st_size
    manifest = dict(manifest)
    manifest["database"] = {"size": size, "sha256": "0" * 64, "compression": "zstd"}
    placeholder = encode_header(manifest)
    # An unpredictable name, created here or not at all, never through a symlink: the
    # capture runs as root, and another user who can write to the bundle directory
    # could otherwise plant a link at a predictable name and have root write through
    # it (a review: a file of that user's overwritten with the bundle).
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True,
                                    write_content_size=True, threads=-1)
    h = hashlib.sha256()
    got = 0
    created = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        created = True
        with open(db_path, "rb") as src, os.fdopen(fd, "wb") as dst:
            dst.write(placeholder)
            # compressobj, not stream_writer: leaving a stream_writer early (Ctrl-C) makes
            # its __exit__ raise "Src size is incorrect" over the real exception.
            z = cctx.compressobj(size=size)
            while chunk := src.read(_CHUNK):
                got += len(chunk)
                h.update(chunk)
                dst.write(z.compress(chunk))
            if got != size:
                raise OSError(f"{db_path} changed size while it was sealed")
            dst.write(z.flush())
            manifest["database"]["sha256"] = h.hexdigest()
            header = encode_header(manifest)
            assert len(header) == len(placeholder)
            dst.seek(0)
            dst.write(header)
            dst.flush()
            os.fsync(dst.fileno())
        # link, not rename: never replace a bundle that already has this name.
        os.link(tmp, out_path)
        tmp.unlink()
        fsync_dir(out_path.parent)
    except BaseException:
        if created:
            tmp.unlink(missing_ok=True)
        raise
    return out_path


def _frame_end(path, f, start: int, file_size: int) -> int:
    """Walk the zstd frame's block headers; return the offset just past the frame.

    zstd's streaming decoder does not notice a frame cut off inside its 4-byte checksum,
    so the structure is walked before decompressing.
    """
    pos = start + frame_header_size(path, f, start)
    while True:
        f.seek(pos)
        bh = f.read(3)
        if len(bh) < 3:
            raise BundleError(path, "truncated inside the compressed database")
        v = bh[0] | bh[1] << 8 | bh[2] << 16
        last, btype, bsize = v & 1, (v >> 1) & 3, v >> 3
        if btype == 3:
            raise BundleError(path, "corrupt zstd block (reserved block type)")
        pos += 3 + (1 if btype == 1 else bsize)
        if pos > file_size:
            raise BundleError(path, "truncated inside the compressed database")
        if last:
            if pos + 4 > file_size:
                raise BundleError(path, "truncated inside the zstd content checksum")
            return pos + 4


#: Largest zstd window a reader allocates (zstd's own default limit for decoders).
MAX_WINDOW_BYTES = 1 << 27


def frame_header_size(path, f, start: int) -> int:
    """Check the zstd frame header at start; return its size."""
    f.seek(start)
    head = f.read(18)
    try:
        if len(head) < 6 or len(head) < zstandard.frame_header_size(head):
            raise BundleError(path, "truncated inside the zstd frame header")
        hsize = zstandard.frame_header_size(head)
        params = zstandard.get_frame_parameters(head)
    except zstandard.ZstdError as e:
        raise BundleError(path, f"corrupt zstd frame header ({e})") from None
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise BundleError(path, "zstd frame does not declare its content size")
    if not params.has_checksum:
        raise BundleError(path, "zstd frame has no content checksum")
    if params.dict_id:
        raise BundleError(path, "zstd frame needs a dictionary (not allowed in a bundle)")
    if params.window_size > MAX_WINDOW_BYTES:
        raise BundleError(path, f"zstd window of {params.window_size} bytes exceeds the "
                                f"limit of {MAX_WINDOW_BYTES}")
    return hsize


def decompress_db(path, out_path, *, limit: int | None = None) -> dict:
    """Verify a bundle's container and stream its database image to out_path.

    Checks, in order: header and manifest; declared size against the limit and the free
    space where out_path lives; the frame structure (header, content size equal to the
    manifest's, checksum flag, blocks, nothing trailing); then decompresses in bounded
    chunks, never past the declared size, verifying zstd's checksum, the size and the
    sha256. Returns the manifest.
    """
    path, out_path = Path(path), Path(out_path)
    limit = max_db_bytes() if limit is None else limit
    try:
        with open_regular(path) as f:
            file_size = os.fstat(f.fileno()).st_size
            manifest, frame_start = _read_header(path, f)
            want_size = manifest["database"]["size"]
            if want_size > limit:
                raise BundleError(path, f"declared database size {want_size} bytes exceeds "
                                        f"the limit of {limit} (possible decompression bomb)")
            free = _free_bytes(out_path.parent)
            if free is not None and want_size > free:
                raise BundleError(path, f"declared database size {want_size} bytes exceeds "
                                        f"free space in {out_path.parent}")
            f.seek(frame_start)
            magic = f.read(4)
            if len(magic) < 4:
                raise BundleError(path, "truncated: no database frame after the manifest")
            if struct.unpack("<I", magic)[0] != ZSTD_MAGIC:
                raise BundleError(path, "no zstd frame after the manifest")
            f.seek(frame_start)
            try:
                fcs = zstandard.frame_content_size(f.read(18))
            except zstandard.ZstdError:
                fcs = None  # reported precisely by frame_header_size below
            if fcs is not None and fcs >= 0 and fcs != want_size:
                raise BundleError(path, f"manifest says {want_size} bytes but the zstd frame "
                                        f"declares {fcs}")
            end = _frame_end(path, f, frame_start, file_size)
            if end != file_size:
                raise BundleError(path, f"{file_size - end} unexpected bytes after the "
                                        "database frame")
            f.seek(frame_start)
            _stream_out(path, f, out_path, want_size, manifest["database"]["sha256"])
    except OSError as e:
        raise BundleError(path, f"cannot read: {e.strerror or e}") from None
    return manifest


def _stream_out(path, f, out_path, want_size: int, want_sha: str) -> None:
    h = hashlib.sha256()
    got = 0
    head = b""
    dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
    try:
        with dctx.stream_reader(f, read_size=_CHUNK, read_across_frames=False) as r, \
                open(out_path, "wb") as out:
            while True:
                chunk = r.read(_CHUNK)
                if not chunk:
                    break
                if got < len(SQLITE_MAGIC):
                    # the image must be SQLite from its first bytes: a bomb of anything
                    # else stops here, not after writing gigabytes
                    head = (head + chunk)[:len(SQLITE_MAGIC)]
                    if len(head) == len(SQLITE_MAGIC) and head != SQLITE_MAGIC:
                        raise BundleError(path, "database image is not SQLite")
                got += len(chunk)
                if got > want_size:
                    raise BundleError(path, "database frame is larger than declared")
                h.update(chunk)
                out.write(chunk)
    except zstandard.ZstdError as e:
        raise BundleError(path, f"corrupt compressed database ({e})") from None
    if got != want_size:
        raise BundleError(path, f"truncated: database is {got} bytes, manifest says {want_size}")
    if h.hexdigest() != want_sha:
        raise BundleError(path, "database sha256 does not match the manifest")


def _free_bytes(directory) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
