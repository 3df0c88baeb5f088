"""k-Same and k-Same-Select face de-identification.

k-Same (Newton, Sweeney & Malin 2005) replaces every face by the pixel average of a
cluster of faces; k-Same-Select (Gross, Airoldi, Malin & Sweeney 2005) runs k-Same
separately inside each partition of utility labels so that the averages keep those labels.

This implementation counts *people*, not images: a cluster is only valid when it holds
images of at least ``k`` distinct people, because a dataset with several images per person
would otherwise let one person's images form a "cluster of k" on their own and release
that person's face unchanged. Every cluster also keeps each person at most ``floor(size/k)``
of its images (so at most 1/k of it), and above ``block_size`` faces the greedy runs in
blocks of the feature space so that a million faces group in about a minute. Clusters that repeat another
cluster's set of people (near-identical frames of a video do) then get other people by swaps that keep every
rule (:mod:`deid.anonymise.ksame_sets`).

This module holds the estimators (:class:`KSame`, :class:`KSameSelect`, :func:`group_people`), their
checks and errors; the greedy is :mod:`deid.anonymise.ksame_greedy`, the blocks
:mod:`deid.anonymise.ksame_blocks`.
"""
from __future__ import annotations

import logging
from numbers import Integral
from typing import Any, Hashable, Sequence

import numpy as np
from sklearn.base import BaseEstimator

from deid.anonymise.ksame_blocks import blockwise_labels
from deid.anonymise.ksame_greedy import CHUNK_ROWS, as_features, greedy_labels
from deid.blas import one_blas_thread
from deid.errors import ConfigError

logger = logging.getLogger(__name__)

_COUNTS = ("people", "images")


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


def _check_arrays(X: Any, images: Any, *, keep_float32: bool = False) -> tuple[np.ndarray, Any]:
    X = as_features(X) if keep_float32 else np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] == 0 or X.shape[1] == 0:
        raise ConfigError(f"X has shape {X.shape}; it must be a non-empty 2-D array (n_faces, n_features) of PCA coefficients")
    # A few thousand rows at a time: a whole-matrix mask is 1 byte per value (50 MB at a million 50-d rows).
    if not all(np.isfinite(X[a:a + CHUNK_ROWS]).all() for a in range(0, X.shape[0], CHUNK_ROWS)):
        raise ConfigError("X contains NaN or infinite values; fix the feature extraction (PCA) before de-identification")
    if images is None:  # group only: the caller averages out of core (deid.operations.worker_deidentify)
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


def _cluster_summaries(labels: np.ndarray, people_codes: np.ndarray, people_keys: list, images: Any
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


def _check_shares(codes: np.ndarray, k: int, count: str, partition: Hashable | None,
                  keys: Sequence[Hashable] | None = None) -> None:
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
    3. Groups that hold the same set of people as an earlier group swap a face with a nearby
       group where that keeps every rule and gives both sets no group holds
       (:mod:`deid.anonymise.ksame_sets`): near-identical frames of one person otherwise land
       alongside the same other people once per frame (issue 26: 105 of 181 clusters of a
       48-pixel drop with 3 frames per image), and the release repeats near-identical averages.

    The result is the feasible maximum of ``floor(n / k)`` clusters (:func:`feasible_clusters`)
    unless more than ``k`` people had to join one step; :func:`greedy_labels` proves that every
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

    def __init__(self, k: int = 5, *, count: str = "people", block_size: int | None = 2000, map_blocks=None,
):
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

    def _labels(self, X: np.ndarray, codes: np.ndarray, partition: Hashable | None,
                keys: Sequence[Hashable] | None = None
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
                return greedy_labels(np.asarray(X, dtype=np.float64), unit, k)
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

    For callers that average the clusters themselves, out of core (:mod:`deid.operations.worker_deidentify`):
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
