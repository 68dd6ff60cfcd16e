"""The static straggler / root-cause report: analyze a fleet.db, render one HTML file."""

from pathlib import Path

from .analyze import Analysis, analyze_fleet
from .render import render_html, write_report


def build_report(fleet_db, out_path, *, bin_s: float | None = None) -> Analysis:
    """Analyze fleet_db and write the HTML report to out_path; return the analysis."""
    analysis = analyze_fleet(fleet_db, bin_s=bin_s)
    write_report(analysis, Path(out_path))
    return analysis


__all__ = ["Analysis", "analyze_fleet", "build_report", "render_html", "write_report"]
