"""Selective weighted mean over random sets (model-agnostic utility-preserving anonymisation)."""
from __future__ import annotations

import logging
from numbers import Real
from typing import Any, Hashable, Mapping, Sequence

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.ensemble import RandomForestClassifier
from sklearn.feature_selection import mutual_info_classif

from deid.errors import ConfigError
from deid.alignment.features import Eigenfaces
from deid.anonymise.ksame import _factorize
from deid.anonymise.methods_factor import check_labels
from deid.anonymise.methods_ksame import check_images, check_k, to_uint8
from deid.memo import Memo, key_for

logger = logging.getLogger(__name__)

# Relevance does not depend on k: the study's points (every k, the parrot, each utility fold)
# score the same features of the same faces again; a forest is grown once per content (deid.memo).
_RELEVANCE = Memo("relevance", max_bytes=4_000_000)

RELEVANCE = ("forest", "mutual-info")


def relevance(Z: np.ndarray, y: np.ndarray, *, method: str, seed: int) -> np.ndarray:
    """Relevance of each feature (column of ``Z``) to the classes ``y``, scaled to max 1.

    ``"forest"``: random-forest impurity importance; ``"mutual-info"``: mutual information
    (k-nearest-neighbour estimator). Zero everywhere when ``y`` has one class.
    """
    if len(np.unique(y)) < 2:
        return np.zeros(Z.shape[1])
    return _RELEVANCE.get_or_compute(key_for("relevance", Z, y, method, seed),
                                     lambda: _relevance(Z, y, method=method, seed=seed))


def _relevance(Z: np.ndarray, y: np.ndarray, *, method: str, seed: int) -> np.ndarray:
    if method == "forest":
        r = RandomForestClassifier(n_estimators=100, random_state=seed, n_jobs=1).fit(Z, y).feature_importances_
    else:
        r = mutual_info_classif(Z, y, random_state=seed)
    top = r.max()
    return r / top if top > 0 else r


def _in_unit(name: str, value: Any, low: float = 0.0, high: float = 1.0, hint: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r} must be a number in [{low:g}, {high:g}]{hint}")
    return float(value)


class SelectiveMean(BaseEstimator):
    """Selective weighted mean: each face averaged with a random set, keeping label-relevant features.

    For every face, a random set of ``k - 1`` faces of other, pairwise distinct people is
    drawn; a fraction ``purity`` of them shares the face's value of the attribute of interest
    (the first label, or ``attribute``). The released face is a weighted mean over the face and
    its set, feature by feature in eigenface space: on the *retained* features the face keeps
    weight ``weight`` (the set shares the rest), elsewhere every member weighs ``1/k``. The
    retained features are the top ``retention`` fraction by relevance to the attribute of
    interest minus relevance to identity, plus the top ``extra_retention`` fraction for each
    further label; relevance is random-forest importance or mutual information. Without
    labels nothing is retained and purity does not apply: a plain mean of random sets.
    Sets overlap and differ per face, so there are no clusters and no formal guarantee: the
    empirical attacks decide.

    Parameters
    ----------
    k : int, default 5
        Set size including the face itself (>= 2).
    purity : float in [0, 1], default 1.0
        Fraction of the other set members sharing the face's attribute of interest.
    retention : float in [0, 1], default 0.2
        Fraction of features retained for the attribute of interest.
    extra_retention : float in [0, 1], default 0.1
        Fraction of features retained for each further label.
    weight : float in [1/k, 1], default 0.5
        The face's own weight on retained features.
    relevance : {"forest", "mutual-info"}, default "forest"
    attribute : str, optional
        The attribute of interest (default: the first label).
    n_components : int, default 50
    random_state : int, default 0
        Seed of the eigenface fit, the relevance estimators and the set draws.

    Attributes
    ----------
    sets_ : ndarray of shape (n_faces, k)
        Row i: face i followed by its set (indices).
    retained_ : ndarray of bool, shape (n_components_,)
        The features on which each face keeps weight ``weight``.
    released_ : ndarray of shape (n_faces, n_pixels)

    References
    ----------
    C.-F. Chen, B. Moriarty, S. Hu, S. Moran, M. Pistoia, V. Piuri, P. Samarati.
    Model-agnostic utility-preserving biometric information anonymization. arXiv:2405.15062, 2024.
    """

    def __init__(self, k: int = 5, *, purity: float = 1.0, retention: float = 0.2, extra_retention: float = 0.1,
                 weight: float = 0.5, relevance: str = "forest", attribute: str | None = None,
                 n_components: int = 50, random_state: int = 0):
        self.k = k
        self.purity = purity
        self.retention = retention
        self.extra_retention = extra_retention
        self.weight = weight
        self.relevance = relevance
        self.attribute = attribute
        self.n_components = n_components
        self.random_state = random_state

    def _check(self) -> None:
        k = check_k(self.k)
        _in_unit("purity", self.purity, hint=" (fraction of the set sharing the attribute of interest)")
        _in_unit("retention", self.retention, hint=" (fraction of features retained for the attribute)")
        _in_unit("extra_retention", self.extra_retention, hint=" (fraction retained per further label)")
        _in_unit("weight", self.weight, 1.0 / k, 1.0, " (the face's own weight on retained features; 1/k = plain mean)")
        if self.relevance not in RELEVANCE:
            raise ConfigError(f"relevance={self.relevance!r} must be one of {list(RELEVANCE)}")

    def fit(self, X: Any, *, people: Sequence[Hashable],
            labels: Mapping[str, Sequence[Hashable]] | None = None) -> "SelectiveMean":
        """Draw the sets, score the features and form the released faces of ``X`` (n_faces, n_pixels)."""
        self._check()
        a = check_images(X)
        n, k = len(a), int(self.k)
        pcodes, pkeys = _factorize(people, "people", n)
        if len(pkeys) < k:
            raise ConfigError(f"k={k} needs faces of at least {k} distinct people but there are {len(pkeys)}; lower k")
        codes = check_labels(labels, n)
        if self.attribute is not None and self.attribute not in codes:
            raise ConfigError(f"attribute={self.attribute!r} is not among the labels {list(codes)}; pass one of them")
        names = list(codes)
        if self.attribute is not None:
            names.remove(self.attribute)
            names.insert(0, self.attribute)
        e = Eigenfaces(self.n_components, random_state=self.random_state).fit(a)
        Z = e.transform(a).astype(np.float64)
        self.retained_ = self._retained(Z, pcodes, codes, names)
        rng = np.random.default_rng(self.random_state)
        target = codes[names[0]] if names else np.zeros(n, dtype=np.intp)
        self.sets_ = np.stack([self._draw(i, pcodes, target, rng) for i in range(n)])
        w = np.where(self.retained_, float(self.weight), 1.0 / k)  # the face's own weight per feature
        others = Z[self.sets_[:, 1:]].mean(axis=1)
        coef = w * Z + (1 - w) * others
        self.released_ = e.mean_.astype(np.float64) + coef @ e.components_.astype(np.float64)
        return self

    def _retained(self, Z: np.ndarray, pcodes: np.ndarray, codes: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
        keep = np.zeros(Z.shape[1], dtype=bool)
        if not names:
            return keep
        seed = int(self.random_state)
        r_id = relevance(Z, pcodes, method=self.relevance, seed=seed)
        for j, name in enumerate(names):
            score = relevance(Z, codes[name], method=self.relevance, seed=seed) - r_id
            m = int(round((self.retention if j == 0 else self.extra_retention) * Z.shape[1]))
            keep[np.argsort(-score, kind="stable")[:m]] = True
        return keep

    def _draw(self, i: int, pcodes: np.ndarray, target: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Face i then k - 1 faces of distinct other people, ``purity`` of them sharing ``target[i]``."""
        need = int(self.k) - 1
        order = rng.permutation(len(pcodes))
        order = order[pcodes[order] != pcodes[i]]
        _, first = np.unique(pcodes[order], return_index=True)  # one random face per other person
        cand = order[np.sort(first)]
        same, diff = cand[target[cand] == target[i]], cand[target[cand] != target[i]]
        n_same = min(len(same), max(need - len(diff), int(round(self.purity * need))))
        # >= k people in all, so same + diff hold >= need faces; when one kind runs short the
        # other fills the set and purity is as near as the data allows.
        chosen = np.r_[same[:n_same], diff[:need - n_same]]
        return np.r_[i, chosen].astype(np.intp)

    def fit_transform(self, X: Any, *, people: Sequence[Hashable],
                      labels: Mapping[str, Sequence[Hashable]] | None = None) -> np.ndarray:
        """Fit, then return the released faces (uint8)."""
        return to_uint8(self.fit(X, people=people, labels=labels).released_)
