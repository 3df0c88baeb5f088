"""Synthetic recordings as real video files: the talking/smiling people of :mod:`deid.intake.synth_sequences`.

Each person gets ``recordings`` videos of ``seconds`` x ``fps`` frames: the face of
:func:`~deid.intake.synth_sequences.draw_sequence` (its small head motion, talking mouth or
smile) pasted on a plain canvas of ``width`` x ``height``. The containers cycle through
:data:`CONTAINERS` (AVI/MJPEG, MP4 and MOV with MPEG-4 part 2, WebM/VP8: what the installed
OpenCV writes; H.264 it does not). Each manifest row names one video with ``subject_id`` and the
labels ``gender`` and ``expression`` (``talk`` or ``smile``: the recording's kind).

With ``extras`` two more recordings test tracking: ``two-faces`` (person 1 and a stranger who
is in no manifest row, side by side, the stranger entering after the first frames, so the
subject's track exists) and ``face-leaves`` (person 2 slides out of the frame for the middle
third, then comes back).
"""
from __future__ import annotations

import csv
import logging
from pathlib import Path

import numpy as np
import yaml

from deid.errors import ConfigError
from deid.intake.synth import check_int
from deid.intake.synth_face import make_person
from deid.intake.synth_sequences import SEQUENCE_KINDS, draw_sequence
from deid.intake.video import write_video

log = logging.getLogger(__name__)

CONTAINERS: tuple[tuple[str, str], ...] = ((".avi", "MJPG"), (".mp4", "mp4v"), (".webm", "VP80"), (".mov", "mp4v"))
COLUMNS = ("image", "subject_id", "gender", "expression")
STRANGER = 10_000  # the person number of the unlisted second face


def _canvas(width: int, height: int) -> np.ndarray:
    """A plain, slightly graded backdrop (no face-like texture for the detector)."""
    ramp = np.linspace(150, 185, width, dtype=np.float32)[None, :, None]
    return np.broadcast_to(ramp, (height, width, 3)).astype(np.uint8).copy()


def _paste(canvas: np.ndarray, face: np.ndarray, x: int, y: int) -> None:
    """Paste ``face`` with its top-left at (x, y), clipped to the canvas."""
    h, w = face.shape[:2]
    H, W = canvas.shape[:2]
    x0, y0, x1, y1 = max(0, x), max(0, y), min(W, x + w), min(H, y + h)
    if x0 < x1 and y0 < y1:
        canvas[y0:y1, x0:x1] = face[y0 - y:y1 - y, x0 - x:x1 - x]


def recording_frames(seed: int, number: int, index: int, *, frames: int, width: int, height: int,
                     variant: str = "plain"):
    """The BGR frames of recording ``index`` of person ``number`` (``variant``: plain, two-faces, face-leaves)."""
    side = int(0.75 * height) // 2 * 2
    y = (height - side) // 2
    faces = draw_sequence(seed, number, index, frames=frames, image_size=side)
    others = draw_sequence(seed, STRANGER, 0, frames=frames, image_size=side) if variant == "two-faces" else None
    for t, (_, _, img, _) in enumerate(faces):
        canvas = _canvas(width, height)
        x = (width - side) // 2
        if variant == "two-faces":
            x = max(0, width // 2 - side - 4)
            stranger = next(others)[2]
            if t >= 2:  # the stranger walks in once the subject's track exists
                _paste(canvas, stranger, width // 2 + 4, y)
        elif variant == "face-leaves":
            third = frames // 3
            if third <= t < frames - third:
                x = width + side  # out of the frame
        _paste(canvas, img, x, y)
        yield canvas


def make_video_drop(drop_dir, *, people: int, recordings: int = 2, seconds: float = 2.0, fps: float = 5.0,
                    width: int = 320, height: int = 240, seed: int = 0, extras: bool = True,
                    name: str | None = None) -> Path:
    """Write a drop whose manifest rows name synthetic video files (see the module docstring).

    Returns the drop directory; ``_READY`` is written last.
    """
    check_int("people", people, 1, None, "ask for at least one synthetic person")
    check_int("recordings", recordings, 1, 100, "use e.g. 2 (one talking, one smiling)")
    check_int("width", width, 96, 4096, "use e.g. 320")
    check_int("height", height, 96, 4096, "use e.g. 240")
    if not 0 < fps <= 60 or not 0 < seconds <= 3600:
        raise ConfigError(f"fps={fps!r} must be in (0, 60] and seconds={seconds!r} in (0, 3600]; e.g. --fps 5 --seconds 2")
    frames = max(2, round(seconds * fps))
    drop = Path(drop_dir)
    if drop.exists() and (not drop.is_dir() or any(drop.iterdir())):
        raise ConfigError(f"drop_dir={str(drop)!r} exists and is not an empty directory; pass a new or empty directory")
    (drop / "videos").mkdir(parents=True, exist_ok=True)
    rows = []
    n = 0
    jobs = [(number, q, "plain") for number in range(1, people + 1) for q in range(recordings)]
    if extras:
        jobs += [(1, recordings, "two-faces"), (min(2, people), recordings + 1, "face-leaves")]
    for number, q, variant in jobs:
        person = make_person(seed, number)
        suffix, fourcc = CONTAINERS[n % len(CONTAINERS)]
        rel = f"videos/{person.subject_id}-v{q}{'-' + variant if variant != 'plain' else ''}{suffix}"
        write_video(drop / rel, recording_frames(seed, number, q, frames=frames, width=width, height=height,
                                                 variant=variant), fps=fps, fourcc=fourcc)
        kind = SEQUENCE_KINDS[(q + number) % 2]
        rows.append([rel, person.subject_id, person.gender, "talk" if kind == "talking" else "smile"])
        n += 1
    with open(drop / "manifest.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        w.writerows(rows)
    with open(drop / "drop.yaml", "w", encoding="utf-8") as fh:
        yaml.safe_dump({"name": name or drop.resolve().name, "labels": ["gender", "expression"]}, fh, sort_keys=False)
    (drop / "_READY").write_bytes(b"")  # last: consumers only pick up complete drops
    log.info("synthetic video drop %s: %d recordings of %d frames at %g fps", drop, n, frames, fps)
    return drop
