"""Multi-factor on stills reports the cells it releases (identity cluster x labels): the gate's exact 1/k bound."""
from __future__ import annotations

import numpy as np

from deid.method_registry import release_guarantee
from deid.anonymise.methods import deidentify
from deid.anonymise.methods_factor import MultiFactor, release_cells
from deid.evaluation.gate_types import GateConfig, GateInputs
from deid.evaluation.gate_structure import structural_checks

SHAPE = (8, 7)
K = 3


def london_like(n_people=13, seed=0):
    """Every person one neutral and one smiling face (as London): identity + expression + noise, gender per person."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(SHAPE[0] * SHAPE[1], 5)))[0]
    ident = rng.normal(scale=30, size=(n_people, 4))
    people = np.repeat(np.arange(n_people), 2)
    expr = np.tile(["neutral", "smile"], n_people)
    x = (128 + ident[people] @ basis[:, :4].T + 40.0 * (expr == "smile")[:, None] * basis[:, 4]
         + rng.normal(scale=2.0, size=(len(people), SHAPE[0] * SHAPE[1])))
    gender = np.where(people % 2 == 0, "f", "m")
    return np.clip(np.rint(x), 0, 255).astype(np.uint8), people, expr, gender


def structure(released, clusters, people, k):
    """The gate's own structural checks on this would-be release: (exact, min people, max share, checks)."""
    inputs = GateInputs.from_arrays(shape=SHAPE, people=people, released=released, originals=released,
                                    clusters=clusters, records_in=len(people))
    checks, min_people, share, exact = structural_checks(inputs, GateConfig(k=k, method="multi-factor"))
    return exact, min_people, share, {c.name: c for c in checks}


def test_stills_release_one_identical_image_per_cell_of_k_people_and_the_gate_finds_the_exact_bound():
    x, people, expr, gender = london_like()
    released, cells = deidentify(x, shape=SHAPE, people=people, method="multi-factor", k=K, n_components=6,
                                 labels={"expression": list(expr), "gender": list(gender)})
    for c in np.unique(cells):
        cell = cells == c
        assert (released[cell] == released[cell][0]).all()  # the identical bytes for every member
        assert len(set(expr[cell])) == 1  # nothing merged: each face keeps its own expression's image
        _, counts = np.unique(people[cell], return_counts=True)
        assert len(counts) >= K and counts.max() == 1  # every member once: share 1/|cell| <= 1/k
    assert len(np.unique(cells)) == 2 * len(np.unique(cells[expr == "neutral"]))  # cluster x expression
    exact, min_people, share, checks = structure(released, cells, people, K)
    assert exact and min_people >= K and share <= 1 / K + 1e-12
    assert checks["min_distinct_people_per_cluster"].passed and checks["max_person_share"].passed
    assert "exact bound" in checks["max_person_share"].detail
    text = release_guarantee("multi-factor", K, exact=True)
    assert text.startswith("exact in this release: 1/k = 1/3 bound") and "no formal guarantee" in text
    assert release_guarantee("multi-factor", K, exact=False).startswith("no formal guarantee")
    # "projected" keeps each face's own expression intensity: its clusters are no identical copies.
    own, clusters = deidentify(x, shape=SHAPE, people=people, method="multi-factor", k=K, n_components=6,
                               labels={"expression": list(expr)}, options={"non_identity": "projected"})
    assert not structure(own, clusters, people, K)[0]


def test_a_person_lacking_an_expression_releases_no_cell_below_k():
    x, people, expr, _ = london_like(n_people=4 * K, seed=1)
    keep = ~((people == 0) & (expr == "smile"))  # person 0 has no smiling photo
    x, people, expr = x[keep], people[keep], expr[keep]
    model = MultiFactor(K, n_components=6).fit(x, people=people, labels={"expression": list(expr)})
    released, cells = model.fit_transform(x, people=people, labels={"expression": list(expr)}), model.labels_
    for c in np.unique(cells):
        cell = cells == c
        assert (released[cell] == released[cell][0]).all() and len(set(people[cell])) >= K
    # 12 people in k-Same clusters of 3: person 0's cluster would keep a smiling cell of 2 people, so it
    # joined its nearest cluster; every cell still holds one expression (each face keeps its own).
    cluster = model.person_clusters_[model.people_.index(0)]
    mates = [p for i, p in enumerate(model.people_) if model.person_clusters_[i] == cluster]
    assert len(mates) >= 2 * K and len(np.unique(model.person_clusters_)) < 4
    assert all(len(set(expr[cells == c])) == 1 for c in np.unique(cells))
    mine = cells == cells[(people == 0)][0]
    assert set(people[mine]) == set(mates)
    exact, min_people, share, checks = structure(released, cells, people, K)
    assert exact and min_people >= K and share <= 1 / K + 1e-12
    assert checks["min_distinct_people_per_cluster"].passed and checks["max_person_share"].passed
    # The joined cluster's identity is the mean of all its people's identities.
    rows = [model.people_.index(p) for p in mates]
    np.testing.assert_allclose(model.cluster_identity_[cluster], model.identity_[rows].mean(axis=0))


def test_release_cells_merges_small_cells_within_their_identity_cluster():
    clusters = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    people = np.array([0, 1, 2, 1, 2, 3, 4, 5, 3, 4, 5])
    label = np.array([0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1])
    cells, merged = release_cells(clusters, people, [label], 3)
    # Cluster 0's second label holds 2 people: merged into the first; cluster 1 keeps both cells.
    np.testing.assert_array_equal(cells, [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(merged, [True] * 5 + [False] * 6)
    cells, merged = release_cells(clusters, people, [label], 2)
    np.testing.assert_array_equal(cells, [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3])
    assert not merged.any()
