"""The next commands of the report run as they are, in the directory of the fleet.db: the
ingero-export line writes a trace of the straggler's window (or the stopped rank's last
seconds) on the nodes it names, and every ingero-query line returns rows."""

import gzip
import json
import shlex
import shutil
import subprocess

import pytest

from ingero_forensics.report import analyze_fleet

from .test_hangs import STOP_RANK, hung_fleet  # noqa: F401 (a fixture)


def run_commands(db, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(db, work / "fleet.db")
    a = analyze_fleet(work / "fleet.db")
    assert a.commands
    for c in a.commands:
        argv = shlex.split(c["command"])
        r = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (c["command"], r.stderr)
        if argv[0] == "ingero-export":
            out = work / argv[argv.index("-o") + 1]
            trace = json.loads(gzip.decompress(out.read_bytes()))
            names = {e["args"]["name"] for e in trace["traceEvents"]
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
            nodes = argv[argv.index("--nodes") + 1].split(",")
            assert all(any(n in p for p in names) for n in nodes), names
            assert sum(1 for e in trace["traceEvents"] if e.get("ph") == "X") > 10
        else:
            assert argv[0] == "ingero-query"
            assert len(r.stdout.strip().splitlines()) >= 3, (c["command"], r.stdout)
    return a


@pytest.mark.parametrize("fault", ["cpu", "network"])
def test_straggler_commands_run(fleets, tmp_path, fault):
    db, truth = fleets(fault)
    a = run_commands(db, tmp_path)
    straggler = truth["fault"]["straggler"]
    export = a.commands[0]["command"]
    assert export.startswith("ingero-export fleet.db --chrome-trace --from ")
    assert f"--nodes {straggler}," in export
    table = {"cpu": "sched_events", "network": "tcp_events"}[fault]
    assert any(table in c["command"] for c in a.commands)


def test_hang_commands_run(hung_fleet, tmp_path):  # noqa: F811
    a = run_commands(hung_fleet, tmp_path)
    assert f"hang-rank{STOP_RANK}" in a.commands[0]["command"]
    assert any("cuda_events" in c["command"] for c in a.commands)


def test_a_long_window_exports_its_first_minute():
    from ingero_forensics.report.analyze import Analysis, NodeLateness, Straggler, Window
    from ingero_forensics.report.commands import next_commands
    t0 = 1_750_000_000_000_000_000
    w = Window(t0 + 500_000_000, t0 + 362_500_000_000, 18.0)
    st = Straggler(node="node-37", node_id=38, ranks=[296], late_ranks=[296], windows=[w],
                   lateness_ms=18.0, peak_ms=20.0, late_bins=90, cost_s=52.0,
                   cost_share=0.14, relative_uncertainty_ms=0.01, clock_caveat=False)
    a = Analysis(fleet="my fleet.db", nodes=2, ranks=2, collectives=10, start_ns=t0,
                 end_ns=t0 + 400_000_000_000, bin_ns=4_000_000_000, noise_ms=0.2,
                 stragglers=[st], lateness=[NodeLateness(1, "node-01", [0], 10, 0.0, 0.1,
                                                         0.5, 0)])
    (export, arrivals) = next_commands(a)
    assert export["what"].startswith("Trace of node-37 in the first 60 s of its window")
    assert export["command"] == (
        "ingero-export 'my fleet.db' --chrome-trace --from 2025-06-15T15:06:40Z "
        "--to 2025-06-15T15:07:41Z --nodes node-37,node-01 -o node-37-window.json.gz")
    assert arrivals["command"].startswith("ingero-query 'my fleet.db' \"SELECT c.seq")


@pytest.mark.parametrize("fault", ["cpu", "network"])
def test_text_form_fits_an_email_and_its_commands_still_paste(fleets, tmp_path, fault):
    """The text form (an email body) keeps its lines within 78 characters: prose broken
    at spaces only, never inside a hyphenated name or between a number and its unit; a
    command broken with backslash-newline where bash still reads the same arguments
    (SQL only gains whitespace, never inside a string literal)."""
    import re
    from ingero_forensics.report.text import WIDTH, render_text, wrap
    db, _ = fleets(fault)
    a = analyze_fleet(db)
    text = render_text(a)
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH, [ln for ln in lines if len(ln) > WIDTH]
    assert wrap("then run nvidia-smi -q -d PERFORMANCE at 84.9 °C " * 3).count("\n") == 1
    for ln in wrap("x" * 70 + " nvidia-smi 84.9 °C and 12.5 ms").splitlines():
        assert not ln.endswith(("nvidia-", " 84.9", " 12.5")), ln
    blocks, k = [], lines.index("Next commands")
    while k < len(lines):
        if lines[k].startswith("    ingero-"):
            end = k
            while lines[end].endswith("\\"):
                end += 1
            blocks.append("\n".join(lines[k:end + 1]))
            k = end
        elif blocks and lines[k] == "":
            break
        k += 1
    assert len(blocks) == len(a.commands)
    for c, pasted in zip(a.commands, blocks):
        script = ('ingero-query() { printf "%s\\0" "$@"; }; '
                  'ingero-export() { printf "%s\\0" "$@"; }\n' + pasted)
        out = subprocess.run(["bash", "-c", script], capture_output=True, timeout=30,
                             check=True).stdout.decode()
        got, want = out.split("\0")[:-1], shlex.split(c["command"])[1:]
        assert [" ".join(g.split()) for g in got] == [" ".join(w.split()) for w in want]
        assert [re.findall(r"'[^']*'", g) for g in got] == \
            [re.findall(r"'[^']*'", w) for w in want]


@pytest.mark.parametrize("fleet", [
    "fleet.db", "/data/Bob's runs/2026-11-27 llama 70b pretraining/fleet.db",
    "/data/it's dir/fleet.db", "/very/long/" + "x" * 90 + "/fleet.db"])
@pytest.mark.parametrize("sql", [
    "SELECT a, b FROM t WHERE x = 'one two three four five six seven eight nine ten "
    "eleven twelve' AND y > 3 ORDER BY a DESC LIMIT 20",
    "SELECT \"quoted col\", '$HOME `x` \\\\ !' AS s FROM t WHERE op = 'all reduce of "
    "many words that go on and on' AND z = 'it''s'",
    "SELECT " + ", ".join(f"c{k}" for k in range(40)) + " FROM t"])
def test_wrapped_commands_keep_their_arguments(fleet, sql):
    """Adversarial paths (apostrophes, spaces, a word longer than a line) and SQL (string
    literals with spaces, characters that make shell_quote use single quotes): pasted
    into bash, the wrapped command gives the same arguments, except whitespace that the
    breaks add inside the double-quoted SQL, never inside an SQL string literal or a
    single-quoted argument."""
    import re
    from ingero_forensics.report.commands import _export, _query
    from ingero_forensics.report.text import WIDTH, wrap_command
    t0 = 1_750_000_000_000_000_000
    for command in (_query(fleet, sql),
                    _export(fleet, t0, t0 + 10**10, ["node-01", "node-02"], "w.json.gz",
                            ranks=[3, 4])):
        lines = wrap_command(command)
        assert len(lines) > 1 or len(lines[0]) <= WIDTH or command.count("'") > 2, lines
        script = ('ingero-query() { printf "%s\\0" "$@"; }; '
                  'ingero-export() { printf "%s\\0" "$@"; }\n' + "\n".join(lines))
        out = subprocess.run(["bash", "-c", script], capture_output=True, timeout=30,
                             check=True).stdout.decode()
        got, want = out.split("\0")[:-1], shlex.split(command)[1:]
        assert len(got) == len(want), (command, lines)
        for g, w in zip(got, want):
            if g != w:      # only the SQL, only whitespace, no literal touched
                assert w == one_line_sql(sql), (g, w)
                assert " ".join(g.split()) == " ".join(w.split()), (g, w)
                assert re.findall(r"'[^']*'", g) == re.findall(r"'[^']*'", w), (g, w)


def one_line_sql(sql):
    from ingero_forensics.report.sql import one_line
    return one_line(sql)
