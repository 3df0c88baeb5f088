"""The stages of a feature drop's release: ingest, who is who, partitions, de-identify, stage, gate, report.

The feature path of a release, as plain core functions without Prefect or Dask (a feature
drop is a matrix: nothing to align, nothing to distribute). :func:`deid.operations.runner.run_release`
runs a drop whose ``drop.yaml`` says ``kind: features`` through :class:`FeatureSteps` (the
Prefect flow swaps in its tasks), inside the runner's one order of commitment
(:mod:`deid.operations.safety`: pre-flight, recovery, lock; report validated, card, attestation, signed,
publish by one rename or withhold; signed rejection of an unreadable drop; signed addendum
when publishing fails). The stages:

1. **ingest** (:func:`ingest_features`): the drop is read and validated
   (:func:`deid.intake.features.read_feature_drop`; bad rows quarantined with reasons) and
   staged as ``ingested_features.parquet``; an unreadable drop is an :class:`~deid.contracts.UnreadableDrop`;
2. **identity** (:func:`identify_features`): subject ids normalised, and records whose
   standardised vectors are near-duplicates under different ids made one person
   (:func:`deid.anonymise.identity.resolve_people`, the eigenface rule on the vectors);
3. **partition** (:func:`partition_features`) by the utility labels (:func:`deid.anonymise.partition.plan_partitions`);
4. **de-identify** (:func:`deidentify_feature_partitions`): the method on the vectors
   (:func:`deid.anonymise.features.deidentify_vectors`), staged as ``deidentified_features.parquet``;
5. **stage** (:func:`stage_features`) the would-be release (:func:`deid.release.vectors.stage_vector_release`)
   inside the staging directory, with its encrypted linkage record beside it;
6. **gate** (:func:`gate_features`): the same checks as for faces, with the feature-space
   attackers and the feature near-copy rule;
7. **report** (:func:`feature_report`): the same :class:`~deid.reporting.report.Report` model as for faces.

Successive releases of one dataset go through the image path's lineage registry
(:mod:`deid.release.lineage`, m-invariance after Xiao & Tao 2007) when the method gives every
cluster member the identical vector (the k-Same family, ``RunConfig.lineage_applies``): the
partition stage plans the lineage on the effective people (:func:`plan_feature_lineage`; a
record's fingerprint is the SHA-256 of its float32 vector bytes), only new people are clustered,
and :func:`apply_feature_lineage` releases returning people's records as their registered
cluster's stored vector, bit for bit, adds the counterfeits of republished clusters at staging,
and runs the gate's lineage checks (structure against the registry, the differencing attack in
feature space). The runner registers the release before signing, as for faces.
"""
from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.anonymise.features import deidentify_vectors, feature_guarantee, vector_method_runner
from deid.anonymise.identity import PeopleResolution, normalize_subject_id, resolve_people
from deid.anonymise.methods import K_METHODS, method_spec
from deid.anonymise.partition import PartitionPlan, plan_partitions
from deid.anonymise.randomness import ReleaseSeed
from deid.contracts import (
    ClusterInfo,
    LineageApplied,
    LineagePlanned,
    PartitionInfo,
    RecordCounts,
    ReleaseRows,
    SmallPartition,
    StagingLayout,
    UnreadableDrop,
    small_detail,
)
from deid.release.staged import Staged
from deid.errors import ConfigError, DataError, Quarantined
from deid.evaluation.checks import Check
from deid.evaluation.gate_types import GateInputs, GateResult
from deid.evaluation.gate import evaluate
from deid.evaluation.validation import drop_checks, validation_section
from deid.intake.features import INGESTED, FeatureDrop, read_feature_drop
from deid.operations import stage_signatures as sig
from deid.reporting.report import Report, SigningInfo, dataset_fingerprint
from deid.reporting.report_build import dataset_summary, lineage_section, shared_configuration, verdict_fields
from deid.run_config import RunConfig
from deid.schemas.arrow import FEATURE_RELEASE_BASE_COLUMNS

log = logging.getLogger(__name__)
Logger = logging.Logger | logging.LoggerAdapter

DEIDENTIFIED = "deidentified_features.parquet"
KIND = "features"
# The lineage's differencing attack on feature vectors: an exact match is a difference within this
# share of the mean feature standard deviation (mean absolute error at the averages' scale). The
# stored vectors are float32 means, not rounded to grey levels: float32 rounding explains about
# 1e-6 of a feature's spread, a wrong record misses by about a feature's spread over the cluster size.
FEATURE_DIFFERENCE_TOLERANCE = 0.01


# --------------------------------------------------------------------------- typed stage results


@dataclass(frozen=True)
class FeatureIngest:
    """The ingest stage: the parsed drop and where its usable records were staged."""

    drop: FeatureDrop
    ingested: Path
    fingerprint: str
    validation: Mapping[str, Any] = field(default_factory=dict)  # Great Expectations suites by table
    checks: tuple[Check, ...] = ()  # the gate checks of the suites that must pass


@dataclass(frozen=True)
class FeatureIdentity:
    """Effective person of every staged record (aligned with ``FeatureDrop.record_ids``)."""

    person: np.ndarray
    resolution: PeopleResolution
    quarantined: tuple[Quarantined, ...]
    keep: np.ndarray  # records not quarantined by the identity check (duplicate_ids=quarantine)


@dataclass(frozen=True)
class FeatureDeidentified:
    """The de-identified records: indices into the staged records, their vectors, clusters and partitions."""

    rows: np.ndarray
    vectors: np.ndarray
    clusters: tuple[str, ...]
    partitions: tuple[str, ...]
    cluster_summary: tuple[ClusterInfo, ...]
    path: Path | None


# --------------------------------------------------------------------------- stages


def ingest_feature_drop(drop_dir: str | os.PathLike, staging: Path, *, labels: list[str] | None = None,
                        name: str | None = None, max_bytes: int | None = None) -> FeatureIngest:
    """Read and validate the drop, stage its usable records (``ingested_features.parquet``).

    Raises :class:`~deid.errors.DropError` for a drop that cannot be read at all.
    """
    drop = read_feature_drop(drop_dir, labels=labels, name=name, max_bytes=max_bytes)
    path = Path(staging) / INGESTED
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(drop.to_table(), tmp)
    os.replace(tmp, path)
    fingerprint = dataset_fingerprint(drop.config_bytes, [drop.table_sha256])
    log.info("ingest: %d of %d feature records staged (dim %d), %d quarantined", len(drop.record_ids),
             drop.records_in, drop.dim, len(drop.quarantined))
    return FeatureIngest(drop, path, fingerprint)


def _standardised(vectors: np.ndarray) -> np.ndarray:
    v = np.asarray(vectors, dtype=np.float64)
    sd = v.std(axis=0)
    return (v - v.mean(axis=0)) / np.where(sd > 0, sd, 1.0)


def resolve_feature_people(drop: FeatureDrop, *, policy: str = "merge") -> FeatureIdentity:
    """Who is who: normalised subject ids, and near-duplicate vectors under different ids made one person.

    The vectors are standardised (each feature divided by its standard deviation) so that the
    rule has no unit; a pair under different ids closer than
    :data:`deid.anonymise.identity.NEAR_DUPLICATE_RATIO` x the median nearest-other-person
    distance is one person (``policy="merge"``) or both are quarantined (``"quarantine"``).
    """
    if policy not in ("merge", "quarantine"):
        raise ConfigError(f"duplicate_ids={policy!r} must be 'merge' or 'quarantine'")
    n = len(drop.record_ids)
    X = _standardised(drop.vectors) if n else None
    res = resolve_people(list(drop.subject_ids), X, space="feature")
    res = res.named(drop.record_ids)  # the report names a merge by its records' staging ids, never by subject id
    person = np.asarray(res.person, dtype=object)
    keep = np.ones(n, dtype=bool)
    quarantined: list[Quarantined] = []
    if policy == "quarantine" and res.flagged_records:
        for i in res.flagged_records:
            keep[i] = False
            quarantined.append(Quarantined(drop.record_ids[i], drop.source_ids[i], "same_face_other_id",
                                           "the feature vector is a near-duplicate of a record under another "
                                           "subject id (duplicate_ids=quarantine)", "identity"))
    if res.face_merges:
        log.warning("identity: %d groups of subject ids merged: their vectors are near-duplicates (%s)",
                    len(res.face_merges), policy)
    return FeatureIdentity(person, res, tuple(quarantined), keep)


def plan_feature_partitions(drop: FeatureDrop, identity: FeatureIdentity, *, k: int, select: bool,
                            policy: str, keep: np.ndarray | None = None) -> tuple[PartitionPlan, np.ndarray]:
    """Partitions of the kept records by their labels; returns the plan (indices into ``kept``) and ``kept``.

    ``keep`` (default ``identity.keep``) narrows the records partitioned, e.g. to the new people of a lineage.
    """
    kept = np.flatnonzero(identity.keep if keep is None else keep)
    rows = [{x: drop.label_values[x][i] for x in drop.labels} for i in kept]
    plan = plan_partitions(rows, [identity.person[i] for i in kept], k=k, label_names=list(drop.labels),
                           select=select, policy=policy)
    return plan, kept


def deidentify_features(drop: FeatureDrop, identity: FeatureIdentity, plan: PartitionPlan, kept: np.ndarray, *,
                        method: str, k: int, sigma: float | None, seed: int, staging: Path | None = None
                        ) -> FeatureDeidentified:
    """De-identify every planned partition's records; one call, the partitions passed as keys.

    k-Same-Select clusters inside each partition; the other methods see one partition (the
    plan's only group) or, with merged small partitions, run on all of them together.
    """
    order = [(f"p{n:03d}", [int(kept[i]) for i in idx]) for n, (_, idx) in enumerate(plan.groups.items())]
    rows = np.asarray([r for _, idx in order for r in idx], dtype=np.int64)
    parts = [key for key, idx in order for _ in idx]
    if len(rows) == 0:
        return FeatureDeidentified(rows, np.zeros((0, drop.dim), np.float32), (), (), (), None)
    people = [identity.person[i] for i in rows]
    labels = {x: [drop.label_values[x][i] for i in rows] for x in drop.labels}
    released, found = deidentify_vectors(drop.vectors[rows], people=people, method=method, k=k, sigma=sigma,
                                         partitions=parts if method_spec(method).partitions_by_labels else None,
                                         labels=labels or None, seed=seed)
    labels_ = np.arange(len(rows)) if found is None else np.asarray(found)
    names = {c: uuid.uuid4().hex[:12] for c in np.unique(labels_).tolist()}  # random: nothing follows the input
    clusters = tuple(names[c] for c in labels_.tolist())
    who = np.asarray(people, dtype=object)
    summary = tuple(ClusterInfo(cluster=name, size=int(np.count_nonzero(labels_ == c)),
                                people=int(len(set(who[labels_ == c])))) for c, name in names.items())
    vectors = released.astype(np.float32)
    path = None
    if staging is not None:
        path = Path(staging) / DEIDENTIFIED
        table = pa.table({"record_id": pa.array([drop.record_ids[i] for i in rows], pa.string()),
                          "cluster": pa.array(clusters, pa.string()), "partition": pa.array(parts, pa.string()),
                          "features": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()),
                                                                        drop.dim)})
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    log.info("deidentify: %d feature records in %d clusters (%s, k=%s)", len(rows), len(names), method, k)
    return FeatureDeidentified(rows, vectors, clusters, tuple(parts), summary, path)


def feature_gate_inputs(drop: FeatureDrop, identity: FeatureIdentity, deid: FeatureDeidentified, *,
                        method: str, k: int, sigma: float | None, seed: ReleaseSeed, records_in: int,
                        suppressed: int,
                        quarantined: int, partition_failed: bool = False, partition_detail: str = "",
                        release_columns: tuple[str, ...] = (), extra_checks: tuple[Check, ...] = (),
                        republished=None) -> GateInputs:
    """The gate's typed inputs for a feature release (``kind="features"``, ``shape=(dim,)``).

    ``deidentify`` re-runs the method with the seed :meth:`ReleaseSeed.for_parrot` gives (an
    independent one unless ``seed`` is fixed): the parrot attacker applies it to its gallery,
    the utility protocol to the training people.
    """
    common = dict(records_in=records_in, suppressed=suppressed, quarantined=quarantined,
                  partition_failed=partition_failed, partition_detail=partition_detail,
                  release_columns=release_columns, extra_checks=extra_checks, kind=KIND, republished=republished,
                  deidentify=vector_method_runner(method, k=k if method in K_METHODS else None, sigma=sigma,
                                                  seed=seed.for_parrot()))
    if len(deid.rows) == 0:
        return GateInputs.empty(shape=(drop.dim,), **common)
    released = np.ascontiguousarray(deid.vectors, dtype=np.float32)
    originals = np.ascontiguousarray(drop.vectors[deid.rows], dtype=np.float32)
    return GateInputs.from_arrays(
        shape=(drop.dim,), people=identity.person[deid.rows], released=released, originals=originals,
        clusters=np.asarray(deid.clusters, dtype=object), partitions=np.asarray(deid.partitions, dtype=object),
        labels={x: np.asarray([drop.label_values[x][i] for i in deid.rows], dtype=object) for x in drop.labels},
        **common)


# --------------------------------------------------------------------------- the stages as the runner calls them


@dataclass(frozen=True)
class FeaturePartitioned:
    """The drop's checks, the label partitions of the kept records and what was held back before the gate."""

    plan: PartitionPlan
    kept: np.ndarray  # indices of the records partitioned (kept by the identity check; new people under a lineage)
    checks: tuple[Check, ...]  # drop_not_empty, enough_people: failed, the drop goes straight to a rejected gate
    suppressed: int
    notes: tuple[str, ...] = ()
    lineage: LineagePlanned | None = None  # the dataset's lineage plan over the kept records (record_ids: staging ids)
    partitions: tuple[PartitionInfo, ...] = ()  # the plan's groups, named as deidentify_features names them
    small: tuple[SmallPartition, ...] = ()

    @property
    def proceed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def small_detail(self) -> str:
        return small_detail(self.small)


def ingest_features(drop_dir: str | os.PathLike, layout: StagingLayout, config: RunConfig, *,
                    logger: Logger | None = None) -> FeatureIngest | UnreadableDrop:
    """Read, validate and stage the drop; an unreadable drop is a verdict on the input, not a crash.

    Great Expectations suites (:func:`deid.evaluation.validation.validate_feature_table`): the table
    as the steward wrote it (``feature_table``, in the report: the rows the reader quarantined show
    there) and the staged records (``feature_ingested``, a gate check: it must pass).
    """
    from deid.evaluation.validation import suite_check, validate_feature_table  # noqa: PLC0415

    try:
        ing = ingest_feature_drop(drop_dir, layout.root, labels=list(config.labels) if config.labels else None,
                                  name=config.name, max_bytes=config.feature_max_bytes)
        validation = {"feature_table": validate_feature_table(ing.drop),
                      "feature_ingested": validate_feature_table(ing.drop, staged=True)}
    except DataError as exc:
        (logger or log).info("ingest: the feature drop is unreadable; the run signs a rejection naming the reason")
        return UnreadableDrop(str(exc))
    return replace(ing, validation=validation, checks=(suite_check(validation["feature_ingested"]),))


def identify_features(ingested: FeatureIngest, config: RunConfig, *, logger: Logger | None = None) -> FeatureIdentity:
    """Who is who (:func:`resolve_feature_people` under ``config.duplicate_ids``)."""
    return resolve_feature_people(ingested.drop, policy=config.duplicate_ids)


def vector_fingerprints(vectors: np.ndarray) -> list[str]:
    """SHA-256 of each record's vector as staged (little-endian float32 bytes): the lineage's record fingerprint.

    The feature analogue of an image's ``source_sha256``: the same record in a later drop of the
    dataset has the same fingerprint, whatever its row or the steward's record id.
    """
    v = np.ascontiguousarray(vectors, dtype="<f4")
    return [hashlib.sha256(row.tobytes()).hexdigest() for row in v]


def plan_feature_lineage(drop: FeatureDrop, identity: FeatureIdentity, state, config: RunConfig, *,
                         logger: Logger | None = None) -> tuple[LineagePlanned, np.ndarray]:
    """The lineage plan over the records the identity check kept (:func:`deid.release.lineage_plan.plan_release`).

    Returns the plan (its ``record_ids`` the staging ids of the kept records, in order) and the mask
    of the records to partition and cluster: the new people's. As for faces, fewer than k new people
    per label partition wait (the ``suppress`` small-partition policy); under ``merge`` or ``fail``
    the plan holds one partition and the small-partition policy decides.
    """
    from deid.operations.run_setup import linkage_key  # noqa: PLC0415
    from deid.release.lineage_plan import plan_release  # noqa: PLC0415 - crypto imports only where needed

    rows = np.flatnonzero(identity.keep)
    labels = list(drop.labels)
    select = config.select(labels) and config.small_partitions == "suppress"
    parts = [tuple(str(drop.label_values[x][i]) for x in labels) for i in rows] if select and labels else None
    # Every record's labels: new clusters register them, so their later counterfeits reproduce the label mix.
    record_labels = [tuple(str(drop.label_values[x][i]) for x in labels) for i in rows]
    # Keyed by the normalised steward id (what cannot flip between runs); this run's merges overlay the k rules.
    normal = {s: normalize_subject_id(s) for s in dict.fromkeys(drop.subject_ids[i] for i in rows)}
    plan = plan_release(state, [normal[drop.subject_ids[i]] for i in rows], vector_fingerprints(drop.vectors[rows]),
                        key=linkage_key(config)[0], k=config.k, policy=config.lineage_policy,
                        absent=config.lineage_absent, partitions=parts, record_labels=record_labels,
                        label_names=labels, persons=[identity.person[i] for i in rows], merges=config.lineage_merges)
    new = np.zeros(len(drop.record_ids), dtype=bool)
    new[rows[list(plan.new_records)]] = True
    (logger or log).info("partition: lineage of %s (%s): %d records of returning people, %d new records, %d held back",
                         state.dataset, config.lineage_policy, sum(len(r.records) for r in plan.republish),
                         len(plan.new_records), len(plan.suppressed))
    planned = LineagePlanned(plan=plan, state=state, record_ids=tuple(drop.record_ids[i] for i in rows),
                             returning_dir=None)
    return planned, new


def partition_features(ingested: FeatureIngest, identity: FeatureIdentity, config: RunConfig, *,
                       lineage_state=None, logger: Logger | None = None) -> FeaturePartitioned:
    """The drop checks, then the label partitions (k-Same-Select partitions only when the drop has labels).

    With a ``lineage_state`` (:class:`deid.release.lineage_state.LineageState`) the lineage is planned
    first (:func:`plan_feature_lineage`): only the new people are partitioned and clustered; the
    records the plan holds back count as suppressed.
    """
    drop = ingested.drop
    notes = ()
    if config.spec.partitions_by_labels and not drop.labels:
        notes = (f"{config.method} without utility labels runs as k-Same (one partition); utility is not applicable",)
        (logger or log).warning("%s", notes[0])
    checks = tuple(drop_checks(records_in=drop.records_in, people=len(set(identity.person[identity.keep])),
                               k=config.k, unit="the feature table has no rows"))
    # An empty drop or one with fewer than k people goes straight to a (rejected) gate, its records held back.
    proceed = all(c.passed for c in checks)
    planned, keep = None, None
    if proceed and lineage_state is not None:
        planned, keep = plan_feature_lineage(drop, identity, lineage_state, config, logger=logger)
    plan, kept = plan_feature_partitions(drop, identity, k=config.k, select=config.select(drop.labels),
                                         policy=config.small_partitions, keep=keep)
    held_back = len(planned.plan.suppressed) if planned is not None else 0
    plan = plan if proceed else PartitionPlan(groups={})
    parts = tuple(PartitionInfo(name=f"p{n:03d}", key=tuple(map(str, key)), dir=None, records=len(idx),
                                people=len({identity.person[kept[i]] for i in idx}))
                  for n, (key, idx) in enumerate(plan.groups.items()))
    return FeaturePartitioned(plan=plan, kept=kept, checks=checks,
                              suppressed=len(plan.suppressed) + held_back if proceed else len(kept), notes=notes,
                              lineage=planned, partitions=parts, small=SmallPartition.of_plan(plan))


def deidentify_feature_partitions(ingested: FeatureIngest, identity: FeatureIdentity, part: FeaturePartitioned,
                                  layout: StagingLayout, config: RunConfig, *,
                                  logger: Logger | None = None) -> FeatureDeidentified:
    """De-identify every planned partition (:func:`deidentify_features`), staged as ``deidentified_features.parquet``."""
    # The release's random state (deid.anonymise.randomness): secret, drawn per release unless DEID_SEED fixes it.
    return deidentify_features(ingested.drop, identity, part.plan, part.kept, method=config.method, k=config.k,
                               sigma=config.sigma if config.method == "noise" else None,
                               seed=config.release_seed.value,
                               staging=layout.root if part.plan.groups else None)


def _gate_partition(part: FeaturePartitioned, select: bool) -> Callable[[tuple[str, ...]], str]:
    """The gate partition of a returning person's record: the new records' partition of its label values.

    As :func:`deid.operations.worker_lineage.lineage_partition_key` for faces: the gate's utility protocol
    re-runs the method per partition, so returning records join the partition of the same labels
    (k-Same-Select), or the single partition of plain k-Same.
    """
    keys = {tuple(map(str, key)): f"p{n:03d}" for n, key in enumerate(part.plan.groups)}
    if not select:
        single = next(iter(keys.values())) if len(keys) == 1 else "lineage"
        return lambda lab: single
    return lambda lab: keys.get(lab, "lineage|" + "|".join(lab))


def apply_feature_lineage(ingested: FeatureIngest, identity: FeatureIdentity, part: FeaturePartitioned,
                          deid: FeatureDeidentified, config: RunConfig, *, release_id: str,
                          logger: Logger | None = None) -> LineageApplied:
    """The release as the lineage sees it: new clusters as made, returning people's records as their stored
    vectors (bit for bit), and the gate's lineage checks (structure, the differencing attack in feature space).

    Returns a :class:`~deid.contracts.LineageApplied` whose ``deidentified`` is the
    :class:`FeatureDeidentified` with the returning records added (their registered cluster key as
    cluster); the counterfeits of republished clusters are added by :func:`stage_features`.
    """
    from deid.operations import worker_lineage  # noqa: PLC0415
    from deid.release.lineage import build_release  # noqa: PLC0415

    lg = logger or log
    drop, lin = ingested.drop, part.lineage
    plan, state = lin.plan, lin.state
    where = {rid: i for i, rid in enumerate(drop.record_ids)}
    rows = np.asarray([where[r] for r in lin.record_ids], dtype=np.int64)  # staged record of each plan record
    pos = {int(r): j for j, r in enumerate(deid.rows.tolist())}
    names: dict[str, int] = {}
    new_labels = np.full(len(plan.new_records), -1, dtype=np.intp)
    new_vectors = np.zeros((len(plan.new_records), drop.dim), dtype=np.float32)
    for j, i in enumerate(plan.new_records):
        at = pos.get(int(rows[i]))
        if at is not None:  # else withheld by the partition stage (a small partition)
            new_labels[j] = names.setdefault(deid.clusters[at], len(names))
            new_vectors[j] = deid.vectors[at]
    rel = build_release(plan, state, release_id=release_id, method=config.method, new_labels=new_labels,
                        new_images=new_vectors, shape=(drop.dim,))
    # Returning people's records carry their registered cluster's stored vector, in the gate's partitions.
    back = [(int(rows[i]), r.cluster.key) for r in plan.republish for i in r.records]
    out = deid
    if back:
        key_of = _gate_partition(part, config.select(drop.labels))
        b_rows = np.asarray([i for i, _ in back], dtype=np.int64)
        b_clusters = tuple(c for _, c in back)
        b_vectors = np.stack([np.asarray(state.clusters[c].image, dtype=np.float32) for c in b_clusters])
        b_parts = tuple(key_of(tuple(str(drop.label_values[x][i]) for x in drop.labels)) for i in b_rows.tolist())
        summary = tuple(ClusterInfo(cluster=c, size=b_clusters.count(c),
                                    people=len({identity.person[i] for i, x in back if x == c}))
                        for c in sorted(set(b_clusters)))
        out = FeatureDeidentified(rows=np.concatenate([deid.rows, b_rows]),
                                  vectors=np.vstack([deid.vectors.reshape(-1, drop.dim), b_vectors]),
                                  clusters=(*deid.clusters, *b_clusters), partitions=(*deid.partitions, *b_parts),
                                  cluster_summary=(*deid.cluster_summary, *summary), path=deid.path)
    lg.info("lineage-release: %s", dict(rel.counts))
    checks = feature_lineage_checks(lin, rel, drop.vectors[rows], logger=lg)
    return LineageApplied(release=rel, state=state, deidentified=out, checks=checks,
                          republished=worker_lineage.republished_for_gate(rel, state), record_ids=lin.record_ids)


def feature_lineage_checks(lin: LineagePlanned, rel, originals: np.ndarray, *,
                           logger: Logger | None = None) -> tuple[Check, ...]:
    """The gate's lineage checks on a feature release: structure against the registry, the differencing attack.

    The attack matches every difference of released averages across the lineage against this
    drop's vectors (``originals``, one per plan record), exact within
    :data:`FEATURE_DIFFERENCE_TOLERANCE` of the mean feature standard deviation.
    """
    from deid.release.lineage_checks import check_merges, check_structure  # noqa: PLC0415
    from deid.release.lineage_differencing import differencing_attack  # noqa: PLC0415

    checks = [c.to_gate_check() for c in check_structure(lin.state, rel)]
    merges = check_merges(lin.plan)
    if merges is not None:   # a merge between runs re-checked registered clusters (issue 27)
        checks.append(merges.to_gate_check())
    X = np.asarray(originals, dtype=np.float32)
    if len(X) >= 2:
        spread = float(np.mean(X.std(axis=0, dtype=np.float64)))
        tol = max(FEATURE_DIFFERENCE_TOLERANCE * spread, float(np.finfo(np.float32).tiny))
        attack = differencing_attack(lin.state, rel, X, original_people=[rel.person(p) for p in lin.plan.pseudonyms],
                                     tolerance=tol,
                                     unit="feature units")
        (logger or log).info("lineage differencing attack: %d cluster pairs, %d tests, %d matches",
                             attack.n_cluster_pairs, attack.n_tests, len(attack.matches))
        checks.append(attack.to_check().to_gate_check())
    return tuple(checks)


def _release_rows(drop: FeatureDrop, deid: FeatureDeidentified, lineage: LineageApplied | None,
                  *, logger: Logger | None = None) -> ReleaseRows:
    """Vectors, clusters, labels and staging ids of the would-be release, as the lineage makes them
    (:func:`deid.operations.worker_lineage.lineage_release_rows`: registered labels, counterfeits of republished
    clusters with their stored vector and no source, marked only in the linkage record)."""
    from deid.operations import worker_lineage  # noqa: PLC0415

    rows = ReleaseRows(vectors=deid.vectors.reshape(-1, drop.dim), shape=(drop.dim,), clusters=tuple(deid.clusters),
                       labels={x: tuple(drop.label_values[x][i] for i in deid.rows) for x in drop.labels},
                       record_ids=tuple(drop.record_ids[i] for i in deid.rows))
    return worker_lineage.lineage_release_rows(
        rows, lineage, drop.labels, lambda: {x: Counter(drop.label_values[x]).most_common(1)[0][0] for x in drop.labels},
        logger=logger)


def stage_features(ingested: FeatureIngest, deid: FeatureDeidentified, layout: StagingLayout, config: RunConfig, *,
                   release_id: str, lineage: LineageApplied | None = None, logger: Logger | None = None) -> Staged:
    """The would-be release inside the staging directory, and its encrypted linkage record beside it.

    With a lineage, the counterfeit records of its republished clusters are added (stored vector,
    labels of their partition); only the private linkage record marks them.
    """
    from deid.operations.run_setup import linkage_key  # noqa: PLC0415
    from deid.release.linkage import build_linkage, write_linkage  # noqa: PLC0415
    from deid.release.manifest import list_release  # noqa: PLC0415
    from deid.release.publish import discard  # noqa: PLC0415
    from deid.release.vectors import stage_vector_release  # noqa: PLC0415

    lg = logger or log
    drop, tmp = ingested.drop, layout.release_dir
    from deid.evaluation.validation import suite_check, validate_feature_release  # noqa: PLC0415
    from deid.operations.release_staging import lineage_label_mix, releasable_label_sets  # noqa: PLC0415
    from deid.release.publish import RELEASE_TABLE  # noqa: PLC0415

    rows = _release_rows(drop, deid, lineage, logger=lg)
    people = pa.table({"subject_id": pa.array(drop.subject_ids, pa.string()),
                       **{x: pa.array(drop.label_values[x], pa.string()) for x in drop.labels}})
    try:
        staged = stage_vector_release(tmp, vectors=rows.vectors, clusters=rows.clusters, labels=rows.labels,
                                      record_ids=rows.record_ids)
        label_sets = releasable_label_sets(people, drop.labels, config.k)
        lineage_checks_ = ()
        if lineage is not None:
            label_sets, lineage_checks_ = lineage_label_mix(lineage, rows, drop.labels, label_sets)
        validation = validate_feature_release(
            tmp / RELEASE_TABLE, list(drop.labels), k=config.k, dim=drop.dim, label_sets=label_sets,
            source_record_ids=[*drop.record_ids, *drop.source_ids], clustered=config.spec.clustered)
        key, key_path, origin = linkage_key(config)
        sources = {drop.record_ids[i]: {"subject_id": drop.subject_ids[i], "image": drop.source_ids[i]}
                   for i in deid.rows}
        write_linkage(layout.linkage, build_linkage(staged.mapping, sources), key, release_id=release_id,
                      seed=config.release_seed)
    except BaseException:
        discard(tmp)
        raise
    if origin == "development":
        lg.warning("linkage record encrypted with the development key %s; set DEID_LINKAGE_KEY", key_path)
    lg.info("stage: %d feature records staged for release in %s", staged.n_records, tmp)
    # One listing for every release (a feature release's manifest lists no file: it has no images/).
    images, listing = list_release(tmp)
    return Staged(dir=tmp, artifacts=listing.artifacts, columns=tuple(staged.columns),
                  records=staged.n_records, validation=validation, checks=(suite_check(validation), *lineage_checks_),
                  file_metadata={}, linkage=layout.linkage, manifest=listing.manifest, images=images)


def gate_features(ingested: FeatureIngest, identity: FeatureIdentity, part: FeaturePartitioned,
                  deid: FeatureDeidentified, config: RunConfig, *, counts: RecordCounts, staged: Staged | None = None,
                  lineage: LineageApplied | None = None, logger: Logger | None = None) -> GateResult:
    """The core gate (:func:`deid.evaluation.gate.evaluate`) on the would-be release and its originals.

    With a lineage, its checks join the gate's and the republished clusters are counted and attacked
    as for faces (registered members; counterfeit rows of no one).
    """
    drop = ingested.drop
    inputs = feature_gate_inputs(
        drop, identity, deid, method=config.method, k=config.k,
        sigma=config.sigma if config.method == "noise" else None, seed=config.release_seed,
        records_in=counts.records_in, suppressed=counts.suppressed, quarantined=counts.quarantined,
        partition_failed=part.plan.failed, partition_detail=part.small_detail,
        release_columns=tuple(staged.columns) if staged else (*FEATURE_RELEASE_BASE_COLUMNS, *drop.labels),
        extra_checks=(*part.checks, *ingested.checks, *(lineage.checks if lineage else ()),
                      *(staged.checks if staged else ())),
        republished=lineage.republished if lineage is not None else None)
    result = evaluate(inputs, config.gate_config(drop.labels))
    (logger or log).info("gate: " + ("passed" if result.passed else "failed - " + "; ".join(result.reasons)))
    return result


@dataclass(frozen=True)
class FeatureSteps:
    """The feature stages :func:`deid.operations.runner.run_release` calls, in its order; the flow swaps in tasks."""

    ingest: sig.FeatureIngestStage = ingest_features
    identify: sig.FeatureIdentifyStage = identify_features
    partition: sig.FeaturePartitionStage = partition_features
    deidentify: sig.FeatureDeidentifyStage = deidentify_feature_partitions
    apply_lineage: sig.FeatureApplyLineageStage = apply_feature_lineage
    stage: sig.FeatureStageStage = stage_features
    gate: sig.FeatureGateStage = gate_features


# --------------------------------------------------------------------------- the report


def feature_report(*, release_id: str, run_id: str, created_at: str, config: RunConfig, ingested: FeatureIngest,
                   identity: FeatureIdentity, partitioned: FeaturePartitioned, deidentified: FeatureDeidentified,
                   staged: Staged | None, gate: GateResult, counts: RecordCounts,
                   quarantine_by_reason: Mapping[str, int], timings: Mapping[str, Mapping], signing: SigningInfo,
                   versions: Mapping[str, str | None], lineage: LineageApplied | None = None,
                   validation: Mapping[str, Any] | None = None) -> Report:
    """The run's :class:`~deid.reporting.report.Report` (the image runs' model), from the feature stages (pure)."""
    drop, passed = ingested.drop, gate.passed
    return Report(
        **verdict_fields(release_id=release_id, run_id=run_id, created_at=created_at, config=config, gate=gate,
                         promise=feature_guarantee(config.method, config.k),
                         dataset=dataset_summary(drop.name, ingested.fingerprint, counts, passed=passed,
                                                 quarantine_by_reason=quarantine_by_reason),
                         artifacts=staged.artifacts if staged else (), signing=signing, versions=versions,
                         file_manifest=staged.manifest if staged else None),
        lineage=lineage_section(config, drop.dataset, partitioned, lineage, registered=passed),
        validation=validation_section(validation or {}),
        configuration={
            "kind": KIND, "feature_dim": drop.dim, "features_file": drop.features_file,
            "vector_column": drop.vector_column, "vector_value_type": drop.value_type,
            **shared_configuration(config, labels=drop.labels, license=drop.license,
                                   attribution=drop.attribution, notes=partitioned.notes,
                                   identity=identity.resolution.summary(), partitions=partitioned.partitions,
                                   small=partitioned.small, clusters=deidentified.cluster_summary),
            "extra_table_columns": list(drop.extra_columns), "stage_seconds": dict(timings),
            "validation": "every row checked by deid.intake.features; Great Expectations suites feature_table (the "
                          "table as written), feature_ingested and feature_release",
        })
