"""Building and atomically publishing a release directory.

A release holds only de-identified images (PNG written from pixel arrays, so no source bytes
or metadata), the utility labels and random cluster ids, in a random order with fresh random
record ids. It follows the Hugging Face ``imagefolder`` layout, so consumers load it with
``datasets.load_dataset("imagefolder", data_dir=...)`` or pandas as it is: ``images/*.png``,
``metadata.csv`` (``file_name`` + ``record_id``, ``cluster_id``, the labels), ``release.parquet``
and ``release.csv`` (the same table with the column ``image``) and a dataset card ``README.md``
(:mod:`deid.release.card`, written once the gate's figures exist, before the release is hashed and signed),
and ``MANIFEST.sha256``, the sha256 of every image (:mod:`deid.release.manifest`; the signed report lists its hash).
A release of image sequences adds ``sequence_id`` (fresh random per sequence) and ``frame``
(0, 1, 2... in the sequence's order) to those tables, and each sequence as a video,
``videos/<sequence_id>.avi`` (Motion-JPEG, written by OpenCV from the released frames). It is written to a directory inside the run's private staging directory and renamed into place only when the gate
has passed, so a reader never sees half a release and a rejected run leaves nothing behind.
"""
from __future__ import annotations

import csv
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from deid.errors import ConfigError, DataError, StateError
from deid.release.manifest import ReleaseFiles, sort_paths
from deid.faults import fault_enospc
from deid.schemas import arrow as schemas

RELEASE_TABLE = "release.parquet"
VIDEOS = "videos"
# Motion-JPEG in AVI: written and read back by opencv-python-headless's bundled FFmpeg, playable everywhere.
VIDEO_FOURCC = "MJPG"
VIDEO_SUFFIX = ".avi"
VIDEO_FPS = 10.0
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
    # the flow encrypts it into the linkage record (deid.release.linkage). A table (columns record_id,
    # released_record_id, image, cluster, cluster_id; one row per record) from stage_release.
    mapping: pa.Table | list[dict] = field(default_factory=list)
    # Release-relative paths of the sequence videos (empty without sequences).
    videos: list[str] = field(default_factory=list)
    # (path, sha256, bytes) of every image file as written, as columns (not re-read to list the release).
    images: ReleaseFiles = field(default_factory=ReleaseFiles.empty)


def write_video(path: Path, frames: list[np.ndarray], *, fps: float = VIDEO_FPS) -> Path:
    """Write frames ((h, w) grey or (h, w, 3) BGR uint8, all one size) as a Motion-JPEG AVI.

    MJPG needs even sides (FFmpeg drops an odd last column or row), so each frame is padded by
    replicating its last column / row: a reader gets every released pixel.
    """
    if not frames:
        raise ConfigError("a video needs at least one frame")
    h, w = frames[0].shape[:2]
    colour = frames[0].ndim == 3
    ph, pw = h + h % 2, w + w % 2
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*VIDEO_FOURCC), float(fps), (pw, ph), isColor=colour)
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {VIDEO_FOURCC} video to {path} (no FFmpeg backend?)")
    try:
        for f in frames:
            if f.shape != frames[0].shape:
                raise ConfigError(f"video frames differ in shape: {f.shape} vs {frames[0].shape}")
            writer.write(cv2.copyMakeBorder(np.ascontiguousarray(f), 0, ph - h, 0, pw - w, cv2.BORDER_REPLICATE))
    finally:
        writer.release()
    path.write_bytes(blank_encoder_tags(path.read_bytes()))
    return path


def blank_encoder_tags(data: bytes) -> bytes:
    """The AVI with FFmpeg's text blanked in place: the ``INFO`` list (``ISFT`` = ``Lavf<version>``)
    becomes zeroed ``JUNK`` and each frame's JPEG ``COM`` (``Lavc<version>``) is zeroed.

    Sizes and offsets do not change, so the index stays valid and every player reads the same
    pixels. The tags only name the encoder build (no subject, path or date), but the release
    carries nothing beyond pixels: :func:`deid.evaluation.leaks.avi_has_metadata` checks it.
    """
    from deid.evaluation.leaks import avi_chunks, jpeg_segments  # noqa: PLC0415

    out = bytearray(data)
    for cid, kind, start, end, in_movi in avi_chunks(data):
        if kind == b"INFO":
            out[start:start + 4] = b"JUNK"
            out[start + 8:end] = bytes(end - start - 8)
        elif in_movi and cid[2:] == b"dc":
            for marker, a, b in jpeg_segments(data[start + 8:end]):
                if marker == 0xFE:
                    out[start + 8 + a:start + 8 + b] = bytes(b - a)
    return bytes(out)


def read_video(path: str | os.PathLike) -> np.ndarray:
    """All frames of a video (n, h, w, 3) BGR uint8, as OpenCV decodes them (e.g. to check a release's videos)."""
    cap = cv2.VideoCapture(str(path))
    frames = []
    try:
        while True:
            ok, f = cap.read()
            if not ok:
                break
            frames.append(f)
    finally:
        cap.release()
    return np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8)


def stage_release(tmp_dir: Path, *, images: np.ndarray, shape: tuple[int, ...], clusters: list[str],
                  labels: dict[str, list[str]], record_ids: list[str] | None = None,
                  sequences: list | None = None, frames: list | None = None,
                  fps: float | Mapping[Any, float] = VIDEO_FPS) -> StagedRelease:
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
    sequences, frames : per image, its sequence key (None: a still image; the key itself is never
        released) and frame number. The release then has ``sequence_id``/``frame`` columns (frames
        renumbered 0, 1, 2... in order, so the source numbering is not released) and one video per
        sequence under ``videos/`` at ``fps`` frames per second (a mapping: per sequence key, the rate a
        video file's frames were taken at; :data:`VIDEO_FPS` for a key it lacks).
    """
    if record_ids is not None and len(record_ids) != len(images):
        raise ValueError(f"record_ids has {len(record_ids)} entries but images has {len(images)}; pass one id per image")
    clash = sorted(set(labels) & set(_RESERVED))
    if clash:
        raise DataError(f"labels {clash} clash with the release columns {list(_RESERVED)}; rename those label "
                          "columns in the manifest")
    n = len(images)
    seq_of = _sequence_ids(sequences, frames, n)
    tmp_dir.mkdir(parents=True)
    (tmp_dir / "images").mkdir()
    order = list(range(n))
    secrets.SystemRandom().shuffle(order)  # the release order must not follow the input
    order = np.asarray(order, dtype=np.int64)
    # Columns, not a dict per record (issue 13: a million records' dicts held ~1 GB).
    cluster_col = _strings(clusters, n, "clusters")
    distinct = cluster_col.dictionary_encode()
    cluster_ids = {c: "c-" + secrets.token_hex(6) for c in sorted(set(distinct.dictionary.to_pylist()))}
    cluster_id_col = pa.array([cluster_ids[c] for c in distinct.dictionary.to_pylist()], pa.string()).take(
        distinct.indices)
    take = pa.array(order)
    rids = _random_hex(n, 8)  # the j-th released record's fresh id (os.urandom, as secrets.token_hex)
    released_names = pc.binary_join_element_wise("images/", rids, ".png", "")
    names = released_names.take(pa.array(np.argsort(order)))  # image file of each input record
    schema = schemas.release(list(labels), sequences=seq_of is not None)
    cols = {"record_id": rids, "image": released_names, "cluster_id": cluster_id_col.take(take),
            **{k: _strings(v, n, f"labels[{k!r}]").take(take) for k, v in labels.items()}}
    if seq_of is not None:
        cols["sequence_id"] = pa.array([seq_of[i][0] for i in order.tolist()], pa.string())
        cols["frame"] = pa.array([seq_of[i][1] for i in order.tolist()], pa.int64())
    table = pa.table([cols[c] for c in schema.names], schema=schema)
    mapping = pa.table({"record_id": _strings(record_ids, n, "record_ids").take(take), "released_record_id": rids,
                        "image": released_names, "cluster": cluster_col.take(take),
                        "cluster_id": cols["cluster_id"]}) if record_ids is not None else []
    del cols
    written = _write_images(tmp_dir, images, shape, names)
    videos = []
    if seq_of is not None:
        (tmp_dir / VIDEOS).mkdir()
        by_sequence: dict[str, list[tuple[int, int]]] = {}
        rate: dict[str, float] = {}
        for i, (sid, f) in enumerate(seq_of):
            if sid is not None:
                by_sequence.setdefault(sid, []).append((f, i))
                rate[sid] = float(fps.get(sequences[i], VIDEO_FPS)) if isinstance(fps, Mapping) else float(fps)
        for sid in sorted(by_sequence):  # random ids: sorted order says nothing about the input
            name = f"{VIDEOS}/{sid}{VIDEO_SUFFIX}"
            fault_enospc("stage", tmp_dir / name)
            write_video(tmp_dir / name, [images[i].reshape(shape) for _, i in sorted(by_sequence[sid])], fps=rate[sid])
            videos.append(name)
    pq.write_table(table, tmp_dir / RELEASE_TABLE)
    _write_table_csv(tmp_dir / RELEASE_CSV, table, schema.names, schema.names)
    # imagefolder: file_name first, relative to metadata.csv; the same columns otherwise.
    others = [c for c in schema.names if c != "image"]
    _write_table_csv(tmp_dir / METADATA_CSV, table, ["file_name", *others], ["image", *others])
    return StagedRelease(tmp_dir, schema.names, n, mapping, videos, written)


def _strings(values, n: int, name: str) -> pa.Array:
    """``values`` (a sequence of str, or an Arrow string array) as one Arrow string array of ``n`` entries."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not isinstance(values, pa.Array):
        values = pa.array(list(values), pa.string())
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries but images has {n}; pass one per image")
    return values


def _random_hex(n: int, nbytes: int) -> pa.Array:
    """``n`` fresh random ids of ``nbytes`` bytes each, in lowercase hex (``secrets.token_hex``'s alphabet and source)."""
    raw = np.frombuffer(os.urandom(n * nbytes), np.uint8).reshape(n, nbytes)
    text = np.empty((n, 2 * nbytes), np.uint8)
    text[:, 0::2], text[:, 1::2] = _HEX[raw >> 4], _HEX[raw & 15]
    offsets = np.arange(0, 2 * nbytes * n + 1, 2 * nbytes, dtype=np.int64)
    return pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(text.tobytes())).cast(pa.string())


_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def _write_images(tmp_dir: Path, images, shape: tuple[int, ...], names, chunk: int = 4096) -> ReleaseFiles:
    """Write ``images[i]`` as PNG to ``tmp_dir / names[i]``; returns (path, sha256, bytes) of every file written.

    A k-Same release gives every member of a cluster the same image: when ``images`` says which
    rows are the same (an ``index`` of distinct rows, :class:`deid.operations.worker_rows.IndexedRows`),
    each distinct image is read, encoded and hashed once and its bytes written to every member's
    file (the files are byte for byte what one encoding per record gives: PNG encoding is
    deterministic). Distinct rows are read in order, a chunk at a time (issue 13).
    """
    import hashlib  # noqa: PLC0415

    n = len(names)
    index = getattr(images, "index", None)
    keys = np.asarray(index, dtype=np.int64) if index is not None and len(index) == n else np.arange(n)
    by_key = np.argsort(keys, kind="stable")
    starts = np.flatnonzero(np.r_[True, keys[by_key][1:] != keys[by_key][:-1]]) if n else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], n].astype(np.int64) if n else starts
    arrow = isinstance(names, (pa.Array, pa.ChunkedArray))
    # Columns in path order, filled per record where its path sorts (issue 13: a dict entry per image held
    # ~350 bytes; columns ~70, and no sorted copy made afterwards).
    paths, order = sort_paths(names if arrow else list(names))
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    del order
    sha = np.zeros((n, 32), np.uint8)
    sizes = np.zeros(n, np.int64)
    dfd = os.open(tmp_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for c in range(0, len(starts), chunk):
            reps = by_key[starts[c:c + chunk]]  # one record per distinct image
            block = np.asarray(images[reps]) if index is not None else None
            first = int(starts[c]) if len(starts) else 0
            last = int(ends[min(c + chunk, len(starts)) - 1]) if len(starts) else 0
            # This chunk's members' file names (an Arrow column is read a chunk at a time).
            chunk_names = names.take(pa.array(by_key[first:last])).to_pylist() if arrow else \
                [names[i] for i in by_key[first:last].tolist()]
            for j, (a, b) in enumerate(zip(starts[c:c + chunk].tolist(), ends[c:c + chunk].tolist())):
                img = block[j] if block is not None else images[int(reps[j])]
                ok, buf = cv2.imencode(".png", np.asarray(img).reshape(shape))
                if not ok:
                    raise RuntimeError(f"PNG encoding failed for a {shape} image")
                data = buf.tobytes()
                members = rank[by_key[a:b]]
                sha[members] = np.frombuffer(hashlib.sha256(data).digest(), np.uint8)
                sizes[members] = len(data)
                mine = chunk_names[a - first:b - first]
                if mine:
                    fault_enospc("stage", tmp_dir / mine[0])
                for name in mine:
                    _write_file(dfd, name, data, tmp_dir)
    finally:
        os.close(dfd)
    return ReleaseFiles.from_sorted(paths, sha, sizes)


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)


def _write_file(dir_fd: int, name: str, data: bytes, where: Path) -> None:
    """``data`` into the file ``name`` under the directory ``dir_fd`` (``where``), as ``open(..., "wb")`` writes
    it, without a file object or a path object per file (a million release files). An error names the file."""
    try:
        fd = os.open(name, _CREATE, 0o666, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, os.path.join(where, name)) from None


def _sequence_ids(sequences: list | None, frames: list | None, n: int) -> list[tuple[str | None, int | None]] | None:
    """Per image, (fresh random sequence id, frame renumbered 0..m-1 in order), or None without sequences."""
    if sequences is None:
        return None
    if len(sequences) != n or frames is None or len(frames) != n:
        raise ConfigError(f"sequences and frames need one entry per image ({n}); got "
                          f"{len(sequences)} and {None if frames is None else len(frames)}")
    members: dict = {}
    for i, (key, f) in enumerate(zip(sequences, frames)):
        if key is not None:
            members.setdefault(key, []).append((f, i))
    out: list[tuple[str | None, int | None]] = [(None, None)] * n
    for key, items in members.items():
        if len({f for f, _ in items}) != len(items):
            raise DataError("a sequence lists one frame number twice; frames must be unique within a sequence")
        sid = "q-" + secrets.token_hex(6)
        for rank, (_, i) in enumerate(sorted(items)):
            out[i] = (sid, rank)
    return out


def _write_csv(path: Path, fieldnames: list[str], rows: list[dict], *, drop: tuple[str, ...] = ()) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows({k: csv_safe(v) for k, v in row.items() if k not in drop} for row in rows)


def _write_table_csv(path: Path, table: pa.Table, header: list[str], columns: list[str], batch: int = 4096) -> None:
    """``table``'s ``columns`` as CSV under the names ``header``: the bytes :func:`_write_csv` writes for the
    table's rows as dicts, from columns a batch at a time (no dict per record; issue 32: a million rows twice).

    :func:`csv_safe` is applied to every value that can be text (a numeric or boolean column holds none).
    """
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)  # DictWriter's own writer: the same dialect (excel), quoting and line ends
        writer.writerow(header)
        for b in table.select(columns).to_batches(max_chunksize=batch):
            cols = [_csv_cells(b.column(i)) for i in range(b.num_columns)]
            writer.writerows(zip(*cols))


def _csv_cells(column: pa.Array) -> list:
    """A column's Python values as :func:`_write_csv` writes them (``csv_safe`` on anything that can be text)."""
    t = column.type
    values = column.to_pylist()
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t):
        return values
    return [csv_safe(v) for v in values]


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
