"""Canonical stacks: the identity of a stack is its symbolized frames, never raw addresses
or install paths, so the same call path on two nodes (different ASLR layouts, different
/opt prefixes) is one fleet stack."""

from __future__ import annotations

import hashlib
import json
import posixpath

#: Frame keys kept (bundle spec "Stack frame keys"): canonical name <- bundle key. ip and
#: build_id are dropped (raw addresses differ with ASLR, build ids with rebuilds);
#: module_offset is kept only for unsymbolized frames (it is load-bias free).
_KEEP = (("module", "module"), ("symbol", "symbol"), ("offset", "symbol_offset"),
         ("file", "file"), ("line", "line"), ("py_file", "py_file"),
         ("py_func", "py_func"), ("py_line", "py_line"), ("name", "name"))
_PATHS = ("module", "file", "py_file")


def _base(v):
    if isinstance(v, str):
        return posixpath.basename(v.replace("\\", "/")) or v
    return v


def canonical_frame(frame) -> dict:
    """module base name + symbol + offset, or file:line; no addresses, no directories."""
    if not isinstance(frame, dict):
        return {"symbol": str(frame)}
    out = {}
    for canon, key in _KEEP:
        v = frame.get(key)
        if v is not None and v != "":
            out[canon] = _base(v) if canon in _PATHS else v
    if not ({"symbol", "py_func", "name"} & out.keys()) and frame.get("module_offset"):
        out["module_offset"] = frame["module_offset"]
    return out


def canonical_stack(frames_json: str) -> str:
    """Canonical JSON text of a bundle stack's frames (raises ValueError if not JSON)."""
    try:
        frames = json.loads(frames_json)
    except RecursionError:      # nested deeper than Python's parser goes: not a stack
        raise ValueError("frames JSON is nested too deeply") from None
    if not isinstance(frames, list):
        raise ValueError("frames is not a JSON array")
    return json.dumps([canonical_frame(f) for f in frames], sort_keys=True,
                      separators=(",", ":"))


def stack_hash(canonical: str) -> str:
    return hashlib.sha256(canonical.encode()).hexdigest()
