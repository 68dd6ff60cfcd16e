"""docs/airgap.md is a tested runbook: every command in it is a line of
scripts/airgap-rehearsal.sh (run here end to end) or of a test, the unit file it shows is
the one shipped, and the rehearsal passes."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "airgap.md"
REHEARSAL = ROOT / "scripts" / "airgap-rehearsal.sh"
#: The site's own tools, which no test can run here; srun's command is checked instead.
SITE_TOOLS = ("apt", "dnf", "zypper", "systemctl", "torchrun")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^ *```{lang}\n(.*?)^ *```", DOC.read_text(), re.S | re.M)


def doc_commands() -> list[str]:
    """The runbook's shell lines, less a trailing comment and a trailing `|| true` (the
    command is the same; the doc says where its failure must not stop a prolog)."""
    out = []
    for block in blocks("sh"):
        for line in block.splitlines():
            line = re.sub(r"\s+#[^\"']*$", "", line.strip())
            line = re.sub(r"\s*\|\|\s*true$", "", line)
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _tested_text() -> str:
    parts = [REHEARSAL.read_text()]
    parts += [p.read_text() for p in (ROOT / "tests").rglob("*.py")]
    return "\n".join(parts)


def _inner_srun(line: str) -> str:
    words = shlex.split(line, posix=False)[1:]
    while words and words[0].startswith("-"):
        words.pop(0)
    return " ".join(words)


def test_every_command_of_the_runbook_is_tested():
    commands = doc_commands()
    assert len(commands) >= 25, commands
    text = _tested_text()
    untested = []
    for line in commands:
        first = line.split()[0]
        if first in SITE_TOOLS:
            continue
        if first == "srun":
            line = _inner_srun(line)
        if line not in text:
            untested.append(line)
    assert untested == [], "commands of docs/airgap.md in no tested script or test"


def test_the_check_can_fail():
    assert "ingero-capture --frob" + "nicate" not in _tested_text()   # built: not in this file
    assert _inner_srun('srun --ntasks-per-node=1 --overlap "$X" start "$Y"') == '"$X" start "$Y"'


def test_unit_file_in_the_doc_is_the_shipped_one():
    (ini,) = blocks("ini")
    assert ini == (ROOT / "scripts" / "ingero-capture.service").read_text()


@pytest.mark.slow
def test_rehearsal_runs_end_to_end(tmp_path):
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("needs the project's .venv (scripts/test.sh makes it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in (
        "PIP_CONFIG_FILE",)}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env['PATH']}"
    r = subprocess.run(["bash", str(REHEARSAL), str(tmp_path / "w")], capture_output=True,
                       text=True, env=env, timeout=540, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.rstrip().endswith("== rehearsal complete")
    ws = tmp_path / "w" / "workstation"
    for f in ("fleet.db", "trace.json.gz", "report.html", "fleet-redacted.db",
              "report-redacted.html", "trace-redacted.json.gz", "SHA256SUMS"):
        assert (ws / f).stat().st_size > 0, f
    assert "gpu-node-01" in (ws / "report.html").read_text()
    assert "gpu-node-01" not in (ws / "report-redacted.html").read_text()
