"""The capture's spool directory is attack surface (issue 20): a symlinked lock file is
never followed (the capture, often root, would write its pid into the target) and a
spool directory that other users may write is refused; the first segment is index 0
(docs/bundle-format.md)."""

import os

import pytest

from ingero_forensics.capture.segments import lock_directory, next_index
from ingero_forensics.errors import IngeroError


def test_a_symlinked_lock_is_not_followed(tmp_path):
    spool = tmp_path / ".spool"
    spool.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_text("precious\n")
    (spool / "lock").symlink_to(target)
    with pytest.raises(IngeroError, match="lock: cannot open the lock file: .*a symlink"):
        lock_directory(spool)
    assert target.read_text() == "precious\n"


def test_a_spool_writable_by_others_is_refused(tmp_path):
    spool = tmp_path / ".spool"
    spool.mkdir()
    os.chmod(spool, 0o777)
    with pytest.raises(IngeroError, match=r"writable by other users \(mode 777\); chmod go-w"):
        lock_directory(spool)
    assert not (spool / "lock").exists()


def test_a_symlinked_spool_is_refused(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / ".spool").symlink_to(real)
    with pytest.raises(IngeroError, match="not a directory"):
        lock_directory(tmp_path / ".spool")


def test_a_private_spool_locks(tmp_path):
    spool = tmp_path / ".spool"
    spool.mkdir(mode=0o700)
    fd = lock_directory(spool)
    try:
        assert (spool / "lock").read_text() == f"{os.getpid()}\n"
    finally:
        os.close(fd)


def test_the_first_segment_is_index_0(tmp_path):
    spool = tmp_path / ".spool"
    spool.mkdir()
    assert next_index(tmp_path, spool, "n1") == 0
    (spool / "segment-0.db").write_bytes(b"")
    assert next_index(tmp_path, spool, "n1") == 1
