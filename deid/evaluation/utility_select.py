"""The release-trained utility classifier's front chosen per fold by an inner cross-validation over the training people.

The cross-fit (:mod:`deid.evaluation.utility`) trains, per fold, a linear SVM on a release of the training people and
one on their originals. The SVM's **front** (per-pixel scale, PCA, score scale; label-free) can be fitted on the
fold's *original* training faces or on the release's faces themselves, and neither is right for every release
(true held-out accuracy: train on N people, test on every other person of the drop, averaged over random draws;
``docs/methods.md`` has the commands):

- fitted on itself, a release of few distinct averages with little per-pixel spread scales up the pixels where real
  faces vary and it does not (synthetic video, 30 people x 2 recordings, multi-factor k=5, N=24, 25 draws: held-out
  gender 0.872 with the release's front, 0.977 with the originals', trained on the originals 0.997);
- put in the originals' front, a label-agnostic k-Same release of few people is measured by the spread of real faces
  in directions its few averages barely span (synthetic, 200 people, k-same k=3, N=10, 60 draws: 0.801 with the
  originals' front, 0.884 with the release's own, trained on the originals 0.902).

:func:`choose` picks the front per fold and per label by a grouped (by person) inner cross-validation on the fold's
*training* people only: each front's SVM is trained on the release's rows of some training people and scored on the
original faces of the other training people; the outer fold's held-out people are never seen. The inner validation
faces are real faces with their labels, as the outer test's are: the choice assumes a user who checks a classifier
trained on the release against a few labelled real faces. Validating on the release's own rows instead cannot tell
the fronts apart (both fit averages of averages): on the k-same draws above it kept the originals' front in most
draws, held-out 0.819, against 0.861 validating on real faces. The fronts are tried in a fixed order and a tie keeps
the first (the originals'), and the inner folds are seeded, so the choice is deterministic from the run's seed.

The SVM's C stays 1 (:data:`C_GRID`). Chosen the same way from 0.01-10, it changed little (N=10: no change, the
few distinct rows are fitted exactly at any C; N=48: 0.950 at C=1, 0.962 at C=0.01) but a release whose labels
are permuted across its averages (tests/integration/evaluation/test_utility.py) then got the most regularised SVM,
a near-constant guess at the majority rate (0.720 against 0.750) whose interval no longer excludes a gain: the
label-lost rule could not see it; a majority-class null model in the choice, kept unless the best SVM beat it by one
standard error, then chose the majority for a 12-person k-same release that does teach gender (20 of 20 gate seeds
failed). It also doubled the cross-fit's CPU (London k-same-select k=5: 5.3 s to 10.5 s).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Mapping

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.svm import LinearSVC

C_GRID: tuple[float, ...] = (1.0,)
"""The SVM's C values :func:`choose` tries, in order of preference on a tie: C=1 alone (the module docstring says
why a grid of C is not chosen from)."""

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


def _inner_hits(cand: Candidate, C: float, splits: list[np.ndarray], y_train: np.ndarray,
                people_train: np.ndarray, y_valid: np.ndarray, people_valid: np.ndarray, seed: int) -> np.ndarray:
    """Whether each validation face (in :func:`inner_splits` order) is labelled right by the SVM trained on the other
    inner folds' rows of ``cand`` (by those rows' one value when they hold one)."""
    hits = []
    for held in splits:
        fit_rows, val_rows = ~np.isin(people_train, held), np.isin(people_valid, held)
        if not val_rows.any():
            continue
        ys = y_train[fit_rows]
        if not fit_rows.any():
            pred = np.full(int(val_rows.sum()), -1)  # nothing to learn from: every face wrong
        elif len(np.unique(ys)) < 2:
            pred = np.full(int(val_rows.sum()), np.argmax(np.bincount(ys)))
        else:
            pred = fit_svc(cand.train[fit_rows], ys, C, seed).predict(cand.valid[val_rows])
        hits.append(pred == y_valid[val_rows])
    return np.concatenate(hits) if hits else np.zeros(0, dtype=bool)


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
        The first candidate and C (in :data:`C_GRID` order) with the best inner accuracy; the first of each when
        there is nothing to choose or no inner split can be made (fewer than 2 training people).
    """
    first = Choice(next(iter(candidates)), C_GRID[0], float("nan"))
    splits = inner_splits(people_valid, seed)
    if not splits or len(candidates) * len(C_GRID) == 1:
        return first
    best = first
    for name, cand in candidates.items():
        for C in C_GRID:
            hits = _inner_hits(cand, C, splits, y_train, people_train, y_valid, people_valid, seed)
            if not hits.mean() <= best.score:  # strictly better (a NaN best is beaten by any score): ties keep the first
                best = Choice(name, C, float(hits.mean()))
    return best
