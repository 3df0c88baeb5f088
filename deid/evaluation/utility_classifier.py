"""The utility classifier: standardised pixels, a PCA above the rounding-noise floor, a linear SVM.

:func:`svm_pipeline` is the classifier every utility measure trains (Gross et al. 2005's linear SVM on
PCA coefficients): :class:`PixelPCA` (standardised pixels, then :class:`GramPCA`, exact PCA through the
Gram matrix, dropping the directions uint8 rounding alone could make), standardised scores, ``LinearSVC``.
:func:`embed`, :func:`svc_predict` and :func:`fit_predict` fit its label-free front once and the SVM
per label; :func:`face_matrix` checks and converts a matrix of faces.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import LinearSVC

from deid.errors import ConfigError
from deid.evaluation.utility_folds import check_int


class GramPCA(TransformerMixin, BaseEstimator):
    """Exact PCA through the n x n Gram matrix, for few samples of many pixels.

    With n training faces of p pixels (n << p) the eigenvectors of ``Xc Xc^T`` give the same
    subspace as an SVD of ``Xc`` at O(n^2 p) cost; measured 4-5x faster than sklearn's PCA on
    160 x 7452, which matters because the gate refits it in every fold of every repeat.

    Parameters
    ----------
    n_components : int
        Number of components; capped at the rank of the centred training data.
    max_samples : int or None, default None
        Fit the basis on at most this many training rows (a seeded uniform subset), so the
        O(n^2 p) Gram matrix stays small at scale; None uses every row.
    random_state : int, default 0
        Seed of that subset.
    noise_var : ndarray of shape (p,) or None, default None
        Variance of each input feature's measurement noise (for pixels standardised by a scale
        ``s``: uint8 rounding, ``1 / (12 s**2)``). A direction whose variance is within the
        Marchenko-Pastur upper edge of that noise projected on it, ``(1 + sqrt(p / n))**2`` times
        it, is indistinguishable from noise and dropped: a release spanning few directions and
        rounded to uint8 otherwise fills the remaining components with rounding noise, which the
        standardisation after the PCA scales up to unit variance (measured on a per-frame
        expression release: held-out accuracy 0.30 on the rounded release, 0.80 before rounding).
        See Marchenko & Pastur (1967), and Johnstone (2001) for the edge as a noise threshold.
    """

    def __init__(self, n_components: int = 50, *, max_samples: int | None = None, random_state: int = 0,
                 noise_var: np.ndarray | None = None):
        self.n_components = n_components
        self.max_samples = max_samples
        self.random_state = random_state
        self.noise_var = noise_var

    def fit(self, X, y=None):
        X = np.asarray(X, dtype=np.float64)
        if self.max_samples is not None and len(X) > self.max_samples:
            rows = np.sort(np.random.default_rng(self.random_state).choice(len(X), self.max_samples, replace=False))
            X = X[rows]
        self.mean_ = X.mean(axis=0)
        Xc = X - self.mean_
        w, V = np.linalg.eigh(Xc @ Xc.T)
        order = np.argsort(w)[::-1]
        w, V = w[order], V[:, order]
        keep = int(min(self.n_components, np.count_nonzero(w > w[0] * 1e-12)))
        if keep and self.noise_var is not None:
            units = (V[:, :keep].T @ Xc) / np.sqrt(w[:keep])[:, None]
            n, p = X.shape
            edge = (1.0 + np.sqrt(p / n)) ** 2 * ((units ** 2) @ np.asarray(self.noise_var, dtype=np.float64))
            above = w[:keep] / n > edge
            # Components come in decreasing variance; keep the leading run above the noise edge.
            keep = int(np.argmin(above)) if not above.all() else keep
        if keep == 0:  # identical rows (a release of one image): one zero direction, every score 0
            self.components_ = np.zeros((1, X.shape[1]))
        else:
            self.components_ = (V[:, :keep].T @ Xc) / np.sqrt(w[:keep])[:, None]
        self.n_components_ = len(self.components_)
        return self

    def transform(self, X):
        return (np.asarray(X, dtype=np.float64) - self.mean_) @ self.components_.T


class PixelPCA(TransformerMixin, BaseEstimator):
    """Standardised pixels, then :class:`GramPCA` with the pixels' rounding noise as its floor.

    When every training value is an integer (uint8 images), the rounding noise of pixel j after
    standardisation by its scale ``s_j`` has variance ``1 / (12 s_j**2)``; :class:`GramPCA` drops
    the directions that noise alone could make. Non-integer data (features, float releases) get
    no floor: nothing is known of their noise.

    Parameters
    ----------
    n_components, max_samples, random_state
        As :class:`GramPCA`.
    """

    def __init__(self, n_components: int = 50, *, max_samples: int | None = None, random_state: int = 0):
        self.n_components = n_components
        self.max_samples = max_samples
        self.random_state = random_state

    def fit(self, X, y=None):
        X = np.asarray(X, dtype=np.float64)
        self.scaler_ = StandardScaler().fit(X)
        quantised = bool(np.all(X == np.round(X)))
        noise = (1.0 / 12.0) / self.scaler_.scale_ ** 2 if quantised else None
        self.pca_ = GramPCA(self.n_components, max_samples=self.max_samples, random_state=self.random_state,
                            noise_var=noise).fit(self.scaler_.transform(X))
        self.n_components_ = self.pca_.n_components_
        return self

    def transform(self, X):
        return self.pca_.transform(self.scaler_.transform(np.asarray(X, dtype=np.float64)))

    def fit_transform(self, X, y=None, **fit_params):
        """``fit(X).transform(X)``, bit for bit, standardising ``X`` once instead of twice."""
        X = np.asarray(X, dtype=np.float64)
        self.scaler_ = StandardScaler().fit(X)
        quantised = bool(np.all(X == np.round(X)))
        noise = (1.0 / 12.0) / self.scaler_.scale_ ** 2 if quantised else None
        Xs = self.scaler_.transform(X)
        self.pca_ = GramPCA(self.n_components, max_samples=self.max_samples, random_state=self.random_state,
                            noise_var=noise).fit(Xs)
        self.n_components_ = self.pca_.n_components_
        return self.pca_.transform(Xs)


# Basis of the SVM's PCA fitted on at most this many training faces: the Gram matrix costs
# O(n^2 p): 4 s at n = 1,600 faces of 7,452 pixels on one core, 0.5 s at 600, 0.1 s at 300.
PCA_FIT_ROWS = 300


def check_components(n_components: Any) -> None:
    if n_components is not None:
        check_int("n_components", n_components, 1, " (setting pca_components); pass e.g. 50, or None for "
                   "feature vectors (no PCA)")


def as_components(n_components: Any) -> int | None:
    return None if n_components is None else int(n_components)


def svm_pipeline(n_components: int | None, n_train: int, p: int, seed: int):
    """StandardScaler -> PCA (above the rounding-noise floor, :class:`PixelPCA`) -> StandardScaler -> LinearSVC;
    StandardScaler -> LinearSVC without PCA.

    The PCA scores are standardised before the SVM: raw scores have variances in the
    thousands, which makes liblinear's dual solver behave like a hard-margin SVM and crawl
    (0.17 s per fit with 11 classes one-vs-rest on 132 faces, 0.03 s once standardised; same
    accuracy within noise on London and synthetic drops).

    ``n_components=None`` is for feature vectors (tens to hundreds of features, not pixels):
    no PCA. A k-Same release of vectors spans as many directions as it has distinct clusters;
    whitening all of them (PCA then StandardScaler) scales up the directions in which the
    release barely varies and the held-out originals vary most (measured on a synthetic
    feature drop, 60 people x 3 in 32-d: a classifier trained on the release scored 0.42 on
    held-out originals with 31 whitened components, 0.96 on the standardised features).
    """
    if n_components is None:
        return make_pipeline(StandardScaler(), LinearSVC(C=1.0, max_iter=10_000, random_state=seed))
    nc = max(1, min(n_components, min(n_train, PCA_FIT_ROWS) - 1, p))
    return make_pipeline(PixelPCA(n_components=nc, max_samples=PCA_FIT_ROWS, random_state=seed),
                         StandardScaler(), LinearSVC(C=1.0, max_iter=10_000, random_state=seed))


def fitted_front(Xfit: np.ndarray, n_components: int | None, seed: int):
    """The label-free front of :func:`svm_pipeline` (everything before the SVM) fitted on ``Xfit``.

    It never sees labels, so one fit serves every label; the cross-fit fits it on a fold's *original* training
    faces and on the fold's release, and the release's classifier works in the one an inner cross-validation
    chooses (:mod:`deid.evaluation.utility_select`).
    """
    return svm_pipeline(n_components, len(Xfit), Xfit.shape[1], seed)[:-1].fit(Xfit)


def fit_embed(Xfit: np.ndarray, n_components: int | None, seed: int) -> tuple[Any, np.ndarray]:
    """:func:`fitted_front` and ``Xfit`` embedded in it: ``front.transform(Xfit)`` bit for bit, without a second pass."""
    front = svm_pipeline(n_components, len(Xfit), Xfit.shape[1], seed)[:-1]
    return front, front.fit_transform(Xfit)


def embed(Xtr: np.ndarray, Xte: np.ndarray, n_components: int | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The label-free front of :func:`svm_pipeline` fitted on Xtr: standardised PCA scores of Xtr and Xte.

    Fitted once per training set and shared by every label, since only the SVM sees labels.
    """
    front, Ztr = fit_embed(Xtr, n_components, seed)
    return Ztr, front.transform(Xte)


def svc_predict(Ztr: np.ndarray, ytr: np.ndarray, Zte: np.ndarray, seed: int) -> tuple[np.ndarray, bool]:
    """The SVM of :func:`svm_pipeline` on embedded data; the bool says whether liblinear converged."""
    svc = svm_pipeline(1, 2, 1, seed)[-1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        svc.fit(Ztr, ytr)
    return svc.predict(Zte), not any(issubclass(w.category, ConvergenceWarning) for w in caught)


def fit_predict(Xtr: np.ndarray, ytr: np.ndarray, Xte: np.ndarray, n_components: int | None, seed: int) -> tuple[np.ndarray, bool]:
    """Fit :func:`svm_pipeline` on (Xtr, ytr), predict Xte; the bool says whether liblinear converged."""
    Ztr, Zte = embed(Xtr, Xte, n_components, seed)
    return svc_predict(Ztr, ytr, Zte, seed)


def face_matrix(a: Any, name: str, *, hint: str = "") -> np.ndarray:
    X = np.asarray(a)
    if X.ndim != 2 or X.shape[0] == 0 or X.shape[1] == 0:
        raise ConfigError(f"{name} has shape {X.shape}; it must be a non-empty 2-D array (n_images, n_pixels){hint}")
    X = X.astype(np.float64, copy=False)
    if not np.isfinite(X).all():
        raise ConfigError(f"{name} contain NaN or infinite values; pass finite pixel values")
    return X
