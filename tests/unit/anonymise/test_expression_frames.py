"""multi-factor-expression (MultiFactor's "label-groups" mode): per-frame expression with privacy, on small synthetic frames."""
from __future__ import annotations

import numpy as np
import pytest

from deid.method_registry import REGISTRY, guarantee
from deid.anonymise.methods import deidentify, method_runner
from deid.anonymise.methods_factor import MultiFactor, label_groups
from deid.anonymise.sequences import sequence_options, sequence_warning
from deid.evaluation.sequences import sequence_linkage_check

SHAPE = (10, 9)
K = 3


def recordings(n_people=12, frames=8, seed=0):
    """Frames = 128 + identity (4-D) + expression: 'talk' frames open the mouth by a drawn amount (1-D), 'neutral' not.

    Every person has ``frames`` frames, half of each label; returns the faces, people, labels, the
    drawn openness of every frame, and the openness direction in pixel space.
    """
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(SHAPE[0] * SHAPE[1], 5)))[0]
    u_id, u_open = basis[:, :4], basis[:, 4]
    ident = rng.normal(scale=30, size=(n_people, 4))
    people = np.repeat(np.arange(n_people), frames)
    expr = np.array(["talk" if f % 2 else "neutral" for f in range(frames)] * n_people)
    opening = np.where(expr == "talk", rng.uniform(10, 60, size=len(people)), 0.0)
    x = 128 + ident[people] @ u_id.T + np.outer(opening, u_open) + rng.normal(scale=0.5, size=(len(people), len(u_open)))
    gender = np.where(people % 2 == 0, "f", "m")
    return np.clip(np.rint(x), 0, 255).astype(np.uint8), people, expr, gender, opening, u_open


def test_every_frame_residual_is_a_mean_over_k_people_with_its_label_and_identity_clusters_are_k_same():
    x, people, expr, gender, _, _ = recordings()
    labels = {"expression": expr, "gender": gender}
    m = MultiFactor(K, n_components=8, non_identity="label-groups").fit(x, people=people, labels=labels)
    own = MultiFactor(K, n_components=8, non_identity="frames").fit(x, people=people, labels=labels)
    released = np.clip(np.rint(m.released_), 0, 255).astype(np.uint8)
    cluster = m.person_clusters_[[m.people_.index(p) for p in people]]
    for c in np.unique(m.person_clusters_):  # identity: people-aware k-Same clusters of one gender
        members = np.asarray(m.people_)[m.person_clusters_ == c]
        assert len(members) >= K and len(set(gender[np.isin(people, members)])) == 1
    for g in np.unique(m.labels_):
        idx = np.flatnonzero(m.labels_ == g)
        who, counts = np.unique(people[idx], return_counts=True)
        assert len(who) >= K and counts.max() * K <= len(idx)  # >= k distinct people, none above 1/k
        assert len(set(expr[idx])) == 1 and len(set(cluster[idx])) == 1  # one label, one identity cluster
        # The released residual is the group's mean of the frames' own factors, not any one frame's ...
        np.testing.assert_allclose(m.non_identity_[idx], np.broadcast_to(own.non_identity_[idx].mean(axis=0),
                                                                         (len(idx), own.non_identity_.shape[1])))
        assert (released[idx] == released[idx][0]).all()  # ... so the group's frames are one identical image
    assert not np.allclose(m.non_identity_, own.non_identity_)


def test_groups_take_the_nearest_frames_and_every_person_even_with_unequal_frame_counts():
    # One cell of 3 people: openness 0, 10, 20 (+ a small person offset); person 2 has a fourth frame.
    V = np.array([[0.0], [10], [20], [0.4], [10.4], [20.4], [0.8], [10.8], [20.8], [19.9]])
    people = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    groups = label_groups(V, people, np.zeros(len(V), dtype=np.intp))
    assert len(np.unique(groups)) == 3
    for g in np.unique(groups):
        assert set(people[groups == g]) == {0, 1, 2}  # every group holds every person of the cell
        assert np.ptp(V[groups == g]) < 1.0  # of the same openness: nearest in expression space
    assert groups[9] == groups[2]  # the extra frame joins the group nearest to it
    # With k, a group where that extra frame puts person 2 above 1/k joins its nearest group.
    V4, people4 = np.vstack([V[:9], [[1.2], [11.2], [21.2], [20.2]]]), np.r_[people[:9], 3, 3, 3, 3]
    fair = label_groups(V4, people4, np.zeros(len(V4), dtype=np.intp), k=3)
    assert len(np.unique(fair)) == 2 and fair[12] == fair[11] == fair[2] == fair[1] != fair[0]
    for g in np.unique(fair):
        assert np.unique(people4[fair == g], return_counts=True)[1].max() * 3 <= (fair == g).sum()


def test_dropped_frames_never_leave_a_group_short_of_k_people_or_above_1_over_k():
    x, people, expr, gender, _, _ = recordings(seed=4)
    keep = np.random.default_rng(4).random(len(x)) >= 0.25  # a quarter of the frames quarantined
    m = MultiFactor(K, n_components=8, non_identity="label-groups").fit(
        x[keep], people=people[keep], labels={"expression": expr[keep], "gender": gender[keep]})
    kept = people[keep]
    assert len(np.unique(m.labels_)) > len(np.unique(m.person_clusters_)) * 2  # still per-frame groups
    for g in np.unique(m.labels_):
        who, counts = np.unique(kept[m.labels_ == g], return_counts=True)
        assert len(who) >= K and counts.max() * K <= counts.sum()


def test_keeps_how_far_each_frame_opens_within_its_label_where_labels_mode_keeps_none():
    x, people, expr, gender, opening, u_open = recordings(seed=1)
    labels = {"expression": expr, "gender": gender}
    talk = expr == "talk"
    r = {}
    for mode in ("label-groups", "labels"):
        rel = MultiFactor(K, n_components=8, non_identity=mode).fit_transform(x, people=people, labels=labels)
        seen = (rel.astype(float) - 128) @ u_open
        r[mode] = 0.0 if np.std(seen[talk]) < 1e-9 else np.corrcoef(seen[talk], opening[talk])[0, 1]
    assert r["label-groups"] > 0.6 and abs(r["labels"]) < 0.3, r


def test_registered_once_for_cli_gate_parrot_and_sequences():
    x, people, expr, gender, _, _ = recordings(n_people=9, frames=4, seed=2)
    labels = {"expression": list(expr), "gender": list(gender)}
    spec = REGISTRY["multi-factor-expression"]
    assert spec.strength == "k" and spec.clustered and spec.clusters_people
    assert guarantee("multi-factor-expression", K).startswith("no formal guarantee")
    assert sequence_warning("multi-factor-expression") is None
    assert sequence_options("multi-factor-expression") == {"non_identity": "label-groups"}
    seq = [f"q{p}" for p in people]
    released, clusters = deidentify(x, shape=SHAPE, people=list(people), method="multi-factor-expression", k=K,
                                    labels=labels, n_components=8, sequences=seq)
    # The gate's parrot re-runs the whole method (with the sequence drop's options) and gets the release.
    run = method_runner("multi-factor-expression", shape=SHAPE, k=K, n_components=8,
                        options=sequence_options("multi-factor-expression"))
    np.testing.assert_array_equal(run(x, people=list(people), labels=labels), released)
    plain = deidentify(x, shape=SHAPE, people=list(people), method="multi-factor", k=K, labels=labels,
                       n_components=8, sequences=seq)[0]
    assert not np.array_equal(plain, released)
    # Each person's recording spans groups of the same >= k people: the sequence linkage check passes.
    check = sequence_linkage_check(seq, list(clusters), list(people), k=K)
    assert check.passed and check.value >= K


def test_a_cell_short_of_k_people_is_merged_not_released_with_fewer():
    x, people, expr, gender, _, _ = recordings(n_people=9, frames=4, seed=3)
    expr = expr.copy()
    expr[people == 0] = "neutral"  # person 0 never talks: a talk cell of their cluster lacks them
    m = MultiFactor(K, n_components=8, non_identity="label-groups").fit(
        x, people=people, labels={"expression": expr, "gender": gender})
    for g in np.unique(m.labels_):
        assert len(set(people[m.labels_ == g])) >= K


def test_unknown_mode_names_the_choices():
    from deid.errors import ConfigError

    x, people, expr, _, _, _ = recordings(n_people=6, frames=2)
    with pytest.raises(ConfigError, match="label-groups"):
        MultiFactor(K, non_identity="groups").fit(x, people=people, labels={"expression": expr})
