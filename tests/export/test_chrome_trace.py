import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from ingero_forensics.db import connect_readonly
from ingero_forensics.export.chrome_trace import ExportError, iso_utc, parse_ranks, parse_time
from ingero_forensics.export.cli import main

from .fleetgen import BASE_NS
from .traceval import validate

HERE = Path(__file__).parent


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def export(fleet_path, tmp_path, *args, name="t.json"):
    out = tmp_path / name
    r = run(fleet_path, "--chrome-trace", "-o", out, "-q", *args)
    assert r.exit_code == 0, r.output
    raw = out.read_bytes()
    if name.endswith(".gz"):
        raw = gzip.decompress(raw)
    return json.loads(raw)


@pytest.fixture(scope="module")
def full(fleet, tmp_path_factory):
    path, truth = fleet
    return export(path, tmp_path_factory.mktemp("full")), truth


def test_structure_and_counts_match_fleet(full):
    doc, truth = full
    v = validate(doc)
    c = v["counts"]
    assert c["X"] == (truth["nccl"] + truth["comm"] + truth["cuda_slices"] + truth["sched"]
                      + truth["block"] + truth["windows"])
    assert c["i"] == truth["cuda_instants"] + truth["tcp"]
    assert c["C"] == truth["host"] + truth["stats_groups"]
    assert v["flows"] == truth["flows"]
    counts = doc["metadata"]["counts"]
    assert counts["slices"] == c["X"] and counts["flows"] == truth["flows"]
    assert counts["events"] == c["X"] + c["i"] + c["C"] + 2 * truth["flows"]


def test_process_and_thread_layout(full):
    doc, truth = full
    names = validate(doc)["names"]
    assert names[(1, None, "process_name")] == "node-00 (ranks 0-1)"
    assert names[(2, None, "process_name")] == "node-01 (ranks 2-3)"
    assert names[(1, None, "process_sort_index")] == 1
    assert names[(2, 1000, "thread_name")] == "rank 2 · python (tid 1000)"
    sort = {k[1]: v for k, v in names.items() if k[0] == 1 and k[2] == "thread_sort_index"}
    assert sort[1000] < sort[1001]          # rank 0 above rank 1
    overflow = [n for (p, t, k), n in names.items() if k == "thread_name" and "overlap" in n]
    # one partially overlapping CUDA call + two overflow lanes of concurrent I/O per node
    assert "rank 0 · python (tid 1000) (overlap 1)" in overflow
    assert len(overflow) == truth["overlaps"] + 2 * truth["nodes"]


def test_timestamps_are_exact_nanoseconds_in_fleet_time(full, fleet):
    doc, _ = full
    path, _ = fleet
    origin = doc["metadata"]["origin_utc_ns"]
    assert origin % 1_000_000_000 == 0 and origin <= BASE_NS
    con = connect_readonly(path)
    want = {(r[0], r[1]): (r[2], r[3]) for r in con.execute(
        "SELECT rank, seq, timestamp_ns, duration_ns FROM nccl_events")}
    con.close()
    seen = 0
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "nccl" and "seq" in e["args"]:
            ts_ns, dur_ns = want[(e["args"]["rank"], e["args"]["seq"])]
            assert round(e["ts"] * 1000) + origin == ts_ns
            assert round(e["dur"] * 1000) == dur_ns
            seen += 1
    assert seen == len(want)


def test_lateness_and_straggler_marks(full, fleet):
    doc, truth = full
    path, _ = fleet
    con = connect_readonly(path)
    last = dict(con.execute("SELECT seq, last_rank FROM collectives"))
    con.close()
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "nccl" and "seq" in e["args"]:
            a = e["args"]
            assert a["last_to_arrive"] is (a["rank"] == last[a["seq"]])
            assert a["late_ns"] >= 0 and a["wait_ns"] >= 0
            if a["last_to_arrive"]:
                assert a["wait_ns"] == 0 and a["late_ns"] == a["entry_spread_ns"]
    windows = [e for e in doc["traceEvents"] if e.get("cat") == "straggler"]
    assert len(windows) == truth["windows"]
    assert {e["name"].split(": ")[1] for e in windows} == {f"waiting for rank {r}"
                                                          for r in set(last.values())}
    assert all(e["args"]["last_node"].startswith("node-") for e in windows)


def test_flows_chain_each_collective_across_ranks(full):
    doc, truth = full
    by_id = {}
    slice_at = {(e["pid"], e["tid"], e["ts"]): e for e in doc["traceEvents"]
                if e["ph"] == "X" and e["cat"] == "nccl"}
    for e in doc["traceEvents"]:
        if e["ph"] in ("s", "f"):
            by_id.setdefault(e["id"], {})[e["ph"]] = slice_at[(e["pid"], e["tid"], e["ts"])]
    assert len(by_id) == truth["flows"]
    for pair in by_id.values():
        s, f = pair["s"]["args"], pair["f"]["args"]
        assert s["seq"] == f["seq"] and s["rank"] != f["rank"]
        assert pair["s"]["ts"] <= pair["f"]["ts"]      # arrival order


def test_metadata(full):
    doc, truth = full
    m = doc["metadata"]
    assert m["tool"].startswith("ingero-export ")
    assert [n["name"] for n in m["nodes"]] == ["node-00", "node-01"]
    assert m["nodes"][1]["clock_alignment"]["method"] == "collectives"
    assert m["nodes"][1]["clock_alignment"]["uncertainty_ns"] == 20001
    assert m["origin_utc"] == iso_utc(m["origin_utc_ns"])


def test_deterministic_and_gzip(fleet, tmp_path):
    path, _ = fleet
    a, b, z = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json.gz"
    for out in (a, b, z):
        assert run(path, "--chrome-trace", "-o", out, "-q").exit_code == 0
    assert a.read_bytes() == b.read_bytes()
    assert gzip.decompress(z.read_bytes()) == a.read_bytes()
    z2 = tmp_path / "d.json.gz"
    run(path, "--chrome-trace", "-o", z2, "-q")
    assert z.read_bytes() == z2.read_bytes()


def test_stdout_when_no_output(fleet, tmp_path):
    path, _ = fleet
    r = run(path, "--chrome-trace")
    assert r.exit_code == 0
    assert r.stderr == ""
    ref = tmp_path / "r.json"
    run(path, "--chrome-trace", "-o", ref, "-q")
    assert r.stdout_bytes == ref.read_bytes()


def test_time_window_and_node_and_rank_filters(fleet, tmp_path):
    path, truth = fleet
    doc = export(path, tmp_path, "--from", "+55ms", "--to", "+105ms", "--kinds", "nccl")
    origin = doc["metadata"]["origin_utc_ns"]
    start = BASE_NS  # data start = earliest node capture start
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "nccl" and "seq" in e["args"]:
            t = round(e["ts"] * 1000) + origin
            assert start + 55_000_000 <= t < start + 105_000_000
    seqs = {e["args"]["seq"] for e in doc["traceEvents"] if e.get("cat") == "nccl"
            and "seq" in e.get("args", {})}
    assert seqs == {2}
    doc = export(path, tmp_path, "--nodes", "node-01", name="n.json")
    assert {e["pid"] for e in doc["traceEvents"] if e["ph"] != "M"} <= {2, 3}
    assert 2 in {e["pid"] for e in doc["traceEvents"]}      # pid stays the node's own
    doc = export(path, tmp_path, "--ranks", "0", "--kinds", "cuda", name="r.json")
    tids = {e["tid"] for e in doc["traceEvents"] if e["ph"] in "Xi"}
    assert 1000 in tids and 1001 not in tids
    doc = export(path, tmp_path, "--kinds", "host", name="h.json")
    assert {e["ph"] for e in doc["traceEvents"]} == {"C", "M"}
    assert sum(e["ph"] == "C" for e in doc["traceEvents"]) == truth["host"]


def test_iso_from_equals_offset(fleet, tmp_path):
    path, _ = fleet
    a = export(path, tmp_path, "--from", "+55ms", name="a.json")
    b = export(path, tmp_path, "--from", iso_utc(BASE_NS + 55_000_000), name="b.json")
    assert a["traceEvents"] == b["traceEvents"]


def test_max_events_refuses_and_writes_nothing(fleet, tmp_path):
    path, _ = fleet
    out = tmp_path / "keep.json"
    out.write_text("previous")
    r = run(path, "--chrome-trace", "-o", out, "--max-events", "10")
    assert r.exit_code == 1
    assert r.stderr.startswith(f"Error: {path}: the export would hold ")
    assert r.stderr.endswith("more than --max-events 10; narrow it with --from/--to, --nodes, "
                             "--ranks or --kinds, or raise --max-events\n")
    assert out.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.json"]


def test_bad_inputs_are_one_line_errors(fleet, tmp_path, bundle_path):
    path, _ = fleet
    cases = [
        ((tmp_path / "none.db", "--chrome-trace"), f"Error: {tmp_path / 'none.db'}: no such file\n"),
        ((bundle_path, "--chrome-trace"),
         f"Error: {bundle_path}: is a bundle, not a fleet.db: merge first (ingero-merge "
         "BUNDLES -o fleet.db), then use fleet.db\n"),
        ((path, "--chrome-trace", "--nodes", "node-99"),
         f"Error: {path}: no node named node-99 (nodes: node-00, node-01)\n"),
        ((path, "--chrome-trace", "--ranks", "99"),
         f"Error: {path}: no rank 99 (ranks: 0-3)\n"),
        ((path, "--chrome-trace", "-o", tmp_path / "no" / "x.json"),
         f"Error: {tmp_path / 'no' / 'x.json'}: directory {tmp_path / 'no'} does not exist\n"),
    ]
    for args, err in cases:
        r = run(*args)
        assert r.exit_code == 1, (args, r.output)
        assert r.stderr == err
    other = tmp_path / "other.db"
    con = __import__("apsw").Connection(str(other))
    con.execute("CREATE TABLE t (a)")
    con.close()
    r = run(other, "--chrome-trace")
    assert r.stderr == (f"Error: {other}: not a fleet.db (a SQLite database with "
                        "application_id 0x0, not ingero-merge's); merge first (ingero-merge "
                        "BUNDLES -o fleet.db)\n")


def test_usage_errors(fleet):
    path, _ = fleet
    # a bad time, or --to not after --from, is a bad option: exit 2, one line
    for args, err in [
        (("--from", "yesterday"),
         "Error: --from: time 'yesterday': not ISO 8601 UTC (2025-01-31T12:00:00Z) nor an "
         "offset from the start of the data (+30s, +2m)\n"),
        (("--to", "-5s"), "Error: --to: time '-5s': offsets look like +30s, +2m, +1.5h "
                          "(units ns, us, ms, s, m, h, d)\n"),
        (("--from", "+2s", "--to", "+1s"),
         f"Error: --to ({iso_utc(BASE_NS + 10**9)}) is not after --from "
         f"({iso_utc(BASE_NS + 2 * 10**9)})\n"),
        (("--from", iso_utc(BASE_NS + 2 * 10**9), "--to", "+2s"),
         f"Error: --to ({iso_utc(BASE_NS + 2 * 10**9)}) is not after --from "
         f"({iso_utc(BASE_NS + 2 * 10**9)})\n"),
    ]:
        r = run(path, "--chrome-trace", *args)
        assert r.exit_code == 2, (args, r.output)
        assert r.stderr == err and r.stdout == ""
    r = run(path, "--chrome-trace", "--kinds", "nccl,gpu")
    assert r.exit_code == 2 and "unknown kind gpu" in r.stderr
    r = run(path, "--chrome-trace", "--ranks", "a-b")
    assert r.exit_code == 2 and "--ranks" in r.stderr
    r = run(path)
    assert r.exit_code == 2 and "--chrome-trace" in r.stderr


def test_help_and_version():
    r = run("--help")
    assert r.exit_code == 0 and "Example:" in r.stdout and "Exit codes" in r.stdout
    assert run("--version").stdout.startswith("ingero-export ")


def test_json_summary(fleet, tmp_path):
    path, truth = fleet
    r = run(path, "--chrome-trace", "-o", tmp_path / "s.json", "--json")
    s = json.loads(r.stdout)
    assert s["flows"] == truth["flows"] and s["bytes"] == (tmp_path / "s.json").stat().st_size
    assert s["json_bytes"] == s["bytes"]
    # gzip: bytes is the file's size, json_bytes the text inside it; the line says both
    r = run(path, "--chrome-trace", "-o", tmp_path / "s.json.gz", "--json")
    z = json.loads(r.stdout)
    assert z["bytes"] == (tmp_path / "s.json.gz").stat().st_size < z["json_bytes"]
    assert z["json_bytes"] == len(gzip.decompress((tmp_path / "s.json.gz").read_bytes()))
    r = run(path, "--chrome-trace", "-o", tmp_path / "t.json.gz")
    assert "of JSON, gzipped" in r.stderr, r.stderr


@pytest.mark.parametrize("text, want", [
    ("+30s", 30 * 10**9), ("+2m", 120 * 10**9), ("+1.5h", 5400 * 10**9),
    ("+250us", 250_000), ("+0.000000001s", 1),
])
def test_parse_offsets(text, want):
    assert parse_time(text, 10**18) == 10**18 + want


def test_parse_iso_keeps_nanoseconds():
    assert parse_time("2025-01-04T14:13:20.123456789Z", 0) == 1_736_000_000_123_456_789
    assert parse_time("2025-01-04T15:13:20.5+01:00", 0) == 1_736_000_000_500_000_000
    with pytest.raises(ExportError):
        parse_time("-5s", 0)


def test_parse_ranks():
    assert parse_ranks("0-3,8") == {0, 1, 2, 3, 8}
    with pytest.raises(ExportError):
        parse_ranks("3-1")


def _engine():
    d = os.environ.get("INGERO_TRACE_ENGINE",
                       "/opt/ingero-trace-engine/node_modules/@paulirish/trace_engine")
    return d if shutil.which("node") and Path(d, "models/trace/trace.js").exists() else None


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_devtools_trace_engine_loads_it(fleet, tmp_path, name):
    """A real consumer: Chrome DevTools' Performance-panel trace engine.

    scripts/test.sh installs it (npm) and sets INGERO_TRACE_ENGINE; without it this test
    fails rather than skips, so a run that did not check a real consumer is not green."""
    if _engine() is None:
        pytest.fail("Chrome DevTools trace engine not installed: run scripts/test.sh, or "
                    "npm install --prefix /opt/ingero-trace-engine @paulirish/trace_engine@0.0.65")
    path, truth = fleet
    out = tmp_path / name
    assert run(path, "--chrome-trace", "-o", out, "-q").exit_code == 0
    res = subprocess.run(["node", str(HERE / "devtools_check.mjs"), str(out), _engine()],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    con = connect_readonly(path)
    q = lambda sql: con.execute(sql).fetchone()[0]  # noqa: E731
    want_slices = (q("SELECT COUNT(*) FROM nccl_events") + q("SELECT COUNT(*) FROM nccl_comm_events")
                   + q("SELECT COUNT(*) FROM cuda_events WHERE duration_ns IS NOT NULL")
                   + q("SELECT COUNT(*) FROM sched_events") + q("SELECT COUNT(*) FROM block_events")
                   + q("SELECT COUNT(*) FROM collectives WHERE entry_spread_ns > 0"))
    want_flows = q("SELECT COUNT(*) FROM nccl_events") - q("SELECT COUNT(*) FROM collectives")
    want_counters = q("SELECT COUNT(*) FROM host_samples") + q(
        "SELECT COUNT(*) FROM (SELECT DISTINCT node_id, source, name, interval_start_ns "
        "FROM event_stats)")
    con.close()
    assert got["slices"] == want_slices
    assert got["flows"] == want_flows and got["flowSizes"] == [2]
    assert got["counters"] == want_counters
    assert got["processNames"]["1"] == "node-00 (ranks 0-1)"
    named = {(t["pid"], t["tid"]): t["name"] for t in got["threads"]}
    assert named[(1, 1000)] == "rank 0 · python (tid 1000)"


def test_sampled_launch_counts_are_rates_over_the_time_they_counted(fleet, tmp_path):
    """event_stats.observed_ns (the capture's --launch-budget): a counter is the count
    over the time the probes counted, and an interval they did not count (observed_ns
    0, count 0) gives no counter sample rather than a false zero."""
    import shutil

    import apsw

    path = tmp_path / "sampled.db"
    shutil.copyfile(fleet[0], path)
    con = apsw.Connection(str(path))
    try:
        (t0, t1), = con.execute("SELECT interval_start_ns, interval_end_ns FROM event_stats "
                                "WHERE node_id = 1 ORDER BY interval_start_ns LIMIT 1")
        first, second = (t0, t1), (t1, 2 * t1 - t0)
        con.execute("DELETE FROM event_stats WHERE node_id = 1 AND interval_start_ns IN (?, ?)",
                    (first[0], second[0]))
        span = first[1] - first[0]
        for (a, b), count, observed, pid in ((first, 300, span // 4, 1000),
                                             (second, 0, 0, None)):
            con.execute("INSERT INTO event_stats (node_id, bundle_id, mono_ns, "
                        "interval_start_ns, interval_end_ns, source, name, pid, tid, count, "
                        "observed_ns) VALUES (1, 1, 1, ?, ?, 'cuda', 'cudaLaunchKernel', ?, ?, "
                        "?, ?)", (a, b, pid, pid, count, observed))
    finally:
        con.close()
    doc = export(path, tmp_path)
    node1 = next(e["pid"] for e in doc["traceEvents"]
                 if e["ph"] == "M" and e.get("name") == "process_name"
                 and e["args"]["name"].startswith("node-00"))
    launches = sorted((e["ts"], e["args"]["value"]) for e in doc["traceEvents"]
                      if e["ph"] == "C" and e["pid"] == node1
                      and e["name"] == "cuda cudaLaunchKernel calls/s")
    # the first interval: 300 launches in the quarter it counted; the second: none shown
    assert launches[0][1] == pytest.approx(300 * 4e9 / span)
    assert launches[1][0] - launches[0][0] == pytest.approx(2 * span / 1e3), launches[:3]
    con = connect_readonly(path)
    try:
        (intervals,), = con.execute("SELECT COUNT(DISTINCT interval_start_ns) FROM event_stats "
                                    "WHERE node_id = 1 AND name = 'cudaLaunchKernel'")
    finally:
        con.close()
    assert len(launches) == intervals - 1


def test_dash_is_stdout_and_an_empty_selection_warns(fleet, tmp_path, monkeypatch):
    """-o - wrote a file named '-' (a review); a selection that leaves nothing (nodes and
    ranks that share nothing) wrote an empty trace without a word."""
    path, truth = fleet
    monkeypatch.chdir(tmp_path)
    r = run(path, "--chrome-trace", "-o", "-", "--kinds", "nccl")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["traceEvents"] and not (tmp_path / "-").exists()
    assert "warning" not in r.stderr
    # --json summarises a file; on stdout it would be lost behind the trace: refused
    for out in (["-o", "-"], []):
        r = run(path, "--chrome-trace", *out, "--json")
        assert r.exit_code == 2 and "give the trace a file with -o" in r.stderr, r.output
        assert r.stdout == ""
    nodes = json.loads(run(path, "--chrome-trace", "--kinds", "nccl").stdout)["metadata"]["nodes"]
    first, last = nodes[0], nodes[-1]
    r = run(path, "--chrome-trace", "-o", tmp_path / "e.json", "--nodes", first["name"],
            "--ranks", str(last["ranks"][0]))
    assert r.exit_code == 0, r.output
    assert "the selection leaves no event" in r.stderr
