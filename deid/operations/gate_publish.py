"""The gate and the stages after it: the gate's inputs streamed and the core gate run, the dataset card,
the attestation and the signed report written, then the release published or withheld.

One function per stage, with the contract :mod:`deid.operations` describes.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from deid.evaluation.checks import Check
from deid.contracts import (
    Deidentified,
    LineageApplied,
    Partitioned,
    Published,
    RecordCounts,
    SignedReport,
    StagingLayout,
)
from deid.release.staged import Staged
from deid.errors import Quarantined
from deid.operations.executors import Executor
from deid.run_config import RunConfig
from deid.operations import worker_gate

from deid.operations.run_setup import Logger, now_iso, signing_key

log = logging.getLogger(__name__)


def gate_inputs(deidentified: Deidentified, partitioned: Partitioned, config: RunConfig, *, labels: Sequence[str],
                counts: RecordCounts, republished=None, file_metadata: Mapping[str, list[str]] | None = None,
                extra_checks: Sequence[Check] = ()):
    """The gate's :class:`~deid.evaluation.gate_types.GateInputs`: the would-be release and its originals, streamed.

    Nothing here reads the staged release: a :class:`~deid.evaluation.gate_parts.GateHelper` builds them
    while it is staged, and the gate adds ``file_metadata`` and ``extra_checks`` (staging's) after.
    """
    from deid.evaluation.gate_types import GateInputs  # noqa: PLC0415
    from deid.anonymise.methods import method_runner  # noqa: PLC0415

    shape = config.shape_hw
    common = dict(records_in=counts.records_in, suppressed=counts.suppressed, quarantined=counts.quarantined,
                  partition_failed=partitioned.failed, partition_detail=partitioned.small_detail,
                  file_metadata=dict(file_metadata or {}), extra_checks=tuple(extra_checks),
                  # The attacker re-runs the method with the seed the shared policy gives it
                  # (deid.anonymise.randomness: an independent one unless DEID_SEED fixed the release's).
                  deidentify=method_runner(config.method, shape=shape, k=config.k, sigma=config.sigma,
                                           block=config.block, n_components=config.pca_components,
                                           seed=config.release_seed.for_parrot(),
                                           # image sequences: the model the release was made with
                                           options=partitioned.inputs.gate_options(config.method)),
                  republished=republished)
    if not deidentified.parts:
        return GateInputs.empty(shape=shape, **common)
    # The landmark points the method used: the parrot and the utility folds re-run it with them.
    rec = worker_gate.gate_records(str(partitioned.root), [str(p) for p in deidentified.parts], labels=list(labels),
                              select=config.select(labels), partition_keys=partitioned.gate_keys,
                              points=partitioned.inputs.gate_points(config.method),
                              skip=deidentified.suppressed, suspects=partitioned.identity_suspects)
    return GateInputs(shape=shape, people=rec.people, image_index=rec.image_index, own_distance=rec.own_distance,
                      fetch=rec.fetch, clusters=rec.clusters, partitions=rec.partitions, labels=rec.labels,
                      points=rec.points, suspects=rec.suspects, **common)


def start_gate(deidentified: Deidentified, partitioned: Partitioned, config: RunConfig, *, labels: Sequence[str],
               counts: RecordCounts, lineage: LineageApplied | None = None):
    """A large release's :class:`~deid.evaluation.gate_parts.GateHelper`, started before staging (None for a small one).

    It builds the gate's inputs (:func:`gate_inputs`) and runs the deep attackers on the core
    staging leaves idle; :func:`gate` takes them. The caller closes it.
    """
    from deid.evaluation.gate_parts import GateHelper, wants_helper  # noqa: PLC0415

    gconfig = config.gate_config(labels)
    if not deidentified.parts or not wants_helper(deidentified.records, gconfig):
        return None
    # Only what gate_inputs reads travels to the helper (not the identity report, nor the lineage state).
    light = replace(partitioned, identity=None, lineage=None, quarantined=())
    return GateHelper.start(gconfig, gate_inputs, deidentified=deidentified, partitioned=light, config=config,
                            labels=list(labels), counts=counts,
                            republished=lineage.republished if lineage is not None else None)


def gate(deidentified: Deidentified, partitioned: Partitioned, config: RunConfig, *, labels: Sequence[str],
         counts: RecordCounts, extra_checks: Sequence[Check] = (), staged: Staged | None = None,
         lineage: LineageApplied | None = None, logger: Logger | None = None, executor: Executor | None = None,
         helper=None):
    """Stream the would-be release and its originals into the core gate (:func:`deid.evaluation.gate.evaluate`).

    ``executor``: a small run's process pool runs the gate's attackers and utility parts (same figures).
    ``helper``: a large release's :class:`~deid.evaluation.gate_parts.GateHelper` (:func:`start_gate`), which
    built the inputs and ran the deep attackers ahead (same figures).

    With a lineage, the republished clusters are counted and attacked as
    :func:`deid.evaluation.gate_structure.structural_checks` and :func:`deid.evaluation.gate_privacy.privacy_checks` say
    (registered members; counterfeit rows of no one).
    """
    from deid.evaluation.gate import evaluate  # noqa: PLC0415

    lg = logger or log
    gconfig = config.gate_config(labels)
    staging = dict(file_metadata=dict(staged.file_metadata) if staged else {}, extra_checks=tuple(extra_checks))
    inputs = None
    if helper is not None:
        try:
            inputs = replace(helper.inputs(), **staging)
        except Exception as exc:  # noqa: BLE001 - the gate then builds its inputs here, as without a helper
            lg.warning("gate: the helper process could not build the gate's inputs (%s); building them here", exc)
            helper = None
    if inputs is None:
        inputs = gate_inputs(deidentified, partitioned, config, labels=labels, counts=counts,
                             republished=lineage.republished if lineage is not None else None, **staging)
    result = evaluate(inputs, gconfig, executor=executor, helper=helper)
    lg.info("gate: " + ("passed" if result.passed else "failed - " + "; ".join(result.reasons)))
    return result


# --------------------------------------------------------------------------- report -> publish


def dataset_card(staged: Staged, report, *, logger: Logger | None = None):
    """Write the dataset card (the gate's figures) into the staged release, then list every release file.

    Runs after the gate and before the report is signed: the signed report lists the card's sha256.
    Returns the :class:`~deid.release.manifest.ReleaseListing` (the files outside the manifest, the
    manifest) the report takes; the images were hashed as they were written (stage) and are never
    written again: not re-read here.
    """
    from deid.release.card import DatasetCard, write_card  # noqa: PLC0415
    from deid.release.manifest import list_release  # noqa: PLC0415

    path = write_card(staged.dir, DatasetCard.from_report(report.to_dict()))
    (logger or log).info("dataset card: %s", path)
    _, listing = list_release(staged.dir, known=staged.images)
    return listing


def attest(staged: Staged, report, config: RunConfig, *, logger: Logger | None = None):
    """Write the release's signed attestation (``ATTESTATION.json`` + ``.sig``) into the staged release.

    Runs after the dataset card (``report`` lists the card, the tables and ``MANIFEST.sha256``) and
    before the report is signed and the release published: returns the report with the two files
    added to its ``artifacts``, so the signed report covers them too (:mod:`deid.release.attestation`).
    """
    from deid.release.attestation import write_attestation  # noqa: PLC0415
    from deid.reporting.attestation import attestation_from_report  # noqa: PLC0415
    from deid.reporting.report import Artifact, hash_file  # noqa: PLC0415

    written = write_attestation(staged.dir, attestation_from_report(report), signing_key(config))
    added = [Artifact(p.name, *hash_file(p)) for p in written]
    (logger or log).info("attestation: %s (signed)", written[0])
    return replace(report, artifacts=sorted([*report.artifacts, *added], key=lambda a: a.path))


def write_report(report, config: RunConfig, *, validation: Mapping | None = None, staged: Staged | None = None,
                 logger: Logger | None = None) -> SignedReport:
    """Render report.html and the validation page, then sign report.json; every run gets one.

    Runs *before* publishing: ``staged`` is the staged release that passed the gate (its sample
    faces go into report.html); a rejected run passes None and shows no faces.
    """
    from deid.reporting.html_report import sample_release_images, write_report_bundle  # noqa: PLC0415
    from deid.release.signing import warn_development_key  # noqa: PLC0415
    from deid.operations.safety import fault_enospc  # noqa: PLC0415

    key = signing_key(config)
    if key.origin == "development":  # said once per process (ensure_signing_key may have said it already)
        warn_development_key(key.path, log=logger or log)
    report_dir = config.reports_path / report.release_id
    fault_enospc("reports", report_dir)
    samples = sample_release_images(staged.dir, n=24, seed=0) if staged and report.verdict == "released" else None
    path = write_report_bundle(report_dir, report, key, sample_images=samples,
                               validation_results=dict(validation) if validation else None)
    (logger or log).info(f"report: {path} ({report.verdict})")
    return SignedReport(path=Path(path), public_key=key.public_path, key_origin=key.origin)


def publish(staged: Staged, config: RunConfig, *, release_id: str, logger: Logger | None = None) -> Published:
    """File the linkage record, then publish by one atomic rename (only after the report is signed)."""
    from deid.release.linkage import linkage_path  # noqa: PLC0415
    from deid.release.publish import commit_release  # noqa: PLC0415

    target = linkage_path(config.data_path, release_id)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.replace(staged.linkage, target)
    try:
        final = commit_release(staged.dir, config.releases_dir / release_id)
    except BaseException:
        # Nothing was published: the linkage record goes back to private staging with its release.
        os.replace(target, staged.linkage)
        raise
    (logger or log).info(f"publish: {staged.records} records released to {final} (linkage record {target})")
    return Published(path=Path(final), linkage=target)


def publish_failed_addendum(report_dir: Path, config: RunConfig, *, release_id: str, error: str) -> Path:
    """A publish that failed after the report was signed: say so in a signed addendum."""
    from deid.operations.safety import write_signed_addendum  # noqa: PLC0415

    return write_signed_addendum(Path(report_dir), {
        "release_id": release_id, "event": "publish_failed", "release_published": False, "created_at": now_iso(),
        "detail": f"publishing failed after the report was signed ({error}); the release was not published"},
        signing_key(config))


def withhold(staged: Staged, *, logger: Logger | None = None) -> None:
    """A rejected run publishes nothing: drop the staged release and its linkage record."""
    from deid.release.publish import discard  # noqa: PLC0415

    discard(staged.dir)
    staged.linkage.unlink(missing_ok=True)
    (logger or log).info("withhold: staged release removed; nothing published")


def quarantine_summary(quarantined: Sequence[Quarantined], layout: StagingLayout) -> dict[str, int]:
    """Write the quarantine table and count it by reason."""
    from deid.intake.ingest import write_quarantine  # noqa: PLC0415

    write_quarantine(list(quarantined), layout.quarantine)
    return dict(Counter(q.code for q in quarantined))
