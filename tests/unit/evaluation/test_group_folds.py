"""The utility checks' grouped folds are scikit-learn's StratifiedGroupKFold folds, computed faster."""
from __future__ import annotations

import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.model_selection import StratifiedGroupKFold

from deid.evaluation.utility_folds import _stratified_group_kfold, grouped_splits


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 120), classes=st.integers(1, 10), groups=st.integers(1, 120), folds=st.integers(2, 7),
       seed=st.integers(0, 2**31 - 1), per_group=st.booleans(), data=st.randoms(use_true_random=False))
def test_the_folds_are_sklearns(n, classes, groups, folds, seed, per_group, data):
    rng = np.random.default_rng(data.randint(0, 2**32 - 1))
    _, g = np.unique(rng.integers(0, min(groups, n), n), return_inverse=True)
    y = rng.integers(0, classes, g.max() + 1)[g] if per_group else rng.integers(0, classes, n)
    _, y = np.unique(y, return_inverse=True)
    fast = _stratified_group_kfold(y, g, folds, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            slow = list(StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed).split(
                np.zeros((n, 1)), y, g))
        except ValueError:
            assert fast is None  # sklearn refuses: the caller asks sklearn, which says why
            return
    assert fast is not None and len(fast) == len(slow) == folds
    for (tr, te), (tr2, te2) in zip(fast, slow):
        assert np.array_equal(tr, tr2) and np.array_equal(te, te2) and te.dtype == te2.dtype


def test_a_split_sklearn_refuses_still_falls_back_with_its_message():
    splits, detail = grouped_splits(["a", "a", "b", "b"], groups=[1, 2, 3, 4], folds=3, seed=0)
    assert len(splits) == 3 and detail.startswith("GroupKFold(3")
    assert "stratification impossible (n_splits=3 cannot be greater than the number of members in each class" in detail


def test_thin_people_spends_the_budget_on_people_not_on_frames():
    """90 people x 20 frames (10 per label) in 1,000 records: every person kept, 11 frames each, both labels."""
    from deid.evaluation.utility_folds import thin_people

    pc = np.repeat(np.arange(90), 20)
    strata = np.tile(np.repeat([0, 1], 10), 90)
    rows, cap = thin_people(pc, strata, 1000)
    assert cap == 11 and len(rows) == 990 and np.all(np.diff(rows) > 0)
    assert np.array_equal(np.bincount(pc[rows]), np.full(90, 11))
    both = np.zeros((90, 2), dtype=int)
    np.add.at(both, (pc[rows], strata[rows]), 1)
    assert both.min() >= 5  # each person keeps both labels, evenly
    assert np.array_equal(rows, thin_people(pc, strata, 1000)[0])  # seeded: the same rows again


def test_thin_people_does_not_alias_with_a_periodic_motion():
    """Frames kept at random within a label, not evenly spaced: a 6-frame talking cycle keeps every phase."""
    from deid.evaluation.utility_folds import thin_people

    pc = np.repeat(np.arange(300), 20)
    strata = np.tile(np.repeat([0, 1], 10), 300)
    phase = np.tile(np.arange(10) % 6, 600)  # the frame's place in the mouth's cycle
    rows, cap = thin_people(pc, strata, 1200)
    assert cap == 4
    kept = np.bincount(phase[rows], minlength=6) / len(rows)
    assert np.all(np.abs(kept - np.bincount(phase, minlength=6) / len(phase)) < 0.04)


def test_thin_people_leaves_stills_and_small_drops_alone():
    from deid.evaluation.utility_folds import THIN_FLOOR, thin_people

    pc = np.repeat(np.arange(600), 2)  # two photos per person: over budget, but nothing to thin
    rows, cap = thin_people(pc, np.zeros(len(pc), dtype=int), 1000)
    assert cap is None and np.array_equal(rows, np.arange(len(pc)))
    pc = np.repeat(np.arange(30), 20)  # within budget: every record
    assert thin_people(pc, np.zeros(len(pc), dtype=int), 1000)[1] is None
    # 400 people x 20 frames: the floor, then the caller samples whole (thinned) people
    pc = np.repeat(np.arange(400), 20)
    rows, cap = thin_people(pc, np.zeros(len(pc), dtype=int), 1000)
    assert cap == THIN_FLOOR and np.array_equal(np.bincount(pc[rows]), np.full(400, THIN_FLOOR))
