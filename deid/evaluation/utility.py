"""Utility evaluation: how well a utility label can still be predicted from (released) faces.

Gross, Airoldi, Malin & Sweeney (2005) measure the utility of de-identified faces by the
accuracy of a classifier for the data's utility labels (gender, expression). We use a
linear SVM on standardised PCA coefficients, cross-validated with folds grouped so that
no group (a person, or a k-Same cluster whose released images are identical copies) is
split between training and test data: otherwise the classifier would be tested on
copies of its training images and utility would be overstated.

The gate's check is :func:`cross_fit_utility`: the method is re-run on the training people
of each fold and the classifiers are tested on held-out people's originals, with bootstrap
bounds and a pass / fail / inconclusive status (:class:`UtilityEvidence`). The three older
protocols (:func:`utility_protocols`) remain as extra evidence for the report and the study.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import asdict, dataclass, field
from numbers import Integral, Real
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GroupKFold, StratifiedGroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import LinearSVC
from deid.blas import one_blas_thread

from deid.errors import ConfigError, DataError
from deid.anonymise.ksame import DominantPersonError, InsufficientPeopleError
from deid.anonymise.partition import _trim_dominant  # the flow's rule for a person above 1/k of a partition
from deid.progress import Progress, track
from deid.memo import Memo, digest, key_for, key_for_size, plain

logger = logging.getLogger(__name__)

# The comparison study measures every point against the same originals: their grouped-CV
# accuracy and each cross-fit fold's originals-trained predictions are computed once (deid.memo).
_CV = Memo("grouped_cv_accuracy", max_bytes=8_000_000)
_ORIGINAL_FOLDS = Memo("cross_fit_originals", max_bytes=32_000_000)


@dataclass(frozen=True)
class UtilityResult:
    """Outcome of :func:`grouped_cv_accuracy`.

    ``accuracy`` is the fraction of correctly predicted test images pooled over the folds
    that could be evaluated, or ``None`` when no accuracy can be measured; ``detail`` says
    how the folds were made and anything that was adjusted.
    """

    accuracy: float | None
    folds_used: int
    n_groups: int
    detail: str
    fold_accuracies: tuple[float, ...] = field(default=())


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


def _codes(values: Sequence[Hashable], name: str, n: int) -> np.ndarray:
    seq = list(values)
    if len(seq) != n:
        raise ConfigError(f"{name} has {len(seq)} entries but images has {n} rows; pass one value per image")
    mapping: dict[Hashable, int] = {}
    out = np.empty(n, dtype=np.intp)
    for i, v in enumerate(seq):
        if isinstance(v, np.generic):
            v = v.item()
        if v is None or (isinstance(v, float) and np.isnan(v)):
            raise DataError(f"{name}[{i}] is missing; drop or quarantine rows without a {name} value first")
        out[i] = mapping.setdefault(v, len(mapping))
    return out


def grouped_splits(y: Sequence[Hashable], *, groups: Sequence[Hashable], folds: int = 5, seed: int = 0) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    """Cross-validation splits in which no group straddles training and test data.

    Uses ``StratifiedGroupKFold(shuffle=True, random_state=seed)``; falls back to
    ``GroupKFold(shuffle=True, random_state=seed)`` when stratification is impossible (it
    raises, leaves a fold empty, or leaves a training fold with a single class). ``folds``
    is reduced to the number of groups when there are fewer groups.

    Returns
    -------
    splits : list of (train_indices, test_indices)
    detail : str
        Which splitter was used and any adjustment.
    """
    y_codes = _codes(y, "y", len(list(y)))
    n = len(y_codes)
    g_codes = _codes(groups, "groups", n)
    n_groups = int(g_codes.max()) + 1 if n else 0
    _check_folds(folds)
    if n_groups < 2:
        raise DataError(f"groups has {n_groups} distinct value(s); grouped cross-validation needs at least 2 groups")
    notes = []
    n_splits = int(folds)
    if n_groups < n_splits:
        notes.append(f"folds reduced from {folds} to {n_groups} (only {n_groups} groups)")
        n_splits = n_groups
    dummy = np.zeros((n, 1))
    splits: list[tuple[np.ndarray, np.ndarray]] | None = None
    try:
        cand = _stratified_group_kfold(y_codes, g_codes, n_splits, seed)
        if cand is None:  # a case sklearn refuses (its message goes into the detail): let it say so
            with warnings.catch_warnings():
                # "least populated class has fewer members than n_splits" is expected on small data.
                warnings.simplefilter("ignore", UserWarning)
                cand = list(StratifiedGroupKFold(n_splits=n_splits, shuffle=True, random_state=seed).split(
                    dummy, y_codes, g_codes))
        if all(len(te) and len(np.unique(y_codes[tr])) > 1 for tr, te in cand):
            splits = cand
            notes.insert(0, f"StratifiedGroupKFold({n_splits}, shuffle, seed={seed})")
        else:
            notes.append("stratified folds left a fold empty or single-class; fell back to GroupKFold")
    except ValueError as exc:
        notes.append(f"stratification impossible ({exc}); fell back to GroupKFold")
    if splits is None:
        splits = list(GroupKFold(n_splits=n_splits, shuffle=True, random_state=seed).split(dummy, y_codes, g_codes))
        notes.insert(0, f"GroupKFold({n_splits}, shuffle, seed={seed})")
    return splits, "; ".join(notes)


def _stratified_group_kfold(y_codes: np.ndarray, g_codes: np.ndarray, n_splits: int, seed: int
                            ) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """``StratifiedGroupKFold(n_splits, shuffle=True, random_state=seed).split`` (scikit-learn 1.9), the same folds.

    sklearn's greedy assignment scores every fold for every group in a Python loop of small NumPy
    calls (~0.15 s per split of 1,000 images, a dozen splits per gate); here the folds of one
    group are scored together, with the same arithmetic in the same order (so the same floats and
    the same ties), and the test sets are gathered without a Python loop over images. None for the
    inputs sklearn refuses (more folds than images, groups or members of every class): the caller
    asks sklearn, whose message the detail quotes. ``y_codes`` and ``g_codes`` are codes 0..m-1.

    References
    ----------
    scikit-learn, ``sklearn.model_selection.StratifiedGroupKFold`` (after J. Wasikowski's Kaggle
    kernel "Stratified group k-fold cross-validation").
    """
    n = len(y_codes)
    y_cnt = np.bincount(y_codes)
    n_groups = int(g_codes.max()) + 1 if n else 0
    if n_splits > n or np.all(n_splits > y_cnt) or n_splits > n_groups or not np.all(y_cnt):
        return None
    n_classes = len(y_cnt)
    y_counts_per_group = np.zeros((n_groups, n_classes))
    np.add.at(y_counts_per_group, (g_codes, y_codes), 1)
    perm = np.arange(n_groups)
    np.random.RandomState(seed).shuffle(perm)  # sklearn's check_random_state(seed) and its one shuffle
    y_counts_per_group = y_counts_per_group[perm]
    inv_perm = np.empty_like(perm)
    inv_perm[perm] = np.arange(perm.size)
    groups_inv = inv_perm[g_codes]
    order = np.argsort(-np.std(y_counts_per_group, axis=1), kind="stable")
    per_fold = np.zeros((n_splits, n_classes))
    fold_of = np.empty(n_groups, dtype=np.int64)
    scale = y_cnt.reshape(1, 1, -1)
    eye = np.eye(n_splits)[:, :, None]
    for g in order:
        counts = per_fold[None] + eye * y_counts_per_group[g]  # candidate f: the group added to fold f
        evals = np.mean(np.std(counts / scale, axis=1), axis=1)
        sizes = per_fold.sum(axis=1)
        best, best_eval, best_size = None, np.inf, np.inf
        for f in range(n_splits):
            e = float(evals[f])
            close = abs(e - best_eval) <= 1e-08 + 1e-05 * abs(best_eval)  # np.isclose's defaults
            if e < best_eval or (close and sizes[f] < best_size):
                best, best_eval, best_size = f, e, sizes[f]
        per_fold[best] += y_counts_per_group[g]
        fold_of[g] = best
    folds = fold_of[groups_inv]
    indices = np.arange(n)
    return [(indices[folds != f], indices[folds == f]) for f in range(n_splits)]


def _check_int(name: str, value: Any, low: int, advice: str) -> None:
    """Refuse a non-integer (or bool) ``value`` below ``low``; ``advice`` ends the message."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise ConfigError(f"{name}={value!r} must be an integer >= {low}{advice}")


def _check_folds(folds: Any) -> None:
    _check_int("folds", folds, 2, " (setting cv_folds); pass e.g. folds=5")


def grouped_cv_accuracy(
    images: Any,
    y: Sequence[Hashable],
    *,
    groups: Sequence[Hashable],
    folds: int = 5,
    n_components: int | None = 50,
    seed: int = 0,
    repeats: int = 1,
) -> UtilityResult:
    """Grouped cross-validated accuracy of a linear SVM predicting ``y`` from face pixels.

    Each fold fits ``StandardScaler -> PCA -> LinearSVC`` on its training part only (PCA
    ``n_components`` capped at ``min(n_components, n_train - 1, n_pixels)``, since
    ``n_train`` centred images span at most ``n_train - 1`` directions). Accuracy is pooled
    over the test images of all evaluated folds. A fold whose training part has a single
    class cannot train a classifier and is skipped (reported in ``detail``).

    Parameters
    ----------
    images : array-like of shape (n, n_pixels)
        uint8 or float pixel vectors (original or released faces).
    y : sequence of hashable, length n
        The utility label (e.g. gender).
    groups : sequence of hashable, length n
        Images sharing a group are kept in the same fold: person ids for originals,
        cluster labels for k-Same releases.
    folds : int, default 5
    n_components : int or None, default 50
        None: no PCA (feature vectors), see :func:`_svm`.
    seed : int, default 0
        Seeds the fold shuffling and the SVM; equal inputs and seed give equal results.
    repeats : int, default 1
        Repeat the grouped K-fold with seeds ``seed, seed+1, ...`` and pool the test
        predictions. A k-Same release has only ``n/k`` distinct images, so one split of
        its few groups is a noisy estimate (measured on a 40-person synthetic release:
        0.85-1.00 across seeds); repeating shrinks that noise without mixing groups.

    Returns
    -------
    UtilityResult
        ``accuracy`` is ``None`` when ``y`` has a single class or no fold could be evaluated.

    References
    ----------
    R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility into face
    de-identification. Privacy Enhancing Technologies (PET), LNCS 3856, 227-242, 2005.
    """
    X = _matrix(images, "images", hint=": flatten with .reshape(len(images), -1)")
    key = key_for("grouped_cv_accuracy", X, [plain(v) for v in y], [plain(g) for g in groups], folds, n_components,
                  seed, repeats)
    return _CV.get_or_compute(key, lambda: _grouped_cv_accuracy(X, y, groups=groups, folds=folds,
                                                                n_components=n_components, seed=seed,
                                                                repeats=repeats))


def _grouped_cv_accuracy(X: np.ndarray, y: Sequence[Hashable], *, groups: Sequence[Hashable], folds: int,
                         n_components: int, seed: int, repeats: int) -> UtilityResult:
    n, p = X.shape
    _check_components(n_components)
    _check_folds(folds)
    y_codes = _codes(y, "y", n)
    g_codes = _codes(groups, "groups", n)
    n_groups = int(g_codes.max()) + 1
    n_classes = int(y_codes.max()) + 1
    if n_classes < 2:
        return UtilityResult(None, 0, n_groups, "y has a single class; accuracy is undefined (nothing to predict)")
    if n_groups < 2:
        return UtilityResult(None, 0, n_groups, "only one group; grouped cross-validation needs at least 2 groups")
    _check_int("repeats", repeats, 1, " (setting cv_repeats); pass e.g. 10")
    splits, detail = [], ""
    for r in range(int(repeats)):
        rep_splits, rep_detail = grouped_splits(y_codes, groups=g_codes, folds=folds, seed=seed + r)
        splits.extend(rep_splits)
        detail = detail or rep_detail
    if repeats > 1:
        detail += f"; repeated {repeats}x (seeds {seed}..{seed + repeats - 1}), predictions pooled"
    # Single-threaded BLAS: these are small factorisations, and on a busy 2-core machine
    # OpenBLAS threads contending for cores were measured 12x slower (6.2 s vs 0.5 s on the
    # London set).
    with one_blas_thread():
        return _cross_validate(X, y_codes, g_codes, splits, detail, n_groups, _components(n_components), seed)


def _cross_validate(X: np.ndarray, y_codes: np.ndarray, g_codes: np.ndarray, splits: list, detail: str,
                    n_groups: int, n_components: int | None, seed: int) -> UtilityResult:
    p = X.shape[1]
    correct = 0
    tested = 0
    accs: list[float] = []
    skipped = 0
    converged = True
    for tr, te in splits:
        if len(te) == 0 or len(np.unique(y_codes[tr])) < 2:
            skipped += 1
            continue
        model = _svm(n_components, len(tr), p, seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            model.fit(X[tr], y_codes[tr])
        if any(issubclass(w.category, ConvergenceWarning) for w in caught):
            converged = False
        hit = int(np.count_nonzero(model.predict(X[te]) == y_codes[te]))
        correct += hit
        tested += len(te)
        accs.append(hit / len(te))
    notes = [detail]
    if skipped:
        notes.append(f"{skipped} fold(s) skipped: training part had a single class or the test part was empty")
    if not converged:
        notes.append("LinearSVC did not fully converge in some fold (max_iter=10000)")
    if not accs:
        return UtilityResult(None, 0, n_groups, "; ".join(notes + ["no fold could be evaluated"]))
    accuracy = correct / tested
    logger.debug("grouped CV accuracy %.4f over %d folds (%d groups)", accuracy, len(accs), n_groups)
    return UtilityResult(accuracy, len(accs), n_groups, "; ".join(notes), tuple(accs))


# --------------------------------------------------------------------------- protocols 2 and 3

PROTOCOLS: dict[str, str] = {
    "cv": "protocol 1: grouped k-fold CV on the release (groups = clusters) vs on the originals (groups = people)",
    "train-original-test-release": "protocol 2: trained on the originals, tested on the release (Moriarty et al.)",
    "train-release-test-heldout": "protocol 3: trained on the released records of half the people, tested on the "
                                  "originals of the other half (2-fold over people, repeated)",
}
"""Utility protocol id -> description (the ``protocol`` field of a report's utility row)."""


# Basis of the SVM's PCA fitted on at most this many training faces: the Gram matrix costs
# O(n^2 p): 4 s at n = 1,600 faces of 7,452 pixels on one core, 0.5 s at 600, 0.1 s at 300.
PCA_FIT_ROWS = 300


def _check_components(n_components: Any) -> None:
    if n_components is not None:
        _check_int("n_components", n_components, 1, " (setting pca_components); pass e.g. 50, or None for "
                   "feature vectors (no PCA)")


def _components(n_components: Any) -> int | None:
    return None if n_components is None else int(n_components)


def _svm(n_components: int | None, n_train: int, p: int, seed: int):
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


def _embed(Xtr: np.ndarray, Xte: np.ndarray, n_components: int | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The label-free front of :func:`_svm` fitted on Xtr: standardised PCA scores of Xtr and Xte.

    Fitted once per training set and shared by every label, since only the SVM sees labels.
    """
    front = _svm(n_components, len(Xtr), Xtr.shape[1], seed)[:-1]
    return front.fit_transform(Xtr), front.transform(Xte)


def _originals_fold(X: np.ndarray, ys: dict[str, np.ndarray], names: list[str], tr: np.ndarray, te: np.ndarray,
                    n_components: int | None, seed: int) -> dict[str, np.ndarray]:
    """Per label, the held-out predictions of the classifier trained on the fold's original training faces."""
    Ztr, Zte = _embed(X[tr], X[te], n_components, seed)
    return {name: _svc_predict(Ztr, ys[name][tr], Zte, seed)[0] for name in names if len(np.unique(ys[name][tr])) >= 2}


def _svc_predict(Ztr: np.ndarray, ytr: np.ndarray, Zte: np.ndarray, seed: int) -> tuple[np.ndarray, bool]:
    """The SVM of :func:`_svm` on embedded data; the bool says whether liblinear converged."""
    svc = _svm(1, 2, 1, seed)[-1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        svc.fit(Ztr, ytr)
    return svc.predict(Zte), not any(issubclass(w.category, ConvergenceWarning) for w in caught)


def _fit_predict(Xtr: np.ndarray, ytr: np.ndarray, Xte: np.ndarray, n_components: int | None, seed: int) -> tuple[np.ndarray, bool]:
    """Fit :func:`_svm` on (Xtr, ytr), predict Xte; the bool says whether liblinear converged."""
    Ztr, Zte = _embed(Xtr, Xte, n_components, seed)
    return _svc_predict(Ztr, ytr, Zte, seed)


def _matrix(a: Any, name: str, *, hint: str = "") -> np.ndarray:
    X = np.asarray(a)
    if X.ndim != 2 or X.shape[0] == 0 or X.shape[1] == 0:
        raise ConfigError(f"{name} has shape {X.shape}; it must be a non-empty 2-D array (n_images, n_pixels){hint}")
    X = X.astype(np.float64, copy=False)
    if not np.isfinite(X).all():
        raise ConfigError(f"{name} contain NaN or infinite values; pass finite pixel values")
    return X


def _check_same_width(Xo: np.ndarray, Xr: np.ndarray) -> None:
    if Xo.shape[1] != Xr.shape[1]:
        raise ConfigError(f"originals have {Xo.shape[1]} pixels but released faces {Xr.shape[1]}; use the same canonical size")


def _joint_label_codes(a: Sequence[Hashable], b: Sequence[Hashable], na: int, nb: int, name_a: str, name_b: str) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes shared by two label sequences (equal values, equal codes)."""
    a, b = list(a), list(b)
    _codes(a, name_a, na)  # length and missing-value errors that name the right argument
    _codes(b, name_b, nb)
    c = _codes(a + b, f"{name_a} + {name_b}", na + nb)
    return c[:na], c[na:]


def train_original_test_release(
    originals: Any,
    original_y: Sequence[Hashable],
    released: Any,
    released_y: Sequence[Hashable],
    *,
    n_components: int | None = 50,
    seed: int = 0,
) -> UtilityResult:
    """Protocol 2: a linear SVM trained on all originals, tested on all released faces.

    Answers "does a classifier built on real faces still read the label off the released
    ones?" (Moriarty et al.'s protocol). ``StandardScaler -> PCA -> LinearSVC`` as in
    :func:`grouped_cv_accuracy`.

    Returns
    -------
    UtilityResult
        ``accuracy`` over the released faces (None when the originals hold a single class);
        ``folds_used`` is 1.

    References
    ----------
    R. Moriarty et al. (train on original faces, test on de-identified faces), as used to
    judge face de-identification utility; R. Gross, E. Airoldi, B. Malin, L. Sweeney.
    Integrating utility into face de-identification. PET 2005, LNCS 3856, 227-242.
    """
    Xo, Xr = _matrix(originals, "originals"), _matrix(released, "released")
    _check_same_width(Xo, Xr)
    yo, yr = _joint_label_codes(original_y, released_y, len(Xo), len(Xr), "original_y", "released_y")
    if len(np.unique(yo)) < 2:
        return UtilityResult(None, 0, 0, "originals hold a single class; nothing to learn")
    with one_blas_thread():
        pred, converged = _fit_predict(Xo, yo, Xr, _components(n_components), seed)
    acc = float(np.mean(pred == yr))
    detail = f"trained on {len(Xo)} originals, tested on {len(Xr)} released faces"
    if not converged:
        detail += "; LinearSVC did not fully converge (max_iter=10000)"
    return UtilityResult(acc, 1, 0, detail, (acc,))


def train_release_test_heldout(
    released: Any,
    released_y: Sequence[Hashable],
    released_people: Sequence[Hashable],
    originals: Any,
    original_y: Sequence[Hashable],
    original_people: Sequence[Hashable],
    *,
    repeats: int = 5,
    n_components: int | None = 50,
    seed: int = 0,
) -> tuple[UtilityResult, UtilityResult]:
    """Protocol 3: trained on the release, tested on originals of people outside the training part.

    What a data consumer does: learn from the released faces, apply to new real faces. The
    people are split into two halves A and B (seeded, ``repeats`` times, both directions):
    the SVM is trained on the released records of the people in A and tested on the
    original faces of the people in B. The same splits trained on the originals of A give
    the reference accuracy. A k-Same released face is an average over a cluster, which may
    include people of B; that is inherent to testing a given release (re-running the
    de-identification on A alone would test a different release) and only makes the test
    people slightly less "unseen".

    Returns
    -------
    (release, reference) : tuple of UtilityResult
        Accuracy pooled over every tested original face of every split, trained on the
        release and on the originals respectively.
    """
    Xr, Xo = _matrix(released, "released"), _matrix(originals, "originals")
    _check_same_width(Xo, Xr)
    _check_int("repeats", repeats, 1, "; pass e.g. 5")
    yr, yo = _joint_label_codes(released_y, original_y, len(Xr), len(Xo), "released_y", "original_y")
    pr, po = _joint_label_codes(released_people, original_people, len(Xr), len(Xo), "released_people", "original_people")
    people = np.unique(np.r_[pr, po])
    if len(people) < 2:
        return (UtilityResult(None, 0, len(people), "fewer than 2 people; no held-out people to test on"),) * 2
    hits = {"release": [0, 0], "originals": [0, 0]}
    accs: dict[str, list[float]] = {"release": [], "originals": []}
    skipped = 0
    converged = True
    with one_blas_thread():
        for r in range(int(repeats)):
            perm = np.random.default_rng(seed + r).permutation(people)
            halves = (perm[: len(perm) // 2], perm[len(perm) // 2:])
            for a, b in (halves, halves[::-1]):
                test = np.isin(po, b)
                for source, X, y, pp in (("release", Xr, yr, pr), ("originals", Xo, yo, po)):
                    train = np.isin(pp, a)
                    if not test.any() or len(np.unique(y[train])) < 2:
                        skipped += 1
                        continue
                    pred, ok = _fit_predict(X[train], y[train], Xo[test], _components(n_components), seed)
                    converged &= ok
                    hit = int(np.count_nonzero(pred == yo[test]))
                    hits[source][0] += hit
                    hits[source][1] += int(test.sum())
                    accs[source].append(hit / int(test.sum()))
    note = f"{repeats} random halvings of {len(people)} people (seeds {seed}..{seed + repeats - 1}), both directions"
    if skipped:
        note += f"; {skipped} training part(s) skipped (single class or empty test)"
    if not converged:
        note += "; LinearSVC did not fully converge in some split"
    out = []
    for source in ("release", "originals"):
        c, t = hits[source]
        out.append(UtilityResult(c / t if t else None, len(accs[source]), len(people),
                                 f"trained on the {source} of half the people, tested on the other half's originals; {note}",
                                 tuple(accs[source])))
    return out[0], out[1]


def utility_protocols(
    *,
    labels: Sequence[str],
    originals: Any,
    original_labels: dict[str, Sequence[Hashable]],
    original_people: Sequence[Hashable],
    released: Any,
    released_labels: dict[str, Sequence[Hashable]],
    released_people: Sequence[Hashable],
    released_groups: Sequence[Hashable] | None = None,
    protocols: Sequence[str] = tuple(PROTOCOLS),
    folds: int = 5,
    repeats: int = 10,
    n_components: int | None = 50,
    seed: int = 0,
) -> list[dict]:
    """All utility protocols for every label: one row per (label, protocol).

    ``originals`` are the original faces of the released records (row ``i`` of the
    originals and of the release need not correspond). ``released_groups`` are the k-Same
    cluster labels (identical copies); for methods without clusters (blur, pixelation)
    pass None and the release is grouped by person.

    Returns
    -------
    list of dict
        ``{"label", "protocol", "original_accuracy", "deidentified_accuracy", "detail"}``
        (the report's utility row without ``tolerance``, which the gate adds).
        ``original_accuracy`` is the reference measured the same way on the originals:
        protocol 1 and 2 use grouped CV on the originals, protocol 3 trains on the
        originals of the same halves of people.
    """
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad or not protocols:
        raise ConfigError(f"protocols={list(protocols)!r} must be a non-empty subset of {list(PROTOCOLS)}")
    groups = list(released_people) if released_groups is None else list(released_groups)
    rows = []
    for label in labels:
        for name, source in (("original_labels", original_labels), ("released_labels", released_labels)):
            if label not in source:
                raise ConfigError(f"{name} has no entry for label {label!r}; it has {sorted(source)}")
        cv_orig = grouped_cv_accuracy(originals, original_labels[label], groups=original_people, folds=folds,
                                      n_components=n_components, seed=seed, repeats=repeats)
        for protocol in protocols:
            if protocol == "cv":
                rel = grouped_cv_accuracy(released, released_labels[label], groups=groups, folds=folds,
                                          n_components=n_components, seed=seed, repeats=repeats)
                ref = cv_orig
            elif protocol == "train-original-test-release":
                rel = train_original_test_release(originals, original_labels[label], released, released_labels[label],
                                                  n_components=n_components, seed=seed)
                ref = cv_orig
            else:
                rel, ref = train_release_test_heldout(released, released_labels[label], released_people, originals,
                                                      original_labels[label], original_people,
                                                      repeats=max(1, repeats // 2), n_components=n_components,
                                                      seed=seed)
            rows.append({"label": str(label), "protocol": protocol, "original_accuracy": ref.accuracy,
                         "deidentified_accuracy": rel.accuracy,
                         "detail": f"{PROTOCOLS[protocol]}. originals: {ref.detail}; release: {rel.detail}"})
    return rows


# --------------------------------------------------------------------------- cross-fitted utility (the gate's check)

STATUSES: tuple[str, ...] = ("pass", "fail", "inconclusive", "not_applicable")
"""Status of a utility check: decided from bounds, ``inconclusive`` when the data cannot decide."""


@dataclass(frozen=True)
class UtilityEvidence:
    """Cross-fitted utility of one label: paired accuracies on held-out people, with bounds.

    ``delta`` = accuracy(trained on originals) - accuracy(trained on the de-identified
    release), both tested on the same held-out people's original images; ``delta_lower`` /
    ``delta_upper`` are one-sided ``confidence`` bounds from a bootstrap over held-out
    people. ``status`` is ``pass`` when ``delta_upper <= tolerance``, ``fail`` when
    ``delta_lower > tolerance``, ``inconclusive`` otherwise (``testable_margin`` is the
    smallest margin these test images could have shown: the half-width of the interval).
    ``majority_status`` tests accuracy(release) - ``majority_rate`` > 0 the same way
    (``gain_lower`` / ``gain_upper`` are its bounds). The ``actual_*`` fields are set when the
    actual release was passed: the same held-out test with the classifier trained on the
    released records of the training people (catches a release whose labels or rows do
    not match its faces, which re-running the method cannot see). :attr:`decision`
    combines them. Accuracies are None, and bounds None, when nothing could be tested.

    Other fields: ``n_test_images`` / ``n_test_people`` are the distinct held-out images and
    people behind the bounds; ``folds_used`` counts evaluated folds over all repeats;
    ``suppressed_training_records`` counts training records withheld from the method
    (partitions below k), summed over folds and repeats; ``trimmed_training_records`` those
    withheld as the flow withholds them (one person's images above 1/k of a partition);
    ``folds_run`` counts the folds de-identified, ``folds_skipped`` those that gave this label no
    evidence (a defect, never silent) with each reason in ``skipped_folds``; ``sample`` says which
    images were used (all, or a seeded sample of people) and ``seed`` the seed of everything random.
    ``actual_majority_status`` (with ``actual_gain_lower`` / ``actual_gain_upper``) is the majority
    test of the actual release's rows; :attr:`label_lost` is either majority test failing
    (``majority_status`` also fails when the release's classifier names one value for every held-out face).
    """

    label: str
    status: str
    delta: float | None
    delta_lower: float | None
    delta_upper: float | None
    tolerance: float
    accuracy_original: float | None
    accuracy_release: float | None
    majority_rate: float | None
    majority_status: str
    gain_lower: float | None
    gain_upper: float | None
    n_test_images: int
    n_test_people: int
    n_boot: int
    confidence: float
    testable_margin: float | None
    folds_used: int
    suppressed_training_records: int
    sample: str
    seed: int
    detail: str
    folds_run: int = 0
    folds_skipped: int = 0
    skipped_folds: tuple[str, ...] = ()
    trimmed_training_records: int = 0
    actual_status: str | None = None
    actual_accuracy: float | None = None
    actual_delta: float | None = None
    actual_delta_lower: float | None = None
    actual_delta_upper: float | None = None
    actual_majority_status: str | None = None
    actual_gain_lower: float | None = None
    actual_gain_upper: float | None = None

    @property
    def label_lost(self) -> bool:
        """The released faces cannot beat the majority-class rate: point estimate and upper bound at or below it.

        Either release (the method re-run on the training people, or the actual release's rows)
        failing that test loses the label: a consumer learns nothing a constant guess would not
        give. Not noise (the bound excludes any gain), so no policy turns it into ``inconclusive``.
        """
        return "fail" in (self.majority_status, self.actual_majority_status)

    @property
    def decision(self) -> str:
        """Overall status: ``fail`` if any part fails; ``pass`` only if every applicable part passes."""
        if self.status == "not_applicable":
            return "not_applicable"
        parts = [self.status, self.majority_status] + [p for p in (self.actual_status, self.actual_majority_status) if p]
        if "fail" in parts:
            return "fail"
        if all(p in ("pass", "not_applicable") for p in parts):
            return "pass"
        return "inconclusive"

    def to_dict(self) -> dict:
        """JSON-ready fields (floats rounded to 6 places) plus ``decision``."""
        out = {k: (round(v, 6) if isinstance(v, float) else list(v) if isinstance(v, tuple) else v)
               for k, v in asdict(self).items()}
        out["decision"] = self.decision
        out["label_lost"] = self.label_lost
        return out


def paired_bootstrap(people: Sequence[Hashable], a: Any, b: Any, *, n_boot: int = 2000, confidence: float = 0.95,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a - b`` over items, with one-sided bounds from a bootstrap over people.

    The items (held-out images) of one person are resampled together, because a person's
    images are not independent; ``a`` and ``b`` (e.g. 0/1 correct) stay paired. Each
    replicate draws the people with replacement and takes the ratio of summed differences
    to summed image counts; the bounds are the ``1 - confidence`` and ``confidence``
    percentiles of the replicates (two one-sided bounds, i.e. a ``2 * confidence - 1``
    two-sided interval).

    A bootstrap cannot see an effect rarer than its sample: when the two scores never
    disagree its interval collapses to a point, however few people were tested. Each bound
    is therefore at least ``1 - (1 - confidence) ** (1 / n_people)`` from the estimate: the
    one-sided Clopper-Pearson bound on the share of people affected when none of
    ``n_people`` was seen affected (about 3 / n_people, the "rule of three").

    Parameters
    ----------
    people : sequence of hashable
        Person of each item.
    a, b : array-like of float in [0, 1]
        Paired scores of each item (e.g. 1 when a classifier is right).
    n_boot, confidence, seed
        Replicates, one-sided level, seed.

    Returns
    -------
    (estimate, lower, upper) : tuple of float
        Bounds clipped to [-1, 1].

    References
    ----------
    B. Efron, R. Tibshirani. An Introduction to the Bootstrap. Chapman & Hall, 1993
    (percentile interval); A. C. Davison, D. V. Hinkley. Bootstrap Methods and their
    Application. CUP, 1997, section 3.8 (resampling clusters).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ConfigError(f"a and b have shapes {a.shape} and {b.shape}; pass two non-empty 1-D arrays of equal length")
    if not (np.all((a >= 0) & (a <= 1)) and np.all((b >= 0) & (b <= 1))):
        raise ConfigError("a and b must be scores in [0, 1] (e.g. 1 = correct prediction, 0 = wrong)")
    codes = _codes(people, "people", len(a))
    _check_int("n_boot", n_boot, 1, "; pass e.g. n_boot=2000")
    _check_confidence(confidence)
    n_people = int(codes.max()) + 1
    count = np.bincount(codes, minlength=n_people).astype(np.float64)
    diff = np.bincount(codes, weights=a - b, minlength=n_people)
    estimate = float(diff.sum() / count.sum())
    rng = np.random.default_rng(seed)
    stats = np.empty(int(n_boot))
    step = max(1, 2_000_000 // n_people)  # bounded memory: at most ~2M draws per block
    for start in range(0, int(n_boot), step):
        m = min(step, int(n_boot) - start)
        w = rng.multinomial(n_people, np.full(n_people, 1.0 / n_people), size=m).astype(np.float64)
        stats[start:start + m] = (w @ diff) / (w @ count)
    q = 1.0 - float(confidence)
    lower, upper = np.quantile(stats, [q, 1.0 - q])
    floor = 1.0 - q ** (1.0 / n_people)
    # Scores in [0, 1]: a difference of means lies in [-1, 1].
    return estimate, float(max(-1.0, min(lower, estimate - floor))), float(min(1.0, max(upper, estimate + floor)))


def _check_confidence(confidence: Any) -> None:
    if isinstance(confidence, bool) or not isinstance(confidence, Real) or not 0.5 < confidence < 1:
        raise ConfigError(f"confidence={confidence!r} must be a number in (0.5, 1) (one-sided level); pass e.g. 0.95")


def _decide(lower: float, upper: float, margin: float) -> str:
    """pass if the whole upper bound is within ``margin``, fail if the lower bound exceeds it."""
    if upper <= margin + 1e-12:
        return "pass"
    if lower > margin + 1e-12:
        return "fail"
    return "inconclusive"


def _majority(gain_lower: float, gain_upper: float) -> str:
    """The release must beat the majority-class rate: ``pass`` if the gain's lower bound is above 0.

    ``fail`` (the label is lost, :attr:`UtilityEvidence.label_lost`) when the upper bound, and so
    the point estimate, is at or below 0: released accuracy at or below the majority rate with
    the stated confidence. Otherwise ``inconclusive``: only the noise of too few held-out people.
    """
    if gain_lower > 1e-12:
        return "pass"
    if gain_upper <= 1e-12:
        return "fail"
    return "inconclusive"


def _sample_people(pc: np.ndarray, max_images: int, seed: int) -> tuple[np.ndarray, str]:
    """Rows of a seeded uniform sample of people holding at most ``max_images`` images."""
    n = len(pc)
    n_people = int(pc.max()) + 1
    if n <= max_images:
        return np.arange(n), f"all {n} images of {n_people} people"
    counts = np.bincount(pc, minlength=n_people)
    order = np.random.default_rng(seed).permutation(n_people)
    # People whose images would overflow the budget are passed over, not cut: every sampled
    # person keeps all their images so the folds stay grouped by person.
    chosen = order[np.cumsum(counts[order]) <= max_images]
    if len(chosen) < 2:
        chosen = order[:2]
    rows = np.flatnonzero(np.isin(pc, chosen))
    return rows, (f"seeded sample (seed {seed}) of {len(chosen)} of {n_people} people, {len(rows)} of {n} images "
                  f"(max_images={max_images})")


def _released_part(out: Any, n: int) -> np.ndarray:
    """The released images from a de-identification callable's return value."""
    rel = out[0] if isinstance(out, tuple) else out
    rel = np.asarray(rel)
    if rel.ndim != 2 or rel.shape[0] != n:
        raise ConfigError(f"deidentify returned images of shape {rel.shape} for {n} training faces; it must return "
                          "(released, ...) or released with one row per input face, in input order")
    return rel


def _small_cells(parts: list, people: np.ndarray, k: int) -> np.ndarray:
    """Mask of rows whose partition holds fewer than ``k`` distinct people (the flow's 'suppress')."""
    members: dict[Hashable, set] = {}
    for p, who in zip(parts, people.tolist()):
        members.setdefault(p, set()).add(who)
    small = {p for p, m in members.items() if len(m) < k}
    return np.array([p in small for p in parts], dtype=bool)


def _trim_rows(rows: np.ndarray, people: np.ndarray, k: int) -> np.ndarray:
    """The rows among ``rows`` (one partition) the flow withholds so no person holds more than 1/k of it."""
    _, trimmed = _trim_dominant(rows.tolist(), people.tolist(), k)
    return np.asarray(trimmed, dtype=np.intp)


@dataclass(frozen=True)
class FoldRun:
    """One training fold de-identified (:func:`_deidentify_fold`).

    ``released``: the released rows of the kept training rows (None: nothing could be released,
    the fold is skipped: ``note`` says why); ``keep``: mask of the kept rows; ``trimmed``: rows
    withheld as the flow withholds them (a person's images above 1/k of a partition:
    :func:`deid.anonymise.partition.plan_partitions`), not a loss of the fold's making.
    """

    released: np.ndarray | None
    keep: np.ndarray
    note: str
    trimmed: int = 0


def _deidentify_fold(deidentify: Callable[..., Any], X: np.ndarray, people: np.ndarray, parts: list | None,
                     k: int | None, labels: Mapping[str, Sequence[Hashable]] | None = None,
                     points: Sequence[Any] | None = None) -> FoldRun:
    """De-identify one training fold as the flow would: small partitions suppressed, dominant people trimmed.

    ``labels`` holds the fold's own label values (row i of ``X``); the method receives the
    values of the rows it de-identifies, so label-aware methods never guess them; the same for
    ``points`` (landmarks, k-same-m), passed only when given.

    A partition (of ``parts``, or all rows without) where one person holds more than 1/k of the
    images keeps at most the share the flow keeps of that person (the rest is trimmed, as the
    release's partition plan trims it); a training side of 4/5 of the people can make a person
    dominant who was not in the whole drop. Before this, the method's ``DominantPersonError``
    withheld the whole partition (and with it every training record of a skewed drop).
    """
    keep = np.ones(len(X), dtype=bool)
    key = list(parts) if parts is not None else ["all"] * len(X)
    trimmed = 0

    def trim(partition: Hashable, kk: int) -> int:
        rows = np.flatnonzero(keep & np.array([p == partition for p in key], dtype=bool))
        cut = _trim_rows(rows, people, kk)
        keep[cut] = False
        return len(cut)

    if parts is not None and k is not None:
        keep &= ~_small_cells(parts, people, k)
    if k is not None:
        for partition in dict.fromkeys(key):
            trimmed += trim(partition, k)
    while keep.any():
        idx = np.flatnonzero(keep)
        try:
            out = deidentify(X[idx], people=people[idx].tolist(),
                             partitions=None if parts is None else [parts[i] for i in idx],
                             labels=None if not labels else {name: [v[i] for i in idx] for name, v in labels.items()},
                             **({} if points is None else {"points": [points[i] for i in idx]}))
        except InsufficientPeopleError as exc:
            partition = exc.partition if parts is not None else "all"
            if isinstance(exc, DominantPersonError) and partition is not None:
                cut = trim(partition, int(exc.k))
                if cut:
                    trimmed += cut
                    continue
            hit = (np.array([p == partition for p in key], dtype=bool)
                   if partition is not None and (parts is not None or isinstance(exc, DominantPersonError))
                   else np.zeros(len(X), dtype=bool))
            if not (hit & keep).any():
                return FoldRun(None, keep, f"training part could not be de-identified ({exc})", trimmed)
            keep &= ~hit
            continue
        return FoldRun(_released_part(out, len(idx)), keep, "", trimmed)
    return FoldRun(None, keep, "every training record was suppressed (partitions with fewer than k people)", trimmed)


MAX_FOLDS = 10
"""Most folds :func:`partition_safe_splits` raises the asked number to (each fold re-runs the method)."""


def partition_safe_splits(y_codes: np.ndarray, people: np.ndarray, partitions: Sequence[Hashable] | None,
                          *, k: int | None, folds: int, seed: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    """Grouped folds over people in which no training side loses a partition the whole sample can fill.

    A partition (k-Same-Select's label cell) with ``P >= k`` people in the sample must keep ``>= k``
    people on every fold's training side, or the fold's de-identification suppresses it although
    the release kept it, and the fold measures another release. So each test fold may hold at
    most ``P - k`` of its people. The stratified folds of :func:`grouped_splits` are used when they
    already respect that (the usual case: the same folds as before). Otherwise people are dealt
    into folds, tightest partitions first (least spare ``(P - k) / P``), then most images, each to
    the fold with the fewest people of its label (stratified by label), then the fewest images,
    within the caps; the number of folds is raised (at most to :data:`MAX_FOLDS`) until every
    partition's people fit. Where that is impossible (a partition of exactly k people, or more
    people than the raised folds' caps hold) the person is dealt without the cap and the fold
    testing them suppresses the partition, counted (keeping them untested would hide their label
    value from the test). ``detail`` says which happened. Without ``k`` or ``partitions`` these are :func:`grouped_splits`' folds.

    Returns
    -------
    splits : list of (train_indices, test_indices)
    detail : str
    """
    n_people = int(people.max()) + 1
    base = min(int(folds), n_people)
    splits, how = grouped_splits(y_codes, groups=people, folds=base, seed=seed)
    if k is None or partitions is None:
        return splits, how
    part = _codes([p.item() if isinstance(p, np.generic) else p for p in partitions], "partitions", len(people))
    n_parts = int(part.max()) + 1
    member = np.zeros((n_parts, n_people), dtype=bool)
    member[part, people] = True
    size = member.sum(axis=1)
    fillable = size >= k
    if not fillable.any():
        return splits, how
    cap = np.where(fillable, size - k, n_people)

    def safe(test_people: np.ndarray) -> bool:
        return bool(np.all(member[:, test_people].sum(axis=1) <= cap))

    if all(safe(np.unique(people[te])) for _, te in splits):
        return splits, how  # already safe: the folds (and figures) of before
    need = max([int(np.ceil(s / c)) for s, c, f in zip(size, cap, fillable) if f and c > 0] or [base])
    n_folds = int(max(base, min(need, max(base, min(MAX_FOLDS, n_people)))))
    images = np.bincount(people, minlength=n_people)
    label = np.empty(n_people, dtype=np.intp)  # each person's most frequent label value (their stratum)
    n_labels = int(y_codes.max()) + 1
    counts = np.zeros((n_people, n_labels), dtype=np.int64)
    np.add.at(counts, (people, y_codes), 1)
    label[:] = counts.argmax(axis=1)
    slack = np.ones(n_people)
    for p in np.flatnonzero(fillable):
        slack[member[p]] = np.minimum(slack[member[p]], cap[p] / size[p])
    rng = np.random.default_rng(seed)
    order = rng.permutation(n_people)
    order = order[np.lexsort((-images[order], slack[order]))]
    fold_rank = rng.permutation(n_folds)  # seeded tie order among folds
    in_fold = np.zeros((n_parts, n_folds), dtype=np.int64)
    by_label = np.zeros((n_labels, n_folds), dtype=np.int64)
    load = np.zeros(n_folds, dtype=np.int64)
    fold_of = np.full(n_people, -1, dtype=np.int64)
    held = 0
    for who in order:
        mine = np.flatnonzero(member[:, who] & fillable)
        ok = np.all(in_fold[mine] < cap[mine, None], axis=0) if len(mine) else np.ones(n_folds, dtype=bool)
        over = not ok.any()
        # No fold can test this person without a training side losing a partition (e.g. one of exactly k
        # people): dealt as the stratification wants; that fold suppresses the partition, as it must.
        cand = np.arange(n_folds) if over else np.flatnonzero(ok)
        held += int(over)
        f = cand[np.lexsort((fold_rank[cand], load[cand], by_label[label[who], cand]))[0]]
        fold_of[who] = f
        in_fold[member[:, who], f] += 1
        by_label[label[who], f] += 1
        load[f] += images[who]
    img_fold = fold_of[people]
    index = np.arange(len(people))
    out = [(index[img_fold != f], index[img_fold == f]) for f in range(n_folds) if np.any(img_fold == f)]
    detail = (f"partition-safe folds (seed {seed}): people dealt into {len(out)} folds, stratified by label, so every "
              f"partition with >= {k} people keeps >= {k} on each training side (the stratified folds "
              f"[{how}] would have left one with fewer)")
    if n_folds > base:
        detail += f"; folds raised from {base} to {n_folds} so each partition's people fit its spare places"
    if held:
        detail += (f"; {held} people of partitions with no spare people (fewer than k + 1, or more than the "
                   f"folds' caps hold) tested anyway: the folds testing them suppress their partition (counted)")
    return out, detail


AUTO_REPEAT_IMAGES = 600
""":func:`cross_fit_utility` repeats the cross-fit 3 times up to this many images, once above."""


def cross_fit_utility(
    images: Any,
    *,
    people: Sequence[Hashable],
    labels: Mapping[str, Sequence[Hashable]],
    deidentify: Callable[..., Any],
    partitions: Sequence[Hashable] | None = None,
    points: Sequence[Any] | None = None,
    k: int | None = None,
    released: Any = None,
    tolerance: float = 0.05,
    folds: int = 5,
    repeats: int | None = None,
    n_boot: int = 2000,
    confidence: float = 0.95,
    max_images: int = 1000,
    n_components: int | None = 50,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[UtilityEvidence]:
    """Utility of a de-identification method by mechanism-level cross-fitting over people.

    People are split into ``folds`` grouped folds (stratified by the joint label values
    where possible, seeded). For each fold, only the *training* people's faces are
    de-identified with ``deidentify`` (the same method and k as the release); a linear SVM
    (:func:`_svm`) is trained on that release and, separately, on the same people's
    originals, and both are tested on the held-out people's *original* faces. Every
    held-out image thus gets two paired predictions; Δ = accuracy(originals) -
    accuracy(release) is bounded by :func:`paired_bootstrap` over held-out people and
    decided against ``tolerance`` (see :class:`UtilityEvidence`). The release-trained
    classifier must also beat the majority class of the training labels.

    Parameters
    ----------
    images : array-like of shape (n, n_pixels)
        Aligned original faces.
    people : sequence of hashable, length n
        Person id of each face; folds and the bootstrap are over people.
    labels : mapping of str to sequence, each length n
        Utility label values per face, e.g. ``{"gender": [...], "expression": [...]}``.
    deidentify : callable
        ``deidentify(images, people=list, partitions=list | None, labels=dict | None) -> released`` or
        ``(released, clusters)``, e.g. ``functools.partial(deid.anonymise.methods.deidentify,
        shape=(h, w), method=m, k=k, sigma=s, block=b, n_components=c, seed=seed)``.
        It may raise :class:`deid.anonymise.ksame.InsufficientPeopleError`; that partition's training
        records are then suppressed (the flow's ``suppress`` policy) and counted.
    partitions : sequence of hashable, length n, optional
        Partition key of each face for k-Same-Select (the tuple of all utility label
        values); None for methods that do not partition.
    points : sequence, length n, optional
        Landmark points of each face as the release's method got them (k-same-m); the folds'
        rows go to ``deidentify(..., points=...)``. None: the keyword is not passed.
    k : int, optional
        The method's k. With ``partitions``, training partitions with fewer than k people
        are suppressed up front instead of one error at a time.
    released : array-like of shape (n, n_pixels), optional
        The actual release, row i being face i's released image. Adds the ``actual_*``
        evidence: trained on the released rows of the training people.
    tolerance : float, default 0.05
        Largest acceptable accuracy loss Δ.
    folds : int, default 5
        Grouped folds over people (reduced to the number of people).
    repeats : int or None, default None
        How many times the cross-fit is repeated with new folds (seed, seed + 1, ...);
        predictions are pooled (each held-out image then counts ``repeats`` times, still
        bootstrapped by person). One cross-fit's Δ moves with the fold assignment (London
        k=5, gender: -0.049 to +0.010 over seeds 0-4); three repeats averaged it to -0.021 to
        +0.003 and made the decision the same for every seed, at 0.8 s CPU per repeat on
        London. None: 3 when the (sampled) data hold at most :data:`AUTO_REPEAT_IMAGES`
        images, else 1 (with more people the fold assignment matters less and a repeat
        costs more).
    n_boot, confidence : int, float
        Bootstrap replicates and one-sided level of the bounds.
    max_images : int, default 1000
        At most this many images (a seeded uniform sample of whole people) are used, so the
        check stays cheap at any drop size; the sample is stated in ``sample``. 1,000 images
        of 500 people resolve a margin of about 0.02 (London's 204 images of 102 people:
        0.03), well inside a 0.05 tolerance; each fold re-runs the method on 80% of them.
    n_components, seed : int
        PCA components of the SVM (None: no PCA, for feature vectors); seed of the sample,
        folds, SVM and bootstrap.
    progress : deid.progress.Progress, optional
        Told the number of folds (repeats x folds) and each fold done.

    Returns
    -------
    list of UtilityEvidence
        One per label, in the order of ``labels``.

    References
    ----------
    R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility into face
    de-identification. PET 2005, LNCS 3856, 227-242 (utility as label accuracy);
    V. Chernozhukov et al. Double/debiased machine learning. Econometrics J. 21, 2018
    (cross-fitting: fit on some units, evaluate on the others, rotate).
    """
    # Validate shapes on the whole input but convert only the sampled rows: a 100,000-face
    # drop as float64 would be 6 GB.
    A = np.asarray(images)
    if A.ndim != 2 or A.shape[0] == 0 or A.shape[1] == 0:
        raise ConfigError(f"images has shape {A.shape}; it must be a non-empty 2-D array (n_images, n_pixels)")
    n = len(A)
    if not callable(deidentify):
        raise ConfigError(f"deidentify={deidentify!r} must be a callable deidentify(images, people=..., partitions=..., labels=...), "
                          "e.g. functools.partial(deid.anonymise.methods.deidentify, shape=(h, w), method='k-same', k=5)")
    if isinstance(tolerance, bool) or not isinstance(tolerance, Real) or not 0 <= tolerance <= 1:
        raise ConfigError(f"tolerance={tolerance!r} must be a number in [0, 1] (accuracy loss; setting "
                          "utility_tolerance); pass e.g. 0.05")
    _check_folds(folds)
    if repeats is not None:
        _check_int("repeats", repeats, 1, "; pass e.g. 3, or None for automatic")
    _check_int("n_boot", n_boot, 100, "; pass e.g. n_boot=2000")
    _check_confidence(confidence)
    _check_int("max_images", max_images, 2, "; pass e.g. 1000")
    _check_components(n_components)
    if k is not None:
        _check_int("k", k, 2, "; pass the method's k, e.g. 5")
    pc_all = _codes(people, "people", n)
    label_codes = {}
    for name, values in labels.items():
        label_codes[str(name)] = _codes(values, f"labels[{name!r}]", n)
    parts_all = None
    if partitions is not None:
        parts_all = [p.item() if isinstance(p, np.generic) else p for p in partitions]
        if len(parts_all) != n:
            raise ConfigError(f"partitions has {len(parts_all)} entries but images has {n} rows; pass one key per face")
    R = None
    if released is not None:
        R = np.asarray(released)
        if R.shape != A.shape:
            raise ConfigError(f"released has shape {R.shape} but images {A.shape}; row i must be face i's released image")
    rows, sample = _sample_people(pc_all, int(max_images), seed)
    X = _matrix(A[rows], "images")
    R = None if R is None else _matrix(R[rows], "released")
    pc = _codes(pc_all[rows], "people", len(rows))
    parts = None if parts_all is None else [parts_all[i] for i in rows]
    if points is not None and len(points) != n:
        raise ConfigError(f"points has {len(points)} entries but images has {n} rows; pass one entry per face")
    pts = None if points is None else [points[i] for i in rows]
    ys = {name: c[rows] for name, c in label_codes.items()}
    raw = {str(name): [values[i] for i in rows] for name, values in labels.items()}
    n_people = int(pc.max()) + 1
    if repeats is None:
        repeats = 3 if len(rows) <= AUTO_REPEAT_IMAGES else 1

    def evidence(label: str, status: str, detail: str, **kw) -> UtilityEvidence:
        base = dict(label=label, status=status, delta=None, delta_lower=None, delta_upper=None, tolerance=float(tolerance),
                    accuracy_original=None, accuracy_release=None, majority_rate=None,
                    majority_status=status if status == "not_applicable" else "inconclusive", gain_lower=None,
                    gain_upper=None, n_test_images=0, n_test_people=0, n_boot=int(n_boot), confidence=float(confidence),
                    testable_margin=None, folds_used=0, suppressed_training_records=0, sample=sample, seed=int(seed),
                    detail=detail)
        base.update(kw)
        return UtilityEvidence(**base)

    results: dict[str, UtilityEvidence] = {}
    applicable = []
    for name, y in ys.items():
        classes_ok = sum(len(np.unique(pc[y == c])) >= 2 for c in np.unique(y))
        if len(np.unique(y)) < 2:
            results[name] = evidence(name, "not_applicable", f"{name} has a single value; nothing to predict")
        elif classes_ok < 2:
            results[name] = evidence(name, "not_applicable", f"fewer than 2 values of {name} are held by 2 or more "
                                     "people; the originals cannot be tested on unseen people")
        else:
            applicable.append(name)
    if applicable and n_people < 2:
        for name in applicable:
            results[name] = evidence(name, "inconclusive", "fewer than 2 people; no held-out people to test on")
        applicable = []
    if not applicable:
        return [results[name] for name in ys]

    joint = _codes([tuple(int(ys[a][i]) for a in ys) for i in range(len(pc))], "labels", len(pc))
    # The originals' side of a fold (their classifier's predictions) depends only on the sample, the
    # labels and the fold: the same for every method and strength of a study (deid.memo).
    originals_key = None if key_for_size(X) is None else digest(
        "cross_fit_originals", X, {name: y for name, y in ys.items()}, list(applicable), _components(n_components),
        int(seed))
    preds = {name: {"row": [], "who": [], "o": [], "r": [], "m": [], "a": []} for name in applicable}
    folds_used = dict.fromkeys(applicable, 0)
    folds_run = 0
    suppressed = trimmed = 0
    skipped: dict[str, list[str]] = {name: [] for name in applicable}
    notes: list[str] = []
    how = ""
    fold_parts = parts if parts is not None else (["all"] * len(pc) if k is not None else None)
    split_sets = [partition_safe_splits(joint, pc, fold_parts, k=k, folds=int(folds), seed=seed + r)
                  for r in range(int(repeats))]
    if progress is not None:
        progress.start(sum(len(sp) for sp, _ in split_sets))
    with one_blas_thread():
        for r, (splits, how_r) in enumerate(split_sets):
            how = how or how_r
            for f, (tr, te) in enumerate(track(splits, progress)):
                folds_run += 1
                run = _deidentify_fold(deidentify, X[tr], pc[tr], None if parts is None else [parts[i] for i in tr],
                                       k, {name: [v[i] for i in tr] for name, v in raw.items()},
                                       None if pts is None else [pts[i] for i in tr])
                rel, keep = run.released, run.keep
                trimmed += run.trimmed if rel is not None else 0
                suppressed += int(np.count_nonzero(~keep)) - run.trimmed if rel is not None else 0
                if rel is None:
                    for name in applicable:
                        skipped[name].append(f"repeat {r} fold {f}: {run.note}")
                    continue
                kept = tr[keep]
                fold_key = None if originals_key is None else digest(originals_key, tr, te)
                p_orig = _ORIGINAL_FOLDS.get_or_compute(fold_key, lambda: _originals_fold(X, ys, applicable, tr, te,
                                                                                          _components(n_components), seed))
                Zr = _embed(rel.astype(np.float64), X[te], _components(n_components), seed)
                Za = None if R is None else _embed(R[tr], X[te], _components(n_components), seed)
                for name in applicable:
                    y = ys[name]
                    if len(np.unique(y[tr])) < 2:
                        skipped[name].append(f"repeat {r} fold {f}: training people hold a single value of {name}")
                        continue
                    p_o = p_orig[name]
                    if len(np.unique(y[kept])) < 2:  # the release teaches a single value: predict it
                        # Suppression (partitions below k on this fold's training side) left one value: a
                        # defect of the measurement on small data, not evidence that the release lost the label.
                        p_r = np.full(len(te), y[kept][0])
                        preds[name]["single_taught"] = preds[name].get("single_taught", 0) + 1
                    else:
                        p_r, _ = _svc_predict(Zr[0], y[kept], Zr[1], seed)
                        preds[name].setdefault("values", set()).update(np.unique(p_r).tolist())
                    majority = int(np.argmax(np.bincount(y[tr])))
                    d = preds[name]
                    d["row"].append(te)
                    d["who"].append(pc[te])
                    d["o"].append(p_o == y[te])
                    d["r"].append(p_r == y[te])
                    d["m"].append(y[te] == majority)
                    if R is not None:
                        p_a, _ = _svc_predict(Za[0], y[tr], Za[1], seed)
                        d["a"].append(p_a == y[te])
                        d.setdefault("a_values", set()).update(np.unique(p_a).tolist())
                    folds_used[name] += 1

    if progress is not None:
        progress.finish()  # a repeat may yield fewer folds than asked
    base_note = f"{how}; {repeats} repeat(s)" + (f"; {suppressed} training record(s) suppressed over all folds "
                                                 "(partitions with fewer than k people)" if suppressed else "") + (
        f"; {trimmed} training record(s) trimmed over all folds as the flow trims them (one person's images "
        "above 1/k of a partition)" if trimmed else "")

    def skip_note(name: str) -> list[str]:
        # A skipped fold is a defect of the protocol, never silent: counted, each with its reason.
        if not skipped[name]:
            return []
        return [f"{len(skipped[name])} of {folds_run} fold(s) skipped (a defect: the evidence rests on fewer folds): "
                + "; ".join(skipped[name])]

    fold_fields = lambda name: dict(folds_skipped=len(skipped[name]), skipped_folds=tuple(skipped[name]),  # noqa: E731
                                    folds_run=folds_run, trimmed_training_records=trimmed)
    for name in applicable:
        d = preds[name]
        if not d["who"]:
            results[name] = evidence(name, "inconclusive", "; ".join([base_note, *notes, *skip_note(name),
                                                                       "no fold could be evaluated"]),
                                     suppressed_training_records=suppressed, **fold_fields(name))
            continue
        who, o, rr, m = (np.concatenate(d[key]) for key in ("who", "o", "r", "m"))
        delta, lo, up = paired_bootstrap(who, o, rr, n_boot=n_boot, confidence=confidence, seed=seed)
        gain, g_lo, g_up = paired_bootstrap(who, rr, m, n_boot=n_boot, confidence=confidence, seed=seed)
        status = _decide(lo, up, float(tolerance))
        majority_status = _majority(g_lo, g_up)
        # A release whose classifier names one value for every held-out face (e.g. every partition averaged
        # into one image) carries no label at all: lost, by construction rather than by a bound.
        # Only a classifier that was taught both values and still names one counts (a fold whose training
        # side was suppressed down to one value proves nothing: see single_taught, reported in the detail).
        constant = 0 < len(d.get("values", ())) < 2
        if constant:
            majority_status = "fail"
        single = ([f"{d['single_taught']} fold(s) taught {name} a single value (the rest suppressed as partitions "
                   "below k): their predictions are constant by construction, not evidence"]
                  if d.get("single_taught") else [])
        margin = (up - lo) / 2
        n_img, n_ppl = len(np.unique(np.concatenate(d["row"]))), len(np.unique(who))
        msg = [f"originals {o.mean():.3f} vs release {rr.mean():.3f} on held-out originals: "
               f"delta {delta:+.3f}, {confidence:.0%} bounds [{lo:+.3f}, {up:+.3f}] vs tolerance {tolerance}"]
        if status == "inconclusive":
            msg.append(f"{n_img} test images of {n_ppl} people can only test a margin of {margin:.3f}")
        msg.append(f"release vs majority rate {m.mean():.3f}: gain {gain:+.3f} [{g_lo:+.3f}, {g_up:+.3f}] "
                   f"({majority_status}" + ("; the release's classifier names one value for every held-out face"
                                            if constant else "") + ")")
        extra = {}
        if d["a"]:
            a = np.concatenate(d["a"])
            a_d, a_lo, a_up = paired_bootstrap(who, o, a, n_boot=n_boot, confidence=confidence, seed=seed)
            a_gain, ag_lo, ag_up = paired_bootstrap(who, a, m, n_boot=n_boot, confidence=confidence, seed=seed)
            extra = dict(actual_status=_decide(a_lo, a_up, float(tolerance)), actual_accuracy=float(a.mean()),
                         actual_delta=a_d, actual_delta_lower=a_lo, actual_delta_upper=a_up,
                         actual_majority_status="fail" if len(d.get("a_values", ())) < 2 else _majority(ag_lo, ag_up),
                         actual_gain_lower=ag_lo,
                         actual_gain_upper=ag_up)
            msg.append(f"actual release (rows of the training people) {a.mean():.3f}: delta {a_d:+.3f} "
                       f"[{a_lo:+.3f}, {a_up:+.3f}] ({extra['actual_status']}); vs majority rate: gain "
                       f"{a_gain:+.3f} [{ag_lo:+.3f}, {ag_up:+.3f}] ({extra['actual_majority_status']})")
        results[name] = evidence(
            name, status, "; ".join(msg + single + [base_note, *notes, *skip_note(name)]), delta=delta, delta_lower=lo,
            delta_upper=up,
            accuracy_original=float(o.mean()), accuracy_release=float(rr.mean()), majority_rate=float(m.mean()),
            majority_status=majority_status, gain_lower=g_lo, gain_upper=g_up, n_test_images=n_img,
            n_test_people=n_ppl, testable_margin=margin, folds_used=folds_used[name],
            suppressed_training_records=suppressed, **fold_fields(name), **extra)
        logger.info("utility %s: %s (delta %.3f [%.3f, %.3f], %d test images of %d people)",
                    name, results[name].decision, delta, lo, up, n_img, n_ppl)
    return [results[name] for name in ys]
