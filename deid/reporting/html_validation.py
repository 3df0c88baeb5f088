"""The offline data-validation page (``reports/<id>/validation/``) and its summary table in report.html.

Both render :class:`deid.evaluation.validation.SuiteResult`, the one shape :func:`deid.evaluation.validation.run_suite`
builds from Great Expectations' result objects and report.json stores. GX's own Data Docs load
Bootstrap, jQuery, Vega and Font Awesome from CDNs and GX 1.24 does not ship those assets, so they
cannot be made offline by rewriting links; this page shows the same results with inline CSS only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deid.reporting.html_page import document, esc, fmt, table
from deid.evaluation.validation import ExpectationResult, SuiteResult, suite_results

__all__ = ["VALIDATION_HTML", "VALIDATION_JSON", "build_offline_data_docs", "render_validation_html",
           "validation_summary_table"]

VALIDATION_JSON = "validation_results.json"
VALIDATION_HTML = "index.html"

# What each table is, for a reader who did not write the flow.
_TABLES = {
    "manifest": "the drop's manifest.csv, as the steward wrote it",
    "ingested": "the staged originals (one row per readable image)",
    "aligned": "the aligned faces",
    "release": "the release table (release.parquet)",
    "feature_table": "the feature drop's table, as the steward wrote it",
    "feature_ingested": "the staged feature records (one row per usable record)",
    "feature_release": "the feature release table (release.parquet)",
}


def _result(ok: bool) -> str:
    return '<span class="pass">pass</span>' if ok else '<span class="fail">FAIL</span>'


def validation_summary_table(suites: list[SuiteResult], *, href: str | None = None) -> str:
    """One row per suite: result and the counts of evaluated, passed and failed expectations."""
    if not suites:
        return "<p class='muted'>No validation results.</p>"
    rows = []
    for s in suites:
        name = f'<a href="{esc(href)}#{esc(s.suite)}">{esc(s.suite)}</a>' if href is not None else esc(s.suite)
        rows.append([name, esc(_TABLES.get(s.suite, "")), _result(s.success), str(s.evaluated), str(s.passed),
                     str(s.failed)])
    return table(["suite", "table", "result", "evaluated", "passed", "failed"], rows, num=(3, 4, 5))


def _arguments(e: ExpectationResult) -> str:
    if not e.kwargs:
        return "<span class='muted'>none</span>"
    return "<br>".join(f"<code>{esc(k)}</code> = {esc(fmt(v))}" for k, v in e.kwargs.items())


def _expectation_rows(s: SuiteResult) -> list[list[str]]:
    return [[
        _result(e.success),
        f"<code>{esc(e.type)}</code>" + (f"<small class='code'>{esc(e.why)}</small>" if e.why else ""),
        _arguments(e),
        esc(e.observed_text()),
    ] for e in s.expectations]


def render_validation_html(results: Any, *, title: str = "Data validation results", run: str | None = None,
                           back_href: str | None = None) -> str:
    """Offline HTML of the run's validation: per suite, every expectation with its arguments, observation, result.

    ``results``: anything :func:`deid.evaluation.validation.suite_results` accepts (the flow's mapping table ->
    SuiteResult, report.json's ``validation``, GX result objects). ``run``: which run this is (dataset, k,
    method, release id, verdict), in the page's title and under its heading, so a page opened on its own
    says whose it is; ``back_href``: a link back to the run's report.html (relative: the page stays offline).
    """
    suites = suite_results(results)
    if run:
        title = f"{title}: {run}"
    parts = [f"<nav class='back'><a href=\"{esc(back_href)}\">&larr; back to the run's report.html</a></nav>"
             if back_href else "",
             f"<h1>{esc(title)}</h1>",
             "<p class='muted'>Great Expectations suites run on each table of the run; every expectation "
             "is listed with its arguments, what was observed and whether it passed.</p>",
             validation_summary_table(suites, href="")]
    for s in suites:
        parts.append(f'<h2 id="{esc(s.suite)}">{esc(s.suite)} {_result(s.success)}</h2>')
        about = _TABLES.get(s.suite)
        parts.append(f"<p class='muted'>{esc(about[0].upper() + about[1:]) + '. ' if about else ''}{s.passed} of {s.evaluated} "
                     f"expectations passed" + (f"; Great Expectations {esc(s.gx_version)}" if s.gx_version else "")
                     + ".</p>")
        parts.append(table(["result", "expectation", "arguments", "observed"], _expectation_rows(s))
                     if s.expectations else "<p class='muted'>no expectations</p>")
    return document(title, "".join(parts), viewport=False)


def build_offline_data_docs(validation_results: Any, out_dir: Path, *, run: str | None = None,
                            back_href: str | None = None) -> list[Path]:
    """Write the run's validation results for offline reading: ``validation_results.json`` and ``index.html``.

    Returns the written paths. The JSON is one :meth:`SuiteResult.to_dict` per suite (what
    report.json's ``validation`` holds); the HTML is :func:`render_validation_html` (with ``run`` and
    ``back_href``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suites = suite_results(validation_results)
    json_path = out_dir / VALIDATION_JSON
    json_path.write_text(json.dumps([s.to_dict() for s in suites], indent=2, sort_keys=True, default=str) + "\n",
                         encoding="utf-8")
    html_path = out_dir / VALIDATION_HTML
    html_path.write_text(render_validation_html(suites, run=run, back_href=back_href), encoding="utf-8")
    return [json_path, html_path]
