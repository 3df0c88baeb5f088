"""The utility classifier's front (deid.evaluation.utility_classifier): one fit, the same numbers."""
from __future__ import annotations

import numpy as np
import pytest

from deid.evaluation.utility_classifier import PixelPCA, embed, fit_embed, fitted_front


@pytest.mark.parametrize("integer", [True, False])
def test_fit_transform_is_fit_then_transform_bit_for_bit(integer):
    """PixelPCA.fit_transform and fit_embed standardise once; their numbers are fit(X).transform(X)'s, bit for bit."""
    rng = np.random.default_rng(4)
    X = rng.normal(120, 30, (60, 300))
    X = np.round(X) if integer else X  # integer pixels get the rounding-noise floor, others none
    pca = PixelPCA(20, max_samples=40, random_state=2)
    assert np.array_equal(pca.fit_transform(X), PixelPCA(20, max_samples=40, random_state=2).fit(X).transform(X))
    front, Z = fit_embed(X, 20, 3)
    assert np.array_equal(Z, fitted_front(X, 20, 3).transform(X))
    assert np.array_equal(front.transform(X[:7]), fitted_front(X, 20, 3).transform(X[:7]))
    Ztr, Zte = embed(X[:50], X[50:], 20, 3)
    reference = fitted_front(X[:50], 20, 3)
    assert np.array_equal(Ztr, reference.transform(X[:50])) and np.array_equal(Zte, reference.transform(X[50:]))
