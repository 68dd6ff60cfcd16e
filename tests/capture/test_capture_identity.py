"""Node identity: precedence --node > config file > $INGERO_NODE > hostname, and validation."""

import os

import pytest
from click.testing import CliRunner

from ingero_forensics.capture.cli import main
from ingero_forensics.capture.identity import (ConfigError, _parse_simple_toml, host_facts,
                                               read_config, resolve_node_name)


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text('# capture config\nnode = "from-config"\n')
    return p


@pytest.mark.parametrize("cli, use_cfg, env, want, origin", [
    ("from-cli", True, "from-env", "from-cli", "--node"),
    (None, True, "from-env", "from-config", "config file"),
    (None, False, "from-env", "from-env", "INGERO_NODE"),
    (None, False, None, "from-host", "hostname"),
    ("from-cli", False, None, "from-cli", "--node"),
])
def test_precedence(cli, use_cfg, env, want, origin, cfg, tmp_path):
    environ = {"INGERO_NODE": env} if env else {}
    name, got_origin = resolve_node_name(cli, cfg if use_cfg else None, environ, "from-host",
                                         default_config=tmp_path / "absent.toml")
    assert name == want
    assert got_origin.startswith(origin)


def test_default_config_file_used_when_present(cfg):
    name, origin = resolve_node_name(None, None, {"INGERO_NODE": "env"}, "host",
                                     default_config=cfg)
    assert (name, origin) == ("from-config", f"config file {cfg}")


def test_config_without_node_falls_through(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[other]\nnode = "not-top-level"\n')
    assert resolve_node_name(None, p, {"INGERO_NODE": "env-1"}, "h")[0] == "env-1"


@pytest.mark.parametrize("bad", ["", "has space", "a" * 64, "slash/name", "plus+sign",
                                 "ünï", "semi;colon", "-o", "--help", ".hidden", "..x",
                                 "a\x1b]0;t\x07"])
def test_invalid_names_rejected_with_origin(bad):
    with pytest.raises(ConfigError) as e:
        resolve_node_name(bad, None, {}, "host")
    assert f"invalid node name {bad!r} (from --node)" in str(e.value)


@pytest.mark.parametrize("good", ["a", "A" * 63, "gpu-017.rack_3", "0", "_", "x-", "x."])
def test_valid_names(good):
    assert resolve_node_name(good, None, {}, "host")[0] == good


def test_invalid_env_name_names_its_origin():
    with pytest.raises(ConfigError, match=r"\(from INGERO_NODE\)"):
        resolve_node_name(None, None, {"INGERO_NODE": "bad name"}, "host")


def test_invalid_hostname_names_its_origin(tmp_path):
    with pytest.raises(ConfigError, match=r"\(from hostname\)"):
        resolve_node_name(None, None, {}, "x" * 70, default_config=tmp_path / "none")


def test_bad_toml_names_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('node = "unterminated\n')
    with pytest.raises(ConfigError, match=rf"^{p}: invalid TOML"):
        read_config(p)


def test_missing_config_names_file(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'nope.toml'}: cannot read config file"):
        resolve_node_name(None, tmp_path / "nope.toml", {}, "h")


def test_non_string_node_in_config(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("node = 17\n")
    with pytest.raises(ConfigError, match="'node' must be a string"):
        resolve_node_name(None, p, {}, "h")


def test_python310_fallback_parser_reads_the_node_key():
    raw = b'# x\n  node = "gpu-1"  # comment\nother = "y"\n[table]\nnode = "inner"\n'
    assert _parse_simple_toml("f", raw) == {"node": "gpu-1", "other": "y"}


def test_host_facts_have_manifest_keys():
    h = host_facts()
    for key in ("hostname", "boot_id", "kernel_release", "tool_version"):
        assert isinstance(h[key], str) and h[key]


def test_cli_invalid_node_is_one_line_error(tmp_path):
    r = CliRunner().invoke(main, ["--bundle", str(tmp_path / "b"), "--node", "bad name",
                                  "--no-ebpf", "--duration", "1"])
    assert r.exit_code == 1
    assert r.output == ("Error: invalid node name 'bad name' (from --node): use 1-63 "
                        "characters of A-Z a-z 0-9 . _ -, not starting with - or .\n")
    assert not (tmp_path / "b").exists()  # nothing created for a bad configuration


def test_cli_missing_pid_is_one_line_error(tmp_path):
    r = CliRunner().invoke(main, ["--bundle", str(tmp_path), "--node", "n", "--no-ebpf",
                                  "--pid", "999999999", "--duration", "1"])
    assert r.exit_code == 1
    assert r.output == "Error: --pid 999999999: no such process\n"


def test_cli_pid_of_a_thread_names_its_process(tmp_path):
    """/proc lists processes only: a thread's id given as --pid traced nothing, with a
    warning only at the end (a review). It is a usage mistake said at start."""
    import threading
    import time
    done = threading.Event()
    t = threading.Thread(target=done.wait, args=(30,))
    t.start()
    try:
        while t.native_id is None:
            time.sleep(0.01)
        r = CliRunner().invoke(main, ["--bundle", str(tmp_path / "b"), "--node", "n",
                                      "--no-ebpf", "--pid", str(t.native_id),
                                      "--duration", "1"])
    finally:
        done.set()
        t.join()
    me = os.getpid()
    assert r.exit_code == 1
    assert r.output == (f"Error: --pid {t.native_id}: a thread of process {me}, not a "
                        f"process; pass --pid {me} (its threads are traced with it)\n")
    assert not (tmp_path / "b").exists()


def test_cli_pid_of_a_kernel_thread_is_refused(tmp_path):
    """A kernel thread has no user space, and kthreadd's children are every kernel
    thread: a --pid of it traced them all, where the docs say kernel threads are
    skipped. (Found by its flags, not assumed to be pid 2: a PID namespace has none.)"""
    from ingero_forensics.capture.procs import is_kernel_thread, list_pids, read_comm
    kthreads = sorted(p for p in list_pids() if is_kernel_thread(p) and read_comm(p))
    if not kthreads:
        pytest.skip("no kernel thread visible here (a PID namespace)")
    pid = kthreads[0]
    comm = read_comm(pid)
    r = CliRunner().invoke(main, ["--bundle", str(tmp_path / "b"), "--node", "n",
                                  "--no-ebpf", "--pid", str(pid), "--duration", "1"])
    assert r.exit_code == 1
    assert r.output == (f"Error: --pid {pid}: a kernel thread ({comm}), not a user "
                        "process: nothing of it can be traced\n")
