"""Synthetic face drops: cartoon faces drawn with OpenCV, with known identity, labels and eye points.

The faces are never real photographs (they are drawn by :mod:`deid.intake.synth_face`): person ``n`` of a
seed looks the same whatever the size of the drop, and identity survives pose, lighting and expression
changes well enough for an eigenface recogniser to re-identify most people: a useful test bed for
k-Same. This module makes the drops: what each image shows (:class:`SynthSpec`: labels or Yale-like
conditions, tight crops, grey, side light, clutter, head yaw, near-identical frames), its encoding
(PNG, JPEG, PGM, a lossless grey GIF), and the writing of ``images/``, ``manifest.csv``, ``drop.yaml`` and
``_READY`` by :func:`make_synthetic_drop`, in worker processes, byte-identical whatever their number.
"""
from __future__ import annotations

import csv
import logging
import math
import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import yaml

from deid.errors import ConfigError
from deid.intake.synth_face import SynthPerson, draw_face, make_person, seeded_rng

log = logging.getLogger(__name__)

LABELS: tuple[str, ...] = ("gender", "expression")
MANIFEST_COLUMNS: tuple[str, ...] = (
    "image", "subject_id", "gender", "expression",
    "eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y",
)
IMAGE_FORMATS: tuple[str, ...] = ("png", "jpg", "jpeg", "pgm", "gif")


def _expression(index: int, rng: np.random.Generator) -> str:
    if index == 1:
        return "neutral"
    if index == 2:
        return "smile"
    return "smile" if rng.random() < 0.5 else "neutral"


# Conditions of the many-valued label (after the Yale face database's 11: expressions,
# glasses on/off, three lightings). Order: the first V are used for condition_values=V.
CONDITIONS: tuple[str, ...] = ("normal", "happy", "leftlight", "glasses", "surprised", "rightlight",
                               "sad", "noglasses", "sleepy", "centerlight", "wink")

# condition -> (expression, glasses: None = the person's own / True / False, lighting)
_CONDITION_DRAW: dict[str, tuple[str, bool | None, str]] = {
    "normal": ("neutral", None, "normal"), "happy": ("smile", None, "normal"),
    "leftlight": ("neutral", None, "left"), "glasses": ("neutral", True, "normal"),
    "surprised": ("surprised", None, "normal"), "rightlight": ("neutral", None, "right"),
    "sad": ("sad", None, "normal"), "noglasses": ("neutral", False, "normal"),
    "sleepy": ("sleepy", None, "normal"), "centerlight": ("neutral", None, "center"),
    "wink": ("wink", None, "normal"),
}
_GLASSES_ON = (40.0, 38.0, 36.0)
CROPS: tuple[str, ...] = ("none", "tight")
LIGHTINGS: tuple[str, ...] = ("normal", "side")
BACKGROUNDS: tuple[str, ...] = ("plain", "clutter")
EYE_COLUMNS: tuple[str, ...] = MANIFEST_COLUMNS[4:]
_EXT = {"png": "png", "jpg": "jpg", "jpeg": "jpg", "pgm": "pgm", "gif": "gif"}

# Tight crop box around the eye midpoint, in eye distances (width 2.4, height 2.9: ORL-like 0.83 aspect).
_CROP_X, _CROP_TOP, _CROP_BOTTOM = 1.2, 1.0, 1.9


@dataclass(frozen=True)
class SynthSpec:
    """Everything that decides a synthetic drop's bytes (besides ``people``); picklable for workers."""

    seed: int = 0
    images_per_person: int = 2
    image_size: int = 200
    image_format: str = "png"
    condition_values: int | None = None
    crop: str = "none"
    grey: bool = False
    lighting: str = "normal"
    background: str = "plain"
    labels: bool = True
    eyes: bool = True
    quick_noise: bool = False
    fast: bool = False
    counts: tuple[int, ...] | None = None  # images of person n = counts[n - 1] (else images_per_person each)
    pose_spread: float = 0.0  # each image's yaw uniform in [-spread, spread] degrees
    frames_per_sequence: int = 1  # > 1: each still becomes that many near-identical consecutive frames
    frame_jitter: str = "small"

    def images_of(self, n: int) -> int:
        """How many images person ``n`` (1-based) has."""
        return self.counts[n - 1] if self.counts is not None else self.images_per_person

    @property
    def label_columns(self) -> tuple[str, ...]:
        if not self.labels:
            return ()
        return ("condition",) if self.condition_values else LABELS

    @property
    def columns(self) -> tuple[str, ...]:
        return ("image", "subject_id", *self.label_columns, *(EYE_COLUMNS if self.eyes else ()),
                *(("sequence", "frame") if self.frames_per_sequence > 1 else ()))

    @property
    def jpeg_quality(self) -> int:
        # 85 in fast mode: two thirds of the bytes of 92 (7.8 vs 11.4 KiB at 200 px), which is
        # 3 GiB less disk for a million faces, at the same encoding cost.
        return 85 if self.fast else 92

    @property
    def draw_size(self) -> int:
        # A tight crop keeps ~0.5-0.8 of the drawn width: draw large enough to downsample.
        return max(200, math.ceil(2.1 * self.image_size)) if self.crop == "tight" else self.image_size

    @property
    def is_grey(self) -> bool:
        return self.grey or self.image_format in ("pgm", "gif")


def _crop_tight(img: np.ndarray, eyes, width: int):
    """Crop the face box around the eyes and resize it to ``width``; eye points follow exactly."""
    (lx, ly), (rx, ry) = eyes
    mx, my = (lx + rx) / 2, (ly + ry) / 2
    d = math.hypot(rx - lx, ry - ly)
    x0, y0 = int(round(mx - _CROP_X * d)), int(round(my - _CROP_TOP * d))
    w, h = int(round(2 * _CROP_X * d)), int(round((_CROP_TOP + _CROP_BOTTOM) * d))
    rows = np.clip(np.arange(y0, y0 + h), 0, img.shape[0] - 1)
    cols = np.clip(np.arange(x0, x0 + w), 0, img.shape[1] - 1)
    height = int(round(width * (_CROP_TOP + _CROP_BOTTOM) / (2 * _CROP_X)))
    out = cv2.resize(img[rows][:, cols], (width, height), interpolation=cv2.INTER_AREA)
    sx, sy = width / w, height / h
    # cv2.resize maps pixel centres: x' = (x + 0.5) * s - 0.5.
    return out, tuple(((x - x0 + 0.5) * sx - 0.5, (y - y0 + 0.5) * sy - 0.5) for x, y in eyes)


def _lzw_literal_codes(data: bytes) -> bytes:
    """GIF LZW data that codes every pixel as a literal (9-bit codes, a clear code every 250)."""
    px = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
    n_chunks = max(1, -(-px.size // 250))
    codes: list[np.ndarray] = []
    for c in range(n_chunks):
        codes.append(np.array([256], dtype=np.uint16))  # clear: the decoder's table never outgrows 9 bits
        codes.append(px[c * 250:(c + 1) * 250])
    codes.append(np.array([257], dtype=np.uint16))  # end of information
    seq = np.concatenate(codes)
    bits = ((seq[:, None] >> np.arange(9, dtype=np.uint16)) & 1).astype(np.uint8).ravel()
    return np.packbits(bits, bitorder="little").tobytes()


def encode_gif_grey(grey: np.ndarray) -> bytes:
    """A GIF89a with a 256-level grey palette: lossless for 8-bit grey (OpenCV's GIF encoder dithers)."""
    h, w = grey.shape
    head = b"GIF89a" + w.to_bytes(2, "little") + h.to_bytes(2, "little") + bytes([0xF7, 0, 0])
    palette = np.repeat(np.arange(256, dtype=np.uint8), 3).tobytes()
    desc = b"\x2c" + bytes(4) + w.to_bytes(2, "little") + h.to_bytes(2, "little") + b"\x00"
    lzw = _lzw_literal_codes(np.ascontiguousarray(grey).tobytes())
    blocks = b"".join(bytes([len(lzw[i:i + 255])]) + lzw[i:i + 255] for i in range(0, len(lzw), 255))
    return head + palette + desc + b"\x08" + blocks + b"\x00\x3b"


def _encode(img: np.ndarray, fmt: str, *, jpeg_quality: int = 92) -> bytes:
    if fmt == "gif":
        return encode_gif_grey(img)
    params = {"png": [cv2.IMWRITE_PNG_COMPRESSION, 1], "jpg": [cv2.IMWRITE_JPEG_QUALITY, jpeg_quality],
              "pgm": [cv2.IMWRITE_PXM_BINARY, 1]}[_EXT[fmt]]
    ok, buf = cv2.imencode(f".{_EXT[fmt]}", img, params)
    if not ok:  # pragma: no cover - OpenCV always encodes these
        raise RuntimeError(f"OpenCV could not encode a {fmt} image")
    return buf.tobytes()


def _faces_of(spec: SynthSpec, n: int):
    """Yield ``(person, image_number, label_values, image, eyes)`` for person ``n`` under ``spec``."""
    person = make_person(spec.seed, n)
    for i in range(1, spec.images_of(n) + 1):
        rng = seeded_rng(spec.seed, n, i)
        who, lighting = person, "normal"
        if spec.condition_values:
            cond = CONDITIONS[(i - 1 + n - 1) % spec.condition_values]
            expression, glasses, lighting = _CONDITION_DRAW[cond]
            if glasses is True and person.glasses is None:
                who = replace(person, glasses=_GLASSES_ON)
            elif glasses is False:
                who = replace(person, glasses=None)
            values: tuple[str, ...] = (cond,)
        else:
            expression = _expression(i, rng)
            values = (person.gender, expression)
        # A second stream for the new variations, so the default drawing consumes rng as before.
        extra: Any = seeded_rng(spec.seed, n, i, 1) if (spec.lighting != "normal" or spec.background != "plain") else None
        if spec.lighting == "side" and lighting == "normal":
            lighting = "left" if extra.random() < 0.5 else "right"
        # Its own stream too: a pose spread changes only the yaw of the otherwise identical drop.
        yaw = float(seeded_rng(spec.seed, n, i, 2).uniform(-spec.pose_spread, spec.pose_spread)) if spec.pose_spread else 0.0
        img, eyes = draw_face(who, expression=expression, rng=rng, image_size=spec.draw_size, lighting=lighting,
                              clutter=extra if spec.background == "clutter" else None, quick_noise=spec.quick_noise,
                              fast=spec.fast, yaw=yaw)
        if spec.crop == "tight":
            img, eyes = _crop_tight(img, eyes, spec.image_size)
        if spec.is_grey:
            img = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
        yield person, i, values, img, eyes


def iter_synthetic_faces(*, people: int, images_per_person: int = 2, seed: int = 0, image_size: int = 200
                         ) -> Iterator[tuple[SynthPerson, int, str, np.ndarray, tuple[tuple[float, float], tuple[float, float]]]]:
    """Yield ``(person, image_number, expression, bgr_image, eyes)`` one image at a time."""
    _check(people=people, images_per_person=images_per_person, seed=seed, image_size=image_size)
    spec = SynthSpec(seed=seed, images_per_person=images_per_person, image_size=image_size)
    for n in range(1, people + 1):
        for person, i, values, img, eyes in _faces_of(spec, n):
            yield person, i, values[1], img, eyes


def _render_people(spec: SynthSpec, drop: Path, numbers: range) -> list[list[str]]:
    """Draw, encode and write the images of people ``numbers``; return their manifest rows (pure per person)."""
    rows = []
    ext = _EXT[spec.image_format]
    for n in numbers:
        for person, i, values, img, eyes in _faces_of(spec, n):
            frames = [(None, img, eyes)] if spec.frames_per_sequence == 1 else \
                [(t, *f) for t, f in enumerate(_frames(spec, n, i, img, eyes))]
            for t, im, (le, re_) in frames:
                rel = f"images/{person.subject_id}_{i}.{ext}" if t is None else \
                    f"images/{person.subject_id}_{i}_f{t}.{ext}"
                (drop / rel).write_bytes(_encode(im, spec.image_format, jpeg_quality=spec.jpeg_quality))
                row = [rel, person.subject_id, *(values if spec.labels else ())]
                if spec.eyes:
                    row += [f"{le[0]:.3f}", f"{le[1]:.3f}", f"{re_[0]:.3f}", f"{re_[1]:.3f}"]
                if t is not None:
                    row += [f"{person.subject_id}-q{i}", str(t)]
                rows.append(row)
    return rows


# Frame jitter: (largest shift in pixels, largest rotation in degrees, sensor noise sigma) between
# consecutive frames of one still (the 48x48 video-frame sets: 3 frames a fraction of a second apart).
FRAME_JITTERS: dict[str, tuple[float, float, float]] = {"none": (0.0, 0.0, 0.0), "small": (0.6, 0.8, 1.5)}


def _frames(spec: SynthSpec, n: int, i: int, img: np.ndarray, eyes):
    """``spec.frames_per_sequence`` near-identical frames of one drawn still: frame 0 is the still, each
    later one is shifted, rotated and re-noised by at most :data:`FRAME_JITTERS` [``spec.frame_jitter``]
    (eye points moved with it)."""
    shift, turn, sigma = FRAME_JITTERS[spec.frame_jitter]
    r = seeded_rng(spec.seed, n, i, 3)
    (lx, ly), (rx, ry) = eyes
    out = [(img, eyes)]
    for _ in range(1, spec.frames_per_sequence):
        dx, dy = r.uniform(-shift, shift, 2) if shift else (0.0, 0.0)
        m = cv2.getRotationMatrix2D(((lx + rx) / 2, (ly + ry) / 2), float(r.uniform(-turn, turn)) if turn else 0.0, 1.0)
        m[:, 2] += (dx, dy)  # type: ignore[arg-type]
        im = cv2.warpAffine(img, m, (img.shape[1], img.shape[0]), flags=cv2.INTER_LINEAR,
                            borderMode=cv2.BORDER_REFLECT)
        if sigma:
            im = np.clip(im + r.normal(0, sigma, im.shape) + 0.5, 0, 255).astype(np.uint8)
        moved = tuple((float(m[0, 0] * x + m[0, 1] * y + m[0, 2]), float(m[1, 0] * x + m[1, 1] * y + m[1, 2]))
                      for x, y in eyes)
        out.append((im, moved))
    return out


def zipf_counts(people: int, *, top: int = 40, exponent: float = 1.0, minimum: int = 2) -> tuple[int, ...]:
    """Images per person falling as a Zipf law: person r (1-based) gets ``max(minimum, round(top / r**exponent))``.

    Skewed drops like web photo sets, where a few people hold most images (e.g. ``top=47``,
    ``people=24``: 47, 24, 16, 12, 9, 8, 7, 6, 5, 5, 4, 4, 4, 3, ...).
    """
    check_int("people", people, 1, None, "ask for at least one synthetic person")
    check_int("top", top, 1, 100_000, "use e.g. 40 images for the most photographed person")
    check_int("minimum", minimum, 1, top, "use e.g. 2 (at least two images a person)")
    if not 0.0 < float(exponent) <= 5.0:
        raise ConfigError(f"exponent={exponent!r} must be in (0, 5]; use e.g. 1.0 (Zipf's law)")
    return tuple(max(minimum, int(round(top / r ** float(exponent)))) for r in range(1, people + 1))


def _worker_init() -> None:
    cv2.setNumThreads(1)  # the processes are the parallelism
    _keep_heap()


def _keep_heap() -> None:
    """Stop glibc returning the heap to the kernel after every image (worker processes only).

    Each 200 px face allocates and frees about 2 MB of buffers; with glibc's default trim and
    mmap thresholds that memory goes back to the kernel and is faulted in again per image
    (about 250 page faults per face, a fifth of the CPU time of a fast drop). Fixed 64 MiB
    thresholds keep it: the worker's resident size stays flat at the one image's buffers.
    """
    try:
        import ctypes  # noqa: PLC0415

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_trim_threshold, 64 << 20)
    libc.mallopt(m_mmap_threshold, 64 << 20)


def check_int(name: str, value, lo: int, hi: int | None, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ConfigError(f"{name}={value!r} must be an integer {rng}; {fix}")


def _check(*, people, images_per_person, seed, image_size, smallest: int = 64) -> None:
    check_int("people", people, 1, None, "ask for at least one synthetic person")
    check_int("images_per_person", images_per_person, 1, None, "use 2 for a neutral and a smiling image")
    check_int("seed", seed, 0, None, "pass a non-negative integer seed")
    check_int("image_size", image_size, smallest, 4096,
               "use e.g. 200 (eye distance is 20-35% of the size); with crop='tight' down to 32 (e.g. 48)")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} must be one of {list(choices)}")


def make_synthetic_drop(drop_dir, *, people: int, images_per_person: int = 2, seed: int = 0,
                        image_size: int = 200, image_format: str = "png", name: str | None = None,
                        condition_values: int | None = None, crop: str = "none", grey: bool = False,
                        lighting: str = "normal", background: str = "plain", labels: bool = True,
                        eyes: bool = True, workers: int = 1, chunk_people: int = 50, quick_noise: bool = False,
                        fast: bool = False, counts: list[int] | tuple[int, ...] | None = None,
                        pose_spread: float = 0.0, frames_per_sequence: int = 1, frame_jitter: str = "small") -> Path:
    """Write a drop of synthetic faces (manifest.csv, drop.yaml, images/, then _READY); return its path.

    Images are written one at a time (by each worker) and the manifest is streamed in person
    order, so memory does not grow with ``people``. The same arguments always give the same
    bytes whatever ``workers`` is: every image is drawn from a generator seeded by
    ``(seed, person, image)``, and person ``n`` is the same in every drop of a seed.

    Parameters
    ----------
    drop_dir : path
        A new or empty directory to write the drop into.
    people, images_per_person, seed : int
        How many people, images of each (unless ``counts``), and the seed of every random draw.
    image_size, image_format : int, str
        Image side in pixels (the width with ``crop="tight"``); ``png``, ``jpg`` (or ``jpeg``), ``pgm`` or ``gif``.
    name : str, optional
        The drop's name in drop.yaml (default: the directory's name).
    condition_values : int, optional
        2..11: instead of ``gender``/``expression``, one label ``condition`` with that many values (Yale-like:
        normal, happy, leftlight, glasses, surprised, rightlight, sad, noglasses, sleepy, centerlight, wink),
        image ``i`` of person ``n`` taking value ``(i + n - 2) mod condition_values``.
    crop : {"none", "tight"}
        "tight": the face fills the frame (ORL-like), ``image_size`` wide, 1.21x as high.
    lighting : {"normal", "side"}
        "side": every image lit strongly from a random side (the far half in shadow).
    background : {"plain", "clutter"}
        "clutter": an indoor-like coloured background (shelves, frames, a window).
    grey, labels, eyes : bool
        Single-channel images (always so for ``image_format`` "pgm" and "gif"); False: no label columns and
        ``labels: []`` in drop.yaml; False: no eye columns, so alignment has to find the eyes.
    workers, chunk_people : int
        Processes drawing the images (1 = this process); people per work item handed to a worker.
    quick_noise : bool
        Cheaper sensor noise (see :func:`draw_face`); the images differ from the default ones.
    fast : bool
        About 4x cheaper images for million-face drops (see :func:`draw_face`; JPEG quality 85
        instead of 92): the same people, placements, eye points and labels as the default
        drop, with another background texture and sensor noise.
    counts : list of int, optional
        Images of each person (person n gets ``counts[n - 1]``; ``len(counts) == people``), instead of
        ``images_per_person`` each: skewed drops, e.g. :func:`zipf_counts`, or one person holding half
        a partition.
    pose_spread : float
        0..60 degrees: each image's head yaw is drawn uniformly in [-pose_spread, pose_spread]
        (:func:`draw_face`'s ``yaw``; its own random stream, so the drop is otherwise the same).
    frames_per_sequence : int
        1..100; above 1 every image becomes that many near-identical consecutive frames (``frame_jitter``:
        "small" moves each later frame by <= 0.6 px, <= 0.8 degrees and fresh noise; "none" copies it),
        with manifest columns ``sequence`` (``<subject>-q<image>``) and ``frame``.

    Returns
    -------
    Path
        The drop directory.

    Raises
    ------
    ConfigError
        An argument out of range (the message names it and what to pass), or ``drop_dir`` not empty.
    """
    spec = _checked_spec(people=people, images_per_person=images_per_person, seed=seed, image_size=image_size,
                         image_format=image_format, condition_values=condition_values, crop=crop, grey=grey,
                         lighting=lighting, background=background, labels=labels, eyes=eyes, workers=workers,
                         chunk_people=chunk_people, quick_noise=quick_noise, fast=fast, counts=counts,
                         pose_spread=pose_spread, frames_per_sequence=frames_per_sequence, frame_jitter=frame_jitter)
    drop = _new_drop_dir(drop_dir, name)
    t0 = time.perf_counter()
    count = _write_images(spec, drop, people=people, workers=workers, chunk_people=chunk_people)
    _close_drop(drop, spec, name)
    dt = time.perf_counter() - t0
    log.info("synthetic drop %s: %d images of %d people in %.1f s (%.2f ms/image, %d workers)",
             drop, count, people, dt, 1000 * dt / max(count, 1), workers)
    return drop


def _new_drop_dir(drop_dir, name: str | None) -> Path:
    """:func:`make_synthetic_drop`'s target directory, checked to be new or empty (no existing drop is mixed in), its
    ``name`` checked (a non-empty string or None), and its ``images/`` made."""
    drop = Path(drop_dir)
    if drop.exists() and (not drop.is_dir() or any(drop.iterdir())):
        raise ConfigError(f"drop_dir={str(drop)!r} exists and is not an empty directory; "
                          "pass a new or empty directory so no existing drop is mixed in")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"name={name!r} must be a non-empty string or None (None = the directory name)")
    (drop / "images").mkdir(parents=True, exist_ok=True)
    return drop


def _close_drop(drop: Path, spec: SynthSpec, name: str | None) -> None:
    """Write the drop's ``drop.yaml`` (its name, default the directory's, and label columns), then ``_READY``."""
    with open(drop / "drop.yaml", "w", encoding="utf-8") as fh:
        yaml.safe_dump({"name": name or drop.resolve().name, "labels": list(spec.label_columns)}, fh, sort_keys=False)
    # _READY last: consumers only pick up complete drops.
    (drop / "_READY").write_bytes(b"")


def _checked_spec(*, people, images_per_person, seed, image_size, image_format, condition_values, crop, grey,
                  lighting, background, labels, eyes, workers, chunk_people, quick_noise, fast, counts, pose_spread,
                  frames_per_sequence, frame_jitter) -> SynthSpec:
    """:func:`make_synthetic_drop`'s arguments checked (each error names the argument and what to pass), as the
    :class:`SynthSpec` that decides the drop's bytes (``counts`` as a tuple; None: ``images_per_person`` each)."""
    _check(people=people, images_per_person=images_per_person, seed=seed, image_size=image_size,
           smallest=32 if crop == "tight" else 64)
    if counts is not None:
        counts = tuple(counts)
        if len(counts) != people:
            raise ConfigError(f"counts has {len(counts)} entries but people={people}; give one image count per "
                              "person, e.g. counts=[47, 40, 33] with people=3")
        for c in counts:
            check_int("counts entry", c, 1, 100_000, "every person needs at least one image")
    if isinstance(pose_spread, bool) or not isinstance(pose_spread, (int, float)) or not 0 <= pose_spread <= 60:
        raise ConfigError(f"pose_spread={pose_spread!r} must be a number of degrees from 0 to 60; e.g. 30")
    check_int("frames_per_sequence", frames_per_sequence, 1, 100, "use e.g. 3 near-identical frames per image")
    _check_choice("frame_jitter", frame_jitter, tuple(FRAME_JITTERS))
    _check_choice("image_format", image_format, tuple(_EXT))
    _check_choice("crop", crop, CROPS)
    _check_choice("lighting", lighting, LIGHTINGS)
    _check_choice("background", background, BACKGROUNDS)
    if condition_values is not None:
        check_int("condition_values", condition_values, 2, len(CONDITIONS),
                  f"use up to {len(CONDITIONS)} values ({', '.join(CONDITIONS)})")
    check_int("workers", workers, 1, 256, "use at most the number of CPU cores, e.g. 2")
    check_int("chunk_people", chunk_people, 1, None, "use e.g. 50")
    for flag, value in (("grey", grey), ("labels", labels), ("eyes", eyes), ("quick_noise", quick_noise),
                        ("fast", fast)):
        if not isinstance(value, bool):
            raise ConfigError(f"{flag}={value!r} must be True or False")
    return SynthSpec(seed=seed, images_per_person=images_per_person, image_size=image_size,
                     image_format=image_format, condition_values=condition_values, crop=crop, grey=grey,
                     lighting=lighting, background=background, labels=labels, eyes=eyes, quick_noise=quick_noise,
                     fast=fast, counts=counts, pose_spread=float(pose_spread), frames_per_sequence=frames_per_sequence,
                     frame_jitter=frame_jitter)


def _write_images(spec: SynthSpec, drop: Path, *, people: int, workers: int, chunk_people: int) -> int:
    """Draw and write every image (``workers`` processes, chunks of ``chunk_people``) and stream ``manifest.csv`` in
    person order; returns the number of images."""
    count = 0
    chunks = [range(a, min(a + chunk_people, people + 1)) for a in range(1, people + 1, chunk_people)]
    work = partial(_render_people, spec, drop)
    with open(drop / "manifest.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(spec.columns)
        if workers == 1:
            results: Iterator[list[list[str]]] = map(work, chunks)
            pool = None
        else:
            pool = mp.get_context("spawn").Pool(workers, initializer=_worker_init)
            results = pool.imap(work, chunks)  # in order: the manifest streams as chunks finish
        try:
            for rows in results:
                w.writerows(rows)
                count += len(rows)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    return count
