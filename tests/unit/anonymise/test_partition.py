"""Label partitions (deid.anonymise.partition): small partitions and people above 1/k of a partition."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deid.anonymise.partition import plan_partitions


def test_a_person_above_one_over_k_of_a_partition_keeps_only_what_k_same_can_hide():
    # Person "a" has 8 of 14 images; with k=3 at most floor((14 - 8) / 2) = 3 of them can stay.
    people = ["a"] * 8 + ["b", "b", "c", "c", "d", "e"]
    plan = plan_partitions([{"g": "x"}] * len(people), people, k=3, label_names=["g"])
    kept = plan.groups[("x",)]
    assert sum(people[i] == "a" for i in kept) == 3
    assert sorted(plan.suppressed) == [3, 4, 5, 6, 7]
    assert plan.small[-1]["records"] == 5 and plan.small[-1]["people"] == 1
    assert "partition" in plan.small[-1] and "suppressed" in plan.small[-1]["action"]


@settings(max_examples=80, deadline=None)
@given(k=st.integers(2, 5), counts=st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_every_kept_partition_leaves_each_person_at_most_one_kth(k, counts):
    people = [f"p{i}" for i, c in enumerate(counts) for _ in range(c)]
    plan = plan_partitions([{"g": "x"}] * len(people), people, k=k, label_names=["g"])
    for idx in plan.groups.values():
        for p in set(people[i] for i in idx):
            assert sum(people[i] == p for i in idx) * k <= len(idx)
    assert sorted(plan.suppressed + [i for idx in plan.groups.values() for i in idx]) == list(range(len(people)))
