"""The de-identify stage and the release lineage's stages: each partition de-identified, the lineage
registry opened and settled, the release as the lineage sees it (with the gate's lineage checks and the
differencing attacks), and the release registered or marked.

One function per stage, with the contract :mod:`deid.operations` describes.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.operations.executors import map_on_cluster
from deid.progress import Progress
from deid.evaluation.checks import Check
from deid.contracts import (
    Aligned,
    Deidentified,
    LineageApplied,
    LineagePlanned,
    Partitioned,
    StagingLayout,
)
from deid.errors import ConfigError, StateError
from deid.anonymise.near_copy import NearCopyRepair
from deid.operations.executors import Executor
from deid.run_config import RunConfig

from deid.operations import worker_deidentify, worker_lineage, worker_rows
from deid.operations.run_setup import Logger, linkage_key, signing_key

log = logging.getLogger(__name__)


def deidentify(partitioned: Partitioned, labels: Sequence[str], layout: StagingLayout, config: RunConfig,
               executor: Executor, *, logger: Logger | None = None) -> Deidentified:
    """De-identify each partition (k-Same family, or a comparison filter), one executor call per partition."""
    lg = logger or log
    color_dir = str(layout.aligned_color_dir) if config.color else None
    calls = [dict(partition_dir=str(p.dir), out_path=str(layout.deidentified_part(p.dir)), k=config.k,
                  method=config.method, shape=config.shape_hw, sigma=config.sigma, block=config.block,
                  labels=list(labels), color_dir=color_dir, block_size=config.ksame_block_size,
                  **({"pose_degrees": config.pose_grouping_degrees} if config.pose_grouping_degrees else {}),
                  map_blocks=map_on_cluster, seed=config.release_seed.value,
                  # The gate's own near-copy threshold: the stage repairs what the gate would reject.
                  near_copy_threshold=config.gate.leak_threshold) for p in partitioned.partitions]
    progress = Progress("deidentify", logger=lg).start(sum(p.records for p in partitioned.partitions))
    results = executor.map(worker_deidentify.deidentify_partition, calls, on_done=lambda r: progress.advance(r.records))
    progress.finish()
    clusters = tuple(c for r in results for c in r.clusters)
    lg.info(f"deidentify: {sum(r.records for r in results)} records in {len(clusters)} clusters")
    sources = Counter()
    for r in results:
        sources.update(r.shape_sources or {})
    if sources:
        lg.info(f"deidentify: cluster shapes from {dict(sources)} (k-same-m: landmark points or optical flow)")
    suppressed = tuple(rid for r in results for rid in r.suppressed)
    near = NearCopyRepair.combine(r.near_copies for r in results if r.near_copies is not None)
    if near is not None and near.near_copy_clusters:
        lg.warning(f"deidentify: near-copy repair (threshold {near.threshold:g}): {near.near_copy_clusters} clusters "
                   f"within the threshold of a member, {near.clusters_merged} merged, {near.clusters_suppressed} "
                   f"suppressed ({near.records_suppressed} records)")
    return Deidentified(parts=tuple(Path(r.path) for r in results), clusters=clusters, shape_sources=dict(sources),
                        suppressed=suppressed, near_copies=near)


# --------------------------------------------------------------------------- release lineage (deid.release.lineage)


def _registry(dataset: str, config: RunConfig):
    """The dataset's lineage registry: files under data/private/, or PostgreSQL when DEID_DATABASE_URL is set."""
    from deid.release.lineage_registry import Registry  # noqa: PLC0415

    url = config.database_url
    url = url.get_secret_value() if hasattr(url, "get_secret_value") else url
    return Registry.open(config.data_path, dataset, linkage_key(config)[0], database_url=url)


def open_lineage(dataset: str, config: RunConfig, *, logger: Logger | None = None):
    """Load and verify the dataset's lineage registry; settle releases an interrupted run left pending.

    A tampered registry or a wrong key is a :class:`~deid.errors.StateError` (exit 70): the run
    stops before any work, with the registry's one-line reason. So is a registry older than the
    newest head a signed report of the dataset names (``lineage.registry_head``; rolled back to an
    earlier copy, or deleted): :func:`deid.release.lineage_anchor.check_registry_head`.
    """
    from deid.release.lineage import LineageError  # noqa: PLC0415
    from deid.release.lineage_anchor import check_registry_head, signed_lineage  # noqa: PLC0415
    from deid.operations.safety import is_live  # noqa: PLC0415

    try:
        reg = _registry(dataset, config)
        state = reg.load()
        # The signed reports anchor the chain outside the registry (the registry alone cannot tell a copy
        # restored from backup from the real one): checked before anything is appended to it.
        signed = signed_lineage(config.reports_path, config.releases_dir, dataset, signing_key(config).public_key)
        check_registry_head(state, signed.head, where=f"{reg.where}")
        for r in state.releases:
            # Settle what a dead run left pending: published if its release directory exists, else abandoned.
            # A pending release of a run still alive (its staging is locked) stays pending: it constrains.
            if r.status != "pending":
                continue
            if (config.releases_dir / r.release_id).exists():
                state = reg.mark_published(state, r.release_id)
            elif not is_live(StagingLayout.for_run(config.data_path, r.release_id).root) and \
                    worker_lineage.lineage_can_abandon(state, r.release_id):
                state = reg.mark_abandoned(state, r.release_id)
    except LineageError as exc:
        raise StateError(f"lineage of dataset {dataset!r}: {exc}") from None
    (logger or log).info(f"lineage {dataset}: {len(state.releases)} earlier releases, {len(state.clusters)} "
                           f"registered clusters (entry {state.seq})")
    return state


def apply_lineage(partitioned: Partitioned, deidentified: Deidentified, aligned: Aligned, layout: StagingLayout,
                  config: RunConfig, *, release_id: str, logger: Logger | None = None) -> LineageApplied:
    """The release as the lineage sees it: new clusters registered as made, returning people's registered
    averages added as a de-identified part, and the gate's lineage checks (structure, differencing attack)."""
    from deid.release.lineage import build_release  # noqa: PLC0415

    lin = partitioned.lineage
    ids = list(lin.record_ids)
    parts = [str(p) for p in deidentified.parts]
    new_labels, new_images = worker_lineage.lineage_new_labels(lin.plan, ids, parts)
    # A colour release registers each new cluster's colour average too (returning people get it back, bit for bit).
    new_colors = worker_lineage.lineage_new_labels(lin.plan, ids, parts, "color")[1] if config.color else None
    rel = build_release(lin.plan, lin.state, release_id=release_id, method=config.method, new_labels=new_labels,
                        new_images=new_images, shape=config.shape_hw, new_colors=new_colors)
    out = deidentified
    if lin.returning_dir is not None:
        part = worker_lineage.write_lineage_part(str(lin.returning_dir), str(layout.deidentified_part(lin.returning_dir)),
                                         rel, lin.state, ids)
        out = replace(deidentified, parts=(*deidentified.parts, Path(part.path)),
                      clusters=(*deidentified.clusters, *part.clusters))
    (logger or log).info(f"lineage-release: {dict(rel.counts)}")
    # The attack runs in this process: on as many of its cores as the run's workers use.
    checks = lineage_checks(lin, rel, aligned, threads=max(1, min(config.dask_workers, os.cpu_count() or 1)),
                            published=published_outside_registry(lin.state, config, logger=logger), logger=logger)
    return LineageApplied(release=rel, state=lin.state, deidentified=out, checks=checks,
                          republished=worker_lineage.republished_for_gate(rel, lin.state), record_ids=lin.record_ids)


def published_outside_registry(state, config: RunConfig, *, logger: Logger | None = None) -> list:
    """The dataset's releases published on disk (signed ``released``) that the registry does not remember,
    read as an attacker reads them (:func:`deid.release.lineage_anchor.read_published_averages`).

    Empty while the registry is whole (it remembers every published release); a registry restored from
    an earlier copy or deleted and bypassed leaves releases only the disk knows, and those are attacked.
    """
    from deid.release.lineage_anchor import PublishedAverages, read_published_averages, signed_lineage  # noqa: PLC0415

    known = {r.release_id for r in state.releases if r.status != "abandoned"}
    signed = signed_lineage(config.reports_path, config.releases_dir, state.dataset, signing_key(config).public_key)
    out = []
    for rid in signed.published:
        if rid in known:
            continue
        try:
            out.append(read_published_averages(config.releases_dir / rid, config.shape_hw))
        except ConfigError as exc:   # another canonical size: reported as not comparable, never silently dropped
            (logger or log).warning(f"lineage: {exc}")
            out.append(PublishedAverages(rid, (), np.zeros((0, 0), np.uint8), ()))
    if out:
        (logger or log).warning(f"lineage {state.dataset}: {len(out)} published releases the registry does not "
                                "remember; the differencing attack runs against them too")
    return out


def lineage_checks(lin: LineagePlanned, rel, aligned: Aligned, *, threads: int = 1, published: Sequence = (),
                   logger: Logger | None = None) -> tuple[Check, ...]:
    """The gate's lineage checks: structure against the registry, the differencing attack against the registered
    clusters (on ``threads``) and against the ``published`` releases the registry does not remember
    (:func:`published_outside_registry`)."""
    from deid.release.lineage_checks import (  # noqa: PLC0415
        REPUBLISHED_ONLY, DifferencingResult, check_merges, check_structure, differencing_attack,
        published_differencing_attack)

    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import pyarrow.compute as pc  # noqa: PLC0415

    paths = [str(p) for p in aligned.parts]
    # Which drop records have aligned faces, as Arrow arrays (not a set of a million Python strings).
    aligned_ids = [pq.read_table(p, columns=["record_id"]).column("record_id") for p in paths]
    present = pa.chunked_array([c for col in aligned_ids for c in col.chunks], pa.string())
    keep = np.flatnonzero(pc.is_in(pa.array(lin.record_ids, pa.string()), value_set=present.combine_chunks())
                          .to_numpy(zero_copy_only=False)).tolist()
    rows = [lin.record_ids[i] for i in keep]
    people = [rel.person(lin.plan.pseudonyms[i]) for i in keep]   # people counted under this run's merges
    records = [lin.plan.fingerprints[i] for i in keep]
    checks = [c.to_gate_check() for c in check_structure(lin.state, rel)]
    merges = check_merges(lin.plan)
    if merges is not None:   # a merge between runs re-checked registered clusters (issue 27)
        checks.append(merges.to_gate_check())
    pub = None

    def attack_published(X, people):
        if not published:
            return None
        released = list(rel.released_clusters(lin.state).values())
        return published_differencing_attack(
            [c.key for c, _ in released], [c.image for c, _ in released],
            [sorted({len(c.records), n} - {0}) for c, n in released], published, X, original_people=people)

    if len(rows) >= 2 and not rel.new_clusters and not published:
        # Every released cluster is a registered one, tested against every registered cluster when it was
        # first released: no pair can differ now, and no original is read (issue 32).
        attack = DifferencingResult(0, 0, REPUBLISHED_ONLY, (), frozenset(), 1.0)
        (logger or log).info(f"lineage differencing attack: {attack.mode}")
        checks.append(attack.to_check().to_gate_check())
    elif len(rows) >= 2:
        # The originals stay on disk (one file of raw rows next to the aligned parts), read as the attack needs them.
        tmp = Path(tempfile.mkdtemp(prefix=".lineage-originals-", dir=Path(paths[0]).parent.parent))
        try:
            X = worker_rows.RowFile.from_aligned(paths, rows, tmp / "originals.u8")
            # Only pairs whose basis contents can differ by fewer than k records are attacked (issue 32).
            attack = differencing_attack(lin.state, rel, X, original_people=people, original_records=records,
                                         threads=threads, pairs="content")
            pub = attack_published(X, people)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        (logger or log).info(f"lineage differencing attack: {attack.n_cluster_pairs} cluster pairs, "
                               f"{attack.n_tests} tests, {len(attack.matches)} matches")
        checks.append(attack.to_check().to_gate_check())
    else:
        pub = attack_published(None, None)   # no gallery: the differences are still tested as images
    if pub is not None:
        (logger or log).info(f"lineage differencing attack against {len(pub.releases)} published releases: "
                             f"{pub.n_cluster_pairs} cluster pairs, {len(pub.matches)} matches")
        checks.append(pub.to_check().to_gate_check())
    return tuple(checks)


def register_lineage(dataset: str, state, config: RunConfig, rel=None, *, mark: str | None = None,
                     release_id: str | None = None, logger: Logger | None = None):
    """Append a release to the registry (pending), or mark it ``published`` / ``abandoned``; returns the state.

    Marking ``published`` with the ``state`` the registration returned appends to it when the registry
    has not moved on since (its authenticated head): at a million faces, reading and replaying the
    whole registry again held 1.9 GiB for a one-line entry (issue 13). Otherwise it is read again.
    """
    from deid.release.lineage import LineageError  # noqa: PLC0415

    reg = _registry(dataset, config)
    try:
        if rel is not None:
            return reg.append_release(state, rel)
        if mark == "published" and state is not None:
            try:
                return reg.mark_published(state, release_id)
            except LineageError:  # another run appended since (or the state is not current): read it again
                pass
        current = reg.load()
        if mark == "published":
            return reg.mark_published(current, release_id)
        if not worker_lineage.lineage_can_abandon(current, release_id):
            (logger or log).warning(f"lineage {dataset}: {release_id} stays pending (a later release was "
                                      "planned on it)")
            return current
        return reg.mark_abandoned(current, release_id)
    except LineageError as exc:
        raise StateError(f"lineage of dataset {dataset!r}: {exc}") from None
