"""Redaction: no original host name, address, path or user name anywhere in a redacted
fleet.db, report or trace; what analysis needs is kept, pseudonyms are consistent and keep
the subnet structure."""

from __future__ import annotations

import gzip
import ipaddress
import json

import apsw
import pytest
from click.testing import CliRunner

from ingero_forensics.export.cli import main as export_main
from ingero_forensics.redact import redact_fleet
from ingero_forensics.redact.cli import main as redact_main
from ingero_forensics.redact.core import IpPseudonyms, Redactor
from ingero_forensics.report.cli import main as report_main

from .conftest import NTP, ORIGINALS


def _leaks(blob: bytes) -> list[str]:
    return [s for group in ORIGINALS.values() for s in group if s.encode() in blob]


def _all_text(path) -> bytes:
    """The database file itself and every value dumped as text (nothing hides in pages
    that a text dump would decode differently)."""
    con = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    parts = [path.read_bytes()]
    for (t,) in con.execute("SELECT name FROM sqlite_schema WHERE type = 'table'"):
        for row in con.execute(f'SELECT * FROM "{t}"'):
            parts.append(repr(row).encode())
    con.close()
    return b"\n".join(parts)


def test_the_fixture_holds_every_original(sensitive_fleet):
    """Each string the tests look for is in the unredacted fleet.db (or the check is void)."""
    blob = _all_text(sensitive_fleet)
    missing = [s for group in ORIGINALS.values() for s in group if s.encode() not in blob]
    assert not missing, missing


@pytest.fixture(scope="module")
def redacted(sensitive_fleet, tmp_path_factory):
    out = tmp_path_factory.mktemp("redacted") / "out.db"
    res = redact_fleet(sensitive_fleet, out)
    return out, res


def test_no_original_in_the_redacted_fleet_db(redacted, sensitive_fleet):
    out, res = redacted
    assert _leaks(_all_text(out)) == []
    assert res.nodes == 3 and res.users == 2 and res.addresses >= 7
    # the source is untouched
    assert b"gpu-17.dc1.example.org" in sensitive_fleet.read_bytes()


def test_what_analysis_needs_is_kept(redacted, sensitive_fleet):
    out, _ = redacted
    a = apsw.Connection(str(sensitive_fleet), flags=apsw.SQLITE_OPEN_READONLY)
    b = apsw.Connection(str(out), flags=apsw.SQLITE_OPEN_READONLY)
    for table in ("nccl_events", "cuda_events", "collectives", "clock_alignment",
                  "host_samples", "host_bins", "sync_points"):
        q = f"SELECT * FROM {table} ORDER BY 1"
        assert list(a.execute(q)) == list(b.execute(q)), table
    assert [r[0] for r in b.execute("SELECT name FROM nodes ORDER BY node_id")] == [
        "nodeid-1", "nodeid-2", "nodeid-3"]
    assert [r[0] for r in b.execute("SELECT hostname FROM nodes ORDER BY node_id")] == [
        "nodeid-1", "nodeid-2", "nodeid-3"]
    cmd = json.loads(b.execute("SELECT cmdline FROM processes WHERE pid = 4242 "
                               "AND node_id = 1").fetchone()[0])
    master = cmd[cmd.index("--master") + 1]
    assert cmd[:3] == ["python3", "train.py", "--data=dataset"]
    assert cmd[cmd.index("--ckpt") + 1] == "step-1000.pt"
    # a URL keeps its scheme, its host's pseudonym and its base name (no user, no path)
    assert cmd[cmd.index("--repo") + 1] == "https://host.domain/repo.git"
    exe = b.execute("SELECT DISTINCT exe FROM processes WHERE pid = 4242").fetchall()
    assert exe == [("python3",)]
    info = json.loads(b.execute("SELECT value FROM fleet_info WHERE key = 'redacted'")
                      .fetchone()[0])
    assert info["tool"].startswith("ingero-redact ")
    # one pseudonym per address throughout the output: the --master address of the
    # command line is the daddr of the TCP rows
    daddrs = {r[0] for r in b.execute("SELECT daddr FROM tcp_events WHERE family = 4 AND dport = 29500")}
    assert daddrs == {master}
    frames = [json.loads(r[0]) for r in b.execute("SELECT frames FROM stacks")]
    assert {"module": "libnccl.so.2", "symbol": "ncclAllReduce", "offset": 16} in \
        [f for fs in frames for f in fs]


def test_pseudonyms_keep_subnets(redacted):
    out, _ = redacted
    b = apsw.Connection(str(out), flags=apsw.SQLITE_OPEN_READONLY)
    by_node = dict(b.execute("SELECT node_id, saddr FROM tcp_events WHERE family = 4 AND dport = 29500"))
    a40, a41, a31 = (ipaddress.IPv4Address(by_node[i]) for i in (1, 2, 3))
    assert len({a40, a41, a31}) == 3
    # 10.20.30.40 / 10.20.30.41 share /24; 10.20.31.7 shares only /16 with them
    assert a40.packed[:3] == a41.packed[:3]
    assert a40.packed[:2] == a31.packed[:2] and a40.packed[2] != a31.packed[2]
    v6 = {r[0] for r in b.execute("SELECT saddr FROM tcp_events WHERE family = 6")} | \
        {r[0] for r in b.execute("SELECT daddr FROM tcp_events WHERE family = 6")}
    s, d = sorted(ipaddress.IPv6Address(x) for x in v6)
    assert s.packed[:14] == d.packed[:14] and s != d
    ref = b.execute("SELECT DISTINCT device FROM clock_samples WHERE source = 'chrony'").fetchall()
    assert len(ref) == 1 and len(ref[0][0]) == 8
    assert ref[0][0] != f"{int(ipaddress.IPv4Address(NTP)):08X}"


def test_pseudonyms_differ_per_output_but_not_within(sensitive_fleet, tmp_path):
    one, two = tmp_path / "1.db", tmp_path / "2.db"
    redact_fleet(sensitive_fleet, one)
    redact_fleet(sensitive_fleet, two)
    q = "SELECT saddr FROM tcp_events ORDER BY id"
    a = [r[0] for r in apsw.Connection(str(one)).execute(q)]
    b = [r[0] for r in apsw.Connection(str(two)).execute(q)]
    assert a != b and len(set(a)) == len(set(b))


def test_ip_pseudonyms_never_hold_an_original():
    originals = {"10.0.0.1", "10.0.0.2", "110.0.0.1", "1.2.3.4", "fd00::1"}
    for k in range(50):
        ips = IpPseudonyms(bytes([k]) * 32, originals)
        out = {o: ips.pseudonym(o) for o in originals}
        assert len(set(out.values())) == len(originals)
        for p in out.values():
            assert not any(o in p for o in originals), (k, out)
    ips = IpPseudonyms(b"k" * 32, set())
    assert ips.pseudonym("127.0.0.1") == "127.0.0.1" and ips.pseudonym("::") == "::"
    assert ips.pseudonym("::ffff:10.0.0.1") == "::ffff:" + ips.pseudonym("10.0.0.1")


def test_text_rewrites():
    r = Redactor({"gpu-17.dc1.example.org": "nodeid-1", "gpu-17": "nodeid-1",
                  "dc1.example.org": "domain"}, {"alice"}, IpPseudonyms(b"x" * 32, {"10.1.2.3"}))
    ip = r.ips.pseudonym("10.1.2.3")
    assert r.text("spool /home/alice/x/y.db on gpu-17 (gpu-17.dc1.example.org)") == \
        "spool y.db on nodeid-1 (nodeid-1)"
    assert r.text("ssh alice@gpu-17 to 10.1.2.3:22") == f"ssh user@nodeid-1 to {ip}:22"
    assert r.text("file:///home/alice/notes.txt and /home/alice") == "file:///notes.txt and ~"
    assert r.text("3 events/s, 12:30:45, cpu.busy_pct / 100") == \
        "3 events/s, 12:30:45, cpu.busy_pct / 100"


@pytest.mark.parametrize("text, want", [
    # e-mail addresses, whatever their local part
    ("john.doe+ml@acme.com", "user@host"), ("1234@acme.com", "user@host"),
    ("a_very_long_firstname.lastname.team@gmail.com", "user@host"),
    ("jane.o'neil@acme.com", "user@host"), ("--notify=ops@dc1.example.org", "--notify=user@domain"),
    # other machines of the fleet's domains, also after _ ; a node keeps its pseudonym
    ("log_ntp1.example.org", "log_host.domain"), ("--ntp=ntp1.dc1.example.org", "--ntp=host.domain"),
    ("--master_addr=GPU-17.DC1.Example.org", "--master_addr=nodeid-1"),
    ("gpu-17.example.org", "nodeid-1.domain"),
    # what the analysis and the reader need stays
    ("python -m torch.distributed.run train.py", "python -m torch.distributed.run train.py"),
    ("torch@2.1 4.18.0-553.2.3.el8 nodeid-3", "torch@2.1 4.18.0-553.2.3.el8 nodeid-3"),
])
def test_names_users_and_addresses_in_free_text(text, want):
    r = Redactor({"gpu-17.dc1.example.org": "nodeid-1", "gpu-17": "nodeid-1",
                  "dc1.example.org": "domain", "example.org": "domain"}, {"alice"},
                 IpPseudonyms(b"x" * 32, set()))
    assert r.text(text) == want


def test_a_node_named_by_its_address_gives_no_domain(tmp_path):
    """--node 10.1.2.3 is a valid node name: its 'domains' (1.2.3, 2.3) would rewrite
    kernel releases and version strings that end in them."""
    from ingero_forensics.redact.core import _node_names
    con = apsw.Connection(":memory:")
    con.execute("CREATE TABLE nodes (node_id, name, claimed_name, hostname)")
    con.execute("INSERT INTO nodes VALUES (1, '10.1.2.3', '10.1.2.3', 'gpu-17.dc1.example.org')")
    names = _node_names(con)
    assert "1.2.3" not in names and "2.3" not in names
    assert names["dc1.example.org"] == names["example.org"] == "domain"


# ------------------------------------------------------------------------------ CLIs

def test_ingero_redact_cli(sensitive_fleet, tmp_path):
    out = tmp_path / "r.db"
    r = CliRunner().invoke(redact_main, [str(sensitive_fleet), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["output"] == str(out) and got["nodes"] == 3
    assert _leaks(r.stdout.encode()) == []
    assert _leaks(_all_text(out)) == []
    r = CliRunner().invoke(redact_main, [str(sensitive_fleet), "-o", str(sensitive_fleet)])
    assert r.exit_code == 2 and "would replace the input" in r.stderr   # a usage error
    junk = tmp_path / "junk.db"
    junk.write_text("not a database")
    r = CliRunner().invoke(redact_main, [str(junk), "-o", str(tmp_path / "x.db")])
    assert r.exit_code == 1 and r.stderr.startswith(f"Error: {junk}: ")
    assert r.stderr.count("\n") == 1 and not (tmp_path / "x.db").exists()
    assert not list(tmp_path.glob(".*"))      # no working copy left behind
    r = CliRunner().invoke(redact_main, ["-h"])
    assert r.exit_code == 0 and "Example:" in r.stdout


def test_report_and_export_redact(sensitive_fleet, tmp_path):
    html = tmp_path / "report.html"
    r = CliRunner().invoke(report_main, [str(sensitive_fleet), "-o", str(html), "--redact"])
    assert r.exit_code == 0, r.output
    text = html.read_bytes()
    assert _leaks(text) == [] and _leaks(r.stdout.encode()) == []
    assert b"nodeid-" in text
    plain = tmp_path / "plain.html"
    r = CliRunner().invoke(report_main, [str(sensitive_fleet), "-o", str(plain)])
    assert r.exit_code == 0 and b"rack3-gpu-" in plain.read_bytes()   # the check can fail
    trace = tmp_path / "trace.json.gz"
    r = CliRunner().invoke(export_main, [str(sensitive_fleet), "--chrome-trace", "--redact",
                                         "-o", str(trace), "--jobs", "1"])
    assert r.exit_code == 0, r.output
    data = gzip.decompress(trace.read_bytes())
    assert _leaks(data) == [] and _leaks(r.output.encode()) == []
    doc = json.loads(data)
    assert doc["metadata"]["source"] == "redacted-fleet.db"
    assert {n["name"] for n in doc["metadata"]["nodes"]} == {"nodeid-1", "nodeid-2", "nodeid-3"}
    r = CliRunner().invoke(export_main, [str(sensitive_fleet), "--chrome-trace", "--jobs", "1"])
    assert r.exit_code == 0 and b"10.20.30.40" in r.stdout_bytes      # unredacted has it
    r = CliRunner().invoke(export_main, [str(sensitive_fleet), "--chrome-trace", "--redact",
                                         "--jobs", "1"])
    assert r.exit_code == 0 and _leaks(r.stdout_bytes) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ingero-redact-")]


def test_the_report_says_the_same_of_a_redacted_fleet(redacted, sensitive_fleet):
    """Same verdict, windows and scores; only the node names differ (node ids)."""
    from ingero_forensics.report import analyze_fleet
    out, _ = redacted
    a = json.dumps(analyze_fleet(sensitive_fleet).to_json(), sort_keys=True)
    b = json.dumps(analyze_fleet(out).to_json(), sort_keys=True)
    for i in range(3):
        a = a.replace(f"rack3-gpu-{i}", f"nodeid-{i + 1}")
    a = a.replace(sensitive_fleet.name, out.name)
    assert a == b


def test_redacting_twice_changes_no_name(redacted, tmp_path):
    out, _ = redacted
    again = tmp_path / "again.db"
    res = redact_fleet(out, again)
    assert _leaks(_all_text(again)) == []
    con = apsw.Connection(str(again))
    assert [r[0] for r in con.execute("SELECT name FROM nodes ORDER BY node_id")] == [
        "nodeid-1", "nodeid-2", "nodeid-3"]
    assert res.nodes == 3


def test_a_name_that_looks_like_another_nodes_pseudonym_is_refused(redacted, tmp_path):
    import shutil
    out, _ = redacted
    odd = tmp_path / "odd.db"
    shutil.copy(out, odd)
    con = apsw.Connection(str(odd))
    con.execute("UPDATE nodes SET hostname = 'nodeid-2' WHERE node_id = 1")
    con.close()
    r = CliRunner().invoke(redact_main, [str(odd), "-o", str(tmp_path / "x.db")])
    assert r.exit_code == 1
    assert r.stderr == (f"Error: {odd}: node name 'nodeid-2' has the form of the pseudonyms (nodeid-N) "
                        "but is not that node's; cannot tell them apart\n")
    assert not (tmp_path / "x.db").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("word, want", [
    # user@host whatever the host, when it is a name (a review found these kept)
    ("root@login01", "user@host"), ("--ssh=zed@login01", "--ssh=user@host"),
    ("carol@login01", "user@host"),
    # a URL in a command line keeps its scheme, host pseudonym and base name
    ("https://bob:s3cr@git.example.org/team/repo.git", "https://host/repo.git"),
    ("--db=postgres://dave@db.internal:5432/x", "--db=postgres://host:5432/x"),
    # versions, digests, versioned or PLT symbols are no user@host; a path is still cut
    # to its base name
    ("torch@2.1", "torch@2.1"), ("pkg@v1.2.3", "pkg@v1.2.3"),
    ("memcpy@GLIBC_2.14", "memcpy@GLIBC_2.14"), ("foo@plt", "foo@plt"),
    ("nvcr.io/nvidia/pytorch@sha256:ab12", "pytorch@sha256:ab12"),
    ("torch@https://download.pytorch.org/whl/cu121", "torch@https://host/cu121"),
    ("/data/acme/train.py", "train.py"), ("~dave/projX/c.bundle", "c.bundle"),
])
def test_command_line_words(word, want):
    r = Redactor({"gpu-17": "nodeid-1"}, set(), IpPseudonyms(b"x" * 32, set()))
    assert r.word(word) == want


def test_bare_system_directories_and_tilde_users():
    """'/proc and NVML counters' keeps its slash (a bare system directory names nothing
    of the site); ~NAME/ makes NAME a user name, removed wherever it appears."""
    from ingero_forensics.redact.core import _collect
    r = Redactor({}, set(), IpPseudonyms(b"x" * 32, set()))
    assert r.text("/proc and NVML counters at 10 Hz") == "/proc and NVML counters at 10 Hz"
    assert r.text("read /proc/pressure/cpu") == "read cpu"
    users: set = set()
    _collect(["merged ~dave/c.bundle", "~/x.bundle"], users, set(), set())
    assert users == {"dave"}
    r = Redactor({}, users, IpPseudonyms(b"x" * 32, set()))
    assert "dave" not in r.text("merged ~dave/c.bundle for dave")
    assert r.text("merged ~dave/projX/c.bundle") == "merged c.bundle"


def test_relative_input_paths_are_cut_to_base_names(tmp_path, monkeypatch):
    """Bundles merged by a relative path (as docs/airgap.md's runbook does): the
    directories in it (a user's, a project's) are gone from the redacted fleet.db,
    merge_log.input and its messages included (a review found them kept)."""
    from ingero_forensics.merge import merge_bundles
    from ingero_forensics.simulate import FleetConfig, simulate_fleet

    d = tmp_path / "home" / "bob" / "acme-secretproj"
    simulate_fleet(d, FleetConfig(nodes=2, ranks_per_node=1, steps=10, fault="none", seed=1))
    first = sorted(d.glob("*.bundle"))[0]
    (d / "trunc.bundle").write_bytes(first.read_bytes()[:5000])
    monkeypatch.chdir(tmp_path)
    merge_bundles(["home/bob/acme-secretproj"], "fleet.db")
    con = apsw.Connection("fleet.db", flags=apsw.SQLITE_OPEN_READONLY)
    inputs = [r[0] for r in con.execute("SELECT input FROM merge_log WHERE input IS NOT NULL")]
    con.close()
    assert any(i.startswith("home/bob/acme-secretproj/") for i in inputs), inputs
    redact_fleet("fleet.db", tmp_path / "out.db")
    blob = _all_text(tmp_path / "out.db")
    assert b"bob" not in blob and b"secretproj" not in blob
    con = apsw.Connection(str(tmp_path / "out.db"), flags=apsw.SQLITE_OPEN_READONLY)
    assert "trunc.bundle" in {r[0] for r in con.execute("SELECT input FROM merge_log")}
    con.close()
