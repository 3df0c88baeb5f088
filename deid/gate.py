"""The release gate: structural k checks, a re-identification attack and utility checks.

A release passes only if every check passes; the result lists every check with its value and
threshold so the signed report says exactly why a run was released or rejected.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from deid.attacks import MODES, attack_all
from deid.errors import ConfigError
from deid.leaks import near_copy_check
from deid.utility import PROTOCOLS, utility_protocols
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
                   released: np.ndarray, released_people: np.ndarray, shape: tuple[int, int],
                   parrot=None, modes=MODES, attackers=None) -> tuple[list[Check], list[dict], float | None]:
    """Re-identification by every attacker in every mode, over all released records; max must be <= 1/k.

    Attackers (:data:`deid.attacks.ATTACKERS`): PCA with Mahalanobis distance (Gross et al.
    2005), PCA whitened cosine (Gross et al. 2009), Fisherfaces, LBP chi-square, and PCA re-fitted
    on the release. Modes (Newton et al. 2005; Gross et al. 2009): naive (released probes vs
    originals), reverse (originals vs released gallery) and parrot (the attacker applies the same
    de-identification to its gallery). A match counts when it is the right person (any of that
    person's images), ties credited fractionally.
    """
    if len(released) == 0:
        return [Check("reidentification_rate", False, None, 1.0 / k, "nothing released to attack")], [], None
    modes = tuple(m for m in modes if m != "parrot" or parrot is not None)
    rates = attack_all(originals=originals, original_people=original_people, released=released,
                       released_people=released_people, shape=shape, modes=modes, parrot=parrot,
                       attackers=attackers)
    max_rate = max(r["rate"] for r in rates)
    bound = 1.0 / k
    worst = max(rates, key=lambda r: r["rate"])
    detail = (f"max over {len(rates)} attacker x mode pairs: {worst['attacker']}/{worst['mode']} "
              f"{worst['rate']:.4f}")
    # A tiny epsilon absorbs float rounding at exactly 1/k (e.g. every cluster of exactly k).
    return [Check("reidentification_rate", max_rate <= bound + 1e-12, round(max_rate, 6), round(bound, 6),
                  detail)], rates, max_rate


def utility_checks(*, labels: list[str], originals: np.ndarray, original_labels: dict[str, np.ndarray],
                   original_people: np.ndarray, released: np.ndarray, released_labels: dict[str, np.ndarray],
                   released_people: np.ndarray, released_groups: np.ndarray, tolerance: float,
                   protocol: str = "cv", folds: int = 5, repeats: int = 10,
                   seed: int = 0) -> tuple[list[Check], list[dict]]:
    """Linear-SVM utility per label under every protocol; the gate holds ``protocol`` to the tolerance.

    Protocol "cv" (Gross et al. 2005 §5.4): grouped 5-fold CV on the release (folds by cluster)
    against the same on the originals (folds by person); "train-original-test-release"
    (Moriarty et al.); "train-release-test-heldout" (what a data consumer does).
    """
    if protocol not in PROTOCOLS:
        raise ConfigError(f"utility_protocol={protocol!r} must be one of {sorted(PROTOCOLS)}")
    rows = utility_protocols(labels=labels, originals=originals, original_labels=original_labels,
                             original_people=original_people, released=released, released_labels=released_labels,
                             released_people=released_people, released_groups=released_groups,
                             folds=folds, repeats=repeats, seed=seed)
    checks = []
    for row in rows:
        row["tolerance"] = tolerance
        if row["protocol"] != protocol:
            continue
        label, orig, rel = row["label"], row["original_accuracy"], row["deidentified_accuracy"]
        if orig is None:
            # A label the originals cannot predict (one class) gives nothing to preserve.
            checks.append(Check(f"utility_{label}", True, rel, None, f"not evaluated: {row['detail']}"))
            continue
        threshold = orig - tolerance
        ok = rel is not None and rel >= threshold - 1e-12
        checks.append(Check(f"utility_{label}", ok, None if rel is None else round(rel, 4), round(threshold, 4),
                            f"protocol {protocol}: release {rel} vs originals {orig:.4f} - tolerance {tolerance}"))
    return checks, rows


def leak_checks(*, released: np.ndarray, originals: np.ndarray, threshold: float,
                file_metadata: dict[str, list[str]]) -> list[Check]:
    """No released face is (nearly) a copy of an original; no released file carries metadata."""
    near = near_copy_check(released, originals, threshold=threshold)
    bad_files = sorted(file_metadata)
    return [
        Check("no_near_copies", bool(near["passed"]), near["min_distance"], threshold,
              f"{near['identical']} identical and {near['below_threshold']} within {threshold} grey levels "
              "(mean absolute difference) of an original aligned face"),
        Check("no_source_metadata", not bad_files, len(bad_files), 0,
              "clean" if not bad_files else f"{bad_files[:5]} carry {file_metadata[bad_files[0]]}"),
    ]
