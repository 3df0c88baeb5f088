"""Leak checks on a would-be release: near-copies of original faces and metadata in image and video files."""
from __future__ import annotations

import fnmatch
import logging
import os
import re
import struct
import zlib
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np

from deid.errors import ConfigError

logger = logging.getLogger(__name__)

# Mean absolute difference (grey levels, 0..255) below which a released face counts as a
# copy of an original. Re-encoding or +-2 noise stays under it; blurring with sigma 1 px
# and every k-Same average of distinct people were measured well above it on London.
DEFAULT_THRESHOLD = 2.0
# Ancillary PNG chunks that can carry source metadata (text, EXIF, timestamps, profiles).
METADATA_CHUNKS = frozenset({b"tEXt", b"iTXt", b"zTXt", b"eXIf", b"tIME", b"iCCP"})
# Ancillary chunks that only describe how to display the pixels.
_HARMLESS = frozenset({b"gAMA", b"cHRM", b"sRGB", b"sBIT", b"pHYs", b"bKGD", b"tRNS", b"hIST", b"sPLT"})
_PNG = b"\x89PNG\r\n\x1a\n"


def mean_abs_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise mean absolute grey difference, in blocks (no full int16 copies).

    Two uint8 arrays take :func:`_abs_diff_u8` (max - min in uint8, summed as integers): the same float64
    values as the int16 mean (each row's sum is an exact integer either way, divided by the row's length
    once), ~8x less CPU (issue 32: every record of a release is measured in de-identify and in the gate).
    """
    out = np.empty(len(a), dtype=np.float64)
    a, b = np.asarray(a), np.asarray(b)
    u8 = a.dtype == np.uint8 and b.dtype == np.uint8 and a.ndim == 2
    step = 256 if u8 else 4096  # uint8 blocks of ~2 MB stay in cache
    for s in range(0, len(a), step):
        if u8:
            d = _abs_diff_u8(a[s:s + step], b[s:s + step])
            out[s:s + step] = d.sum(axis=1, dtype=_sum_type(d.shape[1])) / d.shape[1]
        else:
            out[s:s + 4096] = np.abs(a[s:s + 4096].astype(np.int16) - b[s:s + 4096].astype(np.int16)).mean(axis=1)
    return out


def _abs_diff_u8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b|`` of uint8 arrays (broadcast), exact, in uint8: ``max(a, b) - min(a, b)`` never wraps."""
    d = np.maximum(a, b)
    d -= np.minimum(a, b)
    return d


def _sum_type(values: int) -> type:
    """The integer type a row of ``values`` uint8 differences sums in without overflow (uint32: ~3x faster)."""
    return np.uint32 if values * 255 < 2 ** 32 else np.uint64


def nearest_original_distance(released: Any, originals: Any, *, threshold: float = DEFAULT_THRESHOLD
                              ) -> tuple[np.ndarray, float]:
    """Mean absolute pixel difference from every released face to its nearest original.

    A released face at distance 0 is byte-identical to an original aligned face; one below
    ``threshold`` is a near copy. Exact and blocked (O(m n p) integer work; 0.2 s for 204 x
    204 London faces).

    Parameters
    ----------
    released : array-like of shape (m, n_pixels), uint8
    originals : array-like of shape (n, n_pixels), uint8
    threshold : float, default 2.0
        Grey levels; returned unchanged so the report can state it.

    Returns
    -------
    distances : ndarray of shape (m,)
        Minimum over originals of the mean absolute pixel difference.
    threshold : float
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 255:
        raise ConfigError(f"threshold={threshold!r} must be a number in [0, 255) grey levels; e.g. {DEFAULT_THRESHOLD}")
    r, o = np.asarray(released), np.asarray(originals)
    for name, a in (("released", r), ("originals", o)):
        if a.ndim != 2 or a.shape[0] == 0:
            raise ConfigError(f"{name} has shape {a.shape}; it must be a non-empty (n_images, n_pixels) array")
    if r.shape[1] != o.shape[1]:
        raise ConfigError(f"released faces have {r.shape[1]} pixels but originals {o.shape[1]}; compare aligned faces of the same size")
    # Whole grey levels 0..255 as uint8: the same integer sums as int16 |r - o| (see mean_abs_difference).
    r = np.clip(np.rint(r), 0, 255).astype(np.uint8)
    o = np.clip(np.rint(o), 0, 255).astype(np.uint8)
    out = np.empty(len(r), dtype=np.float64)
    block = max(1, 2_000_000 // o.size)
    for s in range(0, len(r), block):
        d = _abs_diff_u8(r[s:s + block, None, :], o[None, :, :]).sum(axis=2, dtype=_sum_type(r.shape[1]))
        out[s:s + block] = d.min(axis=1) / r.shape[1]
    return out, float(threshold)


def near_copy_check(released: Any, originals: Any, *, threshold: float = DEFAULT_THRESHOLD) -> dict:
    """Summary of :func:`nearest_original_distance` for the gate and the report.

    Returns
    -------
    dict
        ``passed`` (no identical face and none below the threshold), ``identical``,
        ``below_threshold``, ``min_distance``, ``threshold``.
    """
    d, t = nearest_original_distance(released, originals, threshold=threshold)
    identical = int(np.count_nonzero(d == 0))
    below = int(np.count_nonzero(d < t))
    return {"passed": identical == 0 and below == 0, "identical": identical, "below_threshold": below,
            "min_distance": float(d.min()), "threshold": t}


def png_has_metadata(data: bytes) -> list[str]:
    """Names of the PNG chunks in ``data`` that can carry metadata, or other problems.

    Lists every ``tEXt``, ``iTXt``, ``zTXt``, ``eXIf``, ``tIME``, ``iCCP`` chunk, any
    unknown ancillary chunk (``"unknown ancillary chunk xxXx"``), bytes after ``IEND``
    (``"data after IEND"``) and a CRC mismatch; an empty list means clean.

    Raises
    ------
    ConfigError
        When ``data`` is not a PNG (the release writes PNG only).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ConfigError(f"data must be the bytes of a PNG file; got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(_PNG):
        raise ConfigError(f"data is not a PNG (first bytes {data[:8].hex()}); release images must be PNG")
    found: list[str] = []
    pos = len(_PNG)
    while pos + 8 <= len(data):
        length, ctype = struct.unpack(">I4s", data[pos:pos + 8])
        end = pos + 12 + length
        if end > len(data):
            found.append(f"truncated chunk {ctype.decode('latin-1')}")
            return found
        if zlib.crc32(data[pos + 4:pos + 8 + length]) != struct.unpack(">I", data[end - 4:end])[0]:
            found.append(f"bad CRC in chunk {ctype.decode('latin-1')}")
        if ctype in METADATA_CHUNKS:
            found.append(ctype.decode("latin-1"))
        elif ctype[0:1].islower() and ctype not in _HARMLESS:  # lower-case first letter = ancillary
            found.append(f"unknown ancillary chunk {ctype.decode('latin-1')}")
        pos = end
        if ctype == b"IEND":
            if pos < len(data):
                found.append("data after IEND")
            return found
    found.append("no IEND chunk")
    return found


# RIFF chunks an AVI of pixels needs (headers, stream format, OpenDML indexes, frames, index);
# anything else (the INFO list: ISFT encoder, INAM title, ICMT comment, IDIT date...; strn stream
# names; unknown chunks) can carry text and is reported.
_AVI_LISTS = frozenset({b"hdrl", b"strl", b"movi", b"odml", b"rec "})
_AVI_CHUNKS = frozenset({b"avih", b"strh", b"strf", b"indx", b"dmlh", b"idx1", b"JUNK"})
# Placeholders FFmpeg leaves in JUNK (reserved OpenDML index space): ids, not text.
_JUNK_TOKENS = (b"odml", b"dmlh", b"indx", b"ix00", b"00dc", b"00db")
_TEXT = re.compile(rb"[\x20-\x7e]{6,}")


def _frame_chunk(cid: bytes) -> bool:
    """``00dc``/``00db`` (stream 0 compressed/uncompressed video), ``ix00`` (OpenDML field index)."""
    return (cid[:2].isdigit() and cid[2:] in (b"dc", b"db")) or (cid[:2] == b"ix" and cid[2:].isdigit())


def jpeg_segments(data: bytes) -> Iterator[tuple[int, int, int]]:
    """``(marker, body start, body end)`` of each segment of a JPEG before its scan data.

    A structural problem is reported as marker -1 (and ends the walk).
    """
    if not data.startswith(b"\xff\xd8"):
        yield -1, 0, 0
        return
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            yield -1, pos, pos
            return
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        if marker in (0xDA, 0xD9):  # start of scan / end of image: no metadata after this
            return
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        yield marker, pos + 4, pos + 2 + length
        pos += 2 + length


def jpeg_has_metadata(data: bytes) -> list[str]:
    """Metadata segments of one JPEG (a Motion-JPEG frame) before its scan data.

    ``APP0`` JFIF/AVI1 headers describe the pixels; every other ``APPn`` (EXIF, XMP, ICC, ...)
    and a ``COM`` comment with any non-zero byte (FFmpeg writes its encoder version there) are
    reported by name.
    """
    found: list[str] = []
    for marker, start, end in jpeg_segments(data):
        body = data[start:end]
        if marker < 0:
            found.append("frame is not a well-formed JPEG")
        elif marker == 0xFE and any(body):
            found.append("JPEG COM " + body.rstrip(b"\x00").decode("latin-1")[:40])
        elif 0xE1 <= marker <= 0xEF or (marker == 0xE0 and not body.startswith((b"JFIF", b"AVI1"))):
            found.append(f"JPEG APP{marker - 0xE0}")
    return found


def avi_chunks(data: bytes) -> Iterator[tuple[bytes, bytes | None, int, int, bool]]:
    """Every RIFF chunk of an AVI: ``(id, list kind or None, start, end, inside movi)``.

    ``start`` is the chunk header's offset, ``end`` the end of its payload. The lists an AVI of
    pixels has (``hdrl``, ``strl``, ``movi``, ``odml``, ``rec``) are walked into; others are
    yielded whole. OpenDML ``AVIX`` extensions after the first RIFF are walked too; a chunk that
    runs past its parent is yielded with id ``b"!trunc"``, bytes after the RIFFs as ``b"!tail"``.
    """
    def walk(pos: int, end: int, in_movi: bool):
        while pos + 8 <= end:
            cid = data[pos:pos + 4]
            size = int.from_bytes(data[pos + 4:pos + 8], "little")
            stop = pos + 8 + size
            if stop > end:
                yield b"!trunc", cid, pos, end, in_movi
                return
            kind = data[pos + 8:pos + 12] if cid == b"LIST" else None
            yield cid, kind, pos, stop, in_movi
            if kind in _AVI_LISTS:
                yield from walk(pos + 12, stop, kind in (b"movi", b"rec "))
            pos = stop + (size & 1)

    pos = 0
    while pos + 12 <= len(data) and data[pos:pos + 4] == b"RIFF":  # AVI, then OpenDML AVIX extensions
        size = int.from_bytes(data[pos + 4:pos + 8], "little")
        yield from walk(pos + 12, min(pos + 8 + size, len(data)), False)
        pos += 8 + size + (size & 1)
    if pos < len(data) and any(data[pos:]):
        yield b"!tail", None, pos, len(data), False


def avi_has_metadata(data: bytes) -> list[str]:
    """Chunks of an AVI (the release's Motion-JPEG videos) that can carry metadata; empty means clean.

    Lists every chunk outside the headers, stream formats, indexes and frames an AVI of pixels
    needs (:func:`avi_chunks`: the ``INFO`` list with FFmpeg's ``ISFT`` encoder tag, titles,
    comments, dates; ``strn`` stream names; unknown chunks), readable text in ``JUNK`` padding,
    bytes after the RIFF, and each frame's :func:`jpeg_has_metadata` (de-duplicated).

    Raises
    ------
    ConfigError
        When ``data`` is not a RIFF AVI (the release writes AVI only).
    """
    data = bytes(data)
    if not (data[:4] == b"RIFF" and data[8:12] == b"AVI "):
        raise ConfigError(f"data is not an AVI (first bytes {data[:12].hex()}); release videos must be AVI")
    found: dict[str, None] = {}
    for cid, kind, start, end, in_movi in avi_chunks(data):
        if cid == b"!trunc":
            found[f"truncated chunk {kind.decode('latin-1')}"] = None
        elif cid == b"!tail":
            found["data after the RIFF"] = None
        elif kind is not None:
            if kind not in _AVI_LISTS:
                found[f"LIST {kind.decode('latin-1')}"] = None
        elif in_movi and _frame_chunk(cid):
            if cid[2:] == b"dc":
                found.update(dict.fromkeys(jpeg_has_metadata(data[start + 8:end])))
        elif cid not in _AVI_CHUNKS:
            found[f"chunk {cid.decode('latin-1')}"] = None
        elif cid == b"JUNK":
            body = data[start + 8:end]
            for token in _JUNK_TOKENS:
                body = body.replace(token, b"\x00" * 4)
            if _TEXT.search(body):
                found["text in JUNK"] = None
    return list(found)


def release_files_metadata(release_dir: str | Path, *, pattern: str = "images/*.png",
                           videos: str = "videos/*.avi",
                           digests: Mapping[str, tuple[str, int]] | None = None) -> dict[str, list[str]]:
    """:func:`png_has_metadata` for every release image and :func:`avi_has_metadata` for every video.

    Only files with findings are returned. ``digests`` (path -> (sha256, bytes) as the files were
    written) lets files of identical content be read and checked once: the members of a k-Same
    cluster share one PNG. A file not listed, or whose size differs, is checked on its own.
    """
    root = Path(release_dir)
    if not root.is_dir():
        raise ConfigError(f"release_dir={str(root)!r} is not a directory")
    known = digests or {}
    out: dict[str, list[str]] = {}
    for glob, check in ((pattern, png_has_metadata), (videos, avi_has_metadata)):
        by_content: dict[tuple[str, int], list[str]] = {}
        for rel in _matching(root, glob):
            path, got = root / rel, known.get(rel)
            if got is None or os.stat(path).st_size != got[1]:
                found = check(path.read_bytes())
            elif (found := by_content.get(got)) is None:
                found = by_content[got] = check(path.read_bytes())
            if found:
                out[rel] = list(found)
    return out


def _matching(root: Path, pattern: str) -> list[str]:
    """Paths under ``root`` matching ``folder/name-glob`` (one level), sorted; one directory scan, no Path per file."""
    folder, _, name_glob = pattern.rpartition("/")
    where = root / folder if folder else root
    if not where.is_dir():
        return []
    prefix = f"{folder}/" if folder else ""
    return sorted(prefix + e.name for e in os.scandir(where) if e.is_file() and fnmatch.fnmatchcase(e.name, name_glob))


# --------------------------------------------------------------------------- feature vectors

# A released feature vector closer to an original than this fraction of the median distance
# from an original to the nearest record of another person is a near copy: as close as the
# identity check's near-duplicate rule (deid.anonymise.identity.NEAR_DUPLICATE_RATIO), the
# distance at which two records are taken to be one face.
FEATURE_NEAR_COPY_RATIO = 0.2


def vector_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise Euclidean distance between two (n, d) matrices of feature vectors, in blocks."""
    out = np.empty(len(a), dtype=np.float64)
    for s in range(0, len(a), 4096):
        diff = np.asarray(a[s:s + 4096], dtype=np.float64) - np.asarray(b[s:s + 4096], dtype=np.float64)
        out[s:s + 4096] = np.sqrt(np.einsum("ij,ij->i", diff, diff))
    return out


def _min_sq_dist(a: np.ndarray, b: np.ndarray, mask_same=None) -> np.ndarray:
    from deid.evaluation.attackers import _sq_dist  # noqa: PLC0415

    out = np.empty(len(a), dtype=np.float64)
    block = max(1, 4_000_000 // max(1, len(b)))
    for s in range(0, len(a), block):
        d = _sq_dist(a[s:s + block], b)
        if mask_same is not None:
            d[mask_same(s, s + len(d))] = np.inf
        out[s:s + block] = d.min(axis=1)
    return out


def nearest_vector_distance(released: Any, originals: Any) -> np.ndarray:
    """Euclidean distance from every released vector to its nearest original vector (exact, blocked)."""
    r = np.asarray(released, dtype=np.float64)
    o = np.asarray(originals, dtype=np.float64)
    for name, a in (("released", r), ("originals", o)):
        if a.ndim != 2 or a.shape[0] == 0:
            raise ConfigError(f"{name} has shape {a.shape}; it must be a non-empty (n_records, n_features) array")
    if r.shape[1] != o.shape[1]:
        raise ConfigError(f"released vectors have {r.shape[1]} features but originals {o.shape[1]}; compare "
                          "vectors of the same dimension")
    return np.sqrt(np.maximum(_min_sq_dist(r, o), 0.0))


def other_person_scale(originals: Any, people: Any) -> float | None:
    """Median over originals of the Euclidean distance to the nearest record of another person.

    The typical distance between different people in the feature space, which the feature
    leak threshold is a fraction of; None when fewer than two people are given.
    """
    o = np.asarray(originals, dtype=np.float64)
    codes = np.unique(np.asarray(people, dtype=object).astype(str), return_inverse=True)[1].ravel()
    if len(np.unique(codes)) < 2:
        return None
    d = _min_sq_dist(o, o, mask_same=lambda s, e: codes[s:e, None] == codes[None, :])
    return float(np.median(np.sqrt(np.maximum(d, 0.0))))
