"""Building and atomically publishing a release directory.

A release holds only de-identified images (PNG written from pixel arrays, so no source bytes
or metadata), the utility labels and random cluster ids, in a random order with fresh random
record ids. It follows the Hugging Face ``imagefolder`` layout, so consumers load it with
``datasets.load_dataset("imagefolder", data_dir=...)`` or pandas as it is: ``images/*.png``,
``metadata.csv`` (``file_name`` + ``record_id``, ``cluster_id``, the labels), ``release.parquet``
and ``release.csv`` (the same table with the column ``image``) and a dataset card ``README.md``
(:mod:`deid.release.card`, written once the gate's figures exist, before the release is hashed and signed). It is written to a directory inside the run's private staging directory and renamed into place only when the gate
has passed, so a reader never sees half a release and a rejected run leaves nothing behind.
"""
from __future__ import annotations

import csv
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.errors import ConfigError, StateError
from deid.operations.safety import fault_enospc
from deid.schemas import arrow as schemas

RELEASE_TABLE = "release.parquet"
RELEASE_CSV = "release.csv"
# The Hugging Face imagefolder metadata file: ``file_name`` is the image path relative to it.
METADATA_CSV = "metadata.csv"
# Columns every release table has; a utility label may not take one of these names.
_RESERVED = ("record_id", "image", "cluster_id", "file_name")


# Spreadsheets execute a cell starting with one of these as a formula (CSV formula injection).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(value):
    """A CSV cell that no spreadsheet runs as a formula: text starting with = + - @ TAB or CR gets a leading '.

    Only the CSV files (``release.csv``, ``metadata.csv``) are neutralised (the OWASP
    recommendation); ``release.parquet`` keeps the exact label values, which a typed reader never evaluates.
    """
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def new_release_id() -> str:
    """A fresh, unguessable release id (the run's time is in the report, not in the id)."""
    return "rel-" + secrets.token_hex(8)


@dataclass
class StagedRelease:
    path: Path
    columns: list[str]
    n_records: int
    # Private: staging record_id / internal cluster -> what was released. Never written into the release;
    # the flow encrypts it into the linkage record (deid.release.linkage).
    mapping: list[dict] = field(default_factory=list)


def stage_release(tmp_dir: Path, *, images: np.ndarray, shape: tuple[int, ...], clusters: list[str],
                  labels: dict[str, list[str]], record_ids: list[str] | None = None) -> StagedRelease:
    """Write a release into ``tmp_dir`` (which must not exist yet).

    Parameters
    ----------
    images : (n, h*w) uint8 de-identified grey faces, or (n, h*w*3) BGR colour faces.
    shape : (height, width) of each face, or (height, width, 3) for colour.
    clusters : internal cluster names; they are re-mapped to fresh random ids here.
    labels : label name -> per-record values.
    record_ids : staging record ids, parallel to ``images``; when given, ``StagedRelease.mapping``
        lists ``{record_id, released_record_id, image, cluster, cluster_id}`` per released record
        (for the private linkage record; nothing of it goes into the release).
    """
    if record_ids is not None and len(record_ids) != len(images):
        raise ValueError(f"record_ids has {len(record_ids)} entries but images has {len(images)}; pass one id per image")
    clash = sorted(set(labels) & set(_RESERVED))
    if clash:
        raise ConfigError(f"labels {clash} clash with the release columns {list(_RESERVED)}; rename those label "
                          "columns in the manifest")
    tmp_dir.mkdir(parents=True)
    (tmp_dir / "images").mkdir()
    n = len(images)
    order = list(range(n))
    secrets.SystemRandom().shuffle(order)  # the release order must not follow the input
    cluster_ids = {c: "c-" + secrets.token_hex(6) for c in sorted(set(clusters))}
    rows = []
    mapping = []
    for i in order:
        rid = secrets.token_hex(8)
        name = f"images/{rid}.png"
        ok, buf = cv2.imencode(".png", images[i].reshape(shape))
        if not ok:
            raise RuntimeError(f"PNG encoding failed for a {shape} image")
        fault_enospc("stage", tmp_dir / name)
        (tmp_dir / name).write_bytes(buf.tobytes())
        rows.append({"record_id": rid, "image": name, "cluster_id": cluster_ids[clusters[i]],
                     **{k: v[i] for k, v in labels.items()}})
        if record_ids is not None:
            mapping.append({"record_id": record_ids[i], "released_record_id": rid, "image": name,
                            "cluster": clusters[i], "cluster_id": cluster_ids[clusters[i]]})
    schema = schemas.release(list(labels))
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, tmp_dir / RELEASE_TABLE)
    _write_csv(tmp_dir / RELEASE_CSV, schema.names, rows)
    # imagefolder: file_name first, relative to metadata.csv; the same columns otherwise.
    _write_csv(tmp_dir / METADATA_CSV, ["file_name", *(c for c in schema.names if c != "image")],
               [{"file_name": r["image"], **r} for r in rows], drop=("image",))
    return StagedRelease(tmp_dir, schema.names, n, mapping)


def _write_csv(path: Path, fieldnames: list[str], rows: list[dict], *, drop: tuple[str, ...] = ()) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows({k: csv_safe(v) for k, v in row.items() if k not in drop} for row in rows)


def commit_release(staged: Path, final: Path) -> Path:
    """Atomically move a staged release to its final name (a fresh name: never overwrite).

    ``staged`` lives in the run's staging directory on the same filesystem as ``final`` (checked
    before the run), so this one ``rename`` is the publication: readers see all or nothing.
    """
    if final.exists():
        raise StateError(f"release directory {final} already exists; release ids must be fresh")
    final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(staged, final)
    return final


def unpublish(final: Path, staged: Path) -> None:
    """Move a just-published release back out (when what follows its rename fails)."""
    os.rename(final, staged)


def discard(staged: Path) -> None:
    shutil.rmtree(staged, ignore_errors=True)
