"""Counting clusters: each cluster's size, distinct people and largest one-person share.

The k-Same guarantee is a statement about these counts (every released cluster holds >= k distinct
people, no person above 1/k of it; Newton, Sweeney & Malin 2005). The anonymise layer checks its own
repairs with them (:func:`deid.anonymise.near_copy.check_merged`) and the gate checks the release
with the same function (:func:`deid.evaluation.gate_structure.structural_checks`), so the two cannot count
differently.

References
----------
E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images. IEEE TKDE
17(2):232-243, 2005.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

__all__ = ["cluster_shares", "value_codes"]


def cluster_shares(clusters: Sequence[Hashable], people: Sequence[Hashable]) -> tuple[dict, dict, dict]:
    """Per cluster: its size, its number of distinct people and its largest one-person share."""
    c_codes, c_keys = value_codes(clusters)
    p_codes, _ = value_codes(people)
    sizes = np.bincount(c_codes, minlength=len(c_keys))
    pairs, counts = np.unique(np.stack([c_codes, p_codes]), axis=1, return_counts=True)
    distinct = np.bincount(pairs[0], minlength=len(c_keys))
    top = np.zeros(len(c_keys), dtype=np.int64)
    np.maximum.at(top, pairs[0], counts)
    return ({c_keys[i]: int(sizes[i]) for i in range(len(c_keys))},
            {c_keys[i]: int(distinct[i]) for i in range(len(c_keys))},
            {c_keys[i]: float(top[i] / sizes[i]) for i in range(len(c_keys))})


def value_codes(values: Sequence[Hashable]) -> tuple[np.ndarray, list]:
    """Integer codes of ``values`` in order of first appearance, and the distinct values in that order."""
    index: dict = {}
    codes = np.fromiter((index.setdefault(v, len(index)) for v in values), dtype=np.int64, count=len(values))
    return codes, list(index)
