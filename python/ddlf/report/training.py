"""The training report: one self-contained HTML file (inline SVG and CSS, no script, nothing fetched), written by
``app.train(..., run=ddlf.RunConfig(report="run.html"))`` or :func:`write_report`.

It answers "why is training slow?" at a glance: the loss and metric curves, a per-worker timeline of every
round split into sending the weights, computing, moving request and reply, and waiting for the slowest worker,
where each worker's time went in total, the bytes on the wire, staleness (async), and the faults of the run.
The numbers behind it are embedded as JSON (``<script type="application/json" id="ddlf-stats">``) and written
beside it as ``run.json``.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from ..training.history import History, RoundStats, worker_totals
from .html import CSS, LOST, _e, _fmt_tick, _line_chart, _nice_ticks, _table

# Phase colours (colour-blind safe, Okabe-Ito) shared by the timeline, the breakdown and their legends.
PHASES: list[tuple[str, str, str]] = [
    ("send", "Sending weights", "#0072B2"),
    ("compute", "Computing", "#009E73"),
    ("data", "Waiting for data", "#F0E442"),
    ("comm", "Request + reply on the wire", "#E69F00"),
    ("wait", "Waiting for other workers", "#BBBBBB"),
]


MAX_TIMELINE_ROUNDS = 4000  # segments drawn per run; beyond that the timeline shows the first rounds only


def check_report_path(path: str | os.PathLike[str]) -> None:
    """Raise :class:`~ddlf.errors.ConfigError` now (before training) when a report could not be written at ``path``."""
    p = Path(path)
    if p.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"report={os.fspath(path)!r}: give an .html file name (its numbers go beside it as .json)")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if p.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"report={os.fspath(path)!r}: cannot write there ({parent} is not a writable directory)")


def write_report(history: History, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Write ``history`` as a self-contained HTML report at ``path`` and its numbers as JSON beside it
    (same name, ``.json``). Returns the HTML file's path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = render_report(history, title=title)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    path.with_suffix(".json").write_text(history.to_json(), encoding="utf-8")
    return path


def render_report(history: History, *, title: str | None = None) -> str:
    """The report of ``history`` as an HTML document (a string)."""
    p = history.params
    title = title or f"ddlf training report: {p.get('mode', '?')} mode, {p.get('workers', '?')} workers"
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f"<div class='sub'>{_e(_subtitle(history))}</div>",
        _cards(history),
        "<h2>Learning curves</h2><div class='charts'>",
        _curves(history),
        "</div>",
        "<h2>Per-worker timeline</h2>",
        _legend(),
        _timeline(history.stats),
        "<h2>Where each worker's time went</h2>",
        _breakdown(history.stats),
        _worker_table(history),
        _events(history),
        "<h2>Run parameters</h2>",
        _params(history),
        '<script type="application/json" id="ddlf-stats">',
        history.to_json().replace("</", "<\\/"),
        "</script></body></html>",
    ]
    return "\n".join(parts)


def _subtitle(h: History) -> str:
    p = h.params
    bits = [
        f"{p.get('samples', '?')} samples per epoch",
        f"batch size {p.get('batch_size', '?')}",
        f"{len(h.epoch_seconds)} epochs in {sum(h.epoch_seconds):.1f} s",
        f"compression: {p.get('compression') or 'none'}",
        f"master on {platform.node()}",
        f"written {_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
    ]
    return " · ".join(bits)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _phase_seconds(row: dict[str, float]) -> dict[str, float]:
    """A :func:`~ddlf.training.history.worker_totals` row as seconds per timeline phase (compute net of data wait)."""
    return {
        "send": row["send_seconds"],
        "data": row["data_wait_seconds"],
        "compute": max(0.0, row["compute_seconds"] - row["data_wait_seconds"]),
        "comm": row["comm_seconds"],
        "wait": row["wait_seconds"],
    }


def _cards(h: History) -> str:
    rows = worker_totals(h.stats).values()
    t = {k: sum(row[k] for row in rows) for k in ("samples", "bytes_sent", "bytes_received")}
    for row in rows:
        for k, v in _phase_seconds(row).items():
            t[k] = t.get(k, 0.0) + v
    busy = sum(t[k] for k, _, _ in PHASES) or 1.0
    wall = sum(h.epoch_seconds)
    cards: list[tuple[str, str]] = []
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        if h.history.get(key):
            cards.append((f"{h.history[key][-1]:.4f}", f"final {key}"))
    if wall > 0:
        cards.append((f"{t['samples'] / wall:,.0f}", "samples/s"))
    cards.append((f"{100 * t['compute'] / busy:.0f}%", "of worker time computing"))
    cards.append((f"{100 * (t['send'] + t['comm']) / busy:.0f}%", "communicating"))
    cards.append((f"{100 * t['wait'] / busy:.0f}%", "waiting for others"))
    cards.append((_fmt_bytes(t["bytes_sent"] + t["bytes_received"]), "on the wire"))
    stale = [s.staleness for s in h.stats if not s.lost]
    if h.params.get("mode") == "async" and stale:
        cards.append((f"{sum(stale) / len(stale):.2f} / {max(stale)}", "staleness mean / max"))
    lost = sum(s.lost for s in h.stats)
    dropped = sum(s.dropped for s in h.stats)
    if lost or dropped:
        cards.append((f"{lost} / {dropped}", "rounds lost / deltas dropped"))
    return (
        "<div class='cards'>"
        + "".join(f"<div class='card'><b>{_e(v)}</b><span>{_e(k)}</span></div>" for v, k in cards)
        + "</div>"
    )


def _legend() -> str:
    items = [f"<span><i class='sw' style='background:{c}'></i>{_e(label)}</span>" for _, label, c in PHASES]
    items.append(f"<span><i class='sw' style='background:{LOST}'></i>Worker lost</span>")
    return "<div class='legend'>" + "".join(items) + "</div>"


def _curves(h: History) -> str:
    losses = {k: v for k, v in h.history.items() if k.endswith("loss")}
    metrics = {k: v for k, v in h.history.items() if not k.endswith("loss")}
    charts = [_line_chart("chart-loss", "Loss", losses)]
    if metrics:
        charts.append(_line_chart("chart-metrics", "Metrics", metrics))
    return "".join(charts)


def _timeline(stats: Sequence[RoundStats], width: int = 1080) -> str:
    """Gantt chart: one row per worker, one bar per round split into its phases."""
    if not stats:
        return "<p class='note'>No rounds were recorded.</p>"
    shown = sorted(stats, key=lambda s: (s.start, s.worker))[:MAX_TIMELINE_ROUNDS]
    workers = sorted({s.worker for s in stats})
    row_h, pad_l, pad_r, pad_t, pad_b = 26, 80, 16, 14, 40
    height = pad_t + row_h * len(workers) + pad_b
    origin = min(s.start for s in shown)
    setup = f" (set-up before it: {origin:.2f} s)" if origin > 0.005 else ""
    end = max(s.start - origin + _round_seconds(s) for s in shown) or 1.0
    x0, x1 = pad_l, width - pad_r

    def sx(t: float) -> float:
        return x0 + (x1 - x0) * (t - origin) / end

    out = [f"<svg id='timeline' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img'>"]
    epoch_starts: dict[int, float] = {}
    for s in shown:
        epoch_starts[s.epoch] = min(epoch_starts.get(s.epoch, s.start), s.start)
    for ep, t in sorted(epoch_starts.items()):
        x = sx(t)
        out.append(
            f"<line x1='{x:.1f}' x2='{x:.1f}' y1='2' y2='{height - pad_b}' stroke='#888' stroke-dasharray='3 3'/>"
        )
        out.append(f"<text x='{x + 3:.1f}' y='9' font-size='9' fill='#666'>epoch {ep + 1}</text>")
    for rel in _nice_ticks(0.0, end, 10):
        t = origin + rel
        x = sx(t)
        out.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{pad_t}' y2='{height - pad_b}' stroke='#eee'/>")
        out.append(
            f"<text x='{x:.1f}' y='{height - pad_b + 16}' text-anchor='middle' font-size='11' fill='#555'>"
            f"{_fmt_tick(rel)}</text>"
        )
    out.append(
        f"<text x='{(x0 + x1) / 2}' y='{height - 6}' text-anchor='middle' font-size='12'>"
        f"seconds since the first round{setup}</text>"
    )
    row = {w: i for i, w in enumerate(workers)}
    for w in workers:
        y = pad_t + row_h * row[w]
        out.append(f"<text x='{x0 - 8}' y='{y + row_h / 2 + 4}' text-anchor='end' font-size='12'>worker {w}</text>")
    for s in shown:
        y = pad_t + row_h * row[s.worker] + 3
        t = s.start
        if s.lost:
            w_px = max(3.0, sx(t + max(_round_seconds(s), 0.0)) - sx(t))
            out.append(
                f"<rect class='seg lost' x='{sx(t):.2f}' y='{y}' width='{w_px:.2f}' height='{row_h - 6}' fill='{LOST}'>"
                f"<title>epoch {s.epoch + 1} round {s.round}: worker {s.worker} lost</title></rect>"
            )
            continue
        for key, seconds in _phases(s):
            if seconds <= 0:
                continue
            w_px = sx(t + seconds) - sx(t)
            color = next(c for k, _, c in PHASES if k == key)
            out.append(
                f"<rect class='seg {key}' x='{sx(t):.2f}' y='{y}' width='{max(w_px, 0.5):.2f}' height='{row_h - 6}' "
                f"fill='{color}'><title>epoch {s.epoch + 1} round {s.round} worker {s.worker}: {key} "
                f"{seconds * 1000:.1f} ms</title></rect>"
            )
            t += seconds
    out.append("</svg>")
    if len(stats) > len(shown):
        out.append(f"<p class='note'>The first {len(shown)} of {len(stats)} rounds are drawn.</p>")
    return "".join(out)


def _phases(s: RoundStats) -> list[tuple[str, float]]:
    compute = max(0.0, s.compute_seconds - s.data_wait_seconds)
    return [
        ("send", s.send_seconds),
        ("data", s.data_wait_seconds),
        ("compute", compute),
        ("comm", s.comm_seconds),
        ("wait", s.wait_seconds),
    ]


def _round_seconds(s: RoundStats) -> float:
    return s.send_seconds + s.compute_seconds + s.comm_seconds + s.wait_seconds


def _breakdown(stats: Sequence[RoundStats], width: int = 1080) -> str:
    """Stacked horizontal bars: each worker's total seconds per phase."""
    workers = sorted({s.worker for s in stats})
    if not workers:
        return ""
    totals = {w: _phase_seconds(row) for w, row in worker_totals(stats).items()}
    longest = max(sum(t[k] for k, _, _ in PHASES) for t in totals.values()) or 1.0
    row_h, pad_l, pad_r = 26, 80, 140
    height = 10 + row_h * len(workers) + 10
    out = [f"<svg id='breakdown' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img'>"]
    for i, w in enumerate(workers):
        y = 10 + row_h * i
        x = float(pad_l)
        out.append(f"<text x='{pad_l - 8}' y='{y + row_h / 2 + 4}' text-anchor='end' font-size='12'>worker {w}</text>")
        for key, label, color in PHASES:
            sec = totals[w][key]
            if sec <= 0:
                continue
            w_px = (width - pad_l - pad_r) * sec / longest
            out.append(
                f"<rect class='bar {key}' x='{x:.2f}' y='{y + 3}' width='{w_px:.2f}' height='{row_h - 6}' "
                f"fill='{color}'>"
                f"<title>worker {w}: {label} {sec:.2f} s</title></rect>"
            )
            x += w_px
        total = sum(totals[w][k] for k, _, _ in PHASES)
        out.append(f"<text x='{x + 6:.1f}' y='{y + row_h / 2 + 4}' font-size='12'>{total:.2f} s</text>")
    out.append("</svg>")
    return "".join(out)


def _worker_table(h: History) -> str:
    rows = []
    for w, s in sorted(worker_totals(h.stats).items()):
        rate = s["samples"] / s["compute_seconds"] if s["compute_seconds"] else 0.0
        merged = s["rounds"] - s["lost"]
        mean_staleness = s["staleness"] / merged if merged else 0.0
        rows.append(
            [
                f"worker {w}",
                s["rounds"],
                f"{s['samples']:,}",
                f"{rate:,.0f}",
                f"{s['compute_seconds']:.2f}",
                f"{s['data_wait_seconds']:.2f}",
                f"{s['send_seconds'] + s['comm_seconds']:.2f}",
                f"{s['wait_seconds']:.2f}",
                _fmt_bytes(s["bytes_sent"]),
                _fmt_bytes(s["bytes_received"]),
                f"{mean_staleness:.2f} / {s['max_staleness']:.0f}",
                s["dropped"],
                s["lost"],
            ]
        )
    head = [
        "worker",
        "rounds",
        "samples",
        "samples/s",
        "compute s",
        "data wait s",
        "comm s",
        "waiting s",
        "sent",
        "received",
        "staleness",
        "dropped",
        "lost",
    ]
    note = (
        "<p class=note>samples/s: while computing. comm: request and reply on the wire, beyond the weights sent. "
        "staleness: mean / max updates applied between a worker's pull and its push (async). dropped: deltas "
        "over max_staleness. lost: rounds the worker was lost in.</p>"
    )
    return _table(head, rows, "workers") + note


def _events(h: History) -> str:
    if not h.events:
        return "<h2>Faults and membership</h2><p class='note'>None: every worker took part in every round.</p>"
    rows = []
    for ev in h.events:
        extra = {k: v for k, v in ev.items() if k not in ("time", "event", "worker", "address", "epoch", "round")}
        rows.append(
            [
                ev.get("event", ""),
                ev.get("worker", ""),
                ev.get("address", ""),
                "" if ev.get("epoch") is None else int(ev["epoch"]) + 1,
                ev.get("round", ""),
                ", ".join(f"{k}={v}" for k, v in extra.items()),
            ]
        )
    return "<h2>Faults and membership</h2>" + _table(
        ["event", "worker", "address", "epoch", "round", "details"], rows, "events"
    )


def _params(h: History) -> str:
    rows = [[k, v] for k, v in h.params.items() if k != "setup"]
    rows.append(["epoch seconds", ", ".join(f"{s:.2f}" for s in h.epoch_seconds)])
    return _table(["parameter", "value"], rows, "params")
