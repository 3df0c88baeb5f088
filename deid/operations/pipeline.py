"""The release stages as plain functions: contracts in, one contract out, no Prefect.

Each function here is one stage of a release run (see :mod:`deid.contracts` for the walk). The
heavy per-part work goes to an :class:`~deid.pool.Executor` as the worker functions of
:mod:`deid.operations.stages`; ``logger`` (optional, default this module's) receives the stage's
progress and warnings, e.g. Prefect's run logger. :mod:`deid.operations.runner` calls them in order; the Prefect tasks of
:mod:`deid.tasks.stages` are one-line adapters around them.
"""
from __future__ import annotations

import json
import logging
import math
import os
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from deid.operations.executors import map_on_cluster
from deid.progress import Progress
from deid.operations import stages
from deid.evaluation.checks import Check
from deid.contracts import (
    LINEAGE_PARTITION,
    Aligned,
    Deidentified,
    Featurized,
    Ingested,
    LineageApplied,
    LineagePlanned,
    MethodInputs,
    PartitionInfo,
    Partitioned,
    Published,
    RecordCounts,
    ReleaseRows,
    SignedReport,
    SmallPartition,
    StagingLayout,
    UnreadableDrop,
)
from deid.release.staged import Staged
from deid.errors import ConfigError, DataError, Quarantined, RecordError, StateError
from deid.method_registry import COLOR_METHODS
from deid.heap import release_free_memory
from deid.anonymise.near_copy import NearCopyRepair
from deid.anonymise.sequences import sequence_warning
from deid.intake.drop import SEQUENCE_COLUMNS
from deid.schemas import arrow as schemas
from deid.operations.executors import Executor
from deid.run_config import RunConfig

log = logging.getLogger(__name__)
Logger = logging.Logger | logging.LoggerAdapter


def now_iso() -> str:
    """Current UTC time, second precision, ``Z`` suffix (the report's timestamps)."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


# --------------------------------------------------------------------------- keys and locations


def signing_key(config: RunConfig):
    """The run's :class:`~deid.release.signing.SigningKey` (configured, or the development key created once)."""
    from deid.release.signing import ensure_signing_key  # noqa: PLC0415

    secret = config.signing_passphrase
    return ensure_signing_key(configured=config.signing_key, keys_dir=config.keys_dir,
                              passphrase_env_value=secret.get_secret_value().encode() if secret else None)


def linkage_key(config: RunConfig) -> tuple[bytes, Path, str]:
    """(key, path, origin) of the steward's linkage key; the key itself never leaves this process."""
    from deid.release.linkage import ensure_linkage_key  # noqa: PLC0415

    return ensure_linkage_key(configured=config.linkage_key, keys_dir=config.keys_dir)


def preflight(config: RunConfig):
    """Before any work: every location is writable and the signing key loads (readable, 0600, passphrase).

    Returns the key's :class:`~deid.reporting.report.SigningInfo` (fingerprint and origin; the key stays here).
    """
    from deid.reporting.report import SigningInfo  # noqa: PLC0415
    from deid.operations.safety import preflight_locations  # noqa: PLC0415

    preflight_locations(config.data_path, config.reports_path)
    return SigningInfo.from_key(signing_key(config))


def recover_leftovers(config: RunConfig, *, logger: Logger | None = None) -> tuple[str, ...]:
    """Remove what killed runs left (temporary releases, dead runs' staging, partial files); returns what went."""
    from deid.operations.safety import recover, write_signed_addendum  # noqa: PLC0415

    def unpublished(release_id: str, report_dir: Path) -> None:
        write_signed_addendum(report_dir, {
            "release_id": release_id, "event": "not_published", "release_published": False,
            "created_at": now_iso(),
            "detail": "the run died after signing its report and before publishing; its staged release was "
                      "removed by recovery and nothing was published"}, signing_key(config))

    rec = recover(config.data_path, config.reports_path, on_unpublished=unpublished)
    if rec.removed:
        (logger or log).warning("recovery: removed %d leftovers of killed runs: %s", len(rec.removed), ", ".join(rec.removed))
    return tuple(rec.removed)


# --------------------------------------------------------------------------- ingest -> align -> featurize


def validate_off_main(executor: Executor | None, fn, /, **kwargs):
    """A validation suite ``fn(**kwargs)`` on a small run's pool process (Great Expectations imported there
    while this process started the run), else here."""
    remote = getattr(executor, "call_remote", None)
    return remote(fn, **kwargs) if remote is not None else fn(**kwargs)


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
    res = ingest(drop, layout.ingested, max_pixels=config.max_pixels, batch_size=batch)
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
    results = executor.map(stages.align_batch, calls,
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
    pose = stages.pose_spread(hist, max_yaw=config.aligner.max_yaw,
                              quarantined=sum(q.code == "pose" for q in quarantined))
    if pose["estimated"]:
        lg.info(f"align: pose {pose}")
    w, h = config.aligner.size
    validation = validate_off_main(executor, validate_aligned, paths=[str(p) for p in parts],
                                   pixel_bytes=int(w) * int(h)) if parts else None
    return Aligned(parts=parts, quarantined=quarantined, eye_sources=dict(sources), validation=validation,
                   checks=(suite_check(validation),) if validation else (), pose=pose)


def featurize(aligned: Aligned, layout: StagingLayout, config: RunConfig, executor: Executor, *,
              logger: Logger | None = None) -> Featurized:
    """Fit eigenfaces on the aligned set, then project every part (the model is shared with the workers once).

    Above ``identity_embed_max`` faces the same reading of each part also computes the identity first
    pass's features (:func:`identity_first_pass`): the pixels are read once, on the workers, instead of
    a second pass over every part in this process.
    """
    lg = logger or log
    (model,) = executor.map(stages.fit_eigenfaces, [dict(
        aligned_paths=[str(p) for p in aligned.parts], n_components=config.pca_components, seed=config.seed)])
    lg.info(f"featurize: {model.n_components_} eigenfaces, "
        f"{100 * float(np.sum(model.explained_variance_ratio_)):.1f}% of variance")
    shared = executor.share(model)
    outs = tuple(layout.feature_part(p) for p in aligned.parts)
    counts = [pq.ParquetFile(p).metadata.num_rows for p in aligned.parts]
    identity = None
    if sum(counts) > config.identity_embed_max > 0:
        first = next(p for p, n in zip(aligned.parts, counts) if n)
        (identity,) = executor.map(stages.fit_identity_features, [dict(aligned_path=str(first),
                                                                        shape=tuple(config.shape_hw))])
    shared_identity = executor.share(identity) if identity is not None else None
    progress = Progress("featurize: projecting", logger=lg).start(sum(counts))
    n = sum(executor.map(stages.project_part, [dict(aligned_path=str(p), model=shared, out_path=str(o),
                                                    identity=shared_identity)
                                                for p, o in zip(aligned.parts, outs)], on_done=progress.advance))
    progress.finish()
    lg.info(f"featurize: {n} faces projected" + (" (and their identity first pass's features)" if identity else ""))
    return Featurized(parts=outs, n_components=int(model.n_components_),
                      identity_dims=int(identity.n_components) if identity is not None else 0)


# --------------------------------------------------------------------------- partition -> de-identify


def load_faces(metadata: pa.Table, aligned: Aligned, featurized: Featurized, labels: Sequence[str], *,
               pixels: bool = True) -> pa.Table:
    """One row per aligned face: record and subject ids, labels, pixels and eigenface features.

    ``pixels=False`` leaves the pixels out (:func:`write_with_pixels` attaches them while writing,
    one aligned part at a time: a million faces' pixels are 7.5 GB).

    A drop with landmarks adds ``points`` (canonical pixels, as alignment moved them: k-same-m's
    shape), one with image sequences ``sequence`` and ``frame`` (multi-factor's one identity per
    person; the release's videos): the de-identify stage reads them from the partitions.
    """
    seq = [c for c in SEQUENCE_COLUMNS if c in metadata.column_names]
    meta = metadata.select(["record_id", "subject_id", *labels, *seq])
    names = pq.read_schema(aligned.parts[0]).names if aligned.parts else []
    pix_cols = ["pixels"] if pixels else []
    pix = pa.concat_tables([pq.read_table(p, columns=["record_id", *pix_cols, *(["points"] if "points" in names else [])])
                            for p in aligned.parts])
    # Sorted before the list columns join: they are then placed once, straight into record order (a
    # sort after would copy the features again; issue 13).
    faces = meta.join(pix.select(["record_id", *pix_cols]), "record_id", join_type="inner").sort_by("record_id")
    faces = faces.append_column("features", _features_in_order(faces.column("record_id"), featurized.parts))
    if "points" in names:  # Arrow joins cannot carry list columns: attached by position
        take = stages.positions_in(faces.column("record_id"), pix.column("record_id"))
        faces = faces.append_column("points", pix.column("points").take(take))
    del pix
    release_free_memory()  # the parts as read and the join's hash tables: held for nothing otherwise
    return faces


def _features_in_order(ids: pa.ChunkedArray | pa.Array, parts: Sequence[Path]) -> pa.Array:
    """The feature parts' ``features`` rows in the order of ``ids``, as a list column over one buffer."""
    field = pq.read_schema(parts[0]).field("features") if parts else pa.field("features", pa.list_(pa.float32()))
    out = _rows_in_order(ids, parts, "features")
    n = len(ids)
    if out.size >= 2 ** 31:  # the list type's int32 offsets (a take of the parts would refuse it too)
        raise StateError(f"{n} faces x {out.shape[1]} features is too many values for one list column "
                         f"({out.size} >= 2**31); lower DEID_PCA_COMPONENTS or release the drop in parts")
    offsets = np.arange(n + 1, dtype=np.int64) * out.shape[1]
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(out.ravel()), type=field.type)


def _rows_in_order(ids: pa.ChunkedArray | pa.Array, parts: Sequence[Path], column: str) -> np.ndarray:
    """The feature parts' ``column`` (a list column of equal lengths) as a matrix in the order of ``ids``.

    Concatenating the parts and taking rows held the features three times at the peak (+0.7 GB at 1M
    faces); this holds the result and one part (issue 13). Every id must have a row.
    """
    field = pq.read_schema(parts[0]).field(column) if parts else pa.field(column, pa.list_(pa.float32()))
    part_ids = [pq.read_table(p, columns=["record_id"]).column("record_id") for p in parts]
    sizes = [len(a) for a in part_ids]
    at = stages.positions_in(ids, pa.chunked_array([c for a in part_ids for c in a.chunks], pa.string())).to_numpy()
    del part_ids
    n = len(ids)
    dest = np.full(sum(sizes), -1, np.int64)  # each part row's place in the result (-1: not asked for)
    dest[at] = np.arange(n)
    out, start = None, 0
    for path, m in zip(parts, sizes):
        col = stages._array(pq.read_table(path, columns=[column]).column(column))
        to, start = dest[start:start + m], start + m
        if not m:
            continue
        widths = pc.unique(pc.list_value_length(col)).to_pylist()
        if len(widths) > 1 or out is not None and widths[0] != out.shape[1]:
            raise StateError(f"feature part {path} holds rows of different lengths ({sorted(widths)[:5]}); "
                             "re-run featurize")
        X = stages._features(col, field.type.value_type.to_pandas_dtype())
        if out is None:
            out = np.zeros((n, X.shape[1]), X.dtype)
        keep = to >= 0
        out[to[keep]] = X[keep]
    if out is None:
        out = np.zeros((n, 0), field.type.value_type.to_pandas_dtype())
    return out


def embed_faces(faces: pa.Table, shape_hw: tuple[int, int], executor: Executor) -> np.ndarray:
    """dlib descriptors of every face, chunked over the executor; remembered for the gate's attacker."""
    from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415 (dlib import cost)

    pixels = faces.column("pixels").to_pylist()
    # Identical faces (the same photo staged twice) have one descriptor: only distinct faces go to the
    # workers, so no two chunks embed the same face (each worker's own cache sees only its chunk).
    first: dict[bytes, int] = {}
    of = np.fromiter((first.setdefault(p, len(first)) for p in pixels), dtype=np.int64, count=len(pixels))
    distinct = list(first)
    # Chunks of 8-32 faces (~16 per worker; a face's descriptor does not depend on its chunk), each
    # pool process holding one queued behind its running one (``ahead``): this process embeds its
    # share holding the GIL, so it hands calls on late, and a chunk of >= 8 faces (0.75 s) covers
    # that. The last 4 chunks per worker hold 4 faces, so the chunk a pool process holds queued at
    # the end is a small one: the processes finish within about one of those (0.4 s).
    n, workers = len(distinct), max(1, executor.workers)
    size = min(32, max(8, math.ceil(n / (16 * workers))))
    body = n - min(n // 2, 16 * workers)
    bounds = [*np.linspace(0, body, max(1, round(body / size)) + 1).astype(int), *range(body + 4, n, 4), n]
    progress = Progress("partition: face descriptors").start(len(distinct))
    E = np.vstack(executor.map(stages.embed_faces, [dict(pixels=distinct[a:b], shape=tuple(shape_hw))
                                                    for a, b in zip(bounds[:-1], bounds[1:]) if b > a],
                               on_done=lambda e: progress.advance(len(e)), ahead=1))[of]
    progress.finish()
    DlibEmbedder(tuple(shape_hw)).prime(np.frombuffer(b"".join(pixels), np.uint8).reshape(len(pixels), -1), E)
    return E


def identity_first_pass(record_ids: pa.ChunkedArray, aligned: Aligned, featurized: Featurized,
                        shape_hw: tuple[int, int], executor: Executor, *, lg=log) -> dict:
    """The identity stage's cheap first pass over every face (self-quotient images), as featurize computed it.

    Returns ``cheap`` (:class:`~deid.operations.stages.CheapIdentityFeatures`, one row per record in the
    order of ``record_ids``, read from the feature parts' ``identity`` column: :func:`featurize`) and
    ``embed(positions)``: dlib descriptors of those records, their pixels read back from the aligned
    parts that hold them and embedded over the executor (:func:`embed_faces`).
    """
    if not featurized.identity_dims:
        raise StateError("the feature parts hold no identity first pass features (featurize computes them above "
                         "DEID_IDENTITY_EMBED_MAX faces); re-run the release")
    ids = stages._array(record_ids)
    cheap = _rows_in_order(ids, featurized.parts, "identity")
    lg.info("partition: identity first pass features of %d faces read", len(ids))

    def embed(positions: np.ndarray) -> np.ndarray:
        want = ids.take(pa.array(np.asarray(positions, dtype=np.int64)))
        # Each wanted record's aligned part and row: only the parts holding one are read, whole (a
        # filtered dataset read cost ~40 ms a part, 1,954 parts at 1M faces).
        part_ids = [pq.read_table(p, columns=["record_id"]).column("record_id") for p in aligned.parts]
        ends = np.cumsum([len(a) for a in part_ids])
        where = stages.positions_in(want, pa.chunked_array([c for a in part_ids for c in a.chunks], pa.string()))
        where = where.to_numpy()
        del part_ids
        part_of = np.searchsorted(ends, where, side="right")
        pixels: list = [None] * len(want)
        for p in np.unique(part_of).tolist():
            mine = np.flatnonzero(part_of == p)
            rows = where[mine] - (ends[p - 1] if p else 0)
            col = pq.ParquetFile(aligned.parts[p]).read(columns=["pixels"]).column("pixels").take(pa.array(rows))
            for j, v in zip(mine.tolist(), col.to_pylist()):
                pixels[j] = v
        got = pa.table({"record_id": want, "pixels": pa.array(pixels, pa.binary())})
        lg.info("partition: the recogniser embeds %d faces the identity first pass chose", got.num_rows)
        return embed_faces(got, shape_hw, executor)

    return {"cheap": cheap, "embed": embed}


def _write_hive(table: pa.Table, root: Path, key: str, basename: str) -> Path:
    """Append ``table`` to the Hive partition ``partition=<key>`` under ``root``."""
    table = table.append_column("partition", pa.array([key] * table.num_rows))
    options = ds.ParquetFileFormat().make_write_options(**schemas.writer_options(table.column_names))
    ds.write_dataset(table, root, format="parquet", partitioning=ds.partitioning(
        pa.schema([("partition", pa.string())]), flavor="hive"), existing_data_behavior="overwrite_or_ignore",
        basename_template=basename, file_options=options)
    return root / f"partition={key}"


def write_with_pixels(targets: Sequence[tuple[pa.Table, Sequence[int], Path]], aligned: Aligned) -> None:
    """Write the rows ``rows`` of ``table`` to ``path`` as Parquet for every ``(table, rows, path)``,
    with the faces' ``pixels`` read from the aligned parts.

    The tables (from ``load_faces(..., pixels=False)``) hold no pixels; the aligned parts are read
    one at a time, in their order, and each part's rows are appended to their tables' files, so
    memory holds one aligned part whatever the drop size (issue 13). The targets name their rows of
    one shared table, not copies of it (a copy of the partitions' rows is the whole table again).
    Rows follow the aligned parts' order (record order); ``pixels`` goes where :func:`load_faces`
    puts it, before ``features``.
    """
    picks = [np.asarray(rows, dtype=np.int64) for _, rows, _ in targets]
    # Which table and row each record id goes to, as columns (issue 13: a dict of a million ids held ~200 MB).
    all_ids = pa.chunked_array([c for (t, _, _), r in zip(targets, picks) for c in t.column("record_id").take(r).chunks],
                               pa.string()).combine_chunks()
    sizes = [len(r) for r in picks]
    target_of = np.repeat(np.arange(len(targets), dtype=np.int64), sizes)
    row_of = np.concatenate(picks) if picks else np.zeros(0, np.int64)
    del picks
    writers: dict[int, pq.ParquetWriter] = {}

    def chunk(t: int, rows: list[int], pix: pa.Array) -> pa.Table:
        table = targets[t][0].take(pa.array(rows, pa.int64()))
        at = table.column_names.index("features") if "features" in table.column_names else table.num_columns
        return table.add_column(at, "pixels", pix)

    # Every aligned part's positions in one index_in: it hashes its value set on each call, and a call
    # per part hashed all N ids once per part (O(N^2 / part size): 1,954 parts took 227 s at 1M).
    part_ids = [pq.read_table(part, columns=["record_id"]).column("record_id") for part in aligned.parts]
    where = pc.index_in(pa.chunked_array(part_ids, pa.string()), value_set=all_ids) if part_ids else None
    ends = np.cumsum([len(a) for a in part_ids], dtype=np.int64)
    del part_ids
    try:
        for p, part in enumerate(aligned.parts):
            got = pq.read_table(part, columns=["record_id", "pixels"])
            start = int(ends[p - 1]) if p else 0
            pos = where.slice(start, int(ends[p]) - start).to_numpy()
            if len(pos) != got.num_rows:
                raise StateError(f"aligned part {part} changed while its faces were partitioned; re-run the release")
            found = np.flatnonzero(~np.isnan(pos)) if pos.dtype.kind == "f" else np.arange(len(pos))
            j = pos[found].astype(np.int64)
            hits: dict[int, tuple[list[int], list[int]]] = {}
            for t in dict.fromkeys(target_of[j].tolist()):  # tables in order of their first record in this part
                mine = target_of[j] == t
                hits[t] = (row_of[j[mine]].tolist(), found[mine].tolist())
            for t, (rows, at) in hits.items():
                out = chunk(t, rows, got.column("pixels").take(pa.array(at, pa.int64())))
                if t not in writers:
                    targets[t][2].parent.mkdir(parents=True, exist_ok=True)
                    writers[t] = pq.ParquetWriter(targets[t][2], out.schema, **schemas.writer_options(out.schema.names))
                writers[t].write_table(out)
        for t, (_, _, path) in enumerate(targets):  # a table none of whose faces is aligned: an empty file
            if t not in writers:
                path.parent.mkdir(parents=True, exist_ok=True)
                empty = chunk(t, [], pa.array([], pa.binary()))
                pq.write_table(empty, path, **schemas.writer_options(empty.column_names))
    finally:
        for w in writers.values():
            w.close()


def write_partitions(faces: pa.Table, groups: Mapping[tuple, list[int]], layout: StagingLayout,
                     aligned: Aligned | None = None) -> tuple[PartitionInfo, ...]:
    """Write each label partition as Hive-partitioned Parquet under opaque keys (p000, ...).

    With ``aligned``, ``faces`` holds no pixels and :func:`write_with_pixels` streams them in.
    """
    subjects = faces.column("subject_id")  # people counted as columns (no str per record; issue 13)
    out = []
    streamed = []
    for n, (key, idx) in enumerate(groups.items()):
        # The key column keeps merged partitions distinct from their label values.
        if aligned is None:
            d = _write_hive(faces.take(pa.array(idx, pa.int64())), layout.partitions_dir, f"p{n:03d}",
                            f"part-{n:03d}-{{i}}.parquet")
        else:
            d = layout.partitions_dir / f"partition=p{n:03d}"
            streamed.append((faces, idx, d / f"part-{n:03d}-0.parquet"))
        out.append(PartitionInfo(name=f"p{n:03d}", key=tuple(map(str, key)), dir=d, records=len(idx),
                                 people=pc.count_distinct(subjects.take(pa.array(idx, pa.int64()))).as_py()))
    if streamed:
        write_with_pixels(streamed, aligned)
    if out:
        # For people reading the staging directory: which labels each opaque key holds.
        layout.partition_index.write_text(json.dumps(
            [{"dir": str(p.dir), "key": list(p.key), "records": p.records, "people": p.people} for p in out], indent=2))
    return tuple(out)


def _plan_lineage(faces: pa.Table, metadata: pa.Table, state, layout: StagingLayout, config: RunConfig,
                  labels: Sequence[str], *, lg, aligned: Aligned) -> tuple[pa.Table, LineagePlanned, list[str]]:
    """Plan the lineage on the effective persons; stage the returning people's records; keep the new ones."""
    # Looked up as columns (issue 13); the manifest's subject ids key the lineage, merges overlay it (issue 27).
    sources = metadata.select(["record_id", "source_sha256", "subject_id"])
    # Per label partition, the lineage holds back fewer than k new people (they wait): the `suppress`
    # policy. Under `merge` or `fail` it plans on one partition and the small-partition policy decides.
    plan = stages.plan_lineage(faces, sources, state, key=linkage_key(config)[0], k=config.k,
                               policy=config.lineage_policy, absent=config.lineage_absent, labels=list(labels),
                               select=config.select(labels) and config.small_partitions == "suppress",
                               merges=config.lineage_merges)
    ids = faces.column("record_id").to_pylist()
    held_back = [ids[i] for i, _ in plan.suppressed]
    returning = sorted(i for r in plan.republish for i in r.records)
    back_dir = None
    if returning:
        back_dir = layout.partitions_dir / f"partition={LINEAGE_PARTITION}"
        write_with_pixels([(faces, returning, back_dir / "part-lineage-0.parquet")], aligned)
    lg.info(f"partition: lineage of {state.dataset} ({config.lineage_policy}): {len(returning)} records of returning "
        f"people, {len(plan.new_records)} new records, {len(held_back)} held back")
    planned = LineagePlanned(plan=plan, state=state, record_ids=tuple(ids), returning_dir=back_dir)
    # Sorted distinct indices: as many as rows is every row in order (a first release): no copy of the table.
    new = faces if len(plan.new_records) == faces.num_rows else faces.take(pa.array(plan.new_records, pa.int64()))
    return new, planned, held_back


def partition(ingested: Ingested, aligned: Aligned, featurized: Featurized, layout: StagingLayout,
              config: RunConfig, executor: Executor, *, lineage_state=None, routing=None,
              logger: Logger | None = None) -> Partitioned:
    """Resolve who is who, then split the faces by utility labels into Hive-partitioned Parquet.

    With a ``lineage_state`` (:class:`deid.release.lineage.LineageState`) the lineage is planned on the
    effective persons first: only new people are partitioned (and clustered); the returning
    people's records go to ``partition=lineage`` and the records the plan holds back are suppressed.
    With the claim's ``routing`` (:func:`claim_people`) the people the person index's lookup did not find are
    searched by face among the registered faces first (:func:`search_people`): a match is refused or routed.
    """
    from deid.anonymise.partition import plan_partitions  # noqa: PLC0415

    lg = logger or log
    labels = ingested.labels
    # No pixels in memory: the partitions get them streamed from the aligned parts (issue 13).
    faces = load_faces(ingested.metadata, aligned, featurized, labels, pixels=False)
    embeddings = (embed_faces(load_faces(ingested.metadata, aligned, featurized, labels), config.shape_hw, executor)
                  if 0 < faces.num_rows <= config.identity_embed_max else None)
    first_pass: dict = {}
    embedded: dict[str, np.ndarray] = {}  # the faces the recogniser embedded: searched in the person index too
    if embeddings is None and faces.num_rows > config.identity_embed_max > 0:
        # Above the budget: a cheap pass (self-quotient images) over every face flags the closest cross-id pairs, and the
        # recogniser embeds only those (and references for its calibration): identity at any size (issue 27).
        first_pass = identity_first_pass(faces.column("record_id"), aligned, featurized, config.shape_hw, executor,
                                         lg=lg)
        embed = first_pass["embed"]

        def kept(positions: np.ndarray) -> np.ndarray:
            embedded["rows"], embedded["E"] = np.asarray(positions, np.int64), embed(positions)
            return embedded["E"]
        first_pass["embed"] = kept
    elif embeddings is not None:
        embedded = {"rows": np.arange(faces.num_rows), "E": embeddings}
    # As listed, before identity resolution replaces them by the effective person (columns: no copy).
    listed, record_ids = stages._array(faces.column("subject_id")), stages._array(faces.column("record_id"))
    faces, identity, dup_quarantined = stages.resolve_identities(faces, policy=config.duplicate_ids,
                                                                 embeddings=embeddings, **first_pass,
                                                                 embed_budget=config.identity_embed_max)
    if identity.normalized_merges or identity.face_merges:
        lg.warning("partition: %d subject ids merged by normalisation, %d groups by matching faces (%s)",
                    identity.normalized_merges, len(identity.face_merges), config.duplicate_ids)
    checks: tuple[Check, ...] = ()
    notes: tuple[str, ...] = ()
    person_faces = None
    if lineage_state is not None and routing is not None:
        # One person index per project (issue 27): the people the claim's lookup did not find, searched by face.
        aliases, lineage_state, check, note, person_faces = search_people(
            config, routing, lineage_state, listed=listed, record_ids=record_ids, identity=identity,
            rows=embedded.get("rows", np.zeros(0, np.int64)), descriptors=embedded.get("E", np.zeros((0, 128))),
            metadata=ingested.metadata, quarantined=dup_quarantined, layout=layout, lg=lg)
        checks, notes = (check,), ((note,) if note else ())
        if aliases:
            column = pa.array([aliases.get(p, p) for p in stages._array(faces.column("subject_id")).to_pylist()],
                              pa.string())
            faces = faces.set_column(faces.schema.get_field_index("subject_id"), "subject_id", column)
    del listed, record_ids
    planned, held_back = None, []
    if lineage_state is not None:
        faces, planned, held_back = _plan_lineage(faces, ingested.metadata, lineage_state, layout, config, labels,
                                                  lg=lg, aligned=aligned)
    plan = plan_partitions(_label_rows(faces, labels), list(_shared_tuple(faces.column("subject_id"))),
                           k=config.k, label_names=list(labels), select=config.select(labels),
                           policy=config.small_partitions)
    parts = write_partitions(faces, plan.groups, layout, aligned)
    small = SmallPartition.of_plan(plan)
    for e in small:  # counts only: a rare label value held by one person is itself identifying (also in logs)
        lg.warning("a partition of %s records has %s people (< k=%d): %s", e.records, e.people, config.k, e.action)
    suppressed = (*faces.column("record_id").take(pa.array(plan.suppressed, pa.int64())).to_pylist(), *held_back)
    lg.info(f"partition: {len(parts)} partitions, {len(suppressed)} records suppressed")
    inputs = method_inputs(faces)
    if inputs.sequences:
        why = sequence_warning(config.method)
        if why:
            lg.warning("partition: %s", why)
    return Partitioned(root=layout.partitions_dir, partitions=parts, suppressed=suppressed, small=small,
                       failed=plan.failed, identity=identity.summary(), quarantined=tuple(dup_quarantined),
                       lineage=planned, inputs=inputs, checks=checks, notes=notes, person_faces=person_faces)


def _label_rows(faces: pa.Table, labels: Sequence[str]) -> list[dict[str, str]]:
    """Each row's ``{label: value}``, one dict object per distinct combination of values (shared by its rows:
    8 bytes per record instead of a dict each; issue 13)."""
    if not labels:
        return [{}] * faces.num_rows
    combos, inverse = stages.label_combinations(faces, labels)
    shared = [dict(zip(labels, c)) for c in combos]
    return [shared[i] for i in inverse.tolist()]


def method_inputs(faces: pa.Table) -> MethodInputs:
    """Counts of the records with landmark points and of the image sequences and their frames."""
    names = faces.column_names
    points = faces.num_rows - faces.column("points").null_count if "points" in names else 0
    keys = [q for q in faces.column("sequence").to_pylist() if q is not None] if "sequence" in names else []
    return MethodInputs(points=int(points), sequences=len(set(keys)), frames=len(keys))


def deidentify(partitioned: Partitioned, labels: Sequence[str], layout: StagingLayout, config: RunConfig,
               executor: Executor, *, logger: Logger | None = None) -> Deidentified:
    """De-identify each partition (k-Same family, or a comparison filter), one executor call per partition."""
    lg = logger or log
    color_dir = str(layout.aligned_color_dir) if config.color else None
    calls = [dict(partition_dir=str(p.dir), out_path=str(layout.deidentified_part(p.dir)), k=config.k,
                  method=config.method, shape=config.shape_hw, sigma=config.sigma, block=config.block,
                  labels=list(labels), color_dir=color_dir, block_size=config.ksame_block_size,
                  map_blocks=map_on_cluster, seed=config.release_seed.value,
                  # The gate's own near-copy threshold: the stage repairs what the gate would reject.
                  near_copy_threshold=config.gate.leak_threshold) for p in partitioned.partitions]
    progress = Progress("deidentify", logger=lg).start(sum(p.records for p in partitioned.partitions))
    results = executor.map(stages.deidentify_partition, calls, on_done=lambda r: progress.advance(r.records))
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
                    stages.lineage_can_abandon(state, r.release_id):
                state = reg.mark_abandoned(state, r.release_id)
    except LineageError as exc:
        raise StateError(f"lineage of dataset {dataset!r}: {exc}") from None
    (logger or log).info(f"lineage {dataset}: {len(state.releases)} earlier releases, {len(state.clusters)} "
                           f"registered clusters (entry {state.seq})")
    return state


def person_index(config: RunConfig):
    """The project's :class:`~deid.operations.person_index.PersonIndex` (under the data dir, or DEID_DATABASE_URL)."""
    from deid.operations.person_index import PersonIndex  # noqa: PLC0415

    url = config.database_url
    url = url.get_secret_value() if hasattr(url, "get_secret_value") else url
    return PersonIndex.open(config.data_path, linkage_key(config)[0], database_url=url)


PERSON_FACES = "person_faces.npz"  # in the run's private staging: the descriptors the release registers


def search_people(config: RunConfig, routing, lineage_state, *, listed: pa.Array, record_ids: pa.Array, identity,
                  rows: np.ndarray, descriptors: np.ndarray, metadata: pa.Table, quarantined: Sequence[Quarantined],
                  layout: StagingLayout, lg=log):
    """The person index's face search of a drop (issue 27): its people the fingerprint and id lookup did not find,
    searched among the faces other datasets (and other ids of its own) registered.

    ``listed``, ``record_ids``: each face's subject id as listed (before identity resolution;
    ``identity.person`` is its effective person) and record id; ``rows``, ``descriptors``: the faces
    identity resolution embedded and their dlib descriptors; ``metadata``: the drop's records as claimed.
    At identity resolution's calibrated threshold, a match is that registered person
    (:meth:`~deid.operations.person_index.PersonIndex.route_faces`): under ``DEID_CROSS_DATASET=refuse`` a
    person of another dataset refuses the drop naming it (the claim withdrawn), under ``route`` the drop is
    planned in that dataset's lineage as those people (the claim moved there).

    Returns ``(aliases, lineage_state, check, note, faces_file)``: drop person -> registered person;
    the lineage to plan in (another dataset's, opened, when routed); the ``person_index`` check (its
    detail states how many people were matched by face); the report note (empty: none); the staged
    descriptors the release registers (None: nothing to register).
    """
    from deid.release.lineage import pseudonymize  # noqa: PLC0415

    cal = identity.calibration
    if cal is None or not len(rows):
        detail = ("face search: not run (identity resolution embedded no face of the drop, so there is no calibrated "
                  "same-person distance); the person index looked the drop up by fingerprint and steward id only")
        return {}, lineage_state, Check("person_index", True, 0, None, detail), "", None
    rows = np.asarray(rows, np.int64)
    people = [identity.person[r] for r in rows.tolist()]
    # People the lineage holds already (released under its pseudonyms) were found by the lookup: not matched again.
    distinct = sorted(set(people))
    released, clusters = lineage_state.released_people, lineage_state.person_clusters  # looked up, not copied
    known = {p for p, h in zip(distinct, pseudonymize(linkage_key(config)[0], lineage_state.dataset, distinct))
             if h in released or h in clusters}
    index = person_index(config)
    faces = index.route_faces(routing, people, descriptors, threshold=float(cal["threshold"]), known=known,
                              held=len(known), policy=config.cross_dataset)
    lg.info("partition: %s", faces.detail())
    if faces.routed_from is not None:
        lg.warning("%s", faces.note)
        # The drop's records move to the lineage it is planned in, the matched people's under their registered ids.
        person_of = dict(zip(listed.take(pa.array(rows)).to_pylist(), people))
        final = [faces.aliases.get(person_of.get(s, ""), s) for s in metadata.column("subject_id").to_pylist()]
        index.resettle(routing, faces.dataset, final, [str(f) for f in metadata.column("source_sha256").to_pylist()],
                       id_scope=config.cross_dataset_ids)
        lineage_state = open_lineage(faces.dataset, config, logger=lg)
        blocked = [c for c in (lineage_color_check(config, lineage_state), lineage_size_check(config, lineage_state))
                   if c is not None and not c.passed]
        if blocked:
            raise DataError("; ".join(c.detail for c in blocked))
    elif faces.note:
        lg.warning("person index: %s", faces.note)
    # Registered with the release (register_person_faces): the faces with no registered copy, of records not
    # quarantined, under the person they are planned as.
    out = {q.record_id for q in quarantined}
    fresh = np.asarray(faces.fresh, np.int64)
    ids = record_ids.take(pa.array(rows[fresh])).to_pylist() if len(fresh) else []
    keep = [int(i) for i, r in zip(fresh.tolist(), ids) if r not in out]
    path = None
    if keep:
        path = layout.root / PERSON_FACES
        np.savez(path, people=np.array([faces.aliases.get(people[i], people[i]) for i in keep], dtype=str),
                 descriptors=np.asarray(descriptors, np.float32)[keep])
    detail = faces.detail()
    # Face search sees only the faces identity resolution embedded (at most DEID_IDENTITY_EMBED_MAX, chosen by
    # the cheap first pass): a drop's other people were looked up by fingerprint and steward id only. Said in
    # the check, so a large drop's report never reads as if all its people had been searched by face.
    unembedded = identity.n_people - len(distinct)
    if unembedded > 0:
        detail += (f"; {unembedded} of the drop's {identity.n_people} people had no face embedded (identity "
                   f"resolution embedded {len(rows)} faces: at most DEID_IDENTITY_EMBED_MAX="
                   f"{config.identity_embed_max}, those its cheap first pass flagged): they were looked up by "
                   "fingerprint and steward id only, not by face")
    check = Check("person_index", True, faces.n_matched, None, detail, n=faces.searched)
    return faces.aliases, lineage_state, check, faces.note, path


def register_person_faces(config: RunConfig, dataset: str, path: Path | None, *, logger: Logger | None = None) -> int:
    """Register a released drop's face descriptors (staged by :func:`search_people`) under ``dataset``, sealed
    (AES-256-GCM under the linkage key, as the rest of the person index); the number registered."""
    if path is None or not Path(path).is_file():
        return 0
    with np.load(path) as z:
        people, descriptors = z["people"].tolist(), z["descriptors"]
    person_index(config).register_faces(dataset, people, descriptors)
    (logger or log).info("person index: %d face descriptors registered under dataset %r", len(people), dataset)
    return len(people)


def claim_records(config: RunConfig, dataset: str, subject_ids: Sequence[str], fingerprints: Sequence[str], *,
                  logger: Logger | None = None):
    """The person index's :meth:`~deid.operations.person_index.PersonIndex.claim` of a drop's records (faces or
    feature vectors): its :class:`~deid.operations.person_index.Routing`, logged."""
    routing = person_index(config).claim(dataset, subject_ids, fingerprints, policy=config.cross_dataset,
                                         id_scope=config.cross_dataset_ids)
    lg = logger or log
    if routing.note:
        lg.warning("%s", routing.note)
    elif routing.aliases:
        lg.warning("person index: %d re-keyed subject ids of dataset %r (their records are registered under another "
                   "id) are listed under their registered ids", len(routing.aliases), routing.dataset)
    return routing


def claim_people(ingested: Ingested, config: RunConfig, *, logger: Logger | None = None):
    """Look the drop's people up in the project's person index and claim them for a lineage.

    Returns ``(ingested, routing)``: the drop with re-keyed subject ids listed under their registered
    ids (:attr:`~deid.operations.person_index.Routing.aliases`), and where its lineage is planned
    (:class:`~deid.operations.person_index.Routing`). A drop holding people another dataset
    registered is refused (:class:`~deid.errors.DataError`, naming it) under ``DEID_CROSS_DATASET=refuse``.
    """
    meta = ingested.metadata
    subjects = [str(s) for s in meta.column("subject_id").to_pylist()]
    routing = claim_records(config, ingested.dataset, subjects,
                            [str(f) for f in meta.column("source_sha256").to_pylist()], logger=logger)
    if routing.aliases:
        column = pa.array([routing.aliases.get(s, s) for s in subjects], pa.string())
        meta = meta.set_column(meta.column_names.index("subject_id"), meta.schema.field("subject_id"), column)
        ingested = replace(ingested, metadata=meta, people=pc.count_distinct(column).as_py())
    del subjects
    release_free_memory()  # a million records' ids, fingerprints and digests (~1 GB): not held through the run
    return ingested, routing


def apply_lineage(partitioned: Partitioned, deidentified: Deidentified, aligned: Aligned, layout: StagingLayout,
                  config: RunConfig, *, release_id: str, logger: Logger | None = None) -> LineageApplied:
    """The release as the lineage sees it: new clusters registered as made, returning people's registered
    averages added as a de-identified part, and the gate's lineage checks (structure, differencing attack)."""
    from deid.release.lineage import build_release  # noqa: PLC0415

    lin = partitioned.lineage
    ids = list(lin.record_ids)
    parts = [str(p) for p in deidentified.parts]
    new_labels, new_images = stages.lineage_new_labels(lin.plan, ids, parts)
    # A colour release registers each new cluster's colour average too (returning people get it back, bit for bit).
    new_colors = stages.lineage_new_labels(lin.plan, ids, parts, "color")[1] if config.color else None
    rel = build_release(lin.plan, lin.state, release_id=release_id, method=config.method, new_labels=new_labels,
                        new_images=new_images, shape=config.shape_hw, new_colors=new_colors)
    out = deidentified
    if lin.returning_dir is not None:
        part = stages.write_lineage_part(str(lin.returning_dir), str(layout.deidentified_part(lin.returning_dir)),
                                         rel, lin.state, ids)
        out = replace(deidentified, parts=(*deidentified.parts, Path(part.path)),
                      clusters=(*deidentified.clusters, *part.clusters))
    (logger or log).info(f"lineage-release: {dict(rel.counts)}")
    # The attack runs in this process: on as many of its cores as the run's workers use.
    checks = lineage_checks(lin, rel, aligned, threads=max(1, min(config.dask_workers, os.cpu_count() or 1)),
                            published=published_outside_registry(lin.state, config, logger=logger), logger=logger)
    return LineageApplied(release=rel, state=lin.state, deidentified=out, checks=checks,
                          republished=stages.republished_for_gate(rel, lin.state), record_ids=lin.record_ids)


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
            X = stages.RowFile.from_aligned(paths, rows, tmp / "originals.u8")
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
        if not stages.lineage_can_abandon(current, release_id):
            (logger or log).warning(f"lineage {dataset}: {release_id} stays pending (a later release was "
                                      "planned on it)")
            return current
        return reg.mark_abandoned(current, release_id)
    except LineageError as exc:
        raise StateError(f"lineage of dataset {dataset!r}: {exc}") from None


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


def _shared_tuple(column: pa.ChunkedArray) -> tuple:
    """``tuple(column.to_pylist())`` with one str object per distinct value (a cluster's or a label's
    records share it: 8 bytes per record instead of ~60; issue 13)."""
    return tuple(stages.shared_objects(column.combine_chunks() if isinstance(column, pa.ChunkedArray)
                                       else column).tolist())


def _release_rows(deidentified: Deidentified, metadata: pa.Table, labels: Sequence[str], shape_hw,
                  lineage: LineageApplied | None, *, lg, spill: Path | None = None) -> ReleaseRows:
    """Images, clusters, labels and staging ids of every record of the would-be release.

    An image-sequence drop adds each record's (private) sequence key and frame number: the release
    gets fresh sequence ids, renumbered frames and one video per sequence. The images are an
    :class:`~deid.operations.stages.IndexedRows`: the parts are streamed and each cluster's image
    is kept once, in ``spill`` on disk when given (issue 13: never every released image at once).
    """
    seq = [c for c in SEQUENCE_COLUMNS if c in metadata.column_names]
    meta = metadata.select(["record_id", *labels, *seq])
    parts = [str(p) for p in deidentified.parts]
    names = set().union(*(pq.read_schema(p).names for p in parts)) if parts else set()
    # DEID_COLOR: the colour faces (BGR) are released; the gate attacked their grey ("pixels").
    column, shape = ("color", (*shape_hw, 3)) if "color" in names else ("pixels", tuple(shape_hw))
    keys, distinct = stages.distinct_rows(parts, column, spill=spill)
    rel = keys.join(meta, "record_id", join_type="inner")
    images = distinct.take(rel.column("row").to_numpy()) if rel.num_rows else stages.IndexedRows(
        np.zeros((0, int(np.prod(shape))), np.uint8), np.zeros(0, np.int64))
    rows = ReleaseRows(
        vectors=images,
        shape=shape, clusters=_shared_tuple(rel.column("cluster")),
        labels={x: _shared_tuple(rel.column(x)) for x in labels},
        record_ids=tuple(rel.column("record_id").to_pylist()),
        sequences=tuple(rel.column("sequence").to_pylist()) if seq else None,
        frames=tuple(rel.column("frame").to_pylist()) if seq else None)
    return stages.lineage_release_rows(
        rows, lineage, labels, lambda: {x: Counter(map(str, meta.column(x).to_pylist())).most_common(1)[0][0]
                                        for x in labels}, logger=lg)


def lineage_label_mix(lineage: LineageApplied, rows: ReleaseRows, labels: Sequence[str],
                       label_sets: dict[str, list[str]]) -> tuple[dict[str, list[str]], tuple[Check, ...]]:
    """The gate's ``lineage_label_mix`` check on the would-be release's rows; the label values it may carry.

    A republished cluster carries its registered labels, released before (so releasable) even when
    the people holding a value are absent from this drop: those values join the releasable sets.
    """
    from deid.release.lineage_checks import check_label_mix  # noqa: PLC0415

    keys = stages.lineage_row_keys(lineage.release, list(lineage.record_ids), rows)
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


def gate_inputs(deidentified: Deidentified, partitioned: Partitioned, config: RunConfig, *, labels: Sequence[str],
                counts: RecordCounts, republished=None, file_metadata: Mapping[str, list[str]] | None = None,
                extra_checks: Sequence[Check] = ()):
    """The gate's :class:`~deid.evaluation.gate.GateInputs`: the would-be release and its originals, streamed.

    Nothing here reads the staged release: a :class:`~deid.evaluation.gate.GateHelper` builds them
    while it is staged, and the gate adds ``file_metadata`` and ``extra_checks`` (staging's) after.
    """
    from deid.evaluation.gate import GateInputs  # noqa: PLC0415
    from deid.anonymise.methods import method_runner  # noqa: PLC0415

    shape = config.shape_hw
    common = dict(records_in=counts.records_in, suppressed=counts.suppressed, quarantined=counts.quarantined,
                  partition_failed=partitioned.failed, partition_detail=partitioned.small_detail,
                  file_metadata=dict(file_metadata or {}), extra_checks=tuple(extra_checks),
                  # The attacker re-runs the method with the seed the shared policy gives it
                  # (deid.anonymise.randomness: an independent one unless DEID_SEED fixed the release's).
                  deidentify=method_runner(config.method, shape=shape, k=config.k, sigma=config.sigma,
                                           block=config.block, n_components=config.pca_components,
                                           seed=config.release_seed.for_parrot(),
                                           # image sequences: the model the release was made with
                                           options=partitioned.inputs.gate_options(config.method)),
                  republished=republished)
    if not deidentified.parts:
        return GateInputs.empty(shape=shape, **common)
    # The landmark points the method used: the parrot and the utility folds re-run it with them.
    rec = stages.gate_records(str(partitioned.root), [str(p) for p in deidentified.parts], labels=list(labels),
                              select=config.select(labels), partition_keys=partitioned.gate_keys,
                              points=partitioned.inputs.gate_points(config.method),
                              skip=deidentified.suppressed)
    return GateInputs(shape=shape, people=rec.people, image_index=rec.image_index, own_distance=rec.own_distance,
                      fetch=rec.fetch, clusters=rec.clusters, partitions=rec.partitions, labels=rec.labels,
                      points=rec.points, **common)


def start_gate(deidentified: Deidentified, partitioned: Partitioned, config: RunConfig, *, labels: Sequence[str],
               counts: RecordCounts, lineage: LineageApplied | None = None):
    """A large release's :class:`~deid.evaluation.gate.GateHelper`, started before staging (None for a small one).

    It builds the gate's inputs (:func:`gate_inputs`) and runs the deep attackers on the core
    staging leaves idle; :func:`gate` takes them. The caller closes it.
    """
    from deid.evaluation.gate import GateHelper, wants_helper  # noqa: PLC0415

    gconfig = config.gate_config(labels)
    if not deidentified.parts or not wants_helper(deidentified.records, gconfig):
        return None
    # Only what gate_inputs reads travels to the helper (not the identity report, nor the lineage state).
    light = replace(partitioned, identity=None, lineage=None, quarantined=())
    return GateHelper.start(gconfig, gate_inputs, deidentified=deidentified, partitioned=light, config=config,
                            labels=list(labels), counts=counts,
                            republished=lineage.republished if lineage is not None else None)


def gate(deidentified: Deidentified, partitioned: Partitioned, config: RunConfig, *, labels: Sequence[str],
         counts: RecordCounts, extra_checks: Sequence[Check] = (), staged: Staged | None = None,
         lineage: LineageApplied | None = None, logger: Logger | None = None, executor: Executor | None = None,
         helper=None):
    """Stream the would-be release and its originals into the core gate (:func:`deid.evaluation.gate.evaluate`).

    ``executor``: a small run's process pool runs the gate's attackers and utility parts (same figures).
    ``helper``: a large release's :class:`~deid.evaluation.gate.GateHelper` (:func:`start_gate`), which
    built the inputs and ran the deep attackers ahead (same figures).

    With a lineage, the republished clusters are counted and attacked as
    :func:`deid.evaluation.gate.structural_checks` and :func:`deid.evaluation.gate.privacy_checks` say
    (registered members; counterfeit rows of no one).
    """
    from deid.evaluation.gate import evaluate  # noqa: PLC0415

    lg = logger or log
    gconfig = config.gate_config(labels)
    staging = dict(file_metadata=dict(staged.file_metadata) if staged else {}, extra_checks=tuple(extra_checks))
    inputs = None
    if helper is not None:
        try:
            inputs = replace(helper.inputs(), **staging)
        except Exception as exc:  # noqa: BLE001 - the gate then builds its inputs here, as without a helper
            lg.warning("gate: the helper process could not build the gate's inputs (%s); building them here", exc)
            helper = None
    if inputs is None:
        inputs = gate_inputs(deidentified, partitioned, config, labels=labels, counts=counts,
                             republished=lineage.republished if lineage is not None else None, **staging)
    result = evaluate(inputs, gconfig, executor=executor, helper=helper)
    lg.info("gate: " + ("passed" if result.passed else "failed - " + "; ".join(result.reasons)))
    return result


# --------------------------------------------------------------------------- report -> publish


def dataset_card(staged: Staged, report, *, logger: Logger | None = None):
    """Write the dataset card (the gate's figures) into the staged release, then list every release file.

    Runs after the gate and before the report is signed: the signed report lists the card's sha256.
    Returns the :class:`~deid.release.manifest.ReleaseListing` (the files outside the manifest, the
    manifest) the report takes; the images were hashed as they were written (stage) and are never
    written again: not re-read here.
    """
    from deid.release.card import DatasetCard, write_card  # noqa: PLC0415
    from deid.release.manifest import list_release  # noqa: PLC0415

    path = write_card(staged.dir, DatasetCard.from_report(report.to_dict()))
    (logger or log).info("dataset card: %s", path)
    _, listing = list_release(staged.dir, known=staged.images)
    return listing


def attest(staged: Staged, report, config: RunConfig, *, logger: Logger | None = None):
    """Write the release's signed attestation (``ATTESTATION.json`` + ``.sig``) into the staged release.

    Runs after the dataset card (``report`` lists the card, the tables and ``MANIFEST.sha256``) and
    before the report is signed and the release published: returns the report with the two files
    added to its ``artifacts``, so the signed report covers them too (:mod:`deid.release.attestation`).
    """
    from deid.release.attestation import write_attestation  # noqa: PLC0415
    from deid.reporting.attestation import attestation_from_report  # noqa: PLC0415
    from deid.reporting.report import Artifact, hash_file  # noqa: PLC0415

    written = write_attestation(staged.dir, attestation_from_report(report), signing_key(config))
    added = [Artifact(p.name, *hash_file(p)) for p in written]
    (logger or log).info("attestation: %s (signed)", written[0])
    return replace(report, artifacts=sorted([*report.artifacts, *added], key=lambda a: a.path))


def write_report(report, config: RunConfig, *, validation: Mapping | None = None, staged: Staged | None = None,
                 logger: Logger | None = None) -> SignedReport:
    """Render report.html and the validation page, then sign report.json; every run gets one.

    Runs *before* publishing: ``staged`` is the staged release that passed the gate (its sample
    faces go into report.html); a rejected run passes None and shows no faces.
    """
    from deid.reporting.html_report import sample_release_images, write_report_bundle  # noqa: PLC0415
    from deid.release.signing import warn_development_key  # noqa: PLC0415
    from deid.operations.safety import fault_enospc  # noqa: PLC0415

    key = signing_key(config)
    if key.origin == "development":  # said once per process (ensure_signing_key may have said it already)
        warn_development_key(key.path, log=logger or log)
    report_dir = config.reports_path / report.release_id
    fault_enospc("reports", report_dir)
    samples = sample_release_images(staged.dir, n=24, seed=0) if staged and report.verdict == "released" else None
    path = write_report_bundle(report_dir, report.to_dict(), key, sample_images=samples,
                               validation_results=dict(validation) if validation else None)
    (logger or log).info(f"report: {path} ({report.verdict})")
    return SignedReport(path=Path(path), public_key=key.public_path, key_origin=key.origin)


def publish(staged: Staged, config: RunConfig, *, release_id: str, logger: Logger | None = None) -> Published:
    """File the linkage record, then publish by one atomic rename (only after the report is signed)."""
    from deid.release.linkage import linkage_path  # noqa: PLC0415
    from deid.release.publish import commit_release  # noqa: PLC0415

    target = linkage_path(config.data_path, release_id)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.replace(staged.linkage, target)
    try:
        final = commit_release(staged.dir, config.releases_dir / release_id)
    except BaseException:
        # Nothing was published: the linkage record goes back to private staging with its release.
        os.replace(target, staged.linkage)
        raise
    (logger or log).info(f"publish: {staged.records} records released to {final} (linkage record {target})")
    return Published(path=Path(final), linkage=target)


def publish_failed_addendum(report_dir: Path, config: RunConfig, *, release_id: str, error: str) -> Path:
    """A publish that failed after the report was signed: say so in a signed addendum."""
    from deid.operations.safety import write_signed_addendum  # noqa: PLC0415

    return write_signed_addendum(Path(report_dir), {
        "release_id": release_id, "event": "publish_failed", "release_published": False, "created_at": now_iso(),
        "detail": f"publishing failed after the report was signed ({error}); the release was not published"},
        signing_key(config))


def withhold(staged: Staged, *, logger: Logger | None = None) -> None:
    """A rejected run publishes nothing: drop the staged release and its linkage record."""
    from deid.release.publish import discard  # noqa: PLC0415

    discard(staged.dir)
    staged.linkage.unlink(missing_ok=True)
    (logger or log).info("withhold: staged release removed; nothing published")


def quarantine_summary(quarantined: Sequence[Quarantined], layout: StagingLayout) -> dict[str, int]:
    """Write the quarantine table and count it by reason."""
    from deid.intake.ingest import write_quarantine  # noqa: PLC0415

    write_quarantine(list(quarantined), layout.quarantine)
    return dict(Counter(q.code for q in quarantined))
