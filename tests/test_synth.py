"""The synthetic face-drop generator: deterministic, exact eye points, and faces that carry signal."""
from __future__ import annotations

import csv
import hashlib

import cv2
import numpy as np
import pytest

from deid.align import EyePair, FaceAligner
from deid.attacks import WhitenedCosineAttacker, reidentification_rate
from deid.drop import read_drop
from deid.errors import ConfigError
from deid.synth import make_synthetic_drop
from deid.utility import grouped_cv_accuracy


def _digest(drop) -> str:
    h = hashlib.sha256()
    for p in sorted(drop.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(drop).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def test_deterministic_per_seed(tmp_path):
    a = make_synthetic_drop(tmp_path / "a", people=4, seed=3, name="s")
    b = make_synthetic_drop(tmp_path / "b", people=4, seed=3, name="s")
    c = make_synthetic_drop(tmp_path / "c", people=4, seed=4, name="s")
    assert _digest(a) == _digest(b) != _digest(c)
    # A larger drop with the same seed starts with the same people.
    d = make_synthetic_drop(tmp_path / "d", people=6, seed=3)
    assert (a / "images" / "s00002_1.png").read_bytes() == (d / "images" / "s00002_1.png").read_bytes()


def test_drop_is_canonical_and_eyes_fall_on_pupils(tmp_path):
    drop = make_synthetic_drop(tmp_path / "d", people=6, images_per_person=3, seed=1, image_format="jpg")
    parsed = read_drop(drop)
    assert parsed.labels == ["gender", "expression"] and len(parsed.rows) == 18 and not parsed.quarantined
    assert (drop / "_READY").exists()
    with open(drop / "manifest.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["expression"] for r in rows if r["image"].endswith("_1.jpg")} == {"neutral"}
    assert {r["expression"] for r in rows if r["image"].endswith("_2.jpg")} == {"smile"}
    for r in rows:
        img = cv2.imread(str(drop / r["image"]), cv2.IMREAD_GRAYSCALE)
        for x, y in ((r["eye_left_x"], r["eye_left_y"]), (r["eye_right_x"], r["eye_right_y"])):
            x, y = round(float(x)), round(float(y))
            # The pupil is the darkest thing around the eye centre.
            patch = img[max(0, y - 12): y + 13, max(0, x - 12): x + 13]
            assert img[y, x] <= np.percentile(patch, 20) + 10


def test_bad_parameters_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="people"):
        make_synthetic_drop(tmp_path / "x", people=0)
    with pytest.raises(ConfigError, match="png|jpg"):
        make_synthetic_drop(tmp_path / "y", people=2, image_format="gif")


@pytest.mark.slow
def test_faces_carry_identity_gender_and_expression(tmp_path):
    drop = make_synthetic_drop(tmp_path / "d", people=60, images_per_person=2, seed=7)
    d = read_drop(drop)
    aligner = FaceAligner()
    pix, people, gender, expr = [], [], [], []
    for r in d.rows:
        gray = cv2.imread(str(r.path), cv2.IMREAD_GRAYSCALE)
        face = aligner.align(gray, EyePair(*r.eyes)).image
        pix.append(face.ravel())
        people.append(r.subject_id)
        gender.append(r.labels["gender"])
        expr.append(r.labels["expression"])
    X = np.asarray(pix)
    people = np.asarray(people, dtype=object)
    assert grouped_cv_accuracy(X, gender, groups=people, repeats=3).accuracy >= 0.85
    assert grouped_cv_accuracy(X, expr, groups=people, repeats=3).accuracy >= 0.85
    first = np.arange(0, len(X), 2)
    second = first + 1
    attacker = WhitenedCosineAttacker(n_components=50).fit(X[first], people=people[first])
    rate = reidentification_rate(attacker.similarity(X[second]), people[second], people[first])
    assert rate >= 0.7
