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
import time
from collections.abc import Iterator
from dataclasses import dataclass
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
IMAGE_FORMATS: tuple[str, ...] = ("png", "jpg")

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


class _Pen:
    """Draws in face coordinates (eye midpoint at the origin, eye distance 1) through a similarity."""

    def __init__(self, img: np.ndarray, centre: tuple[float, float], scale: float, angle_deg: float):
        self.img = img
        self.cx, self.cy = centre
        self.s = scale
        self.deg = angle_deg
        a = math.radians(angle_deg)
        self.c, self.sn = math.cos(a), math.sin(a)

    def map(self, x: float, y: float) -> tuple[float, float]:
        return (self.cx + self.s * (self.c * x - self.sn * y), self.cy + self.s * (self.sn * x + self.c * y))

    def _p(self, x: float, y: float) -> tuple[int, int]:
        u, v = self.map(x, y)
        return (int(round(u * _ONE)), int(round(v * _ONE)))

    def _t(self, t: float) -> int:
        return max(1, int(round(t * self.s)))

    def ellipse(self, c, axes, colour, *, angle=0.0, start=0.0, end=360.0, thick: float | None = None):
        ax = (max(1, int(round(axes[0] * self.s * _ONE))), max(1, int(round(axes[1] * self.s * _ONE))))
        cv2.ellipse(self.img, self._p(*c), ax, angle + self.deg, start, end, colour,
                    -1 if thick is None else self._t(thick), cv2.LINE_AA, _SHIFT)

    def circle(self, c, r, colour, *, thick: float | None = None):
        cv2.circle(self.img, self._p(*c), max(1, int(round(r * self.s * _ONE))), colour,
                   -1 if thick is None else self._t(thick), cv2.LINE_AA, _SHIFT)

    def poly(self, pts, colour, *, thick: float | None = None, closed: bool = False):
        arr = np.array([self._p(x, y) for x, y in pts], dtype=np.int32).reshape(-1, 1, 2)
        if thick is None:
            cv2.fillPoly(self.img, [arr], colour, cv2.LINE_AA, _SHIFT)
        else:
            cv2.polylines(self.img, [arr], closed, colour, self._t(thick), cv2.LINE_AA, _SHIFT)


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


def draw_face(person: SynthPerson, *, expression: str, rng: np.random.Generator, image_size: int = 200
              ) -> tuple[np.ndarray, tuple[tuple[float, float], tuple[float, float]]]:
    """Draw one BGR image of ``person``; return it with the (left, right) eye centres in pixels."""
    if expression not in ("neutral", "smile"):
        raise ConfigError(f"expression={expression!r} must be 'neutral' or 'smile'")
    p = person
    smile = expression == "smile"
    img = _background(rng, image_size)
    centre, scale, angle = _place(rng, image_size)
    pen = _Pen(img, centre, scale, angle)
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

    # Cheeks raised in a smile.
    if smile:
        for side in (-1, 1):
            pen.ellipse((side * 0.55, p.nose_len - 0.05), (0.22, 0.14), _shade(skin, 1.1))

    # Eyes: sclera, iris, pupil exactly at (+-0.5, 0), upper lid, brows.
    ry = p.eye_ry * (0.72 if smile else 1.0)
    iris_r = min(p.eye_ry * 0.95, ry * 1.1)
    for side in (-1, 1):
        ex = side * 0.5
        pen.ellipse((ex, 0.0), (p.eye_rx, ry), (235.0, 238.0, 240.0))
        pen.circle((ex, 0.0), iris_r, p.iris)
        pen.circle((ex, 0.0), iris_r * 0.5, (14.0, 12.0, 12.0))
        pen.circle((ex + iris_r * 0.45, -iris_r * 0.45), iris_r * 0.16, (250.0, 250.0, 250.0))
        pen.ellipse((ex, 0.0), (p.eye_rx, ry), (30.0, 30.0, 35.0), start=180, end=360, thick=0.025)
        by = -p.brow_dy * (1.08 if smile else 1.0)
        a = math.radians(p.brow_angle)
        dx, dy = math.cos(a) * p.brow_len / 2, math.sin(a) * p.brow_len / 2
        pen.poly([(ex - side * dx, by - dy * 0), (ex, by - 0.03), (ex + side * dx, by + dy)],
                 _mix(hair, (15.0, 15.0, 15.0), 0.5), thick=p.brow_thick)
        if p.glasses is not None:
            pen.ellipse((ex, 0.0), (0.3, 0.22), p.glasses, thick=0.04)
    if p.glasses is not None:
        pen.poly(_curve(-0.2, 0.2, -0.02, 0.04, 5), p.glasses, thick=0.04)

    # Nose.
    nl, nw = p.nose_len, p.nose_w
    pen.poly([(-0.08, 0.05), (-0.1, nl * 0.7), (-nw / 2, nl)], skin_dark, thick=0.03)
    pen.poly(_curve(-nw / 2, nw / 2, nl + 0.04, -0.04, 7), skin_dark, thick=0.03)
    for side in (-1, 1):
        pen.ellipse((side * nw * 0.28, nl + 0.01), (0.05, 0.03), _shade(skin, 0.45))

    # Mouth: straight closed line, or a wide upturned open smile with teeth.
    my = nl + p.mouth_dy
    lip = _mix(_shade(skin, 0.7), (60.0, 50.0, 150.0), 0.35)
    if smile:
        hw = p.mouth_w * 0.62
        up = 0.13 + rng.uniform(-0.02, 0.03)
        upper = _curve(-hw, hw, my - 0.02, up, 12)
        lower = _curve(hw, -hw, my - 0.02, up + 0.2, 12)
        pen.poly(upper + lower, (30.0, 25.0, 70.0))
        teeth = _curve(-hw * 0.8, hw * 0.8, my - 0.02, up * 0.8, 10)
        pen.poly(teeth + [(x, y + 0.09) for x, y in reversed(teeth)], (225.0, 230.0, 235.0))
        pen.poly(upper + lower, lip, thick=p.lip_thick, closed=True)
        for side in (-1, 1):  # smile lines
            pen.poly([(side * (nw / 2 + 0.08), nl - 0.05), (side * (hw + 0.08), my - up + 0.05)],
                     skin_dark, thick=0.025)
    else:
        hw = p.mouth_w / 2
        pen.poly(_curve(-hw, hw, my, p.mouth_curve, 10), lip, thick=p.lip_thick)
        pen.poly(_curve(-hw * 0.7, hw * 0.7, my + 0.06, -0.05, 8), _shade(lip, 1.12), thick=p.lip_thick * 0.8)

    if p.mole is not None:
        pen.circle(p.mole, 0.035, (35.0, 40.0, 60.0))

    # Lighting: per-image gain and a directional gradient, then sensor noise.
    g = rng.uniform(0.88, 1.12)
    d = rng.uniform(-0.25, 0.25, 2)
    lin = np.linspace(-0.5, 0.5, image_size, dtype=np.float32)
    light = g * (1.0 + d[0] * lin[None, :] + d[1] * lin[:, None])
    noise = rng.standard_normal((image_size, image_size, 3), dtype=np.float32) * np.float32(rng.uniform(2, 5))
    out = img.astype(np.float32) * light[:, :, None] + noise
    out = np.clip(out + 0.5, 0, 255).astype(np.uint8)
    eyes = (pen.map(-0.5, 0.0), pen.map(0.5, 0.0))
    return out, eyes


def _expression(index: int, rng: np.random.Generator) -> str:
    if index == 1:
        return "neutral"
    if index == 2:
        return "smile"
    return "smile" if rng.random() < 0.5 else "neutral"


def iter_synthetic_faces(*, people: int, images_per_person: int = 2, seed: int = 0, image_size: int = 200
                         ) -> Iterator[tuple[SynthPerson, int, str, np.ndarray, tuple[tuple[float, float], tuple[float, float]]]]:
    """Yield ``(person, image_number, expression, bgr_image, eyes)`` one image at a time."""
    _check(people=people, images_per_person=images_per_person, seed=seed, image_size=image_size)
    for n in range(1, people + 1):
        person = make_person(seed, n)
        for i in range(1, images_per_person + 1):
            rng = _seq(seed, n, i)
            expression = _expression(i, rng)
            img, eyes = draw_face(person, expression=expression, rng=rng, image_size=image_size)
            yield person, i, expression, img, eyes


def _check_int(name: str, value, lo: int, hi: int | None, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ConfigError(f"{name}={value!r} must be an integer {rng}; {fix}")


def _check(*, people, images_per_person, seed, image_size) -> None:
    _check_int("people", people, 1, None, "ask for at least one synthetic person")
    _check_int("images_per_person", images_per_person, 1, None, "use 2 for a neutral and a smiling image")
    _check_int("seed", seed, 0, None, "pass a non-negative integer seed")
    _check_int("image_size", image_size, 64, 4096, "use e.g. 200 (eye distance is 20-35% of the size)")


def make_synthetic_drop(drop_dir, *, people: int, images_per_person: int = 2, seed: int = 0,
                        image_size: int = 200, image_format: str = "png", name: str | None = None) -> Path:
    """Write a drop of synthetic faces (manifest.csv, drop.yaml, images/, then _READY); return its path.

    Images are written one at a time, so memory does not grow with ``people``. The same
    arguments always give the same bytes; person ``n`` is the same in every drop of a seed.
    """
    _check(people=people, images_per_person=images_per_person, seed=seed, image_size=image_size)
    if image_format not in IMAGE_FORMATS:
        raise ConfigError(f"image_format={image_format!r} must be one of {list(IMAGE_FORMATS)}")
    drop = Path(drop_dir)
    if drop.exists() and (not drop.is_dir() or any(drop.iterdir())):
        raise ConfigError(f"drop_dir={str(drop)!r} exists and is not an empty directory; "
                          "pass a new or empty directory so no existing drop is mixed in")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"name={name!r} must be a non-empty string or None (None = the directory name)")
    (drop / "images").mkdir(parents=True, exist_ok=True)
    params = ([cv2.IMWRITE_PNG_COMPRESSION, 1] if image_format == "png" else [cv2.IMWRITE_JPEG_QUALITY, 92])
    t0 = time.perf_counter()
    count = 0
    with open(drop / "manifest.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(MANIFEST_COLUMNS)
        for person, i, expression, img, (le, re_) in iter_synthetic_faces(
                people=people, images_per_person=images_per_person, seed=seed, image_size=image_size):
            rel = f"images/{person.subject_id}_{i}.{image_format}"
            ok, buf = cv2.imencode(f".{image_format}", img, params)
            if not ok:  # pragma: no cover - OpenCV always encodes these
                raise RuntimeError(f"OpenCV could not encode {rel}")
            (drop / rel).write_bytes(buf.tobytes())
            w.writerow([rel, person.subject_id, person.gender, expression,
                        f"{le[0]:.3f}", f"{le[1]:.3f}", f"{re_[0]:.3f}", f"{re_[1]:.3f}"])
            count += 1
    with open(drop / "drop.yaml", "w", encoding="utf-8") as fh:
        yaml.safe_dump({"name": name or drop.resolve().name, "labels": list(LABELS)}, fh, sort_keys=False)
    # _READY last: consumers only pick up complete drops.
    (drop / "_READY").write_bytes(b"")
    dt = time.perf_counter() - t0
    log.info("synthetic drop %s: %d images of %d people in %.1f s (%.2f ms/image)",
             drop, count, people, dt, 1000 * dt / max(count, 1))
    return drop
