"""De-identification methods behind one interface, for the gate and the comparison study.

``k-same`` and ``k-same-select`` count distinct people per cluster and carry the formal
k-Same guarantee. ``k-same-naive`` (Newton et al.'s formulation, which counts images),
``blur`` and ``pixelate`` (the ad-hoc methods of Gross et al. 2005 §4.2) exist so that
the gate and the study can show where they fail. ``k-same-eigen``, ``k-same-m``
(:mod:`deid.anonymise.methods_ksame`) and ``k-same-aam`` (:mod:`deid.anonymise.methods_aam`, clusters in a fitted
shape-and-appearance model's parameter space) form each cluster's face differently but keep the k-Same
structure (identical image per cluster). ``multi-factor`` (:mod:`deid.anonymise.methods_factor`),
``selective-mean`` (:mod:`deid.anonymise.methods_selective`) and ``attribute-preserving``
(:mod:`deid.anonymise.methods_attribute`) give faces individual releases: no formal guarantee, the
gate's attacks decide. :data:`REGISTRY` holds what each method promises. Each method has a
*parrot*: the same de-identification an attacker applies to its own gallery of originals.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
import logging
from numbers import Integral, Real
from typing import Any, Callable, Hashable, Mapping, Sequence

import cv2
import numpy as np

from deid.errors import ConfigError
from deid.memo import Memo, plain, key_for
from deid.alignment.features import Eigenfaces
from deid.anonymise.ksame import KSame, KSameSelect
from deid.method_registry import (  # noqa: F401 (re-exported: the registry is the one method list)
    COLOR_METHODS,
    FEATURE_METHODS,
    FEATURE_ONLY,
    K_METHODS,
    METHODS,
    REGISTRY,
    STRENGTH,
    MethodSpec,
    _check_method,
    guarantee,
    method_spec,
)
from deid.anonymise.methods_aam import KSameAAM
from deid.anonymise.methods_attribute import AttributePreserving
from deid.anonymise.methods_factor import MultiFactor
from deid.anonymise.methods_ksame import KSameEigen, KSameM, check_images, check_shape, to_uint8
from deid.anonymise.methods_selective import SelectiveMean
from deid.anonymise.sequences import SequenceMultiFactor, sequence_options, sequence_warning

logger = logging.getLogger(__name__)


def _check_images(images: Any, shape: Any) -> tuple[np.ndarray, int, int]:
    a = check_images(images)
    h, w = check_shape(shape, a.shape[1])
    return a, h, w


def blur(images: Any, *, shape: tuple[int, int], sigma: float) -> np.ndarray:
    """Gaussian blur of every face with standard deviation ``sigma`` canonical pixels.

    Borders are replicated; the kernel spans +-4 sigma (OpenCV's default for float images).

    References
    ----------
    R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility into face
    de-identification. PET 2005, LNCS 3856, 227-242 (section 4.2).
    """
    if isinstance(sigma, bool) or not isinstance(sigma, Real) or not 0 < sigma <= 100:
        raise ConfigError(f"sigma={sigma!r} must be a number in (0, 100] (Gaussian standard deviation in canonical pixels); e.g. --sigma 4")
    a, h, w = _check_images(images, shape)
    out = np.empty(a.shape, dtype=np.uint8)
    for i, row in enumerate(a):
        face = row.reshape(h, w).astype(np.float32)
        out[i] = to_uint8(cv2.GaussianBlur(face, (0, 0), float(sigma), borderType=cv2.BORDER_REPLICATE)).ravel()
    return out


def pixelate(images: Any, *, shape: tuple[int, int], block: int) -> np.ndarray:
    """Replace every ``block`` x ``block`` square of each face by its mean (edge blocks may be smaller).

    References
    ----------
    R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility into face
    de-identification. PET 2005, LNCS 3856, 227-242 (section 4.2).
    """
    a, h, w = _check_images(images, shape)
    if isinstance(block, bool) or not isinstance(block, Integral) or not 1 <= block <= max(h, w):
        raise ConfigError(f"block={block!r} must be an integer between 1 and {max(h, w)} (pixels per block side); e.g. --block 8")
    b = int(block)
    faces = a.reshape(len(a), h, w).astype(np.float64)
    rows, cols = np.arange(0, h, b), np.arange(0, w, b)
    sums = np.add.reduceat(np.add.reduceat(faces, rows, axis=1), cols, axis=2)
    counts = np.outer(np.diff(np.r_[rows, h]), np.diff(np.r_[cols, w]))
    means = sums / counts
    full = np.repeat(np.repeat(means, b, axis=1)[:, :h], b, axis=2)[:, :, :w]
    return to_uint8(full).reshape(len(a), h * w)


# The gate's parrot attacker re-runs the method on the very originals (same people and k; the same
# seed only when it is fixed, deid.anonymise.randomness) the release was made from, and its utility
# folds re-run it on the same training people for every point: a deterministic function of those
# inputs is computed once (deid.memo).
_DEIDENTIFIED = Memo("deidentify")


def _memo_key(images: Any, *, shape, people, partitions, method: str, k, sigma, block, n_components, seed, labels,
              options, points, sequences, frames) -> bytes | None:
    """Content key of a :func:`deidentify` call, with only the arguments the method reads."""
    a = np.asarray(images)
    # Only the faces as released and attacked (integer pixels) repeat: the parrot re-runs the
    # release on the same originals. The utility folds pass float copies of always-new subsets,
    # which would only cost a hash.
    if not np.issubdtype(a.dtype, np.integer):
        return None
    spec = REGISTRY[method]
    uses_partitions = method == "k-same-select" or (method in _ESTIMATORS and spec.partitions_by_labels)
    seq = sequences is not None and any(v is not None for v in sequences)
    filters = method in ("blur", "pixelate")
    return key_for(
        "deidentify", a, tuple(shape), method, k if STRENGTH[method] == "k" else None,
        sigma if method == "blur" else None, block if method == "pixelate" else None,
        None if filters else n_components, None if filters else seed,
        None if filters else [plain(p) for p in people],
        [plain(p) for p in partitions] if uses_partitions and partitions is not None else None,
        {str(n): [plain(v) for v in vals] for n, vals in labels.items()} if labels and
        (method in _USES_LABELS or seq) else None,
        dict(options or {}), None if points is None or method not in _USES_POINTS else
        [None if p is None else np.asarray(p, dtype=np.float64) for p in points],
        [plain(v) for v in sequences] if seq else None, [plain(v) for v in frames] if seq and frames is not None
        else None)


def _memoised(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a :func:`deidentify`-shaped function) computed once per content of its arguments (:mod:`deid.memo`)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def memoised(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        _check_method(call.arguments["method"])
        key = _memo_key(**call.arguments)
        return _DEIDENTIFIED.get_or_compute(key, lambda: fn(*args, **kwargs))

    return memoised


@_memoised
def deidentify(images: Any, *, shape: tuple[int, int], people: Sequence[Hashable],
               partitions: Sequence[Hashable] | None = None, method: str, k: int | None = None,
               sigma: float | None = None, block: int | None = None, n_components: int = 50, seed: int = 0,
               labels: Mapping[str, Sequence[Hashable]] | None = None, options: Mapping[str, Any] | None = None,
               points: Sequence[Any] | None = None, sequences: Sequence[Hashable | None] | None = None,
               frames: Sequence[Any] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """De-identify aligned faces with one of :data:`METHODS`.

    The k-Same family clusters faces by Euclidean distance between their eigenface
    coefficients (``n_components`` PCA components fitted on ``images``, as the release flow
    does) and releases one face per cluster: the pixel mean (``k-same``, ``k-same-select``,
    ``k-same-naive``), the reconstruction of the mean coefficients (``k-same-eigen``), the
    shape-and-appearance average (``k-same-m``) or, for ``k-same-aam``, the rendering of the mean
    parameters of a fitted shape-and-appearance model, in whose parameter space it also clusters.

    Parameters
    ----------
    images : array-like of shape (n, height * width)
        Aligned grey faces (0..255).
    shape : (int, int)
        (height, width) of the faces.
    people : sequence of hashable, length n
        Person id of each face (k-Same methods count them).
    partitions : sequence of hashable, length n, optional
        Utility-label partition of each face; required by ``k-same-select``.
    method : str
        One of :data:`METHODS`; :data:`REGISTRY` says what each promises.
    k, sigma, block
        The strength of the chosen method (:data:`STRENGTH`).
    n_components : int, default 50
    seed : int, default 0
        Seed of the eigenface fit (and of any random draw of the method).
    labels : mapping of str to sequence, optional
        Utility labels per face (e.g. ``{"gender": [...], "expression": [...]}``) for the
        methods that use them (``multi-factor``, ``selective-mean``, ``attribute-preserving``).
    options : mapping, optional
        Further parameters of the method's estimator (e.g. ``{"flow": "dis"}`` for k-same-m).
    points : sequence, length n, optional
        Per face, its landmarks (n_points, 2) in canonical pixels or None; k-same-m takes its
        clusters' shape from them where every member has some, k-same-aam its shape model where every
        face has some (other methods ignore them).
    sequences, frames : sequence, length n, optional
        Per face, its image-sequence key (None: a still image) and frame number. With
        ``multi-factor`` the faces are de-identified by
        :class:`deid.anonymise.sequences.SequenceMultiFactor` (one identity per person, each frame its
        labels' expression; ``options`` may still set ``non_identity``); other methods ignore them
        with a warning (their identity can change from frame to frame).

    Returns
    -------
    released : ndarray of shape (n, height * width), uint8
        Row ``i`` is the de-identified face ``i``.
    clusters : ndarray of shape (n,) or None
        Cluster index of every face (for methods with ``identical_within_cluster``, identical
        released copies share it); None for methods without clusters (blur, pixelation).
    """
    _check_method(method)
    a, h, w = _check_images(images, shape)
    _check_strength(method, k=k, sigma=sigma, block=block)
    opts = dict(options or {})
    if method == "blur":
        return blur(a, shape=(h, w), sigma=sigma), None
    if method == "pixelate":
        return pixelate(a, shape=(h, w), block=block), None
    people, points = _per_face(method, people, points, len(a))
    if sequences is not None and any(s is not None for s in sequences):
        if (why := sequence_warning(method)) is None:
            return _deidentify_sequences(method, a, people, labels, sequences, frames, k=k, n_components=n_components,
                                         seed=seed, options=opts)
        logger.warning("deidentify: %s", why)
    if method in _ESTIMATORS:
        if partitions is None or not REGISTRY[method].partitions_by_labels:
            return _fit_estimator(method, a, people, labels, k=k, shape=(h, w), n_components=n_components, seed=seed,
                                  options=opts, points=points)
        return _fit_per_partition(method, a, people, labels, partitions, k=k, shape=(h, w), n_components=n_components,
                                  seed=seed, options=opts, points=points)
    return _ksame_family(method, a, people, partitions, k=k, n_components=n_components, seed=seed)


def _check_strength(method: str, *, k: int | None, sigma: float | None, block: int | None) -> None:
    """The strength :data:`STRENGTH` names for ``method`` is given (the others are ignored, logged at debug).

    Raises
    ------
    ConfigError
        The method's strength is None.
    """
    given = {"k": k, "sigma": sigma, "block": block}
    need = STRENGTH[method]
    if given[need] is None:
        raise ConfigError(f"method={method!r} needs {need}=...; e.g. --{need} {dict(k=5, sigma=4, block=8)[need]}")
    extra = [name for name, v in given.items() if v is not None and name != need]
    if extra:
        logger.debug("deidentify %s: ignoring %s", method, extra)


def _per_face(method: str, people: Sequence[Hashable], points: Sequence[Any] | None,
              n: int) -> tuple[list, list | None]:
    """The person of each of the ``n`` faces, as a list; the landmark points as a list when ``method`` uses them,
    None when not given or not used (logged at debug).

    Raises
    ------
    ConfigError
        ``people``, or ``points`` that the method uses, not one entry per face.
    """
    people = list(people)
    if len(people) != n:
        raise ConfigError(f"people has {len(people)} entries but images has {n} rows; pass one person id per face")
    if points is not None and method in _USES_POINTS:
        points = list(points)
        if len(points) != n:
            raise ConfigError(f"points has {len(points)} entries but images has {n} rows; one entry per face")
        return people, points
    if points is not None:
        logger.debug("deidentify %s: landmark points not used by this method", method)
    return people, None


def _deidentify_sequences(method: str, a: np.ndarray, people: list, labels: Mapping[str, Sequence[Hashable]] | None,
                          sequences: Sequence[Hashable | None], frames: Sequence[Any] | None, *, k: int | None,
                          n_components: int, seed: int, options: dict) -> tuple[np.ndarray, np.ndarray]:
    """Faces with image sequences, by :class:`deid.anonymise.sequences.SequenceMultiFactor` (the method's own
    sequence mode unless ``options`` name one): the released faces and their clusters.

    Raises
    ------
    ConfigError
        ``options`` the estimator does not take.
    """
    opts = {**(sequence_options(method) or {}), **options}  # the method's own mode unless options name one
    try:
        model = SequenceMultiFactor(k, n_components=n_components, random_state=seed, **opts)
    except TypeError as exc:
        raise ConfigError(f"options={opts!r} for method={method!r} on sequences: {exc}") from None
    released = model.fit_transform(a, people=people, labels=labels, sequences=list(sequences),
                                   frames=None if frames is None else list(frames))
    return released, model.labels_.copy()


def _ksame_family(method: str, a: np.ndarray, people: list, partitions: Sequence[Hashable] | None, *, k: int | None,
                  n_components: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``k-same``, ``k-same-naive`` or ``k-same-select``: clusters by distance between eigenface coefficients
    (``n_components``, fitted on ``a``), each face released as its cluster's pixel mean; and the clusters.

    Raises
    ------
    ConfigError
        ``k-same-select`` without ``partitions``.
    """
    X = Eigenfaces(n_components, random_state=seed).fit_transform(a)
    model: KSame | KSameSelect
    if method == "k-same-select":
        if partitions is None:
            raise ConfigError("method='k-same-select' needs partitions=[one utility-label key per face], e.g. (gender, expression) tuples")
        model = KSameSelect(k)
        released = model.fit_transform(X, people=people, images=a, partitions=list(partitions))
    else:
        model = KSame(k, count="images" if method == "k-same-naive" else "people")
        released = model.fit_transform(X, people=people, images=a)
    return released, model.labels_.copy()


def _fit_per_partition(method: str, a: np.ndarray, people: list, labels: Mapping[str, Sequence[Hashable]] | None,
                       partitions: Sequence[Hashable], *, k: int | None, shape: tuple[int, int],
                       n_components: int | None, seed: int, options: dict,
                       points: list | None) -> tuple[np.ndarray, np.ndarray]:
    """An estimator method run on its own inside each utility-label partition (as k-Same-Select): the released
    images and each face's cluster, numbered across the partitions."""
    # As k-Same-Select: the method runs on its own inside each utility-label partition.
    keys = list(partitions)
    if len(keys) != len(a):
        raise ConfigError(f"partitions has {len(keys)} entries but images has {len(a)} rows; one key per face")
    released = np.empty(a.shape, dtype=np.uint8)
    clusters = np.empty(len(a), dtype=np.intp)
    offset = 0
    for key in dict.fromkeys(keys):
        idx = np.array([i for i, v in enumerate(keys) if v == key])
        sub_labels = None if labels is None else {n: [list(v)[i] for i in idx] for n, v in labels.items()}
        rel, lab = _fit_estimator(method, a[idx], [people[i] for i in idx], sub_labels, k=k, shape=shape,
                                  n_components=n_components, seed=seed, options=options,
                                  points=None if points is None else [points[i] for i in idx])
        released[idx] = rel
        clusters[idx] = lab + offset
        offset = int(clusters[idx].max()) + 1
    return released, clusters


def _fit_estimator(method: str, a: np.ndarray, people: list, labels: Mapping[str, Sequence[Hashable]] | None, *,
                   k: int, shape: tuple[int, int], n_components: int, seed: int,
                   options: dict[str, Any], points: list | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    try:
        model = _ESTIMATORS[method](k, shape=shape, n_components=n_components, seed=seed, **options)
    except TypeError as exc:
        raise ConfigError(f"options={options!r} for method={method!r}: {exc}") from None
    extra = {"labels": labels} if method in _USES_LABELS else {}
    if points is not None:
        extra["points"] = points
    released = model.fit_transform(a, people=people, **extra)
    clusters = getattr(model, "labels_", None)
    return released, None if clusters is None else np.asarray(clusters).copy()


# The estimators of the methods beyond pixel k-Same: (k, shape, n_components, seed, **options) -> estimator.
_ESTIMATORS: dict[str, Callable[..., Any]] = {
    "k-same-eigen": lambda k, shape, n_components, seed, **o: KSameEigen(k, n_components=n_components,
                                                                          random_state=seed, **o),
    "k-same-m": lambda k, shape, n_components, seed, **o: KSameM(k, shape=shape, n_components=n_components,
                                                                  random_state=seed, **o),
    "k-same-aam": lambda k, shape, n_components, seed, **o: KSameAAM(k, shape=shape, n_components=n_components,
                                                                      random_state=seed, **o),
    "multi-factor": lambda k, shape, n_components, seed, **o: MultiFactor(k, n_components=n_components,
                                                                          random_state=seed, **o),
    # Per-frame expression with privacy: MultiFactor's "label-groups" mode (a sequence drop's options may name it).
    "multi-factor-expression": lambda k, shape, n_components, seed, **o: MultiFactor(
        k, n_components=n_components, random_state=seed, **{"non_identity": "label-groups", **o}),
    "selective-mean": lambda k, shape, n_components, seed, **o: SelectiveMean(k, n_components=n_components,
                                                                              random_state=seed, **o),
    "attribute-preserving": lambda k, shape, n_components, seed, **o: AttributePreserving(
        k, n_components=n_components, random_state=seed, **o),
}
# Methods whose estimator takes the utility labels.
_USES_LABELS: frozenset[str] = frozenset({"multi-factor", "multi-factor-expression", "selective-mean",
                                          "attribute-preserving"})
# Methods whose estimator takes landmark points.
_USES_POINTS: frozenset[str] = frozenset({"k-same-m", "k-same-aam"})


def uses_points(method: str) -> bool:
    """Whether the method's estimator takes landmark points (k-same-m's cluster shapes, k-same-aam's shape model)."""
    return method in _USES_POINTS


def parrot_for(
    method: str,
    *,
    shape: tuple[int, int],
    people: Sequence[Hashable] | None = None,
    partitions: Sequence[Hashable] | None = None,
    k: int | None = None,
    sigma: float | None = None,
    block: int | None = None,
    n_components: int = 50,
    seed: int = 0,
    labels: Mapping[str, Sequence[Hashable]] | None = None,
    options: Mapping[str, Any] | None = None,
    points: Sequence[Any] | None = None,
) -> Callable[[np.ndarray], np.ndarray]:
    """The parrot attacker's de-identification of its gallery: ``f(originals) -> released-like``.

    Blur and pixelation are applied with the same filter and strength (which an attacker
    can estimate from the release); the k-Same family and the other k methods run the same
    algorithm and ``k`` on the originals, for which the attacker also needs their ``people``
    (and ``partitions`` for k-Same-Select, ``labels`` for the label-using methods, ``points``
    for k-same-m), aligned with the originals it will pass.

    Returns
    -------
    callable
        For :func:`deid.evaluation.attacks.attack_all`'s ``parrot`` argument.
    """
    _check_method(method)
    if method in K_METHODS and people is None:
        raise ConfigError(f"parrot_for({method!r}) needs people=[person id of each original]: the attacker "
                          "re-runs k-Same on its originals, which counts people")
    people_list = None if people is None else list(people)
    part_list = None if partitions is None else list(partitions)

    def parrot(originals: np.ndarray) -> np.ndarray:
        ids = people_list if people_list is not None else [None] * len(originals)
        return deidentify(originals, shape=shape, people=ids, partitions=part_list, method=method, k=k,
                          sigma=sigma, block=block, n_components=n_components, seed=seed, labels=labels,
                          options=options, points=points)[0]

    return parrot


def method_runner(method: str, *, shape: tuple[int, int], k: int | None = None, sigma: float | None = None,
                  block: int | None = None, n_components: int = 50, seed: int = 0,
                  options: Mapping[str, Any] | None = None) -> Callable[..., np.ndarray]:
    """``f(images, people=..., partitions=..., labels=..., points=...) -> released``: the run's method, re-applied.

    The gate's parrot attacker de-identifies its gallery with it, and the utility protocol
    the training people. k-Same-Select without partitions (a drop with no labels) is k-Same.
    ``options`` go to the method's estimator as in :func:`deidentify` (e.g. a drop of image
    sequences runs multi-factor with :func:`deid.anonymise.sequences.sequence_options`, what
    :class:`deid.anonymise.sequences.SequenceMultiFactor` uses, so the attacker re-applies that).
    ``points`` are the faces' landmarks as the release used them (k-same-m's cluster shapes).
    """
    _check_method(method)
    return MethodRunner(method, shape=tuple(shape), k=k, sigma=sigma, block=block, n_components=n_components,
                        seed=seed, options=None if options is None else dict(options))


@dataclass(frozen=True)
class MethodRunner:
    """:func:`method_runner`'s callable: plain values only, so it travels to other processes (the gate's parts)."""

    method: str
    shape: tuple[int, int]
    k: int | None = None
    sigma: float | None = None
    block: int | None = None
    n_components: int = 50
    seed: int = 0
    options: Mapping[str, Any] | None = None

    def __call__(self, images: np.ndarray, *, people: Sequence[Hashable], partitions: Sequence[Hashable] | None = None,
                 labels: Mapping[str, Sequence[Hashable]] | None = None,
                 points: Sequence[Any] | None = None) -> np.ndarray:
        m = self.method
        if m == "k-same-select" and partitions is None:
            m = "k-same"
        if not REGISTRY[m].partitions_by_labels:
            partitions = None
        return deidentify(images, shape=self.shape, people=people, partitions=partitions, method=m, k=self.k,
                          sigma=self.sigma, block=self.block, n_components=self.n_components, seed=self.seed,
                          labels=labels or None, options=self.options, points=points)[0]
