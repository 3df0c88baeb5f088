"""deid.bound: the one comparison with 1/k every layer uses (issue 30: it was typed at 8 sites)."""
from __future__ import annotations

import pytest

from deid.bound import RATE_EPS, bound, within_bound


def test_exactly_one_over_k_is_within_and_anything_above_is_not():
    assert bound(5) == 0.2
    assert within_bound(0.2, 5) and within_bound(sum([0.04] * 5), 5)  # 1/k summed in floating point
    assert not within_bound(0.2 + 10 * RATE_EPS, 5) and not within_bound(0.21, 5)
    assert within_bound(0.1, limit=0.1) and not within_bound(0.1001, limit=0.1)
    with pytest.raises(TypeError):
        within_bound(0.1)
    with pytest.raises(TypeError):
        within_bound(0.1, 5, limit=0.2)
