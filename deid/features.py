"""Eigenface features (PCA on aligned grey faces)."""
from __future__ import annotations

import logging

import numpy as np
from sklearn.decomposition import PCA

from deid.errors import ConfigError

log = logging.getLogger(__name__)


class Eigenfaces:
    """PCA "eigenfaces" of aligned face images (Turk & Pentland 1991).

    k-Same (Newton, Sweeney, Malin 2005) and k-Same-Select (Gross et al. 2005) measure face
    distances in this space to form clusters.

    Parameters
    ----------
    n_components : int, default=50
        Number of eigenfaces; capped at ``min(n_samples - 1, n_pixels)`` of the fit data.
    max_fit_samples : int, default=5000
        Fit on at most this many faces (a seeded random subset) so that fitting stays cheap on
        large drops; projection uses every face.
    random_state : int, default=0
        Seed of the subset and of the randomized SVD.

    Attributes
    ----------
    mean_ : ndarray of shape (n_pixels,)
    components_ : ndarray of shape (n_components_, n_pixels)
    n_components_ : int
    explained_variance_ratio_ : ndarray
    """

    def __init__(self, n_components: int = 50, *, max_fit_samples: int = 5000, random_state: int = 0):
        self.n_components = n_components
        self.max_fit_samples = max_fit_samples
        self.random_state = random_state

    def fit(self, X, y=None):
        X = np.asarray(X, dtype=np.float32)
        if X.ndim != 2 or X.shape[0] < 2:
            raise ConfigError(f"Eigenfaces needs a 2-D array of at least 2 faces; got shape {X.shape}")
        if not isinstance(self.n_components, int) or self.n_components < 1:
            raise ConfigError(f"n_components={self.n_components!r} must be an integer >= 1")
        rng = np.random.default_rng(self.random_state)
        if X.shape[0] > self.max_fit_samples:
            X = X[np.sort(rng.choice(X.shape[0], self.max_fit_samples, replace=False))]
        n = min(self.n_components, X.shape[0] - 1, X.shape[1])
        if n < self.n_components:
            log.info("n_components=%d capped to %d (fit data has %d faces)", self.n_components, n, X.shape[0])
        pca = PCA(n_components=n, svd_solver="auto", random_state=self.random_state).fit(X)
        self.mean_ = pca.mean_.astype(np.float32)
        self.components_ = pca.components_.astype(np.float32)
        self.explained_variance_ratio_ = pca.explained_variance_ratio_
        self.n_components_ = n
        return self

    def transform(self, X) -> np.ndarray:
        X = np.asarray(X, dtype=np.float32)
        return (X - self.mean_) @ self.components_.T

    def fit_transform(self, X, y=None) -> np.ndarray:
        return self.fit(X).transform(X)
