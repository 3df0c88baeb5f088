"""The release gate: exact k checks, bounded re-identification attacks, leak and utility checks.

One entry point, :func:`evaluate`, takes typed inputs (:class:`GateInputs`,
:class:`GateConfig`) and returns a :class:`GateResult`; the Prefect task only loads the
arrays and adapts. Every check has a status (``pass``, ``fail``, ``inconclusive``,
``not_applicable``) besides ``passed`` (does it block the release?) and, where it is an
empirical rate, its interval and sample size.

Privacy is decided exactly where it can be. When every member of every cluster received the
identical image (the k-Same family), no recogniser can do better than naming, for each
released image, the person who holds the largest share of its cluster: the exact bound is
``max_person_share`` (max over clusters of that share), checked against 1/k in O(N). The
empirical attacks still run, each rate with a one-sided Clopper-Pearson interval
(Bonferroni over all attacker x mode pairs); for such releases a rate fails only if its
*lower* bound exceeds 1/k (a correct release sits at 1/k against a strong attacker), for
every other method its *upper* bound must stay <= 1/k.

The parts live beside this module: :mod:`~deid.evaluation.gate_types` (settings, inputs, result),
:mod:`~deid.evaluation.gate_structure` (the exact checks), :mod:`~deid.evaluation.gate_privacy` (attacks,
membership, leaks), :mod:`~deid.evaluation.gate_utility` (utility) and :mod:`~deid.evaluation.gate_parts`
(the parallel-parts runner and the helper process).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from deid.evaluation.membership import membership_check

from deid.evaluation.gate_parts import (GateHelper, helper_size, parallel_parts, read_samples_once, serial_parts,
                                        start_helper, worth_parallel)
from deid.evaluation.gate_privacy import leak_checks, membership_disclosure, privacy_checks
from deid.evaluation.gate_structure import (closeness_check, clusters_people, forms_clusters, partition_clusters_check,
                                            partition_grouping, structural_checks)
from deid.evaluation.gate_rows import AttackRow, UtilityRow
from deid.evaluation.gate_types import GateConfig, GateInputs, GateResult

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the gate


def evaluate(inputs: GateInputs, config: GateConfig, *, executor: Any = None,
             helper: GateHelper | None = None) -> GateResult:
    """Run every check on the would-be release; the release passes only if none blocks.

    Parameters
    ----------
    inputs : GateInputs
        The released records with their originals, people, clusters and labels.
    config : GateConfig
        k, method, bounds and sample sizes.
    executor : deid.pool.Executor, optional
        Runs the attackers and the utility protocols as separate calls (e.g. on a small run's
        process pool, :func:`parallel_parts`); the result is the same as without it.
    helper : GateHelper, optional
        A large release's helper process, started before the gate (:meth:`GateHelper.start`);
        the caller closes it. Without one, a large release's gate starts its own.

    Returns
    -------
    GateResult

    References
    ----------
    E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images. IEEE
    TKDE 17(2):232-243, 2005. R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility
    into face de-identification. PET 2005, LNCS 3856, 227-242.
    """
    if helper is not None:
        return _evaluate(inputs, config, executor=executor, pool=helper.pool, ready=helper.ready())
    # A large release's helper process starts first: its imports overlap the checks and the reading below.
    pool = start_helper() if executor is None and helper_size(inputs, config) else None
    try:
        return _evaluate(inputs, config, executor=executor, pool=pool)
    finally:
        if pool is not None:
            pool.close()


def _evaluate(inputs: GateInputs, config: GateConfig, *, executor: Any, pool: Any,
              ready: Mapping[tuple, Callable[[], Any]] | None = None) -> GateResult:
    """:func:`evaluate` with the helper ``pool`` a large release started (or None); ``ready``: parts it ran ahead."""
    checks, min_people, share, exact = structural_checks(inputs, config)
    grouping: tuple[dict, ...] = ()
    if inputs.n and inputs.clusters is not None and forms_clusters(config.method):
        grouping = tuple(partition_grouping(inputs, config.k, per_person=clusters_people(config.method)))
        if config.min_cluster_fraction > 0:
            checks.append(partition_clusters_check(grouping, config))
    checks.extend(inputs.extra_checks)
    inputs = read_samples_once(inputs, config)
    reid: list[AttackRow] = []
    util: list[UtilityRow] = []
    max_rate = None
    sample = None
    membership = None
    if inputs.n:
        checks.append(closeness_check(inputs, config))
        if worth_parallel(inputs, executor):
            parts = parallel_parts(inputs, config, executor)
        elif worth_parallel(inputs, pool):
            # A GateHelper's pool holds the inputs it built: its parts are sent without them (HelperInputs).
            helped: dict[str, Any] = {"ready": ready, "prepared": True} if ready is not None else {}
            parts = parallel_parts(inputs, config, pool, large=True, **helped)
        else:
            parts = serial_parts(inputs, config)
        p_checks, reid, max_rate, sample = privacy_checks(inputs, config, exact=exact, rows=parts.attack_rows)
        checks.extend(p_checks)
        log.info("gate: max re-identification rate %s over %d attacker x mode pairs (bound %.4f)",
                 "insufficient evidence" if max_rate is None else f"{max_rate:.4f}", len(reid), 1 / config.k)
        checks.extend(leak_checks(inputs, config) if parts.leaks is None else parts.leaks)
        membership = membership_disclosure(inputs, config) if parts.membership is None else parts.membership
        checks.append(membership_check(membership, config.membership_max_advantage))
        u_checks, util = parts.utility
        checks.extend(u_checks)
    result = GateResult(checks=tuple(checks), reidentification=tuple(reid), utility=tuple(util),
                        max_rate=max_rate, min_people=min_people, max_person_share=share, exact_bound=exact,
                        attack_sample=sample, partitions=grouping, membership=membership)
    log.info("gate: %s%s", "passed" if result.passed else "failed",
             "" if result.passed else " - " + "; ".join(result.reasons))
    return result
