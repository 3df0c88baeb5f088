"""Landmark points files named by the manifest's optional ``points`` column.

One file per image, (x, y) landmarks in the source image's pixels (origin top-left, the
same coordinates as the eye columns), in a fixed order shared by every file of the drop
(landmark ``i`` is the same feature on every face): k-Same-M builds its mean shape from
them (:class:`deid.anonymise.methods_ksame.KSameM`). Formats, by file suffix:

* ``.tem`` (Face Research Lab / Psychomorph template, as the London set ships it): first line
  ``N``, then ``N`` lines ``x<TAB>y``; what follows (line definitions) is ignored;
* ``.json``: ``[[x, y], ...]`` or ``{"points": [[x, y], ...]}``;
* ``.pts`` (ibug 300-W): ``version: 1``, ``n_points: N``, ``{``, N lines ``x y``, ``}``;
* anything else: one ``x y`` (or ``x,y``) pair per line; blank lines and ``#`` comments skipped.
"""
from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath

import numpy as np

from deid.errors import RecordError
from deid.intake.drop_files import read_drop_file

POINTS_COLUMN = "points"
MIN_POINTS = 3  # a triangle: fewer cannot carry a shape
MAX_POINTS = 10_000
MAX_BYTES = 1 << 20  # a 10,000-point text file is ~150 kB


def _bad(name: str, why: str) -> RecordError:
    return RecordError("bad_points", f"points file {name!r}: {why}")


def _pair(text: str, name: str, where: str) -> tuple[float, float]:
    cells = text.replace(",", " ").split()
    if len(cells) < 2:
        raise _bad(name, f"{where} is {text.strip()!r}, not an 'x y' pair")
    try:
        return float(cells[0]), float(cells[1])
    except ValueError:
        raise _bad(name, f"{where} is {text.strip()!r}, not two numbers") from None


def _tem(lines: list[str], name: str) -> list[tuple[float, float]]:
    try:
        n = int(lines[0].strip())
    except (ValueError, IndexError):
        raise _bad(name, "a .tem file starts with the number of points N on its own line") from None
    if not MIN_POINTS <= n <= MAX_POINTS or len(lines) < n + 1:
        raise _bad(name, f"declares {n} points but has {len(lines) - 1} further lines (need {MIN_POINTS}..{MAX_POINTS})")
    return [_pair(lines[i + 1], name, f"line {i + 2}") for i in range(n)]


def _pts(lines: list[str], name: str) -> list[tuple[float, float]]:
    try:
        start, end = lines.index("{"), lines.index("}")
    except ValueError:
        raise _bad(name, "a .pts file holds its points between '{' and '}' lines") from None
    return [_pair(s, name, f"line {start + 2 + i}") for i, s in enumerate(lines[start + 1:end])]


def _json(text: str, name: str) -> list[tuple[float, float]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(name, f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, dict):
        data = data.get("points")
    if not isinstance(data, list):
        raise _bad(name, 'JSON points must be [[x, y], ...] or {"points": [[x, y], ...]}')
    out = []
    for i, p in enumerate(data):
        if not (isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, (int, float)) and
                                                                      not isinstance(v, bool) for v in p)):
            raise _bad(name, f"point {i} is {p!r}, not an [x, y] pair of numbers")
        out.append((float(p[0]), float(p[1])))
    return out


def parse_points(data: bytes, name: str) -> np.ndarray:
    """The (n, 2) float64 landmarks of one points file's bytes; ``name`` picks the format by suffix.

    Raises
    ------
    RecordError
        ``bad_points``: not UTF-8 text, too large, malformed, fewer than 3 or more than 10,000
        points, or a coordinate that is not finite.
    """
    if len(data) > MAX_BYTES:
        raise _bad(name, f"{len(data)} bytes is above the {MAX_BYTES}-byte limit for a points file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _bad(name, "not UTF-8 text") from None
    suffix = PurePosixPath(name).suffix.lower()
    lines = [s.strip() for s in text.splitlines()]
    if suffix == ".json":
        pts = _json(text, name)
    elif suffix == ".tem":
        pts = _tem(lines, name)
    elif suffix == ".pts":
        pts = _pts(lines, name)
    else:
        pts = [_pair(s, name, f"line {i + 1}") for i, s in enumerate(lines) if s and not s.startswith("#")]
    if not MIN_POINTS <= len(pts) <= MAX_POINTS:
        raise _bad(name, f"has {len(pts)} points; give {MIN_POINTS} to {MAX_POINTS} (x, y) landmarks")
    if not all(math.isfinite(v) for p in pts for v in p):
        raise _bad(name, "has a coordinate that is not a finite number")
    return np.asarray(pts, dtype=np.float64)


def read_points(root: Path, relative: str) -> np.ndarray:
    """Read and parse the points file ``relative`` inside the drop ``root`` (no symlink followed).

    A file that does not exist is ``missing_points_file``; every other problem is ``bad_points``
    (an unsafe path, a non-regular or unreadable file, or a parse error of :func:`parse_points`).
    """
    try:
        data = read_drop_file(root, relative)
    except RecordError as exc:
        code = "missing_points_file" if exc.code == "missing_file" else "bad_points"
        raise RecordError(code, f"points file: {exc.message}") from None
    return parse_points(data, relative)


def write_points(path: Path, points: np.ndarray) -> Path:
    """Write (n, 2) landmarks as ``{"points": [[x, y], ...]}`` JSON (2 decimals), e.g. for synthetic drops."""
    pts = np.asarray(points, dtype=np.float64)
    path.write_text(json.dumps({"points": [[round(float(x), 2), round(float(y), 2)] for x, y in pts]}))
    return path
