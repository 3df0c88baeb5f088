"""Tests of the re-identification attacks (deid.evaluation.attacks)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deid.evaluation.attackers import WhitenedCosineAttacker
from deid.evaluation.attacks import attack_rate
from deid.evaluation.scoring import rank_credit, reidentification_rate
from deid.errors import ConfigError
from deid.anonymise.ksame import KSame
from helpers import load_london_aligned

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
    if max(counts) * k > sum(counts):
        # No grouping can keep that person at <= 1/k of every cluster: k-Same refuses.
        from deid.anonymise.ksame import DominantPersonError

        with pytest.raises(DominantPersonError):
            model.fit(originals.astype(np.float64), people=people, images=originals)
        return
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


def load_london():
    """Aligned London faces (read in place): pupils from .tem for neutral, Haar for smiling."""
    faces, people, gender, expr = load_london_aligned(smiling="smile")
    return faces, np.array(people), np.array(gender), np.array(expr)


@pytest.mark.london
@pytest.mark.slow
def test_london_ksame_select_meets_one_over_k():
    from sklearn.decomposition import PCA

    from deid.evaluation.utility_protocols import grouped_cv_accuracy

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


# --------------------------------------------------------------------------- all attackers and modes

from deid.evaluation.attacks import ATTACKERS, attack_all  # noqa: E402
from deid.evaluation.attackers import FisherfacesAttacker, LBPAttacker, MahalanobisAttacker, lbp_codes  # noqa: E402
from deid.anonymise.ksame import KSameSelect  # noqa: E402
from deid.anonymise.methods import deidentify, parrot_for  # noqa: E402

SHAPE = (12, 12)  # make_people's default p=144 pixels viewed as 12 x 12 faces


def smooth_people(n_people, per_person, *, seed=0, noise=3.0):
    """12x12 faces with spatial structure (smoothed random prototypes), so filters keep some identity."""
    import cv2

    rng = np.random.default_rng(seed)
    protos = np.stack([cv2.GaussianBlur(rng.uniform(0, 255, SHAPE).astype(np.float32), (0, 0), 1.0)
                       for _ in range(n_people)])
    protos = (protos - protos.mean()) * 3 + 128
    people = np.repeat(np.arange(n_people), per_person)
    faces = protos[people] + rng.normal(scale=noise, size=(len(people), *SHAPE))
    return np.clip(np.rint(faces), 0, 255).astype(np.uint8).reshape(len(people), -1), people


def test_every_attacker_reidentifies_unprotected_faces():
    originals, people = make_people([2] * 30, seed=11)
    rng = np.random.default_rng(12)
    released = np.clip(originals + rng.normal(scale=2.0, size=originals.shape), 0, 255)
    rows = attack_all(originals=originals, original_people=people, released=released, released_people=people,
                      shape=SHAPE, modes=("naive", "reverse"))
    assert {(r["attacker"], r["mode"]) for r in rows} == {(a, m) for a in ATTACKERS for m in ("naive", "reverse")}
    for r in rows:
        assert r["rate"] >= 0.95, r


def test_every_attacker_and_mode_respects_one_over_k_on_ksame_select():
    originals, people = make_people([2] * 24, seed=13)
    partitions = np.where(people % 2 == 0, "a", "b")
    for k in (2, 3, 4):
        released, clusters = deidentify(originals, shape=SHAPE, people=people, partitions=partitions,
                                         method="k-same-select", k=k, n_components=20)
        parrot = parrot_for("k-same-select", shape=SHAPE, people=people, partitions=partitions, k=k, n_components=20)
        rows = attack_all(originals=originals, original_people=people, released=released, released_people=people,
                          shape=SHAPE, parrot=parrot)
        assert len(rows) == len(ATTACKERS) * 3
        for r in rows:
            assert r["rate"] <= 1 / k + 1e-9, (k, r)


def test_parrot_defeats_blur_and_pixelation():
    originals, people = smooth_people(25, 2, seed=14)
    for method, kw in (("blur", {"sigma": 3.0}), ("pixelate", {"block": 4})):
        released, clusters = deidentify(originals, shape=SHAPE, people=people, method=method, **kw)
        assert clusters is None
        parrot = parrot_for(method, shape=SHAPE, **kw)
        rows = attack_all(originals=originals, original_people=people, released=released, released_people=people,
                          shape=SHAPE, modes=("naive", "parrot"), parrot=parrot)
        parrot_rates = [r["rate"] for r in rows if r["mode"] == "parrot"]
        assert min(parrot_rates) >= 0.9, (method, rows)
        # Each record's parrot gallery image is its released image exactly: far above any 1/k.
        assert max(r["rate"] for r in rows) >= 0.99


def test_attack_all_splits_credit_between_people_sharing_a_face():
    originals, people = make_people([1] * 6, seed=15)
    originals[1] = originals[0]  # persons 0 and 1 have the same face
    released = originals.copy()
    rows = attack_all(originals=originals, original_people=people, released=released, released_people=people,
                      shape=SHAPE, modes=("naive", "reverse"))
    for r in rows:
        # Probes 0 and 1 each face two identical best candidates, one of them right: 1/2 each.
        assert r["rate"] == pytest.approx((0.5 + 0.5 + 4) / 6), r


def test_attack_all_is_invariant_to_record_order():
    originals, people = make_people([2] * 15, seed=16)
    released, _ = deidentify(originals, shape=SHAPE, people=people, method="k-same", k=3, n_components=10)
    parrot = parrot_for("blur", shape=SHAPE, sigma=1.0)
    base = attack_all(originals=originals, original_people=people, released=released, released_people=people,
                      shape=SHAPE, parrot=parrot)
    rng = np.random.default_rng(17)
    po, pr = rng.permutation(len(people)), rng.permutation(len(people))
    other = attack_all(originals=originals[po], original_people=people[po], released=released[pr],
                       released_people=people[pr], shape=SHAPE, parrot=parrot)
    for a, b in zip(base, other):
        assert (a["attacker"], a["mode"]) == (b["attacker"], b["mode"])
        assert a["rate"] == pytest.approx(b["rate"], abs=1e-9), (a, b)


def test_mahalanobis_is_euclidean_in_whitened_pca_space():
    faces, people = make_people([1] * 20, p=30, seed=18)
    att = MahalanobisAttacker(5).fit(faces, people=people)
    from sklearn.decomposition import PCA

    pca = PCA(5).fit(faces.astype(float))
    z = pca.transform(faces.astype(float)) / np.sqrt(pca.explained_variance_)
    expected = -np.sqrt(((z[:3, None, :] - z[None, :, :]) ** 2).sum(axis=2))
    np.testing.assert_allclose(att.similarity(faces[:3]), expected, atol=1e-6)


def test_fisherfaces_uses_labels_and_falls_back_without_within_class_scatter():
    faces, people = make_people([3] * 10, p=50, seed=19)
    att = FisherfacesAttacker().fit(faces, people=people)
    assert att.fallback_ is None
    assert att.n_components_ == 9  # c - 1
    assert att.pca_.n_components_ == 20  # n - c
    single, ids = make_people([1] * 8, p=50, seed=20)
    fb = FisherfacesAttacker().fit(single, people=ids)
    assert fb.fallback_ and "LDA is undefined" in fb.fallback_
    assert np.isfinite(fb.similarity(single)).all()
    with pytest.raises(ConfigError, match="metric="):
        FisherfacesAttacker(metric="manhattan").fit(faces, people=people)


def test_lbp_codes_and_uniform_histograms():
    flat = np.full((1, 5, 5), 100.0)
    assert (lbp_codes(flat) == 255).all()  # every neighbour >= centre
    spot = flat.copy()
    spot[0, 2, 2] = 200.0  # a bright centre: all neighbours darker
    assert lbp_codes(spot)[0, 2, 2] == 0
    imgs = np.random.default_rng(0).integers(0, 256, (4, 120))
    att = LBPAttacker(shape=(10, 12), grid=(2, 3)).fit(imgs, people=[0, 1, 2, 3])
    assert att.n_bins_ == 59  # 58 uniform 8-bit patterns + 1 for the rest
    assert att.gallery_.shape == (4, 6 * 59)
    np.testing.assert_allclose(att.gallery_.reshape(4, 6, 59).sum(axis=2), 1.0, rtol=1e-6)
    sim = att.similarity(imgs)  # minus chi-square: 0 for an image against itself, negative otherwise
    assert np.allclose(np.diag(sim), 0.0, atol=1e-6)
    assert (sim[~np.eye(4, dtype=bool)] < -1e-3).all()
    with pytest.raises(ConfigError, match="shape="):
        LBPAttacker(shape=(10, 10)).fit(np.zeros((3, 120)) + np.arange(3)[:, None], people=[0, 1, 2])


def test_attack_all_errors_are_clear():
    faces, people = make_people([1] * 5, seed=21)
    with pytest.raises(ConfigError, match="parrot=None"):
        attack_all(originals=faces, original_people=people, released=faces, released_people=people, shape=SHAPE)
    with pytest.raises(ConfigError, match="modes="):
        attack_all(originals=faces, original_people=people, released=faces, released_people=people, shape=SHAPE,
                   modes=("sideways",))
    with pytest.raises(ConfigError, match="attackers="):
        attack_all(originals=faces, original_people=people, released=faces, released_people=people, shape=SHAPE,
                   modes=("naive",), attackers=["eigen-magic"])
    with pytest.raises(ConfigError, match="shape="):
        attack_all(originals=faces, original_people=people, released=faces, released_people=people, shape=(10, 10),
                   modes=("naive",))
