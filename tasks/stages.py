"""Thin Prefect tasks around the core stages (:class:`deid.operations.runner.Steps`): contracts in, a contract out.

Each task only adds what Prefect gives: a task run in the UI, its log lines (the stage logs its
progress and warnings to the run logger) and retries. The order of the stages is :mod:`deid.operations.runner`'s;
:data:`STEPS` hands these tasks to it. Heavy work goes from the core stages to the Dask cluster
as plain core functions, so Dask workers never import Prefect (in Prefect's ephemeral mode each
worker that does would start its own temporary API server, ~10 s each).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import opaque

from deid.operations import (deidentify_lineage, features, featurize_partition, gate_publish, ingest_align, person_search,
                             release_staging, run_setup)
from deid.operations.features import FeatureSteps
from deid.operations.runner import Steps

TASK: dict[str, Any] = dict(cache_policy=NO_CACHE)
RETRY: dict[str, Any] = dict(retries=1, retry_delay_seconds=2, **TASK)
P = ParamSpec("P")
R = TypeVar("R")




@task(name="preflight", **TASK)
def preflight(config):
    """Before any work: the signing key loads (readable, mode 0600, passphrase) and every location is writable."""
    return run_setup.preflight(config)


@task(name="recover", **TASK)
def recover(config):
    """Remove what killed runs left (temporary releases, dead runs' staging, partial files)."""
    return run_setup.recover_leftovers(config, logger=get_run_logger())


@task(name="ingest", **TASK)
def ingest(drop, layout, config, executor=None):
    """Validate the manifest and stage the image bytes as Parquet."""
    return ingest_align.ingest_drop(drop, layout, config, logger=get_run_logger(), executor=executor)


@task(name="person-index", **TASK)
def claim_people(ingested, config):
    """Look the drop's people up in the project's person index: refused or routed when another dataset holds them."""
    return person_search.claim_people(ingested, config, logger=get_run_logger())


@task(name="lineage-open", **TASK)
def open_lineage(dataset, config):
    """Load and verify the dataset's lineage registry; settle releases an interrupted run left pending."""
    return deidentify_lineage.open_lineage(dataset, config, logger=get_run_logger())


@task(name="align", **RETRY)
def align(ingested, layout, config, executor):
    """Align every face on the cluster, one task per Parquet row group."""
    return ingest_align.align(ingested, layout, config, executor, logger=get_run_logger())


@task(name="featurize", **RETRY)
def featurize(aligned, layout, config, executor):
    """Fit eigenfaces on the aligned set, then project every part on the cluster."""
    return featurize_partition.featurize(aligned, layout, config, executor, logger=get_run_logger())


@task(name="partition", **TASK)
def partition(ingested, aligned, featurized, layout, config, executor, *, lineage_state=None, routing=None):
    """Resolve who is who, then split the faces by utility labels into Hive-partitioned Parquet."""
    return featurize_partition.partition(ingested, aligned, featurized, layout, config, executor, lineage_state=lineage_state,
                              routing=routing, logger=get_run_logger())


@task(name="deidentify", **RETRY)
def deidentify(partitioned, labels, layout, config, executor):
    """De-identify each partition (k-Same family, or a comparison filter), one Dask task per partition."""
    return deidentify_lineage.deidentify(partitioned, labels, layout, config, executor, logger=get_run_logger())


@task(name="lineage-release", **TASK)
def apply_lineage(partitioned, deidentified, aligned, layout, config, *, release_id):
    """The release as the lineage sees it, the returning people's registered averages, the lineage checks."""
    return deidentify_lineage.apply_lineage(partitioned, deidentified, aligned, layout, config, release_id=release_id,
                                  logger=get_run_logger())


@task(name="lineage-register", **TASK)
def register_lineage(dataset, state, config, rel=None, *, mark=None, release_id=None):
    """Append a release to the registry (pending), or mark it ``published`` / ``abandoned``."""
    return deidentify_lineage.register_lineage(dataset, state, config, rel, mark=mark, release_id=release_id,
                                     logger=get_run_logger())


@task(name="stage-release", **TASK)
def stage(deidentified, ingested, layout, config, *, release_id, lineage=None, executor=None):
    """Write the would-be release inside the run's staging directory and validate exactly that."""
    return release_staging.stage(deidentified, ingested, layout, config, release_id=release_id, lineage=lineage,
                          logger=get_run_logger(), executor=executor)


@task(name="gate", **TASK)
def gate(deidentified, partitioned, config, *, labels, counts, extra_checks=(), staged=None, lineage=None,
         executor=None, helper=None):
    """Run the core gate on the would-be release and its originals (a large release's helper started ahead)."""
    return gate_publish.gate(deidentified, partitioned, config, labels=labels, counts=counts, extra_checks=extra_checks,
                         staged=staged, lineage=lineage, logger=get_run_logger(), executor=executor, helper=helper)


@task(name="dataset-card", **TASK)
def dataset_card(staged, report):
    """Write the dataset card (the gate's figures) into the staged release, then hash every release file."""
    return gate_publish.dataset_card(staged, report, logger=get_run_logger())


@task(name="attestation", **TASK)
def attest(staged, report, config):
    """Write the release's signed ATTESTATION.json into the staged release (before the report is signed)."""
    return gate_publish.attest(staged, report, config, logger=get_run_logger())


@task(name="report", **TASK)
def write_report(report, config, *, validation=None, staged=None):
    """Render report.html and the validation page, then sign report.json (released or rejected)."""
    return gate_publish.write_report(report, config, validation=validation, staged=staged, logger=get_run_logger())


@task(name="publish", **TASK)
def publish(staged, config, *, release_id):
    """File the linkage record, then publish by one atomic rename (called only after the report is signed)."""
    return gate_publish.publish(staged, config, release_id=release_id, logger=get_run_logger())


@task(name="addendum", **TASK)
def publish_failed(report_dir, config, *, release_id, error):
    """A publish that failed after the report was signed: say so in a signed addendum."""
    return gate_publish.publish_failed_addendum(report_dir, config, release_id=release_id, error=error)


@task(name="withhold", **TASK)
def withhold(staged):
    """A rejected run publishes nothing: drop the staged release and its linkage record."""
    gate_publish.withhold(staged, logger=get_run_logger())


@task(name="feature-ingest", **TASK)
def feature_ingest(drop, layout, config):
    """Read and validate the feature drop, stage its usable records."""
    return features.ingest_features(drop, layout, config, logger=get_run_logger())


@task(name="feature-identity", **TASK)
def feature_identify(ingested, config):
    """Who is who: near-duplicate vectors under different ids made one person."""
    return features.identify_features(ingested, config, logger=get_run_logger())


@task(name="feature-partition", **TASK)
def feature_partition(ingested, identity, config, *, lineage_state=None):
    """The drop checks, the lineage plan (returning people keep their clusters), then the label partitions."""
    return features.partition_features(ingested, identity, config, lineage_state=lineage_state,
                                       logger=get_run_logger())


@task(name="feature-deidentify", **TASK)
def feature_deidentify(ingested, identity, partitioned, layout, config):
    """De-identify the feature vectors of every partition."""
    return features.deidentify_feature_partitions(ingested, identity, partitioned, layout, config,
                                                  logger=get_run_logger())


@task(name="feature-lineage-release", **TASK)
def feature_apply_lineage(ingested, identity, partitioned, deidentified, config, *, release_id):
    """The feature release as the lineage sees it, returning people's stored vectors, the lineage checks."""
    return features.apply_feature_lineage(ingested, identity, partitioned, deidentified, config,
                                          release_id=release_id, logger=get_run_logger())


@task(name="feature-stage-release", **TASK)
def feature_stage(ingested, deidentified, layout, config, *, release_id, lineage=None):
    """Write the would-be feature release inside the run's staging directory, its linkage record beside it."""
    return features.stage_features(ingested, deidentified, layout, config, release_id=release_id, lineage=lineage,
                                   logger=get_run_logger())


@task(name="feature-gate", **TASK)
def feature_gate(ingested, identity, partitioned, deidentified, config, *, counts, staged=None, lineage=None):
    """Run the core gate, with the feature-space attackers, on the would-be release and its originals."""
    return features.gate_features(ingested, identity, partitioned, deidentified, config, counts=counts,
                                  staged=staged, lineage=lineage, logger=get_run_logger())


def _opaque(t: Callable[P, R]) -> Callable[P, R]:
    """``t`` called with every argument in Prefect's ``opaque``: resolved at the top level, never walked into.

    The runner passes finished contracts, never futures; walking into them (a report's checks and
    validation results, the gate's inputs) cost the run's process ~0.35 s of CPU per run (measured).
    """
    @functools.wraps(t)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        # Each argument in its wrapper: Prefect resolves it to the value before calling the stage.
        return cast(Callable[..., R], t)(*map(opaque, args), **{k: opaque(v) for k, v in kwargs.items()})
    return call


# One keyword per stage (not a dict of them): mypy checks each task against its stage's signature
# (deid.operations.stage_signatures).
FEATURE_STEPS = FeatureSteps(
    ingest=_opaque(feature_ingest), identify=_opaque(feature_identify), partition=_opaque(feature_partition),
    deidentify=_opaque(feature_deidentify), apply_lineage=_opaque(feature_apply_lineage), stage=_opaque(feature_stage),
    gate=_opaque(feature_gate))

# The run's stages as Prefect tasks, for deid.operations.runner.run_release (which owns their order).
STEPS = Steps(
    preflight=_opaque(preflight), recover=_opaque(recover), ingest=_opaque(ingest),
    claim_people=_opaque(claim_people), open_lineage=_opaque(open_lineage), align=_opaque(align),
    featurize=_opaque(featurize), partition=_opaque(partition), deidentify=_opaque(deidentify),
    apply_lineage=_opaque(apply_lineage), register_lineage=_opaque(register_lineage), stage=_opaque(stage),
    gate=_opaque(gate), dataset_card=_opaque(dataset_card), attest=_opaque(attest), write_report=_opaque(write_report),
    publish=_opaque(publish), publish_failed=_opaque(publish_failed), withhold=_opaque(withhold),
    features=FEATURE_STEPS)
