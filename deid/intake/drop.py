"""Reading and validating a dataset drop (``manifest.csv`` + optional ``drop.yaml``).

A drop is a directory holding ``manifest.csv`` (``image``, ``subject_id``, one column per
utility label, optional eye points, an optional ``points`` column naming a landmark file per
image (:mod:`deid.intake.points`), optional ``sequence`` and ``frame`` columns for image
sequences), an optional ``drop.yaml`` (``name``, ``labels``, ``sensitive``,
``license``, ``license_name``, ``license_link``, ``citation``) and the images. Problems with the drop as a whole raise :class:`~deid.errors.DropError`; problems with
one row quarantine that row with a stable reason code and never stop the run.

The drop's files are opened by :mod:`deid.intake.drop_files`.
"""
from __future__ import annotations

import csv
from array import array
import logging
import math
import os
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import yaml

from deid.errors import ConfigError, DropError, Quarantined, RecordError
from deid.intake.points import POINTS_COLUMN, read_points
from deid.intake.video import check_fps, is_video

from deid.intake.drop_files import read_drop_text

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("image", "subject_id")
EYE_COLUMNS = ("eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y")
# A sequence (video) drop: every frame names its sequence (the steward's id, never released) and
# its position in it; a row with both cells empty is a still image.
SEQUENCE_COLUMNS = ("sequence", "frame")
RESERVED_COLUMNS = set(REQUIRED_COLUMNS) | set(EYE_COLUMNS) | {POINTS_COLUMN} | set(SEQUENCE_COLUMNS)
MANIFEST = "manifest.csv"
DROP_YAML = "drop.yaml"
READY = "_READY"
# The licence a release carries when drop.yaml names none: "other" (Hugging Face's id for "see the
# card") -- the steward must state the terms; the dataset card says that none were given.
DEFAULT_LICENSE = "other"
# A licence id as the Hugging Face hub writes them (SPDX-like, e.g. cc-by-4.0, apache-2.0, other).
_LICENSE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+-]{0,63}$")


@dataclass(frozen=True)
class ManifestRow:
    """One usable manifest row; ``eyes`` is ``((lx, ly), (rx, ry))`` or None for "detect".

    ``points`` are the row's landmarks in source pixels (None: no points file); ``sequence`` and
    ``frame`` place it in an image sequence (None: a still image).
    """

    record_id: str
    row: int
    image: str
    path: Path
    subject_id: str
    labels: dict[str, str]
    eyes: tuple[tuple[float, float], tuple[float, float]] | None
    points: tuple[tuple[float, float], ...] | None = None
    sequence: str | None = None
    frame: int | None = None


# The manifest table's columns besides the labels (named as in the ingested table).
_ROW_COLUMNS = ("record_id", "image", "subject_id")


@dataclass(frozen=True, eq=False)
class ManifestRows(Sequence):
    """The usable manifest rows as one Arrow table, read as :class:`ManifestRow` on demand.

    ``table`` holds ``record_id``, ``image``, ``subject_id``, one string column per label, the four
    eye columns, and ``points`` / ``sequence`` / ``frame`` when the drop has them (the ingested
    table's names and types); ``rows`` is each row's 1-based manifest line number. A million
    ``ManifestRow`` objects would hold about 2 GB; the table holds about 100 bytes per row (issue 13).
    """

    table: pa.Table
    rows: np.ndarray
    root: Path
    labels: tuple[str, ...] = ()

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        j = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"row {i} of a manifest of {n} usable rows")
        return next(self._rows(self.table.slice(j, 1), self.rows[j:j + 1]))

    def __iter__(self) -> Iterator[ManifestRow]:
        start = 0
        for batch in self.table.to_batches(max_chunksize=4096):
            yield from self._rows(batch, self.rows[start:start + batch.num_rows])
            start += batch.num_rows

    def __eq__(self, other) -> bool:
        if isinstance(other, ManifestRows):
            return self.table.equals(other.table) and np.array_equal(self.rows, other.rows)
        return isinstance(other, (list, tuple)) and list(self) == list(other)

    __hash__ = None

    def column(self, name: str) -> pa.ChunkedArray:
        """One column of :attr:`table` (``record_id``, ``image``, ``subject_id``, a label...)."""
        return self.table.column(name)

    def take(self, indices) -> "ManifestRows":
        """These rows (positions in this table), in that order."""
        idx = np.asarray(indices, dtype=np.int64)
        return ManifestRows(self.table.take(pa.array(idx)), self.rows[idx], self.root, self.labels)

    def _rows(self, batch, lines: np.ndarray) -> Iterator[ManifestRow]:
        cols = batch.to_pydict()
        eyes = cols.get("eye_left_x")
        for j, line in enumerate(lines.tolist()):
            image = cols["image"][j]
            e = None if eyes is None or eyes[j] is None else (
                (cols["eye_left_x"][j], cols["eye_left_y"][j]), (cols["eye_right_x"][j], cols["eye_right_y"][j]))
            pts = cols["points"][j] if "points" in cols else None
            yield ManifestRow(cols["record_id"][j], line, image, self.root / image,
                              cols["subject_id"][j], {x: cols[x][j] for x in self.labels}, e,
                              None if pts is None else tuple(zip(pts[0::2], pts[1::2])),
                              cols["sequence"][j] if "sequence" in cols else None,
                              cols["frame"][j] if "frame" in cols else None)


def manifest_schema(labels: Sequence[str], *, eyes: bool, points: bool, sequences: bool) -> pa.Schema:
    """The columns of :attr:`ManifestRows.table` (eye columns only when the manifest has them)."""
    from deid.schemas import arrow as schemas  # noqa: PLC0415

    return pa.schema([*(pa.field(c, pa.string(), nullable=False) for c in (*_ROW_COLUMNS[:3], *labels)),
                      *(schemas.EYES if eyes else []), *([schemas.POINTS] if points else []),
                      *(schemas.SEQUENCE if sequences else [])])


class _RowsBuilder:
    """Accumulates parsed rows column by column, a chunk at a time, into :class:`ManifestRows`."""

    CHUNK = 65536

    def __init__(self, schema: pa.Schema, root: Path, labels: Sequence[str]):
        self.schema, self.root, self.labels = schema, root, tuple(labels)
        self.cols: dict[str, list] = {f.name: [] for f in schema}
        self.lines = array("q")
        self.batches: list[pa.RecordBatch] = []

    def add(self, line: int, values: dict) -> None:
        for name, col in self.cols.items():
            col.append(values[name])
        self.lines.append(line)
        if len(self.lines) % self.CHUNK == 0:
            self._flush()

    def _flush(self) -> None:
        n = len(self.cols["record_id"])
        if n:
            self.batches.append(pa.RecordBatch.from_pydict(self.cols, schema=self.schema))
            for col in self.cols.values():
                col.clear()

    def build(self) -> ManifestRows:
        self._flush()
        table = pa.Table.from_batches(self.batches, schema=self.schema).combine_chunks()
        self.batches = []
        return ManifestRows(table, np.asarray(self.lines, dtype=np.int64), self.root, self.labels)


@dataclass
class Drop:
    """A parsed drop: its usable rows, and the rows quarantined while reading the manifest."""

    root: Path
    name: str
    labels: list[str]
    manifest_bytes: bytes
    rows: ManifestRows  # the usable rows, columnar (a sequence of ManifestRow)
    quarantined: list[Quarantined]
    extra_columns: list[str] = field(default_factory=list)
    # From drop.yaml's ``license`` (a licence id such as cc-by-4.0); None when the steward set none.
    license: str | None = None
    # drop.yaml's ``license_name``, ``license_link`` and ``citation`` (those set): the dataset card carries them.
    attribution: dict[str, str] = field(default_factory=dict)
    dataset: str = ""  # the lineage this drop belongs to (drop.yaml `dataset:`, default: a name-safe form of `name`)
    has_points: bool = False  # the manifest has a ``points`` column
    has_sequences: bool = False  # the manifest has ``sequence`` and ``frame`` columns, or names video files
    has_videos: bool = False  # some rows name video files (deid.intake.video): ingest expands them into frames
    fps: float | None = None  # drop.yaml ``fps:``: the rate videos are decoded at (None: each source's own)
    # drop.yaml's ``sensitive`` columns: never partition labels; released only when every cluster is l-diverse.
    sensitive: list[str] = field(default_factory=list)

    @property
    def records_in(self) -> int:
        return len(self.rows) + len(self.quarantined)


def check_dataset_name(dataset: str) -> str:
    """A dataset name usable as a directory name (letters, digits, ``._-``; not starting with a dot)."""
    ok = isinstance(dataset, str) and 0 < len(dataset) <= 128 and not dataset.startswith(".") and all(
        c.isalnum() or c in "._-" for c in dataset)
    if not ok:
        raise ConfigError(f"dataset={dataset!r} must be 1-128 letters, digits, '.', '_' or '-' not starting "
                          "with '.', e.g. the drop's name; set `dataset:` in drop.yaml")
    return dataset


def record_id_for_row(row: int) -> str:
    """Staging record id (internal only; released records get fresh random ids)."""
    return f"r{row:08d}"


def _yaml_problem(exc: Exception) -> str:
    """A YAML parser error in one line (PyYAML's spans several, with a caret under the bad character)."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _read_yaml(root: Path) -> dict:
    path = root / DROP_YAML
    raw = read_drop_text(root, DROP_YAML)
    if raw is None:
        return {}
    try:
        data = yaml.safe_load(raw.decode("utf-8-sig")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise DropError(f"{path}: drop.yaml is not valid YAML ({_yaml_problem(exc)}); fix or remove it") from exc
    if not isinstance(data, dict):
        raise DropError(f"{path}: drop.yaml must be a mapping with 'name' and 'labels'; got {type(data).__name__}")
    return data


# One line of a text with its ending, as ``open(..., newline="")`` splits it (\r\n, \r or \n).
_LINE = re.compile(r"[^\r\n]*(?:\r\n?|\n)|[^\r\n]+$")


def csv_lines(text: str) -> Iterator[str]:
    """The lines of ``text`` with their endings, as ``io.StringIO(text, newline="")`` gives them to ``csv.reader``
    (a StringIO of the text would hold four bytes per character: ~290 MB for a million-row manifest)."""
    return (m.group() for m in _LINE.finditer(text))


def _csv_rows(path: Path, text: str) -> Iterator[list[str]]:
    """The manifest's non-empty CSV rows, parsed as they are read (not a list of every row: issue 13).

    The lines come straight from ``text`` (an ``io.StringIO`` of it would hold four bytes per character).
    """
    try:
        for row in csv.reader(csv_lines(text), strict=True):
            if any(cell.strip() for cell in row):
                yield row
    except csv.Error as exc:
        raise DropError(f"{path} is not valid CSV ({exc}); the manifest must be comma-separated UTF-8") from exc


def _parse_manifest(path: Path, raw: bytes) -> tuple[bytes, list[str], Iterator[list[str]]]:
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DropError(f"{path} is not UTF-8 text ({exc}); save the manifest as UTF-8 CSV") from exc
    if "\x00" in text:
        raise DropError(f"{path} is not a CSV file (it contains NUL bytes); the manifest must be UTF-8 CSV")
    rows = _csv_rows(path, text)
    first = next(rows, None)
    if first is None:
        raise DropError(f"{path} is empty; it needs a header row with columns image,subject_id,<labels>")
    header = [h.strip() for h in first]
    if len(set(header)) != len(header):
        dupes = sorted({h for h in header if header.count(h) > 1})
        raise DropError(f"{path}: duplicate column names {dupes}; every column name must be unique")
    return raw, header, rows


def _safe_relative(root: Path, image: str, parents: dict[str, str] | None = None
                   ) -> tuple[str | None, str | None, int | None]:
    """Check ``image`` stays inside ``root``; return (the drop's key for it, None, lstat mode or None if absent)
    or (None, reason, None).

    The key is the path's POSIX form (``PurePosixPath(image).as_posix()``). The file is looked at with
    one ``lstat`` and not followed; a symlink is resolved to say where it points (one pointing outside
    the drop is refused here; every link is refused again when the file is opened, :func:`open_drop_file`).
    Strings, not ``pathlib``: this runs once per manifest row (pathlib made it ~0.2 ms a row, ~3 min at
    1M rows). ``parents``: the resolved directories seen so far in one manifest.
    """
    if not image:
        return None, "empty image path", None
    if "\\" in image or image.startswith("/") or (len(image) > 1 and image[1] == ":"):
        return None, f"absolute or non-POSIX path {image!r}; use a relative POSIX path inside the drop", None
    parts = [p for p in image.split("/") if p and p != "."]
    if ".." in parts:
        return None, f"path {image!r} contains '..'; paths must stay inside the drop", None
    key = "/".join(parts) or "."
    top = os.fspath(root)
    candidate = os.path.join(top, *parts)
    try:
        mode: int | None = os.lstat(candidate).st_mode
    except OSError:
        mode = None  # absent: reported as a missing file by the caller
    if parents is None:
        parents = {}
    if mode is not None and stat.S_ISLNK(mode):
        resolved = os.path.realpath(candidate)  # a link: followed, to say where it points
    else:
        parent, _, name = candidate.rpartition("/")
        real = parents.get(parent)
        if real is None:
            real = parents[parent] = os.path.realpath(parent)
        resolved = f"{real}/{name}" if parts else real
    real_top = parents.get(top)
    if real_top is None:
        real_top = parents[top] = os.path.realpath(top)
    if resolved != real_top and not resolved.startswith(real_top.rstrip("/") + "/"):
        return None, f"path {image!r} resolves outside the drop (symlink to {resolved})", None
    return key, None, mode


def _parse_eyes(cells: list[str]):
    if all(c == "" for c in cells):
        return None, None
    if any(c == "" for c in cells):
        return None, "eye points are incomplete: give all four of " + ", ".join(EYE_COLUMNS) + " or none"
    try:
        vals = [float(c) for c in cells]
    except ValueError:
        return None, f"eye points {cells} are not numbers"
    if not all(math.isfinite(v) for v in vals):
        return None, f"eye points {cells} are not finite"
    a, b = (vals[0], vals[1]), (vals[2], vals[3])
    # "left" is the eye with the smaller x in the image; accept either order.
    return (a, b) if a[0] <= b[0] else (b, a), None


def _parse_sequence(cells: list[str]) -> tuple[str | None, int | None, str | None]:
    """(sequence, frame, problem) of a row's ``sequence``/``frame`` cells; both empty = a still image."""
    seq, frame = cells
    if not seq and not frame:
        return None, None, None
    if not seq or not frame:
        return None, None, "sequence and frame must both be given (a frame of a sequence) or both be empty (a still image)"
    try:
        f = int(frame)
    except ValueError:
        return None, None, f"frame {frame!r} is not an integer (the frame's position in its sequence, 0, 1, 2...)"
    if f < 0:
        return None, None, f"frame {f} is negative; number frames 0, 1, 2..."
    return seq, f, None


def _check_points_and_sequences(rows: ManifestRows, quarantine) -> ManifestRows:
    """Drop-wide rules, after every row was read: one landmark count, one subject per sequence, no repeated frame.

    Landmark ``i`` must be the same feature on every face, so a points file with another count than
    the drop's most common one is another template (``bad_points``). A sequence listing frames of
    two subject ids cannot be trusted to be one person: all its frames are quarantined; a repeated
    (sequence, frame) keeps its first row.
    """
    counts: dict[int, int] = {}
    for r in rows:
        if r.points is not None:
            counts[len(r.points)] = counts.get(len(r.points), 0) + 1
    # The most common count; ties go to the larger template.
    usual = max(counts, key=lambda c: (counts[c], c)) if counts else None
    subjects: dict[str, set[str]] = {}
    for r in rows:
        if r.sequence is not None:
            subjects.setdefault(r.sequence, set()).add(r.subject_id)
    mixed = {s for s, who in subjects.items() if len(who) > 1}
    seen: dict[tuple[str, int], int] = {}
    kept = []
    for i, r in enumerate(rows):
        if r.points is not None and len(r.points) != usual:
            quarantine(r.record_id, r.image, "bad_points", f"row {r.row}: the points file has {len(r.points)} points; "
                       f"the drop's points files have {usual} (one landmark template for the whole drop)")
            continue
        if r.sequence is not None:
            if r.sequence in mixed:
                quarantine(r.record_id, r.image, "bad_sequence", f"row {r.row}: its sequence lists frames of "
                           f"{len(subjects[r.sequence])} subject ids; a sequence shows one person")
                continue
            if (r.sequence, r.frame) in seen:
                quarantine(r.record_id, r.image, "bad_sequence", f"row {r.row}: frame {r.frame} of its sequence is "
                           f"already listed on row {seen[(r.sequence, r.frame)]}")
                continue
            seen[(r.sequence, r.frame)] = r.row
        kept.append(i)
    return rows if len(kept) == len(rows) else rows.take(kept)


def read_drop(drop_dir: str | os.PathLike, *, labels: list[str] | None = None, name: str | None = None) -> Drop:
    """Read and validate a drop's manifest; bad rows are quarantined, never dropped silently.

    Parameters
    ----------
    drop_dir : path
        The drop directory.
    labels : list of str, optional
        Utility label columns; overrides ``drop.yaml``'s ``labels``.
    name : str, optional
        Dataset name; overrides ``drop.yaml``'s ``name`` (default: the directory name).

    Raises
    ------
    DropError
        When the drop as a whole is unusable: no directory, no manifest, not CSV, a required
        or declared label column missing, or no labels declared.
    """
    root, manifest, meta, (raw, header, body) = _image_drop_manifest(drop_dir)
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise DropError(f"{manifest}: missing required column(s) {missing}; found columns {header}")
    labels = _drop_labels(labels, meta, root, manifest, header)
    sensitive = _sensitive(root, meta, labels, header)
    extra = [c for c in header if c not in RESERVED_COLUMNS and c not in labels and c not in sensitive]
    eye_cols_present, seq_cols_present = _optional_columns(manifest, header)
    has_points = POINTS_COLUMN in header

    idx = {c: i for i, c in enumerate(header)}
    # A sensitive column travels with the labels' columns (strings, one per record) but is never a label.
    rows = _RowsBuilder(manifest_schema([*labels, *sensitive], eyes=bool(eye_cols_present), points=has_points,
                                        sequences=bool(seq_cols_present)), root, labels)
    quarantined: list[Quarantined] = []
    seen_paths: dict[str, int] = {}

    parents: dict[str, str] = {}  # resolved directories of the manifest's paths
    videos = 0
    try:
        fps = check_fps(meta.get("fps"), where=f"{root / DROP_YAML}: fps")
    except ConfigError as exc:
        raise DropError(str(exc)) from None

    def quarantine(rid: str, image: str, code: str, message: str) -> None:
        quarantined.append(Quarantined(rid, image, code, message, "manifest"))

    for n, cells in enumerate(body, start=1):
        rid = record_id_for_row(n)
        cells = [c.strip() for c in cells] + [""] * max(0, len(header) - len(cells))
        if len(cells) > len(header) and any(cells[len(header):]):
            quarantine(rid, cells[idx["image"]], "bad_row", f"row {n} has {len(cells)} cells, header has {len(header)}")
            continue
        values, why, video = _manifest_row(n, rid, cells, root=root, idx=idx, parents=parents, seen_paths=seen_paths,
                                           labels=labels, sensitive=sensitive, eye_cols=bool(eye_cols_present),
                                           sequences=bool(seq_cols_present), has_points=has_points)
        videos += video
        if why is not None:
            quarantine(rid, cells[idx["image"]], *why)
            continue
        rows.add(n, values)
    del body, parents, seen_paths
    rows = rows.build()

    if has_points or seq_cols_present:
        rows = _check_points_and_sequences(rows, quarantine)
    if videos and not seq_cols_present:
        rows = _with_sequence_columns(rows)

    drop_name = name or meta.get("name") or root.name
    if extra:
        log.info("manifest columns not used and kept out of the release: %s", extra)
    return Drop(root, str(drop_name), labels, raw, rows, quarantined, extra, license=_license(root, meta),
                attribution=_attribution(root, meta),
                dataset=_dataset_name(root, meta.get("dataset"), str(drop_name)), has_points=has_points,
                has_sequences=bool(seq_cols_present) or videos > 0, has_videos=videos > 0, fps=fps,
                sensitive=sensitive)


def _image_drop_manifest(drop_dir: str | os.PathLike) -> tuple[Path, Path, dict, tuple]:
    """An image drop's resolved directory, manifest path, ``drop.yaml`` and parsed manifest
    (``(raw bytes, header, body rows)``); a missing directory or manifest, or a drop of another kind, is a
    :class:`~deid.errors.DropError`."""
    root = Path(drop_dir)
    if not root.is_dir():
        raise DropError(f"drop directory {root} does not exist or is not a directory")
    root = root.resolve()
    manifest = root / MANIFEST
    manifest_raw = read_drop_text(root, MANIFEST)
    if manifest_raw is None:
        raise DropError(f"{root} has no {MANIFEST}; a drop needs a manifest with columns image,subject_id,<labels>")
    meta = _read_yaml(root)
    if meta.get("kind", "images") != "images":
        raise DropError(f"{root / DROP_YAML}: kind={meta.get('kind')!r}: not an image drop; a feature drop (kind: "
                        "features) is read by deid.intake.features.read_feature_drop (deid run routes it there)")
    raw, header, body = _parse_manifest(manifest, manifest_raw)
    return root, manifest, meta, (raw, header, body)


def _optional_columns(manifest: Path, header: Sequence[str]) -> tuple[list[str], list[str]]:
    """The manifest's eye columns and image-sequence columns present (each all or none)."""
    eye_cols_present = [c for c in EYE_COLUMNS if c in header]
    if eye_cols_present and len(eye_cols_present) != len(EYE_COLUMNS):
        raise DropError(f"{manifest}: eye columns must come as all four of {list(EYE_COLUMNS)}; found {eye_cols_present}")
    seq_cols_present = [c for c in SEQUENCE_COLUMNS if c in header]
    if seq_cols_present and len(seq_cols_present) != len(SEQUENCE_COLUMNS):
        raise DropError(f"{manifest}: an image-sequence drop needs both columns {list(SEQUENCE_COLUMNS)}; found "
                        f"{seq_cols_present}")
    return eye_cols_present, seq_cols_present


def _with_sequence_columns(rows: ManifestRows) -> ManifestRows:
    """``rows`` with empty sequence and frame columns: a drop of video files without them (ingest numbers the
    frames)."""
    # Ingest gives each video's frames a sequence and a frame number: the table carries both columns.
    from deid.schemas import arrow as schemas  # noqa: PLC0415

    t = rows.table
    for f in schemas.SEQUENCE:
        t = t.append_column(f, pa.nulls(t.num_rows, f.type))
    return ManifestRows(t, rows.rows, rows.root, rows.labels)


def _drop_labels(labels: list[str] | None, meta: dict, root: Path, manifest: Path, header: Sequence[str]) -> list[str]:
    """The drop's utility label columns: ``labels`` (the caller's), else ``drop.yaml``'s, each a manifest column
    that is not reserved; none is a normal drop (k-Same without partitions, utility not applicable)."""
    if labels is None:
        labels = meta.get("labels")
        if isinstance(labels, str):
            labels = [s.strip() for s in labels.split(",") if s.strip()]
        elif labels is not None and not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)):
            raise DropError(
                f"{root / DROP_YAML}: 'labels' must be a list of column names, e.g. 'labels: [gender, expression]'; "
                f"got a {type(labels).__name__} ({labels!r}); or pass --labels gender,expression")
    # No labels is a normal drop: k-Same runs without partitions and utility is not applicable.
    labels = [str(x) for x in labels or []]
    bad = [x for x in labels if x in RESERVED_COLUMNS]
    if bad:
        raise DropError(f"labels {bad} are reserved manifest columns; utility labels must be other columns")
    absent = [x for x in labels if x not in header]
    if absent:
        raise DropError(f"{manifest}: declared label column(s) {absent} are missing; found columns {header}")
    return labels


def _manifest_row(n: int, rid: str, cells: list[str], *, root: Path, idx: dict[str, int], parents: dict[str, str],
                  seen_paths: dict[str, int], labels: list[str], sensitive: list[str], eye_cols: bool, sequences: bool,
                  has_points: bool) -> tuple[dict | None, tuple[str, str] | None, bool]:
    """Manifest row ``n`` (record ``rid``, its ``cells`` stripped and padded to the header) checked and read.

    Returns ``(values, None, video)`` for a record, ``(None, (code, message), video)`` for one to
    quarantine; ``video``: the row names a video file (counted by :func:`read_drop` even when the row is
    quarantined after that check). ``seen_paths`` and ``parents`` are updated.
    """
    image = cells[idx["image"]]
    video = False
    subject = cells[idx["subject_id"]]
    key, why, mode = _safe_relative(root, image, parents)
    if key is None:
        return None, ("unsafe_path", str(why)), video
    if key in seen_paths:
        return None, ("duplicate_path", f"{image!r} is listed again (first on row {seen_paths[key]})"), video
    seen_paths[key] = n
    if not subject:
        return None, ("missing_subject_id", f"row {n}: subject_id is empty"), video
    empty = [x for x in (*labels, *sensitive) if not cells[idx[x]]]
    if empty:
        return None, ("missing_label", f"row {n}: label(s) {empty} empty"), video
    eyes = None
    if eye_cols:
        eyes, why = _parse_eyes([cells[idx[c]] for c in EYE_COLUMNS])
        if why:
            return None, ("bad_eye_points", f"row {n}: {why}"), video
    sequence = frame = None
    if sequences:
        sequence, frame, why = _parse_sequence([cells[idx[c]] for c in SEQUENCE_COLUMNS])
        if why:
            return None, ("bad_sequence", f"row {n}: {why}"), video
    if is_video(image):
        if sequence is not None:
            return None, ("bad_sequence", f"row {n}: a video file is a sequence by itself; leave its "
                                          "sequence and frame cells empty"), video
        video = True
    # Cheap early look (the lstat above, no link followed); the file is checked again when it is opened.
    if mode is None:
        return None, ("missing_file", f"{image!r} does not exist in the drop"), video
    if not stat.S_ISREG(mode) and not stat.S_ISLNK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        return None, ("not_regular_file", f"{image!r} is {kind}; list image files only"), video
    points = None
    if has_points and cells[idx[POINTS_COLUMN]]:
        # A named points file must be usable (like eye points: a bad value quarantines the record,
        # an empty cell means "none"): the steward said this face has landmarks.
        try:
            points = tuple(map(tuple, read_points(root, cells[idx[POINTS_COLUMN]]).tolist()))
        except RecordError as exc:
            return None, (exc.code, f"row {n}: {exc.message}"), video
    values = {"record_id": rid, "image": key, "subject_id": subject,
              **{x: cells[idx[x]] for x in (*labels, *sensitive)}}
    if eye_cols:
        values.update(zip(EYE_COLUMNS, (*eyes[0], *eyes[1]) if eyes else (None,) * 4))
    if has_points:
        values[POINTS_COLUMN] = None if points is None else [v for pt in points for v in pt]
    if sequences:
        values.update(sequence=sequence, frame=frame)
    return values, None, video


def _sensitive(root: Path, meta: dict, labels: Sequence[str], header: Sequence[str]) -> list[str]:
    """drop.yaml's ``sensitive`` columns, each present, none reserved and none a partition label.

    A label partitions k-Same-Select's clusters, so every member of a cluster shares it: linking a
    person to their cluster would reveal a sensitive value with certainty (the homogeneity attack).
    """
    value = meta.get("sensitive")
    if value is None:
        return []
    if isinstance(value, str):
        value = [s.strip() for s in value.split(",") if s.strip()]
    if not isinstance(value, list) or not all(isinstance(x, str) and x.strip() for x in value):
        raise DropError(f"{root / DROP_YAML}: 'sensitive' must be a list of column names, e.g. 'sensitive: "
                        f"[diagnosis]'; got {value!r}")
    value = list(dict.fromkeys(x.strip() for x in value))
    both = [x for x in value if x in labels]
    if both:
        raise ConfigError(f"{root / DROP_YAML}: sensitive column(s) {both} are also partition labels; a sensitive "
                          "column is never a partition label (every member of a cluster would share its value): "
                          f"remove {both} from 'labels' (or from --labels) or from 'sensitive'")
    bad = [x for x in value if x in RESERVED_COLUMNS]
    if bad:
        raise DropError(f"{root / DROP_YAML}: sensitive {bad} are reserved manifest columns; name other columns")
    absent = [x for x in value if x not in header]
    if absent:
        raise DropError(f"{root / MANIFEST}: sensitive column(s) {absent} declared in {DROP_YAML} are missing; found "
                        f"columns {list(header)}")
    return value


def _license(root: Path, meta: dict) -> str | None:
    """drop.yaml's ``license``: a licence id (cc-by-4.0, apache-2.0, other...), or None when absent."""
    value = meta.get("license")
    if value is None:
        return None
    if not isinstance(value, str) or not _LICENSE_ID.match(value.strip()):
        raise DropError(f"{root / DROP_YAML}: 'license' must be a licence id such as cc-by-4.0, cc-by-nc-4.0 or "
                        f"other (letters, digits, '.', '+', '-'; at most 64); got {value!r}")
    return value.strip()


# drop.yaml's attribution fields: (pattern, what it must be). license_name as the Hugging Face Hub expects it
# (an id, with license: other); license_link an address or a file of the release (e.g. LICENSE.md).
ATTRIBUTION_FIELDS = {
    "license_name": (re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}$"),
                     "a licence id such as my-licence-1.0 (letters, digits, '.', '+', '_', '-'; at most 64)"),
    "license_link": (re.compile(r"^(?:https?://[^\s<>\"]{1,490}|[A-Za-z0-9._/#-]{1,200})$"),
                     "an http(s) address or a file name such as LICENSE.md (no spaces)"),
    "citation": (re.compile(r"^[^\x00-\x08\x0b-\x1f]{1,4000}$", re.DOTALL),
                 "the text to cite the source by (1-4000 characters)"),
}


def _attribution(root: Path, meta: dict) -> dict[str, str]:
    """drop.yaml's ``license_name``, ``license_link`` and ``citation``: those set, each checked."""
    out = {}
    for key, (pattern, what) in ATTRIBUTION_FIELDS.items():
        value = meta.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not pattern.match(value.strip()):
            raise DropError(f"{root / DROP_YAML}: {key!r} must be {what}; got {value!r}")
        out[key] = value.strip()
    return out


def _dataset_name(root: Path, declared: object, drop_name: str) -> str:
    """The drop's dataset (its release lineage): ``dataset:`` as declared, else the drop's name made name-safe."""

    if declared is None:
        # A slug that starts and ends with a letter or digit ("../../x" gave "-..-x", an option-like name).
        safe = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", re.sub(r"[^A-Za-z0-9._-]+", "-", drop_name))[:128]
        return safe.rstrip("._-") or "drop"
    try:
        return check_dataset_name(str(declared) if isinstance(declared, str | int) else declared)
    except ConfigError as exc:
        raise DropError(f"{root / DROP_YAML}: {exc}") from None
