"""k-Same and k-Same-Select face de-identification.

k-Same (Newton, Sweeney & Malin 2005) replaces every face by the pixel average of a
cluster of faces; k-Same-Select (Gross, Airoldi, Malin & Sweeney 2005) runs k-Same
separately inside each partition of utility labels so that the averages keep those labels.

This implementation counts *people*, not images: a cluster is only valid when it holds
images of at least ``k`` distinct people, because a dataset with several images per person
would otherwise let one person's images form a "cluster of k" on their own and release
that person's face unchanged. Every cluster also keeps each person at most ``floor(size/k)``
of its images (so at most 1/k of it), and above ``block_size`` faces the greedy runs in
blocks of the feature space so that a million faces group in about a minute.
"""
from __future__ import annotations

import logging
from collections import abc
from dataclasses import dataclass
from functools import partial
from numbers import Integral
from typing import Any, Hashable, Sequence

import numpy as np
from sklearn.base import BaseEstimator
from deid.blas import one_blas_thread

from deid.errors import ConfigError

logger = logging.getLogger(__name__)

_COUNTS = ("people", "images")
_ROWS = 8192  # rows of X a temporary copy holds at a time (issue 13: never a second copy of all of X)


class InsufficientPeopleError(ConfigError):
    """Fewer than ``k`` distinct people (in the data or in one partition) to form a cluster.

    Attributes ``k``, ``n_people`` and ``partition`` (``None`` for plain k-Same) let the
    caller decide what to do, e.g. suppress or merge a small partition.
    """

    def __init__(self, message: str, *, k: int, n_people: int, partition: Hashable | None = None):
        super().__init__(message)
        self.k = k
        self.n_people = n_people
        self.partition = partition


class DominantPersonError(InsufficientPeopleError):
    """One person holds more than ``1/k`` of the images (of the data or of one partition).

    Every cluster may hold at most ``floor(size / k)`` images of one person, so summed over
    clusters a person can have at most ``floor(n / k)`` images; beyond that no grouping exists.
    """


# --------------------------------------------------------------------------- helpers


def _factorize(values: Any, name: str, n: int) -> tuple[np.ndarray, list]:
    """Integer codes (first-appearance order) for a sequence of hashable keys."""
    seq = list(values)
    if len(seq) != n:
        raise ConfigError(f"{name} has {len(seq)} entries but X has {n} rows; pass one {name} key per row of X")
    mapping: dict[Hashable, int] = {}
    codes = np.empty(n, dtype=np.intp)
    for i, v in enumerate(seq):
        if isinstance(v, np.ndarray):
            v = tuple(v.tolist())
        elif isinstance(v, np.generic):
            v = v.item()
        try:
            codes[i] = mapping.setdefault(v, len(mapping))
        except TypeError as exc:
            raise ConfigError(f"{name}[{i}]={v!r} is not hashable; use str, int or tuple keys") from exc
    return codes, list(mapping)


def _check_params(k: Any, count: Any, block_size: Any = None, map_blocks: Any = None) -> None:
    if map_blocks is not None and not callable(map_blocks):
        raise ConfigError(f"map_blocks={map_blocks!r} must be None or a callable like map(fn, *iterables) returning "
                          "results in input order; pass None to run the blocks serially")
    if isinstance(k, bool) or not isinstance(k, Integral) or k < 2:
        raise ConfigError(f"k={k!r} must be an integer >= 2 (k=1 releases every face unchanged); pass e.g. k=5")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, Integral) or block_size < 2):
        raise ConfigError(f"block_size={block_size!r} must be None or an integer >= 2; use e.g. 2000 "
                          "(blocks of 1,000-2,000 faces keep k-Same within a few % of the single greedy)")
    if count not in _COUNTS:
        raise ConfigError(f"count={count!r} must be one of {_COUNTS}; use 'people' unless reproducing Newton et al.'s image-counting k-Same")


def _features(X: Any) -> np.ndarray:
    """``X`` as float64, or as float32 when it is float32: the grouping then converts a part at a time
    (float32 to float64 is exact, so every sum and product is the one of the float64 copy; issue 13)."""
    X = np.asarray(X)
    return X if X.dtype == np.float32 else np.asarray(X, dtype=np.float64)


def _check_arrays(X: Any, images: Any, *, keep_float32: bool = False) -> tuple[np.ndarray, np.ndarray]:
    X = _features(X) if keep_float32 else np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] == 0 or X.shape[1] == 0:
        raise ConfigError(f"X has shape {X.shape}; it must be a non-empty 2-D array (n_faces, n_features) of PCA coefficients")
    # A few thousand rows at a time: a whole-matrix mask is 1 byte per value (50 MB at a million 50-d rows).
    if not all(np.isfinite(X[a:a + _ROWS]).all() for a in range(0, X.shape[0], _ROWS)):
        raise ConfigError("X contains NaN or infinite values; fix the feature extraction (PCA) before de-identification")
    if images is None:  # group only: the caller averages out of core (deid.operations.stages)
        return X, None
    images = np.asarray(images)
    if images.ndim != 2 or images.shape[0] != X.shape[0]:
        raise ConfigError(
            f"images has shape {images.shape}; it must be 2-D (n_faces={X.shape[0]}, n_pixels): "
            "flatten each aligned face with images.reshape(len(images), -1)"
        )
    if not np.issubdtype(images.dtype, np.number):
        raise ConfigError(f"images has dtype {images.dtype}; pass uint8 or float pixel values")
    return X, images


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


def feasible_clusters(counts: Any, k: int) -> int:
    """The most clusters any k-Same grouping of these images can form (0 when none exists).

    ``counts`` are the images per person. Every cluster needs >= ``k`` images of >= ``k``
    distinct people and no person above ``floor(size / k)`` of its images, so there are at most
    ``floor(n / k)`` clusters; that many exist exactly when some grouping does (>= k people and no
    person above ``floor(n / k)`` images): deal the images, person by person, round-robin into
    ``floor(n / k)`` clusters, and each gets >= k images of pairwise distinct people (a person with
    ``c <= floor(n / k)`` images lands in ``c`` different clusters).
    """
    c = np.asarray(counts, dtype=np.int64)
    c = c[c > 0]
    n = int(c.sum())
    if c.size < k or int(c.max(initial=0)) * k > n:
        return 0
    return n // k


def _greedy_labels(X: np.ndarray, codes: np.ndarray, k: int) -> tuple[np.ndarray, int]:
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
    people. A last pass moves faces out of groups larger than ``k`` into nearer groups that lack
    their person (:func:`_refine_moves`). Ties everywhere go to the lowest input index.

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
        cap = n_alive // k
        forced = np.flatnonzero(left == cap) if int(left.max()) >= cap else np.empty(0, np.intp)
        centroid = total / n_alive
        far = sq - 2.0 * (Xw @ centroid)
        far[~alive] = -np.inf
        in_forced = None
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
        members = _nearest_distinct(d, cw, need, n_alive)
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
    return labels, int(n - k * g)


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


def _cluster_summaries(labels: np.ndarray, people_codes: np.ndarray, people_keys: list, images: np.ndarray | None
                       ) -> dict[str, Any]:
    n_clusters = int(labels.max()) + 1
    order = np.argsort(labels, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(labels, minlength=n_clusters))]
    averages = None if images is None else np.empty((n_clusters, images.shape[1]), dtype=np.float64)
    cluster_people: list[frozenset] = []
    sizes = np.diff(bounds)
    max_share = np.empty(n_clusters, dtype=np.float64)
    for c in range(n_clusters):
        members = order[bounds[c]:bounds[c + 1]]
        if averages is not None:
            averages[c] = images[members].mean(axis=0, dtype=np.float64)
        pc = people_codes[members]
        cluster_people.append(frozenset(people_keys[j] for j in np.unique(pc)))
        max_share[c] = np.bincount(pc).max() / len(members)
    return {
        "n_clusters_": n_clusters,
        **({} if averages is None else {"averages_": averages}),
        "cluster_people_": cluster_people,
        "cluster_sizes_": sizes,
        "cluster_max_share_": max_share,
    }


def _to_uint8(averages: np.ndarray, labels: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(averages), 0, 255).astype(np.uint8)[labels]


# --------------------------------------------------------------------------- blocks


@dataclass(frozen=True)
class BlockGrouping:
    """k-Same grouping of one block: ``labels`` are 0-based within the block."""

    labels: np.ndarray
    n_leftover: int

    @property
    def n_clusters(self) -> int:
        return int(self.labels.max()) + 1 if self.labels.size else 0


def group_block(X: np.ndarray, codes: np.ndarray, k: int) -> BlockGrouping:
    """The greedy k-Same grouping of one block (pure; map it over blocks on any executor).

    ``codes`` are integer person codes (any non-negative ints); the block must hold >= k
    distinct people and no person above ``floor(n/k)`` images, which :func:`plan_blocks`
    guarantees for its blocks.
    """
    X = np.ascontiguousarray(X, dtype=np.float64)
    _, local = np.unique(np.asarray(codes), return_inverse=True)
    with one_blas_thread():
        labels, n_left = _greedy_labels(X, local.astype(np.intp), int(k))
    return BlockGrouping(labels, n_left)


def _principal_direction(Xn: np.ndarray, *, overwrite: bool = False) -> np.ndarray:
    """Leading eigenvector of the node's covariance, sign fixed (largest |component| > 0).

    ``overwrite``: centre ``Xn`` (float64) in place instead of a centred copy (the same values).
    """
    if overwrite:
        Xn -= Xn.mean(axis=0)
        c = Xn
    else:
        c = Xn - Xn.mean(axis=0)
    cov = c.T @ c
    _, vecs = np.linalg.eigh(cov)
    v = vecs[:, -1]
    return v if v[np.argmax(np.abs(v))] >= 0 else -v


def _node_projection(X: np.ndarray, node: np.ndarray | None) -> np.ndarray:
    """Every row of ``X[node]`` (None: all of X) projected on the rows' principal direction, in float64.

    A float32 ``X`` (what :func:`group_people` holds: half the memory) gives the same values as
    its float64 copy, one float64 copy of the node at a time: centred in place for the covariance,
    then made again for the projection.
    """
    if X.dtype == np.float64:
        Xn = X if node is None else X[node]  # the root is X itself, other nodes one copy (issue 13)
        return Xn @ _principal_direction(Xn)
    Xn = (X if node is None else X[node]).astype(np.float64)
    v = _principal_direction(Xn, overwrite=True)
    del Xn
    return (X if node is None else X[node]).astype(np.float64) @ v


def plan_blocks(X: np.ndarray, codes: np.ndarray, *, k: int, block_size: int) -> list[np.ndarray]:
    """Split faces into blocks of at most about ``block_size`` images for blockwise k-Same.

    A k-d-tree-like recursive split of the feature space (principal-direction median
    splits, as in the blocking step of large-scale microaggregation): a node with more than
    ``block_size`` images is split at the image-count median of its *people* ordered by
    their mean projection on the node's principal direction. Every person's images stay in
    one block (the k rules are about people, and a person split across blocks could end up
    above 1/k nowhere visible to one block's greedy). A split is made only when both sides
    keep >= 2k distinct people and stay feasible (no person above ``floor(n_side / k)``
    images), so the greedy inside every block can always satisfy the invariants; a node
    that cannot be split that way stays one (larger) block.

    Deterministic: ties in projection go to the lower person code; blocks come in
    depth-first, low-side-first order. Returns sorted index arrays that partition
    ``range(n)``.

    References
    ----------
    J. Domingo-Ferrer, J. M. Mateo-Sanz. Practical data-oriented microaggregation for
    statistical disclosure control. IEEE TKDE 14(1):189-201, 2002 (blocking for large data).
    """
    X = _features(X)
    codes = np.asarray(codes)
    n = X.shape[0]
    k = int(k)
    blocks: list[np.ndarray] = []
    stack = [np.arange(n)]
    while stack:
        node = stack.pop()
        if node.size <= block_size:
            blocks.append(node)
            continue
        people, local = np.unique(codes[node], return_inverse=True)
        n_people = people.size
        if n_people < 4 * k:
            blocks.append(node)
            continue
        proj = _node_projection(X, None if node.size == n else node)
        cnt = np.bincount(local, minlength=n_people)
        mean_proj = np.bincount(local, weights=proj, minlength=n_people) / cnt
        order = np.lexsort((np.arange(n_people), mean_proj))
        cum = np.cumsum(cnt[order])
        j = int(np.searchsorted(cum, node.size / 2.0)) + 1  # people on the low side
        j = min(max(j, 2 * k), n_people - 2 * k)
        left_people = np.zeros(n_people, dtype=bool)
        left_people[order[:j]] = True
        n_left = int(cum[j - 1])
        n_right = node.size - n_left
        if (cnt[left_people].max() * k > n_left) or (cnt[~left_people].max() * k > n_right):
            blocks.append(node)
            continue
        side = left_people[local]
        stack.append(node[~side])  # popped second
        stack.append(node[side])
    logger.debug("k-Same blocks: %d faces -> %d blocks (largest %d)", n, len(blocks), max(b.size for b in blocks))
    return blocks


# Shares of the worst clusters (by mean squared distance to their centroid) dissolved and
# regrouped in each refinement round; measured on 48-50-d Gaussian mixtures (bench/bench_grouping.py)
# it takes blockwise WCSS from ~+14% to ~+2.5% over the single greedy at ~30% extra time.
REFINE_SCHEDULE: tuple[float, ...] = (0.25, 0.12, 0.06, 0.03)


def _cluster_sse(X: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum of squared distances to the mean, size) of every cluster ``0 .. labels.max()``."""
    n_c = int(labels.max()) + 1
    cnt = np.bincount(labels, minlength=n_c)
    order = np.argsort(labels, kind="stable")
    starts = np.r_[0, np.cumsum(cnt)[:-1]]
    # The clusters' sums a run of whole clusters at a time, not a sorted copy of X (issue 13: X's size
    # again); reduceat adds each cluster's rows in the same order either way, so the sums are the same.
    sums = np.empty((n_c, X.shape[1]), np.float64)
    c0 = 0
    while c0 < n_c:
        c1 = min(n_c, int(np.searchsorted(starts, starts[c0] + _ROWS, side="right")))
        c1 = max(c1, c0 + 1)
        a, z = int(starts[c0]), int(starts[c1 - 1] + cnt[c1 - 1])
        sums[c0:c1] = np.add.reduceat(X[order[a:z]].astype(np.float64, copy=False), starts[c0:c1] - a, axis=0)
        c0 = c1
    if X.dtype == np.float64:
        sq_rows = np.einsum("ij,ij->i", X, X)
    else:  # each row's square in float64, as of X's float64 copy (row by row: the same sums)
        sq_rows = np.concatenate([np.einsum("ij,ij->i", b, b) for b in
                                  (X[a:a + _ROWS].astype(np.float64) for a in range(0, len(X), _ROWS))])
    sq = np.bincount(labels, weights=sq_rows, minlength=n_c)
    return np.maximum(sq - np.einsum("ij,ij->i", sums, sums) / cnt, 0.0), cnt


def _feasible(codes: np.ndarray, k: int) -> bool:
    cnt = np.bincount(codes)
    return int(np.count_nonzero(cnt)) >= k and int(cnt.max()) * k <= codes.size


class _Rows(abc.Sequence):
    """``[A[b] for b in blocks]``, each block's rows copied only when asked for (a block map that runs a
    few blocks at a time holds only those; issue 13)."""

    def __init__(self, A: np.ndarray, blocks: list[np.ndarray]):
        self.A, self.blocks = A, blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.A[b] for b in self.blocks[i]]
        return self.A[self.blocks[i]]


def _map_blocks(X: np.ndarray, codes: np.ndarray, blocks: list[np.ndarray], k: int, map_blocks) -> np.ndarray:
    results = list(map_blocks(partial(group_block, k=k), _Rows(X, blocks), _Rows(codes, blocks)))
    labels = np.empty(X.shape[0], dtype=np.intp)
    offset = 0
    for b, res in zip(blocks, results):
        labels[b] = res.labels + offset
        offset += res.n_clusters
    return labels


def blockwise_labels(X: np.ndarray, codes: np.ndarray, *, k: int, block_size: int, map_blocks=map,
                     schedule: tuple[float, ...] = REFINE_SCHEDULE) -> np.ndarray:
    """Blockwise k-Same grouping with boundary refinement; ``map_blocks`` runs the blocks.

    1. :func:`plan_blocks` splits the faces; :func:`group_block` groups each block.
    2. Clusters at block boundaries are the costly ones (their faces' neighbours lie across
       the cut; measured: the block greedy's worst clusters are its first seeds, the faces
       farthest out along the cut). For each share ``f`` in ``schedule`` (default 25, 12,
       6, 3%): the ``f`` share of clusters with the largest mean squared distance to their
       centroid is dissolved, its
       faces are re-blocked (new cuts, since they are a different set) and regrouped; the
       new clusters replace the old ones only if their total within-cluster sum of squares
       is smaller, and only if the dissolved faces form a feasible set (>= k people, no
       person above ``floor(n/k)`` images).

    With a single block (nothing to cut) the result is exactly the greedy's. Every cluster is
    made by :func:`group_block` on a feasible block, so every cluster has
    >= k distinct people and no person above ``floor(size/k)`` of its images. Deterministic
    whatever ``map_blocks`` is, as long as it returns results in input order: e.g. the
    builtin ``map``, or ``lambda f, *its: client.gather(client.map(f, *its))`` on Dask.
    """
    k = int(k)
    blocks = plan_blocks(X, codes, k=k, block_size=block_size)
    labels = _map_blocks(X, codes, blocks, k, map_blocks)
    if len(blocks) == 1:
        return labels  # no cut to refine across: exactly the greedy, as KSame.fit gives below block_size
    for share in schedule:
        sse, cnt = _cluster_sse(X, labels)
        n_c = sse.size
        m = int(share * n_c)
        if m < 2:
            continue
        worst = np.zeros(n_c, dtype=bool)
        worst[np.argsort(-(sse / cnt), kind="stable")[:m]] = True
        redo = np.flatnonzero(worst[labels])
        if not _feasible(codes[redo], k):
            continue
        XD, cD = X[redo], codes[redo]
        new = _map_blocks(XD, cD, plan_blocks(XD, cD, k=k, block_size=block_size), k, map_blocks)
        if _cluster_sse(XD, new)[0].sum() >= sse[worst].sum():
            continue
        renumber = np.cumsum(~worst) - 1
        n_keep = int(renumber[-1]) + 1
        labels = renumber[labels]
        labels[redo] = new + n_keep
    return labels


def _check_shares(codes: np.ndarray, k: int, count: str, partition: Hashable | None, keys: list | None = None) -> None:
    """Refuse data where some person holds more than ``floor(n/k)`` images: no grouping can hide them."""
    if count != "people":
        return
    cnt = np.bincount(codes)
    n = codes.size
    top = int(np.argmax(cnt))
    if cnt[top] * k > n:
        who = keys[top] if keys is not None else top
        where = "the data" if partition is None else f"partition {partition!r}"
        raise DominantPersonError(
            f"person {who!r} has {int(cnt[top])} of the {n} images in {where}; with k={k} no person may hold "
            f"more than 1/k of any cluster, so at most {n // k} images of one person can be released; "
            "drop some of that person's images, add images of other people, or lower k",
            k=k, n_people=int(np.count_nonzero(cnt)), partition=partition,
        )


# --------------------------------------------------------------------------- estimators


class KSame(BaseEstimator):
    """k-Same de-identification: replace each face by the mean of a cluster of >= k people.

    Greedy and deterministic (Newton, Sweeney & Malin 2005, with distinct-people counting):

    1. While at least ``2k`` faces remain: take as seed the remaining face farthest from the
       centroid of the remaining faces in ``X`` space, then walk the remaining faces by
       increasing Euclidean distance to the seed, keeping the first face of each person not
       yet in the group, until the group holds ``k`` people. People who hold as many remaining
       faces as there are clusters left to form (``floor(remaining / k)``) join first, with
       their face nearest the seed: without that, a person with many photos is left over at
       the end and the groups must merge until the partition collapses into one face (issue 26).
    2. The last fewer-than-``2k`` faces are pairwise distinct people and form the last group;
       faces of groups larger than ``k`` then move to nearer groups that lack their person.

    The result is the feasible maximum of ``floor(n / k)`` clusters (:func:`feasible_clusters`)
    unless more than ``k`` people had to join one step; :func:`_greedy_labels` proves that every
    group holds pairwise distinct people, so no person holds more than ``1/k`` of a cluster.

    Above ``block_size`` faces the greedy (O(N^2)) runs inside blocks instead: the faces are
    split recursively at the median along each node's principal direction, people never
    split across blocks and each side keeping >= 2k people (:func:`plan_blocks`), and each
    block is grouped independently (:func:`group_block`), so the cost is about
    ``N * block_size`` and the blocks can run in parallel. With one block it is exactly the
    greedy.

    All ties go to the lowest input index. A person's images are deliberately *not* pulled
    into the same cluster: a cluster with several images of one person has an average
    weighted towards that person, which is what a recogniser exploits (the naive attack
    rate of a cluster is at most its largest one-person share of images, see
    ``cluster_max_share_``). Keeping one image per person per cluster keeps that share at
    ``1 / cluster size <= 1/k``; a person with several images appears in several clusters,
    each of which still hides them among ``k`` people.

    Parameters
    ----------
    k : int, default 5
        Minimum number of distinct people (``count="people"``) or images
        (``count="images"``) per cluster; >= 2.
    count : {"people", "images"}, default "people"
        ``"images"`` treats every image as its own person: Newton et al.'s original
        formulation, which gives no guarantee when people have several images. Kept only
        for comparison studies.
    block_size : int or None, default 2000
        Faces (of one partition) above which the grouping runs blockwise; ``None`` always
        runs the single greedy. Blocks hold about ``block_size / 2`` to ``block_size`` faces.
    map_blocks : callable or None, default None
        How the blocks run: ``map_blocks(fn, *iterables)`` must return ``fn``'s results in input
        order (``None``: the builtin ``map``, serially; on Dask e.g. a ``client.map`` + ``gather``).
        The clusters do not depend on it.

    Attributes
    ----------
    labels_ : ndarray of shape (n_faces,)
        Cluster index of every face, ``0 .. n_clusters_ - 1`` in creation order.
    n_clusters_ : int
    averages_ : ndarray of shape (n_clusters_, n_pixels), float64
        Pixel mean of each cluster (not set when ``fit`` got ``images=None``).
    cluster_people_ : list of frozenset
        The distinct person ids in each cluster.
    cluster_sizes_ : ndarray of shape (n_clusters_,)
        Images per cluster.
    cluster_max_share_ : ndarray of shape (n_clusters_,)
        Largest fraction of a cluster's images that belong to one person.
    n_leftover_ : int
        Faces beyond ``k`` per cluster (``n_faces - k * n_clusters_``).

    References
    ----------
    E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images.
    IEEE Trans. Knowledge and Data Engineering 17(2):232-243, 2005.
    """

    def __init__(self, k: int = 5, *, count: str = "people", block_size: int | None = 2000, map_blocks=None):
        self.k = k
        self.count = count
        self.block_size = block_size
        self.map_blocks = map_blocks

    def fit(self, X: Any, *, people: Sequence[Hashable], images: Any | None) -> "KSame":
        """Cluster the faces.

        Parameters
        ----------
        X : array-like of shape (n_faces, n_features)
            Features used for distances (PCA coefficients of the aligned faces).
        people : sequence of hashable, length n_faces
            Person id of each face.
        images : array-like of shape (n_faces, n_pixels), or None
            Pixel vectors (0..255 scale) to average. None groups only (no ``averages_``): for
            callers that average the clusters out of core, a block of faces at a time.

        Returns
        -------
        self
        """
        _check_params(self.k, self.count, self.block_size, self.map_blocks)
        X, images = _check_arrays(X, images)
        codes, keys = _factorize(people, "people", X.shape[0])
        labels, n_left = self._labels(X, codes, partition=None, keys=keys)
        self.labels_ = labels
        self.n_leftover_ = n_left
        for name, value in _cluster_summaries(labels, codes, keys, images).items():
            setattr(self, name, value)
        logger.debug("k-Same k=%d: %d faces -> %d clusters", self.k, X.shape[0], self.n_clusters_)
        return self

    def _labels(self, X: np.ndarray, codes: np.ndarray, partition: Hashable | None, keys: list | None = None
                ) -> tuple[np.ndarray, int]:
        k = int(self.k)
        unit = codes if self.count == "people" else np.arange(X.shape[0])
        n_units = int(np.count_nonzero(np.bincount(unit)))
        if n_units < k:
            raise _insufficient(k, n_units, self.count, partition)
        _check_shares(unit, k, self.count, partition, keys)
        if self.block_size is None or X.shape[0] <= self.block_size:
            # Thousands of small matrix-vector products: BLAS threads only add synchronisation
            # (and stall badly when other processes hold the cores), so run them single-threaded.
            with one_blas_thread():
                return _greedy_labels(np.asarray(X, dtype=np.float64), unit, k)
        with one_blas_thread():
            labels = blockwise_labels(X, unit, k=k, block_size=int(self.block_size), map_blocks=self.map_blocks or map)
        # Blockwise, "leftover" has no single meaning (each block and refinement round has its
        # own); report faces in clusters larger than the people needed, a comparable count.
        n_left = int(labels.size - k * (int(labels.max()) + 1))
        logger.debug("k-Same: %d faces blockwise -> %d clusters", X.shape[0], int(labels.max()) + 1)
        return labels, n_left

    def fit_transform(self, X: Any, *, people: Sequence[Hashable], images: Any) -> np.ndarray:
        """Fit, then return the released images: each row its cluster's mean, rounded to uint8."""
        self.fit(X, people=people, images=images)
        return _to_uint8(self.averages_, self.labels_)


def group_people(X: Any, codes: Any, *, k: int = 5, count: str = "people", block_size: int | None = 2000,
                 map_blocks=None, names: Sequence[Hashable] | None = None) -> np.ndarray:
    """The cluster labels of ``KSame(k, ...).fit(X, people=...)``, from integer person codes.

    For callers that average the clusters themselves, out of core (:mod:`deid.operations.stages`):
    no per-cluster summaries, and the people as integer ``codes`` numbered in order of first
    appearance (as :meth:`KSame.fit` numbers its ``people``; then the labels are the same), not one
    Python object per face (issue 13). ``names[c]`` is the person of code ``c``, for error messages.
    Parameters and the grouping as :class:`KSame` (Newton, Sweeney & Malin 2005, counting people).
    """
    _check_params(k, count, block_size, map_blocks)
    X, _ = _check_arrays(X, None, keep_float32=True)
    codes = np.asarray(codes)
    if codes.shape != (X.shape[0],) or not np.issubdtype(codes.dtype, np.integer) or (codes.size and codes.min() < 0):
        raise ConfigError(f"codes has shape {codes.shape} and dtype {codes.dtype}; pass one non-negative integer "
                          f"person code per row of X ({X.shape[0]} rows)")
    est = KSame(k, count=count, block_size=block_size, map_blocks=map_blocks)
    return est._labels(X, codes.astype(np.intp, copy=False), partition=None, keys=names)[0]


def _insufficient(k: int, n_units: int, count: str, partition: Hashable | None) -> InsufficientPeopleError:
    what = "distinct people" if count == "people" else "images"
    where = "the data" if partition is None else f"partition {partition!r}"
    fix = (
        "merge or suppress this partition before k-Same-Select (setting small_partitions), or lower k"
        if partition is not None
        else f"lower k to at most {n_units}, or add images of more people"
    )
    return InsufficientPeopleError(
        f"k={k} needs at least {k} {what} per cluster but {where} holds only {n_units}; {fix}",
        k=k, n_people=n_units, partition=partition,
    )


class KSameSelect(KSame):
    """k-Same-Select: k-Same run separately inside each partition of utility labels.

    Averaging only faces that share the utility labels (e.g. gender x expression) keeps
    those labels in the released averages while each cluster still holds >= k people.
    Partitions are processed in order of first appearance; cluster labels are numbered
    consecutively across partitions, so they are globally unique.

    Parameters
    ----------
    k : int, default 5
    count : {"people", "images"}, default "people"
        See :class:`KSame`.

    Attributes
    ----------
    labels_, n_clusters_, averages_, cluster_people_, cluster_sizes_, cluster_max_share_, n_leftover_
        As in :class:`KSame`, over all partitions.
    partitions_ : list
        The partition keys in first-appearance order.
    cluster_partition_ : list
        The partition key of each cluster.

    References
    ----------
    R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility into face
    de-identification. Privacy Enhancing Technologies (PET), LNCS 3856, 227-242, 2005.
    """

    def fit(self, X: Any, *, people: Sequence[Hashable], images: Any, partitions: Sequence[Hashable]) -> "KSameSelect":  # type: ignore[override]
        """Cluster the faces within each partition.

        Parameters
        ----------
        X, people, images
            As in :meth:`KSame.fit`.
        partitions : sequence of hashable, length n_faces
            Partition key of each face (e.g. ``("female", "smiling")``).

        Returns
        -------
        self

        Raises
        ------
        InsufficientPeopleError
            When a partition holds fewer than ``k`` distinct people (names the partition);
            nothing is clustered in that case.
        """
        _check_params(self.k, self.count, self.block_size, self.map_blocks)
        X, images = _check_arrays(X, images)
        n = X.shape[0]
        codes, keys = _factorize(people, "people", n)
        pcodes, pkeys = _factorize(partitions, "partitions", n)
        k = int(self.k)
        members = [np.flatnonzero(pcodes == j) for j in range(len(pkeys))]
        for j, m in enumerate(members):  # check all first: fail before any work
            unit = codes[m] if self.count == "people" else m
            n_units = len(np.unique(unit))
            if n_units < k:
                raise _insufficient(k, n_units, self.count, pkeys[j])
            _check_shares(codes[m], k, self.count, pkeys[j], keys)
        labels = np.empty(n, dtype=np.intp)
        cluster_partition: list = []
        offset = 0
        n_left = 0
        for j, m in enumerate(members):
            lab, left = self._labels(X[m], codes[m], partition=pkeys[j])
            labels[m] = lab + offset
            n_sub = int(lab.max()) + 1
            cluster_partition.extend([pkeys[j]] * n_sub)
            offset += n_sub
            n_left += left
        self.labels_ = labels
        self.n_leftover_ = n_left
        self.partitions_ = pkeys
        self.cluster_partition_ = cluster_partition
        for name, value in _cluster_summaries(labels, codes, keys, images).items():
            setattr(self, name, value)
        logger.debug("k-Same-Select k=%d: %d faces, %d partitions -> %d clusters", k, n, len(pkeys), self.n_clusters_)
        return self

    def fit_transform(self, X: Any, *, people: Sequence[Hashable], images: Any, partitions: Sequence[Hashable]) -> np.ndarray:  # type: ignore[override]
        """Fit, then return the released images: each row its cluster's mean, rounded to uint8."""
        self.fit(X, people=people, images=images, partitions=partitions)
        return _to_uint8(self.averages_, self.labels_)
