"""The release's file list as columns, and its signed file manifest (issue 13: a million images).

A release of a million faces holds a million image files. Their (path, sha256, size) are kept as
three columns (:class:`ReleaseFiles`: an Arrow string array and two NumPy arrays, ~70 bytes a
file), never as one Python object per file, built from the digests computed as the images were
written. They are written into the release once, as ``MANIFEST.sha256``: one line
``<sha256 hex>  <path>`` per image, sorted by path, the format of ``sha256sum`` (so
``sha256sum -c MANIFEST.sha256`` in the release directory checks every image without deid). The
signed report lists every *other* release file as before (the tables, the card, the manifest
itself) and describes the manifest (:class:`~deid.release.hashing.FileManifest`: its sha256, line
count and the images' total size), so the Ed25519 signature covers every released byte while the
report stays a few kilobytes; ``deid verify`` checks the signature, then the manifest's hash, then
streams the manifest (:func:`read_manifest`) to check every image and that no other file exists.

The manifest holds only the images' release paths (random names, as in ``release.csv``), sorted:
no subject id, source path or input order.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from deid.errors import DataError, StateError
from deid.release.hashing import Artifact, FileManifest, hash_file, iter_tree

logger = logging.getLogger(__name__)

__all__ = ["COVERS", "MANIFEST_NAME", "ReleaseFiles", "ReleaseListing", "list_release", "read_manifest",
           "safe_release_path"]

MANIFEST_NAME = "MANIFEST.sha256"
# The directories the manifest lists (one file per released record); every other file is in the report.
COVERS = ("images/",)
_CHUNK = 1 << 16
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_LINE = re.compile(rb"([0-9a-f]{64})  ([^\r\n\\\x00]+)\n")
# The report schema's rule for a release path: relative, no '.' or '..' segment, no '//', no backslash.
_SAFE = re.compile(r"(?!/)(?!.*//)(?!(.*/)?\.\.?(/|$))[^\\\x00\r\n]+(?<!/)")


def safe_release_path(path: str) -> bool:
    """True when ``path`` is a release-relative POSIX path a manifest may list (the report schema's path rule)."""
    return _SAFE.fullmatch(path) is not None


def _hex(sha: np.ndarray) -> list[str]:
    """(m, 32) uint8 digests as m lowercase hex strings."""
    text = np.empty((len(sha), 64), np.uint8)
    text[:, 0::2], text[:, 1::2] = _HEX[sha >> 4], _HEX[sha & 15]
    return [h.decode("ascii") for h in text.view("S64").ravel().tolist()]


def sort_paths(paths) -> tuple[pa.Array, np.ndarray]:
    """``paths`` (Arrow or a sequence of str) as one sorted Arrow string array, and the order that sorts them."""
    if isinstance(paths, pa.ChunkedArray):
        paths = paths.combine_chunks()
    if not isinstance(paths, pa.Array):
        paths = pa.array(list(paths), pa.string())
    paths = paths.cast(pa.string())
    order = pc.sort_indices(paths)
    return paths.take(order), order.to_numpy()


def _fixed_width(paths: pa.Array, width: int | None = None) -> np.ndarray:
    """UTF-8 ``paths`` as one NumPy fixed-width bytes array (``width``: the longest, unless given), a chunk at a time."""
    n = len(paths)
    if width is None:
        width = max(1, int(pc.max(pc.binary_length(paths)).as_py() or 1)) if n else 1
    out = np.empty(n, f"S{width}")
    for s in range(0, n, _CHUNK):
        out[s:s + _CHUNK] = paths.slice(s, _CHUNK).cast(pa.binary()).to_pylist()
    return out


@dataclass(frozen=True, eq=False)  # arrays: compare with to_table().equals
class ReleaseFiles:
    """(path, sha256, size) of many release files as columns, sorted by path (each path once).

    ``paths``: Arrow string array of release-relative POSIX paths; ``sha256``: (n, 32) uint8 raw
    digests; ``sizes``: (n,) int64 bytes. About 70 bytes a file for ``images/<16 hex>.png``
    (a million images: ~70 MB), where a Python object per file cost ~1 KB.
    """

    paths: pa.Array
    sha256: np.ndarray
    sizes: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.paths)
        if self.sha256.shape != (n, 32) or self.sha256.dtype != np.uint8 or self.sizes.shape != (n,):
            raise ValueError(f"ReleaseFiles needs sha256 of shape ({n}, 32) uint8 and sizes of shape ({n},); got "
                             f"{self.sha256.shape} {self.sha256.dtype} and {self.sizes.shape}")

    @classmethod
    def empty(cls) -> ReleaseFiles:
        return cls(pa.array([], pa.string()), np.zeros((0, 32), np.uint8), np.zeros(0, np.int64))

    @classmethod
    def from_columns(cls, paths, sha256: np.ndarray, sizes: np.ndarray) -> ReleaseFiles:
        """Sort parallel columns by path; raises :class:`~deid.errors.StateError` when a path repeats."""
        paths, order = sort_paths(paths)
        return cls.from_sorted(paths, np.ascontiguousarray(np.asarray(sha256, np.uint8)[order]),
                               np.asarray(sizes, np.int64)[order])

    @classmethod
    def from_sorted(cls, paths: pa.Array, sha256: np.ndarray, sizes: np.ndarray) -> ReleaseFiles:
        """Columns already in path order (:func:`sort_paths`), kept as they are (no copy); raises
        :class:`~deid.errors.StateError` when a path is not after the one before it (repeated or unsorted)."""
        if len(paths) > 1 and not pc.all(pc.greater(paths.slice(1), paths.slice(0, len(paths) - 1))).as_py():
            raise StateError("release files are not sorted by path or one is listed twice; every released file "
                             "must be written once")
        return cls(paths, sha256, np.asarray(sizes, np.int64))

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def rows(self, chunk: int = _CHUNK) -> Iterator[tuple[str, str, int]]:
        """(path, sha256 hex, bytes) of each file in path order, converted a chunk at a time."""
        for s in range(0, len(self), chunk):
            e = min(s + chunk, len(self))
            yield from zip(self.paths.slice(s, e - s).to_pylist(), _hex(self.sha256[s:e]),
                           self.sizes[s:e].tolist())

    def to_table(self) -> pa.Table:
        """The columns as an Arrow table (path string, sha256 fixed_size_binary[32], bytes int64)."""
        sha = pa.FixedSizeBinaryArray.from_buffers(pa.binary(32), len(self),
                                                   [None, pa.py_buffer(self.sha256.tobytes())])
        return pa.table({"path": self.paths, "sha256": sha, "bytes": pa.array(self.sizes, pa.int64())})

    def known(self) -> Mapping[str, tuple[str, int]]:
        """A read-only mapping path -> (sha256 hex, bytes), looked up by bisection (no dict of every path)."""
        return _Known(self)

    def write_manifest(self, path: Path, *, covers: tuple[str, ...] = COVERS) -> tuple[FileManifest, Artifact]:
        """Write the ``sha256sum`` manifest to ``path`` (atomically), streaming; its report entry and its artifact."""
        path = Path(path)
        bad = self._first_bad(covers)
        if bad is not None:
            raise StateError(f"release file {bad!r} cannot be listed in {path.name}: a manifest lists relative "
                             f"paths under {list(covers)} without newline, backslash, '.' or '..' segments")
        digest, size = hashlib.sha256(), 0
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                for s in range(0, len(self), _CHUNK):
                    e = min(s + _CHUNK, len(self))
                    names = self.paths.slice(s, e - s).to_pylist()
                    block = "".join(f"{h}  {p}\n" for h, p in zip(_hex(self.sha256[s:e]), names)).encode("utf-8")
                    fh.write(block)
                    digest.update(block)
                    size += len(block)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        sha = digest.hexdigest()
        return (FileManifest(path=path.name, sha256=sha, files=len(self), bytes=self.total_bytes, covers=covers),
                Artifact(path.name, sha, size))

    def _first_bad(self, covers: tuple[str, ...]) -> str | None:
        for s in range(0, len(self), _CHUNK):
            for p in self.paths.slice(s, min(_CHUNK, len(self) - s)).to_pylist():
                if not safe_release_path(p) or not p.startswith(covers):
                    return p
        return None


class _Known(Mapping):
    """path -> (sha256 hex, bytes) over a :class:`ReleaseFiles`, by bisection in its sorted paths.

    The paths are held once more, as fixed-width bytes (one NumPy array: ~27 MB for a million images).
    """

    def __init__(self, files: ReleaseFiles):
        self.files = files
        self._keys = _fixed_width(files.paths)
        self.width = self._keys.dtype.itemsize
        self._next = 0

    def _index(self, path: str) -> int:
        key = path.encode("utf-8") if isinstance(path, str) else None
        if key is None or len(key) > self.width or b"\x00" in key:
            raise KeyError(path)
        i = self._next  # callers often walk the paths in order (a sorted directory listing): try the next one first
        if i >= len(self._keys) or self._keys[i] != key:
            i = int(np.searchsorted(self._keys, key))
            if i == len(self._keys) or self._keys[i] != key:
                raise KeyError(path)
        self._next = i + 1
        return i

    def __getitem__(self, path: str) -> tuple[str, int]:
        i = self._index(path)
        return self.files.sha256[i].tobytes().hex(), int(self.files.sizes[i])

    def __contains__(self, path: object) -> bool:
        try:
            self._index(path)  # type: ignore[arg-type]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        for s in range(0, len(self.files), _CHUNK):
            yield from self.files.paths.slice(s, _CHUNK).to_pylist()

    def __len__(self) -> int:
        return len(self.files)


@dataclass(frozen=True)
class ReleaseListing:
    """What the signed report says about a release's files: every file outside the manifest's directories
    (the manifest included) one by one, and the manifest (a few kilobytes, whatever the release's size)."""

    artifacts: tuple[Artifact, ...]
    manifest: FileManifest


def list_release(root: Path, *, known: ReleaseFiles | None = None,
                 covers: tuple[str, ...] = COVERS) -> tuple[ReleaseFiles, ReleaseListing]:
    """Scan a (staged) release, write its ``MANIFEST.sha256`` and return its files and its report listing.

    Every regular file under ``covers`` goes into the manifest (:class:`ReleaseFiles`); every other
    file is hashed and listed in ``artifacts``, with the manifest. ``known``: digests computed as
    the files were written (:attr:`deid.release.publish.StagedRelease.images`); a file listed there
    with the size on disk is not read again. The tree is scanned a chunk of names at a time into
    Arrow arrays (no Python object kept per file). Refuses symlinks and special files.
    """
    root = Path(root)
    if not root.is_dir():
        raise StateError(f"release directory {root} does not exist or is not a directory")
    found = _as_known(root, known, covers) if known is not None and len(known) else None
    if found is not None:
        files, small = known, found
    else:
        files, small = _scan(root, known, covers)
    manifest, manifest_artifact = files.write_manifest(root / MANIFEST_NAME, covers=covers)
    artifacts = sorted([*(Artifact(rel, *hash_file(Path(p))) for rel, p in small), manifest_artifact],
                       key=lambda a: a.path)
    return files, ReleaseListing(tuple(artifacts), manifest)


def _as_known(root: Path, known: ReleaseFiles, covers: tuple[str, ...]) -> list[tuple[str, str]] | None:
    """The files outside ``covers`` (relative path, path), when the regular files under ``covers`` are exactly
    ``known``'s, with its sizes; None otherwise (or on a symlink or special file: the full scan says which).

    Each chunk of names found on disk is looked up in ``known``'s sorted paths (fixed-width bytes, one
    array): nothing is kept per file but one bit (seen), so the check costs ~30 MB at a million images.
    """
    keys = _fixed_width(known.paths)
    width = keys.dtype.itemsize
    seen = np.zeros(len(keys), bool)
    small: list[tuple[str, str]] = []
    names: list[bytes] = []
    sizes: list[int] = []

    def check() -> bool:
        if any(len(b) > width for b in names):
            return False
        got = np.array(names, dtype=f"S{width}")
        idx = np.minimum(np.searchsorted(keys, got), len(keys) - 1)
        ok = (keys[idx] == got) & (known.sizes[idx] == np.asarray(sizes, np.int64)) & ~seen[idx]
        seen[idx] = True
        names.clear()
        sizes.clear()
        return bool(ok.all())

    for rel, entry, regular in iter_tree(root):
        if not regular:
            return None
        if rel.startswith(covers):
            names.append(rel.encode("utf-8"))
            sizes.append(entry.stat(follow_symlinks=False).st_size)
            if len(names) >= _CHUNK and not check():
                return None
        elif rel != MANIFEST_NAME:
            small.append((rel, entry.path))
    if names and not check():
        return None
    return small if seen.all() else None


def _scan(root: Path, known: ReleaseFiles | None,
          covers: tuple[str, ...]) -> tuple[ReleaseFiles, list[tuple[str, str]]]:
    """Every regular file under ``covers`` as columns (hashed unless ``known`` has it, same size), and the others."""
    names: list[pa.Array] = []
    sizes: list[np.ndarray] = []
    buf_names: list[str] = []
    buf_sizes: list[int] = []
    small: list[tuple[str, str]] = []
    special: list[str] = []
    for rel, entry, regular in iter_tree(root):
        if not regular:
            special.append(rel)
        elif rel.startswith(covers):
            buf_names.append(rel)
            buf_sizes.append(entry.stat(follow_symlinks=False).st_size)
            if len(buf_names) >= _CHUNK:
                names.append(pa.array(buf_names, pa.string()))
                sizes.append(np.asarray(buf_sizes, np.int64))
                buf_names, buf_sizes = [], []
        elif rel != MANIFEST_NAME:
            small.append((rel, entry.path))
    if special:
        raise StateError(f"release directory {root} contains symlinks or special files {sorted(special)[:5]}; a "
                         "release must hold only regular files (copy the data instead of linking it)")
    names.append(pa.array(buf_names, pa.string()))
    sizes.append(np.asarray(buf_sizes, np.int64))
    del buf_names, buf_sizes
    paths, order = sort_paths(pa.chunked_array(names, pa.string()))
    del names
    size = np.concatenate(sizes)[order]
    del sizes, order
    return ReleaseFiles(paths, _digests(root, paths, size, known), size), small


def _digests(root: Path, paths: pa.Array, sizes: np.ndarray, known: ReleaseFiles | None) -> np.ndarray:
    """(n, 32) sha256 of the files ``paths`` (sorted), from ``known`` where it lists the path with that size."""
    n = len(paths)
    sha = np.empty((n, 32), np.uint8)
    hit = np.zeros(n, bool)
    if known is not None and len(known) and n:
        if len(known) == n and known.paths.equals(paths):
            idx = np.arange(n)
        else:
            idx = pc.index_in(paths, value_set=known.paths).fill_null(-1).to_numpy(zero_copy_only=False)
        hit = idx >= 0
        hit[hit] = known.sizes[idx[hit]] == sizes[hit]
        sha[hit] = known.sha256[idx[hit]]
    todo = np.flatnonzero(~hit)
    if len(todo):
        logger.info("hashing %d release file(s) not hashed as they were written", len(todo))
    for i in todo.tolist():
        digest, _ = hash_file(root / paths[i].as_py())
        sha[i] = np.frombuffer(bytes.fromhex(digest), np.uint8)
    return sha


def read_manifest(path: Path) -> Iterator[tuple[str, str]]:
    """(sha256 hex, path) of each line of a manifest, streaming; raises :class:`~deid.errors.DataError`
    naming the line that is not ``<64 lowercase hex>  <path>``, or a path that is unsafe or not after
    the previous one (the manifest is sorted, each path once)."""
    prev: str | None = None
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            m = _LINE.fullmatch(line)
            try:
                rel = m.group(2).decode("utf-8") if m else None
            except UnicodeDecodeError:
                rel = None
            if rel is None or not safe_release_path(rel):
                raise DataError(f"{Path(path).name} line {lineno} is not '<sha256 hex>  <relative path>': "
                                f"{line[:120]!r}")
            if prev is not None and rel <= prev:
                raise DataError(f"{Path(path).name} line {lineno}: {rel!r} is not after {prev!r}; a manifest lists "
                                "each path once, sorted")
            prev = rel
            yield m.group(1).decode("ascii"), rel
