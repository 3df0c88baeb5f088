"""The recogniser's same-person threshold, calibrated on a drop's own faces (issue 27).

:func:`calibrate_recogniser` judges, per k-means subset of the descriptors, whether the recogniser separates the
people there (its ids with several faces identified), and sets the merge threshold at the robust lower tail of the
distance to the nearest other id; :func:`deid.anonymise.identity.resolve_people` merges with it. Split from
:mod:`deid.anonymise.identity` (the rules that use it) as its own room.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from deid.errors import ConfigError
from deid.neighbours import distance_blocks

log = logging.getLogger(__name__)

# Recogniser calibration (issue 27): the merge threshold is set on the drop's own faces, never above
# MAX_SAME_PERSON (London, 102 people x 2: 0 false of 20,604 pairs below 0.45, yet two participants sit at
# 0.447), at the robust lower tail of the distances from a record to its nearest other id, so that about
# FALSE_MERGE_TARGET of the records of real, distinct people would have another person within it.
MAX_SAME_PERSON = 0.45
DUPLICATE_DISTANCE = 0.12  # near-copies in descriptor space: what merges where the recogniser does not separate
MIN_MEDIAN_OTHER = 0.65  # a subset with no id of several faces is informative when its median other-id distance >= this
FALSE_MERGE_TARGET = 1e-3
MIN_IDENTIFIED = 0.8  # a subset is informative when this share of its several-face ids is identified (lower bound)
SUBSET_SIZE = 60  # descriptors per k-means subset (at most MAX_SUBSETS subsets)
MAX_SUBSETS = 8
MIN_SUBSET = 30  # smaller k-means subsets join their nearest larger one



def rate_interval(count: int, n: int, confidence: float) -> dict:
    """A rate with its two-sided Clopper-Pearson interval at ``confidence``."""
    from scipy.stats import beta  # noqa: PLC0415

    if n <= 0:
        return {"count": int(count), "n": 0, "rate": None, "interval": None}
    a = (1 - confidence) / 2
    lo = 0.0 if count == 0 else float(beta.ppf(a, count, n - count + 1))
    hi = 1.0 if count == n else float(beta.ppf(1 - a, count + 1, n - count))
    return {"count": int(count), "n": int(n), "rate": round(count / n, 6), "interval": [round(lo, 6), round(hi, 6)]}


def _nearest_by_code(E: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each row's nearest row under its own code and under another code: (same, d_same, other, d_other).

    Exact (blocked); ``d_same`` is inf for a row whose code has no other row.
    """
    n = len(E)
    out = [np.full(n, -1, np.int64), np.full(n, np.inf), np.full(n, -1, np.int64), np.full(n, np.inf)]
    for s, d2 in distance_blocks(E, max_cells=4_000_000):
        rows = np.arange(s, s + len(d2))
        d2[np.arange(len(d2)), rows] = np.inf
        same = codes[rows, None] == codes[None, :]
        for k, mask in ((0, ~same), (2, same)):
            d = np.where(mask, np.inf, d2)
            j = np.argmin(d, axis=1)
            out[k][rows] = j
            out[k + 1][rows] = np.sqrt(np.maximum(d[np.arange(len(j)), j], 0.0))
    return out[0], out[1], out[2], out[3]


@dataclass(frozen=True)
class Calibration:
    """The recogniser's merge threshold for one drop, judged on that drop's own faces.

    ``informative[i]``: the recogniser separates the people of descriptor row i's subset (its pairs
    merge below ``threshold``). ``row_threshold[i]``: the distance below which row i matches another id's
    row (a pair matches below the smaller of its two rows'): ``threshold`` in informative subsets; in an
    undecided subset that subset's own lower tail, never below ``duplicate`` nor above the cap.
    ``false_merge``: the share of records of ids with several faces (informative subsets) whose nearest
    other id lies within the threshold; ``miss``: the share whose own other face does not. Both with
    intervals.
    """

    threshold: float
    duplicate: float
    informative: np.ndarray
    subsets: tuple[dict, ...]
    false_merge: dict
    miss: dict
    tail_threshold: float | None
    false_merge_target: float
    row_threshold: np.ndarray
    row_scale: np.ndarray  # each row's subset's median distance to the nearest other id (nan: none)

    def to_dict(self) -> dict:
        return {"threshold": round(self.threshold, 4), "duplicate_threshold": self.duplicate,
                "tail_threshold": None if self.tail_threshold is None else round(self.tail_threshold, 4),
                "false_merge_target": self.false_merge_target, "false_merge": self.false_merge, "miss": self.miss,
                "records_informative": int(np.count_nonzero(self.informative)),
                "records_undecided": int(np.count_nonzero(~self.informative)), "subsets": list(self.subsets)}


def calibrate_recogniser(E: np.ndarray, codes: np.ndarray, *, max_threshold: float = MAX_SAME_PERSON,
                         duplicate: float = DUPLICATE_DISTANCE, false_merge_target: float = FALSE_MERGE_TARGET,
                         min_identified: float = MIN_IDENTIFIED, min_median_other: float = MIN_MEDIAN_OTHER,
                         confidence: float = 0.95) -> Calibration:
    """Calibrate the recogniser's same-person threshold on a drop's own descriptors.

    1. The descriptors are split into subsets by k-means (one per :data:`SUBSET_SIZE` rows, at most
       :data:`MAX_SUBSETS`): faces the recogniser does not separate (cartoons, low resolution, infrared)
       gather in their own region of descriptor space, and must not switch the recogniser off for the rest.
    2. A subset is *informative* when its ids with several faces are identified (a face's nearest other face
       is its own id's) at a rate whose lower confidence bound is at least ``min_identified``; a subset with
       fewer than 3 such ids, when the median distance between its faces of different ids is at least
       ``min_median_other``.
    3. Over the informative rows, the distance to the nearest other id is modelled by its median and
       MAD (robust to a minority of copies planted under other ids); the threshold is its lower tail at
       ``false_merge_target``, capped at ``max_threshold`` and floored at ``duplicate``. An undecided
       subset gets the same lower tail of its own rows' distances (floored at ``duplicate``): where
       the recogniser does not separate people their nearest other ids are close and that tail stays at
       ``duplicate``; where copies planted under other ids made some of its people "not identified"
       (the victim's nearest other id is her own copy), the other people's distances stay far and the
       copies still merge. Either way about ``false_merge_target`` of distinct people fall within it.
    4. The false-merge and miss rates are counted on the rows of ids with several faces, with intervals.

    Parameters
    ----------
    E : ndarray of shape (n, d)
        Descriptors (dlib ResNet, 128-d).
    codes : ndarray of shape (n,)
        An integer per row, equal for rows of the same id.
    max_threshold, duplicate, false_merge_target, min_identified, min_median_other, confidence : float

    Returns
    -------
    Calibration

    References
    ----------
    P. J. Rousseeuw, C. Croux. Alternatives to the median absolute deviation. JASA 88:1273-1283, 1993.
    """
    E = np.asarray(E, dtype=np.float64)
    codes = np.asarray(codes)
    n = len(E)
    if not 0 < false_merge_target < 0.5:
        raise ConfigError(f"false_merge_target={false_merge_target!r} must be in (0, 0.5); e.g. 0.001")
    _, d_same, _, d_other = _nearest_by_code(E, codes) if n >= 2 else (None, np.full(n, np.inf), None,
                                                                       np.full(n, np.inf))
    labels = _descriptor_subsets(E)
    informative = np.zeros(n, bool)
    row_scale = np.full(n, np.nan)  # each row's subset's median distance to the nearest other id
    subsets, parts = [], []
    for s in range(int(labels.max()) + 1 if n else 1):
        rows = np.flatnonzero(labels == s)
        own = d_other[rows][np.isfinite(d_other[rows])]  # the subset's finite nearest-other-id distances
        if len(own):
            row_scale[rows] = float(np.median(own))
        entry = _judge_subset(E, codes, rows, d_same, d_other, seed=s, confidence=confidence,
                              min_identified=min_identified, min_median_other=min_median_other)
        informative[rows] = entry["informative"]
        subsets.append(entry)
        parts.append((rows, own))
    threshold, tail = _tail_threshold(d_other[informative & np.isfinite(d_other)],
                                      any_informative=bool(informative.any()), max_threshold=max_threshold,
                                      duplicate=duplicate, false_merge_target=false_merge_target)
    row_threshold = np.where(informative, threshold, float(duplicate))
    for entry, (rows, own) in zip(subsets, parts):
        if not entry["informative"]:
            t, _ = _tail_threshold(own, any_informative=len(own) >= MIN_SUBSET, max_threshold=max_threshold,
                                   duplicate=duplicate, false_merge_target=false_merge_target)
            row_threshold[rows] = t
            entry["threshold"] = round(t, 4)
    ref_inf = informative & np.isfinite(d_same) & np.isfinite(d_other)
    n_ref = int(np.count_nonzero(ref_inf))
    false_merge = rate_interval(int(np.count_nonzero(d_other[ref_inf] < threshold)), n_ref, confidence)
    miss = rate_interval(int(np.count_nonzero(d_same[ref_inf] >= threshold)), n_ref, confidence)
    if not informative.all():
        log.warning("identity: the recogniser does not separate %d of %d embedded faces (their subsets); only "
                    "near-copies and pairs below their subset's own lower tail (distance < %.2f-%.2f) merge there",
                    int(np.count_nonzero(~informative)), n, duplicate, float(row_threshold[~informative].max()))
    return Calibration(threshold, float(duplicate), informative, tuple(subsets), false_merge, miss, tail,
                       float(false_merge_target), row_threshold, row_scale)


def _descriptor_subsets(E: np.ndarray) -> np.ndarray:
    """Step 1 of :func:`calibrate_recogniser`: the subset of each descriptor row, ``0..n_subsets-1``.

    k-means (:func:`_kmeans`) with one subset per :data:`SUBSET_SIZE` rows, at most :data:`MAX_SUBSETS`; a
    subset of fewer than :data:`MIN_SUBSET` rows joins the nearest larger one. One subset (all zeros) below
    ``2 * SUBSET_SIZE`` rows.
    """
    n = len(E)
    labels = np.zeros(n, np.int64)
    n_sub = int(min(MAX_SUBSETS, max(1, n // SUBSET_SIZE)))
    if n_sub > 1:
        labels = _kmeans(E, n_sub)
        # A small subset cannot show that the recogniser separates it (8 of 8 identified: lower bound 0.63):
        # its faces join the nearest subset of at least MIN_SUBSET faces.
        sizes = np.bincount(labels, minlength=n_sub)
        big = np.flatnonzero(sizes >= MIN_SUBSET)
        if len(big) and len(big) < n_sub:
            centres = np.array([E[labels == j].mean(0) for j in big])
            small = ~np.isin(labels, big)
            labels[small] = big[np.argmin(((E[small][:, None, :] - centres[None]) ** 2).sum(-1), axis=1)]
        labels = np.unique(labels, return_inverse=True)[1].ravel()
    return labels


def _judge_subset(E: np.ndarray, codes: np.ndarray, rows: np.ndarray, d_same: np.ndarray, d_other: np.ndarray, *,
                  seed: int, confidence: float, min_identified: float, min_median_other: float) -> dict:
    """Step 2 of :func:`calibrate_recogniser`: is one subset of descriptors informative, and the evidence.

    Parameters
    ----------
    E, codes : ndarray
        All descriptors and their id codes.
    rows : ndarray of int
        The subset's rows.
    d_same, d_other : ndarray of shape (n,)
        Each row's distance to its nearest row of the same id and of another id (inf: none).
    seed : int
        Seed of the random pairs of the rule without ids of several faces (the subset's number).
    confidence, min_identified, min_median_other : float
        As in :func:`calibrate_recogniser`.

    Returns
    -------
    dict
        The subset's entry of :attr:`Calibration.subsets`: records, ids with several faces, median nearest other
        id, the rule and its evidence, and ``informative`` (bool).
    """
    from scipy.stats import beta  # noqa: PLC0415

    ref = rows[np.isfinite(d_same[rows]) & np.isfinite(d_other[rows])]
    ref_ids = len(np.unique(codes[ref]))
    finite = d_other[rows][np.isfinite(d_other[rows])]
    med = float(np.median(finite)) if len(finite) else float("nan")
    entry: dict[str, Any] = {"records": int(len(rows)), "ids_with_several_faces": int(ref_ids),
             "median_nearest_other": None if np.isnan(med) else round(med, 4)}
    if ref_ids >= 3:
        hit = int(np.count_nonzero(d_same[ref] < d_other[ref]))
        lo = 0.0 if hit == 0 else float(beta.ppf(1 - confidence, hit, len(ref) - hit + 1))
        ok = lo >= min_identified
        entry.update(identified=rate_interval(hit, len(ref), confidence), rule=f"identified lower bound >= "
                     f"{min_identified:g}")
    else:
        # No ids of several faces to judge by: the old rule, the median distance between random pairs of
        # different ids (London 0.83, cartoons 0.47), within this subset only.
        rng = np.random.default_rng(seed)
        a, b = rng.choice(rows, 20_000), rng.choice(rows, 20_000)
        keep = codes[a] != codes[b]
        pair_med = float(np.median(np.linalg.norm(E[a[keep]] - E[b[keep]], axis=1))) if keep.any() else float("nan")
        ok = not np.isnan(pair_med) and pair_med >= min_median_other
        entry.update(median_other_pair=None if np.isnan(pair_med) else round(pair_med, 4),
                     rule=f"median distance between different ids >= {min_median_other:g}")
    entry["informative"] = bool(ok)
    return entry


def _tail_threshold(o: np.ndarray, *, any_informative: bool, max_threshold: float, duplicate: float,
                    false_merge_target: float) -> tuple[float, float | None]:
    """Step 3 of :func:`calibrate_recogniser`: the merge threshold from the informative rows' distances to their
    nearest other id ``o``.

    The lower tail of a normal with ``o``'s median and MAD (x 1.4826) at ``false_merge_target``, capped at
    ``max_threshold`` and floored at ``duplicate``; ``max_threshold`` with fewer than two distances; ``duplicate``
    when no row is informative.

    Returns
    -------
    threshold : float
    tail : float or None
        The tail before the cap and floor (None: not modelled).
    """
    from scipy.stats import norm  # noqa: PLC0415

    tail = None
    threshold = duplicate
    if any_informative:
        if len(o) >= 2:
            med = float(np.median(o))
            sigma = 1.4826 * float(np.median(np.abs(o - med)))
            tail = med - float(norm.isf(false_merge_target)) * sigma
            threshold = float(min(max_threshold, max(duplicate, tail)))
        else:
            threshold = float(max_threshold)
    return threshold, tail


def _kmeans(E: np.ndarray, k: int, *, iterations: int = 30, seed: int = 0) -> np.ndarray:
    """Lloyd's k-means with k-means++ seeding (fixed seed: the same subsets for the same descriptors).

    D. Arthur, S. Vassilvitskii. k-means++: the advantages of careful seeding. SODA 2007.
    """
    rng = np.random.default_rng(seed)
    centres = [E[int(rng.integers(len(E)))]]
    d2 = ((E - centres[0]) ** 2).sum(1)
    for _ in range(1, k):
        p = d2 / d2.sum() if d2.sum() > 0 else None
        centres.append(E[int(rng.choice(len(E), p=p))])
        d2 = np.minimum(d2, ((E - centres[-1]) ** 2).sum(1))
    C = np.array(centres)
    labels = np.zeros(len(E), np.int64)
    for _ in range(iterations):
        dist = (E * E).sum(1)[:, None] + (C * C).sum(1)[None, :] - 2.0 * (E @ C.T)
        new = np.argmin(dist, axis=1)
        if _ and np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            if np.any(labels == j):
                C[j] = E[labels == j].mean(0)
    return labels
