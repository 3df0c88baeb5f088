"""Tests of pose-aware k-Same grouping (deid.anonymise.ksame_pose): the yaw as one more feature, every rule kept."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deid.anonymise.ksame import InsufficientPeopleError, KSame, feasible_clusters
from deid.anonymise.ksame_pose import pose_features, typical_distance
from deid.errors import ConfigError


def test_off_or_without_estimates_the_features_are_unchanged():
    X = np.random.default_rng(0).normal(size=(10, 4))
    assert pose_features(X, [10.0] * 10, degrees=0) is X
    assert pose_features(X, [10.0] * 10, degrees=None) is X
    assert pose_features(X, [None] * 10, degrees=10) is X  # no face has an estimate: grouped as before
    assert pose_features(X, np.full(10, np.nan), degrees=10) is X


def test_degrees_of_yaw_count_as_a_typical_distance_and_the_sign_counts():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(50, 6)).astype(np.float32)
    yaw = [-30.0, 30.0, 0.0, None, *rng.uniform(-20, 20, 46)]
    Z = pose_features(X, yaw, degrees=15)
    assert Z.dtype == np.float32 and Z.shape == (50, 7)
    np.testing.assert_array_equal(Z[:, :6], X)
    unit = typical_distance(X)
    # Pairs of faces are on average sqrt(2 x total variance) apart; 15 degrees of yaw now weigh as much.
    d = np.sqrt(((X[:, None, :].astype(np.float64) - X[None, :, :]) ** 2).sum(-1))
    assert unit == pytest.approx(np.sqrt((d ** 2).sum() / (50 * 49)) * np.sqrt(49 / 50), rel=1e-6)
    assert Z[0, 6] == pytest.approx(-30 / 15 * unit, rel=1e-5)
    # A left and a right profile are twice as far apart on the pose axis as either from a frontal face.
    assert Z[1, 6] - Z[0, 6] == pytest.approx(2 * (Z[1, 6] - Z[2, 6]), rel=1e-5)
    assert Z[3, 6] == 0.0  # not estimated: frontal


@pytest.mark.parametrize("degrees", [-5, 181, float("nan"), True, "10"])
def test_bad_degrees_are_rejected(degrees):
    with pytest.raises(ConfigError, match="degrees"):
        pose_features(np.zeros((3, 2)), [0.0] * 3, degrees=degrees)


def test_yaw_of_the_wrong_length_is_rejected():
    with pytest.raises(ConfigError, match="one yaw"):
        pose_features(np.zeros((3, 2)), [0.0] * 4, degrees=10)


def test_pose_grouping_keeps_left_and_right_profiles_apart():
    # 40 people, each with one face turned left (-35) and one right (+35); appearance is noise. By appearance
    # alone clusters mix both sides; with 10 degrees = a typical distance every cluster is one side.
    rng = np.random.default_rng(2)
    people = np.repeat(np.arange(40), 2)
    yaw = np.tile([-35.0, 35.0], 40)
    X = rng.normal(size=(80, 8))
    plain = KSame(5).fit(X, people=people, images=None).labels_
    posed = KSame(5).fit(pose_features(X, yaw, degrees=10), people=people, images=None).labels_

    def mixed(labels):
        return sum(len(set(np.sign(yaw[labels == c]))) > 1 for c in np.unique(labels))

    assert mixed(plain) > 0
    assert mixed(posed) == 0
    assert posed.max() + 1 == feasible_clusters(np.bincount(people), 5)


@st.composite
def posed_layouts(draw):
    k = draw(st.integers(2, 6))
    counts = np.array(draw(st.lists(st.integers(1, 8), min_size=k, max_size=40)))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    yaw = rng.uniform(-60, 60, int(counts.sum()))
    yaw[rng.random(len(yaw)) < 0.2] = np.nan  # some faces without an estimate
    return k, counts, rng.normal(size=(int(counts.sum()), 5)), yaw, draw(st.sampled_from([2.0, 10.0, 45.0]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(posed_layouts(), st.sampled_from([None, 40]))
def test_pose_grouping_keeps_every_rule_and_the_feasible_maximum(case, block_size):
    # Issue 26's property with the yaw in the distance: every cluster >= k distinct people, no person above 1/k,
    # and (one block) the feasible maximum of clusters wherever a grouping exists.
    k, counts, X, yaw, degrees = case
    people = np.repeat(np.arange(len(counts)), counts)
    best = feasible_clusters(counts, k)
    model = KSame(k, block_size=block_size)
    Z = pose_features(X, yaw, degrees=degrees)
    if best == 0:
        with pytest.raises(InsufficientPeopleError):
            model.fit(Z, people=people, images=None)
        return
    model.fit(Z, people=people, images=None)
    for c in range(model.n_clusters_):
        members = people[model.labels_ == c].tolist()
        assert len(set(members)) >= k
        assert max(Counter(members).values()) * k <= len(members)
    if block_size is None or len(people) <= block_size:
        assert model.n_clusters_ >= 0.95 * best, (model.n_clusters_, best)
