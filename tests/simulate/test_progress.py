"""The simulated ring's tcp_progress rows (simulate/progress.py): the capture's grid, both
ends of each hop, causality in true time, and what the merge makes of them."""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict

import apsw
import pytest

from ingero_forensics.capture.ebpf import progress as bpf_progress
from ingero_forensics.merge import merge_bundles
from ingero_forensics.simulate.progress import SLICE, next_mark

_COLS = ("timestamp_ns, direction, saddr, sport, daddr, dport, connected_ns, "
         "stream_offset, bytes, pid, tid")


def test_next_mark_is_the_capture_s(tmp_path):
    """The simulator's grid is the BPF program's, compiled from its own text."""
    src = next(v for v in vars(bpf_progress).values()
               if isinstance(v, str) and "next_mark(u64 last)" in v)
    body = re.search(r"static __always_inline u64 next_mark\(u64 last\) \{.*?\n\}", src,
                     re.S).group(0).replace("static __always_inline", "static")
    values = [0, 1, 2, 65535, 65536, 65537, (1 << 21) - 1, 1 << 21, (1 << 21) + 1,
              123_456_789, (1 << 34) - 7, 1 << 39, (1 << 40) + 12345, 1 << 50, (1 << 62) + 3]
    values += [(k * 2654435761) % (1 << 45) for k in range(1, 200)]
    c = tmp_path / "mark.c"
    c.write_text("#include <stdio.h>\n#include <stdint.h>\ntypedef uint64_t u64;\n" + body
                 + "\nint main(void) { unsigned long long v;\n"
                 "  while (scanf(\"%llu\", &v) == 1) printf(\"%llu\\n\", "
                 "(unsigned long long)next_mark(v));\n  return 0; }\n")
    exe = tmp_path / "mark"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(c)], check=True)
    out = subprocess.run([str(exe)], input="\n".join(map(str, values)), text=True,
                         capture_output=True, check=True).stdout.split()
    assert [int(x) for x in out] == [next_mark(v) for v in values]


def _rows(fleet):
    """{node: [row dict]} of every node's tcp_progress."""
    out = {}
    for node in fleet.bundles:
        out[node] = [dict(zip([c.strip() for c in _COLS.split(",")], r))
                     for r in fleet.q(node, f"SELECT {_COLS} FROM tcp_progress")]
    return out


def _hops(rows):
    """{4-tuple of the sender: (sending node, its rows, receiving node, its rows)}."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for node, rs in rows.items():
        for r in rs:
            if r["direction"] == "send":
                sends[(r["saddr"], r["sport"], r["daddr"], r["dport"])].append((node, r))
            else:
                recvs[(r["daddr"], r["dport"], r["saddr"], r["sport"])].append((node, r))
    assert sends.keys() == recvs.keys()
    out = {}
    for key in sends:
        snodes = {n for n, _ in sends[key]}
        rnodes = {n for n, _ in recvs[key]}
        assert len(snodes) == 1 and len(rnodes) == 1 and snodes != rnodes
        out[key] = (snodes.pop(), [r for _, r in sends[key]], rnodes.pop(),
                    [r for _, r in recvs[key]])
    return out


def test_each_hop_of_the_ring_has_a_sending_and_a_receiving_end(make_fleet):
    f = make_fleet()
    hops = _hops(_rows(f))
    names = sorted(f.bundles)
    # the ring: node k sends to node k+1, and receives from node k-1
    assert sorted((s, r) for s, _, r, _ in hops.values()) == sorted(
        (names[k], names[(k + 1) % len(names)]) for k in range(len(names)))
    ring = {n["name"]: n for n in f.truth["nodes"]}
    for s, srows, r, rrows in hops.values():
        assert {x["saddr"] for x in srows} == {ring[s]["address"]}
        assert {x["saddr"] for x in rrows} == {ring[r]["address"]}
        # the last local rank sends, the first receives; each end has one establishment
        assert {x["pid"] for x in srows} == {ring[s]["pids"][-1]}
        assert {x["pid"] for x in rrows} == {ring[r]["pids"][0]}
        assert len({x["connected_ns"] for x in srows}) == 1
        assert len({x["connected_ns"] for x in rrows}) == 1
        assert {x["direction"] for x in rrows} == {"arrive", "recv"}


def test_both_ends_write_rows_for_the_same_grid_positions(make_fleet):
    """Past the first 16 MiB the grid is at least a slice apart: every grid position the
    stream reached has exactly one row of each kind covering it, on both ends."""
    f = make_fleet()
    for _s, srows, _r, rrows in _hops(_rows(f)).values():
        end = max(x["stream_offset"] + x["bytes"] for x in srows)
        marks, m = [], 16 << 20
        while m < end - SLICE:
            marks.append(m)
            m = next_mark(m)
        assert len(marks) > 100
        for kind, rows in (("send", srows), ("arrive", rrows), ("recv", rrows)):
            spans = sorted((x["stream_offset"], x["stream_offset"] + x["bytes"])
                           for x in rows if x["direction"] == kind)
            for m in marks:
                cover = [sp for sp in spans if sp[0] <= m < sp[1]]
                assert len(cover) == 1, (kind, m, cover)


def test_bytes_arrive_after_they_were_sent_in_true_time(make_fleet):
    """Each arrival is after the sender's latest row below its end, in true time (the
    message constraint the merge relies on), by a healthy link's transit."""
    f = make_fleet()
    transits = []
    for s, srows, r, rrows in _hops(_rows(f)).values():
        sends = sorted((x["stream_offset"], f.true_ns(s, x["timestamp_ns"])) for x in srows)
        for x in rrows:
            end = x["stream_offset"] + x["bytes"]
            below = [t for off, t in sends if off < end]
            if not below:
                continue
            latest = max(below)
            t = f.true_ns(r, x["timestamp_ns"])
            assert t > latest, (x, latest)
            if x["direction"] == "arrive":
                transits.append(t - latest)
    transits.sort()
    med = transits[len(transits) // 2]
    assert len(transits) > 300
    # a 512 KiB send slice takes ~12 us at the ring's rate; the wire 6-26 us more
    assert 5_000 < med < 200_000, med


def test_rows_are_as_few_as_the_capture_s(make_fleet):
    """Per end and kind: at most one row per grid position reached plus one an interval
    (1 s) of the job, as the capture writes them."""
    f = make_fleet()
    job_s = (f.truth["job"]["end_utc_ns"] - f.truth["job"]["start_utc_ns"]) / 1e9
    for _s, srows, _r, rrows in _hops(_rows(f)).values():
        end = max(x["stream_offset"] + x["bytes"] for x in srows)
        marks, m = 0, next_mark(0)
        while m < end:
            marks, m = marks + 1, next_mark(m)
        for kind, rows in (("send", srows), ("arrive", rrows), ("recv", rrows)):
            n = sum(1 for x in rows if x["direction"] == kind)
            assert marks // 8 < n <= marks + job_s + 1, (kind, n, marks, job_s)


def test_no_tcp_progress_writes_none(make_fleet):
    f = make_fleet(tcp_progress=False)
    for node in f.bundles:
        assert f.q(node, "SELECT COUNT(*) FROM tcp_progress")[0][0] == 0
        # and the rest of the fleet is the same as with them
    g = make_fleet()
    for node in f.bundles:
        for table in ("nccl_events", "cuda_events", "sched_events", "host_samples"):
            q = f"SELECT COUNT(*), SUM(timestamp_ns % 1000000007) FROM {table}"
            assert f.q(node, q) == g.q(node, q)


@pytest.mark.parametrize("fault", ["network", "none"])
def test_the_merge_pairs_them_and_stays_within_truth(make_fleet, tmp_path, fault):
    """The merge takes the hops' pairs as clock bounds (clock_alignment.message_pairs)
    for every node; aligned collectives agree with truth across nodes to a few us, as
    without them."""
    kw = dict(fault=fault, straggler=2) if fault != "none" else {}
    errors = {}
    for progress in (True, False):
        f = make_fleet(ntp_step=True, tcp_progress=progress, **kw)
        db = tmp_path / f"fleet-{progress}.db"
        merge_bundles(sorted(f.dir.glob("*.bundle")), db)
        con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
        pairs = dict(con.execute("SELECT n.name, a.message_pairs FROM clock_alignment a "
                                 "JOIN nodes n USING (node_id)").fetchall())
        if progress:
            assert all(v and v > 10 for v in pairs.values()), pairs
        else:
            assert not any(pairs.values()), pairs
        med = {}
        for name in f.bundles:
            c = f.node_truth(name)["clock"]["true_utc_of_mono"]
            errs = sorted(e for (e,) in con.execute(
                "SELECT (e.timestamp_ns - :boot) - e.mono_ns * :rate FROM nccl_events e "
                "JOIN nodes n USING (node_id) WHERE n.name = :n",
                {"boot": c["boot_utc_ns"], "rate": c["rate"], "n": name}))
            med[name] = errs[len(errs) // 2]
        con.close()
        common = sorted(med.values())[len(med) // 2]
        errors[progress] = max(abs(v - common) for v in med.values())
    assert errors[True] < 20_000, errors


def test_ports_are_ports_whatever_the_fleet_size(make_fleet):
    """The job's ports do not grow with the node index (a 1,024-node fleet's would have
    passed 65535): every row's ports are valid, the same on every node."""
    f = make_fleet(fault="network", straggler=2)
    ports = set()
    for node in f.bundles:
        for table in ("tcp_progress", "tcp_events"):
            ports |= {p for row in f.q(node, f"SELECT sport, dport FROM {table}")
                      for p in row}
    assert ports and all(0 < p < 65536 for p in ports)
    send = {r for node in f.bundles for r in f.q(
        node, "SELECT sport, dport FROM tcp_progress WHERE direction = 'send'")}
    assert len(send) == 1, send
