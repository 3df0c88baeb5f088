"""One synthetic face drawn with OpenCV: a cartoon person with known identity, expression and eye points.

The faces are never real photographs. Each person (:class:`SynthPerson`) has identity features (face
shape, eye spacing, brows, nose, mouth, skin and hair tone, glasses, a mole...) drawn from an RNG
derived from ``(seed, person number)`` (:func:`make_person`, :func:`seeded_rng`) so that person ``n``
looks the same whatever the size of the drop. A gender factor (hair length, ears, jaw, brows, stubble)
and an expression factor (smile: wide open upturned mouth, raised cheeks, narrower eyes) have visual
effects strong enough that a linear classifier on aligned, PCA-reduced pixels separates them.
:func:`draw_face` draws one image: background, head, eyes and brows, nose, mouth (through a pen in face
coordinates that can turn the features with a head yaw, :class:`_Pen`), then lighting and sensor noise.
The drops made of these faces are written by :mod:`deid.intake.synth`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from functools import lru_cache, partial

import cv2
import numpy as np

from deid.errors import ConfigError


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


def seeded_rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *key]))


def make_person(seed: int, number: int) -> SynthPerson:
    """The person ``number`` (1-based) of the drops made with ``seed``; independent of drop size."""
    r = seeded_rng(seed, number)
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
        iris=tuple(float(v) for v in _IRIS[r.integers(len(_IRIS))] + r.normal(0, 8, 3)),  # type: ignore[arg-type]
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
        skin=tuple(float(v) for v in np.clip(skin, 0, 255)),  # type: ignore[arg-type]
        hair=tuple(float(v) for v in np.clip(hair, 0, 255)),  # type: ignore[arg-type]
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
        cv2.ellipse(self.img, self._p(c[0], c[1], surface), ax, angle + self.deg, start, end, colour,
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
    small = cv2.add(tex, (*(float(v) for v in base), 0.0), dtype=cv2.CV_8U)  # type: ignore[call-overload]  # rounds, saturates
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
    img = (_background_fast if fast else _background)(rng, image_size)
    if clutter is not None:
        _clutter(img, clutter)
    centre, scale, angle = _place(rng, image_size)
    pen = _Pen(img, centre, scale, angle, yaw=yaw, head_w=p.face_w, nose=(p.nose_w / 2, p.nose_len))
    skin_dark = _shade(p.skin, 0.78)
    _draw_head(pen, p, rng, skin_dark)
    face = _Surface(pen)  # the facial features turn with the yaw; the outlines below them do not
    _draw_eyes(face, p, expression)
    _draw_nose(face, p, skin_dark)
    _draw_mouth(face, p, expression, rng, skin_dark, mouth_open=mouth_open)
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


def _draw_head(pen: _Pen, p: SynthPerson, rng: np.random.Generator, skin_dark: tuple[float, float, float]) -> None:
    """Clothes and neck, the hair behind the head, the head, stubble, the hair on the forehead (not turned by the yaw).

    Draws the clothes' colour from ``rng`` (:func:`draw_face`'s stream: its order is the image's bytes).
    """
    skin, hair = p.skin, p.hair
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


def _draw_eyes(face: _Surface, p: SynthPerson, expression: str) -> None:
    """Cheeks raised in a smile; eyes (sclera, iris, pupil exactly at (+-0.5, 0), upper lid), brows, glasses."""
    smile = expression == "smile"
    if smile:
        for side in (-1, 1):
            face.ellipse((side * 0.55, p.nose_len - 0.05), (0.22, 0.14), _shade(p.skin, 1.1))
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
                  _mix(p.hair, (15.0, 15.0, 15.0), 0.5), thick=p.brow_thick)
        if p.glasses is not None:
            face.ellipse((ex, 0.0), (0.3, 0.22), p.glasses, thick=0.04)
    if p.glasses is not None:
        face.poly(_curve(-0.2, 0.2, -0.02, 0.04, 5), p.glasses, thick=0.04)


def _draw_nose(face: _Surface, p: SynthPerson, skin_dark: tuple[float, float, float]) -> None:
    nl, nw = p.nose_len, p.nose_w
    face.poly([(-0.08, 0.05), (-0.1, nl * 0.7), (-nw / 2, nl)], skin_dark, thick=0.03)
    face.poly(_curve(-nw / 2, nw / 2, nl + 0.04, -0.04, 7), skin_dark, thick=0.03)
    for side in (-1, 1):
        face.ellipse((side * nw * 0.28, nl + 0.01), (0.05, 0.03), _shade(p.skin, 0.45))


def _draw_mouth(face: _Surface, p: SynthPerson, expression: str, rng: np.random.Generator,
                skin_dark: tuple[float, float, float], *, mouth_open: float | None) -> None:
    """The mouth: a straight closed line, a wide upturned open smile with teeth (its curve drawn from ``rng``), an
    open talking mouth (``mouth_open``), a round surprised one, or corners pulled down."""
    nl, nw = p.nose_len, p.nose_w
    my = nl + p.mouth_dy
    lip = _mix(_shade(p.skin, 0.7), (60.0, 50.0, 150.0), 0.35)
    if expression == "smile":
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
