"""Worker functions of the de-identify stage: one label partition de-identified (k-Same family or a
comparison filter), in memory or out of core, with the near-copy repair and the colour faces.

Each worker function is idempotent (it writes to a temporary file and renames it into place), so a task
re-run after a lost worker produces the same output; it takes paths and small parameters, never large
arrays, so nothing big travels through the scheduler.
"""
from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from deid.contracts import ClusterInfo
from deid.errors import ConfigError, StateError
from deid.anonymise.ksame import KSame, _factorize, group_people
from deid.anonymise.ksame_pose import pose_features
from deid.anonymise.near_copy import (NearCopyRepair, RepairPlan, check_merged, closest_member, cluster_centroids,
                                      plan_repair, relabel, repair_in_memory, summarize)
from deid.evaluation.leaks import mean_abs_difference
from deid.heap import release_free_memory
from deid.method_registry import COLOR_METHODS, REGISTRY
from deid.anonymise.methods import deidentify as deidentify_images
from deid.anonymise.methods_aam import given_shapes
from deid.anonymise.methods_ksame import shape_sources
from deid.schemas import arrow as schemas

from deid.operations.worker_rows import (OUT_ROWS, StringColumn, binary_rows, feature_rows, pixel_rows, shared_objects,
                                         stream_rows, write_atomic)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeidentifiedPart:
    """What one de-identification task returns: its part and the cluster summary (sizes, distinct people)."""

    path: str
    records: int
    clusters: tuple[ClusterInfo, ...]
    shape_sources: dict[str, int] | None = None  # k-same-m, k-same-aam: clusters shaped from points / optical flow
    suppressed: tuple[str, ...] = ()  # records withheld as near copies (not in the part)
    near_copies: NearCopyRepair | None = None  # the near-copy repair (None: the method gets none)


def deidentify_partition(partition_dir: str, out_path: str, *, k: int, method: str = "k-same-select",
                         shape: tuple[int, int] | None = None, sigma: float | None = None,
                         block: int | None = None, labels: tuple[str, ...] | list[str] = (),
                         color_dir: str | None = None, block_size: int | None = 2000,
                         map_blocks=None, near_copy_threshold: float | None = None,
                         seed: int = 0, pose_degrees: float | None = None) -> DeidentifiedPart:
    """De-identify one partition: k-Same (k-Same-Select = this, once per label partition).

    ``k-same-naive`` counts images instead of people (Newton et al.'s formulation, for
    comparison); ``blur`` and ``pixelate`` filter each face on its own (no clusters: every record
    is its own "cluster", which the gate's k checks reject). Every other method of
    :data:`deid.anonymise.methods.REGISTRY` runs through :func:`deid.anonymise.methods.deidentify` on the pixels,
    with the partition's ``labels`` columns; methods without clusters get one per record too. Returns the cluster summary: per
    cluster its size and number of distinct people. Cluster names are random, so nothing about
    them follows the input order.

    With ``color_dir`` (the aligned colour faces, ``DEID_COLOR``), a k-Same method releases each
    cluster's mean per colour channel (BGR, column ``color``) and its ``pixels`` become the grey
    of that colour face, so the gate attacks exactly the grey of what is published.

    A k-Same partition above ``block_size`` faces is grouped blockwise (:class:`deid.anonymise.ksame.KSame`);
    ``map_blocks`` runs its blocks (e.g. one Dask task per block); the clusters do not depend on it.

    ``near_copy_threshold`` (the gate's leak threshold): for a method that
    :attr:`~deid.method_registry.MethodSpec.repairs_near_copies`, a cluster whose released
    image lies below it from a member's own aligned face is merged with its nearest cluster, or its
    records are suppressed (:mod:`deid.anonymise.near_copy`); they are then left out of the part and
    listed in ``suppressed``. None, or any other method: no repair (the gate judges the clusters as made).

    ``seed``: the release's random state (:class:`deid.anonymise.randomness.ReleaseSeed`), for the
    methods that draw (selective-mean's sets, attribute-preserving's donors).

    ``pose_degrees`` (``DEID_POSE_GROUPING_DEGREES``): a k-Same method groups by the faces' estimated yaw
    (the partition's ``yaw`` column) as well as their features (:func:`deid.anonymise.ksame_pose.pose_features`);
    None, or a partition without yaw: by the features alone.
    """
    spec = REGISTRY.get(method)
    repair = near_copy_threshold if spec is not None and spec.repairs_near_copies else None
    release_free_memory()  # what earlier calls on this worker freed but its allocators kept (issue 13)
    if spec is not None and spec.cluster_mean and color_dir is None:
        return _ksame_out_of_core(partition_dir, out_path, k=k, method=method, block_size=block_size,
                                  map_blocks=map_blocks, near_copy_threshold=repair, pose_degrees=pose_degrees)
    table, has_points, seq_cols, yaw_col = _read_partition(partition_dir, labels, pose_degrees)
    ids = table.column("record_id").to_pylist()
    people = np.asarray(table.column("subject_id").to_pylist(), dtype=object)
    X = feature_rows(table.column("features"))
    images = pixel_rows(table.column("pixels"))
    sources: dict[str, int] = {}
    if spec is None or not spec.cluster_mean:  # (an unknown name gets deid.anonymise.methods' ConfigError)
        released, labels_, sources = _method_on_pixels(table, images, people, method=method, k=k, shape=shape,
                                                       sigma=sigma, block=block, seed=seed, labels=labels,
                                                       has_points=has_points, sequences=bool(seq_cols))
    else:
        yaw = table.column("yaw").to_pylist() if yaw_col else None
        released, labels_ = _ksame_in_memory(X, people, images, yaw, k=k, counts_people=spec.counts_people,
                                             block_size=block_size, map_blocks=map_blocks, pose_degrees=pose_degrees)
    names = [uuid.uuid4().hex[:12] for _ in range(int(labels_.max()) + 1 if len(labels_) else 0)]
    near: NearCopyRepair | None = None
    suppressed: tuple[str, ...] = ()
    colour = None
    if color_dir is not None:
        ids, people, labels_, released, colour, near, suppressed = _colour_release(
            color_dir, ids, people, labels_, X, images, method=method, k=k, repair=repair)
    columns = {"record_id": ids, "cluster": [names[c] for c in labels_]}
    if colour is not None:
        columns["color"] = [r.tobytes() for r in colour]
    columns["pixels"] = [r.tobytes() for r in released]
    out = pa.table(columns, schema=schemas.deidentified(color=color_dir is not None))
    write_atomic(out, Path(out_path))
    # A cluster merged into its partner by the near-copy repair is gone.
    summary = _cluster_summary(names, labels_, people)
    del out, columns, table, X, images, released, colour
    release_free_memory()  # what the stage freed goes back to the OS (issue 13)
    return DeidentifiedPart(path=out_path, records=len(ids), clusters=summary,
                            shape_sources=sources, suppressed=suppressed, near_copies=near)


def _read_partition(partition_dir: str, labels, pose_degrees: float | None) -> tuple[pa.Table, bool, list, list]:
    """The partition's table with the columns its method needs: ``(table, has points, sequence cols, yaw col)``."""
    dataset = ds.dataset(partition_dir, format="parquet")
    # Canonical landmarks, when the aligned faces carry them (a drop with a points column): k-same-m's shape.
    has_points = "points" in dataset.schema.names
    # Image sequences (a drop with sequence/frame columns): multi-factor keeps one identity per person.
    seq_cols = ["sequence", "frame"] if "sequence" in dataset.schema.names else []
    yaw_col = ["yaw"] if pose_degrees and "yaw" in dataset.schema.names else []
    table = dataset.to_table(columns=["record_id", "subject_id", "features", "pixels", *labels,
                                      *(["points"] if has_points else []), *seq_cols, *yaw_col])
    return table, has_points, seq_cols, yaw_col


def _ksame_in_memory(X: np.ndarray, people: np.ndarray, images: np.ndarray, yaw: list | None, *, k: int,
                     counts_people: bool, block_size: int | None, map_blocks,
                     pose_degrees: float | None) -> tuple[np.ndarray, np.ndarray]:
    """A k-Same method on a partition held in memory: ``(released uint8 faces, cluster labels)``, row for row.

    Groups on the features ``X``, with the estimated ``yaw`` appended when pose grouping is on
    (:func:`deid.anonymise.ksame_pose.pose_features`); each face is replaced by its cluster's mean, rounded.
    """
    Z = pose_features(X, yaw, degrees=pose_degrees) if yaw is not None else X
    model = KSame(k, count="people" if counts_people else "images", block_size=block_size,
                  map_blocks=map_blocks).fit(Z, people=people, images=images)
    released = np.clip(np.rint(model.averages_[model.labels_]), 0, 255).astype(np.uint8)
    return released, model.labels_


def _method_on_pixels(table: pa.Table, images: np.ndarray, people: np.ndarray, *, method: str, k: int,
                      shape: tuple[int, int] | None, sigma: float | None, block: int | None, seed: int,
                      labels: Sequence[str], has_points: bool,
                      sequences: bool) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """A method other than a k-Same cluster mean on the partition's pixels (:func:`deid.anonymise.methods.deidentify`).

    Returns the released images, each record's cluster (methods without clusters: blur, pixelate,
    selective-mean, attribute-preserving, get one per record) and, for k-same-m and k-same-aam, where
    the clusters' shapes came from (the report says).
    """
    n = table.num_rows
    sources: dict[str, int] = {}
    # Every other method (registry in deid.anonymise.methods) runs on the pixels; those without
    # clusters (blur, pixelate, selective-mean, attribute-preserving) get one per record.
    points = table.column("points").to_pylist() if has_points else None
    released, found = deidentify_images(images, shape=shape, people=list(people), method=method, k=k,
                                        sigma=sigma, block=block, seed=seed,
                                        labels={x: table.column(x).to_pylist() for x in labels} or None,
                                        points=points,
                                        sequences=table.column("sequence").to_pylist() if sequences else None,
                                        frames=table.column("frame").to_pylist() if sequences else None)
    labels_ = np.arange(n) if found is None else found
    if method == "k-same-m" and n:  # the report says where the clusters' shapes came from
        for source in shape_sources(labels_, points):
            sources[source] = sources.get(source, 0) + 1
    elif method == "k-same-aam" and n:  # one shape model per partition: its clusters share its source
        source = "points" if shape is not None and given_shapes(points, shape) is not None else "flow"
        sources[source] = sources.get(source, 0) + int(labels_.max()) + 1
    return released, labels_, sources


def _colour_release(color_dir: str, ids: list, people: np.ndarray, labels_: np.ndarray, X: np.ndarray,
                    images: np.ndarray, *, method: str, k: int, repair: float | None):
    """``DEID_COLOR``: each cluster's mean per colour channel (BGR) released, and the grey of that colour face
    as its ``pixels`` (what the gate attacks); with ``repair`` (the near-copy threshold), the near copies
    repaired on that grey.

    Returns ``(ids, people, labels_, released grey, colour, near-copy repair or None, suppressed ids)``:
    the records the repair suppressed are left out of the first three.
    """
    near: NearCopyRepair | None = None
    suppressed: tuple[str, ...] = ()
    if method not in COLOR_METHODS:
        raise ConfigError(f"method={method!r} cannot release colour; with DEID_COLOR=true use one of "
                          f"{list(COLOR_METHODS)}")
    faces = _colour_faces(color_dir, ids)
    colour = _colour_means(faces, labels_)
    released = colour_to_grey(colour)
    if repair is not None and len(ids):
        # The gate compares the grey of the colour mean with the grey original: so does the repair.
        labels_, near = repair_in_memory(
            labels_, X, people, released, images, lambda m: colour_to_grey(_colour_means(faces[m], None))[0],
            k=k, threshold=repair, distance=mean_abs_difference)
        if near.near_copy_clusters:
            keep = labels_ >= 0
            suppressed = tuple(r for r, kept in zip(ids, keep) if not kept)
            ids, people, labels_ = [r for r, kept in zip(ids, keep) if kept], people[keep], labels_[keep]
            colour = _colour_means(faces[keep], labels_)
            released = colour_to_grey(colour)
    return ids, people, labels_, released, colour, near, suppressed


def _cluster_summary(names: list[str], labels_: np.ndarray, people) -> tuple[ClusterInfo, ...]:
    """Each non-empty cluster's size and distinct people, in cluster order (label -1: suppressed, not
    counted); one sort of (cluster, person) pairs, not a scan of every record per cluster."""
    labels_ = np.asarray(labels_, dtype=np.int64)
    keep = labels_ >= 0
    labs = labels_[keep]
    codes = isinstance(people, np.ndarray) and people.dtype.kind in "iu"  # person codes: no objects to sort
    _, person = np.unique((people if codes else np.asarray(people, dtype=object))[keep], return_inverse=True)
    width = int(person.max()) + 1 if len(person) else 1
    sizes = np.bincount(labs, minlength=len(names))
    distinct = np.bincount(np.unique(labs * width + person.ravel()) // width, minlength=len(names))
    return tuple(ClusterInfo(cluster=names[c], size=int(sizes[c]), people=int(distinct[c]))
                 for c in range(len(names)) if sizes[c])


# Pixels held at once when k-Same averages a partition out of core: one bucket of whole clusters.
# 8 MB: a worker's memory stays flat up to 256 x 8 MB of pixels per partition (~280,000 faces of 81 x 92).
AVERAGE_BUCKET_BYTES = 8 << 20
_MAX_BUCKETS = 256  # open spill files; above 256 x 8 MB per partition the buckets grow instead
_SPILL_ROWS = 512  # records read at a time when spilling pixels to the buckets (~4 MB of 81 x 92 faces)
_DISTANCE_ROWS = 256  # faces measured against their cluster's mean at a time (near-copy repair)
_MEAN_CLUSTERS = 64  # clusters averaged at a time in a bucket (~2.5 MB of their pixels, ~4 MB of float64 sums)


def _ksame_out_of_core(partition_dir: str, out_path: str, *, k: int, method: str, block_size: int | None,
                       map_blocks, near_copy_threshold: float | None = None,
                       pose_degrees: float | None = None) -> DeidentifiedPart:
    """k-Same on one partition holding the features in memory and the pixels one bucket at a time.

    The grouping needs only the eigenface features (n x d). The averages are computed from the
    pixels in three streaming passes, so memory does not grow with the partition (issue 13: a
    250,000-face partition is 1.9 GB of pixels): (1) each face's pixels are appended to the spill
    file of its cluster's bucket (consecutive clusters of about ``AVERAGE_BUCKET_BYTES`` of
    faces); (2) each bucket is read back and its clusters' means (exact integer sums, then
    float64 division and rounding, as :class:`deid.anonymise.ksame.KSame` does) are appended to
    an averages file; (3) the partition's record order is streamed again and every record gets
    its cluster's mean (read with ``pread``) in row groups of the de-identified part. The
    released bytes equal the in-memory ``KSame.fit_transform``.

    With ``near_copy_threshold``, pass (2) also measures every member against its cluster's mean
    (a bucket at a time) and the near-copy clusters are repaired before pass (3)
    (:func:`_repair_out_of_core`); their suppressed records are left out of the part.

    With ``pose_degrees`` and a ``yaw`` column, the grouping's features get the yaw appended
    (:func:`deid.anonymise.ksame_pose.pose_features`: one more float32 copy of the features).
    """
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    dataset = ds.dataset(partition_dir, format="parquet")
    files = list(dataset.files)
    ids, codes, who, X = _grouping_inputs(files)
    if pose_degrees and "yaw" in dataset.schema.names:
        X = pose_features(X, dataset.to_table(columns=["yaw"]).column("yaw").to_pylist(), degrees=pose_degrees)
    release_free_memory()  # what reading them left in Arrow's pool and the C heap (~30 MB at 200,000 faces)
    labels_ = group_people(X, codes, k=k, count="people" if REGISTRY[method].counts_people else "images",
                           block_size=block_size, map_blocks=map_blocks, names=who)
    del X  # the repair reads the features again if it needs them (issue 13)
    n_clusters = int(labels_.max()) + 1
    sizes = np.bincount(labels_, minlength=n_clusters).astype(np.int64)
    names = [uuid.uuid4().hex[:12] for _ in range(n_clusters)]
    first = next(stream_rows(files[:1], ["pixels"], 1))
    p = len(first.column(0)[0].as_py())
    total = len(ids) * p
    bucket_rows = max(1, max(AVERAGE_BUCKET_BYTES, -(-total // _MAX_BUCKETS)) // p)
    bucket_of_cluster = (np.cumsum(sizes) - sizes) // bucket_rows  # buckets: runs of consecutive clusters
    n_buckets = int(bucket_of_cluster[-1]) + 1
    bucket_of_row = bucket_of_cluster[labels_]
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    spill = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _spill_by_bucket(files, spill, bucket_of_row, n_buckets)
        repair = near_copy_threshold is not None
        own = np.empty(len(ids), np.float64) if repair else None
        by_bucket, bounds = _bucket_means(spill, labels_, sizes, bucket_of_row, n_buckets, p, own)
        near = suppressed = None
        if repair:
            features = lambda: (feature_rows(b.column(0)) for b in stream_rows(files, ["features"]))  # noqa: E731
            labels_, near, dropped = _repair_out_of_core(
                spill, labels_, features, codes, own, bucket_of_row, by_bucket, bounds,
                n_clusters=n_clusters, p=p, k=k, threshold=near_copy_threshold)
            suppressed = tuple(ids.take(pa.array(dropped, pa.int64())).to_pylist())
            for b in range(n_buckets):
                (spill / f"b{b:05d}").unlink()
        kept = _write_released_means(out, spill, ids, labels_, names, p)
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    # Each cluster's size and distinct people (merged clusters grew, merged-away and suppressed ones are gone).
    summary = _cluster_summary(names, labels_, codes)
    n_kept = len(kept)
    del ids, codes, labels_, kept, bucket_of_row, by_bucket, own
    release_free_memory()  # what the stage freed goes back to the OS: a worker holds it for no one (issue 13)
    return DeidentifiedPart(path=out_path, records=n_kept, clusters=summary, shape_sources={},
                            suppressed=suppressed or (), near_copies=near)


def _spill_by_bucket(files: list[str], spill: Path, bucket_of_row: np.ndarray, n_buckets: int) -> None:
    """Pass 1 of :func:`_ksame_out_of_core`: every face's pixels appended to its bucket's spill file
    (``spill/bNNNNN``), in record order."""
    handles = [open(spill / f"b{b:05d}", "wb") for b in range(n_buckets)]  # noqa: SIM115
    try:
        row = 0
        for batch in stream_rows(files, ["pixels"], _SPILL_ROWS):  # pass 1: spill by bucket, in record order
            pix = pixel_rows(batch.column(0))
            bb = bucket_of_row[row: row + len(pix)]
            for b in np.unique(bb):
                handles[b].write(pix[bb == b].tobytes())
            row += len(pix)
    finally:
        for h in handles:
            h.close()


def _bucket_means(spill: Path, labels_: np.ndarray, sizes: np.ndarray, bucket_of_row: np.ndarray, n_buckets: int,
                  p: int, own: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Pass 2 of :func:`_ksame_out_of_core`: each bucket read back and its clusters' means appended to
    ``spill/averages`` (cluster c at row c).

    With ``own`` (the near-copy repair), every member's distance to its cluster's mean is written into
    it and the buckets are kept (the repair reads members back from them); without, each bucket's
    file goes once read. Returns (each bucket's rows in record order, the buckets' bounds in them).
    """
    by_bucket = np.argsort(bucket_of_row, kind="stable")  # each bucket's rows in record order
    bounds = np.r_[0, np.cumsum(np.bincount(bucket_of_row, minlength=n_buckets))]
    repair = own is not None
    with open(spill / "averages", "wb") as avg:  # pass 2: cluster means, cluster c at row c
        for b in range(n_buckets):
            rows = by_bucket[bounds[b]:bounds[b + 1]]
            data = np.fromfile(spill / f"b{b:05d}", dtype=np.uint8).reshape(len(rows), p)
            if not repair:  # the repair reads members back from the buckets
                (spill / f"b{b:05d}").unlink()
            labs = labels_[rows]
            order = np.argsort(labs, kind="stable")
            labs = labs[order]
            starts = np.flatnonzero(np.r_[True, labs[1:] != labs[:-1]])
            ends = np.r_[starts[1:], len(labs)]
            members = rows[order]
            # A few hundred clusters at a time (issue 13: the whole bucket's float64 sums were ~8x its
            # pixels); each cluster's mean is computed as for the whole bucket, so the bytes are the same.
            for c0 in range(0, len(starts), _MEAN_CLUSTERS):
                c1 = min(c0 + _MEAN_CLUSTERS, len(starts))
                a, z = int(starts[c0]), int(ends[c1 - 1])
                chunk = data[order[a:z]]  # these clusters' rows, grouped by cluster
                sums = _cluster_sums(chunk, starts[c0:c1] - a, ends[c0:c1] - a)
                means = sums / sizes[labs[starts[c0:c1]]][:, None]  # float64, rounded and clipped in place
                del sums
                np.rint(means, out=means)
                means = np.clip(means, 0, 255, out=means).astype(np.uint8)
                if repair:  # every member against its cluster's released mean (what the gate measures)
                    seg = np.repeat(np.arange(c1 - c0), ends[c0:c1] - starts[c0:c1])
                    mine = members[a:z]
                    for s in range(0, len(seg), _DISTANCE_ROWS):  # a few MB of int16 at a time
                        own[mine[s:s + _DISTANCE_ROWS]] = mean_abs_difference(
                            means[seg[s:s + _DISTANCE_ROWS]], chunk[s:s + _DISTANCE_ROWS])
                avg.write(means.tobytes())
            del data, chunk
    return by_bucket, bounds


def _cluster_sums(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Each segment ``rows[starts[i]:ends[i]]``'s column sums (uint8 rows, exact in uint32): what
    ``np.add.reduceat(rows, starts, axis=0, dtype=np.uint32)`` gives for back-to-back segments, ~10x less CPU
    (reduceat walks a segment's rows column by column: 18.5 -> 1.9 us a 81 x 92 face; issue 32)."""
    out = np.empty((len(starts), rows.shape[1]), np.uint32)
    for i, (a, z) in enumerate(zip(starts.tolist(), ends.tolist())):
        np.add.reduce(rows[a:z], axis=0, dtype=np.uint32, out=out[i])
    return out


def _write_released_means(out: Path, spill: Path, ids: pa.Array, labels_: np.ndarray, names: list[str],
                          p: int) -> np.ndarray:
    """Pass 3 of :func:`_ksame_out_of_core`: the partition's record order streamed again, every kept record
    (label >= 0) written with its cluster's mean (read from ``spill/averages`` with ``pread``) into the
    de-identified part ``out`` (atomically); returns the kept records' rows."""
    kept = np.flatnonzero(labels_ >= 0)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}.tmp")
    schema = schemas.deidentified()
    fd = os.open(spill / "averages", os.O_RDONLY)
    try:
        with pq.ParquetWriter(tmp, schema, **schemas.writer_options(schema.names)) as writer:  # pass 3: every record its cluster's mean
            for a in range(0, len(kept), OUT_ROWS):
                rows = kept[a: a + OUT_ROWS]
                labs = labels_[rows]
                uniq, inv = np.unique(labs, return_inverse=True)
                means = np.empty((len(uniq), p), dtype=np.uint8)
                for j, c in enumerate(uniq):
                    means[j] = np.frombuffer(os.pread(fd, p, int(c) * p), dtype=np.uint8)
                writer.write_batch(pa.record_batch(
                    [ids.take(pa.array(rows, pa.int64())), pa.array([names[c] for c in labs], pa.string()),
                     binary_rows(means[inv])], schema=schema))
    finally:
        os.close(fd)
    os.replace(tmp, out)
    return kept


def _grouping_inputs(files: list[str]) -> tuple[pa.Array, np.ndarray, Sequence, np.ndarray]:
    """(record ids, person codes, person of each code, float32 features) of a partition's files, in record order.

    What k-Same's grouping needs, without a Python object per record (issue 13): the ids stay an
    Arrow column; people are integer codes in order of first appearance (as :class:`KSame` numbers
    them; a null person is its own code) with one str per person, read from Arrow only for a message;
    the features go a batch at a time into one float32 matrix, as stored, which the grouping
    converts to float64 a part at a time (:func:`deid.anonymise.ksame.group_people`).
    """
    n = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    id_chunks: list[pa.Array] = []
    person_chunks: list[pa.Array] = []
    X = None
    row = 0
    for b in stream_rows(files, ["record_id", "subject_id", "features"]):
        id_chunks.append(b.column(0))
        person_chunks.append(b.column(1))
        f = feature_rows(b.column(2))
        if len(f):
            if X is None:
                X = np.empty((n, f.shape[1]), np.float32)
            X[row:row + len(f)] = f
            row += len(f)
    if X is None:
        X = np.zeros((0, 0), np.float32)
    ids = pa.chunked_array(id_chunks, pa.string()).combine_chunks() if id_chunks else pa.array([], pa.string())
    persons = pa.chunked_array(person_chunks, pa.string()).combine_chunks() if person_chunks \
        else pa.array([], pa.string())
    del id_chunks, person_chunks
    enc = persons.dictionary_encode()  # codes in order of first appearance
    if enc.indices.null_count:  # KSame numbers None where it first appears: so do these codes
        codes, who = _factorize(shared_objects(persons), "people", len(persons))
    else:
        codes, who = enc.indices.to_numpy(zero_copy_only=False).astype(np.intp), StringColumn(enc.dictionary)
    return ids, codes, who, X


def _repair_out_of_core(spill: Path, labels_: np.ndarray, features: Callable[[], Iterable[np.ndarray]],
                        people: np.ndarray, own: np.ndarray, bucket_of_row: np.ndarray, by_bucket: np.ndarray,
                        bounds: np.ndarray, *, n_clusters: int, p: int, k: int, threshold: float):
    """The near-copy repair of :func:`_ksame_out_of_core`, between its passes (2) and (3).

    ``own`` is every record's distance to its cluster's mean; ``features()`` yields the records'
    features in record order, a block at a time (read only when a cluster is a near copy);
    ``people`` the person (code) of each record. A merge candidate's members are read
    back from their bucket spill files (``pread``, only those rows), their exact integer sums give
    the merged mean (rounded as pass 2 rounds), which is written into the averages file at the
    partner's row. Returns the new labels (-1: suppressed), the :class:`NearCopyRepair` and the
    suppressed records (indices in the partition's record order).
    """
    closest = closest_member(labels_, own, n_clusters)
    if not np.any(closest < threshold):
        return labels_, summarize(RepairPlan((), (), ()), closest, labels_, threshold=threshold), ()
    local = np.empty(len(labels_), np.int64)  # each record's row inside its bucket's spill file
    local[by_bucket] = np.arange(len(by_bucket)) - bounds[bucket_of_row[by_bucket]]
    merged: dict[tuple[int, int], np.ndarray] = {}

    def pixels_of(rows: np.ndarray) -> np.ndarray:
        out = np.empty((len(rows), p), np.uint8)
        for j, r in enumerate(rows):
            with open(spill / f"b{int(bucket_of_row[r]):05d}", "rb") as f:
                out[j] = np.frombuffer(os.pread(f.fileno(), p, int(local[r]) * p), np.uint8)
        return out

    def merged_closest(a: int, b: int) -> float:
        rows = np.flatnonzero((labels_ == a) | (labels_ == b))
        pix = pixels_of(rows)
        mean = np.clip(np.rint(pix.sum(axis=0, dtype=np.uint32) / len(rows)), 0, 255).astype(np.uint8)
        merged[(a, b)] = mean
        return float(mean_abs_difference(np.broadcast_to(mean, pix.shape), pix).min())

    plan = plan_repair(closest, cluster_centroids(features(), labels_, n_clusters), threshold=threshold,
                       merged_closest=merged_closest)
    new = relabel(labels_, plan)
    check_merged(new, people, plan, k=k)
    fd = os.open(spill / "averages", os.O_WRONLY)
    try:
        for a, b in plan.merges:  # the partner's row now holds the merged mean
            os.pwrite(fd, merged[(a, b)].tobytes(), b * p)
    finally:
        os.close(fd)
    summary = summarize(plan, closest, new, threshold=threshold)
    log.info("deidentify: near-copy repair (threshold %g): %d near-copy clusters, %d merged, %d suppressed "
             "(%d records)", threshold, summary.near_copy_clusters, summary.clusters_merged,
             summary.clusters_suppressed, summary.records_suppressed)
    return new, summary, tuple(np.flatnonzero(new < 0).tolist())


def _colour_faces(color_dir: str, ids: list[str]) -> np.ndarray:
    """The aligned colour faces of ``ids``, in that order (uint8, n x h*w*3)."""
    import pyarrow.compute as pc  # noqa: PLC0415

    t = ds.dataset(color_dir, format="parquet").to_table(filter=pc.field("record_id").isin(ids))
    where = {rid: i for i, rid in enumerate(t.column("record_id").to_pylist())}
    missing = [rid for rid in ids if rid not in where]
    if missing:
        raise StateError(f"{len(missing)} records have no colour face in {color_dir} (e.g. {missing[0]}); "
                         "the aligned colour parts are incomplete")
    raw = t.column("color").to_pylist()
    return np.frombuffer(b"".join(raw[where[rid]] for rid in ids), np.uint8).reshape(len(ids), -1)


def _colour_means(colour: np.ndarray, labels_: np.ndarray | None) -> np.ndarray:
    """Per record, the per-channel mean colour face of its cluster (uint8; ``labels_`` None: one cluster)."""
    if labels_ is None:
        return np.clip(np.rint(colour.mean(axis=0, dtype=np.float64)), 0, 255).astype(np.uint8)[None]
    out = np.empty_like(colour)
    for c in np.unique(labels_):
        members = labels_ == c
        out[members] = np.clip(np.rint(colour[members].mean(axis=0, dtype=np.float64)), 0, 255).astype(np.uint8)
    return out


def colour_to_grey(colour: np.ndarray) -> np.ndarray:
    """(n, h*w*3) BGR faces to (n, h*w) grey with OpenCV's weights (those every grey decode uses)."""
    import cv2  # noqa: PLC0415

    n = len(colour)
    if n == 0:
        return np.zeros((0, 0), np.uint8)
    grey = cv2.cvtColor(colour.reshape(n, -1, 3), cv2.COLOR_BGR2GRAY)
    return np.ascontiguousarray(grey.reshape(n, -1))
