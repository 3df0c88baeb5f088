"""The face recognisers an attacker fits on the faces it knows (eigenfaces, Fisherfaces, LBP).

Each follows the scikit-learn estimator contract: ``fit(gallery, people=...)`` learns the model,
``enroll(gallery, people=...)`` embeds another gallery with it and ``similarity(probes)`` scores
probes against the enrolled gallery (higher means more alike). The deep recogniser is
:class:`deid.evaluation.recognizer.DlibResNetAttacker`; how they are run and scored is in
:mod:`deid.evaluation.attacks` and :mod:`deid.evaluation.scoring`.
"""
from __future__ import annotations

import hashlib
import logging
from numbers import Integral
from typing import Any, Hashable, Sequence

import numpy as np
from scipy.linalg import eigh
from sklearn.base import BaseEstimator
from sklearn.decomposition import PCA
from deid.blas import one_blas_thread

from deid.errors import ConfigError, DataError
from deid.memo import RowCache
from deid.evaluation.scoring import _joint_codes

logger = logging.getLogger(__name__)


# Components whose variance is below this fraction of the largest are dropped before
# whitening: dividing by ~0 would turn rounding noise into the dominant signal.
_MIN_RELATIVE_VARIANCE = 1e-10


def _one_blas_thread():
    """Single-threaded BLAS for the attack's small factorisations and products.

    On a busy 2-core machine OpenBLAS threads contending for cores made PCA/SVD work 12x
    slower than one thread; the pipeline gets its parallelism from separate workers instead.
    """
    return one_blas_thread()


def _as_matrix(a: Any, name: str) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ConfigError(f"{name} has shape {a.shape}; it must be a non-empty 2-D array (n_images, n_pixels): flatten with .reshape(len(a), -1)")
    if not np.isfinite(a).all():
        raise ConfigError(f"{name} contains NaN or infinite values; pass finite pixel values")
    return a


def _people_array(people: Sequence[Hashable], n: int) -> np.ndarray:
    """Person ids as an object array, checked to hold one id per gallery image."""
    people = np.asarray(list(people), dtype=object)
    if len(people) != n:
        raise ConfigError(f"people has {len(people)} entries but gallery has {n} images; pass one person id per image")
    return people


def _enroll(attacker: Any, gallery: Any, people: Sequence[Hashable]) -> Any:
    """Shared ``enroll``: embed a new gallery with the attacker's already fitted model."""
    attacker._check_fitted()
    g = attacker._check_width(_as_matrix(gallery, "gallery"))
    people = _people_array(people, len(g))
    with _one_blas_thread():
        attacker.gallery_ = getattr(attacker, "_embed_cached", attacker._embed)(g)
    attacker.gallery_people_ = people
    return attacker


class WhitenedCosineAttacker(BaseEstimator):
    """PCA whitened-cosine face recogniser (the "MahCosine" measure of the CSU system).

    Images are projected on the gallery's principal components, each coordinate is divided
    by the component's standard deviation (whitening), and probes are scored against the
    gallery by cosine similarity. ``n_components`` is capped at ``min(n_gallery - 1,
    n_pixels)``: ``n`` centred images span at most ``n - 1`` directions, and whitening a
    direction of zero variance would divide by zero. Components with negligible variance
    (below 1e-10 of the largest, e.g. from duplicate images) are dropped for the same reason.

    Parameters
    ----------
    n_components : int, default 50
        Number of principal components kept (before the caps above).

    Attributes
    ----------
    pca_ : sklearn.decomposition.PCA
        Fitted with ``whiten=True``.
    n_components_ : int
        Components actually used.
    gallery_ : ndarray of shape (n_gallery, n_components_)
        Unit-length whitened projections of the gallery.
    gallery_people_ : ndarray of shape (n_gallery,)
        Person id of each gallery image, as passed.

    References
    ----------
    R. Gross, L. Sweeney, J. Cohn, F. de la Torre, S. Baker. Face de-identification.
    In Protecting Privacy in Video Surveillance, Springer, 2009, 129-146.
    D. Bolme, R. Beveridge, M. Teixeira, B. Draper. The CSU face identification
    evaluation system. ICVS 2003, LNCS 2626, 304-313.
    """

    def __init__(self, n_components: int = 50):
        self.n_components = n_components

    def fit(self, gallery: Any, *, people: Sequence[Hashable]) -> "WhitenedCosineAttacker":
        """Fit the whitened PCA on the gallery images and store their projections.

        Parameters
        ----------
        gallery : array-like of shape (n_gallery, n_pixels)
        people : sequence of hashable, length n_gallery

        Returns
        -------
        self
        """
        nc = self.n_components
        if isinstance(nc, bool) or not isinstance(nc, Integral) or nc < 1:
            raise ConfigError(f"n_components={nc!r} must be an integer >= 1; pass e.g. n_components=50")
        g = _as_matrix(gallery, "gallery")
        n, p = g.shape
        if n < 2:
            raise ConfigError(f"gallery has {n} image; the attacker needs at least 2 to fit a PCA")
        people = _people_array(people, n)
        use = min(int(nc), n - 1, p)
        with _one_blas_thread():
            pca = _sklearn_pca(g, use, whiten=True)
            if pca.n_components_ < use:
                logger.info("attacker: %d of %d components have ~zero variance; refitting with %d",
                            use - pca.n_components_, use, pca.n_components_)
                use = pca.n_components_
            self.pca_ = pca
            self.n_components_ = use
            self.gallery_ = self._embed(g)
        self.gallery_people_ = people
        return self

    def enroll(self, gallery: Any, *, people: Sequence[Hashable]) -> "WhitenedCosineAttacker":
        """Replace the gallery by other images, keeping the fitted PCA (used by reverse attacks).

        Returns
        -------
        self
        """
        return _enroll(self, gallery, people)

    def _check_fitted(self) -> None:
        if not hasattr(self, "pca_"):
            raise ConfigError("this WhitenedCosineAttacker is not fitted; call fit(gallery, people=...) first")

    def _check_width(self, a: np.ndarray) -> np.ndarray:
        if a.shape[1] != self.pca_.n_features_in_:
            raise ConfigError(f"images have {a.shape[1]} pixels but the attacker was fitted on {self.pca_.n_features_in_}; use images of the same canonical size")
        return a

    def _embed(self, a: np.ndarray) -> np.ndarray:
        z = self.pca_.transform(a)
        norm = np.linalg.norm(z, axis=1, keepdims=True)
        # An image equal to the gallery mean has no direction: leave it at 0 (similarity 0).
        return np.divide(z, norm, out=np.zeros_like(z), where=norm > 0)

    def similarity(self, probes: Any) -> np.ndarray:
        """Cosine similarity of whitened probe projections to the gallery, shape (m, n_gallery)."""
        self._check_fitted()
        a = self._check_width(_as_matrix(probes, "probes"))
        with _one_blas_thread():
            return self._embed(a) @ self.gallery_.T




def _check_shape(shape: Any) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in shape)
    except (TypeError, ValueError):
        raise ConfigError(f"shape={shape!r} must be the (height, width) of the aligned faces, e.g. (92, 81)") from None
    if h < 3 or w < 3:
        raise ConfigError(f"shape={shape!r} must be at least (3, 3); pass the canonical (height, width), e.g. (92, 81)")
    return h, w


def _check_int(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"between {low} and {high}"
        raise ConfigError(f"{name}={value!r} must be an integer {rng}{'; ' + hint if hint else ''}")
    return int(value)


class _GalleryAttacker(BaseEstimator):
    """Common fit / enroll / similarity plumbing: subclasses embed images and score embeddings.

    Subclasses implement ``_fit_model(images, codes)`` (sets the fitted model attributes),
    ``_embed(images) -> embedding`` and ``_score(probe_embedding, gallery_embedding) -> (m, n)``
    similarities (higher means more alike).
    """

    def fit(self, gallery: Any, *, people: Sequence[Hashable]):
        """Fit the recogniser on the gallery images and store their embeddings.

        Parameters
        ----------
        gallery : array-like of shape (n_gallery, n_pixels)
        people : sequence of hashable, length n_gallery

        Returns
        -------
        self
        """
        g = _as_matrix(gallery, "gallery")
        if len(g) < 2:
            raise ConfigError(f"gallery has {len(g)} image; the attacker needs at least 2 to fit")
        people = _people_array(people, len(g))
        codes, _ = _joint_codes(people, [], len(g), 0)
        self.__dict__.pop("_embedding_cache", None)
        with _one_blas_thread():
            self._fit_model(g, codes)
            self.n_features_in_ = g.shape[1]
            self.gallery_ = self._embed_cached(g)
        self.gallery_people_ = people
        return self

    def enroll(self, gallery: Any, *, people: Sequence[Hashable]):
        """Replace the gallery by other images, keeping the fitted model (used by reverse attacks).

        Returns
        -------
        self
        """
        return _enroll(self, gallery, people)

    def similarity(self, probes: Any) -> np.ndarray:
        """Similarity of every probe to every gallery image, shape (n_probes, n_gallery)."""
        self._check_fitted()
        a = self._check_width(_as_matrix(probes, "probes"))
        with _one_blas_thread():
            return self._score(self._embed_cached(a), self.gallery_)

    def _embed_cached(self, a: np.ndarray) -> np.ndarray:
        """``_embed``, remembering the last few arrays: attack_all shows the same originals and
        distinct released images to one fitted recogniser in several modes."""
        cache = self.__dict__.setdefault("_embedding_cache", {})
        # Keyed by the memory the rows live in; the entry holds a reference to that memory's
        # owner, so it cannot be freed and reused by another array while cached. fit() clears it.
        key = (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
        hit = cache.get(key)
        if hit is not None:
            return hit[1]
        z = self._embed(a)
        if len(cache) >= 4:
            cache.pop(next(iter(cache)))
        cache[key] = (a if a.base is None else a.base, z)
        return z

    def _check_fitted(self) -> None:
        if not hasattr(self, "gallery_"):
            raise ConfigError(f"this {type(self).__name__} is not fitted; call fit(gallery, people=...) first")

    def _check_width(self, a: np.ndarray) -> np.ndarray:
        if a.shape[1] != self.n_features_in_:
            raise ConfigError(f"images have {a.shape[1]} pixels but the attacker was fitted on {self.n_features_in_}; use images of the same canonical size")
        return a


# Raised by the attackers' PCA: words the whole drop's problem (faces or feature vectors), not an attacker's internals.
_IDENTICAL = ("every gallery record the attacker learns people from is identical (the same face or feature vector "
              "for everyone): there is nothing to recognise and nothing to de-identify; check the drop's images or "
              "vectors (e.g. a constant or zero feature column exported by mistake)")


class _GramPCA:
    """Exact PCA through the n x n Gram matrix (n images << n pixels): ~4x faster than an SVD."""

    def __init__(self, g: np.ndarray, n_components: int, whiten: bool):
        self.mean_ = g.mean(axis=0)
        xc = g - self.mean_
        w, v = np.linalg.eigh(xc @ xc.T)
        order = np.argsort(w)[::-1][:n_components]
        w, v = w[order], v[:, order]
        keep = int(np.count_nonzero(w > _MIN_RELATIVE_VARIANCE * w[0])) if w[0] > 0 else 0
        if keep == 0:
            raise DataError(_IDENTICAL)
        w, v = w[:keep], v[:, :keep]
        self.components_ = (v.T @ xc) / np.sqrt(w)[:, None]
        self.explained_variance_ = w / (len(g) - 1)
        self.n_components_ = keep
        self.whiten = whiten

    def transform(self, a: np.ndarray) -> np.ndarray:
        z = (a - self.mean_) @ self.components_.T
        return z / np.sqrt(self.explained_variance_) if self.whiten else z


def _fit_pca(g: np.ndarray, n_components: int, *, whiten: bool) -> Any:
    """PCA on at most ``min(n_components, n - 1, p)`` components, dropping ~zero-variance ones.

    Uses the Gram matrix when there are fewer images than pixels (and at most 3000 of them,
    so the n x n matrix stays small), sklearn's PCA otherwise.
    """
    use = min(n_components, g.shape[0] - 1, g.shape[1])
    if g.shape[0] <= min(g.shape[1], 3000):
        return _GramPCA(g, use, whiten)
    return _sklearn_pca(g, use, whiten=whiten)


def _sklearn_pca(g: np.ndarray, use: int, *, whiten: bool) -> PCA:
    """sklearn PCA on ``use`` components, refitted without the ~zero-variance ones."""
    pca = PCA(n_components=use, whiten=whiten, random_state=0).fit(g)
    ev = pca.explained_variance_
    keep = int(np.count_nonzero(ev > _MIN_RELATIVE_VARIANCE * ev[0])) if ev[0] > 0 else 0
    if keep == 0:
        raise DataError(_IDENTICAL)
    if keep < use:
        pca = PCA(n_components=keep, whiten=whiten, random_state=0).fit(g)
    return pca


def _sq_dist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = np.einsum("ij,ij->i", a, a)[:, None] + np.einsum("ij,ij->i", b, b)[None, :] - 2.0 * (a @ b.T)
    return np.maximum(d, 0.0, out=d)


def _unit(z: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(z, axis=1, keepdims=True)
    return np.divide(z, norm, out=np.zeros_like(z), where=norm > 0)


class MahalanobisAttacker(_GalleryAttacker):
    """PCA eigenfaces with the Mahalanobis distance; similarity is minus the distance.

    Probes and gallery are projected on the gallery's principal components and compared by
    the Euclidean distance after dividing each coordinate by the standard deviation of its
    component (the square root of its eigenvalue), i.e. the Mahalanobis distance in PCA
    space. Components are capped as in :class:`WhitenedCosineAttacker`.

    Parameters
    ----------
    n_components : int, default 50

    Attributes
    ----------
    pca_ : object
        Whitened PCA of the gallery (``mean_``, ``components_``, ``explained_variance_``,
        ``transform``): exact, through the Gram matrix when images are fewer than pixels.
    n_components_ : int
    gallery_ : ndarray of shape (n_gallery, n_components_)
    gallery_people_ : ndarray of shape (n_gallery,)

    References
    ----------
    R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility into face
    de-identification. PET 2005, LNCS 3856, 227-242 (section 3.1).
    """

    def __init__(self, n_components: int = 50):
        self.n_components = n_components

    def _fit_model(self, g: np.ndarray, codes: np.ndarray) -> None:
        nc = _check_int("n_components", self.n_components, 1, hint="pass e.g. n_components=50")
        self.pca_ = _fit_pca(g, nc, whiten=True)
        self.n_components_ = self.pca_.n_components_

    def _embed(self, a: np.ndarray) -> np.ndarray:
        return self.pca_.transform(a)

    def _score(self, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        return -np.sqrt(_sq_dist(p, g))


class FisherfacesAttacker(_GalleryAttacker):
    """Fisherfaces: PCA to ``n - c`` dimensions, then LDA with the person labels.

    PCA keeps ``min(n - c, n - 1, n_pixels)`` components (``n`` gallery images of ``c``
    people), which makes the within-class scatter matrix non-singular when every person has
    several images (Belhumeur et al.); LDA then keeps the ``min(c - 1, pca components)``
    generalised eigenvectors of the between- versus within-class scatter, and faces are
    compared by cosine (default) or Euclidean distance in that space.

    People with a single image contribute to the between-class scatter only. When fewer
    than two people have two or more images there is no within-class scatter to estimate,
    LDA is undefined, and the attacker falls back to whitened-cosine eigenfaces (the
    ``fallback_`` attribute says so); likewise PCA falls back to ``n - 1`` components when
    ``n - c < 1``. A small ridge (1e-6 of the mean within-class variance) keeps the
    generalised eigenproblem well posed when duplicates make the scatter rank-deficient.

    Parameters
    ----------
    n_components : int or None, default None
        LDA dimensions kept (None: all ``c - 1``).
    metric : {"cosine", "euclidean"}, default "cosine"

    Attributes
    ----------
    pca_ : object
        PCA of the gallery (``mean_``, ``components_``, ``transform``).
    projection_ : ndarray of shape (pca components, n_components_)
        LDA directions in PCA space (identity-whitening in the fallback).
    n_components_ : int
    fallback_ : str or None
        Why LDA was not used, or None.
    gallery_, gallery_people_
        As in :class:`WhitenedCosineAttacker`.

    References
    ----------
    P. Belhumeur, J. Hespanha, D. Kriegman. Eigenfaces vs. Fisherfaces: recognition using
    class specific linear projection. IEEE TPAMI 19(7):711-720, 1997.
    """

    def __init__(self, n_components: int | None = None, *, metric: str = "cosine"):
        self.n_components = n_components
        self.metric = metric

    def _fit_model(self, g: np.ndarray, codes: np.ndarray) -> None:
        if self.n_components is not None:
            _check_int("n_components", self.n_components, 1, hint="or None for c - 1 (people - 1)")
        if self.metric not in ("cosine", "euclidean"):
            raise ConfigError(f"metric={self.metric!r} must be 'cosine' or 'euclidean'")
        n = len(g)
        counts = np.bincount(codes)
        c = len(counts)
        self.fallback_ = None
        if c < 2 or np.count_nonzero(counts >= 2) < 2:
            self.fallback_ = (f"{np.count_nonzero(counts >= 2)} of {c} people have two or more images: no "
                              "within-class scatter, so LDA is undefined; using whitened-cosine eigenfaces")
            logger.info("fisherfaces: %s", self.fallback_)
            self.pca_ = _fit_pca(g, 50, whiten=True)
            self.projection_ = np.eye(self.pca_.n_components_)
            self.n_components_ = self.pca_.n_components_
            return
        self.pca_ = _fit_pca(g, n - c if n - c >= 1 else n - 1, whiten=False)
        z = self.pca_.transform(g)
        d = z.shape[1]
        means = np.zeros((c, d))
        np.add.at(means, codes, z)
        means /= counts[:, None]
        within = z - means[codes]
        sw = within.T @ within
        centred = (means - z.mean(axis=0)) * np.sqrt(counts)[:, None]
        sb = centred.T @ centred
        ridge = 1e-6 * max(np.trace(sw) / d, 1e-12)
        w, v = eigh(sb, sw + ridge * np.eye(d))
        order = np.argsort(w)[::-1]
        keep = min(c - 1, d) if self.n_components is None else min(int(self.n_components), c - 1, d)
        self.projection_ = v[:, order[:keep]]
        self.n_components_ = keep

    def _embed(self, a: np.ndarray) -> np.ndarray:
        z = self.pca_.transform(a) @ self.projection_
        return _unit(z) if self.metric == "cosine" else z

    def _score(self, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        return p @ g.T if self.metric == "cosine" else -np.sqrt(_sq_dist(p, g))


def _uniform_table(points: int) -> tuple[np.ndarray, int]:
    """Map every ``points``-bit LBP code to its uniform-pattern bin (last bin: non-uniform)."""
    codes = np.arange(1 << points, dtype=np.int64)
    rotated = ((codes >> 1) | ((codes & 1) << (points - 1)))
    transitions = np.array([bin(int(x)).count("1") for x in (codes ^ rotated)])
    uniform = transitions <= 2
    n_bins = int(np.count_nonzero(uniform)) + 1  # P(P-1)+2 uniform patterns + one shared bin
    table = np.full(1 << points, n_bins - 1, dtype=np.intp)
    table[uniform] = np.arange(n_bins - 1)
    return table, n_bins


def lbp_codes(faces: np.ndarray, *, radius: float = 1, points: int = 8) -> np.ndarray:
    """Circular LBP codes (bilinear sampling, replicated borders) of a stack of grey images.

    Parameters
    ----------
    faces : ndarray of shape (n, height, width)
    radius : float
    points : int

    Returns
    -------
    ndarray of shape (n, height, width), int64 codes in ``[0, 2**points)``.
    """
    faces = np.asarray(faces, dtype=np.float32)
    n, h, w = faces.shape
    pad = int(np.ceil(radius)) + 1
    padded = np.pad(faces, ((0, 0), (pad, pad), (pad, pad)), mode="edge")
    codes = np.zeros((n, h, w), dtype=np.int64)
    for p in range(points):
        # Rounding makes the axis-aligned neighbours fall exactly on pixels (no 1e-17 weights).
        dy = round(-radius * np.sin(2 * np.pi * p / points), 9)
        dx = round(radius * np.cos(2 * np.pi * p / points), 9)
        y0, x0 = int(np.floor(dy)), int(np.floor(dx))
        fy, fx = dy - y0, dx - x0

        def shifted(oy: int, ox: int) -> np.ndarray:
            return padded[:, pad + oy:pad + oy + h, pad + ox:pad + ox + w]

        sample = ((1 - fy) * (1 - fx)) * shifted(y0, x0)
        if fx:
            sample = sample + ((1 - fy) * fx) * shifted(y0, x0 + 1)
        if fy:
            sample = sample + (fy * (1 - fx)) * shifted(y0 + 1, x0)
        if fx and fy:
            sample = sample + (fy * fx) * shifted(y0 + 1, x0 + 1)
        # A small tolerance so that flat regions (sample == centre up to rounding) give 1 bits.
        codes |= (sample >= faces - 1e-4).astype(np.int64) << p
    return codes


LBP_CACHE = RowCache(4000)
"""LBP histograms of the last 4,000 distinct faces (~46 MB at 7 x 7 cells of 59 bins): a gate's attacked
sample (1,000 originals, their N/k released and parrot images) is histogrammed once."""


class LBPAttacker(_GalleryAttacker):
    """Uniform local binary pattern histograms on a grid, compared by the chi-square distance.

    Each aligned face is coded with circular LBP (``points`` neighbours on a circle of
    ``radius`` pixels, bilinear sampling), codes are mapped to the ``P(P-1)+3`` uniform-pattern
    bins, and a histogram is made in each cell of a ``grid`` over the face; histograms are
    normalised by the cell's pixel count and concatenated. Similarity is minus the
    chi-square distance ``sum (a - b)^2 / (a + b)``. Cells are weighted equally (Ahonen et
    al. also try per-region weights). Nothing is learned from the gallery, so ``fit`` only
    enrolls it; it captures texture that PCA recognisers miss.

    Parameters
    ----------
    shape : (int, int), default (92, 81)
        (height, width) of the aligned faces the flat pixel vectors come from.
    grid : (int, int), default (7, 7)
        Cells along (height, width).
    radius : float, default 1
    points : int, default 8
        Neighbours sampled on the circle, 4..16.

    Attributes
    ----------
    n_bins_ : int
        Histogram bins per cell.
    gallery_ : ndarray of shape (n_gallery, grid cells * n_bins_), float32
    gallery_people_ : ndarray

    References
    ----------
    T. Ahonen, A. Hadid, M. Pietikainen. Face description with local binary patterns:
    application to face recognition. IEEE TPAMI 28(12):2037-2041, 2006.
    """

    def __init__(self, shape: tuple[int, int] = (92, 81), *, grid: tuple[int, int] = (7, 7), radius: float = 1,
                 points: int = 8):
        self.shape = shape
        self.grid = grid
        self.radius = radius
        self.points = points

    def _fit_model(self, g: np.ndarray, codes: np.ndarray) -> None:
        h, w = _check_shape(self.shape)
        if g.shape[1] != h * w:
            raise ConfigError(f"images have {g.shape[1]} pixels but shape={self.shape!r} has {h * w}; pass the (height, width) of the aligned faces")
        try:
            gy, gx = (int(v) for v in self.grid)
        except (TypeError, ValueError):
            raise ConfigError(f"grid={self.grid!r} must be a pair of integers (cells along height, width), e.g. (7, 7)") from None
        if not (1 <= gy <= h and 1 <= gx <= w):
            raise ConfigError(f"grid={self.grid!r} must have between 1 and (height, width)=({h}, {w}) cells per axis")
        _check_int("points", self.points, 4, 16, "Ahonen et al. use 8 (16 for radius 2)")
        if not (isinstance(self.radius, (int, float)) and not isinstance(self.radius, bool) and 0.5 <= self.radius <= min(h, w) / 4):
            raise ConfigError(f"radius={self.radius!r} must be a number between 0.5 and {min(h, w) / 4:g} pixels; e.g. 1 or 2")
        self.table_, self.n_bins_ = _uniform_table(int(self.points))
        rows = np.searchsorted(np.linspace(0, h, gy + 1)[1:-1], np.arange(h), side="right")
        cols = np.searchsorted(np.linspace(0, w, gx + 1)[1:-1], np.arange(w), side="right")
        self.cell_ = (rows[:, None] * gx + cols[None, :]).ravel()
        self.n_cells_ = gy * gx
        self.cell_sizes_ = np.bincount(self.cell_, minlength=self.n_cells_).astype(np.float32)
        self.n_features_in_ = h * w

    def _embed(self, a: np.ndarray) -> np.ndarray:
        """Histograms of the rows of ``a``, each distinct face computed once per process.

        :func:`deid.evaluation.attacks.attack_all` shows one face to the attacker several times
        (the gallery it is fitted on, then the same faces enrolled as distinct rows; the release
        in every mode; a parrot gallery of N/k distinct images in N rows). A row's histogram
        depends on that row alone, so rows are keyed by their bytes (:data:`LBP_CACHE`) and the
        new ones computed in chunks of 256 (bounded temporaries): the result is bit for bit
        that of one pass over every row.
        """
        h, w = _check_shape(self.shape)
        a = np.asarray(a)
        n = len(a)
        nb, nc = self.n_bins_, self.n_cells_
        out = np.empty((n, nc * nb), dtype=np.float32)
        base = hashlib.blake2b(repr((h, w, tuple(self.grid), float(self.radius), int(self.points), a.dtype.str))
                               .encode(), digest_size=16, person=b"deid-lbp")
        keys = LBP_CACHE.keys(a, base)
        todo = LBP_CACHE.fill(out, keys)
        first = np.fromiter((idx[0] for idx in todo.values()), dtype=np.int64, count=len(todo))
        for s in range(0, len(first), 256):
            rows = first[s:s + 256]
            m = len(rows)
            bins = self.table_[lbp_codes(a[rows].reshape(m, h, w), radius=self.radius,
                                         points=int(self.points))].reshape(m, -1)
            index = (np.arange(m)[:, None] * nc + self.cell_[None, :]) * nb + bins
            hist = np.bincount(index.ravel(), minlength=m * nc * nb).reshape(m, nc, nb).astype(np.float32)
            hist /= self.cell_sizes_[None, :, None]
            hist = hist.reshape(m, nc * nb)
            for j, i in enumerate(rows):
                out[todo[keys[i]]] = hist[j]
                LBP_CACHE.put(keys[i], hist[j].copy())
        return out

    def _score(self, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        out = np.empty((len(p), len(g)), dtype=np.float64)
        # Few probe rows per block keep the (block, n_gallery, n_features) temporaries in
        # cache (and bounded: ~1M floats whatever the gallery size): 1 row was 3x faster than
        # 16 on 204 x 2891 histograms, and 3x faster than a sparse bin-by-bin accumulation.
        block = max(1, 1_000_000 // max(1, g.size))
        for s in range(0, len(p), block):
            a = p[s:s + block, None, :]
            num = a - g[None, :, :]
            np.square(num, out=num)
            den = a + g[None, :, :]
            den += 1e-12  # empty bins in both histograms: 0 / 1e-12 = 0
            np.divide(num, den, out=num)
            out[s:s + block] = -num.sum(axis=2, dtype=np.float64)
        return out


class ReleaseRefitAttacker(WhitenedCosineAttacker):
    """Whitened-cosine eigenfaces re-fitted on the released images themselves.

    Identical to :class:`WhitenedCosineAttacker`, but :func:`attack_all` fits its PCA on
    the release (``fit_on = "released"``) rather than on the originals, so its components
    describe the variation that survives de-identification; originals and released faces
    are then projected on them as usual.

    Parameters
    ----------
    n_components : int, default 50
    """

    fit_on = "released"
