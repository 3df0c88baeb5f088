"""Utility evaluation, the gate's check: the method cross-fitted over people (:func:`cross_fit_utility`).

Gross, Airoldi, Malin & Sweeney (2005) measure the utility of de-identified faces by the
accuracy of a classifier for the data's utility labels (gender, expression). We use a
linear SVM on standardised PCA coefficients, cross-validated with folds grouped so that
no group (a person, or a k-Same cluster whose released images are identical copies) is
split between training and test data: otherwise the classifier would be tested on
copies of its training images and utility would be overstated.

The gate's check is :func:`cross_fit_utility`: the method is re-run on the training people
of each fold (:func:`_deidentify_fold`, as the flow would: small partitions suppressed, dominant
people trimmed) and the classifiers are tested on held-out people's originals, with bootstrap
bounds and a pass / fail / inconclusive status. The rooms it uses:

- :mod:`deid.evaluation.utility_folds`: the folds over people and the seeded sample;
- :mod:`deid.evaluation.utility_classifier`: the PCA and linear SVM;
- :mod:`deid.evaluation.utility_evidence`: the bootstrap bounds, the decision and the label-lost rule;
- :mod:`deid.evaluation.utility_protocols`: the three older protocols (:func:`utility_protocols`),
  extra evidence for the report and the study (imported here for the gate).

**The cross-fit.** People are split into grouped folds (stratified by the joint label values where
possible, seeded). For each fold, only the *training* people's faces are de-identified with the
method (the same method and k as the release); a linear SVM is trained on that release and,
separately, on the same people's originals, and both are tested on the held-out people's
*original* faces; the originals' classifier in the label-free front (per-pixel scale, PCA, score scale) fitted on
the fold's original training faces, the release's in that front or one fitted on the release, as an inner
cross-validation over the training people chooses (:mod:`deid.evaluation.utility_select` says why). Every held-out image thus gets two paired predictions; Δ = accuracy(originals) -
accuracy(release) is bounded by a paired bootstrap over held-out people and decided against the
tolerance (:class:`~deid.evaluation.utility_evidence.UtilityEvidence`). The release-trained
classifier must also beat the majority class of the training labels.

**Repeats.** One cross-fit's Δ moves with the fold assignment (London k=5, gender: -0.049 to
+0.010 over seeds 0-4); three repeats with new folds (seed, seed + 1, ...), their predictions
pooled (each held-out image then counts once per repeat, still bootstrapped by person), averaged
it to -0.021 to +0.003 and made the decision the same for every seed, at 0.8 s CPU per repeat on
London. So the default is 3 repeats up to :data:`AUTO_REPEAT_IMAGES` (sampled) images and 1 above:
with more people the fold assignment matters less and a repeat costs more.

**The sample.** At most ``max_images`` images (a seeded uniform sample of whole people) are used,
so the check stays cheap at any drop size (the gate first thins a person's many records, a recording's frames,
so that more people fit: :func:`deid.evaluation.utility_folds.thin_people`): 1,000 images of 500 people resolve a margin of about
0.02 (London's 204 images of 102 people: 0.03), well inside a 0.05 tolerance; each fold re-runs
the method on 80% of them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from numbers import Real
from typing import Any, Callable, Hashable, Mapping, Sequence, cast

import numpy as np

from deid.anonymise.ksame import DominantPersonError, InsufficientPeopleError
from deid.anonymise.partition import _trim_dominant  # the flow's rule for a person above 1/k of a partition
from deid.blas import one_blas_thread
from deid.errors import ConfigError
from deid.evaluation.utility_classifier import (as_components, check_components, face_matrix, fit_embed,
                                               svc_predict)
from deid.evaluation.utility_evidence import (PooledPredictions, UtilityEvidence, blank_evidence, check_confidence,
                                             label_evidence)
from deid.evaluation.utility_folds import check_folds, check_int, codes_of, partition_safe_splits, sample_people
from deid.evaluation.utility_select import Candidate, Choice, choose, fit_svc
from deid.evaluation.utility_protocols import utility_protocols  # noqa: F401 (the gate imports it from here)
from deid.memo import Memo, digest, key_for_size
from deid.progress import Progress, track

logger = logging.getLogger(__name__)

# The comparison study measures every point against the same originals: each cross-fit fold's
# originals-trained predictions are computed once (deid.memo).
_ORIGINAL_FOLDS = Memo("cross_fit_originals", max_bytes=32_000_000)


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


def _deidentify_fold(deidentify: Callable[..., Any], X: np.ndarray, people: np.ndarray, parts: list | None,
                     k: int | None, labels: Mapping[str, Any] | None = None,
                     points: Any = None) -> FoldRun:
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


def _originals_fold(Ztr: np.ndarray, Zte: np.ndarray, ys: dict[str, np.ndarray], names: list[str], tr: np.ndarray,
                    seed: int) -> dict[str, np.ndarray]:
    """Per label, the held-out predictions of the classifier trained on the fold's original training faces (``Ztr``,
    ``Zte``: the training and held-out faces in the front fitted on the training faces, :func:`_fold_front`)."""
    return {name: svc_predict(Ztr, ys[name][tr], Zte, seed)[0] for name in names if len(np.unique(ys[name][tr])) >= 2}


AUTO_REPEAT_IMAGES = 600
""":func:`cross_fit_utility` repeats the cross-fit 3 times up to this many images, once above."""


def cross_fit_utility(images: Any, *, people: Sequence[Hashable], labels: Mapping[str, Sequence[Hashable]],
                      deidentify: Callable[..., Any], partitions: Sequence[Hashable] | None = None,
                      points: Sequence[Any] | None = None, k: int | None = None, released: Any = None,
                      tolerance: float = 0.05, folds: int = 5, repeats: int | None = None, n_boot: int = 2000,
                      confidence: float = 0.95, max_images: int = 1000, n_components: int | None = 50, seed: int = 0,
                      progress: Progress | None = None) -> list[UtilityEvidence]:
    """Utility of a de-identification method by mechanism-level cross-fitting over people.

    Per grouped fold of people, the method de-identifies only the training people's faces; SVMs trained on that
    release and on the same people's originals are tested on the held-out people's originals; their accuracy loss
    Δ is bounded over people and decided against ``tolerance`` (the cross-fit in full: the module docstring).

    Parameters
    ----------
    images : array-like of shape (n, n_pixels)
        Aligned original faces.
    people : sequence of hashable, length n
        Person id of each face; folds and the bootstrap are over people.
    labels : mapping of str to sequence, each length n
        Utility label values per face, e.g. ``{"gender": [...], "expression": [...]}``.
    deidentify : callable
        ``deidentify(images, people=list, partitions=list | None, labels=dict | None) -> released`` or ``(released,
        clusters)``, e.g. ``functools.partial(deid.anonymise.methods.deidentify, shape=(h, w), method=m, k=k, sigma=s,
        block=b, n_components=c, seed=seed)``. It may raise :class:`deid.anonymise.ksame.InsufficientPeopleError`;
        that partition's training records are then suppressed (the flow's ``suppress`` policy) and counted.
    partitions : sequence of hashable, length n, optional
        Partition key of each face for k-Same-Select (the tuple of all utility label values); None for methods
        that do not partition.
    points : sequence, length n, optional
        Landmark points of each face as the release's method got them (k-same-m); the folds' rows go to
        ``deidentify(..., points=...)``. None: the keyword is not passed.
    k : int, optional
        The method's k. With ``partitions``, training partitions with fewer than k people are suppressed up
        front instead of one error at a time.
    released : array-like of shape (n, n_pixels), optional
        The actual release, row i being face i's released image. Adds the ``actual_*`` evidence: trained on
        the released rows of the training people.
    tolerance : float, default 0.05
        Largest acceptable accuracy loss Δ.
    folds : int, default 5
        Grouped folds over people (reduced to the number of people).
    repeats : int or None, default None
        How many times the cross-fit is repeated with new folds (seed, seed + 1, ...), predictions pooled.
        None: 3 when the (sampled) data hold at most :data:`AUTO_REPEAT_IMAGES` images, else 1.
    n_boot, confidence : int, float
        Bootstrap replicates and one-sided level of the bounds.
    max_images : int, default 1000
        At most this many images (a seeded uniform sample of whole people, stated in ``sample``) are used.
    n_components, seed : int
        PCA components of the SVM (None: no PCA, for feature vectors); seed of the sample, folds, SVM, bootstrap.
    progress : deid.progress.Progress, optional
        Told the number of folds (repeats x folds) and each fold done.

    Returns
    -------
    list of UtilityEvidence
        One per label, in the order of ``labels``.

    References
    ----------
    R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility into face de-identification. PET 2005,
    LNCS 3856, 227-242 (utility as label accuracy); V. Chernozhukov et al. Double/debiased machine learning.
    Econometrics J. 21, 2018 (cross-fitting: fit on some units, evaluate on the others, rotate).
    """
    A = _check_arguments(images, deidentify, tolerance=tolerance, folds=folds, repeats=repeats, n_boot=n_boot,
                         confidence=confidence, max_images=max_images, n_components=n_components, k=k)
    s = _take_sample(A, people, labels, partitions=partitions, points=points, released=released,
                     max_images=max_images, seed=seed)
    if repeats is None:
        repeats = 3 if len(s.pc) <= AUTO_REPEAT_IMAGES else 1
    evidence = partial(blank_evidence, tolerance=tolerance, n_boot=n_boot, confidence=confidence, sample=s.sample,
                       seed=seed)
    results, applicable = _applicable(s, evidence)
    if applicable:
        tally = _cross_fit_folds(s, applicable, deidentify, k=k, folds=int(folds), repeats=int(repeats),
                                 n_components=as_components(n_components), seed=seed, progress=progress)
        for name in applicable:
            results[name] = _pooled_evidence(name, tally, evidence, repeats=repeats, tolerance=tolerance,
                                             n_boot=n_boot, confidence=confidence, seed=seed)
    return [results[name] for name in s.ys]


def _pooled_evidence(name: str, tally: _Tally, evidence: Callable[..., UtilityEvidence], *, repeats: int,
                     tolerance: float, n_boot: int, confidence: float, seed: int) -> UtilityEvidence:
    """One label's evidence from the cross-fit's pooled predictions (:func:`label_evidence`), its note saying how the
    folds were made and what the folds suppressed or trimmed; logged when it has test images.

    Parameters
    ----------
    name : str
        The label.
    tally : _Tally
        The folds' pooled predictions and counts (:func:`_cross_fit_folds`).
    evidence : callable
        :func:`blank_evidence` bound to the run's settings.
    repeats, tolerance, n_boot, confidence, seed
        As in :func:`cross_fit_utility` (``repeats`` resolved).

    Returns
    -------
    UtilityEvidence
    """
    base_note = f"{tally.how}; {repeats} repeat(s)" + (
        f"; {tally.suppressed} training record(s) suppressed over all folds (partitions with fewer than k people)"
        if tally.suppressed else "") + (
        f"; {tally.trimmed} training record(s) trimmed over all folds as the flow trims them (one person's images "
        "above 1/k of a partition)" if tally.trimmed else "")
    e = label_evidence(name, tally.pooled[name], evidence, tolerance=tolerance, n_boot=n_boot,
                       confidence=confidence, seed=seed, base_note=base_note,
                       folds_run=tally.folds_run, suppressed=tally.suppressed, trimmed=tally.trimmed)
    if e.n_test_images:
        logger.info("utility %s: %s (delta %.3f [%.3f, %.3f], %d test images of %d people)",
                    name, e.decision, e.delta, e.delta_lower, e.delta_upper, e.n_test_images, e.n_test_people)
    return e


def _check_arguments(images: Any, deidentify: Any, *, tolerance: Any, folds: Any, repeats: Any, n_boot: Any,
                     confidence: Any, max_images: Any, n_components: Any, k: Any) -> np.ndarray:
    """:func:`cross_fit_utility`'s arguments checked (each error names the parameter and what to pass); ``images``
    as an array, not converted: shapes are validated on the whole input but only the sampled rows are converted
    (a 100,000-face drop as float64 would be 6 GB)."""
    A = np.asarray(images)
    if A.ndim != 2 or A.shape[0] == 0 or A.shape[1] == 0:
        raise ConfigError(f"images has shape {A.shape}; it must be a non-empty 2-D array (n_images, n_pixels)")
    if not callable(deidentify):
        raise ConfigError(f"deidentify={deidentify!r} must be a callable deidentify(images, people=..., partitions=..., labels=...), "
                          "e.g. functools.partial(deid.anonymise.methods.deidentify, shape=(h, w), method='k-same', k=5)")
    if isinstance(tolerance, bool) or not isinstance(tolerance, Real) or not 0 <= cast(float, tolerance) <= 1:
        raise ConfigError(f"tolerance={tolerance!r} must be a number in [0, 1] (accuracy loss; setting "
                          "utility_tolerance); pass e.g. 0.05")
    check_folds(folds)
    if repeats is not None:
        check_int("repeats", repeats, 1, "; pass e.g. 3, or None for automatic")
    check_int("n_boot", n_boot, 100, "; pass e.g. n_boot=2000")
    check_confidence(confidence)
    check_int("max_images", max_images, 2, "; pass e.g. 1000")
    check_components(n_components)
    if k is not None:
        check_int("k", k, 2, "; pass the method's k, e.g. 5")
    return A


@dataclass(frozen=True)
class _Sample:
    """The cross-fit's inputs on the rows of the sampled people (:func:`deid.evaluation.utility_folds.sample_people`).

    ``X`` / ``R``: the originals and the actual release (None: not passed) as float64; ``pc``: person codes
    ``0..n_people-1``; ``parts`` / ``pts``: partition keys and landmark points (None: not passed); ``ys``: label
    codes and ``raw``: label values, per label; ``sample``: which images were used.
    """

    X: np.ndarray
    R: np.ndarray | None
    pc: np.ndarray
    parts: list | None
    pts: list | None
    ys: dict[str, np.ndarray]
    raw: dict[str, list]
    sample: str


def _take_sample(A: np.ndarray, people: Sequence[Hashable], labels: Mapping[str, Sequence[Hashable]], *,
                 partitions: Sequence[Hashable] | None, points: Sequence[Any] | None, released: Any,
                 max_images: int, seed: int) -> _Sample:
    """Check the per-face inputs against ``A`` and take the seeded sample of whole people."""
    n = len(A)
    pc_all = codes_of(people, "people", n)
    label_codes = {}
    for name, values in labels.items():
        label_codes[str(name)] = codes_of(values, f"labels[{name!r}]", n)
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
    rows, sample = sample_people(pc_all, int(max_images), seed)
    X = face_matrix(A[rows], "images")
    R = None if R is None else face_matrix(R[rows], "released")
    pc = codes_of(pc_all[rows], "people", len(rows))
    parts = None if parts_all is None else [parts_all[i] for i in rows]
    if points is not None and len(points) != n:
        raise ConfigError(f"points has {len(points)} entries but images has {n} rows; pass one entry per face")
    pts = None if points is None else [points[i] for i in rows]
    return _Sample(X=X, R=R, pc=pc, parts=parts, pts=pts, ys={name: c[rows] for name, c in label_codes.items()},
                   raw={str(name): [values[i] for i in rows] for name, values in labels.items()}, sample=sample)


def _applicable(s: _Sample, evidence: Callable[..., UtilityEvidence]) -> tuple[dict[str, UtilityEvidence], list[str]]:
    """The labels the cross-fit can test, and the evidence of those it cannot (a single value, too few people)."""
    results: dict[str, UtilityEvidence] = {}
    applicable = []
    for name, y in s.ys.items():
        classes_ok = sum(len(np.unique(s.pc[y == c])) >= 2 for c in np.unique(y))
        if len(np.unique(y)) < 2:
            results[name] = evidence(name, "not_applicable", f"{name} has a single value; nothing to predict")
        elif classes_ok < 2:
            results[name] = evidence(name, "not_applicable", f"fewer than 2 values of {name} are held by 2 or more "
                                     "people; the originals cannot be tested on unseen people")
        else:
            applicable.append(name)
    if applicable and int(s.pc.max()) + 1 < 2:
        for name in applicable:
            results[name] = evidence(name, "inconclusive", "fewer than 2 people; no held-out people to test on")
        applicable = []
    return results, applicable


@dataclass
class _Tally:
    """The cross-fit's folds run: each label's pooled predictions, the training records withheld, how folds were made."""

    pooled: dict[str, PooledPredictions]
    folds_run: int = 0
    suppressed: int = 0
    trimmed: int = 0
    how: str = ""


def _cross_fit_folds(s: _Sample, applicable: list[str], deidentify: Callable[..., Any], *, k: int | None, folds: int,
                     repeats: int, n_components: int | None, seed: int, progress: Progress | None) -> _Tally:
    """De-identify each fold's training people and pool the held-out predictions of every applicable label."""
    joint = codes_of([tuple(int(s.ys[a][i]) for a in s.ys) for i in range(len(s.pc))], "labels", len(s.pc))
    # The originals' side of a fold (their classifier's predictions) depends only on the sample, the
    # labels and the fold: the same for every method and strength of a study (deid.memo).
    originals_key = None if key_for_size(s.X) is None else digest(
        "cross_fit_originals", s.X, {name: y for name, y in s.ys.items()}, list(applicable), n_components, int(seed))
    tally = _Tally(pooled={name: PooledPredictions() for name in applicable})
    fold_parts = s.parts if s.parts is not None else (["all"] * len(s.pc) if k is not None else None)
    split_sets = [partition_safe_splits(joint, s.pc, fold_parts, k=k, folds=folds, seed=seed + r)
                  for r in range(repeats)]
    if progress is not None:
        progress.start(sum(len(sp) for sp, _ in split_sets))
    with one_blas_thread():
        for r, (splits, how_r) in enumerate(split_sets):
            tally.how = tally.how or how_r
            for f, (tr, te) in enumerate(track(splits, progress)):
                tally.folds_run += 1
                run = _deidentify_fold(deidentify, s.X[tr], s.pc[tr], None if s.parts is None else [s.parts[i] for i in tr],
                                       k, {name: [v[i] for i in tr] for name, v in s.raw.items()},
                                       None if s.pts is None else [s.pts[i] for i in tr])
                if run.released is None:
                    for name in applicable:
                        tally.pooled[name].skipped.append(f"repeat {r} fold {f}: {run.note}")
                    continue
                tally.trimmed += run.trimmed
                tally.suppressed += int(np.count_nonzero(~run.keep)) - run.trimmed
                fold_key = None if originals_key is None else digest(originals_key, tr, te)
                front = _fold_front(s.X[tr], s.X[te], n_components, seed)
                p_orig = _ORIGINAL_FOLDS.get_or_compute(fold_key, lambda: _originals_fold(front[1], front[2], s.ys,
                                                                                          applicable, tr, seed))
                _pool_fold(s, tally.pooled, run, tr, te, p_orig, front, n_components=n_components, seed=seed,
                           where=f"repeat {r} fold {f}")
    if progress is not None:
        progress.finish()  # a repeat may yield fewer folds than asked
    return tally


def _fold_front(Xtr: np.ndarray, Xte: np.ndarray, n_components: int | None, seed: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """The label-free front fitted on a fold's original training faces, those faces and the held-out faces in it: one
    fit serves the originals' classifier and both release sides (:func:`_side_views`)."""
    front, Ztr = fit_embed(Xtr, n_components, seed)
    return front, Ztr, front.transform(Xte)


class _HeldOut(dict):
    """The held-out faces embedded per front, the release's own front's only when the choice asks for it."""

    def __init__(self, originals: np.ndarray, own: Any, Xte: np.ndarray):
        super().__init__(originals=originals)
        self._own, self._Xte = own, Xte

    def __missing__(self, key: str) -> np.ndarray:
        if key != "release":
            raise KeyError(key)
        self[key] = value = self._own.transform(self._Xte)
        return value


def _side_views(front: Any, Zvalid: np.ndarray, Ztest: np.ndarray, rows: np.ndarray, Xtr: np.ndarray,
                Xte: np.ndarray, n_components: int | None, seed: int) -> tuple[dict[str, Candidate], dict[str, np.ndarray]]:
    """The two fronts a fold's release side is tried in (:mod:`deid.evaluation.utility_select`): the one fitted on
    the fold's original training faces (``front``; ``Zvalid`` / ``Ztest``: those faces and the held-out faces in it)
    and one fitted on the release's rows themselves; per front, the candidate and the held-out faces embedded (the
    release front's when the choice picks it)."""
    own, own_rows = fit_embed(rows, n_components, seed)
    return ({"originals": Candidate(front.transform(rows), Zvalid),
             "release": Candidate(own_rows, own.transform(Xtr))},
            _HeldOut(Ztest, own, Xte))


def _side_predict(views: tuple[dict[str, Candidate], dict[str, np.ndarray]], y_rows: np.ndarray, p_rows: np.ndarray,
                  y_tr: np.ndarray, p_tr: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, Choice]:
    """The release side's SVM in the front and C :func:`~deid.evaluation.utility_select.choose` picks: its predictions
    on the held-out faces, and on the held-out faces and the release's own rows (the label-lost rule's values)."""
    cands, tests = views
    c = choose(cands, y_rows, p_rows, y_tr, p_tr, seed)
    both = fit_svc(cands[c.front].train, y_rows, c.C, seed).predict(np.vstack([tests[c.front], cands[c.front].train]))
    return both[:len(tests[c.front])], both, c


def _pool_fold(s: _Sample, pooled: dict[str, PooledPredictions], run: FoldRun, tr: np.ndarray, te: np.ndarray,
               p_orig: dict[str, np.ndarray], fold_front: tuple[Any, np.ndarray, np.ndarray], *,
               n_components: int | None, seed: int, where: str) -> None:
    """One fold's held-out predictions, per label: the originals' classifier (``p_orig``), the classifier trained on
    the fold's release and (with the actual release) on its rows of the training people, and the majority class.

    Each release-trained classifier works in the label-free front (per-pixel scale, PCA basis, score scale) fitted on
    the fold's *original* training faces or in the one fitted on the release's rows (SVM C=1), as an inner
    cross-validation over the training people chooses (:mod:`deid.evaluation.utility_select` says why neither front
    is right for every release); the held-out faces are never seen by the choice.
    """
    kept = tr[run.keep]
    front, Zvalid, Ztest = fold_front
    views = _side_views(front, Zvalid, Ztest, cast(np.ndarray, run.released).astype(np.float64), s.X[tr], s.X[te],
                        n_components, seed)
    actual = None if s.R is None else _side_views(front, Zvalid, Ztest, s.R[tr], s.X[tr], s.X[te], n_components, seed)
    for name, d in pooled.items():
        y = s.ys[name]
        if len(np.unique(y[tr])) < 2:
            d.skipped.append(f"{where}: training people hold a single value of {name}")
            continue
        p_o = p_orig[name]
        if len(np.unique(y[kept])) < 2:  # the release teaches a single value: predict it
            # Suppression (partitions below k on this fold's training side) left one value: a
            # defect of the measurement on small data, not evidence that the release lost the label.
            p_r = np.full(len(te), y[kept][0])
            d.single_taught += 1
        else:
            # Predicted on the held-out faces and on the release's own faces: a classifier that names one value
            # even there cannot tell the release's faces apart (the label is lost by construction); one that
            # names one value on a handful of held-out faces only is small-sample evidence for the bounds.
            p_r, both, choice = _side_predict(views, y[kept], s.pc[kept], y[tr], s.pc[tr], seed)
            d.values.update(np.unique(both).tolist())
            d.choices.append((choice.front, choice.C))
        majority = int(np.argmax(np.bincount(y[tr])))
        d.row.append(te)
        d.who.append(s.pc[te])
        d.o.append(p_o == y[te])
        d.r.append(p_r == y[te])
        d.m.append(y[te] == majority)
        if actual is not None:
            p_a, both, _ = _side_predict(actual, y[tr], s.pc[tr], y[tr], s.pc[tr], seed)
            d.a.append(p_a == y[te])
            d.a_values.update(np.unique(both).tolist())
        d.folds_used += 1
