"""The call signature of every release stage, as :func:`deid.operations.runner.run_release` calls it.

:class:`~deid.operations.runner.Steps` and :class:`~deid.operations.features.FeatureSteps` hold one callable per
stage; typed with these protocols, mypy checks that the plain runner's stage functions and the Prefect tasks
(:mod:`deid.tasks.stages`) accept the arguments the runner passes, by position and by keyword, and return the
contract it reads. Each protocol lists only what the runner passes: a stage function may take more (its
``logger``, defaulted), never less.

Returns typed ``Any`` are the lineage and person-index states (:mod:`deid.release.lineage_state`,
:mod:`deid.release.person_index`), held opaque by the contracts too (:class:`~deid.contracts.LineagePlanned`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from deid.contracts import (
    Aligned,
    Deidentified,
    Featurized,
    Ingested,
    LineageApplied,
    Partitioned,
    Published,
    RecordCounts,
    SignedReport,
    StagingLayout,
    UnreadableDrop,
)
from deid.evaluation.checks import Check
from deid.evaluation.gate_types import GateResult
from deid.operations.executors import Executor
from deid.release.staged import Staged
from deid.reporting.report import Report, SigningInfo
from deid.run_config import RunConfig

if TYPE_CHECKING:  # pragma: no cover - typing only (deid.operations.features imports this module)
    from deid.operations.features import FeatureDeidentified, FeatureIdentity, FeatureIngest, FeaturePartitioned
    from deid.release.manifest import ReleaseListing

# --------------------------------------------------------------------------- the image run's stages


class Preflight(Protocol):
    def __call__(self, config: RunConfig, /) -> SigningInfo: ...


class Recover(Protocol):
    def __call__(self, config: RunConfig, /) -> Sequence[str]: ...


class Ingest(Protocol):
    def __call__(self, drop: str, layout: StagingLayout, config: RunConfig, /, *,
                 executor: Executor | None = ...) -> Ingested | UnreadableDrop: ...


class OpenLineage(Protocol):
    def __call__(self, dataset: str, config: RunConfig, /) -> Any: ...


class ClaimPeople(Protocol):
    def __call__(self, ingested: Ingested, config: RunConfig, /) -> tuple[Ingested, Any]: ...


class Align(Protocol):
    def __call__(self, ingested: Ingested, layout: StagingLayout, config: RunConfig, executor: Executor, /) -> Aligned: ...


class Featurize(Protocol):
    def __call__(self, aligned: Aligned, layout: StagingLayout, config: RunConfig, executor: Executor, /
                 ) -> Featurized: ...


class Partition(Protocol):
    def __call__(self, ingested: Ingested, aligned: Aligned, featurized: Featurized, layout: StagingLayout,
                 config: RunConfig, executor: Executor, /, *, lineage_state: Any = ..., routing: Any = ...
                 ) -> Partitioned: ...


class Deidentify(Protocol):
    def __call__(self, partitioned: Partitioned, labels: Sequence[str], layout: StagingLayout, config: RunConfig,
                 executor: Executor, /) -> Deidentified: ...


class ApplyLineage(Protocol):
    def __call__(self, partitioned: Partitioned, deidentified: Deidentified, aligned: Aligned, layout: StagingLayout,
                 config: RunConfig, /, *, release_id: str) -> LineageApplied: ...


class RegisterLineage(Protocol):
    def __call__(self, dataset: str, state: Any, config: RunConfig, rel: Any = ..., /, *, mark: str | None = ...,
                 release_id: str | None = ...) -> Any: ...


class Stage(Protocol):
    def __call__(self, deidentified: Deidentified, ingested: Ingested, layout: StagingLayout, config: RunConfig, /,
                 *, release_id: str, lineage: LineageApplied | None = ..., executor: Executor | None = ...
                 ) -> Staged: ...


class Gate(Protocol):
    def __call__(self, deidentified: Deidentified, partitioned: Partitioned, config: RunConfig, /, *,
                 labels: Sequence[str], counts: RecordCounts, extra_checks: Sequence[Check] = ...,
                 staged: Staged | None = ..., lineage: LineageApplied | None = ..., executor: Executor | None = ...,
                 helper: Any = ...) -> GateResult: ...


class DatasetCard(Protocol):
    def __call__(self, staged: Staged, report: Report, /) -> ReleaseListing: ...


class Attest(Protocol):
    def __call__(self, staged: Staged, report: Report, config: RunConfig, /) -> Report: ...


class WriteReport(Protocol):
    def __call__(self, report: Report, config: RunConfig, /, *, validation: Mapping[str, Any] | None = ...,
                 staged: Staged | None = ...) -> SignedReport: ...


class Publish(Protocol):
    def __call__(self, staged: Staged, config: RunConfig, /, *, release_id: str) -> Published: ...


class PublishFailed(Protocol):
    def __call__(self, report_dir: Path, config: RunConfig, /, *, release_id: str, error: str) -> Path: ...


class Withhold(Protocol):
    def __call__(self, staged: Staged, /) -> None: ...


# --------------------------------------------------------------------------- a feature drop's stages


class FeatureIngestStage(Protocol):
    def __call__(self, drop: str, layout: StagingLayout, config: RunConfig, /) -> FeatureIngest | UnreadableDrop: ...


class FeatureIdentifyStage(Protocol):
    def __call__(self, ingested: FeatureIngest, config: RunConfig, /) -> FeatureIdentity: ...


class FeaturePartitionStage(Protocol):
    def __call__(self, ingested: FeatureIngest, identity: FeatureIdentity, config: RunConfig, /, *,
                 lineage_state: Any = ...) -> FeaturePartitioned: ...


class FeatureDeidentifyStage(Protocol):
    def __call__(self, ingested: FeatureIngest, identity: FeatureIdentity, part: FeaturePartitioned,
                 layout: StagingLayout, config: RunConfig, /) -> FeatureDeidentified: ...


class FeatureApplyLineageStage(Protocol):
    def __call__(self, ingested: FeatureIngest, identity: FeatureIdentity, part: FeaturePartitioned,
                 deid: FeatureDeidentified, config: RunConfig, /, *, release_id: str) -> LineageApplied: ...


class FeatureStageStage(Protocol):
    def __call__(self, ingested: FeatureIngest, deid: FeatureDeidentified, layout: StagingLayout, config: RunConfig,
                 /, *, release_id: str, lineage: LineageApplied | None = ...) -> Staged: ...


class FeatureGateStage(Protocol):
    def __call__(self, ingested: FeatureIngest, identity: FeatureIdentity, part: FeaturePartitioned,
                 deid: FeatureDeidentified, config: RunConfig, /, *, counts: RecordCounts,
                 staged: Staged | None = ..., lineage: LineageApplied | None = ...) -> GateResult: ...
