"""Victims of another straggler (docs/report.md, rule 5): a node named late with another,
only while that one was, resending towards it, with no clear cause of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import Analysis

#: the share of a victim's window time that must lie within its culprits' windows
VICTIM_OVERLAP = 0.9


def demote_victims(a: Analysis) -> None:
    """A node named late with another, with no clear cause of its own, whose job connections
    resent towards that node (``victim_of``), late only while that node was (90 % of its
    window time within the other's windows) and costing less: it waited for the other
    (a sender held by a late receiver), so it is that node's victim, not a straggler of
    its own (issue 16: "a node whose sends are retransmitted towards a late peer is a
    victim, not the cause"). Named in the culprit's evidence and in ``victims``. Seen on
    the real-kernel rig: with one GPU three times slower, its upstream neighbour was
    late in 1.0 s of the slow node's 5.0 s of windows (0 ms on average over the run, on
    the shared clock) and was named a second straggler, "cannot tell"."""
    by_name = {st.node: st for st in a.stragglers}
    kept = []
    for st in a.stragglers:
        culprits = [by_name[n] for n in st.victim_of if n in by_name]
        inside = overlap_s(st.windows, [w for c in culprits for w in c.windows])
        total = sum(w.end_ns - w.start_ns for w in st.windows) / 1e9
        # (victim_of is set only without a clear cause: _diagnose)
        if (culprits and len(culprits) == len(st.victim_of)
                and all(c.cost_s > st.cost_s for c in culprits)
                and total > 0 and inside >= VICTIM_OVERLAP * total):
            a.victims.append(st.node)
            whom = " and ".join(c.node for c in culprits)
            note = (f"{st.node} arrived late too ({st.lateness_ms:.1f} ms in "
                    f"{total:.2f} s), only while {whom} {'was' if len(culprits) == 1 else 'were'} "
                    f"late, with no clear cause of its own and resending towards "
                    f"{'it' if len(culprits) == 1 else 'them'}: {whom}'s victim, not named a "
                    "straggler.")
            a.victim_notes.append(note)
            for c in culprits:
                c.evidence.append(note)
        else:
            kept.append(st)
    a.stragglers = kept


def overlap_s(windows, others) -> float:
    """Seconds of ``windows`` that lie within the union of ``others``."""
    spans = sorted((w.start_ns, w.end_ns) for w in others)
    merged: list[list[int]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(max(0, min(w.end_ns, e) - max(w.start_ns, s))
               for w in windows for s, e in merged) / 1e9
