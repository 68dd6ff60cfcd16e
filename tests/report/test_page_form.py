"""The page's form: a title that says which job (or --title), one time axis with round
ticks for every chart, units on the y axes, no '-0.0', no empty headers, a chart without
signal replaced by one line, and a summed figure that says it is summed."""

import re

from click.testing import CliRunner

from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.cli import main
from ingero_forensics.report.render import nice_ticks, render_html


def test_nice_ticks():
    assert nice_ticks(0, 21.2, 6) == [0, 5, 10, 15, 20, 25]
    assert nice_ticks(-0.3, 1.1, 4) == [-0.5, 0, 0.5, 1.0, 1.5]
    assert nice_ticks(0, 0) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_title_axes_and_labels(fleets, tmp_path):
    db, truth = fleets("cpu")
    a = analyze_fleet(db)
    page = render_html(a)
    h1 = re.search(r"<h1>(.*?)</h1>", page).group(1)
    assert h1.startswith(f"Job {a.job_ids[0]} · 6 nodes · ") and h1.endswith(" s)")
    assert re.search(r"<title>Job .* · node-\d+</title>", page)
    text = re.sub(r"<[^>]+>", " ", page)
    assert not re.search(r"(?<![\d.])-0(\.0+)?(?![\d.])", text)
    assert "<th></th>" not in page and "<th> </th>" not in page
    # one time axis: every line chart has the same x ticks, round ones, ending in s
    charts = re.findall(r'<svg class="chart".*?</svg>', page, re.S)
    xticks = [re.findall(r'text-anchor="middle">([^<]*) s</text>', c) for c in charts]
    xticks = [t for t in xticks if t]
    assert len(xticks) >= 2 and all(t == xticks[0] for t in xticks)
    step = float(xticks[0][1]) - float(xticks[0][0])
    assert step in (1, 2, 2.5, 5, 10, 20, 25, 50)
    assert all(re.search(r">y: [^<]*(ms|%|MHz|per s)", c) for c in charts if "polyline" in c)
    # nothing slow for everyone in a CPU fault: the transfer chart is one line
    assert a.slow_bins == 0 and "Nothing unusual: no bin was slow" in page
    assert "summed over threads" in page
    # --title replaces the title on the page and in the text form
    out = tmp_path / "r.html"
    r = CliRunner().invoke(main, [str(db), "-o", str(out), "--title", "Run 7 <x>", "-q"])
    assert r.exit_code == 0 and "<h1>Run 7 &lt;x&gt;</h1>" in out.read_text()
    r = CliRunner().invoke(main, [str(db), "--format", "text", "--title", "Run 7"])
    assert r.output.startswith("Straggler report: Run 7\n")


def test_offsets_count_from_where_the_export_counts(fleets, tmp_path):
    """"Seconds from the start of the data" on the page (the windows' offsets, the charts'
    ticks) count from where ingero-export's --from +Ns counts: a window's offset copied
    into --from/--to exports that window's collectives (a review found the page counting
    from the first collective, the export from the first capture start: 29 s apart,
    nothing exported)."""
    import json

    from ingero_forensics.db import connect_readonly
    from ingero_forensics.export.cli import main as export_main
    from ingero_forensics.merge.nodes import data_start

    db, truth = fleets("cpu")
    a = analyze_fleet(db)
    con = connect_readonly(db)
    try:
        start = data_start(con)
    finally:
        con.close()
    assert a.data_start_ns == start
    lead_s = (a.start_ns - start) / 1e9
    assert lead_s > 1.0, "captures start with the job here: the case is not exercised"
    page = render_html(a)
    w = a.windows[0]
    off, end, length = (float(x) for x in re.search(
        r'<td class="num">\+([\d.]+) s to \+([\d.]+) s</td><td class="num">([\d.]+) s</td>',
        page).groups())
    # the offsets rounded down and up: [off, end) covers the window; its length as it is
    assert 0 <= w.start_ns - (start + off * 1e9) < 0.1e9, (off, w.start_ns - start)
    assert start + end * 1e9 >= w.end_ns > start + (end - 0.1) * 1e9
    assert abs(length - (w.end_ns - w.start_ns) / 1e9) <= 0.05 + 1e-9, (length, w)
    # the charts' ticks: the same origin, within the collectives' span
    ticks = [float(t.replace(",", "")) for t in re.findall(
        r'text-anchor="middle">([^<]*) s</text>', re.search(
            r'<svg class="chart".*?</svg>', page, re.S).group(0))]
    step = ticks[1] - ticks[0]
    assert lead_s - step <= ticks[0] and ticks[-1] <= (a.end_ns - start) / 1e9 + step, ticks
    r = CliRunner().invoke(export_main, [str(db), "--chrome-trace", "--from", f"+{off}s",
                                         "--to", f"+{end:.1f}s", "--kinds", "nccl",
                                         "-o", str(tmp_path / "w.json"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["by_kind"]["nccl"] > 0


def test_json_carries_the_title_and_short_windows_keep_their_decimals(fleets):
    """--json's title is the page's (it was empty unless --title was given); a window
    total under a second is not rounded to "0 s"."""
    import json

    from ingero_forensics.report.render import report_title
    from ingero_forensics.report.wording import seconds_text

    db, truth = fleets("cpu")
    a = analyze_fleet(db)
    r = CliRunner().invoke(main, [str(db), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["title"] == report_title(a) != ""
    assert [seconds_text(x) for x in (0.48, 0.044, 3.26, 61.4)] == \
        ["0.48 s", "0.04 s", "3.3 s", "61 s"]


def test_charts_keep_their_colours_without_the_stylesheet(fleets):
    """Mail clients strip or rewrite <style>: every shape of every chart carries its
    colour as an SVG attribute too (a window shade without one turns solid black and
    hides the data), and the legend's swatches are coloured text, not styled boxes."""
    db, _ = fleets("cpu")
    page = render_html(analyze_fleet(db))
    shapes = re.findall(r"<(rect|line|polyline)\b([^>]*)>", page)
    assert len(shapes) > 20
    for tag, attrs in shapes:
        assert re.search(r'\b(fill|stroke)="#[0-9a-f]{3,6}"', attrs), (tag, attrs)
        if tag == "polyline":
            assert 'fill="none"' in attrs, attrs
    swatches = re.findall(r'<b class="sw" style="color:#[0-9a-f]{6}">', page)
    assert len(swatches) >= 2
    assert "<i class=\"sw\"" not in page
