"""Ingest: copy a drop's image bytes into a Parquet staging table, quarantining what cannot be used.

Only cheap checks happen here (readable, non-empty, a known format by content, a header that is
not a decompression bomb); decoding happens once, in alignment.
"""
from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from deid.drop import Drop, ManifestRow
from deid.errors import Quarantined
from deid.imaging import header_size, sniff_format
from schemas import arrow as schemas

log = logging.getLogger(__name__)


@dataclass
class IngestResult:
    """Where the staged table is, how many records it holds, and what was quarantined."""

    path: Path
    n_records: int
    quarantined: list[Quarantined]
    source_sha256: dict[str, str]  # record_id -> sha256 of the source bytes
    row_groups: int


def _check_bytes(data: bytes, *, max_pixels: int) -> tuple[str, str] | None:
    if not data:
        return "empty_file", "the file has zero bytes"
    fmt = sniff_format(data)
    if fmt is None:
        return "unsupported_format", f"not a supported image format (first bytes {data[:8].hex()})"
    size = header_size(data)
    if size is not None and size[0] * size[1] > max_pixels:
        return "image_too_large", (
            f"{size[0]}x{size[1]} = {size[0] * size[1]} pixels exceeds max_pixels={max_pixels}; "
            "raise DEID_MAX_PIXELS if the image is genuine"
        )
    return None


def ingest(drop: Drop, out_path: Path, *, max_pixels: int = 100_000_000, batch_size: int = 64) -> IngestResult:
    """Stream the drop's usable rows into ``out_path`` (Parquet, one row group per batch).

    Records whose identical bytes appear under two different subject ids are both quarantined
    (``duplicate_across_people``): the same photo credited to two people would break the
    per-person count behind the k guarantee.
    """
    out_path.parent.mkdir(parents=True, exist_ok=True)
    schema = schemas.ingested(drop.labels)
    quarantined: list[Quarantined] = []
    hashes: dict[str, str] = {}
    by_hash: dict[str, set[str]] = defaultdict(set)
    kept: list[tuple[ManifestRow, str, int]] = []

    # Pass 1: hash and check every file (streamed, one file in memory at a time).
    for row in drop.rows:
        try:
            data = row.path.read_bytes()
        except OSError as exc:
            quarantined.append(Quarantined(row.record_id, row.image, "unreadable_file", str(exc), "ingest"))
            continue
        problem = _check_bytes(data, max_pixels=max_pixels)
        if problem:
            quarantined.append(Quarantined(row.record_id, row.image, *problem, "ingest"))
            continue
        digest = hashlib.sha256(data).hexdigest()
        hashes[row.record_id] = digest
        by_hash[digest].add(row.subject_id)
        kept.append((row, digest, len(data)))

    clash = {h for h, people in by_hash.items() if len(people) > 1}
    final: list[tuple[ManifestRow, str, int]] = []
    for row, digest, size in kept:
        if digest in clash:
            others = sorted(by_hash[digest] - {row.subject_id})
            quarantined.append(
                Quarantined(row.record_id, row.image, "duplicate_across_people",
                            f"the same image bytes are also listed under subject(s) {others}", "ingest")
            )
        else:
            final.append((row, digest, size))

    # Pass 2: write the staged table in row groups of ``batch_size`` (the unit of align work).
    tmp = out_path.with_suffix(".parquet.tmp")
    n_groups = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, len(final), batch_size):
            chunk = final[start : start + batch_size]
            cols: dict[str, list] = defaultdict(list)
            for row, digest, size in chunk:
                cols["record_id"].append(row.record_id)
                cols["image"].append(row.image)
                cols["subject_id"].append(row.subject_id)
                for label in drop.labels:
                    cols[label].append(row.labels[label])
                eyes = row.eyes
                for name, val in zip(
                    ("eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y"),
                    (eyes[0][0], eyes[0][1], eyes[1][0], eyes[1][1]) if eyes else (None,) * 4,
                ):
                    cols[name].append(val)
                cols["source_sha256"].append(digest)
                cols["size"].append(size)
                cols["data"].append(row.path.read_bytes())
            writer.write_table(pa.table(dict(cols), schema=schema))
            n_groups += 1
    tmp.replace(out_path)
    log.info("ingested %d records (%d quarantined) into %s", len(final), len(quarantined), out_path)
    return IngestResult(out_path, len(final), quarantined, hashes, n_groups)


def write_quarantine(records: list[Quarantined], path: Path) -> Path:
    """Write the quarantine table (record id, image, reason code, message, stage)."""
    table = pa.table(
        {
            "record_id": [q.record_id for q in records],
            "image": [q.image for q in records],
            "code": [q.code for q in records],
            "message": [q.message for q in records],
            "stage": [q.stage for q in records],
        },
        schema=schemas.QUARANTINE,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path
