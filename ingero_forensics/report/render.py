"""Render an Analysis as one self-contained HTML file: inline CSS, inline SVG charts,
no JavaScript, no external resource, readable offline in any browser or mail client.

Charts are built here as SVG strings from escaped values and marked safe once
(markupsafe.Markup), so templates never need ``|safe``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
from pathlib import Path

import jinja2
from markupsafe import Markup, escape

from .. import __version__
from ..errors import IngeroError
from .analyze import CAUSE_TITLES, Analysis
from .evidence import utc
from .links import (LINK_CAUSE_TITLE, LINK_METRIC, LINK_SIGNAL_PREFIX, link_note,
                    period_text, periods_list)
from .wording import clock_check_text, grouped_issues, per_node_text, seconds_text

_ENV: jinja2.Environment | None = None


def environment() -> jinja2.Environment:
    """The one template environment: package templates, autoescape on."""
    global _ENV
    if _ENV is None:
        _ENV = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(template_dir())),
            autoescape=True, trim_blocks=True, lstrip_blocks=True,
            undefined=jinja2.StrictUndefined)
        _ENV.filters["utc"] = _utc
        _ENV.filters["ms"] = lambda v: "-" if v is None else f"{v:,.1f}"
        _ENV.filters["num"] = lambda v, step=0.01: "-" if v is None else _num(v, step)
        _ENV.filters["seconds"] = seconds_text
        _ENV.filters["per_node"] = per_node_text
    return _ENV


def template_dir() -> Path:
    """templates/ ships in the wheel as the package ingero_forensics.templates; in a source
    checkout it is the top-level templates/ folder beside the package."""
    try:
        import importlib.resources as resources
        d = resources.files("ingero_forensics.templates")
        if d.joinpath("report.html").is_file():
            return Path(str(d))
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / "templates"


_utc = utc


#: The charts' colours also as SVG presentation attributes: a mail client that strips
#: the page's <style> block still shows them (the stylesheet wins where it stays).
_PAINT = {
    "bar": 'fill="#8aa4c8"', "bar hi": 'fill="#c0392b"',
    "axis": 'stroke="#99a" stroke-width="1"', "grid": 'stroke="#e6e8ee" stroke-width="1"',
    "window": 'fill="#f6d5cf"',
    "line suspect": 'fill="none" stroke="#c0392b" stroke-width="1.6"',
    "line fleet": 'fill="none" stroke="#4a6fa5" stroke-width="1.6"',
}


def _paint(cls: str) -> str:
    return f'class="{cls}" {_PAINT[cls]}'


#: Bars in the per-node lateness chart; a larger fleet's shows the latest nodes.
CHART_NODES = 32


def _bar_chart(items: list[tuple[str, float, bool]], unit: str, width=640) -> Markup:
    """Horizontal bars: (label, value, highlight)."""
    if not items:
        return Markup("")
    row_h, label_w = 18, 150
    h = row_h * len(items) + 24
    vmax = max(max(v for _, v, _ in items), 1e-9)
    parts = [f'<svg class="chart" width="{width}" height="{h}" viewBox="0 0 {width} {h}" '
             f'role="img" xmlns="http://www.w3.org/2000/svg">']
    for i, (label, v, hi) in enumerate(items):
        y = 4 + i * row_h
        w = max(0.0, (width - label_w - 90) * max(v, 0) / vmax)
        cls = "bar hi" if hi else "bar"
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">{escape(label)}</text>'
                     f'<rect {_paint(cls)} x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 5}"/>'
                     f'<text x="{label_w + w + 4:.1f}" y="{y + 12}">{_num(v, 0.01)} {escape(unit)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _num(v: float, step: float = 1.0) -> str:
    """A tick or value label: as many decimals as the step needs, never '-0'."""
    dec = 0 if step >= 1 else min(3, -math.floor(math.log10(step)))
    text = f"{v:,.{dec}f}"
    return text[1:] if text.startswith("-") and float(text.replace(",", "")) == 0 else text


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round ticks (1, 2 or 5 times a power of ten) covering [lo, hi], about n of them."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    k = 0
    while first + k * step < hi + step * 0.999:
        ticks.append(round(first + k * step, 10))
        k += 1
    return ticks


def _line_chart(points: list[dict], series: list[tuple[str, str, str]], unit: str,
                windows: list[tuple[float, float]] = (), width=720, height=200,
                t_end: float | None = None, origin_s: float = 0.0) -> Markup:
    """Lines over time: points are dicts with 't_s' and one key per series
    (key, label, css class); windows are shaded (start_s, end_s). Every chart of a page
    gets the same t_end: one time axis, with round ticks; the y axis carries its unit.
    origin_s: where t_s = 0 lies in seconds from the start of the data, which the tick
    labels count from."""
    pts = [p for p in points if any(k in p for k, _, _ in series)]
    if len(pts) < 2:
        return Markup("")
    left, right, top, bottom = 64, 10, 10, 34
    tmax = t_end or max(p["t_s"] for p in pts) or 1.0
    vals = [p[k] for p in pts for k, _, _ in series if k in p]
    yt = nice_ticks(min(0.0, min(vals)), max(vals), 4)
    vmin, vmax = yt[0], yt[-1]
    # ticks in seconds from the start of the data, drawn at t_s = tick - origin_s
    xt = [t for t in nice_ticks(origin_s, origin_s + tmax, 6)
          if origin_s - tmax * 1e-4 <= t <= origin_s + tmax * 1.0001]
    pw, ph = width - left - right, height - top - bottom

    def x(t):
        return left + pw * t / tmax

    def y(v):
        return top + ph * (1 - (v - vmin) / (vmax - vmin))

    parts = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'role="img" xmlns="http://www.w3.org/2000/svg">']
    for s, e in windows:
        parts.append(f'<rect {_paint("window")} x="{x(s):.1f}" y="{top}" width="{max(1.0, x(e) - x(s)):.1f}" '
                     f'height="{ph}"/>')
    ystep = yt[1] - yt[0] if len(yt) > 1 else 1.0
    for v in yt:
        cls = "axis" if v == 0 else "grid"
        parts.append(f'<line {_paint(cls)} x1="{left}" y1="{y(v):.1f}" x2="{left + pw}" '
                     f'y2="{y(v):.1f}"/><text x="{left - 4}" y="{y(v) + 4:.1f}" '
                     f'text-anchor="end">{_num(v, ystep)}</text>')
    parts.append(f'<line {_paint("axis")} x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}"/>')
    tstep = xt[1] - xt[0] if len(xt) > 1 else 1.0
    for t in xt:
        parts.append(f'<text x="{x(t - origin_s):.1f}" y="{height - 18}" text-anchor="middle">'
                     f'{_num(t, tstep)} s</text>')
    parts.append(f'<text x="{left}" y="{height - 3}">y: {escape(unit)}; x: seconds from the start '
                 f'of the data{"; shaded: fault windows" if windows else ""}</text>')
    for key, label, cls in series:
        coords = " ".join(f"{x(p['t_s']):.1f},{y(p[key]):.1f}" for p in pts if key in p)
        parts.append(f'<polyline {_paint(cls)} points="{coords}"><title>{escape(label)}</title></polyline>')
    parts.append("</svg>")
    return Markup("".join(parts))


def sql_details(a: Analysis, *keys: str, what: str = "") -> Markup:
    """The statements that computed a figure, in a <details> block (no script needed):
    each runnable as it is with ingero-query or sqlite3 on the fleet.db, with the rows it
    returned when the report ran."""
    entries = [e for k in keys for e in a.sql.get(k, [])]
    if not entries:
        return Markup("")
    n = len(entries)
    parts = [f'<details class="sql"><summary>SQL{(" " + escape(what)) if what else ""} '
             f'({n} statement{"s" if n != 1 else ""})</summary>'
             f'<p class="muted">Each statement runs as it is, one at a time (ingero-query '
             f'takes one per call): <code>ingero-query {escape(a.fleet)} '
             f'-f query.sql</code> or <code>sqlite3 {escape(a.fleet)} &lt; query.sql</code>.</p>']
    for e in entries:
        rows = e["rows"]
        parts.append(f'<pre style="white-space:pre-wrap">-- {rows:,} '
                     f'row{"s" if rows != 1 else ""} when the report ran\n'
                     f'{escape(e["sql"])}</pre>')
    parts.append("</details>")
    return Markup("".join(parts))


#: The y axis of the cause chart: what its metric measures, in its unit.
METRIC_LABELS = {
    "psi.cpu.some_pct": "CPU pressure (PSI some), % of time",
    "psi.io.some_pct": "I/O pressure (PSI some), % of time",
    "psi.memory.some_pct": "memory pressure (PSI some), % of time",
    "vm.job.refault_bytes_per_s": "evicted pages read back, MiB/s (the job's memory cgroup, worst)",
    "vm.refault_bytes_per_s": "evicted pages read back, MiB/s (whole node)",
    "tcp.retrans_segs_per_s": "TCP segments retransmitted per s (whole node)",
    LINK_METRIC: "transit of the link's bytes, ms (median per bin; the other links' arrivals, median)",
    "gpu.sm_clock_mhz": "SM clock, MHz (slowest GPU)",
}


def _span_text(a: Analysis) -> str:
    """The capture's span (every node's first to last time), else the collectives'."""
    lo, hi = a.capture_span if len(a.capture_span) == 2 and None not in a.capture_span \
        else (a.start_ns, a.end_ns)
    if lo is None or hi is None:
        return "no time span"
    start, end = _utc(lo)[:19], _utc(hi)[:19]
    if start[:10] == end[:10]:
        end = end[11:]
    secs = (hi - lo) / 1e9
    length = f"{secs:,.0f} s" if secs < 600 else f"{secs / 60:,.0f} min"
    return f"{start} to {end} UTC ({length})"


def report_title(a: Analysis) -> str:
    """The job (its ids), the node count and the time span; --title replaces it."""
    if a.title:
        return a.title
    jobs = a.job_ids
    who = (f"Job {jobs[0]}" if len(jobs) == 1 else
           f"Jobs {', '.join(jobs[:3])}{' and more' if len(jobs) > 3 else ''}" if jobs
           else f"Fleet {a.fleet}")
    return f"{who} · {a.nodes} node{'s' if a.nodes != 1 else ''} · {_span_text(a)}"


def render_html(a: Analysis) -> str:
    t0 = a.start_ns or 0
    # the charts span the collectives (from t0); their ticks and the windows' offsets
    # count from the start of the data, as ingero-export's --from +Ns does
    origin_s = (t0 - a.data_start_ns) / 1e9 if a.data_start_ns is not None and a.start_ns \
        else 0.0
    t_end = (a.end_ns - t0) / 1e9 if a.end_ns and a.start_ns else None
    windows_s = [((w.start_ns - t0) / 1e9, (w.end_ns - t0) / 1e9) for w in a.windows]
    charted, lateness_note = a.lateness, ""
    named = {st.node_id for st in a.stragglers} | {a.straggler_node_id}
    if len(charted) > CHART_NODES:
        # a bar per node of a thousand is a page-long chart: the latest ones, with every
        # straggler among them; the table below lists every node
        charted = sorted(charted, key=lambda nl: (nl.node_id not in named,
                                                  -nl.p90_ms))[:CHART_NODES]
        charted.sort(key=lambda nl: -nl.p90_ms)
        lateness_note = (f"The {len(charted)} nodes of {a.nodes} latest at their p90"
                         + (" (every straggler among them)" if a.stragglers else "")
                         + "; the table lists every node.")
    lateness_chart = _bar_chart(
        [(f"{nl.name}", nl.p90_ms, nl.node_id in named) for nl in charted], "ms (p90)")
    timeline_series = [("fleet_ms", "median node", "line fleet")]
    if any("suspect_ms" in p for p in a.timeline):
        timeline_series.insert(0, ("suspect_ms", a.straggler or "suspect", "line suspect"))
    timeline_chart = _line_chart(a.timeline, timeline_series, "lateness at collectives, ms",
                                 windows_s, t_end=t_end, origin_s=origin_s)
    transfer_chart = Markup("")
    transfer_ms = [p["transfer_ms"] for p in a.timeline if p.get("transfer_ms")]
    if a.slow_bins or (a.link_suspect and a.link_suspect["windows"]):
        # (a link named for its periods: the transfer it lengthened there, whether or not
        # a bin crossed 3 times the run's median)
        transfer_chart = _line_chart(
            a.timeline, [("transfer_ms", "last arrival to completion", "line fleet")],
            "last arrival to completion, ms (median per bin)", windows_s, t_end=t_end,
            origin_s=origin_s)
    cause_chart = Markup("")
    if a.cause_series.get("points"):
        metric = a.cause_series["metric"]
        pts = [p for p in a.cause_series["points"] if t_end is None or p["t_s"] <= t_end]
        s = a.link_suspect
        cause_chart = _line_chart(
            pts, [("suspect", f"{s['from']} to {s['to']}" if s else a.straggler or "suspect",
                   "line suspect"),
                  ("others", "other links (median)" if s else "other nodes (median)",
                   "line fleet")],
            METRIC_LABELS.get(metric, metric), windows_s, t_end=t_end, origin_s=origin_s)
    window_rows = []
    for w in a.windows:
        # offsets in tenths, the start rounded down and the end up, so that
        # --from +START --to +END exports the whole window; beside them the window's own
        # length, not that padded span (a review: 0.45 s shown as 0.6 s, and the rows
        # added up to more than the verdict's total)
        start_s = math.floor(((w.start_ns - t0) / 1e9 + origin_s) * 10) / 10
        end_s = math.ceil(((w.end_ns - t0) / 1e9 + origin_s) * 10 - 1e-6) / 10
        length_s = (w.end_ns - w.start_ns) / 1e9
        window_rows.append({"start": _utc(w.start_ns), "end": _utc(w.end_ns),
                            "from_start": f"+{start_s:.1f} s to +{end_s:.1f} s",
                            "length": (f"{length_s:.2f} s" if length_s < 10 else
                                       f"{length_s:.1f} s"),
                            "lateness": w.lateness_ms})
    tpl = environment().get_template("report.html")
    return tpl.render(
        a=a, sql=lambda *keys, what="": sql_details(a, *keys, what=what),
        clock_check=clock_check_text,
        title=report_title(a), window_rows=window_rows, lateness_note=lateness_note,
        capture_issues=grouped_issues(a.capture_issues, every=True),
        cause_title=(LINK_CAUSE_TITLE if a.link_suspect else
                     CAUSE_TITLES.get(a.cause or "", "")), cause_titles=CAUSE_TITLES,
        link_title=LINK_CAUSE_TITLE, link_signal=LINK_SIGNAL_PREFIX, link_period=period_text,
        link_note=link_note, all_periods=periods_list,
        lateness_chart=lateness_chart, timeline_chart=timeline_chart,
        transfer_chart=transfer_chart, cause_chart=cause_chart, t0=t0,
        transfer_median=_num(sorted(transfer_ms)[len(transfer_ms) // 2], 0.01)
        if transfer_ms else None,
        version=__version__,
        generated=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def write_report(a: Analysis, out_path) -> Path:
    """Write the HTML atomically (temp file + rename)."""
    return write_text(render_html(a), out_path)


def write_text(text: str, out_path) -> Path:
    """Write a report file atomically (temp file + rename)."""
    out = Path(out_path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    except BaseException as e:
        with contextlib.suppress(OSError):      # a read-only file system refuses this too
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise IngeroError(f"{out}: cannot write: {e.strerror or e}") from None
        raise
    return out
