"""Structural checks of a Chrome Trace Event Format document (what Perfetto requires)."""

from __future__ import annotations

import math
from collections import defaultdict


def validate(doc: dict) -> dict:
    """Assert the trace is well formed; return counts by phase and the tracks."""
    assert set(doc) >= {"traceEvents", "metadata"}
    events = doc["traceEvents"]
    counts = defaultdict(int)
    slices = defaultdict(list)          # (pid, tid) -> [(start, end, event)]
    flows = defaultdict(list)           # (cat, name, id) -> [event]
    names = {}
    for e in events:
        ph = e["ph"]
        counts[ph] += 1
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert 0 <= e["tid"] < 2 ** 31 and 0 <= e["pid"] < 2 ** 31, e
        if ph == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name",
                                 "thread_sort_index"), e
            key = "name" if e["name"].endswith("_name") else "sort_index"
            assert key in e["args"], e
            names[(e["pid"], e["tid"] if e["name"].startswith("thread") else None,
                   e["name"])] = e["args"][key]
            continue
        assert isinstance(e["ts"], (int, float)) and math.isfinite(e["ts"]), e
        if ph == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            assert isinstance(e["name"], str) and e["name"] and isinstance(e["cat"], str)
            assert isinstance(e.get("args", {}), dict)
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e))
        elif ph == "i":
            assert e["s"] in ("t", "p", "g") and e["name"]
        elif ph == "C":
            assert e["args"] and all(isinstance(v, (int, float)) and math.isfinite(v)
                                     for v in e["args"].values()), e
        elif ph in ("s", "f"):
            flows[(e["cat"], e["name"], e["id"])].append(e)
        else:
            raise AssertionError(f"unexpected phase {ph}: {e}")
    # Slices on one track nest or follow, never partially overlap.
    for track, items in slices.items():
        items.sort(key=lambda x: (x[0], -x[1]))
        stack = []
        for start, end, e in items:
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"partial overlap on {track}: {e}"
            stack.append(end)
        assert (track[0], track[1], "thread_name") in names, f"unnamed track {track}"
    # Flow ids are paired (one s, one f) and each end binds to a slice on its track.
    starts = {(pid, tid, ts, e["cat"]) for (pid, tid), items in slices.items()
              for ts, _, e in items}
    for key, evs in flows.items():
        assert sorted(e["ph"] for e in evs) == ["f", "s"], f"unpaired flow {key}"
        for e in evs:
            assert (e["pid"], e["tid"], e["ts"], e["cat"]) in starts, f"unbound flow {e}"
            if e["ph"] == "f":
                assert e.get("bp") == "e"
    pids = {p for p, _ in slices} | {e["pid"] for e in events if e["ph"] in "iC"}
    for pid in pids:
        assert (pid, None, "process_name") in names, f"unnamed process {pid}"
    return {"counts": dict(counts), "flows": len(flows), "tracks": set(slices),
            "names": names}
