"""Attribute-preserving k-Same with a linear attribute transfer in eigenface space."""
from __future__ import annotations

import logging
from numbers import Real
from typing import Any, Hashable, Mapping, Sequence

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.linear_model import Ridge

from deid.errors import ConfigError
from deid.alignment.features import Eigenfaces
from deid.anonymise.ksame import _factorize
from deid.anonymise.methods_factor import check_labels
from deid.anonymise.methods_ksame import check_images, check_k, to_uint8

logger = logging.getLogger(__name__)


def one_hot(codes: dict[str, np.ndarray]) -> np.ndarray:
    """Concatenated one-hot encodings of integer-coded labels, (n, total number of values)."""
    return np.hstack([np.eye(int(c.max()) + 1)[c] for c in codes.values()])


def random_donors(pcodes: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Per face, one uniformly random face of each of ``k`` uniformly random *other* people, (n_faces, k).

    ``pcodes``: integer person codes 0..P-1 (P > k). The people are drawn without replacement
    from the P - 1 others; a person's face uniformly among theirs.
    """
    n, n_people = len(pcodes), int(pcodes.max()) + 1
    order = np.argsort(pcodes, kind="stable")  # each person's faces, contiguous
    counts = np.bincount(pcodes, minlength=n_people)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    # k distinct people of the P - 1 others: distinct codes of 0..P-2, those at or above the
    # face's own person shifted up by one (the own person is never drawn).
    who = np.stack([rng.choice(n_people - 1, size=k, replace=False) for _ in range(n)])
    who += who >= pcodes[:, None]
    pick = (rng.random((n, k)) * counts[who]).astype(np.intp)  # a uniform face of each drawn person
    return order[starts[who] + np.minimum(pick, counts[who] - 1)]


class AttributePreserving(BaseEstimator):
    """Attribute-preserving k-Same: average k random faces of other people moved to the face's attributes.

    For each face, ``k`` distinct *other* people are drawn at random and one random face of
    each (the paper's k random donors); the donors are each moved to the face's label values
    and averaged; the face itself does not enter its release. The draws use ``random_state``:
    in a release its secret seed (:mod:`deid.anonymise.randomness`), so an attacker who re-runs
    the method on the originals draws other donors. (The k *nearest* donors, chosen
    deterministically, let that attacker rebuild every released face: parrot 0.990 on London at
    k=5, issue 31; the variant is not kept.) The paper moves faces with a GAN (ELEGANT) whose weights cannot be
    obtained here; this implementation uses a *linear* attribute transfer: per-label-value
    directions in eigenface space, fitted by ridge regression of the coefficients on the
    one-hot labels (all labels jointly, so correlated labels are separated), and moving face
    j to face i's labels adds ``(h_i - h_j) @ B``. Releases differ face by face (no clusters),
    so no formal guarantee holds: the empirical attacks decide.

    Parameters
    ----------
    k : int, default 5
        Number of other people averaged for each face (>= 2); needs >= k + 1 people.
    alpha : float, default 1.0
        Ridge penalty of the attribute directions (> 0).
    n_components : int, default 50
    random_state : int, default 0
        Seed of the donor draws and of the eigenface fit (a release passes its secret seed).

    Attributes
    ----------
    directions_ : ndarray of shape (n_label_values, n_components_)
        Eigenface-space offset of each label value (one-hot order: labels, then values in
        first-appearance order).
    donors_ : ndarray of shape (n_faces, k)
        The faces averaged for each face: one of each of k random other people.
    released_ : ndarray of shape (n_faces, n_pixels)

    References
    ----------
    B. Yan, M. Pei, Z. Nie. Attributes preserving face de-identification. ICCV Workshops
    2019. T. Xiao, J. Hong, J. Ma. ELEGANT: exchanging latent encodings with GAN for
    transferring multiple face attributes. ECCV 2018.
    """

    def __init__(self, k: int = 5, *, alpha: float = 1.0, n_components: int = 50, random_state: int = 0):
        self.k = k
        self.alpha = alpha
        self.n_components = n_components
        self.random_state = random_state

    def fit(self, X: Any, *, people: Sequence[Hashable],
            labels: Mapping[str, Sequence[Hashable]] | None = None) -> "AttributePreserving":
        """Learn the attribute directions and form the released faces of ``X`` (n_faces, n_pixels)."""
        k = check_k(self.k)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, Real) or not self.alpha > 0:
            raise ConfigError(f"alpha={self.alpha!r} must be a number > 0 (ridge penalty of the attribute directions)")
        a = check_images(X)
        n = len(a)
        pcodes, pkeys = _factorize(people, "people", n)
        codes = check_labels(labels, n)
        if not codes:
            raise ConfigError("method 'attribute-preserving' needs labels={name: one value per face}, e.g. "
                              "{'expression': [...]}: the attributes it preserves")
        if len(pkeys) < k + 1:
            raise ConfigError(f"k={k} needs faces of at least {k + 1} distinct people (k others per face) but there "
                              f"are {len(pkeys)}; lower k")
        e = Eigenfaces(self.n_components, random_state=self.random_state).fit(a)
        Z = e.transform(a).astype(np.float64)
        H = one_hot(codes)
        self.directions_ = Ridge(alpha=float(self.alpha)).fit(H, Z).coef_.T  # (n_values, n_components)
        shift = H @ self.directions_  # each face's attribute offset
        donors = self.donors_ = random_donors(pcodes, k, np.random.default_rng(self.random_state))
        # Move every donor j to face i's labels: z_j - shift_j + shift_i, then average.
        coef = (Z[donors] - shift[donors]).mean(axis=1) + shift
        self.released_ = e.mean_.astype(np.float64) + coef @ e.components_.astype(np.float64)
        return self

    def fit_transform(self, X: Any, *, people: Sequence[Hashable],
                      labels: Mapping[str, Sequence[Hashable]] | None = None) -> np.ndarray:
        """Fit, then return the released faces (uint8)."""
        return to_uint8(self.fit(X, people=people, labels=labels).released_)
