"""Re-identification attacks used to check that a release keeps its 1/k promise.

Five face recognisers (``ATTACKERS``), each fitted by the attacker on the original aligned
faces, and three ways of using them (Newton et al. 2005; Gross et al. 2009 §2.2):

* ``naive``: released faces are the probes, originals the gallery;
* ``reverse``: originals are the probes, released faces the gallery;
* ``parrot``: the attacker applies the same de-identification to its gallery of originals
  first (and trains its recogniser on that), then matches released faces against it.

Credit for a probe is given at the person level (right person, any of their images) and
split evenly over every gallery item tied at the best score, so identical released images
can never be credited by their position in a list. :func:`attack_all` runs every
attacker in every mode.
"""
from __future__ import annotations

import logging
from numbers import Integral
from typing import Any, Callable, Hashable, Iterable, Literal, Sequence

import numpy as np
from scipy.linalg import eigh
from sklearn.base import BaseEstimator
from sklearn.decomposition import PCA
from threadpoolctl import threadpool_limits

from deid.errors import ConfigError

logger = logging.getLogger(__name__)

# Components whose variance is below this fraction of the largest are dropped before
# whitening: dividing by ~0 would turn rounding noise into the dominant signal.
_MIN_RELATIVE_VARIANCE = 1e-10
# Probe rows scored per block in attack_rate, to bound the (block, gallery) matrix.
_BLOCK = 1024


def _one_blas_thread() -> threadpool_limits:
    """Single-threaded BLAS for the attack's small factorisations and products.

    On a busy 2-core machine OpenBLAS threads contending for cores made PCA/SVD work 12x
    slower than one thread; the pipeline gets its parallelism from separate workers instead.
    """
    return threadpool_limits(limits=1, user_api="blas")


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


def _joint_codes(probe_people: Sequence[Hashable], gallery_people: Sequence[Hashable], m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer person codes shared by probes and gallery (ids of any hashable type)."""
    mapping: dict[Hashable, int] = {}

    def encode(seq: Sequence[Hashable], name: str, size: int) -> np.ndarray:
        seq = list(seq)
        if len(seq) != size:
            raise ConfigError(f"{name} has {len(seq)} entries but there are {size} {name.split('_')[0]} images; pass one person id per image")
        out = np.empty(size, dtype=np.intp)
        for i, v in enumerate(seq):
            if isinstance(v, np.generic):
                v = v.item()
            out[i] = mapping.setdefault(v, len(mapping))
        return out

    return encode(probe_people, "probe_people", m), encode(gallery_people, "gallery_people", n)


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


def _credit_codes(similarity: np.ndarray, probe_codes: np.ndarray, gallery_codes: np.ndarray, rtol: float) -> np.ndarray:
    best = similarity.max(axis=1, keepdims=True)
    tied = similarity >= best - rtol * np.maximum(np.abs(best), 1.0)
    right = gallery_codes[None, :] == probe_codes[:, None]
    return np.count_nonzero(tied & right, axis=1) / np.count_nonzero(tied, axis=1)


def _check_similarity(similarity: Any, rtol: float) -> np.ndarray:
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] == 0 or s.shape[1] == 0:
        raise ConfigError(f"similarity has shape {s.shape}; it must be a non-empty (n_probes, n_gallery) matrix")
    if np.isnan(s).any():
        raise ConfigError("similarity contains NaN; the recogniser produced undefined scores")
    if not (isinstance(rtol, (int, float)) and 0 <= rtol < 1):
        raise ConfigError(f"rtol={rtol!r} must be a number in [0, 1); the default 1e-9 absorbs floating-point noise only")
    return s


def rank_credit(similarity: Any, probe_people: Sequence[Hashable], gallery_people: Sequence[Hashable], *, rtol: float = 1e-9) -> np.ndarray:
    """Rank-1 re-identification credit of each probe, with ties split evenly.

    The candidates of a probe are all gallery items whose similarity is within
    ``rtol * max(|best|, 1)`` of its best similarity; its credit is the fraction of
    candidates that show the probe's person (any image of them).

    Parameters
    ----------
    similarity : array-like of shape (n_probes, n_gallery)
        Higher means more alike.
    probe_people, gallery_people : sequences of hashable
        Person ids of probes and gallery items.
    rtol : float, default 1e-9
        Tie tolerance; absorbs rounding differences between identical images.

    Returns
    -------
    ndarray of shape (n_probes,) with values in [0, 1].
    """
    s = _check_similarity(similarity, rtol)
    pc, gc = _joint_codes(probe_people, gallery_people, *s.shape)
    return _credit_codes(s, pc, gc, rtol)


def reidentification_rate(similarity: Any, probe_people: Sequence[Hashable], gallery_people: Sequence[Hashable], *, rtol: float = 1e-9) -> float:
    """Mean rank-1 credit over all probes (see :func:`rank_credit`).

    Because tied candidates share the credit, the rate does not depend on the gallery order,
    and ``m`` identical probes facing the same candidates earn together at most
    ``m * (largest share of one person among those probes)``.
    """
    return float(rank_credit(similarity, probe_people, gallery_people, rtol=rtol).mean())


def attack_rate(
    attacker: WhitenedCosineAttacker,
    *,
    originals: Any,
    original_people: Sequence[Hashable],
    released: Any,
    released_people: Sequence[Hashable],
    mode: Literal["naive", "reverse"] = "naive",
    rtol: float = 1e-9,
) -> float:
    """Re-identification rate of an attacker that knows the original faces.

    The attacker is (re)fitted on ``originals`` in both modes.

    * ``"naive"``: released faces are the probes, originals the gallery (who is this
      released face?).
    * ``"reverse"``: originals are the probes, released faces the gallery (which released
      face is this person?).

    Parameters
    ----------
    attacker : WhitenedCosineAttacker
        Any object with ``fit(gallery, people=...)``, ``enroll(gallery, people=...)`` and
        ``similarity(probes)``.
    originals, released : array-like of shape (n, n_pixels)
    original_people, released_people : sequences of hashable
    mode : {"naive", "reverse"}
    rtol : float
        Tie tolerance, see :func:`rank_credit`.

    Returns
    -------
    float
        Mean credit over all probes; a k-Same release with one image per person per cluster
        scores at most 1/k in both modes.
    """
    if mode not in ("naive", "reverse"):
        raise ConfigError(f"mode={mode!r} must be 'naive' (released faces as probes) or 'reverse' (originals as probes)")
    orig = _as_matrix(originals, "originals")
    rel = _as_matrix(released, "released")
    attacker.fit(orig, people=original_people)
    if mode == "naive":
        probes, probe_people, gallery, gallery_people = rel, released_people, orig, original_people
    else:
        probes, probe_people, gallery, gallery_people = orig, original_people, rel, released_people
    pc, gc = _joint_codes(probe_people, gallery_people, len(probes), len(gallery))
    if mode == "reverse":
        attacker.enroll(gallery, people=gallery_people)  # PCA stays fitted on the originals
    credits = np.empty(len(probes), dtype=np.float64)
    for start in range(0, len(probes), _BLOCK):
        s = _check_similarity(attacker.similarity(probes[start:start + _BLOCK]), rtol)
        credits[start:start + _BLOCK] = _credit_codes(s, pc[start:start + _BLOCK], gc, rtol)
    return float(credits.mean())


# --------------------------------------------------------------------------- more recognisers


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
            raise ConfigError("gallery images are all identical; there is nothing to recognise")
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
        raise ConfigError("gallery images are all identical; there is nothing to recognise")
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
        h, w = _check_shape(self.shape)
        n = len(a)
        bins = self.table_[lbp_codes(a.reshape(n, h, w), radius=self.radius, points=int(self.points))].reshape(n, -1)
        nb, nc = self.n_bins_, self.n_cells_
        index = (np.arange(n)[:, None] * nc + self.cell_[None, :]) * nb + bins
        hist = np.bincount(index.ravel(), minlength=n * nc * nb).reshape(n, nc, nb).astype(np.float32)
        hist /= self.cell_sizes_[None, :, None]
        return hist.reshape(n, nc * nb)

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


# --------------------------------------------------------------------------- all attacks

def _dlib_resnet(shape: tuple[int, int]) -> Any:
    from deid.evaluation.recognizer import DlibResNetAttacker  # noqa: PLC0415 - recognizer imports this module

    return DlibResNetAttacker(tuple(shape))


ATTACKERS: dict[str, Callable[[tuple[int, int]], Any]] = {
    "pca-mahalanobis": lambda shape: MahalanobisAttacker(50),
    "pca-whitened-cosine": lambda shape: WhitenedCosineAttacker(50),
    "fisherfaces": lambda shape: FisherfacesAttacker(),
    "lbp-chi2": lambda shape: LBPAttacker(tuple(shape)),
    "release-refit-pca": lambda shape: ReleaseRefitAttacker(50),
    "dlib-resnet": _dlib_resnet,
}
"""Attacker name -> factory ``f(shape) -> unfitted recogniser`` (``shape`` = (height, width))."""

DEEP_ATTACKERS: frozenset[str] = frozenset({"dlib-resnet"})
"""Attackers that embed every face with a deep network (~0.09 s of one core per distinct face):
the gate runs them on a smaller sample of whole clusters (``deep_attack_sample``)."""

MODES = ("naive", "reverse", "parrot")


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of ``a`` (first occurrences, in order) and the index of each row's distinct row.

    A k-Same release of N faces holds only about N/k distinct images: scoring each once and
    expanding by index gives the same similarities at a fraction of the cost. Rows are
    grouped by a 64-bit hash and every row is then compared with its group's first row, so
    a hash collision can never merge different images (it falls back to an exact sort).
    """
    a = np.ascontiguousarray(a)
    if len(a) == 0:
        return a, np.zeros(0, dtype=np.int64)
    flat = a.reshape(len(a), -1).view(np.uint8)
    width = flat.shape[1]
    words = np.zeros((len(a), -(-width // 8) * 8), dtype=np.uint8)
    words[:, :width] = flat
    words = words.view(np.uint64)
    mult = np.random.default_rng(0x5EED).integers(1, 2**63, size=words.shape[1], dtype=np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):
        h = (words * mult).sum(axis=1, dtype=np.uint64) ^ np.uint64(width)
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    if not np.array_equal(flat, flat[first[inverse]]):
        view = flat.view(np.dtype((np.void, width))).ravel()
        _, first, inverse = np.unique(view, return_index=True, return_inverse=True)
        inverse = inverse.ravel()
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return a[first[order]], rank[inverse]


def _rate(attacker: Any, probes: tuple[np.ndarray, np.ndarray], probe_people: Sequence[Hashable],
          gallery_people: Sequence[Hashable], rtol: float, gallery_index: np.ndarray | None = None
          ) -> tuple[float, int, float]:
    """Mean credit over all probes, the number of distinct probe images and the credit sum.

    ``probes`` is ``(distinct rows, index of each probe record's row)``: distinct probe rows
    are scored once; ``gallery_index`` expands the similarity of a gallery enrolled as
    distinct rows back to one column per gallery record, so ties between identical released
    images are still credited fractionally per record.
    """
    distinct, index = probes
    pc, gc = _joint_codes(probe_people, gallery_people, len(index), len(gallery_people))
    credits = np.empty(len(index), dtype=np.float64)
    n_gallery = len(gallery_people)
    # Bound the (block, gallery) matrix to ~32 MiB of float64 whatever the gallery size.
    block = max(1, min(_BLOCK, 4_000_000 // max(1, n_gallery)))
    order = np.argsort(index, kind="stable")
    bounds = np.searchsorted(index[order], np.arange(0, len(distinct) + block, block))
    for b, start in enumerate(range(0, len(distinct), block)):
        s = _check_similarity(attacker.similarity(distinct[start:start + block]), rtol)
        if gallery_index is not None:
            s = s[:, gallery_index]
        rows = order[bounds[b]:bounds[b + 1]]
        credits[rows] = _credit_codes(s[index[rows] - start], pc[rows], gc, rtol)
    return float(credits.mean()), int(len(distinct)), float(credits.sum())


def attack_all(
    *,
    originals: Any,
    original_people: Sequence[Hashable],
    released: Any,
    released_people: Sequence[Hashable],
    shape: tuple[int, int],
    modes: Iterable[str] = MODES,
    parrot: Callable[[np.ndarray], np.ndarray] | None = None,
    attackers: Iterable[str] | None = None,
    rtol: float = 1e-9,
) -> list[dict]:
    """Re-identification rate of every attacker in every mode.

    Each recogniser is fitted by the attacker on the images it knows: the originals in
    ``naive`` and ``reverse`` mode, ``parrot(originals)`` in ``parrot`` mode (the attacker
    trains on faces de-identified like the release), and the release itself for
    ``release-refit-pca``.

    * ``naive``: probes = released, gallery = originals;
    * ``reverse``: probes = originals, gallery = released;
    * ``parrot``: probes = released, gallery = ``parrot(originals)`` with the originals' people.

    Parameters
    ----------
    originals : array-like of shape (n, height * width)
        The aligned original faces the attacker holds (at least those of the released people).
    original_people : sequence of hashable, length n
    released : array-like of shape (m, height * width)
    released_people : sequence of hashable, length m
    shape : (int, int)
        (height, width) of the aligned faces.
    modes : iterable of {"naive", "reverse", "parrot"}
    parrot : callable, optional
        ``parrot(originals) -> de-identified originals`` (same shape); required for the
        ``parrot`` mode, e.g. :func:`deid.anonymise.methods.parrot_for`.
    attackers : iterable of str, optional
        Names from :data:`ATTACKERS`; default all.
    rtol : float
        Tie tolerance, see :func:`rank_credit`.

    Returns
    -------
    list of dict
        One ``{"attacker", "mode", "rate", "n_probes", "credit"}`` per attacker x mode;
        ``rate`` is the mean rank-1 credit at the person level over all probes (ties credited
        fractionally), ``n_probes`` the number of distinct probe images scored and ``credit``
        the summed credit over all probe records.

    References
    ----------
    E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images.
    IEEE TKDE 17(2):232-243, 2005. R. Gross, L. Sweeney, J. Cohn, F. de la Torre, S. Baker.
    Face de-identification. In Protecting Privacy in Video Surveillance, Springer, 2009.
    """
    modes = list(modes)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"modes={modes!r} must be a non-empty subset of {MODES}")
    names = list(ATTACKERS) if attackers is None else list(attackers)
    unknown = [a for a in names if a not in ATTACKERS]
    if unknown or not names:
        raise ConfigError(f"attackers={names!r} must be a non-empty subset of {sorted(ATTACKERS)}")
    h, w = _check_shape(shape)
    orig = _as_matrix(originals, "originals")
    rel = _as_matrix(released, "released")
    for name, a in (("originals", orig), ("released", rel)):
        if a.shape[1] != h * w:
            raise ConfigError(f"{name} have {a.shape[1]} pixels but shape={tuple(shape)!r} has {h * w}; pass the (height, width) of the aligned faces")
    original_people = list(original_people)
    released_people = list(released_people)
    _joint_codes(released_people, original_people, len(rel), len(orig))  # length checks up front
    gallery_parrot = None
    if "parrot" in modes:
        if parrot is None:
            raise ConfigError("modes includes 'parrot' but parrot=None; pass parrot=deid.anonymise.methods.parrot_for(method, ...) "
                              "or drop 'parrot' from modes")
        gallery_parrot = _as_matrix(parrot(np.asarray(originals)), "parrot(originals)")
        if gallery_parrot.shape != orig.shape:
            raise ConfigError(f"parrot(originals) returned shape {gallery_parrot.shape}; it must keep the originals' shape {orig.shape}")
    sets = {"originals": (orig, original_people), "released": (rel, released_people),
            "parrot": (gallery_parrot, original_people)}
    distinct: dict[str, tuple[np.ndarray, np.ndarray, list]] = {}

    def distinct_rows(key: str) -> tuple[np.ndarray, np.ndarray, list]:
        if key not in distinct:
            a, people = sets[key]
            rows_, index = unique_rows(a)
            first = np.unique(index, return_index=True)[1]
            distinct[key] = (rows_, index, [people[i] for i in first])
        return distinct[key]

    gallery_of = {"naive": "originals", "reverse": "released", "parrot": "parrot"}
    probes_of = {"naive": "released", "reverse": "originals", "parrot": "released"}
    rows = []
    for name in names:
        # One fit per training set: naive and reverse share the recogniser fitted on the
        # originals, and an attacker fitted on the release serves every mode.
        fitted: dict[str, Any] = {}
        for mode in modes:
            attacker = ATTACKERS[name]((h, w))
            on_release = getattr(attacker, "fit_on", "originals") == "released"
            train_key = "released" if on_release else ("parrot" if mode == "parrot" else "originals")
            if train_key not in fitted:
                train, train_people = sets[train_key]
                fitted[train_key] = attacker.fit(train, people=train_people)
            attacker = fitted[train_key]
            g_rows, g_index, g_people = distinct_rows(gallery_of[mode])
            attacker.enroll(g_rows, people=g_people)
            p_rows, p_index, _ = distinct_rows(probes_of[mode])
            rate, n, credit = _rate(attacker, (p_rows, p_index), sets[probes_of[mode]][1], sets[gallery_of[mode]][1],
                                    rtol, g_index)
            rows.append({"attacker": name, "mode": mode, "rate": rate, "n_probes": n, "credit": credit})
            logger.debug("attack %s/%s: %.4f over %d distinct probes", name, mode, rate, n)
    return rows
