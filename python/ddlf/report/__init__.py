"""Self-contained HTML reports: of a training run (:mod:`.training`) and of a sweep (:mod:`.sweep`)."""

from __future__ import annotations

from .training import check_report_path, render_report, write_report

__all__ = ["check_report_path", "render_report", "write_report"]
