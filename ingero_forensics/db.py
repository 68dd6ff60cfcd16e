"""apsw connection factories: the only place connections are opened.

Untrusted databases (bundles from other machines) are opened read-only in SQLite's
defensive mode with trusted_schema off and triggers and views disabled, so no SQL stored
in a file is ever executed by opening or reading it.
"""

from __future__ import annotations

import apsw

from . import accel


def harden(con: apsw.Connection) -> apsw.Connection:
    """Make a connection safe to point at (or ATTACH) untrusted database files."""
    con.config(apsw.SQLITE_DBCONFIG_DEFENSIVE, 1)
    con.config(apsw.SQLITE_DBCONFIG_TRUSTED_SCHEMA, 0)
    con.config(apsw.SQLITE_DBCONFIG_ENABLE_TRIGGER, 0)
    con.config(apsw.SQLITE_DBCONFIG_ENABLE_VIEW, 0)
    con.config(apsw.SQLITE_DBCONFIG_ENABLE_LOAD_EXTENSION, 0)
    con.execute("PRAGMA trusted_schema = OFF")
    con.execute("PRAGMA cell_size_check = ON")
    # the screens for untrusted rows in C (bundle/_screen.c), where built: DIRECTONLY,
    # so nothing stored in a file can call them
    screens = accel.screens()
    if screens is not None:
        screens.register(con.sqlite3pointer())
    return con


def connect_untrusted(path) -> apsw.Connection:
    """Open a database file we did not write, read-only and hardened."""
    con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    return harden(con)


def connect_readonly(path) -> apsw.Connection:
    """Open a database for queries only (fleet.db or a verified bundle image)."""
    con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    return harden(con)


def connect_writable(path, *, wal: bool = True) -> apsw.Connection:
    """Open (creating) a database this process owns and writes."""
    con = apsw.Connection(str(path))
    con.execute("PRAGMA busy_timeout = 5000")
    if wal:
        con.execute("PRAGMA journal_mode = WAL")
        # NORMAL in WAL mode: a crash loses at most the last commits, never corrupts.
        con.execute("PRAGMA synchronous = NORMAL")
    return con
