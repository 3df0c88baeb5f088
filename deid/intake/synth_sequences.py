"""Synthetic image-sequence drops: cartoon people talking and smiling, frame by frame.

Each person (:func:`deid.intake.synth_face.make_person`, the same people as the still drops of a
seed) gets ``sequences_per_person`` sequences of ``frames`` frames, alternately *talking*
(the mouth opens and closes: openness ``0.5 (1 - cos(2 pi t / 6))``, label ``talk`` when the
mouth is at least half open, else ``neutral``) and *smiling* (neutral, then a smile over the
middle third, then neutral again). A sequence keeps one scene: background, placement,
lighting and the sensor noise pattern are drawn once; every frame adds a small smooth head
motion (rotation <= 1.5 degrees, shift <= 1 px, eye points moved with it) and fresh noise.
The manifest has ``sequence`` and ``frame`` columns besides the usual ones.
"""
from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

import cv2
import numpy as np
import yaml

from deid.errors import ConfigError
from deid.intake.synth import EYE_COLUMNS, LABELS, check_int
from deid.intake.synth_face import draw_face, make_person, seeded_rng

log = logging.getLogger(__name__)

SEQUENCE_KINDS: tuple[str, ...] = ("talking", "smiling")
COLUMNS: tuple[str, ...] = ("image", "subject_id", *LABELS, *EYE_COLUMNS, "sequence", "frame")
TALK_PERIOD = 6  # frames per open-close cycle of a talking mouth


def frame_states(kind: str, frames: int) -> list[tuple[str, str, float | None]]:
    """Per frame: (expression drawn, expression label, mouth openness or None) of a sequence ``kind``."""
    if kind not in SEQUENCE_KINDS:
        raise ConfigError(f"kind={kind!r} must be one of {list(SEQUENCE_KINDS)}")
    out = []
    for t in range(frames):
        if kind == "talking":
            o = 0.5 * (1.0 - math.cos(2.0 * math.pi * t / TALK_PERIOD))
            out.append(("neutral", "talk" if o >= 0.5 else "neutral", o))
        else:
            smile = frames // 3 <= t < frames - frames // 3
            out.append(("smile", "smile", None) if smile else ("neutral", "neutral", None))
    return out


def draw_sequence(seed: int, number: int, index: int, *, frames: int = 12, image_size: int = 200):
    """Yield ``(frame, label, bgr_image, eyes)`` for sequence ``index`` (0-based) of person ``number``.

    The kind alternates with ``index`` and the person (talking first for odd people), so both kinds
    cover both genders.
    """
    person = make_person(seed, number)
    kind = SEQUENCE_KINDS[(index + number) % 2]
    for t, (drawn, label, mouth) in enumerate(frame_states(kind, frames)):
        # The same scene generators every frame: one background, placement, lighting and noise pattern.
        img, (le, re_) = draw_face(person, expression=drawn, rng=seeded_rng(seed, number, 10_000 + index),
                                   image_size=image_size, mouth_open=mouth,
                                   light_rng=seeded_rng(seed, number, 10_000 + index, 1))
        phase = 2.0 * math.pi * t / max(frames, 1)
        m = cv2.getRotationMatrix2D(((le[0] + re_[0]) / 2, (le[1] + re_[1]) / 2), 1.5 * math.sin(phase), 1.0)
        m[:, 2] += (1.0 * math.sin(phase), 0.7 * math.cos(phase) - 0.7)
        img = cv2.warpAffine(img, m, (img.shape[1], img.shape[0]), flags=cv2.INTER_LINEAR,
                             borderMode=cv2.BORDER_REFLECT)
        noise = seeded_rng(seed, number, 10_000 + index, 2 + t).normal(0, 2.0, img.shape)
        img = np.clip(img + noise + 0.5, 0, 255).astype(np.uint8)
        eyes = tuple((float(m[0, 0] * x + m[0, 1] * y + m[0, 2]), float(m[1, 0] * x + m[1, 1] * y + m[1, 2]))
                     for x, y in (le, re_))
        yield t, label, img, eyes


def make_sequence_drop(drop_dir, *, people: int, sequences_per_person: int = 2, frames: int = 12, seed: int = 0,
                       image_size: int = 200, name: str | None = None) -> Path:
    """Write a drop of synthetic talking/smiling sequences (PNG frames, manifest with sequence and frame).

    Labels are ``gender`` (constant per person) and ``expression`` (per frame: ``neutral``,
    ``talk`` or ``smile``). Sequence ids are ``<subject>-q<index>``; frames are numbered from 0.
    """
    check_int("people", people, 1, None, "ask for at least one synthetic person")
    check_int("sequences_per_person", sequences_per_person, 1, 100, "use e.g. 2 (one talking, one smiling)")
    check_int("frames", frames, 2, 10_000, "use e.g. 12 frames per sequence")
    check_int("seed", seed, 0, None, "pass a non-negative integer seed")
    check_int("image_size", image_size, 64, 4096, "use e.g. 200")
    drop = Path(drop_dir)
    if drop.exists() and (not drop.is_dir() or any(drop.iterdir())):
        raise ConfigError(f"drop_dir={str(drop)!r} exists and is not an empty directory; pass a new or empty directory")
    (drop / "images").mkdir(parents=True, exist_ok=True)
    n = 0
    with open(drop / "manifest.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for number in range(1, people + 1):
            person = make_person(seed, number)
            for q in range(sequences_per_person):
                sequence = f"{person.subject_id}-q{q}"
                for t, label, img, (le, re_) in draw_sequence(seed, number, q, frames=frames, image_size=image_size):
                    rel = f"images/{sequence}-f{t:04d}.png"
                    ok, buf = cv2.imencode(".png", img, [cv2.IMWRITE_PNG_COMPRESSION, 1])
                    if not ok:  # pragma: no cover - OpenCV always encodes PNG
                        raise RuntimeError("OpenCV could not encode a PNG frame")
                    (drop / rel).write_bytes(buf.tobytes())
                    w.writerow([rel, person.subject_id, person.gender, label, f"{le[0]:.3f}", f"{le[1]:.3f}",
                                f"{re_[0]:.3f}", f"{re_[1]:.3f}", sequence, t])
                    n += 1
    with open(drop / "drop.yaml", "w", encoding="utf-8") as fh:
        yaml.safe_dump({"name": name or drop.resolve().name, "labels": list(LABELS)}, fh, sort_keys=False)
    (drop / "_READY").write_bytes(b"")  # last: consumers only pick up complete drops
    log.info("synthetic sequence drop %s: %d frames, %d people x %d sequences x %d frames", drop, n, people,
             sequences_per_person, frames)
    return drop
