"""Stage functions that run on Dask workers: each reads Parquet, computes, writes Parquet.

Every function is idempotent (it writes to a temporary file and renames it into place) so a
task re-run after a lost worker produces the same output. They take paths and small parameters,
never large arrays, so nothing big travels through the scheduler.
"""
from __future__ import annotations

import logging
import os
import uuid
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from deid.alignment.eyes import EyePair, HaarEyeDetector
from deid.alignment.canonical import FaceAligner
from deid.alignment.align import align_records
from deid.contracts import LINEAGE_PARTITION, ClusterInfo, CounterfeitRow, ReleaseRows, StagingLayout
from deid.errors import ConfigError, Quarantined, StateError
from deid.alignment.features import Eigenfaces, IlluminationFeatures
from deid.anonymise.identity import PeopleResolution, normalize_subject_id, resolve_people
from deid.anonymise.ksame import KSame, _factorize, group_people
from deid.anonymise.near_copy import (NearCopyRepair, RepairPlan, check_merged, closest_member, cluster_centroids,
                                      plan_repair, relabel, repair_in_memory, summarize)
from deid.evaluation.leaks import mean_abs_difference
from deid.heap import release_free_memory
from deid.release.linkage import COUNTERFEIT_PREFIX  # staging id of a counterfeit record (private linkage only)
from deid.method_registry import COLOR_METHODS, REGISTRY
from deid.anonymise.methods import deidentify as deidentify_images
from deid.anonymise.methods_aam import given_shapes
from deid.anonymise.methods_ksame import shape_sources
from deid.schemas import arrow as schemas

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlignedBatch:
    """What one align task returns: its aligned part, how many faces it holds, what it quarantined."""

    path: str
    aligned: int
    quarantined: tuple[Quarantined, ...]
    eye_sources: Mapping[str, int]  # eye source (detector, manifest, ...) -> aligned faces
    yaw_histogram: tuple[int, ...] = ()  # aligned faces per whole degree of |yaw| (0..90); () = not estimated


@dataclass(frozen=True)
class DeidentifiedPart:
    """What one de-identification task returns: its part and the cluster summary (sizes, distinct people)."""

    path: str
    records: int
    clusters: tuple[ClusterInfo, ...]
    shape_sources: dict[str, int] | None = None  # k-same-m, k-same-aam: clusters shaped from points / optical flow
    suppressed: tuple[str, ...] = ()  # records withheld as near copies (not in the part)
    near_copies: NearCopyRepair | None = None  # the near-copy repair (None: the method gets none)


@dataclass(frozen=True)
class GateRecords:
    """The per-record facts the gate needs (:func:`gate_records`), as :class:`~deid.evaluation.gate.GateInputs` takes them."""

    record_ids: Sequence[str]  # a StringColumn (Arrow-backed) from gate_records
    people: np.ndarray
    clusters: np.ndarray
    partitions: np.ndarray
    labels: dict[str, np.ndarray]
    image_index: np.ndarray
    own_distance: np.ndarray
    fetch: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    points: list | None = None  # per record, its canonical landmarks (None: none) when asked for


def _write_atomic(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    pq.write_table(table, tmp, **schemas.writer_options(table.column_names))
    os.replace(tmp, path)


def make_aligner(params: dict) -> FaceAligner:
    """Build the aligner from plain parameters (so it can be sent to a worker)."""
    return FaceAligner(
        size=tuple(params["size"]),
        eye_left=tuple(params["eye_left"]),
        eye_right=tuple(params["eye_right"]),
        max_upsample=params["max_upsample"],
        min_eye_distance=params["min_eye_distance"],
        detector=HaarEyeDetector(),
    )


def align_batch(ingested_path: str, row_groups: list[int], out_path: str, aligner_params: dict,
                exclude: list[str] = ()) -> AlignedBatch:
    """Align the faces of some row groups of the ingested table; return counts and quarantine records."""
    pf = pq.ParquetFile(ingested_path)
    points = "points" in pf.schema_arrow.names  # landmarks go to canonical pixels with their face
    boxes = "face_box" in pf.schema_arrow.names  # video frames: the tracked face box, eyes found in it
    table = pf.read_row_groups(
        row_groups, columns=["record_id", "image", "data", "eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y",
                             *(["points"] if points else []), *(["face_box"] if boxes else [])]
    )
    skip = set(exclude)
    aligner = make_aligner(aligner_params)
    cols = table.to_pydict()
    records = []
    for i, rid in enumerate(cols["record_id"]):
        if rid in skip:
            continue
        lx, ly, rx, ry = (cols[c][i] for c in ("eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y"))
        eyes = EyePair((lx, ly), (rx, ry)) if lx is not None else None
        records.append({"record_id": rid, "image": cols["image"][i], "data": cols["data"][i], "eyes": eyes,
                        **({"points": cols["points"][i]} if points else {}),
                        **({"face_box": cols["face_box"][i]} if boxes else {})})
    del cols, table
    color = bool(aligner_params.get("color"))
    max_yaw = aligner_params.get("max_yaw")
    ok, bad = align_records(records, aligner, color=color, max_yaw=max_yaw)
    if color:
        # Colour faces beside the grey ones (<staging>/aligned_color/<same part name>): only the
        # de-identification reads them; everything measured (eyes, features, identity, attacks) is grey.
        _write_atomic(pa.table({"record_id": [r["record_id"] for r in ok], "color": [r["color"] for r in ok]},
                               schema=schemas.aligned_color()), color_part(out_path))
    out = pa.table(
        {
            "record_id": [r["record_id"] for r in ok],
            "pixels": [r["pixels"] for r in ok],
            "eye_source": [r["eye_source"] for r in ok],
            "eye_left_x": [float(r["eye_left_x"]) for r in ok],
            "eye_left_y": [float(r["eye_left_y"]) for r in ok],
            "eye_right_x": [float(r["eye_right_x"]) for r in ok],
            "eye_right_y": [float(r["eye_right_y"]) for r in ok],
            **({"points": [r["points"] for r in ok]} if points else {}),
            **({"yaw": [r.get("yaw") for r in ok]} if max_yaw is not None else {}),
        },
        schema=schemas.aligned(points=points, yaw=max_yaw is not None),
    )
    _write_atomic(out, Path(out_path))
    return AlignedBatch(path=out_path, aligned=len(ok), quarantined=tuple(bad),
                        eye_sources={s: sum(r["eye_source"] == s for r in ok) for s in {r["eye_source"] for r in ok}},
                        yaw_histogram=yaw_histogram([r.get("yaw") for r in ok]) if max_yaw is not None else ())


def yaw_histogram(yaws: Iterable[float | None]) -> tuple[int, ...]:
    """Faces per whole degree of |yaw| (bins 0..90; None, not estimable, left out): summed over align tasks."""
    a = np.abs(np.array([y for y in yaws if y is not None], dtype=np.float64))
    return tuple(int(c) for c in np.bincount(np.minimum(a, 90).astype(np.int64), minlength=91))


def pose_spread(histogram: Sequence[int], *, max_yaw: float | None, quarantined: int) -> dict:
    """The report's pose figures: |yaw| quantiles (whole degrees, upper bin edge) of the aligned faces."""
    if max_yaw is None:
        return {"estimated": False, "max_yaw_degrees": None}
    h = np.asarray(histogram, dtype=np.int64)
    n = int(h.sum())
    out = {"estimated": True, "max_yaw_degrees": max_yaw, "faces": n, "quarantined_pose": int(quarantined)}
    if n:
        cum = np.cumsum(h)
        for q in (50, 90, 99):
            out[f"abs_yaw_p{q}"] = int(np.searchsorted(cum, q / 100 * n)) + 1
        out["abs_yaw_max"] = int(np.nonzero(h)[0][-1]) + 1
    return out


def color_part(aligned_part: str | Path) -> Path:
    """Where :func:`align_batch` writes the colour faces of one aligned part (``<staging>/aligned/<part>``)."""
    p = Path(aligned_part)
    return StagingLayout(p.parent.parent).color_part(p)


def read_pixels(paths: list[str], columns=("record_id", "pixels")) -> tuple[list[str], np.ndarray]:
    """Load aligned faces from Parquet parts as (record ids, uint8 matrix n x p)."""
    table = pa.concat_tables([pq.read_table(p, columns=list(columns)) for p in paths]) if paths else None
    if table is None or table.num_rows == 0:
        return [], np.zeros((0, 0), dtype=np.uint8)
    return table.column("record_id").to_pylist(), _pixels(table.column("pixels"))


class RowFile:
    """An (n, p) uint8 matrix on disk whose rows are read on demand with ``pread``.

    For attacks that need any original face but never all of them at once (the lineage
    differencing attack): nothing is memory-mapped, so the process's resident memory holds only
    the rows asked for (issue 13).
    """

    def __init__(self, path: Path, n: int, p: int):
        self.path, self.n, self.p = Path(path), int(n), int(p)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.p)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64).ravel()
        out = np.empty((len(idx), self.p), dtype=np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if len(idx) and idx[-1] - idx[0] + 1 == len(idx) and (len(idx) == 1 or (np.diff(idx) == 1).all()):
                out[:] = np.frombuffer(os.pread(fd, len(idx) * self.p, int(idx[0]) * self.p),
                                       np.uint8).reshape(len(idx), self.p)  # a run of rows: one read
            else:
                for j, i in enumerate(idx.tolist()):
                    out[j] = np.frombuffer(os.pread(fd, self.p, i * self.p), np.uint8)
        finally:
            os.close(fd)
        return out

    def read_image(self, row: int) -> np.ndarray:
        """Row ``row`` (the source of a :class:`deid.release.lineage.StoredImage`)."""
        return self[[int(row)]][0]

    def read_images(self, rows) -> np.ndarray:
        """Rows ``rows`` in that order, read in ascending order (runs of rows in one read)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        order = np.argsort(rows, kind="stable")
        out = np.empty((len(rows), self.p), dtype=np.uint8)
        out[order] = self[rows[order]]
        return out

    @classmethod
    def from_aligned(cls, aligned_paths: list[str], record_ids: list[str], path: Path) -> "RowFile":
        """The aligned faces of ``record_ids`` (all present), row ``i`` = ``record_ids[i]``, one part in memory at a time."""
        where = {r: i for i, r in enumerate(record_ids)}
        p = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for part in aligned_paths:
                t = pq.read_table(part, columns=["record_id", "pixels"])
                if not t.num_rows:
                    continue
                pix = _pixels(t.column("pixels"))
                p = pix.shape[1]
                for j, rid in enumerate(t.column("record_id").to_pylist()):
                    if rid in where:
                        os.pwrite(fd, pix[j].tobytes(), where[rid] * p)
        finally:
            os.close(fd)
        return cls(path, len(record_ids), p)


class IndexedRows:
    """An (n, p) matrix whose row ``i`` is ``table[index[i]]``: each distinct row is held once.

    A release's records carry their cluster's image: ``table`` holds each distinct (cluster,
    image) once, in memory or on disk (:class:`RowFile`), and rows added later (counterfeits)
    stay in memory. An int index gives a 1-D row, an array of indices a matrix, a tuple indexes
    the rows then the values; ``np.asarray`` materialises the whole matrix (small inputs only).
    Issue 13: the stage never holds every released image at once.
    """

    ndim = 2

    def __init__(self, table, index, extra: np.ndarray | None = None):
        self.table, self.index = table, np.asarray(index, dtype=np.int64).reshape(-1)
        self.dtype = np.dtype(np.uint8) if isinstance(table, RowFile) else np.asarray(table).dtype
        self.extra = extra if extra is not None else np.zeros((0, table.shape[1]), self.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.index), int(self.table.shape[1]))

    def __len__(self) -> int:
        return len(self.index)

    def _rows(self, j: np.ndarray) -> np.ndarray:
        n0 = self.table.shape[0]
        out = np.empty((len(j), self.shape[1]), dtype=self.dtype)
        mine = j < n0
        if mine.any():
            out[mine] = np.asarray(self.table[j[mine]])
        if not mine.all():
            out[~mine] = self.extra[j[~mine] - n0]
        return out

    def __getitem__(self, i):
        if isinstance(i, tuple):
            return self[i[0]][i[1:]]
        if isinstance(i, (int, np.integer)):
            return self._rows(self.index[[int(i)]])[0]
        return self._rows(self.index[i])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self._rows(self.index)
        return out if dtype is None else out.astype(dtype, copy=False)

    def stored_image(self, i: int):
        """Row ``i`` as the lineage registers it: a :class:`~deid.release.lineage.StoredImage` reading the
        row file on demand when the table is on disk (issue 13), else a copy of the row."""
        from deid.release.lineage import StoredImage, average_sha256  # noqa: PLC0415

        j = int(self.index[int(i)])
        if not isinstance(self.table, RowFile) or j >= self.table.shape[0]:
            return self[int(i)].copy()
        return StoredImage(self.table, j, sha256=average_sha256(self.table.read_image(j)), size=self.shape[1])

    def same_image(self, rows) -> bool:
        """Whether ``rows`` all hold one image (rows sharing a table row do by construction)."""
        idx = np.unique(self.index[np.asarray(rows, dtype=np.int64)])
        if len(idx) == 1:
            return True
        first = self._rows(idx[:1])[0]
        return all(np.array_equal(self._rows(idx[n:n + 1])[0], first) for n in range(1, len(idx)))

    def take(self, rows) -> "IndexedRows":
        """These rows, in the order of ``rows`` (indices of this matrix)."""
        return IndexedRows(self.table, self.index[np.asarray(rows, dtype=np.int64)], self.extra)

    def with_rows(self, rows: np.ndarray) -> "IndexedRows":
        """This matrix with ``rows`` appended (held in memory)."""
        rows = np.asarray(rows, dtype=self.dtype).reshape(-1, self.shape[1])
        start = self.table.shape[0] + len(self.extra)
        return IndexedRows(self.table, np.concatenate([self.index, start + np.arange(len(rows))]),
                           np.vstack([self.extra, rows]))


def distinct_rows(parts: Sequence[str], column: str = "pixels", *,
                  spill: Path | None = None) -> tuple[pa.Table, IndexedRows]:
    """(record_id, cluster, row) of every record of the de-identified ``parts`` and their ``column`` pixels.

    The parts are streamed a batch at a time; each distinct (cluster, image) is stored once (a
    k-Same release holds one image per cluster), on disk in ``spill`` (a :class:`RowFile`) when
    given, else in memory. ``row`` indexes the returned matrix.
    """
    import hashlib  # noqa: PLC0415

    seen: dict[tuple[str, bytes], int] = {}
    keys: list[pa.Table] = []
    held: list[np.ndarray] = []
    p = 0
    fh = open(spill, "wb") if spill is not None else None  # noqa: SIM115 - closed below
    try:
        for batch in _stream(list(parts), ["record_id", "cluster", column]):
            if not batch.num_rows:
                continue
            pix = _pixels(batch.column(column))
            p = pix.shape[1]
            clusters = batch.column("cluster").to_pylist()
            rows = np.empty(len(clusters), dtype=np.int64)
            for r, c in enumerate(clusters):
                key = (c, hashlib.blake2b(pix[r], digest_size=16).digest())
                j = seen.get(key)
                if j is None:
                    j = seen[key] = len(seen)
                    if fh is not None:
                        fh.write(pix[r].tobytes())
                    else:
                        held.append(pix[r].copy())
                rows[r] = j
            keys.append(pa.table({"record_id": batch.column("record_id"), "cluster": batch.column("cluster"),
                                  "row": rows}))
    finally:
        if fh is not None:
            fh.close()
    table = (RowFile(spill, len(seen), p) if spill is not None else
             np.stack(held) if held else np.zeros((0, p), np.uint8))
    keys_t = (pa.concat_tables(keys) if keys else
              pa.table({"record_id": pa.array([], pa.string()), "cluster": pa.array([], pa.string()),
                        "row": pa.array([], pa.int64())}))
    return keys_t, IndexedRows(table, np.arange(len(seen)))


def fit_eigenfaces(aligned_paths: list[str], n_components: int, seed: int = 0) -> Eigenfaces:
    """Fit the eigenface model on the aligned set (a seeded subset on large drops).

    Only the subset Eigenfaces would draw is loaded (the same seeded choice), so memory stays
    bounded by ``max_fit_samples`` faces instead of the whole drop.
    """
    model = Eigenfaces(n_components, random_state=seed)
    counts = [pq.ParquetFile(p).metadata.num_rows for p in aligned_paths]
    total = sum(counts)
    if total <= model.max_fit_samples:
        _, X = read_pixels(aligned_paths)
        return model.fit(X)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(total, model.max_fit_samples, replace=False))
    rows, start = [], 0
    for path, n in zip(aligned_paths, counts):
        local = chosen[(chosen >= start) & (chosen < start + n)] - start
        if len(local):
            pix = pq.read_table(path, columns=["pixels"]).column("pixels").take(pa.array(local)).to_pylist()
            rows.extend(pix)
        start += n
    X = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), -1)
    return model.fit(X)


def _list_column(feats: np.ndarray, n: int) -> pa.ListArray:
    """Rows of a float matrix as an Arrow list column (one buffer, no Python lists)."""
    return pa.ListArray.from_arrays(
        pa.array(np.arange(0, feats.size + 1, max(feats.shape[1], 1), dtype=np.int32)[: n + 1]),
        pa.array(np.ascontiguousarray(feats, dtype=np.float32).ravel()))


def project_part(aligned_path: str, model: Eigenfaces, out_path: str, identity=None) -> int:
    """Project one aligned part onto the eigenfaces; write (record_id, features).

    ``identity`` (a fitted :data:`CheapIdentityFeatures`): also write the identity first pass's
    features of the part (column ``identity``), from the pixels read once for both.
    """
    ids, X = read_pixels([aligned_path])
    feats = model.transform(X) if len(ids) else np.zeros((0, model.n_components_), np.float32)
    columns = {"record_id": ids, "features": _list_column(feats, len(ids))}
    if identity is not None:
        columns["identity"] = _list_column(identity.transform(X), len(ids))
    _write_atomic(pa.table(columns, schema=schemas.features(identity=identity is not None)), Path(out_path))
    return len(ids)


def fit_identity_features(aligned_path: str, shape: tuple[int, int]):
    """The identity first pass's model (:data:`CheapIdentityFeatures`), fitted on the first aligned part
    (at most ~4,000 of its faces, evenly spaced)."""
    _, rows = read_pixels([aligned_path])
    return CheapIdentityFeatures(shape).fit(rows[:: max(1, len(rows) // 4000)])


def deidentify_partition(partition_dir: str, out_path: str, *, k: int, method: str = "k-same-select",
                         shape: tuple[int, int] | None = None, sigma: float | None = None,
                         block: int | None = None, labels: tuple[str, ...] | list[str] = (),
                         color_dir: str | None = None, block_size: int | None = 2000,
                         map_blocks=None, near_copy_threshold: float | None = None,
                         seed: int = 0) -> DeidentifiedPart:
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
    """
    spec = REGISTRY.get(method)
    repair = near_copy_threshold if spec is not None and spec.repairs_near_copies else None
    release_free_memory()  # what earlier calls on this worker freed but its allocators kept (issue 13)
    if spec is not None and spec.cluster_mean and color_dir is None:
        return _ksame_out_of_core(partition_dir, out_path, k=k, method=method, block_size=block_size,
                                  map_blocks=map_blocks, near_copy_threshold=repair)
    dataset = ds.dataset(partition_dir, format="parquet")
    # Canonical landmarks, when the aligned faces carry them (a drop with a points column): k-same-m's shape.
    has_points = "points" in dataset.schema.names
    # Image sequences (a drop with sequence/frame columns): multi-factor keeps one identity per person.
    seq_cols = ["sequence", "frame"] if "sequence" in dataset.schema.names else []
    table = dataset.to_table(columns=["record_id", "subject_id", "features", "pixels", *labels,
                                      *(["points"] if has_points else []), *seq_cols])
    ids = table.column("record_id").to_pylist()
    people = np.asarray(table.column("subject_id").to_pylist(), dtype=object)
    X = _features(table.column("features"))
    images = _pixels(table.column("pixels"))
    spec = REGISTRY.get(method)
    sources: dict[str, int] = {}
    if spec is None or not spec.cluster_mean:  # (an unknown name gets deid.anonymise.methods' ConfigError)
        # Every other method (registry in deid.anonymise.methods) runs on the pixels; those without
        # clusters (blur, pixelate, selective-mean, attribute-preserving) get one per record.
        points = table.column("points").to_pylist() if has_points else None
        released, found = deidentify_images(images, shape=shape, people=list(people), method=method, k=k,
                                            sigma=sigma, block=block, seed=seed,
                                            labels={x: table.column(x).to_pylist() for x in labels} or None,
                                            points=points,
                                            sequences=table.column("sequence").to_pylist() if seq_cols else None,
                                            frames=table.column("frame").to_pylist() if seq_cols else None)
        labels_ = np.arange(len(ids)) if found is None else found
        if method == "k-same-m" and len(ids):  # the report says where the clusters' shapes came from
            for source in shape_sources(labels_, points):
                sources[source] = sources.get(source, 0) + 1
        elif method == "k-same-aam" and len(ids):  # one shape model per partition: its clusters share its source
            source = "points" if shape is not None and given_shapes(points, shape) is not None else "flow"
            sources[source] = sources.get(source, 0) + int(labels_.max()) + 1
    else:
        model = KSame(k, count="people" if spec.counts_people else "images", block_size=block_size,
                      map_blocks=map_blocks).fit(X, people=people, images=images)
        released = np.clip(np.rint(model.averages_[model.labels_]), 0, 255).astype(np.uint8)
        labels_ = model.labels_
    names = [uuid.uuid4().hex[:12] for _ in range(int(labels_.max()) + 1 if len(labels_) else 0)]
    near: NearCopyRepair | None = None
    suppressed: tuple[str, ...] = ()
    colour = None
    if color_dir is not None:
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
    columns = {"record_id": ids, "cluster": [names[c] for c in labels_]}
    if colour is not None:
        columns["color"] = [r.tobytes() for r in colour]
    columns["pixels"] = [r.tobytes() for r in released]
    out = pa.table(columns, schema=schemas.deidentified(color=color_dir is not None))
    _write_atomic(out, Path(out_path))
    # A cluster merged into its partner by the near-copy repair is gone.
    summary = _cluster_summary(names, labels_, people)
    del out, columns, table, X, images, released, colour
    release_free_memory()  # what the stage freed goes back to the OS (issue 13)
    return DeidentifiedPart(path=out_path, records=len(ids), clusters=summary,
                            shape_sources=sources, suppressed=suppressed, near_copies=near)


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
_OUT_ROWS = 2048  # records per row group of the de-identified part
_SPILL_ROWS = 512  # records read at a time when spilling pixels to the buckets (~4 MB of 81 x 92 faces)
_DISTANCE_ROWS = 256  # faces measured against their cluster's mean at a time (near-copy repair)
_MEAN_CLUSTERS = 64  # clusters averaged at a time in a bucket (~2.5 MB of their pixels, ~4 MB of float64 sums)


def _stream(files: list[str], columns: list[str], batch_rows: int = _OUT_ROWS):
    """Record batches of ``files`` in order (the order the gate pairs the partition with its release).

    Decoded in this thread: Arrow's decoding threads each keep their own allocator heap, which
    releasing the pool from here does not empty (~27 MB left per process; issue 13).
    """
    for f in files:
        yield from pq.ParquetFile(f, buffer_size=STREAM_BUFFER, pre_buffer=False).iter_batches(
            batch_size=batch_rows, columns=columns, use_threads=False)


def _binary_rows(rows: np.ndarray) -> pa.Array:
    """An (m, p) uint8 matrix as a binary column, without a Python bytes object per row."""
    m, p = rows.shape
    offsets = pa.py_buffer(np.arange(0, (m + 1) * p, p, dtype=np.int32).tobytes())
    return pa.Array.from_buffers(pa.binary(), m, [None, offsets, pa.py_buffer(np.ascontiguousarray(rows))])


def _ksame_out_of_core(partition_dir: str, out_path: str, *, k: int, method: str, block_size: int | None,
                       map_blocks, near_copy_threshold: float | None = None) -> DeidentifiedPart:
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
    """
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    files = list(ds.dataset(partition_dir, format="parquet").files)
    ids, codes, who, X = _grouping_inputs(files)
    release_free_memory()  # what reading them left in Arrow's pool and the C heap (~30 MB at 200,000 faces)
    labels_ = group_people(X, codes, k=k, count="people" if REGISTRY[method].counts_people else "images",
                           block_size=block_size, map_blocks=map_blocks, names=who)
    del X  # the repair reads the features again if it needs them (issue 13)
    n_clusters = int(labels_.max()) + 1
    sizes = np.bincount(labels_, minlength=n_clusters).astype(np.int64)
    names = [uuid.uuid4().hex[:12] for _ in range(n_clusters)]
    first = next(_stream(files[:1], ["pixels"], 1))
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
        handles = [open(spill / f"b{b:05d}", "wb") for b in range(n_buckets)]  # noqa: SIM115
        try:
            row = 0
            for batch in _stream(files, ["pixels"], _SPILL_ROWS):  # pass 1: spill by bucket, in record order
                pix = _pixels(batch.column(0))
                bb = bucket_of_row[row: row + len(pix)]
                for b in np.unique(bb):
                    handles[b].write(pix[bb == b].tobytes())
                row += len(pix)
        finally:
            for h in handles:
                h.close()
        by_bucket = np.argsort(bucket_of_row, kind="stable")  # each bucket's rows in record order
        bounds = np.r_[0, np.cumsum(np.bincount(bucket_of_row, minlength=n_buckets))]
        repair = near_copy_threshold is not None
        own = np.empty(len(ids), np.float64) if repair else None
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
                    sums = np.add.reduceat(chunk, starts[c0:c1] - a, axis=0, dtype=np.uint32)
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
        near = suppressed = None
        if repair:
            features = lambda: (_features(b.column(0)) for b in _stream(files, ["features"]))  # noqa: E731
            labels_, near, dropped = _repair_out_of_core(
                spill, labels_, features, codes, own, bucket_of_row, by_bucket, bounds,
                n_clusters=n_clusters, p=p, k=k, threshold=near_copy_threshold)
            suppressed = tuple(ids.take(pa.array(dropped, pa.int64())).to_pylist())
            for b in range(n_buckets):
                (spill / f"b{b:05d}").unlink()
        kept = np.flatnonzero(labels_ >= 0)
        tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}.tmp")
        schema = schemas.deidentified()
        fd = os.open(spill / "averages", os.O_RDONLY)
        try:
            with pq.ParquetWriter(tmp, schema, **schemas.writer_options(schema.names)) as writer:  # pass 3: every record its cluster's mean
                for a in range(0, len(kept), _OUT_ROWS):
                    rows = kept[a: a + _OUT_ROWS]
                    labs = labels_[rows]
                    uniq, inv = np.unique(labs, return_inverse=True)
                    means = np.empty((len(uniq), p), dtype=np.uint8)
                    for j, c in enumerate(uniq):
                        means[j] = np.frombuffer(os.pread(fd, p, int(c) * p), dtype=np.uint8)
                    writer.write_batch(pa.record_batch(
                        [ids.take(pa.array(rows, pa.int64())), pa.array([names[c] for c in labs], pa.string()),
                         _binary_rows(means[inv])], schema=schema))
        finally:
            os.close(fd)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    # Each cluster's size and distinct people (merged clusters grew, merged-away and suppressed ones are gone).
    summary = _cluster_summary(names, labels_, codes)
    n_kept = len(kept)
    del ids, codes, labels_, kept, bucket_of_row, by_bucket, own
    release_free_memory()  # what the stage freed goes back to the OS: a worker holds it for no one (issue 13)
    return DeidentifiedPart(path=out_path, records=n_kept, clusters=summary, shape_sources={},
                            suppressed=suppressed or (), near_copies=near)


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
    for b in _stream(files, ["record_id", "subject_id", "features"]):
        id_chunks.append(b.column(0))
        person_chunks.append(b.column(1))
        f = _features(b.column(2))
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


STREAM_BUFFER = 1 << 20  # bytes read at a time from a Parquet column chunk when streaming


def _paired_batches(partition_dir: str, deid_path: str, columns: list[str], batch_rows: int,
                    skip: frozenset[str] = frozenset()):
    """Stream a label partition and its de-identified part side by side (same record order).

    ``skip``: records the de-identification withheld (near copies): in the partition, not in the part.
    """
    # Little read-ahead and buffered column streams (no pre-buffering of whole column chunks):
    # without them the reader's memory grew with the file (1 GB at 100,000 faces), with them it
    # stays at a few batches of pixels whatever the partition size (bench/bench_gate.py).
    # The dataset scanner read ahead of a slow consumer (~0.5 GB held at 100,000 faces), so the
    # partition's files are streamed one by one, in the dataset's own file order.
    def stream(path: str, cols: list[str]):
        return pq.ParquetFile(path, buffer_size=STREAM_BUFFER, pre_buffer=False).iter_batches(
            batch_size=batch_rows, columns=cols)

    orig = (b for f in ds.dataset(partition_dir, format="parquet").files for b in stream(f, columns))
    if skip:
        drop = pa.array(sorted(skip), pa.string())
        orig = (b.filter(pc.invert(pc.is_in(b.column("record_id"), value_set=drop))) for b in orig)
    rel = stream(deid_path, ["record_id", "cluster", "pixels"])
    o_buf: list[pa.RecordBatch] = []
    for r in rel:
        need = r.num_rows
        while sum(b.num_rows for b in o_buf) < need:
            o_buf.append(next(orig))
        o = pa.Table.from_batches(o_buf).combine_chunks()
        head, rest = o.slice(0, need), o.slice(need)
        o_buf = rest.to_batches() if rest.num_rows else []
        if head.column("record_id").to_pylist() != r.column("record_id").to_pylist():
            raise StateError(f"gate: {deid_path} and {partition_dir} do not list the same records in the same order")
        yield head, r


def _features(column: pa.ChunkedArray | pa.Array, dtype=np.float32) -> np.ndarray:
    """A list column of equal-length feature rows as an (n, d) matrix, through Arrow's flat values.

    Not through ``to_pylist``: a million 50-d rows would be 50 M Python floats.
    """
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        return np.zeros((0, 0), dtype)
    return np.asarray(arr.flatten().to_numpy(zero_copy_only=False), dtype=dtype).reshape(len(arr), -1)


def _pixels(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A binary column of equal-length pixel rows as an (n, p) uint8 matrix, without Python bytes.

    Going through ``to_pylist`` makes one Python bytes object per face; at 100,000 faces the
    freed 7 KB blocks fragment the C heap and the process keeps gigabytes it no longer uses.
    The matrix views the Arrow data buffer directly (one copy when the column is chunked).
    """
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(arr)
    if n == 0:
        return np.zeros((0, 0), np.uint8)
    if arr.null_count:
        raise StateError("pixel column holds nulls; every staged face must have pixels")
    wide = pa.types.is_large_binary(arr.type)
    offsets = np.frombuffer(arr.buffers()[1], np.int64 if wide else np.int32)[arr.offset: arr.offset + n + 1]
    width = int(offsets[1] - offsets[0])
    if width == 0 or np.any(np.diff(offsets) != width):
        raise StateError("pixel rows differ in length; every staged face must have the canonical size")
    data = np.frombuffer(arr.buffers()[2], np.uint8)
    return data[int(offsets[0]): int(offsets[-1])].reshape(n, width)


def gate_records(partitions_root: str, deid_paths: list[str], *, labels: list[str], batch_rows: int = 4096,
                 select: bool = False, partition_keys: dict[tuple[str, ...], str] | None = None,
                 points: bool = False, skip: Sequence[str] = ()) -> GateRecords:
    """Per-record facts the gate needs, streamed: memory holds metadata, never all pixels.

    Returns :class:`GateRecords` for :class:`deid.evaluation.gate.GateInputs`: ``record_ids``, ``people`` (the
    effective person the partition stage resolved, see :func:`resolve_identities`),
    ``clusters``, ``partitions``, ``labels`` (name -> values), ``image_index`` (index of the
    record's released image among the distinct ones, by content hash) and ``own_distance``
    (mean absolute difference between the released image and the record's own original),
    plus ``fetch(idx) -> (released, originals)``, which reads just those records' pixels.
    ``select``: the method partitions by the labels (the returning people's records then join
    the partition of their label values); ``partition_keys`` maps label values to Hive keys, as
    the partition stage returned them (:attr:`deid.contracts.Partitioned.gate_keys`; read from
    ``_index.json`` when absent). ``points``: also each record's landmark points as the
    de-identify stage gave them to the method (None for a record or partition without).
    ``skip``: the records the de-identify stage suppressed as near copies (in no part).
    """
    import hashlib  # noqa: PLC0415

    pairs = []
    for path in sorted(deid_paths):
        name = Path(path).name[: -len(".parquet")]
        pairs.append((str(Path(partitions_root) / name), path))
    # Columns a batch at a time (Arrow), made object arrays once at the end with one str per
    # distinct value (issue 13: lists of a million records' strings each held ~65 MB).
    ids: list[pa.Array] = []
    people: list[pa.Array] = []
    clusters: list[pa.Array] = []
    partitions: list[pa.Array] = []
    label_values: dict[str, list[pa.Array]] = {x: [] for x in labels}
    image_index: list[np.ndarray] = []
    own: list[np.ndarray] = []
    record_points: list | None = [] if points else None
    digests: dict[bytes, int] = {}
    lineage_key = _lineage_partition_key(Path(partitions_root), labels, select, partition_keys)
    skip = frozenset(skip)
    for pdir, dpath in pairs:
        key = Path(pdir).name.split("=", 1)[-1]
        # The returning people's partition of a lineage holds no points: its records are not re-made.
        with_points = points and "points" in ds.dataset(pdir, format="parquet").schema.names
        for o, r in _paired_batches(pdir, dpath, ["record_id", "subject_id", "pixels", *labels,
                                                  *(["points"] if with_points else [])], batch_rows, skip):
            ids.append(_array(r.column("record_id")))
            people.append(_array(o.column("subject_id")))
            clusters.append(_array(r.column("cluster")))
            if key == LINEAGE_PARTITION:
                cols = [o.column(x).to_pylist() for x in labels]
                partitions.append(pa.array([lineage_key(tuple(str(c[j]) for c in cols)) for j in range(r.num_rows)],
                                           pa.string()))
            else:
                partitions.append(pa.array([key] * r.num_rows, pa.string()))
            for x in labels:
                label_values[x].append(_array(o.column(x)))
            if record_points is not None:
                record_points += o.column("points").to_pylist() if with_points else [None] * r.num_rows
            a, b = _pixels(r.column("pixels")), _pixels(o.column("pixels"))
            image_index.append(np.fromiter(
                (digests.setdefault(hashlib.blake2b(row, digest_size=16).digest(), len(digests)) for row in a),
                dtype=np.int64, count=len(a)))
            own.append(mean_abs_difference(a, b))
    del digests
    ids_a = _concat(ids, pa.string())
    del ids

    memo: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}

    def fetch(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(idx, dtype=np.int64)
        key = idx.tobytes()
        if key in memo:
            return memo[key]
        wanted = ids_a.take(pa.array(idx)).to_pylist()
        want = pa.array(sorted(set(wanted)), pa.string())
        got_ids: list[str] = []
        rel_parts, orig_parts = [], []
        for pdir, dpath in pairs:
            for o, r in _paired_batches(pdir, dpath, ["record_id", "pixels"], batch_rows, skip):
                mask = pc.is_in(r.column("record_id"), value_set=want)
                if not pc.any(mask).as_py():
                    continue
                got_ids += r.column("record_id").filter(mask).to_pylist()
                rel_parts.append(_pixels(r.column("pixels").filter(mask)))
                orig_parts.append(_pixels(o.column("pixels").filter(mask)))
        if not len(idx):
            out = (np.zeros((0, 0), np.uint8), np.zeros((0, 0), np.uint8))
        else:
            where = {rid: n for n, rid in enumerate(got_ids)}
            order = np.asarray([where[rid] for rid in wanted], dtype=np.int64)
            out = (np.concatenate(rel_parts)[order], np.concatenate(orig_parts)[order])
        memo.clear()  # keep one sample: the gate asks for the same records several times in a row
        memo[key] = out
        return out

    return GateRecords(
        record_ids=StringColumn(ids_a),
        people=shared_objects(_concat(people, pa.string())),
        clusters=shared_objects(_concat(clusters, pa.string())),
        partitions=shared_objects(_concat(partitions, pa.string())),
        labels={x: shared_objects(_concat(v, pa.string())) for x, v in label_values.items()},
        image_index=np.concatenate(image_index) if image_index else np.zeros(0, np.int64),
        own_distance=np.concatenate(own) if own else np.zeros(0),
        fetch=fetch,
        points=record_points,
    )


def _array(column) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _concat(arrays: list[pa.Array], type_: pa.DataType) -> pa.Array:
    return pa.chunked_array(arrays, type=type_).combine_chunks() if arrays else pa.array([], type_)


def positions_in(ids: pa.ChunkedArray | pa.Array, among: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Each of ``ids``' row in ``among`` (one hash of ``among``); a KeyError names the first id ``among``
    lacks, as a dict lookup would."""
    at = pc.index_in(ids, value_set=_array(among))
    if at.null_count:
        raise KeyError(ids.filter(pc.is_null(at))[0].as_py())
    return at


def shared_objects(values: pa.Array) -> np.ndarray:
    """``np.asarray(values.to_pylist(), dtype=object)`` with one str object per distinct value."""
    if not len(values):
        return np.asarray([], dtype=object)
    enc = values.dictionary_encode()
    table = np.empty(len(enc.dictionary) + 1, dtype=object)
    table[:-1] = enc.dictionary.to_pylist()  # the last entry: None, for null
    return table[enc.indices.fill_null(len(enc.dictionary)).to_numpy()]


class StringColumn(Sequence):
    """A read-only sequence of str over an Arrow string array (the gate's record ids, without a str per record)."""

    def __init__(self, values: pa.Array):
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.values[i].to_pylist()
        return self.values[int(i)].as_py()

    def __iter__(self):
        return iter(self.values.to_pylist())


def _lineage_partition_key(root: Path, labels: list[str], select: bool,
                           by_key: dict[tuple[str, ...], str] | None = None):
    """The gate partition of a returning person's record: the label partition its labels belong to.

    Returning records are staged together (``partition=lineage``); the gate's utility protocol
    re-runs the method per partition, so they join the new records' partition of the same label
    values (k-Same-Select), or the single partition of plain k-Same.
    """
    import json  # noqa: PLC0415

    if by_key is None:
        index_path = StagingLayout(root.parent).partition_index
        index = json.loads(index_path.read_text()) if index_path.is_file() else []
        by_key = {tuple(e["key"]): Path(e["dir"]).name.split("=", 1)[-1] for e in index}
    if not select:
        single = next(iter(by_key.values())) if len(by_key) == 1 else LINEAGE_PARTITION
        return lambda lab: single
    return lambda lab: by_key.get(lab, f"{LINEAGE_PARTITION}|" + "|".join(lab))


def embed_faces(pixels: list[bytes], shape: tuple[int, int]) -> np.ndarray:
    """dlib ResNet descriptors of aligned canonical faces (a Dask task: one core per chunk)."""
    from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415 (dlib import cost)

    a = np.frombuffer(b"".join(pixels), np.uint8).reshape(len(pixels), -1)
    return DlibEmbedder(tuple(shape)).transform(a)


IDENTITY_CHEAP_DIMS = 48  # principal components of the self-quotient images the first pass searches


def identity_cheap_features(pixels: np.ndarray, shape: tuple[int, int], *, dims: int = IDENTITY_CHEAP_DIMS,
                            chunk: int = 4096) -> np.ndarray:
    """The identity first pass's features of in-memory faces (:class:`CheapIdentityFeatures`)."""
    a = np.asarray(pixels)
    if len(a) == 0:
        return np.zeros((0, dims), np.float32)
    model = CheapIdentityFeatures(shape, n_components=dims).fit(a)
    return np.vstack([model.transform(a[s:s + chunk]) for s in range(0, len(a), chunk)])


CheapIdentityFeatures = IlluminationFeatures
"""The identity stage's first-pass features (:class:`deid.alignment.features.IlluminationFeatures`)."""


def resolve_identities(faces: pa.Table, *, policy: str = "merge", embeddings: np.ndarray | None = None,
                       cheap: np.ndarray | None = None, embed: Callable[[np.ndarray], np.ndarray] | None = None,
                       embed_budget: int = 2000) -> tuple[pa.Table, PeopleResolution, list[Quarantined]]:
    """Replace ``subject_id`` by the effective person (normalised ids, matching faces merged).

    Near-duplicate eigenface features always count; ``embeddings`` (dlib descriptors, one per
    row) add the recogniser's same-person matches, or ``cheap`` first-pass features with ``embed``
    (descriptors of the positions it flags, at most ``embed_budget``) at any size
    (:func:`deid.anonymise.identity.resolve_people`). ``policy="quarantine"`` withholds every
    record involved in a face match across ids instead of merging them.
    """
    if policy not in ("merge", "quarantine"):
        raise ConfigError(f"duplicate_ids={policy!r} must be 'merge' or 'quarantine'")
    # float32 as stored (resolve_people converts a bucket at a time) and one str per person (issue 13).
    X = _features(faces.column("features"), np.float32) if faces.num_rows else None
    res = resolve_people(shared_objects(_array(faces.column("subject_id"))).tolist(), X, embeddings=embeddings,
                         cheap=cheap, embed=embed, embed_budget=embed_budget)
    del X
    if res.face_merges:  # the report names a merge by its records' staging ids, never by subject id
        at = res.merged_positions()
        res = res.named(dict(zip(at, _array(faces.column("record_id")).take(pa.array(at, pa.int64())).to_pylist())))
    people = pa.array(list(res.person), pa.string())
    faces = faces.set_column(faces.schema.get_field_index("subject_id"), "subject_id", people)
    quarantined: list[Quarantined] = []
    if policy == "quarantine" and res.flagged_records:
        ids = faces.column("record_id").to_pylist()
        quarantined = [Quarantined(ids[i], "", "same_face_other_id",
                                   "the face matches a record under another subject id", "identity")
                       for i in res.flagged_records]
        keep = np.ones(faces.num_rows, dtype=bool)
        keep[list(res.flagged_records)] = False
        faces = faces.filter(pa.array(keep))
    return faces, res, quarantined


# --------------------------------------------------------------------------- release lineage (deid.release.lineage)


def plan_lineage(faces: pa.Table, sources: Mapping[str, str] | pa.Table, state, *, key: bytes, k: int, policy: str,
                 absent: str, labels: list[str], select: bool, merges: str = "withhold"):
    """The lineage plan over the resolved faces (``subject_id`` = effective person), in table order.

    ``sources`` maps record_id -> source_sha256: a mapping, or a table with those two columns (the
    ingested table's; looked up as columns, no dict of a million ids). A table that also has the
    manifest's ``subject_id`` keys the lineage by each record's normalised steward id, the resolved
    person being the overlay of this run's merges for the k rules (issue 27: a merge that holds in one
    run and not the next never re-keys a record); otherwise the resolved ``subject_id`` is both.
    Partitions are the label tuples when the method partitions by labels (k-Same-Select), else none.
    """
    from deid.release.lineage import plan_release  # noqa: PLC0415 - crypto imports only where needed

    n = faces.num_rows
    ids = _array(faces.column("record_id"))
    stewards: list | None = None
    if isinstance(sources, pa.Table):
        at = positions_in(ids, sources.column("record_id"))  # as the mapping's lookup: every face has its source
        fingerprints = _array(sources.column("source_sha256")).take(at).to_pylist()
        if "subject_id" in sources.column_names and n:
            raw = shared_objects(_array(sources.column("subject_id")).take(at)).tolist()
            normal = {s: normalize_subject_id(s) for s in dict.fromkeys(raw)}  # one str per distinct id
            stewards = [normal[s] for s in raw]
    else:
        fingerprints = [sources[r] for r in ids.to_pylist()]
    # Every record's labels: new clusters register them, so their later counterfeits reproduce the label mix.
    # One tuple (and one str per value) per distinct combination, shared by its records (issue 13).
    record_labels = _label_tuples(faces, labels)
    parts = record_labels if select and labels else None
    people = shared_objects(_array(faces.column("subject_id"))).tolist() if n else []
    persons = None
    if stewards is None:
        stewards = people        # no manifest ids given: the resolved ids are the keys, no overlay
    else:
        persons = people
    return plan_release(state, stewards, fingerprints, key=key, k=k, policy=policy, absent=absent, partitions=parts,
                        record_labels=record_labels, label_names=labels, persons=persons, merges=merges)


def label_combinations(faces: pa.Table, labels: Sequence[str]) -> tuple[list[tuple], np.ndarray]:
    """The distinct combinations of the ``labels`` columns' values (a null is None), and each row's index
    into them: per-record label rows can then share one object per combination (issue 13)."""
    codes = np.zeros(faces.num_rows, np.int64)
    values = []
    for x in labels:
        enc = _array(faces.column(x)).dictionary_encode()
        vals = [*enc.dictionary.to_pylist(), None]
        idx = enc.indices.fill_null(len(vals) - 1).to_numpy(zero_copy_only=False).astype(np.int64)
        codes = codes * len(vals) + idx
        values.append(vals)
    uniq, inverse = np.unique(codes, return_inverse=True)
    combos = []
    for c in uniq.tolist():
        key = []
        for vals in reversed(values):
            c, i = divmod(c, len(vals))
            key.append(vals[i])
        combos.append(tuple(reversed(key)))
    return combos, inverse.ravel()


def _label_tuples(faces: pa.Table, labels: list[str]) -> list[tuple[str, ...]]:
    """Each row's label values as a tuple of str (``str(value)``; a null is ``"None"``), one tuple object per
    distinct combination."""
    if not labels:
        return [()] * faces.num_rows
    combos, inverse = label_combinations(faces, labels)
    shared = [tuple(str(v) for v in c) for c in combos]
    return [shared[i] for i in inverse.tolist()]


def lineage_new_labels(plan, record_ids: list[str], deid_paths: list[str],
                       column: str = "pixels") -> tuple[np.ndarray, IndexedRows]:
    """(cluster index, released uint8 image) of each of ``plan.new_records`` from the de-identified parts.

    A new record the partition stage withheld (not in any part) gets cluster -1 and a zero image.
    The images are an :class:`IndexedRows`: each cluster's image once, not one copy per record
    (the parts are streamed a batch at a time; issue 13). ``column="color"``: the colour averages of a
    colour release (DEID_COLOR), numbered the same way.
    """
    import pyarrow.compute as pc  # noqa: PLC0415

    n_new = len(plan.new_records)
    # Each cluster's image once, on disk next to the de-identified parts (200,000 clusters of a million
    # faces are 1.5 GB): the registered clusters read it when asked (issue 13).
    spill = Path(deid_paths[0]).parent / f".lineage-new-{'colors' if column == 'color' else 'images'}.u8" \
        if deid_paths else None
    keys, images = distinct_rows(deid_paths, column, spill=spill)
    # Records matched to new records and clusters numbered as arrays (Arrow), not Python strings per record.
    new_ids = pa.array([record_ids[i] for i in plan.new_records], pa.string())
    j = pc.index_in(keys.column("record_id"), value_set=new_ids).to_numpy(zero_copy_only=False)
    found = ~np.isnan(j) if j.dtype.kind == "f" else np.ones(len(j), bool)
    j = np.where(found, j, -1).astype(np.int64)
    code = pc.dictionary_encode(keys.column("cluster").combine_chunks()).indices.to_numpy(zero_copy_only=False)
    hit = np.flatnonzero(j >= 0)
    cluster = np.full(n_new, -1, dtype=np.int64)
    row = np.full(n_new, -1, dtype=np.int64)
    cluster[j[hit]] = code[hit]
    row[j[hit]] = keys.column("row").to_numpy()[hit]
    labels_ = np.full(n_new, -1, dtype=np.intp)
    given = np.flatnonzero(cluster >= 0)
    if len(given):  # numbered in record order, as before: by each cluster's first new record
        uniq, first = np.unique(cluster[given], return_index=True)
        number = np.empty(int(uniq.max()) + 1, dtype=np.intp)
        number[uniq[np.argsort(first, kind="stable")]] = np.arange(len(uniq))
        labels_[given] = number[cluster[given]]
    p = images.shape[1] if len(keys) else 0
    n0 = images.table.shape[0]
    # A withheld record points past the table: one zero row held in memory.
    return labels_, IndexedRows(images.table, np.where(row >= 0, row, n0), extra=np.zeros((1, p), np.uint8))


def write_lineage_part(partition_dir: str, out_path: str, release, state, record_ids: list[str]) -> DeidentifiedPart:
    """The de-identified part of the returning people: each record carries its registered stored average.

    Written in the order of the ``partition=lineage`` dataset, like every de-identified part, so
    the gate pairs each record with its original. A colour release (``release.color``) adds each
    cluster's stored colour average (column ``color``, as :func:`deidentify_partition` writes it) beside
    its grey. Returns the cluster summary of :func:`deidentify_partition` (sizes count this drop's records,
    not counterfeits).
    """
    where = {record_ids[i]: key for i, key in enumerate(release.record_cluster) if key is not None}
    t = ds.dataset(partition_dir, format="parquet").to_table(columns=["record_id", "subject_id"])
    ids = t.column("record_id").to_pylist()
    people = t.column("subject_id").to_pylist()
    clusters = [where[r] for r in ids]
    # The part written a row group at a time, each registered image read once per row group, a registry
    # pack's at once (a stored average is read from the registry when asked: never every one at once, issue 13;
    # one read and decryption per cluster, not an open file per record's cluster, issue 32).
    from deid.release.lineage import stored_rows  # noqa: PLC0415

    color = bool(getattr(release, "color", False))
    schema = schemas.deidentified(color=color)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}.tmp")
    with pq.ParquetWriter(tmp, schema, **schemas.writer_options(schema.names)) as writer:
        for a in range(0, len(ids), _OUT_ROWS):
            cs = pa.array(clusters[a:a + _OUT_ROWS], pa.string()).dictionary_encode()
            keys = cs.dictionary.to_pylist()
            at = cs.indices.to_numpy()
            columns = [pa.array(ids[a:a + _OUT_ROWS], pa.string()), cs.dictionary_decode()]
            if color:  # the schema's order: colour, then its grey
                colours = stored_rows([state.clusters[c].released(True) for c in keys], slice(None))
                columns.append(_binary_rows(colours.astype(np.uint8, copy=False)[at]))
            table = stored_rows([state.clusters[c].image for c in keys], slice(None)).astype(np.uint8, copy=False)
            columns.append(_binary_rows(table[at]))
            writer.write_batch(pa.record_batch(columns, schema=schema))
    os.replace(tmp, out)
    # Each cluster's size and people from one pass (a pass per cluster was quadratic in the drop).
    members: dict[str, list] = defaultdict(list)
    for person, c in zip(people, clusters):
        members[c].append(person)
    summary = [ClusterInfo(cluster=c, size=len(members[c]), people=len(set(members[c]))) for c in sorted(members)]
    return DeidentifiedPart(path=out_path, records=len(ids), clusters=tuple(summary))


def counterfeit_rows(release, state, labels: list[str], present: Mapping[str, Sequence[Mapping[str, str]]],
                     fallback: Mapping[str, str]) -> list[CounterfeitRow]:
    """The counterfeit records of the republished clusters: stored average and utility labels, no source.

    Labels are the registered labels of the cluster's absent members
    (:meth:`~deid.release.lineage.LineageRelease.republished_labels`). A cluster registered before the
    registry kept labels falls back to its partition (k-Same-Select), else a record of the cluster in
    this drop (``present``: cluster key -> label mappings), else the drop's most common values.
    """
    rows: list[CounterfeitRow] = []
    registered = release.republished_labels(state, labels)
    color = bool(getattr(release, "color", False))
    for r in release.republished:
        c = state.clusters[r.key]
        # Read once per cluster; a colour release publishes the stored colour average.
        average = np.ascontiguousarray(c.released(color)) if r.n_counterfeit else None
        for n in range(r.n_counterfeit):
            if registered.get(r.key) is not None:
                lab = dict(zip(labels, registered[r.key].counterfeits[n]))
            elif labels and len(c.partition) == len(labels):
                lab = dict(zip(labels, c.partition))
            elif present.get(r.key):
                lab = dict(present[r.key][n % len(present[r.key])])
            else:
                lab = dict(fallback)
            # The stored average as registered: uint8 pixels, or a feature drop's float vector.
            rows.append(CounterfeitRow(record_id=f"{COUNTERFEIT_PREFIX}{len(rows):06d}", cluster=r.key,
                                       average=average, labels=lab))
    return rows


def lineage_release_rows(rows: ReleaseRows, lineage, labels: Sequence[str],
                         fallback: Callable[[], Mapping[str, str]], *, logger=None) -> ReleaseRows:
    """The would-be release's rows as the lineage makes them (image and feature drops alike).

    Returning records carry their registered labels (the cluster's released label mix stays the
    registered one, :func:`registered_row_labels`); the counterfeits of republished clusters follow
    (:func:`counterfeit_rows`; ``fallback()`` gives the drop's most common label values).
    """
    if lineage is None:
        return rows
    labels = list(labels)
    if lineage.release.republished:
        rows = registered_row_labels(lineage.release, lineage.state, list(lineage.record_ids), labels, rows)
    if not lineage.release.counts["counterfeit_records"]:
        return rows
    present: dict[str, list[dict[str, str]]] = {}
    for c, lab in zip(rows.clusters, rows.label_rows(labels)):
        present.setdefault(c, []).append(dict(zip(labels, lab)))
    fakes = counterfeit_rows(lineage.release, lineage.state, labels, present, fallback())
    (logger or log).info(f"stage: {len(fakes)} counterfeit records of republished clusters")
    return rows.with_counterfeits(fakes)


def lineage_row_keys(release, record_ids: list[str], rows: ReleaseRows) -> list[str | None]:
    """The lineage cluster key of every row of the would-be release (None: no key).

    A drop record's key is the one the release gives it; a counterfeit row's cluster is its key.
    """
    where = {r: i for i, r in enumerate(record_ids)}
    republished = {r.key for r in release.republished}
    out: list[str | None] = []
    for rid, cluster in zip(rows.record_ids, rows.clusters):
        i = where.get(rid)
        out.append(release.record_cluster[i] if i is not None else cluster if cluster in republished else None)
    return out


def registered_row_labels(release, state, record_ids: list[str], labels: list[str], rows: ReleaseRows) -> ReleaseRows:
    """The rows with the drop records of republished clusters given their registered labels.

    So that each republished cluster's released labels are its registered label mix
    (:meth:`~deid.release.lineage.LineageRelease.republished_labels`); clusters registered without
    labels keep the drop's labels.
    """
    registered = release.republished_labels(state, labels)
    where = {r: i for i, r in enumerate(record_ids)}
    out = {x: list(v) for x, v in rows.labels.items()}
    for j, rid in enumerate(rows.record_ids):
        i = where.get(rid)
        got = registered.get(release.record_cluster[i]) if i is not None else None
        if got is not None:
            for x, v in zip(labels, got.records[i]):
                out[x][j] = v
    return replace(rows, labels={x: tuple(v) for x, v in out.items()})


def republished_for_gate(release, state):
    """The gate's view of the republished clusters (:class:`deid.evaluation.gate.Republished`).

    Per republished cluster: the person (pseudonym) of each registered basis record, under this run's
    merges (two steward ids it resolves to one person count once), its counterfeit rows and its stored image.
    """
    from deid.evaluation.gate import Republished  # noqa: PLC0415 (the gate's imports are not needed on workers)

    person = getattr(release, "person", lambda p: p)
    return Republished(
        members={r.key: tuple(sorted(person(p) for _, p in state.clusters[r.key].members)) for r in release.republished},
        counterfeits={r.key: int(r.n_counterfeit) for r in release.republished},
        images={r.key: state.clusters[r.key].image for r in release.republished})


def lineage_can_abandon(state, release_id: str) -> bool:
    """Whether a pending release may be marked abandoned: no release registered after it.

    A later release was planned with this one's clusters as registered (pending constrains) and
    may republish them; abandoning it would drop clusters that release refers to. It stays
    pending then, which only ever constrains more.
    """
    seen = False
    for doc in state.entries:
        if doc.get("kind") == "release":
            if seen:
                return False
            seen = doc.get("release_id") == release_id
    return True
