"""Tests of the utility evaluation (deid.utility)."""
from __future__ import annotations

import numpy as np
import pytest

from deid.errors import ConfigError
from deid.utility import UtilityResult, grouped_cv_accuracy, grouped_splits


def faces(n_people=40, per_person=3, p=100, seed=0, separable=True):
    """Pixel vectors whose label shifts a block of pixels (separable) or is random."""
    rng = np.random.default_rng(seed)
    people = np.repeat(np.arange(n_people), per_person)
    label_of_person = rng.integers(0, 2, size=n_people)
    y = label_of_person[people]
    base = rng.uniform(60, 190, size=(n_people, p))[people] + rng.normal(scale=8, size=(len(people), p))
    if separable:
        base[:, :20] += np.where(y[:, None] == 1, 40.0, -40.0)
    return np.clip(base, 0, 255).astype(np.uint8), y, people


def test_separable_label_is_learned():
    X, y, people = faces(seed=1)
    res = grouped_cv_accuracy(X, y, groups=people, folds=5, n_components=20, seed=0)
    assert isinstance(res, UtilityResult)
    assert res.accuracy >= 0.95
    assert res.folds_used == 5 and res.n_groups == 40
    assert "StratifiedGroupKFold" in res.detail


def test_random_label_is_chance():
    X, _, people = faces(n_people=100, per_person=2, separable=False, seed=2)
    y = np.random.default_rng(3).integers(0, 2, size=len(people))
    res = grouped_cv_accuracy(X, y, groups=people, folds=5, n_components=20, seed=0)
    assert 0.35 <= res.accuracy <= 0.65


def test_identical_copies_never_straddle_folds():
    # Released k-Same data: each cluster's rows are identical copies and form one group.
    rng = np.random.default_rng(4)
    clusters = np.repeat(np.arange(30), rng.integers(3, 7, size=30))
    y = rng.integers(0, 2, size=30)[clusters]
    for seed in range(3):
        splits, _ = grouped_splits(y, groups=clusters, folds=5, seed=seed)
        assert len(splits) == 5
        seen = np.zeros(len(y), dtype=int)
        for train, test in splits:
            assert not set(clusters[train]) & set(clusters[test])
            seen[test] += 1
        assert np.all(seen == 1)  # every row tested exactly once


def test_deterministic_given_seed():
    X, y, people = faces(n_people=30, separable=False, seed=5)
    y = np.random.default_rng(6).integers(0, 2, size=len(y))
    a = grouped_cv_accuracy(X, y, groups=people, seed=7, n_components=10)
    b = grouped_cv_accuracy(X, y, groups=people, seed=7, n_components=10)
    assert a == b
    s1, _ = grouped_splits(y, groups=people, seed=1)
    s2, _ = grouped_splits(y, groups=people, seed=2)
    assert any(not np.array_equal(t1, t2) for (_, t1), (_, t2) in zip(s1, s2))


def test_folds_reduced_to_number_of_groups():
    X, y, people = faces(n_people=4, per_person=5, seed=8)
    y = np.array([0, 1, 0, 1])[people]
    res = grouped_cv_accuracy(X, y, groups=people, folds=5, n_components=50)
    assert res.folds_used == 4 and res.n_groups == 4
    assert "reduced from 5 to 4" in res.detail
    assert res.accuracy is not None


def test_single_class_gives_none():
    X, _, people = faces(n_people=10, seed=9)
    res = grouped_cv_accuracy(X, np.ones(len(people)), groups=people)
    assert res.accuracy is None and res.folds_used == 0
    assert "single class" in res.detail


def test_fallback_when_stratification_impossible():
    # Class 1 lives in a single group: StratifiedGroupKFold cannot spread it; the fold that
    # tests it has no class-1 training data and is skipped rather than faked.
    X, _, people = faces(n_people=6, per_person=4, seed=10)
    y = (people == 0).astype(int)
    res = grouped_cv_accuracy(X, y, groups=people, folds=3, n_components=5)
    assert "GroupKFold" in res.detail
    assert res.folds_used == 2 and "skipped" in res.detail
    assert res.accuracy is not None


def test_bad_inputs_are_rejected():
    X, y, people = faces(n_people=6, seed=11)
    with pytest.raises(ConfigError, match="folds=1"):
        grouped_cv_accuracy(X, y, groups=people, folds=1)
    with pytest.raises(ConfigError, match="groups has 3 entries"):
        grouped_cv_accuracy(X, y, groups=people[:3])
    with pytest.raises(ConfigError, match="n_components=0"):
        grouped_cv_accuracy(X, y, groups=people, n_components=0)
    with pytest.raises(ConfigError, match="y\\[0\\] is missing"):
        grouped_cv_accuracy(X, [None] + list(y[1:]), groups=people)
    with pytest.raises(ConfigError, match="images has shape"):
        grouped_cv_accuracy(X.reshape(len(X), 10, 10), y, groups=people)


def test_gram_pca_matches_full_svd_pca():
    from sklearn.decomposition import PCA

    from deid.utility import GramPCA

    rng = np.random.default_rng(3)
    X = rng.random((60, 500)) * 255
    g = GramPCA(20).fit(X)
    p = PCA(20, svd_solver="full").fit(X)
    # Same subspace (projection matrices equal) and same coordinates up to sign.
    np.testing.assert_allclose(g.components_.T @ g.components_, p.components_.T @ p.components_, atol=1e-10)
    np.testing.assert_allclose(np.abs(g.transform(X)), np.abs(p.transform(X)), atol=1e-6)
    assert GramPCA(100).fit(X[:10]).n_components_ == 9  # capped at the rank of 10 centred rows


# --------------------------------------------------------------------------- protocols 2 and 3

from deid.utility import (  # noqa: E402
    PROTOCOLS,
    train_original_test_release,
    train_release_test_heldout,
    utility_protocols,
)


def test_protocol2_trains_on_originals_and_tests_the_release():
    X, y, people = faces(n_people=40, per_person=2, seed=21)
    rng = np.random.default_rng(22)
    kept = np.clip(X + rng.normal(scale=3, size=X.shape), 0, 255)
    good = train_original_test_release(X, y, kept, y, n_components=20)
    assert good.accuracy >= 0.95 and good.folds_used == 1
    wiped = X.copy()
    wiped[:, :20] = 128  # the label's pixels destroyed in the release
    bad = train_original_test_release(X, y, wiped, y, n_components=20)
    assert bad.accuracy < good.accuracy - 0.2
    # Labels are matched by value, not by position of first appearance.
    names = np.where(y == 1, "f", "m")
    flipped = train_original_test_release(X, names, kept[::-1], names[::-1], n_components=20)
    assert flipped.accuracy == pytest.approx(good.accuracy)


def test_protocol3_tests_on_originals_of_people_outside_the_training_half():
    X, y, people = faces(n_people=40, per_person=2, seed=23)
    rel, ref = train_release_test_heldout(X, y, people, X, y, people, repeats=2, n_components=20)
    assert rel.accuracy >= 0.9 and ref.accuracy >= 0.9
    assert rel.folds_used == 4 and rel.n_groups == 40  # 2 halvings x 2 directions
    noise = np.random.default_rng(24).integers(0, 256, size=X.shape)
    useless, _ = train_release_test_heldout(noise, y, people, X, y, people, repeats=2, n_components=20)
    assert useless.accuracy <= 0.7


def test_protocol3_never_tests_on_a_training_person(monkeypatch):
    import deid.utility as u

    X, y, people = faces(n_people=10, per_person=2, seed=25)
    seen = []
    real = u._fit_predict

    def spy(Xtr, ytr, Xte, n_components, seed):
        seen.append((Xtr, Xte))
        return real(Xtr, ytr, Xte, n_components, seed)

    monkeypatch.setattr(u, "_fit_predict", spy)
    # Released rows encode their person in pixel 0 so we can tell who trained.
    rel = X.copy()
    rel[:, 0] = people
    orig = X.copy()
    orig[:, 0] = people
    u.train_release_test_heldout(rel, y, people, orig, y, people, repeats=1, n_components=5)
    for Xtr, Xte in seen:
        assert not set(Xtr[:, 0].astype(int)) & set(Xte[:, 0].astype(int))


def test_utility_protocols_rows():
    X, y, people = faces(n_people=30, per_person=2, seed=26)
    labels = {"g": y, "r": np.random.default_rng(27).integers(0, 2, size=len(y))}
    rows = utility_protocols(labels=["g"], originals=X, original_labels=labels, original_people=people,
                             released=X, released_labels=labels, released_people=people, released_groups=None,
                             repeats=1, n_components=10)
    assert [r["protocol"] for r in rows] == list(PROTOCOLS)
    for r in rows:
        assert set(r) == {"label", "protocol", "original_accuracy", "deidentified_accuracy", "detail"}
        assert r["label"] == "g" and r["deidentified_accuracy"] >= 0.9 and r["original_accuracy"] >= 0.9
    with pytest.raises(ConfigError, match="protocols="):
        utility_protocols(labels=["g"], originals=X, original_labels=labels, original_people=people, released=X,
                          released_labels=labels, released_people=people, protocols=["loo"])
    with pytest.raises(ConfigError, match="no entry for label 'x'"):
        utility_protocols(labels=["x"], originals=X, original_labels=labels, original_people=people, released=X,
                          released_labels=labels, released_people=people)
