"""The report's words: the verdict, each straggler's sentence, and why no node could be
compared. analyze.py decides; this says it."""

from __future__ import annotations

import re
import statistics

from typing import TYPE_CHECKING

from .evidence import CAUSE_TITLES

if TYPE_CHECKING:
    from .model import Analysis, Straggler


def no_comparison_text(a: Analysis, nodes) -> str:
    """Why no node can be compared with another, what is missing and how to get it."""
    if not nodes:
        return ("The fleet database holds no nodes: merge the bundles of the job's nodes "
                "into it (ingero-merge node*.bundle -o fleet.db).")
    what = ("What the capture shows is below: host signals, the job connections' "
            "retransmits, where the traced processes waited.")
    if not a.inventory.get("nccl_events"):
        return ("Not enough data to name a straggler: no NCCL collectives were captured "
                "(nccl_events is empty), and a straggler is found by comparing when nodes "
                "arrive at collectives. Check that the capture found the training "
                "processes (those that map libnccl; ingero-capture --check shows which "
                "sources would run) and whether the capture's gaps (\"What the capture "
                "could not see\" on the page, the caveats in text) list the nccl source. "
                + what)
    if len(nodes) == 1:
        name, ranks = next(iter(nodes.values()))
        return (f"Not enough data to name a straggler: one node, {name} "
                f"({rank_text(ranks)}), and a straggler is a node the others wait for. "
                "Capture every node of the job (ingero-capture on each) and merge their "
                "bundles (ingero-merge) to compare them. " + what)
    return ("Not enough data to name a straggler: no collective was seen on two or more "
            "nodes (each node's ranks are in communicators of their own, or the captures "
            "do not overlap in time). " + what)


def bins_limited_text(a: Analysis, nl, span_s: float) -> str:
    """A node late in every bin a short run has, and costly, while a straggler must be
    late in more bins than there are: neither "straggler" nor "no straggler" is known."""
    b = a.bins_limited
    others = [n for n in b["nodes"] if n != nl.name]
    also = f" ({', '.join(others)} too)" if others else ""
    suggest = max(0.01, round(span_s / (4 * b["min_bins"]), 2))
    return (f"Cannot tell whether {nl.name} is a straggler{also}: it arrived late (by "
            f"{nl.median_ms:.1f} ms at the median) in {nl.late_bins} of the {b['bins']} time "
            f"bins of {b['bin_s']:g} s the run has, and the others waited "
            f"{nl.cost_share:.1%} of the run for it, but a straggler must be late in at "
            f"least {b['min_bins']} bins. The run is too short for bins this long: report "
            f"again with a smaller bin (ingero-report --bin {suggest:g}).")


def clock_unsure_text(unsure: list[dict], also: bool = False) -> str:
    """Nodes late by no more than the clock alignment uncertainty between them and their
    peers: neither they nor the others can be said to be late."""
    parts = []
    for u in unsure:
        bound = ("an unbounded uncertainty" if u["relative_uncertainty_ms"] is None else
                 f"{ms_text(u['relative_uncertainty_ms'])}")
        parts.append(f"{u['node']} ({rank_text(u['ranks'])}) arrived late by "
                     f"{u['peak_ms']:.1f} ms at its peak, against {bound} between its clock "
                     "and its peers'")
    nodes = ", ".join(u["node"] for u in unsure)
    head = (f"Also, cannot tell whether {nodes} {'is a straggler' if len(unsure) == 1 else 'are stragglers'}: "
            if also else
            f"Cannot tell whether {nodes} {'is a straggler' if len(unsure) == 1 else 'are stragglers'}: ")
    return (head + "; ".join(parts) + ". The clock error alone could make a node look "
            "that late, so not even which node was late is known. Each node's clock bound "
            "is listed (the page's clock section, the text's caveats); clocks "
            "synchronized better (PTP, or chrony on every node), or a capture that sees "
            "the job's TCP traffic (tcp_progress), would tell.")


def _windows_text(windows) -> str:
    return "1 window" if len(windows) == 1 else f"{len(windows)} windows"


def rank_text(ranks) -> str:
    if not ranks:
        return "its ranks"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def seconds_text(secs: float) -> str:
    """A duration in seconds with the decimals its size needs (0.48 s, not "0 s")."""
    return f"{secs:.0f} s" if secs >= 10 else f"{secs:.1f} s" if secs >= 1 else f"{secs:.2f} s"


#: Per-node figures listed one by one up to this many nodes; beyond, summarised.
LIST_NODES = 8


def per_node_text(values: dict, unit: str, decimals: int = 1) -> str:
    """"2.6 % of one core on node-00; 2.5 % ... on node-01" for a few nodes; for a large
    fleet the median and the range with the nodes at its ends (a thousand nodes listed
    one by one is no sentence)."""
    if len(values) <= LIST_NODES:
        return "; ".join(f"{v:.{decimals}f} % {unit} on {n}" for n, v in values.items())
    lo = min(values, key=values.get)
    hi = max(values, key=values.get)
    if f"{values[lo]:.{decimals}f}" == f"{values[hi]:.{decimals}f}":
        return f"{values[lo]:.{decimals}f} % {unit} on each of the {len(values)} nodes"
    return (f"median {statistics.median(values.values()):.{decimals}f} % {unit} over "
            f"{len(values)} nodes (lowest {values[lo]:.{decimals}f} % on {lo}, highest "
            f"{values[hi]:.{decimals}f} % on {hi})")


def nodes_text(names: list[str], keep=()) -> str:
    """A few node names, or how many with the first and last of them and those of
    ``keep`` (the stragglers: their own gaps are never summarised away)."""
    names = sorted(names, key=natural_key)
    if len(names) <= LIST_NODES:
        return ", ".join(names)
    shown = [names[0], names[1], "...", names[-1]]
    named = [n for n in names[2:-1] if n in keep]
    return (f"{len(names)} nodes ({', '.join(shown)}"
            + (f"; among them {', '.join(named)}" if named else "") + ")")


def grouped_issues(issues: list[dict], keep=(), every: bool = False) -> list[dict]:
    """What the capture could not see, one entry per (source, event, message) with the
    nodes it was on (every node of a fleet without NVML says the same thing): nodes,
    node (their names: all of them with ``every``, else summarised, the nodes of
    ``keep`` always named), source, event, count (summed; None when no member was
    counted: "how many is unknown"), message; in the order first seen."""
    out: dict[tuple, dict] = {}
    for c in issues:
        key = (c["source"], c["event"], c["message"])
        g = out.setdefault(key, {"nodes": [], "source": c["source"], "event": c["event"],
                                 "count": None, "message": c["message"]})
        g["nodes"].append(c["node"])
        if c["count"] is not None:
            g["count"] = (g["count"] or 0) + c["count"]
    for g in out.values():
        g["node"] = (", ".join(sorted(g["nodes"], key=natural_key)) if every
                     else nodes_text(g["nodes"], keep))
    return list(out.values())


def natural_key(name: str) -> tuple:
    """Sort key that orders node names as people count them: node-2 before node-10
    (real fleets name nodes gpu-1 .. gpu-1000, unpadded)."""
    return tuple((0, int(part), "") if part.isascii() and part.isdigit() else (1, 0, part)
                 for part in re.split(r"([0-9]+)", name) if part)


def _clock_margin() -> float:
    from .analyze import CLOCK_MARGIN  # noqa: PLC0415 (analyze imports this module)
    return CLOCK_MARGIN


def clock_check_text(st: Straggler) -> str:
    """A straggler's clock check in a few words, with the figures it compares (the
    tables' clock column): its peak lateness against the margin times its relative
    alignment uncertainty."""
    u = st.relative_uncertainty_ms
    if u is None:
        return "clock error cannot be ruled out (uncertainty unbounded)"
    head, rel = ("clock error cannot be ruled out", "<=") if st.clock_caveat else ("ok", ">")
    return f"{head}: peak {st.peak_ms:.1f} ms {rel} {_clock_margin():g} x {ms_text(u)}"


def clock_check_sentence(st: Straggler) -> str:
    """clock_check_text in a sentence, for the text form's bullets (the tables keep the
    short form under their "clock" heading)."""
    u = st.relative_uncertainty_ms
    if u is None:
        return ("clock error cannot be ruled out: no bound on the alignment between it "
                "and its peers")
    if st.clock_caveat:
        return (f"clock error cannot be ruled out: its peak lateness, {st.peak_ms:.1f} ms, is "
                f"at most {_clock_margin():g} x the alignment uncertainty between it and its "
                f"peers ({ms_text(u)})")
    return (f"clock check ok: its peak lateness, {st.peak_ms:.1f} ms, is more than "
            f"{_clock_margin():g} x the alignment uncertainty between it and its peers "
            f"({ms_text(u)})")


def ms_text(ms: float) -> str:
    """A small duration in ms with the unit its size needs: 8.35 ms, but 1.4 us (not
    "0.00 ms", which reads as a zero or a bug)."""
    return f"{ms:.2f} ms" if ms >= 0.01 or ms == 0 else f"{ms * 1000:.1f} us"


def _straggler_text(st: Straggler, noise_ms: float, nodes: int) -> str:
    secs = sum(w.end_ns - w.start_ns for w in st.windows) / 1e9
    whom = "the other node" if nodes == 2 else "the median node"
    if st.reference == "early_half":
        whom = (f"the earliest half of the nodes (late together with "
                f"{', '.join(st.late_with)}, so the median arrival was no healthy node's)")
    text = (f"{st.node} ({rank_text(st.late_ranks or st.ranks)}) is a straggler: it arrived "
            f"at collectives {st.lateness_ms:.1f} ms after {whom}, on average, in "
            f"{_windows_text(st.windows)} totalling {seconds_text(secs)} (fleet jitter "
            f"{noise_ms if st.jitter_ms is None else st.jitter_ms:.2f} ms); the other {'node' if nodes == 2 else 'nodes'} waited "
            f"{st.cost_s:.1f} s for it ({st.cost_share:.1%} of the run).")
    u = st.relative_uncertainty_ms
    margin = _clock_margin()
    if st.clock_caveat:
        text += (" Its lateness is not well above the clock alignment uncertainty between "
                 "it and its peers (" + ("unbounded" if u is None else
                                         f"{ms_text(u)}, against a peak lateness of "
                                         f"{st.peak_ms:.1f} ms") +
                 "): clock error cannot be ruled out.")
    elif st.lateness_ms <= margin * u:
        # the mean quoted above would not pass the check: show the figure that did
        text += (f" Its peak lateness ({st.peak_ms:.1f} ms: at the latest collective of "
                 f"each late bin, the median over them) is more than {margin:g} times the "
                 f"clock alignment uncertainty between it and its peers ({ms_text(u)}), so "
                 "clock error does not explain it.")
    if st.victim_of:
        whom = ", ".join(st.victim_of)
        text += (f" Its job connections resent segments towards {whom}, late too: it may be "
                 + (f"{whom}'s" if len(st.victim_of) == 1 else "their")
                 + " victim rather than a straggler of its own.")
    if st.retransmits_towards:
        r = st.retransmits_towards
        text += (f" {r['node']}'s job connections retransmitted {r['retransmits']} segments "
                 f"towards it, which fits both a lossy link at {r['node']} ({st.node} then "
                 f"its victim, not a straggler of its own) and {st.node}'s own slowness.")
    return text + _cause_tail(st)


def _cause_tail(st: Straggler) -> str:
    """The verdict's cause sentence and next step."""
    if st.cause and st.cause_confidence == "clear":
        text = f" Root cause: {CAUSE_TITLES[st.cause]}."
    elif st.cause and st.close_cause:
        text = (f" Most likely cause: {CAUSE_TITLES[st.cause]} or "
                f"{CAUSE_TITLES[st.close_cause]} (weak evidence: they score within 2x of "
                "each other).")
    elif st.cause:
        text = f" Most likely cause: {CAUSE_TITLES[st.cause]} (weak evidence)."
    else:
        text = " The captured signals do not single out a cause; see the scores below."
    if st.cause and st.next_step:
        text += f" Next step: {st.next_step}"
    return text


def slow_link_text(a: Analysis) -> str:
    """Rule 4c's verdict: nobody late, nothing retransmitted, one link far slower."""
    from .links import (LINK_CAUSE_TITLE, _there, period_cost_text,  # noqa: PLC0415
                        period_text, side_text)  # (links imports evidence)
    s = a.link_suspect
    if s.get("windows"):
        cost = period_cost_text(s, ms_text)
    else:
        cost = (f"the collectives spent {s['transfer_share']:.0%} of the run between the "
                "last arrival and completion, the transfer a slow link lengthens")
    return (f"No node arrives late at collectives and no job connection retransmits "
            f"markedly, but the job's link from {s['from']} to {s['to']} "
            f"{'was' if s.get('windows') else 'is'} slow{period_text(s)}: its bytes took "
            f"{ms_text(s['median_ms'])} from sender to receiver at the median, against "
            f"{ms_text(s['others_ms'])} on the job's other links{_there(s)} (score {s['score']:g}); {cost}. {side_text(s)} "
            f"{a.straggler} is named. Root cause: {LINK_CAUSE_TITLE}. Next step: "
            f"{a.next_step}")


def gpu_suspect_text(a: Analysis, st: Straggler) -> str:
    """The verdict when nobody arrives late but one node's GPU work is slower (rule 4b)."""
    g = a.gpu_suspect
    who = (rank_text([g["rank"]]) if g.get("rank") is not None else "its slowest process")
    if a.clock_limited:
        # the waits are durations on one node's clock: they hold; arrivals do not
        bound = g.get("clock_bound_ms")
        lead = ("Whether a node arrives late at collectives cannot be told (the clocks "
                "could only be aligned to within " + ("an unbounded error" if bound is None
                                                     else ms_text(bound)) +
                f", more than the fleet's jitter of {a.noise_ms:.2f} ms)")
    else:
        whom = "the other node" if a.nodes == 2 else "the median node"
        when = (f"{g['lateness_ms']:.1f} ms after" if g["lateness_ms"] >= 0 else
                f"{-g['lateness_ms']:.1f} ms before")
        from .analyze import MIN_COST_SHARE  # noqa: PLC0415 (analyze imports this module)
        lead = (f"No node arrives late at collectives (late means over {a.threshold_ms:.2f} "
                f"ms in at least {g['min_bins']} time bins and costing the others at least "
                f"{MIN_COST_SHARE:.0%} of the run, the fleet's jitter being "
                f"{a.noise_ms:.2f} ms; {st.node} "
                f"arrives {when} {whom} at the median)")
    clear = g["clear"]
    text = (f"{lead}, but {st.node} waits {'far ' if clear else ''}longer for its own GPU "
            f"work: {who}'s event and device synchronizations took "
            f"{ms_text(g['wait_ms'])} at the median, against {ms_text(g['others_ms'])} on "
            f"the other nodes, and {seconds_text(g['extra_s'])} longer in all "
            f"({st.cost_share:.1%} of the run). A GPU that runs the same work slower starts "
            "every collective late on the GPU, where the capture sees no arrival, and its "
            "peers wait inside the collective: "
            + (f"{st.node} is the suspect." if clear else
               f"{st.node} may be the suspect, on weak evidence (its waits score "
               f"{g['score']:g}, under the 5 of a clear difference: on a busy host, ranks "
               "that wait for a CPU wait longer for their GPU work too)."))
    if g.get("gpu_share") is not None and g["gpu_share"] < 0.9:
        # some of its excess was its threads waiting for a CPU: how much is left
        text += (f" With the waiting threads' run-queue delay inside the waits taken out "
                 f"(waiting for a CPU, not for the GPU), its waits took "
                 f"{ms_text(g['free_ms'])} against {ms_text(g['others_free_ms'])} at the "
                 f"median, {g['free_ratio']:.1f} times the others' against "
                 f"{g['wait_ratio']:.1f} times with it: {max(g['gpu_share'], 0.0):.0%} of "
                 "its excess is left.")
    launches, peers = g["launches_per_s"], g["others_launches_per_s"]
    if not g["same_syncs"]:
        text += (f" It waited {g['waits']:,} times against {g['others_waits']:,.0f} for its "
                 "peers: its ranks synchronize differently (a device synchronization also "
                 "waits for the collectives), and a slower GPU is only one reading.")
    elif g["same_work"] is True:
        text += (f" It launched about as many kernels as its peers ({launches:,.0f} per s "
                 f"against {peers:,.0f}) and waited as often.")
    elif g["same_work"] is False:
        ratio = launches / peers
        text += (f" It launched {'only ' if ratio < 1 else ''}{ratio:.1f} times as many "
                 f"kernels per second as its peers ({launches:,.0f} against {peers:,.0f}): "
                 "its ranks may run other work than theirs, and a slower GPU is only one "
                 "reading.")
    else:
        text += (" Kernel launches were not counted on every node, so whether its ranks "
                 "ran the same work as their peers is not known.")
    return text + _cause_tail(st)


def verdict_text(a: Analysis, network: bool, primary: Straggler | None = None) -> str:
    if a.gpu_suspect and primary is not None and not a.stragglers and not network:
        return gpu_suspect_text(a, primary)
    if network and a.link_suspect:
        return slow_link_text(a)
    if network:
        secs = sum(w.end_ns - w.start_ns for w in a.windows) / 1e9
        late = ("no rank arrived markedly late" if not a.victims else
                ", ".join(a.victims) + " arrived late only for want of its data")
        # the windows are the bins of the suspect's retransmits (and of slow transfers):
        # say that, and how many bins the transfer itself was slow in, not more
        slow = (f" The time from the last arrival to completion was over 3 times the "
                f"run's median in {a.slow_bins} time bin{'s' if a.slow_bins != 1 else ''}."
                if a.slow_bins else "")
        if a.network_basis == "contrast":
            lead = (f"{a.straggler}'s own job connections retransmitted far more than any "
                    f"other node's, while {late}: its network is the suspect. Its windows "
                    f"(the bins of its retransmits and of slow transfers): "
                    f"{_windows_text(a.windows)} totalling {seconds_text(secs)}.{slow}")
        else:
            lead = (f"Collectives were slow in {_windows_text(a.windows)} totalling "
                    f"{seconds_text(secs)} while {late}, and {a.straggler}'s own job "
                    "connections retransmitted the most in them: its network is the "
                    f"suspect.{slow}")
        if a.cause and a.cause_confidence == "clear":
            return f"{lead} Root cause: {CAUSE_TITLES[a.cause]}. Next step: {a.next_step}"
        return lead
    texts = [_straggler_text(st, a.noise_ms, a.nodes) for st in a.stragglers]
    texts += a.victim_notes     # report/victims.py, demote_victims
    if len(a.stragglers) > 1:
        return f"{len(a.stragglers)} stragglers. " + " ".join(texts)
    return " ".join(texts)
