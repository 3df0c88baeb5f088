"""Multi-factor de-identification (deid.anonymise.methods_factor) on a synthetic identity x expression model."""
from __future__ import annotations

import numpy as np
import pytest

from deid.errors import ConfigError
from deid.anonymise.methods import deidentify, guarantee, parrot_for
from deid.anonymise.methods_factor import MultiFactor

SHAPE = (10, 9)
EFFECT = {"neutral": (0.0, 0.0), "smile": (40.0, 0.0), "surprise": (0.0, 40.0)}


def factor_faces(n_people=24, seed=0, intensity=False):
    """Faces = 128 + identity (4-D subspace) + expression (2-D subspace, orthogonal) + noise.

    Expressions are unbalanced across people (some only smile), so person means mix
    expression into identity unless the labels constrain the fit.
    """
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(SHAPE[0] * SHAPE[1], 6)))[0]
    u_id, u_ex = basis[:, :4], basis[:, 4:]
    # ``intensity``: how strongly each face shows its expression (1 = the label's mean effect).
    ident = rng.normal(scale=30, size=(n_people, 4))
    people, expr = [], []
    for p in range(n_people):
        options = ["smile"] if p % 4 == 0 else list(EFFECT)
        for _ in range(rng.integers(1, 4)):
            people.append(p)
            expr.append(str(rng.choice(options)))
    people = np.array(people)
    ex = np.array([EFFECT[e] for e in expr]) * (rng.uniform(0.6, 1.4, size=len(people))[:, None] if intensity else 1)
    x = 128 + ident[people] @ u_id.T + ex @ u_ex.T + rng.normal(scale=0.5, size=(len(people), basis.shape[0]))
    gender = np.where(people % 2 == 0, "f", "m")
    return np.clip(np.rint(x), 0, 255).astype(np.uint8), people, expr, gender, ident, ex, u_id, u_ex


def test_multi_factor_separates_identity_from_expression_and_keeps_expression():
    x, people, expr, gender, ident, ex, u_id, u_ex = factor_faces()
    labels = {"expression": expr, "gender": gender}
    m = MultiFactor(3, n_components=6).fit(x, people=people, labels=labels)
    assert m.non_identity_labels_ == ["expression"]  # gender is constant within people: part of identity
    e = m.eigenfaces_
    id_pix = e.mean_ + m.identity_ @ e.components_ - 128
    # The identity factor carries no expression (the same expression part for every person) ...
    assert (id_pix @ u_ex).std(axis=0).max() < 1.0
    # ... and all of the identity: it equals the true identity up to one offset.
    err = id_pix @ u_id - ident[np.array(m.people_)]
    assert (err - err.mean(axis=0)).std(axis=0).max() < 1.0
    # Without labels, person means mix the unbalanced expressions into identity.
    plain = MultiFactor(3, n_components=6).fit(x, people=people)
    assert ((e.mean_ + plain.identity_ @ e.components_ - 128) @ u_ex).std(axis=0).max() > 5.0

    released = m.fit_transform(x, people=people, labels=labels)  # non_identity="labels"
    rel = released.astype(float) - 128
    expr = np.asarray(expr)
    # Expressions here are sparse (1-3 faces a person): most identity cluster x expression cells hold
    # fewer than 3 people and are merged (release_cells); the faces of an unmerged cell keep their own
    # expression exactly (up to one offset), those of a merged one their cell's mean.
    pure = np.array([len(set(expr[m.labels_ == c])) == 1 for c in m.labels_])
    kept = rel[pure] @ u_ex - ex[pure]
    assert pure.sum() >= 3 and (kept - kept.mean(axis=0)).std(axis=0).max() < 1.5
    assert m.identity_labels_ == ["gender"]
    cluster = m.person_clusters_[[m.people_.index(p) for p in people]]
    for c in np.unique(cluster):  # identity: the mean identity of >= k people of one gender
        members = cluster == c
        assert len(set(people[members])) >= 3 and len(set(gender[members])) == 1
        want = ident[np.unique(people[members])].mean(axis=0)
        got = (rel[members] @ u_id).mean(axis=0)
        assert np.abs(got - want).max() < 2.0
    for c in np.unique(m.labels_):  # non_identity="labels": one image per cell, of >= k people, none above 1/k
        cell = m.labels_ == c
        assert (released[cell] == released[cell][0]).all() and len(set(cluster[cell])) == 1
        assert not (released[~cell] == released[cell][0]).all(axis=1).any()
        assert len(set(people[cell])) >= 3
        whole = (cluster == cluster[cell][0]).sum() == cell.sum()  # the last resort: a whole identity cluster,
        # whose one-person share (unequal photo counts) is left to the gate; any smaller cell is within 1/k.
        assert whole or np.unique(people[cell], return_counts=True)[1].max() * 3 <= cell.sum()


def test_multi_factor_label_mode_keeps_only_label_effects_and_is_reachable_by_name():
    x, people, expr, gender, *_ = factor_faces(seed=1)
    r = MultiFactor(3, n_components=6, non_identity="residual").fit(x, people=people, labels={"expression": expr})
    z = r.eigenfaces_.transform(x)
    codes = {p: i for i, p in enumerate(r.people_)}
    np.testing.assert_allclose(r.non_identity_ + r.identity_[[codes[p] for p in people]], z, atol=1e-3)
    m = MultiFactor(3, n_components=6, non_identity="labels").fit(x, people=people, labels={"expression": expr})
    fx = m.effects_["expression"]
    codes = {v: i for i, v in enumerate(dict.fromkeys(expr))}
    own = fx[[codes[v] for v in expr]]  # each face's label effects, averaged over its cell where cells were merged
    cell_mean = np.array([own[m.labels_ == c].mean(axis=0) for c in m.labels_])
    np.testing.assert_allclose(m.non_identity_, cell_mean, atol=1e-9)
    released, clusters = deidentify(x, shape=SHAPE, people=people, method="multi-factor", k=3, n_components=6,
                                    labels={"expression": expr}, options={"non_identity": "labels"})
    np.testing.assert_array_equal(released, m.fit_transform(x, people=people, labels={"expression": expr}))
    np.testing.assert_array_equal(clusters, m.labels_)
    parrot = parrot_for("multi-factor", shape=SHAPE, people=people, k=3, n_components=6, labels={"expression": expr},
                        options={"non_identity": "labels"})
    np.testing.assert_array_equal(parrot(x), released)
    assert guarantee("multi-factor", 3).startswith("no formal guarantee; the empirical attacks decide")
    with pytest.raises(ConfigError, match="non_identity='pose'"):
        MultiFactor(3, non_identity="pose").fit(x, people=people)
    with pytest.raises(ConfigError, match="labels="):
        MultiFactor(3).fit(x, people=people, labels=[expr])
    with pytest.raises(ConfigError, match="labels\\['expression'\\] has 3 entries"):
        MultiFactor(3).fit(x, people=people, labels={"expression": expr[:3]})


def test_projected_keeps_each_faces_expression_intensity_labels_mode_only_the_label_mean():
    x, people, expr, gender, ident, ex, u_id, u_ex = factor_faces(seed=2, intensity=True)
    labels = {"expression": expr}

    def kept_error(mode):  # spread of (released expression - the face's true expression)
        rel = MultiFactor(3, n_components=6, non_identity=mode).fit_transform(x, people=people, labels=labels) - 128.0
        d = rel @ u_ex - ex
        return (d - d.mean(axis=0)).std(axis=0).max()

    # Only smiles and surprises have an intensity to keep: the projection keeps it, label
    # effects keep the mean smile / surprise only.
    assert kept_error("projected") < 2.0
    assert kept_error("labels") > 4.0


def test_identity_cells_fall_back_to_one_when_too_small():
    x, people, expr, gender, *_ = factor_faces(seed=3)
    few = np.where(people == people[0], "x", "y")  # one person alone in cell "x"
    m = MultiFactor(3, n_components=6).fit(x, people=people, labels={"expression": expr, "group": few})
    assert m.identity_labels_ == []
    assert min(len(set(people[m.labels_ == c])) for c in np.unique(m.labels_)) >= 3
    off = MultiFactor(3, n_components=6, select_identity=False).fit(x, people=people, labels={"gender": gender})
    assert off.identity_labels_ == []
    assert any(len(set(gender[off.labels_ == c])) == 2 for c in np.unique(off.labels_))  # genders mixed
    with pytest.raises(ConfigError, match="select_identity='yes'"):
        MultiFactor(3, select_identity="yes").fit(x, people=people)
