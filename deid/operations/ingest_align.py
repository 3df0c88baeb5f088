"""The ingest and align stages: the drop validated and staged as Parquet, its colour mode decided
(DEID_COLOR=auto) and checked against its lineage's, every face aligned.

One function per stage, with the contract :mod:`deid.operations` describes.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from deid.progress import Progress
from deid.evaluation.checks import Check
from deid.contracts import (
    Aligned,
    Ingested,
    StagingLayout,
    UnreadableDrop,
)
from deid.errors import DataError, RecordError
from deid.method_registry import COLOR_METHODS
from deid.operations.executors import Executor
from deid.run_config import RunConfig
from deid.operations import worker_align

from deid.operations.run_setup import Logger, validate_off_main

log = logging.getLogger(__name__)


def validate_drop(drop, metadata: pa.Table) -> dict:
    """The manifest's and the ingested table's validation suites."""
    from deid.evaluation.validation import validate_ingested, validate_manifest  # noqa: PLC0415

    return {"manifest": validate_manifest(drop), "ingested": validate_ingested(metadata, drop.labels)}


def _manifest_only(drop):
    """The drop without its rows: what the manifest suite reads (its bytes and labels), cheap to send to a pool."""
    return replace(drop, rows=drop.rows.take([]), quarantined=[])


def ingest_drop(drop_dir: str | Path, layout: StagingLayout, config: RunConfig, *,
                logger: Logger | None = None, executor: Executor | None = None) -> Ingested | UnreadableDrop:
    """Validate the manifest and stage the image bytes as Parquet; an unreadable drop is a verdict, not a crash.

    ``executor``: a small run's pool runs the validation suites (:func:`validate_off_main`).
    """
    from deid.intake.drop import read_drop  # noqa: PLC0415
    from deid.intake.ingest import ingest  # noqa: PLC0415
    from deid.alignment.align import tracked_eyes_finder  # noqa: PLC0415
    from deid.reporting.report import dataset_fingerprint  # noqa: PLC0415
    from deid.evaluation.validation import drop_checks, suite_check  # noqa: PLC0415

    lg = logger or log
    try:
        drop = read_drop(drop_dir, labels=list(config.labels) if config.labels else None, name=config.name)
    except DataError as exc:
        lg.info("ingest: the drop is unreadable; the run signs a rejection naming the reason")
        return UnreadableDrop(str(exc))
    # Several align tasks per worker even on small drops, at most align_batch_size records each.
    batch = max(1, min(config.align_batch_size, math.ceil(len(drop.rows) / (4 * max(config.dask_workers, 1)))))
    # A video's frames are staged with their eyes: one landmark pass per detected frame, moved with the face on
    # the frames followed in between (deid.intake.video.StagedEyes), instead of one per frame in alignment.
    res = ingest(drop, layout.ingested, max_pixels=config.max_pixels, batch_size=batch,
                 eyes_finder=tracked_eyes_finder() if drop.has_videos else None)
    names = pq.read_schema(res.path).names
    metadata = pq.read_table(res.path, columns=[c for c in names if c != "data"])
    people = pc.count_distinct(metadata.column("subject_id")).as_py()
    validation = validate_off_main(executor, validate_drop, drop=_manifest_only(drop), metadata=metadata)
    quarantined = (*drop.quarantined, *res.quarantined)
    records_in = drop.records_in - res.video_rows + res.video_frames  # a video row counts as its frames
    lg.info(f"ingest: {res.n_records} of {records_in} records staged, {len(quarantined)} quarantined")
    if drop.extra_columns:
        lg.info(f"ingest: unknown manifest columns kept out of the release: {drop.extra_columns}")
    return Ingested(
        path=res.path, row_groups=res.row_groups, staged=res.n_records,
        records_in=records_in,
        labels=tuple(drop.labels), sensitive=tuple(drop.sensitive), name=drop.name, license=drop.license, attribution=dict(drop.attribution),
        dataset=drop.dataset,
        extra_columns=tuple(drop.extra_columns),
        fingerprint=dataset_fingerprint(drop.manifest_bytes, res.source_sha256.values()),
        quarantined=tuple(quarantined), people=people, validation=validation,
        checks=(*drop_checks(records_in=records_in, people=people, k=config.k),
                suite_check(validation["ingested"])),
        metadata=metadata,
        sequence_fps=dict(res.sequence_fps),
        colour_sample=colour_sample(res.path, res.row_groups, max_pixels=config.max_pixels)
        if config.color_auto and config.kind == "images" else (0, 0))


COLOUR_SAMPLE = 64  # images DEID_COLOR=auto decodes (at 1/8 scale): ~64 ms, whatever the drop's size


def colour_sample(path: Path, row_groups: int, *, max_pixels: int, n: int = COLOUR_SAMPLE) -> tuple[int, int]:
    """(colour images, images sampled): up to ``n`` staged images spread evenly over the row groups.

    An image that does not decode is left out of the sample (the align stage quarantines it).
    """
    from deid.intake.imaging import is_colour  # noqa: PLC0415

    if row_groups <= 0:
        return (0, 0)
    pf = pq.ParquetFile(path)
    groups = sorted({int(g) for g in np.linspace(0, row_groups - 1, min(row_groups, n))})
    per = max(1, -(-n // len(groups)))
    colour = sampled = 0
    for g in groups:
        data = pf.read_row_group(g, columns=["data"]).column("data")
        for i in np.unique(np.linspace(0, len(data) - 1, min(per, len(data))).astype(int)).tolist():
            try:
                colour += is_colour(data[i].as_py(), max_pixels=max_pixels)
            except (RecordError, cv2.error):
                continue
            sampled += 1
    return (colour, sampled)


def resolve_color(config: RunConfig, ingested: Ingested, lineage_state=None) -> RunConfig:
    """DEID_COLOR=auto decided for this drop; the reason goes to the report (``configuration.color_decision``).

    A dataset's lineage keeps one colour mode (:attr:`deid.release.lineage.LineageState.color_mode`: that of
    its first release that registered clusters), because a returning person's released image must stay
    bit-identical to their first one (invariant 2) and the registry stores each cluster's average as it was
    released (grey, or colour with its grey). So auto follows the lineage's mode when it has one; otherwise
    colour when most sampled images are colour, the method can release colour and the drop has at most
    ``DEID_COLOR_AUTO_MAX`` staged records (colour clusters are averaged in memory). An explicit
    ``DEID_COLOR`` is kept as set: one that conflicts with the lineage's mode fails the gate's
    ``lineage_color`` check (:func:`lineage_color_check`).
    """
    if not config.color_auto:
        return config
    mode = getattr(lineage_state, "color_mode", None)
    colour, n = ingested.colour_sample
    share = f"{round(100 * colour / n)}% of {n} sampled images colour" if n else "no image sampled"
    chosen = False
    if mode is not None:
        name = getattr(lineage_state, "dataset", "")
        chosen = mode == "colour" and config.method in COLOR_METHODS
        reason = (f"auto: dataset {name!r} was released in {mode}, so its returning people's images stay "
                  f"identical: {mode}" if chosen == (mode == "colour") else
                  f"auto: dataset {name!r} was released in colour, but method {config.method} releases grey faces: "
                  "grey")
    elif not n or 2 * colour < n:
        reason = f"auto: {share}: grey"
    elif config.method not in COLOR_METHODS:
        reason = f"auto: {share}, but method {config.method} releases grey faces: grey"
    elif getattr(ingested, "staged", 0) > config.color_auto_max:
        reason = (f"auto: {share}, but {ingested.staged} records are more than DEID_COLOR_AUTO_MAX="
                  f"{config.color_auto_max} (colour clusters are averaged in memory): grey (DEID_COLOR=true forces "
                  "colour)")
    else:
        chosen, reason = True, f"auto: {share}: colour"
    log.info("colour: %s", reason)
    return replace(config, aligner=replace(config.aligner, color=chosen), color_reason=reason)


def lineage_color_check(config: RunConfig, lineage_state) -> Check | None:
    """The gate's ``lineage_color`` check: this release's colour mode is its dataset's lineage's.

    None for a run without a lineage, or whose lineage has registered nothing yet (its first release
    sets the mode). A failure blocks the drop before any work (a signed rejection, exit 1) and says
    what to set: releasing a colour lineage in grey, or a grey one in colour, would give every returning
    person another image than their first release's.
    """
    mode = getattr(lineage_state, "color_mode", None)
    if mode is None:
        return None
    mine = "colour" if config.color else "grey"
    name = lineage_state.dataset
    if mine == mode:
        return Check("lineage_color", True, mine, f"= {mode}", f"released in {mode}, as dataset {name!r} was before "
                     f"({config.color_reason or 'DEID_COLOR'})")
    fix = ("unset DEID_COLOR (auto follows the lineage's mode)" if not config.color_auto else
           f"use one of {list(COLOR_METHODS)} (they release colour)")
    return Check("lineage_color", False, mine, f"= {mode}",
                 f"this release would be in {mine} ({config.color_reason or 'DEID_COLOR'}) but dataset {name!r} was "
                 f"released in {mode}: every returning person's image must stay identical to their first release's; "
                 f"{fix}")


def lineage_size_check(config: RunConfig, lineage_state) -> Check | None:
    """The gate's ``lineage_canonical_size`` check: this release's canonical face size is its lineage's.

    A registered cluster's stored average has the size it was released at; a returning person's
    image cannot be republished at another size and stay identical. None without registered clusters.
    A failure blocks the drop before any work (a signed rejection, exit 1) and names the sizes to set.
    """
    clusters = getattr(lineage_state, "clusters", None) or {}
    if not clusters:
        return None
    registered = tuple(next(iter(clusters.values())).shape)
    h, w = config.shape_hw
    if len(registered) != 2:   # a feature lineage (vectors) under an image drop: not this check's to judge
        return None
    rh, rw = registered
    name = lineage_state.dataset
    if (rh, rw) == (h, w):
        return Check("lineage_canonical_size", True, f"{w}x{h}", f"= {rw}x{rh}",
                     f"faces at {w}x{h}, as dataset {name!r} was released before")
    return Check("lineage_canonical_size", False, f"{w}x{h}", f"= {rw}x{rh}",
                 f"this release's faces would be {w}x{h} but dataset {name!r} was released at {rw}x{rh}: every "
                 "returning person's image must stay identical to their first release's; set "
                 f"DEID_CANONICAL_WIDTH={rw} DEID_CANONICAL_HEIGHT={rh}")


def align(ingested: Ingested, layout: StagingLayout, config: RunConfig, executor: Executor, *,
          logger: Logger | None = None) -> Aligned:
    """Align every face, one executor call per Parquet row group of the ingested table."""
    from deid.evaluation.validation import suite_check, validate_aligned  # noqa: PLC0415

    lg = logger or log
    params = config.aligner.to_dict()
    calls = [dict(ingested_path=str(ingested.path), row_groups=[g], out_path=str(layout.aligned_part(g)),
                  aligner_params=params) for g in range(ingested.row_groups)]
    progress = Progress("align", logger=lg).start(ingested.staged)
    results = executor.map(worker_align.align_batch, calls,
                           on_done=lambda res: progress.advance(res.aligned + len(res.quarantined)))
    progress.finish()
    parts = tuple(sorted(Path(r.path) for r in results))
    sources = Counter()
    for r in results:
        sources.update(r.eye_sources)
    quarantined = tuple(q for r in results for q in r.quarantined)
    lg.info(f"align: {sum(sources.values())} aligned ({dict(sources)}), {len(quarantined)} quarantined")
    hist = np.zeros(91, np.int64)
    for r in results:
        if r.yaw_histogram:
            hist += np.asarray(r.yaw_histogram, np.int64)
    pose = worker_align.pose_spread(hist, max_yaw=config.aligner.max_yaw,
                              quarantined=sum(q.code == "pose" for q in quarantined))
    if pose["estimated"]:
        lg.info(f"align: pose {pose}")
    w, h = config.aligner.size
    validation = validate_off_main(executor, validate_aligned, paths=[str(p) for p in parts],
                                   pixel_bytes=int(w) * int(h)) if parts else None
    return Aligned(parts=parts, quarantined=quarantined, eye_sources=dict(sources), validation=validation,
                   checks=(suite_check(validation),) if validation else (), pose=pose)
