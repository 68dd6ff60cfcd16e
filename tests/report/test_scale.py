"""Diagnosis at 16 nodes (issue: the largest of N nodes' noisy lateness grows with N, and
a network fault's ring neighbour retransmits too). The cases that went wrong before the
size-aware threshold, the cost rule and the per-node network rule, kept from coming
back; bench/bench_accuracy.py sweeps sizes up to 64 nodes."""

import json

import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.simulate import FleetConfig, simulate_fleet


@pytest.mark.slow
@pytest.mark.parametrize("fault, seed", [("none", 31), ("none", 32), ("network", 31),
                                         ("network", 32), ("cpu", 31), ("cpu", 32)])
def test_sixteen_nodes(tmp_path, fault, seed):
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=16, ranks_per_node=4, steps=600,
                                               fault=fault, seed=seed))
    merge_bundles([tmp_path / "b"], tmp_path / "fleet.db")
    truth = json.loads((tmp_path / "b" / "truth.json").read_text())
    a = analyze_fleet(tmp_path / "fleet.db")
    assert a.straggler == truth["fault"]["straggler"], a.verdict
    if fault == "none":
        assert a.stragglers == [] and a.cause is None and a.verdict.startswith("No straggler")
    else:
        assert a.cause == fault and a.cause_confidence == "clear", a.verdict


def test_a_large_fleet_reads_as_a_report(tmp_path):
    """At hundreds of nodes the per-node lists made the report unreadable (1,000 nodes: a
    1,000-row table in the email, a capture-cost sentence naming every node, a bar chart
    18,000 px tall). The text shows the nodes the others waited for most, the chart the
    latest ones, the per-node figures a median and range; the page's table keeps every
    node."""
    import re
    from ingero_forensics.report.render import CHART_NODES, render_html
    from ingero_forensics.report.text import TABLE_NODES, WIDTH, render_text
    nodes = 40
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=nodes, ranks_per_node=1, steps=120,
                                               fault="cpu", straggler=23, seed=5))
    merge_bundles([tmp_path / "b"], tmp_path / "fleet.db")
    a = analyze_fleet(tmp_path / "fleet.db")
    assert [s.node for s in a.stragglers] == ["node-23"], a.verdict
    text = render_text(a)
    assert max(map(len, text.splitlines())) <= WIDTH
    head = f"The {TABLE_NODES} nodes the others waited for most, of {nodes}"
    assert head in text
    after = text.split(head)[1].splitlines()
    start = next(i for i, ln in enumerate(after) if ln.startswith("node "))
    table = after[start:after.index("", start)]
    assert len(table) == 1 + TABLE_NODES and table[1].startswith("node-23 "), table
    assert f"{nodes - TABLE_NODES} more nodes" in " ".join(text.split())
    assert re.search(rf"Capture cost: (median [\d.]+ % of one core over {nodes} nodes|"
                     rf"[\d.]+ % of one core on each of the {nodes} nodes)",
                     " ".join(text.split()))
    page = render_html(a)
    bars = re.findall(r'<rect class="(bar(?: hi)?)"', page)
    assert len(bars) == CHART_NODES and bars[0] == "bar hi"
    assert f"The {CHART_NODES} nodes of {nodes} latest at their p90" in page
    lateness_table = page.split("<h2>Lateness at collectives</h2>")[1].split("</table>")[0]
    assert lateness_table.count("<tr") == 1 + nodes       # every node on the page


def test_names_in_the_order_people_count_and_issues_grouped():
    from ingero_forensics.report.wording import grouped_issues, natural_key, nodes_text
    assert sorted(["gpu-10", "gpu-2", "gpu-1", "a7b", "a10b"], key=natural_key) == \
        ["a7b", "a10b", "gpu-1", "gpu-2", "gpu-10"]
    issues = [{"node": f"gpu-{k}", "source": "nvml", "event": "source_off", "count": 1,
               "message": "NVML off"} for k in range(12, 0, -1)]
    issues.append({"node": "gpu-3", "source": "tcp", "event": "lost_events", "count": 5,
                   "message": "ring buffer full"})
    issues += [{"node": n, "source": "tcp", "event": "unknown", "count": None,
                "message": "lost, not counted"} for n in ("gpu-1", "gpu-2")]
    (nvml, tcp, unknown) = grouped_issues(issues, keep={"gpu-7"})
    assert nvml["node"] == "12 nodes (gpu-1, gpu-2, ..., gpu-12; among them gpu-7)"
    assert nvml["count"] == 12 and tcp["node"] == "gpu-3" and tcp["count"] == 5
    assert unknown["count"] is None         # "how many is unknown", not 0
    (every, _, _) = grouped_issues(issues, every=True)
    assert every["node"] == ", ".join(f"gpu-{k}" for k in range(1, 13))
    assert nodes_text(["b", "a"]) == "a, b"
    from ingero_forensics.report.wording import per_node_text
    same = {f"n{k}": 2.0 for k in range(10)}
    assert per_node_text(same, "of one core") == "2.0 % of one core on each of the 10 nodes"
    spread = {f"n{k}": float(k) for k in range(10)}
    assert per_node_text(spread, "of one core").startswith("median 4.5 % of one core over 10")


def test_small_uncertainties_keep_their_digits():
    """'peak 37.8 ms > 3 x 0.00 ms' read as a zero or a bug: 1.4 us is shown as such."""
    from ingero_forensics.report.wording import ms_text
    assert [ms_text(x) for x in (8.354, 0.0014, 0.01, 0.0)] == \
        ["8.35 ms", "1.4 us", "0.01 ms", "0.00 ms"]
