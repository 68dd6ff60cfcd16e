"""What the report cannot see, said instead of a healthy verdict: ranks no capture saw
(report/coverage.py) and a run with fewer time bins than the straggler rule needs; and
the cited evidence counts what it says it counts."""

import json
import re

import apsw
import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.lateness import MIN_LATE_BINS
from ingero_forensics.simulate import FleetConfig, simulate_fleet


@pytest.fixture(scope="module")
def cpu_fleet(tmp_path_factory):
    """4 nodes x 2 ranks, node-02 CPU-starved the whole run: (bundle dir, truth)."""
    d = tmp_path_factory.mktemp("cpu")
    simulate_fleet(d / "b", FleetConfig(nodes=4, ranks_per_node=2, steps=200, fault="cpu",
                                        seed=1))
    return d / "b", json.loads((d / "b" / "truth.json").read_text())


def _merge(bundle_dir, out, skip=()):
    merge_bundles([p for p in sorted(bundle_dir.glob("*.bundle"))
                   if not any(p.name.startswith(s) for s in skip)], out)
    return out


def test_the_straggler_not_collected_is_not_no_straggler(cpu_fleet, tmp_path):
    bundles, truth = cpu_fleet
    assert truth["fault"]["straggler"] == "node-02" and truth["fault"]["ranks"] == [4, 5]
    a = analyze_fleet(_merge(bundles, tmp_path / "f.db", skip=("node-02",)))
    assert not a.stragglers and a.straggler is None
    assert a.verdict.startswith("Cannot tell whether a node is a straggler"), a.verdict
    assert a.uncaptured["missing"] == [4, 5] and a.uncaptured["nranks"] == 8, a.uncaptured
    assert a.uncaptured["ranks_seen"] == 6
    assert "Ranks 4-5 of the 8" in a.verdict and a.cause_confidence == "none"


def test_a_named_straggler_says_which_ranks_were_not_captured(cpu_fleet, tmp_path):
    bundles, _ = cpu_fleet
    a = analyze_fleet(_merge(bundles, tmp_path / "f.db", skip=("node-00",)))
    assert [s.node for s in a.stragglers] == ["node-02"], a.verdict
    assert a.uncaptured["missing"] == [0, 1]
    assert "Ranks 0-1 of the 8 in the job's largest communicator were not captured" in a.verdict


@pytest.fixture(scope="module")
def lossy_fleet(tmp_path_factory):
    """4 nodes x 2 ranks, node-01's NIC lossy the whole run: (bundle dir, truth)."""
    d = tmp_path_factory.mktemp("lossy")
    simulate_fleet(d / "b", FleetConfig(nodes=4, ranks_per_node=2, steps=150,
                                        fault="network", straggler=1, seed=43))
    return d / "b", json.loads((d / "b" / "truth.json").read_text())


def test_a_lossy_node_not_collected_is_not_blamed_on_its_neighbour(lossy_fleet, tmp_path):
    """From a review: without the lossy node's bundles, its upstream neighbour, whose
    sends into it are resent, was named "network retransmits, clear" (7 fleets of 7).
    Those retransmits go to an address no merged bundle owns: said, not named."""
    bundles, truth = lossy_fleet
    assert (truth["fault"]["straggler"], truth["fault"]["kind"]) == ("node-01", "network")
    a = analyze_fleet(_merge(bundles, tmp_path / "f.db", skip=("node-01",)))
    assert a.straggler is None and a.cause_confidence == "none", a.verdict
    u = a.network_unsure
    assert u is not None and u["node"] == "node-02" and u["unseen"] == u["retransmits"] > 0, u
    assert a.verdict.startswith("Cannot tell whether a node is a straggler"), a.verdict
    assert (f"node-02's job connections retransmitted {u['retransmits']:,} segments, "
            f"{u['unseen']:,} of them towards addresses that no merged bundle owns") \
        in a.verdict and "Ranks 2-3 of the 8" in a.verdict, a.verdict
    assert json.loads(json.dumps(a.to_json()))["network_unsure"] == u


@pytest.mark.parametrize("left_out", [("node-00",), ("node-02",), ("node-03",)])
def test_a_lossy_node_is_named_with_a_neighbour_not_collected(lossy_fleet, tmp_path,
                                                              left_out):
    """The lossy node captured, any other node left out (its upstream or downstream
    neighbour too): its retransmits towards the captured nodes still name it."""
    bundles, _ = lossy_fleet
    a = analyze_fleet(_merge(bundles, tmp_path / "f.db", skip=left_out))
    assert (a.straggler, a.cause, a.cause_confidence) == ("node-01", "network", "clear"), \
        a.verdict
    assert a.network_unsure is None and "not captured" in a.verdict


def test_a_lossy_node_whose_every_peer_is_missing_is_not_named(lossy_fleet, tmp_path):
    """Both ring neighbours left out: the lossy node resends only where no bundle
    shows, to two addresses, which one uncaptured node could own as well (two NICs; a
    review made one missing node's retransmits go to two addresses and its neighbour was
    named again): said, not named."""
    bundles, _ = lossy_fleet
    a = analyze_fleet(_merge(bundles, tmp_path / "f.db", skip=("node-00", "node-02")))
    assert a.straggler is None and a.verdict.startswith("Cannot tell"), a.verdict
    u = a.network_unsure
    assert u is not None and u["node"] == "node-01" and u["unseen_addresses"] == 2, u
    assert "at the uncaptured node or nodes behind those 2 addresses" in a.verdict, a.verdict


def test_retransmits_into_a_missing_node_beside_a_straggler_are_not_said(cpu_fleet,
                                                                          tmp_path):
    """From a review: beside a straggler named for a cause of its own, a node resending
    into an uncaptured one is no finding either way; the verdict said "no node's
    network is named" about it."""
    bundles, _ = cpu_fleet
    db = _merge(bundles, tmp_path / "f.db", skip=("node-03",))
    con = apsw.Connection(str(db))
    nid, sa, pid = con.execute(
        "SELECT p.node_id, p.saddr, p.pid FROM tcp_progress p JOIN nodes n USING (node_id) "
        "WHERE n.name = 'node-01' LIMIT 1").fetchone()
    (bid,) = con.execute("SELECT MIN(bundle_id) FROM bundles WHERE node_id = ?", (nid,)
                         ).fetchone()
    t0, t1 = con.execute("SELECT MIN(first_entry_ns), MAX(last_entry_ns) FROM collectives"
                         ).fetchone()
    with con:
        con.executemany(
            "INSERT INTO tcp_events (timestamp_ns, mono_ns, event, family, saddr, daddr, "
            "sport, dport, state, pid, owner_pid, scope, node_id, bundle_id) VALUES "
            "(?, ?, 'tcp_retransmit_skb', 4, ?, '10.250.0.9', 40001, 29500, "
            "'ESTABLISHED', ?, ?, 'job', ?, ?)",
            [(t, t, sa, pid, pid, nid, bid)
             for t in (t0 + (t1 - t0) * k // 3000 for k in range(3000))])
    con.close()
    a = analyze_fleet(db)
    assert [s.node for s in a.stragglers] == ["node-02"] and a.cause == "cpu", a.verdict
    assert a.network_unsure is None and "network is named" not in a.verdict, a.verdict


def test_no_links_measured_is_not_said_in_a_cannot_tell(tmp_path):
    """From a review: links_unmeasured was true in the JSON while the verdict ("Cannot
    tell", ranks uncaptured) said nothing of links: set only where it is said."""
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=4, ranks_per_node=2, steps=150, seed=3,
                                               tcp_progress=False))
    a = analyze_fleet(_merge(tmp_path / "b", tmp_path / "f.db", skip=("node-02",)))
    assert a.verdict.startswith("Cannot tell") and a.uncaptured, a.verdict
    assert not a.links_unmeasured and "transit was measured" not in a.verdict
    a = analyze_fleet(_merge(tmp_path / "b", tmp_path / "g.db"))
    assert a.verdict.startswith("No straggler") and a.links_unmeasured, a.verdict


def test_every_rank_captured_no_caveat(cpu_fleet, tmp_path):
    bundles, _ = cpu_fleet
    a = analyze_fleet(_merge(bundles, tmp_path / "f.db"))
    assert a.uncaptured is None and "not captured" not in a.verdict
    assert [s.node for s in a.stragglers] == ["node-02"]


def test_bins_too_long_for_the_run_cannot_tell(cpu_fleet, tmp_path):
    """20 s bins over a 50 s run: two bins, both late, 12 % of the run; the rule wants
    three. Not "no straggler"; the bin the verdict suggests answers."""
    bundles, _ = cpu_fleet
    db = _merge(bundles, tmp_path / "f.db")
    a = analyze_fleet(db, bin_s=20)
    assert not a.stragglers
    assert a.bins_limited is not None and a.bins_limited["bins"] < MIN_LATE_BINS, a.verdict
    assert a.bins_limited["nodes"][0] == "node-02"
    assert a.verdict.startswith("Cannot tell whether node-02 is a straggler"), a.verdict
    suggested = float(re.search(r"--bin ([0-9.]+)", a.verdict).group(1))
    b = analyze_fleet(db, bin_s=suggested)
    assert [s.node for s in b.stragglers] == ["node-02"] and b.bins_limited is None


def test_a_run_of_three_steps_cannot_tell(tmp_path):
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=4, ranks_per_node=2, steps=3,
                                               fault="cpu", seed=1))
    a = analyze_fleet(_merge(tmp_path / "b", tmp_path / "f.db"))
    assert a.bins_limited is not None and not a.stragglers, a.verdict
    assert not a.verdict.startswith("No straggler")


def test_clean_short_run_is_still_no_straggler(tmp_path):
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=4, ranks_per_node=2, steps=3,
                                               fault="none", seed=2))
    a = analyze_fleet(_merge(tmp_path / "b", tmp_path / "f.db"))
    assert a.bins_limited is None and a.verdict.startswith("No straggler"), a.verdict


def test_network_evidence_counts_every_connection(tmp_path):
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=4, ranks_per_node=2, steps=200,
                                               fault="network", seed=1))
    db = _merge(tmp_path / "b", tmp_path / "f.db")
    a = analyze_fleet(db)
    assert a.cause == "network", a.verdict
    said = int(re.match(r"([\d,]+) TCP retransmits", a.evidence[0]).group(1).replace(",", ""))
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        conns = con.execute("SELECT COUNT(DISTINCT daddr || ':' || dport) FROM tcp_events "
                            "WHERE node_id = ? AND scope = 'job'", (a.straggler_node_id,)
                            ).fetchone()[0]
        clause = " OR ".join("(timestamp_ns >= ? AND timestamp_ns < ?)" for _ in a.windows)
        want = con.execute(
            f"SELECT COUNT(*) FROM tcp_events WHERE node_id = ? AND scope = 'job' AND event "
            f"= 'tcp_retransmit_skb' AND ({clause})",
            [a.straggler_node_id] + [v for w in a.windows for v in (w.start_ns, w.end_ns)]
        ).fetchone()[0]
    finally:
        con.close()
    assert conns > 5            # more connections than the table of the top five lists
    assert said == want, (said, want)
