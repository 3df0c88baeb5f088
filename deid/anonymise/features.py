"""De-identification of feature vectors (speaker or face embeddings, sensor windows) instead of faces.

The face methods work on matrices already; what ties them to faces is the uint8 rounding of
their output, the eigenface space they cluster in and, for some, the image shape. On vectors:

* every method runs on *standardised* vectors (each feature centred and divided by its
  standard deviation over the records de-identified), so no feature dominates a distance
  because of its unit, and the result is mapped back to the original units. Cluster means
  commute with that affine map: a k-Same release is exactly the mean of its members' raw
  vectors;
* k-Same (people-aware), k-Same-Select and the naive k-Same cluster on the standardised
  vectors themselves and release each cluster's mean (float, not rounded);
* multi-factor, the selective weighted mean and attribute-preserving k-Same fit their linear
  models in a PCA of the vectors with every component kept (``n_components`` = dimension,
  capped at records - 1), i.e. in the feature space itself rotated, so nothing is lost by a
  truncated basis;
* ``noise`` adds Gaussian noise of ``sigma`` feature standard deviations to each vector: the
  control without a guarantee (the feature analogue of blur), which the gate must reject.

Image-only methods (:data:`~deid.method_registry.IMAGE_ONLY_METHODS`: blur, pixelate, the
k-Same-Eigen/-M/-AAM family, per-frame expression) need a face and are refused.
"""
from __future__ import annotations

import logging
from numbers import Real
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from deid.anonymise.ksame import KSame, KSameSelect
from deid.method_registry import IMAGE_ONLY_METHODS
from deid.anonymise.methods import FEATURE_METHODS, K_METHODS, method_spec
from deid.anonymise.methods_attribute import AttributePreserving
from deid.anonymise.methods_factor import MultiFactor
from deid.anonymise.methods_ksame import check_k
from deid.anonymise.methods_selective import SelectiveMean
from deid.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

_ESTIMATORS = {"multi-factor": MultiFactor, "selective-mean": SelectiveMean,
               "attribute-preserving": AttributePreserving}


def check_vectors(X: Any, name: str = "vectors") -> np.ndarray:
    """A non-empty finite float64 matrix (n_records, n_features)."""
    a = np.asarray(X)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0 or not np.issubdtype(a.dtype, np.number):
        raise ConfigError(f"{name} has shape {a.shape} and dtype {a.dtype}; pass a non-empty numeric "
                          "(n_records, n_features) matrix, one feature vector per row")
    a = a.astype(np.float64, copy=False)
    if not np.isfinite(a).all():
        raise DataError(f"{name} holds NaN or infinite values; quarantine those records first "
                          "(deid.intake.features.read_feature_drop does)")
    return a


def check_feature_method(method: Any) -> str:
    """The method name if it runs on feature vectors, else a ConfigError listing those that do."""
    if method not in FEATURE_METHODS:
        raise ConfigError(f"method={method!r} does not run on feature vectors; use one of {list(FEATURE_METHODS)} "
                          f"({', '.join(IMAGE_ONLY_METHODS)} need face images)")
    return method


def _standardise(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mean = a.mean(axis=0)
    sd = a.std(axis=0)
    # A constant feature carries nothing to hide or to keep: leave its scale at 1.
    sd = np.where(sd > 1e-12 * max(float(np.abs(a).max()), 1.0), sd, 1.0)
    return (a - mean) / sd, mean, sd


def deidentify_vectors(
    vectors: Any,
    *,
    people: Sequence[Hashable],
    method: str,
    k: int | None = None,
    sigma: float | None = None,
    partitions: Sequence[Hashable] | None = None,
    labels: Mapping[str, Sequence[Hashable]] | None = None,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """De-identify feature vectors with one of :data:`deid.anonymise.methods.FEATURE_METHODS`.

    Parameters
    ----------
    vectors : array-like of shape (n, d)
        One feature vector per record (finite).
    people : sequence of hashable, length n
        Person of each record (the k methods count distinct people).
    method : str
    k : int, optional
        Strength of the k methods (>= 2).
    sigma : float, optional
        Strength of ``noise``: its standard deviation in units of each feature's standard
        deviation (e.g. 0.1).
    partitions : sequence of hashable, length n, optional
        Utility-label partition of each record; ``k-same-select`` clusters inside each one
        (without partitions it is k-Same).
    labels : mapping of str to sequence, optional
        Utility labels per record, for ``multi-factor``, ``selective-mean`` and
        ``attribute-preserving``.
    seed : int, default 0
        Seed of the random parts (the noise, the selective mean's random sets).
    options : mapping, optional
        Further parameters of the method's estimator.

    Returns
    -------
    released : ndarray of shape (n, d), float64
        Row i is record i's released vector, in the input's units.
    clusters : ndarray of shape (n,) or None
        Cluster of each record for the clustered methods (identical released vectors within a
        cluster for the k-Same family); None otherwise.

    References
    ----------
    E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images. IEEE
    TKDE 17(2):232-243, 2005. R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility
    into face de-identification. PET 2005. C.-F. Chen et al. Model-agnostic utility-preserving
    biometric information anonymization. arXiv:2405.15062, 2024 (the same methods on voice and
    motion features).
    """
    check_feature_method(method)
    a = check_vectors(vectors)
    n = len(a)
    people = list(people)
    if len(people) != n:
        raise ConfigError(f"people has {len(people)} entries but vectors has {n} rows; pass one person id per record")
    if method in K_METHODS:
        if k is None:
            raise ConfigError(f"method={method!r} needs k=...; e.g. k=5")
        check_k(k)
    z, mean, sd = _standardise(a)
    opts = dict(options or {})
    clusters: np.ndarray | None
    if method == "noise":
        out, clusters = _noise(z, sigma, seed), None
    elif method in ("k-same", "k-same-naive", "k-same-select"):
        out, clusters = _ksame_vectors(method, z, people, partitions, k=k, options=opts)
    else:
        out, clusters = _estimator_vectors(method, z, people, labels, k=k, seed=seed, options=opts)
    return mean + out * sd, clusters


def _noise(z: np.ndarray, sigma: Any, seed: int) -> np.ndarray:
    """``noise`` on standardised vectors: ``z`` plus Gaussian noise of standard deviation ``sigma`` (seeded).

    Raises
    ------
    ConfigError
        ``sigma`` not a number in (0, 100].
    """
    if isinstance(sigma, bool) or not isinstance(sigma, Real) or not 0 < sigma <= 100:
        raise ConfigError(f"sigma={sigma!r} must be a number in (0, 100]: the noise's standard deviation in "
                          "units of each feature's standard deviation; e.g. --sigma 0.1")
    return z + np.random.default_rng(seed).normal(0.0, float(sigma), size=z.shape)


def _ksame_vectors(method: str, z: np.ndarray, people: list, partitions: Sequence[Hashable] | None, *,
                   k: int | None, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """The k-Same family on standardised vectors ``z``: each record's cluster mean, and its cluster.

    ``k-same-naive`` counts records, the others people; ``k-same-select`` clusters inside each of
    ``partitions`` (without partitions it is k-Same).

    Returns
    -------
    released : ndarray of shape (n, d)
    clusters : ndarray of shape (n,)
    """
    count = "images" if method == "k-same-naive" else "people"
    if method == "k-same-select" and partitions is not None:
        keys = list(partitions)
        if len(keys) != len(z):
            raise ConfigError(f"partitions has {len(keys)} entries but vectors has {len(z)} rows; one key per record")
        model = KSameSelect(k, count=count, **options).fit(z, people=people, images=z, partitions=keys)
    else:
        model = KSame(k, count=count, **options).fit(z, people=people, images=z)
    return model.averages_[model.labels_], model.labels_.copy()


def _estimator_vectors(method: str, z: np.ndarray, people: list, labels: Mapping[str, Sequence[Hashable]] | None, *,
                       k: int | None, seed: int, options: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """``multi-factor``, ``selective-mean`` or ``attribute-preserving`` on standardised vectors ``z``.

    Returns
    -------
    released : ndarray of shape (n, d)
    clusters : ndarray of shape (n,) or None
        The estimator's ``labels_`` when it has them.
    """
    n, d = z.shape
    # A PCA with every component the records span: the linear models live in the feature
    # space itself (rotated), not in a truncated eigenface basis.
    nc = int(min(d, max(n - 1, 1)))
    est = _ESTIMATORS[method](k, n_components=nc, random_state=seed, **options)
    est.fit(z, people=people, labels=labels)
    found = getattr(est, "labels_", None)
    return est.released_, None if found is None else np.asarray(found).copy()


def vector_method_runner(method: str, *, k: int | None = None, sigma: float | None = None,
                         seed: int = 0) -> Callable[..., np.ndarray]:
    """``f(vectors, people=..., partitions=..., labels=...) -> released``: the run's method on other vectors.

    The gate's parrot attacker de-identifies its gallery with it, and the cross-fitted utility
    protocol the training people (:class:`deid.evaluation.gate_types.GateInputs.deidentify`).
    """
    check_feature_method(method)

    def run(vectors: np.ndarray, *, people: Sequence[Hashable], partitions: Sequence[Hashable] | None = None,
            labels: Mapping[str, Sequence[Hashable]] | None = None) -> np.ndarray:
        parts = partitions if method_spec(method).partitions_by_labels else None
        return deidentify_vectors(vectors, people=people, method=method, k=k, sigma=sigma, partitions=parts,
                                  labels=labels or None, seed=seed)[0]

    return run


def feature_guarantee(method: str, k: int | None = None) -> str:
    """What the method promises on feature vectors, for the report and the dataset card."""
    spec = method_spec(check_feature_method(method))
    if spec.identical_within_cluster and spec.clustered and method != "k-same-naive":
        return (f"formal: 1/k = 1/{k} bound on re-identification by any recogniser, because every released vector "
                f"is the mean vector of a cluster of at least k={k} distinct people, identical for every member "
                "(structural check min_distinct_people_per_cluster >= k; Newton et al. 2005, counting people)")
    return spec.guarantee(k)
