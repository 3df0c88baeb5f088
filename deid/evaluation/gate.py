"""The release gate: exact k checks, bounded re-identification attacks, leak and utility checks.

One entry point, :func:`evaluate`, takes typed inputs (:class:`GateInputs`,
:class:`GateConfig`) and returns a :class:`GateResult`; the Prefect task only loads the
arrays and adapts. Every check has a status (``pass``, ``fail``, ``inconclusive``,
``not_applicable``) besides ``passed`` (does it block the release?) and, where it is an
empirical rate, its interval and sample size.

Privacy is decided exactly where it can be. When every member of every cluster received the
identical image (the k-Same family), no recogniser can do better than naming, for each
released image, the person who holds the largest share of its cluster: the exact bound is
``max_person_share`` (max over clusters of that share), checked against 1/k in O(N). The
empirical attacks still run, each rate with a one-sided Clopper-Pearson interval
(Bonferroni over all attacker x mode pairs); for such releases a rate fails only if its
*lower* bound exceeds 1/k (a correct release sits at 1/k against a strong attacker), for
every other method its *upper* bound must stay <= 1/k.
"""
from __future__ import annotations

import logging
import math
import pickle
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Literal, Mapping, Sequence

import numpy as np
from scipy.stats import beta

from deid.anonymise.clusters import cluster_shares, value_codes
from deid.anonymise.ksame import feasible_clusters
from deid.method_registry import CLUSTER_METHODS
from deid.evaluation.attacks import ATTACKERS, DEEP_ATTACKERS, FEATURE_ATTACKERS, MODES, attack_all
from deid.evaluation.scoring import unique_rows
from deid.evaluation.checks import INSUFFICIENT, STATUSES, Check, Status  # noqa: F401 (re-exported)
from deid.errors import ConfigError
from deid.evaluation.membership import measure_membership, membership_check
from deid.evaluation.leaks import (
    FEATURE_NEAR_COPY_RATIO,
    mean_abs_difference,
    nearest_original_distance,
    nearest_vector_distance,
    other_person_scale,
    vector_distance,
)
from deid.progress import PartsProgress, Progress
from deid.evaluation.validation import quarantine_fraction_check
from deid.schemas.arrow import FEATURE_RELEASE_BASE_COLUMNS, FORBIDDEN_RELEASE_COLUMNS, RELEASE_BASE_COLUMNS
from deid.bound import within_bound

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class GateConfig:
    """How strict the gate is; one value per run, from :class:`deid.settings.Settings`."""

    k: int
    method: str
    labels: tuple[str, ...] = ()
    tolerance: float = 0.05
    confidence: float = 0.95
    max_quarantine_fraction: float = 0.05
    leak_threshold: float = 2.0
    closeness_ratio: float = 0.25
    feature_near_copy_ratio: float = FEATURE_NEAR_COPY_RATIO
    attack_sample: int = 1000
    deep_attack_sample: int = 100
    min_probes: int = 20
    attackers: tuple[str, ...] | None = None
    modes: tuple[str, ...] = MODES
    utility_sample: int = 1000
    utility_inconclusive: Literal["release", "reject"] = "release"
    folds: int = 5
    repeats: int = 3
    n_components: int = 50
    seed: int = 0
    helper_min_records: int = 10_000
    evidence_sample: int = 500
    min_cluster_fraction: float = 0.5
    membership_max_advantage: float | None = None
    identity_check_max: int = 2000  # faces the within-cluster identity check may embed (0: off)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 2:
            raise ConfigError(f"k={self.k!r} must be an integer >= 2; k is the minimum number of people per cluster")
        if not 0.5 < self.confidence < 1:
            raise ConfigError(f"confidence={self.confidence!r} must be in (0.5, 1); e.g. 0.95")
        if self.attack_sample < 10:
            raise ConfigError(f"attack_sample={self.attack_sample!r} must be >= 10 records; e.g. 2000")
        if isinstance(self.min_probes, bool) or not isinstance(self.min_probes, int) or self.min_probes < 1:
            raise ConfigError(f"min_probes={self.min_probes!r} must be an integer >= 1 (setting DEID_MIN_PROBES: the "
                              "fewest distinct probes behind a deciding re-identification rate); e.g. 20")
        if self.utility_inconclusive not in ("release", "reject"):
            raise ConfigError(f"utility_inconclusive={self.utility_inconclusive!r} must be 'release' or 'reject'")
        if not 0 <= self.min_cluster_fraction <= 1:
            raise ConfigError(f"min_cluster_fraction={self.min_cluster_fraction!r} must be in [0, 1] (the share of a "
                              "partition's feasible maximum of clusters it must keep; 0 turns the check off); e.g. 0.5")
        if not 0 < self.closeness_ratio < 1:
            raise ConfigError(f"closeness_ratio={self.closeness_ratio!r} must be in (0, 1); e.g. 0.25")
        if not 0 < self.feature_near_copy_ratio < 1:
            raise ConfigError(f"feature_near_copy_ratio={self.feature_near_copy_ratio!r} must be in (0, 1); e.g. 0.2")
        if self.membership_max_advantage is not None and not 0 <= self.membership_max_advantage <= 1:
            raise ConfigError(f"membership_max_advantage={self.membership_max_advantage!r} must be in [0, 1] (setting "
                              "DEID_MEMBERSHIP_MAX_ADVANTAGE: the largest 2 x AUC - 1 of telling members from "
                              "non-members; unset = report only); e.g. 0.2")
        if isinstance(self.evidence_sample, bool) or not isinstance(self.evidence_sample, int) \
                or self.evidence_sample < 10:
            raise ConfigError(f"evidence_sample={self.evidence_sample!r} must be an integer >= 10 records (the "
                              "evidence-only utility protocols' sample); e.g. 500")
        if isinstance(self.helper_min_records, bool) or not isinstance(self.helper_min_records, int) \
                or self.helper_min_records < 0:
            raise ConfigError(f"helper_min_records={self.helper_min_records!r} must be an integer >= 0 (0: the gate "
                              "never starts a helper process); e.g. 10000")

    @classmethod
    def from_settings(cls, settings: Any, *, k: int, method: str, labels: Sequence[str] = (),
                      **overrides: Any) -> GateConfig:
        """The gate the settings configure: each :data:`GATE_SETTINGS` field from its setting, then ``overrides``."""
        values = {name: getattr(settings, setting) for name, setting in GATE_SETTINGS.items()}
        values["seed"] = values["seed"] or 0  # an unset seed (None: OS randomness elsewhere) is 0 for the gate
        return cls(k=k, method=method, labels=tuple(labels), **{**values, **overrides})


# The one place that says which GateConfig field comes from which setting (deid.settings.Settings,
# DEID_<SETTING>); the run configuration, the feature path and the study all build the gate from it.
GATE_SETTINGS: dict[str, str] = {
    "tolerance": "utility_tolerance", "confidence": "gate_confidence",
    "max_quarantine_fraction": "max_quarantine_fraction", "leak_threshold": "leak_threshold",
    "attack_sample": "attack_sample", "deep_attack_sample": "deep_attack_sample", "min_probes": "min_probes",
    "utility_sample": "utility_sample", "utility_inconclusive": "utility_inconclusive",
    "folds": "cv_folds", "repeats": "cv_repeats", "n_components": "pca_components", "seed": "seed",
    "min_cluster_fraction": "min_cluster_fraction", "membership_max_advantage": "membership_max_advantage",
    "identity_check_max": "identity_embed_max"}


class _NoOne:
    """The person of a counterfeit row: equal to nobody but itself, so naming anyone for it is wrong."""

    def __repr__(self) -> str:
        return "<counterfeit: no one>"

    def __reduce__(self) -> str:
        return "COUNTERFEIT"  # unpickled as this module's one instance (the gate's parts run in other processes)


COUNTERFEIT = _NoOne()


@dataclass(frozen=True)
class Republished:
    """Registered clusters of a dataset's lineage that this release publishes again (:mod:`deid.release.lineage`).

    ``members[c]`` is the person of every registered basis record of cluster ``c`` (the records
    averaged into its stored image, from the earlier release); ``counterfeits[c]`` the counterfeit
    rows released with it (the stored image, the cluster's labels, no source and no original);
    ``images[c]`` its stored uint8 image (a feature release: its stored float vector), needed for
    every cluster with counterfeits. The drop's real records of these clusters (returning people,
    old and new photos) are ordinary gate records. How the gate counts them is explained in :func:`structural_checks` and
    :func:`privacy_checks`.
    """

    members: Mapping[Hashable, tuple[Hashable, ...]]
    counterfeits: Mapping[Hashable, int] = field(default_factory=dict)
    images: Mapping[Hashable, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = sorted(str(c) for c, n in self.counterfeits.items()
                     if n and (c not in self.members or c not in self.images))
        if bad:
            raise ConfigError(f"counterfeits of clusters {bad[:3]} need the cluster's registered members and its "
                              "stored image (Republished.members and .images)")


@dataclass(frozen=True)
class GateInputs:
    """The would-be release, one entry per released record, without holding its pixels.

    ``people[i]`` is record i's person (after id normalisation and merging of records
    recognised as the same person), ``clusters[i]`` its cluster (None for methods without
    clusters), ``partitions[i]`` its label partition, ``image_index[i]`` the index of its
    released image among the distinct released images, ``own_distance[i]`` the mean absolute
    grey difference between its released image and its own aligned original. ``fetch(idx)``
    returns ``(released, originals)`` pixel rows for the records ``idx`` (only the attacked
    sample is ever loaded). ``deidentify(images, people=..., partitions=...)`` re-runs the
    run's method with its k on other faces: the parrot attacker applies it to its gallery,
    the utility protocol to the training people. ``republished``: registered lineage clusters
    released again, with their registered members and counterfeit rows (:class:`Republished`).
    ``points``: each record's landmark points as the release's method got them (k-same-m's cluster
    shapes; None per record without, or None for a drop without points); ``deidentify`` gets those
    of the faces it re-runs, so the parrot and the utility protocol make what the release made.

    ``kind`` is ``"images"`` (faces: ``shape`` = (height, width), ``own_distance`` in grey
    levels) or ``"features"`` (feature vectors: ``shape`` = (n_features,), ``own_distance``
    Euclidean in the features' units); it selects the attackers (:data:`ATTACKERS` or
    :data:`FEATURE_ATTACKERS`, unless ``GateConfig.attackers`` names them), the leak rule and
    the release columns allowed.
    """

    shape: tuple[int, ...]
    people: np.ndarray
    image_index: np.ndarray
    own_distance: np.ndarray
    fetch: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    clusters: np.ndarray | None = None
    partitions: np.ndarray | None = None
    labels: dict[str, np.ndarray] = field(default_factory=dict)
    records_in: int = 0
    suppressed: int = 0
    quarantined: int = 0
    partition_failed: bool = False
    partition_detail: str = ""
    release_columns: tuple[str, ...] = ()
    file_metadata: dict[str, list[str]] = field(default_factory=dict)
    extra_checks: tuple[Check, ...] = ()
    deidentify: Callable[..., np.ndarray] | None = None
    republished: Republished | None = None
    kind: Literal["images", "features"] = "images"
    points: Sequence[Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("images", "features"):
            raise ConfigError(f"kind={self.kind!r} must be 'images' (faces) or 'features' (feature vectors)")

    @property
    def n(self) -> int:
        return int(len(self.people))

    @classmethod
    def from_arrays(cls, *, shape: tuple[int, int], people: Any, released: np.ndarray, originals: np.ndarray,
                    **kw: Any) -> "GateInputs":
        """Inputs from in-memory arrays (tests, notebooks, the study)."""
        released, originals = np.asarray(released), np.asarray(originals)
        if released.shape != originals.shape:
            raise ConfigError(f"released has shape {released.shape} but originals {originals.shape}; pass one "
                              "original per released record")
        _, index = unique_rows(released)
        own = (vector_distance(released, originals) if kw.get("kind") == "features"
               else mean_abs_difference(released, originals))
        return cls(shape=tuple(shape), people=np.asarray(people, dtype=object), image_index=index,
                   own_distance=own, fetch=lambda idx: (released[idx], originals[idx]), **kw)

    @classmethod
    def empty(cls, *, shape: tuple[int, int], **kw: Any) -> "GateInputs":
        """Nothing to release (empty drop, everything suppressed)."""
        z = np.zeros((0, math.prod(shape)), np.float32 if kw.get("kind") == "features" else np.uint8)
        return cls.from_arrays(shape=shape, people=[], released=z, originals=z, **kw)


@dataclass(frozen=True)
class GateResult:
    """Every check, the attack rates with their intervals, and the utility evidence."""

    checks: tuple[Check, ...]
    reidentification: tuple[dict, ...] = ()
    utility: tuple[dict, ...] = ()
    max_rate: float | None = None
    min_people: int | None = None
    max_person_share: float | None = None
    exact_bound: bool = False
    attack_sample: dict | None = None
    partitions: tuple[dict, ...] = ()  # per label partition: records, people, clusters, faces, feasible_max
    membership: dict | None = None  # membership disclosure (deid.evaluation.membership), None: not measured

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.detail or f'value {c.value} vs threshold {c.threshold}'}"
                for c in self.checks if not c.passed]

    @property
    def warnings(self) -> list[str]:
        out = [f"{c.name}: {c.detail}" for c in self.checks if c.passed and c.status == "inconclusive"]
        # A skipped cross-fit fold is a defect of the evidence, never silent (deid.evaluation.utility).
        out += [f"utility_{u['label']}: {u['folds_skipped']} of {u.get('folds_run')} cross-fit fold(s) skipped: "
                + "; ".join(u.get("skipped_folds") or []) for u in self.utility
                if u.get("protocol") == "cross-fit" and u.get("folds_skipped")]
        return out


# --------------------------------------------------------------------------- statistics


def clopper_pearson(successes: float, n: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """One-sided exact binomial bounds: (lower, upper), each holding with ``confidence``.

    Fractional successes (tie credit) are rounded outwards: down for the lower bound, up for
    the upper, so the interval stays conservative on both sides.

    References
    ----------
    C. J. Clopper, E. S. Pearson. The use of confidence or fiducial limits illustrated in the
    case of the binomial. Biometrika 26(4):404-413, 1934.
    """
    if n <= 0:
        return 0.0, 1.0
    alpha = 1.0 - confidence
    lo_x = max(0, min(n, math.floor(successes + 1e-9)))
    hi_x = max(0, min(n, math.ceil(successes - 1e-9)))
    lower = 0.0 if lo_x == 0 else float(beta.ppf(alpha, lo_x, n - lo_x + 1))
    upper = 1.0 if hi_x == n else float(beta.ppf(1 - alpha, hi_x + 1, n - hi_x))
    return lower, upper


# --------------------------------------------------------------------------- structure


def identical_within_clusters(image_index: Sequence[int], clusters: Sequence[Hashable] | None) -> bool:
    """True when every cluster's released rows are one distinct image (the k-Same structure)."""
    if clusters is None or len(image_index) == 0:
        return False
    c_codes, _ = value_codes(list(clusters))
    pairs = np.unique(np.stack([c_codes, np.asarray(image_index, dtype=np.int64)]), axis=1)
    return bool(pairs.shape[1] == len(np.unique(c_codes)))


def _clustered(method: str) -> bool:
    """Does the method form clusters (the registry says)? Unknown names are treated as clustered."""
    from deid.anonymise.methods import FEATURE_ONLY, REGISTRY  # noqa: PLC0415

    spec = REGISTRY.get(method) or FEATURE_ONLY.get(method)
    return True if spec is None else bool(spec.clustered)


def registered_rows(clusters: Sequence[Hashable], people: Sequence[Hashable],
                    members: Mapping[Hashable, Sequence[Hashable]]) -> tuple[list, list]:
    """Cluster and person of every row, a republished cluster's rows replaced by its registered basis.

    The image of a republished cluster is the average of its registered basis records (the earlier
    release's members), whoever of them is in this drop: its size, its distinct people and their
    shares are those of the basis. A republished cluster with no row in this drop is counted too.
    """
    keep = [(c, p) for c, p in zip(clusters, people) if c not in members]
    keep += [(c, p) for c, ps in members.items() for p in ps]
    return [c for c, _ in keep], [p for _, p in keep]


def republished_row_shares(clusters: Sequence[Hashable], people: Sequence[Hashable], republished: Republished
                           ) -> tuple[dict, dict]:
    """Per republished cluster: one person's largest share of its released rows, and of its real rows.

    Released rows are this drop's real rows plus the counterfeits, which belong to no one. Every row
    carries the identical image, so any recogniser names one person (or a tie) for all of them: the
    first share bounds its success on the cluster. The second is what an attacker who knows exactly
    who is in this drop learns: the real rows belong to the present members (evidence, see
    :func:`structural_checks`).
    """
    per: dict[Hashable, Counter] = {c: Counter() for c in republished.members}
    for c, p in zip(clusters, people):
        if c in per:
            per[c][p] += 1
    rows, real = {}, {}
    for c, counts in per.items():
        n_real = sum(counts.values())
        top = max(counts.values(), default=0)
        total = n_real + int(republished.counterfeits.get(c, 0))
        rows[c] = top / total if total else 0.0
        real[c] = top / n_real if n_real else 0.0
    return rows, real


# The drop's own checks (deid.evaluation.validation.drop_checks): when one fails, nothing was de-identified.
_DROP_CHECKS = ("drop_not_empty", "enough_people", "lineage_color", "lineage_canonical_size")


def structural_checks(inputs: GateInputs, config: GateConfig) -> tuple[list[Check], int | None, float | None, bool]:
    """Checks that need no model: cluster sizes, people and person shares per cluster, columns, accounting.

    Republished lineage clusters (``inputs.republished``) are counted twice, and both must hold.
    Their size, distinct people and person shares are those of their *registered basis*: the
    released image is the average of those records, so the k-anonymity of the image is the basis's
    (a drop where members are absent, or bring new photos, does not change the image). And one
    person's share of their *released rows*, counterfeits included as rows of no one, must stay
    <= 1/k: all rows carry one image, so that share is the exact bound on any recogniser naming a
    person for them (:func:`republished_row_shares`); a returning person with new photos is where
    it could exceed the basis share (the lineage plan pads or trims for it).
    """
    k = config.k
    n = inputs.n
    # A drop that failed its own checks (empty, fewer than k people) never reached de-identification:
    # that failure is the reason, not the empty release or the records it did not account for.
    held = [c.name for c in inputs.extra_checks if c.name in _DROP_CHECKS and not c.passed]
    if held and n == 0:
        why = f"not applicable: the drop failed {', '.join(held)}, so no record reached de-identification"
        checks = [Check("release_not_empty", True, n, ">= 1", why, status="not_applicable")]
    else:
        # n counts the records judged here: released if every check passes, withheld if the gate rejects.
        checks = [Check("release_not_empty", n > 0, n, ">= 1",
                        f"{n} de-identified records judged (released only if every check passes)" if n > 0
                        else "no record could be released")]
    min_people = share = None
    exact = False
    if n and inputs.clusters is not None and _clustered(config.method):
        rep = inputs.republished
        clusters, people = list(inputs.clusters), list(inputs.people)
        row_shares: dict = {}
        real_shares: dict = {}
        if rep is not None and rep.members:
            row_shares, real_shares = republished_row_shares(clusters, people, rep)
            clusters, people = registered_rows(clusters, people, rep.members)
        sizes, distinct, shares = cluster_shares(clusters, people)
        shares = {c: max(v, row_shares.get(c, 0.0)) for c, v in shares.items()}
        min_size, min_people, share = min(sizes.values()), min(distinct.values()), max(shares.values())
        exact = identical_within_clusters(inputs.image_index, list(inputs.clusters))
        unit, copy = ("records", "vector") if inputs.kind == "features" else ("images", "image")
        note = ""
        if row_shares:
            n_fake = sum(int(rep.counterfeits.get(c, 0)) for c in row_shares)
            note = (f"; {len(row_shares)} republished clusters counted on their registered members, and on their "
                    f"released rows with {n_fake} counterfeit rows of no one (largest share "
                    f"{max(row_shares.values()):.3f})")
        checks.append(Check("min_cluster_size", min_size >= k, min_size, f">= {k}",
                            f"{len(sizes)} clusters; smallest has {min_size} {unit}" + note))
        checks.append(Check("min_distinct_people_per_cluster", min_people >= k, min_people, f">= {k}",
                            f"smallest number of distinct people in a cluster: {min_people}" + note))
        worst = max(shares, key=shares.get)
        presence = ""
        if real_shares:
            presence = (f"; an attacker who knows exactly who is in this drop knows a republished cluster's real rows "
                        f"belong to its present members: up to {max(real_shares.values()):.3f} of them to one person "
                        "(1.0: one member present; DEID_LINEAGE_ABSENT=suppress withholds clusters with absent "
                        "members)")
        checks.append(Check(
            "max_person_share", within_bound(share, k), round(share, 6), f"<= {1.0 / k:.4f}",
            f"largest share of one person's {unit} in a cluster: {share:.3f} (cluster of {sizes[worst]} {unit}, "
            f"{distinct[worst]} people); " + (f"every cluster's members received the identical {copy}, so this is "
                                               "the exact bound on any recogniser's success"
                                               if exact else "clusters are not identical copies: the empirical "
                                               "attacks decide") + note + presence))
    elif n:
        checks.append(Check("min_cluster_size", True, None, f">= {k}",
                            f"not applicable: method {config.method} forms no clusters, so nothing structural "
                            "bounds re-identification; the empirical attacks decide (every upper bound <= 1/k)",
                            status="not_applicable"))
        # Invariant 1 (every released image is shared by a cluster of >= k distinct people) is what the
        # report validator enforces before anything is published: a method that releases one image per
        # face is rejected here, with its reason, instead of failing that validation after the gate
        # (a "state" error, exit 70). Its attack figures stay in the report as evidence.
        checks.append(Check("released_in_clusters", False, 1, f">= {k} distinct people per released image",
                            f"method {config.method} releases one image per face (no cluster of k people shares "
                            "it): a release needs every image shared by >= k distinct people; use a k-Same "
                            f"method ({', '.join(CLUSTER_METHODS)})"))
    base = FEATURE_RELEASE_BASE_COLUMNS if inputs.kind == "features" else RELEASE_BASE_COLUMNS
    columns = inputs.release_columns or (*base, *config.labels)
    allowed = set(base) | set(config.labels)
    bad = sorted(set(columns) - allowed)
    forbidden = sorted(set(columns) & set(FORBIDDEN_RELEASE_COLUMNS))
    checks.append(Check("no_forbidden_columns", not bad and not forbidden, bad or forbidden or [],
                        sorted(allowed), "release columns: " + ", ".join(columns)))
    total = n + inputs.suppressed + inputs.quarantined
    if held and n == 0:
        checks.append(Check("records_accounted", True, total, f"= {inputs.records_in}", why, status="not_applicable"))
    else:
        checks.append(Check("records_accounted", total == inputs.records_in, total, f"= {inputs.records_in}",
                            f"judged {n} (released, or withheld if rejected) + suppressed {inputs.suppressed} + "
                            f"quarantined {inputs.quarantined} = {total} of {inputs.records_in} in"))
    if inputs.partition_failed:
        checks.append(Check("small_partitions", False, "fail", "every partition >= k people",
                            inputs.partition_detail or "a label partition has fewer than k distinct people"))
    checks.append(quarantine_fraction_check(inputs.records_in, inputs.quarantined, config.max_quarantine_fraction))
    return checks, min_people, share, exact


def _clusters_people(method: str) -> bool:
    """Does the method cluster people rather than images (the registry says)? Unknown names: no."""
    from deid.anonymise.methods import FEATURE_ONLY, REGISTRY  # noqa: PLC0415

    spec = REGISTRY.get(method) or FEATURE_ONLY.get(method)
    return spec is not None and spec.clusters_people


def partition_grouping(inputs: GateInputs, k: int, *, per_person: bool = False) -> list[dict]:
    """Per label partition: records, people, clusters formed, distinct released faces and the feasible maximum.

    The feasible maximum is :func:`deid.anonymise.ksame.feasible_clusters` of the partition's images per
    person (``floor(records / k)`` when any grouping exists, else 0); with ``per_person`` (a method that
    clusters people: ``MethodSpec.clusters_people``) of one per person (``floor(people / k)``). Partitions are
    named by their opaque key (``p000``; the report's configuration maps keys to label values), never by a
    label value.
    """
    parts = inputs.partitions if inputs.partitions is not None else np.zeros(inputs.n, dtype=object)
    p_codes, p_keys = value_codes(parts)  # the columns as they are: no list copy of a million records
    c_codes, _ = value_codes(inputs.clusters)
    who, _ = value_codes(inputs.people)
    image = np.asarray(inputs.image_index)
    rows = []
    for j, key in enumerate(p_keys):
        m = p_codes == j
        counts = np.bincount(who[m])
        rows.append({"partition": "all" if inputs.partitions is None else str(key), "records": int(m.sum()),
                     "people": int(np.count_nonzero(counts)), "clusters": int(np.unique(c_codes[m]).size),
                     "faces": int(np.unique(image[m]).size),
                     # A method clustering people: each person counts once (a video of 20 frames is one person).
                     "feasible_max": feasible_clusters(np.minimum(counts, 1) if per_person else counts, k)})
    return rows


def partition_clusters_check(rows: Sequence[Mapping[str, Any]], config: GateConfig) -> Check:
    """Every partition keeps at least ``min_cluster_fraction`` of the clusters a grouping could form (issue 26).

    A partition whose people hold skewed numbers of photos could collapse into a handful of
    clusters (one released face for hundreds of records): the k rules hold, but the release has lost
    that partition's faces. The feasible maximum is exact (a person with ``c`` photos needs ``c``
    clusters; :func:`deid.anonymise.ksame.feasible_clusters`), so this check is a count, not an estimate.
    """
    judged = [r for r in rows if r["feasible_max"] > 0]
    worst = min(judged, key=lambda r: r["clusters"] / r["feasible_max"], default=None)
    table = "; ".join(f"{r['partition']}: {r['records']} records of {r['people']} people -> {r['clusters']} clusters "
                      f"of {r['feasible_max']} feasible" for r in rows)
    if worst is None:
        return Check("partition_clusters", True, None, f">= {config.min_cluster_fraction:g} x feasible maximum",
                     f"not applicable: no partition can form a cluster of {config.k} people ({table})",
                     status="not_applicable")
    ratio = worst["clusters"] / worst["feasible_max"]
    ok = ratio >= config.min_cluster_fraction
    return Check("partition_clusters", ok, round(ratio, 4), f">= {config.min_cluster_fraction:g} x feasible maximum",
                 (f"every partition keeps >= {config.min_cluster_fraction:g} of the clusters its people allow"
                  if ok else f"partition {worst['partition']} collapsed: {worst['records']} records released as "
                  f"{worst['clusters']} clusters where {worst['feasible_max']} were feasible ({ratio:.2f} < "
                  f"{config.min_cluster_fraction:g}); its labels' faces are lost")
                 + f" (lowest {ratio:.3f}; {table})")


def closeness_check(inputs: GateInputs, config: GateConfig) -> Check:
    """No cluster's image is much closer to one member's face than clusters normally are.

    A cluster made of one person's photographs under several subject ids averages away the
    noise and releases that person's face; its image then sits far closer to one member's
    original than a real average of k different people does. Each cluster's distance to its
    closest member (mean absolute grey difference) is compared with the median of that
    distance over all clusters. Measured (k-Same, k = 2..10): the smallest ratio was 0.65 on
    London and 0.56 on synthetic drops; five noisy copies of one face (sigma 3) gave ~0.2.
    Records under different ids with near-identical faces are merged into one person before
    clustering (:mod:`deid.anonymise.identity`); this check is the backstop on the released images.
    """
    name = "cluster_not_close_to_one_member"
    if inputs.clusters is None or inputs.n == 0 or not _clustered(config.method):
        return Check(name, True, None, None, "not applicable: no clusters", status="not_applicable")
    c_codes, keys = value_codes(list(inputs.clusters))
    if len(keys) < 5:
        return Check(name, True, None, None, f"not applicable: {len(keys)} clusters are too few for a typical "
                     "distance (needs 5)", status="not_applicable")
    d = np.asarray(inputs.own_distance, dtype=np.float64)
    closest = np.full(len(keys), np.inf)
    np.minimum.at(closest, c_codes, d)
    typical = float(np.median(closest))
    limit = config.closeness_ratio * typical
    worst = int(np.argmin(closest))
    bad = int(np.count_nonzero(closest < limit))
    unit = "(Euclidean, feature units)" if inputs.kind == "features" else "grey levels"
    return Check(name, bad == 0, round(float(closest[worst]), 3), f">= {limit:.3f}",
                 f"{bad} of {len(keys)} clusters lie within {config.closeness_ratio:g} x the median closest-member "
                 f"distance ({typical:.2f} {unit}) of one member; closest {closest[worst]:.2f}")


# --------------------------------------------------------------------------- attacks


def attack_sample(inputs: GateInputs, *, max_records: int, seed: int, min_units: int = 0) -> np.ndarray:
    """Indices of the records attacked: all of them, or whole clusters (or people) at random.

    Sampling whole clusters keeps every cluster's k people together, so the attacker still
    faces the k-way ambiguity the release has; the gallery shrinks to the sample's people,
    which only makes the attacks stronger.

    ``min_units``: at least this many whole clusters (people) when the release has them, even
    beyond ``max_records`` (the gate passes ``GateConfig.min_probes``). A k-Same cluster is one
    distinct released image, so a sample of fewer clusters gives its naive and parrot modes fewer
    distinct probes than a rate needs to be evidence (:func:`privacy_checks`). The extra units are
    the next ones of the same seeded order: the sample only grows.
    """
    n = inputs.n
    if n <= max_records:
        return np.arange(n)
    units = inputs.clusters if inputs.clusters is not None and len(set(inputs.clusters)) < inputs.n else inputs.people
    codes, keys = value_codes(list(units))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(keys))
    sizes = np.bincount(codes, minlength=len(keys))
    take = order[np.cumsum(sizes[order]) <= max_records]
    if len(take) < min(max(int(min_units), 1), len(keys)):
        take = order[:max(int(min_units), 1)]
    return np.flatnonzero(np.isin(codes, take))


def gate_attack_sample(inputs: GateInputs, config: GateConfig) -> np.ndarray:
    """The gate's attacked records: ``attack_sample`` records, at least ``min_probes`` whole clusters (people)."""
    return attack_sample(inputs, max_records=config.attack_sample, seed=config.seed, min_units=config.min_probes)


def counterfeit_sample(inputs: GateInputs, idx: np.ndarray, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The counterfeit rows attacked with the sampled records ``idx``: (uint8 images, people = no one).

    Every counterfeit of a republished cluster the sample holds real records of, and of the
    clusters released with counterfeits only, a seeded share as large as the sample's share of the
    release's clusters (all of them when the whole release is attacked).
    """
    rep = inputs.republished
    width = int(np.prod(inputs.shape))  # (h, w) faces or (n_features,) vectors
    dtype = np.float32 if inputs.kind == "features" else np.uint8  # as released: pixels, or float32 vectors
    none = np.zeros((0, width), dtype), np.zeros(0, dtype=object)
    if rep is None or not any(rep.counterfeits.values()) or inputs.clusters is None:
        return none
    present = set(inputs.clusters.tolist())
    sampled = set(inputs.clusters[np.asarray(idx, dtype=np.int64)].tolist())
    only = sorted((c for c, m in rep.counterfeits.items() if m and c not in present), key=str)
    n_only = len(only) if len(sampled) >= len(present) else round(len(only) * len(sampled) / max(len(present), 1))
    chosen = [only[i] for i in sorted(np.random.default_rng(seed).permutation(len(only))[:n_only])]
    keys = [c for c in sorted(sampled & set(rep.counterfeits), key=str) if rep.counterfeits[c]] + chosen
    if not keys:
        return none
    images = np.vstack([np.broadcast_to(np.asarray(rep.images[c], dtype=dtype).reshape(1, -1),
                                        (int(rep.counterfeits[c]), width)) for c in keys])
    return images, np.full(len(images), COUNTERFEIT, dtype=object)


def _points_of(inputs: GateInputs, idx: np.ndarray) -> list | None:
    """The landmark points of the records ``idx`` (None when the release's method got none)."""
    return None if inputs.points is None else [inputs.points[int(i)] for i in idx]


def _parrot(deidentify: Callable[..., np.ndarray], people: np.ndarray, partitions: np.ndarray | None,
            labels: dict[str, np.ndarray] | None = None, points: list | None = None
            ) -> Callable[[np.ndarray], np.ndarray]:
    """The parrot attacker de-identifies its own gallery of originals the way the release was made.

    With the same inputs as the release: its people, partitions, labels and, where the method
    took them, the landmark points (a k-same-m release shaped from points is not re-made by flow).
    """
    extra = {} if points is None else {"points": points}
    return lambda originals: deidentify(originals, people=people, partitions=partitions,
                                        labels={x: list(v) for x, v in (labels or {}).items()} or None, **extra)


def attack_modes(inputs: GateInputs, config: GateConfig) -> tuple[str, ...]:
    """The configured attack modes this release can be attacked in (parrot needs the method)."""
    return tuple(m for m in config.modes if m != "parrot" or inputs.deidentify is not None)


def attack_groups(inputs: GateInputs, config: GateConfig) -> list[tuple[int | None, tuple[str, ...]]]:
    """The attackers in order, grouped by the records they can afford: (cap or None for all, names).

    Attackers that can afford the whole sample share one pass (one parrot gallery, one set of
    distinct images); an attacker may cap the records it attacks (a deep recogniser embeds
    every face it sees).
    """
    default = FEATURE_ATTACKERS if inputs.kind == "features" else ATTACKERS
    names = list(config.attackers) if config.attackers is not None else list(default)
    groups: dict[int | None, list[str]] = {}
    for name in names:
        groups.setdefault(config.deep_attack_sample if name in DEEP_ATTACKERS else None, []).append(name)
    return [(cap, tuple(group)) for cap, group in groups.items()]


def attack_rows(inputs: GateInputs, config: GateConfig, *, cap: int | None, attackers: Sequence[str],
                on_pair: Callable[[str, str], None] | None = None) -> list[dict]:
    """Rates of ``attackers`` in every mode on the attacked sample (at most ``cap`` records of it).

    Rows of one attacker do not depend on which others run in the same call: the gate may run
    its attackers one call each, in other processes, and get the same rows.
    """
    idx = gate_attack_sample(inputs, config)
    released, originals = inputs.fetch(idx)
    people = inputs.people[idx]
    modes = attack_modes(inputs, config)
    parts = None if inputs.partitions is None else inputs.partitions[idx]
    labs = {x: np.asarray(v)[idx] for x, v in inputs.labels.items()}
    sub = np.arange(len(idx))
    if cap is not None and len(idx) > cap:
        sub_inputs = replace(inputs, people=people, clusters=None if inputs.clusters is None else inputs.clusters[idx])
        sub = attack_sample(sub_inputs, max_records=cap, seed=config.seed + 1, min_units=config.min_probes)
    pts = _points_of(inputs, idx)
    parrot = None if "parrot" not in modes else _parrot(
        inputs.deidentify, people[sub], None if parts is None else parts[sub], {x: v[sub] for x, v in labs.items()},
        None if pts is None else [pts[i] for i in sub])
    fake, no_one = counterfeit_sample(inputs, idx[sub], seed=config.seed + 2)
    rel = np.vstack([released[sub], fake]) if len(fake) else released[sub]
    rows = attack_all(originals=originals[sub], original_people=people[sub], released=rel,
                      released_people=np.concatenate([people[sub], no_one]), shape=inputs.shape, modes=modes,
                      parrot=parrot, attackers=list(attackers), on_pair=on_pair)
    for r in rows:
        r["records"] = int(len(sub))
    return rows


def privacy_checks(inputs: GateInputs, config: GateConfig, *, exact: bool, rows: list[dict] | None = None
                   ) -> tuple[list[Check], list[dict], float | None, dict]:
    """Every attacker in every mode on a bounded sample, each rate with its interval.

    ``rows``: the attack rows (:func:`attack_rows` of every :func:`attack_groups` group, in that
    order) when they were computed elsewhere; by default they are computed here.

    Counterfeit rows of republished lineage clusters (``inputs.republished``) are attacked as what
    they are in the release: rows that carry their cluster's stored image and labels, under a
    random name, in random order, and belong to no one. They join the released side of every mode
    (naive and parrot probes, the reverse gallery) with a person that matches nobody; they have no
    original, so they are never a reverse probe nor in a gallery of originals. An attacker holding
    every release cannot tell them from the real rows of their cluster (bit-identical), so naming
    a person for one is wrong and, in the reverse gallery, they take their share of a tie. The
    gallery of originals holds this drop's real records: the absent members' faces are not in the
    drop. For a fixed recogniser, leaving them out can only raise the credit of a released row
    (fewer candidates to lose to: naive and parrot modes; the reverse mode's probes are this drop's
    faces either way), so the rates are those of an attacker who also knows who is absent, and at
    least those of one who holds the absent members' faces and does not know they left (the
    m-invariance premise). A returning person's new photo is a real record with its own original,
    released as the registered image: an ordinary probe and gallery item.

    Measuring this drop's real rows alone (counterfeits dropped) is not the release's rate: it
    conditions on knowing which rows are real, which the release hides, and it would exceed 1/k
    for release 1's own rows restricted to the people who came back. What an attacker who knows
    who is present does learn (a cluster's real rows belong to its present members) is stated by
    ``max_person_share`` (:func:`structural_checks`).

    Evidence before a figure: a row from fewer than ``config.min_probes`` distinct probes gets the
    status ``insufficient_evidence`` (its n and interval are kept); it is never the headline
    ``max_rate`` and never decides the check. The other rows get ``pass`` or ``fail`` by the rule
    above. The samples take at least ``min_probes`` whole clusters (:func:`gate_attack_sample`), so
    a row is short of probes only when the release itself has fewer distinct images than that
    (e.g. a partition released as one cluster). If every row is short, ``max_rate`` is None and the
    check is ``inconclusive``: it lets an exact release (identical images per cluster) through, whose
    privacy the exact structural checks decide, and blocks any other (nothing bounds it).
    """
    k = config.k
    if inputs.n == 0:
        return [Check("reidentification_rate", False, None, f"<= {1.0 / k:.4f}", "nothing released to attack")], \
            [], None, {}
    idx = gate_attack_sample(inputs, config)
    if rows is None:
        groups = attack_groups(inputs, config)
        progress = Progress(f"gate: attacks on {len(idx)} records", unit="attacker x mode pairs").start(
            sum(len(g) for _, g in groups) * len(attack_modes(inputs, config)))
        rows = [r for cap, group in groups for r in attack_rows(
            inputs, config, cap=cap, attackers=group, on_pair=lambda a, m: progress.advance(note=f"{a}/{m}"))]
    m = len(rows)
    # Bonferroni: the family of m one-sided tests keeps the stated confidence overall (every row counts in the
    # family, whether or not it has the evidence to decide: the bounds stay those of the whole family).
    level = 1.0 - (1.0 - config.confidence) / m
    bound = 1.0 / k
    need = config.min_probes
    failing, thin = [], []
    for r in rows:
        lo, hi = clopper_pearson(r["rate"] * r["n_probes"], r["n_probes"], confidence=level)
        r["lower"], r["upper"] = round(lo, 6), round(hi, 6)
        r["rate"] = round(r["rate"], 6)
        r.pop("credit", None)
        above = not within_bound(lo if exact else hi, limit=bound)
        if r["n_probes"] < need:
            # Too few distinct probes to be evidence: kept in the report with its n and interval, never the
            # headline, never deciding (a [0, 1] interval from one probe says nothing about the release).
            r["status"] = INSUFFICIENT
            thin.append(r)
        else:
            r["status"] = "fail" if above else "pass"
            if above:
                failing.append(r)
    sample = {"records": int(len(idx)), "of": inputs.n, "seed": config.seed,
              "unit": "cluster" if inputs.clusters is not None else "person", "confidence": config.confidence,
              "bonferroni_over": m, "min_probes": need, "insufficient": len(thin)}
    n_fake = len(counterfeit_sample(inputs, idx, seed=config.seed + 2)[0])
    fake_note = ""
    if n_fake:
        sample["counterfeits"] = n_fake
        fake_note = (f"; {n_fake} counterfeit rows of republished lineage clusters attacked as released rows of no "
                     "one (no original)")
    thin_note = ""
    if thin:
        most = max(r["n_probes"] for r in thin)
        thin_note = (f"; {len(thin)} of {m} pairs insufficient evidence (fewer than {need} distinct probes, at most "
                     f"{most}: {', '.join(sorted({r['attacker'] + '/' + r['mode'] for r in thin}))}): reported, "
                     "neither the headline nor deciding")
    deciding = [r for r in rows if r["status"] != INSUFFICIENT]
    if not deciding:
        most = max(rows, key=lambda r: r["n_probes"])
        units = len(set(inputs.clusters.tolist())) if inputs.clusters is not None else len(set(inputs.people.tolist()))
        why = (f"insufficient evidence: every one of {m} attacker x mode pairs had fewer than {need} distinct probes "
               f"(at most {most['n_probes']}, {most['attacker']}/{most['mode']}; the release has {units} "
               f"{'clusters' if inputs.clusters is not None else 'people'}), so no rate is a headline or a decision")
        if exact:
            detail = (why + "; every cluster's members share one image, so the exact structural checks "
                      "(min_distinct_people_per_cluster, max_person_share) decide privacy" + fake_note)
        else:
            detail = (why + "; the clusters are not identical copies, so no exact bound stands in for the attacks: "
                      "nothing shows the release keeps 1/k (more records, or a k-Same method)" + fake_note)
        check = Check("reidentification_rate", exact, None, f"<= {bound:.4f}", detail, status="inconclusive",
                      interval=(most["lower"], most["upper"]), n=most["n_probes"])
        return [check], rows, None, sample
    worst = max(deciding, key=lambda r: r["rate"])
    max_rate = worst["rate"]
    rule = ("fails only if a lower bound exceeds 1/k (the exact bound max_person_share decides)" if exact
            else "every upper bound must be <= 1/k (no exact bound: clusters are not identical copies)")
    detail = (f"max over {len(deciding)} attacker x mode pairs with at least {need} distinct probes: "
              f"{worst['attacker']}/{worst['mode']} {worst['rate']:.3f} "
              f"[{worst['lower']:.3f}, {worst['upper']:.3f}] on {worst['n_probes']} distinct probes; "
              f"one-sided {config.confidence:.0%} Clopper-Pearson, Bonferroni over {m}; {rule}")
    if failing:
        f0 = max(failing, key=lambda r: r["upper"])
        detail += (f"; {len(failing)} failing, e.g. {f0['attacker']}/{f0['mode']} {f0['rate']:.3f} "
                   f"[{f0['lower']:.3f}, {f0['upper']:.3f}]")
    detail += thin_note + fake_note
    check = Check("reidentification_rate", not failing, max_rate, f"<= {bound:.4f}", detail,
                  interval=(worst["lower"], worst["upper"]), n=worst["n_probes"])
    return [check], rows, max_rate, sample


def membership_disclosure(inputs: GateInputs, config: GateConfig) -> dict:
    """Membership disclosure of the release's method on the attacked sample (:mod:`deid.evaluation.membership`).

    The attacked sample's people are split at random into members and non-members; the run's method
    re-makes a release from the members alone (as the parrot attacker does), and every configured
    attacker that can afford the sample (deep recognisers only within ``deep_attack_sample`` records)
    tells members from non-members by their photos' nearest released face. k-Same bounds linking a
    released face to a person (1/k), not this: the figure stands beside the 1/k rate.
    """
    if inputs.deidentify is None:
        return {"status": "not_applicable", "reason": "the run's method cannot be re-run on a subset of people"}
    idx = gate_attack_sample(inputs, config)
    _, originals = inputs.fetch(idx)
    default = FEATURE_ATTACKERS if inputs.kind == "features" else ATTACKERS
    names = list(config.attackers) if config.attackers is not None else list(default)
    names = [a for a in names if a not in DEEP_ATTACKERS or len(idx) <= config.deep_attack_sample]
    known = {**ATTACKERS, **FEATURE_ATTACKERS}
    log.info("gate: membership disclosure on %d records, %d attackers", len(idx), len(names))
    out = measure_membership(
        originals=originals, people=inputs.people[idx], shape=inputs.shape, deidentify=inputs.deidentify,
        attackers={a: known[a] for a in names}, partitions=None if inputs.partitions is None else
        inputs.partitions[idx], labels={x: np.asarray(v)[idx] for x, v in inputs.labels.items()},
        points=_points_of(inputs, idx), confidence=config.confidence, seed=config.seed)
    out["records"] = int(len(idx))
    return out


def leak_checks(inputs: GateInputs, config: GateConfig) -> list[Check]:
    """No released face is (nearly) a copy of an original; no released file carries metadata."""
    threshold = config.leak_threshold
    checks = []
    if inputs.n and inputs.kind == "features":
        checks.append(feature_near_copy_check(inputs, config))
    elif inputs.n:
        # Every record against its own original (O(N)); all pairs on the bounded sample.
        own = np.asarray(inputs.own_distance)
        idx = gate_attack_sample(inputs, config)
        released, originals = inputs.fetch(idx)
        fake, _ = counterfeit_sample(inputs, idx, seed=config.seed + 2)  # stored images released again
        distinct, _ = unique_rows(np.vstack([released, fake]) if len(fake) else released)
        cross, _ = nearest_original_distance(distinct, originals, threshold=threshold)
        low = float(min(own.min(), cross.min()))
        n_ident = int(np.count_nonzero(own == 0) + np.count_nonzero(cross == 0))
        n_below = int(np.count_nonzero(own < threshold) + np.count_nonzero(cross < threshold))
        checks.append(Check("no_near_copies", low >= threshold, round(low, 4), f">= {threshold}",
                            f"{n_ident} identical and {n_below} within {threshold} grey levels (mean absolute "
                            f"difference) of an original aligned face; every record vs its own original, and "
                            f"{len(distinct)} distinct released images vs {len(idx)} originals"))
    if inputs.n and inputs.clusters is not None:
        checks.append(one_person_clusters_check(inputs, config))
    bad_files = sorted(inputs.file_metadata)
    checks.append(Check("no_source_metadata", not bad_files, len(bad_files), "= 0",
                        "clean" if not bad_files else f"{bad_files[:5]} carry {inputs.file_metadata[bad_files[0]]}"))
    return checks


def one_person_clusters_check(inputs: GateInputs, config: GateConfig) -> Check:
    """No released cluster is one person under several ids (:mod:`deid.evaluation.identity_checks`).

    The clusters of the gate's attack sample (whole clusters; every cluster of a release of at most
    ``attack_sample`` records); faces go through a cheap first pass over every one of them, the
    recogniser (at most ``identity_check_max`` faces) on the ones it flags.
    """
    from deid.evaluation import identity_checks  # noqa: PLC0415

    idx = gate_attack_sample(inputs, config)  # the sample the leak checks read (read once: _read_samples_once)
    released, originals = inputs.fetch(idx)
    clusters, people = np.asarray(inputs.clusters, dtype=object)[idx], inputs.people[idx]
    if inputs.kind == "features":
        return identity_checks.feature_check(clusters, people, originals, released, confidence=config.confidence)
    return identity_checks.image_check(clusters, people, originals, released, shape=tuple(inputs.shape),
                                       budget=config.identity_check_max, total=inputs.n,
                                       confidence=config.confidence, seed=config.seed)


def feature_near_copy_check(inputs: GateInputs, config: GateConfig) -> Check:
    """No released feature vector is (nearly) a copy of an original vector.

    Vectors have no grey levels: the threshold is ``feature_near_copy_ratio`` (0.2) times the
    median distance from an original to the nearest record of *another* person, measured on the
    attacked sample's originals (the typical distance between different people). Every record
    is compared with its own original (``own_distance``), the sample's distinct released
    vectors with every original of the sample.
    """
    own = np.asarray(inputs.own_distance, dtype=np.float64)
    idx = gate_attack_sample(inputs, config)
    released, originals = inputs.fetch(idx)
    distinct, _ = unique_rows(np.ascontiguousarray(released))
    cross = nearest_vector_distance(distinct, originals)
    scale = other_person_scale(originals, inputs.people[idx])
    low = float(min(own.min(), cross.min()))
    n_ident = int(np.count_nonzero(own == 0) + np.count_nonzero(cross == 0))
    if scale is None or scale <= 0:
        ok = n_ident == 0
        return Check("no_near_copies", ok, round(low, 6), "> 0",
                     f"{n_ident} released vectors identical to an original; the sample holds one person, so no "
                     "typical distance between people sets a near-copy threshold", status="pass" if ok else "fail")
    threshold = config.feature_near_copy_ratio * scale
    n_below = int(np.count_nonzero(own < threshold) + np.count_nonzero(cross < threshold))
    return Check("no_near_copies", low >= threshold, round(low, 6), f">= {threshold:.6g}",
                 f"{n_ident} identical and {n_below} within {config.feature_near_copy_ratio:g} x the median "
                 f"nearest-other-person distance ({scale:.4g}, Euclidean) of an original vector; every record vs "
                 f"its own original, and {len(distinct)} distinct released vectors vs {len(idx)} originals")


# --------------------------------------------------------------------------- the gate


def evaluate(inputs: GateInputs, config: GateConfig, *, executor: Any = None,
             helper: GateHelper | None = None) -> GateResult:
    """Run every check on the would-be release; the release passes only if none blocks.

    Parameters
    ----------
    inputs : GateInputs
        The released records with their originals, people, clusters and labels.
    config : GateConfig
        k, method, bounds and sample sizes.
    executor : deid.pool.Executor, optional
        Runs the attackers and the utility protocols as separate calls (e.g. on a small run's
        process pool, :func:`parallel_parts`); the result is the same as without it.
    helper : GateHelper, optional
        A large release's helper process, started before the gate (:meth:`GateHelper.start`);
        the caller closes it. Without one, a large release's gate starts its own.

    Returns
    -------
    GateResult

    References
    ----------
    E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images. IEEE
    TKDE 17(2):232-243, 2005. R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility
    into face de-identification. PET 2005, LNCS 3856, 227-242.
    """
    if helper is not None:
        return _evaluate(inputs, config, executor=executor, pool=helper.pool, ready=helper.ready())
    # A large release's helper process starts first: its imports overlap the checks and the reading below.
    pool = _start_helper() if executor is None and _helper_size(inputs, config) else None
    try:
        return _evaluate(inputs, config, executor=executor, pool=pool)
    finally:
        if pool is not None:
            pool.close()


def _evaluate(inputs: GateInputs, config: GateConfig, *, executor: Any, pool: Any,
              ready: Mapping[tuple, Callable[[], Any]] | None = None) -> GateResult:
    """:func:`evaluate` with the helper ``pool`` a large release started (or None); ``ready``: parts it ran ahead."""
    checks, min_people, share, exact = structural_checks(inputs, config)
    grouping: tuple[dict, ...] = ()
    if inputs.n and inputs.clusters is not None and _clustered(config.method):
        grouping = tuple(partition_grouping(inputs, config.k, per_person=_clusters_people(config.method)))
        if config.min_cluster_fraction > 0:
            checks.append(partition_clusters_check(grouping, config))
    checks.extend(inputs.extra_checks)
    inputs = _read_samples_once(inputs, config)
    reid: list[dict] = []
    util: list[dict] = []
    max_rate = None
    sample = None
    membership = None
    if inputs.n:
        checks.append(closeness_check(inputs, config))
        if _parallel(inputs, executor):
            parts = parallel_parts(inputs, config, executor)
        elif _parallel(inputs, pool):
            parts = parallel_parts(inputs, config, pool, large=True, **({"ready": ready} if ready else {}))
        else:
            parts = serial_parts(inputs, config)
        p_checks, reid, max_rate, sample = privacy_checks(inputs, config, exact=exact, rows=parts.attack_rows)
        checks.extend(p_checks)
        log.info("gate: max re-identification rate %s over %d attacker x mode pairs (bound %.4f)",
                 "insufficient evidence" if max_rate is None else f"{max_rate:.4f}", len(reid), 1 / config.k)
        checks.extend(leak_checks(inputs, config) if parts.leaks is None else parts.leaks)
        membership = membership_disclosure(inputs, config) if parts.membership is None else parts.membership
        checks.append(membership_check(membership, config.membership_max_advantage))
        u_checks, util = parts.utility
        checks.extend(u_checks)
    result = GateResult(checks=tuple(checks), reidentification=tuple(reid), utility=tuple(util),
                        max_rate=max_rate, min_people=min_people, max_person_share=share, exact_bound=exact,
                        attack_sample=sample, partitions=grouping, membership=membership)
    log.info("gate: %s%s", "passed" if result.passed else "failed",
             "" if result.passed else " - " + "; ".join(result.reasons))
    return result


def _read_samples_once(inputs: GateInputs, config: GateConfig) -> GateInputs:
    """The same inputs whose ``fetch`` serves the attack and utility samples from one read.

    ``fetch`` streams the staged release from disk; the attacked sample and the utility sample
    differ when the release is large, and one pass over their union halves the reading.
    """
    if not inputs.n:
        return inputs
    wanted = [gate_attack_sample(inputs, config)]
    if config.labels and inputs.deidentify is not None:
        wanted.append(people_sample(inputs, max_records=config.utility_sample, seed=config.seed))
    union = np.unique(np.concatenate(wanted)).astype(np.int64)
    if isinstance(inputs.fetch, SampleFetch) and np.array_equal(inputs.fetch.index, union):
        return inputs  # read already (a helper's prepared inputs, GateHelper)
    released, originals = inputs.fetch(union)
    return replace(inputs, fetch=SampleFetch(union, released, originals, inputs.fetch))


@dataclass(frozen=True)
class SampleFetch:
    """``fetch`` from pre-read rows ``index`` (sorted), other records from ``fallback``.

    Without a fallback (the copy sent to another process: a reader of the staged release does
    not travel) asking for other records is an error.
    """

    index: np.ndarray
    released: np.ndarray
    originals: np.ndarray
    fallback: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None

    def __call__(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(idx, dtype=np.int64)
        at = np.searchsorted(self.index, idx)
        if len(idx) and (at.max() >= len(self.index) or not np.array_equal(self.index[at], idx)):
            if self.fallback is None:
                raise ValueError("records outside the gate's pre-read samples asked of a detached fetch")
            return self.fallback(idx)  # not one of the pre-read samples
        return self.released[at], self.originals[at]


# --------------------------------------------------------------------------- parallel parts


@dataclass(frozen=True)
class ParallelParts:
    """What :func:`parallel_parts` (or :func:`serial_parts`) computed: the attack rows in gate order, the utility
    checks and rows, and (when computed there) the leak checks and the membership disclosure."""

    attack_rows: list[dict]
    utility: tuple[list[Check], list[dict]]
    leaks: list[Check] | None = None
    membership: dict | None = None


def _parallel(inputs: GateInputs, executor: Any) -> bool:
    """Worth running in parts: more than one worker, and the inputs travel to other processes."""
    if executor is None or getattr(executor, "workers", 1) < 2 or not isinstance(inputs.fetch, SampleFetch):
        return False
    try:
        pickle.dumps(inputs.deidentify)
    except Exception:  # noqa: BLE001 - any closure or lambda: run in this process
        log.debug("gate: the method runner cannot be sent to other processes; parts run here")
        return False
    return True


def gate_part(part: str, inputs: GateInputs, config: GateConfig, *, cap: int | None = None,
              attackers: tuple[str, ...] = (), descriptors: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
    """One part of the gate (a call of :func:`parallel_parts`): ``attack``, ``cross-fit``, ``protocols`` or ``leaks``.

    ``descriptors`` are (faces, dlib descriptors) the calling process already had: primed here,
    so a deep attacker embeds each original once per run, whichever process it runs in.
    """
    if descriptors is not None and len(descriptors[0]):
        from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415 (dlib import cost)

        DlibEmbedder(tuple(inputs.shape)).prime(*descriptors)
    if part == "attack":
        return attack_rows(inputs, config, cap=cap, attackers=attackers)
    if part == "cross-fit":
        return cross_fit_checks(inputs, config)
    if part == "protocols":
        return protocol_rows(inputs, config)
    if part == "leaks":
        return leak_checks(inputs, config)
    raise ValueError(f"part={part!r} must be 'attack', 'cross-fit', 'protocols' or 'leaks'")


def _timed_part(label: str, **kwargs: Any) -> tuple[str, float, Any]:
    """:func:`gate_part` with its name and measured seconds (for the gate's progress lines and time left)."""
    t0 = time.perf_counter()
    result = gate_part(**kwargs)
    return label, time.perf_counter() - t0, result


# Relative prior costs of the gate's parts for the time-left estimate (deid.progress.PartsProgress scales
# them by the parts' measured seconds): the deep recogniser and the cross-fit dominate.
_PART_WEIGHT = {"attack-deep": 4.0, "cross-fit": 3.0, "protocols": 2.0, "membership": 2.0, "leaks": 1.0,
                "attack": 1.0}


def _part_label(call: Mapping[str, Any]) -> str:
    """A part's name in the progress lines: ``attack dlib-resnet``, ``cross-fit`` ..."""
    names = call.get("attackers") or ()
    return f"attack {'+'.join(names)}" + (f" (cap {call['cap']})" if call.get("cap") is not None else "") \
        if call["part"] == "attack" else call["part"]


def parallel_parts(inputs: GateInputs, config: GateConfig, executor: Any, *, large: bool = False,
                   ready: Mapping[tuple, Callable[[], Any]] | None = None) -> ParallelParts:
    """The attackers (one call each) and the two utility parts as calls of ``executor``, longest first.

    Every part is a deterministic function of the inputs (seeded samples, seeded methods, one
    BLAS thread), so the figures are those of the serial gate, bit for bit; rows are put back in
    the serial order. The costly parts go first, so the processes finish close together.

    ``large`` (a large release's helper, :func:`_start_helper`): the deep attackers first (the
    dlib recogniser embeds ~140 distinct faces, ~0.09 s each), then the other attackers of each
    cap as *one* call (they share its sample, parrot gallery and distinct images: one call each
    would redo those per attacker), the cross-fit, the evidence-only protocols and the leak
    checks; no part is computed twice.

    ``ready``: parts a :class:`GateHelper` ran ahead, ``(part, attackers)`` -> a call that waits
    for its result; they are not run again.
    """
    ready = dict(ready or {})
    shipped = replace(inputs, fetch=replace(inputs.fetch, fallback=None))
    groups = attack_groups(inputs, config)
    calls: list[dict] = []
    if config.labels and not large:
        calls.append(dict(part="cross-fit"))
    deep = [dict(part="attack", cap=cap, attackers=(name,)) for cap, group in groups
            for name in group if name in DEEP_ATTACKERS and ("attack", (name,)) not in ready]
    if deep and inputs.kind == "images":
        from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415 (dlib import cost)

        _, originals = inputs.fetch(gate_attack_sample(inputs, config))
        known = DlibEmbedder(tuple(inputs.shape)).known(originals)
        deep = [dict(c, descriptors=known) for c in deep]
    calls += deep
    light = [(cap, tuple(name for name in group if name not in DEEP_ATTACKERS)) for cap, group in groups]
    if large:
        calls += [dict(part="attack", cap=cap, attackers=names) for cap, names in light if names]
        calls += [dict(part="cross-fit"), dict(part="protocols")] if config.labels else []
        calls.append(dict(part="leaks"))
    else:
        calls += [dict(part="protocols")] if config.labels else []
        calls += [dict(part="attack", cap=cap, attackers=(name,)) for cap, names in light for name in names]
    labels = [_part_label(c) for c in calls]
    labels = [f"{x} #{i}" if labels.count(x) > 1 else x for i, x in enumerate(labels)]
    weights = [_PART_WEIGHT["attack-deep" if set(c.get("attackers", ())) & DEEP_ATTACKERS else c["part"]]
               for c in calls]
    progress = PartsProgress("gate", list(zip(labels, weights)), workers=getattr(executor, "workers", 1)).start()
    try:
        out = executor.map(_timed_part, [dict(c, label=x, inputs=shipped, config=config) for c, x in zip(calls, labels)],
                           on_done=lambda r: progress.done(r[0], r[1]))
    finally:
        progress.finish()
    done = {(c["part"], c.get("attackers", ())): r for c, (_, _, r) in zip(calls, out)}
    done.update({key: wait() for key, wait in ready.items()})
    by_attacker: dict[str, list[dict]] = {}
    for (part, _), result in done.items():
        for r in result if part == "attack" else ():
            by_attacker.setdefault(r["attacker"], []).append(r)
    rows = [r for _, group in groups for name in group for r in by_attacker.get(name, [])]
    utility = ((done["cross-fit", ()][0], done["cross-fit", ()][1] + done["protocols", ()]) if config.labels else
               utility_checks(inputs, config))
    return ParallelParts(attack_rows=rows, utility=utility, leaks=done.get(("leaks", ())))


def serial_parts(inputs: GateInputs, config: GateConfig) -> ParallelParts:
    """The gate's parts one after another in this process, with the progress of :func:`parallel_parts`.

    The serial gate (no pool: a study's evaluations, a run on one worker, a method runner that cannot
    travel) runs the same functions in the same order as before: each attack group (the attackers
    that share a sample, as one part: they share its parrot gallery and distinct images), the leak
    checks, the membership disclosure, the cross-fit and the evidence-only protocols. So its figures
    are unchanged; what it gains is the parallel path's :class:`deid.progress.PartsProgress`: the
    parts named up front, a line as each ends with its measured seconds, a heartbeat at least every
    15 s naming the running part, and the time left from the parts' measured costs (a group's prior
    weight is the sum of its attackers').
    """
    groups = attack_groups(inputs, config)
    # Within the attack parts, a line per attacker x mode pair as before (the parts' lines say which group runs).
    pairs = Progress(f"gate: attacks on {len(gate_attack_sample(inputs, config))} records",
                     unit="attacker x mode pairs").start(sum(len(g) for _, g in groups) * len(attack_modes(inputs, config)))
    plan: list[tuple[str, float, Callable[[], Any]]] = [
        (_part_label({"part": "attack", "cap": cap, "attackers": group}),
         sum(_PART_WEIGHT["attack-deep" if n in DEEP_ATTACKERS else "attack"] for n in group),
         lambda cap=cap, group=group: attack_rows(inputs, config, cap=cap, attackers=group,
                                                  on_pair=lambda a, m: pairs.advance(note=f"{a}/{m}")))
        for cap, group in groups]
    plan += [("leaks", _PART_WEIGHT["leaks"], lambda: leak_checks(inputs, config)),
             ("membership", _PART_WEIGHT["membership"], lambda: membership_disclosure(inputs, config))]
    if config.labels:
        plan += [("cross-fit", _PART_WEIGHT["cross-fit"], lambda: cross_fit_checks(inputs, config)),
                 ("protocols", _PART_WEIGHT["protocols"], lambda: protocol_rows(inputs, config))]
    names = [x for x, _, _ in plan]
    names = [f"{x} #{i}" if names.count(x) > 1 else x for i, x in enumerate(names)]
    progress = PartsProgress("gate", [(x, w) for x, (_, w, _) in zip(names, plan)], workers=1).start()
    done: dict[str, Any] = {}
    try:
        for name, (_, _, run) in zip(names, plan):
            t0 = time.perf_counter()
            done[name] = run()
            progress.done(name, time.perf_counter() - t0)
    finally:
        progress.finish()
    rows = [r for name in names[:len(groups)] for r in done[name]]  # the attack parts come first, in group order
    utility = ((done["cross-fit"][0], done["cross-fit"][1] + done["protocols"]) if config.labels else
               utility_checks(inputs, config))
    return ParallelParts(attack_rows=rows, utility=utility, leaks=done["leaks"], membership=done["membership"])


def _helper_size(inputs: GateInputs, config: GateConfig) -> bool:
    """A release of at least ``helper_min_records`` records, judged in a process that may have children."""
    return wants_helper(inputs.n, config)


def _start_helper() -> Any:
    """This process and one spawned helper, for a large release's gate: the same figures, about half the wall time.

    The gate's work is nearly fixed in N (bounded samples), and at 100,000 faces the run's other
    core is idle while it runs (the stages' workers are gone). Its parts
    (:func:`parallel_parts` with ``large=True``: the dlib attack, the other attackers together,
    the cross-fit, the evidence-only protocols, the leak checks) start in that order on whichever
    process is free; nothing is computed twice, so the CPU added is the helper's start (imports,
    the dlib model, the inputs sent: ~2-4 s measured on a busy machine).
    """
    from deid.pool import PoolExecutor  # noqa: PLC0415 (a base module: the pool without the stages' warm-up)

    return PoolExecutor(2, warm=None)


def wants_helper(records: int, config: GateConfig) -> bool:
    """Does a release of ``records`` records get a gate helper process (at least ``helper_min_records``)?"""
    import multiprocessing  # noqa: PLC0415

    if not config.helper_min_records or records < config.helper_min_records:
        return False
    return not multiprocessing.current_process().daemon  # a daemonic pool's process (a study's worker) has none


class GateHelper:
    """A large release's gate helper process, started before the gate: the run's other core works ahead.

    At 100,000 faces the run's second core is idle while the release is staged (the stages'
    workers have exited, staging runs in the run's process). Started then (:meth:`start`), the
    helper builds the gate's inputs (``build(**kwargs)``, e.g. streaming the records; they do not
    depend on the staged files) with their samples read, then runs the deep attackers
    (:data:`DEEP_ATTACKERS`, the gate's longest part: the dlib recogniser embeds ~140 faces, ~13
    CPU-s). The gate then takes the inputs (:meth:`inputs`), adds what staging found, and runs its
    other parts on this process and the helper (:func:`parallel_parts`, ``ready=``
    :meth:`ready`). Every part is the function the gate would call, on the same inputs: the
    figures are the gate's without a helper, bit for bit. The caller closes it (:meth:`close`).
    """

    def __init__(self, config: GateConfig, pool: Any, built: Any, deep: Any):
        self.config, self.pool, self._built, self._deep = config, pool, built, deep

    @classmethod
    def start(cls, config: GateConfig, build: Callable[..., GateInputs], /, **kwargs: Any) -> GateHelper:
        """Spawn the helper and queue its two jobs: ``build(**kwargs)`` with its samples read, then the deep attackers."""
        pool = _start_helper()
        built = pool.submit(_prepare_inputs, build=build, config=config, kwargs=kwargs)
        deep = pool.submit(_prepared_deep_attacks, config=config)
        return cls(config, pool, built, deep)

    def inputs(self) -> GateInputs:
        """The inputs the helper built (waits for them); its samples read, ``fetch`` detached."""
        return self._built.result()

    def ready(self) -> dict[tuple, Callable[[], Any]]:
        """The parts the helper runs ahead, as :func:`parallel_parts` names them -> a call waiting for each."""
        inputs = self.inputs()
        keys = [("attack", (name,)) for _, group in attack_groups(inputs, self.config) for name in group
                if name in DEEP_ATTACKERS] if inputs.n and isinstance(inputs.fetch, SampleFetch) else []
        return {key: (lambda key=key: self._deep.result()[key]) for key in keys}

    def close(self) -> None:
        """Shut the helper down (a job still queued is cancelled; one running is waited for)."""
        self.pool.close()


_PREPARED: dict[str, GateInputs] = {}
"""In a :class:`GateHelper` process: the inputs its first job built, for its second job."""


def _prepare_inputs(build: Callable[..., GateInputs], config: GateConfig, kwargs: Mapping[str, Any]) -> GateInputs:
    """A :class:`GateHelper`'s first job: ``build(**kwargs)``, its samples read once, ``fetch`` detached."""
    from deid.heap import release_free_memory  # noqa: PLC0415

    _PREPARED.clear()
    inputs = _read_samples_once(build(**kwargs), config)
    if isinstance(inputs.fetch, SampleFetch):
        inputs = replace(inputs, fetch=replace(inputs.fetch, fallback=None))
    _PREPARED["inputs"] = inputs
    release_free_memory()  # what reading every record's row freed (its digests, batches): not kept for the attacks
    return inputs


def _prepared_deep_attacks(config: GateConfig) -> dict[tuple, list[dict]]:
    """A :class:`GateHelper`'s second job: each deep attacker's rows (:func:`attack_rows`) on the first job's inputs."""
    inputs = _PREPARED.pop("inputs", None)
    if inputs is None or not inputs.n or not isinstance(inputs.fetch, SampleFetch):
        return {}
    return {("attack", (name,)): gate_part("attack", inputs, config, cap=cap, attackers=(name,))
            for cap, group in attack_groups(inputs, config) for name in group if name in DEEP_ATTACKERS}


def people_sample(inputs: GateInputs, *, max_records: int, seed: int) -> np.ndarray:
    """Indices of all records of a seeded random sample of whole people, at most ``max_records``."""
    if inputs.n <= max_records:
        return np.arange(inputs.n)
    codes, keys = value_codes(list(inputs.people))
    order = np.random.default_rng(seed).permutation(len(keys))
    sizes = np.bincount(codes, minlength=len(keys))
    take = order[np.cumsum(sizes[order]) <= max_records]
    return np.flatnonzero(np.isin(codes, take if len(take) else order[:1]))


def utility_checks(inputs: GateInputs, config: GateConfig) -> tuple[list[Check], list[dict]]:
    """Utility per label, decided by mechanism-level cross-fitting; the older protocols are extra evidence.

    The gate's protocol (:func:`deid.evaluation.utility.cross_fit_utility`): the run's method
    de-identifies only the training people of each fold; classifiers trained on that release
    and on the same people's originals are tested on the held-out people's originals, and the
    paired accuracy drop is bounded by a bootstrap over people. ``pass`` if its upper bound
    is within the tolerance, ``fail`` if its lower bound exceeds it, otherwise
    ``inconclusive`` (blocking only with ``utility_inconclusive="reject"``).
    """
    if not config.labels:
        return [Check("utility", True, None, None, "not applicable: the drop declares no utility labels",
                      status="not_applicable")], []
    checks, rows = cross_fit_checks(inputs, config)
    return checks, rows + protocol_rows(inputs, config)


def cross_fit_checks(inputs: GateInputs, config: GateConfig) -> tuple[list[Check], list[dict]]:
    """The deciding utility checks and their rows (:func:`utility_checks`); none without the run's method."""
    from deid.anonymise.methods import K_METHODS, method_spec  # noqa: PLC0415
    from deid.evaluation.utility import cross_fit_utility  # noqa: PLC0415 (sklearn import cost)

    rows: list[dict] = []
    checks: list[Check] = []
    if inputs.deidentify is None:
        return checks, rows
    # Feature vectors are classified as they are (standardised, no PCA): see deid.evaluation.utility._svm.
    n_components = None if inputs.kind == "features" else config.n_components
    idx = people_sample(inputs, max_records=config.utility_sample, seed=config.seed)
    released, originals = inputs.fetch(idx)
    labels = {x: np.asarray(inputs.labels[x])[idx] for x in config.labels}
    select = method_spec(config.method).partitions_by_labels and inputs.partitions is not None
    evidence = cross_fit_utility(
        originals, people=list(inputs.people[idx]), labels=labels,
        deidentify=inputs.deidentify,
        partitions=list(inputs.partitions[idx]) if select else None, points=_points_of(inputs, idx),
        k=config.k if config.method in K_METHODS else None, released=released, tolerance=config.tolerance,
        folds=config.folds, confidence=config.confidence, max_images=config.utility_sample,
        n_components=n_components, seed=config.seed,
        progress=Progress(f"gate: utility cross-fit on {len(idx)} records", unit="folds"))
    for ev in evidence:
        row = ev.to_dict()
        row.update(protocol="cross-fit", original_accuracy=ev.accuracy_original,
                   deidentified_accuracy=ev.accuracy_release)
        status, detail = ev.decision, ev.detail
        if ev.label_lost:
            # Released accuracy at or below the majority-class rate, upper bound included: the label is lost,
            # which no noise explains; it fails whatever DEID_UTILITY_INCONCLUSIVE says.
            detail = (f"the release loses {ev.label}: released faces do not beat the majority-class rate "
                      f"{ev.majority_rate:.3f} (point estimate and upper bound at or below it). {detail}")
        elif status == "fail" and ev.suppressed_training_records and ev.actual_status not in (None, "fail"):
            # The folds' de-identification had to withhold label cells with fewer than k of
            # their (fewer) training people, which the real release kept: its loss is then
            # not evidence about this release, and the release's own rows did not fail.
            status = "inconclusive"
            detail = (f"cross-fit failed only after withholding {ev.suppressed_training_records} training "
                      f"records in label cells below k (the release itself kept them), and the release's own "
                      f"rows did not fail: inconclusive. {detail}")
        row["gate_status"] = status
        rows.append(row)
        interval = None if ev.delta_lower is None else (ev.delta_lower, ev.delta_upper)
        checks.append(utility_status_check(
            f"utility_{ev.label}", status=status, value=None if ev.delta is None else round(ev.delta, 4),
            threshold=f"accuracy drop <= {config.tolerance}", inconclusive=config.utility_inconclusive,
            interval=interval, n=ev.n_test_images, detail=detail))
    return checks, rows


def protocol_rows(inputs: GateInputs, config: GateConfig) -> list[dict]:
    """The earlier utility protocols' rows, evidence only (:func:`utility_checks`).

    On whole clusters of the attacked sample, at most ``evidence_sample`` records (the same seed:
    a release that small is used whole): they decide nothing, and their repeated grouped CV
    (``folds x repeats`` fits on originals and on the release, per label) was the gate's largest
    cost after the deep attack. Each row states its sample.
    """
    from deid.evaluation.utility import utility_protocols  # noqa: PLC0415 (sklearn import cost)

    rows: list[dict] = []
    # Earlier protocols (Gross et al. 2005 grouped CV; Moriarty et al.; consumer), on a bounded sample.
    idx = attack_sample(inputs, max_records=min(config.attack_sample, config.evidence_sample), seed=config.seed)
    unit = "cluster" if inputs.clusters is not None else "person"
    note = (f"evidence only, on all {inputs.n} records" if len(idx) == inputs.n else
            f"evidence only, on {len(idx)} of {inputs.n} records (whole {unit}s at random, seed {config.seed})")
    released, originals = inputs.fetch(idx)
    labels = {x: np.asarray(v)[idx] for x, v in inputs.labels.items()}
    for row in utility_protocols(labels=list(config.labels), originals=originals, original_labels=labels,
                                 original_people=inputs.people[idx], released=released, released_labels=labels,
                                 released_people=inputs.people[idx],
                                 released_groups=inputs.clusters[idx] if inputs.clusters is not None else None,
                                 folds=config.folds, repeats=config.repeats, seed=config.seed,
                                 **({"n_components": None} if inputs.kind == "features" else {})):
        row["tolerance"] = config.tolerance
        row["evidence_only"] = True
        row["detail"] = f"{note}. {row['detail']}"
        row.update(sample_records=int(len(idx)), sample_of=inputs.n, sample_seed=config.seed)
        rows.append(row)
    return rows


def utility_status_check(name: str, *, status: str, value: Any, threshold: Any, detail: str,
                         inconclusive: str, interval: tuple[float, float] | None = None,
                         n: int | None = None) -> Check:
    """A utility check whose blocking follows its status and the inconclusive policy."""
    passed = status in ("pass", "not_applicable") or (status == "inconclusive" and inconclusive == "release")
    return Check(name, passed, value, threshold, detail, status=status, interval=interval, n=n)
