"""Verify bundles without merging them: the library behind ``ingero-merge --verify``.

After bundles are carried off the nodes (scp, rsync, a USB disk), every one is checked
end to end exactly as the merge would before reading it (``bundle.open_bundle``): the
container and its manifest, the zstd frame, the sha256 and size of the database image,
the SQLite image itself (``PRAGMA quick_check`` by default), the schema of the format
and the manifest's mirror and row counts in the database. Nothing is written except the
temporary images, removed as each check ends.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from ..bundle import open_bundle, read_manifest
from ..errors import BundleError
from .files import expand_inputs
from .fleet_schema import NOT_EVENTS

#: Bundles verified at once (decompression, sha256 and SQLite's check release the GIL).
VERIFY_THREADS = 2


@dataclass
class BundleCheck:
    """One input's verdict; node, host and window come from its manifest when readable."""

    input: str
    ok: bool
    reason: str | None = None
    node: str | None = None
    host: str | None = None
    segment: int | None = None
    start_utc_ns: int | None = None
    end_utc_ns: int | None = None
    #: the window's length by the node's monotonic clock (its UTC ends may be a clock
    #: step apart)
    seconds: float | None = None
    size: int | None = None       # bytes of the bundle file
    rows: int | None = None       # rows of every table, as the manifest counts them

    def to_dict(self) -> dict:
        return asdict(self)


def _from_manifest(check: BundleCheck, m: dict) -> None:
    check.node = m["node"]
    check.host = m["host"]["hostname"]
    check.segment = m["segment"]["index"]
    check.start_utc_ns = m["capture"]["start_utc_ns"]
    check.end_utc_ns = m["capture"]["end_utc_ns"]
    check.seconds = (m["capture"]["end_mono_ns"] - m["capture"]["start_mono_ns"]) / 1e9
    check.rows = sum(n or 0 for t, n in m["tables"].items() if t not in NOT_EVENTS)


def verify_bundle(path, *, shown: str | None = None, tmpdir=None,
                  integrity: str = "quick") -> BundleCheck:
    """Check one bundle fully; never raises for a bad bundle (the reason is returned)."""
    check = BundleCheck(input=shown or str(path), ok=False)
    try:
        check.size = os.stat(path).st_size
    except OSError as e:
        check.reason = f"cannot read: {e.strerror or e}"
        return check
    try:
        with open_bundle(path, tmpdir=tmpdir, integrity=integrity) as b:
            _from_manifest(check, b.manifest)
    except BundleError as e:
        check.reason = e.reason
        try:   # name the node and host of a bundle whose manifest is still readable
            _from_manifest(check, read_manifest(path))
        except BundleError:
            pass
        return check
    check.ok = True
    return check


def verify_bundles(inputs, *, tmpdir=None, integrity: str = "quick",
                   progress=None) -> list[BundleCheck]:
    """Verify every bundle of inputs (files, directories, globs), in input order."""
    entries = expand_inputs(inputs)
    results: list[BundleCheck | None] = [None] * len(entries)
    todo = []
    for i, (shown, path, err) in enumerate(entries):
        if err:
            results[i] = BundleCheck(input=shown, ok=False, reason=err)
        else:
            todo.append((i, shown, path))
    with ThreadPoolExecutor(VERIFY_THREADS) as pool:
        futures = [(i, pool.submit(verify_bundle, path, shown=shown, tmpdir=tmpdir,
                                   integrity=integrity)) for i, shown, path in todo]
        for i, fut in futures:
            results[i] = fut.result()
            if progress:
                progress(1)
    return results


__all__ = ["BundleCheck", "verify_bundle", "verify_bundles", "VERIFY_THREADS"]
