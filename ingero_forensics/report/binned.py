"""The report's host figures from host_bins (merge/summaries.py), when they answer.

host_bins holds, per node, metric, device and report time bin, the count, sum, count of
positive values, minimum and maximum of host_samples.value. A straggler window is a run
of the report's bins, so a mean over the windows is SUM(total) / SUM(samples) over a
range of bins: the same samples as the statement over host_samples, summed in two steps
(the figures are rounded far above the last bits where the two sums can differ), and
minima, maxima and counts are exact. The statements here are the ones shown under the
figures; they run as they are against fleet.db.

host_bins answers only when its bins are the report's (the default bins; not with
--bin) and every window starts and ends on a bin edge; otherwise, and on a fleet.db
without it (version 3), evidence.py reads host_samples as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..merge.summaries import host_bin_params

__all__ = ["HostBins"]


@dataclass(frozen=True)
class HostBins:
    t0_ns: int
    bin_ns: int
    #: the report's bins are host_bins' bins (else only whole-run figures use it)
    aligned: bool

    @classmethod
    def open(cls, con, t0_ns, bin_ns) -> "HostBins | None":
        """host_bins of this fleet.db, or None without them (version 3, no collectives)."""
        p = host_bin_params(con)
        if p is None:
            return None
        return cls(p[0], p[1], p == (t0_ns, bin_ns))

    def clause(self, windows) -> tuple[str, list] | None:
        """SQL on host_bins.bin for exactly the samples in windows ([start, end) fleet
        times), or None when a window does not fall on bin edges."""
        if not self.aligned:
            return None
        if not windows:
            return "0", []
        parts, params = [], []
        for s, e in windows:
            i, ri = divmod(s - self.t0_ns, self.bin_ns)
            j, rj = divmod(e - self.t0_ns, self.bin_ns)
            if ri or rj or i < 0:
                return None
            parts.append("(bin >= ? AND bin < ?)")
            params += [i, j]
        return "(" + " OR ".join(parts) + ")", params

    @staticmethod
    def signal_sql(agg: str, where: str) -> str:
        """Per node, the worst device's mean of one metric (parameter 1) over the bins
        in where; of cpu.* metrics host_bins holds the whole-node row only."""
        return (f"SELECT node_id, {agg}(v) FROM (SELECT node_id, device, "
                f"SUM(total) / SUM(samples) v FROM host_bins WHERE metric = ? AND {where} "
                "GROUP BY node_id, device) GROUP BY node_id")

    @staticmethod
    def throttled_sql(where: str) -> str:
        """Per node, the largest share of throttled samples of a GPU over the bins."""
        return ("SELECT node_id, MAX(f) FROM (SELECT node_id, device, "
                "CAST(SUM(positive) AS REAL) / SUM(samples) f FROM host_bins "
                f"WHERE metric = 'gpu.throttle_reasons' AND {where} "
                "GROUP BY node_id, device) GROUP BY node_id")

    @staticmethod
    def memory_peaks_sql(where: str) -> str:
        return ("SELECT metric, MAX(hi) FROM host_bins WHERE node_id = ? AND metric IN "
                "('psi.memory.some_pct', 'vm.pgmajfault_per_s', 'vm.pgscan_per_s', "
                "'vm.refault_bytes_per_s') "
                f"AND {where} GROUP BY metric ORDER BY metric")

    @staticmethod
    def gpu_devices_sql(where: str) -> str:
        return ("SELECT device, SUM(CASE WHEN metric = 'gpu.sm_clock_mhz' THEN total END) / "
                "SUM(CASE WHEN metric = 'gpu.sm_clock_mhz' THEN samples END), "
                "SUM(CASE WHEN metric = 'gpu.temp_c' THEN total END) / "
                "SUM(CASE WHEN metric = 'gpu.temp_c' THEN samples END) FROM host_bins "
                "WHERE node_id = ? AND metric IN ('gpu.sm_clock_mhz', 'gpu.temp_c') "
                f"AND {where} GROUP BY device ORDER BY 2 ASC LIMIT 3")

    @staticmethod
    def series_sql(agg: str) -> str:
        """Per node and report bin from 0 on, the metric's (parameter 1) extreme over
        devices. Bin -1 (the samples less than a bin before t0) counts in bin 0, as
        SQLite's truncating (timestamp_ns - t0) / bin_ns puts them there."""
        col = "lo" if agg == "MIN" else "hi"
        return (f"SELECT node_id, MAX(bin, 0), {agg}({col}) FROM host_bins "
                "WHERE metric = ? AND bin >= -1 GROUP BY node_id, MAX(bin, 0)")

    @staticmethod
    def whole_run_mean_sql(metric: str) -> str:
        """Per node, the mean of a metric over the whole capture (every bin)."""
        return ("SELECT node_id, SUM(total) / SUM(samples) FROM host_bins "
                f"WHERE metric = '{metric}' GROUP BY node_id ORDER BY node_id")
