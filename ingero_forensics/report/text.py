"""The report as plain text or Markdown: an email body or a ticket.

The verdict (with cost, cause and next step), every straggler, the per-node table, what
the capture shows where no node could be compared (host signals, retransmits, waits),
and the clock and capture caveats; the HTML page has the charts and the evidence tables.
"""

from __future__ import annotations

import re
import textwrap

from .analyze import CAUSE_TITLES, Analysis
from .wording import (clock_check_sentence, clock_check_text, grouped_issues, per_node_text,
                      rank_text, seconds_text)
from .links import link_note, periods_list
from .render import report_title


def _table(rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        return out + ["| " + " | ".join(r) + " |" for r in rows[1:]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


#: Columns that hold identifiers, not quantities: printed as they are, to be pasted
#: into ps, kill or ss (a pid of "1,206" is none).
_IDENTIFIERS = frozenset({"pid", "tid", "port", "dport", "sport", "rank", "seq"})


def _cell(v, key: str = "") -> str:
    if v is None:
        return "-"
    if key in _IDENTIFIERS:
        return str(v)
    if isinstance(v, float):
        return f"{v:,.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


#: Nodes in the text form's per-node table; a larger fleet's shows those the others
#: waited for most.
TABLE_NODES = 20
#: Plain text is read in a mail client: lines of at most this many characters.
WIDTH = 78
#: A number and its unit stay on one line ("84.9 °C", "12.1 ms").
_NUMBER_UNIT = re.compile(r"(\d) (%|(?:ms|us|ns|s|min|°C|MHz|GHz|B|KiB|MiB|GiB|ppm)\b)")


def wrap(text: str, lead: str = "") -> str:
    """A paragraph filled to WIDTH, broken only at spaces: never inside a word, a
    hyphenated name (nvidia-smi, ingero-query) or between a number and its unit."""
    glued = _NUMBER_UNIT.sub("\\1\0\\2", text)
    return textwrap.fill(glued, WIDTH, initial_indent=lead, subsequent_indent=" " * len(lead),
                         break_on_hyphens=False, break_long_words=False).replace("\0", " ")


def wrap_command(command: str, indent: str = "    ") -> list[str]:
    """A shell command as lines of at most WIDTH characters where it can be, joined by
    backslash-newline, so that it still runs when pasted. A break goes only where bash
    drops the backslash-newline and nothing else changes but whitespace: at a space
    between words, or at a space inside a double-quoted argument (the SQL of
    ingero-query, which then reads the indent as more whitespace) outside any SQL
    string literal in it; never inside single quotes, where the break would become part
    of the argument. A piece longer than a line stays whole."""
    cont = indent + "  "
    pieces: list[str] = []          # the command cut at the spaces where a break may go
    start, i, state, literal = 0, 0, "word", False
    while i < len(command):
        ch = command[i]
        if state == "word":
            if ch == "\\":
                i += 1              # an escaped character, a space too
            elif ch == "'":
                state = "single"
            elif ch == '"':
                state, literal = "double", False
            elif ch == " ":
                pieces.append(command[start:i])
                start = i + 1
        elif state == "single":
            if ch == "'":
                state = "word"
        else:                       # inside double quotes
            if ch == "\\":
                i += 1
            elif ch == '"':
                state = "word"
            elif ch == "'":
                literal = not literal       # an SQL string literal (or an apostrophe)
            elif ch == " " and not literal:
                pieces.append(command[start:i])
                start = i + 1
        i += 1
    pieces.append(command[start:])
    lines, line = [], indent + pieces[0]
    for p in pieces[1:]:
        if len(line) + 1 + len(p) + 2 <= WIDTH:
            line += " " + p
        else:
            lines.append(line + " \\")
            line = cont + p
    return lines + [line]


def render_text(a: Analysis, *, markdown: bool = False) -> str:
    h = (lambda t: f"## {t}") if markdown else (lambda t: f"{t}\n{'-' * len(t)}")
    # plain text is read in a mail client: paragraphs wrapped; Markdown wraps itself
    para = (lambda t, lead="": lead + t) if markdown else wrap
    lines = [("# " if markdown else "") + para(f"Straggler report: {report_title(a)}"), "",
             para(f"{a.nodes} node{'s' if a.nodes != 1 else ''}, {a.ranks} "
                  f"rank{'s' if a.ranks != 1 else ''}, {a.collectives:,} collective"
                  f"{'s' if a.collectives != 1 else ''}"
                  + (f" over {seconds_text(a.run_s)} of run (what the shares of the run "
                     "are of)" if a.run_s else "") + "."), "",
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
        # the clock check goes under the table in plain text: a sixth column would not
        # fit a mail client's 78 characters
        rows = [["node", "ranks", "late, ms", "others waited", "cause"]
                + (["clock"] if markdown else [])]
        for st in a.stragglers:
            cause = CAUSE_TITLES[st.cause] if st.cause else "cannot tell"
            if st.cause and st.close_cause:
                cause += f" or {CAUSE_TITLES[st.close_cause]} (weak)"
            elif st.cause and st.cause_confidence != "clear":
                cause += " (weak)"
            rows.append([st.node, rank_text(st.late_ranks or st.ranks),
                         f"{st.lateness_ms:.1f}", f"{st.cost_s:.1f} s ({st.cost_share:.1%})",
                         cause] + ([clock_check_text(st)] if markdown else []))
        lines += _table(rows, markdown) + [""]
        for st in a.stragglers:
            for e in st.evidence:       # the figures the verdict's next step rests on
                lines.append(para(f"{st.node}: {e}", "- " if markdown else "* "))
            if not markdown:
                lines.append(para(f"{st.node}: {clock_check_sentence(st)}.", "* "))
            if st.next_step:
                lines.append(para(f"{st.node}: {st.next_step}", "- " if markdown else "* "))
        lines.append("")
    marked = a.link_suspect or a.also_slow_link or a.link_unsure or a.link_unnamed
    if marked:
        lines += [h("Transit on the job's links"), ""]
        rows = [["from", "to", "arrivals", "median, ms", "p90, ms"]]
        for lk in a.links:
            rows.append([lk["from"], lk["to"], f"{lk['transits']:,}", f"{lk['median_ms']:.3f}",
                         f"{lk['p90_ms']:.3f}"])
        lines += _table(rows, markdown) + [""]
        if marked["windows"]:
            lines += [para(f"The table's figures are over the whole run; the link from "
                           f"{marked['from']} to {marked['to']} was slow in "
                           + (f"the period {periods_list(marked)} UTC"
                              if len(marked["windows"]) == 1 else
                              f"{len(marked['windows'])} periods only: "
                              f"{periods_list(marked)} UTC") + "."), ""]
        if a.link_suspect:
            notes = a.evidence
        elif not a.also_slow_link:
            notes = [link_note(a)]
        else:
            s = a.also_slow_link
            notes = [f"The link from {s['from']} to {s['to']} is the verdict's second "
                     "finding (above): far slower than the others, "
                     + ("away from the nodes named." if not s.get("named_ends") else
                        "outside the windows of " + " and ".join(s["named_ends"])
                        + " (named above) as well.")]
        for e in notes:
            lines.append(para(e, "- " if markdown else "* "))
        lines.append("")
    if a.commands:
        lines += [h("Next commands"), "",
                  para(f"Runnable as they are in the directory of {a.fleet}."), ""]
        for c in a.commands:
            lines.append(para(c["what"] + ":"))
            lines += ["```", c["command"], "```"] if markdown else wrap_command(c["command"])
        lines.append("")
    if a.lateness:
        shown = a.lateness
        if len(shown) > TABLE_NODES:
            # an email of a thousand rows is read by no one: the nodes the others waited
            # for most, the stragglers among them; the page and --json list every node
            named = {st.node_id for st in a.stragglers}
            shown = sorted(shown, key=lambda nl: (nl.node_id not in named, -nl.cost_s,
                                                  -nl.late_bins, -nl.median_ms))[:TABLE_NODES]
            lines += [h(f"The {len(shown)} nodes the others waited for most, of {a.nodes}"), ""]
        else:
            lines += [h("Every node"), ""]
        rows = [["node", "median late, ms", "p90, ms", "late bins", "others waited, s"]]
        for nl in shown:
            rows.append([nl.name, f"{nl.median_ms:.2f}", f"{nl.p90_ms:.2f}",
                         str(nl.late_bins), f"{nl.cost_s:.2f}"])
        lines += _table(rows, markdown) + [""]
        if len(shown) < len(a.lateness):
            rest = [nl for nl in a.lateness if nl not in shown]
            lines += [para(f"{len(rest)} more node{'s' if len(rest) != 1 else ''}, each "
                           "late in at most "
                           f"{max(nl.late_bins for nl in rest)} bins, the others waiting at "
                           f"most {max(nl.cost_s for nl in rest):.2f} s for any one of them "
                           "(the HTML page and --json list every node)."), ""]
    # what the capture shows when no node could be compared (the page's same tables)
    for t in a.host:
        lines += [h(t["title"]), "", para(t["note"]), ""]
        rows = [[label for _key, label, _num in t["cols"]]]
        for r in t["rows"]:
            rows.append([_cell(r[key], key) for key, _label, _num in t["cols"]])
        lines += _table(rows, markdown) + [""]
    if a.capture_cost:
        lines += [para("Capture cost: " + per_node_text(a.capture_cost, "of one core")
                       + "." + _bpf_cost(a)), ""]
    warn = [r for r in a.alignment if r["exceeds_claim"] or r["rate_clamped"]
            or r["causal_moved_us"] or r["violations_after"]]
    if a.clock_limited:
        # the verdict rests on the clocks: each node's bound too, the loosest first (an
        # unbounded one first of all), as many as a mail can hold
        rest = sorted((r for r in a.alignment if r not in warn),
                      key=lambda r: (r["relative_uncertainty_us"] is not None,
                                     -(r["relative_uncertainty_us"] or 0)))
        warn += rest[:max(0, CLOCK_LINES - len(warn))]
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
            lines.append(para(f"clock of {r['node']}: method {r['method']}, relative "
                              + ("uncertainty unbounded" if r["relative_uncertainty_us"] is None
                                 else f"uncertainty {r['relative_uncertainty_us']} us")
                              + (", time service claims wrong" if r["exceeds_claim"] else "")
                              + (", rate clamped" if r["rate_clamped"] else "")
                              + (f", moved {r['causal_moved_us']:,.0f} us by causal bounds"
                                 if r["causal_moved_us"] else "")
                              + (f", {r['violations_after']:,} observations still out of "
                                 "order after alignment" if r["violations_after"] else ""),
                              "- "))
        for c in grouped_issues(a.capture_issues, keep={st.node for st in a.stragglers}):
            lines.append(para(f"{c['node']}: {c['source']} {c['event']}: {c['message']}",
                              "- "))
        lines.append("")
    return "\n".join(lines)


#: clock lines the text gives when the verdict rests on the clocks
CLOCK_LINES = 20


def _bpf_cost(a) -> str:
    if not a.capture_bpf_cost:
        return ""
    return (" In its BPF programs (in the kernel, paid by the traced threads): "
            + per_node_text(a.capture_bpf_cost, "of one CPU", 2) + ".")
