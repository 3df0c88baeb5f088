"""The utility classifier's front and C chosen per fold by an inner cross-validation over the training people.

The cross-fit (:mod:`deid.evaluation.utility`) trains, per fold, a linear SVM on a release of the training people and
one on their originals. Two choices of that classifier decide how much of a release's label signal it finds, and
neither is right for every release:

- **the front** (per-pixel scale, PCA, score scale; label-free): fitted on the fold's *original* training faces, or on
  the release's faces themselves. A release of few distinct averages with little per-pixel spread, fitted on itself,
  scales up the pixels where real faces vary and it does not (a synthetic video drop, 30 people x 2 recordings,
  multi-factor k=5: held-out gender 0.872 against 0.977 with the originals' front, trained on the originals 0.997);
  a label-agnostic k-Same release of few people, put in the originals' front, is measured by the spread of real
  faces in directions its few averages barely span (200-person synthetic drop, k-same k=3, 10 training people:
  held-out gender 0.801 with the originals' front, 0.884 with the release's own, 0.902 trained on the originals);
- **C**, the SVM's regularisation (a release's few distinct rows are fitted exactly at any C; a large release of
  averages can be over-fitted at C=1).

:func:`choose` picks both per fold and per label by a grouped (by person) inner cross-validation on the fold's
*training* people only: each candidate is trained on the rows of some training people and scored on the original
faces of the other training people, the outer fold's held-out people never seen. Both sides are chosen the same
way (the originals' classifier: C only, its front is the originals' own). The inner validation faces are real
faces with their labels, as the outer test is: what the choice assumes is a user who checks a classifier trained on
the release against a few labelled real faces, the test the gate itself makes; validating on the release's own
rows instead cannot see a front that fails on real faces (on the video drop it chose as often as not the
release-fitted front that scored 0.872). Candidates are tried in a fixed order and ties keep the first (the
originals' front, then C nearest 1), so the choice is deterministic from the run's seed.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Mapping

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.svm import LinearSVC

C_GRID: tuple[float, ...] = (1.0, 0.1, 10.0, 0.01)
"""The SVM's C values :func:`choose` tries, in order of preference on a tie (the default C=1 first)."""

INNER_FOLDS = 3
"""Grouped inner folds over the training people (fewer when there are fewer people)."""


@dataclass(frozen=True)
class Candidate:
    """One front's view of a fold: the training rows of the side (``train``: release or originals, embedded) and the
    fold's original training faces (``valid``), both embedded in the same fitted front."""

    train: np.ndarray
    valid: np.ndarray


@dataclass(frozen=True)
class Choice:
    """The chosen front (a key of the candidates) and C, and the inner accuracy that chose them."""

    front: str
    C: float
    score: float


def svc(C: float, seed: int) -> LinearSVC:
    """The utility check's linear SVM (:func:`deid.evaluation.utility_classifier.svm_pipeline`'s last step)."""
    return LinearSVC(C=C, max_iter=10_000, random_state=seed)


def fit_svc(Z: np.ndarray, y: np.ndarray, C: float, seed: int) -> LinearSVC:
    """:func:`svc` fitted; a convergence warning is silenced (the inner fits are many and small)."""
    model = svc(C, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(Z, y)
    return model


def inner_splits(people: np.ndarray, seed: int) -> list[np.ndarray]:
    """The training people split into :data:`INNER_FOLDS` groups (fewer with fewer people), seeded."""
    uniq = np.unique(people)
    n = min(INNER_FOLDS, len(uniq))
    order = np.random.default_rng(seed).permutation(uniq)
    return [order[i::n] for i in range(n)] if n >= 2 else []


def choose(candidates: Mapping[str, Candidate], y_train: np.ndarray, people_train: np.ndarray, y_valid: np.ndarray,
           people_valid: np.ndarray, seed: int) -> Choice:
    """The front and C whose SVM, trained on some training people's rows, best labels the other training people's
    original faces (accuracy pooled over the inner folds; the module docstring says why).

    Parameters
    ----------
    candidates : mapping of str to Candidate
        The fronts to try, in order of preference on a tie.
    y_train, people_train : ndarray, shape (n_train,)
        Label code and person code of each training row (``Candidate.train``).
    y_valid, people_valid : ndarray, shape (n_valid,)
        Label code and person code of each original training face (``Candidate.valid``).
    seed : int
        Seed of the inner split and of the SVM.

    Returns
    -------
    Choice
        The first candidate and C (in :data:`C_GRID` order) with the best inner accuracy; the first of each when no
        inner split can be made (fewer than 2 training people).
    """
    splits = inner_splits(people_valid, seed)
    first = Choice(next(iter(candidates)), C_GRID[0], float("nan"))
    if not splits:
        return first
    best = first
    for name, cand in candidates.items():
        for C in C_GRID:
            hit = total = 0
            for held in splits:
                fit_rows = ~np.isin(people_train, held)
                val_rows = np.isin(people_valid, held)
                if not fit_rows.any() or not val_rows.any():
                    continue
                ys = y_train[fit_rows]
                if len(np.unique(ys)) < 2:
                    pred = np.full(int(val_rows.sum()), ys[0])
                else:
                    pred = fit_svc(cand.train[fit_rows], ys, C, seed).predict(cand.valid[val_rows])
                hit += int(np.count_nonzero(pred == y_valid[val_rows]))
                total += int(val_rows.sum())
            score = hit / total if total else float("nan")
            if total and not score <= best.score:  # strictly better (a NaN best is beaten by any score)
                best = Choice(name, C, score)
    return best
