"""Scoring of re-identification attacks: rank-1 credit at the person level, ties credited fractionally.

Credit for a probe is given at the person level (right person, any of their images) and split
evenly over every gallery item tied at the best score, so identical released images can never be
credited by their position in a list (Newton, Sweeney & Malin 2005; Gross et al. 2009 §2.2).
Distinct probe rows (:func:`unique_rows`) are scored once and expanded back to one credit per record.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

from deid.errors import ConfigError

# Probe rows scored per block in attack_rate, to bound the (block, gallery) matrix.
_BLOCK = 1024


def _joint_codes(probe_people: Sequence[Hashable], gallery_people: Sequence[Hashable], m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer person codes shared by probes and gallery (ids of any hashable type)."""
    mapping: dict[Hashable, int] = {}

    def encode(seq: Sequence[Hashable], name: str, size: int) -> np.ndarray:
        seq = list(seq)
        if len(seq) != size:
            raise ConfigError(f"{name} has {len(seq)} entries but there are {size} {name.split('_')[0]} images; pass one person id per image")
        out = np.empty(size, dtype=np.intp)
        for i, v in enumerate(seq):
            if isinstance(v, np.generic):
                v = v.item()
            out[i] = mapping.setdefault(v, len(mapping))
        return out

    return encode(probe_people, "probe_people", m), encode(gallery_people, "gallery_people", n)


def _credit_codes(similarity: np.ndarray, probe_codes: np.ndarray, gallery_codes: np.ndarray, rtol: float) -> np.ndarray:
    best = similarity.max(axis=1, keepdims=True)
    tied = similarity >= best - rtol * np.maximum(np.abs(best), 1.0)
    right = gallery_codes[None, :] == probe_codes[:, None]
    return np.count_nonzero(tied & right, axis=1) / np.count_nonzero(tied, axis=1)


def _check_similarity(similarity: Any, rtol: float) -> np.ndarray:
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] == 0 or s.shape[1] == 0:
        raise ConfigError(f"similarity has shape {s.shape}; it must be a non-empty (n_probes, n_gallery) matrix")
    if np.isnan(s).any():
        raise ConfigError("similarity contains NaN; the recogniser produced undefined scores")
    if not (isinstance(rtol, (int, float)) and 0 <= rtol < 1):
        raise ConfigError(f"rtol={rtol!r} must be a number in [0, 1); the default 1e-9 absorbs floating-point noise only")
    return s


def rank_credit(similarity: Any, probe_people: Sequence[Hashable], gallery_people: Sequence[Hashable], *, rtol: float = 1e-9) -> np.ndarray:
    """Rank-1 re-identification credit of each probe, with ties split evenly.

    The candidates of a probe are all gallery items whose similarity is within
    ``rtol * max(|best|, 1)`` of its best similarity; its credit is the fraction of
    candidates that show the probe's person (any image of them).

    Parameters
    ----------
    similarity : array-like of shape (n_probes, n_gallery)
        Higher means more alike.
    probe_people, gallery_people : sequences of hashable
        Person ids of probes and gallery items.
    rtol : float, default 1e-9
        Tie tolerance; absorbs rounding differences between identical images.

    Returns
    -------
    ndarray of shape (n_probes,) with values in [0, 1].
    """
    s = _check_similarity(similarity, rtol)
    pc, gc = _joint_codes(probe_people, gallery_people, *s.shape)
    return _credit_codes(s, pc, gc, rtol)


def reidentification_rate(similarity: Any, probe_people: Sequence[Hashable], gallery_people: Sequence[Hashable], *, rtol: float = 1e-9) -> float:
    """Mean rank-1 credit over all probes (see :func:`rank_credit`).

    Because tied candidates share the credit, the rate does not depend on the gallery order,
    and ``m`` identical probes facing the same candidates earn together at most
    ``m * (largest share of one person among those probes)``.
    """
    return float(rank_credit(similarity, probe_people, gallery_people, rtol=rtol).mean())


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of ``a`` (first occurrences, in order) and the index of each row's distinct row.

    A k-Same release of N faces holds only about N/k distinct images: scoring each once and
    expanding by index gives the same similarities at a fraction of the cost. Rows are
    grouped by a 64-bit hash and every row is then compared with its group's first row, so
    a hash collision can never merge different images (it falls back to an exact sort).
    """
    a = np.ascontiguousarray(a)
    if len(a) == 0:
        return a, np.zeros(0, dtype=np.int64)
    flat = a.reshape(len(a), -1).view(np.uint8)
    width = flat.shape[1]
    words = np.zeros((len(a), -(-width // 8) * 8), dtype=np.uint8)
    words[:, :width] = flat
    words = words.view(np.uint64)
    mult = np.random.default_rng(0x5EED).integers(1, 2**63, size=words.shape[1], dtype=np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):
        h = (words * mult).sum(axis=1, dtype=np.uint64) ^ np.uint64(width)
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    if not np.array_equal(flat, flat[first[inverse]]):
        view = flat.view(np.dtype((np.void, width))).ravel()
        _, first, inverse = np.unique(view, return_index=True, return_inverse=True)
        inverse = inverse.ravel()
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return a[first[order]], rank[inverse]


def _rate(attacker: Any, probes: tuple[np.ndarray, np.ndarray], probe_people: Sequence[Hashable],
          gallery_people: Sequence[Hashable], rtol: float, gallery_index: np.ndarray | None = None
          ) -> tuple[float, int, float]:
    """Mean credit over all probes, the number of distinct probe images and the credit sum.

    ``probes`` is ``(distinct rows, index of each probe record's row)``: distinct probe rows
    are scored once; ``gallery_index`` expands the similarity of a gallery enrolled as
    distinct rows back to one column per gallery record, so ties between identical released
    images are still credited fractionally per record.
    """
    distinct, index = probes
    pc, gc = _joint_codes(probe_people, gallery_people, len(index), len(gallery_people))
    credits = np.empty(len(index), dtype=np.float64)
    n_gallery = len(gallery_people)
    # Bound the (block, gallery) matrix to ~32 MiB of float64 whatever the gallery size.
    block = max(1, min(_BLOCK, 4_000_000 // max(1, n_gallery)))
    order = np.argsort(index, kind="stable")
    bounds = np.searchsorted(index[order], np.arange(0, len(distinct) + block, block))
    for b, start in enumerate(range(0, len(distinct), block)):
        s = _check_similarity(attacker.similarity(distinct[start:start + block]), rtol)
        if gallery_index is not None:
            s = s[:, gallery_index]
        rows = order[bounds[b]:bounds[b + 1]]
        credits[rows] = _credit_codes(s[index[rows] - start], pc[rows], gc, rtol)
    return float(credits.mean()), int(len(distinct)), float(credits.sum())
