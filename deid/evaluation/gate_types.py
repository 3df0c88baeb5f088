"""The gate's types: its settings (:class:`GateConfig`, mapped from the run's settings by
:data:`GATE_SETTINGS`), its inputs (:class:`GateInputs`, with the lineage's :class:`Republished` clusters and
the :data:`COUNTERFEIT` person of their counterfeit rows) and its result (:class:`GateResult`).

Every part of the gate takes these; :func:`deid.evaluation.gate.evaluate` is the one entry point.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Literal, Mapping, Sequence

import numpy as np

from deid.evaluation.attacks import MODES
from deid.evaluation.scoring import unique_rows
from deid.evaluation.checks import Check
from deid.evaluation.gate_rows import AttackRow, UtilityRow
from deid.errors import ConfigError
from deid.evaluation.leaks import (
    FEATURE_NEAR_COPY_RATIO,
    mean_abs_difference,
    vector_distance,
)



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
    ``suspects``: the records identity resolution found within the same-person distance of another person without
    merging them (indices, closest first; None: none named): the within-cluster check looks at their clusters
    beside its sample.

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
    suspects: np.ndarray | None = None

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
    reidentification: tuple[AttackRow, ...] = ()
    utility: tuple[UtilityRow, ...] = ()
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
        out += [f"utility_{u.label}: {u.evidence['folds_skipped']} of {u.evidence.get('folds_run')} cross-fit "
                "fold(s) skipped: " + "; ".join(u.evidence.get("skipped_folds") or []) for u in self.utility
                if u.protocol == "cross-fit" and u.evidence.get("folds_skipped")]
        return out
