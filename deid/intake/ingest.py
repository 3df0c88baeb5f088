"""Ingest: copy a drop's image bytes into a Parquet staging table, quarantining what cannot be used.

Only cheap checks happen here (readable, non-empty, a known format by content, a header that is
not a decompression bomb); decoding happens once, in alignment.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import closing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from deid.intake.drop import Drop
from deid.intake.drop_files import DropDirectories, open_drop_file, read_drop_file
from deid.errors import Quarantined, RecordError
from deid.intake.imaging import decoded_bytes, header_size, max_decoded_bytes, sniff_format
from deid.intake.video import (EyesFinder, StagedEyes, frame_record_id, is_video, segment_messages, staged_crop,
                               track_video, video_rate)
from deid.faults import fault_enospc
from deid.schemas import arrow as schemas

log = logging.getLogger(__name__)

# A video frame's staging columns: record_id, image, sequence, frame, face box in the staged crop (x, y, w, h).
# (record id, image, sequence, frame, face box, eyes: lx, ly, rx, ry, followed or None): deid.intake.video.StagedEyes
VideoFrame = tuple[str, str, str, int, tuple[float, float, float, float], tuple[float, ...] | None]


@dataclass(frozen=True, eq=False)
class SourceHashes(Mapping):
    """record_id -> sha256 (hex) of the source bytes of every record read, as two Arrow arrays.

    A read-only mapping; :meth:`values` is the hash column itself (a million records' hashes as
    a dict of Python strings would hold ~200 MB).
    """

    record_ids: pa.Array
    sha256: pa.Array

    def __len__(self) -> int:
        return len(self.record_ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self.record_ids.to_pylist())

    def __getitem__(self, record_id: str) -> str:
        at = pc.index(self.record_ids, record_id).as_py()
        if at < 0:
            raise KeyError(record_id)
        return self.sha256[at].as_py()

    def values(self) -> list[str]:  # type: ignore[override]
        return self.sha256.to_pylist()


@dataclass
class IngestResult:
    """Where the staged table is, how many records it holds, and what was quarantined."""

    path: Path
    n_records: int
    quarantined: list[Quarantined]
    source_sha256: SourceHashes  # record_id -> sha256 of the source bytes
    row_groups: int
    # Video rows expanded into frame records (deid.intake.video) and the frames they gave (staged or
    # quarantined): the run's records_in counts frames, not the rows that named the videos.
    video_rows: int = 0
    video_frames: int = 0
    sequence_fps: dict[str, float] = field(default_factory=dict)  # video row id -> frames per second taken


def _check_bytes(data: bytes, *, max_pixels: int) -> tuple[str, str] | None:
    if not data:
        return "empty_file", "the file has zero bytes"
    fmt = sniff_format(data)
    if fmt is None:
        return "unsupported_format", f"not a supported image format (first bytes {data[:8].hex()})"
    size = header_size(data, fmt=fmt)
    if size is not None and size[0] * size[1] > max_pixels:
        return "image_too_large", (
            f"{size[0]}x{size[1]} = {size[0] * size[1]} pixels exceeds max_pixels={max_pixels}; "
            "raise DEID_MAX_PIXELS if the image is genuine"
        )
    need, limit = decoded_bytes(data, fmt=fmt, size=size), max_decoded_bytes(max_pixels)
    if need is not None and need > limit:
        return "image_too_large", (
            f"decoding needs {need} bytes (width x height x channels x bytes per sample), above "
            f"{limit} (3 bytes per pixel of max_pixels={max_pixels}); raise DEID_MAX_PIXELS if the image is genuine"
        )
    return None


# Threads reading the drop's files ahead of the writer: opening, reading and hashing a file release the
# GIL, so readers overlap the files' I/O with each other and with the Parquet writes. A new drop is read
# from the disk, where several reads in flight pay; from the page cache the readers only contend for the
# GIL. bench/bench_ingest.py, 100k faces (7.9 KB JPEGs), quiet 2-core machine, wall seconds by readers:
# cold cache 1: 19.1, 2: 15.3, 3: 12.2, 4: 12.7-13.4, 8: 16.4; warm cache 1: 3.5-6.8, 3: 6.8-8.5
# (before the readers: 11.9 warm). The 1M run reads its drop from the disk (ingest: 311 s wall, ~190 s
# of it waiting for reads).
READ_THREADS = 3
VIDEO = "video"  # a row the reader leaves to the writer's thread (its frames are staged as they are tracked)

# One read file: (bytes, raw sha256) when usable, else (None, (reason code, message)).
_Read = tuple[bytes, bytes] | tuple[None, tuple[str, str]] | str


def _read_rows(drop: Drop, images: list[str], dirs: threading.local, opened: list[DropDirectories], *,
               max_pixels: int) -> list[_Read]:
    """Read, check and hash the drop files ``images`` (a reader thread's share, in order)."""
    mine = getattr(dirs, "cache", None)
    if mine is None:
        mine = dirs.cache = DropDirectories()
        opened.append(mine)
    out: list[_Read] = []
    for image in images:
        if drop.has_videos and is_video(image):
            out.append(VIDEO)
            continue
        try:
            # Opened relative to the drop, following no symlink, at the moment of reading.
            data = read_drop_file(drop.root, image, dirs=mine)
        except RecordError as exc:
            out.append((None, (exc.code, exc.message)))
            continue
        problem = _check_bytes(data, max_pixels=max_pixels)
        out.append((None, problem) if problem else (data, hashlib.sha256(data).digest()))
    return out


def _read_ahead(drop: Drop, manifest: pa.Table, *, max_pixels: int, batch_size: int,
                threads: int = READ_THREADS) -> Iterator[tuple[int, str, str, _Read]]:
    """(row, record_id, image, what was read) for every manifest row, in manifest order.

    ``threads`` threads read chunks of rows ahead of the caller; at most ``batch_size`` files are
    read and not yet taken (with the caller's batch: ``2 x batch_size`` files in memory at most).
    """
    chunk = max(1, batch_size // (2 * threads))
    window = max(1, batch_size // chunk)
    local, opened = threading.local(), []
    pending: deque = deque()
    rows = ((start + j, rid, image) for batch, start in _batches(manifest)
            for j, (rid, image) in enumerate(zip(batch.column(0).to_pylist(), batch.column(1).to_pylist())))
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="deid-ingest") as pool:
            def submit() -> bool:
                part = [r for _, r in zip(range(chunk), rows)]
                if part:
                    pending.append((part, pool.submit(_read_rows, drop, [r[2] for r in part], local, opened,
                                                      max_pixels=max_pixels)))
                return bool(part)

            while len(pending) < window and submit():
                pass
            while pending:
                part, future = pending.popleft()
                got = future.result()
                submit()
                for (row, rid, image), read in zip(part, got):
                    yield row, rid, image, read
    finally:
        for cache in opened:
            cache.close()


def _batches(manifest: pa.Table) -> Iterator[tuple[pa.RecordBatch, int]]:
    start = 0
    for batch in manifest.select(["record_id", "image"]).to_batches(max_chunksize=4096):
        yield batch, start
        start += batch.num_rows


def _batch_table(manifest: pa.Table, rows: list[int], digests: list[str], data: list[bytes],
                 schema: pa.Schema, frames: list[VideoFrame | None] | None = None) -> pa.Table:
    """The manifest's ``rows`` (their columns as read) with their source hash, size and bytes.

    ``frames[j]`` (record_id, image, sequence, frame, face box), when not None, replaces those
    columns of row ``j``: a frame of the video on manifest row ``rows[j]`` (:mod:`deid.intake.video`).
    """
    t = manifest.take(pa.array(rows, pa.int64()))
    cols = {name: t.column(name) for name in t.column_names}
    if frames is not None and any(f is not None for f in frames):
        for c, name in enumerate(("record_id", "image", "sequence", "frame")):
            old = cols[name].to_pylist()
            cols[name] = pa.array([o if f is None else f[c] for o, f in zip(old, frames)], cols[name].type)
    for name in ("eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y"):  # a manifest without eye columns
        cols.setdefault(name, pa.nulls(len(rows), pa.float64()))
    if "face_box" in schema.names:
        cols["face_box"] = pa.array([None if f is None else list(f[4]) for f in (frames or [None] * len(rows))],
                                    schema.field("face_box").type)
    if "frame_eyes" in schema.names:
        cols["frame_eyes"] = pa.array([None if f is None or f[5] is None else list(f[5])
                                       for f in (frames or [None] * len(rows))], schema.field("frame_eyes").type)
    cols.update(source_sha256=pa.array(digests, pa.string()), size=pa.array([len(d) for d in data], pa.int64()),
                data=pa.array(data, pa.large_binary()))
    return pa.table([cols[f.name] for f in schema], schema=schema)


def ingest(drop: Drop, out_path: Path, *, max_pixels: int = 100_000_000, batch_size: int = 64,
           read_threads: int = READ_THREADS, eyes_finder: EyesFinder | None = None) -> IngestResult:
    """Stream the drop's usable rows into ``out_path`` (Parquet, one row group per batch).

    Each source file is read once and at most ``batch_size`` files are held in memory. Records whose
    identical bytes appear under two different subject ids are both quarantined
    (``duplicate_across_people``): the same photo credited to two people would break the per-person
    count behind the k guarantee. Such clashes are only known at the end, so when there are any the
    staged table is rewritten without them (from the staged table, not from the sources).
    ``read_threads`` threads read and hash the files ahead of the writer (at most ``2 x batch_size``
    files in memory; :data:`READ_THREADS`). With ``eyes_finder`` (alignment's landmark pass on a staged
    crop, :func:`deid.alignment.align.tracked_eyes_finder`) a video's frames are staged with their eyes
    (``frame_eyes``): found on detected frames, moved with the face on followed ones
    (:class:`deid.intake.video.StagedEyes`); without it alignment finds them in each frame's face box.
    """
    out_path.parent.mkdir(parents=True, exist_ok=True)
    schema = schemas.ingested([*drop.labels, *drop.sensitive], points=drop.has_points, sequences=drop.has_sequences,
                              videos=drop.has_videos, video_eyes=drop.has_videos and eyes_finder is not None)

    tmp = out_path.with_suffix(".parquet.tmp")
    try:
        return _ingest(drop, out_path, tmp, schema, max_pixels=max_pixels, batch_size=batch_size,
                       read_threads=read_threads, eyes_finder=eyes_finder)
    except BaseException:
        # A partial file of raw source bytes must not stay behind (e.g. on a full disk).
        tmp.unlink(missing_ok=True)
        out_path.with_suffix(".rewrite.tmp").unlink(missing_ok=True)
        raise


def _ingest(drop: Drop, out_path: Path, tmp: Path, schema: pa.Schema, *, max_pixels: int,
            batch_size: int, read_threads: int, eyes_finder: EyesFinder | None = None) -> IngestResult:
    quarantined: list[Quarantined] = []
    # Per record read: its manifest row and the raw sha256 of its bytes (columnar: issue 13).
    staged_rows = np.empty(len(drop.rows), np.int64)
    raw = bytearray()
    n_staged = n_groups = 0
    manifest = drop.rows.table
    chunk_rows: list[int] = []
    chunk_digests: list[str] = []
    chunk_data: list[bytes] = []
    chunk_frames: list[VideoFrame | None] = []
    frame_ids: list[str] = []  # staged record ids of video frames, in staging order (None-free)
    n_frames = 0

    def stage(row: int, data: bytes, frame: VideoFrame | None = None, *, digest: bytes | None = None) -> None:
        nonlocal n_staged, staged_rows, n_frames
        digest = digest or hashlib.sha256(data).digest()
        raw.extend(digest)
        if n_staged == len(staged_rows):  # video rows add records: grow the per-record arrays
            staged_rows = np.concatenate([staged_rows, np.empty(max(1024, len(staged_rows)), np.int64)])
        staged_rows[n_staged] = row
        if frame is not None:
            frame_at.append(n_staged)
            frame_ids.append(frame[0])
        n_staged += 1
        chunk_rows.append(row)
        chunk_digests.append(digest.hex())
        chunk_data.append(data)
        chunk_frames.append(frame)
        if len(chunk_rows) == batch_size:
            flush()

    frame_at: list[int] = []
    video_count = [0, 0]  # video rows expanded, frames they gave
    sequence_fps: dict[str, float] = {}
    with pq.ParquetWriter(tmp, schema, **schemas.writer_options(schema.names)) as writer:
        def flush() -> None:
            nonlocal n_groups
            fault_enospc("data", tmp)
            writer.write_table(_batch_table(manifest, chunk_rows, chunk_digests, chunk_data, schema, chunk_frames))
            n_groups += 1
            chunk_frames.clear()
            chunk_rows.clear()
            chunk_digests.clear()
            chunk_data.clear()

        with closing(_read_ahead(drop, manifest, max_pixels=max_pixels, batch_size=batch_size,
                                 threads=read_threads)) as reads:
            for row, rid, image, read in reads:
                if isinstance(read, str):  # VIDEO
                    why, frames = _ingest_video(drop, rid, image, row, stage, max_pixels=max_pixels, rates=sequence_fps,
                                                eyes=StagedEyes(eyes_finder) if eyes_finder is not None else None)
                    quarantined.extend(why)
                    if frames is not None:  # expanded into frames: counted as frames from here on
                        video_count[0] += 1
                        video_count[1] += frames
                    continue
                if read[0] is None:
                    quarantined.append(Quarantined(rid, image, *read[1], "ingest"))
                    continue
                stage(row, read[0], digest=read[1])
        if chunk_rows:
            flush()

    staged_rows = staged_rows[:n_staged]
    ids, digests, hexes = _staged_ids_and_digests(manifest, staged_rows, frame_at, frame_ids, raw)
    n_final = n_staged
    clashes = _clashes(drop, staged_rows, digests)
    if clashes:
        quarantined.extend(clashes)
        n_final -= len(clashes)
        n_groups = _rewrite_without(tmp, {q.record_id for q in clashes}, schema, batch_size)
    tmp.replace(out_path)
    log.info("ingested %d records (%d quarantined) into %s", n_final, len(quarantined), out_path)
    return IngestResult(out_path, n_final, quarantined, SourceHashes(ids, hexes), n_groups,
                        video_rows=video_count[0], video_frames=video_count[1], sequence_fps=sequence_fps)


def _staged_ids_and_digests(manifest: pa.Table, staged_rows: np.ndarray, frame_at: list[int], frame_ids: list[str],
                            raw: bytearray) -> tuple[pa.Array, pa.FixedSizeBinaryArray, pa.StringArray]:
    """The staged records' ids (a video's frames have their own) and the raw sha256 of their bytes, as binary and
    as hex columns; ``raw`` (the digests' bytes, in staging order) is emptied."""
    n_staged = len(staged_rows)
    ids = manifest.column("record_id").take(pa.array(staged_rows)).combine_chunks()
    if frame_at:  # a video's frames have their own record ids
        listed = ids.to_pylist()
        for at, fid in zip(frame_at, frame_ids):
            listed[at] = fid
        ids = pa.array(listed, pa.string())
    sha = np.frombuffer(bytes(raw), np.uint8).reshape(-1, 32)
    digests = pa.FixedSizeBinaryArray.from_buffers(pa.binary(32), n_staged, [None, pa.py_buffer(sha.tobytes())])
    hexes = pa.StringArray.from_buffers(n_staged, pa.py_buffer(np.arange(0, 64 * n_staged + 1, 64, dtype=np.int32)),
                                        pa.py_buffer(_hex(sha).tobytes()))
    raw.clear()  # the digests' bytes (the closure above holds the name, so it is emptied, not deleted)
    del sha
    return ids, digests, hexes


_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def _hex(raw: np.ndarray) -> np.ndarray:
    """Lowercase hex of each row of ``raw`` (n, m) uint8, as (n, 2m) uint8 ASCII."""
    out = np.empty((raw.shape[0], 2 * raw.shape[1]), np.uint8)
    out[:, 0::2], out[:, 1::2] = _HEX[raw >> 4], _HEX[raw & 15]
    return out


def _clashes(drop: Drop, staged_rows: np.ndarray, digests: pa.Array) -> list[Quarantined]:
    """``duplicate_across_people``: every staged record whose bytes are also staged under another subject id."""
    if not len(staged_rows):
        return []
    subjects = drop.rows.column("subject_id").take(pa.array(staged_rows)).combine_chunks()
    t = pa.table({"digest": digests, "subject": subjects})
    people = t.group_by("digest").aggregate([("subject", "count_distinct")])
    clash = people.filter(pc.greater(people.column("subject_count_distinct"), 1)).column("digest")
    if not len(clash):
        return []
    hit = np.flatnonzero(pc.is_in(digests, value_set=clash.combine_chunks()).to_numpy(zero_copy_only=False))
    by_digest: dict[bytes, set[str]] = {}
    for d, who in zip(digests.take(pa.array(hit)).to_pylist(), subjects.take(pa.array(hit)).to_pylist()):
        by_digest.setdefault(d, set()).add(who)
    rows = drop.rows.take(staged_rows[hit]).table
    out = []
    for rid, image, subject, d in zip(rows.column("record_id").to_pylist(), rows.column("image").to_pylist(),
                                      rows.column("subject_id").to_pylist(), digests.take(pa.array(hit)).to_pylist()):
        others = sorted(by_digest[d] - {subject})
        out.append(Quarantined(rid, image, "duplicate_across_people",
                               f"the same image bytes are also listed under subject(s) {others}", "ingest"))
    return out


def _rewrite_without(path: Path, drop_ids: set[str], schema: pa.Schema, batch_size: int) -> int:
    """Rewrite the staged table without ``drop_ids``, re-batched to ``batch_size`` rows per row group."""
    import pyarrow.compute as pc  # noqa: PLC0415

    src = pq.ParquetFile(path)
    out = path.with_suffix(".rewrite.tmp")
    n_groups = 0
    skip = pa.array(sorted(drop_ids), pa.string())
    pending: list[pa.Table] = []
    pending_rows = 0
    with pq.ParquetWriter(out, schema, **schemas.writer_options(schema.names)) as writer:
        def flush(limit: int) -> int:
            nonlocal pending, pending_rows
            wrote = 0
            if not pending:
                return 0
            table = pa.concat_tables(pending)
            while table.num_rows >= limit and table.num_rows > 0:
                writer.write_table(table.slice(0, batch_size))
                wrote += 1
                table = table.slice(batch_size)
            pending, pending_rows = ([table], table.num_rows) if table.num_rows else ([], 0)
            return wrote

        for g in range(src.num_row_groups):
            t = src.read_row_group(g)
            t = t.filter(pc.invert(pc.is_in(t.column("record_id"), value_set=skip)))
            pending.append(t)
            pending_rows += t.num_rows
            if pending_rows >= batch_size:
                n_groups += flush(batch_size)
        n_groups += flush(1)
    src.close()
    out.replace(path)
    return n_groups


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


def _ingest_video(drop: Drop, rid: str, image: str, row: int, stage, *, max_pixels: int,
                  rates: dict[str, float], eyes: StagedEyes | None = None) -> tuple[list[Quarantined], int | None]:
    """Stage the tracked subject's face of every sampled frame of the video on manifest row ``row``.

    Frames stream from the decoder one at a time (:func:`deid.intake.video.track_video`). Frames
    without the subject's face are quarantined, each naming its segment. Returns the quarantined
    records and the number of frame records the row became (None: the row itself is quarantined,
    e.g. a video that does not open).
    """
    try:
        fd = open_drop_file(drop.root, image)
    except RecordError as exc:
        return [Quarantined(rid, image, exc.code, exc.message, "ingest")], None
    dropped: list[tuple[int, float, str]] = []
    kept = 0
    stopped: list[Quarantined] = []
    try:
        rate = rates[rid] = video_rate(fd, drop.fps)
        for tf in track_video(fd, fps=drop.fps, max_pixels=max_pixels):
            if tf.crop is None:
                dropped.append((tf.index, tf.seconds, tf.reason))
                continue
            # The sequence key is the video's row id: private (the release gives sequences random ids).
            data, face = staged_crop(tf)
            stage(row, data, (frame_record_id(rid, tf.index), f"{image}#{tf.index}", rid, tf.index, face,
                              None if eyes is None else eyes(tf, data, face)))
            kept += 1
    except RecordError as exc:
        if not kept and not dropped:
            return [Quarantined(rid, image, exc.code, exc.message, "ingest")], None
        at = kept + len(dropped)  # decoding broke off: the frames before stay, the rest is one record
        stopped.append(Quarantined(frame_record_id(rid, at), f"{image}#{at}", exc.code,
                                   f"decoding stopped at frame {at}: {exc.message}", "ingest"))
    finally:
        os.close(fd)
    out = [Quarantined(frame_record_id(rid, i), f"{image}#{i}", reason, msg, "ingest")
           for (i, _, reason), msg in zip(dropped, segment_messages(dropped, rate))] + stopped
    if kept == 0 and not out:
        return [Quarantined(rid, image, "unreadable_video", "no frame could be decoded", "ingest")], None
    log.info("video row %s: %d frames staged, %d quarantined", rid, kept, len(out))
    return out, kept + len(out)
