"""The earlier utility protocols, kept as extra evidence for the report and the study.

Protocol 1 (:func:`grouped_cv_accuracy`): grouped cross-validated accuracy on the release (groups =
clusters, whose released images are identical copies) against the originals (groups = people), Gross,
Airoldi, Malin & Sweeney (2005). Protocol 2 (:func:`train_original_test_release`): trained on the
originals, tested on the release (Moriarty et al.). Protocol 3 (:func:`train_release_test_heldout`):
trained on the release of half the people, tested on the other half's originals. :func:`utility_protocols`
runs them for every label. The gate decides from the cross-fit (:mod:`deid.evaluation.utility`).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np
from sklearn.exceptions import ConvergenceWarning

from deid.blas import one_blas_thread
from deid.errors import ConfigError
from deid.evaluation.utility_classifier import as_components, check_components, face_matrix, fit_predict, svm_pipeline
from deid.evaluation.utility_folds import check_folds, check_int, codes_of, grouped_splits
from deid.memo import Memo, key_for, plain

logger = logging.getLogger(__name__)


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


# The comparison study measures every point against the same originals: their grouped-CV
# accuracy is computed once (deid.memo; the cross-fit's originals side: deid.evaluation.utility).
_CV = Memo("grouped_cv_accuracy", max_bytes=8_000_000)


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
        None: no PCA (feature vectors), see :func:`svm_pipeline`.
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
    X = face_matrix(images, "images", hint=": flatten with .reshape(len(images), -1)")
    key = key_for("grouped_cv_accuracy", X, [plain(v) for v in y], [plain(g) for g in groups], folds, n_components,
                  seed, repeats)
    return _CV.get_or_compute(key, lambda: _grouped_cv_accuracy(X, y, groups=groups, folds=folds,
                                                                n_components=n_components, seed=seed,
                                                                repeats=repeats))


def _grouped_cv_accuracy(X: np.ndarray, y: Sequence[Hashable], *, groups: Sequence[Hashable], folds: int,
                         n_components: int | None, seed: int, repeats: int) -> UtilityResult:
    n, p = X.shape
    check_components(n_components)
    check_folds(folds)
    y_codes = codes_of(y, "y", n)
    g_codes = codes_of(groups, "groups", n)
    n_groups = int(g_codes.max()) + 1
    n_classes = int(y_codes.max()) + 1
    if n_classes < 2:
        return UtilityResult(None, 0, n_groups, "y has a single class; accuracy is undefined (nothing to predict)")
    if n_groups < 2:
        return UtilityResult(None, 0, n_groups, "only one group; grouped cross-validation needs at least 2 groups")
    check_int("repeats", repeats, 1, " (setting cv_repeats); pass e.g. 10")
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
        return _cross_validate(X, y_codes, g_codes, splits, detail, n_groups, as_components(n_components), seed)


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
        model = svm_pipeline(n_components, len(tr), p, seed)
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


PROTOCOLS: dict[str, str] = {
    "cv": "protocol 1: grouped k-fold CV on the release (groups = clusters) vs on the originals (groups = people)",
    "train-original-test-release": "protocol 2: trained on the originals, tested on the release (Moriarty et al.)",
    "train-release-test-heldout": "protocol 3: trained on the released records of half the people, tested on the "
                                  "originals of the other half (2-fold over people, repeated)",
}
"""Utility protocol id -> description (the ``protocol`` field of a report's utility row)."""


def _check_same_width(Xo: np.ndarray, Xr: np.ndarray) -> None:
    if Xo.shape[1] != Xr.shape[1]:
        raise ConfigError(f"originals have {Xo.shape[1]} pixels but released faces {Xr.shape[1]}; use the same canonical size")


def _joint_label_codes(a: Sequence[Hashable], b: Sequence[Hashable], na: int, nb: int, name_a: str, name_b: str) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes shared by two label sequences (equal values, equal codes)."""
    a, b = list(a), list(b)
    codes_of(a, name_a, na)  # length and missing-value errors that name the right argument
    codes_of(b, name_b, nb)
    c = codes_of(a + b, f"{name_a} + {name_b}", na + nb)
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
    Xo, Xr = face_matrix(originals, "originals"), face_matrix(released, "released")
    _check_same_width(Xo, Xr)
    yo, yr = _joint_label_codes(original_y, released_y, len(Xo), len(Xr), "original_y", "released_y")
    if len(np.unique(yo)) < 2:
        return UtilityResult(None, 0, 0, "originals hold a single class; nothing to learn")
    with one_blas_thread():
        pred, converged = fit_predict(Xo, yo, Xr, as_components(n_components), seed)
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
    Xr, Xo = face_matrix(released, "released"), face_matrix(originals, "originals")
    _check_same_width(Xo, Xr)
    check_int("repeats", repeats, 1, "; pass e.g. 5")
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
                    pred, ok = fit_predict(X[train], y[train], Xo[test], as_components(n_components), seed)
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
