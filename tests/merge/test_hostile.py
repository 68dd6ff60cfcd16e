"""Issue 20: one hostile bundle (validly sealed, hostile values inside) never takes the
fleet down. Each is skipped with one line naming the bundle, table, row and reason, or
(a time far outside the capture window, a stack too deep to be one) merged without the
rows that cannot be, counted; every other bundle merges as without it."""

import apsw
import pytest
from click.testing import CliRunner

from .fleetgen import make_fleet
from .hostile import HOSTILE, reseal
from ingero_forensics.bundle.schema import TABLES_BY_NAME as BUNDLE_TABLES
from ingero_forensics.merge import merge_bundles
from ingero_forensics.merge.cli import main as merge_cli

#: hostile bundle -> what the skip reason says (None: the bundle merges, rows counted)
SKIPPED = {
    "realtime_min": None,
    "deep_frames": None,
    "comm_not_utf8": "table nccl_events row id '1': comm_id_hash is not UTF-8 text",
    "meta_not_utf8": "table meta row key 'created_by': value is not UTF-8 text",
    "job_not_utf8": "table processes row id '1': job_id is not UTF-8 text",
    "segment_index_huge": "manifest field segment.index missing, negative or not a 64-bit integer",
}


@pytest.fixture(scope="module")
def fleet3(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    return make_fleet(d / "b", nodes=3, seconds=3, seed=21), d


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_one_hostile_bundle_does_not_take_the_fleet_down(fleet3, tmp_path, name):
    fleet, _ = fleet3
    bad = reseal(fleet.paths[1], tmp_path / "bad", HOSTILE[name][0], name)
    out = tmp_path / "fleet.db"
    r = CliRunner().invoke(merge_cli, ["-q", "-o", str(out), str(fleet.paths[0]), str(bad),
                                       str(fleet.paths[2])], catch_exceptions=False)
    lines = r.stderr.splitlines() if hasattr(r, "stderr") else r.output.splitlines()
    con = apsw.Connection(str(out), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        nodes = con.execute("SELECT COUNT(*) FROM nodes").fetchone()[0]
        first = con.execute("SELECT MIN(realtime_ns) FROM clock_samples").fetchone()[0]
    finally:
        con.close()
    assert first > 1_700_000_000 * 10 ** 9      # no clock sample from another century
    if SKIPPED[name] is None:
        assert r.exit_code == 0, r.output
        assert nodes == 3
    else:
        assert r.exit_code == 3, r.output
        assert nodes == 2
        errors = [ln for ln in lines if ln.startswith("Error:")]
        assert errors == [f"Error: {bad}: {SKIPPED[name]} (skipped)"], r.output


def test_far_realtime_samples_are_dropped_and_counted(fleet3, tmp_path):
    fleet, _ = fleet3
    bad = reseal(fleet.paths[1], tmp_path / "bad", HOSTILE["realtime_min"][0], "rt")
    res = merge_bundles([fleet.paths[0], bad, fleet.paths[2]], tmp_path / "fleet.db")
    assert not res.skipped
    assert any(w.startswith(f"{bad}: ") and "invalid rows of clock_samples skipped" in w
               for w in res.warnings), res.warnings


#: NCCL op names the format knows (the warning lists them)
OPS = [v for c in BUNDLE_TABLES["nccl_events"].columns if c.name == "op" for v in c.values]


def test_skipped_rows_say_which_row_and_rule(fleet3, tmp_path):
    """A writer whose rows the merge skips learns from the warning and merge_log which
    row broke which rule, not only a list of every possible reason."""
    fleet, _ = fleet3
    sql = ("UPDATE nccl_events SET op = 'ALLREDUCE' WHERE id = (SELECT MIN(id) + 1 FROM "
           "nccl_events);"
           "UPDATE cuda_events SET timestamp_ns = 'soon' WHERE id = (SELECT MAX(id) FROM "
           "cuda_events);"
           "UPDATE clock_samples SET realtime_ns = -9223372036854775808 WHERE id = "
           "(SELECT MIN(id) FROM clock_samples);"
           "UPDATE tcp_events SET pid = -3 WHERE id = (SELECT MIN(id) FROM tcp_events);")
    bad = reseal(fleet.paths[1], tmp_path / "bad", sql, "rows")
    res = merge_bundles([fleet.paths[0], bad, fleet.paths[2]], tmp_path / "fleet.db")
    assert not res.skipped
    mine = sorted(w for w in res.warnings if w.startswith(f"{bad}: "))
    from ingero_forensics.bundle import open_bundle
    with open_bundle(bad, tmpdir=tmp_path) as b:
        ids = {t: b.con.execute(q).fetchone()[0] for t, q in {
            "nccl_events": "SELECT id FROM nccl_events WHERE op = 'ALLREDUCE'",
            "cuda_events": "SELECT id FROM cuda_events WHERE typeof(timestamp_ns) = 'text'",
            "clock_samples": "SELECT MIN(id) FROM clock_samples",
            "tcp_events": "SELECT id FROM tcp_events WHERE pid < 0"}.items()}
    assert mine == sorted([
        f"{bad}: 1 invalid rows of clock_samples skipped (the first, id "
        f"{ids['clock_samples']}: realtime_ns -9223372036854775808 lies outside the "
        "capture's UTC window (+-86400 s))",
        f"{bad}: 1 invalid rows of cuda_events skipped (the first, id {ids['cuda_events']}: "
        "timestamp_ns holds text 'soon', not an integer)",
        f"{bad}: 1 invalid rows of nccl_events skipped (the first, id {ids['nccl_events']}: "
        f"op 'ALLREDUCE' is not a known value ({', '.join(OPS)}))",
        f"{bad}: 1 invalid rows of tcp_events skipped (the first, id "
        f"{ids['tcp_events']}: pid -3 is negative)"]), mine
    db = apsw.Connection(str(tmp_path / "fleet.db"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        logged = [m for m, in db.execute("SELECT message FROM merge_log WHERE event = "
                                         "'skipped_rows' AND input = ?", (str(bad),))]
    finally:
        db.close()
    assert f"1 rows of cuda_events not merged (the first, id {ids['cuda_events']}: " \
        "timestamp_ns holds text 'soon', not an integer)" in logged, logged


def test_skipped_rows_with_bytes_that_are_not_utf8_are_named_too(fleet3, tmp_path):
    """Text that is not UTF-8 in an INTEGER or enum column passes the reader (it screens
    TEXT columns) and the row screen skips it: naming it must not decode it (a review
    found the whole merge ending in a traceback)."""
    fleet, _ = fleet3
    sql = ("UPDATE cuda_events SET timestamp_ns = CAST(x'ff41' AS TEXT) WHERE id = "
           "(SELECT MAX(id) FROM cuda_events);"
           "UPDATE nccl_events SET op = CAST(x'ff42' AS TEXT) WHERE id = "
           "(SELECT MIN(id) FROM nccl_events);")
    bad = reseal(fleet.paths[1], tmp_path / "bad", sql, "bytes")
    res = merge_bundles([fleet.paths[0], bad, fleet.paths[2]], tmp_path / "fleet.db")
    assert not res.skipped and res.bundles_merged == 3
    mine = sorted(w for w in res.warnings if w.startswith(f"{bad}: "))
    assert len(mine) == 2, res.warnings
    assert "timestamp_ns holds text '\\xffA', not an integer" in mine[0], mine
    assert "op '\\xffB' is not a known value" in mine[1], mine


class _LateEvent:
    """An event set by the other thread just after wait() gave up (the race of issue
    20: the thread sets it and ends between the timeout and future.done())."""

    def __init__(self):
        self.flag = False

    def wait(self, timeout):
        was, self.flag = self.flag, True
        return was

    def is_set(self):
        return self.flag


def test_wait_staged_rechecks_ready_after_the_thread_ended():
    from concurrent.futures import Future
    from types import SimpleNamespace
    from ingero_forensics.merge.core import _wait_staged
    done = Future()
    done.set_result(None)
    job = SimpleNamespace(completions_ready=_LateEvent(), bundles_read=_LateEvent())
    _wait_staged(job, done)         # no "ended before its results"


# ------------------------------------------------------------ fleet.db is never damaged

def _integrity(db):
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return con.execute("PRAGMA integrity_check").fetchall()
    finally:
        con.close()


def _bundles_in(db):
    con = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return con.execute("SELECT COUNT(*) FROM bundles").fetchone()[0]
    finally:
        con.close()


def test_a_live_viewer_wal_beside_the_output_refuses(fleet3, tmp_path):
    from ingero_forensics.merge import MergeError
    fleet, _ = fleet3
    out = tmp_path / "fleet.db"
    merge_bundles(fleet.paths[:2], out)
    viewer = apsw.Connection(str(out))
    viewer.execute("PRAGMA journal_mode = WAL")
    viewer.execute("INSERT INTO merge_log (merged_utc, level, event, message) "
                   "VALUES ('x', 'info', 'viewer', 'written in WAL mode')")
    try:
        with pytest.raises(MergeError, match="is open in another program"):
            merge_bundles([fleet.paths[2]], out)
    finally:
        viewer.close()
    assert _integrity(out) == [("ok",)]


def test_a_wal_left_by_a_dead_viewer_is_checkpointed_first(fleet3, tmp_path):
    fleet, _ = fleet3
    out = tmp_path / "fleet.db"
    merge_bundles(fleet.paths[:2], out)
    viewer = apsw.Connection(str(out))
    viewer.execute("PRAGMA journal_mode = WAL")
    viewer.execute("PRAGMA wal_autocheckpoint = 0")
    viewer.execute("INSERT INTO merge_log (merged_utc, level, event, message) "
                   "VALUES ('x', 'info', 'viewer', 'written in WAL mode')")
    # the viewer dies: its -wal stays, holding the row (copied, as kill -9 leaves it)
    import shutil
    dead = tmp_path / "dead"
    dead.mkdir()
    for suffix in ("", "-wal"):
        shutil.copyfile(f"{out}{suffix}", dead / f"fleet.db{suffix}")
    viewer.close()
    out = dead / "fleet.db"
    assert (dead / "fleet.db-wal").stat().st_size > 0
    res = merge_bundles([fleet.paths[2]], out)
    assert res.bundles_merged == 1
    assert not (dead / "fleet.db-wal").exists()
    assert _integrity(out) == [("ok",)] and _bundles_in(out) == 3
    con = apsw.Connection(str(out), flags=apsw.SQLITE_OPEN_READONLY)
    assert con.execute("SELECT COUNT(*) FROM merge_log WHERE event = 'viewer'").fetchone()[0] == 1
    con.close()


def test_a_second_merge_into_the_same_output_refuses(fleet3, tmp_path):
    import fcntl
    import os
    from ingero_forensics.merge import MergeError
    fleet, _ = fleet3
    out = tmp_path / "fleet.db"
    fd = os.open(tmp_path / ".fleet.db.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)      # a first merge, running
    try:
        r = CliRunner().invoke(merge_cli, ["-q", "-o", str(out), *map(str, fleet.paths)])
    finally:
        os.close(fd)
    assert r.exit_code == 1
    assert r.output == (f"Error: {out}: another ingero-merge is writing it (lock "
                        ".fleet.db.lock); wait for it to finish\n")
    assert not out.exists()


def test_scratch_files_of_a_killed_merge_are_removed(fleet3, tmp_path):
    import os
    import subprocess
    fleet, _ = fleet3
    p = subprocess.Popen(["true"])
    p.wait()                            # a pid that is gone
    stale = [tmp_path / f".fleet.db.{p.pid}.{x}" for x in ("tmp", "tmp-journal", "staging",
                                                           "nccl_events")]
    for f in stale:
        with open(f, "wb") as fh:
            fh.truncate(1 << 40)        # sparse, a terabyte of apparent size
    stale += [tmp_path / f"ingero-{p.pid}-x1y2z3.db{s}" for s in ("", ".sync", ".run0")]
    for f in stale[-3:]:
        f.write_bytes(b"image")
    mine = tmp_path / ".fleet.db.notes"   # not a merge's: kept
    mine.write_text("x")
    live = tmp_path / f"ingero-{os.getppid()}-a1b2c3.db"   # a live process's: kept
    live.write_bytes(b"image")
    merge_bundles(fleet.paths, tmp_path / "fleet.db")
    assert not [f for f in stale if f.exists()]
    assert mine.exists() and live.exists()


# ----------------------------------------------------------- the terminal is attack surface

def test_control_characters_in_printed_names_are_escaped(fleet3, tmp_path):
    fleet, _ = fleet3
    evil = tmp_path / "a\x1b]0;owned\x07\x1b[1A\x1b[2K\r.bundle"
    evil.write_bytes(b"not a bundle")
    r = CliRunner().invoke(merge_cli, ["-q", "-o", str(tmp_path / "f.db"), str(evil),
                                       *map(str, fleet.paths)])
    assert r.exit_code == 3, r.output
    assert "\x1b" not in r.output and "\x07" not in r.output and "\r" not in r.output
    # (click drops the CSI sequences itself when stderr is no terminal; on one they
    # are escaped as the rest)
    assert "a\\x1b]0;owned\\x07" in r.output and "\\x0d.bundle: " in r.output


def test_clean_keeps_text_tabs_and_newlines():
    from ingero_forensics.cliutil import clean
    assert clean("node-1\tOK\n\u00e9\u4e2d") == "node-1\tOK\n\u00e9\u4e2d"
    assert clean("\x00\x1b\x7f\x9b") == "\\x00\\x1b\\x7f\\x9b"


@pytest.mark.parametrize("node", ["-o", ".hidden"])
def test_a_node_name_that_starts_with_dash_or_dot_is_refused(fleet3, tmp_path, node):
    """Its file would be `-o+2025....bundle` (read as an option by the shell's
    `*.bundle`) or a dotfile that `*.bundle` skips: such a bundle is refused by name."""
    fleet, _ = fleet3
    sql = f"UPDATE meta SET value = '\"{node}\"' WHERE key = 'node'"
    bad = reseal(fleet.paths[1], tmp_path / "bad", sql, "named")
    r = CliRunner().invoke(merge_cli, ["-q", "-o", str(tmp_path / "f.db"), str(bad),
                                       str(fleet.paths[0])])
    assert r.exit_code == 3
    assert r.output == (f"Error: {bad}: manifest: invalid node name {node!r}: use 1-63 "
                        "characters of A-Z a-z 0-9 . _ -, not starting with - or . "
                        "(skipped)\n")
    from ingero_forensics.bundle import bundle_filename
    with pytest.raises(ValueError):
        bundle_filename(node, 0, 0)


# ---------------------------------------------------------------------- smaller, all seen

def test_a_fifo_named_bundle_is_refused_not_waited_on(fleet3, tmp_path):
    import os
    fleet, _ = fleet3
    fifo = tmp_path / "p.bundle"
    os.mkfifo(fifo)
    r = CliRunner().invoke(merge_cli, ["-q", "-o", str(tmp_path / "f.db"), str(tmp_path),
                                       str(fleet.paths[0])])
    assert r.exit_code == 3
    assert r.output == (f"Error: {fifo}: not a regular file (a FIFO, socket or device) "
                        "(skipped)\n")


def test_a_zstd_bomb_of_anything_but_sqlite_stops_at_the_first_chunk(fleet3, tmp_path):
    """An honest bomb (declared size, checksum and sha256 all right) of zeros: refused as
    'not SQLite' after the first decompressed chunk, before the rest reaches the disk."""
    from ingero_forensics.bundle import container
    from ingero_forensics.errors import BundleError
    from ..bundle.conftest import pack, split_bundle
    fleet, _ = fleet3
    manifest, _ = split_bundle(fleet.paths[0])
    size = 256 << 20
    bomb = tmp_path / "bomb.bundle"
    bomb.write_bytes(pack(manifest, bytes(size)))
    assert bomb.stat().st_size < 1 << 20
    written = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            written.append(len(b))
            return self.f.write(b)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    def spy_open(p, mode="r", *a, **k):
        f = real_open(p, mode, *a, **k)
        return Spy(f) if "w" in mode else f
    container.open = spy_open
    try:
        with pytest.raises(BundleError, match="database image is not SQLite"):
            container.decompress_db(bomb, tmp_path / "out.db")
    finally:
        del container.open
    assert sum(written) <= 0


@pytest.fixture
def readonly_dir(tmp_path):
    """A read-only file system (a mounted USB stick): a tmpfs mounted ro. CI runs as
    root: there it must mount, not skip."""
    import os
    import subprocess
    if os.geteuid() != 0:
        assert not os.environ.get("CI"), "mounting a tmpfs needs root in CI"
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)],
                   check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_read_only_file_system_is_one_line_for_merge_report_export(fleet3, tmp_path,
                                                                      readonly_dir):
    from ingero_forensics.export.cli import main as export_cli
    from ingero_forensics.report.cli import main as report_cli
    fleet, _ = fleet3
    db = tmp_path / "fleet.db"
    merge_bundles(fleet.paths, db)
    runs = {
        "merge": (merge_cli, ["-q", "-o", str(readonly_dir / "f.db"), *map(str, fleet.paths)]),
        "report": (report_cli, [str(db), "-o", str(readonly_dir / "r.html")]),
        "report-md": (report_cli, [str(db), "--format", "markdown", "-o",
                                   str(readonly_dir / "r.md")]),
        "export": (export_cli, [str(db), "--chrome-trace", "-o",
                                str(readonly_dir / "t.json")]),
    }
    for what, (cli, args) in runs.items():
        r = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert r.exit_code == 1, (what, r.output)
        err = r.stderr.splitlines()
        assert len(err) == 1 and err[0].startswith("Error: ") and "Read-only file system" \
            in err[0], (what, r.output)
    assert not list(readonly_dir.iterdir())


def test_report_on_a_bundle_says_merge_first(fleet3):
    from ingero_forensics.report.cli import main as report_cli
    fleet, _ = fleet3
    r = CliRunner().invoke(report_cli, [str(fleet.paths[0])], catch_exceptions=False)
    assert r.exit_code == 1
    assert r.stderr == (f"Error: {fleet.paths[0]}: is a bundle, not a fleet.db: merge first "
                        "(ingero-merge BUNDLES -o fleet.db), then use fleet.db\n")


@pytest.mark.parametrize("module", ["capture.cli", "merge.cli", "export.cli",
                                    "export.query_cli", "report.cli", "redact.cli",
                                    "simulate.cli"])
def test_dash_h_works_on_every_cli(module):
    import importlib
    cli = importlib.import_module(f"ingero_forensics.{module}").main
    r = CliRunner().invoke(cli, ["-h"], catch_exceptions=False)
    assert r.exit_code == 0 and "Usage:" in r.output


def test_the_rank_list_is_never_cut_inside_a_number():
    from ingero_forensics.merge.cli import ranks_text
    assert ranks_text([16, 17, 18, 19], 10) == "16-19"
    assert ranks_text(list(range(0, 40, 2)), 10) == "0,2,4,+17"
    assert ranks_text([3], 10) == "3"
    assert ranks_text([], 10) == ""
    for ranks in ([16, 17, 18, 100, 1000, 10000], list(range(0, 999, 3)), [123456789012]):
        t = ranks_text(ranks, 10)
        assert len(t) <= 10
        for item in t.split(","):
            a = item.lstrip("+").split("-")
            assert all(x.isdigit() for x in a)
            if not item.startswith("+"):
                assert all(int(x) in ranks for x in a)


def test_rows_of_types_the_schema_does_not_promise_are_skipped_and_counted(fleet3, tmp_path):
    """Text or a blob in an INTEGER column, a pid beyond any kernel's, a blob in a TEXT
    column: merged, those rows are not (counted); export and query then never raise."""
    import json
    from ingero_forensics.export.cli import main as export_cli
    from ingero_forensics.export.query_cli import main as query_cli
    fleet, _ = fleet3
    sql = ("UPDATE nccl_events SET pid = 'abc' WHERE id = 1;"
           "UPDATE nccl_events SET tid = x'00ff' WHERE id = 2;"
           "UPDATE nccl_events SET pid = 9223372036854775807 WHERE id = 3;"
           "UPDATE cuda_events SET api = x'41' WHERE id = 1;"
           "UPDATE host_samples SET value = 'high' WHERE id = 1;")
    bad = reseal(fleet.paths[1], tmp_path / "bad", sql, "types")
    out = tmp_path / "fleet.db"
    res = merge_bundles([fleet.paths[0], bad, fleet.paths[2]], out)
    assert not res.skipped and res.bundles_merged == 3
    con = apsw.Connection(str(out), flags=apsw.SQLITE_OPEN_READONLY)
    skipped = json.loads(con.execute("SELECT skipped_rows FROM bundles WHERE file_name = ?",
                                     (bad.name,)).fetchone()[0])
    con.close()
    assert skipped["nccl_events"] == 3 and skipped["cuda_events"] == 1
    assert skipped["host_samples"] == 1
    r = CliRunner().invoke(export_cli, [str(out), "--chrome-trace", "-q", "-o",
                                        str(tmp_path / "t.json")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(query_cli, [str(out), "SELECT * FROM nccl_events"],
                           catch_exceptions=False)
    assert r.exit_code == 0


def test_same_node_host_and_boot_with_other_data_is_not_merged_into_it(fleet3, tmp_path):
    """An altered copy of a bundle (same node, host, boot, segment and window, clock
    readings moved by 20 s) used to merge into the node: uncertainty 54 ms -> 20 s."""
    fleet, _ = fleet3
    sql = "UPDATE clock_samples SET realtime_ns = realtime_ns + 20000000000"
    bad = reseal(fleet.paths[1], tmp_path / "bad", sql, "altered")
    good_out, out = tmp_path / "good.db", tmp_path / "fleet.db"
    merge_bundles(fleet.paths, good_out)
    r = CliRunner().invoke(merge_cli, ["-q", "-o", str(out), *map(str, fleet.paths),
                                       str(bad)], catch_exceptions=False)
    assert r.exit_code == 3
    assert r.output.startswith(f"Error: {bad}: segment ") and r.output.endswith(
        "with other data: altered or re-sealed; not merged (skipped)\n"), r.output
    q = ("SELECT n.name, n.bundles, a.uncertainty_ns FROM nodes n JOIN clock_alignment a "
         "USING (node_id) ORDER BY n.name")
    con = apsw.Connection(str(out), flags=apsw.SQLITE_OPEN_READONLY)
    con2 = apsw.Connection(str(good_out), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        assert con.execute(q).fetchall() == con2.execute(q).fetchall()
    finally:
        con.close()
        con2.close()


def test_an_overlapping_capture_of_the_same_boot_is_not_merged_into_it(fleet3, tmp_path):
    fleet, _ = fleet3
    sql = ("UPDATE meta SET value = json_set(value, '$.id', 'another-capture') "
           "WHERE key = 'segment'")
    other = reseal(fleet.paths[1], tmp_path / "bad", sql, "second")
    res = merge_bundles([*fleet.paths, other], tmp_path / "fleet.db")
    assert [s["input"] for s in res.skipped] == [str(other)]
    assert "capture window overlaps" in res.skipped[0]["reason"]


def test_ctrl_c_in_pass_1_leaves_no_image(fleet3, tmp_path, monkeypatch):
    from ingero_forensics.merge import core
    fleet, _ = fleet3

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(core, "_copy_stacks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        merge_bundles(fleet.paths, tmp_path / "fleet.db", tmpdir=tmp_path)
    assert not [p.name for p in tmp_path.iterdir()]
