"""The verdict summary: what a steward or a recipient must read first, built once from a report.

One :class:`VerdictSummary` (:func:`verdict_summary`) is rendered by every view of a run: the
``deid run`` summary (:meth:`VerdictSummary.text_lines`), the Prefect verdict artifact
(:meth:`VerdictSummary.markdown`) and the top of report.html (``deid.reporting.html_report``). So
they all say the same thing in the same order:

1. the verdict;
2. the guarantee that holds, or ``none: nothing released`` (a rejected run promises nothing, so no
   view shows the method's would-be guarantee under a rejection);
3. why, root cause first: a drop with fewer than k people is the cause; the release being empty and
   the records not adding up are its consequences, listed after it and marked so;
4. warnings (checks the data could not decide, a development signing key);
5. key figures, rounded for people, with their intervals and sample sizes (report.json keeps them
   exact), absent figures left out rather than printed as ``None``;
6. the terms: what each attacker and mode named above is (``pca-whitened-cosine``, ``parrot``), in words;
7. where report.html is.

The builder reads the report's JSON form and only the fields it knows, so fields added to the
report later pass through untouched.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deid.reporting.html_page import round_numbers
from deid.reporting.markdown import md, md_cell, truncate
from deid.reporting.wording import (
    ATTACKER_WORDS,
    MODE_WORDS,
    check_requirement,
    measured,
    report_only,
    status_text,
    threshold_text,
)

__all__ = ["NOTHING_RELEASED", "VerdictSummary", "check_rows", "checks_description", "root_cause_order",
           "verdict_summary"]

NOTHING_RELEASED = "none: nothing released"
DETAIL_CHARS = 90  # the checks table's detail column (report.html shows the whole text)
# The UI sizes each column of a table artifact to its longest cell and cuts the table at the screen's
# edge: the requirement and required cells are cut so result, requirement and required fit 1400 px.
REQUIREMENT_CHARS = 48
REQUIRED_CHARS = 24
DESCRIPTION_CHARS = 100  # an artifact card's line (the UI cuts it at ~50 on the card, and shows it whole above the page)

# Failed checks in cause order: what is wrong with the drop first, then what the gate measured, then
# what follows from any failure (nothing released, the records judged not adding up).
_INPUT = ("drop_readable", "drop_not_empty", "enough_people", "lineage_color", "lineage_canonical_size",
          "quarantine_fraction", "small_partitions")
_CONSEQUENCES = ("release_not_empty", "records_accounted")


def _rank(name: str) -> int:
    if name in _INPUT:
        return _INPUT.index(name)
    if name.startswith("expectations_"):
        return len(_INPUT)
    if name in _CONSEQUENCES:
        return 1000 + _CONSEQUENCES.index(name)
    if name == "utility" or name.startswith("utility_"):
        return 900
    return 100


def root_cause_order(names: Sequence[str]) -> list[str]:
    """Check names in cause order (the drop's problems, then measurements, then consequences); stable."""
    return sorted(names, key=_rank)


@dataclass(frozen=True)
class VerdictSummary:
    """What a run decided and why, in words (see the module docstring for the order).

    Attributes
    ----------
    verdict : ``released`` or ``rejected``.
    headline : the verdict as shown (``RELEASED``, ``REJECTED``, ``REJECTED (unreadable drop)``).
    guarantee : the guarantee that holds for what was released, or :data:`NOTHING_RELEASED`.
    causes : why it was rejected, root cause first (empty when released).
    consequences : failed checks that follow from the causes (nothing released ...), after them.
    warnings : not blocking, but the reader must know (undecided checks, a development key).
    figures : ``(label, text)`` key figures, rounded, with intervals and sample sizes.
    report_html : where report.html is, when known.
    terms : ``(name, meaning)`` of each attacker and mode the lines above name (a reader outside
        report.html meets ``pca-whitened-cosine (parrot)`` with no table beside it).
    """

    verdict: str
    headline: str
    guarantee: str
    causes: tuple[str, ...]
    consequences: tuple[str, ...]
    warnings: tuple[str, ...]
    figures: tuple[tuple[str, str], ...]
    report_html: str | None = None
    terms: tuple[tuple[str, str], ...] = ()

    @property
    def released(self) -> bool:
        return self.verdict == "released"

    def text_lines(self, *, terms: bool = True) -> list[str]:
        """The summary as plain ``key: value`` lines (the ``deid run`` output); ``terms=False`` leaves the
        attackers' and modes' meanings out (a list of many runs, where they would repeat)."""
        lines = [f"verdict: {self.headline}", f"guarantee: {self.guarantee}"]
        lines += [f"  cause: {c}" for c in self.causes]
        lines += [f"  then: {c}" for c in self.consequences]
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"{label}: {text}" for label, text in self.figures]
        lines += [f"term: {name} = {words}" for name, words in self.terms] if terms else []
        if self.report_html:
            lines.append(f"report: {self.report_html}")
        return lines

    def markdown(self, title: str = "deid release") -> str:
        """The summary as Markdown, every piece of text escaped (the Prefect verdict artifact)."""
        lines = [f"# {md(title)}: **{md(self.headline)}**", "", f"**Guarantee:** {md(self.guarantee)}", ""]
        if self.causes:
            lines += ["## Why it was rejected (root cause first)", "", *[f"1. {md(c)}" for c in self.causes]]
            lines += [f"1. {md(c)} *(a consequence of the above)*" for c in self.consequences]
            lines.append("")
        if self.warnings:
            lines += ["## Warnings (not blocking)", "", *[f"- {md(w)}" for w in self.warnings], ""]
        if self.figures:
            lines += ["## Key figures", "", *[f"- **{md(label)}**: {md(text)}" for label, text in self.figures], ""]
        if self.terms:
            lines += ["## Terms", "", *[f"- **{md(name)}**: {md(words)}" for name, words in self.terms], ""]
        if self.report_html and self.report_html.startswith(("http://", "https://")):
            # Served by `deid server` (a link that opens); a local path as code (a browser will not follow it).
            lines += [f"**report.html**: [{md(self.report_html)}]({self.report_html.replace(')', '%29')})", ""]
        elif self.report_html:
            lines += [f"**report.html**: `{self.report_html.replace('`', '')}`", ""]
        return "\n".join(lines)

    def description(self) -> str:
        """One line for an artifact card (and above the artifact's page): the headline, then the root cause or
        the guarantee, plain text, at most :data:`DESCRIPTION_CHARS` characters (the page has them whole)."""
        why = self.causes[0].split(" (", 1)[0] if self.causes else f"guarantee {self.guarantee}"
        return truncate(f"{self.headline}: {why}", DESCRIPTION_CHARS)


def _as_dict(report: Any) -> Mapping[str, Any]:
    """The report's JSON form without its (possibly million-long) file lists, which no summary reads."""
    if isinstance(report, Mapping):
        return report
    if dataclasses.is_dataclass(report):
        light = dataclasses.replace(report, artifacts=[], report_files=None, file_manifest=None)
        return light.to_dict() if hasattr(light, "to_dict") else dataclasses.asdict(light)
    raise TypeError(f"report={type(report).__name__} must be a deid.reporting.report.Report or its dict")


def _sentence(c: Mapping[str, Any], verb: str) -> str:
    """One check as plain words: requirement, outcome, the detail, then measured vs required (rounded)."""
    name = str(c.get("name"))
    text = f"{check_requirement(name)}: {verb}"
    detail = round_numbers(" ".join(str(c.get("detail") or "").split()))
    evidence = []
    if c.get("value") is not None or c.get("threshold") is not None:
        evidence.append(f"measured {measured(c)}, required {threshold_text(name, c.get('threshold'))}")
    inner = "; ".join([x for x in (detail, *evidence) if x])
    return f"{text} ({inner})" if inner else text


def _named_terms(texts: Sequence[str]) -> list[tuple[str, str]]:
    """The attackers, then the modes, that ``texts`` name as words of their own (``k-same-naive`` names no mode)."""
    text = " ".join(texts)
    return [(name, words[name]) for words in (ATTACKER_WORDS, MODE_WORDS) for name in words
            if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)]


def _num(value: Any, digits: int = 3) -> str:
    return f"{float(value):.{digits}f}"


def _figures(d: Mapping[str, Any]) -> list[tuple[str, str]]:
    ds = d.get("dataset") or {}
    priv = d.get("privacy") or {}
    out: list[tuple[str, str]] = []
    if ds.get("records_in") is not None:
        out.append(("records", f"{ds.get('records_in')} in, {ds.get('records_released', 0)} released, "
                    + (f"{ds['records_withheld']} withheld (rejected), " if ds.get("records_withheld") else "")
                    + f"{ds.get('records_suppressed', 0)} suppressed, {ds.get('records_quarantined', 0)} quarantined"))
    by_reason = ds.get("quarantine_by_reason") or {}
    if by_reason:
        out.append(("quarantined by reason", ", ".join(f"{k}={v}" for k, v in sorted(by_reason.items()))))
    # Imported here: the catalogue imports report.html's module, which imports this one.
    from deid.release.catalogue import key_figures  # noqa: PLC0415

    fig = key_figures(dict(d))
    if fig.max_rate is not None:
        text = f"max {_num(fig.max_rate, 4)}"
        if fig.worst_attack is not None and fig.worst_upper is not None:
            text += (f" (highest bound: {fig.worst_attack} {_num(fig.worst_rate)} [{_num(fig.worst_lower)}, "
                     f"{_num(fig.worst_upper)}]" + (f", n={fig.worst_probes}" if fig.worst_probes is not None else "")
                     + ")")
        if fig.bound is not None:
            text += f"; bound 1/k = {_num(fig.bound, 4)}"
            if priv.get("exact_bound") and d.get("verdict") == "released":
                text += " (holds exactly: each cluster's members share one image)"
        out.append(("re-identification", text))
    if fig.min_people is not None:
        out.append(("people per cluster", f"at least {fig.min_people} distinct"
                    + (f", no person above {_num(priv['max_person_share'])} of a cluster"
                       if isinstance(priv.get("max_person_share"), int | float) else "")))
    protocol = (d.get("configuration") or {}).get("utility_protocol")
    for u in fig.utility:
        if u.original_accuracy is None and u.deidentified_accuracy is None:
            continue
        parts = [f"originals {_num(u.original_accuracy) if u.original_accuracy is not None else 'n/a'}",
                 f"release {_num(u.deidentified_accuracy) if u.deidentified_accuracy is not None else 'n/a'}"]
        if u.original_accuracy is not None and u.deidentified_accuracy is not None:
            drop = f"drop {u.original_accuracy - u.deidentified_accuracy:+.3f}"
            if u.delta_lower is not None and u.delta_upper is not None:
                drop += f" [{u.delta_lower:+.3f}, {u.delta_upper:+.3f}]"
            parts.append(drop)
        if u.n_test is not None:
            parts.append(f"n={u.n_test}")
        # The gate's check decides what the line says (a row's own status is one protocol's view of it).
        decided = next((c.get("status") for c in d.get("checks") or []
                        if isinstance(c, Mapping) and c.get("name") == f"utility_{u.label}"), None) or u.status
        if decided:
            parts.append(str(decided).replace("_", " "))
        out.append((f"utility {u.label}" + (f" [{protocol}]" if protocol else ""), ", ".join(parts)))
    return out


def verdict_summary(report: Any, *, report_html: str | Path | None = None) -> VerdictSummary:
    """The :class:`VerdictSummary` of a report (a :class:`~deid.reporting.report.Report` or its dict).

    Parameters
    ----------
    report : Report or mapping
        The run's report, released or rejected; fields this function does not know are ignored.
    report_html : path, optional
        Where the run's report.html is (the report itself does not know), shown last.
    """
    d = _as_dict(report)
    verdict = str(d.get("verdict"))
    released = verdict == "released"
    checks = [c for c in d.get("checks") or [] if isinstance(c, Mapping)]
    failed = {str(c.get("name")): c for c in checks if not c.get("passed")}
    order = root_cause_order(list(failed))
    causes = [_sentence(failed[n], "not met") for n in order if _rank(n) < 1000]
    consequences = [_sentence(failed[n], "not met") for n in order if _rank(n) >= 1000]
    if not causes:  # only consequences failed: they are the cause then
        causes, consequences = consequences, []
    # A reason with no failed check behind it (older reports, a run that failed before the gate): as written.
    causes += [round_numbers(str(r)) for r in d.get("reasons") or [] if str(r).split(":", 1)[0] not in failed]
    undecided = {str(c.get("name")): c for c in checks if c.get("passed") and c.get("status") == "inconclusive"}
    warnings = [_sentence(undecided[n], "could not be decided") for n in root_cause_order(list(undecided))]
    warnings += [round_numbers(str(w)) for w in d.get("warnings") or [] if str(w).split(":", 1)[0] not in undecided]
    if (d.get("signing") or {}).get("key_origin") == "development":
        warnings.append("signed with a development key: not for production releases (create one with `deid keygen`)")
    headline = verdict.upper() + (" (unreadable drop)" if "drop_readable" in failed
                                  else " (unusable drop)" if "gate_error" in failed else "")
    guarantee = str(d.get("guarantee") or "no formal guarantee") if released else NOTHING_RELEASED
    figures = _figures(d)
    terms = _named_terms([*causes, *consequences, *warnings, *(text for _, text in figures)])
    return VerdictSummary(verdict=verdict, headline=headline, guarantee=guarantee, causes=tuple(causes),
                          consequences=tuple(consequences), warnings=tuple(warnings), figures=tuple(figures),
                          report_html=None if report_html is None else str(report_html), terms=tuple(terms))


def checks_description(report: Any) -> str:
    """One line for the checks table's card: how many checks, by status (``24 checks: 22 pass, 2 inconclusive``)."""
    checks = [c for c in _as_dict(report).get("checks") or [] if isinstance(c, Mapping)]
    counts: dict[str, int] = {}
    for c in checks:
        word = "report only" if report_only(c) else str(c.get("status") or ("pass" if c.get("passed") else "fail")
                                                        ).replace("_", " ")
        counts[word] = counts.get(word, 0) + 1
    order = ["fail", "inconclusive", "pass", "report only", "not applicable"]
    parts = [f"{counts[w]} {w.upper() if w == 'fail' else w}" for w in sorted(counts, key=lambda w: (
        order.index(w) if w in order else len(order), w))]
    return f"{len(checks)} gate checks" + (": " + ", ".join(parts) if parts else "")


def check_rows(report: Any) -> list[dict[str, Any]]:
    """Every gate check as a row of the Prefect checks table, each cell escaped for Markdown.

    ``result`` states the status (``inconclusive (not blocking)``, ``not applicable``), never a bare
    ``true``; ``required`` carries its direction (``>= 5``); ``detail`` is cut to
    :data:`DETAIL_CHARS` characters (report.html has it whole). The columns run result,
    requirement, required, measured, check (its name), detail, the requirement and required cut
    (:data:`REQUIREMENT_CHARS`, :data:`REQUIRED_CHARS`): the UI sizes a column to its longest cell
    and cuts the table at the screen's edge, and with the whole sentence and the name first, result
    and required sat off a 1400 px screen.
    """
    d = _as_dict(report)
    rows = []
    for c in d.get("checks") or []:
        if not isinstance(c, Mapping):
            continue
        name = str(c.get("name"))
        rows.append({"result": md_cell(status_text(c)),
                     "requirement": md_cell(check_requirement(name), limit=REQUIREMENT_CHARS),
                     "required": md_cell(threshold_text(name, c.get("threshold")), limit=REQUIRED_CHARS),
                     "measured": md_cell(measured(c)),
                     "check": md_cell(name),
                     "detail": md_cell(round_numbers(str(c.get("detail") or "")), limit=DETAIL_CHARS)})
    return rows
