"""The catalogue's views: ``deid releases``' table and ``reports/index.html``, from each run's verdict summary.

:mod:`deid.release.catalogue` reads the reports directory; here each run is shown by its verdict
summary (:func:`deid.reporting.verdict.verdict_summary`), the one summary the CLI, the Prefect
verdict artifact and report.html show, so the catalogue says the same thing in the same words: the
verdict, the guarantee that holds or "none: nothing released", why (root cause first), warnings,
the key figures rounded with their intervals, and where report.html is. What only the catalogue
knows is added to it: a report without a signature, and a signed addendum saying a release was
not published after all (its guarantee then holds for nothing: "none: nothing released").

``index.html`` is self-contained (:func:`deid.reporting.html_page.document`: inline CSS, no external
reference, the Content-Security-Policy of report.html) and links each run's ``report.html``
relatively, so it works opened from a disk or a file share, or served by ``deid server``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from deid.release import catalogue as _catalogue
from deid.release.catalogue import INDEX_HTML, CatalogueEntry
from deid.reporting.html_page import document, esc
from deid.reporting.html_report import summary_html
from deid.reporting.verdict import NOTHING_RELEASED, VerdictSummary, verdict_summary

__all__ = ["catalogue_text", "read_catalogue", "render_index_html", "write_index"]

logger = logging.getLogger(__name__)


def _summarise(report: dict[str, Any], report_html: Path | None) -> VerdictSummary:
    return verdict_summary(report, report_html=report_html)


def read_catalogue(reports_dir: str | os.PathLike) -> list[CatalogueEntry]:
    """:func:`deid.release.catalogue.read_catalogue` with each readable run's verdict summary as ``summary``.

    A run signed ``released`` whose signed addendum says it was not published gets the guarantee
    "none: nothing released" (with the addendum's word), as a rejection does.

    Raises
    ------
    deid.errors.ConfigError
        When ``reports_dir`` is not a directory.
    """
    entries = _catalogue.read_catalogue(reports_dir, summarise=_summarise)
    out = []
    for e in entries:
        if isinstance(e.summary, VerdictSummary) and e.status and e.status.startswith("not published"):
            e = dataclasses.replace(e, summary=dataclasses.replace(e.summary, guarantee=f"{NOTHING_RELEASED} ({e.status})"))
        out.append(e)
    return out


def _headline(e: CatalogueEntry) -> str:
    head = e.summary.headline if isinstance(e.summary, VerdictSummary) else e.verdict.upper()
    return head + (f" - {e.status}" if e.status else "")


def catalogue_text(entries: list[CatalogueEntry]) -> str:
    """A plain-text table of the catalogue (one block per run, its verdict summary indented), for ``deid releases``."""
    if not entries:
        return "no reports\n"
    lines = []
    for e in entries:
        lines.append(f"{e.release_id}  {_headline(e)}")
        lines.append(f"  dataset {e.dataset or '-'}; date {e.created_at or '-'}; k {e.k if e.k is not None else '-'}; "
                     f"method {e.method or '-'}")
        if isinstance(e.summary, VerdictSummary):
            # The verdict is in the first line; the terms would repeat for every run (report.html has them).
            lines += [f"  {line}" for line in e.summary.text_lines(terms=False)[1:]]
        if e.report_html is None:
            lines.append(f"  report: {e.report_path} (no report.html)")
    released = sum(e.verdict == "released" and e.status is None for e in entries)
    lines.append(f"{len(entries)} runs: {released} released, {len(entries) - released} rejected, unpublished, unsigned "
                 "or unreadable")
    return "\n".join(lines) + "\n"


def render_index_html(entries: list[CatalogueEntry], *, reports_dir: Path) -> str:
    """The catalogue page: links are relative to ``reports_dir``, so the directory can be moved or copied."""
    rows = []
    for x in entries:
        if x.report_html is not None:
            href = x.report_html.relative_to(reports_dir).as_posix()
            link = f"<a href=\"{esc(href)}\">report.html</a>"
        else:
            link = "<span class=\"muted\">no report.html</span>"
        head = x.summary.headline if isinstance(x.summary, VerdictSummary) else x.verdict.upper()
        # Green only for a signed release that was published; unsigned, unpublished or unreadable: red.
        cls = "released" if x.verdict == "released" and not x.status else "rejected"
        verdict = f"<span class=\"verdict {cls}\">{esc(head)}</span>"
        if x.status:
            verdict += f"<br><span class=\"muted\">{esc(x.status)}</span>"
        summary = summary_html(x.summary, figures=True, fold_warnings=True) if isinstance(x.summary, VerdictSummary) else ""
        # The date and the release id on one line each (the narrow columns broke them at their hyphens).
        date = esc(x.created_at.replace("T", " ").replace("Z", " UTC") if x.created_at else None)
        rows.append(
            f"<tr><td><span class=\"nowrap\">{date}</span><br><b>{esc(x.dataset)}</b><br>k = {esc(x.k)}, "
            f"{esc(x.method)}</td><td>{verdict}</td><td>{summary}</td>"
            f"<td class=\"nowrap\">{link}<br><span class=\"muted\">{esc(x.release_id)}</span></td></tr>")
    released = sum(x.verdict == "released" and x.status is None for x in entries)
    body = (f"<h1>deid releases</h1><p class=\"muted\">{len(entries)} runs, {released} released, newest first. Each "
            "row is the run's verdict summary (as <code>deid run</code>, the Prefect UI and report.html state it) "
            "and links its signed report; check a release with "
            "<code>deid verify RELEASE_DIR --public-key KEY</code>.</p>"
            "<table class=\"catalogue\"><thead><tr><th>run (date, dataset, k, method)</th><th>verdict</th>"
            "<th>guarantee, why, key figures</th><th>report</th></tr></thead><tbody>" + "".join(rows)
            + "</tbody></table>")
    return document("deid releases", body)


def write_index(reports_dir: str | os.PathLike, entries: list[CatalogueEntry] | None = None) -> Path:
    """Write ``reports_dir/index.html`` atomically (a reader never sees half a page); return its path."""
    root = Path(reports_dir)
    entries = read_catalogue(root) if entries is None else entries
    out = root / INDEX_HTML
    tmp = root / f".{INDEX_HTML}.tmp"
    tmp.write_text(render_index_html(entries, reports_dir=root), encoding="utf-8")
    os.replace(tmp, out)
    logger.info("catalogue: %d runs in %s", len(entries), out)
    return out
