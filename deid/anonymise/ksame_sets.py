"""Distinct person-sets: swap faces between k-Same clusters so that no two clusters hold the same people.

Near-identical faces of one person (consecutive video frames, burst photos) sit at one point of the feature
space, and so do their neighbours' faces: the greedy (:func:`deid.anonymise.ksame_greedy.greedy_labels`)
then forms one cluster per frame with the *same* people each time, and the release repeats near-identical
averages (issue 26: 56 of 183 clusters of a 48 x 48 set with 3 frames per sequence). :func:`distinct_person_sets`
gives each such cluster but one another set of people by the cheapest swap of one face with a nearby cluster
(the smallest increase of the within-cluster sum of squares), where one exists.

A swap exchanges a face of person ``p`` in cluster ``b`` with a face of person ``q`` in cluster ``c`` only
when ``q`` has no face in ``b`` and ``p`` none in ``c``: sizes do not change, ``b`` keeps at least as many
distinct people (it may lose ``p`` and gains ``q``), ``q`` and ``p`` hold one face of the cluster they join,
and no person gains a face anywhere, so every rule of the grouping holds after each swap (>= k distinct
people, no person above ``floor(size / k)`` images of a cluster, the same number of clusters). A swap is made
only when neither new set is already some cluster's.

It runs for every k-Same grouping. In a drop that declares image sequences a video links its frames, and its
person is narrowed to the people common to all its frames' clusters
(:func:`deid.evaluation.sequences.sequence_linkage_check`), which repeated person-sets keep at k and distinct ones
shrink: per-frame k-Same fails that check there with or without this pass (a 48 x 48 drop: 231 of 305 sequences
below k before, 303 after), and the methods for sequences (multi-factor) cluster each person once, where no
person-set can repeat.
"""
from __future__ import annotations

import logging
from collections import Counter

import numpy as np

logger = logging.getLogger(__name__)

NEAREST_CLUSTERS = 16  # clusters (nearest by mean) searched for a swap partner of a repeated cluster


def repeated_person_sets(labels: np.ndarray, codes: np.ndarray) -> int:
    """How many clusters hold the same set of people as another cluster."""
    sets = Counter(frozenset(codes[labels == c].tolist()) for c in np.unique(labels))
    return sum(n for n in sets.values() if n > 1)


def _may_repeat(labels: np.ndarray, codes: np.ndarray, n_g: int) -> bool:
    """False when no two clusters can share a person-set: a hash of each cluster's set of people (the sum of a
    seeded random 64-bit number per person, wrapping) is unique. Array work only (a million faces: ~0.1 s);
    equal hashes are checked exactly by the caller."""
    width = int(codes.max()) + 1
    pairs = np.unique(labels.astype(np.int64) * width + codes)  # each (cluster, person) once
    tag = np.random.default_rng(0x5E75).integers(0, 2**63, size=width, dtype=np.int64).view(np.uint64)
    h = np.zeros(n_g, dtype=np.uint64)
    np.add.at(h, pairs // width, tag[pairs % width])
    return np.unique(h).size < n_g


def distinct_person_sets(X: np.ndarray, codes: np.ndarray, labels: np.ndarray, k: int) -> int:
    """Swap faces so that no two clusters share a person-set where a rule-keeping swap allows; in place.

    ``labels`` (0 .. n_clusters - 1) are changed in place; returns the number of swaps. Clusters are
    visited in index order; of each group of clusters with one person-set, the first keeps it and each
    other takes the cheapest valid swap with one of its :data:`NEAREST_CLUSTERS` nearest clusters (by
    mean; all clusters when none of those allows one), ties to the lowest indices; passes repeat until
    one swaps nothing. So afterwards, of clusters sharing a person-set, every one but the first (lowest
    index) has no single rule-keeping swap with any cluster that would give both a set no cluster holds.
    """
    n_g = int(labels.max()) + 1 if labels.size else 0
    if n_g < 2 or not _may_repeat(labels, np.asarray(codes, dtype=np.int64), n_g):
        return 0
    order = np.argsort(labels, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(labels, minlength=n_g))]
    members = [order[bounds[g]:bounds[g + 1]].tolist() for g in range(n_g)]
    held = [Counter(codes[m].tolist()) for m in members]
    sets = [frozenset(h) for h in held]
    count = Counter(sets)
    if all(count[s] == 1 for s in sets):
        return 0
    Xd = np.asarray(X, dtype=np.float64)  # the greedy's block: float64 already, no copy
    sums = np.zeros((n_g, X.shape[1]))
    np.add.at(sums, labels, Xd)
    sizes = np.diff(bounds).astype(np.float64)
    swaps = 0
    while True:  # until a pass swaps nothing: each swap takes one cluster out of a repeated set, so few passes
        made = 0
        seen: set = set()
        for b in range(n_g):
            if count[sets[b]] == 1 or sets[b] not in seen:
                seen.add(sets[b])
                continue
            best = _cheapest_swap(Xd, codes, b, members, held, sets, count, sums, sizes)
            if best is None:
                continue
            i, j, c = best
            for g, out, into in ((b, i, j), (c, j, i)):
                members[g][members[g].index(out)] = into
                held[g][int(codes[out])] -= 1
                if not held[g][int(codes[out])]:
                    del held[g][int(codes[out])]
                held[g][int(codes[into])] += 1
                sums[g] += Xd[into] - Xd[out]
                count[sets[g]] -= 1
                sets[g] = frozenset(held[g])
                count[sets[g]] += 1
                labels[into] = g
            made += 1
        swaps += made
        if not made:
            break
    if swaps:
        logger.debug("k-Same: %d swaps gave repeated person-sets other people", swaps)
    return swaps


def _cheapest_swap(Xd, codes, b, members, held, sets, count, sums, sizes):
    """(face of b, face of c, c) of the cheapest valid swap for cluster ``b``, or None."""
    means = sums / sizes[:, None]
    dist = np.einsum("ij,ij->i", means - means[b], means - means[b])
    dist[b] = np.inf
    mb = np.asarray(members[b])
    best = None
    for rank, c in enumerate(np.argsort(dist, kind="stable").tolist()):
        if not np.isfinite(dist[c]) or (rank >= NEAREST_CLUSTERS and best is not None):
            break  # the nearest clusters gave a swap; further ones are searched only when they did not
        mc = np.asarray(members[c])
        ok_i = np.array([int(codes[i]) not in held[c] for i in mb])
        ok_j = np.array([int(codes[j]) not in held[b] for j in mc])
        if not ok_i.any() or not ok_j.any():
            continue
        # Change of the within-cluster sum of squares of b (x_i out, x_j in) and c (x_j out, x_i in):
        # SSE = sum |x|^2 - |S|^2 / n for a cluster of n faces with sum S.
        xi, xj = Xd[mb], Xd[mc]
        sq_i, sq_j = np.einsum("ij,ij->i", xi, xi), np.einsum("ij,ij->i", xj, xj)
        sb, sc = sums[b], sums[c]
        nb, nc = sizes[b], sizes[c]
        new_b = sb[None, None, :] - xi[:, None, :] + xj[None, :, :]
        new_c = sc[None, None, :] - xj[None, :, :] + xi[:, None, :]
        cost = (sq_j[None, :] - sq_i[:, None]) - (np.einsum("ijd,ijd->ij", new_b, new_b) - sb @ sb) / nb \
            + (sq_i[:, None] - sq_j[None, :]) - (np.einsum("ijd,ijd->ij", new_c, new_c) - sc @ sc) / nc
        cost[~ok_i, :] = np.inf
        cost[:, ~ok_j] = np.inf
        for flat in np.argsort(cost, axis=None, kind="stable").tolist():
            a, z = divmod(flat, len(mc))
            if not np.isfinite(cost[a, z]) or (best is not None and cost[a, z] >= best[0]):
                break
            p, q = int(codes[mb[a]]), int(codes[mc[z]])
            nbset = (sets[b] - {p} if held[b][p] == 1 else sets[b]) | {q}
            ncset = (sets[c] - {q} if held[c][q] == 1 else sets[c]) | {p}
            if count[nbset] or count[ncset] or nbset == ncset:
                continue
            best = (float(cost[a, z]), int(mb[a]), int(mc[z]), c)
            break
    return None if best is None else best[1:]
