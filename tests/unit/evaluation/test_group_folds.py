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
