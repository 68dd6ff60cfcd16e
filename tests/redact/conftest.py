"""A merged fleet whose bundles carry what a security officer asks about: host names and
domains, node names, IPv4/IPv6 addresses (TCP, command lines, chrony's reference id),
home directories with user names, full paths in executables, command lines, stack
frames and capture log messages, a URL with user info and an scp target."""

from __future__ import annotations

import ipaddress
import json
import sqlite3

import pytest

from ingero_forensics.bundle.schema import MANIFEST_TABLES
from ingero_forensics.merge import merge_bundles

from ..bundle.conftest import pack, split_bundle
from ..merge.fleetgen import make_fleet

HOSTS = {0: "gpu-17.dc1.example.org", 1: "gpu-18.dc1.example.org", 2: "gpu-19.dc1.example.org"}
NODE_PREFIX = "rack3-gpu"
USERS = ("alice", "bobsmith")
NTP = "10.99.1.5"
ORIGINALS = {
    "hosts": [*HOSTS.values(), "gpu-17", "gpu-18", "gpu-19", "dc1.example.org",
              "git.corp.example.org",
              # another machine of the site's domain, a host name in capitals, an e-mail
              "ntp1.example.org", "GPU-17", "DC1.example.org", "ops-team", "acme-corp.com"],
    "nodes": [f"{NODE_PREFIX}-{i}" for i in range(3)],
    "ips": ["10.20.30.40", "10.20.30.41", "10.20.31.7", "192.168.77.12", "10.0.0.1", "10.0.0.2",
            "fd12:3456:789a::17", "fd12:3456:789a::99", f"{int(ipaddress.IPv4Address(NTP)):08X}",
            # only in tcp_progress: a peer the job exchanged bytes with
            "10.20.32.8"],
    "users": list(USERS),
    "paths": ["/home/alice/private/dataset", "/home/alice/venvs/llm/bin/python3",
              "/home/alice/private/train.py", "/home/bobsmith/ckpt", "/home/",
              "private/dataset", "venvs/llm"],
}


def _sensitive_sql(ni: int, mono: int) -> str:
    ip_self = ["10.20.30.40", "10.20.30.41", "10.20.31.7"][ni]
    cmd = json.dumps(["/home/alice/venvs/llm/bin/python3", "/home/alice/private/train.py",
                      "--data=/home/alice/private/dataset", "--master", "10.20.30.40",
                      "--repo", "https://alice:tok@git.corp.example.org/ml/repo.git",
                      "--ckpt", "/home/bobsmith/ckpt/step-1000.pt",
                      "--peer", "bobsmith@192.168.77.12:/home/bobsmith/ckpt",
                      "--ntp=ntp1.example.org", "--notify=ops-team@acme-corp.com",
                      "--fallback=GPU-17.DC1.example.org"])
    frames = json.dumps([{"module": "/home/alice/venvs/llm/lib/libnccl.so.2",
                          "symbol": "ncclAllReduce", "offset": 16},
                         {"py_file": "/home/alice/private/train.py", "py_func": "step",
                          "py_line": 212}])
    hexref = f"{int(ipaddress.IPv4Address(NTP)):08X}"
    return f"""
        INSERT INTO processes (pid, start_boottime_ns, comm, exe, cmdline, rank, local_rank,
            world_size, local_world_size, node_rank, job_id, env, first_seen_ns, last_seen_ns)
        VALUES (4242, 1, 'python3', '/home/alice/venvs/llm/bin/python3', '{cmd}', NULL, NULL,
            NULL, NULL, NULL, 'job-42', '{{}}', {mono}, {mono + 1000});
        INSERT INTO tcp_events (timestamp_ns, event, family, saddr, daddr, sport, dport, state,
            pid, netns, owner_pid, scope)
        VALUES ({mono + 10}, 'tcp_retransmit_skb', 4, '{ip_self}', '10.20.30.40', 40000, 29500,
            'ESTABLISHED', 4242, NULL, 4242, 'job'),
               ({mono + 20}, 'tcp_retransmit_skb', 6, 'fd12:3456:789a::17',
            'fd12:3456:789a::99', 40001, 29500, 'ESTABLISHED', 4242, NULL, 4242, 'job');
        INSERT INTO tcp_progress (timestamp_ns, direction, family, saddr, sport, daddr, dport,
            connected_ns, stream_offset, bytes, pid, tid)
        VALUES ({mono + 12}, 'send', 4, '{ip_self}', 41000, '10.20.32.8', 29600, {mono + 1},
            0, 4096, 4242, 4242);
        INSERT INTO capture_log (timestamp_ns, level, source, event, message)
        VALUES ({mono + 30}, 'info', 'nccl', 'source_on',
            'uprobes on /home/alice/venvs/llm/lib/libnccl.so.2: 40 functions'),
               ({mono + 31}, 'info', 'capture', 'capture_start',
            'node {NODE_PREFIX}-{ni} on {HOSTS[ni]} (user alice) spool /var/ingero/.spool');
        INSERT INTO stacks (frames) VALUES ('{frames}');
        INSERT INTO clock_samples (source, mono_before_ns, mono_after_ns, realtime_ns,
            uncertainty_ns, device)
        VALUES ('chrony', {mono + 40}, {mono + 41}, 1760000000000000000, 1, '{hexref}');
    """


def _add_rows(path, sql, tmp_dir) -> None:
    """Rewrite a real bundle with more rows (its manifest and meta counts kept true)."""
    manifest, image = split_bundle(path)
    db = tmp_dir / "edit.db"
    db.write_bytes(image)
    con = sqlite3.connect(db)
    con.executescript(sql)
    counts = {t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in MANIFEST_TABLES}
    manifest["tables"] = counts
    con.execute("UPDATE meta SET value = ? WHERE key = 'tables'", (json.dumps(counts),))
    con.commit()
    con.close()
    path.write_bytes(pack(manifest, db.read_bytes()))


@pytest.fixture(scope="session")
def sensitive_fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("sensitive")
    fleet = make_fleet(d / "bundles", nodes=3, seconds=6, seed=5, straggler_rank=3,
                       host_of=HOSTS, name_prefix=NODE_PREFIX)
    for ni, path in enumerate(fleet.paths):
        manifest, _ = split_bundle(path)
        _add_rows(path, _sensitive_sql(ni, manifest["capture"]["start_mono_ns"]), d)
    res = merge_bundles(fleet.paths, d / "fleet.db")
    assert res.bundles_merged == 3 and not res.skipped, res.skipped
    return d / "fleet.db"
