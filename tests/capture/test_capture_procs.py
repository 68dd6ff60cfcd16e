"""Target processes and the allow-listed rank environment."""

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import pytest
import zstandard

from ingero_forensics.bundle import open_bundle
from ingero_forensics.capture.procs import (RANK_ENV_NAMES, TargetSet, parse_environ_stream,
                                            rank_fields, read_cmdline, read_rank_env)

from .conftest import bundles, capture_env, rows, run_capture, start_capture, wait_for

SECRET = "hunter2-" + "x9Qz"  # built at run time so the literal is not in this file's bytes


def _stream(data: bytes, chunk: int):
    f = io.BytesIO(data)
    return lambda n: f.read(min(n, chunk))


def test_only_allow_listed_names_are_kept():
    env = b"\0".join([b"RANK=3", b"AWS_SECRET_ACCESS_KEY=" + SECRET.encode(), b"WORLD_SIZE=8",
                      b"PATH=/bin", b"RANKX=9", b"XRANK=1", b"SLURM_JOB_ID=77", b""])
    got = parse_environ_stream(_stream(env, 4096))
    assert got == {"RANK": "3", "WORLD_SIZE": "8", "SLURM_JOB_ID": "77"}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_chunk_boundaries_do_not_matter(chunk):
    env = b"A=1\0LOCAL_RANK=5\0" + b"B=" + b"y" * 10000 + b"\0NODE_RANK=2\0CUDA_VISIBLE_DEVICES=0,1"
    assert parse_environ_stream(_stream(env, chunk)) == {
        "LOCAL_RANK": "5", "NODE_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_long_value_of_an_allowed_name_is_cut_not_spread():
    env = b"RANK=" + b"1" * 100000 + b"\0WORLD_SIZE=4\0"
    got = parse_environ_stream(_stream(env, 4096))
    assert got == {"WORLD_SIZE": "4"}  # an over-long entry is skipped whole


@pytest.mark.parametrize("env, want", [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
      "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "job-a"},
     {"rank": 3, "local_rank": 1, "world_size": 16, "local_world_size": 8, "node_rank": 0,
      "job_id": "job-a"}),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     {"rank": 5, "local_rank": 1, "world_size": None, "local_world_size": None,
      "node_rank": None, "job_id": None}),
    ({"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "SLURM_NODEID": "1", "SLURM_JOB_ID": "991"},
     {"rank": 7, "local_rank": 3, "world_size": None, "local_world_size": None,
      "node_rank": 1, "job_id": "991"}),
    ({"RANK": "not-a-number", "PMI_RANK": "2"},
     {"rank": 2, "local_rank": None, "world_size": None, "local_world_size": None,
      "node_rank": None, "job_id": None}),
])
def test_rank_fields(env, want):
    assert rank_fields(env) == want


def test_allow_list_is_the_issue_list():
    assert set(RANK_ENV_NAMES) == {
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        "ROLE_RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_NODEID", "SLURM_PROCID",
        "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK",
        "CUDA_VISIBLE_DEVICES"}


def _sleeper(env_extra, name="rank-sleeper"):
    env = {"PATH": os.environ["PATH"], **env_extra}
    code = f"import sys,time; sys.argv[0]='{name}'; time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def test_read_rank_env_of_a_real_process():
    p = _sleeper({"RANK": "4", "AWS_SECRET_ACCESS_KEY": SECRET})
    try:
        wait_for(lambda: read_rank_env(p.pid) == {"RANK": "4"}, what="environ readable")
    finally:
        p.kill()
        p.wait()


def test_target_set_auto_finds_rank_process_and_keeps_it_after_exit():
    p = _sleeper({"RANK": "1", "WORLD_SIZE": "2"})
    other = _sleeper({"NOT_RANK": "1"})
    try:
        ts = TargetSet()
        seen_new, seen_exit = [], []
        ts.subscribe(seen_new.append, seen_exit.append)
        wait_for(lambda: (ts.scan(), p.pid in ts.pids())[1], what="target found")
        assert other.pid not in ts.pids()
        # other NCCL/rank processes on the machine may be found too; ours exactly once
        assert seen_new.count(p.pid) == 1 and other.pid not in seen_new
        info = ts.known[p.pid]
        assert info.row()[5] == 1 and info.row()[7] == 2
        assert p.pid in info.threads
        p.kill()
        p.wait()
        wait_for(lambda: (ts.scan(), p.pid not in ts.pids())[1], what="exit noticed")
        assert seen_exit.count(p.pid) == 1
        assert ts.known[p.pid].exit_ns is not None  # the record is kept
    finally:
        for q in (p, other):
            q.kill()
            q.wait()


def test_target_set_by_comm_and_pid():
    a = _sleeper({})
    try:
        ts = TargetSet(pids=[a.pid])
        ts.scan()
        assert ts.pids() == {a.pid}
        comm = open(f"/proc/{a.pid}/comm").read().strip()
        ts2 = TargetSet(comms=[comm])
        ts2.scan()
        assert a.pid in ts2.pids()
        assert os.getpid() not in ts2.pids()
    finally:
        a.kill()
        a.wait()


def test_secret_never_reaches_the_bundle(tmp_path, open_all):
    """A traced process (and the capture itself) carry a secret: the bundle must not."""
    target = _sleeper({"RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "job-7",
                       "AWS_SECRET_ACCESS_KEY": SECRET})
    try:
        r = run_capture("--bundle", tmp_path / "b", "--node", "n1", "--no-ebpf",
                        "--duration", "2", env=capture_env(AWS_SECRET_ACCESS_KEY=SECRET))
        assert r.returncode == 0, r.stderr
    finally:
        target.kill()
        target.wait()
    [path] = bundles(tmp_path / "b")
    raw = path.read_bytes()
    image = zstandard.ZstdDecompressor().decompressobj().decompress(raw[8 + int.from_bytes(raw[4:8], "little"):])
    assert b"SQLite format 3" in image
    for blob in (raw, image):
        assert SECRET.encode() not in blob
        assert b"AWS_SECRET_ACCESS_KEY" not in blob
    [b] = open_all(tmp_path / "b")
    [(rank, world, job, env)] = rows(b, "SELECT rank, world_size, job_id, env FROM processes "
                                        "WHERE pid = ?", target.pid)
    assert (rank, world, job) == (3, 4, "job-7")
    assert json.loads(env) == {"RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "job-7"}
    assert b.manifest.get("job_ids") == ["job-7"]
    assert rows(b, "SELECT COUNT(*) FROM threads WHERE pid = ?", target.pid)[0][0] >= 1


def test_children_of_explicit_targets_are_targets():
    """--pid PID takes PID's children and their children too (a data loader's workers:
    their block I/O is the job's, docs/report.md), found on the next scans; so does
    --comm, whatever the children are called; a process that is not a descendant stays
    out."""
    code = ("import os, time\n"
            "with open('/proc/self/comm', 'w') as f:\n"
            "    f.write('ingero-tparent')\n"     # a name no other process here has
            "def worker():\n"
            "    with open('/proc/self/comm', 'w') as f:\n"
            "        f.write('ld-worker')\n"
            "if os.fork() == 0:\n"            # the worker
            "    worker()\n"
            "    if os.fork() == 0:\n"        # the worker's own helper
            "        worker()\n"
            "        time.sleep(60)\n"
            "    time.sleep(60)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    other = _sleeper({})

    def children(pid):
        return [int(x) for x in subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)],
                                               capture_output=True, text=True).stdout.split()]
    try:
        wait_for(lambda: children(parent.pid) and children(children(parent.pid)[0]),
                 what="the worker and its helper")
        (child,) = children(parent.pid)
        (grandchild,) = children(child)
        wait_for(lambda: open(f"/proc/{grandchild}/comm").read().strip() == "ld-worker",
                 what="the helper's name")
        ts = TargetSet(pids=[parent.pid])
        for _ in range(2):          # a grandchild whose pid sorts first: the next scan
            ts.scan()
        assert ts.pids() == {parent.pid, child, grandchild}
        assert other.pid not in ts.pids()
        wait_for(lambda: open(f"/proc/{parent.pid}/comm").read().strip() == "ingero-tparent",
                 what="the parent's name")
        named = TargetSet(comms=["ingero-tparent"])
        for _ in range(2):
            named.scan()
        assert named.pids() == {parent.pid, child, grandchild}
        assert ts.known[child].comm == "ld-worker"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, 9)
        parent.wait()
        other.kill()
        other.wait()


def test_explicit_pids_never_pull_in_other_rank_processes():
    """--pid means those processes and their descendants, not others that carry RANK."""
    a = _sleeper({})
    rank = _sleeper({"RANK": "3"})
    try:
        wait_for(lambda: read_rank_env(rank.pid) == {"RANK": "3"}, what="environ readable")
        ts = TargetSet(pids=[a.pid])
        ts.scan()
        assert ts.pids() == {a.pid}
        auto = TargetSet()
        auto.scan()
        assert rank.pid in auto.pids()   # the same process is a target in auto mode
    finally:
        for q in (a, rank):
            q.kill()
            q.wait()


# --------------------------------------------------------- command lines (issue 21)

API_KEY = "sk-" + "live" + "A1b2C3d4E5f6G7h8I9j0"    # built at run time, as SECRET
PASSWORD = "pw-" + "Tr0ub4dor"
HF = "hf" + "_" + "QwErTyUiOpAsDfGhJkLzXcVbNm"


@pytest.mark.parametrize("argv, want", [
    (["train.py", "--api-key=V1", "--lr", "0.1"], ["train.py", "--api-key=***", "--lr", "0.1"]),
    (["train.py", "--password", "V2", "--epochs", "3"],
     ["train.py", "--password", "***", "--epochs", "3"]),
    (["x", "--db_passwd=V", "--wandbApiKey", "V", "-secret", "V", "--auth", "V"],
     ["x", "--db_passwd=***", "--wandbApiKey", "***", "-secret", "***", "--auth", "***"]),
    (["x", "--client-credentials", "V", "--hftoken", "V", "--access_token=V"],
     ["x", "--client-credentials", "***", "--hftoken", "***", "--access_token=***"]),
    (["env", "HF_TOKEN=V", "AWS_SECRET_ACCESS_KEY=V", "WORLD_SIZE=8", "python"],
     ["env", "HF_TOKEN=***", "AWS_SECRET_ACCESS_KEY=***", "WORLD_SIZE=8", "python"]),
    (["git", "clone", "https://alice:V@git.example.org/r.git"],
     ["git", "clone", "https://alice:***@git.example.org/r.git"]),
    (["curl", "-H", "Authorization: Bearer V"], ["curl", "-H", "Authorization: ***"]),
    (["x", "--token", "--verbose"], ["x", "--token", "--verbose"]),   # a flag: nothing to mask
    # not secrets: counts and names that merely contain the letters
    (["x", "--max-tokens", "4096", "--tokenizer", "gpt2", "--keep-last", "3"],
     ["x", "--max-tokens", "4096", "--tokenizer", "gpt2", "--keep-last", "3"]),
])
def test_mask_cmdline(argv, want):
    from ingero_forensics.capture.procs import mask_cmdline
    assert mask_cmdline(argv) == want
    assert mask_cmdline(argv, "full") == argv and mask_cmdline(argv, "none") is None


def test_token_shapes_are_masked_wherever_they_are():
    from ingero_forensics.capture.procs import mask_cmdline
    akid = "AKIA" + "IOSFODNN7EXAMPLE"
    got = mask_cmdline(["run", API_KEY, f"--extra={HF}", f"key:{akid}", "plain"])
    assert got == ["run", "***", "--extra=***", "key:***", "plain"]


def test_bad_cmdline_mode_is_refused():
    with pytest.raises(ValueError, match="full, masked, none"):
        TargetSet(cmdline="partly")


def _secret_argv_process():
    code = "import time; time.sleep(60)"
    return subprocess.Popen([sys.executable, "-c", code, f"--api-key={API_KEY}", "--password",
                             PASSWORD, f"HF_TOKEN={HF}", "--data", "/home/alice/private/ds"],
                            env={"PATH": os.environ["PATH"], "RANK": "0"})


def _capture_cmdline(tmp_path, open_all, *mode):
    target = _secret_argv_process()
    out = tmp_path / ("b-" + (mode[-1] if mode else "default"))
    try:
        wait_for(lambda: PASSWORD in open(f"/proc/{target.pid}/cmdline").read(),
                 what="cmdline readable")
        r = run_capture("--bundle", out, "--node", "n1", "--no-ebpf", "--pid", target.pid,
                        "--duration", "1", *mode)
        assert r.returncode == 0, r.stderr
    finally:
        target.kill()
        target.wait()
    [path] = bundles(out)
    raw = path.read_bytes()
    image = zstandard.ZstdDecompressor().decompressobj().decompress(
        raw[8 + int.from_bytes(raw[4:8], "little"):])
    [b] = open_all(out)
    [(cmdline,)] = rows(b, "SELECT cmdline FROM processes WHERE pid = ?", target.pid)
    return raw + image, cmdline


def test_capture_masks_cmdline_by_default(tmp_path, open_all):
    blob, cmdline = _capture_cmdline(tmp_path, open_all)
    for secret in (API_KEY, PASSWORD, HF):
        assert secret.encode() not in blob
    assert json.loads(cmdline)[1:] == ["-c", "import time; time.sleep(60)", "--api-key=***",
                                       "--password", "***", "HF_TOKEN=***", "--data",
                                       "/home/alice/private/ds"]


def test_capture_cmdline_full_and_none(tmp_path, open_all):
    blob, cmdline = _capture_cmdline(tmp_path, open_all, "--cmdline", "full")
    assert f"--api-key={API_KEY}" in json.loads(cmdline) and PASSWORD.encode() in blob
    blob, cmdline = _capture_cmdline(tmp_path, open_all, "--cmdline", "none")
    assert cmdline is None
    for secret in (API_KEY, PASSWORD, HF, "/home/alice/private/ds"):
        assert secret.encode() not in blob


def test_record_follows_an_exec(tmp_path):
    """A wrapper shell that execs the trainer keeps its pid: comm, exe, command line and
    rank environment are those of the program it runs now, not of the shell."""
    go = tmp_path / "go"
    p = subprocess.Popen(["/bin/sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; "
                          f"exec {sys.executable} -c 'import time; time.sleep(30)' trainer"],
                         env=dict(os.environ, RANK="5", WORLD_SIZE="8"))
    try:
        t = TargetSet(pids=[p.pid])
        t.scan()
        (before,) = [r for r in t.records() if r.pid == p.pid]
        assert before.comm == "sh" and before.exe.endswith("sh")
        go.touch()
        # the exec done: its binary and its arguments in place (a scan caught between
        # the two waits: test_an_exec_caught_midway_waits_for_its_arguments)
        wait_for(lambda: os.readlink(f"/proc/{p.pid}/exe") == os.path.realpath(sys.executable)
                 and (read_cmdline(p.pid) or [""])[-1] == "trainer")
        t.scan()
        (after,) = [r for r in t.records() if r.pid == p.pid]
        assert after is before                  # the same process record, refreshed
        assert after.exe == os.path.realpath(sys.executable)
        assert after.comm.startswith("python") and after.cmdline[-1] == "trainer"
        assert after.row()[5] == 5 and after.exit_ns is None
    finally:
        p.kill()
        p.wait()


def test_the_bundle_row_follows_an_exec(tmp_path):
    """The process row written before the exec is rewritten after it: the bundle kept the
    shell's exe and command line and no rank (the launcher exports RANK just before the
    exec) while only comm followed."""
    go = tmp_path / "go"
    p = subprocess.Popen(["/bin/sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done; "
                          "export RANK=3 WORLD_SIZE=4; "
                          f"exec {sys.executable} -c 'import time; time.sleep(30)' trainer"])
    cap = start_capture("--bundle", tmp_path / "b", "--node", "n1", "--no-ebpf", "--pid",
                        p.pid, "--duration", "4")
    try:
        for line in cap.stderr:
            if "sources on:" in line:
                break
        time.sleep(1.5)          # the shell's row is in the live segment
        go.touch()
        _, err = cap.communicate(timeout=60)
        assert cap.returncode == 0, err
    finally:
        cap.kill()
        p.kill()
        p.wait()
    [path] = bundles(tmp_path / "b")
    with open_bundle(path) as b:
        [(comm, exe, cmdline, rank, world, log)] = rows(
            b, "SELECT comm, exe, cmdline, rank, world_size, (SELECT group_concat(message) "
            "FROM capture_log WHERE event = 'target') FROM processes WHERE pid = ?", p.pid)
    assert exe == os.path.realpath(sys.executable) and comm.startswith("python"), (exe, comm)
    assert json.loads(cmdline)[-1] == "trainer" and (rank, world) == (3, 4)
    assert f"tracing pid {p.pid} (sh), no rank in its environment" in log, log


def test_a_capture_that_traced_no_process_says_so(tmp_path):
    r = run_capture("--bundle", tmp_path / "b", "--node", "n1", "--no-ebpf", "--comm",
                    "no-such-comm-x", "--duration", "1", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "no process was traced during the capture" in r.stderr, r.stderr
    [path] = bundles(tmp_path / "b")
    with open_bundle(path) as b:
        assert rows(b, "SELECT COUNT(*) FROM capture_log WHERE level = 'warning' AND "
                       "message LIKE 'no process was traced%'") == [(1,)]


def test_an_exec_caught_midway_waits_for_its_arguments(tmp_path):
    """A scan that reads /proc between the exec's new binary and its new arguments (exe
    already the trainer, cmdline still empty) does not take that half-done state: the
    record keeps the shell until the arguments are there; a program that truly has none
    is taken after TargetSet.EXEC_SCANS scans."""
    proc = tmp_path / "proc"
    pid = 4242
    d = proc / str(pid)
    (d / "task" / str(pid)).mkdir(parents=True)
    stat = f"{pid} (sh) S 1 " + " ".join(["0"] * 17) + " 12345 0 0"
    (d / "stat").write_text(stat)
    (d / "comm").write_text("sh\n")
    (d / "task" / str(pid) / "comm").write_text("sh\n")
    (d / "cmdline").write_bytes(b"/bin/sh\0-c\0exec trainer\0")
    (d / "environ").write_bytes(b"RANK=3\0")
    os.symlink("/bin/sh", d / "exe")
    t = TargetSet(pids=[pid], proc=str(proc))
    t.scan()
    (rec,) = t.records()
    assert rec.exe == "/bin/sh" and rec.cmdline[0] == "/bin/sh"
    # the exec, halfway: the new binary, no arguments yet
    os.unlink(d / "exe")
    os.symlink("/usr/bin/trainer", d / "exe")
    (d / "cmdline").write_bytes(b"")
    t.scan()
    assert rec.exe == "/bin/sh" and rec.cmdline[0] == "/bin/sh"
    # done: the arguments are there
    (d / "cmdline").write_bytes(b"/usr/bin/trainer\0--epochs\0" + b"3\0")
    (d / "comm").write_text("trainer\n")
    t.scan()
    assert (rec.exe, rec.cmdline, rec.comm) == ("/usr/bin/trainer",
                                                ["/usr/bin/trainer", "--epochs", "3"],
                                                "trainer")
    # a program with no arguments at all is taken all the same, a few scans later
    os.unlink(d / "exe")
    os.symlink("/usr/bin/argless", d / "exe")
    (d / "cmdline").write_bytes(b"")
    for _ in range(TargetSet.EXEC_SCANS - 1):
        t.scan()
        assert rec.exe == "/usr/bin/trainer"
    t.scan()
    assert rec.exe == "/usr/bin/argless" and rec.cmdline == []
