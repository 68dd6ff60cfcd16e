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
