"""A node whose reads are pages it had evicted is short of memory, not of disk
(evidence._reads_are_refaults, docs/report.md rule 5). The real-kernel proof is tests/rig
(scenario "memory": a job limited to 12 MiB under a 32 MiB memory-mapped shard); here the
rule's edges on a simulated block I/O fault, its straggler's job cgroup given refaults
(host_samples rows, as a capture writes them) at a share of its own block reads."""

import apsw
import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.merge.summaries import JOB_BLOCK, write_summaries
from ingero_forensics.report import analyze_fleet
from ingero_forensics.simulate import FleetConfig, simulate_fleet

STRAGGLER = "node-02"
CGROUP = "/slurm/job_42"


@pytest.fixture(scope="module")
def io_fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("refaults")
    simulate_fleet(d / "b", FleetConfig(nodes=6, ranks_per_node=2, steps=150, seed=5,
                                        fault="io", straggler=2))
    merge_bundles([d / "b"], d / "fleet.db")
    return d / "fleet.db"


def _with_refaults(tmp_path, io_fleet, share: float, node: str = STRAGGLER,
                   job_share: float | None = None):
    """The fleet, with node's job cgroup reading back ``share`` of the straggler's job
    block reads in its windows (bytes per second, at every sample over the whole run).
    ``job_share``: the job cgroup reads back that share, and the node as a whole
    ``share`` (another tenant's refaults on top); None: only the job's rows."""
    base = analyze_fleet(io_fleet)
    assert base.straggler == STRAGGLER and base.cause == "io", base.verdict
    path = tmp_path / "fleet.db"
    path.write_bytes(io_fleet.read_bytes())
    con = apsw.Connection(str(path))
    (sid,) = con.execute("SELECT node_id FROM nodes WHERE name = ?", (STRAGGLER,)).fetchone()
    (nid,) = con.execute("SELECT node_id FROM nodes WHERE name = ?", (node,)).fetchone()
    read = secs = 0
    for w in base.windows:
        read += con.execute(
            f"SELECT COALESCE(SUM(b.bytes), 0) FROM block_events b WHERE b.node_id = ? "
            f"AND b.op = 'read' AND b.timestamp_ns BETWEEN ? AND ? AND {JOB_BLOCK}",
            (sid, w.start_ns, w.end_ns)).fetchone()[0]
        secs += (w.end_ns - w.start_ns) / 1e9
    assert read > 0
    rate = read / secs
    with con:
        # at the node's own sample times (those of its CPU pressure)
        job = share if job_share is None else job_share
        rows = [("vm.job.refault_bytes_per_s", CGROUP, job * rate),
                ("vm.job.pgmajfault_per_s", CGROUP, job * rate / 4096 * 1.2),
                ("mem.job.usage_bytes", CGROUP, 23.9 * 2**20),
                ("mem.job.limit_bytes", CGROUP, 24 * 2**20)]
        if job_share is not None:
            rows.append(("vm.refault_bytes_per_s", None, share * rate))
        for metric, device, value in rows:
            if metric == "vm.refault_bytes_per_s":
                con.execute("DELETE FROM host_samples WHERE node_id = ? AND metric = ?",
                            (nid, metric))
            con.execute(
                "INSERT INTO host_samples (node_id, bundle_id, timestamp_ns, mono_ns, metric, "
                "device, value) SELECT node_id, bundle_id, timestamp_ns, mono_ns, ?, ?, ? "
                "FROM host_samples WHERE node_id = ? AND metric = 'psi.cpu.some_pct'",
                (metric, device, value, nid))
        write_summaries(con)
    con.close()
    return analyze_fleet(path)


def test_reads_that_are_refaults_are_memory(tmp_path, io_fleet):
    a = _with_refaults(tmp_path, io_fleet, share=0.8)
    assert a.straggler == STRAGGLER and a.cause == "memory", a.verdict
    assert a.cause_confidence == "clear", a.verdict
    io = [s for s in a.signals if s.cause == "io"]
    assert io and all(s.score == 0 for s in io)
    assert any("pages the job had evicted" in s.name and "80% of its job's block reads"
               in s.name for s in io), [s.name for s in io]
    assert any(CGROUP in e and "24.0 MiB limit" in e for e in a.evidence), a.evidence
    assert "raise the limit" in a.next_step and CGROUP in a.next_step
    assert a.cause_series["metric"] == "vm.job.refault_bytes_per_s"


def test_another_tenants_refaults_do_not_hide_a_slow_disk(tmp_path, io_fleet):
    """The node reads back as much as its job reads from disk, but the job's own cgroup
    reads back nothing: the refaults are another tenant's, the disk stays the cause."""
    a = _with_refaults(tmp_path, io_fleet, share=1.0, job_share=0.0)
    assert a.straggler == STRAGGLER and a.cause == "io", a.verdict
    assert not any("memory's symptom" in s.name for s in a.signals)


def test_the_nodes_refaults_decide_where_no_job_cgroup_was_read(tmp_path, io_fleet):
    """A node whose job lives in no cgroup of its own (a machine of its own): its
    node-wide refaults stand in, and the note says whose they are."""
    path = tmp_path / "node-wide"
    path.mkdir()
    _with_refaults(path, io_fleet, share=0.8, job_share=0.0)
    con = apsw.Connection(str(path / "fleet.db"))
    with con:
        con.execute("DELETE FROM host_samples WHERE metric LIKE '%.job.%'")
        write_summaries(con)
    con.close()
    a = analyze_fleet(path / "fleet.db")
    assert a.straggler == STRAGGLER and a.cause == "memory", a.verdict
    assert any("pages the node had evicted" in s.name for s in a.signals)
    assert a.cause_series["metric"] == "vm.refault_bytes_per_s"


def test_refaults_at_the_rigs_share_of_the_reads_are_memory(tmp_path, io_fleet):
    """On the rig's milder memory limit refaults were 0.49-0.53 of the job's block reads
    (readahead brings in pages that were not refaulted with those that were); at the old
    bar of a half, a run at 0.49 was named "block I/O, clear"."""
    a = _with_refaults(tmp_path, io_fleet, share=0.45)
    assert a.straggler == STRAGGLER and a.cause == "memory", a.verdict
    assert all(s.score == 0 for s in a.signals if s.cause == "io"), a.signals


def test_refaults_a_third_of_the_reads_leave_the_disk_the_cause(tmp_path, io_fleet):
    """Refaults a third of the reads: most of them were the disk's to serve anyway."""
    a = _with_refaults(tmp_path, io_fleet, share=0.3)
    assert a.straggler == STRAGGLER and a.cause == "io", a.verdict
    assert not any("memory's symptom" in s.name for s in a.signals)


def test_another_nodes_refaults_change_nothing(tmp_path, io_fleet):
    a = _with_refaults(tmp_path, io_fleet, share=0.8, node="node-04")
    assert a.straggler == STRAGGLER and a.cause == "io", a.verdict
    assert a.cause_confidence == "clear"
