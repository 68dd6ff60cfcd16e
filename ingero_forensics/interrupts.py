"""Cleanup that a Ctrl-C does not cut short.

A Ctrl-C raises KeyboardInterrupt wherever the main thread is, including in the cleanup
that an earlier one started (a user who presses it twice; ``timeout -s INT``, which
signals the process and then its group): temporary files, and in ingero-redact's case
an unredacted working copy, would be left half removed. Cleanup runs with SIGINT held
instead (``run_held``), and the interrupt is passed on once it is done.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading


@contextlib.contextmanager
def interrupts_held():
    """Run the block with SIGINT held; a Ctrl-C meanwhile is passed on to the handler
    that was there before (KeyboardInterrupt for Python's default) when the block ends.
    Outside the main thread, where Python delivers no signal, it changes nothing."""
    caught = []
    before = None
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError):    # a sub-interpreter: not ours to set
            before = signal.getsignal(signal.SIGINT)
            if before is not None:      # None: set outside Python, it could not be restored
                signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    if before is None:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if caught:
            if before is signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
            elif callable(before):
                before(signal.SIGINT, None)     # KeyboardInterrupt, or a command's own


def run_held(cleanup, *, reraise: bool = True) -> None:
    """Run cleanup() to its end with SIGINT held, even when a Ctrl-C comes just before
    the hold is in place (it is then run again: cleanup must be idempotent, as closing
    and unlinking are). A Ctrl-C is passed on afterwards, unless reraise is False: the
    command's outputs are complete and only this cleanup was left."""
    interrupted = False
    done = False
    attempts = 0
    while not done and attempts < 5:    # (a KeyboardInterrupt of cleanup's own: not forever)
        attempts += 1
        try:
            with interrupts_held():
                cleanup()
                done = True
        except KeyboardInterrupt:       # held meanwhile, or just before the hold
            interrupted = True
    if interrupted and reraise:
        raise KeyboardInterrupt


_SWEEP: dict[tuple[str, str], None] = {}


def sweep_at_exit(directory, prefix: str) -> None:
    """Remove, when the process ends, the files of ``directory`` whose names start with
    ``prefix``, a prefix that holds this process's pid: its own temporaries. The last
    resort where cleanup never ran: a second Ctrl-C that lands in a ``finally`` before
    its run_held() holds SIGINT skips that cleanup, and helper threads still opening a
    bundle then keep their images (a CI run: two images and their run files left beside
    the output, Ctrl-C twice at once). The interpreter joins such threads before atexit
    handlers run."""
    if not _SWEEP:
        atexit.register(_sweep)
    _SWEEP[(os.fspath(directory), prefix)] = None


def _sweep() -> None:
    for directory, prefix in list(_SWEEP):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name.startswith(prefix):
                with contextlib.suppress(OSError):      # (a directory stays)
                    os.unlink(os.path.join(directory, name))


__all__ = ["interrupts_held", "run_held", "sweep_at_exit"]
