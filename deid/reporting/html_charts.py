"""The charts of report.html, written as inline SVG.

Readable at 100% zoom: every chart is at most :data:`MAX_WIDTH_PX` CSS pixels wide (the page's
content width), so the browser never scales it down, with text at :data:`FONT_PT` points
(:data:`FONT_PX` CSS pixels). Legends sit above the plot area, never over bars. Vector, so sharp at
any zoom and on high-density screens. Written by hand rather than by matplotlib: a report's charts
took ~0.6 s of CPU and ~250 kB of PNG through matplotlib, against milliseconds and a few kB here,
and every release run renders them. The SVG carries no namespace URL (inline SVG in HTML needs
none), so the page still holds no URL at all.

Text widths are estimated (:func:`_text_width`, a generous average glyph width), since no font is
measured here: margins are sized from the estimate, so labels never overlap the plot.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deid.reporting.html_page import esc
from deid.bound import within_bound

if TYPE_CHECKING:  # pragma: no cover - typing only (deid.reporting.report imports the page modules lazily)
    from deid.reporting.report import Reidentification, Utility

__all__ = ["FONT_PT", "FONT_PX", "MAX_WIDTH_PX", "Chart", "cluster_chart", "partition_chart", "partition_name",
           "reid_chart", "utility_chart"]

FONT_PX = 14.0  # tick, label and legend text, in CSS px
FONT_PT = FONT_PX * 72 / 96  # 10.5 pt
MAX_WIDTH_PX = 1000  # the report's content column is 1052 px wide (1100 px minus padding)
_BLUE, _RED, _GREY, _AMBER, _INK, _GRID = "#1a73e8", "#b3261e", "#9aa0a6", "#f9ab00", "#202124", "#e8eaed"
_ROW = 30.0          # px per bar row (horizontal bar charts)
_LEGEND_ROW = 22.0   # px per legend line
_AXIS = 50.0         # px under the plot area: tick labels and the axis title
_PAD = 10.0


@dataclass(frozen=True)
class Chart:
    """A chart: an inline ``<svg>`` element and its CSS size."""

    svg: str
    width: int
    height: int
    alt: str


def _text_width(text: str) -> float:
    # 0.6 em per glyph: above the average advance of sans-serif faces (~0.5 em), so margins suffice.
    return 0.6 * FONT_PX * len(text)


def _fmt(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".") if not float(v).is_integer() else str(int(v))


def _nice_ticks(top: float, *, integer: bool = False, most: int = 6) -> list[float]:
    """Round tick values from 0 to at least ``top`` (1, 2, 2.5 or 5 times a power of ten apart)."""
    top = max(top, 1.0 if integer else 1e-9)
    raw = top / most
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if integer:
        step = max(1.0, math.ceil(step))
    n = math.ceil(top / step - 1e-9)
    return [round(i * step, 10) for i in range(n + 1)]


class _Svg:
    """A few drawing primitives that append SVG elements (coordinates in CSS px)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, fill: str, cls: str = "") -> None:
        c = f' class="{cls}"' if cls else ""
        self.parts.append(f'<rect{c} x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" fill="{fill}"/>')

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str, width: float = 1.0, *,
             dash: bool = False, cls: str = "") -> None:
        c = f' class="{cls}"' if cls else ""
        d = ' stroke-dasharray="6 4"' if dash else ""
        self.parts.append(f'<line{c} x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" '
                          f'stroke-width="{width}"{d}/>')

    def text(self, x: float, y: float, s: str, *, anchor: str = "start", cls: str = "") -> None:
        c = f' class="{cls}"' if cls else ""
        self.parts.append(f'<text{c} x="{x:.1f}" y="{y:.1f}" font-size="{FONT_PX}" text-anchor="{anchor}" '
                          f'dominant-baseline="middle" fill="{_INK}">{esc(s)}</text>')

    def legend(self, items: Sequence[tuple[str, str, str]], width: float) -> float:
        """Legend entries (kind "bar" | "dash" | "whisker", colour, text) in lines; the height used."""
        self.parts.append('<g class="legend">')
        x, y = _PAD, _PAD + _LEGEND_ROW / 2
        for kind, colour, label in items:
            w = 22 + _text_width(label) + 18
            if x > _PAD and x + w > width - _PAD:
                x, y = _PAD, y + _LEGEND_ROW
            if kind == "bar":
                self.rect(x, y - 6, 16, 12, colour)
            elif kind == "whisker":
                self.line(x, y, x + 16, y, colour)
                self.line(x, y - 4, x, y + 4, colour)
                self.line(x + 16, y - 4, x + 16, y + 4, colour)
            else:
                self.line(x, y, x + 16, y, colour, 1.4, dash=True)
            self.text(x + 22, y, label)
            x += w
        self.parts.append("</g>")
        return y + _LEGEND_ROW / 2

    def done(self, width: float, height: float, alt: str) -> Chart:
        w, h = math.ceil(width), math.ceil(height)
        svg = (f'<svg class="chart" role="img" aria-label="{esc(alt)}" width="{w}" height="{h}" '
               f'viewBox="0 0 {w} {h}" font-family="system-ui, sans-serif"><title>{esc(alt)}</title>'
               + "".join(self.parts) + "</svg>")
        return Chart(svg, w, h, alt)


def partition_name(key: Any) -> str:
    """A partition's label values as text: ``["female", "neutral"]`` -> ``female / neutral``."""
    if isinstance(key, list | tuple):
        return " / ".join(str(v) for v in key) if key else "all records"
    return str(key)


def _hbars(names: Sequence[str], series: Sequence[tuple[str, str, Sequence[float]]], *, width: float, xmax: float,
           xlabel: str, alt: str, integer: bool = False, vline: tuple[float, str, str] | None = None,
           intervals: Sequence[tuple[int, float, float]] = (), extra_legend: Sequence[tuple[str, str, str]] = (),
           colours: Sequence[str] | None = None) -> Chart:
    """Horizontal bars: one row per name, one bar per series in each row (top to bottom as given).

    ``vline`` is (x, colour, legend text), drawn dashed across the plot; ``intervals`` are
    (row, low, high) whiskers on the first series; ``colours`` overrides the first series' colour per row.
    """
    svg = _Svg()
    legend = [("bar", colour, label) for label, colour, _ in series] + list(extra_legend)
    if intervals:
        legend.append(("whisker", _INK, "confidence interval"))
    if vline is not None:
        legend.append(("dash", vline[1], vline[2]))
    top = svg.legend(legend, width) + 6
    left = min(width * 0.45, _PAD + max(_text_width(n) for n in names) + 8)
    right = width - _PAD - 8
    n = len(names)
    bottom = top + n * _ROW
    ticks = _nice_ticks(xmax, integer=integer) if xmax > 1 or integer else [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    hi = ticks[-1] if (xmax > 1 or integer) else min(1.0, max(xmax, 1e-9))
    if not (xmax > 1 or integer):
        ticks = [t for t in ticks if t <= hi + 1e-9]

    def sx(v: float) -> float:
        return left + (right - left) * min(max(v, 0.0), hi) / hi

    svg.parts.append('<g class="grid">')
    for t in ticks:
        svg.line(sx(t), top, sx(t), bottom, _GRID, 0.8)
        svg.text(sx(t), bottom + 12, _fmt(t), anchor="middle")
    svg.parts.append("</g>")
    svg.line(left, bottom, right, bottom, _INK, 1.0)
    svg.text((left + right) / 2, bottom + 36, xlabel, anchor="middle")
    bar_h = 0.7 * _ROW / len(series)
    for i, name in enumerate(names):
        y0 = top + i * _ROW + 0.15 * _ROW
        svg.text(left - 8, top + (i + 0.5) * _ROW, name, anchor="end", cls="ylabel")
        for s, (_, colour, values) in enumerate(series):
            fill = colours[i] if (colours is not None and s == 0) else colour
            svg.rect(left, y0 + s * bar_h, sx(values[i]) - left, bar_h, fill, cls="bar")
    for i, lo, up in intervals:
        y = top + (i + 0.5) * _ROW
        svg.line(sx(lo), y, sx(up), y, _INK, 1.0, cls="whisker")
        svg.line(sx(lo), y - 4, sx(lo), y + 4, _INK, 1.0)
        svg.line(sx(up), y - 4, sx(up), y + 4, _INK, 1.0)
    if vline is not None:
        svg.line(sx(vline[0]), top, sx(vline[0]), bottom, vline[1], 1.4, dash=True, cls="vline")
    return svg.done(width, bottom + _AXIS, alt)


def reid_chart(reid: Sequence[Reidentification], bound: float) -> Chart | None:
    """Re-identification rate per attacker and mode (horizontal bars), its confidence interval and 1/k."""
    if not reid:
        return None
    rates = [float(r.rate) for r in reid]
    over = [not within_bound(r, limit=bound) for r in rates]
    intervals = [(i, float(r.lower), float(r.upper)) for i, r in enumerate(reid)
                 if r.lower is not None and r.upper is not None]
    top = max([bound, *rates, *[u for _, _, u in intervals]])
    return _hbars([f"{r.attacker} \u00b7 {r.mode}" for r in reid], [("rate \u2264 1/k", _BLUE, rates)],
                  width=960, xmax=min(1.0, top * 1.08) if top > 0 else 1.0,
                  xlabel="re-identification rate (share of probes matched to the right person)",
                  alt="re-identification rate per attacker and mode, with confidence intervals and the 1/k bound",
                  vline=(bound, _INK, f"1/k = {bound:.2f}"), intervals=intervals,
                  colours=[_RED if o else _BLUE for o in over],
                  extra_legend=[("bar", _RED, "rate > 1/k")] if any(over) else ())


def _utility_name(u: Utility) -> str:
    return f"{u.label} \u00b7 {u.protocol}" if u.protocol else str(u.label)


def utility_chart(utility: Sequence[Utility]) -> Chart | None:
    """Classifier accuracy per label and protocol: on the originals vs on the release."""
    rows = [u for u in utility if u.original_accuracy is not None or u.deidentified_accuracy is not None]
    if not rows:
        return None
    return _hbars([_utility_name(u) for u in rows],
                  [("originals", _GREY, [u.original_accuracy or 0.0 for u in rows]),
                   ("release", _BLUE, [u.deidentified_accuracy or 0.0 for u in rows])],
                  width=960, xmax=1.0, xlabel="classifier accuracy",
                  alt="classifier accuracy per label and protocol, originals vs release")


def partition_chart(partitions: Sequence[Mapping[str, Any]], k: int) -> Chart | None:
    """Records and distinct people per label partition, with the k people every partition needs."""
    if not partitions:
        return None
    records = [p.get("records", 0) for p in partitions]
    people = [p.get("people", 0) for p in partitions]
    return _hbars([partition_name(p.get("key", i)) for i, p in enumerate(partitions)],
                  [("records", _BLUE, records), ("people", _AMBER, people)],
                  width=800, xmax=max([k, *records, *people]) * 1.05, integer=True, xlabel="count",
                  alt="records and people per partition, with the k people a partition needs",
                  vline=(k, _RED, f"k = {k} people needed"))


def cluster_chart(sizes: Sequence[int], k: int) -> Chart | None:
    """Histogram of cluster sizes (records per cluster) with the minimum k drawn at k."""
    if not sizes:
        return None
    counts = Counter(int(s) for s in sizes)
    xs = sorted(counts)
    lo, hi = min(k, xs[0]) - 1, xs[-1] + 1
    width = min(960.0, max(500.0, 45 * (hi - lo) + 250))
    svg = _Svg()
    top = svg.legend([("bar", _BLUE, "clusters of that size"), ("dash", _RED, f"k = {k} (smallest allowed size)")],
                     width) + 6
    yticks = _nice_ticks(max(counts.values()), integer=True, most=5)
    left = _PAD + max(_text_width(_fmt(t)) for t in yticks) + 30
    right, bottom = width - _PAD - 8, top + 220

    def sx(v: float) -> float:
        return left + (right - left) * (v - lo) / (hi - lo)

    def sy(v: float) -> float:
        return bottom - (bottom - top) * v / yticks[-1]

    svg.parts.append('<g class="grid">')
    for t in yticks:
        svg.line(left, sy(t), right, sy(t), _GRID, 0.8)
        svg.text(left - 8, sy(t), _fmt(t), anchor="end")
    svg.parts.append("</g>")
    step = max(1, math.ceil((hi - lo) / 15))
    for x in range(lo, hi + 1, step):
        svg.text(sx(x), bottom + 12, str(x), anchor="middle")
    svg.line(left, bottom, right, bottom, _INK, 1.0)
    svg.text((left + right) / 2, bottom + 36, "records per cluster", anchor="middle")
    svg.parts.append(f'<text x="{_PAD + 4:.1f}" y="{(top + bottom) / 2:.1f}" font-size="{FONT_PX}" '
                     f'text-anchor="middle" dominant-baseline="hanging" fill="{_INK}" '
                     f'transform="rotate(-90 {_PAD + 4:.1f} {(top + bottom) / 2:.1f})">clusters</text>')
    bar = 0.7 * (sx(1) - sx(0))
    for x in xs:
        svg.rect(sx(x) - bar / 2, sy(counts[x]), bar, bottom - sy(counts[x]), _BLUE, cls="bar")
    # At k itself: a cluster of exactly k records is allowed, anything left of the line is not.
    svg.line(sx(k), top, sx(k), bottom, _RED, 1.4, dash=True, cls="vline")
    return svg.done(width, bottom + _AXIS, "histogram of cluster sizes with the minimum size k")
