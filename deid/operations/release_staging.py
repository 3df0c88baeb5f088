"""The stage stage: the would-be release written inside the run's private staging and validated
(its rows, the releasable label values, the sensitive columns, the lineage's label mix, the linkage record).

One function per stage, with the contract :mod:`deid.operations` describes.
"""
from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from deid.evaluation.checks import Check
from deid.contracts import (
    Deidentified,
    Ingested,
    LineageApplied,
    ReleaseRows,
    StagingLayout,
)
from deid.release.staged import Staged
from deid.intake.drop import SEQUENCE_COLUMNS
from deid.operations.executors import Executor
from deid.run_config import RunConfig

from deid.operations import worker_lineage, worker_rows
from deid.operations.featurize_partition import shared_tuple
from deid.operations.run_setup import Logger, linkage_key, validate_off_main

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- stage -> gate


def releasable_label_sets(metadata: pa.Table, labels: Sequence[str], k: int) -> dict[str, list[str]]:
    """Per label, the values at least k distinct people hold: what a release may carry.

    Stricter than every observed value, and it keeps the rare values out of the validation
    results that go into the signed report (a value held by one person is itself identifying).
    """
    t = metadata.select(["subject_id", *labels]).to_pydict()
    out = {}
    for x in labels:
        people: dict[str, set] = {}
        for value, subject in zip(t[x], t["subject_id"]):
            people.setdefault(str(value), set()).add(subject)
        out[x] = sorted(v for v, who in people.items() if len(who) >= k)
    return out


def _release_rows(deidentified: Deidentified, metadata: pa.Table, labels: Sequence[str], shape_hw,
                  lineage: LineageApplied | None, *, lg, spill: Path | None = None) -> ReleaseRows:
    """Images, clusters, labels and staging ids of every record of the would-be release.

    An image-sequence drop adds each record's (private) sequence key and frame number: the release
    gets fresh sequence ids, renumbered frames and one video per sequence. The images are an
    :class:`~deid.operations.worker_rows.IndexedRows`: the parts are streamed and each cluster's image
    is kept once, in ``spill`` on disk when given (issue 13: never every released image at once).
    """
    seq = [c for c in SEQUENCE_COLUMNS if c in metadata.column_names]
    meta = metadata.select(["record_id", *labels, *seq])
    parts = [str(p) for p in deidentified.parts]
    names = set().union(*(pq.read_schema(p).names for p in parts)) if parts else set()
    # DEID_COLOR: the colour faces (BGR) are released; the gate attacked their grey ("pixels").
    column, shape = ("color", (*shape_hw, 3)) if "color" in names else ("pixels", tuple(shape_hw))
    keys, distinct = worker_rows.distinct_rows(parts, column, spill=spill)
    rel = keys.join(meta, "record_id", join_type="inner")
    images = distinct.take(rel.column("row").to_numpy()) if rel.num_rows else worker_rows.IndexedRows(
        np.zeros((0, int(np.prod(shape))), np.uint8), np.zeros(0, np.int64))
    rows = ReleaseRows(
        vectors=images,
        shape=shape, clusters=shared_tuple(rel.column("cluster")),
        labels={x: shared_tuple(rel.column(x)) for x in labels},
        record_ids=tuple(rel.column("record_id").to_pylist()),
        sequences=tuple(rel.column("sequence").to_pylist()) if seq else None,
        frames=tuple(rel.column("frame").to_pylist()) if seq else None)
    return worker_lineage.lineage_release_rows(
        rows, lineage, labels, lambda: {x: Counter(map(str, meta.column(x).to_pylist())).most_common(1)[0][0]
                                        for x in labels}, logger=lg)


def lineage_label_mix(lineage: LineageApplied, rows: ReleaseRows, labels: Sequence[str],
                       label_sets: dict[str, list[str]]) -> tuple[dict[str, list[str]], tuple[Check, ...]]:
    """The gate's ``lineage_label_mix`` check on the would-be release's rows; the label values it may carry.

    A republished cluster carries its registered labels, released before (so releasable) even when
    the people holding a value are absent from this drop: those values join the releasable sets.
    """
    from deid.release.lineage_checks import check_label_mix  # noqa: PLC0415

    keys = worker_lineage.lineage_row_keys(lineage.release, list(lineage.record_ids), rows)
    republished = {r.key for r in lineage.release.republished}
    extra = {x: {v for key, v in zip(keys, rows.labels[x]) if key in republished} for x in labels}
    sets = {x: sorted(set(label_sets[x]) | extra[x]) for x in labels}
    check = check_label_mix(lineage.state, lineage.release,
                            [(key, lab) for key, lab in zip(keys, rows.label_rows(labels)) if key is not None],
                            list(labels))
    return sets, (check.to_gate_check(),)


def stage(deidentified: Deidentified, ingested: Ingested, layout: StagingLayout, config: RunConfig, *,
          release_id: str, lineage: LineageApplied | None = None, logger: Logger | None = None,
          executor: Executor | None = None) -> Staged:
    """Write the would-be release inside the run's staging directory and validate exactly that.

    ``executor``: a small run's pool runs the validation suite (:func:`validate_off_main`).

    Never inside ``data/releases/``: a run killed before publishing leaves nothing there. With a
    lineage, the counterfeit records of its republished clusters are added (stored average,
    labels of their partition); only the private linkage record marks them. The linkage record
    (which source went into which cluster) is encrypted at once and stays in private staging.
    """
    from deid.evaluation.leaks import release_files_metadata  # noqa: PLC0415
    from deid.release.linkage import linkage_table, write_linkage  # noqa: PLC0415
    from deid.release.manifest import list_release  # noqa: PLC0415
    from deid.release.publish import RELEASE_TABLE, VIDEO_FPS, discard, stage_release  # noqa: PLC0415
    from deid.evaluation.validation import suite_check, validate_release  # noqa: PLC0415

    lg = logger or log
    labels = ingested.labels
    # Each cluster's released image once, on disk in private staging, read back as the release is written.
    spill = layout.root / f".release-pixels-{uuid.uuid4().hex}.u8"
    tmp = layout.release_dir
    try:
        rows = _release_rows(deidentified, ingested.metadata, labels, config.shape_hw, lineage, lg=lg, spill=spill)
        sensitive, sensitive_check = _sensitive_columns(rows, ingested, config)
        rows = replace(rows, labels={**rows.labels, **sensitive}) if sensitive else rows
        staged = stage_release(tmp, images=rows.vectors, shape=rows.shape, clusters=rows.clusters,
                               labels=rows.labels, record_ids=rows.record_ids, sequences=rows.sequences,
                               frames=rows.frames, fps=dict(ingested.sequence_fps) or VIDEO_FPS)
        # The images as columns and in MANIFEST.sha256 (hashed as they were written: not read again).
        images, listing = list_release(staged.path, known=staged.images)
        label_sets = releasable_label_sets(ingested.metadata, labels, config.k)
        lineage_checks_ = ()
        if lineage is not None:
            label_sets, lineage_checks_ = lineage_label_mix(lineage, rows, labels, label_sets)
        # The validation results go into the signed report: a sensitive column's values never reach them.
        table = staged.path / RELEASE_TABLE
        validation = validate_off_main(executor, validate_release, release=pq.read_table(table).drop_columns(
                                           list(sensitive)) if sensitive else table,
                                       labels=list(labels), k=config.k, clustered=config.spec.clustered,
                                       label_sets=label_sets)
        file_metadata = release_files_metadata(staged.path, digests=images.known())
        key, key_path, origin = linkage_key(config)
        write_linkage(layout.linkage, linkage_table(staged.mapping, ingested.metadata), key, release_id=release_id,
                      seed=config.release_seed)
    except BaseException:
        discard(tmp)
        raise
    finally:
        spill.unlink(missing_ok=True)
    if origin == "development":
        lg.warning("linkage record encrypted with the development key %s; set DEID_LINKAGE_KEY", key_path)
    lg.info(f"stage: {staged.n_records} records staged for release in {tmp}"
            + (f", {len(staged.videos)} videos" if staged.videos else ""))
    checks = (suite_check(validation), *lineage_checks_, *([sensitive_check] if ingested.sensitive else []))
    if rows.sequences is not None:
        checks += (_sequence_linkage(rows, layout, config.k),)
    return Staged(dir=tmp, artifacts=listing.artifacts, columns=tuple(staged.columns), records=staged.n_records,
                  validation=validation, checks=checks, file_metadata=file_metadata,
                  linkage=layout.linkage, videos=tuple(staged.videos), manifest=listing.manifest, images=images)


def _sensitive_columns(rows: ReleaseRows, ingested: Ingested, config: RunConfig) -> tuple[dict[str, tuple], Check]:
    """The drop's sensitive columns the release may carry (every cluster l-diverse), and the check saying so.

    Counterfeit rows of republished lineage clusters hold no sensitive values: with any, every sensitive
    column is withheld (:func:`deid.evaluation.sensitive.sensitive_release`).
    """
    from deid.evaluation.sensitive import sensitive_release  # noqa: PLC0415

    names = list(ingested.sensitive)
    if not names:
        return {}, sensitive_release(None, {}, l=config.sensitive_l)[1]
    meta = ingested.metadata.select(["record_id", *names]).to_pydict()
    at = {r: i for i, r in enumerate(meta["record_id"])}
    real = [i for i, r in enumerate(rows.record_ids) if r in at]
    why_not = None if len(real) == len(rows.record_ids) else (
        "the release republishes registered clusters whose counterfeit rows carry no sensitive values")
    values = {x: [meta[x][at[rows.record_ids[i]]] for i in real] for x in names}
    clusters = [rows.clusters[i] for i in real] if config.spec.clustered else None
    released, check = sensitive_release(clusters, values, l=config.sensitive_l, measure=config.sensitive_diversity,
                                        why_not=why_not)
    return {x: tuple(values[x]) for x in released}, check


def _sequence_linkage(rows: ReleaseRows, layout: StagingLayout, k: int) -> Check:
    """The gate's check that every released video fits >= k people (the effective people of the partitions)."""
    from deid.evaluation.sequences import sequence_linkage_check  # noqa: PLC0415

    t = ds.dataset(layout.partitions_dir, format="parquet", partitioning="hive").to_table(
        columns=["record_id", "subject_id"]).to_pydict()
    person = dict(zip(t["record_id"], t["subject_id"]))
    return sequence_linkage_check(list(rows.sequences), list(rows.clusters), [person.get(r) for r in rows.record_ids],
                                  k=k)
