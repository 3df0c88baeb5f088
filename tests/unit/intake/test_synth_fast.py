"""Fast synthetic drops (issue 13: a million faces in 20 minutes): same faces, other texture and noise."""
from __future__ import annotations

import csv
from pathlib import Path

import cv2
import numpy as np

from deid.intake.synth import make_synthetic_drop
from deid.intake.synth_face import _noise_fast, draw_face, make_person, seeded_rng


def _rows(drop: Path) -> list[dict[str, str]]:
    with open(drop / "manifest.csv", newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _bytes(drop: Path) -> dict[str, bytes]:
    return {str(p.relative_to(drop)): p.read_bytes() for p in sorted(drop.rglob("*"))
            if p.is_file() and p.name != "drop.yaml"}


def test_fast_drop_is_the_default_drop_redrawn_and_independent_of_workers(tmp_path):
    kw = dict(people=3, seed=5, image_size=96, image_format="jpeg")
    exact = make_synthetic_drop(tmp_path / "exact", **kw)
    one = make_synthetic_drop(tmp_path / "one", fast=True, **kw)
    two = make_synthetic_drop(tmp_path / "two", fast=True, workers=2, chunk_people=1, **kw)
    assert _bytes(one) == _bytes(two) and len(_bytes(one)) == 8  # 6 images, manifest, _READY
    for e, f in zip(_rows(exact), _rows(one), strict=True):
        assert e == f  # same people, labels and eye points
        ie, jf = (cv2.imread(str(d / e["image"])).astype(float) for d in (exact, one))
        assert not np.array_equal(ie, jf) and np.abs(ie - jf).mean() < 8  # only texture and noise differ
        assert (one / e["image"]).stat().st_size < (exact / e["image"]).stat().st_size  # quality 85, not 92


def test_fast_noise_is_gaussian_and_tiles_above_the_bank():
    rng = np.random.default_rng(0)
    small, large = _noise_fast(rng, 200), _noise_fast(rng, 700)
    assert small.shape == (200, 200, 3) and large.shape == (700, 700, 3)
    for field in (small, large):
        assert abs(field.mean()) < 0.05 and abs(field.std() - 1) < 0.05
    img, eyes = draw_face(make_person(1, 1), expression="smile", rng=seeded_rng(1, 1, 2), image_size=700, fast=True)
    exact_eyes = draw_face(make_person(1, 1), expression="smile", rng=seeded_rng(1, 1, 2), image_size=700)[1]
    assert img.shape == (700, 700, 3) and img.dtype == np.uint8 and eyes == exact_eyes
