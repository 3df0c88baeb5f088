"""The k-Same greedy: faces grouped into clusters of at least k distinct people, none above 1/k of a cluster.

:func:`greedy_labels` is a capacity-constrained MDAV greedy (Domingo-Ferrer & Torra 2005) over the
faces' features: it forms the feasible maximum of ``floor(n / k)`` clusters of pairwise distinct
people (:func:`deid.anonymise.ksame.feasible_clusters`), seeding each at the face farthest from the
remaining centroid and filling it with the nearest faces of further people (:func:`_nearest_distinct`),
then moves faces out of groups larger than k where that lowers the within-cluster sum of squares
(:func:`_refine_moves`) and gives groups that repeat another's set of people other people
(:mod:`deid.anonymise.ksame_sets`). It is O(N^2): above a block size the faces are first split into blocks
(:mod:`deid.anonymise.ksame_blocks`); :class:`deid.anonymise.ksame.KSame` is the estimator.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from deid.anonymise.ksame_sets import distinct_person_sets

logger = logging.getLogger(__name__)

CHUNK_ROWS = 8192  # rows of X a temporary copy holds at a time (issue 13: never a second copy of all of X)


def as_features(X: Any) -> np.ndarray:
    """``X`` as float64, or as float32 when it is float32: the grouping then converts a part at a time
    (float32 to float64 is exact, so every sum and product is the one of the float64 copy; issue 13)."""
    X = np.asarray(X)
    return X if X.dtype == np.float32 else np.asarray(X, dtype=np.float64)


def _nearest_distinct(d: np.ndarray, codes: np.ndarray, need: int, n_alive: int) -> np.ndarray:
    """Positions of the ``need`` nearest entries of ``d`` with pairwise distinct ``codes``.

    Walks the faces by increasing distance (ties: lowest position first) and keeps the first
    face of each person. Only a short head of the order is sorted; it grows when the head
    does not hold enough distinct people.
    """
    m = min(n_alive, max(4 * need, 64))
    while True:
        if m >= n_alive:
            order = np.argsort(d, kind="stable")[:n_alive]
        else:
            t = np.partition(d, m - 1)[m - 1]
            cand = np.flatnonzero(d <= t)  # every tie at the threshold, in position order
            order = cand[np.argsort(d[cand], kind="stable")]
        _, first = np.unique(codes[order], return_index=True)
        if len(first) >= need or m >= n_alive:
            return order[np.sort(first)[:need]]
        m *= 4


def greedy_labels(X: np.ndarray, codes: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """Cluster faces into groups of >= k distinct ``codes`` (people); returns (labels, n_leftover).

    A capacity-constrained MDAV greedy (issue 26): it forms the feasible maximum of
    ``floor(n / k)`` clusters (:func:`feasible_clusters`) unless a step below must take more than
    ``k`` people, and never collapses a partition whose people hold skewed numbers of images.

    Invariant, with ``r`` faces left: no person has more than ``T = floor(r / k)`` of them (true at
    the start: the caller refused anyone above ``floor(n / k)``, :func:`_check_shares`). Each step
    takes one image of each person of a set ``S`` of distinct people, ``|S| = max(k, |F|)``, where
    ``F`` are the people at the cap ``T``: they must be in ``S`` or the ``T - 1`` clusters left could
    not hold them. Afterwards every person has ``<= T - 1 <= floor((r - |S|) / k)`` left (for
    ``|F| > k``: ``r - |F| >= |F| (T - 1) >= k (T - 1)``), so the invariant holds and every later
    group can be filled with distinct people. With fewer than ``2k`` faces left, ``T = 1``: all of
    them are distinct people and form the last group. No face is left over, every group holds
    pairwise distinct people, so each person holds ``1 / size <= 1/k`` of any cluster.

    Seed rule: the remaining face farthest from the centroid of the remaining faces (as in MDAV
    microaggregation; among the forced people's faces when those fill the group alone); the group
    is the seed, the forced people's faces nearest the seed, then the nearest faces of further
    people. A pass moves faces out of groups larger than ``k`` into nearer groups that lack
    their person (:func:`_refine_moves`); a last one swaps faces so that no two groups hold the same
    set of people where a rule-keeping swap allows (:func:`deid.anonymise.ksame_sets.distinct_person_sets`:
    near-identical frames of one person otherwise land alongside the same other people in one group per
    frame, and the release repeats near-identical averages). Ties everywhere go to the lowest input index.

    References
    ----------
    J. Domingo-Ferrer, V. Torra. Ordinal, continuous and heterogeneous k-anonymity through
    microaggregation. Data Mining and Knowledge Discovery 11(2):195-212, 2005 (MDAV).
    """
    n = X.shape[0]
    labels = np.full(n, -1, dtype=np.intp)
    idx = np.arange(n)
    Xw = X
    sq = np.einsum("ij,ij->i", X, X)
    cw = codes
    alive = np.ones(n, dtype=bool)
    n_alive = n
    left = np.bincount(codes)
    total = X.sum(axis=0)
    g = 0
    while n_alive >= 2 * k:
        if 10 * n_alive <= 9 * len(idx):
            # The distance passes are memory-bound, so keep the working copy within ~10% of
            # the remaining faces; a copy every (len/10)/k groups costs far less than the
            # passes over dead rows it saves.
            idx, Xw, sq, cw = idx[alive], Xw[alive], sq[alive], cw[alive]
            alive = np.ones(len(idx), dtype=bool)
        members = _next_group(Xw, sq, cw, alive, n_alive, total / n_alive, left, k)
        labels[idx[members]] = g
        g += 1
        alive[members] = False
        n_alive -= len(members)
        total = total - Xw[members].sum(axis=0)
        np.subtract.at(left, cw[members], 1)
    rest = idx[alive]
    if rest.size:
        labels[rest] = g  # T = 1: every remaining face is a distinct person (the invariant)
        g += 1
    if g > 1:
        _refine_moves(X, codes, labels, k)
        distinct_person_sets(X, codes, labels, k)  # clusters repeating another's people get others (issue 26)
    return labels, int(n - k * g)


def _next_group(Xw: np.ndarray, sq: np.ndarray, cw: np.ndarray, alive: np.ndarray, n_alive: int,
                centroid: np.ndarray, left: np.ndarray, k: int) -> np.ndarray:
    """One step of :func:`greedy_labels`: positions (in the working copy) of the next group's faces.

    The seed is the live face farthest from ``centroid`` (among the forced people's faces when they
    fill the group alone); then each forced person's face nearest the seed (people with ``left ==
    n_alive // k`` faces left), then the nearest faces of further people, one per person, up to
    ``max(k, forced)`` people.
    """
    cap = n_alive // k
    forced = np.flatnonzero(left == cap) if int(left.max()) >= cap else np.empty(0, np.intp)
    far = sq - 2.0 * (Xw @ centroid)
    far[~alive] = -np.inf
    in_forced: Any = None
    if forced.size:
        in_forced = np.zeros(left.size, dtype=bool)
        in_forced[forced] = True
        if forced.size >= k:  # the forced people alone fill the group: seed among their faces
            far[~in_forced[cw]] = -np.inf
    s = int(np.argmax(far))
    d = sq - 2.0 * (Xw @ Xw[s])
    d[~alive] = np.inf
    d[s] = -np.inf  # the seed always heads its own group
    need = k
    if forced.size:
        # Each forced person's face nearest the seed goes first (ranked at -inf; one per person).
        cand = np.flatnonzero(alive & in_forced[cw])
        cand = cand[cw[cand] != cw[s]]
        if cand.size:
            order = cand[np.lexsort((cand, d[cand], cw[cand]))]
            first = order[np.r_[True, cw[order][1:] != cw[order][:-1]]]
            d[first] = -np.inf
        need = max(k, int(forced.size))
    return _nearest_distinct(d, cw, need, n_alive)


def _refine_moves(X: np.ndarray, codes: np.ndarray, labels: np.ndarray, k: int) -> int:
    """Move faces out of groups larger than ``k`` into groups they are nearer, keeping every rule.

    The greedy's last group (and a group that had to take more than ``k`` forced people) collects
    faces far from each other. A face of such a group moves to the group whose mean is nearest it
    when that group lacks its person and the move lowers the total within-cluster sum of squares
    (Ward's criterion, ``|B|/(|B|+1) d(x, m_B)^2 < |A|/(|A|-1) d(x, m_A)^2``); the source keeps >= k
    faces. Every group keeps pairwise distinct people, so the k rules hold after every move.
    Returns the number of moves.
    """
    n_g = int(labels.max()) + 1
    sizes = np.bincount(labels, minlength=n_g).astype(np.int64)
    big = np.flatnonzero(sizes > k)
    if big.size == 0:
        return 0
    Xd = np.asarray(X, dtype=np.float64)
    sums = np.zeros((n_g, X.shape[1]))
    np.add.at(sums, labels, Xd)
    has = {(int(c), int(g)) for c, g in zip(codes.tolist(), labels.tolist())}
    moves = 0
    for i in np.flatnonzero(np.isin(labels, big)).tolist():
        a = int(labels[i])
        if sizes[a] <= k:
            continue
        means = sums / sizes[:, None]
        dist = np.einsum("ij,ij->i", means - Xd[i], means - Xd[i])
        cost_out = sizes[a] / (sizes[a] - 1) * dist[a]
        gain = sizes / (sizes + 1) * dist
        gain[a] = np.inf
        p = int(codes[i])
        for b in np.argsort(gain, kind="stable").tolist():
            if gain[b] >= cost_out:
                break
            if (p, b) in has:
                continue
            labels[i] = b
            sums[a] -= Xd[i]
            sums[b] += Xd[i]
            sizes[a] -= 1
            sizes[b] += 1
            has.discard((p, a))
            has.add((p, b))
            moves += 1
            break
    if moves:
        logger.debug("k-Same: %d faces moved out of groups larger than k", moves)
    return moves
