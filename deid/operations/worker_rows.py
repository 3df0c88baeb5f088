"""Row helpers the Dask worker functions share: Arrow columns as NumPy rows, streamed Parquet reads,
atomic Parquet writes, and the on-disk row matrices (:class:`RowFile`, :class:`IndexedRows`).

Nothing here is a stage's work; the ``worker_*`` modules (one per stage they serve) build on these.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from deid.errors import StateError
from deid.release.hashing import image_digest
from deid.schemas import arrow as schemas



def write_atomic(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    pq.write_table(table, tmp, **schemas.writer_options(table.column_names))
    os.replace(tmp, path)


def read_pixels(paths: list[str], columns=("record_id", "pixels")) -> tuple[list[str], np.ndarray]:
    """Load aligned faces from Parquet parts as (record ids, uint8 matrix n x p)."""
    table = pa.concat_tables([pq.read_table(p, columns=list(columns)) for p in paths]) if paths else None
    if table is None or table.num_rows == 0:
        return [], np.zeros((0, 0), dtype=np.uint8)
    return table.column("record_id").to_pylist(), pixel_rows(table.column("pixels"))


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
                pix = pixel_rows(t.column("pixels"))
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
    seen: dict[tuple[str, bytes], int] = {}
    keys: list[pa.Table] = []
    held: list[np.ndarray] = []
    p = 0
    fh = open(spill, "wb") if spill is not None else None  # noqa: SIM115 - closed below
    try:
        for batch in stream_rows(list(parts), ["record_id", "cluster", column]):
            if not batch.num_rows:
                continue
            pix = pixel_rows(batch.column(column))
            p = pix.shape[1]
            clusters = batch.column("cluster").to_pylist()
            rows = np.empty(len(clusters), dtype=np.int64)
            for r, c in enumerate(clusters):
                key = (c, image_digest(pix[r]))
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
OUT_ROWS = 2048  # records per row group of the de-identified part


def stream_rows(files: list[str], columns: list[str], batch_rows: int = OUT_ROWS):
    """Record batches of ``files`` in order (the order the gate pairs the partition with its release).

    Decoded in this thread: Arrow's decoding threads each keep their own allocator heap, which
    releasing the pool from here does not empty (~27 MB left per process; issue 13).
    """
    for f in files:
        yield from pq.ParquetFile(f, buffer_size=STREAM_BUFFER, pre_buffer=False).iter_batches(
            batch_size=batch_rows, columns=columns, use_threads=False)


def binary_rows(rows: np.ndarray) -> pa.Array:
    """An (m, p) uint8 matrix as a binary column, without a Python bytes object per row."""
    m, p = rows.shape
    offsets = pa.py_buffer(np.arange(0, (m + 1) * p, p, dtype=np.int32).tobytes())
    return pa.Array.from_buffers(pa.binary(), m, [None, offsets, pa.py_buffer(np.ascontiguousarray(rows))])


STREAM_BUFFER = 1 << 20  # bytes read at a time from a Parquet column chunk when streaming


def feature_rows(column: pa.ChunkedArray | pa.Array, dtype=np.float32) -> np.ndarray:
    """A list column of equal-length feature rows as an (n, d) matrix, through Arrow's flat values.

    Not through ``to_pylist``: a million 50-d rows would be 50 M Python floats.
    """
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        return np.zeros((0, 0), dtype)
    return np.asarray(arr.flatten().to_numpy(zero_copy_only=False), dtype=dtype).reshape(len(arr), -1)


def pixel_rows(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
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


def as_array(column) -> pa.Array:
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def positions_in(ids: pa.ChunkedArray | pa.Array, among: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Each of ``ids``' row in ``among`` (one hash of ``among``); a KeyError names the first id ``among``
    lacks, as a dict lookup would."""
    at = pc.index_in(ids, value_set=as_array(among))
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
