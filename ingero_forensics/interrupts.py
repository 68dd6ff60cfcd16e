"""Cleanup that a Ctrl-C does not cut short.

A Ctrl-C raises KeyboardInterrupt wherever the main thread is, including in the cleanup
that an earlier one started (a user who presses it twice; ``timeout -s INT``, which
signals the process and then its group): temporary files, and in ingero-redact's case
an unredacted working copy, would be left half removed. The cleanup runs with SIGINT
held instead, and the interrupt is raised once it is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_held():
    """Run the block with SIGINT held; a Ctrl-C meanwhile raises KeyboardInterrupt when
    the block ends (when SIGINT was handled that way before). Outside the main thread,
    where Python delivers no signal, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    try:
        before = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except ValueError:      # a sub-interpreter: signals are not ours to set
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if caught and before is signal.default_int_handler:
            raise KeyboardInterrupt


__all__ = ["interrupts_held"]
