"""Worker functions of the gate stage: the per-record facts the gate needs, streamed from the partitions and
the de-identified parts (:func:`gate_records`), pixels fetched only for the attacked sample.

Each worker function is idempotent (it writes to a temporary file and renames it into place), so a task
re-run after a lost worker produces the same output; it takes paths and small parameters, never large
arrays, so nothing big travels through the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from deid.contracts import LINEAGE_PARTITION
from deid.errors import StateError
from deid.evaluation.leaks import mean_abs_difference

from deid.operations.worker_lineage import lineage_partition_key
from deid.operations.worker_rows import STREAM_BUFFER, StringColumn, as_array, pixel_rows, shared_objects
from deid.release.hashing import image_digest


@dataclass(frozen=True)
class GateRecords:
    """The per-record facts the gate needs (:func:`gate_records`), as :class:`~deid.evaluation.gate_types.GateInputs` takes them."""

    record_ids: Sequence[str]  # a StringColumn (Arrow-backed) from gate_records
    people: np.ndarray
    clusters: np.ndarray
    partitions: np.ndarray
    labels: dict[str, np.ndarray]
    image_index: np.ndarray
    own_distance: np.ndarray
    fetch: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    points: list | None = None  # per record, its canonical landmarks (None: none) when asked for
    suspects: np.ndarray | None = None  # positions of the records named in gate_records' ``suspects``, in their order


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


def gate_records(partitions_root: str, deid_paths: list[str], *, labels: list[str], batch_rows: int = 4096,
                 select: bool = False, partition_keys: dict[tuple[str, ...], str] | None = None,
                 points: bool = False, skip: Sequence[str] = (), suspects: Sequence[str] = ()) -> GateRecords:
    """Per-record facts the gate needs, streamed: memory holds metadata, never all pixels.

    Returns :class:`GateRecords` for :class:`deid.evaluation.gate_types.GateInputs`: ``record_ids``, ``people`` (the
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
    ``skip``: the records the de-identify stage suppressed as near copies (in no part). ``suspects``: record ids
    (identity resolution's near misses, :attr:`deid.contracts.Partitioned.identity_suspects`) whose positions
    ``suspects`` gives, in the order given (a record not released is left out).
    """
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
    lineage_key = lineage_partition_key(Path(partitions_root), labels, select, partition_keys)
    skip = frozenset(skip)
    for pdir, dpath in pairs:
        key = Path(pdir).name.split("=", 1)[-1]
        # The returning people's partition of a lineage holds no points: its records are not re-made.
        with_points = points and "points" in ds.dataset(pdir, format="parquet").schema.names
        for o, r in _paired_batches(pdir, dpath, ["record_id", "subject_id", "pixels", *labels,
                                                  *(["points"] if with_points else [])], batch_rows, skip):
            ids.append(as_array(r.column("record_id")))
            people.append(as_array(o.column("subject_id")))
            clusters.append(as_array(r.column("cluster")))
            if key == LINEAGE_PARTITION:
                cols = [o.column(x).to_pylist() for x in labels]
                partitions.append(pa.array([lineage_key(tuple(str(c[j]) for c in cols)) for j in range(r.num_rows)],
                                           pa.string()))
            else:
                partitions.append(pa.array([key] * r.num_rows, pa.string()))
            for x in labels:
                label_values[x].append(as_array(o.column(x)))
            if record_points is not None:
                record_points += o.column("points").to_pylist() if with_points else [None] * r.num_rows
            a, b = pixel_rows(r.column("pixels")), pixel_rows(o.column("pixels"))
            image_index.append(np.fromiter(
                (digests.setdefault(image_digest(row), len(digests)) for row in a),
                dtype=np.int64, count=len(a)))
            own.append(mean_abs_difference(a, b))
    del digests
    ids_a = _concat(ids, pa.string())
    del ids

    fetch = _record_fetcher(pairs, ids_a, batch_rows, skip)
    return GateRecords(
        suspects=_positions(ids_a, suspects),
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


def _positions(ids: pa.Array, wanted: Sequence[str]) -> np.ndarray | None:
    """The positions in ``ids`` of the ``wanted`` record ids, in ``wanted``'s order (absent ones left out);
    None when nothing is wanted."""
    if not wanted:
        return None
    at = pc.index_in(pa.array(list(wanted), pa.string()), value_set=ids).drop_null()  # null: not released
    return at.to_numpy(zero_copy_only=False).astype(np.int64)


def _record_fetcher(pairs: list[tuple[str, str]], ids_a: pa.Array, batch_rows: int,
                    skip: frozenset[str]) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """:attr:`GateRecords.fetch`: ``fetch(idx) -> (released, originals)`` pixel rows of the records at ``idx``
    (positions in ``ids_a``), read by streaming the (partition, de-identified part) ``pairs`` again; the last
    sample asked for is kept (the gate asks for the same records several times in a row)."""
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
                rel_parts.append(pixel_rows(r.column("pixels").filter(mask)))
                orig_parts.append(pixel_rows(o.column("pixels").filter(mask)))
        if not len(idx):
            out = (np.zeros((0, 0), np.uint8), np.zeros((0, 0), np.uint8))
        else:
            where = {rid: n for n, rid in enumerate(got_ids)}
            order = np.asarray([where[rid] for rid in wanted], dtype=np.int64)
            out = (np.concatenate(rel_parts)[order], np.concatenate(orig_parts)[order])
        memo.clear()  # keep one sample: the gate asks for the same records several times in a row
        memo[key] = out
        return out

    return fetch


def _concat(arrays: list[pa.Array], type_: pa.DataType) -> pa.Array:
    return pa.chunked_array(arrays, type=type_).combine_chunks() if arrays else pa.array([], type_)
