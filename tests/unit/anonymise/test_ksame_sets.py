"""Tests of the distinct person-sets pass of k-Same (deid.anonymise.ksame_sets)."""
from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deid.anonymise.ksame_greedy as ksame_greedy
from deid.anonymise.ksame import KSame
from deid.anonymise.ksame_sets import distinct_person_sets, repeated_person_sets


def frames_layout(images, frames, *, seed=0, d=6, jitter=1e-3):
    """Near-identical frames: each image of a person repeated ``frames`` times with a tiny jitter."""
    rng = np.random.default_rng(seed)
    people = np.repeat(np.arange(len(images)), np.asarray(images) * frames)
    points = rng.normal(size=(int(np.sum(images)), d)) * 3
    X = np.repeat(points, frames, axis=0) + rng.normal(scale=jitter, size=(len(people), d))
    return X, people


def check_rules(labels, people, k):
    for c in np.unique(labels):
        members = people[labels == c].tolist()
        assert len(set(members)) >= k
        assert max(Counter(members).values()) * k <= len(members)


def valid_swap_exists(X, labels, people, b):
    """Brute force: does a swap of one face of b with one of another cluster give both sets no cluster holds?"""
    sets = {c: frozenset(people[labels == c].tolist()) for c in np.unique(labels)}
    taken = Counter(sets.values())
    held = {c: Counter(people[labels == c].tolist()) for c in sets}
    for c in sets:
        if c == b:
            continue
        for p in held[b]:
            if p in held[c]:
                continue
            for q in held[c]:
                if q in held[b]:
                    continue
                nb = (sets[b] - {p} if held[b][p] == 1 else sets[b]) | {q}
                nc = (sets[c] - {q} if held[c][q] == 1 else sets[c]) | {p}
                if not taken[nb] and not taken[nc] and nb != nc:
                    return True
    return False


def test_near_identical_frames_repeat_person_sets_and_the_pass_removes_them(monkeypatch):
    # Issue 26's frames case in miniature: 40 people x 2 images x 3 near-identical frames at k=5.
    X, people = frames_layout([2] * 40, 3)
    with monkeypatch.context() as m:  # the greedy without its last pass: the grouping before the fix
        m.setattr(ksame_greedy, "distinct_person_sets", lambda *a: 0)
        labels = KSame(5).fit(X, people=people, images=None).labels_.copy()
    before = repeated_person_sets(labels, people)
    sizes = np.bincount(labels)
    assert before >= 20  # the greedy deals each person's frames alongside the same other people
    swaps = distinct_person_sets(X, people, labels, 5)
    assert swaps > 0 and repeated_person_sets(labels, people) == 0
    check_rules(labels, people, 5)
    np.testing.assert_array_equal(np.bincount(labels), sizes)  # same clusters, same sizes
    # KSame's grouping runs the pass itself (the greedy's last step), the same swaps.
    np.testing.assert_array_equal(KSame(5).fit(X, people=people, images=None).labels_, labels)


def test_distinct_sets_leave_a_grouping_without_repeats_unchanged():
    rng = np.random.default_rng(3)
    people = np.repeat(np.arange(30), 2)
    X = rng.normal(size=(60, 5))
    labels = KSame(5).fit(X, people=people, images=None).labels_.copy()
    if repeated_person_sets(labels, people) == 0:
        kept = labels.copy()
        assert distinct_person_sets(X, people, labels, 5) == 0
        np.testing.assert_array_equal(labels, kept)


@st.composite
def frame_layouts(draw):
    k = draw(st.integers(2, 5))
    images = draw(st.lists(st.integers(1, 3), min_size=k, max_size=25))
    frames = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    return k, images, frames, seed


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame_layouts())
def test_the_pass_keeps_every_rule_and_leaves_repeats_only_where_no_swap_exists(case):
    k, images, frames, seed = case
    X, people = frames_layout(images, frames, seed=seed)
    if max(Counter(people.tolist()).values()) * k > len(people) or len(set(people.tolist())) < k:
        return  # no grouping exists (KSame refuses it)
    labels = KSame(k).fit(X, people=people, images=None).labels_.copy()
    before, sizes = repeated_person_sets(labels, people), np.bincount(labels)
    distinct_person_sets(X, people, labels, k)
    check_rules(labels, people, k)
    np.testing.assert_array_equal(np.bincount(labels), sizes)
    assert repeated_person_sets(labels, people) <= before
    # Of clusters sharing a person-set, all but the first have no rule-keeping swap left (the stated bound).
    first: dict = {}
    for c in np.unique(labels).tolist():
        s = frozenset(people[labels == c].tolist())
        if s in first:
            assert not valid_swap_exists(X, labels, people, c), (c, s)
        first.setdefault(s, c)
