"""The featurize and partition stages: eigenfaces fitted and every face projected, who is who resolved
(identity first pass, face descriptors), the lineage planned, and the faces split by utility labels into
Hive-partitioned Parquet with their pixels streamed from the aligned parts.

One function per stage, with the contract :mod:`deid.operations` describes.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from deid.progress import Progress
from deid.evaluation.checks import Check
from deid.contracts import (
    LINEAGE_PARTITION,
    Aligned,
    Featurized,
    Ingested,
    LineagePlanned,
    MethodInputs,
    PartitionInfo,
    Partitioned,
    SmallPartition,
    StagingLayout,
)
from deid.errors import StateError
from deid.heap import release_free_memory
from deid.anonymise.sequences import sequence_warning
from deid.intake.drop import SEQUENCE_COLUMNS
from deid.schemas import arrow as schemas
from deid.operations.executors import Executor
from deid.run_config import RunConfig

from deid.operations import worker_featurize, worker_lineage, worker_partition, worker_rows
from deid.operations.person_search import search_people
from deid.operations.run_setup import Logger, linkage_key

log = logging.getLogger(__name__)


def featurize(aligned: Aligned, layout: StagingLayout, config: RunConfig, executor: Executor, *,
              logger: Logger | None = None) -> Featurized:
    """Fit eigenfaces on the aligned set, then project every part (the model is shared with the workers once).

    Above ``identity_embed_max`` faces the same reading of each part also computes the identity first
    pass's features (:func:`identity_first_pass`): the pixels are read once, on the workers, instead of
    a second pass over every part in this process.
    """
    lg = logger or log
    (model,) = executor.map(worker_featurize.fit_eigenfaces, [dict(
        aligned_paths=[str(p) for p in aligned.parts], n_components=config.pca_components, seed=config.seed)])
    lg.info(f"featurize: {model.n_components_} eigenfaces, "
        f"{100 * float(np.sum(model.explained_variance_ratio_)):.1f}% of variance")
    shared = executor.share(model)
    outs = tuple(layout.feature_part(p) for p in aligned.parts)
    counts = [pq.ParquetFile(p).metadata.num_rows for p in aligned.parts]
    identity = None
    if sum(counts) > config.identity_embed_max > 0:
        first = next(p for p, n in zip(aligned.parts, counts) if n)
        (identity,) = executor.map(worker_featurize.fit_identity_features, [dict(aligned_path=str(first),
                                                                        shape=tuple(config.shape_hw))])
    shared_identity = executor.share(identity) if identity is not None else None
    progress = Progress("featurize: projecting", logger=lg).start(sum(counts))
    n = sum(executor.map(worker_featurize.project_part, [dict(aligned_path=str(p), model=shared, out_path=str(o),
                                                    identity=shared_identity)
                                                for p, o in zip(aligned.parts, outs)], on_done=progress.advance))
    progress.finish()
    lg.info(f"featurize: {n} faces projected" + (" (and their identity first pass's features)" if identity else ""))
    return Featurized(parts=outs, n_components=int(model.n_components_),
                      identity_dims=int(identity.n_components) if identity is not None else 0)


# --------------------------------------------------------------------------- partition -> de-identify


def load_faces(metadata: pa.Table, aligned: Aligned, featurized: Featurized, labels: Sequence[str], *,
               pixels: bool = True, yaw: bool = False) -> pa.Table:
    """One row per aligned face: record and subject ids, labels, pixels and eigenface features.

    ``pixels=False`` leaves the pixels out (:func:`write_with_pixels` attaches them while writing,
    one aligned part at a time: a million faces' pixels are 7.5 GB).

    A drop with landmarks adds ``points`` (canonical pixels, as alignment moved them: k-same-m's
    shape), one with image sequences ``sequence`` and ``frame`` (multi-factor's one identity per
    person; the release's videos): the de-identify stage reads them from the partitions. ``yaw`` adds
    each face's estimated head yaw when the aligned parts carry it (``DEID_POSE_GROUPING_DEGREES``: k-Same
    groups by pose too, :mod:`deid.anonymise.ksame_pose`); otherwise the partitions stay as they were.
    """
    seq = [c for c in SEQUENCE_COLUMNS if c in metadata.column_names]
    meta = metadata.select(["record_id", "subject_id", *labels, *seq])
    names = pq.read_schema(aligned.parts[0]).names if aligned.parts else []
    pix_cols = ["pixels"] if pixels else []
    yaw_cols = ["yaw"] if yaw and "yaw" in names else []
    pix = pa.concat_tables([pq.read_table(p, columns=["record_id", *pix_cols, *yaw_cols,
                                                       *(["points"] if "points" in names else [])])
                            for p in aligned.parts])
    # Sorted before the list columns join: they are then placed once, straight into record order (a
    # sort after would copy the features again; issue 13).
    faces = meta.join(pix.select(["record_id", *yaw_cols, *pix_cols]), "record_id",
                      join_type="inner").sort_by("record_id")
    faces = faces.append_column("features", _features_in_order(faces.column("record_id"), featurized.parts))
    if "points" in names:  # Arrow joins cannot carry list columns: attached by position
        take = worker_rows.positions_in(faces.column("record_id"), pix.column("record_id"))
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
    at = worker_rows.positions_in(ids, pa.chunked_array([c for a in part_ids for c in a.chunks], pa.string())).to_numpy()
    del part_ids
    n = len(ids)
    dest = np.full(sum(sizes), -1, np.int64)  # each part row's place in the result (-1: not asked for)
    dest[at] = np.arange(n)
    out, start = None, 0
    for path, m in zip(parts, sizes):
        col = worker_rows.as_array(pq.read_table(path, columns=[column]).column(column))
        to, start = dest[start:start + m], start + m
        if not m:
            continue
        widths = pc.unique(pc.list_value_length(col)).to_pylist()
        if len(widths) > 1 or out is not None and widths[0] != out.shape[1]:
            raise StateError(f"feature part {path} holds rows of different lengths ({sorted(widths)[:5]}); "
                             "re-run featurize")
        X = worker_rows.feature_rows(col, field.type.value_type.to_pandas_dtype())
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
    E = np.vstack(executor.map(worker_partition.embed_faces, [dict(pixels=distinct[a:b], shape=tuple(shape_hw))
                                                    for a, b in zip(bounds[:-1], bounds[1:]) if b > a],
                               on_done=lambda e: progress.advance(len(e)), ahead=1))[of]
    progress.finish()
    DlibEmbedder(tuple(shape_hw)).prime(np.frombuffer(b"".join(pixels), np.uint8).reshape(len(pixels), -1), E)
    return E


def identity_first_pass(record_ids: pa.ChunkedArray, aligned: Aligned, featurized: Featurized,
                        shape_hw: tuple[int, int], executor: Executor, *, lg=log) -> dict:
    """The identity stage's cheap first pass over every face (self-quotient images), as featurize computed it.

    Returns ``cheap`` (:class:`~deid.operations.worker_featurize.CheapIdentityFeatures`, one row per record in the
    order of ``record_ids``, read from the feature parts' ``identity`` column: :func:`featurize`) and
    ``embed(positions)``: dlib descriptors of those records, their pixels read back from the aligned
    parts that hold them and embedded over the executor (:func:`embed_faces`).
    """
    if not featurized.identity_dims:
        raise StateError("the feature parts hold no identity first pass features (featurize computes them above "
                         "DEID_IDENTITY_EMBED_MAX faces); re-run the release")
    ids = worker_rows.as_array(record_ids)
    cheap = _rows_in_order(ids, featurized.parts, "identity")
    lg.info("partition: identity first pass features of %d faces read", len(ids))

    def embed(positions: np.ndarray) -> np.ndarray:
        want = ids.take(pa.array(np.asarray(positions, dtype=np.int64)))
        # Each wanted record's aligned part and row: only the parts holding one are read, whole (a
        # filtered dataset read cost ~40 ms a part, 1,954 parts at 1M faces).
        part_ids = [pq.read_table(p, columns=["record_id"]).column("record_id") for p in aligned.parts]
        ends = np.cumsum([len(a) for a in part_ids])
        where = worker_rows.positions_in(want, pa.chunked_array([c for a in part_ids for c in a.chunks], pa.string()))
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
    plan = worker_lineage.plan_lineage(faces, sources, state, key=linkage_key(config)[0], k=config.k,
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
    faces = load_faces(ingested.metadata, aligned, featurized, labels, pixels=False,
                       yaw=bool(config.pose_grouping_degrees))
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
    listed, record_ids = worker_rows.as_array(faces.column("subject_id")), worker_rows.as_array(faces.column("record_id"))
    faces, identity, dup_quarantined = worker_partition.resolve_identities(faces, policy=config.duplicate_ids,
                                                                 embeddings=embeddings, **first_pass,
                                                                 embed_budget=config.identity_embed_max)
    suspects = _identity_outcome(identity, record_ids, config.duplicate_ids, lg)
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
            column = pa.array([aliases.get(p, p) for p in worker_rows.as_array(faces.column("subject_id")).to_pylist()],
                              pa.string())
            faces = faces.set_column(faces.schema.get_field_index("subject_id"), "subject_id", column)
    del listed, record_ids
    planned, held_back = None, []
    if lineage_state is not None:
        faces, planned, held_back = _plan_lineage(faces, ingested.metadata, lineage_state, layout, config, labels,
                                                  lg=lg, aligned=aligned)
    plan = plan_partitions(_label_rows(faces, labels), list(shared_tuple(faces.column("subject_id"))),
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
                       lineage=planned, inputs=inputs, checks=checks, notes=notes, person_faces=person_faces,
                       identity_suspects=suspects)


def _identity_outcome(identity, record_ids: pa.Array, policy: str, lg: Logger) -> tuple[str, ...]:
    """Identity resolution's merges logged (``policy``: what was done with them), and its near misses
    (:attr:`deid.anonymise.identity.PeopleResolution.suspects`, positions) as staging record ids, closest first: the
    gate's within-cluster check looks at their clusters (issue 27)."""
    if identity.normalized_merges or identity.face_merges:
        lg.warning("partition: %d subject ids merged by normalisation, %d groups by matching faces (%s)",
                   identity.normalized_merges, len(identity.face_merges), policy)
    suspects = tuple(record_ids.take(pa.array(identity.suspects, pa.int64())).to_pylist())
    if suspects:
        lg.info("partition: %d faces within the same-person distance of another person, not merged: the gate's "
                "within-cluster check looks at their clusters", len(suspects))
    return suspects


def _label_rows(faces: pa.Table, labels: Sequence[str]) -> list[dict[str, str]]:
    """Each row's ``{label: value}``, one dict object per distinct combination of values (shared by its rows:
    8 bytes per record instead of a dict each; issue 13)."""
    if not labels:
        return [{}] * faces.num_rows
    combos, inverse = worker_partition.label_combinations(faces, labels)
    shared = [dict(zip(labels, c)) for c in combos]
    return [shared[i] for i in inverse.tolist()]


def method_inputs(faces: pa.Table) -> MethodInputs:
    """Counts of the records with landmark points and of the image sequences and their frames."""
    names = faces.column_names
    points = faces.num_rows - faces.column("points").null_count if "points" in names else 0
    keys = [q for q in faces.column("sequence").to_pylist() if q is not None] if "sequence" in names else []
    return MethodInputs(points=int(points), sequences=len(set(keys)), frames=len(keys))


def shared_tuple(column: pa.ChunkedArray) -> tuple:
    """``tuple(column.to_pylist())`` with one str object per distinct value (a cluster's or a label's
    records share it: 8 bytes per record instead of ~60; issue 13)."""
    return tuple(worker_rows.shared_objects(column.combine_chunks() if isinstance(column, pa.ChunkedArray)
                                       else column).tolist())
