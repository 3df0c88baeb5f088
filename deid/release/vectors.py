"""Building a feature release: de-identified vectors as Parquet, with the same invariants as image releases.

A feature release directory holds ``release.parquet`` (``record_id`` a fresh random id,
``cluster_id`` a random id of the record's cluster, the utility labels and ``features``, the
de-identified vector as ``fixed_size_list<float32>[D]``) in random order, ``metadata.csv``
(the same rows without the vectors, for a spreadsheet or a quick look) and, once the gate's
figures exist, the dataset card ``README.md``. No subject id, source id, source row or input
order leaves: the rows are shuffled with the OS's randomness and every id is drawn fresh.
It is staged inside the run's private staging directory and published by one rename
(:func:`deid.release.publish.commit_release`), exactly like an image release.
"""
from __future__ import annotations

import secrets
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.errors import ConfigError, DataError
from deid.faults import fault_enospc
from deid.release.publish import METADATA_CSV, RELEASE_TABLE, StagedRelease, _write_csv
from deid.schemas import arrow as schemas

_RESERVED = ("record_id", "cluster_id", "features")


def stage_vector_release(tmp_dir: Path, *, vectors: np.ndarray, clusters: list[str], labels: dict[str, list[str]],
                         record_ids: list[str] | None = None) -> StagedRelease:
    """Write a feature release into ``tmp_dir`` (which must not exist yet).

    Parameters
    ----------
    vectors : (n, d) de-identified feature vectors (stored as float32).
    clusters : internal cluster names, one per record; re-mapped to fresh random ids here.
    labels : label name -> per-record values.
    record_ids : staging record ids, parallel to ``vectors``; when given, ``StagedRelease.mapping``
        lists ``{record_id, released_record_id, image, cluster, cluster_id}`` per released record
        (``image`` is None: a vector has no file), for the private linkage record only.
    """
    v = np.asarray(vectors, dtype=np.float32)
    if v.ndim != 2 or v.shape[1] == 0:
        raise ConfigError(f"vectors has shape {v.shape}; pass the (n_records, n_features) de-identified vectors")
    n, d = v.shape
    if len(clusters) != n or (record_ids is not None and len(record_ids) != n):
        raise ConfigError(f"clusters ({len(clusters)}) and record_ids must have one entry per vector ({n})")
    clash = sorted(set(labels) & set(_RESERVED))
    if clash:
        raise DataError(f"labels {clash} clash with the release columns {list(_RESERVED)}; rename those label "
                          "columns in the feature table")
    tmp_dir.mkdir(parents=True)
    order = list(range(n))
    secrets.SystemRandom().shuffle(order)  # the release order must not follow the input
    cluster_ids = {c: "c-" + secrets.token_hex(6) for c in sorted(set(clusters))}
    rids = [secrets.token_hex(8) for _ in order]
    mapping = []
    if record_ids is not None:
        mapping = [{"record_id": record_ids[i], "released_record_id": rid, "image": None, "cluster": clusters[i],
                    "cluster_id": cluster_ids[clusters[i]]} for rid, i in zip(rids, order)]
    schema = schemas.feature_release(list(labels), d)
    idx = np.asarray(order, dtype=np.int64)
    table = pa.table({
        "record_id": pa.array(rids, pa.string()),
        "cluster_id": pa.array([cluster_ids[clusters[i]] for i in order], pa.string()),
        **{x: pa.array([str(vals[i]) for i in order], pa.string()) for x, vals in labels.items()},
        "features": pa.FixedSizeListArray.from_arrays(pa.array(v[idx].reshape(-1), pa.float32()), d),
    }).cast(schema)
    fault_enospc("stage", tmp_dir / RELEASE_TABLE)
    pq.write_table(table, tmp_dir / RELEASE_TABLE)
    meta_cols = [c for c in schema.names if c != "features"]
    _write_csv(tmp_dir / METADATA_CSV, meta_cols, table.select(meta_cols).to_pylist())
    return StagedRelease(tmp_dir, schema.names, n, mapping)


def read_vector_release(release_dir: str | Path) -> tuple[pa.Table, np.ndarray]:
    """A published (or staged) feature release: its table without the vectors, and the vectors (n, d) float32."""
    table = pq.read_table(Path(release_dir) / RELEASE_TABLE)
    col = table.column("features").combine_chunks()
    d = col.type.list_size
    vectors = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), d)
    return table.drop_columns(["features"]), vectors
