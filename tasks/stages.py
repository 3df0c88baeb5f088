"""Thin Prefect tasks around the core: I/O paths in, small summaries out, logging and retries.

Heavy work is submitted from these tasks to the Dask cluster as plain core functions, so Dask
workers never import Prefect (in Prefect's ephemeral mode each worker that does would start its
own temporary API server, ~10 s each).
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from distributed import as_completed
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from deid.evaluation import gate as gate_mod
from deid.operations import stages
from deid.release.card import DatasetCard, write_card
from deid.intake.drop import read_drop
from deid.errors import ConfigError, DataError, Quarantined, StateError
from deid.reporting.html_report import sample_release_images, write_report_bundle
from deid.intake.ingest import ingest, write_quarantine
from deid.evaluation.leaks import release_files_metadata
from deid.release.lineage import LineageError, build_release
from deid.release.lineage_checks import check_structure, differencing_attack
from deid.release.lineage_registry import Registry
from deid.release.linkage import build_linkage, ensure_linkage_key, linkage_path, sources_from_ingested, write_linkage
from deid.anonymise.methods import REGISTRY, method_runner
from deid.anonymise.partition import plan_partitions
from deid.release.publish import RELEASE_TABLE, commit_release, discard, stage_release
from deid.reporting.report import dataset_fingerprint, hash_tree
from deid.operations.safety import RELEASE_SUBDIR, fault_enospc, is_live, preflight_locations, recover, write_signed_addendum
from deid.settings import Settings
from deid.release.signing import ensure_signing_key
from deid.evaluation.validation import (
    drop_checks,
    suite_check,
    validate_aligned,
    validate_ingested,
    validate_manifest,
    validate_release,
)
from tasks.cluster import client_for

TASK = dict(cache_policy=NO_CACHE)


@task(name="ingest", **TASK)
def ingest_drop(drop_dir: str, staging: str, *, labels: list[str] | None, name: str | None,
                max_pixels: int, batch_size: int, workers: int, k: int) -> dict:
    """Validate the manifest and stage the image bytes as Parquet."""
    logger = get_run_logger()
    try:
        drop = read_drop(drop_dir, labels=labels, name=name)
    except DataError as exc:
        # An unreadable drop is a verdict on the input, not a crash: no traceback; the flow signs a rejection.
        logger.info("ingest: the drop is unreadable; the run signs a rejection naming the reason")
        return {"drop_error": str(exc)}
    staging_dir = Path(staging)
    # Several align tasks per worker even on small drops, at most batch_size records each.
    batch = max(1, min(batch_size, math.ceil(len(drop.rows) / (4 * max(workers, 1)))))
    res = ingest(drop, staging_dir / "ingested.parquet", max_pixels=max_pixels, batch_size=batch)
    quarantined = drop.quarantined + res.quarantined
    people = len(set(pq.read_table(res.path, columns=["subject_id"]).column("subject_id").to_pylist()))
    validation = {"manifest": validate_manifest(drop), "ingested": validate_ingested(res.path, drop.labels)}
    checks = [c.to_dict() for c in drop_checks(records_in=drop.records_in, people=people, k=k)]
    checks.append(suite_check(validation["ingested"]).to_dict())
    logger.info("ingest: %d of %d records staged, %d quarantined", res.n_records, drop.records_in, len(quarantined))
    if drop.extra_columns:
        logger.info("ingest: unknown manifest columns kept out of the release: %s", drop.extra_columns)
    return {
        "ingested": str(res.path),
        "row_groups": res.row_groups,
        "records_in": drop.records_in,
        "staged": res.n_records,
        "labels": drop.labels,
        "name": drop.name,
        "license": drop.license,
        "dataset": drop.dataset,
        "extra_columns": drop.extra_columns,
        "fingerprint": dataset_fingerprint(drop.manifest_bytes, res.source_sha256.values()),
        "quarantined": [q.__dict__ for q in quarantined],
        "people": people,
        "validation": validation,
        "checks": checks,
    }


@task(name="align", retries=1, retry_delay_seconds=2, **TASK)
def align(address: str, ingested: str, row_groups: int, staging: str, aligner_params: dict,
          total: int) -> dict:
    """Align every face on the Dask cluster, one task per Parquet row group."""
    logger = get_run_logger()
    client = client_for(address)
    out = Path(staging) / "aligned"
    futures = [
        client.submit(stages.align_batch, ingested, [g], str(out / f"part-{g:05d}.parquet"), aligner_params,
                      key=f"align-{Path(staging).name}-{g}", pure=False)
        for g in range(row_groups)
    ]
    parts, quarantined, done, sources = [], [], 0, Counter()
    for fut in as_completed(futures, loop=client.loop):
        res = fut.result()
        parts.append(res["path"])
        quarantined.extend(res["quarantined"])
        sources.update(res["eye_sources"])
        done += res["aligned"] + len(res["quarantined"])
        logger.info("align: %d/%d records", done, total)
    logger.info("align: %d aligned (%s), %d quarantined", sum(sources.values()), dict(sources), len(quarantined))
    w, h = aligner_params["size"]
    validation = validate_aligned(sorted(parts), pixel_bytes=int(w) * int(h)) if parts else None
    return {"parts": sorted(parts), "quarantined": quarantined, "eye_sources": dict(sources),
            "validation": validation}


@task(name="featurize", retries=1, retry_delay_seconds=2, **TASK)
def featurize(address: str, parts: list[str], staging: str, n_components: int, seed: int) -> dict:
    """Fit eigenfaces on the aligned set, then project every part on the cluster."""
    logger = get_run_logger()
    client = client_for(address)
    model = client.submit(stages.fit_eigenfaces, parts, n_components, seed, pure=False).result()
    logger.info("featurize: %d eigenfaces, %.1f%% of variance", model.n_components_,
                100 * float(np.sum(model.explained_variance_ratio_)))
    model_f = client.scatter(model, broadcast=True)
    out = Path(staging) / "features"
    futs = [client.submit(stages.project_part, p, model_f, str(out / Path(p).name), pure=False) for p in parts]
    n = sum(f.result() for f in futs)
    logger.info("featurize: %d faces projected", n)
    return {"parts": [str(out / Path(p).name) for p in parts], "n_components": model.n_components_}


def _load_faces(ingested: str, aligned_parts: list[str], feature_parts: list[str], labels: list[str]) -> pa.Table:
    meta = pq.read_table(ingested, columns=["record_id", "subject_id", *labels])
    pix = pa.concat_tables([pq.read_table(p, columns=["record_id", "pixels"]) for p in aligned_parts])
    feats = pa.concat_tables([pq.read_table(p) for p in feature_parts])
    faces = meta.join(pix, "record_id", join_type="inner")
    # Arrow joins cannot carry list columns, so the features are attached by position.
    where = {rid: i for i, rid in enumerate(feats.column("record_id").to_pylist())}
    take = pa.array([where[rid] for rid in faces.column("record_id").to_pylist()], pa.int64())
    return faces.append_column("features", feats.column("features").take(take))


def _embed_on_cluster(address: str, faces: pa.Table, shape_hw: tuple[int, int]) -> np.ndarray:
    """dlib descriptors of every face, chunked over the Dask workers; remembered for the gate's attacker."""
    from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415

    client = client_for(address)
    pixels = faces.column("pixels").to_pylist()
    n_chunks = max(1, min(len(pixels) // 16, 2 * len(client.scheduler_info()["workers"])))
    bounds = np.linspace(0, len(pixels), n_chunks + 1).astype(int)
    futs = [client.submit(stages.embed_faces, pixels[a:b], tuple(shape_hw), pure=False)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    E = np.vstack([f.result() for f in futs])
    DlibEmbedder(tuple(shape_hw)).prime(np.frombuffer(b"".join(pixels), np.uint8).reshape(len(pixels), -1), E)
    return E


@task(name="partition", **TASK)
def partition(ingested: str, aligned_parts: list[str], feature_parts: list[str], staging: str, *,
              labels: list[str], k: int, select: bool, policy: str, duplicate_ids: str = "merge",
              address: str | None = None, embed_max: int = 0, shape_hw: tuple[int, int] = (92, 81),
              lineage=None, lineage_policy: str = "invariant", lineage_absent: str = "republish") -> dict:
    """Split the aligned faces by utility labels into Hive-partitioned Parquet.

    With a ``lineage`` (:class:`deid.release.lineage.LineageState`), the lineage is planned on the
    effective persons first: only new people are partitioned (and clustered); the returning
    people's records go to ``partition=lineage`` (released later as their registered averages),
    and the records the plan holds back are suppressed.
    """
    logger = get_run_logger()
    faces = _load_faces(ingested, aligned_parts, feature_parts, labels).sort_by("record_id")
    embeddings = _embed_on_cluster(address, faces, shape_hw) if address and 0 < faces.num_rows <= embed_max else None
    faces, identity, dup_quarantined = stages.resolve_identities(faces, policy=duplicate_ids, embeddings=embeddings)
    if identity.normalized_merges or identity.face_merges:
        logger.warning("partition: %d subject ids merged by normalisation, %d groups by matching faces (%s)",
                       identity.normalized_merges, len(identity.face_merges), duplicate_ids)
    out = Path(staging) / "partitions"
    lineage_plan, lineage_ids, lineage_dir, held_back = None, [], None, []
    if lineage is not None:
        sources = dict(zip(*pq.read_table(ingested, columns=["record_id", "source_sha256"]).to_pydict().values()))
        # Per label partition, the lineage holds back fewer than k new people (they wait): the `suppress`
        # policy. Under `merge` or `fail` it plans on one partition and the small-partition policy decides.
        lineage_plan = stages.plan_lineage(faces, sources, lineage, key=_lineage_key(), k=k, policy=lineage_policy,
                                           absent=lineage_absent, labels=labels, select=select and policy == "suppress")
        lineage_ids = faces.column("record_id").to_pylist()
        held_back = [lineage_ids[i] for i, _ in lineage_plan.suppressed]
        returning = sorted(i for r in lineage_plan.republish for i in r.records)
        if returning:
            back = faces.take(pa.array(returning, pa.int64()))
            back = back.append_column("partition", pa.array([stages.LINEAGE_PARTITION] * back.num_rows))
            ds.write_dataset(back, out, format="parquet", partitioning=ds.partitioning(
                pa.schema([("partition", pa.string())]), flavor="hive"), existing_data_behavior="overwrite_or_ignore",
                basename_template="part-lineage-{i}.parquet")
            lineage_dir = str(out / f"partition={stages.LINEAGE_PARTITION}")
        logger.info("partition: lineage of %s (%s): %d records of returning people, %d new records, %d held back",
                    lineage.dataset, lineage_policy, len(returning), len(lineage_plan.new_records), len(held_back))
        faces = faces.take(pa.array(list(lineage_plan.new_records), pa.int64()))
    cols = faces.select(["subject_id", *labels]).to_pydict()
    lab_rows = [{x: cols[x][i] for x in labels} for i in range(faces.num_rows)]
    plan = plan_partitions(lab_rows, cols["subject_id"], k=k, label_names=labels, select=select, policy=policy)
    dirs = []
    for n, (key, idx) in enumerate(plan.groups.items()):
        part = faces.take(pa.array(idx, pa.int64()))
        # The partition key column keeps merged partitions distinct from their label values.
        part = part.append_column("partition", pa.array([f"p{n:03d}"] * part.num_rows))
        ds.write_dataset(part, out, format="parquet", partitioning=ds.partitioning(
            pa.schema([("partition", pa.string())]), flavor="hive"), existing_data_behavior="overwrite_or_ignore",
            basename_template=f"part-{n:03d}-{{i}}.parquet")
        dirs.append({"dir": str(out / f"partition=p{n:03d}"), "key": list(map(str, key)), "records": len(idx),
                     "people": len(set(cols["subject_id"][i] for i in idx))})
    # Hive keys are opaque (p000, ...) because a merged partition spans several label values;
    # the index says which labels each one holds.
    if dirs:
        (out / "_index.json").write_text(json.dumps(dirs, indent=2))
    ids = faces.column("record_id").to_pylist()
    suppressed = [ids[i] for i in plan.suppressed] + held_back
    for entry in plan.small:
        # Counts only: a rare label value held by one person is itself identifying (also in logs).
        logger.warning("a partition of %s records has %s people (< k=%d): %s", entry["records"], entry["people"], k,
                       entry["action"])
    logger.info("partition: %d partitions, %d records suppressed", len(dirs), len(suppressed))
    return {"partitions": dirs, "suppressed": suppressed, "small": plan.small, "failed": plan.failed,
            "identity": identity.summary(), "quarantined": [q.__dict__ for q in dup_quarantined],
            "lineage_plan": lineage_plan, "lineage_ids": lineage_ids, "lineage_dir": lineage_dir}


def _lineage_key() -> bytes:
    """The steward's key (the linkage key): read here, never passed as a (logged) task parameter."""
    settings = Settings()
    return ensure_linkage_key(configured=settings.linkage_key, keys_dir=settings.data_path / "keys")[0]


@task(name="lineage-open", **TASK)
def lineage_open(dataset: str, releases_dir: str):
    """Load and verify the dataset's lineage registry; settle releases an interrupted run left pending.

    A tampered registry or a wrong key is a :class:`~deid.errors.StateError` (exit 70): the run
    stops before any work, with the registry's one-line reason.
    """
    settings = Settings()
    try:
        reg = Registry.open(settings.data_path, dataset, _lineage_key())
        state = reg.load()
        for r in state.releases:
            # Settle what a dead run left pending: published if its release directory exists, else abandoned.
            # A pending release of a run still alive (its staging is locked) stays pending: it constrains.
            if r.status != "pending":
                continue
            if (Path(releases_dir) / r.release_id).exists():
                state = reg.mark_published(state, r.release_id)
            elif not is_live(settings.data_path / "staging" / r.release_id) and \
                    stages.lineage_can_abandon(state, r.release_id):
                state = reg.mark_abandoned(state, r.release_id)
    except LineageError as exc:
        raise StateError(f"lineage of dataset {dataset!r}: {exc}") from None
    get_run_logger().info("lineage %s: %d earlier releases, %d registered clusters (entry %d)", dataset,
                          len(state.releases), len(state.clusters), state.seq)
    return state


@task(name="lineage-release", **TASK)
def lineage_release(plan, state, record_ids: list[str], deid_parts: list[str], staging: str, *, release_id: str,
                    method: str, shape_hw: list[int], lineage_dir: str | None) -> dict:
    """The release as the lineage sees it, and the returning people's de-identified part (registered averages)."""
    new_labels, new_images = stages.lineage_new_labels(plan, record_ids, deid_parts)
    rel = build_release(plan, state, release_id=release_id, method=method, new_labels=new_labels,
                        new_images=new_images, shape=(int(shape_hw[0]), int(shape_hw[1])))
    part = None
    if lineage_dir:
        out = Path(staging) / "deidentified" / f"{Path(lineage_dir).name}.parquet"
        part = stages.write_lineage_part(lineage_dir, str(out), rel, state, record_ids)
    get_run_logger().info("lineage-release: %s", dict(rel.counts))
    return {"release": rel, "part": part["path"] if part else None, "clusters": part["clusters"] if part else []}


@task(name="lineage-checks", **TASK)
def lineage_checks(state, rel, plan, record_ids: list[str], aligned_parts: list[str]) -> list[dict]:
    """The gate's lineage checks: structure against the registry and the differencing attack."""
    ids, X = stages.read_pixels(aligned_parts)
    where = {r: i for i, r in enumerate(ids)}
    rows = [where[r] for r in record_ids if r in where]
    people = [plan.pseudonyms[i] for i, r in enumerate(record_ids) if r in where]
    checks = [c.to_dict() for c in check_structure(state, rel)]
    if len(rows) >= 2:
        attack = differencing_attack(state, rel, X[rows], original_people=people)
        get_run_logger().info("lineage differencing attack: %d cluster pairs, %d tests, %d matches",
                              attack.n_cluster_pairs, attack.n_tests, len(attack.matches))
        checks.append(attack.to_check().to_dict())
    return checks


@task(name="lineage-register", **TASK)
def lineage_register(dataset: str, state, rel=None, *, mark: str | None = None, release_id: str | None = None):
    """Append a release to the registry (pending), or mark it ``published`` / ``abandoned``; returns the state."""
    settings = Settings()
    reg = Registry.open(settings.data_path, dataset, _lineage_key())
    try:
        if rel is not None:
            return reg.append_release(state, rel)
        current = reg.load()
        if mark == "published":
            return reg.mark_published(current, release_id)
        if not stages.lineage_can_abandon(current, release_id):
            get_run_logger().warning("lineage %s: %s stays pending (a later release was planned on it)", dataset,
                                     release_id)
            return current
        return reg.mark_abandoned(current, release_id)
    except LineageError as exc:
        raise StateError(f"lineage of dataset {dataset!r}: {exc}") from None


@task(name="deidentify", retries=1, retry_delay_seconds=2, **TASK)
def deidentify(address: str, partitions: list[dict], staging: str, *, k: int, method: str, shape_hw: list[int],
               sigma: float | None = None, block: int | None = None, labels: list[str] = (),
               color: bool = False) -> dict:
    """De-identify each partition (k-Same family, or a comparison filter), one Dask task per partition."""
    logger = get_run_logger()
    client = client_for(address)
    out = Path(staging) / "deidentified"
    futs = [client.submit(stages.deidentify_partition, p["dir"], str(out / f"{Path(p['dir']).name}.parquet"),
                          k=k, method=method, shape=tuple(shape_hw), sigma=sigma, block=block, labels=list(labels),
                          color_dir=str(Path(staging) / stages.COLOR_SUBDIR) if color else None, pure=False)
            for p in partitions]
    results = [f.result() for f in futs]
    clusters = [c for r in results for c in r["clusters"]]
    logger.info("deidentify: %d records in %d clusters", sum(r["records"] for r in results), len(clusters))
    return {"parts": [r["path"] for r in results], "clusters": clusters}


@task(name="gate", **TASK)
def run_gate(deid_parts: list[str], *, config: gate_mod.GateConfig,
             counts: dict, partition_failed: bool, partition_detail: str, shape_hw: list[int],
             sigma: float | None, block: int | None, partitions_root: str | None = None,
             file_metadata: dict | None = None, extra_checks: list[dict] = (),
             lineage_members: dict[str, list[str]] | None = None) -> dict:
    """Load the would-be release and its originals, then run the core gate on them.

    ``lineage_members`` (republished cluster -> registered basis people): the k checks count a
    republished cluster's registered members, not its released rows (new photos of returning
    people, counterfeits); every other check runs on the released records of this drop.
    """
    logger = get_run_logger()
    shape = (int(shape_hw[0]), int(shape_hw[1]))
    common = dict(records_in=counts["in"], suppressed=counts["suppressed"], quarantined=counts["quarantined"],
                  partition_failed=partition_failed, partition_detail=partition_detail,
                  file_metadata=file_metadata or {},
                  extra_checks=tuple(gate_mod.Check.from_dict(c) for c in extra_checks),
                  deidentify=method_runner(config.method, shape=shape, k=config.k, sigma=sigma, block=block,
                                           n_components=config.n_components,
                                           # The attacker re-runs the method but cannot know the
                                           # release's random state (a random method's secret).
                                           seed=config.seed + 1))
    if deid_parts and partitions_root:
        rec = stages.gate_records(partitions_root, deid_parts, labels=list(config.labels),
                                  select=REGISTRY[config.method].partitions_by_labels and bool(config.labels))
        inputs = gate_mod.GateInputs(shape=shape, people=rec["people"], image_index=rec["image_index"],
                                     own_distance=rec["own_distance"], fetch=rec["fetch"], clusters=rec["clusters"],
                                     partitions=rec["partitions"], labels=rec["labels"], **common)
    else:
        inputs = gate_mod.GateInputs.empty(shape=shape, **common)
    result = gate_mod.evaluate(inputs, config)
    if lineage_members:
        result = _k_checks_on_registered_members(result, inputs, config, lineage_members)
    logger.info("gate: %s%s", "passed" if result.passed else "failed",
                "" if result.passed else " - " + "; ".join(result.reasons))
    return {
        "passed": result.passed,
        "reasons": result.reasons,
        "warnings": result.warnings,
        "checks": [c.to_dict() for c in result.checks],
        "reidentification": list(result.reidentification),
        "utility": list(result.utility),
        "max_rate": result.max_rate,
        "min_people": result.min_people,
        "max_person_share": result.max_person_share,
        "exact_bound": result.exact_bound,
        "attack_sample": result.attack_sample,
    }


K_CHECKS = ("min_cluster_size", "min_distinct_people_per_cluster", "max_person_share")


def _k_checks_on_registered_members(result, inputs, config, members: dict[str, list[str]]):
    """The gate's k checks again, with every republished cluster counted on its registered members."""
    clusters = inputs.clusters if inputs.clusters is not None else np.zeros(0, dtype=object)
    c, p, idx = stages.count_registered_members(clusters, inputs.people, inputs.image_index, members)
    checks, min_people, share, _ = gate_mod.structural_checks(
        replace(inputs, clusters=c, people=p, image_index=idx), config)
    note = f" ({len(members)} republished clusters counted on their registered members)"
    by_name = {x.name: replace(x, detail=x.detail + note) for x in checks if x.name in K_CHECKS}
    merged = [by_name.pop(x.name, x) if x.name in K_CHECKS else x for x in result.checks]
    bound = 1.0 / config.k
    if result.max_rate is not None and result.max_rate > bound + 1e-12:
        # The exact-bound rule lets a rate through unless its lower bound exceeds 1/k, because the row
        # shares bound it; counted on registered members they no longer do. A released report claims
        # the measured rate <= 1/k: withhold instead. The attacks see this drop's records only (a
        # counterfeit has no original to attack with), so absent members and new photos of returning
        # people make the rate pessimistic.
        merged.append(gate_mod.Check(
            "reidentification_rate_on_drop_records", False, round(result.max_rate, 6), f"<= {bound:.4f}",
            f"the attacks on this drop's released records named their person at rate {result.max_rate:.3f} > 1/k; "
            "returning people with new photos, or absent members of republished clusters (counterfeits cannot be "
            "attacked: they have no original), raise the share of this drop's records above the registered one"))
    return replace(result, checks=(*merged, *by_name.values()), min_people=min_people, max_person_share=share)


def _releasable_label_sets(ingested: str, labels: list[str], k: int) -> dict[str, list[str]]:
    """Per label, the values at least k distinct people hold: what a release may carry.

    Stricter than every observed value, and it keeps the rare values out of the validation
    results that go into the signed report (a value held by one person is itself identifying).
    """
    t = pq.read_table(ingested, columns=["subject_id", *labels]).to_pydict()
    out = {}
    for x in labels:
        people: dict[str, set] = {}
        for value, subject in zip(t[x], t["subject_id"]):
            people.setdefault(str(value), set()).add(subject)
        out[x] = sorted(v for v, who in people.items() if len(who) >= k)
    return out


@task(name="stage-release", **TASK)
def stage(deid_parts: list[str], ingested: str, staging: str, *, labels: list[str], shape: tuple[int, int],
          release_id: str, k: int, lineage_release=None, lineage_state=None) -> dict:
    """Write the would-be release inside the run's staging directory and validate exactly that.

    Never inside ``data/releases/``: a run killed before publishing leaves nothing there. With a
    lineage release, the counterfeit records of its republished clusters are added (stored
    average, labels of their partition); only the private linkage record marks them.
    """
    logger = get_run_logger()
    settings = Settings()
    meta = pq.read_table(ingested, columns=["record_id", *labels])
    rel = pa.concat_tables([pq.read_table(p) for p in deid_parts]).join(meta, "record_id", join_type="inner")
    # DEID_COLOR: the colour faces (BGR) are released; the gate attacked their grey ("pixels").
    column, shape = ("color", (*shape, 3)) if "color" in rel.column_names else ("pixels", shape)
    images = np.frombuffer(b"".join(rel.column(column).to_pylist()), np.uint8).reshape(rel.num_rows, -1)
    clusters = rel.column("cluster").to_pylist()
    label_values = {x: rel.column(x).to_pylist() for x in labels}
    record_ids = rel.column("record_id").to_pylist()
    if lineage_release is not None and lineage_release.counts["counterfeit_records"]:
        if column == "color":
            raise ConfigError("DEID_COLOR=true cannot republish registered clusters yet (their stored averages are "
                              "grey); release this dataset in grey, or start a new dataset name for colour releases")
        present: dict[str, list[dict]] = {}
        for i, c in enumerate(clusters):
            present.setdefault(c, []).append({x: label_values[x][i] for x in labels})
        fallback = {x: Counter(map(str, meta.column(x).to_pylist())).most_common(1)[0][0] for x in labels}
        fakes = stages.counterfeit_rows(lineage_release, lineage_state, labels, present, fallback)
        images = np.vstack([images, *[f["pixels"][None, :] for f in fakes]])
        clusters += [f["cluster"] for f in fakes]
        record_ids += [f["record_id"] for f in fakes]
        for x in labels:
            label_values[x] += [f["labels"][x] for f in fakes]
        logger.info("stage: %d counterfeit records of republished clusters", len(fakes))
    tmp = Path(staging) / RELEASE_SUBDIR
    try:
        staged = stage_release(tmp, images=images, shape=shape, clusters=clusters, labels=label_values,
                               record_ids=record_ids)
        artifacts = hash_tree(staged.path)
        validation = validate_release(staged.path / RELEASE_TABLE, labels,
                                      label_sets=_releasable_label_sets(ingested, labels, k), k=k)
        file_metadata = release_files_metadata(staged.path)
        # Which sources went into which cluster, for audits and erasure requests: encrypted at
        # once, kept in private staging until commit, never returned from this task.
        key, key_path, origin = ensure_linkage_key(configured=settings.linkage_key,
                                                   keys_dir=settings.data_path / "keys")
        rows = build_linkage(staged.mapping, sources_from_ingested(Path(ingested)))
        write_linkage(Path(staging) / "linkage.bin", rows, key, release_id=release_id)
    except BaseException:
        discard(tmp)
        raise
    if origin == "development":
        logger.warning("linkage record encrypted with the development key %s; set DEID_LINKAGE_KEY", key_path)
    logger.info("stage: %d records staged for release in %s", staged.n_records, tmp)
    return {"tmp": str(tmp), "artifacts": artifacts, "columns": staged.columns, "records": staged.n_records,
            "validation": validation, "file_metadata": file_metadata}


@task(name="dataset-card", **TASK)
def dataset_card(staged: dict, *, report: dict) -> list[dict]:
    """Write the dataset card (the gate's figures) into the staged release, then hash every release file.

    Runs after the gate and before the report is signed: the signed report lists the card's sha256.
    """
    path = write_card(Path(staged["tmp"]), DatasetCard.from_report(report))
    get_run_logger().info("dataset card: %s", path)
    return hash_tree(Path(staged["tmp"]))


@task(name="publish", **TASK)
def publish(staged: dict, staging: str, *, releases_dir: str, release_id: str) -> dict:
    """File the linkage record, then publish by one atomic rename (called only after the report is signed)."""
    logger = get_run_logger()
    settings = Settings()
    target = linkage_path(settings.data_path, release_id)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.replace(Path(staging) / "linkage.bin", target)
    try:
        final = commit_release(Path(staged["tmp"]), Path(releases_dir) / release_id)
    except BaseException:
        # Nothing was published: the linkage record goes back to private staging with its release.
        os.replace(target, Path(staging) / "linkage.bin")
        raise
    logger.info("publish: %d records released to %s (linkage record %s)", staged["records"], final, target)
    return {"path": str(final), "linkage": str(target)}


def _signing_key():
    settings = Settings()
    secret = settings.signing_key_passphrase  # read here, never passed as a (logged) task parameter
    return ensure_signing_key(configured=settings.signing_key, keys_dir=settings.data_path / "keys",
                              passphrase_env_value=secret.get_secret_value().encode() if secret else None)


@task(name="preflight", **TASK)
def preflight() -> dict:
    """Before any work: the signing key loads (readable, mode 0600, passphrase) and every location is writable."""
    settings = Settings()
    preflight_locations(settings.data_path, settings.reports_path)
    key = _signing_key()
    return {"key_origin": key.origin, "fingerprint": key.fingerprint}


@task(name="recover", **TASK)
def recover_leftovers() -> dict:
    """Remove what killed runs left (temporary releases, dead runs' staging, partial files)."""
    settings = Settings()

    def unpublished(release_id: str, report_dir: Path) -> None:
        write_signed_addendum(report_dir, {
            "release_id": release_id, "event": "not_published", "release_published": False,
            "created_at": now_iso(),
            "detail": "the run died after signing its report and before publishing; its staged release was "
                      "removed by recovery and nothing was published"}, _signing_key())

    rec = recover(settings.data_path, settings.reports_path, on_unpublished=unpublished)
    if rec.removed:
        get_run_logger().warning("recovery: removed %d leftovers of killed runs: %s", len(rec.removed),
                                 ", ".join(rec.removed))
    return {"removed": rec.removed, "annotated": rec.annotated}


@task(name="addendum", **TASK)
def publish_failed_addendum(report_dir: str, *, release_id: str, error: str) -> str:
    """A publish that failed after the report was signed: say so in a signed addendum."""
    return str(write_signed_addendum(Path(report_dir), {
        "release_id": release_id, "event": "publish_failed", "release_published": False, "created_at": now_iso(),
        "detail": f"publishing failed after the report was signed ({error}); the release was not published"},
        _signing_key()))


@task(name="withhold", **TASK)
def withhold(staged: dict, staging: str) -> None:
    """A rejected run publishes nothing: drop the staged release and its linkage record."""
    discard(Path(staged["tmp"]))
    (Path(staging) / "linkage.bin").unlink(missing_ok=True)
    get_run_logger().info("withhold: staged release removed; nothing published")


def _versions() -> dict:
    out = {}
    for pkg in ("deid", "prefect", "dask", "distributed", "numpy", "opencv-python-headless", "scikit-learn",
                "pyarrow", "cryptography"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


@task(name="report", **TASK)
def write_report(report_dir: str, *, report: dict, validation: dict | None = None,
                 release_files: str | None = None) -> dict:
    """Validate, sign and write report.json (+ .sig); every run gets one, released or rejected.

    Runs *before* publishing: ``release_files`` is the staged release that passed the gate (its
    sample faces go into report.html); a rejected run passes None and shows no faces.
    """
    logger = get_run_logger()
    key = _signing_key()
    if key.origin == "development":
        logger.warning("report signed with the development key %s; set DEID_SIGNING_KEY for real releases", key.path)
    report = dict(report)
    report["versions"] = _versions()
    fault_enospc("reports", report_dir)
    samples = (sample_release_images(Path(release_files), n=24, seed=0)
               if release_files and report.get("verdict") == "released" else None)
    path = write_report_bundle(Path(report_dir), report, key, sample_images=samples,
                               validation_results=validation or None)
    logger.info("report: %s (%s)", path, report["verdict"])
    return {"path": str(path), "public_key": str(key.public_path) if key.public_path else None,
            "key_origin": key.origin}


@task(name="artifacts", **TASK)
def ui_artifacts(report_path: str) -> None:
    """The verdict, key figures and every check, shown on the flow run in the Prefect UI."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    report = json.loads(Path(report_path).read_text())
    ds, priv = report["dataset"], report["privacy"]
    lines = [
        f"# deid release {report['release_id']}: **{report['verdict'].upper()}**",
        "",
        f"- dataset **{ds['name']}** (`{ds['fingerprint'][:23]}…`), method **{report['method']}**, k = **{report['k']}**",
        f"- records: {ds['records_in']} in, {ds['records_released']} released, {ds['records_suppressed']} suppressed,"
        f" {ds['records_quarantined']} quarantined",
        f"- max re-identification rate: {priv['max_rate']} (bound 1/k = {priv['bound']:.4f})",
    ]
    lines += [f"- utility {u['label']}: originals {u['original_accuracy']}, release {u['deidentified_accuracy']}"
              for u in report["utility"]]
    lines += [f"- **reason:** {r}" for r in report.get("reasons", [])]
    create_markdown_artifact("\n".join(lines), key="deid-verdict", description="deid release verdict")
    create_table_artifact([{k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in c.items()}
                           for c in report["checks"]], key="deid-checks", description="every gate check")
    html = Path(report_path).with_name("report.html")
    if html.exists():
        create_link_artifact(html.resolve().as_uri(), link_text=f"report.html ({report['release_id']})",
                             key="deid-report", description="the signed run's self-contained HTML report")


def quarantine_summary(quarantined: list[dict], staging: str) -> dict:
    """Write the quarantine table and count it by reason."""
    write_quarantine([Quarantined(**q) for q in quarantined], Path(staging) / "quarantine.parquet")
    return dict(Counter(q["code"] for q in quarantined))


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")

