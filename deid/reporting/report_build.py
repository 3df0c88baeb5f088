"""The signed report of a run, built by pure functions from the stage contracts.

:func:`build_report` turns what the stages returned (:mod:`deid.contracts`) and the gate's
:class:`~deid.evaluation.gate_types.GateResult` into the typed :class:`~deid.reporting.report.Report`; the runner validates
it against the JSON schema before anything is committed. The record counts of the tiles
(``dataset``) and of the gate's accounting checks come from one :class:`RecordCounts`, so a
rejected run's report cannot contradict itself: what the gate judged is *withheld*, not
released and not suppressed.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deid.evaluation.membership import SCOPE
from deid.evaluation.validation import validation_section
from deid.contracts import (
    Aligned,
    ClusterInfo,
    Deidentified,
    Ingested,
    LineageApplied,
    PartitionInfo,
    Partitioned,
    RecordCounts,
    SmallPartition,
)
from deid.release.staged import Staged
from deid.method_registry import guarantee, release_guarantee
from deid.reporting.report import (
    Artifact,
    FileManifest,
    Check,
    DatasetSummary,
    Privacy,
    Report,
    SigningInfo,
    Utility,
)
from deid.run_config import RunConfig
from deid.bound import within_bound
from deid.release.lineage_anchor import head_doc

if TYPE_CHECKING:  # pragma: no cover - typing only
    from deid.anonymise.near_copy import NearCopyRepair
    from deid.evaluation.gate_types import GateResult

VERSION_PACKAGES = ("deid", "prefect", "dask", "distributed", "numpy", "opencv-python-headless", "scikit-learn",
                    "pyarrow", "cryptography")


def run_versions() -> dict[str, str | None]:
    """Installed version of each package the run depends on (None when not installed)."""
    out: dict[str, str | None] = {}
    for pkg in VERSION_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def lineage_section(config: RunConfig, dataset: str, partitioned: Partitioned | None,
                    lineage: LineageApplied | None, *, registered: bool) -> dict[str, Any]:
    """The report's ``lineage`` section: counts and decisions only (no pseudonym, fingerprint or cluster key)."""
    planned = partitioned.lineage if partitioned is not None else None
    if planned is None:
        why = ("not applicable: the method gives no identical image per cluster to register"
               if not config.lineage_applies else "not planned: nothing reached partitioning")
        return {"dataset": dataset, "applied": False, "detail": why}
    counts = dict(lineage.release.counts) if lineage else {}
    # The registry head as this run found it; a release that registers replaces it with the head after its
    # entry (runner: commit). Checked against the registry before every later run (deid.release.lineage_anchor).
    state = planned.state
    return {**planned.plan.summary(), "applied": True, "based_on_head": planned.plan.based_on_head,
            "registered": bool(registered and lineage), "release_counts": counts,
            # The mode every release of the dataset keeps (None: nothing registered before this run).
            **({"registry_head": head_doc(state), "color_mode": state.color_mode} if state is not None else {})}


def shared_configuration(config: RunConfig, *, labels: Sequence[str], license: str | None, notes: Sequence[str],
                         attribution: Mapping[str, str] | None = None,
                         identity: Mapping[str, Any] | None, partitions: Sequence[PartitionInfo],
                         small: Sequence[SmallPartition], clusters: Sequence[ClusterInfo]) -> dict[str, Any]:
    """The ``configuration`` entries of every run's report (images or feature vectors).

    The gate's settings and what the identity, partition and de-identify stages decided (counts only).
    """
    strength = config.spec.strength
    seed = config.release_seed
    assert seed is not None, "RunConfig draws its release seed on construction"  # narrows the Optional for mypy
    return {
        "labels": list(labels), "license": license, **dict(attribution or {}), "notes": list(notes),
        "identity": dict(identity) if identity is not None else None,
        "duplicate_ids": config.duplicate_ids, "small_partitions": config.small_partitions,
        "pca_components": config.pca_components,
        # Whether the method's seed was secret; never its value (deid.anonymise.randomness).
        "randomness": seed.to_report(), "utility_tolerance": config.gate.tolerance,
        "utility_protocol": "cross-fit", "utility_sample": config.gate.utility_sample,
        "utility_inconclusive": config.gate.utility_inconclusive, "gate_confidence": config.gate.confidence,
        "attack_sample": config.gate.attack_sample,
        **({"sigma": config.sigma} if strength == "sigma" else {}),
        **({"block": config.block} if strength == "block" else {}),
        "max_quarantine_fraction": config.gate.max_quarantine_fraction, "cv_folds": config.gate.folds,
        "cv_repeats": config.gate.repeats,
        "partitions": [{"name": p.name, "key": list(p.key), "records": p.records, "people": p.people}
                       for p in partitions],
        # Counts only, never the label values of a partition too small to release.
        "small_partitions_detail": [{"records": e.records, "people": e.people, "action": e.action} for e in small],
        "clusters": {"count": len(clusters), "sizes": sorted(c.size for c in clusters)},
    }


def configuration(config: RunConfig, *, ingested: Ingested, aligned: Aligned, partitioned: Partitioned,
                  deidentified: Deidentified, notes: Sequence[str], timings: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The report's ``configuration`` of an image run: :func:`shared_configuration` and the image stages' settings."""
    w, h = config.aligner.size
    return {
        **shared_configuration(config, labels=ingested.labels, license=ingested.license,
                               attribution=ingested.attribution, notes=notes,
                               identity=partitioned.identity, partitions=partitioned.partitions,
                               small=partitioned.small, clusters=deidentified.clusters),
        "canonical_size": [w, h], "color": config.color, "color_decision": config.color_reason,
        "canonical_eyes": [list(config.aligner.eye_left), list(config.aligner.eye_right)],
        "deep_attack_sample": config.gate.deep_attack_sample, "leak_threshold": config.gate.leak_threshold,
        "eye_sources": dict(aligned.eye_sources),
        # The pose spread of the aligned faces; with DEID_POSE_GROUPING_DEGREES, the yaw weight k-Same grouped with.
        "pose": {**aligned.pose, **({"grouping_degrees": config.pose_grouping_degrees}
                                    if config.pose_grouping_degrees else {})},
        # Landmark points and image sequences the method was given; k-same-m's cluster shape sources.
        "method_inputs": {**partitioned.inputs.to_dict(), "shape_sources": dict(deidentified.shape_sources)},
        "extra_manifest_columns": list(ingested.extra_columns),
        # drop.yaml's sensitive columns: names only (never values); the check sensitive_l_diversity says which
        # were released (every cluster l-diverse) and which withheld.
        "sensitive_columns": list(getattr(ingested, "sensitive", ())), "sensitive_l": config.sensitive_l,
        "sensitive_diversity": config.sensitive_diversity,
        "dask": config.dask_address or f"LocalCluster({config.dask_workers} workers)",
        "ksame_block_size": config.ksame_block_size,
        "stage_seconds": dict(timings),
    }


def dataset_summary(ingested_name: str, fingerprint: str, counts: RecordCounts, *, passed: bool,
                    quarantine_by_reason: Mapping[str, int],
                    near_copies: NearCopyRepair | None = None) -> DatasetSummary:
    """The tiles: released and withheld split what the gate judged, by its verdict.

    ``near_copies``: the de-identify stage's :class:`~deid.anonymise.near_copy.NearCopyRepair` (None: none).
    """
    return DatasetSummary(
        name=ingested_name, fingerprint=fingerprint, records_in=counts.records_in,
        records_released=counts.released(passed), records_withheld=counts.withheld(passed),
        records_suppressed=counts.suppressed, records_quarantined=counts.quarantined,
        quarantine_by_reason=dict(quarantine_by_reason),
        near_copy_repair=near_copies.to_dict() if near_copies is not None else None)


def privacy_section(gate: GateResult, k: int) -> Privacy:
    """The report's ``privacy``: the bound 1/k and what the gate measured against it (every attack, with its interval)."""
    return Privacy(
        bound=1.0 / k, max_rate=gate.max_rate, min_distinct_people_per_cluster=gate.min_people,
        max_person_share=gate.max_person_share, exact_bound=gate.exact_bound, attack_sample=gate.attack_sample,
        partitions=[dict(r) for r in getattr(gate, "partitions", ())] or None,
        membership=getattr(gate, "membership", None), scope=dict(SCOPE),
        reidentification=list(gate.reidentification))


def exact_bound_holds(gate: GateResult, k: int) -> bool:
    """Did the gate find the exact 1/k bound: identical copies per cluster, >= k people each, no one above 1/k?"""
    return bool(gate.exact_bound and gate.min_people is not None and gate.min_people >= k
                and gate.max_person_share is not None and within_bound(gate.max_person_share, k))


def verdict_fields(*, release_id: str, run_id: str, created_at: str, config: RunConfig, gate: GateResult,
                   promise: str, dataset: DatasetSummary, artifacts: Sequence[Artifact],
                   signing: SigningInfo, versions: Mapping[str, str | None],
                   file_manifest: FileManifest | None = None) -> dict[str, Any]:
    """The :class:`~deid.reporting.report.Report` fields every run's report has (images or feature vectors).

    ``promise`` is what the method promises on this kind of drop; the report's guarantee is that, or
    the exact bound when the gate found it in the data (:func:`release_guarantee`).
    ``release_dir``, ``artifacts`` and ``file_manifest`` (the images, :mod:`deid.release.manifest`)
    describe where the release *will* be once published (the report is signed before the staged
    release is renamed into place); a rejected run lists none.
    """
    passed = gate.passed
    guarantee_text = release_guarantee(config.method, config.k, exact=exact_bound_holds(gate, config.k),
                                       promise=promise)
    return dict(
        release_id=release_id, run_id=run_id, verdict="released" if passed else "rejected", k=config.k,
        method=config.method, created_at=created_at, reasons=list(gate.reasons), warnings=list(gate.warnings),
        guarantee=guarantee_text, dataset=dataset, checks=[Check.from_gate(c) for c in gate.checks],
        privacy=privacy_section(gate, config.k), utility=[Utility.from_row(u.to_dict()) for u in gate.utility],
        artifacts=list(artifacts) if passed else [], file_manifest=file_manifest if passed else None,
        release_dir=str(config.releases_dir / release_id) if passed else None, signing=signing,
        versions=dict(versions))


def build_report(*, release_id: str, run_id: str, created_at: str, config: RunConfig, ingested: Ingested,
                 aligned: Aligned, partitioned: Partitioned, deidentified: Deidentified,
                 lineage: LineageApplied | None, staged: Staged | None, gate: GateResult, counts: RecordCounts,
                 quarantine_by_reason: Mapping[str, int], validation: Mapping[str, Any], notes: Sequence[str],
                 timings: Mapping[str, Mapping[str, Any]], signing: SigningInfo,
                 versions: Mapping[str, str | None]) -> Report:
    """The run's :class:`~deid.reporting.report.Report` from its stage contracts and the gate's result (pure).

    ``release_dir`` and ``artifacts`` describe where the release *will* be once published: the
    report is signed before the staged release is renamed into place.
    """
    fields = verdict_fields(release_id=release_id, run_id=run_id, created_at=created_at, config=config, gate=gate,
                            promise=guarantee(config.method, config.k),
                            dataset=dataset_summary(ingested.name, ingested.fingerprint, counts, passed=gate.passed,
                                                    quarantine_by_reason=quarantine_by_reason,
                                                    near_copies=deidentified.near_copies),
                            artifacts=staged.artifacts if staged else (), signing=signing, versions=versions,
                            file_manifest=staged.manifest if staged else None)
    near = deidentified.near_copies
    warn = near.warning(counts.judged) if near is not None else None
    if warn:  # too many near copies for a release of distinct people: said plainly, whatever the verdict
        fields["warnings"] = [*fields["warnings"], warn]
    return Report(
        **fields,
        lineage=lineage_section(config, ingested.dataset, partitioned, lineage, registered=gate.passed),
        validation=validation_section(validation),
        configuration=configuration(config, ingested=ingested, aligned=aligned, partitioned=partitioned,
                                    deidentified=deidentified, notes=notes, timings=timings))


def build_rejection(*, release_id: str, run_id: str, created_at: str, config: RunConfig, drop: str | Path,
                    reason: str, fingerprint: str, signing: SigningInfo, versions: Mapping[str, str | None],
                    check: str = "drop_readable") -> Report:
    """The report of a run that could not get as far as the gate (unreadable drop, environment failure).

    ``fingerprint`` covers only what could be read without reading the drop: its manifest.csv,
    or a feature drop's drop.yaml (``config.kind == "features"``).
    """
    reason = public_text(reason, drop=drop, roots=(config.data_path.parent, config.reports_path.parent))
    if config.kind == "features":
        from deid.anonymise.features import feature_guarantee  # noqa: PLC0415 - NumPy, only for feature drops

        promise, scope = feature_guarantee(config.method, config.k), "drop.yaml only (the feature table was not read)"
    else:
        promise, scope = guarantee(config.method, config.k), "manifest.csv only (no image was read)"
    return Report(
        release_id=release_id, run_id=run_id, verdict="rejected", reasons=[reason], k=config.k,
        method=config.method, guarantee=promise, created_at=created_at,
        dataset=DatasetSummary(name=config.name or Path(drop).name or "drop", fingerprint=fingerprint,
                               records_in=0, records_released=0, records_withheld=0, records_suppressed=0,
                               records_quarantined=0),
        checks=[Check(check, False, None, None, reason, status="fail")],
        privacy=Privacy(bound=1.0 / config.k), utility=[], validation={}, artifacts=[], release_dir=None,
        signing=signing, versions=dict(versions),
        configuration={"labels": list(config.labels or []), "fingerprint_scope": scope,
                       **({"kind": config.kind} if config.kind != "images" else {})})


# An absolute POSIX path of two or more components ("1/k" and "a/b" are not: no leading slash after a space).
_ABSOLUTE = re.compile(r"(?<![\w.~])/(?:[^\s/'\",;:()]+/)+[^\s/'\",;:()]*")


def public_text(text: str, *, drop: str | os.PathLike[str] | None, roots: Sequence[str | os.PathLike[str]] = ()) -> str:
    """``text`` with no absolute path: the drop's path becomes its directory name, a project path relative.

    A report goes to recipients; the steward's directory layout (home directory, user name,
    mount points) is none of their business. The drop is named by its directory name (as
    ``dataset.name`` is), a path under one of ``roots`` (the project: data/, reports/) relative
    to it, and any other absolute path by its last component.
    """
    out = str(text)
    if drop is not None:
        name = Path(drop).name or "drop"
        for form in sorted({os.fspath(drop), os.path.abspath(drop), os.path.realpath(drop)}, key=len, reverse=True):
            if len(form) > 1:
                out = out.replace(form.rstrip("/"), name)
    for root in sorted({os.path.realpath(r) for r in roots} | {os.path.abspath(r) for r in roots},
                       key=len, reverse=True):
        if len(root) > 1:
            out = out.replace(root.rstrip("/") + "/", "")
    return _ABSOLUTE.sub(lambda m: Path(m.group()).name or "/", out)
