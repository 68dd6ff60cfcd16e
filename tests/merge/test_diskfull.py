"""A full disk on the output side: one clear error, nothing left behind (real tmpfs)."""

import pytest
from click.testing import CliRunner

from ingero_forensics.merge.cli import main

from .fleetgen import make_fleet


@pytest.fixture
def tiny_fs(tmpfs):
    return tmpfs("1m")


def test_full_disk_is_one_error_line_and_leaves_nothing(tmp_path, tiny_fs):
    fleet = make_fleet(tmp_path / "b", nodes=3, seconds=6, seed=8)
    work = tmp_path / "work"
    work.mkdir()
    out = tiny_fs / "fleet.db"
    r = CliRunner().invoke(main, [*map(str, fleet.paths), "-o", str(out),
                                  "--tmpdir", str(work)])
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    lines = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and "disk is full" in lines[0] and str(out) in lines[0]
    assert list(tiny_fs.iterdir()) == []          # no fleet.db, temp or scratch files
    assert list(work.iterdir()) == []             # decompressed images removed too
