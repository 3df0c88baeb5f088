"""The cross-fit's decision for one label: paired bootstrap bounds, the tolerance, the label-lost rule.

:class:`UtilityEvidence` holds a label's paired accuracies on held-out people and its status: ``pass``
when the upper bound of the accuracy loss is within the tolerance, ``fail`` when its lower bound
exceeds it, ``inconclusive`` otherwise (:func:`paired_bootstrap`, over people). The majority-rate rule
(:attr:`UtilityEvidence.label_lost`): a release whose classifier cannot beat the majority class, or
names one value for every held-out face, has lost the label. :func:`label_evidence` builds the
evidence from the predictions the cross-fit pooled (:class:`PooledPredictions`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from numbers import Real
from typing import Any, Callable, cast

import numpy as np

from deid.errors import ConfigError
from deid.evaluation.utility_folds import Values, check_int, codes_of


STATUSES: tuple[str, ...] = ("pass", "fail", "inconclusive", "not_applicable")
"""Status of a utility check: decided from bounds, ``inconclusive`` when the data cannot decide."""


@dataclass(frozen=True)
class UtilityEvidence:
    """Cross-fitted utility of one label: paired accuracies on held-out people, with bounds.

    ``delta`` = accuracy(trained on originals) - accuracy(trained on the de-identified
    release), both tested on the same held-out people's original images; ``delta_lower`` /
    ``delta_upper`` are one-sided ``confidence`` bounds from a bootstrap over held-out
    people. ``status`` is ``pass`` when ``delta_upper <= tolerance``, ``fail`` when
    ``delta_lower > tolerance``, ``inconclusive`` otherwise (``testable_margin`` is the
    smallest margin these test images could have shown: the half-width of the interval).
    ``majority_status`` tests accuracy(release) - ``majority_rate`` > 0 the same way
    (``gain_lower`` / ``gain_upper`` are its bounds). The ``actual_*`` fields are set when the
    actual release was passed: the same held-out test with the classifier trained on the
    released records of the training people (catches a release whose labels or rows do
    not match its faces, which re-running the method cannot see). :attr:`decision`
    combines them. Accuracies are None, and bounds None, when nothing could be tested.

    Other fields: ``n_test_images`` / ``n_test_people`` are the distinct held-out images and
    people behind the bounds; ``folds_used`` counts evaluated folds over all repeats;
    ``suppressed_training_records`` counts training records withheld from the method
    (partitions below k), summed over folds and repeats; ``trimmed_training_records`` those
    withheld as the flow withholds them (one person's images above 1/k of a partition);
    ``folds_run`` counts the folds de-identified, ``folds_skipped`` those that gave this label no
    evidence (a defect, never silent) with each reason in ``skipped_folds``; ``sample`` says which
    images were used (all, or a seeded sample of people) and ``seed`` the seed of everything random.
    ``actual_majority_status`` (with ``actual_gain_lower`` / ``actual_gain_upper``) is the majority
    test of the actual release's rows; :attr:`label_lost` is either majority test failing
    (``majority_status`` also fails when the release's classifier names one value for every held-out face).
    """

    label: str
    status: str
    delta: float | None
    delta_lower: float | None
    delta_upper: float | None
    tolerance: float
    accuracy_original: float | None
    accuracy_release: float | None
    majority_rate: float | None
    majority_status: str
    gain_lower: float | None
    gain_upper: float | None
    n_test_images: int
    n_test_people: int
    n_boot: int
    confidence: float
    testable_margin: float | None
    folds_used: int
    suppressed_training_records: int
    sample: str
    seed: int
    detail: str
    folds_run: int = 0
    folds_skipped: int = 0
    skipped_folds: tuple[str, ...] = ()
    trimmed_training_records: int = 0
    actual_status: str | None = None
    actual_accuracy: float | None = None
    actual_delta: float | None = None
    actual_delta_lower: float | None = None
    actual_delta_upper: float | None = None
    actual_majority_status: str | None = None
    actual_gain_lower: float | None = None
    actual_gain_upper: float | None = None

    @property
    def label_lost(self) -> bool:
        """The released faces cannot beat the majority-class rate: point estimate and upper bound at or below it.

        Either release (the method re-run on the training people, or the actual release's rows)
        failing that test loses the label: a consumer learns nothing a constant guess would not
        give. Not noise (the bound excludes any gain), so no policy turns it into ``inconclusive``.
        """
        return "fail" in (self.majority_status, self.actual_majority_status)

    @property
    def decision(self) -> str:
        """Overall status: ``fail`` if any part fails; ``pass`` only if every applicable part passes."""
        if self.status == "not_applicable":
            return "not_applicable"
        parts = [self.status, self.majority_status] + [p for p in (self.actual_status, self.actual_majority_status) if p]
        if "fail" in parts:
            return "fail"
        if all(p in ("pass", "not_applicable") for p in parts):
            return "pass"
        return "inconclusive"

    def to_dict(self) -> dict:
        """JSON-ready fields (floats rounded to 6 places) plus ``decision``."""
        out = {k: (round(v, 6) if isinstance(v, float) else list(v) if isinstance(v, tuple) else v)
               for k, v in asdict(self).items()}
        out["decision"] = self.decision
        out["label_lost"] = self.label_lost
        return out


def paired_bootstrap(people: Values, a: Any, b: Any, *, n_boot: int = 2000, confidence: float = 0.95,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a - b`` over items, with one-sided bounds from a bootstrap over people.

    The items (held-out images) of one person are resampled together, because a person's
    images are not independent; ``a`` and ``b`` (e.g. 0/1 correct) stay paired. Each
    replicate draws the people with replacement and takes the ratio of summed differences
    to summed image counts; the bounds are the ``1 - confidence`` and ``confidence``
    percentiles of the replicates (two one-sided bounds, i.e. a ``2 * confidence - 1``
    two-sided interval).

    A bootstrap cannot see an effect rarer than its sample: when the two scores never
    disagree its interval collapses to a point, however few people were tested. Each bound
    is therefore at least ``1 - (1 - confidence) ** (1 / n_people)`` from the estimate: the
    one-sided Clopper-Pearson bound on the share of people affected when none of
    ``n_people`` was seen affected (about 3 / n_people, the "rule of three").

    Parameters
    ----------
    people : sequence of hashable
        Person of each item.
    a, b : array-like of float in [0, 1]
        Paired scores of each item (e.g. 1 when a classifier is right).
    n_boot, confidence, seed
        Replicates, one-sided level, seed.

    Returns
    -------
    (estimate, lower, upper) : tuple of float
        Bounds clipped to [-1, 1].

    References
    ----------
    B. Efron, R. Tibshirani. An Introduction to the Bootstrap. Chapman & Hall, 1993
    (percentile interval); A. C. Davison, D. V. Hinkley. Bootstrap Methods and their
    Application. CUP, 1997, section 3.8 (resampling clusters).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ConfigError(f"a and b have shapes {a.shape} and {b.shape}; pass two non-empty 1-D arrays of equal length")
    if not (np.all((a >= 0) & (a <= 1)) and np.all((b >= 0) & (b <= 1))):
        raise ConfigError("a and b must be scores in [0, 1] (e.g. 1 = correct prediction, 0 = wrong)")
    codes = codes_of(people, "people", len(a))
    check_int("n_boot", n_boot, 1, "; pass e.g. n_boot=2000")
    check_confidence(confidence)
    n_people = int(codes.max()) + 1
    count = np.bincount(codes, minlength=n_people).astype(np.float64)
    diff = np.bincount(codes, weights=a - b, minlength=n_people)
    estimate = float(diff.sum() / count.sum())
    rng = np.random.default_rng(seed)
    stats = np.empty(int(n_boot))
    step = max(1, 2_000_000 // n_people)  # bounded memory: at most ~2M draws per block
    for start in range(0, int(n_boot), step):
        m = min(step, int(n_boot) - start)
        w = rng.multinomial(n_people, np.full(n_people, 1.0 / n_people), size=m).astype(np.float64)
        stats[start:start + m] = (w @ diff) / (w @ count)
    q = 1.0 - float(confidence)
    lower, upper = np.quantile(stats, [q, 1.0 - q])
    floor = 1.0 - q ** (1.0 / n_people)
    # Scores in [0, 1]: a difference of means lies in [-1, 1].
    return estimate, float(max(-1.0, min(lower, estimate - floor))), float(min(1.0, max(upper, estimate + floor)))


def check_confidence(confidence: Any) -> None:
    if isinstance(confidence, bool) or not isinstance(confidence, Real) or not 0.5 < cast(float, confidence) < 1:
        raise ConfigError(f"confidence={confidence!r} must be a number in (0.5, 1) (one-sided level); pass e.g. 0.95")


def _decide(lower: float, upper: float, margin: float) -> str:
    """pass if the whole upper bound is within ``margin``, fail if the lower bound exceeds it."""
    if upper <= margin + 1e-12:
        return "pass"
    if lower > margin + 1e-12:
        return "fail"
    return "inconclusive"


def _majority(gain_lower: float, gain_upper: float) -> str:
    """The release must beat the majority-class rate: ``pass`` if the gain's lower bound is above 0.

    ``fail`` (the label is lost, :attr:`UtilityEvidence.label_lost`) when the upper bound, and so
    the point estimate, is at or below 0: released accuracy at or below the majority rate with
    the stated confidence. Otherwise ``inconclusive``: only the noise of too few held-out people.
    """
    if gain_lower > 1e-12:
        return "pass"
    if gain_upper <= 1e-12:
        return "fail"
    return "inconclusive"


def blank_evidence(label: str, status: str, detail: str, *, tolerance: float, n_boot: int, confidence: float,
                   sample: str, seed: int, **kw: Any) -> UtilityEvidence:
    """A label's :class:`UtilityEvidence` with nothing measured (no accuracy, no bound), ``kw`` set on top."""
    base = dict(label=label, status=status, delta=None, delta_lower=None, delta_upper=None, tolerance=float(tolerance),
                accuracy_original=None, accuracy_release=None, majority_rate=None,
                majority_status=status if status == "not_applicable" else "inconclusive", gain_lower=None,
                gain_upper=None, n_test_images=0, n_test_people=0, n_boot=int(n_boot), confidence=float(confidence),
                testable_margin=None, folds_used=0, suppressed_training_records=0, sample=sample, seed=int(seed),
                detail=detail)
    base.update(kw)
    return UtilityEvidence(**base)  # type: ignore[arg-type]  # the fields' values, by name


@dataclass
class PooledPredictions:
    """One label's held-out predictions pooled over the cross-fit's folds, per fold (arrays over its test rows).

    ``row`` / ``who``: the test rows and their people; ``o``, ``r``, ``a``: whether the classifier trained on
    the originals, on the fold's release, on the actual release's rows was right; ``m``: whether the training
    side's majority class was; ``values`` / ``a_values``: the values the release's (the actual release's)
    classifiers named, on the held-out faces or on the release's faces they were trained on; ``single_taught``: folds whose release taught a single value (suppression), predicted
    constant by construction; ``skipped``: each fold that gave this label no evidence, with its reason; ``choices``: the front and C the
    inner cross-validation chose for the release's classifier, per fold (:mod:`deid.evaluation.utility_select`).
    """

    row: list[np.ndarray] = field(default_factory=list)
    who: list[np.ndarray] = field(default_factory=list)
    o: list[np.ndarray] = field(default_factory=list)
    r: list[np.ndarray] = field(default_factory=list)
    m: list[np.ndarray] = field(default_factory=list)
    a: list[np.ndarray] = field(default_factory=list)
    values: set = field(default_factory=set)
    a_values: set = field(default_factory=set)
    single_taught: int = 0
    folds_used: int = 0
    skipped: list[str] = field(default_factory=list)
    choices: list[tuple[str, float]] = field(default_factory=list)

    def choice_note(self) -> list[str]:
        """Which front and C the inner cross-validation chose for the release's classifier, over the folds."""
        if not self.choices:
            return []
        fronts = [f for f, _ in self.choices]
        cs = sorted(set(c for _, c in self.choices))
        return [f"release's classifier chosen per fold by inner cross-validation over the training people: front "
                f"fitted on the originals in {fronts.count('originals')}, on the release in {fronts.count('release')} "
                f"of {len(fronts)} folds; C {', '.join(f'{c:g}' for c in cs)}"]

    def skip_note(self, folds_run: int) -> list[str]:
        """A skipped fold is a defect of the protocol, never silent: counted, each with its reason."""
        if not self.skipped:
            return []
        return [f"{len(self.skipped)} of {folds_run} fold(s) skipped (a defect: the evidence rests on fewer folds): "
                + "; ".join(self.skipped)]


def label_evidence(name: str, d: PooledPredictions, evidence: Callable[..., UtilityEvidence], *, tolerance: float,
                   n_boot: int, confidence: float, seed: int, base_note: str, folds_run: int, suppressed: int,
                   trimmed: int) -> UtilityEvidence:
    """The evidence of one label from its pooled predictions: the paired accuracy drop and the majority-rate gain
    bounded by :func:`paired_bootstrap` over held-out people, decided against the tolerance, and the same for the
    actual release when it was passed.

    ``evidence`` is :func:`blank_evidence` with the run's tolerance, bootstrap, sample and seed bound.
    """
    fold_fields = dict(folds_skipped=len(d.skipped), skipped_folds=tuple(d.skipped), folds_run=folds_run,
                       trimmed_training_records=trimmed)
    if not d.who:
        return evidence(name, "inconclusive", "; ".join([base_note, *d.skip_note(folds_run),
                                                         "no fold could be evaluated"]),
                        suppressed_training_records=suppressed, **fold_fields)
    who, o, rr, m = (np.concatenate(x) for x in (d.who, d.o, d.r, d.m))
    delta, lo, up = paired_bootstrap(who, o, rr, n_boot=n_boot, confidence=confidence, seed=seed)
    gain, g_lo, g_up = paired_bootstrap(who, rr, m, n_boot=n_boot, confidence=confidence, seed=seed)
    status = _decide(lo, up, float(tolerance))
    majority_status = _majority(g_lo, g_up)
    # A release whose classifier names one value for every held-out face and every face of the release it was
    # trained on (e.g. every partition averaged into one image) carries no label at all: lost, by construction
    # rather than by a bound. Only a classifier that was taught both values and still names one counts (a fold whose training
    # side was suppressed down to one value proves nothing: see single_taught, reported in the detail).
    constant = 0 < len(d.values) < 2
    if constant:
        majority_status = "fail"
    single = ([f"{d.single_taught} fold(s) taught {name} a single value (the rest suppressed as partitions "
               "below k): their predictions are constant by construction, not evidence"]
              if d.single_taught else [])
    margin = (up - lo) / 2
    n_img, n_ppl = len(np.unique(np.concatenate(d.row))), len(np.unique(who))
    msg = [f"originals {o.mean():.3f} vs release {rr.mean():.3f} on held-out originals: "
           f"delta {delta:+.3f}, {confidence:.0%} bounds [{lo:+.3f}, {up:+.3f}] vs tolerance {tolerance}"]
    if status == "inconclusive":
        msg.append(f"{n_img} test images of {n_ppl} people can only test a margin of {margin:.3f}")
    msg.append(f"release vs majority rate {m.mean():.3f}: gain {gain:+.3f} [{g_lo:+.3f}, {g_up:+.3f}] "
               f"({majority_status}" + ("; the release's classifier names one value for every held-out face"
                                        if constant else "") + ")")
    extra: dict[str, Any] = {}
    if d.a:
        a = np.concatenate(d.a)
        a_d, a_lo, a_up = paired_bootstrap(who, o, a, n_boot=n_boot, confidence=confidence, seed=seed)
        a_gain, ag_lo, ag_up = paired_bootstrap(who, a, m, n_boot=n_boot, confidence=confidence, seed=seed)
        extra = dict(actual_status=_decide(a_lo, a_up, float(tolerance)), actual_accuracy=float(a.mean()),
                     actual_delta=a_d, actual_delta_lower=a_lo, actual_delta_upper=a_up,
                     actual_majority_status="fail" if len(d.a_values) < 2 else _majority(ag_lo, ag_up),
                     actual_gain_lower=ag_lo,
                     actual_gain_upper=ag_up)
        msg.append(f"actual release (rows of the training people) {a.mean():.3f}: delta {a_d:+.3f} "
                   f"[{a_lo:+.3f}, {a_up:+.3f}] ({extra['actual_status']}); vs majority rate: gain "
                   f"{a_gain:+.3f} [{ag_lo:+.3f}, {ag_up:+.3f}] ({extra['actual_majority_status']})")
    return evidence(
        name, status, "; ".join(msg + single + d.choice_note() + [base_note, *d.skip_note(folds_run)]), delta=delta, delta_lower=lo,
        delta_upper=up,
        accuracy_original=float(o.mean()), accuracy_release=float(rr.mean()), majority_rate=float(m.mean()),
        majority_status=majority_status, gain_lower=g_lo, gain_upper=g_up, n_test_images=n_img,
        n_test_people=n_ppl, testable_margin=margin, folds_used=d.folds_used,
        suppressed_training_records=suppressed, **fold_fields, **extra)
