"""Ctrl-C: one line and exit 130, nothing left behind, even when it comes twice (a user
who presses it again; ``timeout -s INT``, which signals the process and then its group)
or while Python is still loading the command."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from ingero_forensics import entry
from ingero_forensics.interrupts import interrupts_held


def test_interrupts_held_raises_once_the_block_is_done():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)            # a handler would have raised by now
            done.append(True)
    assert done == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_held():             # nothing held: nothing raised
        pass


def test_sweep_at_exit_removes_the_process_temporaries_after_its_threads(tmp_path):
    """Where a second Ctrl-C skipped a cleanup, what this process left is removed when it
    ends: after its helper threads (one still writing an image), only the names with its
    prefix, never a directory or another's file."""
    script = f"""
import os, sys, threading, time
from ingero_forensics.interrupts import sweep_at_exit
d = {str(tmp_path)!r}
prefix = f"ingero-{{os.getpid()}}-"
sweep_at_exit(d, prefix)
open(os.path.join(d, prefix + "a.db"), "w").close()
open(os.path.join(d, prefix + "a.db.run0"), "w").close()
os.mkdir(os.path.join(d, prefix + "dir"))
def late():
    time.sleep(0.3)         # a helper that finishes its image after the main thread
    open(os.path.join(d, prefix + "late.db"), "w").close()
threading.Thread(target=late).start()
sys.exit(130)
"""
    (tmp_path / "ingero-1-other.db").write_text("")          # another process's
    (tmp_path / "fleet.db").write_text("")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert p.returncode == 130, p.stderr
    left = sorted(x.name for x in tmp_path.iterdir())
    assert [x for x in left if x.endswith(".db") or ".run" in x] == \
        ["fleet.db", "ingero-1-other.db"], left
    assert any(x.endswith("-dir") for x in left), left


def test_interrupts_held_passes_the_signal_to_the_handler_before():
    """A command's own SIGINT handler gets the held Ctrl-C (it is not dropped)."""
    from ingero_forensics.interrupts import run_held
    got = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert got == []
        assert got == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)
    # run_held: a Ctrl-C just before the hold (the cleanup is then run again), and one
    # during it; passed on at the end, or not when the outputs are complete
    for reraise in (True, False):
        runs = []

        def cleanup():
            runs.append(len(runs))
            if len(runs) == 1:
                raise KeyboardInterrupt         # as if it came before the hold
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        if reraise:
            with pytest.raises(KeyboardInterrupt):
                run_held(cleanup)
        else:
            run_held(cleanup, reraise=False)
        assert runs == [0, 1]


def test_entry_point_interrupted_while_importing(monkeypatch, capsys):
    def interrupted(name):
        raise KeyboardInterrupt
    monkeypatch.setattr(entry.importlib, "import_module", interrupted)
    with pytest.raises(SystemExit) as e:
        entry.merge()
    assert e.value.code == 130
    assert capsys.readouterr().err == "Interrupted.\n"


def test_entry_point_ignores_ctrl_c_once_the_command_is_over(monkeypatch):
    """A Ctrl-C after the report was written must not make it exit 130."""
    class Done:
        @staticmethod
        def main():
            raise SystemExit(0)
    monkeypatch.setattr(entry.importlib, "import_module", lambda name: Done)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as e:
            entry.report()
        assert e.value.code == 0
        handler = signal.getsignal(signal.SIGINT)
        assert handler not in (signal.SIG_IGN, signal.default_int_handler)
        exits = []
        monkeypatch.setattr(entry.os, "_exit", exits.append)
        handler(signal.SIGINT, None)
        assert exits == [0]     # the command's code, not 130
    finally:
        signal.signal(signal.SIGINT, before)


def test_ctrl_c_is_ignored_once_the_interpreter_shuts_down(tmp_path):
    """Python puts SIGINT's default action back late in its shutdown: a Ctrl-C there
    killed a finished command (a shell's 130 after an error line, exit 1 meant). The
    entry point ignores SIGINT from its exit handler on: a signal sent from an exit
    handler that runs after it (registered before the command ran) changes nothing,
    nor does one sent after Python's own clean-up, from a thread that outlives it."""
    prog = tmp_path / "prog.py"
    prog.write_text(
        "import atexit, os, signal, sys, threading, time\n"
        "from ingero_forensics import entry\n"
        "def late():\n"
        "    print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    def flood():\n"
        "        while True:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            time.sleep(0.0002)\n"
        "    threading.Thread(target=flood, daemon=True).start()\n"
        "    time.sleep(0.05)\n"
        "atexit.register(late)\n"
        "class Failed:\n"
        "    @staticmethod\n"
        "    def main():\n"
        "        sys.stderr.write('Error: x: it failed\\n')\n"
        "        raise SystemExit(1)\n"
        "entry.importlib.import_module = lambda name: Failed\n"
        "entry.merge()\n")
    codes = set()
    for _ in range(5):
        p = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                           timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert p.stdout == "True\n", (p.stdout, p.stderr)
        assert p.stderr == "Error: x: it failed\n", p.stderr
        codes.add(p.returncode)
    assert codes == {1}


def _interrupt(argv, ready, second_after) -> tuple[int, str]:
    """Run the console script argv[0] in a session of its own; once ready() holds, send
    SIGINT to its group as a terminal's Ctrl-C does, and a second one second_after
    seconds later (None: only one). Returns (exit code, stderr)."""
    exe = shutil.which(argv[0], path=os.path.dirname(sys.executable)) or argv[0]
    proc = subprocess.Popen([exe, *argv[1:]], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not ready():
        time.sleep(0.001)
    assert proc.poll() is None, f"{argv[0]} ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    if second_after is not None:
        time.sleep(second_after)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=120)[1].decode()
    return proc.returncode, err


@pytest.fixture(scope="module")
def big_fleet(tmp_path_factory):
    """Eight bundles whose opening takes long enough to be interrupted in pass 1."""
    from ingero_forensics.simulate import FleetConfig, simulate_fleet
    d = tmp_path_factory.mktemp("big") / "b"
    simulate_fleet(d, FleetConfig(nodes=8, ranks_per_node=8, steps=400, fault="cpu", seed=3))
    return d


@pytest.mark.parametrize("second_after", [None, 0.0, 0.01, 0.05])
def test_merge_interrupted_in_pass_1_leaves_nothing(big_fleet, tmp_path, second_after):
    """Ctrl-C (and a second one) once the helper threads are decompressing: exit 130,
    one line, no image, run file or scratch file left where the merge wrote them (a
    review found images left beside the output in 5 of 9 early interrupts)."""
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _interrupt(["ingero-merge", str(big_fleet), "-o", str(out / "fleet.db")],
                         lambda: any(p.name.startswith("ingero-") for p in out.iterdir()),
                         second_after)
    assert rc == 130 and err == "Interrupted.\n", (rc, err)
    assert sorted(p.name for p in out.iterdir()) == []


@pytest.fixture(scope="module")
def big_db(big_fleet, tmp_path_factory):
    from ingero_forensics.merge import merge_bundles
    out = tmp_path_factory.mktemp("bigdb") / "fleet.db"
    merge_bundles([big_fleet], out)
    return out


@pytest.mark.parametrize("second_after", [0.0])
def test_report_redact_interrupted_leaves_no_copy(big_db, tmp_path, second_after):
    """Ctrl-C while `ingero-report --redact` makes its redacted copy: exit 130, no report,
    and neither the unredacted working copy nor the redacted one left beside fleet.db
    (a review found their directories left behind)."""
    fleet = tmp_path / "fleet.db"
    shutil.copyfile(big_db, fleet)
    rc, err = _interrupt(["ingero-report", str(fleet), "--redact", "-o",
                          str(tmp_path / "r.html")],
                         lambda: any(p.name.startswith(".ingero-redact-work-")
                                     for p in tmp_path.iterdir()), second_after)
    assert rc == 130 and err == "Interrupted.\n", (rc, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db"]


def test_a_ctrl_c_in_the_redaction_cleanup_does_not_cut_it_short(big_db, tmp_path,
                                                                  monkeypatch):
    """A Ctrl-C that lands while the redacted copies are being removed (the second one
    of two, say): the removal finishes, then the interrupt is raised. Without that the
    directories stay beside fleet.db, the unredacted working copy in one of them."""
    from ingero_forensics.redact.core import redacted_input

    fleet = tmp_path / "fleet.db"
    shutil.copyfile(big_db, fleet)
    real = shutil.rmtree
    removed = []

    def rmtree_interrupted(path, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)     # as if Ctrl-C came now
        time.sleep(0.02)
        removed.append(os.path.basename(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_interrupted)
    with pytest.raises(KeyboardInterrupt):
        with redacted_input(fleet) as out:
            assert out.exists()
    monkeypatch.setattr(shutil, "rmtree", real)
    assert len(removed) == 2, removed        # the working copy's and the output's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.db"]
