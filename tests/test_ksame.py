"""Tests of k-Same and k-Same-Select (deid.ksame)."""
from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deid.errors import ConfigError
from deid.ksame import InsufficientPeopleError, KSame, KSameSelect


def make_faces(images_per_person, *, d=6, p=12, seed=0, partitions=None):
    """Synthetic faces: features near a per-person centre, random uint8 pixels."""
    rng = np.random.default_rng(seed)
    people = np.repeat(np.arange(len(images_per_person)), images_per_person)
    centres = rng.normal(size=(len(images_per_person), d)) * 3
    X = centres[people] + rng.normal(scale=0.3, size=(len(people), d))
    images = rng.integers(0, 256, size=(len(people), p), dtype=np.uint8)
    return X, people, images


def check_clusters(model, X, people, images, k, count="people"):
    labels = model.labels_
    n = len(X)
    assert labels.shape == (n,)
    assert set(labels.tolist()) == set(range(model.n_clusters_))  # every cluster non-empty, indices dense
    for c in range(model.n_clusters_):
        members = np.flatnonzero(labels == c)
        assert len(members) >= k
        distinct = set(people[members].tolist())
        if count == "people":
            assert len(distinct) >= k
        assert model.cluster_people_[c] == frozenset(distinct)
        assert model.cluster_sizes_[c] == len(members)
        expect_share = max(Counter(people[members].tolist()).values()) / len(members)
        assert model.cluster_max_share_[c] == pytest.approx(expect_share)
        np.testing.assert_allclose(model.averages_[c], images[members].astype(np.float64).mean(axis=0))


@st.composite
def layouts(draw, with_partitions=False):
    k = draw(st.integers(2, 6))
    n_people = draw(st.integers(k, 30))
    counts = draw(st.lists(st.integers(1, 6), min_size=n_people, max_size=n_people))
    while sum(counts) > 80 and len(counts) > k:
        counts.pop()
    seed = draw(st.integers(0, 2**16))
    X, people, images = make_faces(counts, seed=seed)
    parts = None
    if with_partitions:
        n_parts = draw(st.integers(1, 3))
        # A partition per person keeps each person's images together, as gender does.
        person_part = np.random.default_rng(seed).integers(0, n_parts, size=len(counts))
        parts = np.array([f"p{person_part[q]}" for q in people])
    return k, X, people, images, parts


FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(layouts())
def test_ksame_clusters_hold_k_distinct_people(case):
    k, X, people, images, _ = case
    model = KSame(k).fit(X, people=people, images=images)
    check_clusters(model, X, people, images, k)
    released = KSame(k).fit_transform(X, people=people, images=images)
    assert released.dtype == np.uint8 and released.shape == images.shape
    expected = np.clip(np.rint(model.averages_), 0, 255).astype(np.uint8)[model.labels_]
    np.testing.assert_array_equal(released, expected)


@FAST
@given(layouts(with_partitions=True))
def test_ksame_select_never_mixes_partitions(case):
    k, X, people, images, parts = case
    part_people = {p: len(set(people[parts == p].tolist())) for p in set(parts.tolist())}
    model = KSameSelect(k)
    if min(part_people.values()) < k:
        with pytest.raises(InsufficientPeopleError) as err:
            model.fit(X, people=people, images=images, partitions=parts)
        small = [p for p, c in part_people.items() if c < k]
        assert err.value.partition in small and repr(err.value.partition) in str(err.value)
        return
    model.fit(X, people=people, images=images, partitions=parts)
    check_clusters(model, X, people, images, k)
    for c in range(model.n_clusters_):
        members = np.flatnonzero(model.labels_ == c)
        assert set(parts[members].tolist()) == {model.cluster_partition_[c]}


def test_one_image_per_person_per_cluster_when_possible():
    # 12 people with 3 images each: every cluster can hold each of its people once.
    X, people, images = make_faces([3] * 12, seed=1)
    model = KSame(4).fit(X, people=people, images=images)
    check_clusters(model, X, people, images, 4)
    # Leftover images joined clusters that lacked their person, so no average favours anyone.
    assert np.all(model.cluster_max_share_ == 1 / model.cluster_sizes_)


def test_dominant_person_leftovers_join_clusters():
    # One person with 10 images, six with one: after the groups are formed only that person's
    # images remain; they must still land in clusters of >= k people.
    X, people, images = make_faces([10, 1, 1, 1, 1, 1, 1], seed=2)
    model = KSame(3).fit(X, people=people, images=images)
    check_clusters(model, X, people, images, 3)
    assert model.n_leftover_ > 0


def test_leftover_prefers_cluster_without_its_person():
    # Person 0 has 2 images; after two groups of 3 people one image of person 0 is left and
    # must join the group that does not already contain person 0 even if it is farther.
    X = np.array([[0.0], [0.1], [0.2], [10.0], [10.1], [10.2], [0.05]])
    people = np.array([0, 1, 2, 3, 4, 5, 0])
    images = np.arange(7, dtype=np.float64)[:, None]
    model = KSame(3).fit(X, people=people, images=images)
    assert model.n_leftover_ == 1
    assert model.labels_[0] == model.labels_[3] != model.labels_[6]
    for c in range(model.n_clusters_):
        members = np.flatnonzero(model.labels_ == c)
        assert len(set(people[members].tolist())) == len(members)


def test_image_counting_lets_one_person_fill_a_cluster():
    # Two people with 5 images each: count="images" happily makes "clusters of 5" of one
    # person; count="people" refuses.
    X, people, images = make_faces([5, 5], seed=3)
    naive = KSame(5, count="images").fit(X, people=people, images=images)
    assert naive.n_clusters_ == 2
    assert any(len(s) == 1 for s in naive.cluster_people_)
    with pytest.raises(InsufficientPeopleError, match=r"k=5 .* only 2"):
        KSame(5).fit(X, people=people, images=images)


def test_insufficient_people_error_names_k_count_and_fix():
    X, people, images = make_faces([2, 2, 2], seed=4)
    with pytest.raises(InsufficientPeopleError) as err:
        KSame(4).fit(X, people=people, images=images)
    msg = str(err.value)
    assert "k=4" in msg and "3" in msg and "lower k" in msg
    assert err.value.k == 4 and err.value.n_people == 3 and err.value.partition is None
    assert isinstance(err.value, ConfigError)


@pytest.mark.parametrize("k", [1, 0, -3, 2.5, "5", True, None])
def test_bad_k_is_rejected(k):
    X, people, images = make_faces([1] * 6)
    with pytest.raises(ConfigError, match=r"k=.* must be an integer >= 2"):
        KSame(k).fit(X, people=people, images=images)


def test_bad_inputs_are_rejected():
    X, people, images = make_faces([1] * 6)
    with pytest.raises(ConfigError, match="count="):
        KSame(2, count="faces").fit(X, people=people, images=images)
    with pytest.raises(ConfigError, match="people has 5 entries"):
        KSame(2).fit(X, people=people[:5], images=images)
    with pytest.raises(ConfigError, match="images has shape"):
        KSame(2).fit(X, people=people, images=images.reshape(6, 3, 4))
    bad = X.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ConfigError, match="NaN"):
        KSame(2).fit(bad, people=people, images=images)


def test_sklearn_contract_and_determinism():
    X, people, images = make_faces([2, 3, 1, 4, 2, 2, 1, 3], seed=5)
    model = KSame(3)
    assert model.get_params() == {"k": 3, "count": "people"}
    assert model.fit(X, people=people, images=images) is model
    assert model.k == 3 and model.count == "people"
    again = KSame(3).fit(X, people=people, images=images)
    np.testing.assert_array_equal(model.labels_, again.labels_)
    # String person ids and list inputs work the same as integer ids.
    named = KSame(3).fit(X.tolist(), people=[f"person-{q}" for q in people], images=images)
    np.testing.assert_array_equal(model.labels_, named.labels_)


def test_ties_go_to_lowest_index():
    # Four identical faces of four people, k=2: the seed is the lowest index (all equally far
    # from the centroid) and its partner is the next lowest index.
    X = np.zeros((4, 3))
    images = np.arange(4, dtype=np.uint8)[:, None]
    model = KSame(2).fit(X, people=[0, 1, 2, 3], images=images)
    np.testing.assert_array_equal(model.labels_, [0, 0, 1, 1])


def test_select_labels_are_global_and_partition_error_named():
    X, people, images = make_faces([1] * 9, seed=6)
    parts = [("f", "smile")] * 4 + [("m", "neutral")] * 5
    model = KSameSelect(2).fit(X, people=people, images=images, partitions=parts)
    assert model.partitions_ == [("f", "smile"), ("m", "neutral")]
    assert model.n_clusters_ == len(model.cluster_partition_) == len(set(model.labels_.tolist()))
    with pytest.raises(InsufficientPeopleError, match=r"partition \('f', 'smile'\) holds only 4") as err:
        KSameSelect(5).fit(X, people=people, images=images, partitions=parts)
    assert err.value.partition == ("f", "smile")


def test_large_partition_is_fast():
    rng = np.random.default_rng(7)
    n, d = 20_000, 50
    X = rng.normal(size=(n, d))
    people = rng.integers(0, 8_000, size=n)
    images = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    t0 = time.perf_counter()
    model = KSame(5).fit(X, people=people, images=images)
    elapsed = time.perf_counter() - t0
    sizes = np.bincount(model.labels_)
    assert sizes.min() >= 5
    assert min(len(s) for s in model.cluster_people_) >= 5
    assert elapsed < 15, f"k-Same on 20,000 x 50 took {elapsed:.1f}s"
