"""Re-identification attacks used to check that a release keeps its 1/k promise.

The attacker is the PCA whitened-cosine face recogniser that Gross et al. used to
evaluate k-Same (after the CSU face-identification evaluation system). Credit for a probe
is given at the person level and split evenly over every gallery item tied at the best
score, so identical released images can never be credited by their position in a list.
"""
from __future__ import annotations

import logging
from numbers import Integral
from typing import Any, Hashable, Literal, Sequence

import numpy as np
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
        people = np.asarray(list(people), dtype=object)
        if len(people) != n:
            raise ConfigError(f"people has {len(people)} entries but gallery has {n} images; pass one person id per image")
        use = min(int(nc), n - 1, p)
        with _one_blas_thread():
            pca = PCA(n_components=use, whiten=True, random_state=0).fit(g)
            ev = pca.explained_variance_
            keep = int(np.count_nonzero(ev > _MIN_RELATIVE_VARIANCE * ev[0])) if ev[0] > 0 else 0
            if keep == 0:
                raise ConfigError("gallery images are all identical; there is nothing to recognise")
            if keep < use:
                logger.info("attacker: %d of %d components have ~zero variance; refitting with %d", use - keep, use, keep)
                use = keep
                pca = PCA(n_components=use, whiten=True, random_state=0).fit(g)
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
        self._check_fitted()
        g = self._check_width(_as_matrix(gallery, "gallery"))
        people = np.asarray(list(people), dtype=object)
        if len(people) != len(g):
            raise ConfigError(f"people has {len(people)} entries but gallery has {len(g)} images; pass one person id per image")
        with _one_blas_thread():
            self.gallery_ = self._embed(g)
        self.gallery_people_ = people
        return self

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
