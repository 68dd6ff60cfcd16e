"""The C accelerator (_fastslices) writes exactly the bytes of the pure-Python path.

Every test exports the same fleet.db twice, ExportOptions(accel=True) and accel=False
(the Python loops, which are the reference), and compares the bytes: odd strings, NULL
args, non-integer numbers, times before the origin and far after it, overlapping slices
(overflow lanes, flows to them), every option that changes the SQL, gzip, stdout and
--jobs 1 and 2.
"""

import gzip
import importlib.util
import io
import json
import os

import apsw
import pytest
from click.testing import CliRunner

from ingero_forensics.export.chrome_trace import ExportOptions, export_chrome_trace, load_accel
from ingero_forensics.export.cli import main

from .fleetgen import BASE_NS, build_fleet

BUILT = importlib.util.find_spec("ingero_forensics.export._fastslices") is not None
needs_accel = pytest.mark.skipif(not BUILT, reason="the C accelerator is not built here")

ODD = ['quote " and back\\slash', "only back\\slash", 'only "quote"', "ctl \x01\x1f tab\t nl\n cr\r ff\f bs\b",
       "non-ASCII é ü 漢字 😀 \u2028", "del \x7f", "", "{\"json\": [1]}"]


def _odd_fleet(path):
    """A fleet with everything the formatting and the lane allocator must get right."""
    build_fleet(path, nodes=3, ranks_per_node=2, steps=8, cuda_per_step=6)
    con = apsw.Connection(str(path))
    with con:
        x = con.execute
        for i, s in enumerate(ODD):
            x("UPDATE cuda_events SET api = ?, kernel = ? WHERE id % 7 = ?", (s, ODD[-1 - i], i))
            x("UPDATE sched_events SET other_comm = ?, prev_state = ? WHERE id % 6 = ?",
              (s, s[:4] or None, i))
            x("UPDATE nccl_events SET datatype = ? WHERE id % 6 = ?", (s, i))
            x("UPDATE tcp_events SET state = ?, saddr = ? WHERE id % 6 = ?", (s, s, i))
        x("UPDATE block_events SET device = 'nvme\"1\\\\é' WHERE id % 2 = 0")
        x("UPDATE nccl_comm_events SET api = ?, parent_hash = ? WHERE id % 2 = 0",
          (ODD[2], ODD[0]))
        # numbers that are not plain integers: REAL args, a text arg, fractional times
        x("UPDATE cuda_events SET bytes = bytes + 0.5 WHERE id % 5 = 1")
        x("UPDATE cuda_events SET stream = 'stream \"7\"' WHERE id % 9 = 2")
        x("UPDATE cuda_events SET device = 1e300, return_code = -2.25 WHERE id % 13 = 3")
        x("UPDATE cuda_events SET timestamp_ns = timestamp_ns + 0.5 WHERE id % 17 = 4")
        x("UPDATE nccl_events SET timestamp_ns = timestamp_ns + 0.25 WHERE id % 5 = 0")
        x("UPDATE sched_events SET duration_ns = -1000 WHERE id % 4 = 1")   # negative
        # before the origin, far after it (40 days), a huge duration, a huge REAL one
        cols = ("timestamp_ns, duration_ns, api, layer, stream, bytes, memcpy_kind, kernel, "
                "device, return_code, pid, tid, stack_id, node_id, bundle_id, mono_ns")
        for shift, dur in ((-3_000_000_123, None), (40 * 86400 * 10**9, None),
                           (2_000_000, 3 * 10**15), (4_000_000, 2.5e18)):
            dsql = "duration_ns" if dur is None else "?"
            args = () if dur is None else (dur,)
            x(f"INSERT INTO cuda_events ({cols}) SELECT timestamp_ns + {shift}, {dsql}, "
              f"api, layer, stream, bytes, memcpy_kind, kernel, device, return_code, pid, "
              f"tid, stack_id, node_id, bundle_id, mono_ns FROM cuda_events WHERE id % 50 = 3",
              args)
        # one thread's calls touching exactly while lanes are open: [0, 100) [50, 150)
        # [100, 120) [120, 130) [60, 70): ends equal to starts free the lane
        t0 = BASE_NS + 7_000_000
        for start, end in ((0, 100), (50, 150), (100, 120), (120, 130), (60, 70),
                           (130, 160), (150, 155)):
            x("INSERT INTO cuda_events (timestamp_ns, duration_ns, api, layer, pid, tid, "
              "node_id, bundle_id, mono_ns) VALUES (?, ?, 'touch', 'runtime', 77, 77, 1, 1, 1)",
              (t0 + start * 1000, (end - start) * 1000))
        # partial overlaps: NCCL and sched slices onto overflow lanes (flows follow them)
        ncols = [c for c in _columns(con, "nccl_events") if c != "id"]
        sel = ", ".join("timestamp_ns + duration_ns / 2" if c == "timestamp_ns" else c
                        for c in ncols)
        x(f"INSERT INTO nccl_events ({', '.join(ncols)}) SELECT {sel} FROM nccl_events "
          "WHERE id % 5 = 2")
        scols = [c for c in _columns(con, "sched_events") if c != "id"]
        sel = ", ".join("timestamp_ns + 700000" if c == "timestamp_ns" else c for c in scols)
        x(f"INSERT INTO sched_events ({', '.join(scols)}) SELECT {sel} FROM sched_events "
          "WHERE id % 3 = 0")
    con.close()
    return path


def _columns(con, table):
    return [r[1] for r in con.execute(f"PRAGMA table_info({table})")]


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    return _odd_fleet(tmp_path_factory.mktemp("odd") / "fleet.db")


@pytest.fixture(scope="module")
def chunky(tmp_path_factory):
    """More than one 8192-event chunk per node and section."""
    path = tmp_path_factory.mktemp("chunky") / "fleet.db"
    build_fleet(path, nodes=2, ranks_per_node=4, steps=110, cuda_per_step=20)
    return path


def _both(fleet, tmp_path, name="t.json", **opts):
    out = {}
    for accel in (True, False):
        dest = tmp_path / f"{accel}-{name}"
        stats = export_chrome_trace(fleet, dest, ExportOptions(accel=accel, **opts))
        assert stats.accelerated is (accel and BUILT)
        out[accel] = dest.read_bytes()
    return out[True], out[False]


@needs_accel
@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("opts", [
    {},
    {"findings": False, "kinds": frozenset({"cuda", "nccl"})},
    {"start": "+20ms", "end": "+230ms"},
    {"nodes": ("node-00", "node-02")},
    {"ranks": frozenset({1, 2, 3}), "findings": False},
    {"kinds": frozenset({"sched", "block", "tcp"})},
])
def test_same_bytes_on_odd_fleet(odd, tmp_path, opts, jobs):
    fast, slow = _both(odd, tmp_path, jobs=jobs, **opts)
    assert fast == slow
    assert len(fast) > 1000
    events = json.loads(fast)["traceEvents"]
    # the oddities are there to compare, not filtered out before
    if not opts:
        assert any(e.get("name") == ODD[0] for e in events)
        assert any(e.get("tid", 0) >= 1 << 30 and e.get("cat") == "nccl" for e in events
                   if e["ph"] == "X")     # NCCL slices on an overflow lane


@needs_accel
@pytest.mark.parametrize("jobs", [1, 2])
def test_same_bytes_gzip_and_chunks(chunky, tmp_path, jobs):
    fast, slow = _both(chunky, tmp_path, name="t.json.gz", jobs=jobs)
    assert fast == slow
    events = json.loads(gzip.decompress(fast))["traceEvents"]
    cuda_per_node = sum(1 for e in events if e.get("cat") == "cuda" and e["ph"] == "X"
                        and e["pid"] == 1)
    assert cuda_per_node > 8192


@needs_accel
def test_same_bytes_on_stdout(odd):
    outs = []
    for accel in (True, False):
        buf = io.BytesIO()
        stats = export_chrome_trace(odd, None, ExportOptions(accel=accel, jobs=2), stdout=buf)
        assert stats.accelerated is accel
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]


@pytest.fixture(scope="module")
def text_time(tmp_path_factory):
    """A slice bound the C loops leave to Python: a text timestamp, alone on its thread
    (where the Python path, comparing it only with itself, still writes it)."""
    path = tmp_path_factory.mktemp("textts") / "fleet.db"
    build_fleet(path, nodes=2, ranks_per_node=2, steps=4)
    con = apsw.Connection(str(path))
    con.execute("INSERT INTO cuda_events (timestamp_ns, duration_ns, api, layer, pid, tid, "
                "node_id, bundle_id, mono_ns) VALUES ('soon', 5, 'odd', 'runtime', 4242, 4242, "
                "1, 1, 1)")
    con.close()
    return path


@needs_accel
def test_unsupported_values_fall_back_to_python(text_time, tmp_path):
    """A file is redone by the Python path; stdout is checked before anything is written."""
    outs = {}
    for accel in (True, False):
        dest = tmp_path / f"{accel}.json"
        stats = export_chrome_trace(text_time, dest, ExportOptions(accel=accel, jobs=2))
        assert stats.accelerated is False
        outs[accel] = dest.read_bytes()
    assert outs[True] == outs[False]
    assert b'"name":"odd"' in outs[True]
    buf = io.BytesIO()
    stats = export_chrome_trace(text_time, None, ExportOptions(jobs=1), stdout=buf)
    assert stats.accelerated is False
    assert buf.getvalue() == outs[False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["False.json", "True.json"]


def test_accelerator_is_used_when_built(odd, tmp_path):
    """In CI (scripts/test.sh installs gcc) it must be built."""
    if not BUILT:
        assert not os.environ.get("CI"), "the C accelerator was not built"
        pytest.skip("the C accelerator is not built here")
    assert load_accel() is not None
    stats = export_chrome_trace(odd, tmp_path / "t.json", ExportOptions())
    assert stats.accelerated


def test_env_var_turns_it_off(odd, tmp_path, monkeypatch):
    monkeypatch.setenv("INGERO_NO_ACCEL", "1")
    assert load_accel() is None
    stats = export_chrome_trace(odd, tmp_path / "t.json", ExportOptions())
    assert stats.accelerated is False


@needs_accel
def test_cli_same_bytes_with_env_var(odd, tmp_path):
    outs = []
    for env in ({}, {"INGERO_NO_ACCEL": "1"}):
        out = tmp_path / f"t{len(outs)}.json"
        r = CliRunner(env=env).invoke(main, [str(odd), "--chrome-trace", "-o", str(out), "-q",
                                             "--no-findings", "--kinds", "cuda,nccl,tcp"])
        assert r.exit_code == 0, r.output
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


@needs_accel
def test_max_events_same_error(chunky, tmp_path):
    from ingero_forensics.export.chrome_trace import ExportError
    msgs = []
    for accel in (True, False):
        with pytest.raises(ExportError) as e:
            export_chrome_trace(chunky, tmp_path / "t.json",
                                ExportOptions(accel=accel, max_events=5000, jobs=1))
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]
    assert "--max-events 5000" in msgs[0]
    assert list(tmp_path.iterdir()) == []


def test_tcp_endpoints_bracket_ipv6_on_both_paths(tmp_path):
    """An IPv6 endpoint is [addr]:port in the instant's name (fd00::1:22 alone cannot be
    told from an address ending in :22), IPv4 stays addr:port; both paths agree."""
    path = tmp_path / "fleet.db"
    build_fleet(path, nodes=2, ranks_per_node=1, steps=4, cuda_per_step=2)
    con = apsw.Connection(str(path))
    with con:
        t = con.execute("SELECT MIN(timestamp_ns) FROM nccl_events").fetchone()[0]
        for i, (fam, s, d) in enumerate(((6, "fd00:ac::11", "fd00:ac::ff"),
                                         (4, "10.0.0.1", "10.0.0.2"))):
            con.execute("INSERT INTO tcp_events (node_id, bundle_id, timestamp_ns, mono_ns, "
                        "event, family, saddr, daddr, sport, dport, state, scope) VALUES "
                        "(1, 1, ?, ?, 'tcp_retransmit_skb', ?, ?, ?, 22, 55177, "
                        "'ESTABLISHED', 'job')", (t + i, t + i, fam, s, d))
    con.close()
    fast, slow = _both(path, tmp_path, kinds=frozenset({"tcp"}), findings=False)
    assert fast == slow or not BUILT
    names = {e["name"] for e in json.loads(slow)["traceEvents"] if e.get("cat") == "tcp"}
    assert "retransmit [fd00:ac::11]:22 > [fd00:ac::ff]:55177" in names
    assert "retransmit 10.0.0.1:22 > 10.0.0.2:55177" in names
