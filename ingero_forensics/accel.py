"""The optional C accelerators (export/_fastslices.c, merge/_fastcoll.c, bundle/_screen.c).

Each is both a CPython module and a SQLite loadable extension: loading it once into a
scratch connection hands it the routines of apsw's own SQLite, so it steps statements on
our apsw connections (no second SQLite library). Our other connections keep extension
loading off. Without a compiler at install time, or with INGERO_NO_ACCEL=1, the callers
run their SQL/Python path, which stays the reference the tests compare against.
"""

from __future__ import annotations

import importlib
import os

import apsw


def disabled() -> bool:
    return os.environ.get("INGERO_NO_ACCEL", "") not in ("", "0")


def load(module: str, entry: str):
    """``ingero_forensics.<module>``, ready to use, or None (not built, or disabled)."""
    if disabled():
        return None
    try:
        mod = importlib.import_module(f"ingero_forensics.{module}")
    except ImportError:
        return None
    if not mod.ready():
        scratch = apsw.Connection(":memory:")
        try:
            scratch.enable_load_extension(True)
            scratch.load_extension(mod.__file__, entry)
        except (apsw.Error, AttributeError):     # an apsw built without extension loading
            return None
        finally:
            scratch.close()
    return mod


def screens():
    """bundle/_screen.c (the untrusted-row screens as SQL functions), or None."""
    return load("bundle._screen", "sqlite3_screen_init")
