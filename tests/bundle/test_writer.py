"""BundleWriter and seal_spool: crash safety, atomic sealing, refusals."""

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from ingero_forensics.bundle import BundleWriter, container, open_bundle, read_manifest, seal_spool
from ingero_forensics.errors import DiskFullError, IngeroError

from .conftest import END, HOST, START, T0, split_bundle, table_rows, write_sample_bundle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from ingero_forensics.bundle import BundleWriter
    host = {host!r}
    w = BundleWriter(sys.argv[1], node="crash-node", host=host, capture_start={start!r},
                     batch_rows={batch})
    def row(i):
        return ({t0} + i * 1000, 5000 + i, "ALL_REDUCE", 0, 8, "00000000000000aa", i + 1,
                1024, "float32", "sum", None, 7, 4096, 0, 0, 100, 101, None)
    mode = sys.argv[2]
    i = 0
    if mode == "fixed":
        for _ in range({batch} * 5 + 200):   # 5 committed batches, then 200 open rows
            w.add("nccl_events", row(i)); i += 1
        print("READY", w.rows["nccl_events"], flush=True)
        time.sleep(60)
    else:
        while True:
            w.add("nccl_events", row(i)); i += 1
            if i % {batch} == 0:
                print("COMMITTED", w.rows["nccl_events"], flush=True)
""")


#: the optional columns nccl_events gained in 1.1 (comm_handle, handle_seq): the child
#: writes 1.0 rows, which read back with them NULL
_OPTIONAL_NCCL = (None, None)


def _child_row(i):
    return (T0 + i * 1000, 5000 + i, "ALL_REDUCE", 0, 8, "00000000000000aa", i + 1, 1024,
            "float32", "sum", None, 7, 4096, 0, 0, 100, 101, None)


def _run_and_kill(tmp_path, mode, batch, wait_lines):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=ROOT, host=HOST, start=START, batch=batch, t0=T0))
    spool = tmp_path / "spool.db"
    proc = subprocess.Popen([sys.executable, str(script), str(spool), mode],
                            stdout=subprocess.PIPE, text=True)
    last = None
    try:
        for _ in range(wait_lines):
            last = proc.stdout.readline().split()
            assert last, "child ended early"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return spool, last


def test_sigkill_loses_only_the_open_batch(tmp_path):
    batch = 500
    spool, last = _run_and_kill(tmp_path, "fixed", batch, 1)
    assert last == ["READY", str(5 * batch)]
    assert os.path.exists(f"{spool}-wal")  # committed rows are still only in the WAL
    out = tmp_path / "out"
    out.mkdir()
    path = seal_spool(spool, out)
    m = read_manifest(path)
    assert m["tables"]["nccl_events"] == 5 * batch
    assert m["segment"]["recovered"] is True
    # the capture end is the newest committed row
    assert m["capture"]["end_mono_ns"] == T0 + (5 * batch - 1) * 1000
    with open_bundle(path, integrity="full") as b:
        assert table_rows(b.con, "nccl_events") == [_child_row(i) + _OPTIONAL_NCCL for i in range(5 * batch)]
    assert not spool.exists() and not os.path.exists(f"{spool}-wal")


def test_sigkill_mid_stream_keeps_a_whole_batch_prefix(tmp_path):
    batch = 2000
    spool, last = _run_and_kill(tmp_path, "stream", batch, 3)
    committed = int(last[1])
    out = tmp_path / "out"
    out.mkdir()
    path = seal_spool(spool, out)
    n = read_manifest(path)["tables"]["nccl_events"]
    # everything reported committed survived, and only whole batches are there
    assert n >= committed and n % batch == 0
    with open_bundle(path) as b:
        assert table_rows(b.con, "nccl_events") == [_child_row(i) + _OPTIONAL_NCCL for i in range(n)]


def test_seal_is_atomic_when_it_fails(tmp_path, monkeypatch):
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    w.add("threads", (1, 1, "a", T0, T0))
    out = tmp_path / "out"
    out.mkdir()

    def broken_fsync(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(container.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        w.seal(out, capture_end=END)
    assert list(out.iterdir()) == []           # no partial bundle, no temporary file
    assert (tmp_path / "s.db").exists()        # the spool is kept for a retry
    monkeypatch.undo()
    path = seal_spool(tmp_path / "s.db", out)
    assert [p.name for p in out.iterdir()] == [path.name]
    with open_bundle(path) as b:
        assert table_rows(b.con, "threads") == [(1, 1, "a", T0, T0)]


def test_seal_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    """From a review: root's capture sealed into a directory another user could write
    to, through a symlink planted at the predictable temporary name, and overwrote that
    user's file. The name is now unpredictable, and a link there is never followed."""
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    w.add("threads", (1, 1, "a", T0, T0))
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious data")
    monkeypatch.setattr(container.secrets, "token_hex", lambda n: "ab" * n)
    final = out / container.bundle_filename("n1", START[0], 0)
    planted = out / f".{final.name}.{os.getpid()}.{'ab' * 6}.tmp"
    planted.symlink_to(victim)
    with pytest.raises(IngeroError, match="something is already there, at the sealing's "
                                          "temporary name"):
        w.seal(out, capture_end=END)
    assert victim.read_bytes() == b"precious data" and planted.is_symlink()
    assert (tmp_path / "s.db").exists()        # the spool is kept for a retry
    monkeypatch.undo()
    planted.unlink()
    path = seal_spool(tmp_path / "s.db", out)
    assert path.name == final.name and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and victim.read_bytes() == b"precious data"


def test_seal_interrupted_mid_compression_leaves_nothing(tmp_path, monkeypatch):
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    w.add_many("host_samples", [(T0 + i, "cpu.busy_pct", None, float(i)) for i in range(50000)])
    out = tmp_path / "out"
    out.mkdir()
    real = container.zstandard.ZstdCompressor

    class Interrupting:
        def __init__(self, **kw):
            self._c = real(**kw)

        def compressobj(self, **kw):
            inner = self._c.compressobj(**kw)
            calls = []

            class C:
                def compress(s, b):
                    calls.append(1)
                    if len(calls) == 2:
                        raise KeyboardInterrupt
                    return inner.compress(b)

                def flush(s, *a):
                    return inner.flush(*a)
            return C()
    monkeypatch.setattr(container.zstandard, "ZstdCompressor", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        w.seal(out, capture_end=END)
    assert list(out.iterdir()) == []


def test_existing_bundle_is_never_replaced(tmp_path):
    out = tmp_path / "out"
    first, _ = write_sample_bundle(out, spool_name="a.db")
    before = first.read_bytes()
    with pytest.raises(IngeroError) as ei:
        write_sample_bundle(out, spool_name="b.db")
    assert str(ei.value) == (f"{first}: a bundle with this name exists already; the spool "
                             f"{out / 'b.db'} is kept")
    assert first.read_bytes() == before
    assert (out / "b.db").exists()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_sealed_image_is_self_contained(sample_bundle):
    _, image = split_bundle(sample_bundle)
    assert image[18:20] == b"\x01\x01"   # rollback-journal mode: no WAL belongs to it
    assert [p.name for p in sample_bundle.parent.iterdir()] == [sample_bundle.name]


def test_bad_rows_are_dropped_counted_and_logged(tmp_path):
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    good = (1, 2, "a", T0, T0 + 1)
    w.add("threads", good)
    w.add("threads", (1, 3, "b", None, T0))        # NULL in a NOT NULL column
    w.add("threads", (1, 4))                       # wrong width
    w.add("threads", (1, 5, {"x": 1}, T0, T0))     # unbindable value
    w.add("host_samples", (T0, "load.avg1", None, 1.5))
    assert w.flush() == 3   # two good rows and the log row
    assert w.rejected["threads"] == 3 and w.rows["threads"] == 1
    path = w.seal(tmp_path, capture_end=END)
    with open_bundle(path) as b:
        assert table_rows(b.con, "threads") == [good]
        assert table_rows(b.con, "host_samples") == [(T0, "load.avg1", None, 1.5)]
        (level, event, msg, count), = b.con.execute(
            "SELECT level, event, message, count FROM capture_log").fetchall()
    assert (level, event, count) == ("error", "rejected_rows", 3)
    assert msg.startswith("3 threads row(s) refused by the database; first: "
                          "ConstraintError: NOT NULL constraint failed: threads.first_seen_ns")


def test_disk_full_keeps_the_batch_for_a_retry(tmp_path):
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    pages = w.con.execute("PRAGMA page_count").fetchone()[0]
    w.con.execute(f"PRAGMA max_page_count = {pages + 2}")
    rows = [(T0 + i, "mem.dirty_bytes", None, float(i)) for i in range(20000)]
    w.add_many("host_samples", rows)
    with pytest.raises(DiskFullError) as ei:
        w.flush()
    assert str(ei.value) == f"{tmp_path / 's.db'}: file system full"
    assert w.pending == 20000 and w.rows["host_samples"] == 0
    w.con.execute("PRAGMA max_page_count = 1000000")
    assert w.flush() == 20000
    path = w.seal(tmp_path, capture_end=END)
    assert read_manifest(path)["tables"]["host_samples"] == 20000


def test_an_io_error_on_the_spool_is_one_line(tmp_path, monkeypatch):
    """From a review: a failing disk (here SQLite's I/O error on the commit) ended the
    capture in a traceback; it is one line naming the spool, the batch kept."""
    import contextlib

    import apsw

    from ingero_forensics.bundle import writer as writer_mod
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    w.add_many("host_samples", [(T0 + i, "mem.dirty_bytes", None, float(i)) for i in range(10)])

    @contextlib.contextmanager
    def failing(con):
        raise apsw.IOError("disk I/O error")
        yield
    monkeypatch.setattr(writer_mod, "transaction", failing)
    with pytest.raises(IngeroError) as ei:
        w.flush()
    assert str(ei.value) == (f"{tmp_path / 's.db'}: cannot write (disk I/O error); "
                             "what was written stays in the spool, sealed at the next start")
    assert w.pending == 10
    monkeypatch.undo()
    assert w.flush() == 10


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="invalid node name 'a b'"):
        BundleWriter(tmp_path / "x.db", node="a b", host=HOST)
    with pytest.raises(ValueError, match=r"host\['boot_id'\] must be a non-empty string"):
        BundleWriter(tmp_path / "x.db", node="n", host={"hostname": "h", "kernel_release": "k"})
    with pytest.raises(ValueError, match="extra_meta may not set node"):
        BundleWriter(tmp_path / "x.db", node="n", host=HOST, extra_meta={"node": "m"})
    with pytest.raises(ValueError, match=r"extra_meta\['job_ids'\] must be a list of strings"):
        BundleWriter(tmp_path / "x.db", node="n", host=HOST, extra_meta={"job_ids": "j1"})
    assert not (tmp_path / "x.db").exists()
    w = BundleWriter(tmp_path / "x.db", node="n", host=HOST)
    with pytest.raises(ValueError, match="no bundle table named 'nccl'"):
        w.add("nccl", ())
    with pytest.raises(ValueError, match="no bundle table named 'meta'"):
        w.add_many("meta", [("k", "v")])
    with pytest.raises(IngeroError, match="live segment already exists"):
        BundleWriter(tmp_path / "x.db", node="n", host=HOST)
    w.abort()


def test_seal_spool_refusals(tmp_path):
    with pytest.raises(IngeroError) as ei:
        seal_spool(tmp_path / "missing.db", tmp_path)
    assert str(ei.value) == f"{tmp_path / 'missing.db'}: no live segment to seal"
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"junk" * 1000)
    with pytest.raises(IngeroError) as ei:
        seal_spool(junk, tmp_path)
    assert str(ei.value) == f"{junk}: not a live bundle segment (file is not a database)"
    assert junk.read_bytes() == b"junk" * 1000
    assert not list(tmp_path.glob("*.bundle"))


def test_abort_then_recover(tmp_path):
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    w.log("warning", "tcp", "source_off", "tracepoint missing", timestamp_ns=T0 + 77)
    w.abort()
    path = seal_spool(tmp_path / "s.db", tmp_path)
    m = read_manifest(path)
    assert m["segment"]["recovered"] is True
    assert m["capture"]["end_mono_ns"] == T0 + 77
    assert m["tables"]["capture_log"] == 1


def test_size_grows_with_rows(tmp_path):
    w = BundleWriter(tmp_path / "s.db", node="n1", host=HOST, capture_start=START)
    before = w.size_bytes()
    w.add_many("host_samples", [(T0 + i, "cpu.busy_pct", "cpu0", 1.0) for i in range(10000)])
    w.flush()
    assert w.size_bytes() > before + 100_000
    w.abort()
    assert read_manifest(seal_spool(tmp_path / "s.db", tmp_path))["node"] == "n1"


def test_version_1_0_layouts_stay_readable(tmp_path):
    """A writer of the 1.0 layout (rows without the optional columns added in 1.1, or a
    database without those columns at all) makes bundles that open and merge, the
    missing columns read as NULL."""
    import apsw
    from ingero_forensics.bundle.writer import transaction
    from ingero_forensics.db import connect_writable
    from ingero_forensics.merge import merge_bundles
    w = BundleWriter(tmp_path / "a.spool", node="n0", host=HOST, capture_start=START)
    w.add("cuda_events", (T0, 1000, "cudaStreamSynchronize", "runtime", 7, None, None, None,
                          0, 0, 10, 10, None))                       # 13 values: 1.0
    w.add("cuda_events", (T0 + 5, 1000, "cudaStreamSynchronize", "runtime", 7, None, None,
                          None, 0, 0, 10, 10, None, 0, None))        # 15 values: 1.1
    (tmp_path / "out").mkdir()
    (tmp_path / "out2").mkdir()
    first = w.seal(tmp_path / "out", capture_end=END)
    with open_bundle(first) as b:
        assert b.absent == {}
        assert b.con.execute("SELECT queued_ops FROM cuda_events ORDER BY id").fetchall() == \
            [(None,), (0,)]
    # a database that predates the columns entirely
    spool = tmp_path / "old.db"
    with open_bundle(first) as b:
        spool.write_bytes(b.db_path.read_bytes())
    con = connect_writable(spool, wal=False)
    with transaction(con):
        con.execute("ALTER TABLE cuda_events DROP COLUMN queue_gap_ns")
        con.execute("ALTER TABLE cuda_events DROP COLUMN queued_ops")
        con.execute("UPDATE meta SET value = json_set(value, '$.id', 'feedfacefeedfacefeedfacefeedface') "
                    "WHERE key = 'segment'")
    con.close()
    old = seal_spool(spool, tmp_path / "out2")
    with open_bundle(old) as b:
        assert b.absent == {"cuda_events": frozenset({"queued_ops", "queue_gap_ns"})}
    merge_bundles([old], tmp_path / "f.db")
    con = apsw.Connection(str(tmp_path / "f.db"))
    assert con.execute("SELECT COUNT(*), COUNT(queued_ops) FROM cuda_events").fetchone() == (2, 0)
    con.close()


def test_an_io_error_is_a_full_disk_only_where_it_was_one(tmp_path):
    """SQLite reports some writes into a full file system as an I/O error. The errno it
    saw decides where the connection kept one; free space only where it did not."""
    import errno

    import apsw

    from ingero_forensics.bundle.writer import write_error
    from ingero_forensics.errors import DiskFullError

    class Seen:
        def __init__(self, e):
            self.system_errno = e
    err = apsw.IOError("disk I/O error")
    path = tmp_path / "s.db"
    assert isinstance(write_error(path, err, con=Seen(errno.ENOSPC)), DiskFullError)
    eio = write_error(path, err, "; kept", con=Seen(errno.EIO))
    assert type(eio) is IngeroError and str(eio) == \
        f"{path}: cannot write (disk I/O error: {os.strerror(errno.EIO)}); kept"
    # no errno kept: this file system has room, so it is no full disk
    plain = write_error(path, err, con=Seen(0))
    assert type(plain) is IngeroError and str(plain) == f"{path}: cannot write (disk I/O error)"
