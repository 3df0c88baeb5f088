"""The shell shared by deid's offline HTML pages: escaping, URL removal, tables, inline CSS, the document.

Every page deid writes (report.html, the validation page, the catalogue) is self-contained: inline
CSS, images as data URIs, a Content-Security-Policy that forbids fetching anything, and no
``http://``/``https://`` text at all (:func:`deid.urls.strip_urls`), so it renders offline years later and
cannot leak that it was opened.
"""
from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from typing import Any

from deid.urls import strip_urls  # re-exported: the pages' URL rule is the card's too

__all__ = ["CSS", "document", "esc", "fmt", "round_numbers", "strip_urls", "table"]

# A decimal number with 3 or more decimals, not part of a version string, identifier or range.
_LONG_DECIMAL = re.compile(r"(?<![\w.])([-+]?\d+\.\d{3,})(?![\w]|\.\d)")

CSS = """
:root { --ok: #1b7f3b; --bad: #b3261e; --warn: #8a5300; --muted: #5f6368; --line: #dadce0; }
* { box-sizing: border-box; }
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 0 auto;
       max-width: 1100px; padding: 1.5rem; color: #202124; line-height: 1.45; font-size: 16px; }
h1 { margin: .4rem 0 .25rem 0; font-size: 1.6rem; }
h2 { border-bottom: 1px solid var(--line); padding-bottom: .2rem; margin-top: 2.2rem; font-size: 1.25rem; }
h3 { font-size: 1.05rem; margin: 1.2rem 0 .4rem 0; }
.verdict { display: inline-block; padding: .3rem .8rem; border-radius: .3rem; color: #fff; font-weight: 700;
           letter-spacing: .05em; font-size: 1.1rem; }
.verdict.released { background: var(--ok); } .verdict.rejected { background: var(--bad); }
.guarantee { border-left: 4px solid var(--ok); background: #e6f4ea; padding: .6rem 1rem; margin: .8rem 0; }
.guarantee.none { border-color: var(--warn); background: #fef7e0; }
.guarantee.nothing { border-color: var(--bad); background: #f1f3f4; }
.summary { display: flex; flex-wrap: wrap; gap: 1.2rem 2rem; margin: 1rem 0; }
.summary div { min-width: 8rem; } .summary b { display: block; font-size: 1.35rem; }
.muted { color: var(--muted); font-size: .92rem; }
table { border-collapse: collapse; width: 100%; margin: .5rem 0; font-size: .92rem; }
th, td { border: 1px solid var(--line); padding: .3rem .5rem; text-align: left; vertical-align: top; }
th { background: #f1f3f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.nowrap, span.nowrap { white-space: nowrap; }
table.kv td:first-child { width: 30%; }
.pass { color: var(--ok); font-weight: 700; } .fail { color: var(--bad); font-weight: 700; }
.inconclusive { color: var(--warn); font-weight: 700; } .na { color: var(--muted); }
.reasons { background: #fce8e6; border-left: 4px solid var(--bad); padding: .5rem 1rem; margin: .8rem 0; }
.reasons.warnings { background: #fef7e0; border-color: var(--warn); }
.reasons li { margin: .35rem 0; }
.reasons .detail { display: block; color: var(--muted); font-size: .9rem; }
.chart { max-width: 100%; height: auto; display: block; margin: .6rem 0; }
.faces { display: flex; flex-wrap: wrap; gap: 4px; }
.faces img { width: 81px; image-rendering: pixelated; border: 1px solid var(--line); }
pre { background: #f8f9fa; border: 1px solid var(--line); padding: .6rem; overflow-x: auto; font-size: .85rem; }
code { background: #f1f3f4; padding: 0 .2rem; font-size: .88em; }
small.code { display: block; color: var(--muted); }
details summary { cursor: pointer; color: var(--muted); }
.note { border-left: 4px solid var(--line); padding: .3rem 1rem; background: #f8f9fa; }
dl { margin: .4rem 0; } dt { margin-top: .3rem; } dd { margin-left: 1.5rem; color: #3c4043; }
nav.back { margin-bottom: .6rem; }
"""


def esc(value: Any) -> str:
    """HTML-escaped text of any value (None as an em dash)."""
    if value is None:
        return "&mdash;"
    return html.escape(str(value), quote=True)


def round_numbers(text: str, digits: int = 3) -> str:
    """``text`` with every long decimal (3+ decimals) rounded to ``digits`` decimals, for reading.

    Gate details carry full-precision floats (``0.8216666666666667``); the page shows them rounded,
    report.json keeps them exact.
    """
    def short(m: re.Match) -> str:
        sign = "+" if m.group(1).startswith("+") else ""  # an explicit "+" (a signed difference) stays
        return f"{sign}{float(m.group(1)):.{digits}f}"

    return _LONG_DECIMAL.sub(short, text)


def fmt(value: Any) -> str:
    """Compact human text of a value: floats to 4 significant digits, lists comma-separated."""
    if value is None:
        return "\u2014"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int | str):
        return str(value)
    if isinstance(value, list | tuple):
        return ", ".join(fmt(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {fmt(v)}" for k, v in value.items()) if value else "none"
    return json.dumps(value, sort_keys=True, default=str)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], num: Sequence[int] = (), cls: str = "") -> str:
    """An HTML table; cells are already-escaped HTML; columns in ``num`` are right-aligned numbers."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if i in num else f"<td>{c}</td>" for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def document(title: str, body: str, *, viewport: bool = True) -> str:
    """A complete offline HTML document: inline CSS, a CSP that forbids every fetch, URLs removed."""
    doc = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        + ("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">" if viewport else "")
        # Belt and braces: even if a URL slipped through, the browser may not fetch anything.
        + "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
        "style-src 'unsafe-inline'\">"
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        + body
        + "</body></html>\n"
    )
    return strip_urls(doc)
