"""Is this file a fleet.db? One answer, worded the same by every command that reads one
(ingero-report, ingero-export, ingero-redact): a user who hands them an empty file, a
bundle or another program's SQLite database gets the same line and what to do.

Only the file's header is read (and two PRAGMAs of a SQLite one); what the tables hold
is each reader's business.
"""

from __future__ import annotations

import struct
from pathlib import Path

import apsw

from .bundle.container import SKIPPABLE_MAGIC, open_regular
from .db import connect_readonly
from .errors import BundleError, IngeroError

SQLITE_HEADER = b"SQLite format 3\x00"
MERGE_FIRST = "merge first (ingero-merge BUNDLES -o fleet.db)"


def check_fleet_file(path, error: type[IngeroError] = IngeroError) -> int:
    """Raise ``error`` with a one-line reason unless path is a fleet.db this version can
    read; return its format version (user_version)."""
    from .merge.fleet_schema import FLEET_APPLICATION_ID, FLEET_VERSION  # noqa: PLC0415
    path = Path(path)
    try:
        exists = path.exists()
    except OSError as e:            # a directory on the way that cannot be searched
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    if not exists:
        raise error(f"{path}: no such file")
    try:
        with open_regular(path) as f:
            head = f.read(len(SQLITE_HEADER))
    except BundleError as e:
        raise error(f"{path}: {e.reason}") from None
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    if not head:
        raise error(f"{path}: an empty file, not a fleet.db; {MERGE_FIRST}")
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == SKIPPABLE_MAGIC:
        raise error(f"{path}: is a bundle, not a fleet.db: {MERGE_FIRST}, then use fleet.db")
    if head != SQLITE_HEADER:
        raise error(f"{path}: not a fleet.db (not a SQLite database); {MERGE_FIRST}")
    try:
        con = connect_readonly(path)
        try:
            app = con.execute("PRAGMA application_id").fetchone()[0]
            ver = con.execute("PRAGMA user_version").fetchone()[0]
        finally:
            con.close()
    except apsw.Error as e:
        raise error(f"{path}: cannot read fleet.db ({' '.join(str(e).split())})") from None
    if app != FLEET_APPLICATION_ID:
        raise error(f"{path}: not a fleet.db (a SQLite database with application_id "
                    f"{app:#x}, not ingero-merge's); {MERGE_FIRST}")
    if ver > FLEET_VERSION:
        raise error(f"{path}: fleet.db version {ver} is newer than this tool supports "
                    f"({FLEET_VERSION}); upgrade ingero-forensics")
    return ver
