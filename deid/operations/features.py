"""Releasing a feature drop: ingest, who is who, partitions, de-identify, gate, signed report, publish.

The feature path of a release, as plain core functions without Prefect or Dask (a feature
drop is a matrix: nothing to align, nothing to distribute). :func:`release_feature_drop` is
the entry point (``deid run`` calls it for a drop whose ``drop.yaml`` says ``kind:
features``); it keeps the order of commitment of the image flow (:mod:`deid.operations.safety`):

1. configuration checked, signing key loaded, every location probed writable, then what killed
   runs left is recovered; the run's staging directory is created and locked;
2. **ingest** (:func:`ingest_feature_drop`): the drop is read and validated
   (:func:`deid.intake.features.read_feature_drop`; bad rows quarantined with reasons) and
   staged as ``ingested_features.parquet``; an unreadable drop gets a signed rejection;
3. **identity** (:func:`resolve_feature_people`): subject ids normalised, and records whose
   standardised vectors are near-duplicates under different ids made one person
   (:func:`deid.anonymise.identity.resolve_people`, the eigenface rule on the vectors);
4. **partition** by the utility labels (:func:`deid.anonymise.partition.plan_partitions`);
5. **de-identify** (:func:`deidentify_features`): the method on the vectors
   (:func:`deid.anonymise.features.deidentify_vectors`), staged as ``deidentified_features.parquet``;
6. **stage** the would-be release (:func:`deid.release.vectors.stage_vector_release`) inside
   the staging directory, with its encrypted linkage record beside it;
7. **gate** (:func:`feature_gate_inputs` + :func:`deid.evaluation.gate.evaluate`): the same
   checks as for faces, with the feature-space attackers and the feature near-copy rule;
8. **report** (dataset card first if released), validated and signed, then **publish** by one
   rename, or withhold.

Not yet for feature drops: the lineage registry of successive releases (each feature release
stands alone; the report says so) and the Great Expectations suites (the reader validates
every row itself).
"""
from __future__ import annotations

import logging
import os
import secrets
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.anonymise.features import check_feature_method, deidentify_vectors, feature_guarantee, vector_method_runner
from deid.anonymise.identity import PeopleResolution, resolve_people
from deid.anonymise.methods import K_METHODS, method_spec
from deid.anonymise.partition import POLICIES, PartitionPlan, plan_partitions
from deid.errors import ConfigError, DataError, EnvironmentFailure, Quarantined, StateError
from deid.evaluation.gate import Check, GateConfig, GateInputs, GateResult, evaluate
from deid.evaluation.validation import drop_checks
from deid.intake.features import INGESTED, FeatureDrop, read_feature_drop
from deid.intake.ingest import write_quarantine
from deid.operations.safety import RELEASE_SUBDIR, RunLock, fault_point, preflight_locations, recover, write_signed_addendum
from deid.release.card import DatasetCard, write_card
from deid.release.linkage import build_linkage, ensure_linkage_key, linkage_path, write_linkage
from deid.release.publish import StagedRelease, commit_release, discard, new_release_id
from deid.release.signing import SigningKey, ensure_signing_key
from deid.release.vectors import stage_vector_release
from deid.reporting.html_report import write_report_bundle
from deid.reporting.report import dataset_fingerprint, hash_tree, package_versions
from deid.schemas.arrow import FEATURE_RELEASE_BASE_COLUMNS
from deid.settings import Settings

log = logging.getLogger(__name__)

DEIDENTIFIED = "deidentified_features.parquet"
QUARANTINE = "quarantine.parquet"
LINKAGE_STAGED = "linkage.bin"
KIND = "features"


# --------------------------------------------------------------------------- typed stage results


@dataclass(frozen=True)
class FeatureIngest:
    """The ingest stage: the parsed drop and where its usable records were staged."""

    drop: FeatureDrop
    ingested: Path
    fingerprint: str


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
    cluster_summary: tuple[dict, ...]
    path: Path | None


@dataclass(frozen=True)
class FeatureReleaseResult:
    """What one feature release run did (the CLI prints it; the flow's result dict has the same keys)."""

    release_id: str
    verdict: str
    reasons: tuple[str, ...]
    report: Path | None
    report_dir: Path
    release_dir: Path | None
    public_key: Path | None
    key_origin: str
    dataset: dict
    privacy: dict
    utility: tuple[dict, ...]
    staging: Path | None
    linkage: Path | None
    timings: dict = field(default_factory=dict)
    input_error: str | None = None
    recovered: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """The run's result in the flow's dict shape (paths as strings)."""
        out = {}
        for k, v in self.__dict__.items():
            out[k] = str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
        return out


# --------------------------------------------------------------------------- stages


def ingest_feature_drop(drop_dir: str | os.PathLike, staging: Path, *, labels: list[str] | None = None,
                        name: str | None = None) -> FeatureIngest:
    """Read and validate the drop, stage its usable records (``ingested_features.parquet``).

    Raises :class:`~deid.errors.DropError` for a drop that cannot be read at all.
    """
    drop = read_feature_drop(drop_dir, labels=labels, name=name)
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
                            policy: str) -> tuple[PartitionPlan, np.ndarray]:
    """Partitions of the kept records by their labels; returns the plan (indices into ``kept``) and ``kept``."""
    kept = np.flatnonzero(identity.keep)
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
    summary = tuple({"cluster": name, "size": int(np.count_nonzero(labels_ == c)),
                     "people": int(len(set(who[labels_ == c])))} for c, name in names.items())
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
                        method: str, k: int, sigma: float | None, seed: int, records_in: int, suppressed: int,
                        quarantined: int, partition_failed: bool = False, partition_detail: str = "",
                        release_columns: tuple[str, ...] = (), extra_checks: tuple[Check, ...] = ()) -> GateInputs:
    """The gate's typed inputs for a feature release (``kind="features"``, ``shape=(dim,)``).

    ``deidentify`` re-runs the method with another seed (the release's random state is its
    secret): the parrot attacker applies it to its gallery, the utility protocol to the
    training people.
    """
    common = dict(records_in=records_in, suppressed=suppressed, quarantined=quarantined,
                  partition_failed=partition_failed, partition_detail=partition_detail,
                  release_columns=release_columns, extra_checks=extra_checks, kind=KIND,
                  deidentify=vector_method_runner(method, k=k if method in K_METHODS else None, sigma=sigma,
                                                  seed=seed + 1))
    if len(deid.rows) == 0:
        return GateInputs.empty(shape=(drop.dim,), **common)
    released = np.ascontiguousarray(deid.vectors, dtype=np.float32)
    originals = np.ascontiguousarray(drop.vectors[deid.rows], dtype=np.float32)
    return GateInputs.from_arrays(
        shape=(drop.dim,), people=identity.person[deid.rows], released=released, originals=originals,
        clusters=np.asarray(deid.clusters, dtype=object), partitions=np.asarray(deid.partitions, dtype=object),
        labels={x: np.asarray([drop.label_values[x][i] for i in deid.rows], dtype=object) for x in drop.labels},
        **common)


def gate_config(settings: Settings, *, k: int, method: str, labels: tuple[str, ...]) -> GateConfig:
    """The run's gate configuration from the settings (attackers: the feature set, chosen by the inputs' kind)."""
    return GateConfig.from_settings(settings, k=k, method=method, labels=labels)


# --------------------------------------------------------------------------- the run


def _now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@contextmanager
def _timed(timings: dict, stage: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[stage] = round(timings.get(stage, 0.0) + time.perf_counter() - t0, 4)


def _signing_key(settings: Settings, data: Path) -> SigningKey:
    secret = settings.signing_key_passphrase
    return ensure_signing_key(configured=settings.signing_key, keys_dir=data / "keys",
                              passphrase_env_value=secret.get_secret_value().encode() if secret else None)


def _sign(report_dir: Path, report: dict, key: SigningKey) -> Path:
    report = {**report, "versions": package_versions(("deid", "numpy", "scikit-learn", "pyarrow", "cryptography"))}
    return write_report_bundle(report_dir, report, key, sample_images=None, validation_results=None)


def _check_config(k: Any, method: Any, policy: Any) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ConfigError(f"k={k!r} must be an integer >= 2; k is the minimum number of people per cluster")
    check_feature_method(method)
    if policy not in POLICIES:
        raise ConfigError(f"small_partitions={policy!r} must be one of {', '.join(POLICIES)}")


def release_feature_drop(drop_dir: str | os.PathLike, *, k: int | None = None, method: str | None = None,
                         data_dir: str | os.PathLike | None = None, reports_dir: str | os.PathLike | None = None,
                         labels: list[str] | None = None, name: str | None = None,
                         small_partitions: str | None = None, sigma: float | None = None,
                         settings: Settings | None = None) -> FeatureReleaseResult:
    """Release a feature drop: a signed report always, the release only if the gate passed.

    Parameters
    ----------
    drop_dir : path
        The feature drop (``drop.yaml`` with ``kind: features``, see :mod:`deid.intake.features`).
    k : int, optional
        Minimum distinct people per cluster (default ``DEID_K``).
    method : str, optional
        One of :data:`deid.anonymise.methods.FEATURE_METHODS` (default ``DEID_METHOD``).
    data_dir, reports_dir : path, optional
        Where staging, releases, keys and private records go, and the reports (default: the settings').
    labels, name : optional
        Override ``drop.yaml``'s utility labels and dataset name.
    small_partitions : {"suppress", "merge", "fail"}, optional
    sigma : float, optional
        Strength of ``noise`` (feature standard deviations).
    settings : Settings, optional
        Everything else (signing and linkage keys, gate sample sizes, confidence, tolerance).

    Returns
    -------
    FeatureReleaseResult

    Raises
    ------
    ConfigError
        Bad k, method or policy, before any work.
    EnvironmentFailure
        The machine failed the run (disk full, permissions); a signed rejection says so when it
        can be written.
    StateError
        Publishing failed after the report was signed (a signed addendum says it was not published).
    """
    settings = settings or Settings()
    k = settings.k if k is None else k
    method = method or settings.method
    policy = small_partitions or settings.small_partitions
    _check_config(k, method, policy)
    if method == "noise" and sigma is None:
        raise ConfigError("method='noise' needs sigma=... (the noise in feature standard deviations), e.g. --sigma 0.1")
    data = Path(data_dir).resolve() if data_dir is not None else settings.data_path
    reports = Path(reports_dir).resolve() if reports_dir is not None else settings.reports_path
    # Before any work: every location writable, the signing key loads.
    preflight_locations(data, reports)
    key = _signing_key(settings, data)

    def unpublished(release_id: str, report_dir: Path) -> None:
        write_signed_addendum(report_dir, {
            "release_id": release_id, "event": "not_published", "release_published": False, "created_at": _now_iso(),
            "detail": "the run died after signing its report and before publishing; its staged release was removed "
                      "by recovery and nothing was published"}, key)

    recovered = tuple(recover(data, reports, on_unpublished=unpublished).removed)
    release_id = new_release_id()
    staging = data / "staging" / release_id
    report_dir = reports / release_id
    lock = RunLock.create(staging)
    log.info("feature release %s: drop %s, k=%d, method %s", release_id, drop_dir, k, method)
    try:
        result = _run(Path(drop_dir), release_id=release_id, staging=staging, data=data, report_dir=report_dir,
                      settings=settings, key=key, k=k, method=method, labels=labels, name=name, policy=policy,
                      sigma=sigma)
    except OSError as exc:
        failure = EnvironmentFailure.from_oserror(exc, doing=f"feature release {release_id} failed")
        _abandon(staging, report_dir)
        if not (report_dir / "report.json.sig").exists():  # never replace a signed report
            _sign_rejection(report_dir, key, release_id=release_id, drop=Path(drop_dir), name=name, k=k,
                            method=method, labels=labels, reason=f"environment failure (not a verdict on the data): "
                            f"{failure}", check="environment")
        raise failure from None
    except BaseException:
        _abandon(staging, report_dir)
        raise
    finally:
        lock.close()
    return FeatureReleaseResult(**{**result.__dict__, "recovered": recovered})


def _abandon(staging: Path, report_dir: Path) -> None:
    """A run that fails: its private staging goes, and so does an unsigned report."""
    discard(staging)
    if report_dir.is_dir() and not (report_dir / "report.json.sig").exists():
        discard(report_dir)


def _sign_rejection(report_dir: Path, key: SigningKey, *, release_id: str, drop: Path, name: str | None, k: int,
                    method: str, labels: list[str] | None, reason: str, check: str = "drop_readable") -> Path | None:
    """The signed rejection of a run that could not get as far as the gate (unreadable drop, environment)."""
    try:
        raw = (drop / "drop.yaml").read_bytes()
    except OSError:
        raw = b""
    report = {
        "release_id": release_id, "run_id": release_id, "verdict": "rejected", "reasons": [reason], "k": k,
        "method": method, "guarantee": feature_guarantee(method, k), "created_at": _now_iso(),
        "dataset": {"name": name or drop.name or "drop", "fingerprint": dataset_fingerprint(raw, []),
                    "records_in": 0, "records_released": 0, "records_suppressed": 0, "records_quarantined": 0,
                    "quarantine_by_reason": {}},
        "checks": [{"name": check, "passed": False, "value": None, "threshold": None, "detail": reason}],
        "privacy": {"bound": 1.0 / k, "max_rate": None, "min_distinct_people_per_cluster": None,
                    "reidentification": []},
        "utility": [], "validation": {}, "artifacts": [], "release_dir": None,
        "configuration": {"kind": KIND, "labels": labels or [],
                          "fingerprint_scope": "drop.yaml only (the feature table was not read)"},
    }
    try:
        return _sign(report_dir, report, key)
    except Exception as exc:  # noqa: BLE001 - e.g. the reports disk is the full one: say so, raise the cause
        log.error("could not write the signed rejection: %s", exc)
        return None


def _run(drop_dir: Path, *, release_id: str, staging: Path, data: Path, report_dir: Path, settings: Settings,
         key: SigningKey, k: int, method: str, labels: list[str] | None, name: str | None, policy: str,
         sigma: float | None) -> FeatureReleaseResult:
    timings: dict[str, float] = {}
    base = dict(release_id=release_id, report_dir=report_dir, public_key=key.public_path, key_origin=key.origin)
    with _timed(timings, "ingest"):
        try:
            ing = ingest_feature_drop(drop_dir, staging, labels=labels, name=name)
        except DataError as exc:
            # An unreadable drop is a verdict on the input, not a crash: the run signs a rejection naming it.
            reason = f"unreadable drop: {exc}"
            discard(staging)
            path = _sign_rejection(report_dir, key, release_id=release_id, drop=drop_dir, name=name, k=k,
                                   method=method, labels=labels, reason=reason)
            if path is None:
                raise StateError(f"{reason}; and its signed rejection could not be written (see the log)") from None
            return FeatureReleaseResult(
                **base, verdict="rejected", reasons=(reason,), report=path, release_dir=None,
                dataset={"records_in": 0, "records_released": 0, "records_suppressed": 0, "records_quarantined": 0},
                privacy={"max_rate": None}, utility=(), staging=None, linkage=None, input_error=str(exc))
    fault_point("ingest")
    drop = ing.drop
    labels_ = list(drop.labels)
    notes: list[str] = []
    spec = method_spec(method)
    select = spec.partitions_by_labels and bool(labels_)
    if spec.partitions_by_labels and not labels_:
        notes.append(f"{method} without utility labels runs as k-Same (one partition); utility is not applicable")
    with _timed(timings, "identity"):
        identity = resolve_feature_people(drop, policy=settings.duplicate_ids)
    with _timed(timings, "partition"):
        plan, kept = plan_feature_partitions(drop, identity, k=k, select=select, policy=policy)
    quarantined = [*drop.quarantined, *identity.quarantined]
    checks = tuple(drop_checks(records_in=drop.records_in, people=len(set(identity.person[identity.keep])), k=k))
    # An empty drop or one with fewer than k people goes straight to a (rejected) gate, its records withheld.
    proceed = all(c.passed for c in checks)
    suppressed_rows = [int(kept[i]) for i in plan.suppressed] if proceed else [int(i) for i in kept]
    seed = settings.seed if settings.seed is not None else secrets.randbits(31)
    with _timed(timings, "deidentify"):
        if proceed and plan.groups:
            deid = deidentify_features(drop, identity, plan, kept, method=method, k=k, sigma=sigma, seed=seed,
                                       staging=staging)
        else:
            deid = deidentify_features(drop, identity, PartitionPlan(groups={}), kept, method=method, k=k,
                                       sigma=sigma, seed=seed)
    write_quarantine(list(quarantined), staging / QUARANTINE)
    by_reason = dict(Counter(q.code for q in quarantined))
    small_detail = "; ".join(f"a partition of {e['records']} records has {e['people']} people: {e['action']}"
                             for e in plan.small)
    staged: StagedRelease | None = None
    if len(deid.rows):
        with _timed(timings, "stage"):
            staged = _stage(drop, deid, staging, settings=settings, data=data, release_id=release_id)
    with _timed(timings, "gate"):
        inputs = feature_gate_inputs(
            drop, identity, deid, method=method, k=k, sigma=sigma, seed=settings.seed or 0,
            records_in=drop.records_in, suppressed=len(suppressed_rows), quarantined=len(quarantined),
            partition_failed=plan.failed, partition_detail=small_detail,
            release_columns=tuple(staged.columns) if staged else (*FEATURE_RELEASE_BASE_COLUMNS, *labels_),
            extra_checks=checks)
        result = evaluate(inputs, gate_config(settings, k=k, method=method, labels=tuple(labels_)))
    fault_point("gate")
    passed = result.passed
    release_dir = data / "releases" / release_id
    if not passed and staged is not None:
        _withhold(staged, staging)
    clusters = deid.cluster_summary
    n_released = len(deid.rows) if passed else 0
    parts = [{"key": [str(v) for v in key], "records": len(idx),
              "people": len({identity.person[kept[i]] for i in idx})} for key, idx in plan.groups.items()]
    report = _report(release_id, ing, result, method=method, k=k, passed=passed, policy=policy, notes=notes,
                     labels=labels_, identity=identity, plan=plan, parts=parts, clusters=clusters, by_reason=by_reason,
                     n_quarantined=len(quarantined), n_suppressed=len(suppressed_rows),
                     n_withheld=0 if passed else len(deid.rows), n_released=n_released, settings=settings,
                     sigma=sigma, timings=timings, release_dir=release_dir if passed else None)
    if passed:
        # The card states the gate's figures; written into the staged release before it is hashed and signed.
        write_card(staged.path, DatasetCard.from_report(report))
        report["artifacts"] = hash_tree(staged.path)
    path = _sign(report_dir, report, key)
    fault_point("sign")
    linkage = None
    if passed:
        with _timed(timings, "publish"):
            linkage = _publish(staged, staging, data=data, release_id=release_id, report_dir=report_dir, key=key)
        fault_point("publish")
    (staging / ".complete").touch()
    log.info("verdict: %s; report %s", report["verdict"], path)
    return FeatureReleaseResult(
        **base, verdict=report["verdict"], reasons=tuple(result.reasons), report=path,
        release_dir=release_dir if passed else None, dataset=report["dataset"], privacy=report["privacy"],
        utility=tuple(report["utility"]), staging=staging, linkage=linkage, timings=timings)


def _stage(drop: FeatureDrop, deid: FeatureDeidentified, staging: Path, *, settings: Settings, data: Path,
           release_id: str) -> StagedRelease:
    """The would-be release inside the staging directory, and its encrypted linkage record beside it."""
    tmp = staging / RELEASE_SUBDIR
    try:
        staged = stage_vector_release(
            tmp, vectors=deid.vectors, clusters=list(deid.clusters),
            labels={x: [drop.label_values[x][i] for i in deid.rows] for x in drop.labels},
            record_ids=[drop.record_ids[i] for i in deid.rows])
        lk, lk_path, origin = ensure_linkage_key(configured=settings.linkage_key, keys_dir=data / "keys")
        sources = {drop.record_ids[i]: {"subject_id": drop.subject_ids[i], "image": drop.source_ids[i]}
                   for i in deid.rows}
        write_linkage(staging / LINKAGE_STAGED, build_linkage(staged.mapping, sources), lk, release_id=release_id)
    except BaseException:
        discard(tmp)
        raise
    if origin == "development":
        log.warning("linkage record encrypted with the development key %s; set DEID_LINKAGE_KEY", lk_path)
    return staged


def _withhold(staged: StagedRelease, staging: Path) -> None:
    discard(staged.path)
    (staging / LINKAGE_STAGED).unlink(missing_ok=True)


def _publish(staged: StagedRelease, staging: Path, *, data: Path, release_id: str, report_dir: Path,
             key: SigningKey) -> Path:
    """File the linkage record, then publish by one rename; on failure a signed addendum says so."""
    target = linkage_path(data, release_id)
    try:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.replace(staging / LINKAGE_STAGED, target)
        try:
            commit_release(staged.path, data / "releases" / release_id)
        except BaseException:
            os.replace(target, staging / LINKAGE_STAGED)
            raise
    except Exception as exc:
        write_signed_addendum(report_dir, {
            "release_id": release_id, "event": "publish_failed", "release_published": False, "created_at": _now_iso(),
            "detail": f"publishing failed after the report was signed ({type(exc).__name__}: {exc}); the release was "
                      "not published"}, key)
        _withhold(staged, staging)
        if isinstance(exc, OSError):
            raise EnvironmentFailure.from_oserror(
                exc, doing=f"publishing {release_id} failed after its report was signed (signed addendum "
                           f"{report_dir / 'addendum.json'}; nothing published)") from None
        raise StateError(f"publishing {release_id} failed after its report was signed: {exc}; a signed addendum "
                         "says it was not published") from exc
    log.info("publish: %d feature records released to %s (linkage record %s)", staged.n_records,
             data / "releases" / release_id, target)
    return target


def _report(release_id: str, ing: FeatureIngest, g: GateResult, *, method: str, k: int, passed: bool, policy: str,
            notes: list[str], labels: list[str], identity: FeatureIdentity, plan: PartitionPlan, parts: list[dict],
            clusters: tuple[dict, ...], by_reason: dict, n_quarantined: int, n_suppressed: int, n_withheld: int,
            n_released: int, settings: Settings, sigma: float | None, timings: dict,
            release_dir: Path | None) -> dict:
    drop = ing.drop
    return {
        "release_id": release_id, "run_id": release_id, "verdict": "released" if passed else "rejected",
        "reasons": g.reasons, "warnings": g.warnings, "k": k, "method": method,
        "guarantee": feature_guarantee(method, k), "created_at": _now_iso(),
        "dataset": {"name": drop.name, "fingerprint": ing.fingerprint, "records_in": drop.records_in,
                    "records_released": n_released,
                    # A rejected run releases nothing: what would have been released is withheld too.
                    "records_suppressed": n_suppressed + n_withheld, "records_quarantined": n_quarantined,
                    "quarantine_by_reason": by_reason},
        "checks": [c.to_dict() for c in g.checks],
        "privacy": {"bound": 1.0 / k, "max_rate": g.max_rate, "min_distinct_people_per_cluster": g.min_people,
                    "max_person_share": g.max_person_share, "exact_bound": g.exact_bound,
                    "attack_sample": g.attack_sample, "reidentification": list(g.reidentification)},
        "utility": list(g.utility),
        "lineage": {"dataset": drop.dataset, "applied": False,
                    "detail": "not applicable: feature releases are not registered in a lineage yet; this release "
                              "stands alone (a later release of the same people is gated on its own only)"},
        "validation": {}, "artifacts": [], "release_dir": str(release_dir) if release_dir else None,
        "configuration": {
            "kind": KIND, "feature_dim": drop.dim, "features_file": drop.features_file,
            "vector_column": drop.vector_column, "vector_value_type": drop.value_type,
            "labels": labels, "license": drop.license, "notes": notes,
            "identity": identity.resolution.summary(), "duplicate_ids": settings.duplicate_ids,
            "small_partitions": policy, "utility_tolerance": settings.utility_tolerance,
            "utility_protocol": "cross-fit", "utility_sample": settings.utility_sample,
            "utility_inconclusive": settings.utility_inconclusive, "gate_confidence": settings.gate_confidence,
            "attack_sample": settings.attack_sample, "pca_components": settings.pca_components,
            **({"sigma": sigma} if method == "noise" else {}),
            "max_quarantine_fraction": settings.max_quarantine_fraction, "cv_folds": settings.cv_folds,
            "cv_repeats": settings.cv_repeats, "partitions": parts,
            # Counts only, never the label values of a partition too small to release.
            "small_partitions_detail": [{"records": e["records"], "people": e["people"], "action": e["action"]}
                                        for e in plan.small],
            "clusters": {"count": len(clusters), "sizes": sorted(c["size"] for c in clusters)},
            "extra_table_columns": list(drop.extra_columns), "stage_seconds": timings,
            "validation": "every row checked by deid.intake.features (no Great Expectations suite for feature tables)",
        },
    }
