"""Folds over people for the utility checks: who trains and who is tested.

Grouped, stratified K-fold splits (:func:`grouped_splits`, no person or cluster on both sides), the
cross-fit's partition-safe folds (:func:`partition_safe_splits`: no training side loses a partition the
whole sample can fill), the seeded sample of whole people the cross-fit runs on (:func:`sample_people`),
and the label coding and integer checks the utility modules share.
"""
from __future__ import annotations

import warnings
from numbers import Integral
from typing import Any, Hashable, Sequence

import numpy as np
from sklearn.model_selection import GroupKFold, StratifiedGroupKFold

from deid.errors import ConfigError, DataError

# Per-image values (labels, people, groups): a sequence, or an array of them.
Values = Sequence[Hashable] | np.ndarray


def codes_of(values: Values, name: str, n: int) -> np.ndarray:
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


def check_int(name: str, value: Any, low: int, advice: str) -> None:
    """Refuse a non-integer (or bool) ``value`` below ``low``; ``advice`` ends the message."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise ConfigError(f"{name}={value!r} must be an integer >= {low}{advice}")


def check_folds(folds: Any) -> None:
    check_int("folds", folds, 2, " (setting cv_folds); pass e.g. folds=5")


def grouped_splits(y: Values, *, groups: Values, folds: int = 5, seed: int = 0) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
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
    y_codes = codes_of(y, "y", len(list(y)))
    n = len(y_codes)
    g_codes = codes_of(groups, "groups", n)
    n_groups = int(g_codes.max()) + 1 if n else 0
    check_folds(folds)
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
        best: Any = None
        best_eval, best_size = np.inf, np.inf
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


def sample_people(pc: np.ndarray, max_images: int, seed: int) -> tuple[np.ndarray, str]:
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


THIN_FLOOR = 4
"""Fewest records per person :func:`thin_people` keeps (a drop of stills, a few photos per person, is never thinned)."""


def thin_people(pc: np.ndarray, strata: np.ndarray, max_records: int, seed: int = 0) -> tuple[np.ndarray, int | None]:
    """Rows keeping at most ``F`` records of each person, so that as many people as possible fit ``max_records``.

    The utility checks' intervals are bounded by people, not records (the bootstrap resamples
    people): the frames of one recording are near copies, and a budget of whole people spent on
    them tests few people (a video drop of 20 frames per person: 1,000 records are 50 people, a
    margin of 0.059 that can never decide a 0.05 tolerance). ``F`` is the largest per-person count
    with which every person fits, and at least :data:`THIN_FLOOR` (then the caller samples whole
    thinned people as before). A person's kept records are evenly spaced over their records ordered by
    ``strata`` (e.g. the joint label values), so each of their label values keeps its share, and within a
    stratum they are a seeded random choice: frames evenly spaced in time alias with a periodic motion (a
    talking mouth's 6-frame cycle: every kept 'talk' frame closed-mouthed; measured on 300 people: the
    actual release's rows then scored 0.872 against the folds' 0.961, a spurious fail).

    Parameters
    ----------
    pc : ndarray of int, shape (n,)
        Person code of each record, ``0..n_people-1``.
    strata : ndarray of int, shape (n,)
        A code per record whose values each person's kept records spread over (the joint label values).
    max_records : int
        The records budget.
    seed : int, default 0
        Seed of the choice within a stratum.

    Returns
    -------
    rows : ndarray of int
        Kept rows, ascending (all rows when they fit or no person holds more than ``F``).
    cap : int or None
        ``F`` when some person was thinned, else None.
    """
    n = len(pc)
    counts = np.bincount(pc)
    if n <= max_records or counts.max() <= THIN_FLOOR:
        return np.arange(n), None
    # Largest F with sum(min(counts, F)) <= max_records (the total grows with F), at least the floor.
    lo, hi = THIN_FLOOR, int(counts.max())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(np.minimum(counts, mid).sum()) <= max_records:
            lo = mid
        else:
            hi = mid - 1
    cap = lo
    if counts.max() <= cap:
        return np.arange(n), None
    order = np.lexsort((np.random.default_rng(seed).random(n), strata, pc))  # by person, stratum, then at random
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    keep = []
    for who in np.flatnonzero(counts):
        mine = order[starts[who]:starts[who] + counts[who]]
        if counts[who] <= cap:
            keep.append(mine)
        else:
            keep.append(mine[np.round(np.linspace(0, counts[who] - 1, cap)).astype(np.intp)])
    return np.sort(np.concatenate(keep)), cap


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
    part = codes_of([p.item() if isinstance(p, np.generic) else p for p in partitions], "partitions", len(people))
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
    fold_of, held = _deal_people(people, y_codes, member, fillable, size, cap, n_folds, seed)
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


def _deal_people(people: np.ndarray, y_codes: np.ndarray, member: np.ndarray, fillable: np.ndarray, size: np.ndarray,
                 cap: np.ndarray, n_folds: int, seed: int) -> tuple[np.ndarray, int]:
    """:func:`partition_safe_splits`' dealing: the fold of each person, and how many were dealt over a cap.

    Tightest partitions first (least spare ``cap / size``), then most images, each person to the fold with
    the fewest people of their label, then the fewest images, then a seeded fold order, within the caps
    (``member[p, who]``: person ``who`` is in partition ``p``; ``cap[p]``: people of ``p`` a test fold may hold).
    """
    n_people = member.shape[1]
    n_parts = member.shape[0]
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
    return fold_of, held
