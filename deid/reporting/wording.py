"""Gate checks in words: what each check requires, its threshold with its direction, its measured value.

One place for the wording every view of a report shares (report.html, the verdict summary the CLI
and the Prefect UI print, the Prefect checks table); numbers are rounded for people here,
report.json keeps them exact.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deid.reporting.html_page import fmt, round_numbers

__all__ = ["ATTACKER_WORDS", "MODE_WORDS", "attack_terms", "check_requirement", "measured", "report_only",
           "status_text", "threshold_text"]

# What each gate check requires, in words (the check's code name is shown beside it).
_REQUIREMENTS = {
    "drop_readable": "The drop can be read",
    "gate_error": "The drop can be judged (no stage or attacker refused its data)",
    "person_index": "The drop's people belong to no other dataset's lineage (the project's person index)",
    "released_in_clusters": "Every released image is shared by a cluster of at least k distinct people",
    "partition_clusters": "Every label partition keeps enough clusters (no partition collapsed into a few faces)",
    "drop_not_empty": "The drop has records",
    "enough_people": "The drop has at least k distinct usable people",
    "lineage_color": "The release keeps its dataset's colour mode (colour or grey), so returning people's images "
                     "stay identical",
    "lineage_canonical_size": "The release keeps its dataset's canonical face size, so returning people's images "
                              "stay identical",
    "quarantine_fraction": "Few records are quarantined",
    "release_not_empty": "At least one record is released",
    "min_cluster_size": "Every cluster holds at least k images",
    "min_distinct_people_per_cluster": "Every cluster holds at least k distinct people",
    "max_person_share": "No person makes up more than 1/k of a cluster's images",
    "no_forbidden_columns": "The release carries only its allowed columns",
    "records_accounted": "Every record is released, suppressed or quarantined",
    "small_partitions": "Every label partition has at least k people",
    "cluster_not_close_to_one_member": "No released face is close to one member's original",
    "reidentification_rate": "Re-identification attacks succeed at most 1/k of the time",
    "no_near_copies": "No released face is a near-copy of an original",
    "no_source_metadata": "Released files carry no source metadata",
    "no_one_person_clusters": "No released cluster is one person under several ids (members alike as one, or the "
                              "released face at one member)",
    "utility": "The utility labels stay learnable",
    "lineage_cluster_differences": "Clusters of successive releases do not differ by fewer than k people",
    "lineage_returning_identical": "Returning people receive their registered image again",
    "lineage_differencing_attack": "Differencing successive releases exposes nobody",
    "lineage_published_differencing": "Differencing the published releases the registry does not remember exposes "
                                      "nobody",
    "lineage_label_mix": "Every released cluster keeps its registered label mix",
    "lineage_merges": "No registered cluster is republished that this run's identity merges leave below k people "
                      "or with one person above 1/k",
    "membership_advantage": "Telling members from non-members by their photo gives little advantage (not bounded by k)",
    "sensitive_l_diversity": "Every cluster holds at least l distinct values of each sensitive column (else withheld)",
}
# What each re-identification attacker is and what each mode lets it do, for a reader who meets the
# names in a reason or a chart ("pca-whitened-cosine (parrot)"). The attackers of deid.evaluation.attacks.
ATTACKER_WORDS = {
    "pca-mahalanobis": "eigenfaces (PCA of the original faces) compared by Mahalanobis distance",
    "pca-whitened-cosine": "eigenfaces whitened and compared by cosine (the CSU face-recognition baseline)",
    "fisherfaces": "Fisherfaces: eigenfaces, then a linear discriminant trained to tell the people apart",
    "lbp-chi2": "local binary pattern histograms (skin texture) compared by chi-square distance",
    "release-refit-pca": "eigenfaces fitted on the released faces themselves, then whitened cosine",
    "dlib-resnet": "dlib's deep face-recognition network (a ResNet's 128-value face descriptors)",
    "feature-whitened-cosine": "the feature vectors whitened and compared by cosine",
    "feature-euclidean": "the feature vectors compared by Euclidean distance",
    "identity-classifier": "a classifier trained on the original vectors to say who a record is",
}
MODE_WORDS = {
    "naive": "each released face is looked up among the originals (who is this released face?)",
    "reverse": "each original is looked up among the released faces (which released face is this person?)",
    "parrot": "the attacker first de-identifies its own copies of the originals with the same method, then "
              "looks each released face up among them (the strongest mode against averaging)",
}


def attack_terms(attackers: Any, modes: Any = ()) -> list[tuple[str, str]]:
    """``(name, meaning)`` of each attacker then each mode named, in first-seen order (unknown names: no entry)."""
    out: list[tuple[str, str]] = []
    for names, words in ((attackers, ATTACKER_WORDS), (modes, MODE_WORDS)):
        for n in dict.fromkeys(str(x) for x in names):
            if n in words:
                out.append((n, words[n]))
    return out


# Reports signed before thresholds carried their direction: the direction of their bare numbers.
_LEGACY_DIRECTION = {"quarantine_fraction": "<=", "enough_people": ">=", "records_accounted": "=",
                     "min_cluster_size": ">=", "min_distinct_people_per_cluster": ">="}


def check_requirement(name: str) -> str:
    """What gate check ``name`` requires, in plain words."""
    if name in _REQUIREMENTS:
        return _REQUIREMENTS[name]
    if name.startswith("expectations_"):
        return f"Data validation of the {name.removeprefix('expectations_')} table passes"
    if name.startswith("utility_"):
        return f"The label '{name.removeprefix('utility_')}' stays learnable from the release"
    return name.replace("_", " ").capitalize()


def threshold_text(name: str, threshold: Any) -> str:
    """A check's threshold with its direction (``>= 0.840``, ``<= 0.200``, ``= 0``), numbers rounded."""
    if threshold is None:
        return "\u2014"
    if isinstance(threshold, str):
        return round_numbers(threshold)
    if isinstance(threshold, list | tuple):
        return "only: " + (", ".join(str(t) for t in threshold) or "none")
    if isinstance(threshold, int | float) and not isinstance(threshold, bool):
        op = _LEGACY_DIRECTION.get(name) or ("=" if threshold == 0 or name.startswith("expectations_") else "vs")
        return f"{op} {fmt(threshold)}"
    return fmt(threshold)


def measured(c: Mapping[str, Any]) -> str:
    """A check's value (rounded) and, for an empirical rate, its interval and sample size."""
    value = c.get("value")
    text = fmt(round(value, 4) if isinstance(value, float) else value)
    if str(c.get("name", "")).startswith("expectations_") and isinstance(value, int):
        text = f"{value} failed"
    iv = c.get("interval")
    if iv:
        text += f" [{iv[0]:.3f}, {iv[1]:.3f}]"
    if c.get("n") is not None:
        text += f" n={c['n']}"
    return text


def status_text(c: Mapping[str, Any]) -> str:
    """A check's outcome in words: ``pass``, ``FAIL``, ``inconclusive (not blocking)``, ``not applicable`` ...

    ``passed`` alone misleads: a check that could not decide, or did not apply, also does not block.
    """
    status = str(c.get("status") or ("pass" if c.get("passed") else "fail"))
    if status == "inconclusive":
        return "inconclusive (not blocking)" if c.get("passed") else "inconclusive (blocks)"
    if status == "not_applicable":
        return "report only (no limit set)" if report_only(c) else "not applicable"
    return "pass" if c.get("passed") else "FAIL"


def report_only(c: Mapping[str, Any]) -> bool:
    """A check that measured a figure but has no limit to judge it by (membership without
    DEID_MEMBERSHIP_MAX_ADVANTAGE): "not applicable" beside an AUC of 0.95 read as "irrelevant"."""
    return c.get("status") == "not_applicable" and c.get("value") is not None and c.get("threshold") is None
