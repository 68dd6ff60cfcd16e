"""The one place the rig tests read the report's verdict (``ingero-report --json``).

The analysis lists every straggler in ``stragglers`` ({node, ranks, late_ranks, cause,
cause_confidence, ...}); a network suspect, which arrives on time, is only in the
top-level fields (``straggler``, ``late_ranks``, ``cause``, ``cause_confidence``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Straggler:
    node: str
    ranks: tuple[int, ...]      # global ranks the report names for this straggler
    cause: str | None           # cpu, io, memory, network, gpu, or None (cannot tell)
    confidence: str | None      # clear, weak, none


def stragglers(report: dict) -> list[Straggler]:
    listed = report.get("stragglers")
    if listed:
        return [Straggler(s["node"], tuple(s.get("late_ranks") or s.get("ranks") or ()),
                          s.get("cause"), s.get("confidence", s.get("cause_confidence")))
                for s in listed]
    # a network suspect (collectives slow for everyone, nobody late) is not in the list
    if not report.get("straggler"):
        return []
    ranks = report.get("late_ranks") or report.get("straggler_ranks") or ()
    return [Straggler(report["straggler"], tuple(ranks), report.get("cause"),
                      report.get("cause_confidence"))]


def summary(report: dict) -> dict:
    """The verdict fields worth printing when an assertion fails."""
    keys = ("stragglers", "straggler", "straggler_ranks", "late_ranks", "cause",
            "cause_confidence", "verdict", "noise_ms")
    out = {k: report[k] for k in keys if k in report}
    out["lateness_ms"] = {n.get("name"): n.get("median_ms") for n in report.get("lateness", [])}
    out["alignment"] = [{k: a.get(k) for k in ("node", "method", "drift_ppm",
                                                "relative_uncertainty_us")}
                        for a in report.get("alignment", [])]
    return out
