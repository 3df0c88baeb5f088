"""The charts of report.html, drawn with matplotlib and embedded as PNG data URIs.

Readable at 100% zoom: every figure is drawn at most :data:`MAX_WIDTH_PX` CSS pixels wide (the
page's content width), so the browser never scales it down, with text at :data:`FONT_PT` points
(>= 13 CSS px); it is rendered at twice that resolution for sharp text on high-density screens and
displayed at its CSS size through the ``width`` attribute. Legends sit above the axes, never over
bars. PNG rather than SVG because matplotlib's SVG carries XML namespace URLs, and the page holds
no URL at all.
"""
from __future__ import annotations

import io
import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FONT_PT", "MAX_WIDTH_PX", "Chart", "cluster_chart", "partition_chart", "partition_name", "reid_chart",
           "utility_chart"]

FONT_PT = 10.0  # tick, label and legend text; 10 pt at 100 CSS px per inch is 13.9 px
MAX_WIDTH_PX = 1000  # the report's content column is 1052 px wide (1100 px minus padding)
_DPI = 100  # CSS pixels per inch: a figure of w inches is displayed w * 100 px wide
_SCALE = 2  # rendered pixels per CSS pixel
_BLUE, _RED, _GREY, _AMBER, _INK = "#1a73e8", "#b3261e", "#9aa0a6", "#f9ab00", "#202124"


@dataclass(frozen=True)
class Chart:
    """A rendered chart: PNG bytes and the CSS size it is meant to be displayed at."""

    png: bytes
    width: int
    height: int
    alt: str


def _pyplot():
    import matplotlib  # noqa: PLC0415 - ~0.5 s; only needed when a report is rendered

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _style() -> dict[str, Any]:
    return {"font.size": FONT_PT, "axes.labelsize": FONT_PT, "xtick.labelsize": FONT_PT,
            "ytick.labelsize": FONT_PT, "legend.fontsize": FONT_PT, "axes.titlesize": FONT_PT + 1,
            "axes.spines.top": False, "axes.spines.right": False}


def _png_size(png: bytes) -> tuple[int, int]:
    # The IHDR chunk: width and height are the big-endian uint32s at bytes 16..24.
    return struct.unpack(">II", png[16:24])


def _render(fig, alt: str) -> Chart:
    plt = _pyplot()
    buf = io.BytesIO()
    # No Software metadata: it carries matplotlib's homepage URL.
    # The figure keeps its size (constrained layout fits labels and legend inside it), so the
    # displayed width is the width the text was drawn for.
    fig.savefig(buf, format="png", dpi=_DPI * _SCALE, metadata={"Software": None})
    plt.close(fig)
    png = buf.getvalue()
    w, h = _png_size(png)
    return Chart(png, round(w / _SCALE), round(h / _SCALE), alt)


def _figure(width_in: float, height_in: float):
    # Called inside plt.rc_context(_style()): the figure's text takes its sizes from there.
    fig, ax = _pyplot().subplots(figsize=(width_in, height_in), dpi=_DPI, layout="constrained")
    ax.tick_params(labelsize=FONT_PT)
    return fig, ax


def _legend_above(ax, ncol: int) -> None:
    # Above the axes, outside them: a legend inside would cover bars.
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=ncol, frameon=False, fontsize=FONT_PT,
              borderaxespad=0.2, handlelength=1.6, columnspacing=1.4)


def _hbar_height(n_rows: int) -> float:
    return 0.75 + 0.3 * n_rows


def partition_name(key: Any) -> str:
    """A partition's label values as text: ``["female", "neutral"]`` -> ``female / neutral``."""
    if isinstance(key, list | tuple):
        return " / ".join(str(v) for v in key) if key else "all records"
    return str(key)


def reid_chart(reid: Sequence[Mapping[str, Any]], bound: float) -> Chart | None:
    """Re-identification rate per attacker and mode (horizontal bars), its confidence interval and 1/k."""
    if not reid:
        return None
    plt = _pyplot()
    with plt.rc_context(_style()):
        n = len(reid)
        fig, ax = _figure(9.6, _hbar_height(n) + 0.3)
        y = np.arange(n)[::-1]
        rates = np.array([float(r["rate"]) for r in reid])
        over = rates > bound + 1e-12
        ax.barh(y[~over], rates[~over], color=_BLUE, height=0.7, label="rate \u2264 1/k")
        if over.any():
            ax.barh(y[over], rates[over], color=_RED, height=0.7, label="rate > 1/k")
        with_iv = [i for i, r in enumerate(reid) if r.get("lower") is not None and r.get("upper") is not None]
        if with_iv:
            lo = np.array([rates[i] - float(reid[i]["lower"]) for i in with_iv]).clip(0)
            hi = np.array([float(reid[i]["upper"]) - rates[i] for i in with_iv]).clip(0)
            ax.errorbar(rates[with_iv], y[with_iv], xerr=[lo, hi], fmt="none", ecolor=_INK, elinewidth=1,
                        capsize=3, label="confidence interval")
        ax.axvline(bound, color=_INK, linestyle="--", linewidth=1.4, label=f"1/k = {bound:.2f}")
        ax.set_yticks(y, [f"{r['attacker']} \u00b7 {r['mode']}" for r in reid])
        ax.set_ylim(-0.6, n - 0.4)
        top = max([bound, *rates, *[float(reid[i]["upper"]) for i in with_iv]])
        ax.set_xlim(0, min(1.0, top * 1.08) if top > 0 else 1.0)
        ax.set_xlabel("re-identification rate (share of probes matched to the right person)")
        ax.grid(axis="x", color="#e8eaed", linewidth=0.8)
        ax.set_axisbelow(True)
        _legend_above(ax, ncol=4)
        return _render(fig, "re-identification rate per attacker and mode, with confidence intervals and the 1/k bound")


def _utility_name(u: Mapping[str, Any]) -> str:
    return f"{u['label']} \u00b7 {u['protocol']}" if u.get("protocol") else str(u["label"])


def utility_chart(utility: Sequence[Mapping[str, Any]]) -> Chart | None:
    """Classifier accuracy per label and protocol: on the originals vs on the release."""
    rows = [u for u in utility if u.get("original_accuracy") is not None or u.get("deidentified_accuracy") is not None]
    if not rows:
        return None
    plt = _pyplot()
    with plt.rc_context(_style()):
        n = len(rows)
        fig, ax = _figure(9.6, 0.75 + 0.42 * n)
        y = np.arange(n)[::-1].astype(float)
        orig = [u.get("original_accuracy") or 0.0 for u in rows]
        rel = [u.get("deidentified_accuracy") or 0.0 for u in rows]
        ax.barh(y + 0.19, orig, height=0.38, color=_GREY, label="originals")
        ax.barh(y - 0.19, rel, height=0.38, color=_BLUE, label="release")
        ax.set_yticks(y, [_utility_name(u) for u in rows])
        ax.set_ylim(-0.6, n - 0.4)
        ax.set_xlim(0, 1.0)
        ax.set_xlabel("classifier accuracy")
        ax.grid(axis="x", color="#e8eaed", linewidth=0.8)
        ax.set_axisbelow(True)
        _legend_above(ax, ncol=2)
        return _render(fig, "classifier accuracy per label and protocol, originals vs release")


def partition_chart(partitions: Sequence[Mapping[str, Any]], k: int) -> Chart | None:
    """Records and distinct people per label partition, with the k people every partition needs."""
    if not partitions:
        return None
    plt = _pyplot()
    with plt.rc_context(_style()):
        n = len(partitions)
        fig, ax = _figure(8.0, 0.75 + 0.42 * n)
        y = np.arange(n)[::-1].astype(float)
        ax.barh(y + 0.19, [p.get("records", 0) for p in partitions], height=0.38, color=_BLUE, label="records")
        ax.barh(y - 0.19, [p.get("people", 0) for p in partitions], height=0.38, color=_AMBER, label="people")
        ax.axvline(k, color=_RED, linestyle="--", linewidth=1.4, label=f"k = {k} people needed")
        ax.set_yticks(y, [partition_name(p.get("key", i)) for i, p in enumerate(partitions)])
        ax.set_ylim(-0.6, n - 0.4)
        ax.set_xlabel("count")
        ax.grid(axis="x", color="#e8eaed", linewidth=0.8)
        ax.set_axisbelow(True)
        _legend_above(ax, ncol=3)
        return _render(fig, "records and people per partition, with the k people a partition needs")


def cluster_chart(sizes: Sequence[int], k: int) -> Chart | None:
    """Histogram of cluster sizes (records per cluster) with the minimum k drawn at k."""
    if not sizes:
        return None
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    plt = _pyplot()
    with plt.rc_context(_style()):
        counts = Counter(int(s) for s in sizes)
        xs = sorted(counts)
        lo, hi = min(k, xs[0]) - 1, xs[-1] + 1
        fig, ax = _figure(min(9.6, max(5.0, 0.45 * (hi - lo) + 2.5)), 3.2)
        ax.bar(xs, [counts[s] for s in xs], color=_BLUE, width=0.7, label="clusters of that size")
        # At k itself: a cluster of exactly k records is allowed, anything left of the line is not.
        ax.axvline(k, color=_RED, linestyle="--", linewidth=1.4, label=f"k = {k} (smallest allowed size)", zorder=3)
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("records per cluster")
        ax.set_ylabel("clusters")
        ax.grid(axis="y", color="#e8eaed", linewidth=0.8)
        ax.set_axisbelow(True)
        _legend_above(ax, ncol=2)
        return _render(fig, "histogram of cluster sizes with the minimum size k")
