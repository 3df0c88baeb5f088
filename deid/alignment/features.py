"""Eigenface features (PCA on aligned grey faces)."""
from __future__ import annotations

import logging

import numpy as np
from sklearn.decomposition import PCA

from deid.errors import ConfigError
from deid.memo import Memo, key_for

log = logging.getLogger(__name__)

# The same faces are fitted again and again by the comparison study (every method, strength,
# parrot and utility fold re-fits the eigenfaces of the same originals): one fit per content.
_FITS = Memo("eigenfaces")


class Eigenfaces:
    """PCA "eigenfaces" of aligned face images (Turk & Pentland 1991).

    k-Same (Newton, Sweeney, Malin 2005) and k-Same-Select (Gross et al. 2005) measure face
    distances in this space to form clusters.

    Parameters
    ----------
    n_components : int, default=50
        Number of eigenfaces; capped at ``min(n_samples - 1, n_pixels)`` of the fit data.
    max_fit_samples : int, default=2000
        Fit on at most this many faces (a seeded random subset) so that fitting stays cheap on
        large drops (5000 x 7452 took 1.4 s, 2000 took 0.6 s); 50 eigenfaces are well estimated
        from 2000 faces, and projection uses every face.
    random_state : int, default=0
        Seed of the subset and of the randomized SVD.

    Attributes
    ----------
    mean_ : ndarray of shape (n_pixels,)
    components_ : ndarray of shape (n_components_, n_pixels)
    n_components_ : int
    explained_variance_ratio_ : ndarray
    """

    def __init__(self, n_components: int = 50, *, max_fit_samples: int = 2000, random_state: int = 0):
        self.n_components = n_components
        self.max_fit_samples = max_fit_samples
        self.random_state = random_state

    def fit(self, X, y=None):
        X = np.asarray(X)
        if X.ndim != 2 or X.shape[0] < 2:
            raise ConfigError(f"Eigenfaces needs a 2-D array of at least 2 faces; got shape {X.shape}")
        if not isinstance(self.n_components, int) or self.n_components < 1:
            raise ConfigError(f"n_components={self.n_components!r} must be an integer >= 1")
        key = key_for("eigenfaces", X, self.n_components, self.max_fit_samples, self.random_state)
        self.mean_, self.components_, self.explained_variance_ratio_, self.n_components_ = _FITS.get_or_compute(
            key, lambda: self._fit(X))
        return self

    def _fit(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        rng = np.random.default_rng(self.random_state)
        # Subsample before converting: a float copy of 20,000 faces is 600 MB.
        if X.shape[0] > self.max_fit_samples:
            X = X[np.sort(rng.choice(X.shape[0], self.max_fit_samples, replace=False))]
        X = X.astype(np.float32, copy=False)
        n = min(self.n_components, X.shape[0] - 1, X.shape[1])
        if n < self.n_components:
            log.info("n_components=%d capped to %d (fit data has %d faces)", self.n_components, n, X.shape[0])
        pca = PCA(n_components=n, svd_solver="auto", random_state=self.random_state).fit(X)
        return (pca.mean_.astype(np.float32), pca.components_.astype(np.float32), pca.explained_variance_ratio_, n)

    def transform(self, X, *, chunk: int = 4096) -> np.ndarray:
        X = np.asarray(X)
        out = np.empty((X.shape[0], self.n_components_), dtype=np.float32)
        for start in range(0, X.shape[0], chunk):  # bounded memory on large parts
            out[start:start + chunk] = (X[start:start + chunk].astype(np.float32) - self.mean_) @ self.components_.T
        return out

    def fit_transform(self, X, y=None) -> np.ndarray:
        return self.fit(X).transform(X)


_LOG1P_U8 = np.log1p(np.arange(256, dtype=np.float32))  # log1p of every uint8 grey level, in float32


class IlluminationFeatures:
    """Cheap illumination-robust face features: self-quotient images, reduced by PCA.

    Each aligned face ``I`` becomes ``log(1 + I) - log(1 + G_sigma * I)`` (the log of the face over its own
    Gaussian-smoothed version: a smooth multiplicative light, such as a linear ramp, cancels), taken down
    to half size, standardised per face, and projected on ``n_components`` principal components fitted on
    at most 4,000 faces. Measured on London (204 aligned faces): five copies of one photo under linear light
    ramps (gains 0.55-1.45) lie within 0.08 x the median nearest-other-person distance of each other;
    neutral vs smiling photos of one person 0.72 x (median), nearest other person >= 0.80 x (1st
    percentile). About 0.25 ms of CPU per 92 x 81 face on an AVX2 machine (0.36 before the face's own log
    term was looked up and the rows standardised at once): the identity stage's first pass at any size
    (:func:`deid.anonymise.identity.cheap_candidates`) and the within-cluster check's.

    Rows are flat uint8 faces, grey (h*w) or RGB (h*w*3, averaged to grey); ``transform`` returns float32
    (n, n_components) and may be called a part at a time (the same values whatever the chunking).

    References
    ----------
    H. Wang, S. Z. Li, Y. Wang. Face recognition under varying lighting conditions using self quotient
    image. IEEE FGR 2004.
    """

    def __init__(self, shape: tuple[int, int], *, n_components: int = 48, sigma: float = 3.0,
                 max_fit_samples: int = 4000):
        self.h, self.w = (int(v) for v in shape)
        self.n_components = n_components
        self.sigma = sigma
        self.max_fit_samples = max_fit_samples

    def quotient(self, rows: np.ndarray) -> np.ndarray:
        """Standardised half-size self-quotient images of the rows: float32 (n, (h/2) * (w/2))."""
        import cv2  # noqa: PLC0415

        a = np.asarray(rows)
        hw = self.h * self.w
        if a.ndim != 2 or a.shape[1] not in (hw, 3 * hw):
            raise ConfigError(f"rows have shape {a.shape}; each must hold {hw} grey or {3 * hw} RGB values of a "
                              f"{self.h} x {self.w} aligned face")
        size = (max(1, self.w // 2), max(1, self.h // 2))
        out = np.empty((len(a), size[0] * size[1]), np.float32)
        grey_u8 = a.dtype == np.uint8 and a.shape[1] == hw
        for i, r in enumerate(a):
            f = r.reshape(self.h, self.w, -1).mean(axis=2, dtype=np.float32) if r.size != hw else \
                r.reshape(self.h, self.w).astype(np.float32)
            # float32 log1p is a scalar loop in NumPy (~90-175 us a face): for grey uint8 faces the face's own
            # term is looked up, the same float32 values (every level at every offset, checked in the tests).
            own = _LOG1P_U8[r].reshape(self.h, self.w) if grey_u8 else np.log1p(f)
            q = own - np.log1p(cv2.GaussianBlur(f, (0, 0), self.sigma))
            out[i] = cv2.resize(q, size, interpolation=cv2.INTER_AREA).ravel()
        # Standardised per face, all rows at once (a row's own mean and std: the same values as row by row,
        # without NumPy's per-call cost of std, ~0.1 ms a face).
        mu, sd = out.mean(axis=1, keepdims=True), out.std(axis=1, keepdims=True)
        out -= mu
        out /= sd + 1e-6
        return out

    def fit(self, sample: np.ndarray) -> "IlluminationFeatures":
        Q = self.quotient(sample)
        if len(Q) > self.max_fit_samples:
            Q = Q[np.sort(np.random.default_rng(0).choice(len(Q), self.max_fit_samples, replace=False))]
        k = int(min(self.n_components, len(Q), Q.shape[1]))
        self.pca_ = PCA(k, svd_solver="randomized" if k < min(Q.shape) else "full", random_state=0).fit(Q)
        return self

    def transform(self, rows: np.ndarray) -> np.ndarray:
        out = np.zeros((len(rows), self.n_components), np.float32)
        if len(rows):
            z = self.pca_.transform(self.quotient(rows))
            out[:, :z.shape[1]] = z
        return out

    def fit_transform(self, rows: np.ndarray) -> np.ndarray:
        return self.fit(rows).transform(rows)
