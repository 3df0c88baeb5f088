"""A release run, start to end, without Prefect: the one definition of the stages' order.

:func:`run_release` is what ``deid run`` does; the Prefect flow
(:mod:`deid.flows.release`) calls it too, with :class:`Steps` whose stages are Prefect
tasks wrapping the same stage functions, so the order lives here only.

Order of commitment (see :mod:`deid.operations.safety`): pre-flight (signing key, writable locations) ->
recovery of killed runs' leftovers -> lock the run's staging directory -> work, staging the
would-be release inside it -> gate -> build the report and validate it against the schema ->
dataset card -> the release's signed attestation (:mod:`deid.release.attestation`) -> sign the report ->
publish by one rename. A publish that fails after signing gets a signed addendum and the release stays
unpublished.

A feature drop (``drop.yaml`` ``kind: features``) runs its own stages (:class:`~deid.operations.features.FeatureSteps`:
nothing to align, featurize or distribute) inside the same order of commitment, to the same
:class:`~deid.operations.run_result.RunResult` and report model.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ContextManager, cast

from deid.operations import (deidentify_lineage, featurize_partition, gate_publish, ingest_align, person_search,
                             release_staging, run_setup)
from deid.contracts import (
    Aligned,
    Deidentified,
    Ingested,
    LineageApplied,
    Partitioned,
    Published,
    RecordCounts,
    SignedReport,
    StagingLayout,
    UnreadableDrop,
)
from deid.operations import stage_signatures as sig
from deid.operations.run_result import RunResult
from deid.release.staged import Staged
from deid.errors import ConfigError, DataError, EnvironmentFailure, RecordError, StateError
from deid.heap import release_free_memory
from deid.intake.drop import DROP_YAML, MANIFEST
from deid.intake.drop_files import read_drop_file
from deid.intake.features import run_kind
from deid.operations.executors import Executor, LocalExecutor, PoolExecutor
from deid.evaluation.checks import Check
from deid.operations.features import FeatureDeidentified, FeatureSteps, feature_report, vector_fingerprints
from deid.operations.person_routing import CrossDatasetRefusal
from deid.release.lineage_anchor import head_doc
from deid.release.publish import discard, new_release_id
from deid.reporting.report import Report, SigningInfo, dataset_fingerprint, validate_report
from deid.reporting.report_build import build_rejection, build_report, run_versions
from deid.run_config import RunConfig
from deid.operations.safety import RunLock, fault_point
from deid.operations.usage import merge_usage, sample_start, stage_usage

log = logging.getLogger(__name__)

# A stage's measured usage (deid.operations.usage: wall and CPU seconds, peak RSS), by stage name.
Timings = dict[str, dict[str, Any]]
RunLogger = logging.Logger | logging.LoggerAdapter[logging.Logger]


@contextlib.contextmanager
def local_cluster(config: RunConfig) -> Iterator[Executor]:
    """Every stage in this process (tests, notebooks): no cluster to start."""
    yield LocalExecutor()


@dataclass(frozen=True)
class Steps:
    """The stage functions a run calls, in :func:`run_release`'s order; the Prefect flow swaps in its tasks.

    Each field is typed with its stage's call signature (:mod:`deid.operations.stage_signatures`): mypy checks
    that the defaults here and the Prefect tasks (:data:`deid.tasks.stages.STEPS`) take what the runner passes.
    """

    preflight: sig.Preflight = run_setup.preflight
    recover: sig.Recover = run_setup.recover_leftovers
    ingest: sig.Ingest = ingest_align.ingest_drop
    open_lineage: sig.OpenLineage = deidentify_lineage.open_lineage
    claim_people: sig.ClaimPeople = person_search.claim_people
    align: sig.Align = ingest_align.align
    featurize: sig.Featurize = featurize_partition.featurize
    partition: sig.Partition = featurize_partition.partition
    deidentify: sig.Deidentify = deidentify_lineage.deidentify
    apply_lineage: sig.ApplyLineage = deidentify_lineage.apply_lineage
    register_lineage: sig.RegisterLineage = deidentify_lineage.register_lineage
    stage: sig.Stage = release_staging.stage
    gate: sig.Gate = gate_publish.gate
    dataset_card: sig.DatasetCard = gate_publish.dataset_card
    attest: sig.Attest = gate_publish.attest
    write_report: sig.WriteReport = gate_publish.write_report
    publish: sig.Publish = gate_publish.publish
    publish_failed: sig.PublishFailed = gate_publish.publish_failed_addendum
    withhold: sig.Withhold = gate_publish.withhold
    features: FeatureSteps = FeatureSteps()  # the stages of a feature drop (the commitment steps above are shared)


@contextlib.contextmanager
def _timed(timings: Timings, stage: str) -> Iterator[None]:
    """Measure a stage: wall and CPU seconds, peak RSS of the run process and of its tree (deid.operations.usage).

    After it, hand the memory it freed back to the OS (the run process lives on; issue 13). A stage timed
    again (``report``, ``register``) adds its seconds and keeps the larger peaks.
    """
    start = sample_start()
    try:
        yield
    finally:
        release_free_memory()
        timings[stage] = merge_usage(timings.get(stage), stage_usage(start))


def run_release(drop: str | Path, config: RunConfig, *, steps: Steps = Steps(),
                cluster: Callable[[RunConfig], ContextManager[Executor]] = local_cluster,
                run_id: str | None = None, logger: RunLogger | None = None) -> RunResult:
    """Ingest, align, featurize, partition, de-identify, gate, report (signed) and publish (if passed).

    Parameters
    ----------
    drop : path
        The drop directory (manifest.csv, images, optional drop.yaml), or a feature drop
        (drop.yaml ``kind: features`` and its Parquet table of vectors).
    config : RunConfig
        The run's configuration (:meth:`RunConfig.resolve`); its ``kind`` is set to the drop's
        (and the configuration checked again) before any work.
    steps : Steps, keyword-only
        The stage functions (default: :class:`Steps`'s, in this process).
    cluster : callable, keyword-only
        ``cluster(config)`` -> context manager yielding the :class:`~deid.pool.Executor` the
        heavy stages run on (default: this process).
    run_id : str, optional
        The orchestrator's run id, recorded in the report (default: the release id).
    logger : logger, optional
        Where the run's own messages go (default: this module's logger), e.g. Prefect's run logger.

    Returns
    -------
    RunResult
        Released or rejected: both are results. Failures that are not a verdict raise
        (:class:`~deid.errors.EnvironmentFailure`, :class:`~deid.errors.StateError` and any unexpected
        exception, a defect, after signing a rejection naming the fault, with check ``environment``,
        ``state`` or ``internal``, unless a report was already signed; an interrupt signs nothing),
        leaving nothing half-published.
    """
    kind = run_kind(drop)
    if kind != config.kind:
        config = replace(config, kind=kind)  # re-validated: a method the drop's kind cannot run is a ConfigError
    # Every release its own random state (secret unless DEID_SEED fixes it; deid.anonymise.randomness),
    # even when one RunConfig serves several runs.
    config = config.for_release()
    signing = steps.preflight(config)  # before any work: the signing key loads, every location is writable
    recovered = steps.recover(config)
    release_id = new_release_id()
    layout = StagingLayout.for_run(config.data_path, release_id)
    lock = RunLock.create(layout.root)
    run = _Run(drop=str(drop), config=config, layout=layout, release_id=release_id, run_id=run_id or release_id,
               steps=steps, signing=signing, logger=logger or log)
    run.logger.info("release %s: drop %s, k=%d, method %s", release_id, drop, config.k, config.method)
    try:
        result = run.walk_features() if config.kind == "features" else run.walk(cluster)
    except OSError as exc:
        failure = EnvironmentFailure.from_oserror(exc, doing=f"release {release_id} failed")
        run.fail(f"environment failure (not a verdict on the data): {failure}", check="environment")
        raise failure from None
    except EnvironmentFailure as exc:  # raised as such (e.g. the lineage database unreachable): as an OSError
        run.fail(f"environment failure (not a verdict on the data): {exc}", check="environment")
        raise
    except (DataError, ConfigError) as exc:
        # The data (or a setting) found unusable past the ingest, e.g. inside the gate's attackers: a verdict
        # on the input like an unreadable drop's, signed and named, never a run that ends without a report.
        result = run.refused(exc)
    except StateError as exc:
        # A refused registry, a lineage that moved on, a publish that failed after signing: publishes nothing
        # and says why in a signed report (invariant 4); the error still reaches the caller (exit 70).
        run.fail(f"state error (not a verdict on the data): {exc}", check="state")
        raise
    except Exception as exc:
        # Anything else is a defect (e.g. a NumPy error inside an attacker): still never a run that ends without
        # a signed report (invariant 4). Its type only: an unexpected message may quote data (a subject id in a
        # KeyError); the log and `deid run --debug` carry it. The error reaches the caller (exit 70).
        run.logger.error("release %s: internal error: %s: %s", release_id, type(exc).__name__, exc)
        run.fail(f"internal error (not a verdict on the data): {type(exc).__name__} raised during the run; nothing "
                 "was published; the run's log has the message (`deid run --debug` the traceback)", check="internal")
        raise
    except BaseException:  # interrupted (Ctrl-C, SystemExit): no report, nothing published
        run.abandon()
        raise
    finally:
        lock.close()
    run.retain()
    return replace(result, recovered=tuple(recovered))


# How a rejection by :meth:`_Run.refused` begins (the CLI tells it from an unreadable drop by it).
UNUSABLE_DROP = "the drop could not be judged"


@dataclass
class _Run:
    """One run's fixed facts; :meth:`walk` is the order of the stages."""

    drop: str
    config: RunConfig
    layout: StagingLayout
    release_id: str
    run_id: str
    steps: Steps
    signing: SigningInfo
    logger: RunLogger = log

    @property
    def report_dir(self) -> Path:
        return self.config.reports_path / self.release_id

    def walk(self, cluster: Callable[[RunConfig], ContextManager[Executor]]) -> RunResult:
        s, config, layout = self.steps, self.config, self.layout
        timings: Timings = {}
        start = sample_start()
        # The executor first: a small run's pool validates the ingested drop (Great Expectations is
        # imported there while this process starts the run).
        with cluster(config) as executor:
            timings["cluster_start"] = stage_usage(start)
            with _timed(timings, "ingest"):
                ing = s.ingest(self.drop, layout, config, executor=executor)
            if isinstance(ing, UnreadableDrop):
                return self.unreadable(ing)
            fault_point("ingest")
            # Successive releases of one dataset (deid.release.lineage): only methods that give every cluster
            # member the identical image have registered averages to keep; the others are gated on their own.
            notes: list[str] = []
            lineage_dataset = ing.dataset
            routing: Any = None  # the person index claim (deid.operations.person_routing.Routing)
            if config.lineage_applies and ing.proceed:
                # One person index per project (issue 27): people another dataset registered are never released
                # in a lineage of their own; routed into that dataset's lineage or refused (DEID_CROSS_DATASET).
                ing, routing = s.claim_people(ing, config)
                lineage_dataset = routing.dataset
                if routing.note:
                    notes.append(routing.note)
            lineage_state = s.open_lineage(lineage_dataset, config) if config.lineage_applies else None
            # DEID_COLOR=auto decided from the ingested images (pure and cheap: the sample was taken at ingest).
            config = self.config = ingest_align.resolve_color(config, ing, lineage_state)
            # A colour mode or face size other than the lineage's (returning people's images would change)
            # blocks the drop before any work: a signed rejection saying what to set.
            held = tuple(c for c in (ingest_align.lineage_color_check(config, lineage_state),
                                     ingest_align.lineage_size_check(config, lineage_state)) if c is not None)
            if held:
                ing = replace(ing, checks=(*ing.checks, *held))
            if config.spec.partitions_by_labels and not ing.labels:
                notes.append(f"{config.method} without utility labels runs as k-Same (one partition); utility is "
                             "not applicable")
                self.logger.warning("%s", notes[-1])
            aligned, part, deid = Aligned(), Partitioned(root=layout.partitions_dir), Deidentified()
            if ing.proceed:
                with _timed(timings, "align"):
                    aligned = s.align(ing, layout, config, executor)
                fault_point("align")
            if ing.proceed and ing.staged - len(aligned.quarantined) >= 2:
                with _timed(timings, "featurize"):
                    feats = s.featurize(aligned, layout, config, executor)
                with _timed(timings, "partition"):
                    part = s.partition(ing, aligned, feats, layout, config, executor, lineage_state=lineage_state,
                                       **({"routing": routing} if routing is not None else {}))
                notes.extend(part.notes)
                if part.partitions:
                    with _timed(timings, "deidentify"):
                        deid = s.deidentify(part, ing.labels, layout, config, executor)
            if isinstance(executor, PoolExecutor):
                # A small run's warm processes also run the gate's attackers and utility protocols.
                lin, deid = self.lineage(part, deid, aligned, timings)
                return self.judge(ing, aligned, part, deid, lin, notes=notes, timings=timings, executor=executor)
        # The cluster is closed before the lineage: it runs in this process, and the workers' memory goes with
        # them (1.2 GiB at 1M faces; issue 13).
        lin, deid = self.lineage(part, deid, aligned, timings)
        return self.judge(ing, aligned, part, deid, lin, notes=notes, timings=timings)

    def lineage(self, part: Partitioned, deid: Deidentified, aligned: Aligned,
                timings: Timings) -> tuple[LineageApplied | None, Deidentified]:
        """New clusters registered as made; returning people's records carry their stored averages (or no lineage)."""
        if part.lineage is None:
            return None, deid
        with _timed(timings, "lineage"):
            lin = self.steps.apply_lineage(part, deid, aligned, self.layout, self.config, release_id=self.release_id)
        return lin, lin.deidentified

    def judge(self, ing: Ingested, aligned: Aligned, part: Partitioned, deid: Deidentified,
              lin: LineageApplied | None, *,
              notes: list[str], timings: Timings, executor: Executor | None = None) -> RunResult:
        """Stage the would-be release, gate it (its parts on ``executor``), sign the report, publish if it passed."""
        s, config = self.steps, self.config
        quarantined = (*ing.quarantined, *aligned.quarantined, *part.quarantined)
        by_reason = gate_publish.quarantine_summary(quarantined, self.layout)
        # Suppressed: small partitions and waiting newcomers (partition stage), near copies (de-identify stage).
        counts = RecordCounts(records_in=ing.records_in, judged=deid.records,
                              suppressed=len(part.suppressed) + len(deid.suppressed),
                              quarantined=len(quarantined))
        staged = None
        # A large release's gate helper starts now: it reads the gate's inputs and runs the deep attackers
        # on the core staging leaves idle (the stages' workers are gone); a small run's pool has warm processes.
        helper = gate_publish.start_gate(deid, part, config, labels=ing.labels, counts=counts, lineage=lin) \
            if executor is None else None
        try:
            if deid.parts:
                with _timed(timings, "stage"):
                    staged = s.stage(deid, ing, self.layout, config, release_id=self.release_id, lineage=lin,
                                     executor=executor)
            extra_checks = (*ing.checks, *aligned.checks, *part.checks, *(lin.checks if lin else ()),
                            *(staged.checks if staged else ()))
            validation = {**ing.validation, **({"aligned": aligned.validation} if aligned.validation else {}),
                          **({"release": staged.validation} if staged else {})}
            with _timed(timings, "gate"):
                g = s.gate(deid, part, config, labels=ing.labels, counts=counts, extra_checks=extra_checks,
                           staged=staged, lineage=lin, executor=executor,
                           **({"helper": helper} if helper is not None else {}))
        finally:
            if helper is not None:
                helper.close()
        fault_point("gate")
        with _timed(timings, "report"):
            report = build_report(
                release_id=self.release_id, run_id=self.run_id, created_at=run_setup.now_iso(), config=config,
                ingested=ing, aligned=aligned, partitioned=part, deidentified=deid, lineage=lin, staged=staged,
                gate=g, counts=counts, quarantine_by_reason=by_reason, validation=validation, notes=notes,
                timings=timings, signing=self.signing, versions=run_versions())
        # The lineage the release is registered in: the one planned (a routed drop's is another dataset's).
        dataset = lin.state.dataset if lin is not None else ing.dataset
        return self.commit(report, staged, dataset=dataset, validation=validation, timings=timings, lin=lin,
                           person_faces=part.person_faces)

    def walk_features(self) -> RunResult:
        """A feature drop: ingest, who is who, partitions, de-identify, stage, gate (nothing to align or distribute)."""
        f, config, layout = self.steps.features, self.config, self.layout
        timings: Timings = {}
        with _timed(timings, "ingest"):
            ing = f.ingest(self.drop, layout, config)
        if isinstance(ing, UnreadableDrop):
            return self.unreadable(ing)
        fault_point("ingest")
        # Successive releases of one dataset: the same lineage registry as faces (k-Same family only), and the same
        # person index across datasets (a record's fingerprint: its vector's bytes).
        routing = None
        if config.lineage_applies:
            drop = ing.drop
            routing = person_search.claim_records(config, drop.dataset, list(drop.subject_ids),
                                             vector_fingerprints(drop.vectors))
            if routing.aliases:
                ing = replace(ing, drop=replace(drop, subject_ids=tuple(routing.aliases.get(s, s)
                                                                        for s in drop.subject_ids)))
        lineage_state = (self.steps.open_lineage(routing.dataset if routing else ing.drop.dataset, config)
                         if config.lineage_applies else None)
        with _timed(timings, "identity"):
            identity = f.identify(ing, config)
        with _timed(timings, "partition"):
            part = f.partition(ing, identity, config, lineage_state=lineage_state)
        if routing is not None:
            # Vectors have no face to search: the person index looked them up by fingerprint and id only.
            detail = ("face search: not applicable (a feature drop has no faces); the person index looked its records "
                      "up by vector fingerprint and steward id only")
            part = replace(part, notes=(*part.notes, *((routing.note,) if routing.note else ())),
                           checks=(*part.checks, Check("person_index", True, 0, None, detail)))
        with _timed(timings, "deidentify"):
            deid = f.deidentify(ing, identity, part, layout, config)
        lin = None
        if part.lineage is not None:
            # New clusters registered as made; returning people's records carry their stored vectors.
            with _timed(timings, "lineage"):
                lin = f.apply_lineage(ing, identity, part, deid, config, release_id=self.release_id)
            # A feature run's lineage holds the feature release's rows (apply_feature_lineage), though the
            # contract names the image run's type.
            deid = cast(FeatureDeidentified, lin.deidentified)
        quarantined = (*ing.drop.quarantined, *identity.quarantined)
        by_reason = gate_publish.quarantine_summary(quarantined, layout)
        counts = RecordCounts(records_in=ing.drop.records_in, judged=len(deid.rows), suppressed=part.suppressed,
                              quarantined=len(quarantined))
        staged = None
        if len(deid.rows):
            with _timed(timings, "stage"):
                staged = f.stage(ing, deid, layout, config, release_id=self.release_id, lineage=lin)
        validation = {**ing.validation, **({"feature_release": staged.validation} if staged and staged.validation
                                           else {})}
        with _timed(timings, "gate"):
            g = f.gate(ing, identity, part, deid, config, counts=counts, staged=staged, lineage=lin)
        fault_point("gate")
        report = feature_report(
            release_id=self.release_id, run_id=self.run_id, created_at=run_setup.now_iso(), config=config,
            ingested=ing, identity=identity, partitioned=part, deidentified=deid, staged=staged, gate=g,
            counts=counts, quarantine_by_reason=by_reason, timings=timings, signing=self.signing,
            versions=run_versions(), lineage=lin, validation=validation)
        dataset = lin.state.dataset if lin is not None else ing.drop.dataset  # a routed drop's lineage
        return self.commit(report, staged, dataset=dataset, validation=validation, timings=timings, lin=lin)

    def commit(self, report: Report, staged: Staged | None, *, dataset: str, validation: Mapping[str, Any],
               timings: Timings, lin: LineageApplied | None = None, person_faces: Path | None = None) -> RunResult:
        """The order of commitment after the gate: validate the report, card, attestation, sign, then publish or withhold."""
        s, config, passed = self.steps, self.config, report.verdict == "released"
        # Before anything is committed: a report the schema refuses stops the run with nothing registered,
        # signed or published.
        with _timed(timings, "report"):
            validate_report(report.to_dict())
        registered = None
        if passed and lin is not None:
            # Registered (pending) before the report is signed and the release published: a crash from here
            # on can never let the next run re-cluster these people; the next run settles the status.
            with _timed(timings, "register"):
                registered = s.register_lineage(dataset, lin.state, config, lin.release)
                # The faces go with the people (issue 27): a later drop of other photographs of them under new ids and
                # another dataset name is found by face. A rejected run registers none.
                person_search.register_person_faces(config, dataset, person_faces, logger=self.logger)
            fault_point("register")
            if registered is not None and report.lineage:
                # The signed report binds the registry head after this release's entry: a registry later
                # restored from an earlier copy (or deleted) no longer reaches it and the next run is refused.
                report = replace(report, lineage={**report.lineage, "registry_head": head_doc(registered)})
        elif not passed and staged is not None:
            s.withhold(staged)
        if passed:
            if staged is None:  # the gate passes only a staged release (judge): say so before anything is signed
                raise StateError(f"release {self.release_id} passed the gate but nothing was staged")
            # The dataset card states the gate's figures; written into the staged release before it is hashed.
            with _timed(timings, "card"):
                listing = s.dataset_card(staged, report)
                report = replace(report, artifacts=list(listing.artifacts), file_manifest=listing.manifest)
            # The release's own signed attestation (the public part of this report, with the files' hashes), so a
            # recipient verifies the release directory alone; the report lists it in turn.
            with _timed(timings, "attest"):
                report = s.attest(staged, report, config)
        if "stage_seconds" in report.configuration:
            # The report's own steps so far are in the signed stage seconds too; signing, publishing and
            # settling the lineage come after (RunResult.timings, printed by `deid run`).
            report = replace(report, configuration={**report.configuration, "stage_seconds": dict(timings)})
        # report.html shows sample faces of a released image run (a feature release has none).
        with _timed(timings, "sign"):
            signed = s.write_report(report, config, validation=validation,
                                    staged=staged if passed and config.kind == "images" else None)
        fault_point("sign")
        published = (self.publish(staged, dataset, report_dir=signed.dir, timings=timings, lineage=lin is not None)
                     if passed and staged is not None else None)
        if lin is not None and published is not None:
            with _timed(timings, "register"):
                self.settle_lineage(dataset, "published", state=registered)
        # The verdict in the marker: DEID_KEEP_STAGING=failed keeps rejected runs' staging (deid.operations.retention).
        self.layout.complete.write_text(json.dumps({"verdict": report.verdict}))
        self.logger.info("verdict: %s; report %s", report.verdict, signed.path)
        return RunResult(release_id=self.release_id, verdict=report.verdict, report=report, report_path=signed.path,
                         public_key=signed.public_key, key_origin=signed.key_origin, staging=self.layout.root,
                         release_dir=published.path if published else None,
                         linkage=published.linkage if published else None, timings=dict(timings))

    def publish(self, staged: Staged, dataset: str, *, report_dir: Path, timings: Timings,
                lineage: bool) -> Published:
        """Publish by one rename; a failure after signing gets a signed addendum and publishes nothing."""
        s = self.steps
        try:
            with _timed(timings, "publish"):
                published: Published = s.publish(staged, self.config, release_id=self.release_id)
        except Exception as exc:
            # Signed "released" but not published: say so under the same key, and keep nothing staged.
            s.publish_failed(report_dir, self.config, release_id=self.release_id, error=f"{type(exc).__name__}: {exc}")
            s.withhold(staged)
            if lineage:
                self.settle_lineage(dataset, "abandoned")
            if isinstance(exc, OSError):
                raise EnvironmentFailure.from_oserror(
                    exc, doing=f"publishing {self.release_id} failed after its report was signed (signed addendum "
                               f"{report_dir / 'addendum.json'}; nothing published)") from None
            raise StateError(f"publishing {self.release_id} failed after its report was signed: {exc}; a signed "
                             f"addendum says it was not published") from exc
        fault_point("publish")
        return published

    def settle_lineage(self, dataset: str, kind: str, *, state: Any = None) -> None:
        """Mark a registered release published or abandoned; if that fails, the next run's reconcile settles it.

        ``state``: the registry's state this run's registration returned (not read and replayed again).
        """
        try:
            self.steps.register_lineage(dataset, state, self.config, mark=kind, release_id=self.release_id)
        except (StateError, OSError) as exc:
            self.logger.warning("lineage %s: could not mark %s %s (%s); the next run settles it from the releases "
                        "directory", dataset, self.release_id, kind, exc)

    def retain(self) -> None:
        """After the verdict and publication (the lock released): apply DEID_KEEP_STAGING to the staging directory.

        This run's staging and any older finished run's are trimmed to what the policy keeps; live runs are
        never touched. A failure here is logged, never the run's: its verdict is signed and published already.
        """
        from deid.operations.retention import apply_retention  # noqa: PLC0415

        try:
            res = apply_retention(self.config.data_path, self.config.reports_path, self.config.keep_staging,
                                  measure=False)
        except OSError as exc:
            self.logger.warning("staging retention (DEID_KEEP_STAGING=%s) failed: %s; `deid gc` applies it later",
                                self.config.keep_staging, exc)
            return
        trimmed = sum(1 for n in res.freed.values() if n)
        if trimmed:
            self.logger.info("staging retention (DEID_KEEP_STAGING=%s): %d bytes freed in %d run(s), this run's "
                             "staging keeps %d bytes", self.config.keep_staging, res.freed_total, trimmed,
                             res.kept.get(self.release_id, 0))

    def unreadable(self, ing: UnreadableDrop) -> RunResult:
        """A drop that cannot be read is a verdict on the input: a signed rejection naming the reason."""
        reason = f"unreadable drop: {ing.reason}"
        discard(self.layout.root)  # nothing was staged worth keeping
        signed = self.sign_rejection(reason)
        if signed is None:
            raise StateError(f"{reason}; and its signed rejection could not be written (see the log)")
        report, path = signed
        return RunResult(release_id=self.release_id, verdict="rejected", report=report, report_path=path.path,
                         public_key=path.public_key, key_origin=path.key_origin, input_error=ing.reason)

    def refused(self, exc: DataError | ConfigError) -> RunResult:
        """A data or configuration error raised after the ingest (in a stage or the gate): a signed rejection.

        Nothing is published; a report already signed (the error came after it) is never replaced.
        """
        # A refusal (e.g. the person index naming the dataset that holds the drop's people) is a verdict on the
        # drop, worded as such; any other error says the drop could not be judged.
        reason = str(exc) if isinstance(exc, CrossDatasetRefusal) else f"{UNUSABLE_DROP}: {exc}"
        self.logger.error("release %s: %s", self.release_id, reason)
        self.abandon()
        if (self.report_dir / "report.json.sig").exists():
            raise exc
        # A refusal with its own check (e.g. the person index's, naming the other dataset), else gate_error.
        signed = self.sign_rejection(reason, check=getattr(exc, "check", "gate_error"))
        if signed is None:
            raise StateError(f"{reason}; and its signed rejection could not be written (see the log)") from exc
        report, path = signed
        return RunResult(release_id=self.release_id, verdict="rejected", report=report, report_path=path.path,
                         public_key=path.public_key, key_origin=path.key_origin, input_error=reason)

    def sign_rejection(self, reason: str, *, check: str = "drop_readable") -> tuple[Report, SignedReport] | None:
        """The signed rejection of a run that could not get as far as the gate; (report, SignedReport) or None."""
        # Fingerprinted by what describes the drop without reading it: its manifest, or a feature drop's drop.yaml.
        # Read as every drop file is (no link followed, a FIFO refused at once): a rejection never waits on it.
        try:
            raw = read_drop_file(Path(self.drop), DROP_YAML if self.config.kind == "features" else MANIFEST)
        except (RecordError, OSError):
            raw = b""
        report = build_rejection(release_id=self.release_id, run_id=self.run_id, created_at=run_setup.now_iso(),
                                 config=self.config, drop=self.drop, reason=reason,
                                 fingerprint=dataset_fingerprint(raw, []), signing=self.signing,
                                 versions=run_versions(), check=check)
        try:
            return report, self.steps.write_report(report, self.config)
        except Exception as exc:  # noqa: BLE001 - e.g. the reports disk is the full one: say so, raise the cause
            self.logger.error("could not write the signed rejection: %s", exc)
            return None

    def fail(self, reason: str, *, check: str) -> None:
        """A run that fails without a verdict: abandon it, and sign a rejection saying why unless one is signed."""
        self.abandon()
        if not (self.report_dir / "report.json.sig").exists():  # never replace a signed report
            self.sign_rejection(reason, check=check)

    def abandon(self) -> None:
        """A run that fails: its private staging (and any staged release) goes, and so does an unsigned report."""
        discard(self.layout.root)
        if self.report_dir.is_dir() and not (self.report_dir / "report.json.sig").exists():
            discard(self.report_dir)
        self.logger.info("removed the staging directory %s of the failed run", self.layout.root)
