"""dlib ResNet recogniser: chip geometry, embedder contract, the dlib-resnet attacker, same-person pairs."""
from __future__ import annotations

import csv
import math

import cv2
import numpy as np
import pytest
from helpers import load_london_aligned, london_descriptors
from scipy.stats import beta

import deid.evaluation.recognizer as recognizer
from deid.alignment.eyes import EyePair
from deid.alignment.canonical import FaceAligner
from deid.evaluation.attacks import ATTACKERS, attack_all
from deid.evaluation.scoring import rank_credit
from deid.errors import ConfigError
from deid.intake.imaging import decode_gray
from deid.evaluation.recognizer import (
    DESCRIPTOR_CACHE,
    DESCRIPTOR_STORE_ENV,
    SAME_PERSON_THRESHOLD,
    DlibEmbedder,
    DlibResNetAttacker,
    chip_eyes,
    embedding_distances,
    same_person_pairs,
)

SHAPE = (92, 81)


def _faces(n: int, seed: int) -> np.ndarray:
    """Smooth random grey textures of the canonical size (any image can be embedded)."""
    rng = np.random.default_rng(seed)
    out = [np.clip(cv2.GaussianBlur(rng.normal(128, 70, SHAPE), (0, 0), 3), 0, 255) for _ in range(n)]
    return np.rint(np.array(out)).astype(np.uint8).reshape(n, -1)


def _count_computed(monkeypatch) -> list[int]:
    """Record how many rows each network call embeds (with no descriptor store: every miss is a call)."""
    monkeypatch.delenv(DESCRIPTOR_STORE_ENV, raising=False)
    calls: list[int] = []
    real = DlibEmbedder._compute

    def spy(self, a):
        calls.append(len(a))
        return real(self, a)

    monkeypatch.setattr(DlibEmbedder, "_compute", spy)
    return calls


def test_chip_eyes_are_dlibs_template_corner_midpoints():
    left, right = chip_eyes()
    assert left == pytest.approx((47.73, 47.14), abs=0.01)
    assert right == pytest.approx((100.28, 47.12), abs=0.01)


def test_chip_puts_the_canonical_eyes_on_dlibs_eyes():
    # Two bright dots on the canonical eyes must land on the chip's eye points, in all three channels.
    img = np.full(SHAPE, 20, np.uint8)
    for x, y in ((0.30 * 81, 0.37 * 92), (0.70 * 81, 0.37 * 92)):
        cv2.circle(img, (round(x * 16), round(y * 16)), 16 * 2, 255, -1, shift=4)
    chip = DlibEmbedder().chips(img.reshape(1, -1))[0]
    assert chip.shape == (150, 150, 3) and chip.dtype == np.uint8
    assert (chip[:, :, 0] == chip[:, :, 1]).all() and (chip[:, :, 1] == chip[:, :, 2]).all()
    w = np.clip(chip[:, :, 0].astype(float) - 20, 0, None)
    yy, xx = np.mgrid[0:150, 0:150]
    for cx, cy in chip_eyes():
        m = w * ((xx - cx) ** 2 + (yy - cy) ** 2 < 15**2)
        got = ((m * xx).sum() / m.sum(), (m * yy).sum() / m.sum())
        assert math.hypot(got[0] - cx, got[1] - cy) < 0.7, (got, (cx, cy))


def test_embedder_shape_determinism_and_dedup(monkeypatch):
    DESCRIPTOR_CACHE.clear()
    calls = _count_computed(monkeypatch)
    faces = _faces(3, seed=1)
    x = np.vstack([faces, faces[[0, 0]]])  # rows 3 and 4 repeat row 0
    a = DlibEmbedder().transform(x)
    assert a.shape == (5, 128) and a.dtype == np.float32 and np.isfinite(a).all()
    assert calls == [3]  # the repeated rows are embedded once
    assert (a[3] == a[0]).all() and (a[4] == a[0]).all()
    b = DlibEmbedder().transform(x.astype(np.float64))  # floats of the same images: served by the cache
    assert calls == [3]
    np.testing.assert_array_equal(a, b)
    DESCRIPTOR_CACHE.clear()
    np.testing.assert_allclose(DlibEmbedder().transform(faces), a[:3], atol=1e-6)  # recomputed: same values
    assert calls == [3, 3]


def test_a_descriptor_store_serves_another_process_the_same_descriptors(monkeypatch, tmp_path):
    """DEID_DESCRIPTOR_CACHE: what one process embedded, the next reads instead of running the network."""
    faces = _faces(3, seed=4)
    monkeypatch.delenv(DESCRIPTOR_STORE_ENV, raising=False)
    DESCRIPTOR_CACHE.clear()
    plain = DlibEmbedder().transform(faces)  # no store: computed
    monkeypatch.setenv(DESCRIPTOR_STORE_ENV, str(tmp_path / "store"))
    DESCRIPTOR_CACHE.clear()
    calls = []
    real = DlibEmbedder._compute
    monkeypatch.setattr(DlibEmbedder, "_compute", lambda self, a: calls.append(len(a)) or real(self, a))
    first = DlibEmbedder().transform(faces)  # computed and stored
    DESCRIPTOR_CACHE.clear()  # as a new process: only the store holds them
    second = DlibEmbedder().transform(np.vstack([faces, _faces(1, seed=5)]))
    assert calls == [3, 1]  # the stored three were read, only the new face ran through the network
    np.testing.assert_array_equal(first, plain)
    np.testing.assert_array_equal(second[:3], plain)


@pytest.mark.parametrize(
    "kwargs,x,match",
    [
        ({}, np.zeros((2, 100), np.uint8), "rows have 100 values"),
        ({"eye_left": (0.8, 0.37)}, np.zeros((1, 92 * 81), np.uint8), "eye_left"),
        ({"eye_right": (1.3, 0.3)}, np.zeros((1, 92 * 81), np.uint8), "eye_right"),
        ({"shape": (4, 4)}, np.zeros((1, 16), np.uint8), "shape="),
        ({"batch_size": 0}, np.zeros((1, 92 * 81), np.uint8), "batch_size"),
        ({}, np.full((1, 92 * 81), np.nan), "NaN"),
    ],
)
def test_embedder_errors_name_the_parameter(kwargs, x, match):
    with pytest.raises(ConfigError, match=match):
        DlibEmbedder(**kwargs).transform(x)


def test_attacker_contract_and_ties():
    faces = _faces(4, seed=2)
    gallery = np.vstack([faces[0], faces[0], faces[1], faces[2]])  # persons a and b share one image
    people = ["a", "b", "c", "d"]
    att = ATTACKERS["dlib-resnet"](SHAPE)
    assert isinstance(att, DlibResNetAttacker)
    assert att.fit(gallery, people=people) is att
    s = att.similarity(np.vstack([faces[0], faces[1], faces[3]]))
    assert s.shape == (3, 4)
    assert s[0, 0] == s[0, 1] == s.max()  # identical images tie exactly, at the top
    assert s[1, 2] == pytest.approx(0.0, abs=1e-3) and (s <= 1e-3).all()  # minus a distance
    credit = rank_credit(s[:2], ["a", "c"], people)
    assert credit.tolist() == [0.5, 1.0]  # the tie splits the credit
    att.enroll(faces[:2], people=["x", "y"])
    assert att.similarity(faces[:1]).shape == (1, 2)
    with pytest.raises(ConfigError, match="not fitted"):
        DlibResNetAttacker().similarity(faces)


def test_attack_all_embeds_each_distinct_face_once(monkeypatch):
    # k-Same-like release: two clusters, every member gets its cluster's one image; parrot likewise.
    DESCRIPTOR_CACHE.clear()
    calls = _count_computed(monkeypatch)
    originals = _faces(6, seed=3)
    people = np.arange(6)
    released = np.vstack([originals[0]] * 3 + [originals[3]] * 3) // 2 + 60
    rows = attack_all(originals=originals, original_people=people, released=released, released_people=people,
                      shape=SHAPE, attackers=["dlib-resnet"], parrot=lambda o: o // 2 + 60)
    assert [r["mode"] for r in rows] == ["naive", "reverse", "parrot"]
    # 6 originals + 2 distinct released + 6 parrot images (4 of them new), each embedded once.
    assert sum(calls) == len(np.unique(np.vstack([originals, released, originals // 2 + 60]), axis=0))
    for r in rows:
        assert r["rate"] <= 1 / 3 + 1e-9, r  # identical images: ties, never more than 1/k


def test_same_person_pairs_on_constructed_descriptors():
    rng = np.random.default_rng(4)
    base = rng.normal(size=(6, 128)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True) / 0.6  # different people ~0.85 apart
    e = np.vstack([base, base[2] + 0.01])  # record 6 is person 2 again, under another id
    ids = ["p0", "p1", "p2", "p3", "p4", "p5", "other"]
    m = same_person_pairs(e, ids)
    assert m.informative and m.threshold_used == SAME_PERSON_THRESHOLD
    assert [(p.i, p.j, p.id_i, p.id_j) for p in m.pairs] == [(2, 6, "p2", "other")]
    assert m.pairs[0].distance == pytest.approx(float(np.linalg.norm(np.full(128, 0.01))), rel=1e-3)
    same_id = same_person_pairs(e, ids[:6] + ["p2"])  # same id: nothing to merge
    assert same_id.pairs == ()
    # Faces the recogniser cannot separate (all close): only near-copies match.
    close = np.vstack([base[0] + rng.normal(scale=0.02, size=128) for _ in range(5)] + [base[0]])
    weak = same_person_pairs(close, list("abcdef"))
    assert not weak.informative and weak.threshold_used == recognizer.DUPLICATE_THRESHOLD
    assert len(weak.pairs) < 15  # not every one of the 15 pairs
    with pytest.raises(ConfigError, match="ids has 2"):
        same_person_pairs(e, ["a", "b"])
    with pytest.raises(ConfigError, match="threshold="):
        same_person_pairs(e, ids, threshold=-1)


# ---------------------------------------------------------------------------------------- London


@pytest.fixture(scope="module")
def london_embedded():
    """London aligned by deid (81x92 grey) and embedded (once per test process: helpers.london_descriptors)."""
    faces, people, _, expr = load_london_aligned()
    return faces, np.array(people), np.array(expr), london_descriptors()


@pytest.mark.slow
@pytest.mark.london
@pytest.mark.xdist_group("london-dlib")
def test_london_rank1_identification_of_originals(london_embedded):
    # Smiling originals identified against the neutral gallery. Measured 102/102 (Clopper-Pearson
    # 95% lower bound 0.971); chance is 1/102. The PCA attackers reach ~0.6-0.8 here.
    faces, people, expr, e = london_embedded
    neutral = expr == "neutral"
    att = DlibResNetAttacker().fit(faces[neutral], people=people[neutral])
    credit = rank_credit(att.similarity(faces[~neutral]), people[~neutral], people[neutral])
    assert (~neutral).sum() >= 101
    assert credit.mean() >= 0.95, credit.mean()


@pytest.mark.slow
@pytest.mark.london
@pytest.mark.xdist_group("london-dlib")
def test_london_same_person_under_two_ids_and_no_false_merges(london_embedded):
    faces, people, expr, e = london_embedded
    # Every smiling photo listed under a second id of its person.
    ids = [p if x == "neutral" else p + "-again" for p, x in zip(people, expr)]
    m = same_person_pairs(e, ids)
    assert m.informative and m.median_other_distance > 0.7
    true = [p for p in m.pairs if people[p.i] == people[p.j]]
    false = [p for p in m.pairs if people[p.i] != people[p.j]]
    genuine = len(set(people[expr != "neutral"]) & set(people[expr == "neutral"]))
    # Measured: 102/102 found, 0 false matches in 20,604 different-person pairs (95% upper 1.5e-4).
    n_other = int((people[:, None] != people[None, :]).sum() // 2)
    assert len(true) >= genuine - 2, (len(true), genuine)
    assert len(false) <= math.ceil(beta.ppf(0.95, 1, n_other) * n_other), false
    # One photo, plus noisy copies under four more ids (the duplicate-ids attack): all linked.
    rng = np.random.default_rng(5)
    copies = np.clip(faces[0] + rng.normal(0, 3, (4, faces.shape[1])), 0, 255).round().astype(np.uint8)
    dup = same_person_pairs(np.vstack([e, DlibEmbedder().transform(copies)]), ids + [f"fake{i}" for i in range(4)])
    linked = {(p.i, p.j) for p in dup.pairs if p.j >= len(e) and (p.i == 0 or p.i >= len(e))}
    assert len(linked) == 10  # 0-copy x 4 and copy-copy x 6


@pytest.mark.slow
def test_synthetic_cartoon_faces_are_not_informative(tmp_path):
    # dlib does not separate deid's synthetic cartoon people (different ids median ~0.47): no merging
    # of different synthetic people, the drop falls back to near-copies only.
    from deid.intake.synth import make_synthetic_drop

    drop = make_synthetic_drop(tmp_path / "s", people=15, images_per_person=2, seed=3)
    aligner = FaceAligner()
    faces, ids = [], []
    with open(drop / "manifest.csv", newline="") as fh:
        for r in csv.DictReader(fh):
            eyes = EyePair((float(r["eye_left_x"]), float(r["eye_left_y"])), (float(r["eye_right_x"]), float(r["eye_right_y"])))
            faces.append(aligner.align(decode_gray((drop / r["image"]).read_bytes()), eyes).image.reshape(-1))
            ids.append(r["subject_id"])
    e = DlibEmbedder().transform(np.array(faces))
    m = same_person_pairs(e, ids)
    assert not m.informative and m.median_other_distance < 0.6
    assert m.pairs == ()
    d = embedding_distances(e, e)
    assert d[~np.eye(len(e), dtype=bool)].min() > m.threshold_used
