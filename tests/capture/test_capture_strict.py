"""Fleet roll-outs: --strict fails loudly when an eBPF source would be off, BCC is found
where each distribution family installs it, and fix messages name that family's packages."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from ingero_forensics.capture import distro
from ingero_forensics.capture.cli import main
from ingero_forensics.capture.ebpf import _bcc

from .conftest import CAPTURE, ROOT, bundles, capture_env, open_bundle

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

OS_RELEASES = {
    "debian": ('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\n'
               'VERSION_ID="12"\nID=debian\n', "debian"),
    "ubuntu": ('NAME="Ubuntu"\nVERSION="22.04.4 LTS (Jammy Jellyfish)"\nID=ubuntu\n'
               'ID_LIKE=debian\nVERSION_ID="22.04"\n', "debian"),
    "rocky": ('NAME="Rocky Linux"\nVERSION="9.3 (Blue Onyx)"\nID="rocky"\n'
              'ID_LIKE="rhel centos fedora"\nVERSION_ID="9.3"\n', "rhel"),
    "alma": ('NAME="AlmaLinux"\nVERSION="8.9 (Midnight Oncilla)"\nID="almalinux"\n'
             'ID_LIKE="rhel centos fedora"\n', "rhel"),
    "rhel": ('NAME="Red Hat Enterprise Linux"\nVERSION="9.4 (Plow)"\nID="rhel"\n'
             'ID_LIKE="fedora"\nVERSION_ID="9.4"\n', "rhel"),
    "sles": ('NAME="SLES"\nVERSION="15-SP5"\nID="sles"\nID_LIKE="suse"\n', "suse"),
    "other": ('NAME="Some OS"\nID=someos\n', "unknown"),
}


def _require_root_and_setpriv():
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to run a capture as another user")
    probe = subprocess.run([*NOBODY, sys.executable, "-c", "import ingero_forensics"],
                           capture_output=True, text=True, env=capture_env(), cwd="/")
    if probe.returncode != 0:
        pytest.skip("the unprivileged user cannot read this checkout or its interpreter "
                    f"({probe.stderr.strip().splitlines()[-1:]})")


@pytest.fixture
def shared_dir():
    """A directory the unprivileged user can write (pytest's tmp_path is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="ingero-strict-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ distribution family

@pytest.mark.parametrize("name", sorted(OS_RELEASES))
def test_family_and_package_names(tmp_path, name):
    text, fam = OS_RELEASES[name]
    f = tmp_path / "os-release"
    f.write_text(text)
    assert distro.family(distro.read_os_release(str(f))) == fam
    pk = distro.packages(str(f))
    if fam == "debian":
        assert pk.bcc == "apt install python3-bpfcc bpfcc-tools"
        assert pk.headers == "apt install linux-headers-$(uname -r)"
    elif fam == "rhel":
        assert pk.bcc == "dnf install python3-bcc bcc-tools"
        assert pk.headers == "dnf install kernel-devel-$(uname -r)"
    elif fam == "suse":
        assert pk.bcc.startswith("zypper install python3-bcc")
    else:
        assert "python3-bpfcc" in pk.bcc and "python3-bcc" in pk.bcc


def test_missing_os_release_is_unknown(tmp_path):
    assert distro.packages(str(tmp_path / "none")) is distro.UNKNOWN


# --------------------------------------------------------------------------- finding BCC

def _real_bcc_dir() -> str:
    dirs = _bcc.bcc_search_dirs("/", env={})
    if not dirs:
        assert not os.environ.get("INGERO_REQUIRE_EBPF"), "BCC is not installed"
        pytest.skip("BCC's Python module is not installed on this machine")
    return dirs[0]


def _fake_root(tmp_path, layout: dict[str, str], os_release: str) -> Path:
    """A root directory with the real BCC package copied where a distribution puts it."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "os-release").write_text(os_release)
    for rel, src in layout.items():
        shutil.copytree(Path(src) / "bcc", root / rel / "bcc",
                        ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _import_in_fresh_python(root: Path, env_extra=None) -> dict:
    code = ("import json, sys\n"
            "from ingero_forensics.capture.ebpf import _bcc\n"
            "from ingero_forensics.capture.source import SourceUnavailable\n"
            f"root = {str(root)!r}\n"
            "try:\n"
            "    b = _bcc.import_bcc(root)\n"
            "    print(json.dumps({'file': b.__file__, 'has_bpf': hasattr(b, 'BPF'),\n"
            "        'in_path': any(p.startswith(root) for p in sys.path)}))\n"
            "except SourceUnavailable as e:\n"
            "    print(json.dumps({'reason': e.reason, 'fix': e.fix}))\n")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **(env_extra or {})}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=True)
    return json.loads(p.stdout)


def test_search_order_prefers_this_python_then_newest(tmp_path):
    real = _real_bcc_dir()
    own = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    root = _fake_root(tmp_path, {
        "usr/lib64/python3.6/site-packages": real,
        f"usr/lib/{own}/site-packages": real,
        "usr/lib/python3.99/site-packages": real,
        "usr/lib/python3.1/site-packages": real,
    }, OS_RELEASES["rocky"][0])
    (root / "usr/lib/python3.50/site-packages").mkdir(parents=True)   # no bcc/ inside
    dirs = _bcc.bcc_search_dirs(str(root), env={})
    rel = [str(Path(d).relative_to(root)) for d in dirs]
    assert rel == [f"usr/lib/{own}/site-packages", "usr/lib/python3.99/site-packages",
                   "usr/lib/python3.1/site-packages", "usr/lib64/python3.6/site-packages"]
    extra = tmp_path / "opt-bcc"
    shutil.copytree(Path(real) / "bcc", extra / "bcc")
    assert _bcc.bcc_search_dirs(str(root), env={"INGERO_BCC_PATH": str(extra)})[0] == str(extra)


@pytest.mark.ebpf
def test_real_bcc_loads_from_a_rhel_layout(tmp_path):
    """The distribution's BCC, copied to where python3-bcc puts it on Rocky 9, is found
    there by an interpreter that has no system site-packages, without widening sys.path."""
    real = _real_bcc_dir()
    root = _fake_root(tmp_path, {"usr/lib/python3.9/site-packages": real},
                      OS_RELEASES["rocky"][0])
    got = _import_in_fresh_python(root)
    assert got.get("file") == str(root / "usr/lib/python3.9/site-packages/bcc/__init__.py"), got
    assert got["has_bpf"] and not got["in_path"]


@pytest.mark.ebpf
def test_real_bcc_loads_from_ingero_bcc_path(tmp_path):
    real = _real_bcc_dir()
    extra = tmp_path / "opt" / "bcc-site"
    shutil.copytree(Path(real) / "bcc", extra / "bcc")
    root = _fake_root(tmp_path, {}, OS_RELEASES["rhel"][0])
    got = _import_in_fresh_python(root, {"INGERO_BCC_PATH": str(extra)})
    assert got.get("file") == str(extra / "bcc" / "__init__.py"), got


@pytest.mark.parametrize("name, fix", [("rocky", "dnf install python3-bcc bcc-tools"),
                                       ("ubuntu", "apt install python3-bpfcc bpfcc-tools")])
def test_missing_bcc_names_the_family_package(tmp_path, name, fix):
    root = _fake_root(tmp_path, {}, OS_RELEASES[name][0])
    got = _import_in_fresh_python(root)
    assert "not installed" in got["reason"]
    assert got["fix"].startswith(fix) and "INGERO_BCC_PATH" in got["fix"]


# ------------------------------------------------------------------------------ --strict

def test_strict_with_no_ebpf_is_a_usage_error():
    r = CliRunner().invoke(main, ["--check", "--strict", "--no-ebpf", "--node", "n"])
    assert r.exit_code == 2 and "--strict requires the eBPF sources" in r.output


def test_check_strict_fails_when_ebpf_is_off():
    """Not root: every eBPF source is off. --check says so and exits 0; --strict exits 1."""
    _require_root_and_setpriv()
    cmd = [*NOBODY, *CAPTURE, "--check", "--node", "n1"]
    plain = subprocess.run(cmd, capture_output=True, text=True, env=capture_env(), cwd="/")
    assert plain.returncode == 0, plain.stderr
    off = [ln.split()[0] for ln in plain.stdout.splitlines() if ln.split()[1] == "off"]
    assert {"nccl", "cuda", "tcp", "sched", "block"} <= set(off), plain.stdout
    strict = subprocess.run(cmd + ["--strict"], capture_output=True, text=True,
                            env=capture_env(), cwd="/")
    assert strict.returncode == 1
    assert strict.stdout == plain.stdout
    errs = strict.stderr.splitlines()
    assert len(errs) == 5 and all(e.startswith("Error: ") and "(--strict)" in e for e in errs)
    assert any(e.startswith("Error: nccl source off: eBPF needs root") for e in errs)


@pytest.mark.ebpf
def test_check_strict_passes_where_ebpf_runs():
    from .ebpf.conftest import ebpf_skip_reason
    reason = ebpf_skip_reason()
    if reason:
        pytest.skip(reason)
    r = subprocess.run([*CAPTURE, "--check", "--strict", "--node", "n2", "--json"],
                       capture_output=True, text=True, env=capture_env())
    assert r.returncode == 0, r.stdout + r.stderr
    got = {s["name"]: s["available"] for s in json.loads(r.stdout)}
    assert all(got[n] for n in ("nccl", "cuda", "tcp", "sched", "block")), got


def test_strict_capture_stops_at_start_and_seals(shared_dir):
    _require_root_and_setpriv()
    out = shared_dir / "b"
    cmd = [*NOBODY, *CAPTURE, "--bundle", str(out), "--node", "s1", "--duration", "30",
           "--json", "--strict"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=capture_env(), cwd="/",
                       timeout=25)
    assert r.returncode == 4, r.stderr      # its own code: a service is not restarted
    # no "sources on:", the line ingero-job-capture.sh takes for a running capture
    assert "sources on:" not in r.stderr and "stopping at once (--strict" in r.stderr
    summary = json.loads(r.stdout)
    assert summary["stop_reason"] == "strict" and summary["seconds"] < 20
    assert set(summary["sources_off"]) >= {"nccl", "cuda", "tcp", "sched", "block"}
    last = r.stderr.splitlines()[-1]
    assert last.startswith(f"Error: {out}: capture stopped at start (--strict): eBPF source(s) off: nccl (")
    (b,) = bundles(out)     # what was recorded is sealed, with the reasons in capture_log
    with open_bundle(b) as bb:
        offs = [r[0] for r in bb.con.execute(
            "SELECT source FROM capture_log WHERE event = 'source_off'")]
    assert {"nccl", "cuda", "tcp", "sched", "block"} <= set(offs)
    # without --strict the same run goes on for its duration and exits 0
    r = subprocess.run([*NOBODY, *CAPTURE, "--bundle", str(out), "--node", "s1",
                        "--duration", "1", "--json"], capture_output=True, text=True,
                       env=capture_env(), cwd="/", timeout=25)
    assert r.returncode == 0 and json.loads(r.stdout)["stop_reason"] == "duration"
