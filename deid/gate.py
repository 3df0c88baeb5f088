"""The release gate: structural k checks, a re-identification attack and utility checks.

A release passes only if every check passes; the result lists every check with its value and
threshold so the signed report says exactly why a run was released or rejected.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from deid.attacks import WhitenedCosineAttacker, attack_rate
from deid.utility import grouped_cv_accuracy
from schemas.arrow import FORBIDDEN_RELEASE_COLUMNS, RELEASE_BASE_COLUMNS

log = logging.getLogger(__name__)


@dataclass
class Check:
    name: str
    passed: bool
    value: object
    threshold: object
    detail: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "passed": bool(self.passed), "value": self.value,
                "threshold": self.threshold, "detail": self.detail}


@dataclass
class GateResult:
    checks: list[Check] = field(default_factory=list)
    reidentification: list[dict] = field(default_factory=list)
    utility: list[dict] = field(default_factory=list)
    max_rate: float | None = None
    min_people: int | None = None

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.detail or f'value {c.value} vs threshold {c.threshold}'}"
                for c in self.checks if not c.passed]


def structural_checks(*, k: int, cluster_ids: list[str], people: list[str], release_columns: list[str],
                      labels: list[str], records_in: int, released: int, suppressed: int, quarantined: int,
                      partition_failed: bool = False, partition_detail: str = "") -> tuple[list[Check], int | None]:
    """Checks that need no model: cluster sizes, people per cluster, columns, record accounting."""
    checks: list[Check] = []
    sizes: dict[str, int] = {}
    members: dict[str, set] = {}
    for c, p in zip(cluster_ids, people):
        sizes[c] = sizes.get(c, 0) + 1
        members.setdefault(c, set()).add(p)
    min_size = min(sizes.values()) if sizes else None
    min_people = min(len(m) for m in members.values()) if members else None
    checks.append(Check("release_not_empty", released > 0, released, ">= 1",
                        "" if released > 0 else "no record could be released"))
    checks.append(Check("min_cluster_size", min_size is not None and min_size >= k, min_size, k,
                        f"{len(sizes)} clusters; smallest has {min_size} images"))
    checks.append(Check("min_distinct_people_per_cluster", min_people is not None and min_people >= k,
                        min_people, k, f"smallest number of distinct people in a cluster: {min_people}"))
    allowed = set(RELEASE_BASE_COLUMNS) | set(labels)
    bad = sorted(set(release_columns) - allowed)
    forbidden = sorted(set(release_columns) & set(FORBIDDEN_RELEASE_COLUMNS))
    checks.append(Check("no_forbidden_columns", not bad and not forbidden, bad or forbidden or [],
                        sorted(allowed), "release columns: " + ", ".join(release_columns)))
    total = released + suppressed + quarantined
    checks.append(Check("records_accounted", total == records_in, total, records_in,
                        f"released {released} + suppressed {suppressed} + quarantined {quarantined} "
                        f"= {total} of {records_in} in"))
    if partition_failed:
        checks.append(Check("small_partitions", False, "fail", "every partition >= k people",
                            partition_detail or "a label partition has fewer than k distinct people"))
    return checks, min_people


def privacy_checks(*, k: int, originals: np.ndarray, original_people: np.ndarray,
                   released: np.ndarray, released_people: np.ndarray,
                   n_components: int = 50) -> tuple[list[Check], list[dict], float | None]:
    """Re-identification attack (PCA whitened cosine, Gross et al. 2009) over all released records.

    The attacker holds the originals of the released people (its gallery) and matches every
    released face against them; a match counts when its best original is the right person,
    with ties credited fractionally. The rate must be at most 1/k.
    """
    if len(released) == 0:
        return [Check("reidentification_rate", False, None, 1.0 / k, "nothing released to attack")], [], None
    attacker = WhitenedCosineAttacker(n_components=n_components).fit(originals, people=original_people)
    rates = []
    for mode in ("naive", "reverse"):
        rate = attack_rate(attacker, originals=originals, original_people=original_people,
                           released=released, released_people=released_people, mode=mode)
        rates.append({"attacker": "pca-whitened-cosine", "mode": mode, "rate": float(rate)})
    max_rate = max(r["rate"] for r in rates)
    bound = 1.0 / k
    detail = "; ".join(f"{r['attacker']}/{r['mode']} {r['rate']:.4f}" for r in rates)
    # A tiny epsilon absorbs float rounding at exactly 1/k (e.g. every cluster of exactly k).
    return [Check("reidentification_rate", max_rate <= bound + 1e-12, round(max_rate, 6), round(bound, 6),
                  detail)], rates, max_rate


def utility_checks(*, labels: list[str], originals: np.ndarray, original_labels: dict[str, np.ndarray],
                   original_groups: np.ndarray, released: np.ndarray, released_labels: dict[str, np.ndarray],
                   released_groups: np.ndarray, tolerance: float, folds: int = 5, repeats: int = 10,
                   seed: int = 0) -> tuple[list[Check], list[dict]]:
    """Linear-SVM accuracy per label: release (folds grouped by cluster) vs originals (by person)."""
    checks, rows = [], []
    for label in labels:
        orig = grouped_cv_accuracy(originals, original_labels[label], groups=original_groups, folds=folds,
                                   seed=seed, repeats=repeats)
        rel = grouped_cv_accuracy(released, released_labels[label], groups=released_groups, folds=folds,
                                  seed=seed, repeats=repeats)
        row = {"label": label, "original_accuracy": orig.accuracy, "deidentified_accuracy": rel.accuracy,
               "tolerance": tolerance, "detail": f"originals: {orig.detail}; release: {rel.detail}"}
        rows.append(row)
        if orig.accuracy is None:
            # A label the originals cannot predict (one class) gives nothing to preserve.
            checks.append(Check(f"utility_{label}", True, rel.accuracy, None,
                                f"not evaluated: {orig.detail}"))
            continue
        threshold = orig.accuracy - tolerance
        ok = rel.accuracy is not None and rel.accuracy >= threshold - 1e-12
        checks.append(Check(f"utility_{label}", ok, None if rel.accuracy is None else round(rel.accuracy, 4),
                            round(threshold, 4),
                            f"release {rel.accuracy} vs originals {orig.accuracy:.4f} - tolerance {tolerance}"))
    return checks, rows
