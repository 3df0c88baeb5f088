"""Synthetic face drops: cartoon faces drawn with OpenCV, with known identity, labels and eye points.

The faces are never real photographs. Each person has identity features (face shape, eye
spacing, brows, nose, mouth, skin and hair tone, glasses, a mole...) drawn from an RNG
derived from ``(seed, person number)`` so that person ``n`` looks the same whatever the
size of the drop. A gender factor (hair length, ears, jaw, brows, stubble) and an
expression factor (smile: wide open upturned mouth, raised cheeks, narrower eyes) have
visual effects strong enough that a linear classifier on aligned, PCA-reduced pixels
separates them, and identity survives pose, lighting and expression changes well enough
for an eigenface recogniser to re-identify most people: a useful test bed for k-Same.
"""
from __future__ import annotations

import csv
import logging
import math
import multiprocessing as mp
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from pathlib import Path

import cv2
import numpy as np
import yaml

from deid.errors import ConfigError

log = logging.getLogger(__name__)

LABELS: tuple[str, ...] = ("gender", "expression")
MANIFEST_COLUMNS: tuple[str, ...] = (
    "image", "subject_id", "gender", "expression",
    "eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y",
)
IMAGE_FORMATS: tuple[str, ...] = ("png", "jpg", "jpeg", "pgm", "gif")

# Fractional bits for OpenCV drawing coordinates: sub-pixel placement so the eye
# coordinates written to the manifest are exactly where the pupils are drawn.
_SHIFT = 4
_ONE = 1 << _SHIFT

# BGR colours. Hair is darker than the backgrounds on average so that long hair is a
# consistent (same sign) visual cue for a linear classifier.
_SKIN_LIGHT = np.array([180.0, 198.0, 236.0])
_SKIN_DARK = np.array([55.0, 80.0, 118.0])
_HAIR = np.array([
    [22, 22, 26], [30, 42, 64], [42, 64, 100], [60, 90, 130],
    [100, 160, 195], [40, 62, 140], [140, 140, 145],
], dtype=float)
_HAIR_P = np.array([0.24, 0.22, 0.18, 0.12, 0.09, 0.07, 0.08])
_IRIS = np.array([[90, 60, 30], [40, 70, 110], [110, 110, 60], [60, 120, 90], [30, 40, 60]], dtype=float)


@dataclass(frozen=True)
class SynthPerson:
    """Identity and gender of one synthetic person; lengths are in units of their eye distance."""

    number: int
    subject_id: str
    gender: str
    face_w: float          # upper-head half width
    face_h: float          # head half height
    face_cy: float         # head centre below the eye line
    jaw_w: float           # lower-face half width as a fraction of face_w
    eye_rx: float
    eye_ry: float
    iris: tuple[float, float, float]
    brow_dy: float
    brow_thick: float
    brow_angle: float      # degrees, positive = outer end lower
    brow_len: float
    nose_len: float
    nose_w: float
    mouth_dy: float        # mouth below the nose tip
    mouth_w: float
    mouth_curve: float
    lip_thick: float
    skin: tuple[float, float, float]
    hair: tuple[float, float, float]
    hairline: float        # y of the hairline (negative = above the eyes)
    long_hair: bool
    hair_volume: float
    stubble: bool
    glasses: tuple[float, float, float] | None
    mole: tuple[float, float] | None


def _seq(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *key]))


def make_person(seed: int, number: int) -> SynthPerson:
    """The person ``number`` (1-based) of the drops made with ``seed``; independent of drop size."""
    r = _seq(seed, number)
    male = bool(r.random() < 0.5)
    t = r.random()
    skin = (1 - t) * _SKIN_LIGHT + t * _SKIN_DARK + r.normal(0, 6, 3)
    hair = _HAIR[r.choice(len(_HAIR), p=_HAIR_P)] * r.uniform(0.85, 1.15) + r.normal(0, 5, 3)
    glasses = tuple(float(v) for v in r.uniform(10, 90, 3)) if r.random() < 0.25 else None
    mole = (float(r.uniform(-0.75, 0.75)), float(r.uniform(0.3, 1.1))) if r.random() < 0.3 else None
    return SynthPerson(
        number=number,
        subject_id=f"s{number:05d}",
        gender="male" if male else "female",
        face_w=float(r.uniform(0.92, 1.12)),
        face_h=float(r.uniform(1.30, 1.55)),
        face_cy=float(r.uniform(0.15, 0.35)),
        jaw_w=float(r.uniform(0.90, 1.0) if male else r.uniform(0.72, 0.85)),
        eye_rx=float(r.uniform(0.16, 0.22)),
        eye_ry=float(r.uniform(0.075, 0.105)),
        iris=tuple(float(v) for v in _IRIS[r.integers(len(_IRIS))] + r.normal(0, 8, 3)),
        brow_dy=float(r.uniform(0.20, 0.34)),
        brow_thick=float(r.uniform(0.07, 0.10) if male else r.uniform(0.035, 0.06)),
        brow_angle=float(r.uniform(-12, 12)),
        brow_len=float(r.uniform(0.30, 0.42)),
        nose_len=float(r.uniform(0.50, 0.78)),
        nose_w=float(r.uniform(0.20, 0.36)),
        mouth_dy=float(r.uniform(0.22, 0.36)),
        mouth_w=float(r.uniform(0.50, 0.72)),
        mouth_curve=float(r.uniform(-0.03, 0.02)),
        lip_thick=float(r.uniform(0.035, 0.06)),
        skin=tuple(float(v) for v in np.clip(skin, 0, 255)),
        hair=tuple(float(v) for v in np.clip(hair, 0, 255)),
        hairline=float(r.uniform(-0.85, -0.55)),
        long_hair=not male,
        hair_volume=float(r.uniform(0.05, 0.18)),
        stubble=bool(male and r.random() < 0.4),
        glasses=glasses,  # type: ignore[arg-type]
        mole=mole,
    )


# Synthetic head pose: the facial features lie on a vertical cylinder of the head's half width
# (depth sqrt(w^2 - x^2) in eye distances) and the nose base stands out a further _NOSE_DEPTH, so a
# yaw moves the features across the rigid head outline as a turned head does. With the cylinder's
# depth at the eyes (~0.87) the nose base is ~0.5 eye distances in front of the eye centres: the
# anthropometric ratio the pose estimator assumes (deid.alignment.pose.NOSE_DEPTH_RATIO).
_NOSE_DEPTH = 0.37


class _Pen:
    """Draws in face coordinates (eye midpoint at the origin, eye distance 1) through a similarity.

    ``yaw`` (degrees, positive: the face turns towards the image's right) moves the points of the
    shapes drawn with ``surface=True`` (the facial features) by their depth on the head
    (:data:`_NOSE_DEPTH`, ``head_w`` the head's half width) and narrows their ellipses by cos(yaw)
    (weak perspective); the head, hair and body outlines stay as drawn. ``yaw=0`` draws exactly as before.
    """

    def __init__(self, img: np.ndarray, centre: tuple[float, float], scale: float, angle_deg: float,
                 *, yaw: float = 0.0, head_w: float = 1.0, nose: tuple[float, float] = (0.0, 0.0)):
        self.img = img
        self.cx, self.cy = centre
        self.s = scale
        self.deg = angle_deg
        a = math.radians(angle_deg)
        self.c, self.sn = math.cos(a), math.sin(a)
        self.yaw = math.radians(yaw)
        self.head_w = head_w
        self.nose = nose  # (half width, length) of the nose: its points stand out by _NOSE_DEPTH

    def _depth(self, x: float, y: float) -> float:
        z = math.sqrt(max(self.head_w ** 2 - x * x, 0.0))
        half, length = self.nose
        if length > 0 and abs(x) <= half + 0.12 and -0.05 <= y <= length + 0.12:
            z += _NOSE_DEPTH * min(1.0, max(0.0, y) / length)
        return z

    def _turn(self, x: float, y: float, surface: bool) -> tuple[float, float]:
        if not surface or self.yaw == 0.0:
            return x, y
        return x * math.cos(self.yaw) + self._depth(x, y) * math.sin(self.yaw), y

    def map(self, x: float, y: float, *, surface: bool = False) -> tuple[float, float]:
        x, y = self._turn(x, y, surface)
        return (self.cx + self.s * (self.c * x - self.sn * y), self.cy + self.s * (self.sn * x + self.c * y))

    def _p(self, x: float, y: float, surface: bool = False) -> tuple[int, int]:
        u, v = self.map(x, y, surface=surface)
        return (int(round(u * _ONE)), int(round(v * _ONE)))

    def _t(self, t: float) -> int:
        return max(1, int(round(t * self.s)))

    def _squeeze(self, surface: bool) -> float:
        return math.cos(self.yaw) if surface else 1.0

    def ellipse(self, c, axes, colour, *, angle=0.0, start=0.0, end=360.0, thick: float | None = None,
                surface: bool = False):
        sq = self._squeeze(surface)
        ax = (max(1, int(round(axes[0] * sq * self.s * _ONE))), max(1, int(round(axes[1] * self.s * _ONE))))
        cv2.ellipse(self.img, self._p(*c, surface), ax, angle + self.deg, start, end, colour,
                    -1 if thick is None else self._t(thick), cv2.LINE_AA, _SHIFT)

    def circle(self, c, r, colour, *, thick: float | None = None, surface: bool = False):
        if surface and self.yaw != 0.0:  # a foreshortened circle: an ellipse
            self.ellipse(c, (r, r), colour, thick=thick, surface=True)
            return
        cv2.circle(self.img, self._p(*c), max(1, int(round(r * self.s * _ONE))), colour,
                   -1 if thick is None else self._t(thick), cv2.LINE_AA, _SHIFT)

    def poly(self, pts, colour, *, thick: float | None = None, closed: bool = False, surface: bool = False):
        arr = np.array([self._p(x, y, surface) for x, y in pts], dtype=np.int32).reshape(-1, 1, 2)
        if thick is None:
            cv2.fillPoly(self.img, [arr], colour, cv2.LINE_AA, _SHIFT)
        else:
            cv2.polylines(self.img, [arr], closed, colour, self._t(thick), cv2.LINE_AA, _SHIFT)


class _Surface:
    """A :class:`_Pen` whose every shape is drawn on the face's surface (moved by the pen's yaw)."""

    def __init__(self, pen: _Pen):
        self.pen = pen

    def ellipse(self, *a, **kw):
        self.pen.ellipse(*a, surface=True, **kw)

    def circle(self, *a, **kw):
        self.pen.circle(*a, surface=True, **kw)

    def poly(self, *a, **kw):
        self.pen.poly(*a, surface=True, **kw)


def _curve(x0: float, x1: float, y: float, bend: float, n: int = 12) -> list[tuple[float, float]]:
    """A parabola from x0 to x1 at height y whose ends are ``bend`` above its middle."""
    xs = np.linspace(x0, x1, n)
    m, h = (x0 + x1) / 2, (x1 - x0) / 2
    return [(float(x), float(y - bend * ((x - m) / h) ** 2 + bend)) for x in xs]


def _shade(colour, f: float) -> tuple[float, float, float]:
    return tuple(float(min(255.0, v * f)) for v in colour)  # type: ignore[return-value]


def _mix(a, b, t: float) -> tuple[float, float, float]:
    return tuple(float((1 - t) * x + t * y) for x, y in zip(a, b))  # type: ignore[return-value]


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    base = rng.uniform(150, 235) * rng.uniform(0.85, 1.15, 3)
    low = rng.normal(0, 14, (6, 6, 3)).astype(np.float32)
    tex = cv2.resize(low, (size, size), interpolation=cv2.INTER_CUBIC)
    fine = cv2.resize(rng.normal(0, 6, (size // 4, size // 4, 3)).astype(np.float32), (size, size),
                      interpolation=cv2.INTER_LINEAR)
    return np.clip(base + tex + fine, 0, 255).astype(np.uint8)


def _background_fast(rng: np.random.Generator, size: int) -> np.ndarray:
    """:func:`_background` composed at a quarter of the size and upsampled once (``rng`` consumed the same way)."""
    base = rng.uniform(150, 235) * rng.uniform(0.85, 1.15, 3)
    low = rng.normal(0, 14, (6, 6, 3)).astype(np.float32)
    q = size // 4
    fine = rng.normal(0, 6, (q, q, 3)).astype(np.float32)
    tex = cv2.add(cv2.resize(low, (q, q), interpolation=cv2.INTER_CUBIC), fine)
    small = cv2.add(tex, (*(float(v) for v in base), 0.0), dtype=cv2.CV_8U)  # rounds and saturates
    return cv2.resize(small, (size, size), interpolation=cv2.INTER_LINEAR)


# Fast sensor noise: a window of a fixed bank of Gaussian samples at a random offset. Drawing
# 120,000 Gaussians per 200 px image was a quarter of the default cost; the offset (and the
# per-image gain) come from the image's own generator, so the bytes still depend only on it.
_BANK_SIDE, _BANK_PAD = 512, 64


@lru_cache(maxsize=4)
def _noise_bank(side: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([0x5EED, side]))
    return rng.standard_normal((side + _BANK_PAD, side + _BANK_PAD, 3), dtype=np.float32)


def _noise_fast(rng: np.random.Generator, size: int) -> np.ndarray:
    """A (size, size, 3) float32 unit-Gaussian field read from :func:`_noise_bank` (tiled above 512 px)."""
    side = min(size, _BANK_SIDE)
    oy, ox = (int(v) for v in rng.integers(0, _BANK_PAD + 1, 2))
    win = _noise_bank(side)[oy:oy + side, ox:ox + side]
    if side == size:
        return win
    reps = -(-size // side)
    return np.tile(win, (reps, reps, 1))[:size, :size]


def _place(rng: np.random.Generator, size: int) -> tuple[tuple[float, float], float, float]:
    """Random eye midpoint, eye distance (px) and in-plane rotation (degrees)."""
    scale = rng.uniform(0.20, 0.35) * size
    angle = rng.uniform(-12.0, 12.0)
    a = math.radians(angle)
    c, s = math.cos(a), math.sin(a)
    # Keep the region an aligner crops (about x in [-1.3, 1.3], y in [-1.1, 1.9] eye distances)
    # inside the image when it fits; centre it when it does not.
    box = [(x, y) for x in (-1.3, 1.3) for y in (-1.1, 1.9)]
    xs = [scale * (c * x - s * y) for x, y in box]
    ys = [scale * (s * x + c * y) for x, y in box]
    centre = []
    for lo, hi in ((-min(xs), size - max(xs)), (-min(ys), size - max(ys))):
        centre.append(rng.uniform(lo, hi) if hi > lo else (lo + hi) / 2)
    return (centre[0], centre[1]), float(scale), float(angle)


EXPRESSIONS: tuple[str, ...] = ("neutral", "smile", "sad", "surprised", "sleepy", "wink")
LIGHTS: tuple[str, ...] = ("normal", "left", "right", "center")
# Standard-normal quantiles at the 256 mid-probabilities: a byte per sample gives noise with
# the Gaussian's shape, clipped at +-2.9 sigma.
_NORMAL_LUT = np.array([statistics.NormalDist().inv_cdf((j + 0.5) / 256) for j in range(256)], dtype=np.float32)
_EYE_OPEN = {"surprised": 1.3, "sleepy": 0.38}
_BROW_LIFT = {"surprised": 1.4, "sad": 1.15}


def _light_map(kind: str, lin: np.ndarray) -> np.ndarray:
    """Multiplicative light map for strong side ("left"/"right") or frontal ("center") light."""
    if kind == "center":
        r2 = lin[None, :] ** 2 + lin[:, None] ** 2
        return (1.3 - 1.4 * r2).astype(np.float32)
    sign = 1.0 if kind == "left" else -1.0  # light from the image's left: the right side is dark
    return np.broadcast_to((0.62 - sign * 0.58 * np.tanh(3.5 * lin))[None, :], (lin.size, lin.size)).astype(np.float32)


def _clutter(img: np.ndarray, rng: np.random.Generator) -> None:
    """Overdraw an indoor-like background: a wall tone, shelves with objects, frames, a window."""
    h, w = img.shape[:2]
    wall = rng.uniform(60, 220, 3)
    img[:] = np.clip(0.35 * img + 0.65 * wall, 0, 255).astype(np.uint8)
    for _ in range(int(rng.integers(2, 5))):  # frames / doors / windows
        x0, y0 = (int(v) for v in rng.integers(0, [w, h]))
        x1, y1 = x0 + int(rng.integers(w // 8, w // 2)), y0 + int(rng.integers(h // 8, h // 2))
        cv2.rectangle(img, (x0, y0), (x1, y1), tuple(float(v) for v in rng.uniform(0, 255, 3)), -1)
        cv2.rectangle(img, (x0, y0), (x1, y1), tuple(float(v) for v in rng.uniform(0, 120, 3)), max(1, w // 60))
    for _ in range(int(rng.integers(1, 3))):  # shelves with books
        y = int(rng.integers(h // 6, h))
        cv2.line(img, (0, y), (w, y), tuple(float(v) for v in rng.uniform(30, 120, 3)), max(2, h // 40))
        x = int(rng.integers(0, w // 4))
        while x < w:
            bw, bh = int(rng.integers(max(2, w // 60), max(3, w // 25))), int(rng.integers(h // 20, h // 8))
            cv2.rectangle(img, (x, y - bh), (x + bw, y), tuple(float(v) for v in rng.uniform(0, 255, 3)), -1)
            x += bw + int(rng.integers(0, max(2, w // 30)))
    lo = rng.normal(0, 10, (8, 8, 3)).astype(np.float32)
    img[:] = np.clip(img + cv2.resize(lo, (w, h), interpolation=cv2.INTER_CUBIC), 0, 255).astype(np.uint8)


def draw_face(person: SynthPerson, *, expression: str, rng: np.random.Generator, image_size: int = 200,
              lighting: str = "normal", clutter: np.random.Generator | None = None, quick_noise: bool = False,
              mouth_open: float | None = None, light_rng: np.random.Generator | None = None,
              fast: bool = False, yaw: float = 0.0) -> tuple[np.ndarray, tuple[tuple[float, float], tuple[float, float]]]:
    """Draw one BGR image of ``person``; return it with the (left, right) eye centres in pixels.

    ``expression`` is one of :data:`EXPRESSIONS`; ``lighting`` one of :data:`LIGHTS` ("left" and
    "right": strong side lighting that leaves the far half of the face in shadow, "center":
    a strong frontal light with fall-off); ``clutter``, when given, draws an indoor-like
    background (shelves, frames, a window) from that generator; ``quick_noise`` draws the sensor
    noise from a 256-level normal-quantile table (for million-face benchmarks where Gaussian
    draws are a third of the cost). ``mouth_open`` (0 closed .. 1 wide open, for a talking
    frame; not with "smile") draws the mouth open that much; ``light_rng``, when given, draws
    the lighting and the sensor noise instead of ``rng`` (the frames of a sequence share them
    whatever their expression consumes). ``fast`` draws the same face, placement and labels with a
    cheaper background texture and lighting (float32, composed at a quarter size) and sensor
    noise read from a fixed Gaussian bank at a random offset: about 3x cheaper, for
    million-face drops; the pixels differ from the default ones. ``yaw`` (degrees, |yaw| < 90;
    positive turns the face towards the image's right) turns the facial features on the head
    (:class:`_Pen`); the eye points returned are the turned pupils. With the defaults the image
    is exactly the one earlier versions drew (``rng`` is consumed identically).
    """
    if expression not in EXPRESSIONS:
        raise ConfigError(f"expression={expression!r} must be one of {list(EXPRESSIONS)}")
    if lighting not in LIGHTS:
        raise ConfigError(f"lighting={lighting!r} must be one of {list(LIGHTS)}")
    if not -80.0 <= float(yaw) <= 80.0:
        raise ConfigError(f"yaw={yaw!r} must be between -80 and 80 degrees (0 = frontal)")
    p = person
    smile = expression == "smile"
    img = (_background_fast if fast else _background)(rng, image_size)
    if clutter is not None:
        _clutter(img, clutter)
    centre, scale, angle = _place(rng, image_size)
    pen = _Pen(img, centre, scale, angle, yaw=yaw, head_w=p.face_w, nose=(p.nose_w / 2, p.nose_len))
    skin, hair = p.skin, p.hair
    skin_dark = _shade(skin, 0.78)
    hcy, fw, fh = p.face_cy, p.face_w, p.face_h
    jaw = fw * p.jaw_w
    chin = hcy + fh

    # Clothes and neck.
    pen.ellipse((0.0, chin + 1.3), (1.9, 1.0), tuple(float(v) for v in rng.uniform(20, 220, 3)))
    pen.poly([(-0.45 * jaw, chin - 0.5), (0.45 * jaw, chin - 0.5), (0.5 * jaw, chin + 0.6),
              (-0.5 * jaw, chin + 0.6)], skin_dark)

    # Hair behind the head: long hair frames the face down to the shoulders.
    vol = p.hair_volume
    if p.long_hair:
        pen.ellipse((0.0, hcy - 0.1), (fw + 0.28 + vol, fh + 0.05 + vol), hair, start=180, end=360)
        pen.poly([(-(fw + 0.28 + vol), hcy - 0.12), (fw + 0.28 + vol, hcy - 0.12),
                  (fw + 0.18 + vol, chin + 0.35), (-(fw + 0.18 + vol), chin + 0.35)], hair)
    else:
        pen.ellipse((0.0, hcy - 0.05), (fw + 0.06 + vol / 2, fh + 0.06 + vol), hair, start=180, end=360)
        for side in (-1, 1):  # ears
            pen.ellipse((side * fw * 0.98, 0.12), (0.14, 0.26), skin_dark)

    # Head: upper half ellipse, lower half narrower for a pointed (female) or square (male) jaw.
    pen.ellipse((0.0, hcy), (fw, fh), skin, start=180, end=360)
    pen.poly([(-fw, hcy), (fw, hcy), (jaw, hcy + 0.55 * fh), (0.0, chin), (-jaw, hcy + 0.55 * fh)], skin)
    pen.ellipse((0.0, hcy), (jaw, fh), skin, start=0, end=180)
    if p.stubble:
        stub = _mix(skin, hair, 0.45)
        pen.ellipse((0.0, hcy), (jaw * 0.97, fh * 0.97), stub, start=10, end=170)
        pen.ellipse((0.0, p.nose_len + 0.06), (0.55 * p.mouth_w + 0.05, 0.16), skin)

    # Hair on the forehead (cap down to the hairline), side strands for long hair.
    top = hcy - fh
    cap_h = (p.hairline - top) / 2 + 0.05
    pen.ellipse((0.0, top + cap_h - 0.05), (fw * 1.01, cap_h + 0.04), hair)
    if p.long_hair:
        for side in (-1, 1):
            pen.poly([(side * fw * 0.55, p.hairline), (side * (fw + 0.05), p.hairline - 0.1),
                      (side * (fw + 0.05), hcy + 0.6), (side * fw * 0.93, hcy + 0.4),
                      (side * fw * 0.9, -0.1)], hair)

    face = _Surface(pen)  # the facial features turn with the yaw; the outlines above do not
    # Cheeks raised in a smile.
    if smile:
        for side in (-1, 1):
            face.ellipse((side * 0.55, p.nose_len - 0.05), (0.22, 0.14), _shade(skin, 1.1))

    # Eyes: sclera, iris, pupil exactly at (+-0.5, 0), upper lid, brows.
    ry = p.eye_ry * (0.72 if smile else 1.0)
    if expression in _EYE_OPEN:
        ry = p.eye_ry * _EYE_OPEN[expression]
    iris_r = min(p.eye_ry * 0.95, ry * 1.1)
    for side in (-1, 1):
        ex = side * 0.5
        if expression == "wink" and side == 1:  # closed eye: a lid line with lashes
            face.poly(_curve(ex - p.eye_rx, ex + p.eye_rx, 0.0, -0.05, 9), (30.0, 30.0, 35.0), thick=0.04)
        else:
            face.ellipse((ex, 0.0), (p.eye_rx, ry), (235.0, 238.0, 240.0))
            face.circle((ex, 0.0), iris_r, p.iris)
            face.circle((ex, 0.0), iris_r * 0.5, (14.0, 12.0, 12.0))
            face.circle((ex + iris_r * 0.45, -iris_r * 0.45), iris_r * 0.16, (250.0, 250.0, 250.0))
            face.ellipse((ex, 0.0), (p.eye_rx, ry), (30.0, 30.0, 35.0), start=180, end=360, thick=0.025)
        by = -p.brow_dy * (1.08 if smile else 1.0)
        if expression in _BROW_LIFT:
            by = -p.brow_dy * _BROW_LIFT[expression]
        a = math.radians(p.brow_angle)
        dx, dy = math.cos(a) * p.brow_len / 2, math.sin(a) * p.brow_len / 2
        face.poly([(ex - side * dx, by - dy * 0), (ex, by - 0.03), (ex + side * dx, by + dy)],
                 _mix(hair, (15.0, 15.0, 15.0), 0.5), thick=p.brow_thick)
        if p.glasses is not None:
            face.ellipse((ex, 0.0), (0.3, 0.22), p.glasses, thick=0.04)
    if p.glasses is not None:
        face.poly(_curve(-0.2, 0.2, -0.02, 0.04, 5), p.glasses, thick=0.04)

    # Nose.
    nl, nw = p.nose_len, p.nose_w
    face.poly([(-0.08, 0.05), (-0.1, nl * 0.7), (-nw / 2, nl)], skin_dark, thick=0.03)
    face.poly(_curve(-nw / 2, nw / 2, nl + 0.04, -0.04, 7), skin_dark, thick=0.03)
    for side in (-1, 1):
        face.ellipse((side * nw * 0.28, nl + 0.01), (0.05, 0.03), _shade(skin, 0.45))

    # Mouth: straight closed line, or a wide upturned open smile with teeth.
    my = nl + p.mouth_dy
    lip = _mix(_shade(skin, 0.7), (60.0, 50.0, 150.0), 0.35)
    if smile:
        hw = p.mouth_w * 0.62
        up = 0.13 + rng.uniform(-0.02, 0.03)
        upper = _curve(-hw, hw, my - 0.02, up, 12)
        lower = _curve(hw, -hw, my - 0.02, up + 0.2, 12)
        face.poly(upper + lower, (30.0, 25.0, 70.0))
        teeth = _curve(-hw * 0.8, hw * 0.8, my - 0.02, up * 0.8, 10)
        face.poly(teeth + [(x, y + 0.09) for x, y in reversed(teeth)], (225.0, 230.0, 235.0))
        face.poly(upper + lower, lip, thick=p.lip_thick, closed=True)
        for side in (-1, 1):  # smile lines
            face.poly([(side * (nw / 2 + 0.08), nl - 0.05), (side * (hw + 0.08), my - up + 0.05)],
                     skin_dark, thick=0.025)
    elif mouth_open is not None:  # talking: an open mouth whose height follows the frame
        o = float(min(max(mouth_open, 0.0), 1.0))
        hw = p.mouth_w * (0.55 - 0.1 * o)
        oh = 0.02 + 0.26 * o
        face.ellipse((0.0, my + oh / 2), (hw, oh), (30.0, 25.0, 70.0))
        if o > 0.3:  # upper teeth show once the mouth is well open
            face.ellipse((0.0, my + 0.02), (hw * 0.7, 0.035), (225.0, 230.0, 235.0), start=0, end=180)
        face.ellipse((0.0, my + oh / 2), (hw, oh), lip, thick=p.lip_thick)
    elif expression == "surprised":  # open round mouth
        face.ellipse((0.0, my + 0.04), (p.mouth_w * 0.22, 0.13), (30.0, 25.0, 70.0))
        face.ellipse((0.0, my + 0.04), (p.mouth_w * 0.22, 0.13), lip, thick=p.lip_thick)
    elif expression == "sad":  # corners pulled down
        hw = p.mouth_w / 2
        face.poly(_curve(-hw, hw, my, -0.09, 10), lip, thick=p.lip_thick)
    else:
        hw = p.mouth_w / 2
        face.poly(_curve(-hw, hw, my, p.mouth_curve, 10), lip, thick=p.lip_thick)
        face.poly(_curve(-hw * 0.7, hw * 0.7, my + 0.06, -0.05, 8), _shade(lip, 1.12), thick=p.lip_thick * 0.8)

    if p.mole is not None:
        face.circle(p.mole, 0.035, (35.0, 40.0, 60.0))

    # Lighting: per-image gain and a directional gradient, then sensor noise.
    if light_rng is not None:
        rng = light_rng
    g = rng.uniform(0.88, 1.12)
    d = rng.uniform(-0.25, 0.25, 2)
    lin = np.linspace(-0.5, 0.5, image_size, dtype=np.float32)
    eyes = (pen.map(-0.5, 0.0, surface=True), pen.map(0.5, 0.0, surface=True))
    finish = _finish_fast if fast else partial(_finish, quick_noise=quick_noise)
    return finish(img, rng, g, d, lin, lighting), eyes


def _finish(img: np.ndarray, rng: np.random.Generator, g: float, d: np.ndarray, lin: np.ndarray, lighting: str,
            *, quick_noise: bool) -> np.ndarray:
    """``draw_face``'s lighting and sensor noise (float64 light map: the default pixels depend on it)."""
    size = img.shape[0]
    light = g * (1.0 + d[0] * lin[None, :] + d[1] * lin[:, None])
    if lighting != "normal":
        light = light * _light_map(lighting, lin)
    if quick_noise:  # a byte per sample through a normal-quantile table: ~5x cheaper than Gaussian draws
        noise = _NORMAL_LUT[rng.integers(0, 256, (size, size, 3), dtype=np.uint8)]
        noise *= np.float32(rng.uniform(2, 5))
    else:
        noise = rng.standard_normal((size, size, 3), dtype=np.float32) * np.float32(rng.uniform(2, 5))
    out = img.astype(np.float32) * light[:, :, None] + noise
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)


def _finish_fast(img: np.ndarray, rng: np.random.Generator, g: float, d: np.ndarray, lin: np.ndarray,
                 lighting: str) -> np.ndarray:
    """``draw_face``'s lighting and sensor noise in float32 OpenCV calls, the noise from the bank."""
    light = (np.float32(d[0]) * lin)[None, :] + (np.float32(d[1]) * lin)[:, None]
    light += np.float32(1.0)
    light *= np.float32(g)
    if lighting != "normal":
        light *= _light_map(lighting, lin)
    sigma = float(rng.uniform(2, 5))
    lit = cv2.multiply(img, cv2.merge([light, light, light]), dtype=cv2.CV_32F)
    return cv2.addWeighted(lit, 1.0, _noise_fast(rng, img.shape[0]), sigma, 0.0, dtype=cv2.CV_8U)


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
    codes = []
    for c in range(n_chunks):
        codes.append(np.uint16([256]))  # clear: the decoder's table never outgrows 9 bits
        codes.append(px[c * 250:(c + 1) * 250])
    codes.append(np.uint16([257]))  # end of information
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
        rng = _seq(spec.seed, n, i)
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
        extra = _seq(spec.seed, n, i, 1) if (spec.lighting != "normal" or spec.background != "plain") else None
        if spec.lighting == "side" and lighting == "normal":
            lighting = "left" if extra.random() < 0.5 else "right"
        # Its own stream too: a pose spread changes only the yaw of the otherwise identical drop.
        yaw = float(_seq(spec.seed, n, i, 2).uniform(-spec.pose_spread, spec.pose_spread)) if spec.pose_spread else 0.0
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
    r = _seq(spec.seed, n, i, 3)
    (lx, ly), (rx, ry) = eyes
    out = [(img, eyes)]
    for _ in range(1, spec.frames_per_sequence):
        dx, dy = r.uniform(-shift, shift, 2) if shift else (0.0, 0.0)
        m = cv2.getRotationMatrix2D(((lx + rx) / 2, (ly + ry) / 2), float(r.uniform(-turn, turn)) if turn else 0.0, 1.0)
        m[:, 2] += (dx, dy)
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
    _check_int("people", people, 1, None, "ask for at least one synthetic person")
    _check_int("top", top, 1, 100_000, "use e.g. 40 images for the most photographed person")
    _check_int("minimum", minimum, 1, top, "use e.g. 2 (at least two images a person)")
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


def _check_int(name: str, value, lo: int, hi: int | None, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ConfigError(f"{name}={value!r} must be an integer {rng}; {fix}")


def _check(*, people, images_per_person, seed, image_size, smallest: int = 64) -> None:
    _check_int("people", people, 1, None, "ask for at least one synthetic person")
    _check_int("images_per_person", images_per_person, 1, None, "use 2 for a neutral and a smiling image")
    _check_int("seed", seed, 0, None, "pass a non-negative integer seed")
    _check_int("image_size", image_size, smallest, 4096,
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
    condition_values : int, optional
        2..11: instead of ``gender``/``expression``, one label ``condition`` with that many
        values (Yale-like: normal, happy, leftlight, glasses, surprised, rightlight, sad,
        noglasses, sleepy, centerlight, wink), image ``i`` of person ``n`` taking value
        ``(i + n - 2) mod condition_values``.
    crop : {"none", "tight"}
        "tight": the face fills the frame (ORL-like), ``image_size`` wide, 1.21x as high.
    grey : bool
        Single-channel images (always so for ``image_format`` "pgm" and "gif").
    lighting : {"normal", "side"}
        "side": every image lit strongly from a random side (the far half in shadow).
    background : {"plain", "clutter"}
        "clutter": an indoor-like coloured background (shelves, frames, a window).
    labels : bool
        False: no label columns and ``labels: []`` in drop.yaml.
    eyes : bool
        False: no eye columns, so alignment has to find the eyes.
    workers : int
        Processes drawing the images (1 = this process).
    quick_noise : bool
        Cheaper sensor noise (see :func:`draw_face`); the images differ from the default ones.
    fast : bool
        About 4x cheaper images for million-face drops (see :func:`draw_face`; JPEG quality 85
        instead of 92): the same people, placements, eye points and labels as the default
        drop, with another background texture and sensor noise.
    chunk_people : int
        People per work item handed to a worker.
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
    """
    _check(people=people, images_per_person=images_per_person, seed=seed, image_size=image_size,
           smallest=32 if crop == "tight" else 64)
    if counts is not None:
        counts = tuple(counts)
        if len(counts) != people:
            raise ConfigError(f"counts has {len(counts)} entries but people={people}; give one image count per "
                              "person, e.g. counts=[47, 40, 33] with people=3")
        for c in counts:
            _check_int("counts entry", c, 1, 100_000, "every person needs at least one image")
    if isinstance(pose_spread, bool) or not isinstance(pose_spread, (int, float)) or not 0 <= pose_spread <= 60:
        raise ConfigError(f"pose_spread={pose_spread!r} must be a number of degrees from 0 to 60; e.g. 30")
    _check_int("frames_per_sequence", frames_per_sequence, 1, 100, "use e.g. 3 near-identical frames per image")
    _check_choice("frame_jitter", frame_jitter, tuple(FRAME_JITTERS))
    _check_choice("image_format", image_format, tuple(_EXT))
    _check_choice("crop", crop, CROPS)
    _check_choice("lighting", lighting, LIGHTINGS)
    _check_choice("background", background, BACKGROUNDS)
    if condition_values is not None:
        _check_int("condition_values", condition_values, 2, len(CONDITIONS),
                   f"use up to {len(CONDITIONS)} values ({', '.join(CONDITIONS)})")
    _check_int("workers", workers, 1, 256, "use at most the number of CPU cores, e.g. 2")
    _check_int("chunk_people", chunk_people, 1, None, "use e.g. 50")
    for flag, value in (("grey", grey), ("labels", labels), ("eyes", eyes), ("quick_noise", quick_noise),
                        ("fast", fast)):
        if not isinstance(value, bool):
            raise ConfigError(f"{flag}={value!r} must be True or False")
    drop = Path(drop_dir)
    if drop.exists() and (not drop.is_dir() or any(drop.iterdir())):
        raise ConfigError(f"drop_dir={str(drop)!r} exists and is not an empty directory; "
                          "pass a new or empty directory so no existing drop is mixed in")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"name={name!r} must be a non-empty string or None (None = the directory name)")
    spec = SynthSpec(seed=seed, images_per_person=images_per_person, image_size=image_size,
                     image_format=image_format, condition_values=condition_values, crop=crop, grey=grey,
                     lighting=lighting, background=background, labels=labels, eyes=eyes, quick_noise=quick_noise,
                     fast=fast, counts=counts, pose_spread=float(pose_spread), frames_per_sequence=frames_per_sequence,
                     frame_jitter=frame_jitter)
    (drop / "images").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
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
    with open(drop / "drop.yaml", "w", encoding="utf-8") as fh:
        yaml.safe_dump({"name": name or drop.resolve().name, "labels": list(spec.label_columns)}, fh, sort_keys=False)
    # _READY last: consumers only pick up complete drops.
    (drop / "_READY").write_bytes(b"")
    dt = time.perf_counter() - t0
    log.info("synthetic drop %s: %d images of %d people in %.1f s (%.2f ms/image, %d workers)",
             drop, count, people, dt, 1000 * dt / max(count, 1), workers)
    return drop
