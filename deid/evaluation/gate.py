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
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Literal, Sequence

import numpy as np
from scipy.stats import beta

from deid.evaluation.attacks import ATTACKERS, DEEP_ATTACKERS, MODES, attack_all
from deid.evaluation.scoring import unique_rows
from deid.evaluation.checks import STATUSES, Check, Status  # noqa: F401 (re-exported)
from deid.errors import ConfigError
from deid.evaluation.leaks import mean_abs_difference, nearest_original_distance
from deid.evaluation.validation import quarantine_fraction_check
from deid.schemas.arrow import FORBIDDEN_RELEASE_COLUMNS, RELEASE_BASE_COLUMNS

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
    attack_sample: int = 1000
    deep_attack_sample: int = 100
    attackers: tuple[str, ...] | None = None
    modes: tuple[str, ...] = MODES
    utility_sample: int = 1000
    utility_inconclusive: Literal["release", "reject"] = "release"
    folds: int = 5
    repeats: int = 3
    n_components: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 2:
            raise ConfigError(f"k={self.k!r} must be an integer >= 2; k is the minimum number of people per cluster")
        if not 0.5 < self.confidence < 1:
            raise ConfigError(f"confidence={self.confidence!r} must be in (0.5, 1); e.g. 0.95")
        if self.attack_sample < 10:
            raise ConfigError(f"attack_sample={self.attack_sample!r} must be >= 10 records; e.g. 2000")
        if self.utility_inconclusive not in ("release", "reject"):
            raise ConfigError(f"utility_inconclusive={self.utility_inconclusive!r} must be 'release' or 'reject'")
        if not 0 < self.closeness_ratio < 1:
            raise ConfigError(f"closeness_ratio={self.closeness_ratio!r} must be in (0, 1); e.g. 0.25")


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
    the utility protocol to the training people.
    """

    shape: tuple[int, int]
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
        return cls(shape=tuple(shape), people=np.asarray(people, dtype=object), image_index=index,
                   own_distance=mean_abs_difference(released, originals),
                   fetch=lambda idx: (released[idx], originals[idx]), **kw)

    @classmethod
    def empty(cls, *, shape: tuple[int, int], **kw: Any) -> "GateInputs":
        """Nothing to release (empty drop, everything suppressed)."""
        z = np.zeros((0, shape[0] * shape[1]), np.uint8)
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

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.detail or f'value {c.value} vs threshold {c.threshold}'}"
                for c in self.checks if not c.passed]

    @property
    def warnings(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if c.passed and c.status == "inconclusive"]


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


def cluster_shares(clusters: Sequence[Hashable], people: Sequence[Hashable]) -> tuple[dict, dict, dict]:
    """Per cluster: its size, its number of distinct people and its largest one-person share."""
    c_codes, c_keys = _codes(clusters)
    p_codes, _ = _codes(people)
    sizes = np.bincount(c_codes, minlength=len(c_keys))
    pairs, counts = np.unique(np.stack([c_codes, p_codes]), axis=1, return_counts=True)
    distinct = np.bincount(pairs[0], minlength=len(c_keys))
    top = np.zeros(len(c_keys), dtype=np.int64)
    np.maximum.at(top, pairs[0], counts)
    return ({c_keys[i]: int(sizes[i]) for i in range(len(c_keys))},
            {c_keys[i]: int(distinct[i]) for i in range(len(c_keys))},
            {c_keys[i]: float(top[i] / sizes[i]) for i in range(len(c_keys))})


def _codes(values: Sequence[Hashable]) -> tuple[np.ndarray, list]:
    index: dict = {}
    codes = np.fromiter((index.setdefault(v, len(index)) for v in values), dtype=np.int64, count=len(values))
    return codes, list(index)


def identical_within_clusters(image_index: Sequence[int], clusters: Sequence[Hashable] | None) -> bool:
    """True when every cluster's released rows are one distinct image (the k-Same structure)."""
    if clusters is None or len(image_index) == 0:
        return False
    c_codes, _ = _codes(list(clusters))
    pairs = np.unique(np.stack([c_codes, np.asarray(image_index, dtype=np.int64)]), axis=1)
    return bool(pairs.shape[1] == len(np.unique(c_codes)))


def _clustered(method: str) -> bool:
    """Does the method form clusters (the registry says)? Unknown names are treated as clustered."""
    from deid.anonymise.methods import REGISTRY  # noqa: PLC0415

    spec = REGISTRY.get(method)
    return True if spec is None else bool(spec.clustered)


def structural_checks(inputs: GateInputs, config: GateConfig) -> tuple[list[Check], int | None, float | None, bool]:
    """Checks that need no model: cluster sizes, people and person shares per cluster, columns, accounting."""
    k = config.k
    n = inputs.n
    checks = [Check("release_not_empty", n > 0, n, ">= 1", "" if n > 0 else "no record could be released")]
    min_people = share = None
    exact = False
    if n and inputs.clusters is not None and _clustered(config.method):
        sizes, distinct, shares = cluster_shares(list(inputs.clusters), list(inputs.people))
        min_size, min_people, share = min(sizes.values()), min(distinct.values()), max(shares.values())
        exact = identical_within_clusters(inputs.image_index, list(inputs.clusters))
        checks.append(Check("min_cluster_size", min_size >= k, min_size, f">= {k}",
                            f"{len(sizes)} clusters; smallest has {min_size} images"))
        checks.append(Check("min_distinct_people_per_cluster", min_people >= k, min_people, f">= {k}",
                            f"smallest number of distinct people in a cluster: {min_people}"))
        worst = max(shares, key=shares.get)
        checks.append(Check(
            "max_person_share", share <= 1.0 / k + 1e-12, round(share, 6), f"<= {1.0 / k:.4f}",
            f"largest share of one person's images in a cluster: {share:.3f} (cluster of {sizes[worst]} images, "
            f"{distinct[worst]} people); " + ("every cluster's members received the identical image, so this is "
                                               "the exact bound on any recogniser's success"
                                               if exact else "clusters are not identical copies: the empirical "
                                               "attacks decide")))
    elif n:
        checks.append(Check("min_cluster_size", True, None, f">= {k}",
                            f"not applicable: method {config.method} forms no clusters, so nothing structural "
                            "bounds re-identification; the empirical attacks decide (every upper bound <= 1/k)",
                            status="not_applicable"))
    columns = inputs.release_columns or (*RELEASE_BASE_COLUMNS, *config.labels)
    allowed = set(RELEASE_BASE_COLUMNS) | set(config.labels)
    bad = sorted(set(columns) - allowed)
    forbidden = sorted(set(columns) & set(FORBIDDEN_RELEASE_COLUMNS))
    checks.append(Check("no_forbidden_columns", not bad and not forbidden, bad or forbidden or [],
                        sorted(allowed), "release columns: " + ", ".join(columns)))
    total = n + inputs.suppressed + inputs.quarantined
    checks.append(Check("records_accounted", total == inputs.records_in, total, inputs.records_in,
                        f"released {n} + suppressed {inputs.suppressed} + quarantined {inputs.quarantined} "
                        f"= {total} of {inputs.records_in} in"))
    if inputs.partition_failed:
        checks.append(Check("small_partitions", False, "fail", "every partition >= k people",
                            inputs.partition_detail or "a label partition has fewer than k distinct people"))
    checks.append(quarantine_fraction_check(inputs.records_in, inputs.quarantined, config.max_quarantine_fraction))
    return checks, min_people, share, exact


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
    c_codes, keys = _codes(list(inputs.clusters))
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
    return Check(name, bad == 0, round(float(closest[worst]), 3), f">= {limit:.3f}",
                 f"{bad} of {len(keys)} clusters lie within {config.closeness_ratio:g} x the median closest-member "
                 f"distance ({typical:.2f} grey levels) of one member; closest {closest[worst]:.2f}")


# --------------------------------------------------------------------------- attacks


def attack_sample(inputs: GateInputs, *, max_records: int, seed: int) -> np.ndarray:
    """Indices of the records attacked: all of them, or whole clusters (or people) at random.

    Sampling whole clusters keeps every cluster's k people together, so the attacker still
    faces the k-way ambiguity the release has; the gallery shrinks to the sample's people,
    which only makes the attacks stronger.
    """
    n = inputs.n
    if n <= max_records:
        return np.arange(n)
    units = inputs.clusters if inputs.clusters is not None and len(set(inputs.clusters)) < inputs.n else inputs.people
    codes, keys = _codes(list(units))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(keys))
    sizes = np.bincount(codes, minlength=len(keys))
    take = order[np.cumsum(sizes[order]) <= max_records]
    if len(take) == 0:
        take = order[:1]
    return np.flatnonzero(np.isin(codes, take))


def _parrot(deidentify: Callable[..., np.ndarray], people: np.ndarray, partitions: np.ndarray | None,
            labels: dict[str, np.ndarray] | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """The parrot attacker de-identifies its own gallery of originals the way the release was made."""
    return lambda originals: deidentify(originals, people=people, partitions=partitions,
                                        labels={x: list(v) for x, v in (labels or {}).items()} or None)


def _labelled(deidentify: Callable[..., np.ndarray], originals: np.ndarray, labels: dict[str, np.ndarray]
              ) -> Callable[..., np.ndarray]:
    """The method runner, given each face's labels by its pixels (the cross-fitted utility
    protocol hands the runner subsets of these originals, not their indices)."""
    if not labels:
        return deidentify
    def key(rows: np.ndarray) -> list[bytes]:
        return [r.tobytes() for r in np.clip(np.rint(np.asarray(rows, dtype=np.float64)), 0, 255).astype(np.uint8)]

    by_row = {b: i for i, b in enumerate(key(originals))}

    def run(images: np.ndarray, *, people, partitions=None):
        rows = [by_row[b] for b in key(images)]
        return deidentify(images, people=people, partitions=partitions,
                          labels={x: [v[i] for i in rows] for x, v in labels.items()})

    return run


def privacy_checks(inputs: GateInputs, config: GateConfig, *, exact: bool
                   ) -> tuple[list[Check], list[dict], float | None, dict]:
    """Every attacker in every mode on a bounded sample, each rate with its interval."""
    k = config.k
    if inputs.n == 0:
        return [Check("reidentification_rate", False, None, f"<= {1.0 / k:.4f}", "nothing released to attack")], \
            [], None, {}
    idx = attack_sample(inputs, max_records=config.attack_sample, seed=config.seed)
    released, originals = inputs.fetch(idx)
    people = inputs.people[idx]
    modes = tuple(m for m in config.modes if m != "parrot" or inputs.deidentify is not None)
    parts = None if inputs.partitions is None else inputs.partitions[idx]
    labs = {x: np.asarray(v)[idx] for x, v in inputs.labels.items()}
    parrot = None if "parrot" not in modes else _parrot(inputs.deidentify, people, parts, labs)
    names = list(config.attackers) if config.attackers is not None else list(ATTACKERS)
    # Attackers that can afford the whole sample share one pass (one parrot gallery, one set
    # of distinct images); an attacker may cap the records it attacks (a deep recogniser
    # embeds every face it sees).
    groups: dict[int | None, list[str]] = {}
    for name in names:
        groups.setdefault(config.deep_attack_sample if name in DEEP_ATTACKERS else None, []).append(name)
    rows: list[dict] = []
    for cap, group in groups.items():
        sub = np.arange(len(idx))
        if cap is not None and len(idx) > cap:
            sub_inputs = replace(inputs, people=people,
                                 clusters=None if inputs.clusters is None else inputs.clusters[idx])
            sub = attack_sample(sub_inputs, max_records=cap, seed=config.seed + 1)
        p_sub = parrot
        if parrot is not None and len(sub) < len(idx):
            p_sub = _parrot(inputs.deidentify, people[sub], None if parts is None else parts[sub],
                            {x: v[sub] for x, v in labs.items()})
        for r in attack_all(originals=originals[sub], original_people=people[sub], released=released[sub],
                            released_people=people[sub], shape=inputs.shape, modes=modes, parrot=p_sub,
                            attackers=group):
            r["records"] = int(len(sub))
            rows.append(r)
    m = len(rows)
    # Bonferroni: the family of m one-sided tests keeps the stated confidence overall.
    level = 1.0 - (1.0 - config.confidence) / m
    bound = 1.0 / k
    failing = []
    for r in rows:
        lo, hi = clopper_pearson(r["rate"] * r["n_probes"], r["n_probes"], confidence=level)
        r["lower"], r["upper"] = round(lo, 6), round(hi, 6)
        r["rate"] = round(r["rate"], 6)
        r.pop("credit", None)
        if (lo > bound + 1e-12) if exact else (hi > bound + 1e-12):
            failing.append(r)
    worst = max(rows, key=lambda r: r["rate"])
    max_rate = worst["rate"]
    rule = ("fails only if a lower bound exceeds 1/k (the exact bound max_person_share decides)" if exact
            else "every upper bound must be <= 1/k (no exact bound: clusters are not identical copies)")
    detail = (f"max over {m} attacker x mode pairs: {worst['attacker']}/{worst['mode']} {worst['rate']:.3f} "
              f"[{worst['lower']:.3f}, {worst['upper']:.3f}] on {worst['n_probes']} distinct probes; "
              f"one-sided {config.confidence:.0%} Clopper-Pearson, Bonferroni over {m}; {rule}")
    if failing:
        f0 = max(failing, key=lambda r: r["upper"])
        detail += (f"; {len(failing)} failing, e.g. {f0['attacker']}/{f0['mode']} {f0['rate']:.3f} "
                   f"[{f0['lower']:.3f}, {f0['upper']:.3f}]")
    sample = {"records": int(len(idx)), "of": inputs.n, "seed": config.seed,
              "unit": "cluster" if inputs.clusters is not None else "person", "confidence": config.confidence,
              "bonferroni_over": m}
    check = Check("reidentification_rate", not failing, max_rate, f"<= {bound:.4f}", detail,
                  interval=(worst["lower"], worst["upper"]), n=worst["n_probes"])
    return [check], rows, max_rate, sample


def leak_checks(inputs: GateInputs, config: GateConfig) -> list[Check]:
    """No released face is (nearly) a copy of an original; no released file carries metadata."""
    threshold = config.leak_threshold
    checks = []
    if inputs.n:
        # Every record against its own original (O(N)); all pairs on the bounded sample.
        own = np.asarray(inputs.own_distance)
        idx = attack_sample(inputs, max_records=config.attack_sample, seed=config.seed)
        released, originals = inputs.fetch(idx)
        distinct, _ = unique_rows(released)
        cross, _ = nearest_original_distance(distinct, originals, threshold=threshold)
        low = float(min(own.min(), cross.min()))
        n_ident = int(np.count_nonzero(own == 0) + np.count_nonzero(cross == 0))
        n_below = int(np.count_nonzero(own < threshold) + np.count_nonzero(cross < threshold))
        checks.append(Check("no_near_copies", low >= threshold, round(low, 4), f">= {threshold}",
                            f"{n_ident} identical and {n_below} within {threshold} grey levels (mean absolute "
                            f"difference) of an original aligned face; every record vs its own original, and "
                            f"{len(distinct)} distinct released images vs {len(idx)} originals"))
    bad_files = sorted(inputs.file_metadata)
    checks.append(Check("no_source_metadata", not bad_files, len(bad_files), 0,
                        "clean" if not bad_files else f"{bad_files[:5]} carry {inputs.file_metadata[bad_files[0]]}"))
    return checks


# --------------------------------------------------------------------------- the gate


def evaluate(inputs: GateInputs, config: GateConfig) -> GateResult:
    """Run every check on the would-be release; the release passes only if none blocks.

    Parameters
    ----------
    inputs : GateInputs
        The released records with their originals, people, clusters and labels.
    config : GateConfig
        k, method, bounds and sample sizes.

    Returns
    -------
    GateResult

    References
    ----------
    E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images. IEEE
    TKDE 17(2):232-243, 2005. R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility
    into face de-identification. PET 2005, LNCS 3856, 227-242.
    """
    checks, min_people, share, exact = structural_checks(inputs, config)
    checks.extend(inputs.extra_checks)
    reid: list[dict] = []
    util: list[dict] = []
    max_rate = None
    sample = None
    if inputs.n:
        checks.append(closeness_check(inputs, config))
        p_checks, reid, max_rate, sample = privacy_checks(inputs, config, exact=exact)
        checks.extend(p_checks)
        log.info("gate: max re-identification rate %.4f over %d attacker x mode pairs (bound %.4f)",
                 max_rate, len(reid), 1 / config.k)
        checks.extend(leak_checks(inputs, config))
        u_checks, util = utility_checks(inputs, config)
        checks.extend(u_checks)
    result = GateResult(checks=tuple(checks), reidentification=tuple(reid), utility=tuple(util),
                        max_rate=max_rate, min_people=min_people, max_person_share=share, exact_bound=exact,
                        attack_sample=sample)
    log.info("gate: %s%s", "passed" if result.passed else "failed",
             "" if result.passed else " - " + "; ".join(result.reasons))
    return result


def people_sample(inputs: GateInputs, *, max_records: int, seed: int) -> np.ndarray:
    """Indices of all records of a seeded random sample of whole people, at most ``max_records``."""
    if inputs.n <= max_records:
        return np.arange(inputs.n)
    codes, keys = _codes(list(inputs.people))
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
    from deid.anonymise.methods import K_METHODS, REGISTRY  # noqa: PLC0415
    from deid.evaluation.utility import cross_fit_utility, utility_protocols  # noqa: PLC0415 (sklearn import cost)

    if not config.labels:
        return [Check("utility", True, None, None, "not applicable: the drop declares no utility labels",
                      status="not_applicable")], []
    rows: list[dict] = []
    checks: list[Check] = []
    if inputs.deidentify is not None:
        idx = people_sample(inputs, max_records=config.utility_sample, seed=config.seed)
        released, originals = inputs.fetch(idx)
        labels = {x: np.asarray(inputs.labels[x])[idx] for x in config.labels}
        select = REGISTRY[config.method].partitions_by_labels and inputs.partitions is not None
        evidence = cross_fit_utility(
            originals, people=list(inputs.people[idx]), labels=labels,
            deidentify=_labelled(inputs.deidentify, originals, labels),
            partitions=list(inputs.partitions[idx]) if select else None,
            k=config.k if config.method in K_METHODS else None, released=released, tolerance=config.tolerance,
            folds=config.folds, confidence=config.confidence, max_images=config.utility_sample,
            n_components=config.n_components, seed=config.seed)
        for ev in evidence:
            row = ev.to_dict()
            row.update(protocol="cross-fit", original_accuracy=ev.accuracy_original,
                       deidentified_accuracy=ev.accuracy_release)
            status, detail = ev.decision, ev.detail
            if status == "fail" and ev.suppressed_training_records and ev.actual_status not in (None, "fail"):
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
    # Earlier protocols (Gross et al. 2005 grouped CV; Moriarty et al.; consumer), on the attacked sample.
    idx = attack_sample(inputs, max_records=config.attack_sample, seed=config.seed)
    released, originals = inputs.fetch(idx)
    labels = {x: np.asarray(v)[idx] for x, v in inputs.labels.items()}
    for row in utility_protocols(labels=list(config.labels), originals=originals, original_labels=labels,
                                 original_people=inputs.people[idx], released=released, released_labels=labels,
                                 released_people=inputs.people[idx],
                                 released_groups=inputs.clusters[idx] if inputs.clusters is not None else None,
                                 folds=config.folds, repeats=config.repeats, seed=config.seed):
        row["tolerance"] = config.tolerance
        row["evidence_only"] = True
        rows.append(row)
    return checks, rows


def utility_status_check(name: str, *, status: str, value: Any, threshold: Any, detail: str,
                         inconclusive: str, interval: tuple[float, float] | None = None,
                         n: int | None = None) -> Check:
    """A utility check whose blocking follows its status and the inconclusive policy."""
    passed = status in ("pass", "not_applicable") or (status == "inconclusive" and inconclusive == "release")
    return Check(name, passed, value, threshold, detail, status=status, interval=interval, n=n)
