"""Distinct people verified (deid.anonymise.identity): normalised ids, one face under several ids."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deid.errors import ConfigError
from deid.alignment.features import Eigenfaces
from deid.anonymise.identity import normalize_subject_id, resolve_people
from deid.operations.worker_partition import resolve_identities


def test_normalisation_merges_case_width_and_invisible_characters():
    assert normalize_subject_id("Alice") == normalize_subject_id("alice")
    assert normalize_subject_id("ＡＬＩＣＥ") == "alice"           # full-width letters (NFKC)
    assert normalize_subject_id("al\u200bice") == "alice"           # zero-width space
    assert normalize_subject_id("ali\u00adce") == "alice"           # soft hyphen
    assert normalize_subject_id(" bob   smith ") == "bob smith"
    assert normalize_subject_id("Straße") == normalize_subject_id("STRASSE")
    assert normalize_subject_id("s1") != normalize_subject_id("s2")
    res = resolve_people(["S1", "s1", "s\u200b1", "s2"])
    assert res.normalized_merges == 2 and res.n_people == 2


def _people_features(n: int, seed: int = 0, d: int = 20) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 10, (n, d))


def test_noisy_copies_under_fake_ids_become_one_person():
    X = _people_features(60)
    rng = np.random.default_rng(1)
    copies = X[0] + rng.normal(0, 0.05, (5, X.shape[1]))
    ids = [f"p{i}" for i in range(60)] + [f"fake{i}" for i in range(5)]
    res = resolve_people(ids, np.vstack([X, copies]))
    assert res.n_people == 60
    assert len(set(res.person[i] for i in [0, 60, 61, 62, 63, 64])) == 1
    assert set(res.flagged_records) == {0, 60, 61, 62, 63, 64}
    assert res.face_merges and all(m["evidence"] == "eigenface near-duplicate" for m in res.face_merges)
    assert res.summary()["records_in_face_merges"] == 6


def test_distinct_people_are_not_merged():
    X = _people_features(200, seed=3)
    ids = [f"p{i}" for i in range(200)]
    res = resolve_people(ids, X)
    assert res.n_people == 200 and not res.face_merges


def test_embeddings_merge_at_the_calibrated_distance():
    # Informative descriptors (different people far apart) and one pair closer than 0.45.
    rng = np.random.default_rng(0)
    E = rng.normal(0, 1, (30, 128))
    E /= np.linalg.norm(E, axis=1, keepdims=True)  # pairwise distances ~1.41
    E = np.vstack([E, E[0] + 0.01])
    ids = [f"p{i}" for i in range(30)] + ["other-id"]
    res = resolve_people(ids, embeddings=E)
    assert res.person[0] == res.person[30] and res.n_people == 30
    assert res.face_merges[0]["evidence"] == "face recogniser"
    with pytest.raises(ConfigError, match="rows"):
        resolve_people(["a", "b"], embeddings=E)


@settings(max_examples=40, deadline=None)
@given(st.permutations(list(range(12))))
def test_resolution_does_not_depend_on_record_order(order):
    X = _people_features(10, seed=5)
    X = np.vstack([X, X[2] + 0.01, X[7] + 0.02])
    ids = [f"p{i}" for i in range(10)] + ["dupA", "dupB"]
    base = resolve_people(ids, X).person
    res = resolve_people([ids[i] for i in order], X[list(order)]).person
    assert [res[j] for j in np.argsort(order)] == list(base)


def test_resolve_identities_merges_or_quarantines_in_the_staged_table():
    X = _people_features(30, seed=2)
    X = np.vstack([X, X[0] + 0.01])
    table = pa.table({"record_id": [f"r{i:03d}" for i in range(31)],
                      "subject_id": [f"p{i}" for i in range(30)] + ["P0-again"],
                      "features": [list(map(float, x)) for x in X]})
    merged, res, quarantined = resolve_identities(table)
    assert merged.num_rows == 31 and len(set(merged.column("subject_id").to_pylist())) == 30
    assert not quarantined
    kept, _, quarantined = resolve_identities(table, policy="quarantine")
    assert kept.num_rows == 29 and {q.record_id for q in quarantined} == {"r000", "r030"}
    assert all(q.code == "same_face_other_id" for q in quarantined)


@pytest.mark.slow
@pytest.mark.london
def test_london_has_no_false_merges_and_noisy_copies_merge():
    from helpers import load_london_aligned

    faces, people, _, _ = load_london_aligned()
    X = Eigenfaces(50, random_state=0).fit_transform(faces)
    res = resolve_people(people, X)
    assert res.n_people == len(set(people)) and not res.face_merges
    # One person's photo, with light noise, under five fake ids (issue 9's attack).
    rng = np.random.default_rng(0)
    copies = np.clip(faces[0] + rng.normal(0, 3, (5, faces.shape[1])), 0, 255)
    model = Eigenfaces(50, random_state=0).fit(faces)
    res = resolve_people([*people, *[f"fake{i}" for i in range(5)]], model.transform(np.vstack([faces, copies])))
    assert res.n_people == len(set(people))
    assert len({res.person[0], *res.person[-5:]}) == 1


def test_distance_blocks_cover_every_pair_exactly_once():
    from deid.neighbours import distance_blocks
    X = np.random.default_rng(0).normal(size=(37, 5))
    full = ((X[:, None, :] - X[None, :, :]) ** 2).sum(-1)
    got = np.vstack([d for _, d in distance_blocks(X, max_cells=100)])
    assert np.allclose(got, full)
    seen = np.zeros_like(full)
    for s, d in distance_blocks(X, max_cells=100, max_rows=3, upper=True):
        assert d.shape[0] <= 3
        seen[s:s + len(d), s:] += 1
        assert np.allclose(d, full[s:s + len(d), s:])
    assert np.array_equal(np.triu(seen, 1), np.triu(np.ones_like(full), 1))  # every pair i < j, once


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), d=st.integers(1, 12), rows=st.integers(1, 64), seed=st.integers(0, 2**31 - 1))
def test_node_mean_of_float32_chunks_is_the_float64_copys_mean_bit_for_bit(n, d, rows, seed):
    """issue 13: the bucket split centres float32 features a chunk at a time, with no float64 copy of them."""
    import deid.anonymise.identity as ident

    rng = np.random.default_rng(seed)
    X = (rng.normal(0, 1, (n, d)) * 10 ** rng.uniform(-3, 4, d)).astype(np.float32)
    idx = rng.permutation(n)[: max(1, n - int(rng.integers(0, n)))]
    old, ident._ROWS = ident._ROWS, rows
    try:
        got = ident._node_mean(X, idx)
    finally:
        ident._ROWS = old
    assert np.array_equal(got, X[idx].astype(np.float64).mean(axis=0))


def test_float32_features_give_the_buckets_and_merges_of_their_float64_copy(monkeypatch):
    """A float32 matrix is split and searched in float64 a chunk at a time: the float64 copy's results."""
    import deid.anonymise.identity as ident

    rng = np.random.default_rng(5)
    X = rng.normal(0, 10, (3000, 16)).astype(np.float32)
    copies = (X[:12] + rng.normal(0, 0.01, (12, 16))).astype(np.float32)  # noisy copies under fake ids
    ids = [f"p{i // 2}" for i in range(3000)] + [f"fake{i}" for i in range(12)]
    Z = np.vstack([X, copies])
    monkeypatch.setattr(ident, "_EXACT_LIMIT", 500)  # buckets, not one exact search
    monkeypatch.setattr(ident, "_BUCKET", 300)
    monkeypatch.setattr(ident, "_ROWS", 97)  # several chunks per node
    buckets32 = ident._buckets(Z, 300)
    buckets64 = ident._buckets(Z.astype(np.float64), 300)
    assert [b.tolist() for b in buckets32] == [b.tolist() for b in buckets64]
    assert sorted(np.concatenate(buckets32).tolist()) == list(range(len(Z)))
    r32, r64 = resolve_people(ids, Z), resolve_people(ids, Z.astype(np.float64))
    assert r32 == r64
    assert r32.face_merges and {r32.person[i] for i in (0, 3000)} == {r32.person[0]}
