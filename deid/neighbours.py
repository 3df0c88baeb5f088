"""Exact all-pairs squared Euclidean distances in row blocks (BLAS), for the identity searches."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def distance_blocks(X: np.ndarray, *, max_cells: int = 16_000_000, max_rows: int | None = None,
                    upper: bool = False) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(start, d2)`` where ``d2[i, j]`` is the squared distance of row ``start + i`` to row j.

    Rows come in blocks of at most ``max_cells`` distances (and ``max_rows`` rows), so memory
    stays bounded whatever n is. With ``upper`` the block holds only columns ``start..n-1``
    (column j of the block is row ``start + j``): the upper triangle, for symmetric searches.
    Cost: n^2 (or n^2/2) dot products of d floats.
    """
    n = len(X)
    sq = np.einsum("ij,ij->i", X, X)
    step = max(1, max_cells // max(n, 1))
    if max_rows is not None:
        step = max(1, min(step, int(max_rows)))
    for s in range(0, n, step):
        rows = X[s:s + step]
        lo = s if upper else 0
        yield s, sq[s:s + len(rows), None] + sq[None, lo:] - 2.0 * (rows @ X[lo:].T)
