"""Render an Analysis as one self-contained HTML file: inline CSS, inline SVG charts,
no JavaScript, no external resource, readable offline in any browser or mail client.

Charts are built here as SVG strings from escaped values and marked safe once
(markupsafe.Markup), so templates never need ``|safe``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from pathlib import Path

import jinja2
from markupsafe import Markup, escape

from .. import __version__
from ..errors import IngeroError
from .analyze import CAUSE_TITLES, Analysis

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


def _utc(ns) -> str:
    if ns is None:
        return "-"
    t = _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d} UTC"


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
                     f'<rect class="{cls}" x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row_h - 5}"/>'
                     f'<text x="{label_w + w + 4:.1f}" y="{y + 12}">{v:,.2f} {escape(unit)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _line_chart(points: list[dict], series: list[tuple[str, str, str]], unit: str,
                windows: list[tuple[float, float]] = (), width=720, height=200) -> Markup:
    """Lines over time: points are dicts with 't_s' and one key per series
    (key, label, css class); windows are shaded (start_s, end_s)."""
    pts = [p for p in points if any(k in p for k, _, _ in series)]
    if len(pts) < 2:
        return Markup("")
    left, right, top, bottom = 56, 10, 10, 34
    tmax = max(p["t_s"] for p in pts) or 1.0
    vals = [p[k] for p in pts for k, _, _ in series if k in p]
    vmin, vmax = min(0.0, min(vals)), max(vals)
    if vmax <= vmin:
        vmax = vmin + 1
    pw, ph = width - left - right, height - top - bottom

    def x(t):
        return left + pw * t / tmax

    def y(v):
        return top + ph * (1 - (v - vmin) / (vmax - vmin))

    parts = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'role="img" xmlns="http://www.w3.org/2000/svg">']
    for s, e in windows:
        parts.append(f'<rect class="window" x="{x(s):.1f}" y="{top}" width="{max(1.0, x(e) - x(s)):.1f}" '
                     f'height="{ph}"/>')
    parts.append(f'<line class="axis" x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}"/>'
                 f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}"/>')
    for frac in (0, 0.5, 1):
        v = vmin + (vmax - vmin) * frac
        parts.append(f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{v:,.1f}</text>')
    for frac in (0, 0.25, 0.5, 0.75, 1):
        parts.append(f'<text x="{x(tmax * frac):.1f}" y="{height - 18}" text-anchor="middle">'
                     f'{tmax * frac:,.0f} s</text>')
    parts.append(f'<text x="{left}" y="{height - 3}">{escape(unit)}; time from the start of the data; '
                 f'shaded: fault windows</text>')
    for key, label, cls in series:
        coords = " ".join(f"{x(p['t_s']):.1f},{y(p[key]):.1f}" for p in pts if key in p)
        parts.append(f'<polyline class="{cls}" points="{coords}"><title>{escape(label)}</title></polyline>')
    parts.append("</svg>")
    return Markup("".join(parts))


def render_html(a: Analysis) -> str:
    t0 = a.start_ns or 0
    windows_s = [((w.start_ns - t0) / 1e9, (w.end_ns - t0) / 1e9) for w in a.windows]
    lateness_chart = _bar_chart(
        [(f"{nl.name}", nl.p90_ms, nl.node_id == a.straggler_node_id) for nl in a.lateness],
        "ms (p90)")
    timeline_series = [("fleet_ms", "median node", "line fleet")]
    if any("suspect_ms" in p for p in a.timeline):
        timeline_series.insert(0, ("suspect_ms", a.straggler or "suspect", "line suspect"))
    timeline_chart = _line_chart(a.timeline, timeline_series, "lateness at collectives, ms",
                                 windows_s)
    transfer_chart = _line_chart(a.timeline, [("transfer_ms", "last arrival to completion",
                                               "line fleet")],
                                 "last arrival to completion, ms (median per bin)", windows_s)
    cause_chart = Markup("")
    if a.cause_series.get("points"):
        cause_chart = _line_chart(
            a.cause_series["points"],
            [("suspect", a.straggler or "suspect", "line suspect"),
             ("others", "other nodes (median)", "line fleet")],
            a.cause_series["metric"], windows_s)
    window_rows = [{"start": _utc(w.start_ns), "end": _utc(w.end_ns),
                    "from_start": f"+{(w.start_ns - t0) / 1e9:.1f} s",
                    "length": f"{(w.end_ns - w.start_ns) / 1e9:.1f} s",
                    "lateness": w.lateness_ms} for w in a.windows]
    tpl = environment().get_template("report.html")
    return tpl.render(a=a, window_rows=window_rows, cause_title=CAUSE_TITLES.get(a.cause or "", ""),
                      cause_titles=CAUSE_TITLES, lateness_chart=lateness_chart,
                      timeline_chart=timeline_chart, transfer_chart=transfer_chart,
                      cause_chart=cause_chart, t0=t0, version=__version__,
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
