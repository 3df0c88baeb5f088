"""The near-copy distances' uint8 path (issue 32) gives the int16 reference's values, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from deid.evaluation.leaks import mean_abs_difference, nearest_original_distance


def _int16_mean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The definition the distances had before the uint8 path: |a - b| in int16, its mean in float64."""
    return np.abs(np.asarray(a).astype(np.int16) - np.asarray(b).astype(np.int16)).mean(axis=1)


def _int16_nearest(r: np.ndarray, o: np.ndarray) -> np.ndarray:
    r = np.clip(np.rint(r), 0, 255).astype(np.int16)
    o = np.clip(np.rint(o), 0, 255).astype(np.int16)
    return np.abs(r[:, None, :] - o[None, :, :]).sum(axis=2, dtype=np.int64).min(axis=1) / r.shape[1]


@pytest.mark.parametrize("pixels", [1, 3, 7452, 22356])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_uint8_faces_give_the_int16_means_bit_for_bit(pixels, rows):
    rng = np.random.default_rng(pixels * 1000 + rows)
    a = rng.integers(0, 256, (rows, pixels), dtype=np.uint8)
    b = rng.integers(0, 256, (rows, pixels), dtype=np.uint8)
    half = rows // 2  # near copies too: differences of a few grey levels either way
    b[:half] = np.clip(a[:half].astype(np.int16) + rng.integers(-3, 4, (half, pixels)), 0, 255)
    b[-1:] = 255 - a[-1:]  # the largest differences (both ways)
    got = mean_abs_difference(a, b)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, _int16_mean(a, b))
    mean = np.broadcast_to(a[0], a.shape)  # a cluster's mean against its members, as de-identify passes it
    np.testing.assert_array_equal(mean_abs_difference(mean, a), _int16_mean(mean, a))


def test_other_dtypes_keep_the_int16_definition():
    rng = np.random.default_rng(3)
    a, b = rng.random((9, 40)) * 255, rng.random((9, 40)) * 255
    np.testing.assert_array_equal(mean_abs_difference(a, b), _int16_mean(a, b))


@pytest.mark.parametrize("released_dtype", [np.uint8, np.float64])
def test_nearest_original_distance_is_the_int16_minimum(released_dtype):
    rng = np.random.default_rng(5)
    o = rng.integers(0, 256, (40, 7452), dtype=np.uint8)
    r = o[:12].astype(np.float64) + rng.normal(0, 2, (12, 7452))
    r = r.astype(released_dtype) if released_dtype is not np.uint8 else np.clip(np.rint(r), 0, 255).astype(np.uint8)
    d, t = nearest_original_distance(r, o)
    np.testing.assert_array_equal(d, _int16_nearest(r, o))
    assert t == 2.0
    assert nearest_original_distance(o[:3], o)[0].tolist() == [0.0, 0.0, 0.0]
