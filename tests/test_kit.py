"""The offline kit and the one-file capture (docs/airgap.md): a kit built here installs
into a fresh virtual environment with pip --no-index (in a network namespace with no
interfaces where that can be made) and captures; ingero-capture.pyz runs with a bare
python3 that has no site-packages at all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ingero_forensics.kit import KitError, build_kit, native_target, wheel_min_glibc

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def node_python() -> str:
    """The 'node's python3': the system one when it is this Python's version, else the
    interpreter this virtual environment was made from (never the venv itself)."""
    sysp = "/usr/bin/python3"
    if os.path.exists(sysp):
        v = subprocess.run([sysp, "-c", "import sys; print(sys.version_info[:2])"],
                           capture_output=True, text=True).stdout.strip()
        if v == str(tuple(sys.version_info[:2])):
            return sysp
    return getattr(sys, "_base_executable", None) or sys.executable


def no_network_prefix() -> list[str]:
    """unshare -n (a network namespace with only a down loopback) where it works."""
    if os.geteuid() == 0 and shutil.which("unshare"):
        if subprocess.run(["unshare", "-n", "true"]).returncode == 0:
            return ["unshare", "-n"]
    return []


def clean_env(**extra) -> dict:
    """No pip configuration, index or find-links from this machine, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV", "INGERO_"))}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env.update(extra)
    return env


def extract(archive: Path, where: Path) -> Path:
    # the "data" filter where this Python has it (3.11.4+, and backports)
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(archive) as tar:
        tar.extractall(where, **safe)
    (kit,) = where.iterdir()
    return kit


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit")
    res = build_kit(out)
    return res, Path(res.archive)


def test_kit_holds_every_dependency_and_checksums(kit, tmp_path):
    res, archive = kit
    assert archive.name == f"ingero-kit-0.1.0-{native_target().name}.tar.gz"
    side = (archive.parent / f"{archive.name}.sha256").read_text().split()
    assert side == [res.sha256, archive.name]
    assert subprocess.run(["sha256sum", "-c", f"{archive.name}.sha256"], cwd=archive.parent,
                          capture_output=True).returncode == 0
    d = extract(archive, tmp_path)
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=d).returncode == 0
    listed = {line.split("  ", 1)[1] for line in (d / "SHA256SUMS").read_text().splitlines()}
    on_disk = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}
    assert listed == on_disk - {"SHA256SUMS"}
    info = json.loads((d / "kit.json").read_text())
    dists = {w.split("-", 1)[0].lower() for w in info["wheels"]}
    assert dists == {"ingero_forensics", "apsw", "zstandard", "click", "jinja2", "orjson",
                     "markupsafe"}
    assert info["python"] == native_target().python and info["accelerators"] is True
    assert info["min_glibc"] == max(".".join(map(str, g)) for g in
                                    map(wheel_min_glibc, info["wheels"]) if g)
    assert os.access(d / "install.sh", os.X_OK) and (d / "ingero-capture.pyz").is_file()
    # the runbook is in the kit, as its README says
    assert (d / "airgap.md").read_text() == (ROOT / "docs" / "airgap.md").read_text()
    assert "airgap.md, in this kit" in (d / "README.txt").read_text()


def test_wheel_min_glibc():
    assert wheel_min_glibc("a-1-cp311-cp311-manylinux_2_28_x86_64.whl") == (2, 28)
    assert wheel_min_glibc("a-1-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl") \
        == (2, 17)
    assert wheel_min_glibc("a-1-py3-none-any.whl") is None


def test_kit_installs_with_no_index_and_captures(kit, tmp_path):
    _, archive = kit
    d = extract(archive, tmp_path / "carried")
    prefix = tmp_path / "opt" / "ingero-forensics"
    net = no_network_prefix()
    r = subprocess.run([*net, "sh", str(d / "install.sh"), str(prefix)], capture_output=True,
                       text=True, env=clean_env(PYTHON=node_python()), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no network used" in r.stdout
    assert os.access(prefix / "share" / "ingero-job-capture.sh", os.X_OK)
    assert (prefix / "share" / "ingero-capture.service").read_text() == \
        (ROOT / "scripts" / "ingero-capture.service").read_text()
    py = prefix / "bin" / "python"
    where = subprocess.run([str(py), "-c", "import ingero_forensics, apsw, sys; "
                            "print(ingero_forensics.__file__); print(apsw.__file__); "
                            "print(sys.prefix != sys.base_prefix)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
    assert where[0].startswith(str(prefix)) and where[1].startswith(str(prefix))
    assert where[2] == "True"
    cap = str(prefix / "bin" / "ingero-capture")
    r = subprocess.run([*net, cap, "--check", "--node", "kit-node"], capture_output=True,
                       text=True, env=clean_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].split()[:2] == ["node", "ok"]
    bundles = tmp_path / "bundles"
    r = subprocess.run([*net, cap, "--bundle", str(bundles), "--node", "kit-node", "--no-ebpf",
                        "--duration", "2", "--json"], capture_output=True, text=True,
                       env=clean_env(), cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stop_reason"] == "duration"
    r = subprocess.run([str(prefix / "bin" / "ingero-merge"), "--verify", str(bundles), "--json"],
                       capture_output=True, text=True, env=clean_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [c["node"] for c in json.loads(r.stdout)] == ["kit-node"]


def _rewrite(d: Path, path: str, data: bytes) -> None:
    (d / path).write_bytes(data)
    from ingero_forensics.kit import write_sha256sums
    write_sha256sums(d)


def test_install_refuses_a_tampered_or_foreign_kit(kit, tmp_path):
    _, archive = kit
    d = extract(archive, tmp_path / "a")
    whl = next((d / "wheels").glob("click-*.whl"))
    whl.write_bytes(whl.read_bytes()[:-10] + b"0123456789")
    prefix = tmp_path / "p1"
    r = subprocess.run(["sh", str(d / "install.sh"), str(prefix)], capture_output=True,
                       text=True, env=clean_env(PYTHON=node_python()))
    assert r.returncode == 1 and f"Error: {d}: SHA256SUMS check failed" in r.stderr
    assert not prefix.exists()
    d = extract(archive, tmp_path / "b")
    info = json.loads((d / "kit.json").read_text())
    info["python"] = "3.99"
    _rewrite(d, "kit.json", json.dumps(info).encode())
    r = subprocess.run(["sh", str(d / "install.sh"), str(prefix)], capture_output=True,
                       text=True, env=clean_env(PYTHON=node_python()))
    assert r.returncode == 1 and "this kit is for Python 3.99" in r.stderr
    info["python"], info["min_glibc"] = native_target().python, "9.99"
    _rewrite(d, "kit.json", json.dumps(info).encode())
    r = subprocess.run(["sh", str(d / "install.sh"), str(prefix)], capture_output=True,
                       text=True, env=clean_env(PYTHON=node_python()))
    assert r.returncode == 1 and "older than 9.99" in r.stderr
    assert not prefix.exists()


def _bare(py: str, *args, cwd, env=None, timeout=60):
    """python3 -I -S: no site-packages, no user site, no PYTHON* variables."""
    return subprocess.run([py, "-I", "-S", *args], capture_output=True, text=True, cwd=cwd,
                          env=env or clean_env(), timeout=timeout)


def test_pyz_runs_with_nothing_installed(kit, tmp_path):
    _, archive = kit
    d = extract(archive, tmp_path / "k")
    py = node_python()
    for mod in ("ingero_forensics", "apsw", "zstandard", "click"):
        r = _bare(py, "-c", f"import {mod}", cwd=tmp_path)
        assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr, mod
    pyz = tmp_path / "ingero-capture.pyz"      # one file, copied alone to the node
    shutil.copy(d / "ingero-capture.pyz", pyz)
    env = clean_env(INGERO_PYZ_CACHE=str(tmp_path / "cache"))
    r = _bare(py, str(pyz), "--check", "--node", "pyz-node", "--json", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    got = {s["name"]: s for s in json.loads(r.stdout)}
    assert got["node"]["available"] and got["clock"]["available"]
    from tests.capture.ebpf.conftest import ebpf_skip_reason
    if ebpf_skip_reason() is None:
        # where eBPF runs, the bare interpreter finds the distribution's BCC too
        assert all(got[n]["available"] for n in ("nccl", "cuda", "tcp", "sched", "block")), got
    r = _bare(py, str(pyz), "--bundle", str(tmp_path / "b"), "--node", "pyz-node",
              "--no-ebpf", "--duration", "2", "--json", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["sources_on"] == ["clock", "host"] and len(summary["segments"]) == 1
    from ingero_forensics.bundle import open_bundle
    with open_bundle(summary["segments"][0]) as b:
        assert b.node == "pyz-node"
        assert b.con.execute("SELECT COUNT(*) FROM clock_samples").fetchone()[0] >= 2
    # extracted once, then reused; --version names the program
    (cache,) = (tmp_path / "cache").iterdir()
    assert (cache / ".complete").is_file()
    r = _bare(py, str(pyz), "--version", cwd=tmp_path, env=env)
    assert r.stdout == "ingero-capture 0.1.0\n"
    assert list((tmp_path / "cache").iterdir()) == [cache]


def _source_copy(dest: Path, version: str, mark: str) -> Path:
    """This source tree at another version, its package marked."""
    from ingero_forensics import __version__
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".cache", ".dev",
        "*.so", "bench", "tests"))
    for path, line in ((dest / "pyproject.toml", 'version = "{}"'),
                       (dest / "ingero_forensics" / "__init__.py", '__version__ = "{}"')):
        text = path.read_text()
        assert line.format(__version__) in text
        path.write_text(text.replace(line.format(__version__), line.format(version)))
    with open(dest / "ingero_forensics" / "__init__.py", "a") as f:
        f.write(f"KIT_TEST_MARK = {mark!r}\n")
    return dest


def test_each_kit_replaces_the_install_before_it(kit, tmp_path):
    """The runbook installs each new kit over the last: its code must be what runs
    afterwards, a newer version (pip without --upgrade kept the old one and said
    "installed") and a kit of the same version number built from newer sources (pip
    keeps an installed version it is asked for) alike. A relative PREFIX is the caller's,
    not the kit directory's. A kit built from --source is named after that tree's
    version, not the running tool's."""
    from ingero_forensics import __version__
    _, archive = kit
    major, minor, patch = __version__.split(".")
    newer = f"{major}.{minor}.{int(patch) + 1}"
    same = build_kit(tmp_path / "out-same", pyz=False,
                     source=_source_copy(tmp_path / "src-same", __version__, "same"))
    up = build_kit(tmp_path / "out-up", pyz=False,
                   source=_source_copy(tmp_path / "src-up", newer, "up"))
    assert Path(up.archive).name.startswith(f"ingero-kit-{newer}-")
    work = tmp_path / "work"
    work.mkdir()
    env = clean_env(PYTHON=node_python())
    py = work / "node" / "bin" / "python"
    for arch, want, mark in ((archive, __version__, None), (Path(same.archive), __version__,
                                                            "same"),
                             (Path(up.archive), newer, "up")):
        d = extract(arch, tmp_path / f"carried-{mark}")
        r = subprocess.run(["sh", str(d / "install.sh"), "node"], capture_output=True,
                           text=True, env=env, cwd=work)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"ingero-forensics {want} installed in {work / 'node'}" in r.stdout
        assert not (d / "node").exists()
        v = subprocess.run([str(work / "node" / "bin" / "ingero-report"), "--version"],
                           capture_output=True, text=True, env=clean_env())
        assert v.stdout.split() == ["ingero-report", want], v.stdout + v.stderr
        got = subprocess.run([str(py), "-c", "import ingero_forensics as i; "
                              "print(getattr(i, 'KIT_TEST_MARK', None))"],
                             capture_output=True, text=True, env=clean_env(), cwd=work)
        assert got.stdout.strip() == str(mark), (mark, got.stdout + got.stderr)


def test_kit_for_another_python_defaults_to_manylinux_and_checks_the_tag(tmp_path):
    """--python alone once meant this machine's linux_x86_64 tag, which no binary wheel on
    PyPI has ("No matching distribution found for apsw"); a tag pip cannot use is refused
    before any download, and a failed build leaves no empty directory."""
    from ingero_forensics.kit import default_platform
    native = native_target()
    other = "3.12" if native.python != "3.12" else "3.11"
    assert default_platform(other, native).startswith("manylinux_2_28_")
    assert default_platform(native.python, native) == native.platform
    out = tmp_path / "new"
    with pytest.raises(KitError, match="--platform bogus_tag: not a wheel platform tag"):
        build_kit(out, python=other, platform="bogus_tag")
    assert not out.exists()
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    r = subprocess.run([sys.executable, "-m", "ingero_forensics.kit_cli",
                        "-o", str(blocker / "sub")], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"Error: {blocker / 'sub'}: cannot create the output directory")


def test_kit_for_another_platform_tag_is_pure(tmp_path):
    """A target other than this interpreter's own (here: the manylinux tag instead of
    linux_x86_64) gets a py3-none-any project wheel and still installs and runs."""
    import platform
    if platform.machine() != "x86_64":
        pytest.skip("the cross-target case is written for x86_64 builders")
    res = build_kit(tmp_path / "out", platform="manylinux_2_28_x86_64", pyz=True)
    assert res.pure and any(w.startswith("ingero_forensics-0.1.0-py3-none-any")
                            for w in res.wheels)
    d = extract(Path(res.archive), tmp_path / "k")
    r = _bare(node_python(), str(d / "ingero-capture.pyz"), "--check", "--node", "x",
              cwd=tmp_path, env=clean_env(INGERO_PYZ_CACHE=str(tmp_path / "c")))
    assert r.returncode == 0, r.stderr


def test_kit_refuses_old_python(tmp_path):
    with pytest.raises(KitError, match="needs Python 3.10 or newer"):
        build_kit(tmp_path, python="3.9")
    r = subprocess.run([sys.executable, "-m", "ingero_forensics.kit_cli", "--python", "3.9",
                        "-o", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("Error: --python 3.9: ")
    assert "Traceback" not in r.stderr


# --------------------------------------------------------- the per-job wrapper

JOB_SCRIPT = ROOT / "scripts" / "ingero-job-capture.sh"


def _job(action, root, env):
    return subprocess.run(["sh", str(JOB_SCRIPT), action, str(root)], capture_output=True,
                          text=True, env=env, timeout=180, stdin=subprocess.DEVNULL)


def test_job_wrapper_with_the_pyz(kit, tmp_path):
    """start/stop around a job with the one-file capture: node and job from the Slurm
    variables, a sealed bundle in ROOT/JOB, the capture's exit code from stop."""
    _, archive = kit
    d = extract(archive, tmp_path / "k")
    env = clean_env(SLURM_JOB_ID="991", SLURMD_NODENAME="wrap-node", INGERO_STRICT="0",
                    INGERO_CAPTURE_ARGS="--no-ebpf",
                    INGERO_CAPTURE=f"{node_python()} -I -S {d / 'ingero-capture.pyz'}",
                    INGERO_PYZ_CACHE=str(tmp_path / "cache"))
    root = tmp_path / "var-ingero"
    r = _job("start", root, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"capturing as wrap-node into {root / '991'} (pid ")
    r = _job("stop", root, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"capture of wrap-node stopped (exit 0); 1 bundle(s) in {root / '991'}\n"
    (bundle,) = (root / "991").glob("wrap-node+*.bundle")
    from ingero_forensics.bundle import open_bundle
    with open_bundle(bundle) as b:
        assert b.node == "wrap-node"
    r = _job("stop", root, {**env, "SLURM_JOB_ID": "992"})
    assert r.returncode == 1 and "no capture started for job 992" in r.stderr


def test_job_wrapper_start_fails_loudly(tmp_path):
    cap = shutil.which("ingero-capture")
    assert cap, "ingero-capture is not on PATH"
    env = clean_env(INGERO_JOB="bad", INGERO_NODE="n", INGERO_CAPTURE=cap,
                    INGERO_CAPTURE_ARGS="--no-ebpf")       # --strict --no-ebpf: usage error
    r = _job("start", tmp_path, env)
    assert r.returncode == 1
    assert r.stderr.startswith(f"Error: {tmp_path / 'bad'}: capture exited with 2: ")
    r = subprocess.run(["sh", str(JOB_SCRIPT), "restart", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "usage:" in r.stderr


def test_job_wrapper_stops_a_capture_that_never_came_on(tmp_path):
    """A capture still not on at the timeout is stopped, not left running behind a start
    that said it failed (a Slurm prolog would then fail with a capture still going)."""
    import time
    slow = tmp_path / "slow-capture"
    # a capture that never comes on (its arguments kept, as a real one's are: the
    # wrapper signals only a process that names the job's directory)
    slow.write_text("#!/bin/sh\nwhile :; do sleep 0.2; done\n")
    slow.chmod(0o755)
    env = clean_env(INGERO_JOB="slow", INGERO_NODE="n", INGERO_CAPTURE=str(slow),
                    INGERO_START_TIMEOUT="1")
    r = _job("start", tmp_path, env)
    assert r.returncode == 1
    assert r.stderr.startswith(f"Error: {tmp_path / 'slow'}: capture did not start within "
                               "1 s; stopped it"), r.stderr
    pid = int((tmp_path / "slow" / ".capture.pid").read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"capture {pid} still running after a failed start")
    assert (tmp_path / "slow" / ".capture.rc").exists()   # ended, and waited for
    r = _job("start", tmp_path, {**env, "INGERO_START_TIMEOUT": "2m"})
    assert r.returncode == 2 and "give whole seconds" in r.stderr


STUB_CAPTURE = """#!/bin/sh
# a capture that comes on at once and stops on SIGTERM with 0 (or exits with $STUB_RC)
[ -n "${STUB_RC:-}" ] && { echo "Error: stub failed" >&2; exit "$STUB_RC"; }
echo "info: capture: sources on: stub" >&2
trap 'exit 0' TERM
while :; do sleep 0.1; done
"""


def _stub(tmp_path):
    stub = tmp_path / "stub-capture"
    stub.write_text(STUB_CAPTURE)
    stub.chmod(0o755)
    return stub


def test_job_wrapper_capture_outlives_a_prolog_process_group(tmp_path):
    """slurmd runs a prolog in a process group of its own and kills that group when the
    prolog exits (SIGTERM, then SIGKILL): the capture must not be in it (a review saw the
    job run uncaptured and the epilog's stop fail after 120 s)."""
    import signal
    import time
    env = clean_env(SLURM_JOB_ID="31", SLURMD_NODENAME="pg-node",
                    INGERO_CAPTURE=str(_stub(tmp_path)))
    p = subprocess.Popen(["sh", str(JOB_SCRIPT), "start", str(tmp_path)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    for sig in (signal.SIGTERM, signal.SIGKILL):    # what slurmd does to the group
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    pid = int((tmp_path / "31" / ".capture.pid").read_text())
    os.kill(pid, 0)                                 # still running
    r = _job("stop", tmp_path, env)
    assert r.returncode == 0 and "capture of pg-node stopped (exit 0)" in r.stdout, r.stderr


def test_job_wrapper_start_fails_when_strict_stops_the_capture(tmp_path):
    """--strict stops the capture right after its sources start when one is off: the
    wrapper must not take that start for a running capture (it said "capturing" and the
    job ran uncaptured). A capture that says "sources on:" runs; a strict stop says
    something else (capture/runner.py)."""
    stub = tmp_path / "strict-capture"
    stub.write_text("#!/bin/sh\necho 'info: capture: sources started: clock, host; stopping "
                    "at once (--strict: an eBPF source is off)' >&2\nsleep 1\nexit 4\n")
    stub.chmod(0o755)
    env = clean_env(INGERO_JOB="strict", INGERO_NODE="n", INGERO_CAPTURE=str(stub))
    r = _job("start", tmp_path, env)
    assert r.returncode == 1 and "capture exited with 4" in r.stderr, (r.stdout, r.stderr)


def test_job_wrapper_reads_only_its_own_start(tmp_path):
    """A second start in the same job directory (a requeued job, a rerun) must not take
    the first run's "sources on:" line for its own; -q, which hides that line, is
    refused; a capture that died without an exit code fails stop at once."""
    import signal
    import time
    stub = _stub(tmp_path)
    env = clean_env(INGERO_JOB="rerun", INGERO_NODE="n", INGERO_CAPTURE=str(stub))
    assert _job("start", tmp_path, env).returncode == 0
    assert _job("stop", tmp_path, env).returncode == 0
    r = _job("start", tmp_path, {**env, "STUB_RC": "1"})
    assert r.returncode == 1 and "capture exited with 1: Error: stub failed" in r.stderr, \
        (r.stdout, r.stderr)
    assert "sources on:" in (tmp_path / "rerun" / ".capture.log.1").read_text()
    for args in ("--duration 5 -q", "-qp 123", "--quiet"):
        r = _job("start", tmp_path, {**env, "INGERO_CAPTURE_ARGS": args})
        assert r.returncode == 2 and "hides the line start waits for" in r.stderr, args
    assert _job("start", tmp_path, env).returncode == 0
    r = _job("start", tmp_path, env)
    assert r.returncode == 1 and "is still running for job rerun" in r.stderr
    # the capture and its waiting shell killed (as by an OOM kill), a segment left in
    # the spool: no exit code, and stop says so at once
    pid = int((tmp_path / "rerun" / ".capture.pid").read_text())
    (tmp_path / "rerun" / ".spool").mkdir()
    (tmp_path / "rerun" / ".spool" / "segment-000003.db").write_bytes(b"")
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    t = time.monotonic()
    r = _job("stop", tmp_path, env)
    assert r.returncode == 1 and "ended without an exit code" in r.stderr, r.stderr
    assert time.monotonic() - t < 10
    # only the waiting shell killed: the capture still stops on SIGTERM and leaves
    # nothing unsealed; its code is unknown, which stop says without failing
    (tmp_path / "rerun" / ".spool" / "segment-000003.db").unlink()
    assert _job("start", tmp_path, env).returncode == 0
    pid = int((tmp_path / "rerun" / ".capture.pid").read_text())
    os.kill(int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]),
            signal.SIGKILL)
    r = _job("stop", tmp_path, env)
    assert r.returncode == 0 and "exit code unknown" in r.stdout, (r.stdout, r.stderr)
    # a pid saved earlier that is now another process's is never signalled
    other = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "rerun" / ".capture.pid").write_text(f"{other.pid}\n")
        (tmp_path / "rerun" / ".capture.rc").unlink(missing_ok=True)
        r = _job("stop", tmp_path, env)
        assert other.poll() is None, "stop signalled a process that is not the capture"
        assert _job("start", tmp_path, env).returncode == 0   # not "still running"
        assert _job("stop", tmp_path, env).returncode == 0
    finally:
        other.kill()
        other.wait()


def test_install_takes_the_kits_python_beside_another_python3(kit, tmp_path):
    """RHEL: python3 is the system's 3.9, python3.11 is installed beside it. install.sh
    takes python3.X of the kit's version when it is there (it took python3 and told the
    operator to install what they had)."""
    _, archive = kit
    d = extract(archive, tmp_path / "a")
    info = json.loads((d / "kit.json").read_text())
    info["python"] = "3.99"     # a version no python3 here is: the one named after it
    _rewrite(d, "kit.json", json.dumps(info).encode())
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3.99").symlink_to(node_python())
    env = clean_env()
    env["PATH"] = f"{bindir}:{env['PATH']}"
    r = subprocess.run(["sh", str(d / "install.sh"), str(tmp_path / "p")], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 1 and f"{bindir / 'python3.99'} is Python" in r.stderr, r.stderr
    assert "PYTHON=/path/to/it sh install.sh" in r.stderr
    assert not (tmp_path / "p").exists()


def test_a_kit_built_without_a_compiler_says_so(tmp_path, monkeypatch):
    """No C compiler where the kit is built: the build goes on, but warns, and kit.json
    says the accelerators are not there (it said they were, with none in the wheel)."""
    from ingero_forensics.kit import wheel_has_accelerators
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    res = build_kit(tmp_path / "out", pyz=False)
    assert res.pure and len(res.warnings) == 1 and "not built" in res.warnings[0]
    d = extract(Path(res.archive), tmp_path / "x")
    assert json.loads((d / "kit.json").read_text())["accelerators"] is False
    (project,) = (d / "wheels").glob("ingero_forensics-*.whl")
    assert not wheel_has_accelerators(project)


def test_build_kit_script_names_its_clone_as_the_source(tmp_path):
    """scripts/build-kit.sh passes --source (the clone): after scripts/demo.sh, .venv
    holds a plain install, which cannot find the source tree by itself."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "build-kit.sh", tmp_path / "scripts")
    stub = tmp_path / ".venv" / "bin" / "ingero-kit"
    stub.parent.mkdir(parents=True)
    stub.write_text('#!/bin/sh\necho "$@"\n')
    stub.chmod(0o755)
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "build-kit.sh"), "-o", "dist"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["--source", str(tmp_path), "-o", "dist"]
