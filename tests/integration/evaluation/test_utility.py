"""Tests of the utility evaluation (deid.evaluation.utility and its rooms: utility_folds, utility_classifier,
utility_protocols, utility_evidence)."""
from __future__ import annotations

import numpy as np
import pytest

from deid.errors import ConfigError, DataError
from deid.evaluation.utility_folds import grouped_splits
from deid.evaluation.utility_protocols import UtilityResult, grouped_cv_accuracy


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
    with pytest.raises(DataError, match="y\\[0\\] is missing"):
        grouped_cv_accuracy(X, [None] + list(y[1:]), groups=people)
    with pytest.raises(ConfigError, match="images has shape"):
        grouped_cv_accuracy(X.reshape(len(X), 10, 10), y, groups=people)


def test_gram_pca_matches_full_svd_pca():
    from sklearn.decomposition import PCA

    from deid.evaluation.utility_classifier import GramPCA

    rng = np.random.default_rng(3)
    X = rng.random((60, 500)) * 255
    g = GramPCA(20).fit(X)
    p = PCA(20, svd_solver="full").fit(X)
    # Same subspace (projection matrices equal) and same coordinates up to sign.
    np.testing.assert_allclose(g.components_.T @ g.components_, p.components_.T @ p.components_, atol=1e-10)
    np.testing.assert_allclose(np.abs(g.transform(X)), np.abs(p.transform(X)), atol=1e-6)
    assert GramPCA(100).fit(X[:10]).n_components_ == 9  # capped at the rank of 10 centred rows


# --------------------------------------------------------------------------- protocols 2 and 3

from deid.evaluation.utility_protocols import (  # noqa: E402
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
    import deid.evaluation.utility_protocols as u

    X, y, people = faces(n_people=10, per_person=2, seed=25)
    seen = []
    real = u.fit_predict

    def spy(Xtr, ytr, Xte, n_components, seed):
        seen.append((Xtr, Xte))
        return real(Xtr, ytr, Xte, n_components, seed)

    monkeypatch.setattr(u, "fit_predict", spy)
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


# --------------------------------------------------------------------------- cross-fitted utility (the gate's check)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from deid.anonymise.ksame import InsufficientPeopleError  # noqa: E402
from deid.evaluation.utility import cross_fit_utility  # noqa: E402
from deid.evaluation.utility_evidence import STATUSES, UtilityEvidence, paired_bootstrap  # noqa: E402


def group_means(k, *, permute_seed=None):
    """Fake k-Same: within each partition, people in sorted order form groups of k (the last
    absorbs the remainder) and every member gets the group's mean face. ``permute_seed``
    hands each group the mean of a random other group instead: labels permuted across
    clusters (the negative control)."""
    def deidentify(images, *, people, partitions=None, labels=None):
        images = np.asarray(images, dtype=float)
        people = np.asarray(people)
        parts = ["all"] * len(images) if partitions is None else list(partitions)
        groups = []
        for key in dict.fromkeys(parts):
            idx = np.flatnonzero([p == key for p in parts])
            who = np.unique(people[idx])
            if len(who) < k:
                raise InsufficientPeopleError(f"partition {key!r} has {len(who)} people", k=k, n_people=len(who),
                                              partition=key)
            n_groups = len(who) // k
            for g in range(n_groups):
                members = who[g * k:] if g == n_groups - 1 else who[g * k:(g + 1) * k]
                groups.append(idx[np.isin(people[idx], members)])
        means = [images[rows].mean(axis=0) for rows in groups]
        if permute_seed is not None:
            means = [means[i] for i in np.random.default_rng(permute_seed).permutation(len(means))]
        out = np.empty_like(images)
        for rows, m in zip(groups, means):
            out[rows] = m
        return out, None
    return deidentify


def test_cross_fit_passes_when_the_label_survives_deidentification():
    # 120 people: enough that the rule-of-three floor (0.025) leaves room under the 0.05 tolerance.
    X, y, people = faces(n_people=120, per_person=2, seed=31)
    ev, = cross_fit_utility(X, people=people, labels={"g": y}, deidentify=group_means(5),
                            partitions=[(v,) for v in y], k=5, n_components=10)
    assert isinstance(ev, UtilityEvidence) and ev.status in STATUSES
    assert ev.status == "pass" and ev.majority_status == "pass" and ev.decision == "pass"
    assert ev.delta_lower <= ev.delta <= ev.delta_upper <= ev.tolerance
    assert ev.accuracy_release >= 0.9 and ev.n_test_images == 240 and ev.n_test_people == 120
    assert ev.folds_used == 15 and ev.suppressed_training_records == 0  # 5 folds x 3 repeats
    d = ev.to_dict()
    assert d["decision"] == "pass" and d["label"] == "g" and d["sample"] == "all 240 images of 120 people"


def test_cross_fit_fails_when_labels_are_permuted_across_clusters():
    X, y, people = faces(n_people=80, per_person=2, seed=32)
    ev, = cross_fit_utility(X, people=people, labels={"g": y}, deidentify=group_means(5, permute_seed=0),
                            partitions=[(v,) for v in y], k=5, n_components=10)
    assert ev.status == "fail" and ev.decision == "fail"
    assert ev.delta_lower > ev.tolerance
    assert ev.majority_status != "pass"


def test_actual_release_evidence_catches_a_release_whose_labels_do_not_match():
    # The method is fine, but the release handed to the gate has its clusters' faces swapped.
    X, y, people = faces(n_people=80, per_person=2, seed=33)
    parts = [(v,) for v in y]
    good, _ = group_means(5)(X, people=people, partitions=parts)
    bad, _ = group_means(5, permute_seed=1)(X, people=people, partitions=parts)
    kw = dict(people=people, labels={"g": y}, deidentify=group_means(5), partitions=parts, k=5, n_components=10)
    ok, = cross_fit_utility(X, released=good, **kw)
    wrong, = cross_fit_utility(X, released=bad, **kw)
    assert ok.actual_status == "pass" and ok.decision == "pass"
    assert wrong.status == "pass" and wrong.actual_status == "fail" and wrong.decision == "fail"


def test_tiny_data_is_inconclusive_and_states_the_testable_margin():
    X, y, people = faces(n_people=12, per_person=1, seed=34)
    ev, = cross_fit_utility(X, people=people, labels={"g": y}, deidentify=group_means(3),
                            partitions=[(v,) for v in y], k=3, n_components=5)
    assert ev.status == "inconclusive" and ev.decision == "inconclusive"
    # 12 people: the rule-of-three floor alone is 1 - 0.05 ** (1 / 12) = 0.22.
    assert ev.testable_margin >= 0.2
    assert "12 test images of 12 people can only test a margin of" in ev.detail


def test_labels_the_originals_cannot_predict_are_not_applicable():
    X, y, people = faces(n_people=20, per_person=2, seed=35)
    one_class = np.zeros(len(y))
    one_person_each = np.where(people == 0, "a", np.where(people == 1, "b", "c"))  # only 'c' has >= 2 people
    calls = []

    def spy(images, *, people, partitions=None, labels=None):
        calls.append(len(images))
        return np.asarray(images), None

    out = cross_fit_utility(X, people=people, labels={"one": one_class, "rare": one_person_each}, deidentify=spy)
    assert [e.status for e in out] == ["not_applicable", "not_applicable"]
    assert [e.decision for e in out] == ["not_applicable", "not_applicable"]
    assert "single value" in out[0].detail and "fewer than 2 values" in out[1].detail
    assert calls == []  # nothing to test: the method is not even run


def test_small_training_partitions_are_suppressed_and_counted():
    X, y, people = faces(n_people=60, per_person=2, seed=36)
    rare = np.where(people < 4, "r", "c")  # a value held by 4 people: below k=5 in every training fold
    parts = list(zip(y.tolist(), rare.tolist()))
    labels = {"g": y, "rare": rare}
    lazy, = cross_fit_utility(X, people=people, labels=labels, deidentify=group_means(5), partitions=parts,
                              n_components=10)[:1]  # discovered one InsufficientPeopleError at a time
    eager, = cross_fit_utility(X, people=people, labels=labels, deidentify=group_means(5), partitions=parts, k=5,
                               n_components=10)[:1]  # suppressed up front from k
    assert lazy.suppressed_training_records == eager.suppressed_training_records > 0
    assert "suppressed" in eager.detail
    assert lazy.to_dict() == eager.to_dict()


def test_each_person_is_held_out_of_exactly_one_deidentification():
    X, y, people = faces(n_people=30, per_person=2, seed=37)
    seen = []

    def spy(images, *, people, partitions=None, labels=None):
        seen.append(set(people))
        return np.asarray(images), None

    cross_fit_utility(X, people=people, labels={"g": y}, deidentify=spy, folds=5, repeats=1, n_components=5)
    assert len(seen) == 5
    everyone = set(people.tolist())
    held_out = [everyone - s for s in seen]
    assert all(held_out) and sum(len(h) for h in held_out) == 30 and set().union(*held_out) == everyone


def test_large_drops_are_subsampled_by_people_with_the_sample_reported():
    X, y, people = faces(n_people=100, per_person=2, seed=38)
    ev, = cross_fit_utility(X, people=people, labels={"g": y}, deidentify=group_means(5),
                            partitions=[(v,) for v in y], k=5, max_images=60, seed=3, n_components=10)
    assert ev.n_test_images == 60 and ev.n_test_people == 30
    assert "sample (seed 3) of 30 of 100 people, 60 of 200 images" in ev.sample


def test_cross_fit_is_deterministic_per_seed():
    X, y, people = faces(n_people=40, per_person=2, seed=39)
    y = np.random.default_rng(40).integers(0, 3, size=len(y))  # a noisy 3-valued label
    kw = dict(people=people, labels={"g": y}, deidentify=group_means(4), k=4, n_components=10)
    a, b, c = (cross_fit_utility(X, seed=s, **kw)[0] for s in (5, 5, 6))
    assert a == b
    assert a.seed == 5 and c.seed == 6 and a.to_dict() != c.to_dict()


def test_cross_fit_rejects_bad_arguments():
    X, y, people = faces(n_people=10, seed=41)
    kw = dict(people=people, labels={"g": y}, deidentify=group_means(2))
    with pytest.raises(ConfigError, match="deidentify=.*must be a callable"):
        cross_fit_utility(X, **{**kw, "deidentify": "k-same"})
    with pytest.raises(ConfigError, match="tolerance=2"):
        cross_fit_utility(X, tolerance=2, **kw)
    with pytest.raises(ConfigError, match="partitions has 3 entries"):
        cross_fit_utility(X, partitions=[1, 2, 3], **kw)
    with pytest.raises(ConfigError, match="confidence=0.3"):
        cross_fit_utility(X, confidence=0.3, **kw)
    with pytest.raises(ConfigError, match="released has shape"):
        cross_fit_utility(X, released=X[:5], **kw)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 40), st.integers(0, 10_000), st.floats(0.6, 0.9))
def test_bootstrap_bounds_bracket_the_estimate_and_widen_with_confidence(n_people, seed, conf):
    rng = np.random.default_rng(seed)
    who = rng.integers(0, n_people, size=3 * n_people)
    a, b = rng.integers(0, 2, size=(2, len(who)))
    est, lo, up = paired_bootstrap(who, a, b, n_boot=300, confidence=conf, seed=seed)
    assert lo <= est <= up and -1 <= lo and up <= 1
    assert est == pytest.approx(np.mean(a) - np.mean(b))
    n_seen = len(np.unique(who))
    floor = 1 - (1 - conf) ** (1 / n_seen)  # the rule-of-three floor, within the feasible [-1, 1]
    assert up >= min(1.0, est + floor) - 1e-12 and lo <= max(-1.0, est - floor) + 1e-12
    _, lo2, up2 = paired_bootstrap(who, a, b, n_boot=300, confidence=min(conf + 0.09, 0.99), seed=seed)
    assert lo2 <= lo and up2 >= up


def test_bootstrap_narrows_with_more_people():
    rng = np.random.default_rng(42)

    def width(n_people):
        who = np.repeat(np.arange(n_people), 2)
        a = rng.random(len(who)) < 0.9
        b = rng.random(len(who)) < 0.8
        _, lo, up = paired_bootstrap(who, a, b, n_boot=1000, seed=1)
        return up - lo

    assert width(400) < width(100) < width(25)


def _permuted_clusters(deidentify, seed):
    """The method, then every cluster's released face handed to a random cluster: labels permuted
    across clusters (the negative control)."""
    def run(images, *, people, partitions=None, labels=None):
        released, clusters = deidentify(images, people=people, partitions=partitions)
        ids = np.unique(clusters)
        face_of = {c: released[np.flatnonzero(clusters == c)[0]] for c in ids}
        swap = dict(zip(ids.tolist(), np.random.default_rng(seed).permutation(ids).tolist()))
        return np.stack([face_of[swap[c]] for c in clusters.tolist()]), clusters
    return run


@pytest.mark.slow
@pytest.mark.london
def test_london_k_same_select_keeps_gender_and_expression_and_the_permuted_control_fails():
    import functools

    from helpers import load_london_aligned

    from deid.anonymise.methods import deidentify

    X, people, gender, expression = load_london_aligned()
    labels = {"gender": gender, "expression": expression}
    method = functools.partial(deidentify, shape=(92, 81), method="k-same-select", k=5)
    kw = dict(people=people, labels=labels, partitions=list(zip(gender, expression)), k=5)
    ev = {e.label: e for e in cross_fit_utility(X, deidentify=method, **kw)}
    # Gender was +-0.02 around zero in every measurement (delta -0.021 [-0.056, +0.015] when written,
    # +0.021 [-0.013, +0.056] after the landmark aligner and the new k-Same leftover rule): 102 test
    # people cannot always show a margin under 0.05, so it must pass or be inconclusive, never fail.
    assert ev["gender"].status in ("pass", "inconclusive"), ev["gender"].detail
    assert ev["gender"].delta_lower < 0.05, ev["gender"].detail
    # Expression when written: originals 0.941 vs release 0.907, delta +0.034 [+0.005, +0.063]:
    # 102 test people can only test a margin of 0.029, so at tolerance 0.05 it is inconclusive
    # (the same for seeds 0-4); it must not fail.
    assert ev["expression"].status in ("pass", "inconclusive"), ev["expression"].detail
    assert all(e.majority_status == "pass" and e.n_test_people == 102 for e in ev.values())
    control = cross_fit_utility(X, deidentify=_permuted_clusters(method, seed=0), repeats=1, **kw)
    assert [e.status for e in control] == ["fail", "fail"], [e.detail for e in control]


def test_the_method_receives_each_training_rows_own_labels():
    """Label-aware methods get the labels of exactly the rows they de-identify, even when two
    people's faces are pixel-identical (labels travel with the rows, not looked up by pixels)."""
    rng = np.random.default_rng(3)
    people = np.repeat(np.arange(20), 2)
    y = people % 2  # the label is a function of the person
    X = rng.normal(100, 20, (40, 30))
    X[2:4] = X[0:2]  # person 1's faces are person 0's, pixel for pixel, with the other label
    seen = []

    def spy(images, *, people, partitions=None, labels=None):
        seen.append((list(people), list(labels["g"])))
        return np.asarray(images), None

    cross_fit_utility(X, people=people, labels={"g": y}, deidentify=spy, folds=4, repeats=1, n_components=5)
    assert len(seen) == 4
    for who, got in seen:
        assert [int(v) for v in got] == [int(p) % 2 for p in who]
    assert any(0 in who for who, _ in seen) and any(1 in who for who, _ in seen)


# --------------------------------------------------------------------------- issue 26: folds and lost labels

from deid.evaluation.utility_folds import MAX_FOLDS, partition_safe_splits  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(1, 30)), min_size=4, max_size=40),
       st.integers(2, 6), st.integers(2, 5), st.integers(0, 10))
def test_folds_keep_every_fillable_partition_on_every_training_side(design, k, folds, seed):
    # People with a label (their partition) and a skewed number of images each.
    label = np.repeat([g for g, _ in design], [c for _, c in design])
    people = np.repeat(np.arange(len(design)), [c for _, c in design])
    splits, detail = partition_safe_splits(label, people, list(label), k=k, folds=folds, seed=seed)
    tested = np.concatenate([np.unique(people[te]) for _, te in splits])
    assert sorted(tested.tolist()) == list(range(len(design)))  # every person tested exactly once
    n_folds = len(splits)
    for g in (0, 1):
        size = len(set(people[label == g].tolist()))
        if size < k:
            continue  # the whole drop cannot fill it: suppressed in the release too
        possible = size > k and -(-size // (size - k)) <= max(folds, min(MAX_FOLDS, len(design)))
        train_people = [len(set(people[tr][label[tr] == g].tolist())) for tr, _ in splits]
        if possible:
            assert min(train_people) >= k, (detail, train_people)
        assert n_folds <= max(folds, MAX_FOLDS)


def test_a_skewed_drop_uses_every_fold_and_trims_its_dominant_person():
    # The shape: 24 people with 47 .. 2 images, two genders; k-Same-Select at k = 5.
    from deid.anonymise.methods import method_runner

    counts = [47, 40, 33, 28, 24, 20, 17, 14, 12, 10, 9, 8, 7, 6, 5, 5, 4, 4, 3, 3, 3, 2, 2, 2]
    gender = np.asarray(["f" if i % 24 in (0, 2, 5, 7, 9, 12, 15, 18, 20, 23) else "m" for i in range(24)])
    rng = np.random.default_rng(5)
    base = rng.normal(128, 30, (24, 16 * 16)) + np.where(gender == "f", 20, -20)[:, None]
    people = np.repeat(np.arange(24), counts)
    X = np.clip(base[people] + rng.normal(0, 8, (len(people), 256)), 0, 255).astype(np.uint8)
    y = gender[people]
    ev, = cross_fit_utility(X, people=people, labels={"gender": y}, partitions=[(v,) for v in y], k=5,
                            deidentify=method_runner("k-same-select", shape=(16, 16), k=5, n_components=10),
                            repeats=1, n_components=10)
    assert ev.folds_skipped == 0 and ev.folds_used == ev.folds_run == 5, ev.detail
    assert ev.suppressed_training_records == 0 and ev.trimmed_training_records > 0  # the 47-image person
    # 24 people can only test a margin of ~0.12: the decision may be inconclusive, never fail.
    assert ev.majority_status == "pass" and ev.decision in ("pass", "inconclusive"), ev.detail


def test_a_release_that_loses_its_label_fails_not_inconclusive():
    X, _, people = faces(n_people=100, per_person=2, seed=32)
    y = (people % 4 != 0).astype(int)  # 3 of 4 people hold value 1: majority rate 0.75
    X[:, :20] = np.clip(X[:, :20].astype(int) + np.where(y[:, None] == 1, 40, -40), 0, 255).astype(np.uint8)
    parts = [(v,) for v in y]

    def collapse(images, *, people, partitions=None, labels=None):  # every face the same average
        images = np.asarray(images, dtype=float)
        return np.tile(images.mean(axis=0), (len(images), 1)), None

    for method in (collapse, group_means(5, permute_seed=0)):
        ev, = cross_fit_utility(X, people=people, labels={"g": y}, deidentify=method, partitions=parts, k=5,
                                n_components=10, repeats=1)
        assert ev.label_lost and ev.majority_status == "fail" and ev.decision == "fail", ev.detail
        assert ev.accuracy_release <= ev.majority_rate  # a constant classifier, or the bound excludes any gain
        assert ev.to_dict()["label_lost"] is True


def test_a_fold_suppressed_down_to_one_value_is_no_evidence_of_a_lost_label():
    # 12 people, a value held by exactly k=5 of them: every fold's training side keeps 4, so suppression
    # (partitions below k) leaves the release one value to teach. Its constant predictions are the
    # measurement's defect on small data, not the release losing the label: never label_lost for that
    # (the gate then weighs the release's own rows, gate.cross_fit_checks).
    X, _, people = faces(n_people=12, per_person=2, seed=41)
    y = (people < 5).astype(int)
    X[:, :20] = np.clip(X[:, :20].astype(int) + np.where(y[:, None] == 1, 40, -40), 0, 255).astype(np.uint8)
    ev, = cross_fit_utility(X, people=people, labels={"g": y}, deidentify=group_means(5), partitions=[(v,) for v in y],
                            k=5, n_components=5, repeats=1)
    assert "taught g a single value" in ev.detail and ev.suppressed_training_records > 0, ev.detail
    assert not ev.label_lost and ev.majority_status != "fail", ev.detail


def test_pixel_pca_drops_the_directions_rounding_alone_makes():
    """A release spanning 4 directions, rounded to uint8: the PCA keeps those 4, not 40 of rounding noise.

    Without the floor the second standardisation of :func:`deid.evaluation.utility_classifier.svm_pipeline` scaled the rounding-noise components up to
    unit variance (a per-frame expression release: held-out accuracy 0.30, 0.67 with the floor; London
    unchanged). Data that are not integers get no floor.
    """
    from deid.evaluation.utility_classifier import PixelPCA

    rng = np.random.default_rng(0)
    basis = rng.normal(size=(4, 900))
    signal = 120 + rng.normal(size=(300, 4)) * 6 @ basis
    rounded = np.clip(np.round(signal), 0, 255)
    assert PixelPCA(40).fit(rounded).n_components_ == 4
    from sklearn.preprocessing import StandardScaler

    from deid.evaluation.utility_classifier import GramPCA
    assert GramPCA(40).fit(StandardScaler().fit_transform(rounded)).n_components_ == 40  # what the floor removes
    assert PixelPCA(40).fit(signal).n_components_ == 4  # exactly rank 4 (+ centring): no floor needed
    noisy = signal + rng.normal(scale=3.0, size=signal.shape)  # real variation in every direction, not integers
    assert PixelPCA(40).fit(noisy).n_components_ == 40
    originals = np.clip(np.round(noisy), 0, 255)  # integers, but varying far above rounding in 40 directions
    assert PixelPCA(40).fit(originals).n_components_ == 40


def test_release_is_judged_in_the_originals_representation_not_its_own_pixel_scale():
    """A k-Same-like release that is flat where real faces vary (averaged-away background) keeps the label.

    The label lives in 20 pixels; 60 background pixels vary strongly between real faces but the
    release flattens them (each to its mean, plus rounding). Fitting the classifier's per-pixel scale on
    the release scaled those pixels up on the held-out originals and buried the label (gender on a
    synthetic video drop: 0.765 vs 0.984); in the originals' representation the release keeps it.
    """
    X, y, people = faces(n_people=60, per_person=2, p=100, seed=41)
    rng = np.random.default_rng(41)
    X = X.astype(float)
    X[:, 40:] = np.clip(128 + rng.normal(scale=50, size=(len(X), 60)), 0, 255)
    X = np.round(X).astype(np.uint8)
    means = group_means(5)

    def flat_background(images, *, people, partitions=None, labels=None):
        out, groups = means(images, people=people, partitions=partitions, labels=labels)
        out = np.asarray(out, dtype=float).copy()
        out[:, 40:] = out[:, 40:].mean(axis=0) + rng.uniform(-0.5, 0.5, size=out[:, 40:].shape)
        return np.round(out), groups

    ev, = cross_fit_utility(X, people=people, labels={"g": y}, deidentify=flat_background,
                            partitions=[(v,) for v in y], k=5, n_components=20)
    assert ev.accuracy_original > 0.9
    assert ev.accuracy_release > 0.9, ev.detail
    assert ev.decision == "pass", ev.detail
