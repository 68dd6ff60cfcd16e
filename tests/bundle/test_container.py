"""Bad input at the container level: each case is refused with its exact reason."""

import hashlib
import json
import os
import sqlite3
import struct

import pytest
import zstandard

from ingero_forensics.bundle import open_bundle, read_manifest
from ingero_forensics.bundle import container
from ingero_forensics.bundle.container import MANIFEST_FIELDS, check_manifest
from ingero_forensics.errors import BundleError

from .conftest import pack, reason_of, split_bundle


def _write(tmp_path, data: bytes, name="x.bundle"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _header_len(path) -> int:
    return 8 + struct.unpack("<I", path.read_bytes()[4:8])[0]


def test_missing_file(tmp_path):
    assert reason_of(tmp_path / "nope.bundle") == "cannot read: No such file or directory"


def test_empty_and_short_files(tmp_path):
    for data in (b"", b"\x5e\x2a\x4d"):
        assert reason_of(_write(tmp_path, data)) == \
            "truncated: file is shorter than a bundle header"


def test_wrong_magic(tmp_path):
    p = _write(tmp_path, b"PK\x03\x04" + bytes(100))
    assert reason_of(p) == "not an ingero bundle (wrong magic bytes)"


def test_plain_sqlite_file(tmp_path):
    db = tmp_path / "plain.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    assert reason_of(db) == "plain SQLite database, not a bundle (no manifest frame)"


def test_plain_zstd_file(tmp_path, sample_bundle):
    _, image = split_bundle(sample_bundle)
    p = _write(tmp_path, zstandard.ZstdCompressor().compress(image), "db.zst")
    assert reason_of(p) == "plain zstd file, not a bundle (no manifest frame)"


def test_other_skippable_frame(tmp_path):
    # a skippable frame with another magic number is not ours
    p = _write(tmp_path, struct.pack("<II", 0x184D2A50, 2) + b"{}")
    assert reason_of(p) == "not an ingero bundle (wrong magic bytes)"


@pytest.mark.parametrize("n", [0, 1, (1 << 20) + 1, 0xFFFFFFFF])
def test_manifest_length_out_of_range(tmp_path, n):
    p = _write(tmp_path, struct.pack("<II", container.SKIPPABLE_MAGIC, n) + b"{}" * 8)
    assert reason_of(p) == f"manifest length {n} out of range"


def test_manifest_not_json(tmp_path):
    for raw in (b"{not json", b"\xff\xfe{}", b'{"a": NaN}'):
        p = _write(tmp_path, struct.pack("<II", container.SKIPPABLE_MAGIC, len(raw)) + raw)
        assert reason_of(p) == "manifest is not valid UTF-8 JSON"


def test_manifest_duplicate_key(tmp_path, sample_bundle):
    data = sample_bundle.read_bytes()
    n = struct.unpack("<I", data[4:8])[0]
    raw = data[8:8 + n].replace(b'"node":', b'"node":"evil","node":', 1)
    p = _write(tmp_path, struct.pack("<II", container.SKIPPABLE_MAGIC, len(raw)) + raw
               + data[8 + n:])
    assert reason_of(p) == "manifest has duplicate key 'node'"


def test_manifest_not_an_object(tmp_path):
    p = _write(tmp_path, struct.pack("<II", container.SKIPPABLE_MAGIC, 2) + b"[]")
    assert reason_of(p) == "manifest is not a JSON object"


def test_newer_format_version(tmp_path, sample_bundle):
    m, image = split_bundle(sample_bundle)
    # a future version may change everything else: only the version is looked at
    p = _write(tmp_path, pack({"magic": m["magic"], "format_version": 2,
                               "database": m["database"]}, image))
    assert reason_of(p) == ("bundle format version 2 is newer than this tool supports (1); "
                            "upgrade ingero-forensics")
    with pytest.raises(BundleError):
        read_manifest(p)


def _manifest(sample_bundle):
    return split_bundle(sample_bundle)[0]


def _drop(m, dotted):
    *parents, last = dotted.split(".")
    for k in parents:
        m = m[k]
    del m[last]


def test_required_manifest_fields_are_enforced(sample_bundle):
    base = _manifest(sample_bundle)
    for name, _typ, required, _doc in MANIFEST_FIELDS:
        m = json.loads(json.dumps(base))
        if name not in set(_paths(m)):
            assert not required, name
            continue  # an optional field the writer did not set (job_ids)
        _drop(m, name)
        if required:
            with pytest.raises(BundleError, match=r"manifest field|not an ingero|format"):
                check_manifest("x", m)
        else:
            assert check_manifest("x", m) is m


def _paths(m, prefix=""):
    for k, v in m.items():
        yield prefix + k
        if isinstance(v, dict):
            yield from _paths(v, prefix + k + ".")


def test_every_catalogued_field_is_written(sample_bundle):
    written = set(_paths(_manifest(sample_bundle)))
    catalogued = {name for name, *_ in MANIFEST_FIELDS}
    # tables.<t> are covered by the "tables" row
    assert written - catalogued == {p for p in written if p.startswith("tables.")}
    assert catalogued - written == {"job_ids"}  # optional, needs extra_meta


@pytest.mark.parametrize("edit, reason", [
    (lambda m: m.update(magic="something-else"), "not an ingero bundle (manifest magic missing)"),
    (lambda m: m.update(format_version="1"), "invalid format_version '1'"),
    (lambda m: m.update(format_version=True), "invalid format_version True"),
    (lambda m: m.update(format_version=0), "invalid format_version 0"),
    (lambda m: m.update(node="bad/name"), "manifest: invalid node name 'bad/name': use 1-63 "
                                          "characters of A-Z a-z 0-9 . _ -, not starting with - or ."),
    (lambda m: m["host"].update(boot_id=""),
     "manifest field host.boot_id missing or not a non-empty string"),
    (lambda m: m["capture"].update(end_mono_ns=1.5),
     "manifest field capture.end_mono_ns missing or not an integer"),
    (lambda m: m["capture"].update(end_mono_ns=m["capture"]["start_mono_ns"] - 1),
     "manifest capture window ends before it starts"),
    (lambda m: m["segment"].update(index=-1), "manifest field segment.index missing, negative or not a 64-bit integer"),
    (lambda m: m["database"].update(size=100), "manifest field database.size missing or too small"),
    (lambda m: m["database"].update(sha256="ABC"),
     "manifest field database.sha256 missing or not 64 hex digits"),
    (lambda m: m["database"].update(compression="xz"),
     'manifest field database.compression missing or not "zstd"'),
    (lambda m: m["tables"].update(stacks=-1), "manifest field tables.stacks missing or not a count"),
    (lambda m: m.update(job_ids="tr-1"), "manifest field job_ids is not a list of strings"),
    # optional fields, when present, have their documented types: the merge stores
    # segment.recovered as a flag, and "no" would read as true
    (lambda m: m["segment"].update(recovered="no"),
     "manifest field segment.recovered is not a boolean"),
    (lambda m: m["segment"].update(recovered=1),
     "manifest field segment.recovered is not a boolean"),
    (lambda m: m["segment"].update(sealed_utc="yesterday"),
     "manifest field segment.sealed_utc is not YYYY-MM-DDTHH:MM:SSZ"),
    (lambda m: m.update(created_by=42), "manifest field created_by is not a string"),
    (lambda m: m["host"].update(machine=64), "manifest field host.machine is not a string"),
])
def test_bad_manifest_values(tmp_path, sample_bundle, edit, reason):
    m, image = split_bundle(sample_bundle)
    edit(m)
    p = _write(tmp_path, pack(m, image, fix=False))
    assert reason_of(p) == reason


def test_unknown_manifest_keys_are_ignored(sample_bundle):
    m = _manifest(sample_bundle)
    m["future_key"] = {"anything": [1, 2]}
    m["host"]["gpu_model"] = "H100"
    m["tables"]["future_table"] = 5
    assert check_manifest("x", m) is m


# ------------------------------------------------------------------- frame and sizes

def test_lying_size(tmp_path, sample_bundle):
    m, image = split_bundle(sample_bundle)
    m["database"]["size"] += 4096
    p = _write(tmp_path, pack(m, image, fix=False))
    assert reason_of(p) == (f"manifest says {len(image) + 4096} bytes but the zstd frame "
                            f"declares {len(image)}")


def test_lying_hash(tmp_path, sample_bundle):
    m, image = split_bundle(sample_bundle)
    m["database"]["sha256"] = hashlib.sha256(b"other").hexdigest()
    p = _write(tmp_path, pack(m, image, fix=False))
    assert reason_of(p) == "database sha256 does not match the manifest"


def test_huge_declared_size_is_refused_before_decompressing(tmp_path, sample_bundle,
                                                           monkeypatch):
    m, image = split_bundle(sample_bundle)
    m["database"]["size"] = 1 << 50
    p = _write(tmp_path, pack(m, image, fix=False))

    def no_decompressor(*a, **k):
        raise AssertionError("decompression started")
    monkeypatch.setattr(container.zstandard, "ZstdDecompressor", no_decompressor)
    tmpdir = tmp_path / "t"
    tmpdir.mkdir()
    assert reason_of(p, tmpdir=tmpdir) == (f"declared database size {1 << 50} bytes exceeds the "
                                           f"limit of {64 << 30} (possible decompression bomb)")
    assert list(tmpdir.iterdir()) == []


def test_bomb_limit_from_environment(tmp_path, monkeypatch):
    # a real bomb: 256 MiB of zeros compress to a few KiB; the limit stops it unread
    image = bytes(256 << 20)
    m = {"magic": "ingero-forensics-bundle", "format_version": 1, "node": "n",
         "host": {k: "x" for k in ("hostname", "boot_id", "kernel_release", "tool_version")},
         "segment": {"index": 0, "id": "s"},
         "capture": {"start_utc_ns": 0, "end_utc_ns": 0, "start_mono_ns": 0, "end_mono_ns": 0},
         "tables": {}, "database": {"compression": "zstd"}}
    from ingero_forensics.bundle.schema import MANIFEST_TABLES
    m["tables"] = {t: 0 for t in MANIFEST_TABLES}
    data = pack(m, image)
    assert len(data) < 64 << 10
    p = _write(tmp_path, data)
    monkeypatch.setenv("INGERO_MAX_DB_BYTES", str(16 << 20))
    assert reason_of(p) == (f"declared database size {256 << 20} bytes exceeds the limit of "
                            f"{16 << 20} (possible decompression bomb)")
    assert reason_of(p, limit=1 << 20).endswith("exceeds the limit of 1048576 (possible "
                                                 "decompression bomb)")


def test_frame_without_checksum(tmp_path, sample_bundle):
    m, image = split_bundle(sample_bundle)
    p = _write(tmp_path, pack(m, image, write_checksum=False))
    assert reason_of(p) == "zstd frame has no content checksum"


def test_frame_without_content_size(tmp_path, sample_bundle):
    m, image = split_bundle(sample_bundle)
    p = _write(tmp_path, pack(m, image, write_content_size=False))
    assert reason_of(p) == "zstd frame does not declare its content size"


def test_frame_with_dictionary(tmp_path, sample_bundle):
    m, image = split_bundle(sample_bundle)
    samples = [f"event {i} ALL_REDUCE rank {i % 8} bytes {i * 4096} ".encode() * 3
               for i in range(2000)]
    d = zstandard.train_dictionary(4096, samples)
    frame = zstandard.ZstdCompressor(dict_data=d, write_checksum=True).compress(image)
    assert zstandard.get_frame_parameters(frame).dict_id == d.dict_id() != 0
    raw = json.dumps(m).encode()
    p = _write(tmp_path, struct.pack("<II", container.SKIPPABLE_MAGIC, len(raw)) + raw + frame)
    assert reason_of(p) == "zstd frame needs a dictionary (not allowed in a bundle)"


def test_no_frame_after_manifest(tmp_path, sample_bundle):
    data = sample_bundle.read_bytes()
    h = _header_len(sample_bundle)
    assert reason_of(_write(tmp_path, data[:h] + b"SQLite format 3\x00" + bytes(600))) == \
        "no zstd frame after the manifest"


def test_trailing_bytes(tmp_path, sample_bundle):
    data = sample_bundle.read_bytes()
    assert reason_of(_write(tmp_path, data + b"\x00" * 7)) == \
        "7 unexpected bytes after the database frame"
    # a second, valid frame is trailing data too
    extra = zstandard.ZstdCompressor(write_checksum=True).compress(b"more")
    assert reason_of(_write(tmp_path, data + extra)) == \
        f"{len(extra)} unexpected bytes after the database frame"


def test_truncation_at_every_offset(tmp_path, sample_bundle):
    data = sample_bundle.read_bytes()
    h = _header_len(sample_bundle)
    seen = {}
    for n in range(len(data)):
        p = _write(tmp_path, data[:n])
        with pytest.raises(BundleError) as ei:
            container.decompress_db(p, tmp_path / "out.db")
        r = ei.value.reason
        assert "truncated" in r, (n, r)
        region = ("header" if n < 8 else "manifest" if n < h else "frame header"
                  if n < h + 6 else "checksum" if n > len(data) - 4 else "blocks")
        seen.setdefault(region, set()).add(r)
    assert seen["header"] == {"truncated: file is shorter than a bundle header"}
    assert seen["manifest"] == {"truncated inside the manifest"}
    assert seen["checksum"] == {"truncated inside the zstd content checksum"}
    assert "truncated inside the compressed database" in seen["blocks"]
    assert seen["frame header"] <= {"truncated: no database frame after the manifest",
                                    "truncated inside the zstd frame header"}


def test_zstd_checksum_is_verified(tmp_path, sample_bundle):
    """Corrupt the checksum alone: the content and the sha256 still match, so only
    zstd's own XXH64 check can catch it."""
    data = bytearray(sample_bundle.read_bytes())
    data[-1] ^= 0x01
    p = _write(tmp_path, bytes(data))
    assert reason_of(p) == ("corrupt compressed database (zstd decompress error: Restored "
                            "data doesn't match checksum)")


def test_flipped_content_is_caught_by_zstd_before_sha(tmp_path, sample_bundle, monkeypatch):
    """A byte flipped inside a compressed block is detected by zstd's decoder or content
    checksum; the sha256 comparison is never reached."""
    data = bytearray(sample_bundle.read_bytes())
    h = _header_len(sample_bundle)
    data[h + (len(data) - h) // 2] ^= 0x20
    p = _write(tmp_path, bytes(data))
    digests = []
    real = container.hashlib.sha256

    class Spy:
        def __init__(self, *a):
            self._h = real(*a)

        def update(self, b):
            self._h.update(b)

        def hexdigest(self):
            digests.append(True)
            return self._h.hexdigest()
    monkeypatch.setattr(container.hashlib, "sha256", Spy)
    r = reason_of(p)
    assert r.startswith("corrupt compressed database (zstd decompress error:"), r
    assert digests == []


def test_flipped_raw_block_byte_is_caught_by_checksum(tmp_path, sample_bundle):
    """Incompressible content is stored in raw blocks: a flipped byte there decodes
    cleanly to wrong content, and only the XXH64 content checksum refuses it (before the
    sha256, which would too)."""
    m, _ = split_bundle(sample_bundle)
    image = b"SQLite format 3\x00" + os.urandom(65536)
    data = bytearray(pack(m, image))
    data[-1000] ^= 0x01
    assert reason_of(_write(tmp_path, bytes(data))) == (
        "corrupt compressed database (zstd decompress error: Restored data doesn't match "
        "checksum)")


def test_every_flipped_bit_is_refused(tmp_path, sample_bundle):
    """Flip one bit at every offset of a whole bundle. Every flip in the header and the
    manifest is refused (the manifest is mirrored in the checksummed database). In the
    compressed data a flip is refused unless it lands on a bit the decoder ignores, in
    which case the image decodes identical to the original, bit for bit."""
    data = sample_bundle.read_bytes()
    h = _header_len(sample_bundle)
    _, original = split_bundle(sample_bundle)
    accepted = []
    p = tmp_path / "f.bundle"
    for i in range(len(data)):
        out = bytearray(data)
        out[i] ^= 0x04
        p.write_bytes(bytes(out))
        try:
            b = open_bundle(p, tmpdir=tmp_path)
        except BundleError:
            continue
        accepted.append(i)
        assert b.db_path.read_bytes() == original
        b.close()
    assert all(i >= h for i in accepted), accepted
    assert len(accepted) < len(data) // 100
    assert not [i for i in accepted if i >= len(data) - 4]  # checksum bytes


def test_read_manifest_does_not_decompress(tmp_path, sample_bundle):
    data = sample_bundle.read_bytes()
    h = _header_len(sample_bundle)
    p = _write(tmp_path, data[:h] + b"garbage")  # frame gone: manifest still readable
    assert read_manifest(p)["node"] == "gpu-node-07"
