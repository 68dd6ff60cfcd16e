"""The figures from fleet.db 4's summaries (host_bins: report/binned.py; job_block_io and
sync_waits: merge/summaries.py) are the figures from the raw tables: the same analysis
with and without them, on fleets whose straggler windows are part of the run; a
version-3 fleet.db (none of them) and other bins (--bin) are read as before."""

import shutil

import apsw
import pytest

from ingero_forensics.report import analyze as analyze_mod
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.binned import HostBins


def figures(a):
    """The analysis without the statements that computed it."""
    d = a.to_json()
    d.pop("sql")
    d.pop("commands")   # the evidence commands carry the statements
    return d


def host_statements(a) -> str:
    return "\n".join(e["sql"] for k, v in a.sql.items()
                     if k.startswith(("signals", "evidence", "cause_series", "capture_"))
                     for e in v)


@pytest.fixture
def no_bins(monkeypatch):
    """analyze_fleet as on a fleet.db without host_bins."""
    def off():
        monkeypatch.setattr(analyze_mod.HostBins, "open", classmethod(lambda cls, *a: None))
    return off


@pytest.mark.parametrize("fault, extra", [
    ("cpu", ("--fault-window", "30:70")),
    ("gpu", ("--fault-window", "20:50", "--fault-window", "80:100")),
    ("memory", ()),
])
def test_host_bins_give_the_figures_of_host_samples(fleets, no_bins, fault, extra):
    db, truth = fleets(fault, extra=extra)
    binned = analyze_fleet(db)
    no_bins()
    raw = analyze_fleet(db)
    assert figures(binned) == figures(raw)
    # the figures were computed from the summary, and the windows were part of the run
    assert "host_bins" in host_statements(binned) and "host_bins" not in host_statements(raw)
    assert binned.stragglers and binned.cause == fault
    assert sum(w.end_ns - w.start_ns for w in binned.windows) < binned.end_ns - binned.start_ns
    assert binned.cause_series["points"] and binned.capture_cost


@pytest.mark.parametrize("fault, extra", [
    ("gpu", ("--fault-window", "20:50", "--fault-window", "80:100")),
    ("io", ("--fault-window", "40:90")),
])
def test_version_3_fleet_db_reads_the_raw_tables(fleets, tmp_path, fault, extra):
    db, _ = fleets(fault, extra=extra)
    old = tmp_path / "fleet.db"
    shutil.copy(db, old)
    con = apsw.Connection(str(old))
    for t in ("host_bins", "job_block_io", "sync_waits"):
        con.execute(f"DROP TABLE {t}")
    con.execute("DELETE FROM fleet_info WHERE key = 'host_bins'")
    con.execute("PRAGMA user_version = 3")
    con.close()
    a, b = analyze_fleet(db), analyze_fleet(old)
    assert figures(a) == figures(b)
    assert a.cause == fault and a.windows
    new, raw = host_statements(a), host_statements(b)
    assert "host_bins" not in raw and "host_samples" in raw
    sig_a = "\n".join(e["sql"] for k, v in a.sql.items() if k.startswith("signals") for e in v)
    sig_b = "\n".join(e["sql"] for k, v in b.sql.items() if k.startswith("signals") for e in v)
    assert "job_block_io" in sig_a and "sync_waits" in sig_a and "host_bins" in new
    assert "job_block_io" not in sig_b and "FROM block_events" in sig_b
    assert "sync_waits" not in sig_b and "FROM cuda_events" in sig_b


def test_other_bins_read_host_samples_for_windows(fleets):
    db, _ = fleets("cpu", extra=("--fault-window", "30:70"))
    a = analyze_fleet(db, bin_s=0.7)
    sig = "\n".join(e["sql"] for k, v in a.sql.items() if k.startswith("signals")
                    for e in v)
    # the windows are not host_bins' bins: their means come from the samples; the
    # whole-run means (the capture's cost) still from the summary
    assert sig and "host_bins" not in sig and "host_samples" in sig
    assert "host_bins" in a.sql["capture_cost"][0]["sql"]


def test_clause_only_on_bin_edges():
    hb = HostBins(t0_ns=1000, bin_ns=10, aligned=True)
    assert hb.clause([(1000, 1030), (1050, 1060)]) == (
        "((bin >= ? AND bin < ?) OR (bin >= ? AND bin < ?))", [0, 3, 5, 6])
    assert hb.clause([]) == ("0", [])
    assert hb.clause([(1000, 1035)]) is None      # ends inside a bin
    assert hb.clause([(990, 1000)]) is None       # before t0
    assert HostBins(1000, 10, aligned=False).clause([(1000, 1030)]) is None
