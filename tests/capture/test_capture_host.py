"""Host sampler: /proc parsers, rates over the interval, NVML present (fake GPU) and absent."""

import shutil
import time
import subprocess
from pathlib import Path

import pytest

from ingero_forensics.bundle.schema import HOST_METRICS
from ingero_forensics.capture.host import (PAGE_BYTES, HostSource, ProcReader, Snapshot, host_rows,
                                           parse_diskstats, parse_meminfo, parse_net_dev,
                                           parse_psi, parse_snmp_tcp, parse_stat, parse_vmstat)

from .conftest import rows, run_capture, wait_for

METRICS = {m for m, _, _ in HOST_METRICS}
FIXTURES = Path(__file__).parent / "fixtures"

STAT_A = b"""cpu  100 0 100 700 100 0 0 0 0 0
cpu0 50 0 50 350 50 0 0 0 0 0
cpu1 50 0 50 350 50 0 0 0 0 0
intr 1 2 3
procs_running 3
procs_blocked 0
"""
STAT_B = b"""cpu  200 10 190 1450 150 0 0 0 0 0
cpu0 150 10 140 400 100 0 0 0 0 0
cpu1 50 0 50 1050 50 0 0 0 0 0
procs_running 5
"""
MEMINFO = b"""MemTotal:       24684096 kB
MemFree:        20000000 kB
MemAvailable:   22000000 kB
Dirty:               128 kB
SwapTotal:          2048 kB
SwapFree:           1024 kB
"""
VMSTAT_A = b"pgmajfault 10\npgscan_kswapd 5\npgscan_direct 5\npgsteal_kswapd 1\npgsteal_direct 1\n" \
           b"allocstall_normal 0\nallocstall_movable 0\npgscan_khugepaged 999\n" \
           b"workingset_refault_anon 3\nworkingset_refault_file 7\nworkingset_activate_file 50\n"
VMSTAT_B = b"pgmajfault 30\npgscan_kswapd 25\npgscan_direct 5\npgsteal_kswapd 11\npgsteal_direct 1\n" \
           b"allocstall_normal 2\nallocstall_movable 2\npgscan_khugepaged 5000\n" \
           b"workingset_refault_anon 3\nworkingset_refault_file 27\nworkingset_activate_file 90\n"
SNMP_A = b"Ip: Forwarding DefaultTTL\nIp: 1 64\nTcp: RtoAlgorithm OutSegs RetransSegs InErrs\n" \
         b"Tcp: 1 1000 10 0\nUdp: InDatagrams\nUdp: 5\n"
SNMP_B = SNMP_A.replace(b"Tcp: 1 1000 10 0", b"Tcp: 1 3000 14 0")
NETDEV_A = b"""Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    1000      10    0    0    0     0          0         0     1000      10    0    0    0     0       0          0
  eth0: 500000    9607    0    1    0     0          0         0   4000    6161    0    2    0     0       0          0
"""
NETDEV_B = NETDEV_A.replace(b"500000    9607    0    1", b"900000    9907    0    3")
DISK_A = b" 254 0 vda 100 0 2000 50 100 0 4000 150 0 100 200 0 0 0 0\n" \
         b" 7 0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
DISK_B = b" 254 0 vda 110 0 2400 80 130 0 5000 200 1 150 300 0 0 0 0\n" \
         b" 7 0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
PSI_A = b"some avg10=0.00 avg60=0.00 avg300=0.00 total=1000\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=500\n"
PSI_B = b"some avg10=0.00 avg60=0.00 avg300=0.00 total=51000\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=10500\n"


def snap(t_ns, stat, vm, snmp, net, disk, psi) -> Snapshot:
    cpus, running = parse_stat(stat)
    return Snapshot(t_ns, cpus=cpus, running=running, load1=0.5,
                    psi={r: parse_psi(psi) for r in ("cpu", "io", "memory")},
                    mem=parse_meminfo(MEMINFO), vm=parse_vmstat(vm), tcp=parse_snmp_tcp(snmp),
                    net=parse_net_dev(net), disks=parse_diskstats(disk))


A = snap(1_000_000_000, STAT_A, VMSTAT_A, SNMP_A, NETDEV_A, DISK_A, PSI_A)
B = snap(1_500_000_000, STAT_B, VMSTAT_B, SNMP_B, NETDEV_B, DISK_B, PSI_B)  # 0.5 s later


def as_map(rs):
    return {(m, d): v for _, m, d, v in rs}


def test_parsers():
    cpus, running = parse_stat(STAT_A)
    assert cpus[None] == (200, 100, 1000) and cpus["cpu0"] == (100, 50, 500) and running == 3
    assert parse_meminfo(MEMINFO) == {"total": 24684096 * 1024, "available": 22000000 * 1024,
                                      "dirty": 128 * 1024, "swap_total": 2048 * 1024,
                                      "swap_free": 1024 * 1024}
    assert parse_vmstat(VMSTAT_A) == {"pgmajfault": 10, "pgscan": 10, "pgsteal": 2, "allocstall": 0,
                                      "refault": 10, "refault_bytes": 10 * PAGE_BYTES}
    # before kernel 5.9: one refault counter
    assert parse_vmstat(b"workingset_refault 12\nworkingset_activate 4\n")["refault"] == 12
    assert parse_snmp_tcp(SNMP_A) == {"retrans": 10, "out": 1000}
    assert parse_net_dev(NETDEV_A) == {"lo": (1000, 1000, 0), "eth0": (500000, 4000, 3)}
    assert parse_diskstats(DISK_A) == {"vda": (2000 * 512, 4000 * 512, 100, 200, 200)}  # loop0 idle
    assert parse_psi(PSI_A) == (1000, 500)


def test_first_sample_has_gauges_only():
    got = as_map(host_rows(None, A))
    assert got[("mem.total_bytes", None)] == 24684096 * 1024
    assert got[("mem.swap_used_bytes", None)] == 1024 * 1024
    assert got[("load.runnable", None)] == 3
    assert not any(m.endswith(("_per_s", "_pct")) for m, _ in got)


def test_rates_over_the_interval():
    rs = host_rows(A, B)
    assert {m for _, m, _, _ in rs} <= METRICS
    assert all(t == B.t_ns for t, _, _, _ in rs)
    got = as_map(rs)
    # all CPUs: busy 200 -> 400, iowait 100 -> 150, total 1000 -> 2000
    assert got[("cpu.busy_pct", None)] == pytest.approx(20.0)
    assert got[("cpu.iowait_pct", None)] == pytest.approx(5.0)
    assert got[("cpu.busy_pct", "cpu0")] == pytest.approx(200 / 300 * 100)
    assert got[("psi.cpu.some_pct", None)] == pytest.approx(50000 / 500000 * 100)
    assert ("psi.cpu.full_pct", None) not in got  # not in the catalogue
    assert got[("psi.io.full_pct", None)] == pytest.approx(10000 / 500000 * 100)
    assert got[("vm.pgmajfault_per_s", None)] == pytest.approx(40.0)
    assert got[("vm.pgscan_per_s", None)] == pytest.approx(40.0)   # khugepaged not counted
    assert got[("vm.pgsteal_per_s", None)] == pytest.approx(20.0)
    assert got[("vm.allocstall_per_s", None)] == pytest.approx(8.0)
    # activations not counted; pages in bytes
    assert got[("vm.refault_bytes_per_s", None)] == pytest.approx(40.0 * PAGE_BYTES)
    assert got[("tcp.retrans_segs_per_s", None)] == pytest.approx(8.0)
    assert got[("tcp.out_segs_per_s", None)] == pytest.approx(4000.0)
    assert got[("net.rx_bytes_per_s", "eth0")] == pytest.approx(800000.0)
    assert got[("net.drops_per_s", "eth0")] == pytest.approx(4.0)
    assert got[("net.tx_bytes_per_s", "lo")] == 0
    assert got[("disk.read_bytes_per_s", "vda")] == pytest.approx(400 * 512 / 0.5)
    assert got[("disk.busy_pct", "vda")] == pytest.approx(50 / 500 * 100)
    assert got[("disk.await_ms", "vda")] == pytest.approx((80 + 200 - 200) / 40)


def test_counter_reset_writes_no_rate():
    got = as_map(host_rows(B, snap(2_000_000_000, STAT_A, VMSTAT_A, SNMP_A, NETDEV_A,
                                   DISK_A, PSI_A)))
    assert ("vm.pgmajfault_per_s", None) not in got
    assert ("net.rx_bytes_per_s", "eth0") not in got
    assert ("cpu.busy_pct", None) not in got
    assert ("mem.total_bytes", None) in got  # gauges still written


def test_missing_proc_file_is_reported_and_others_sampled(tmp_path):
    reader = ProcReader({"stat": "/proc/stat", "psi_cpu": str(tmp_path / "no-psi")})
    try:
        assert "psi_cpu" in reader.missing and "no-psi" in reader.missing["psi_cpu"]
        s = reader.snapshot()
        assert None in s.cpus and s.psi == {}
    finally:
        reader.close()


class Sink:
    def __init__(self):
        self.rows = []

    def add_many(self, table, rs):
        assert table == "host_samples"
        self.rows += list(rs)


def test_nvml_absent(tmp_path):
    src = HostSource(nvml_library=str(tmp_path / "libnvidia-ml.so.1"))
    src.start(None)
    try:
        assert not src.nvml_status.available
        assert "libnvidia-ml.so.1 not found" in src.nvml_status.reason
        s = Sink()
        src.sample(s)
        wait_for(lambda: (time.sleep(0.02), src.sample(s),
                          [r for r in s.rows if r[1] == "cpu.busy_pct"])[2],
                 what="jiffies to advance")
        assert not [r for r in s.rows if r[1].startswith("gpu.")]
    finally:
        src.stop(Sink())


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake NVML library")
    out = tmp_path_factory.mktemp("nvml") / "libnvidia-ml.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out),
                    str(FIXTURES / "fake_nvml.c")], check=True)
    return out


def test_nvml_present_through_ctypes(fake_nvml):
    src = HostSource(nvml_library=str(fake_nvml))
    src.start(None)
    try:
        assert src.nvml_status.available and src.nvml_status.reason == "2 GPU(s)"
        s = Sink()
        src.sample(s)
        src.sample(s)
        last_t = max(t for t, *_ in s.rows)
        got = {(m, d): v for t, m, d, v in s.rows if t == last_t and m.startswith("gpu.")}
        assert {m for m, _ in got} <= METRICS
        assert got[("gpu.util_pct", "0")] == 90 and got[("gpu.util_pct", "1")] == 91
        assert got[("gpu.mem_util_pct", "0")] == 40
        assert got[("gpu.mem_used_bytes", "1")] == 11 << 30
        assert got[("gpu.sm_clock_mhz", "0")] == 1410
        assert got[("gpu.max_sm_clock_mhz", "0")] == 1980
        assert got[("gpu.temp_c", "0")] == 65
        assert got[("gpu.power_w", "0")] == pytest.approx(312.5)
        assert got[("gpu.throttle_reasons", "1")] == 4
        # counters grow 1 MiB (tx) / 2 MiB (rx) per query on GPU 0; GPU 1 lacks them
        tx = got[("gpu.pcie_tx_bytes_per_s", "0")]
        rx = got[("gpu.pcie_rx_bytes_per_s", "0")]
        assert tx > 0 and rx == pytest.approx(2 * tx)
        assert ("gpu.pcie_tx_bytes_per_s", "1") not in got
    finally:
        src.stop(Sink())


def test_bundle_host_samples(tmp_path, open_all):
    r = run_capture("--bundle", tmp_path, "--node", "h1", "--no-ebpf", "--duration", "2")
    assert r.returncode == 0, r.stderr
    [b] = open_all(tmp_path)
    metrics = {m for (m,) in rows(b, "SELECT DISTINCT metric FROM host_samples")}
    assert metrics <= METRICS
    for m in ("cpu.busy_pct", "load.avg1", "mem.total_bytes", "vm.pgmajfault_per_s",
              "tcp.retrans_segs_per_s", "net.rx_bytes_per_s", "capture.cpu_pct"):
        assert m in metrics
    # what the capture cost: its own CPU time, a share of one core, never above 2 cores
    own = rows(b, "SELECT MIN(value), MAX(value), AVG(value) FROM host_samples "
                  "WHERE metric = 'capture.cpu_pct'")[0]
    assert 0 <= own[0] and own[1] <= 200 and 0 < own[2] < 100
    per_cpu = rows(b, "SELECT COUNT(DISTINCT device) FROM host_samples "
                      "WHERE metric = 'cpu.busy_pct' AND device IS NOT NULL")[0][0]
    assert per_cpu == len([ln for ln in open("/proc/stat") if ln[:3] == "cpu" and ln[3].isdigit()])
    n_samples = rows(b, "SELECT COUNT(DISTINCT timestamp_ns) FROM host_samples")[0][0]
    n_clock = rows(b, "SELECT COUNT(*) FROM clock_samples")[0][0]
    assert n_samples > 2 * n_clock  # sampled far more often than the 1 s clock
    log = rows(b, "SELECT source, event, message FROM capture_log WHERE source = 'nvml'")
    assert log and log[0][1] == "source_off" and "libnvidia-ml.so.1" in log[0][2]


def test_capture_cost_is_the_process_cpu_time_over_the_interval():
    a = Snapshot(1_000_000_000, self_cpu_ns=5_000_000)
    b = Snapshot(1_100_000_000, self_cpu_ns=7_000_000)     # 2 ms of CPU in 100 ms
    (row,) = [r for r in host_rows(a, b) if r[1] == "capture.cpu_pct"]
    assert row == (1_100_000_000, "capture.cpu_pct", None, pytest.approx(2.0))
