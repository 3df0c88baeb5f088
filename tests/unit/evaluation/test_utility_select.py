"""The inner cross-validation that picks the release classifier's front (deid.evaluation.utility_select)."""
from __future__ import annotations

import math

import numpy as np

from deid.evaluation.utility_evidence import PooledPredictions
from deid.evaluation.utility_select import Candidate, choose, inner_splits


def _views(seed: int = 0, n_people: int = 30):
    """Two rows per person; ``good`` embeds the label in its first coordinate, ``bad`` is noise only."""
    rng = np.random.default_rng(seed)
    people = np.repeat(np.arange(n_people), 2)
    y = np.repeat(np.arange(n_people) % 2, 2)
    good = rng.normal(size=(len(y), 5))
    good[:, 0] += 3 * (2 * y - 1)
    bad = rng.normal(size=(len(y), 5))
    return people, y, Candidate(good, good), Candidate(bad, bad)


def test_the_front_whose_classifier_labels_the_other_training_peoples_faces_is_chosen_in_either_order():
    people, y, good, bad = _views()
    for cands in ({"originals": bad, "release": good}, {"release": good, "originals": bad}):
        c = choose(cands, y, people, y, people, seed=0)
        assert c.front == "release" and c.C == 1.0 and c.score > 0.9, c


def test_the_validation_faces_decide_not_the_training_rows():
    # The release's rows carry the label in both fronts, but only one front's view of the real faces does:
    # validated on the real faces, that front is chosen (validated on the rows, the two would tie).
    people, y, good, bad = _views()
    rows = good.train
    c = choose({"originals": Candidate(rows, bad.valid), "release": Candidate(rows, good.valid)}, y, people, y,
               people, seed=0)
    assert c.front == "release", c


def test_a_tie_keeps_the_first_front_and_the_choice_is_deterministic():
    people, y, good, _ = _views()
    picks = {choose({"originals": good, "release": good}, y, people, y, people, seed=s) for s in (0, 0, 1)}
    assert {p.front for p in picks} == {"originals"}
    assert choose({"originals": good, "release": good}, y, people, y, people, seed=3) == \
        choose({"originals": good, "release": good}, y, people, y, people, seed=3)


def test_one_training_person_leaves_nothing_to_validate_on_the_first_front_is_kept():
    people, y, good, bad = _views(n_people=1)
    c = choose({"originals": bad, "release": good}, y, people, y, people, seed=0)
    assert c.front == "originals" and math.isnan(c.score)


def test_inner_splits_partition_the_people_and_follow_the_seed():
    people = np.repeat(np.arange(10), 3)
    for seed in (0, 1):
        groups = inner_splits(people, seed)
        assert len(groups) == 3 and sorted(np.concatenate(groups).tolist()) == list(range(10))
    assert [g.tolist() for g in inner_splits(people, 5)] == [g.tolist() for g in inner_splits(people, 5)]
    assert inner_splits(np.zeros(4, dtype=int), 0) == []  # one person: no split


def test_the_evidence_says_which_front_each_fold_chose():
    d = PooledPredictions(choices=[("originals", 1.0), ("release", 1.0), ("originals", 1.0)])
    note, = d.choice_note()
    assert "originals in 2, on the release in 1 of 3 folds; C 1" in note
    assert PooledPredictions().choice_note() == []
