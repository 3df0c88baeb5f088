"""Recognisers an attacker fits on feature vectors (embeddings, sensor windows) instead of faces.

A feature drop's records are already vectors in a space where identity is measurable, so the
attacker needs no image model: nearest neighbour by Euclidean distance
(:class:`EuclideanAttacker`), nearest neighbour by whitened cosine
(:class:`deid.evaluation.attackers.WhitenedCosineAttacker` on the vectors) and a linear
classifier trained on the original vectors to predict identity
(:class:`IdentityClassifierAttacker`), as the evaluation of Chen et al. (2024) does. All
follow the attacker contract of :mod:`deid.evaluation.attackers` (``fit``, ``enroll``,
``similarity``), so :func:`deid.evaluation.attacks.attack_all` runs them in every mode and
scores them with the same tie credit.
"""
from __future__ import annotations

import logging
import warnings
from numbers import Integral, Real

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from deid.errors import ConfigError, DataError
from deid.evaluation.attackers import _GalleryAttacker, _sq_dist

logger = logging.getLogger(__name__)


class EuclideanAttacker(_GalleryAttacker):
    """Nearest neighbour by Euclidean distance on the raw vectors; similarity is minus the distance.

    Nothing is learnt: the gallery is stored as it is. It is the attacker a consumer of an
    embedding release tries first (embeddings are made to be compared by distance).

    Attributes
    ----------
    gallery_ : ndarray of shape (n_gallery, n_features)
    gallery_people_ : ndarray of shape (n_gallery,)
    """

    def _fit_model(self, g: np.ndarray, codes: np.ndarray) -> None:
        return None

    def _embed(self, a: np.ndarray) -> np.ndarray:
        return a

    def _score(self, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        return -np.sqrt(_sq_dist(p, g))


class IdentityClassifierAttacker(_GalleryAttacker):
    """A linear classifier trained on the original vectors to predict who a record is.

    The classifier (multinomial logistic regression on standardised features) is trained on
    the people with at least ``min_records`` records of the training gallery, the protocol of
    Chen et al. (2024): people with a single record teach a classifier nothing about how a
    person varies. When fewer than two people have that many, every person is a class
    (``fallback_`` says so).

    To be scored like the other recognisers, the classifier becomes a similarity: a gallery
    item is embedded as the class the classifier predicts for it, and a probe's similarity to
    it is the probe's decision score for that class. Against a gallery of originals this is
    "predict the probe's identity" (items of the predicted person tie at the top and the tie
    credit counts the right person), and it uses no identity the attacker does not have in the
    reverse and parrot modes (a released gallery is embedded by its predicted classes only).

    Parameters
    ----------
    C : float, default 1.0
        Inverse L2 regularisation strength.
    min_records : int, default 2
        Records a person needs in the training gallery to be a class.
    max_iter : int, default 300
        lbfgs iterations (a warning is logged, not raised, when they run out).

    Attributes
    ----------
    classifier_ : sklearn.linear_model.LogisticRegression
    mean_, scale_ : ndarray of shape (n_features,)
        Standardisation of the training gallery.
    classes_ : ndarray
        The people the classifier can name.
    fallback_ : str or None
    gallery_ : ndarray of shape (n_gallery, n_classes)
        Decision scores of the gallery (the predicted class is their argmax).

    References
    ----------
    C.-F. Chen, B. Moriarty, S. Hu, S. Moran, M. Pistoia, V. Piuri, P. Samarati.
    Model-agnostic utility-preserving biometric information anonymization. arXiv:2405.15062, 2024
    (identity classifiers trained on the original data as the re-identification test).
    """

    def __init__(self, *, C: float = 1.0, min_records: int = 2, max_iter: int = 300):
        self.C = C
        self.min_records = min_records
        self.max_iter = max_iter

    def _fit_model(self, g: np.ndarray, codes: np.ndarray) -> None:
        if isinstance(self.C, bool) or not isinstance(self.C, Real) or not self.C > 0:
            raise ConfigError(f"C={self.C!r} must be a number > 0 (inverse regularisation); e.g. 1.0")
        for name, v in (("min_records", self.min_records), ("max_iter", self.max_iter)):
            if isinstance(v, bool) or not isinstance(v, Integral) or v < 1:
                raise ConfigError(f"{name}={v!r} must be an integer >= 1")
        counts = np.bincount(codes)
        keep = counts[codes] >= int(self.min_records)
        self.fallback_ = None
        if len(np.unique(codes[keep])) < 2:
            self.fallback_ = (f"{int(np.count_nonzero(counts >= self.min_records))} people have >= "
                              f"{self.min_records} records; every person is a class")
            keep = np.ones(len(codes), dtype=bool)
        if len(np.unique(codes[keep])) < 2:
            raise DataError("the gallery holds one person; an identity classifier needs at least 2")
        self.mean_ = g.mean(axis=0)
        sd = g.std(axis=0)
        self.scale_ = np.where(sd > 1e-12 * max(float(sd.max()), 1.0), sd, 1.0)
        clf = LogisticRegression(C=float(self.C), max_iter=int(self.max_iter))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            clf.fit((g[keep] - self.mean_) / self.scale_, codes[keep])
        if any(issubclass(w.category, ConvergenceWarning) for w in caught):
            logger.info("identity classifier: lbfgs stopped after %d iterations before converging", self.max_iter)
        self.classifier_ = clf
        self.classes_ = clf.classes_

    def _embed(self, a: np.ndarray) -> np.ndarray:
        s = self.classifier_.decision_function((a - self.mean_) / self.scale_)
        # Two classes: sklearn returns one column (the second class's score); make it two.
        return np.column_stack([-s, s]) if s.ndim == 1 else s

    def _score(self, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        return p[:, np.argmax(g, axis=1)]
