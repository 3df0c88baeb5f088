"""The gate's utility part: the people sampled for it, the cross-fit utility checks (a classifier
trained on the release and on the originals, per label) and the earlier protocols' rows kept as evidence.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from deid.evaluation.checks import Check
from deid.evaluation.utility_folds import thin_people
from deid.progress import Progress

from deid.evaluation.gate_order import canonical_order, text_ranks
from deid.evaluation.gate_privacy import attack_sample, points_of
from deid.evaluation.gate_rows import UtilityRow
from deid.evaluation.gate_types import GateConfig, GateInputs

logger = logging.getLogger(__name__)


def people_sample(inputs: GateInputs, *, max_records: int, seed: int, labels: Sequence[str] = ()) -> np.ndarray:
    """Indices of the utility sample, in :func:`canonical_order`: a seeded random sample of whole people, at most
    ``max_records`` records (every record when the release has no more).

    People with many records (a recording's frames) are first thinned to the records per person with
    which every person fits, spread over their values of ``labels``
    (:func:`deid.evaluation.utility_folds.thin_people`): the intervals are bounded by people, not frames.
    Which people and records are sampled, and their order, follow the records' content and ``seed``,
    never their input order (:func:`canonical_order`).
    """
    canon = canonical_order(inputs)
    if inputs.n <= max_records:
        return canon.copy()
    codes = text_ranks(inputs.people)[canon]  # 0..people-1 by the people's text, ascending along canon
    strata = (text_ranks([tuple(v) for v in zip(*(np.asarray(inputs.labels[x]).tolist() for x in labels))])[canon]
              if labels else np.zeros(inputs.n, dtype=np.intp))
    rows, cap = thin_people(codes, strata, max_records, seed)
    if cap is not None:
        logger.info("gate: utility sample thinned to at most %d records per person (%d of %d records) so that more "
                    "people fit %d records", cap, len(rows), inputs.n, max_records)
    codes = codes[rows]
    n_people = int(codes.max()) + 1 if len(codes) else 0
    order = np.random.default_rng(seed).permutation(n_people)
    sizes = np.bincount(codes, minlength=n_people)
    take = order[np.cumsum(sizes[order]) <= max_records]
    return canon[rows[np.isin(codes, take if len(take) else order[:1])]]


def utility_checks(inputs: GateInputs, config: GateConfig) -> tuple[list[Check], list[UtilityRow]]:
    """Utility per label, decided by mechanism-level cross-fitting; the older protocols are extra evidence.

    The gate's protocol (:func:`deid.evaluation.utility.cross_fit_utility`): the run's method
    de-identifies only the training people of each fold; classifiers trained on that release
    and on the same people's originals are tested on the held-out people's originals, and the
    paired accuracy drop is bounded by a bootstrap over people. ``pass`` if its upper bound
    is within the tolerance, ``fail`` if its lower bound exceeds it, otherwise
    ``inconclusive`` (blocking only with ``utility_inconclusive="reject"``).
    """
    if not config.labels:
        return [Check("utility", True, None, None, "not applicable: the drop declares no utility labels",
                      status="not_applicable")], []
    checks, rows = cross_fit_checks(inputs, config)
    return checks, rows + protocol_rows(inputs, config)


def cross_fit_checks(inputs: GateInputs, config: GateConfig) -> tuple[list[Check], list[UtilityRow]]:
    """The deciding utility checks and their rows (:func:`utility_checks`); none without the run's method."""
    from deid.anonymise.methods import K_METHODS, method_spec  # noqa: PLC0415
    from deid.evaluation.utility import cross_fit_utility  # noqa: PLC0415 (sklearn import cost)

    rows: list[UtilityRow] = []
    checks: list[Check] = []
    if inputs.deidentify is None:
        return checks, rows
    # Feature vectors are classified as they are (standardised, no PCA): see deid.evaluation.utility._svm.
    n_components = None if inputs.kind == "features" else config.n_components
    idx = people_sample(inputs, max_records=config.utility_sample, seed=config.seed, labels=config.labels)
    released, originals = inputs.fetch(idx)
    labels = {x: np.asarray(inputs.labels[x])[idx] for x in config.labels}
    select = method_spec(config.method).partitions_by_labels and inputs.partitions is not None
    evidence = cross_fit_utility(
        originals, people=list(inputs.people[idx]), labels=labels,
        deidentify=inputs.deidentify,
        partitions=list(inputs.partitions[idx]) if select else None, points=points_of(inputs, idx),
        k=config.k if config.method in K_METHODS else None, released=released, tolerance=config.tolerance,
        folds=config.folds, confidence=config.confidence, max_images=config.utility_sample,
        n_components=n_components, seed=config.seed,
        progress=Progress(f"gate: utility cross-fit on {len(idx)} records", unit="folds"))
    for ev in evidence:
        status, detail = ev.decision, ev.detail
        if ev.label_lost:
            # Released accuracy at or below the majority-class rate, upper bound included: the label is lost,
            # which no noise explains; it fails whatever DEID_UTILITY_INCONCLUSIVE says.
            detail = (f"the release loses {ev.label}: released faces do not beat the majority-class rate "
                      f"{ev.majority_rate:.3f} (point estimate and upper bound at or below it). {detail}")
        elif status == "fail" and ev.suppressed_training_records and ev.actual_status not in (None, "fail"):
            # The folds' de-identification had to withhold label cells with fewer than k of
            # their (fewer) training people, which the real release kept: its loss is then
            # not evidence about this release, and the release's own rows did not fail.
            status = "inconclusive"
            detail = (f"cross-fit failed only after withholding {ev.suppressed_training_records} training "
                      f"records in label cells below k (the release itself kept them), and the release's own "
                      f"rows did not fail: inconclusive. {detail}")
        rows.append(UtilityRow.from_dict({**ev.to_dict(), "protocol": "cross-fit",
                                          "original_accuracy": ev.accuracy_original,
                                          "deidentified_accuracy": ev.accuracy_release, "gate_status": status}))
        interval = None if ev.delta_lower is None else (ev.delta_lower, ev.delta_upper)
        checks.append(utility_status_check(
            f"utility_{ev.label}", status=status, value=None if ev.delta is None else round(ev.delta, 4),
            threshold=f"accuracy drop <= {config.tolerance}", inconclusive=config.utility_inconclusive,
            interval=interval, n=ev.n_test_images, detail=detail))
    return checks, rows


def protocol_rows(inputs: GateInputs, config: GateConfig) -> list[UtilityRow]:
    """The earlier utility protocols' rows, evidence only (:func:`utility_checks`).

    On whole clusters of the attacked sample, at most ``evidence_sample`` records (the same seed:
    a release that small is used whole): they decide nothing, and their repeated grouped CV
    (``folds x repeats`` fits on originals and on the release, per label) was the gate's largest
    cost after the deep attack. Each row states its sample.
    """
    from deid.evaluation.utility import utility_protocols  # noqa: PLC0415 (sklearn import cost)

    rows: list[UtilityRow] = []
    # Earlier protocols (Gross et al. 2005 grouped CV; Moriarty et al.; consumer), on a bounded sample.
    idx = attack_sample(inputs, max_records=min(config.attack_sample, config.evidence_sample), seed=config.seed)
    unit = "cluster" if inputs.clusters is not None else "person"
    note = (f"evidence only, on all {inputs.n} records" if len(idx) == inputs.n else
            f"evidence only, on {len(idx)} of {inputs.n} records (whole {unit}s at random, seed {config.seed})")
    released, originals = inputs.fetch(idx)
    labels = {x: np.asarray(v)[idx] for x, v in inputs.labels.items()}
    for row in utility_protocols(labels=list(config.labels), originals=originals, original_labels=labels,
                                 original_people=inputs.people[idx], released=released, released_labels=labels,
                                 released_people=inputs.people[idx],
                                 released_groups=inputs.clusters[idx] if inputs.clusters is not None else None,
                                 folds=config.folds, repeats=config.repeats, seed=config.seed,
                                 **({"n_components": None} if inputs.kind == "features" else {})):
        rows.append(UtilityRow.from_dict({**row, "tolerance": config.tolerance, "evidence_only": True,
                                          "detail": f"{note}. {row['detail']}", "sample_records": int(len(idx)),
                                          "sample_of": inputs.n, "sample_seed": config.seed}))
    return rows


def utility_status_check(name: str, *, status: str, value: Any, threshold: Any, detail: str,
                         inconclusive: str, interval: tuple[float, float] | None = None,
                         n: int | None = None) -> Check:
    """A utility check whose blocking follows its status and the inconclusive policy."""
    passed = status in ("pass", "not_applicable") or (status == "inconclusive" and inconclusive == "release")
    return Check(name, passed, value, threshold, detail, status=status, interval=interval, n=n)
