"""The catalogue of releases: every signed report of a reports directory, read for listing.

``deid releases`` lists each run (released or rejected) with its dataset, date, k, method and
verdict, read from ``reports/<release_id>/report.json``, and writes ``reports/index.html``. This
module reads; the views (the terminal table, the self-contained page) are rendered in
:mod:`deid.reporting.catalogue_page` from each run's verdict summary
(:func:`deid.reporting.verdict.verdict_summary`), the one summary every view shows. The catalogue
reads reports only: it never checks a signature (``deid verify`` does) and says when a report is
unsigned, unreadable or annulled by a signed addendum (a run signed "released" that was not
published after all).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deid.errors import ConfigError

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
    ``summary``: what ``read_catalogue``'s ``summarise`` made of the report (the verdict summary,
    :func:`deid.reporting.catalogue_page.read_catalogue`); None when not asked or unreadable.
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
    summary: Any = None


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


Summarise = Callable[[dict[str, Any], Path | None], Any]


def _entry(report_dir: Path, summarise: Summarise | None = None) -> CatalogueEntry:
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
        reasons=tuple(str(r) for r in report.get("reasons") or []), report_path=path, report_html=page, status=status,
        summary=None if summarise is None else summarise(report, page))


def read_catalogue(reports_dir: str | os.PathLike, *, summarise: Summarise | None = None) -> list[CatalogueEntry]:
    """Every run under ``reports_dir`` (one ``<release_id>/report.json`` each), newest first.

    ``summarise(report, report_html)``, when given, is called on each readable report (its dict,
    parsed once) and its result kept as the entry's ``summary``.

    Raises
    ------
    ConfigError
        When ``reports_dir`` is not a directory.
    """
    root = Path(reports_dir)
    if not root.is_dir():
        raise ConfigError(f"reports_dir={str(root)!r} is not a directory; pass the reports directory "
                          "(the DEID_REPORTS_DIR setting, default reports/)")
    entries = [_entry(d, summarise) for d in sorted(root.iterdir())
               if d.is_dir() and not d.is_symlink() and (d / _REPORT).is_file()]
    # Newest first; runs without a date (unreadable reports) last, by id.
    entries.sort(key=lambda e: (e.created_at is not None, e.created_at or "", e.release_id), reverse=True)
    return entries
