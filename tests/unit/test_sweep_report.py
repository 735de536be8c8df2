"""The sweep's HTML page and JSON, rendered from a made-up result (no daemons)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ddlf.report.sweep import render_sweep_report
from ddlf.training.history import History
from ddlf.tune.result import SweepResult, Trial


def _history(values: list[float]) -> History:
    h = History()
    h.history = {"val_accuracy": values, "loss": [1.0] * len(values)}
    h.epoch_seconds = [1.0] * len(values)
    return h


def _result() -> SweepResult:
    trials = [
        Trial(0, {"lr": 3e-3, "width": 64}, "completed", _history([0.8, 0.9, 0.93]), 0.93, 3, [0], None, 1,
              [(0.0, 6.0, [0])]),
        Trial(1, {"lr": 1e-5, "width": 8}, "stopped", _history([0.2]), 0.2, 1, [1], None, 1, [(0.0, 2.0, [1])]),
        # lost its first worker, then finished on worker 1
        Trial(2, {"lr": 1e-3, "width": 32}, "completed", _history([0.7, 0.85, 0.9]), 0.9, 3, [1], None, 2,
              [(2.0, 3.0, [1]), (6.0, 13.0, [0])]),
        Trial(3, {"lr": "<script>", "width": 1}, "failed", None, None, 0, [1], RuntimeError("boom <b>"), 1,
              [(3.0, 3.5, [1])]),
    ]  # fmt: skip
    return SweepResult(trials, "val_accuracy", "max", 13.5)


def test_the_page_shows_the_best_trial_every_curve_span_and_row() -> None:
    page = render_sweep_report(_result())
    assert page.count("<script") == 1  # a config or error cannot open a tag: escaped in the table and the JSON
    assert "boom &lt;b&gt;" in page
    cards = re.search(r"<div class='cards' id='cards'>(.*?)</div></div>", page, re.S)
    assert cards and "0.93" in cards.group(1) and "lr=0.003, width=64" in cards.group(1)
    # one line per trial with a curve (the failed one has none), one bar per attempt, one row per trial
    assert len(re.findall(r"<path class='series'", page)) == 3
    assert len(re.findall(r"<rect class='trial (?:completed|stopped|failed)'", page)) == 4
    assert len(re.findall(r"<rect class='trial lost'", page)) == 1  # trial 2's first attempt
    rows = re.findall(r"<tr class='(\w+)'>", page)
    assert rows == ["completed", "stopped", "completed", "failed"]
    data = json.loads(re.search(r'id="ddlf-sweep">(.*?)</script>', page, re.S).group(1))  # type: ignore[union-attr]
    assert [t["status"] for t in data["trials"]] == rows
    assert data["trials"][2]["spans"][1] == {"start": 6.0, "end": 13.0, "workers": [0]}
    assert data["trials"][1]["curve"] == [0.2] and data["trials"][3]["error"] == "RuntimeError: boom <b>"


def test_write_report_writes_html_and_json(tmp_path: Path) -> None:
    path = _result().write_report(tmp_path / "out" / "sweep.html")
    assert path.read_text().startswith("<!doctype html>")
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["metric"] == "val_accuracy"


def test_a_sweep_where_nothing_reported_still_renders() -> None:
    result = SweepResult([Trial(0, {"lr": 1.0}, "failed", error=ValueError("x"))], "val_loss", "min", 0.1)
    page = render_sweep_report(result)
    assert "no trial reported val_loss" in page and "No trial ran." in page
    with pytest.raises(ValueError):
        _ = result.best
