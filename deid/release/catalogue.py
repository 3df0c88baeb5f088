"""The catalogue of releases: every signed report of a reports directory, as a table and a static page.

``deid releases`` lists each run (released or rejected) with its dataset, date, k, method,
verdict and key figures, read from ``reports/<release_id>/report.json``; and writes
``reports/index.html``, a self-contained page (inline CSS, no external reference, the same
Content-Security-Policy as report.html) that links each run's ``report.html``, so it works
opened from a disk or a file share. The catalogue reads reports only: it never checks a
signature (``deid verify`` does) and says when a report is unsigned, unreadable or annulled by
a signed addendum (a run signed "released" that was not published after all).
"""
from __future__ import annotations

import html
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deid.errors import ConfigError
from deid.reporting.html_report import strip_urls

logger = logging.getLogger(__name__)

INDEX_HTML = "index.html"
_REPORT = "report.json"
_SIGNATURE = "report.json.sig"
_ADDENDUM = "addendum.json"
_REPORT_HTML = "report.html"


@dataclass(frozen=True)
class UtilityFigure:
    """One label's utility as the gate decided it: accuracies on originals and on the release, the
    difference's confidence bounds (originals minus release), the test images, the decision."""

    label: str
    original_accuracy: float | None
    deidentified_accuracy: float | None
    delta_lower: float | None
    delta_upper: float | None
    n_test: int | None
    status: str | None


@dataclass(frozen=True)
class KeyFigures:
    """The figures a reader compares across releases, taken from one signed report.

    ``worst_attack`` is the attack whose upper confidence bound on the re-identification rate is
    highest (the one the gate's decision hinges on), with that interval and its probe count.
    """

    records_in: int | None
    records_released: int | None
    max_rate: float | None
    bound: float | None
    worst_attack: str | None
    worst_rate: float | None
    worst_lower: float | None
    worst_upper: float | None
    worst_probes: int | None
    min_people: int | None
    utility: tuple[UtilityFigure, ...]


@dataclass(frozen=True)
class CatalogueEntry:
    """One run of the reports directory. ``verdict`` is the report's, or ``unreadable``.

    ``status`` says what a reader must know beyond the verdict: ``"unsigned"``, ``"not published
    (signed addendum: <event>)"``, or the reason the report could not be read; None when none.
    """

    release_id: str
    dataset: str | None
    created_at: str | None
    k: int | None
    method: str | None
    verdict: str
    figures: KeyFigures | None
    reasons: tuple[str, ...]
    report_path: Path
    report_html: Path | None
    status: str | None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def key_figures(report: dict[str, Any]) -> KeyFigures:
    """The :class:`KeyFigures` of a report dict (missing fields become None, never an error)."""
    ds = report.get("dataset") or {}
    priv = report.get("privacy") or {}
    # A rate from too few distinct probes (status insufficient_evidence) is never the worst attack shown.
    attacks = [a for a in priv.get("reidentification") or []
               if isinstance(a, dict) and a.get("status") != "insufficient_evidence"]
    # The worst attack by its upper bound (the gate decides from bounds), then by its rate.
    worst = max(attacks, key=lambda a: (_num(a.get("upper")) or 0.0, _num(a.get("rate")) or 0.0), default=None)
    utility = tuple(
        UtilityFigure(str(u.get("label")), _num(u.get("original_accuracy")), _num(u.get("deidentified_accuracy")),
                      _num(u.get("delta_lower")), _num(u.get("delta_upper")), _int(u.get("n_test_images")),
                      u.get("status") if isinstance(u.get("status"), str) else None)
        for u in _headline_utility(report))
    name = None
    if worst is not None:
        name = str(worst.get("attacker")) + (f" ({worst['mode']})" if worst.get("mode") else "")
    return KeyFigures(
        records_in=_int(ds.get("records_in")), records_released=_int(ds.get("records_released")),
        max_rate=_num(priv.get("max_rate")), bound=_num(priv.get("bound")), worst_attack=name,
        worst_rate=_num(worst.get("rate")) if worst else None, worst_lower=_num(worst.get("lower")) if worst else None,
        worst_upper=_num(worst.get("upper")) if worst else None,
        worst_probes=_int(worst.get("n_probes")) if worst else None,
        min_people=_int(priv.get("min_distinct_people_per_cluster")), utility=utility)


def _headline_utility(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per label, the utility entry of the protocol the gate decided by (the report lists others beside it)."""
    entries = [u for u in report.get("utility") or [] if isinstance(u, dict)]
    protocol = (report.get("configuration") or {}).get("utility_protocol")
    out: dict[str, dict[str, Any]] = {}
    for u in entries:
        label = str(u.get("label"))
        if label not in out or (u.get("protocol") == protocol and out[label].get("protocol") != protocol):
            out[label] = u
    return list(out.values())


def _entry(report_dir: Path) -> CatalogueEntry:
    path = report_dir / _REPORT
    page = report_dir / _REPORT_HTML
    page = page if page.is_file() else None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(report, dict):
            raise ValueError(f"a JSON {type(report).__name__}, not an object")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return CatalogueEntry(report_dir.name, None, None, None, None, "unreadable", None, (), path, page,
                              f"report.json could not be read: {exc}")
    status = None if (report_dir / _SIGNATURE).is_file() else "unsigned"
    try:
        addendum = json.loads((report_dir / _ADDENDUM).read_text(encoding="utf-8"))
    except FileNotFoundError:
        addendum = None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        addendum = {"event": f"unreadable addendum ({exc})"}
    if isinstance(addendum, dict) and addendum.get("release_published") is not True:
        status = f"not published (signed addendum: {addendum.get('event', 'unknown event')})"
    ds = report.get("dataset") or {}
    return CatalogueEntry(
        release_id=str(report.get("release_id") or report_dir.name),
        dataset=ds.get("name") if isinstance(ds.get("name"), str) else None,
        created_at=report.get("created_at") if isinstance(report.get("created_at"), str) else None,
        k=_int(report.get("k")), method=report.get("method") if isinstance(report.get("method"), str) else None,
        verdict=str(report.get("verdict") or "unknown"), figures=key_figures(report),
        reasons=tuple(str(r) for r in report.get("reasons") or []), report_path=path, report_html=page, status=status)


def read_catalogue(reports_dir: str | os.PathLike) -> list[CatalogueEntry]:
    """Every run under ``reports_dir`` (one ``<release_id>/report.json`` each), newest first.

    Raises
    ------
    ConfigError
        When ``reports_dir`` is not a directory.
    """
    root = Path(reports_dir)
    if not root.is_dir():
        raise ConfigError(f"reports_dir={str(root)!r} is not a directory; pass the reports directory "
                          "(the DEID_REPORTS_DIR setting, default reports/)")
    entries = [_entry(d) for d in sorted(root.iterdir())
               if d.is_dir() and not d.is_symlink() and (d / _REPORT).is_file()]
    # Newest first; runs without a date (unreadable reports) last, by id.
    entries.sort(key=lambda e: (e.created_at is not None, e.created_at or "", e.release_id), reverse=True)
    return entries


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def figures_text(fig: KeyFigures | None) -> str:
    """The key figures in one line of plain text (for the terminal table and the page)."""
    if fig is None:
        return "-"
    parts = [f"{fig.records_released if fig.records_released is not None else '-'}/"
             f"{fig.records_in if fig.records_in is not None else '-'} records released"]
    if fig.max_rate is not None or fig.bound is not None:
        parts.append(f"max re-id rate {_f(fig.max_rate)} (bound 1/k {_f(fig.bound)})")
    if fig.worst_attack is not None:
        parts.append(f"worst attack {fig.worst_attack} {_f(fig.worst_rate)} "
                     f"[{_f(fig.worst_lower)}, {_f(fig.worst_upper)}] n={fig.worst_probes}")
    if fig.min_people is not None:
        parts.append(f"min people/cluster {fig.min_people}")
    parts += [f"utility {u.label} {_f(u.original_accuracy)} -> {_f(u.deidentified_accuracy)}"
              + (f" (delta [{_f(u.delta_lower)}, {_f(u.delta_upper)}] n={u.n_test})" if u.delta_lower is not None else "")
              + (f" {u.status}" if u.status else "") for u in fig.utility]
    return "; ".join(parts)


def catalogue_text(entries: list[CatalogueEntry]) -> str:
    """A plain-text table of the catalogue (one block per run), for ``deid releases``."""
    if not entries:
        return "no reports\n"
    lines = []
    for e in entries:
        verdict = e.verdict.upper() + (f" - {e.status}" if e.status else "")
        lines.append(f"{e.release_id}  {verdict}")
        lines.append(f"  dataset {e.dataset or '-'}; date {e.created_at or '-'}; k {e.k if e.k is not None else '-'}; "
                     f"method {e.method or '-'}")
        lines.append(f"  {figures_text(e.figures)}")
        lines += [f"  reason: {r}" for r in e.reasons]
        lines.append(f"  report {e.report_path}")
    released = sum(e.verdict == "released" and e.status is None for e in entries)
    lines.append(f"{len(entries)} runs: {released} released, {len(entries) - released} rejected, unpublished, unsigned "
                 "or unreadable")
    return "\n".join(lines) + "\n"


_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 0 auto;
       max-width: 1200px; padding: 1.5rem; color: #202124; line-height: 1.4; }
table { border-collapse: collapse; width: 100%; font-size: .9rem; }
th, td { border: 1px solid #dadce0; padding: .3rem .5rem; text-align: left; vertical-align: top; }
th { background: #f1f3f4; }
.released { color: #1b7f3b; font-weight: 700; } .rejected, .unreadable { color: #b3261e; font-weight: 700; }
.muted { color: #5f6368; font-size: .85rem; }
"""


def render_index_html(entries: list[CatalogueEntry], *, reports_dir: Path) -> str:
    """The catalogue page: links are relative to ``reports_dir``, so the directory can be moved or copied."""
    def e(value: Any) -> str:
        return "-" if value is None else html.escape(str(value), quote=True)

    rows = []
    for x in entries:
        if x.report_html is not None:
            href = x.report_html.relative_to(reports_dir).as_posix()
            link = f"<a href=\"{e(href)}\">report.html</a>"
        else:
            link = "<span class=\"muted\">no report.html</span>"
        status = f"<br><span class=\"muted\">{e(x.status)}</span>" if x.status else ""
        reasons = "".join(f"<br><span class=\"muted\">{e(r)}</span>" for r in x.reasons)
        rows.append(
            f"<tr><td>{e(x.created_at)}</td><td>{e(x.dataset)}</td><td>{e(x.k)}</td><td>{e(x.method)}</td>"
            f"<td class=\"{e(x.verdict)}\">{e(x.verdict)}{status}</td><td>{e(figures_text(x.figures))}{reasons}</td>"
            f"<td>{link}<br><span class=\"muted\">{e(x.release_id)}</span></td></tr>")
    released = sum(x.verdict == "released" and x.status is None for x in entries)
    body = (f"<h1>deid releases</h1><p class=\"muted\">{len(entries)} runs, {released} released. Each row links "
            "the run's signed report; check a release with <code>deid verify REPORT_DIR --public-key KEY</code>.</p>"
            "<table><thead><tr><th>date (UTC)</th><th>dataset</th><th>k</th><th>method</th><th>verdict</th>"
            "<th>key figures</th><th>report</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")
    doc = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
           "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
           "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
           "style-src 'unsafe-inline'\">"
           f"<title>deid releases</title><style>{_CSS}</style></head><body>{body}</body></html>\n")
    return strip_urls(doc)


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
