"""The ``release`` flow: a dropped dataset in, a gated k-anonymous release (or a signed rejection) out."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from deid.errors import ConfigError
from deid.gate import GateConfig
from deid.methods import REGISTRY, guarantee
from deid.publish import new_release_id
from deid.settings import Settings
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
    """Ingest, align, featurize, partition, de-identify, gate, publish (if passed) and report."""
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
    if policy not in ("suppress", "merge", "fail"):
        raise ConfigError(f"small_partitions={policy!r} must be one of suppress, merge, fail")
    release_id = new_release_id()
    staging = settings.data_path / "staging" / release_id
    staging.mkdir(parents=True)
    logger.info("release %s: drop %s, k=%d, method %s", release_id, drop, k, method)

    timings: dict[str, float] = {}
    with _timed(timings, "ingest"):
        ing = t.ingest_drop(drop, str(staging), labels=labels, name=name, max_pixels=settings.max_pixels,
                            batch_size=settings.align_batch_size, workers=settings.dask_workers, k=k)
    labels = ing["labels"]
    select = METHODS[method]["select"] and bool(labels)
    notes: list[str] = []
    if METHODS[method]["select"] and not labels:
        notes.append(f"{method} without utility labels runs as k-Same (one partition); utility is not applicable")
        logger.warning("%s", notes[-1])
    w, h = settings.canonical_size
    aligner = {"size": [w, h], "eye_left": list(settings.canonical_eyes()[0]),
               "eye_right": list(settings.canonical_eyes()[1]), "max_upsample": settings.max_upsample,
               "min_eye_distance": settings.min_eye_distance_px}
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
                                   address=address, embed_max=settings.identity_embed_max, shape_hw=(h, w))
            quarantined += part["quarantined"]
            if part["partitions"]:
                with _timed(timings, "deidentify"):
                    de = t.deidentify(address, part["partitions"], str(staging), k=k, method=method,
                                      shape_hw=[h, w], sigma=sigma, block=block, labels=labels)
                deid_parts, clusters = de["parts"], de["clusters"]
    by_reason = t.quarantine_summary(quarantined, str(staging))
    counts = {"in": ing["records_in"], "suppressed": len(part["suppressed"]), "quarantined": len(quarantined)}
    small_detail = "; ".join(f"{e['partition']} has {e['people']} people: {e['action']}" for e in part["small"])
    releases_dir = str(settings.data_path / "releases")
    staged = None
    if deid_parts:
        with _timed(timings, "stage"):
            staged = t.stage(deid_parts, ing["ingested"], str(staging), labels=labels, shape=(h, w),
                             releases_dir=releases_dir, release_id=release_id, k=k)
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
                       file_metadata=staged["file_metadata"] if staged else None, extra_checks=extra_checks)
    released_dir, artifacts, linkage = None, [], None
    if g["passed"]:
        with _timed(timings, "publish"):
            pub = t.publish(staged, str(staging), releases_dir=releases_dir, release_id=release_id)
        released_dir, artifacts, linkage = pub["path"], staged["artifacts"], pub["linkage"]
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
        "validation": validation,
        "artifacts": artifacts,
        "release_dir": released_dir,
        "configuration": {
            "labels": labels,
            "notes": notes,
            "identity": part["identity"],
            "duplicate_ids": settings.duplicate_ids,
            "small_partitions": policy,
            "canonical_size": [w, h],
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
            "small_partitions_detail": part["small"],
            "clusters": {"count": len(clusters), "sizes": sorted(c["size"] for c in clusters)},
            "extra_manifest_columns": ing["extra_columns"],
            "dask": settings.dask_address or f"LocalCluster({settings.dask_workers} workers)",
            "stage_seconds": timings,
        },
    }
    rep = t.write_report(str(settings.reports_path / release_id), report=report,
                         signing_key_path=str(settings.signing_key) if settings.signing_key else None,
                         keys_dir=str(settings.data_path / "keys"), validation=validation)
    t.ui_artifacts(rep["path"])
    logger.info("verdict: %s; report %s", report["verdict"], rep["path"])
    return {"release_id": release_id, "verdict": report["verdict"], "reasons": g["reasons"],
            "report": rep["path"], "report_dir": str(Path(rep["path"]).parent), "release_dir": released_dir,
            "public_key": rep["public_key"], "key_origin": rep["key_origin"], "dataset": report["dataset"],
            "privacy": report["privacy"], "utility": report["utility"], "staging": str(staging),
            "timings": timings, "linkage": linkage}
