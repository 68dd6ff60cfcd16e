"""The console scripts' entry points. Each loads its command's modules only when run,
inside the same Ctrl-C handling as the command itself: an interrupt while Python is
still importing (a second or so for the report and export) ends with one line and exit
130, like one during the work, never with a traceback (cliutil.EXIT_INTERRUPTED; not
imported from there, which would load click first). Once the command has finished,
a Ctrl-C ends the process at once with the command's own exit code, and in the last
moments of the interpreter's shutdown it is ignored."""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys

#: entry point -> the module whose main() is the command
COMMANDS = {
    "capture": "ingero_forensics.capture.cli",
    "merge": "ingero_forensics.merge.cli",
    "export": "ingero_forensics.export.cli",
    "query": "ingero_forensics.export.query_cli",
    "report": "ingero_forensics.report.cli",
    "simulate": "ingero_forensics.simulate.cli",
    "redact": "ingero_forensics.redact.cli",
    "kit": "ingero_forensics.kit_cli",
}


def _run(name: str):
    try:
        main = importlib.import_module(COMMANDS[name]).main
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        sys.exit(130)
    code = 0
    try:
        return main()       # click's: exits with the command's code
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        raise
    except OSError as e:
        # what click writes itself (--help, --version) onto a full or closed standard
        # output; the commands' own output is handled by cliutil.handle_errors
        code = 1
        sys.stderr.write(f"Error: <stdout>: cannot write: {e.strerror or e}\n")
        sys.stdout = None       # nothing more goes there, not even at exit
        sys.exit(code)
    finally:
        # The command is over, its outputs written or refused and its code set: a
        # Ctrl-C from here to the process's end (a slow exit, say) ends it at once with
        # that code, never turning success into 130.
        signal.signal(signal.SIGINT, lambda signum, frame: _exit_now(code))
        # Python's shutdown puts SIGINT's default action back after the exit handlers:
        # a Ctrl-C then killed the process (a shell's 130) in 11 of 16 tries just after
        # an error line. Ignored from the last exit handler on (it is the first to run),
        # it changes nothing.
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:       # (closed, a broken pipe): nothing more to say
            pass
    os._exit(code)


def capture():
    return _run("capture")


def merge():
    return _run("merge")


def export():
    return _run("export")


def query():
    return _run("query")


def report():
    return _run("report")


def simulate():
    return _run("simulate")


def redact():
    return _run("redact")


def kit():
    return _run("kit")
