"""Tests of k-Same and k-Same-Select (deid.anonymise.ksame)."""
from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deid.errors import ConfigError
from deid.anonymise.ksame import DominantPersonError, InsufficientPeopleError, KSame, KSameSelect, feasible_clusters
from deid.anonymise.ksame_blocks import blockwise_labels, group_block, plan_blocks
from deid.anonymise.ksame_greedy import greedy_labels


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
            # No person above 1/k of the cluster: at most floor(size / k) images each.
            assert max(Counter(people[members].tolist()).values()) <= len(members) // k
        assert model.cluster_people_[c] == frozenset(distinct)
        assert model.cluster_sizes_[c] == len(members)
        expect_share = max(Counter(people[members].tolist()).values()) / len(members)
        assert model.cluster_max_share_[c] == pytest.approx(expect_share)
        np.testing.assert_allclose(model.averages_[c], images[members].astype(np.float64).mean(axis=0))


@st.composite
def layouts(draw, with_partitions=False, max_images=80):
    k = draw(st.integers(2, 6))
    n_people = draw(st.integers(k, 30))
    counts = draw(st.lists(st.integers(1, 6), min_size=n_people, max_size=n_people))
    while sum(counts) > max_images and len(counts) > k:
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


def wcss(X, labels):
    return sum(((X[labels == c] - X[labels == c].mean(axis=0)) ** 2).sum() for c in set(labels.tolist()))


def feasible(people, k):
    """Some grouping exists iff no person holds more than floor(n/k) images (one cluster of all is then valid)."""
    return max(Counter(people.tolist()).values()) <= len(people) // k


FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(layouts())
def test_ksame_clusters_hold_k_distinct_people(case):
    k, X, people, images, _ = case
    if feasible(people, k):
        model = KSame(k).fit(X, people=people, images=images)
    else:
        with pytest.raises(DominantPersonError, match=r"no person may hold more than 1/k"):
            KSame(k).fit(X, people=people, images=images)
        return
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
    bad = {p for p in part_people if part_people[p] < k or not feasible(people[parts == p], k)}
    model = KSameSelect(k)
    if bad:
        with pytest.raises(InsufficientPeopleError) as err:
            model.fit(X, people=people, images=images, partitions=parts)
        small = sorted(bad)
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


def test_dominant_person_is_dealt_into_the_feasible_maximum_of_clusters():
    # One person with 4 images, eight with one (n=12, k=3: 4 = floor(12/3) is just allowed).
    # The person must be in every cluster once: 4 clusters of 3 distinct people, the feasible
    # maximum (the old greedy left their images over and merged clusters, issue 26).
    X, people, images = make_faces([4] + [1] * 8, seed=2)
    model = KSame(3).fit(X, people=people, images=images)
    check_clusters(model, X, people, images, 3)
    assert model.n_clusters_ == feasible_clusters(np.bincount(people), 3) == 4
    assert model.n_leftover_ == 0
    assert model.cluster_max_share_.max() <= 1 / 3


def test_person_above_one_kth_of_all_images_is_refused():
    # 10 of 16 images are one person's: no clustering keeps them at <= 1/3 of every cluster.
    X, people, images = make_faces([10, 1, 1, 1, 1, 1, 1], seed=2)
    with pytest.raises(DominantPersonError) as err:
        KSame(3).fit(X, people=people, images=images)
    assert "person 0 has 10 of the 16 images" in str(err.value) and "at most 5" in str(err.value)
    assert isinstance(err.value, InsufficientPeopleError) and err.value.partition is None
    # Image counting (the naive baseline) has no such rule.
    KSame(3, count="images").fit(X, people=people, images=images)


def test_leftover_never_gives_a_person_two_images_in_a_small_cluster():
    # The old rule "nearest group, even if it holds the person" put a 2nd image of person 0
    # into a cluster of 3 (share 2/4 > 1/3). 4 people x 2 images + 2 singles, k=3.
    rng = np.random.default_rng(0)
    for seed in range(30):
        counts = rng.integers(1, 4, size=int(rng.integers(3, 9))).tolist()
        X, people, images = make_faces(counts, seed=seed)
        if not feasible(people, 3) or len(counts) < 3:
            continue
        model = KSame(3).fit(X, people=people, images=images)
        check_clusters(model, X, people, images, 3)


def test_a_person_at_the_cap_is_dealt_into_distinct_clusters_near_their_neighbours():
    # Person 0 has 2 images (n=7, k=3: floor(7/3) = 2 clusters, so person 0 must be in both).
    # Each cluster holds pairwise distinct people, and the two far-apart groups of faces stay apart.
    X = np.array([[0.0], [0.1], [0.2], [10.0], [10.1], [10.2], [0.05]])
    people = np.array([0, 1, 2, 3, 4, 5, 0])
    images = np.arange(7, dtype=np.float64)[:, None]
    model = KSame(3).fit(X, people=people, images=images)
    assert model.n_clusters_ == 2 and model.n_leftover_ == 1
    assert model.labels_[0] != model.labels_[6]
    assert model.labels_[3] == model.labels_[4] == model.labels_[5] != model.labels_[1] == model.labels_[2]
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
    assert model.get_params() == {"k": 3, "count": "people", "block_size": 2000, "map_blocks": None}
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


# --------------------------------------------------------------------------- blockwise grouping


@FAST
@given(layouts(max_images=120), st.integers(6, 40))
def test_blockwise_grouping_keeps_every_invariant(case, block_size):
    k, X, people, images, _ = case
    if not feasible(people, k):
        return
    model = KSame(k, block_size=block_size).fit(X, people=people, images=images)
    check_clusters(model, X, people, images, k)
    blocks = plan_blocks(X, people, k=k, block_size=block_size)
    np.testing.assert_array_equal(np.sort(np.concatenate(blocks)), np.arange(len(X)))
    block_of = np.empty(len(X), dtype=int)
    for b, idx in enumerate(blocks):
        block_of[idx] = b
        if len(blocks) > 1:
            assert len(set(people[idx].tolist())) >= 2 * k
        assert feasible(people[idx], k)
    for q in set(people.tolist()):  # a person's images never straddle blocks
        assert len(set(block_of[people == q].tolist())) == 1
    # Without refinement, clusters never straddle blocks; refinement regroups across cuts.
    plain = blockwise_labels(X, people, k=k, block_size=block_size, schedule=())
    for c in range(int(plain.max()) + 1):
        assert len(set(block_of[plain == c].tolist())) == 1
    refined = blockwise_labels(X, people, k=k, block_size=block_size)
    np.testing.assert_array_equal(refined, model.labels_)
    assert wcss(X, refined) <= wcss(X, plain) + 1e-9  # a round is kept only when it lowers the WCSS


def test_several_blocks_occur_and_are_deterministic():
    X, people, images = make_faces([2] * 150 + [1] * 40 + [3] * 20, seed=8)
    blocks = plan_blocks(X, people, k=3, block_size=60)
    assert len(blocks) >= 5 and max(len(b) for b in blocks) <= 60
    a = KSame(3, block_size=60).fit(X, people=people, images=images)
    b = KSame(3, block_size=60).fit(X, people=people, images=images)
    np.testing.assert_array_equal(a.labels_, b.labels_)
    check_clusters(a, X, people, images, 3)
    # Blocks cost a little information loss, not much, on this clustered data.
    greedy = KSame(3, block_size=None).fit(X, people=people, images=images)
    assert wcss(X, a.labels_) <= 1.5 * wcss(X, greedy.labels_)
    # Any order-keeping map runs the blocks (the caller may pass a Dask client's map).
    calls = []

    def logging_map(fn, *its):
        calls.append(len(its[0]))
        return [fn(*args) for args in zip(*its)]

    np.testing.assert_array_equal(blockwise_labels(X, people, k=3, block_size=60, map_blocks=logging_map), a.labels_)
    assert calls and calls[0] == len(blocks)


@FAST
@given(layouts(max_images=60))
def test_one_block_is_exactly_the_greedy(case):
    k, X, people, images, _ = case
    if not feasible(people, k):
        return
    greedy = KSame(k, block_size=None).fit(X, people=people, images=images)
    one = KSame(k, block_size=len(X)).fit(X, people=people, images=images)
    np.testing.assert_array_equal(greedy.labels_, one.labels_)
    assert [b.tolist() for b in plan_blocks(X, people, k=k, block_size=len(X))] == [list(range(len(X)))]
    res = group_block(X, people, k)
    np.testing.assert_array_equal(res.labels, greedy_labels(X, np.unique(people, return_inverse=True)[1], k)[0])
    np.testing.assert_array_equal(res.labels, greedy.labels_)


@pytest.mark.parametrize("block_size", [1, 0, 2.5, "big", True])
def test_bad_block_size_is_rejected(block_size):
    X, people, images = make_faces([1] * 6)
    with pytest.raises(ConfigError, match=r"block_size=.* must be None or an integer >= 2"):
        KSame(2, block_size=block_size).fit(X, people=people, images=images)


@st.composite
def skewed_counts(draw):
    """Photos per person as real drops hold them: Zipf-like, one dominant person, many singletons."""
    k = draw(st.integers(2, 6))
    shape = draw(st.sampled_from(["zipf", "dominant", "singletons", "mixed"]))
    n_people = draw(st.integers(k, 60))
    if shape == "zipf":
        a = draw(st.floats(1.2, 3.0))
        seed = draw(st.integers(0, 2**16))
        counts = np.minimum(np.random.default_rng(seed).zipf(a, n_people), 50)
    elif shape == "dominant":  # one person holds up to the 1/k cap, or just above it (infeasible)
        counts = np.ones(n_people, dtype=np.int64)
        counts[0] = draw(st.integers(1, max(1, (n_people - 1) // max(1, k - 1) + 1)))
    elif shape == "singletons":
        counts = np.ones(n_people, dtype=np.int64)
        counts[: draw(st.integers(0, 3))] = draw(st.integers(2, 12))
    else:
        counts = np.array(draw(st.lists(st.integers(1, 20), min_size=n_people, max_size=n_people)))
    return k, np.asarray(counts, dtype=np.int64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(skewed_counts(), st.sampled_from([None, 60]))
def test_skewed_photo_counts_reach_the_feasible_maximum(case, block_size):
    # Issue 26: for any photos-per-person distribution, every cluster holds >= k distinct people, no
    # person above 1/k, and the clusters formed are >= 0.95 x the feasible maximum (floor(n/k))
    # wherever a grouping exists; blockwise too (block_size=60 cuts the larger cases into blocks).
    k, counts = case
    people = np.repeat(np.arange(len(counts)), counts)
    X = np.random.default_rng(int(counts.sum())).normal(size=(len(people), 4))
    best = feasible_clusters(counts, k)
    model = KSame(k, block_size=block_size)
    if best == 0:
        with pytest.raises(InsufficientPeopleError):
            model.fit(X, people=people, images=None)
        return
    model.fit(X, people=people, images=None)
    for c in range(model.n_clusters_):
        members = people[model.labels_ == c]
        assert len(set(members.tolist())) >= k
        assert max(Counter(members.tolist()).values()) * k <= len(members)
    if block_size is None or len(people) <= block_size:
        assert model.n_clusters_ >= 0.95 * best, (model.n_clusters_, best)
    else:  # each block reaches its own floor(n_b / k): at most one cluster short per further block
        n_blocks = len(plan_blocks(X, people, k=k, block_size=block_size))
        assert model.n_clusters_ >= best - (n_blocks - 1), (model.n_clusters_, best, n_blocks)


def test_feasible_clusters_states_the_maximum():
    assert feasible_clusters([47, 40, 33, 28, 24, 20, 17, 14, 12, 10], 5) == 49  # 245 records, floor(245/5)
    assert feasible_clusters([3, 1, 1], 3) == 0       # 3 images of one person in 5: above floor(5/3) = 1
    assert feasible_clusters([2, 2], 3) == 0          # fewer than k people
    assert feasible_clusters([1] * 7 + [0], 3) == 2   # people without images do not count
