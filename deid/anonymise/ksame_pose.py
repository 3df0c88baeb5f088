"""Pose-aware k-Same grouping: each face's estimated head yaw as one more coordinate of the grouping's features.

Averages of faces turned different ways ghost. The eyes are aligned, but in the canonical face (eyes at 30%
and 70% of its width: an inter-ocular distance D of 0.4 widths, 32 px at 81 px) the base of the nose, about
``NOSE_DEPTH_RATIO`` = 0.5 D in front of the eyes (:mod:`deid.alignment.pose`), moves across the image by
0.5 D tan(yaw): two faces 10 degrees apart place nose and mouth about 3 px apart, wider than an edge, and the
average shows both. A left and a right profile (yaw of opposite signs) are the pair furthest apart.

:func:`pose_features` appends the *signed* yaw to the features, scaled so that a yaw difference of
``degrees`` counts as much as the typical distance between two faces of the partition (the root mean square
distance between pairs, ``sqrt(2 x total variance)``): with ``degrees=10``, two faces 10 degrees apart are as
far apart as two typical faces, so the grouping prefers a neighbour of similar pose about as much as one of
similar appearance. Only the distances change: the grouping (:class:`deid.anonymise.ksame.KSame`) keeps every
rule (>= k distinct people per cluster, no person above 1/k, the feasible maximum of clusters). Faces without
an estimate (eyes given by the manifest, or no landmarks) are placed at yaw 0 (frontal); a partition with no
estimate at all is grouped as before.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from deid.anonymise.ksame_greedy import CHUNK_ROWS
from deid.errors import ConfigError

__all__ = ["pose_features", "yaw_values"]


def yaw_values(yaw: Sequence[Any] | np.ndarray, n: int) -> np.ndarray:
    """``yaw`` (degrees; None or NaN: not estimated) as a float64 array of length ``n`` (NaN where unknown)."""
    y = np.array([np.nan if v is None else v for v in yaw], dtype=np.float64) if not isinstance(yaw, np.ndarray) \
        else np.asarray(yaw, dtype=np.float64)
    if y.shape != (n,):
        raise ConfigError(f"yaw has shape {y.shape}; pass one yaw (degrees, None when not estimated) per row of X "
                          f"({n} rows)")
    return y


def typical_distance(X: np.ndarray) -> float:
    """The root mean square distance between two faces of ``X``: ``sqrt(2 x`` the total variance ``)``.

    Computed a few thousand rows at a time in float64 (``X`` may be a million float32 rows: no copy of it).
    """
    n = X.shape[0]
    if n < 2:
        return 0.0
    mean = np.zeros(X.shape[1])
    for a in range(0, n, CHUNK_ROWS):
        mean += X[a:a + CHUNK_ROWS].sum(axis=0, dtype=np.float64)
    mean /= n
    ss = 0.0
    for a in range(0, n, CHUNK_ROWS):
        c = X[a:a + CHUNK_ROWS].astype(np.float64) - mean
        ss += float(np.einsum("ij,ij->", c, c))
    return math.sqrt(2.0 * ss / n)


def pose_features(X: Any, yaw: Sequence[Any] | np.ndarray, *, degrees: float | None) -> np.ndarray:
    """``X`` with the signed yaw appended as one more column, weighted so ``degrees`` of yaw = a typical distance.

    Parameters
    ----------
    X : array-like of shape (n_faces, n_features)
        The grouping's features (eigenface coefficients of one partition).
    yaw : sequence of float or None, length n_faces
        Estimated head yaw in degrees (:func:`deid.alignment.pose.estimate_yaw`; positive: the nose
        towards the image's right); None or NaN where not estimated (placed at 0, frontal).
    degrees : float or None
        The yaw difference that counts as much as the typical distance between two faces of ``X``
        (:func:`typical_distance`); ``None`` or 0: pose not used, ``X`` returned as given.

    Returns
    -------
    ndarray of shape (n_faces, n_features + 1), or ``X`` itself
        Same dtype as ``X`` (float32 stays float32). ``X`` unchanged when ``degrees`` is off, no face
        has an estimate, or the faces are all at one point (no typical distance to scale by).
    """
    if degrees is None or degrees == 0:
        return X
    if isinstance(degrees, bool) or not isinstance(degrees, (int, float)) or not 0 < degrees <= 180:
        raise ConfigError(f"degrees={degrees!r} must be a number of degrees in (0, 180] (DEID_POSE_GROUPING_DEGREES; "
                          "e.g. 10), or 0 to group by appearance only")
    X = np.asarray(X)
    if X.dtype not in (np.float32, np.float64):
        X = X.astype(np.float64)
    y = yaw_values(yaw, X.shape[0])
    known = np.isfinite(y)
    if not known.any():
        return X
    scale = typical_distance(X) / float(degrees)
    if not scale > 0:
        return X
    column = (np.where(known, y, 0.0) * scale).astype(X.dtype)
    return np.hstack([X, column[:, None]])
