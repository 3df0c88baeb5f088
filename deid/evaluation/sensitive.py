"""Sensitive columns: released only when every cluster is l-diverse, else withheld.

A k-Same cluster hides which of its >= k people a released face is, but if all of them share a
sensitive value (a diagnosis), linking a person to the cluster reveals it: the homogeneity attack.
A column declared ``sensitive`` in drop.yaml is therefore never a partition label (deid.intake.drop)
and is released only when every cluster is l-diverse in it; otherwise the column is withheld from the
release. Two measures (setting ``DEID_SENSITIVE_DIVERSITY``), both from Machanavajjhala et al.:

* ``distinct`` (default): every cluster holds at least ``l`` distinct values;
* ``entropy``: every cluster's entropy of its values is at least ``log(l)``, i.e. its *effective*
  number of values ``exp(H)`` is at least ``l``. Stricter: a cluster of ten records holding one
  value nine times and another once has 2 distinct values but ``exp(H) = 1.38``; linking someone
  to it reveals the common value with probability 0.9.

The check names counts, never values.

References
----------
A. Machanavajjhala, D. Kifer, J. Gehrke, M. Venkitasubramaniam. l-diversity: privacy beyond
k-anonymity. ACM TKDD 1(1):3, 2007.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Mapping, Sequence

from deid.errors import ConfigError
from deid.evaluation.checks import Check

MEASURES = ("distinct", "entropy")
"""The l-diversity measures (setting ``DEID_SENSITIVE_DIVERSITY``)."""


def least_diverse(clusters: Sequence[Hashable], values: Sequence[Hashable], measure: str = "distinct") -> float:
    """The least diverse cluster's diversity in ``values`` (0 for no records).

    ``measure="distinct"``: its number of distinct values (an int). ``"entropy"``: its effective number
    of values ``exp(H)``, ``H = -sum p log p`` over the shares ``p`` of its values (entropy l-diversity
    holds for ``l`` when this is at least ``l``); rounded to 6 decimals, so a cluster of ``l`` equally
    frequent values gives exactly ``l``.
    """
    if measure not in MEASURES:
        raise ConfigError(f"measure={measure!r} must be one of {list(MEASURES)} (setting DEID_SENSITIVE_DIVERSITY)")
    if len(clusters) != len(values):
        raise ConfigError(f"clusters has {len(clusters)} entries but values {len(values)}; pass one per record")
    seen: dict[Hashable, Counter] = {}
    for c, v in zip(clusters, values):
        seen.setdefault(c, Counter())[v] += 1
    if measure == "distinct":
        return min((len(s) for s in seen.values()), default=0)

    def effective(counts: Counter) -> float:
        n = sum(counts.values())
        return round(math.exp(-sum(m / n * math.log(m / n) for m in counts.values())), 6)

    return min((effective(s) for s in seen.values()), default=0)


def sensitive_release(clusters: Sequence[Hashable] | None, sensitive: Mapping[str, Sequence[Hashable]], *,
                      l: int, measure: str = "distinct", why_not: str | None = None) -> tuple[list[str], Check]:
    """Which sensitive columns the release may carry, and the ``sensitive_l_diversity`` check saying so.

    Parameters
    ----------
    clusters : sequence or None
        Each released record's cluster; None for a method without clusters (every record its own
        "cluster": nothing to be diverse, every sensitive column is withheld).
    sensitive : mapping of column -> per-record values
        The drop's sensitive columns (drop.yaml ``sensitive``), aligned with ``clusters``.
    l : int
        Distinct values every cluster must hold (setting ``DEID_SENSITIVE_L``), or with ``measure="entropy"``
        the effective number of values ``exp(H)`` it must reach.
    measure : {"distinct", "entropy"}
        The l-diversity measure (setting ``DEID_SENSITIVE_DIVERSITY``; :func:`least_diverse`).
    why_not : str, optional
        A reason every column is withheld whatever its diversity (e.g. republished clusters without values).

    Returns
    -------
    (released, check)
        The columns released (each l-diverse), and the check: ``value`` the least diverse cluster's
        diversity (distinct values, or ``exp(H)``) over all sensitive columns. It passes either way: a
        withheld column is not released, so nothing is disclosed; the detail says which columns were
        withheld (never a value).
    """
    if isinstance(l, bool) or not isinstance(l, int) or l < 1:
        raise ConfigError(f"l={l!r} must be an integer >= 1 (setting DEID_SENSITIVE_L: distinct sensitive values "
                          "every cluster must hold); e.g. 2")
    if measure not in MEASURES:
        raise ConfigError(f"measure={measure!r} must be one of {list(MEASURES)} (setting DEID_SENSITIVE_DIVERSITY: "
                          "how l-diversity is measured)")
    if not sensitive:
        return [], Check("sensitive_l_diversity", True, None, f">= {l}", "not applicable: the drop declares no "
                         "sensitive columns (drop.yaml 'sensitive')", status="not_applicable")
    counts = {x: (least_diverse(clusters, list(v), measure) if clusters is not None and len(v) else 0)
              for x, v in sensitive.items()}
    released = [x for x, n in counts.items() if n >= l - 1e-9 and why_not is None and clusters is not None]
    withheld = [x for x in counts if x not in released]
    worst = min(counts.values())
    if measure == "distinct":
        parts = [f"{x}: least diverse cluster holds {counts[x]} distinct value(s)" for x in counts]
    else:
        parts = [f"{x}: least diverse cluster's effective number of values exp(entropy) is {counts[x]:.3f}"
                 for x in counts]
    if clusters is None:
        reason = "the method forms no clusters, so no cluster can be l-diverse"
    elif why_not is not None:
        reason = why_not
    else:
        reason = (f"fewer than l = {l} distinct values in some cluster" if measure == "distinct" else
                  f"some cluster's entropy of its values below log(l), l = {l}")
    detail = "; ".join(parts) + (f"; released: {released}" if released else "") + \
        (f"; withheld from the release (column dropped, {reason}): {withheld}" if withheld else "")
    detail += f"; {measure} l-diversity, l = {l} (DEID_SENSITIVE_DIVERSITY, DEID_SENSITIVE_L)"
    return released, Check("sensitive_l_diversity", True, worst, f">= {l}", detail,
                           status="pass" if not withheld else "not_applicable")
