"""ingero-redact against what a new user types: an -o that is the input (however spelt),
a damaged fleet.db."""

import os
import shutil

import pytest
from click.testing import CliRunner

from ingero_forensics.cliutil import EXIT_USAGE
from ingero_forensics.redact import redact_fleet
from ingero_forensics.redact.cli import main
from ingero_forensics.redact.core import RedactError

from ..damage import corrupt, sha


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])



@pytest.fixture
def copy(sensitive_fleet, tmp_path):
    dest = tmp_path / "fleet.db"
    shutil.copyfile(sensitive_fleet, dest)
    return dest



def test_output_that_is_the_input_is_a_usage_error(copy, tmp_path):
    before = sha(copy)
    (tmp_path / "link.db").symlink_to(copy)
    os.link(copy, tmp_path / "hard.db")
    for out in (copy, tmp_path / "link.db", tmp_path / "hard.db"):
        r = run(copy, "-o", out)
        assert r.exit_code == 2, r.output
        assert r.stderr == f"Error: {out}: the output would replace the input; choose another -o\n"
        assert sha(copy) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db", "hard.db", "link.db"]
    # the library says so too, with an error the CLIs map to exit 2
    with pytest.raises(RedactError) as e:
        redact_fleet(copy, tmp_path / "hard.db")
    assert e.value.exit_code == EXIT_USAGE


def test_damaged_fleet_db_is_one_line_and_leaves_nothing(copy, tmp_path):
    corrupt(copy)
    out = tmp_path / "red.db"
    r = run(copy, "-o", out)
    assert r.exit_code == 1, r.output
    assert r.stderr == f"Error: {copy}: cannot read fleet.db (database disk image is malformed)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db"]   # no output, no copy
    # a previous output stays as it was
    out.write_text("previous")
    assert run(copy, "-o", out).exit_code == 1 and out.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db", "red.db"]
