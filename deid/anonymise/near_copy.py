"""Near-copy repair of k-Same clusters: merge a cluster whose average nearly shows one member, else suppress it.

In a large drop some average-looking person is nearly the mean of their own cluster (an
extreme-value effect: the smallest distance from a released average to a member's own face
fell from 3.11 grey levels at 10,000 faces to 1.95 at 1,000,000, issue 13). The gate's
``no_near_copies`` check rightly rejects such a release; this module lets the
de-identification stage repair the few clusters concerned instead of losing the whole release.

The rule (:func:`plan_repair`), per label partition and for methods whose every cluster member
receives the cluster's identical pixel mean (:attr:`deid.method_registry.MethodSpec.repairs_near_copies`):

1. a cluster is a *near copy* when one of its members' aligned faces lies below ``threshold``
   (the gate's ``leak_threshold``, mean absolute grey difference, the measure of
   :func:`deid.evaluation.leaks.mean_abs_difference`) from the cluster's released image;
2. near-copy clusters are taken in index order; each is merged with its nearest cluster (squared
   Euclidean distance between the clusters' mean eigenface features, the space k-Same groups in;
   ties to the lowest index) among the clusters no earlier merge used; the merged mean is computed
   and every member of both clusters checked again;
3. if the merged cluster is still a near copy, or no partner is left, the near-copy cluster's
   records are suppressed (reason ``near_copy``) and its would-be partner is left as it was.

Merging two clusters of >= k distinct people, each with no person above 1/k of its images, gives
a cluster with the same two properties (people add, and a person's share of the union is at most
the larger of their two shares); the stages check it anyway (:func:`check_merged`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np

from deid.anonymise.clusters import cluster_shares
from deid.errors import StateError
from deid.bound import within_bound

NEAR_COPY = "near_copy"  # the suppression reason (deid.errors.REASONS)
# Above this share of the judged records suppressed as near copies, the report says so plainly:
# a correct k-Same release of distinct people has a handful at most (1 in 1,000,000 measured), so
# more points at duplicated faces, a mislabelled drop or a threshold set too high.
WARN_SHARE = 0.01


@dataclass(frozen=True)
class RepairPlan:
    """Which near-copy clusters merge with which partner, and which are suppressed (cluster indices)."""

    near: tuple[int, ...]
    merges: tuple[tuple[int, int], ...]  # (near-copy cluster, partner)
    suppressed: tuple[int, ...]
    merged_distance: tuple[float, ...] = ()  # per merge, the smallest own distance in the merged cluster


@dataclass(frozen=True)
class NearCopyRepair:
    """What the near-copy repair did (one partition, or the run once :meth:`combine` d)."""

    threshold: float
    clusters_checked: int = 0
    near_copy_clusters: int = 0
    clusters_merged: int = 0
    clusters_suppressed: int = 0
    records_suppressed: int = 0
    min_distance_before: float | None = None  # smallest own distance before the repair
    min_distance_after: float | None = None   # ... and of the released clusters after it

    @classmethod
    def combine(cls, parts: Iterable[NearCopyRepair]) -> NearCopyRepair | None:
        """The run's repair from its partitions' (None when no partition was repaired)."""
        parts = list(parts)
        if not parts:
            return None

        def low(name: str) -> float | None:
            got = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            return min(got) if got else None

        return cls(threshold=parts[0].threshold, clusters_checked=sum(p.clusters_checked for p in parts),
                   near_copy_clusters=sum(p.near_copy_clusters for p in parts),
                   clusters_merged=sum(p.clusters_merged for p in parts),
                   clusters_suppressed=sum(p.clusters_suppressed for p in parts),
                   records_suppressed=sum(p.records_suppressed for p in parts),
                   min_distance_before=low("min_distance_before"), min_distance_after=low("min_distance_after"))

    def warning(self, judged: int) -> str | None:
        """The report's warning when more than :data:`WARN_SHARE` of the records were suppressed as near copies."""
        total = judged + self.records_suppressed
        if not total or self.records_suppressed <= WARN_SHARE * total:
            return None
        return (f"near-copy repair suppressed {self.records_suppressed} of {total} records "
                f"({self.records_suppressed / total:.1%}, above {WARN_SHARE:.0%}): their cluster averages stayed "
                f"within {self.threshold:g} grey levels of a member's own face, merged with their nearest cluster or with "
                "none left to merge with; a k-Same release of distinct people has a handful at most, so look for "
                "duplicated or near-identical faces in the drop, or a leak threshold set too high")

    def to_dict(self) -> dict:
        return {"threshold": self.threshold, "clusters_checked": self.clusters_checked,
                "near_copy_clusters": self.near_copy_clusters, "clusters_merged": self.clusters_merged,
                "clusters_suppressed": self.clusters_suppressed, "records_suppressed": self.records_suppressed,
                "min_distance_before": self.min_distance_before, "min_distance_after": self.min_distance_after}


def closest_member(labels: np.ndarray, distance: np.ndarray, n_clusters: int) -> np.ndarray:
    """Per cluster, the smallest distance of a member's own face to the cluster's released image (inf: empty)."""
    out = np.full(n_clusters, np.inf)
    np.minimum.at(out, labels, distance)
    return out


def cluster_centroids(X: np.ndarray | Iterable[np.ndarray], labels: np.ndarray, n_clusters: int) -> np.ndarray:
    """Mean feature vector of every cluster (float64, n_clusters x d).

    ``X``: the (n, d) features, or their rows as consecutive blocks in order (e.g. read from Parquet
    a batch at a time, issue 13). ``np.add.at`` adds the rows in order, so blocks give the same sums.
    """
    blocks = (X[a:a + _CENTROID_ROWS] for a in range(0, len(X), _CENTROID_ROWS)) if isinstance(X, np.ndarray) else X
    sums = None
    start = 0
    for block in blocks:
        if sums is None:
            sums = np.zeros((n_clusters, block.shape[1]), np.float64)
        np.add.at(sums, labels[start:start + len(block)], np.asarray(block, np.float64))
        start += len(block)
    if sums is None:  # no rows
        sums = np.zeros((n_clusters, X.shape[1] if isinstance(X, np.ndarray) else 0), np.float64)
    return sums / np.maximum(np.bincount(labels, minlength=n_clusters), 1)[:, None]


_CENTROID_ROWS = 8192  # rows converted to float64 at a time


def plan_repair(closest: np.ndarray, centroids: np.ndarray, *, threshold: float,
                merged_closest: Callable[[int, int], float]) -> RepairPlan:
    """Decide, per near-copy cluster, a merge with its nearest cluster or suppression (module docstring).

    Parameters
    ----------
    closest : ndarray of shape (n_clusters,)
        :func:`closest_member` of the clusters as made.
    centroids : ndarray of shape (n_clusters, d)
        Mean eigenface features of the clusters (:func:`cluster_centroids`).
    threshold : float
        The gate's leak threshold (grey levels): a member below it makes its cluster a near copy.
    merged_closest : callable
        ``merged_closest(a, b)``: the smallest own distance of a member of clusters ``a`` and ``b``
        to the mean of their union, computed as the release would compute it.

    Returns
    -------
    RepairPlan

    References
    ----------
    E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images. IEEE Trans.
    Knowledge and Data Engineering 17(2):232-243, 2005 (k-Same, whose clusters this repairs; the
    repair itself is deid's, for the gate's near-copy check of :mod:`deid.evaluation.leaks`).
    """
    closest = np.asarray(closest, np.float64)
    near = tuple(int(c) for c in np.flatnonzero(closest < threshold))
    used = np.zeros(len(closest), bool)
    merges, suppressed, merged_d = [], [], []
    for c in near:
        if used[c]:  # already merged as an earlier cluster's partner, and checked then
            continue
        d = ((centroids - centroids[c]) ** 2).sum(axis=1)
        d[used] = np.inf
        d[c] = np.inf
        d[suppressed] = np.inf
        partner = int(np.argmin(d)) if len(d) and np.isfinite(d).any() else -1
        got = merged_closest(c, partner) if partner >= 0 else -np.inf
        if got >= threshold:
            merges.append((c, partner))
            merged_d.append(float(got))
            used[[c, partner]] = True
        else:
            suppressed.append(c)
    return RepairPlan(near=near, merges=tuple(merges), suppressed=tuple(suppressed), merged_distance=tuple(merged_d))


def relabel(labels: np.ndarray, plan: RepairPlan) -> np.ndarray:
    """The records' clusters after the repair: a merged cluster's records join their partner; suppressed: -1."""
    out = np.array(labels, dtype=np.int64, copy=True)
    for c, partner in plan.merges:
        out[labels == c] = partner
    for c in plan.suppressed:
        out[labels == c] = -1
    return out


def check_merged(labels: np.ndarray, people: Sequence[Hashable], plan: RepairPlan, *, k: int) -> None:
    """Raise :class:`StateError` unless every merged cluster holds >= k people and no person above 1/k of it.

    The gate's own per-cluster count (:func:`deid.anonymise.clusters.cluster_shares`) on the merged clusters.
    """
    if not plan.merges:
        return
    merged = np.isin(labels, [p for _, p in plan.merges])
    idx = np.flatnonzero(merged)
    _, distinct, shares = cluster_shares(list(labels[idx]), [people[i] for i in idx])
    bad = {c: (distinct[c], shares[c]) for c in distinct if distinct[c] < k or not within_bound(shares[c], k)}
    if bad:
        raise StateError(f"near-copy repair: merged clusters {sorted(bad)[:5]} break k={k} (distinct people, "
                         f"largest person share) = {list(bad.values())[:5]}; this is a bug, nothing was released")


def repair_in_memory(labels: np.ndarray, X: np.ndarray, people: Sequence[Hashable], released: np.ndarray,
                     originals: np.ndarray, image_of: Callable[[np.ndarray], np.ndarray], *, k: int, threshold: float,
                     distance: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> tuple[np.ndarray, NearCopyRepair]:
    """The repair on a partition held in memory (the colour path): new labels (-1: suppressed) and its summary.

    ``released`` and ``originals`` are every record's released and aligned grey faces (uint8, n x
    n_pixels); ``image_of(members)`` the released grey image (n_pixels,) of a cluster of those
    record indices, made as the release makes it; ``distance(a, b)`` the row-wise measure
    (:func:`deid.evaluation.leaks.mean_abs_difference`).
    """
    labels = np.asarray(labels, np.int64)
    n_clusters = int(labels.max()) + 1 if len(labels) else 0
    closest = closest_member(labels, distance(released, originals), n_clusters)

    def merged_closest(a: int, b: int) -> float:
        members = np.flatnonzero((labels == a) | (labels == b))
        image = image_of(members)
        return float(distance(np.broadcast_to(image, (len(members), image.size)), originals[members]).min())

    plan = plan_repair(closest, cluster_centroids(X, labels, n_clusters), threshold=threshold,
                       merged_closest=merged_closest)
    new = relabel(labels, plan)
    check_merged(new, people, plan, k=k)
    return new, summarize(plan, closest, new, threshold=threshold)


def summarize(plan: RepairPlan, closest: np.ndarray, labels_after: np.ndarray, *, threshold: float
              ) -> NearCopyRepair:
    """The :class:`NearCopyRepair` of one partition's plan (``closest``: :func:`closest_member` before it)."""
    closest = np.asarray(closest, np.float64)
    finite = closest[np.isfinite(closest)]
    after = closest.copy()
    for (c, partner), d in zip(plan.merges, plan.merged_distance):
        after[c], after[partner] = np.inf, d
    after[list(plan.suppressed)] = np.inf
    low = after[np.isfinite(after)]
    return NearCopyRepair(threshold=float(threshold), clusters_checked=int(len(finite)),
                          near_copy_clusters=len(plan.near), clusters_merged=len(plan.merges),
                          clusters_suppressed=len(plan.suppressed),
                          records_suppressed=int(np.count_nonzero(labels_after < 0)),
                          min_distance_before=float(finite.min()) if len(finite) else None,
                          min_distance_after=float(low.min()) if len(low) else None)
