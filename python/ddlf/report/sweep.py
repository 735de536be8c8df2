"""The sweep report: one self-contained HTML page (inline SVG and CSS, no script, nothing fetched) for a
:class:`~ddlf.sweep.SweepResult`, written by ``ddlf.sweep(..., report="sweep.html")`` or
:meth:`SweepResult.write_report`.

It answers "which trial won, and where did the time go?": the best trial and the counts by status, every trial's
metric per epoch (where ASHA cut the weak ones), a timeline of the worker groups with one bar per trial attempt,
and the table of trials. The numbers are embedded as JSON (``id="ddlf-sweep"``) and written beside it as
``.json``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .html import CSS, LOST, SERIES, _e, _fmt_tick, _line_chart, _nice_ticks

if TYPE_CHECKING:
    from ..tune.result import SweepResult

__all__ = ["render_sweep_report", "sweep_json", "write_sweep_report"]

STATUS_COLOURS = {"completed": "#009E73", "stopped": "#BBBBBB", "failed": LOST, "running": "#0072B2"}


def sweep_json(result: SweepResult) -> str:
    """The sweep's numbers: its settings, and per trial its config, status, spans and metric per epoch."""

    def finite(v: Any) -> Any:
        return v if not isinstance(v, float) or math.isfinite(v) else None

    trials = []
    for t in result.trials:
        curve = t.history.history.get(result.metric, []) if t.history is not None else []
        trials.append(
            {
                "index": t.index,
                "config": t.config,
                "status": t.status,
                "epochs": t.epochs,
                "metric": finite(t.metric),
                "curve": [finite(float(v)) for v in curve],
                "seconds": t.seconds,
                "attempts": t.attempts,
                "spans": [{"start": s, "end": e, "workers": w} for s, e, w in t.spans],
                "error": None if t.error is None else f"{type(t.error).__name__}: {t.error}",
            }
        )
    doc = {"metric": result.metric, "mode": result.mode, "seconds": result.seconds, "trials": trials}
    return json.dumps(doc, default=str, indent=1)


def write_sweep_report(result: SweepResult, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Write the sweep's HTML page at ``path`` and its numbers as JSON beside it. Returns the HTML path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_sweep_report(result, title=title), encoding="utf-8")
    tmp.replace(path)
    path.with_suffix(".json").write_text(sweep_json(result), encoding="utf-8")
    return path


def render_sweep_report(result: SweepResult, *, title: str | None = None) -> str:
    """The sweep's page as an HTML document (a string)."""
    title = title or f"ddlf sweep: {len(result.trials)} trials, {result.metric} ({result.mode})"
    sub = " · ".join(
        [
            f"{result.seconds:.1f} s",
            f"{sum(t.epochs for t in result.trials)} epochs trained in all",
            f"master on {platform.node()}",
            f"written {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        ]
    )
    return "\n".join(
        [
            "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
            f"<h1>{_e(title)}</h1>",
            f"<div class='sub'>{_e(sub)}</div>",
            _cards(result),
            f"<h2>{_e(result.metric)} per epoch</h2>",
            _curves(result),
            "<h2>Worker groups over time</h2>",
            _legend(),
            _timeline(result),
            "<h2>Trials</h2>",
            _trial_table(result),
            '<script type="application/json" id="ddlf-sweep">',
            sweep_json(result).replace("<", "\\u003c"),  # nothing in it can end or open a tag
            "</script></body></html>",
        ]
    )


def _label(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.items())


def _cards(result: SweepResult) -> str:
    counts = {s: sum(t.status == s for t in result.trials) for s in ("completed", "stopped", "failed")}
    try:
        best = result.best
        best_cards = [(f"{best.metric:.4g}", f"best {result.metric} (trial {best.index})"), (_label(best.config), "")]
    except ValueError:
        best_cards = [("none", f"no trial reported {result.metric}")]
    cards = [
        (str(len(result.trials)), "trials"),
        *((str(n), s) for s, n in counts.items()),
        (f"{result.seconds:.1f} s", "wall time"),
        *best_cards,
    ]
    body = "".join(f"<div class='card'><b>{_e(v)}</b><span>{_e(k)}</span></div>" for v, k in cards)
    return f"<div class='cards' id='cards'>{body}</div>"


def _curves(result: SweepResult) -> str:
    series: dict[str, list[float]] = {}
    colours = []
    for t in result.trials:
        if t.history is not None and result.metric in t.history.history:
            series[f"trial {t.index}"] = [float(v) for v in t.history.history[result.metric]]
            colours.append(_colour(t.index))
    chart = _line_chart("chart-sweep", result.metric, series, width=1080, height=340, colours=colours)
    return (
        chart
        + "<p class='note'>One line per trial, colours as in the trial table; a line that ends early is a "
        + ("trial ASHA stopped.</p>")
    )


def _legend() -> str:
    items = "".join(
        f"<span><span class='sw' style='background:{c}'></span>{_e(s)}</span>" for s, c in STATUS_COLOURS.items()
    )
    return f"<div class='legend'>{items}</div>"


def _timeline(result: SweepResult, width: int = 1080) -> str:
    # (start, end, workers, trial, whether it is the trial's last attempt: earlier ones lost their workers)
    spans = [(s, e, w, t, k == len(t.spans) - 1) for t in result.trials for k, (s, e, w) in enumerate(t.spans)]
    if not spans:
        return "<p class='note'>No trial ran.</p>"
    groups = sorted({tuple(w) for _, _, w, _, _ in spans})
    row_h, pad_l, pad_r, pad_t, pad_b = 26, 110, 16, 10, 40
    height = pad_t + row_h * len(groups) + pad_b
    end = max(e for _, e, _, _, _ in spans) or 1.0
    x0, x1 = pad_l, width - pad_r

    def sx(t: float) -> float:
        return x0 + (x1 - x0) * t / end

    out = [f"<svg id='sweep-timeline' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img'>"]
    for tick in _nice_ticks(0.0, end, 10):
        x = sx(tick)
        out.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{pad_t}' y2='{height - pad_b}' stroke='#eee'/>")
        out.append(
            f"<text x='{x:.1f}' y='{height - pad_b + 16}' text-anchor='middle' font-size='11' fill='#555'>"
            f"{_fmt_tick(tick)}</text>"
        )
    out.append(
        f"<text x='{(x0 + x1) / 2}' y='{height - 6}' text-anchor='middle' font-size='12'>"
        "seconds since the sweep started</text>"
    )
    row = {g: i for i, g in enumerate(groups)}
    for g in groups:
        y = pad_t + row_h * row[g] + row_h / 2 + 4
        name = f"worker{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}"
        out.append(f"<text x='{x0 - 8}' y='{y}' text-anchor='end' font-size='12'>{_e(name)}</text>")
    for start, stop, workers, t, last in spans:
        colour = STATUS_COLOURS.get(t.status, "#888") if last else LOST
        y = pad_t + row_h * row[tuple(workers)] + 3
        w_px = max(2.0, sx(stop) - sx(start))
        out.append(
            f"<rect class='trial {t.status if last else 'lost'}' x='{sx(start):.2f}' y='{y}' width='{w_px:.2f}' "
            f"height='{row_h - 6}' fill='{colour}' stroke='#fff'><title>trial {t.index} ({_e(_label(t.config))}): "
            f"{t.status if last else 'workers lost'}, {stop - start:.1f} s</title></rect>"
        )
        if w_px > 22:
            out.append(
                f"<text x='{sx(start) + w_px / 2:.1f}' y='{y + row_h / 2 + 1}' text-anchor='middle' font-size='10' "
                f"fill='#fff'>{t.index}</text>"
            )
    out.append("</svg>")
    return "".join(out)


def _trial_table(result: SweepResult) -> str:
    head = ["trial", "config", "status", "epochs", result.metric, "seconds", "workers", "attempts", "error"]
    out = ["<table id='trials'><tr>" + "".join(f"<th>{_e(c)}</th>" for c in head) + "</tr>"]
    for t in result.trials:
        swatch = f"<span class='sw' style='background:{_colour(t.index)}'></span>"
        cells = [
            _label(t.config),
            t.status,
            t.epochs,
            "" if t.metric is None else f"{t.metric:.4f}",
            f"{t.seconds:.1f}",
            ", ".join(map(str, t.workers)),
            t.attempts,
            "" if t.error is None else f"{type(t.error).__name__}: {t.error}"[:160],
        ]
        out.append(
            f"<tr class='{_e(t.status)}'><td>{swatch}trial {t.index}</td>"
            + "".join(f"<td>{_e(c)}</td>" for c in cells)
            + "</tr>"
        )
    out.append("</table>")
    return "".join(out)


def _colour(index: int) -> str:
    """A trial's colour, the same in the chart and the table."""
    return SERIES[index % len(SERIES)]
