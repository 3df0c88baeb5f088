"""Blockwise k-Same for large partitions: the faces split into blocks, each grouped on its own, then refined.

Above ``block_size`` faces the greedy (:func:`deid.anonymise.ksame_greedy.greedy_labels`, O(N^2)) runs
inside blocks: :func:`plan_blocks` splits the faces recursively at the median of their people along each
node's principal direction (people never split across blocks, each side feasible), :func:`group_block`
groups one block (pure: mapped over the blocks on any executor, e.g. Dask), and :func:`blockwise_labels`
regroups the worst clusters at the blocks' boundaries (:data:`REFINE_SCHEDULE`) where that lowers the
within-cluster sum of squares. A million faces group in about a minute.
"""
from __future__ import annotations

import logging
from collections import abc
from dataclasses import dataclass
from functools import partial

import numpy as np

from deid.anonymise.ksame_greedy import CHUNK_ROWS, as_features, greedy_labels
from deid.blas import one_blas_thread

logger = logging.getLogger(__name__)


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
        labels, n_left = greedy_labels(X, local.astype(np.intp), int(k))
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
    X = as_features(X)
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
        c1 = min(n_c, int(np.searchsorted(starts, starts[c0] + CHUNK_ROWS, side="right")))
        c1 = max(c1, c0 + 1)
        a, z = int(starts[c0]), int(starts[c1 - 1] + cnt[c1 - 1])
        sums[c0:c1] = np.add.reduceat(X[order[a:z]].astype(np.float64, copy=False), starts[c0:c1] - a, axis=0)
        c0 = c1
    if X.dtype == np.float64:
        sq_rows = np.einsum("ij,ij->i", X, X)
    else:  # each row's square in float64, as of X's float64 copy (row by row: the same sums)
        sq_rows = np.concatenate([np.einsum("ij,ij->i", b, b) for b in
                                  (X[a:a + CHUNK_ROWS].astype(np.float64) for a in range(0, len(X), CHUNK_ROWS))])
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
