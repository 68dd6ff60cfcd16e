"""ingero-capture's command line: --check, --help, --version, --json, --quiet."""

import json

import pytest

from click.testing import CliRunner

from ingero_forensics import __version__
from ingero_forensics.capture.cli import main

from .conftest import run_capture


def test_check_lists_every_source_with_reasons(tmp_path):
    r = CliRunner().invoke(main, ["--check", "--node", "chk-1", "--no-ebpf"])
    assert r.exit_code == 0, r.output
    lines = {ln.split()[0]: ln for ln in r.output.splitlines()}
    assert set(lines) == {"node", "clock", "clock.chrony", "clock.ptp", "host", "host.nvml", "ebpf"}
    assert "chk-1 (from --node)" in lines["node"]
    assert lines["clock"].split()[1] == "ok" and lines["host"].split()[1] == "ok"
    assert lines["ebpf"].split()[1] == "off" and "--no-ebpf" in lines["ebpf"]
    for name in ("clock.chrony", "clock.ptp", "host.nvml"):
        state = lines[name].split()[1]
        assert state in ("ok", "off")
        if state == "off":
            assert "(fix: " in lines[name]  # every off source says how to turn it on
    assert not list(tmp_path.iterdir())  # --check writes nothing


def test_check_json_and_ebpf_reason():
    r = CliRunner().invoke(main, ["--check", "--json", "--node", "n"])
    assert r.exit_code == 0, r.output
    got = {s["name"]: s for s in json.loads(r.output)}
    assert got["clock"]["available"] is True
    assert set(got) >= {"node", "clock", "host", "host.nvml"}
    ebpf = [s for name, s in got.items() if name not in
            ("node", "clock", "clock.chrony", "clock.ptp", "host", "host.nvml")]
    assert ebpf  # either the eBPF sources' own probes or one "ebpf" entry saying why not
    for s in ebpf:
        assert s["available"] or s["reason"]


def test_check_with_invalid_node_exits_1():
    r = CliRunner().invoke(main, ["--check", "--node", "no good", "--no-ebpf"])
    assert r.exit_code == 1
    assert r.stdout.splitlines()[0].startswith("node")
    assert "invalid node name 'no good' (from --node)" in r.output
    # the reason on stderr too, one line (a review: stdout alone had it)
    assert r.stderr.splitlines() == ["Error: invalid node name 'no good' (from --node): use "
                                     "1-63 characters of A-Z a-z 0-9 . _ -, not starting "
                                     "with - or ."], r.stderr


@pytest.mark.parametrize("extra", [(), ("--json",)])
def test_a_failed_check_piped_into_a_closed_pipe_still_fails(extra):
    """`ingero-capture --check --strict | head -1` in a roll-out script: stdout closed
    before the table is written must not turn the failed check into exit 0."""
    import shlex
    import subprocess
    cmd = ["ingero-capture", "--check", "--strict", "--node", "bad/name", *extra]
    r = subprocess.run(["bash", "-c", f"{shlex.join(cmd)} | true; echo ${{PIPESTATUS[0]}}"],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "1", (r.stdout, r.stderr)
    assert "Error: invalid node name 'bad/name'" in r.stderr and "Traceback" not in r.stderr


def test_a_comm_longer_than_the_kernel_keeps_is_a_usage_error(tmp_path):
    """From a review: --comm my_long_trainer_name matched nothing (the kernel keeps 15
    bytes of a name) and the capture traced nothing without saying why."""
    r = CliRunner().invoke(main, ["--bundle", str(tmp_path / "b"), "--no-ebpf",
                                  "--comm", "my_long_trainer_name", "--duration", "1"])
    assert r.exit_code == 2, r.output
    assert ("'my_long_trainer_name' is longer than the 15 bytes the kernel keeps of a "
            "process name: it would match nothing (the process is named 'my_long_trainer' "
            "there)") in r.stderr
    assert not (tmp_path / "b").exists()


def test_help_and_version():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for text in ("Example:", "ingero-capture --bundle /var/ingero", "Exit codes:", "--max-disk",
                 "--no-ebpf", "--check", "SIGHUP"):
        assert text in r.output
    r = CliRunner().invoke(main, ["--version"])
    assert r.output == f"ingero-capture {__version__}\n"


def test_bad_size_is_usage_error(tmp_path):
    r = CliRunner().invoke(main, ["--bundle", str(tmp_path), "--max-disk", "lots"])
    assert r.exit_code == 2
    assert "not a size: 'lots'" in r.output


@pytest.mark.parametrize("args", [
    ("--max-disk", "0"), ("--max-disk", "-5G"), ("--max-disk", "infG"),
    ("--segment-size", "0"), ("--segment-size", "-1M"), ("--segment-size", "1e999M"),
    ("--duration", "nan"), ("--duration", "inf"), ("--segment-seconds", "nan"),
    ("--clock-interval", "nan"), ("--host-interval", "inf")])
def test_sizes_and_seconds_that_are_no_bound_are_usage_errors(tmp_path, args):
    """--max-disk 0 evicted every sealed segment of the node (exit 0); --duration nan
    passed the range check and never stopped; infG was a traceback."""
    (tmp_path / "b").mkdir()
    sealed = tmp_path / "b" / "n1+20250101T000000Z+000000.bundle"
    sealed.write_bytes(b"kept")
    r = CliRunner().invoke(main, ["--bundle", str(tmp_path / "b"), "--node", "n1",
                                  "--no-ebpf", *args])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{args[0]}'" in r.output and "Traceback" not in r.output
    assert sealed.read_bytes() == b"kept" and sorted(p.name for p in (tmp_path / "b").iterdir()) \
        == [sealed.name]


def test_json_summary_and_quiet(tmp_path):
    # --comm of no process: automatic discovery would trace any process on the machine
    # with RANK in its environment (a CI agent's, a leaked rank)
    r = run_capture("--bundle", tmp_path, "--node", "js", "--no-ebpf", "--duration", "1",
                    "--json", "--quiet", "--comm", "ingero-none")
    assert r.returncode == 0
    from ingero_forensics.capture.host import HostSource
    nvml = HostSource.probe_nvml()
    # --quiet: nothing but errors, one line per source that is off (NVML on a machine
    # without the driver; --no-ebpf is on purpose) and the blind spot of a capture that
    # traced no process (none matched)
    lines = r.stderr.splitlines()
    assert [ln for ln in lines if "NVML off: " not in ln and
            "no process was traced during the capture" not in ln] == [], r.stderr
    assert len(lines) == (1 if nvml.available else 2), r.stderr
    s = json.loads(r.stdout)
    assert s["node"] == "js" and s["node_origin"] == "--node"
    assert len(s["segments"]) == 1 and s["segments"][0].startswith(str(tmp_path))
    assert s["sources_on"] == ["clock", "host"]
    assert s["sources_off"] == {"ebpf": "turned off with --no-ebpf",
                                **({} if nvml.available else {"nvml": nvml.reason})}
    assert s["stop_reason"] == "duration"
    assert s["events"]["clock"] >= 2


def test_plain_log_lines_when_not_a_tty(tmp_path):
    r = run_capture("--bundle", tmp_path, "--node", "pl", "--no-ebpf", "--duration", "1")
    assert r.returncode == 0
    assert "\r" not in r.stderr and "\033[" not in r.stderr  # no status-line escapes
    assert "capturing as node pl" in r.stderr and "sealed pl+" in r.stderr


def test_reporter_modes():
    import io
    from ingero_forensics.capture.status import Reporter, status_text
    text = status_text({"clock": 1.0, "host": 370.4}, 0, 3, 2 << 20, 5 << 30)
    assert text == "seg 3 2.0 MiB | disk 5.0 GiB | clock 1/s host 370/s | lost 0"
    tty = io.StringIO()
    rep = Reporter("tty", tty)
    rep.status(text)
    rep.message("warning", "nccl", "nccl source off")
    rep.close()
    out = tty.getvalue()
    assert out.startswith("\r\033[K" + text) and "\r\033[K" in out[len(text) + 4:]
    assert "warning nccl: nccl source off\n" in out
    quiet = io.StringIO()
    rep = Reporter("quiet", quiet)
    rep.status(text)
    rep.message("warning", "x", "hidden")
    rep.message("error", "x", "shown")
    assert "hidden" not in quiet.getvalue() and "error   x: shown" in quiet.getvalue()


def test_sources_start_at_the_lowest_priority_then_return_to_normal():
    """The probes are compiled at SCHED_IDLE and nice 19 (a running job barely notices),
    and the capture goes back to its own priority after."""
    import os
    from ingero_forensics.capture.runner import idle_priority
    before = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    with idle_priority():
        inside = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    after = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    assert inside == (os.SCHED_IDLE, 19)
    assert after == before


def test_a_start_starved_at_idle_priority_goes_on_at_nice_19():
    """SCHED_IDLE never runs while every CPU is busy: after starve_s the block goes on
    under the normal policy at nice 19 (still the lowest), says so, and the thread gets
    its own priority back after."""
    import os
    import time
    from ingero_forensics.capture.runner import idle_priority
    before = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    with idle_priority(starve_s=0.05) as prio:
        first = os.sched_getscheduler(0)
        time.sleep(0.3)
        later = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    assert first == os.SCHED_IDLE
    assert later == (os.SCHED_OTHER, 19) and prio.raised
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)) == before
    with idle_priority(starve_s=5) as quick:
        pass
    assert not quick.raised


def test_duration_counts_from_every_source_on(tmp_path):
    """On a busy node BCC's compile at idle priority took over 30 s, and an 8 s capture
    counted from its start stopped as its sources came on, holding no collective. The
    duration is the time every source is on: a source 1 s slow to start still gets it."""
    import time
    from ingero_forensics.capture.runner import CaptureConfig
    from ingero_forensics.capture.runner import run_capture as run_in_process
    from ingero_forensics.capture.source import Source

    class SlowStart(Source):
        name = "slow"
        polls: list = []

        def start(self, ctx):
            time.sleep(1.0)

        def poll(self, sink):
            SlowStart.polls.append(time.monotonic())

    t0 = time.monotonic()
    summary = run_in_process(CaptureConfig(bundle_dir=tmp_path / "b", node="dur-test",
                                           duration=0.6, ebpf=False, output="quiet",
                                           idle_start=False, extra_sources=(SlowStart(),)))
    polls = SlowStart.polls
    assert summary.stop_reason == "duration"
    assert polls and polls[0] - t0 >= 1.0
    assert polls[-1] - polls[0] >= 0.45, polls     # polled for the duration, after the start
    assert summary.seconds >= 1.5


@pytest.mark.parametrize("idle", [True, False], ids=["idle", "normal"])
def test_start_priority_option_decides_how_sources_start(tmp_path, idle):
    """--start-priority idle (the default) starts every source at SCHED_IDLE and nice 19;
    normal at the capture's own priority. A source records what it started at."""
    import os
    from ingero_forensics.capture.runner import CaptureConfig
    from ingero_forensics.capture.runner import run_capture as run_in_process
    from ingero_forensics.capture.source import Source

    class PrioritySpy(Source):
        name = "spy"
        seen = None

        def start(self, ctx):
            PrioritySpy.seen = (os.sched_getscheduler(0),
                                os.getpriority(os.PRIO_PROCESS, 0))

        def poll(self, sink):
            pass

    own = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    run_in_process(CaptureConfig(bundle_dir=tmp_path / "b", node="prio-test", duration=0.3,
                                 ebpf=False, output="quiet",
                                 extra_sources=(PrioritySpy(),), idle_start=idle))
    assert PrioritySpy.seen == ((os.SCHED_IDLE, 19) if idle else own)
    r = CliRunner().invoke(main, ["--help"])
    assert "--start-priority [idle|normal]" in r.output


@pytest.mark.parametrize("args, budget", [((), 5000), (("--launch-budget", "0"), 0),
                                          (("--launch-budget", "250"), 250)])
def test_launch_budget_option_reaches_the_sources(tmp_path, monkeypatch, args, budget):
    """--launch-budget (default 5000 launches/s) is what the CUDA source samples above;
    0 counts every launch; a negative budget is a usage error."""
    import ingero_forensics.capture.cli as cli

    seen = {}

    def fake_run(config, reporter=None):
        seen["budget"] = config.options.launch_budget
        raise SystemExit(0)

    monkeypatch.setattr(cli, "run_capture", fake_run)
    r = CliRunner().invoke(main, ["--bundle", str(tmp_path), "--node", "n1", *args])
    assert r.exit_code == 0, r.output
    assert seen["budget"] == budget
    bad = CliRunner().invoke(main, ["--bundle", str(tmp_path), "--launch-budget", "-1"])
    assert bad.exit_code == 2 and "--launch-budget" in bad.output


def test_root_without_bpf_capabilities_is_no_ebpf(tmp_path):
    """Root with an empty capability bounding set (an unprivileged container, a service
    with CapabilityBoundingSet=): --check said every eBPF source was ok and --strict
    exited 0, then every source failed at load with advice about kernel headers."""
    import os
    import shutil
    import subprocess
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv")
    from .conftest import CAPTURE, capture_env
    drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]
    r = subprocess.run([*drop, *CAPTURE, "--check", "--strict", "--node", "n1"],
                       capture_output=True, text=True, env=capture_env(), timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    ebpf = [line for line in r.stdout.splitlines() if line.split()[:1] in
            (["nccl"], ["cuda"], ["tcp"], ["sched"], ["block"])]
    assert len(ebpf) == 5 and all(" off " in line and "may not use BPF" in line and
                                  "CAP_BPF" in line for line in ebpf), r.stdout
    r = subprocess.run([*drop, *CAPTURE, "--bundle", tmp_path / "b", "--node", "n1",
                        "--duration", "1", "--strict"],
                       capture_output=True, text=True, env=capture_env(), timeout=120)
    assert r.returncode == 4 and "may not use BPF" in r.stderr, r.stderr   # --strict: 4
    assert "kernel headers" not in r.stderr, r.stderr


def test_a_lib_the_capture_would_skip_is_a_usage_error(tmp_path):
    """--lib with a missing file or a name that does not say which library it is was
    skipped in silence (exit 0, nothing probed, nothing said); so was a file named like
    the library that is not it (a review: /etc/passwd as libnccl.so.2, libcuda as
    libcudart.so.12 passed --check --strict and a --strict capture, recording nothing)."""
    import shutil

    from ..fixtures.build import build_fixtures
    fx = build_fixtures()
    odd = tmp_path / "my_nccl_build.so"
    shutil.copyfile(fx.libnccl, odd)
    not_elf = tmp_path / "not" / "libnccl.so.2"
    not_elf.parent.mkdir()
    not_elf.symlink_to("/etc/passwd")
    other = tmp_path / "other" / "libcudart.so.12"
    other.parent.mkdir()
    shutil.copyfile(fx.libcuda, other)       # the driver library under the runtime's name
    for lib, why in ((tmp_path / "libcudart.so.12", "no such file"),
                     (odd, "the file name does not say which library it is"),
                     (not_elf, "is not an ELF shared library"),
                     (other, "has none of the libcudart.so functions the capture probes")):
        for args in (["--bundle", str(tmp_path / "b"), "--node", "n1", "--no-ebpf",
                      "--duration", "0.1"], ["--check", "--strict"]):
            r = CliRunner().invoke(main, [*args, "--lib", str(lib)])
            assert r.exit_code == 2 and why in r.output, r.output
    assert not (tmp_path / "b").exists()
    link = tmp_path / "libnccl.so.2"
    link.symlink_to(odd)          # the remedy the message gives
    r = CliRunner().invoke(main, ["--bundle", str(tmp_path / "b"), "--node", "n1",
                                  "--no-ebpf", "--duration", "0.1", "--lib", str(link)])
    assert r.exit_code == 0, r.output


def test_an_empty_path_is_a_usage_error(tmp_path, monkeypatch):
    """--bundle "" (the "$DIR" of an unset variable in a unit file) captured into the
    current directory and exited 0; --config "" said "Is a directory"."""
    monkeypatch.chdir(tmp_path)
    for opt in ("--bundle", "--config"):
        r = CliRunner().invoke(main, [opt, "", "--node", "n1", "--no-ebpf", "--duration", "0.1"])
        assert r.exit_code == 2 and "an empty path" in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_a_library_with_none_of_the_functions_is_a_warning():
    """A library found in the targets' mappings that holds none of the probed
    functions: a warning in capture_log (it was an info line, hidden by --quiet)."""
    from types import SimpleNamespace

    from ingero_forensics.capture.ebpf.base import BccSource
    src = SimpleNamespace(attached=[], notes=[], _announced=True)
    BccSource.note_attached(src, "/x/libnccl.so.2", "uprobes", 3, ["a", "b", "c"])
    BccSource.note_attached(src, "/y/libnccl.so.2", "uprobes", 3, ["a"])
    assert [lvl for lvl, _m in src.notes] == ["warning", "info"]
    assert "none of the 3 functions probed is in /x/libnccl.so.2" in src.notes[0][1]
    assert src.attached[1] == "uprobes on /y/libnccl.so.2: 2 functions (not attached: a)"
