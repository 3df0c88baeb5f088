"""Membership disclosure: can an attacker holding a person's photo tell whether they are in the release?

k-Same bounds *linking*: a released face names the right person at most 1/k of the time. It does
not bound *membership*: each released average holds 1/k of each member's face, so a member's photo
sits closer to some released face than a non-member's does. For a cohort defined by a diagnosis,
membership is the diagnosis. This module measures it the way delta-presence is measured for tables
(Nergiz et al. 2007), with the gate's recognisers as the attacker:

1. the people of the gate's attacked sample are split at random into *members* and *non-members*;
2. the run's method re-makes a release from the members only (the parrot re-run the attacks use:
   ``GateInputs.deidentify``), so non-members are people truly absent from a release made like this one;
3. each person's score is the attacker's similarity of their original photo(s) to the nearest released
   face (the best over their photos); the attacker is fitted on the originals it holds (all sample
   people), or on the release for an attacker that fits there;
4. AUC (Mann-Whitney, ties credited one half) and the TPR at 1% FPR of members vs non-members, each
   with a stratified percentile bootstrap interval over people (one-sided bounds, Bonferroni over the
   attackers tried, since the headline is their best), and the membership *advantage*
   ``2 * AUC - 1`` (0: no better than a coin, 1: certain).

The strongest attacker (highest AUC) is the headline. ``GateConfig.membership_max_advantage`` (setting
``DEID_MEMBERSHIP_MAX_ADVANTAGE``) turns the figure into a check decided from the advantage's lower
bound; unset, the figure is reported and decides nothing.

References
----------
M. E. Nergiz, M. Atzori, C. Clifton. Hiding the presence of individuals from shared databases. SIGMOD
2007, 665-676. R. Shokri, M. Stronati, C. Song, V. Shmatikov. Membership inference attacks against
machine learning models. IEEE S&P 2017, 3-18. N. Carlini et al. Membership inference attacks from first
principles. IEEE S&P 2022, 1897-1914 (TPR at low FPR). E. Newton, L. Sweeney, B. Malin. Preserving
privacy by de-identifying face images. IEEE TKDE 17(2):232-243, 2005.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from deid.errors import DeidError
from deid.evaluation.checks import Check
from deid.evaluation.scoring import unique_rows

log = logging.getLogger(__name__)

SCOPE: dict[str, str] = {
    "protects": "Linking: no one holding the people's photos names the person behind a released face more often "
                "than 1/k (each released face is shared by at least k people, none above 1/k of its cluster).",
    "does_not_protect": "Membership: a person's photo can still show whether they are in the release (each released "
                        "face averages 1/k of each member's face); measured in privacy.membership, decided only with "
                        "DEID_MEMBERSHIP_MAX_ADVANTAGE. Homogeneity: the people of a cluster share its partition "
                        "labels, so linking someone to their cluster reveals those labels with certainty; a column "
                        "declared sensitive (drop.yaml 'sensitive') is never a partition label and is released only "
                        "when every cluster is l-diverse in it (at least DEID_SENSITIVE_L distinct values, or with "
                        "DEID_SENSITIVE_DIVERSITY=entropy an entropy of at least log(l)).",
}
"""What the k-anonymity guarantee covers and what it leaves open, in the words the report and the dataset card use."""

FPR_TARGET = 0.01
"""The false-positive rate at which the true-positive rate is reported (Carlini et al. 2022)."""
BOOTSTRAP = 1000
"""Bootstrap resamples (stratified over people) behind every membership interval."""
MIN_PEOPLE = 4
"""Fewest members and fewest non-members behind a membership figure."""


def auc(members: np.ndarray, non_members: np.ndarray) -> float:
    """Probability that a random member scores above a random non-member, ties credited one half.

    The Mann-Whitney U statistic over ``len(members) * len(non_members)`` pairs (invariant 6:
    a tie is never credited by position).
    """
    m, n = np.asarray(members, dtype=np.float64), np.asarray(non_members, dtype=np.float64)
    if not len(m) or not len(n):
        raise ValueError("auc needs at least one member and one non-member score")
    both = np.concatenate([m, n])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both))
    s = both[order]
    # Average ranks of tied values (1-based): a tie between a member and a non-member scores 1/2.
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[: len(m)].sum() - len(m) * (len(m) + 1) / 2.0
    return float(u / (len(m) * len(n)))


def tpr_at_fpr(members: np.ndarray, non_members: np.ndarray, fpr: float = FPR_TARGET) -> float:
    """The largest share of members flagged by a threshold that flags at most ``fpr`` of non-members.

    A person is flagged when their score is >= the threshold; a threshold tied with a non-member
    flags it too, so ties never buy true positives for free. With fewer than ``1 / fpr`` non-members
    the threshold must lie above every non-member score.
    """
    m, n = np.sort(np.asarray(members, dtype=np.float64)), np.sort(np.asarray(non_members, dtype=np.float64))
    allowed = int(np.floor(fpr * len(n) + 1e-9))  # non-members that may be flagged
    # The lowest admissible threshold is just above the (allowed+1)-th largest non-member score.
    if allowed >= len(n):
        return 1.0
    limit = n[len(n) - 1 - allowed]
    return float(np.count_nonzero(m > limit) / len(m))


def bootstrap_figures(members: np.ndarray, non_members: np.ndarray, *, fpr: float, seed: int,
                      resamples: int = BOOTSTRAP) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap replicates of (AUC, TPR at ``fpr``), people resampled with members and non-members apart.

    Stratified: every replicate keeps both group sizes. AUC from the pairwise comparison matrix
    (1 above, 1/2 tied) weighted by each replicate's resampling counts; the TPR from each replicate's
    own threshold (:func:`tpr_at_fpr`).
    """
    rng = np.random.default_rng(seed)
    m, n = np.asarray(members, dtype=np.float64), np.asarray(non_members, dtype=np.float64)
    im = rng.integers(0, len(m), (resamples, len(m)))
    jn = rng.integers(0, len(n), (resamples, len(n)))
    wins = (m[:, None] > n[None, :]) + 0.5 * (m[:, None] == n[None, :])
    cm = np.zeros((resamples, len(m)))
    cn = np.zeros((resamples, len(n)))
    np.add.at(cm, (np.arange(resamples)[:, None], im), 1.0)
    np.add.at(cn, (np.arange(resamples)[:, None], jn), 1.0)
    aucs = np.einsum("bi,ij,bj->b", cm, wins, cn) / (len(m) * len(n))
    allowed = int(np.floor(fpr * len(n) + 1e-9))
    if allowed >= len(n):
        tprs = np.ones(resamples)
    else:
        limit = np.sort(n[jn], axis=1)[:, len(n) - 1 - allowed]
        tprs = (m[im] > limit[:, None]).mean(axis=1)
    return aucs, tprs


def _bounds(values: np.ndarray, confidence: float) -> tuple[float, float]:
    """One-sided percentile bounds (lower, upper), each holding with ``confidence``."""
    alpha = 1.0 - confidence
    return float(np.quantile(values, alpha)), float(np.quantile(values, 1.0 - alpha))


def person_scores(similarity: np.ndarray, probe_people: Sequence[Hashable]) -> dict[Hashable, float]:
    """Each person's score: the highest similarity of any of their photos to any released face."""
    best = similarity.max(axis=1) if similarity.shape[1] else np.full(len(similarity), -np.inf)
    out: dict[Hashable, float] = {}
    for p, s in zip(probe_people, best.tolist()):
        out[p] = max(out.get(p, -np.inf), s)
    return out


def membership_scores(attacker: Any, *, originals: np.ndarray, people: Sequence[Hashable],
                      released: np.ndarray, released_people: Sequence[Hashable]) -> dict[Hashable, float]:
    """Score every person of ``people`` against ``released`` with one recogniser.

    The attacker fits on the originals it holds (every probe person's photos), or on the release
    when it is an attacker that fits there (``fit_on == "released"``); the release's distinct
    faces are its gallery.
    """
    on_release = getattr(attacker, "fit_on", "originals") == "released"
    attacker.fit(released if on_release else originals, people=list(released_people if on_release else people))
    distinct, _ = unique_rows(np.ascontiguousarray(released))
    attacker.enroll(distinct, people=list(range(len(distinct))))
    return person_scores(np.asarray(attacker.similarity(originals), dtype=np.float64), people)


def membership_figures(scores: Mapping[Hashable, float], members: set, *, confidence: float, seed: int,
                       fpr: float = FPR_TARGET) -> dict:
    """AUC, advantage and TPR at ``fpr`` of one attacker's person scores, each with its interval and n."""
    m = np.array([s for p, s in scores.items() if p in members])
    n = np.array([s for p, s in scores.items() if p not in members])
    a, t = auc(m, n), tpr_at_fpr(m, n, fpr)
    aucs, tprs = bootstrap_figures(m, n, fpr=fpr, seed=seed)
    (a_lo, a_hi), (t_lo, t_hi) = _bounds(aucs, confidence), _bounds(tprs, confidence)
    return {"auc": round(a, 6), "auc_interval": [round(a_lo, 6), round(a_hi, 6)],
            "advantage": round(2 * a - 1, 6), "advantage_interval": [round(2 * a_lo - 1, 6), round(2 * a_hi - 1, 6)],
            "tpr_at_fpr": round(t, 6), "tpr_interval": [round(t_lo, 6), round(t_hi, 6)], "fpr": fpr,
            "members": int(len(m)), "non_members": int(len(n))}


def split_people(people: Sequence[Hashable], *, seed: int) -> set:
    """A seeded random half of the distinct people (rounded down): the members."""
    keys = sorted(set(people), key=str)
    order = np.random.default_rng(seed).permutation(len(keys))
    return {keys[i] for i in order[: len(keys) // 2]}


def measure_membership(*, originals: np.ndarray, people: np.ndarray, shape: tuple[int, ...],
                       deidentify: Callable[..., np.ndarray], attackers: Mapping[str, Callable[[Any], Any]],
                       partitions: np.ndarray | None = None, labels: Mapping[str, np.ndarray] | None = None,
                       points: list | None = None, confidence: float = 0.95, seed: int = 0) -> dict:
    """Membership disclosure of a release made by ``deidentify`` from a random half of ``people``.

    Parameters
    ----------
    originals : ndarray of shape (n, n_pixels)
        The sample's original faces (or feature vectors), one row per record.
    people : ndarray of length n
        Each record's person.
    shape : tuple
        (height, width) of the faces or (n_features,), passed to the attacker factories.
    deidentify : callable
        ``deidentify(images, people=..., partitions=..., labels=..., points=...)``: the run's method.
    attackers : mapping of name -> factory(shape)
        The recognisers tried; the one with the highest AUC is the headline.
    partitions, labels, points : optional
        Per record, as the release's method got them.
    confidence : float
        One-sided confidence of each bound.
    seed : int
        Seeds the member split and the bootstrap.

    Returns
    -------
    dict
        ``attacker`` (the strongest), its figures (:func:`membership_figures`), ``attackers`` (every
        attacker's figures), ``method``: how the interval was made; or ``{"status": "not_applicable",
        "reason": ...}`` when there are too few people or the method cannot re-make a release.
    """
    people = np.asarray(people, dtype=object)
    members = split_people(people.tolist(), seed=seed + 3)
    n_people = len(set(people.tolist()))
    if min(len(members), n_people - len(members)) < MIN_PEOPLE:
        return {"status": "not_applicable",
                "reason": f"{n_people} people in the attacked sample; membership needs at least {2 * MIN_PEOPLE} "
                          f"({MIN_PEOPLE} members and {MIN_PEOPLE} non-members)"}
    is_member = np.array([p in members for p in people.tolist()])
    idx = np.flatnonzero(is_member)
    extra = {} if points is None else {"points": [points[int(i)] for i in idx]}
    try:
        released = np.asarray(deidentify(
            originals[idx], people=people[idx], partitions=None if partitions is None else np.asarray(partitions)[idx],
            labels={x: list(np.asarray(v)[idx]) for x, v in (labels or {}).items()} or None, **extra))
    except (DeidError, ValueError) as exc:  # e.g. a partition of the members' half below k people
        log.info("membership: the method could not re-make a release of %d members: %s", len(members), exc)
        return {"status": "not_applicable",
                "reason": f"the run's method could not re-make a release from a random half of the sample's people "
                          f"({len(members)}): {type(exc).__name__}"}
    # The headline is the best of several attackers: Bonferroni over them keeps each bound at ``confidence``.
    level = 1.0 - (1.0 - confidence) / max(len(attackers), 1)
    rows = {}
    for name, factory in attackers.items():
        try:
            scores = membership_scores(factory(shape), originals=originals, people=people.tolist(),
                                       released=released, released_people=people[idx].tolist())
        except (DeidError, ValueError, np.linalg.LinAlgError) as exc:  # cannot fit this sample (identical faces)
            log.info("membership: attacker %s not scored: %s", name, exc)
            continue
        rows[name] = membership_figures(scores, members, confidence=level, seed=seed + 5)
    if not rows:
        return {"status": "not_applicable", "reason": "no attacker could score this sample"}
    best = max(rows, key=lambda a: rows[a]["auc"])
    return {"status": "measured", "attacker": best, **rows[best],
            "interval_method": f"percentile bootstrap over people ({BOOTSTRAP} resamples, members and non-members "
                               f"resampled separately), one-sided {confidence:.0%} bounds each, Bonferroni over "
                               f"{len(attackers)} attackers",
            "attackers": [{"attacker": a, **r} for a, r in rows.items()]}


def membership_check(figures: Mapping[str, Any], max_advantage: float | None) -> Check:
    """``membership_advantage``: the strongest attacker's advantage ``2 AUC - 1``, with its interval and n.

    Unset ``max_advantage``: reported, never deciding (status ``not_applicable``). Set: ``fail`` when
    the advantage's lower bound exceeds it, ``pass`` when its upper bound is within it, otherwise
    ``inconclusive`` (the release goes: the decision is the lower bound's).
    """
    threshold = None if max_advantage is None else f"<= {max_advantage:g}"
    if figures.get("status") != "measured":
        return Check("membership_advantage", True, None, threshold,
                     f"not measured: {figures.get('reason', 'no membership figures')}", status="not_applicable")
    adv, (lo, hi) = figures["advantage"], figures["advantage_interval"]
    n = figures["members"] + figures["non_members"]
    what = (f"{figures['attacker']}: AUC {figures['auc']:.3f} [{figures['auc_interval'][0]:.3f}, "
            f"{figures['auc_interval'][1]:.3f}], advantage 2*AUC-1 {adv:.3f} [{lo:.3f}, {hi:.3f}], TPR at "
            f"{figures['fpr']:.0%} FPR {figures['tpr_at_fpr']:.3f} [{figures['tpr_interval'][0]:.3f}, "
            f"{figures['tpr_interval'][1]:.3f}]; {figures['members']} members vs {figures['non_members']} "
            "non-members (a release re-made from a random half of the attacked people); k-Same does not bound "
            "membership")
    if max_advantage is None:
        return Check("membership_advantage", True, adv, None,
                     what + "; report only (DEID_MEMBERSHIP_MAX_ADVANTAGE unset)", status="not_applicable",
                     interval=(lo, hi), n=n)
    status = "fail" if lo > max_advantage + 1e-12 else "pass" if hi <= max_advantage + 1e-12 else "inconclusive"
    rule = "decided from the lower bound"
    return Check("membership_advantage", status != "fail", adv, threshold, f"{what}; {rule}", status=status,
                 interval=(lo, hi), n=n)
