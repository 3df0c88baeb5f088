"""The k-anonymity bound 1/k and the one rule every layer compares a rate or share with.

k-Same's guarantee (Newton, Sweeney & Malin 2005): no recogniser links a released face to the right
person more often than ``1/k``. Gate, near-copy repair, report validation, charts and the study all
ask "is this rate or share within the bound?"; they ask it here, so the tolerance is one fact.
"""
from __future__ import annotations

# A rate or share of exactly 1/k computed in floating point (e.g. 1/5 as 0.2 summed from counts) may come
# out one ulp above 1/k; anything more than this above the bound is above it.
RATE_EPS = 1e-12


def bound(k: int) -> float:
    """The re-identification bound ``1/k`` of k-Same."""
    return 1.0 / k


def within_bound(rate: float, k: int | None = None, *, limit: float | None = None) -> bool:
    """Is ``rate`` (a re-identification rate, a confidence bound of one, or a person's share) at most ``1/k``?

    Pass ``k``, or ``limit`` when the bound is already a number (a report's ``privacy.bound``).
    """
    if (k is None) == (limit is None):
        raise TypeError("within_bound needs exactly one of k or limit")
    return float(rate) <= (bound(k) if limit is None else float(limit)) + RATE_EPS
