"""The building blocks of ddlf's self-contained HTML reports: style, colours, escaping, line charts, tables."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

LOST = "#D55E00"


SERIES = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"]


CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,'DejaVu Sans',sans-serif;margin:24px auto;
max-width:1120px;color:#222;background:#fff;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;margin-bottom:16px}.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:130px}
.card b{display:block;font-size:18px}.card span{color:#666;font-size:12px}
.charts{display:flex;flex-wrap:wrap;gap:16px}svg{background:#fff}
table{border-collapse:collapse;font-size:13px;margin-top:6px}
td,th{border-bottom:1px solid #eee;padding:3px 10px;text-align:right;white-space:nowrap}th{background:#f6f6f6}
td:first-child,th:first-child{text-align:left}.legend{display:flex;flex-wrap:wrap;gap:14px;margin:6px 0;font-size:12px}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-2px;margin-right:4px}
.note{color:#666;font-size:12px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi):
        return []
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt_tick(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.3g}"


def _line_chart(
    chart_id: str,
    title: str,
    series: dict[str, list[float]],
    width: int = 540,
    height: int = 280,
    colours: Sequence[str] | None = None,
) -> str:
    """An SVG line chart of per-epoch series (x: epoch 1..n). With ``colours`` (one per series) the caller draws
    the legend; without, the series take the palette in turn and a legend is drawn on the chart."""
    pad_l, pad_r, pad_t, pad_b = 56, 16, 30, 44
    values = [v for vs in series.values() for v in vs if math.isfinite(v)]
    n = max((len(vs) for vs in series.values()), default=0)
    out = [
        f"<svg id='{chart_id}' class='chart' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img'>"
    ]
    out.append(f"<text x='{width / 2}' y='18' text-anchor='middle' font-size='14' font-weight='600'>{_e(title)}</text>")
    if not values or n == 0:
        out.append(f"<text x='{width / 2}' y='{height / 2}' text-anchor='middle' fill='#888'>no data</text></svg>")
        return "".join(out)
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    span = hi - lo
    lo, hi = lo - 0.05 * span, hi + 0.05 * span
    x0, x1, y0, y1 = pad_l, width - pad_r, height - pad_b, pad_t

    def sx(i: float) -> float:
        return x0 + (x1 - x0) * (i / (n - 1) if n > 1 else 0.5)

    def sy(v: float) -> float:
        return y0 - (y0 - y1) * (v - lo) / (hi - lo)

    for t in _nice_ticks(lo, hi):
        y = sy(t)
        out.append(f"<line x1='{x0}' x2='{x1}' y1='{y:.1f}' y2='{y:.1f}' stroke='#eee'/>")
        out.append(
            f"<text x='{x0 - 6}' y='{y + 4:.1f}' text-anchor='end' font-size='11' fill='#555'>{_fmt_tick(t)}</text>"
        )
    step = max(1, math.ceil(n / 10))
    for i in range(0, n, step):
        out.append(
            f"<text x='{sx(i):.1f}' y='{y0 + 16}' text-anchor='middle' font-size='11' fill='#555'>{i + 1}</text>"
        )
    out.append(
        f"<text x='{(x0 + x1) / 2}' y='{height - 8}' text-anchor='middle' font-size='12' fill='#333'>epoch</text>"
    )
    out.append(
        f"<line x1='{x0}' x2='{x1}' y1='{y0}' y2='{y0}' stroke='#999'/>"
        f"<line x1='{x0}' x2='{x0}' y1='{y0}' y2='{y1}' stroke='#999'/>"
    )
    for k, (name, vs) in enumerate(series.items()):
        color = colours[k] if colours is not None else SERIES[k % len(SERIES)]
        pts = [(sx(i), sy(v)) for i, v in enumerate(vs) if math.isfinite(v)]
        if not pts:
            continue
        d = " ".join(f"{'M' if j == 0 else 'L'}{x:.1f},{y:.1f}" for j, (x, y) in enumerate(pts))
        dash = " stroke-dasharray='6 4'" if name.startswith("val_") else ""
        out.append(
            f"<path class='series' data-name='{_e(name)}' d='{d}' fill='none' stroke='{color}' stroke-width='2'{dash}/>"
        )
        out.extend(f"<circle cx='{x:.1f}' cy='{y:.1f}' r='3' fill='{color}'/>" for x, y in pts)
        if colours is not None:
            continue
        lx = x0 + 10 + 130 * k
        out.append(
            f"<line x1='{lx}' x2='{lx + 18}' y1='{y1 + 6}' y2='{y1 + 6}' stroke='{color}' stroke-width='2'{dash}/>"
        )
        out.append(f"<text x='{lx + 22}' y='{y1 + 10}' font-size='11'>{_e(name)}</text>")
    out.append("</svg>")
    return "".join(out)


def _table(head: list[str], rows: list[list[Any]], table_id: str) -> str:
    out = [f"<table id='{table_id}'><tr>" + "".join(f"<th>{_e(c)}</th>" for c in head) + "</tr>"]
    out.extend("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    out.append("</table>")
    return "".join(out)
