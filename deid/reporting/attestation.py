"""The attestation a release carries: the public part of its report (:mod:`deid.release.attestation`).

Built from the report once the dataset card and ``MANIFEST.sha256`` are written (its ``artifacts``
and ``file_manifest`` filled), by an allow-list: only the fields below are copied, so a field added
to the report later never reaches a recipient unless it is added here. No subject id, source path,
drop name, dataset fingerprint, run id, configuration (seed, paths) or linkage; a check's free-text
``detail`` is left out, its ``value``/``threshold`` kept only when they are numbers or booleans
(a label value or an example id could otherwise slip through), and its requirement and threshold
are stated in the gate's own words (``requirement``, ``required``: ``>= 5``, ``<= 0.200``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from deid.release.attestation import ATTESTATION_FORMAT
from deid.release.catalogue import key_figures
from deid.reporting.verdict import verdict_summary
from deid.reporting.wording import check_requirement, threshold_text

__all__ = ["attestation_from_report"]


def _number(value: Any) -> bool:
    return isinstance(value, bool | int | float) or value is None


def _public_check(c: Mapping[str, Any]) -> dict[str, Any]:
    name = str(c["name"])
    # The requirement and its threshold in words, with the direction (">= 5", "<= 0.200"): the gate's own text.
    out: dict[str, Any] = {"name": name, "passed": bool(c["passed"]), "requirement": check_requirement(name),
                           "required": threshold_text(name, c.get("threshold"))}
    for field in ("status", "interval", "n"):
        if c.get(field) is not None:
            out[field] = c[field]
    for field in ("value", "threshold"):
        if _number(c.get(field)):
            out[field] = c.get(field)
    return out


def attestation_from_report(report: Any) -> dict[str, Any]:
    """The attestation of a released run: a JSON-ready dict (signed by :func:`deid.release.attestation.write_attestation`).

    Parameters
    ----------
    report : Report or mapping
        The run's report after the dataset card step (``artifacts`` lists every release file outside
        the images, ``MANIFEST.sha256`` among them; ``file_manifest`` describes that manifest).

    Returns
    -------
    dict
        ``format``, ``release_id``, ``created_at``, ``verdict``, ``k``, ``method``, ``guarantee``,
        ``checks`` (name, passed, requirement and required in words, status, numeric value/threshold,
        interval, n), ``figures`` (the key
        figures, exact), ``summary`` (the verdict summary's lines, rounded, as ``deid run`` prints them),
        ``files`` (path, sha256, bytes of each listed file), ``file_manifest`` and ``signer``
        (algorithm, public-key fingerprint, key origin).
    """
    d = report if isinstance(report, Mapping) else report.to_dict()
    if d.get("verdict") != "released" or not d.get("file_manifest"):
        raise ValueError(f"verdict={d.get('verdict')!r}: only a released run's report (with its file_manifest, "
                         "written by the dataset card step) has a release to attest")
    figures = dataclasses.asdict(key_figures(dict(d)))
    figures["max_person_share"] = (d.get("privacy") or {}).get("max_person_share")
    figures["exact_bound"] = (d.get("privacy") or {}).get("exact_bound")
    return {
        "format": ATTESTATION_FORMAT,
        "release_id": d["release_id"],
        "created_at": d["created_at"],
        "verdict": d["verdict"],
        "k": d["k"],
        "method": d["method"],
        "guarantee": verdict_summary(d).guarantee,
        "checks": [_public_check(c) for c in d.get("checks") or []],
        "figures": {k: v for k, v in figures.items() if v is not None and v != ()},
        "summary": verdict_summary(d).text_lines(),
        "files": [{"path": a["path"], "sha256": a["sha256"], "bytes": a["bytes"]} for a in d["artifacts"]],
        "file_manifest": dict(d["file_manifest"]),
        "signer": dict(d["signing"]),
    }
