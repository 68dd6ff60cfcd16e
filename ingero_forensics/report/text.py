"""The report as plain text or Markdown: an email body or a ticket.

The verdict (with cost, cause and next step), every straggler, the per-node table, what
the capture shows where no node could be compared (host signals, retransmits, waits),
and the clock and capture caveats; the HTML page has the charts and the evidence tables.
"""

from __future__ import annotations

import textwrap

from .analyze import CAUSE_TITLES, Analysis
from .wording import clock_check_text, rank_text
from .render import report_title


def _table(rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        return out + ["| " + " | ".join(r) + " |" for r in rows[1:]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def render_text(a: Analysis, *, markdown: bool = False) -> str:
    h = (lambda t: f"## {t}") if markdown else (lambda t: f"{t}\n{'-' * len(t)}")
    # plain text is read in a mail client: paragraphs wrapped; Markdown wraps itself
    para = (lambda t, lead="": lead + t) if markdown else \
        (lambda t, lead="": textwrap.fill(t, 96, initial_indent=lead,
                                          subsequent_indent=" " * len(lead)))
    lines = [("# " if markdown else "") + f"Straggler report: {report_title(a)}", "",
             f"{a.nodes} node{'s' if a.nodes != 1 else ''}, {a.ranks} "
             f"rank{'s' if a.ranks != 1 else ''}, {a.collectives:,} collective"
             f"{'s' if a.collectives != 1 else ''}.", "",
             para(a.verdict), ""]
    if a.hangs:
        lines += [h("Ranks that stopped"), ""]
        rows = [["rank", "node", "pid", "last collective", "never entered", "last CUDA call"]]
        for x in a.hangs:
            call = x["last_calls"][0] if x["last_calls"] else None
            rows.append([str(x["rank"]), x["node"], str(x["pid"]),
                         f"{x['last_op']} seq {x['last_seq']}",
                         f"{x['missed_op']} seq {x['missed_seq']}"
                         + (" (inside it)" if x.get("stall") or (
                             x.get("inside") and x["inside"]["missed"]) else ""),
                         "-" if call is None else call["api"]
                         + (" (in flight)" if call["in_flight"] else "")])
        lines += _table(rows, markdown) + [""]
    if a.stragglers:
        lines += [h("Stragglers"), ""]
        rows = [["node", "ranks", "late, ms", "others waited", "cause", "clock"]]
        for st in a.stragglers:
            cause = CAUSE_TITLES[st.cause] if st.cause else "cannot tell"
            if st.cause and st.close_cause:
                cause += f" or {CAUSE_TITLES[st.close_cause]} (weak)"
            elif st.cause and st.cause_confidence != "clear":
                cause += " (weak)"
            rows.append([st.node, rank_text(st.late_ranks or st.ranks),
                         f"{st.lateness_ms:.1f}", f"{st.cost_s:.1f} s ({st.cost_share:.1%})",
                         cause, clock_check_text(st)])
        lines += _table(rows, markdown) + [""]
        for st in a.stragglers:
            if st.next_step:
                lines.append(para(f"{st.node}: {st.next_step}", "- " if markdown else "* "))
        lines.append("")
    if a.commands:
        lines += [h("Next commands"), ""]
        for c in a.commands:
            lines.append(para(c["what"] + ":"))
            lines += ["```", c["command"], "```"] if markdown else ["    " + c["command"]]
        lines.append("")
    if a.lateness:
        lines += [h("Every node"), ""]
        rows = [["node", "median late, ms", "p90, ms", "late bins", "others waited, s"]]
        for nl in a.lateness:
            rows.append([nl.name, f"{nl.median_ms:.2f}", f"{nl.p90_ms:.2f}",
                         str(nl.late_bins), f"{nl.cost_s:.2f}"])
        lines += _table(rows, markdown) + [""]
    # what the capture shows when no node could be compared (the page's same tables)
    for t in a.host:
        lines += [h(t["title"]), "", para(t["note"]), ""]
        rows = [[label for _key, label, _num in t["cols"]]]
        for r in t["rows"]:
            rows.append([_cell(r[key]) for key, _label, _num in t["cols"]])
        lines += _table(rows, markdown) + [""]
    if a.capture_cost:
        lines += [para("Capture cost: " + "; ".join(f"{pct:.1f} % of one core on {node}"
                                                     for node, pct in a.capture_cost.items())
                       + "." + _bpf_cost(a)), ""]
    warn = [r for r in a.alignment if r["exceeds_claim"] or r["rate_clamped"]
            or r["causal_moved_us"]]
    inferred = a.inferred_communicators
    if warn or a.capture_issues or inferred:
        lines += [h("Caveats"), ""]
        for c in inferred:
            lines.append(para(
                f"communicator {c['comm_id_hash']} inferred (capture attached after its "
                f"init): {c['streams']} streams on {', '.join(c['nodes'])}, "
                + ("; ".join(c["basis"]) + (" (clocks unsynchronized: the match is a "
                                             "choice)" if c["choice"] else "")
                   if c["matched"] else f"matched with nothing: {c['why_alone']}"), "- "))
        for r in warn:
            lines.append(f"- clock of {r['node']}: method {r['method']}, relative "
                         f"uncertainty {r['relative_uncertainty_us']} us"
                         + (", time service claims wrong" if r["exceeds_claim"] else "")
                         + (", rate clamped" if r["rate_clamped"] else "")
                         + (f", moved {r['causal_moved_us']:,.0f} us by causal bounds"
                            if r["causal_moved_us"] else ""))
        for c in a.capture_issues:
            lines.append(para(f"{c['node']}: {c['source']} {c['event']}: {c['message']}",
                              "- "))
        lines.append("")
    return "\n".join(lines)


def _bpf_cost(a) -> str:
    if not a.capture_bpf_cost:
        return ""
    return (" In its BPF programs (in the kernel, paid by the traced threads): "
            + "; ".join(f"{pct:.2f} % of one CPU on {node}"
                        for node, pct in a.capture_bpf_cost.items()) + ".")
