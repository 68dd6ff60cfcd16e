"""Clock-sync samples: bracket, adjtimex, chrony CSV, PTP ioctl layout, and the bundle rows."""

import struct

import pytest

from ingero_forensics.bundle.schema import TABLES_BY_NAME
from ingero_forensics.capture.clock import (PTP_SYS_OFFSET_EXTENDED, PTP_SYS_OFFSET_PRECISE,
                                            STA_NANO, STA_UNSYNC, ClockSource, adjtimex_fields,
                                            bracket, chrony_row, parse_chrony_tracking,
                                            parse_ptp_extended, read_adjtimex, system_row)

from .conftest import rows, run_capture

CHRONY_CSV = ("C0A80001,192.168.0.1,3,1700000000.123456789,0.000012345,-0.000001000,"
              "0.000020000,-12.345,0.001,0.050,0.001500000,0.000250000,64.2,Normal\n")


def test_bracket_orders_reads():
    m0, real, boot, tai, m1 = bracket()
    assert m0 <= m1
    assert boot >= m0  # boottime counts suspend on top of monotonic
    assert abs((tai - real) // 1_000_000_000) < 100  # TAI-UTC is seconds, not more


def test_system_row_matches_schema():
    row = system_row()
    assert len(row) == len(TABLES_BY_NAME["clock_samples"].data_columns)
    d = dict(zip(TABLES_BY_NAME["clock_samples"].data_columns, row))
    assert d["source"] == "system"
    assert d["uncertainty_ns"] == d["mono_after_ns"] - d["mono_before_ns"] >= 0
    assert d["synchronized"] in (0, 1)
    assert isinstance(d["adj_status"], int)


def test_adjtimex_is_read_only_and_consistent():
    a, b = read_adjtimex(), read_adjtimex()
    assert a["adj_status"] == b["adj_status"]
    if a["adj_status"] & STA_UNSYNC:
        assert a["synchronized"] == 0


@pytest.mark.parametrize("state, status, offset, want_sync, want_offset", [
    (0, 0, 5, 1, 5000),                  # TIME_OK, offset in us
    (0, STA_NANO, 5, 1, 5),              # STA_NANO: offset already ns
    (0, STA_UNSYNC, 0, 0, 0),            # unsynchronized
    (5, 0, 0, 0, 0),                     # TIME_ERROR
])
def test_adjtimex_units(state, status, offset, want_sync, want_offset):
    f = adjtimex_fields(state, status, offset, 65536 * 3, 1500, 20, 37)
    assert f["synchronized"] == want_sync
    assert f["adj_offset_ns"] == want_offset
    assert f["adj_freq_ppb"] == pytest.approx(3000.0)   # 3 ppm scaled by 2^16
    assert (f["adj_maxerror_ns"], f["adj_esterror_ns"], f["adj_tai_s"]) == (1_500_000, 20_000, 37)


def test_parse_chrony_tracking():
    t = parse_chrony_tracking(CHRONY_CSV)
    # chronyc's "System time" is positive when the system clock is slow; the schema's
    # ref_offset_ns is system minus reference, so the sign flips.
    assert t == {"ref_id": "C0A80001", "ref_offset_ns": -12345, "root_delay_ns": 1_500_000,
                 "root_dispersion_ns": 250_000, "leap_status": "Normal"}


@pytest.mark.parametrize("bad", ["", "506 Cannot talk to daemon", "a,b,c"])
def test_parse_chrony_rejects_garbage(bad):
    with pytest.raises(ValueError):
        parse_chrony_tracking(bad)


def test_chronyc_is_asked_over_the_unix_socket_without_name_lookups(tmp_path):
    args_file = tmp_path / "args"
    fake = tmp_path / "chronyc"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args_file}\nprintf '%s' '{CHRONY_CSV}'\n")
    fake.chmod(0o755)
    row = chrony_row(str(fake), str(tmp_path / "chronyd.sock"))
    assert args_file.read_text().split() == ["-c", "-n", "-h", str(tmp_path / "chronyd.sock"),
                                             "tracking"]
    assert row[0] == "chrony" and row[14] == -12345 and row[17] == "Normal"
    assert row[1] <= row[2]


def test_chrony_failure_is_logged_once(tmp_path):
    fake = tmp_path / "chronyc"
    fake.write_text("#!/bin/sh\necho '506 Cannot talk to daemon' >&2\nexit 1\n")
    fake.chmod(0o755)
    sock = tmp_path / "sock"
    sock.touch()
    src = ClockSource(chronyc=str(fake), chrony_socket=str(sock), ptp_glob=str(tmp_path / "none*"))
    src.start(None)

    class Sink:
        def __init__(self):
            self.rows, self.logs = [], []

        def add_many(self, t, r):
            self.rows += list(r)

        def log(self, *a, **k):
            self.logs.append(a)

    s = Sink()
    src.sample_now(s)
    src.sample_now(s)
    assert [r[0] for r in s.rows] == ["system", "system"]
    assert len(s.logs) == 1 and "read failed" in s.logs[0][3]


def test_ptp_ioctl_numbers_match_the_kernel_header():
    # _IOWR('=', 9, struct ptp_sys_offset_extended) with sizeof = 16 + 25*3*16 = 1216
    assert PTP_SYS_OFFSET_EXTENDED == 0xC4C03D09
    assert PTP_SYS_OFFSET_PRECISE == 0xC0403D08


def test_parse_ptp_extended_picks_narrowest_window():
    buf = bytearray(16 + 25 * 3 * 16)
    samples = [(100, 5_000_000_050, 300), (200, 5_000_000_140, 210), (400, 5_000_000_600, 900)]
    for i, (s0, phc, s1) in enumerate(samples):
        for k, ns in enumerate((s0, phc, s1)):
            struct.pack_into("<qII", buf, 16 + (i * 3 + k) * 16, ns // 10**9, ns % 10**9, 0)
    real, phc, window = parse_ptp_extended(bytes(buf), 3)
    assert (real, phc, window) == (205, 5_000_000_140, 10)


def test_no_ptp_device_means_no_ptp_rows(tmp_path):
    src = ClockSource(ptp_glob=str(tmp_path / "ptp*"), chronyc="")
    st = {s.name: s for s in src.sub_statuses()}
    assert not st["clock.ptp"].available and not st["clock.chrony"].available
    assert "chronyc not installed" in st["clock.chrony"].reason


def test_bundle_clock_samples_present_and_monotonic(tmp_path, open_all):
    r = run_capture("--bundle", tmp_path, "--node", "clk", "--no-ebpf", "--duration", "3",
                    "--clock-interval", "0.5", "--host-interval", "1")
    assert r.returncode == 0, r.stderr
    [b] = open_all(tmp_path)
    got = rows(b, "SELECT mono_before_ns, mono_after_ns, realtime_ns, boottime_ns, tai_ns, "
                  "uncertainty_ns FROM clock_samples WHERE source = 'system' ORDER BY id")
    assert len(got) >= 5  # start + ~6 ticks + stop, at 0.5 s intervals over 3 s
    for prev, cur in zip(got, got[1:]):
        assert cur[0] > prev[1]            # monotonic brackets do not overlap
        assert cur[3] > prev[3]            # boottime advances too
    for m0, m1, real, boot, tai, unc in got:
        assert unc == m1 - m0 >= 0
        assert real is not None and tai is not None
    cap = b.manifest["capture"]
    assert cap["start_mono_ns"] <= got[0][0] and got[-1][1] <= cap["end_mono_ns"]
    # realtime and monotonic advance together (no step during the test, within 50 ms)
    drift = (got[-1][2] - got[0][2]) - (got[-1][0] - got[0][0])
    assert abs(drift) < 50_000_000
