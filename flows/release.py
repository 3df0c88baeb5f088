"""The ``release`` flow: a dropped dataset in, a gated k-anonymous release (or a signed rejection) out.

Order of commitment (see deid/operations/safety.py): pre-flight (signing key, writable locations) -> recovery
of killed runs' leftovers -> lock the run's staging directory -> work, staging the would-be
release inside it -> gate -> write, validate and sign the report -> publish by one rename. A
publish that fails after signing gets a signed addendum and the release stays unpublished.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from deid.errors import ConfigError, EnvironmentFailure, StateError
from deid.evaluation.gate import GateConfig
from deid.anonymise.methods import REGISTRY, guarantee
from deid.release.publish import discard, new_release_id
from deid.reporting.report import dataset_fingerprint
from deid.operations.safety import RunLock, fault_point
from deid.settings import Settings
from deid.operations.stages import COLOR_METHODS, republished_members
from tasks import stages as t
from tasks.cluster import dask_cluster

@contextmanager
def _timed(timings: dict, stage: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[stage] = round(timings.get(stage, 0.0) + time.perf_counter() - t0, 4)


# Which methods partition by the utility labels. k-same-naive, blur and pixelate exist to be
# compared (and rejected) by the same gate; they carry no formal guarantee.
METHODS = {name: dict(select=spec.partitions_by_labels) for name, spec in REGISTRY.items()}


@flow(name="release", log_prints=False, validate_parameters=True)
def release(drop: str, k: int | None = None, method: str | None = None, labels: list[str] | None = None,
            small_partitions: str | None = None, name: str | None = None, sigma: float | None = None,
            block: int | None = None) -> dict:
    """Ingest, align, featurize, partition, de-identify, gate, report (signed) and publish (if passed)."""
    logger = get_run_logger()
    settings = Settings()
    k = settings.k if k is None else k
    method = method or settings.method
    policy = small_partitions or settings.small_partitions
    sigma = settings.sigma if sigma is None else sigma
    block = settings.block if block is None else block
    if not isinstance(k, int) or k < 2:
        raise ConfigError(f"k={k!r} must be an integer >= 2; k is the minimum number of people per cluster")
    if method not in METHODS:
        raise ConfigError(f"method={method!r} must be one of {sorted(METHODS)}")
    if settings.color and method not in COLOR_METHODS:
        raise ConfigError(f"method={method!r} cannot release colour (DEID_COLOR=true); use one of {list(COLOR_METHODS)}")
    if policy not in ("suppress", "merge", "fail"):
        raise ConfigError(f"small_partitions={policy!r} must be one of suppress, merge, fail")
    # Before any work: the signing key loads and every location is writable.
    t.preflight()
    recovered = t.recover_leftovers()["removed"]
    release_id = new_release_id()
    staging = settings.data_path / "staging" / release_id
    lock = RunLock.create(staging)
    logger.info("release %s: drop %s, k=%d, method %s", release_id, drop, k, method)
    report_dir = settings.reports_path / release_id
    try:
        result = _run(drop, release_id=release_id, staging=staging, settings=settings, k=k, method=method,
                      labels=labels, policy=policy, name=name, sigma=sigma, block=block)
    except OSError as exc:
        failure = EnvironmentFailure.from_oserror(exc, doing=f"release {release_id} failed")
        _abandon(staging, report_dir, logger)
        if not (report_dir / "report.json.sig").exists():  # never replace a signed report
            _sign_rejection(release_id, report_dir, drop=drop, name=name, k=k, method=method, settings=settings,
                            reason=f"environment failure (not a verdict on the data): {failure}", logger=logger,
                            check="environment")
        raise failure from None
    except BaseException:
        _abandon(staging, report_dir, logger)
        raise
    finally:
        lock.close()
    result["recovered"] = recovered
    return result


def _abandon(staging: Path, report_dir: Path, logger) -> None:
    """A run that fails: its private staging (and any staged release) goes, and so does an unsigned report."""
    discard(staging)
    if report_dir.is_dir() and not (report_dir / "report.json.sig").exists():
        discard(report_dir)
    logger.info("removed the staging directory %s of the failed run", staging)


def _lineage_section(dataset: str, plan, lin: dict | None, *, registered: bool, method: str) -> dict:
    """The report's ``lineage`` section: counts and decisions only (no pseudonym, fingerprint or cluster key)."""
    if plan is None:
        spec = REGISTRY[method]
        why = ("not applicable: the method gives no identical image per cluster to register"
               if not (spec.identical_within_cluster and spec.clustered) else "not planned: nothing reached partitioning")
        return {"dataset": dataset, "applied": False, "detail": why}
    counts = dict(lin["release"].counts) if lin else {}
    return {**plan.summary(), "applied": True, "based_on_head": plan.based_on_head,
            "registered": bool(registered and lin), "release_counts": counts}


def _settle_lineage(dataset: str, state, release_id: str, kind: str, logger) -> None:
    """Mark a registered release published or abandoned; if that fails, the next run's reconcile settles it."""
    try:
        t.lineage_register(dataset, state, mark=kind, release_id=release_id)
    except (StateError, OSError) as exc:
        logger.warning("lineage %s: could not mark %s %s (%s); the next run settles it from the releases directory",
                       dataset, release_id, kind, exc)


def _manifest_fingerprint(drop: str) -> str:
    try:
        raw = (Path(drop) / "manifest.csv").read_bytes()
    except OSError:
        raw = b""
    return dataset_fingerprint(raw, [])


def _sign_rejection(release_id: str, report_dir: Path, *, drop: str, name: str | None, k: int, method: str,
                    settings: Settings, reason: str, logger, labels: list[str] | None = None,
                    check: str = "drop_readable") -> dict | None:
    """The signed rejection of a run that could not get as far as the gate (bad drop, environment failure)."""
    report = {
        "release_id": release_id, "run_id": str(flow_run.get_id() or release_id), "verdict": "rejected",
        "reasons": [reason], "k": k, "method": method, "guarantee": guarantee(method, k), "created_at": t.now_iso(),
        "dataset": {"name": name or Path(drop).name or "drop", "fingerprint": _manifest_fingerprint(drop),
                    "records_in": 0, "records_released": 0, "records_suppressed": 0, "records_quarantined": 0,
                    "quarantine_by_reason": {}},
        "checks": [{"name": check, "passed": False, "value": None, "threshold": None, "detail": reason}],
        "privacy": {"bound": 1.0 / k, "max_rate": None, "min_distinct_people_per_cluster": None,
                    "reidentification": []},
        "utility": [], "validation": {}, "artifacts": [], "release_dir": None,
        "configuration": {"labels": labels or [], "fingerprint_scope": "manifest.csv only (no image was read)"},
    }
    try:
        rep = t.write_report(str(report_dir), report=report)
    except Exception as exc:  # noqa: BLE001 - e.g. the reports disk is the full one: say so, raise the cause
        logger.error("could not write the signed rejection: %s", exc)
        return None
    return rep


def _run(drop: str, *, release_id: str, staging: Path, settings: Settings, k: int, method: str,
         labels: list[str] | None, policy: str, name: str | None, sigma: float, block: int) -> dict:
    """The run's work, inside its locked staging directory; returns the flow's result."""
    logger = get_run_logger()
    timings: dict[str, float] = {}
    with _timed(timings, "ingest"):
        ing = t.ingest_drop(drop, str(staging), labels=labels, name=name, max_pixels=settings.max_pixels,
                            batch_size=settings.align_batch_size, workers=settings.dask_workers, k=k)
    if "drop_error" in ing:
        reason = f"unreadable drop: {ing['drop_error']}"
        discard(staging)  # nothing was staged worth keeping
        rep = _sign_rejection(release_id, settings.reports_path / release_id, drop=drop, name=name, k=k,
                              method=method, settings=settings, reason=reason, logger=logger, labels=labels)
        if rep is None:
            raise StateError(f"{reason}; and its signed rejection could not be written (see the log)")
        return {"release_id": release_id, "verdict": "rejected", "reasons": [reason], "report": rep["path"],
                "report_dir": str(Path(rep["path"]).parent), "release_dir": None, "public_key": rep["public_key"],
                "key_origin": rep["key_origin"], "input_error": ing["drop_error"], "staging": None,
                "dataset": {"records_in": 0, "records_released": 0, "records_suppressed": 0,
                            "records_quarantined": 0}, "privacy": {"max_rate": None}, "utility": [],
                "timings": {}, "linkage": None}
    fault_point("ingest")
    releases_dir = str(settings.data_path / "releases")
    # Successive releases of one dataset (deid.release.lineage): only methods that give every cluster member
    # the identical image have registered averages to keep; the others are gated on their own.
    spec = REGISTRY[method]
    lineage_state = (t.lineage_open(ing["dataset"], releases_dir)
                     if spec.identical_within_cluster and spec.clustered else None)
    lin = None
    labels = ing["labels"]
    select = METHODS[method]["select"] and bool(labels)
    notes: list[str] = []
    if METHODS[method]["select"] and not labels:
        notes.append(f"{method} without utility labels runs as k-Same (one partition); utility is not applicable")
        logger.warning("%s", notes[-1])
    w, h = settings.canonical_size
    aligner = {"size": [w, h], "eye_left": list(settings.canonical_eyes()[0]),
               "eye_right": list(settings.canonical_eyes()[1]), "max_upsample": settings.max_upsample,
               "min_eye_distance": settings.min_eye_distance_px, "color": settings.color}
    quarantined = list(ing["quarantined"])
    deid_parts: list[str] = []
    aligned_parts: list[str] = []
    part: dict = {"partitions": [], "suppressed": [], "small": [], "failed": False, "identity": None,
                  "quarantined": []}
    clusters: list[dict] = []
    eye_sources: dict = {}
    validation = dict(ing["validation"])
    extra_checks = list(ing["checks"])
    # An empty drop or one with fewer than k people goes straight to a (rejected) gate.
    proceed = all(c["passed"] for c in ing["checks"] if c["name"] in ("drop_not_empty", "enough_people"))
    t0 = time.perf_counter()
    with dask_cluster(settings.dask_address, workers=settings.dask_workers) as address:
        timings["cluster_start"] = round(time.perf_counter() - t0, 4)
        if ing["staged"] and proceed:
            with _timed(timings, "align"):
                al = t.align(address, ing["ingested"], ing["row_groups"], str(staging), aligner, ing["staged"])
            fault_point("align")
            quarantined += al["quarantined"]
            aligned_parts, eye_sources = al["parts"], al["eye_sources"]
            if al["validation"]:
                validation["aligned"] = al["validation"]
                extra_checks.append(t.suite_check(al["validation"]).to_dict())
        n_aligned = ing["staged"] - (len(quarantined) - len(ing["quarantined"]))
        if n_aligned >= 2 and proceed:
            with _timed(timings, "featurize"):
                feats = t.featurize(address, aligned_parts, str(staging), settings.pca_components, settings.seed or 0)
            with _timed(timings, "partition"):
                part = t.partition(ing["ingested"], aligned_parts, feats["parts"], str(staging), labels=labels,
                                   k=k, select=select, policy=policy, duplicate_ids=settings.duplicate_ids,
                                   address=address, embed_max=settings.identity_embed_max, shape_hw=(h, w),
                                   lineage=lineage_state, lineage_policy=settings.lineage_policy,
                                   lineage_absent=settings.lineage_absent)
            quarantined += part["quarantined"]
            if part["partitions"]:
                with _timed(timings, "deidentify"):
                    de = t.deidentify(address, part["partitions"], str(staging), k=k, method=method,
                                      shape_hw=[h, w], sigma=sigma, block=block, labels=labels,
                                      color=settings.color)
                deid_parts, clusters = de["parts"], de["clusters"]
            if part.get("lineage_plan") is not None:
                # New clusters registered as made; returning people's records carry their stored averages.
                with _timed(timings, "lineage"):
                    lin = t.lineage_release(part["lineage_plan"], lineage_state, part["lineage_ids"], deid_parts,
                                            str(staging), release_id=release_id, method=method, shape_hw=[h, w],
                                            lineage_dir=part["lineage_dir"])
                    if lin["part"]:
                        deid_parts, clusters = [*deid_parts, lin["part"]], [*clusters, *lin["clusters"]]
                    extra_checks += t.lineage_checks(lineage_state, lin["release"], part["lineage_plan"],
                                                     part["lineage_ids"], aligned_parts)
    by_reason = t.quarantine_summary(quarantined, str(staging))
    counts = {"in": ing["records_in"], "suppressed": len(part["suppressed"]), "quarantined": len(quarantined)}
    # Counts only, never the label values: a rare value held by one person is itself identifying.
    small_detail = "; ".join(f"a partition of {e['records']} records has {e['people']} people: {e['action']}"
                             for e in part["small"])
    staged = None
    if deid_parts:
        with _timed(timings, "stage"):
            staged = t.stage(deid_parts, ing["ingested"], str(staging), labels=labels, shape=(h, w),
                             release_id=release_id, k=k, lineage_release=lin["release"] if lin else None,
                             lineage_state=lineage_state)
        validation["release"] = staged["validation"]
        extra_checks.append(t.suite_check(staged["validation"]).to_dict())
    gate_config = GateConfig(
        k=k, method=method, labels=tuple(labels), tolerance=settings.utility_tolerance,
        confidence=settings.gate_confidence, max_quarantine_fraction=settings.max_quarantine_fraction,
        leak_threshold=settings.leak_threshold, attack_sample=settings.attack_sample,
        deep_attack_sample=settings.deep_attack_sample,
        utility_sample=settings.utility_sample, utility_inconclusive=settings.utility_inconclusive,
        folds=settings.cv_folds, repeats=settings.cv_repeats, n_components=settings.pca_components,
        seed=settings.seed or 0)
    with _timed(timings, "gate"):
        g = t.run_gate(deid_parts, config=gate_config, counts=counts,
                       partition_failed=part["failed"], partition_detail=small_detail, shape_hw=[h, w],
                       sigma=sigma, block=block, partitions_root=str(staging / "partitions"),
                       file_metadata=staged["file_metadata"] if staged else None, extra_checks=extra_checks,
                       lineage_members=republished_members(lin["release"], lineage_state) if lin else None)
    fault_point("gate")
    released_dir, artifacts, linkage = None, [], None
    if g["passed"] and lin is not None:
        # Registered (pending) before the report is signed and the release published: a crash from here
        # on can never let the next run re-cluster these people; the next run settles the status.
        lineage_state = t.lineage_register(ing["dataset"], lineage_state, lin["release"])
    if g["passed"]:
        # Where the release will be once published; the report is signed before the rename.
        released_dir, artifacts = str(Path(releases_dir) / release_id), staged["artifacts"]
    elif staged is not None:
        t.withhold(staged, str(staging))
    n_released = sum(c["size"] for c in clusters) if g["passed"] else 0
    report = {
        "release_id": release_id,
        "run_id": str(flow_run.get_id() or release_id),
        "verdict": "released" if g["passed"] else "rejected",
        "reasons": g["reasons"],
        "warnings": g["warnings"],
        "k": k,
        "method": method,
        "guarantee": guarantee(method, k),
        "created_at": t.now_iso(),
        "dataset": {
            "name": ing["name"],
            "fingerprint": ing["fingerprint"],
            "records_in": ing["records_in"],
            "records_released": n_released,
            # A rejected run releases nothing: what would have been released is withheld too.
            "records_suppressed": counts["suppressed"] + (0 if g["passed"] else sum(c["size"] for c in clusters)),
            "records_quarantined": counts["quarantined"],
            "quarantine_by_reason": by_reason,
        },
        "checks": g["checks"],
        "privacy": {
            "bound": 1.0 / k,
            "max_rate": g["max_rate"],
            "min_distinct_people_per_cluster": g["min_people"],
            "max_person_share": g["max_person_share"],
            "exact_bound": g["exact_bound"],
            "attack_sample": g["attack_sample"],
            "reidentification": g["reidentification"],
        },
        "utility": g["utility"],
        "lineage": _lineage_section(ing["dataset"], part.get("lineage_plan"), lin, registered=g["passed"],
                                    method=method),
        "validation": validation,
        "artifacts": artifacts,
        "release_dir": released_dir,
        "configuration": {
            "labels": labels,
            "license": ing["license"],
            "notes": notes,
            "identity": part["identity"],
            "duplicate_ids": settings.duplicate_ids,
            "small_partitions": policy,
            "canonical_size": [w, h],
            "color": settings.color,
            "canonical_eyes": [list(e) for e in settings.canonical_eyes()],
            "pca_components": settings.pca_components,
            "utility_tolerance": settings.utility_tolerance,
            "utility_protocol": "cross-fit",
            "utility_sample": settings.utility_sample,
            "utility_inconclusive": settings.utility_inconclusive,
            "gate_confidence": settings.gate_confidence,
            "attack_sample": settings.attack_sample,
            "deep_attack_sample": settings.deep_attack_sample,
            "leak_threshold": settings.leak_threshold,
            **({"sigma": sigma} if method == "blur" else {}),
            **({"block": block} if method == "pixelate" else {}),
            "max_quarantine_fraction": settings.max_quarantine_fraction,
            "cv_folds": settings.cv_folds,
            "cv_repeats": settings.cv_repeats,
            "eye_sources": eye_sources,
            "partitions": [{"key": p["key"], "records": p["records"], "people": p["people"]}
                           for p in part["partitions"]],
            # Counts only, never the label values of a partition too small to release.
            "small_partitions_detail": [{"records": e["records"], "people": e["people"], "action": e["action"]}
                                        for e in part["small"]],
            "clusters": {"count": len(clusters), "sizes": sorted(c["size"] for c in clusters)},
            "extra_manifest_columns": ing["extra_columns"],
            "dask": settings.dask_address or f"LocalCluster({settings.dask_workers} workers)",
            "stage_seconds": timings,
        },
    }
    if g["passed"]:
        # The dataset card states the gate's figures; written into the staged release before it is hashed and signed.
        report["artifacts"] = t.dataset_card(staged, report=report)
    report_dir = settings.reports_path / release_id
    rep = t.write_report(str(report_dir), report=report, validation=validation,
                         release_files=staged["tmp"] if g["passed"] else None)
    fault_point("sign")
    if g["passed"]:
        try:
            with _timed(timings, "publish"):
                pub = t.publish(staged, str(staging), releases_dir=releases_dir, release_id=release_id)
        except Exception as exc:
            # Signed "released" but not published: say so under the same key, and keep nothing staged.
            t.publish_failed_addendum(str(report_dir), release_id=release_id, error=f"{type(exc).__name__}: {exc}")
            t.withhold(staged, str(staging))
            if lin is not None:
                _settle_lineage(ing["dataset"], lineage_state, release_id, "abandoned", logger)
            if isinstance(exc, OSError):
                raise EnvironmentFailure.from_oserror(
                    exc, doing=f"publishing {release_id} failed after its report was signed (signed addendum "
                               f"{report_dir / 'addendum.json'}; nothing published)") from None
            raise StateError(f"publishing {release_id} failed after its report was signed: {exc}; a signed "
                             f"addendum says it was not published") from exc
        linkage = pub["linkage"]
        fault_point("publish")
        if lin is not None:
            _settle_lineage(ing["dataset"], lineage_state, release_id, "published", logger)
    t.ui_artifacts(rep["path"])
    (staging / ".complete").touch()
    logger.info("verdict: %s; report %s", report["verdict"], rep["path"])
    return {"release_id": release_id, "verdict": report["verdict"], "reasons": g["reasons"],
            "report": rep["path"], "report_dir": str(Path(rep["path"]).parent), "release_dir": released_dir,
            "public_key": rep["public_key"], "key_origin": rep["key_origin"], "dataset": report["dataset"],
            "privacy": report["privacy"], "utility": report["utility"], "staging": str(staging),
            "timings": timings, "linkage": linkage}
