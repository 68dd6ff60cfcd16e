"""The capture's cost on the page: its own CPU time always, its BPF programs' in-kernel
run time only where the bundles recorded it (capture.bpf_cpu_pct)."""

import json
import shutil
import sqlite3
import subprocess

from ingero_forensics.merge.summaries import write_summaries

from .conftest import build_fleet


def report(db, *args):
    return subprocess.run(["ingero-report", str(db), *args], check=True,
                          capture_output=True, text=True).stdout


def test_bpf_run_time_shown_only_where_recorded(tmp_path):
    db, _ = build_fleet(tmp_path, "none", nodes=4, steps=80)
    plain = json.loads(report(db, "--json"))
    assert plain["capture_cost"] and set(plain["capture_cost"]) <= {
        f"node-{i:02d}" for i in range(4)}
    assert plain["capture_bpf_cost"] == {}
    assert "BPF programs" not in report(db, "--format", "text")

    with_bpf = tmp_path / "bpf.db"
    shutil.copy(db, with_bpf)
    con = sqlite3.connect(with_bpf)
    node_id, name = con.execute("SELECT node_id, name FROM nodes ORDER BY node_id").fetchone()
    bundle_id, = con.execute("SELECT bundle_id FROM bundles WHERE node_id = ?",
                             (node_id,)).fetchone()
    t0, = con.execute("SELECT MIN(timestamp_ns) FROM host_samples WHERE node_id = ?",
                      (node_id,)).fetchone()
    con.executemany("INSERT INTO host_samples (timestamp_ns, metric, device, value, node_id, "
                    "bundle_id, mono_ns) VALUES (?, 'capture.bpf_cpu_pct', NULL, ?, ?, ?, ?)",
                    [(t0 + k * 1_000_000_000, v, node_id, bundle_id, k)
                     for k, v in enumerate((0.5, 0.7))])
    write_summaries(con)     # as a merge of such bundles would (host_bins)
    con.commit()
    con.close()
    got = json.loads(report(with_bpf, "--json"))
    assert got["capture_bpf_cost"] == {name: 0.6}
    assert got["capture_cost"] == plain["capture_cost"]
    text = report(with_bpf, "--format", "text")
    assert f"0.60 % of one CPU on {name}" in " ".join(text.split())   # wrapped at 78
    html = tmp_path / "r.html"
    subprocess.run(["ingero-report", str(with_bpf), "-o", str(html)], check=True,
                   capture_output=True)
    assert "In its BPF programs" in html.read_text()
