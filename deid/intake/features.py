"""Feature drops: a Parquet table of fixed-length feature vectors instead of images.

A *feature drop* is a directory whose ``drop.yaml`` says ``kind: features`` and names the
feature table, a Parquet file inside the drop::

    kind: features
    features: vectors.parquet        # the table (a relative path inside the drop)
    name: clinic-voices
    labels: [gender, accent]         # utility label columns of the table
    license: cc-by-4.0
    vector_column: features          # optional, default "features"
    dim: 192                         # optional: the dimension every vector must have

The table holds one row per record: ``subject_id`` (required), optionally ``record_id`` (the
steward's own id; it is never released), one column per utility label, and the vector column,
a list of numbers (``fixed_size_list<float32>[D]`` preferred; any list of floats or integers
is read). No ``manifest.csv`` is needed: the table *is* the manifest, with typed columns and
no second file to keep in step with it.

Problems with the drop as a whole (no table, not Parquet, a required column missing, a
vector column that is not a list of numbers) raise :class:`~deid.errors.DropError` with one
line naming the file, the column, the value and the fix. Problems with one row quarantine
that row with a reason code (``missing_subject_id``, ``missing_label``, ``missing_record_id``,
``duplicate_record_id``, ``missing_features``, ``wrong_length``, ``non_finite_features``, and
``undeclared_label`` for a label value outside drop.yaml's optional ``label_values``) and
never stop the run. The dimension is ``dim`` when declared, else the fixed list size, else the
most common length; vectors of any other length are ``wrong_length``.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from deid.errors import ConfigError, DataError, DropError, Quarantined, RecordError
from deid.intake.drop import DROP_YAML, _dataset_name, _attribution, _license, _read_yaml, record_id_for_row
from deid.intake.drop_files import read_drop_file, read_drop_text

log = logging.getLogger(__name__)

KINDS = ("images", "features")
DEFAULT_VECTOR_COLUMN = "features"
RESERVED = ("record_id", "subject_id")
# Staging table of an ingested feature drop (private): staging id, the steward's id, person, labels, vector.
INGESTED = "ingested_features.parquet"


@dataclass(frozen=True)
class FeatureDrop:
    """A parsed feature drop: the usable records (vectors as float32) and the quarantined rows.

    ``record_ids`` are staging ids (``r00000001`` = table row 1), ``source_ids`` the steward's
    ``record_id`` cells (or ``row N`` without that column); neither is ever released.
    """

    root: Path
    name: str
    labels: tuple[str, ...]
    dim: int
    features_file: str
    vector_column: str
    config_bytes: bytes
    table_sha256: str
    record_ids: tuple[str, ...]
    source_ids: tuple[str, ...]
    subject_ids: tuple[str, ...]
    label_values: dict[str, tuple[str, ...]]
    vectors: np.ndarray
    quarantined: tuple[Quarantined, ...]
    extra_columns: tuple[str, ...] = ()
    license: str | None = None
    attribution: dict[str, str] = field(default_factory=dict)  # drop.yaml's license_name, license_link, citation
    dataset: str = ""
    value_type: str = "float"
    label_sets: dict[str, tuple[str, ...]] | None = None  # drop.yaml's label_values: the values each label may take

    @property
    def records_in(self) -> int:
        return len(self.record_ids) + len(self.quarantined)

    @property
    def people(self) -> int:
        return len(set(self.subject_ids))

    def to_table(self) -> pa.Table:
        """The usable records as the staging table (vectors as ``fixed_size_list<float32>[dim]``)."""
        flat = pa.array(self.vectors.astype(np.float32, copy=False).reshape(-1), pa.float32())
        return pa.table({
            "record_id": pa.array(self.record_ids, pa.string()),
            "source_id": pa.array(self.source_ids, pa.string()),
            "subject_id": pa.array(self.subject_ids, pa.string()),
            **{x: pa.array(self.label_values[x], pa.string()) for x in self.labels},
            "features": pa.FixedSizeListArray.from_arrays(flat, self.dim),
        })


def drop_kind(drop_dir: str | os.PathLike) -> str:
    """``"features"`` when the drop's ``drop.yaml`` says ``kind: features``, else ``"images"``.

    Raises DropError for a ``kind`` that is neither, or an unreadable ``drop.yaml``.
    """
    root = Path(drop_dir)
    if not root.is_dir():
        raise DropError(f"drop directory {root} does not exist or is not a directory")
    kind = _read_yaml(root.resolve()).get("kind", "images")
    if kind not in KINDS:
        raise DropError(f"{root / DROP_YAML}: kind={kind!r} must be one of {list(KINDS)} ('features' for a "
                        "Parquet table of feature vectors, 'images' or no kind for faces)")
    return str(kind)


def run_kind(drop_dir: str | os.PathLike) -> str:
    """The kind a release runs the drop as: :func:`drop_kind`, or ``images`` when that cannot tell.

    A missing drop or an unreadable ``drop.yaml`` goes to the image ingest, which signs a
    rejection naming the problem.
    """
    try:
        return drop_kind(drop_dir)
    except DataError:
        return "images"


def _config(root: Path, meta: dict) -> tuple[str, str, int | None]:
    where = root / DROP_YAML
    table = meta.get("features")
    if not isinstance(table, str) or not table.strip():
        raise DropError(f"{where}: kind: features needs 'features: <table>.parquet', the feature table inside the "
                        f"drop; got features={table!r}")
    column = meta.get("vector_column", DEFAULT_VECTOR_COLUMN)
    if not isinstance(column, str) or not column.strip():
        raise DropError(f"{where}: vector_column={column!r} must be a column name, e.g. 'vector_column: embedding'")
    dim = meta.get("dim")
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 1_000_000):
        raise DropError(f"{where}: dim={dim!r} must be an integer between 1 and 1000000 (the length of every "
                        "feature vector), or left out to take it from the table")
    return table.strip(), column.strip(), dim


def _label_sets(root: Path, meta: dict, labels: list[str]) -> dict[str, tuple[str, ...]] | None:
    """drop.yaml's optional ``label_values`` (label -> list of values), for every declared label; None if absent."""
    declared = meta.get("label_values")
    if declared is None or not labels:
        return None
    if not isinstance(declared, dict) or any(not isinstance(declared.get(x), list) or not declared[x]
                                             for x in labels):
        raise DropError(f"{root / DROP_YAML}: label_values must map every label {labels} to the non-empty list of "
                        f"its values, e.g. 'label_values: {{gender: [f, m]}}'; got {declared!r:.120}")
    return {x: tuple(sorted({str(v).strip() for v in declared[x]})) for x in labels}


# Bytes per value of a Parquet physical type once decoded (a string: its offset and, counted apart, its bytes).
_PHYSICAL_BYTES = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8, "BYTE_ARRAY": 8}


def decoded_table_bytes(meta: pq.FileMetaData) -> int:
    """Bytes a Parquet table decodes to, from its metadata only: values x bytes per value over every column chunk.

    A string column counts an 8-byte offset per value plus its uncompressed pages; a fixed-length
    byte array its declared length per value.
    """
    total = 0
    schema = meta.schema
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            kind = col.physical_type
            if kind == "FIXED_LEN_BYTE_ARRAY":
                width = max(int(schema.column(c).length or 0), 1)
            else:
                width = _PHYSICAL_BYTES.get(kind, 8)
            total += int(col.num_values) * width
            if kind == "BYTE_ARRAY":
                total += int(col.total_uncompressed_size)
    return total


def _read_table(root: Path, relative: str, *, max_bytes: int) -> tuple[pa.Table, str]:
    """The feature table, read from its bytes (opened without following any symlink), and its sha256.

    Refused (DropError) before decoding when its metadata says it decodes to more than ``max_bytes``.
    """
    try:
        raw = read_drop_file(root, relative)
    except RecordError as exc:
        raise DropError(f"{root / DROP_YAML}: features={relative!r}: {exc.message}; put the feature table inside "
                        "the drop as a regular file") from None
    try:
        meta = pq.ParquetFile(pa.BufferReader(raw)).metadata
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DropError(f"{root / relative} is not a readable Parquet file ({str(exc).splitlines()[0][:200]}); "
                        "write the feature table with pyarrow.parquet.write_table or pandas.DataFrame.to_parquet") from None
    need = decoded_table_bytes(meta)
    if need > max_bytes:
        raise DropError(f"{root / relative}: the feature table ({len(raw):,} bytes on disk, {meta.num_rows:,} rows) "
                        f"decodes to {need:,} bytes, above DEID_FEATURE_MAX_BYTES={max_bytes:,} (rows x dim x bytes "
                        "per value, read from its metadata; nothing was decoded); split the drop, reduce dim, store "
                        "float32, or raise DEID_FEATURE_MAX_BYTES if this machine has the memory (a run holds "
                        "several copies of it)")
    try:
        table = pq.read_table(pa.BufferReader(raw))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DropError(f"{root / relative} is not a readable Parquet file ({str(exc).splitlines()[0][:200]}); "
                        "write the feature table with pyarrow.parquet.write_table or pandas.DataFrame.to_parquet") from None
    return table, hashlib.sha256(raw).hexdigest()


def _text_cells(column: pa.ChunkedArray) -> list[str | None]:
    """Cells as stripped text, None for null or empty (ids and labels may be strings or numbers)."""
    out = []
    for v in column.to_pylist():
        s = None if v is None else str(v).strip()
        out.append(s or None)
    return out


def _vector_column(path: Path, table: pa.Table, column: str) -> pa.Array:
    if column not in table.column_names:
        raise DropError(f"{path}: vector column {column!r} is missing (found {table.column_names}); name it in "
                        "drop.yaml as 'vector_column: <name>'")
    col = table.column(column).combine_chunks()
    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise DropError(f"{path}: column {column!r} has type {t}; it must be a list of numbers, one feature vector "
                        "per row (fixed_size_list<float32>[D], e.g. pa.FixedSizeListArray.from_arrays(values, D))")
    vt = t.value_type
    if not (pa.types.is_floating(vt) or pa.types.is_integer(vt)):
        raise DropError(f"{path}: column {column!r} is a list of {vt}; feature vectors must hold numbers "
                        "(float32 preferred)")
    return col


def _dimension(path: Path, col: pa.Array, lengths: np.ndarray, valid: np.ndarray, declared: int | None) -> int:
    fixed = col.type.list_size if pa.types.is_fixed_size_list(col.type) else None
    if declared is not None:
        if fixed is not None and fixed != declared:
            raise DropError(f"{path}: drop.yaml says dim={declared} but the vector column is a fixed-size list of "
                            f"{fixed}; fix dim or the table")
        return declared
    if fixed is not None:
        return int(fixed)
    seen = Counter(lengths[valid].tolist())
    if not seen:
        raise DropError(f"{path}: the vector column holds no vector (every row is null); write one feature vector "
                        "per record")
    # The most common length (ties: the longer); the other rows are quarantined as wrong_length.
    return int(max(seen, key=lambda n: (seen[n], n)))


def read_feature_drop(drop_dir: str | os.PathLike, *, labels: list[str] | None = None,
                      name: str | None = None, max_bytes: int | None = None) -> FeatureDrop:
    """Read and validate a feature drop; bad rows are quarantined with a reason, never dropped silently.

    Parameters
    ----------
    drop_dir : path
        The drop directory (``drop.yaml`` with ``kind: features`` and the feature table).
    labels : list of str, optional
        Utility label columns; overrides ``drop.yaml``'s ``labels``.
    name : str, optional
        Dataset name; overrides ``drop.yaml``'s ``name`` (default: the directory name).
    max_bytes : int, optional
        The most bytes the table may decode to, checked from its Parquet metadata before it is
        decoded (default: the setting ``DEID_FEATURE_MAX_BYTES``'s default).

    Returns
    -------
    FeatureDrop

    Raises
    ------
    DropError
        When the drop as a whole is unusable (see the module docstring).
    """
    root, config_bytes, meta = _feature_drop_yaml(drop_dir)
    relative, column, declared = _config(root, meta)
    path = root / relative
    if max_bytes is None:
        from deid.settings import FEATURE_MAX_BYTES as max_bytes  # noqa: PLC0415 - the setting's default, declared there
    table, sha = _read_table(root, relative, max_bytes=max_bytes)
    labels = _feature_labels(labels, meta, root)
    label_sets = _checked_columns(root, path, meta, table, labels, column)
    col = _vector_column(path, table, column)
    n = table.num_rows
    valid, lengths = _vector_lengths(col, n)
    dim = _dimension(path, col, lengths, valid, declared)

    subjects = _text_cells(table.column("subject_id"))
    label_cells = {x: _text_cells(table.column(x)) for x in labels}
    has_ids = "record_id" in table.column_names
    own_ids = _text_cells(table.column("record_id")) if has_ids else [f"row {i}" for i in range(1, n + 1)]
    vectors, null_elem, where = _readable_vectors(col, valid, lengths, dim)
    check = partial(_feature_row_problem, own_ids=own_ids, has_ids=has_ids, seen={}, subjects=subjects, labels=labels,
                    label_cells=label_cells, label_sets=label_sets, valid=valid, lengths=lengths, dim=dim,
                    column=column, where=where, null_elem=null_elem, vectors=vectors)
    keep_rows, quarantined = _sort_rows(n, own_ids, check)
    keep_vec = [where[i] for i in keep_rows]
    extra = tuple(c for c in table.column_names if c not in (*RESERVED, column, *labels))
    if extra:
        log.info("feature table columns not used and kept out of the release: %s", list(extra))
    if quarantined:
        log.info("feature drop %s: %d of %d rows quarantined", root.name, len(quarantined), n)
    drop_name = name or meta.get("name") or root.name
    return FeatureDrop(
        root=root, name=str(drop_name), labels=tuple(labels), dim=dim, features_file=relative, vector_column=column,
        config_bytes=config_bytes, table_sha256=sha,
        record_ids=tuple(record_id_for_row(i + 1) for i in keep_rows),
        source_ids=tuple(own_ids[i] for i in keep_rows),
        subject_ids=tuple(subjects[i] for i in keep_rows),
        label_values={x: tuple(label_cells[x][i] for i in keep_rows) for x in labels},
        vectors=vectors[keep_vec].astype(np.float32) if keep_vec else np.zeros((0, dim), np.float32),
        quarantined=tuple(quarantined), extra_columns=extra, license=_license(root, meta),
        attribution=_attribution(root, meta),
        dataset=_dataset_name(root, meta.get("dataset"), str(drop_name)),
        value_type=str(col.type.value_type), label_sets=label_sets)


def _checked_columns(root: Path, path: Path, meta: dict, table: pa.Table, labels: list[str],
                     column: str) -> dict[str, tuple[str, ...]] | None:
    """The feature table's columns checked against drop.yaml (the labels are neither the id, subject nor vector
    column; ``subject_id`` and every label column are present); returns drop.yaml's ``label_values``
    (:func:`_label_sets`).

    Raises
    ------
    DropError
        A label names a reserved column, or a required column is missing.
    """
    bad = [x for x in labels if x in (*RESERVED, column)]
    if bad:
        raise DropError(f"labels {bad} are the id, subject or vector columns; utility labels must be other columns")
    if "subject_id" not in table.column_names:
        raise DropError(f"{path}: required column 'subject_id' is missing (found {table.column_names}); add one "
                        "person id per record")
    label_sets = _label_sets(root, meta, labels)
    absent = [x for x in labels if x not in table.column_names]
    if absent:
        raise DropError(f"{path}: declared label column(s) {absent} are missing; found columns {table.column_names}")
    return label_sets


def _vector_lengths(col: pa.Array, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Whether each of the ``n`` rows holds a vector (not null), and its length (-1 for a null row)."""
    valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if pa.types.is_fixed_size_list(col.type):
        lengths = np.full(n, col.type.list_size, dtype=np.int64)
    else:
        lengths = pc.list_value_length(col).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return valid, lengths


def _sort_rows(n: int, own_ids: list, problem: Callable[[int, int], tuple[str, str] | None]
               ) -> tuple[list[int], list[Quarantined]]:
    """The ``n`` rows of a feature table sorted into records and quarantine, in row order.

    Parameters
    ----------
    n : int
        Rows in the table.
    own_ids : list
        The steward's record id of each row (None: none given), named in a quarantine entry.
    problem : callable
        ``problem(i, row) -> (code, message) | None``: why row ``i`` (``row``, its 1-based number) is quarantined
        (:func:`_feature_row_problem`, bound to the table).

    Returns
    -------
    keep : list of int
        The rows that are records.
    quarantined : list of Quarantined
    """
    quarantined: list[Quarantined] = []
    keep: list[int] = []
    for i in range(n):
        row = i + 1
        why = problem(i, row)
        if why is not None:
            quarantined.append(Quarantined(record_id_for_row(row), own_ids[i] or f"row {row}", *why, "features"))
        else:
            keep.append(i)
    return keep, quarantined


def _feature_drop_yaml(drop_dir: str | os.PathLike) -> tuple[Path, bytes, dict]:
    """A feature drop's resolved directory, its ``drop.yaml`` bytes and contents; a missing directory or
    ``drop.yaml``, or a drop of another kind, is a :class:`~deid.errors.DropError`."""
    root = Path(drop_dir)
    if not root.is_dir():
        raise DropError(f"drop directory {root} does not exist or is not a directory")
    root = root.resolve()
    config_bytes = read_drop_text(root, DROP_YAML)
    if config_bytes is None:
        raise DropError(f"{root} has no {DROP_YAML}; a feature drop needs one with 'kind: features' and "
                        "'features: <table>.parquet'")
    meta = _read_yaml(root)
    if meta.get("kind") != "features":
        raise DropError(f"{root / DROP_YAML}: kind={meta.get('kind')!r}; a feature drop needs 'kind: features'")
    return root, config_bytes, meta


def _feature_labels(labels: list[str] | None, meta: dict, root: Path) -> list[str]:
    """The feature drop's utility label columns: ``labels`` (the caller's), else ``drop.yaml``'s; a sensitive
    column (``drop.yaml``'s ``sensitive``) is never one, and stays out of the release."""
    if labels is None:
        labels = meta.get("labels")
        if isinstance(labels, str):
            labels = [s.strip() for s in labels.split(",") if s.strip()]
        elif labels is not None and not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)):
            raise DropError(f"{root / DROP_YAML}: 'labels' must be a list of column names, e.g. 'labels: [gender, "
                            f"accent]'; got a {type(labels).__name__} ({labels!r}); or pass --labels gender,accent")
    labels = [str(x) for x in labels or []]
    sensitive = meta.get("sensitive") or []
    sensitive = [s.strip() for s in sensitive.split(",")] if isinstance(sensitive, str) else list(sensitive)
    if set(map(str, sensitive)) & set(labels):
        raise ConfigError(f"{root / DROP_YAML}: sensitive column(s) {sorted(set(map(str, sensitive)) & set(labels))} "
                          "are also labels; a sensitive column is never a label: remove it from 'labels' or 'sensitive'")
    if sensitive:  # a feature release carries its labels only: a sensitive column stays out of it
        log.info("feature drop: sensitive column(s) %s are kept out of the release", sensitive)
    return labels


def _readable_vectors(col: pa.ChunkedArray, valid: np.ndarray, lengths: np.ndarray,
                      dim: int) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
    """The vectors of the rows that can be read (not null, ``dim`` long) as float64 rows, whether each holds a
    null element, and each such row's place among them."""
    # Which rows' vectors can be read: not null and of the right length; then null elements and non-finite values.
    right = valid & (lengths == dim)
    take = np.flatnonzero(right)
    vectors = np.zeros((len(take), dim), dtype=np.float64)
    null_elem = np.zeros(len(take), dtype=bool)
    if len(take):
        values = col.take(pa.array(take, pa.int64())).flatten()
        null_elem = ~np.asarray(values.is_valid().to_numpy(zero_copy_only=False), dtype=bool).reshape(len(take), dim).all(axis=1)
        vectors = values.cast(pa.float64()).to_numpy(zero_copy_only=False).reshape(len(take), dim)
    where = {int(r): j for j, r in enumerate(take)}
    return vectors, null_elem, where


def _feature_row_problem(i: int, row: int, *, own_ids: list, has_ids: bool, seen: dict[str, int], subjects: list,
                         labels: list[str], label_cells: dict[str, list], label_sets: dict | None, valid: np.ndarray,
                         lengths: np.ndarray, dim: int, column: str, where: dict[int, int], null_elem: np.ndarray,
                         vectors: np.ndarray) -> tuple[str, str] | None:
    """Why row ``i`` (``row``: its 1-based number) of a feature table is quarantined, as (code, message); None:
    it is a record. ``seen`` (record id -> first row) is updated."""
    if has_ids and own_ids[i] is None:
        return ("missing_record_id", f"row {row}: record_id is empty")
    if has_ids:
        if own_ids[i] in seen:
            return ("duplicate_record_id", f"row {row}: record_id {own_ids[i]!r} is listed again (first on row "
                                           f"{seen[own_ids[i]]})")
        seen[own_ids[i]] = row
    if subjects[i] is None:
        return ("missing_subject_id", f"row {row}: subject_id is empty")
    empty = [x for x in labels if label_cells[x][i] is None]
    if empty:
        return ("missing_label", f"row {row}: label(s) {empty} empty")
    if label_sets is not None:
        odd = [x for x in labels if label_cells[x][i] not in label_sets[x]]
        if odd:
            return ("undeclared_label", f"row {row}: label(s) {odd} hold a value drop.yaml's label_values does not "
                                        "declare; add it there or fix the row")
    if not valid[i]:
        return ("missing_features", f"row {row}: column {column!r} is null; give a vector of {dim} numbers")
    if lengths[i] != dim:
        return ("wrong_length", f"row {row}: column {column!r} holds {lengths[i]} values; every vector must have "
                                f"dim={dim}")
    j = where[i]
    if null_elem[j]:
        return ("missing_features", f"row {row}: column {column!r} holds null values; give {dim} numbers")
    if not np.isfinite(vectors[j]).all():
        bad_at = int(np.flatnonzero(~np.isfinite(vectors[j]))[0])
        return ("non_finite_features", f"row {row}: column {column!r} holds {vectors[j][bad_at]} at position "
                                       f"{bad_at}; every value must be finite")
    return None


def write_feature_drop(drop_dir: str | os.PathLike, *, vectors: Any, subject_ids: list[str],
                       labels: dict[str, list[str]] | None = None, record_ids: list[str] | None = None,
                       name: str | None = None, license: str | None = None, table: str = "vectors.parquet",
                       extra_yaml: dict | None = None) -> Path:
    """Write a feature drop (the table, then ``drop.yaml``, then ``_READY``); return its path.

    The producer side of :func:`read_feature_drop`, used by ``deid synth --kind features`` and
    the tests. ``vectors`` is (n, d); the table stores them as ``fixed_size_list<float32>[d]``.
    """
    import yaml  # noqa: PLC0415

    drop = Path(drop_dir)
    if drop.exists() and (not drop.is_dir() or any(drop.iterdir())):
        raise DropError(f"drop directory {drop} exists and is not empty; choose a new directory")
    v = np.asarray(vectors, dtype=np.float32)
    if v.ndim != 2 or len(v) != len(subject_ids):
        raise DropError(f"vectors has shape {v.shape} but there are {len(subject_ids)} subject ids; pass one "
                        "(n, d) vector per record")
    labels = dict(labels or {})
    cols: dict[str, Any] = {}
    if record_ids is not None:
        cols["record_id"] = pa.array(record_ids, pa.string())
    cols["subject_id"] = pa.array(subject_ids, pa.string())
    for x, values in labels.items():
        cols[x] = pa.array(values, pa.string())
    cols["features"] = pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1), pa.float32()), v.shape[1])
    drop.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), drop / table)
    meta = {"kind": "features", "features": table, "name": name or drop.name, "labels": list(labels),
            **({"license": license} if license else {}), **(extra_yaml or {})}
    (drop / DROP_YAML).write_text(yaml.safe_dump(meta, sort_keys=False), encoding="utf-8")
    (drop / "_READY").touch()  # last: consumers only pick up complete drops
    return drop
