"""Tests of the re-identification attacks (deid.attacks)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deid.attacks import WhitenedCosineAttacker, attack_rate, rank_credit, reidentification_rate
from deid.errors import ConfigError
from deid.ksame import KSame

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_people(images_per_person, *, p=144, noise=12.0, seed=0):
    """Faces as uint8 pixel vectors: a random prototype per person plus per-image noise."""
    rng = np.random.default_rng(seed)
    people = np.repeat(np.arange(len(images_per_person)), images_per_person)
    protos = rng.uniform(40, 215, size=(len(images_per_person), p))
    faces = protos[people] + rng.normal(scale=noise, size=(len(people), p))
    return np.clip(np.rint(faces), 0, 255).astype(np.uint8), people


def naive_bound(labels, people):
    """Naive-mode ceiling: identical probes of a cluster share one candidate set C, so their
    credits sum to sum_{c in C} m(person(c)) / |C| <= max_person m; summed over clusters / N."""
    total = 0
    for c in np.unique(labels):
        total += max(Counter(people[labels == c].tolist()).values())
    return total / len(labels)


def test_unprotected_release_is_reidentified():
    originals, people = make_people([3] * 40, seed=1)
    rng = np.random.default_rng(2)
    released = np.clip(originals + rng.normal(scale=2.0, size=originals.shape), 0, 255)
    for mode in ("naive", "reverse"):
        rate = attack_rate(WhitenedCosineAttacker(30), originals=originals, original_people=people,
                           released=released, released_people=people, mode=mode)
        assert rate >= 0.95, (mode, rate)


@FAST
@given(
    k=st.integers(2, 5),
    counts=st.lists(st.integers(1, 4), min_size=6, max_size=25),
    seed=st.integers(0, 2**16),
)
def test_ksame_release_respects_the_attack_bound(k, counts, seed):
    if len(counts) < k:
        return
    originals, people = make_people(counts, p=64, seed=seed)
    model = KSame(k)
    released = model.fit_transform(originals.astype(np.float64), people=people, images=originals)
    attacker = WhitenedCosineAttacker(20)
    naive = attack_rate(attacker, originals=originals, original_people=people,
                        released=released, released_people=people, mode="naive")
    reverse = attack_rate(attacker, originals=originals, original_people=people,
                          released=released, released_people=people, mode="reverse")
    assert naive <= naive_bound(model.labels_, people) + 1e-9
    # Reverse: a probe's candidates are whole clusters (identical copies), so its credit is
    # at most the largest one-person share of a cluster.
    assert reverse <= model.cluster_max_share_.max() + 1e-9
    if np.all(model.cluster_max_share_ * model.cluster_sizes_ == 1):
        # One image per person per cluster: the k-Same promise holds in both modes.
        assert naive <= 1 / k + 1e-9
        assert reverse <= 1 / k + 1e-9


def test_identical_gallery_images_split_credit():
    s = np.array([[0.9, 0.9, 0.1], [0.2, 0.3, 0.3], [0.5, 0.1, 0.0]])
    credit = rank_credit(s, ["a", "c", "a"], ["a", "b", "c"])
    np.testing.assert_allclose(credit, [0.5, 0.5, 1.0])
    assert reidentification_rate(s, ["a", "c", "a"], ["a", "b", "c"]) == pytest.approx(2 / 3)

    # The same through the recogniser: two people share one identical gallery image.
    faces, people = make_people([1] * 8, seed=3)
    faces[1] = faces[0]
    attacker = WhitenedCosineAttacker(5).fit(faces, people=people)
    sim = attacker.similarity(faces[:1])
    assert reidentification_rate(sim, people[:1], people) == pytest.approx(0.5)


def test_near_ties_within_rtol_are_ties():
    s = np.array([[1.0, 1.0 - 1e-12, 0.5]])
    assert reidentification_rate(s, [0], [0, 1, 2]) == pytest.approx(0.5)
    assert reidentification_rate(s, [0], [0, 1, 2], rtol=0.0) == 1.0


@FAST
@given(
    data=st.data(),
    m=st.integers(1, 8),
    n=st.integers(1, 12),
)
def test_rate_does_not_depend_on_gallery_order(data, m, n):
    values = data.draw(st.lists(st.integers(0, 3), min_size=m * n, max_size=m * n))
    s = np.array(values, dtype=np.float64).reshape(m, n)  # few values: many ties
    gallery_people = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    probe_people = data.draw(st.lists(st.integers(0, 4), min_size=m, max_size=m))
    perm = data.draw(st.permutations(list(range(n))))
    a = reidentification_rate(s, probe_people, gallery_people)
    b = reidentification_rate(s[:, perm], probe_people, [gallery_people[j] for j in perm])
    assert a == b


def test_reverse_rate_ignores_order_of_identical_released_copies():
    originals, people = make_people([1] * 12, seed=4)
    model = KSame(3)
    released = model.fit_transform(originals.astype(np.float64), people=people, images=originals)
    rates = []
    for perm in (np.arange(12), np.arange(12)[::-1], np.random.default_rng(5).permutation(12)):
        rates.append(attack_rate(WhitenedCosineAttacker(10), originals=originals, original_people=people,
                                 released=released[perm], released_people=people[perm], mode="reverse"))
    assert max(rates) - min(rates) < 1e-12
    assert rates[0] <= 1 / 3 + 1e-9


def test_attacker_fits_on_originals_and_caps_components():
    originals, people = make_people([1] * 6, seed=6)
    released = np.full_like(originals, 128)
    attacker = WhitenedCosineAttacker(50)
    attack_rate(attacker, originals=originals, original_people=people,
                released=released, released_people=people, mode="reverse")
    np.testing.assert_allclose(attacker.pca_.mean_, originals.mean(axis=0))
    assert attacker.n_components_ == 5  # min(50, n - 1, p)
    assert attacker.gallery_.shape == (6, 5)

    dup = np.vstack([originals, originals])  # duplicates: rank 5 in 11 possible components
    fitted = WhitenedCosineAttacker(50).fit(dup, people=np.r_[people, people])
    assert fitted.n_components_ == 5
    assert np.isfinite(fitted.similarity(originals)).all()


def test_attack_errors_are_clear():
    faces, people = make_people([1] * 5, seed=7)
    with pytest.raises(ConfigError, match="mode="):
        attack_rate(WhitenedCosineAttacker(), originals=faces, original_people=people,
                    released=faces, released_people=people, mode="both")
    with pytest.raises(ConfigError, match="not fitted"):
        WhitenedCosineAttacker().similarity(faces)
    with pytest.raises(ConfigError, match="n_components=0"):
        WhitenedCosineAttacker(0).fit(faces, people=people)
    with pytest.raises(ConfigError, match="people has 4 entries"):
        WhitenedCosineAttacker().fit(faces, people=people[:4])
    with pytest.raises(ConfigError, match="NaN"):
        reidentification_rate(np.array([[np.nan, 1.0]]), [0], [0, 1])
    with pytest.raises(ConfigError, match="pixels"):
        WhitenedCosineAttacker(3).fit(faces, people=people).similarity(faces[:, :10])


LONDON = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "london"


def load_london():
    """Aligned London faces (read in place): pupils from .tem for neutral, Haar for smiling."""
    import csv

    from deid.align import EyePair, FaceAligner
    from deid.errors import RecordError
    from deid.imaging import decode_gray

    if not (LONDON / "london_info.csv").is_file():
        pytest.fail(f"the London set is missing at {LONDON}; see ../shared/datasets/london/README.md")
    info = {r["face_id"].zfill(3): r["face_gender"] for r in csv.DictReader(open(LONDON / "london_info.csv"))}
    aligner = FaceAligner()
    faces, people, gender, expr = [], [], [], []
    for folder, ex in (("neutral_front", "neutral"), ("smiling_front", "smile")):
        for f in sorted((LONDON / folder).glob("*.jpg")):
            eyes = None
            if f.with_suffix(".tem").is_file():
                lines = f.with_suffix(".tem").read_text().splitlines()
                eyes = EyePair(*[tuple(float(v) for v in lines[1 + i].split()[:2]) for i in range(2)])
            try:
                face = aligner.align(decode_gray(f.read_bytes()), eyes)
            except RecordError:
                continue
            faces.append(face.image.reshape(-1))
            people.append(f.name[:3])
            gender.append(info[f.name[:3]])
            expr.append(ex)
    return np.array(faces), np.array(people), np.array(gender), np.array(expr)


@pytest.mark.london
@pytest.mark.slow
def test_london_ksame_select_meets_one_over_k():
    from sklearn.decomposition import PCA

    from deid.ksame import KSameSelect
    from deid.utility import grouped_cv_accuracy

    faces, people, gender, expr = load_london()
    assert len(faces) >= 180  # 204 photos; a few smiling ones may fail eye detection
    unprotected = attack_rate(WhitenedCosineAttacker(50), originals=faces, original_people=people,
                              released=faces, released_people=people)
    assert unprotected >= 0.95
    X = PCA(50, random_state=0).fit_transform(faces.astype(np.float64))
    k = 5
    model = KSameSelect(k)
    released = model.fit_transform(X, people=people, images=faces, partitions=list(zip(gender, expr)))
    for mode in ("naive", "reverse"):
        rate = attack_rate(WhitenedCosineAttacker(50), originals=faces, original_people=people,
                           released=released, released_people=people, mode=mode)
        assert rate <= 1 / k + 1e-9, (mode, rate)
    util = grouped_cv_accuracy(released, gender, groups=model.labels_, seed=0)
    assert util.accuracy >= 0.75, util
