"""The real pipeline: ingero-simulate -> ingero-merge -> ingero-export, then validation."""

import json
import subprocess
import sys

from ingero_forensics.db import connect_readonly
from ingero_forensics.report import analyze_fleet

from .traceval import validate


def _cli(module, *args):
    code = f"import sys; from {module} import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_simulated_fleet_exports_valid_trace(tmp_path):
    sim, fleet, out = tmp_path / "sim", tmp_path / "fleet.db", tmp_path / "t.json.gz"
    r = _cli("ingero_forensics.simulate.cli", "-o", sim, "--nodes", 2, "--ranks-per-node", 2,
             "--steps", 20, "--fault", "cpu")
    assert r.returncode == 0, r.stderr
    r = _cli("ingero_forensics.merge.cli", sim, "-o", fleet)
    assert r.returncode == 0, r.stderr
    r = _cli("ingero_forensics.export.cli", fleet, "--chrome-trace", "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    import gzip
    doc = json.loads(gzip.decompress(out.read_bytes()))
    v = validate(doc)
    con = connect_readonly(fleet)
    q = lambda sql: con.execute(sql).fetchone()[0]  # noqa: E731
    # the report names node-00 (the cpu fault: a two-node fleet) and the export marks its
    # windows, one slice each
    a = analyze_fleet(fleet)
    assert a.straggler == json.loads((sim / "truth.json").read_text())["fault"]["straggler"]
    findings = [e for e in doc["traceEvents"] if e.get("cat") == "finding"]
    assert len(findings) == len(a.windows) >= 1
    assert v["counts"]["X"] == len(findings) + (
        q("SELECT COUNT(*) FROM nccl_events") + q("SELECT COUNT(*) FROM nccl_comm_events")
        + q("SELECT COUNT(*) FROM cuda_events WHERE duration_ns IS NOT NULL")
        + q("SELECT COUNT(*) FROM sched_events") + q("SELECT COUNT(*) FROM block_events")
        + q("SELECT COUNT(*) FROM collectives WHERE entry_spread_ns > 0"))
    assert v["flows"] == q("SELECT COUNT(*) FROM nccl_events WHERE comm_id_hash IS NOT NULL "
                           "AND seq IS NOT NULL") - q("SELECT COUNT(*) FROM collectives")
    assert v["counts"]["C"] >= q("SELECT COUNT(*) FROM host_samples")
    assert [n["name"] for n in doc["metadata"]["nodes"]] == ["node-00", "node-01"]
    con.close()
