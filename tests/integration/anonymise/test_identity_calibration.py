"""Identity at any size, calibrated on the drop (issue 27): calibration, evidence merges, the cheap first
pass and the within-cluster check, on small synthetic descriptor sets (no recogniser run)."""
from __future__ import annotations

import numpy as np
import pytest

from deid.anonymise.identity import cheap_candidates, resolve_people
from deid.anonymise.identity_calibration import calibrate_recogniser
from deid.evaluation import identity_checks


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _people(n_people: int, per: int, *, spread: float, noise: float, seed: int, d: int = 32, centre=None):
    """``per`` descriptors for each of ``n_people``: people ~``spread`` apart, photos ~``noise`` from their person."""
    rng = np.random.default_rng(seed)
    base = rng.normal(0, spread / np.sqrt(2 * d), (n_people, d)) + (0 if centre is None else centre)
    E = np.repeat(base, per, axis=0) + rng.normal(0, noise / np.sqrt(2 * d), (n_people * per, d))
    ids = [f"{seed}-{i // per}" for i in range(n_people * per)]
    return E, ids


def test_calibration_is_judged_per_subset_not_on_the_global_median():
    # A majority the recogniser does not separate (people 0.3 apart, photos 0.3 from their person)
    # far from a minority it does (people 0.8 apart, photos 0.2): only the minority is informative.
    bad, bad_ids = _people(300, 2, spread=0.3, noise=0.3, seed=1, centre=3.0)
    good, good_ids = _people(100, 2, spread=0.8, noise=0.2, seed=2)
    E, ids = np.vstack([bad, good]), bad_ids + good_ids
    codes = np.unique(ids, return_inverse=True)[1]
    cal = calibrate_recogniser(E, codes)
    assert cal.informative[600:].all() and not cal.informative[:600].any()
    assert cal.duplicate < cal.threshold <= 0.45
    assert cal.false_merge["n"] == 200 and cal.false_merge["interval"][1] < 0.05
    assert cal.miss["count"] <= cal.miss["n"] and cal.miss["interval"][0] <= cal.miss["rate"] <= cal.miss["interval"][1]
    # The global median between different ids is that of the majority: the old rule switched the recogniser off.
    assert np.median(np.linalg.norm(E[:300] - E[300:600], axis=1)) < 0.65
    # Undecided subsets match below their own lower tail: near the near-copy distance where faces of different
    # ids are close, so none of their distinct people (nor their own second photographs) fall within it.
    undecided = cal.row_threshold[:600]
    assert (undecided >= cal.duplicate).all() and (undecided < cal.threshold).all()
    res = resolve_people(ids, embeddings=E)
    assert res.n_people == 400 and not res.face_merges


def _sybil_drop(offset: float) -> tuple[np.ndarray, list[str]]:
    """60 people x 2 photographs (rows 0-119), then 10 victims' (persons 0-9) first photographs copied 5 times each
    under 5 new ids (rows 120-169, victim v's at 120 + 5v), each copy ``offset`` from the photograph."""
    E, ids = _people(60, 2, spread=0.8, noise=0.3, seed=8)
    u = np.random.default_rng(9).normal(0, 1, (50, E.shape[1]))
    copies = np.repeat(E[0:20:2], 5, axis=0) + offset * u / np.linalg.norm(u, axis=1, keepdims=True)
    return np.vstack([E, copies]), ids + [f"sybil{v}-{c}" for v in range(10) for c in range(5)]


def test_planted_copies_that_make_their_subset_undecided_still_merge():
    # 60 people x 2 photographs; 10 victims, each with 5 copies of her first photograph under 5 new ids, each
    # copy 0.10 from it (the copies ~0.14 apart, her second photograph ~0.3 from them). A victim whose nearest
    # other face is her own copy counts as "not identified": the copies pull a subset under the informative bar.
    X, all_ids = _sybil_drop(0.10)
    cal = calibrate_recogniser(X, np.unique(all_ids, return_inverse=True)[1])
    assert not all(s["informative"] for s in cal.subsets)  # the attack bites: a subset is undecided
    res = resolve_people(all_ids, embeddings=X)
    for v in range(10):
        assert {res.person[2 * v]} == {res.person[120 + 5 * v + c] for c in range(5)}, f"victim {v}"
    assert res.n_people == 60  # every copy with its victim, no two real people merged


def test_sybil_copies_merge_where_the_recogniser_separates_and_different_people_do_not():
    E, ids = _people(100, 2, spread=0.8, noise=0.2, seed=3)
    pad, pad_ids = _people(300, 2, spread=0.3, noise=0.3, seed=4, centre=3.0)
    rng = np.random.default_rng(5)
    copies = E[0] + rng.normal(0, 0.1 / 8, (5, E.shape[1]))  # five copies ~0.1 from her photo
    X = np.vstack([E, pad, copies])
    all_ids = ids + pad_ids + [f"sybil{i}" for i in range(5)]
    res = resolve_people(all_ids, embeddings=X)
    victim = res.person[0]
    assert all(res.person[-5 + i] == victim for i in range(5))
    assert res.n_people == 100 + 300  # nobody else merged
    assert res.calibration["records_undecided"] == 600 and res.calibration["threshold"] <= 0.45


def test_one_close_pair_does_not_join_two_ids_with_several_faces():
    # Two ids of two faces each; one cross pair close (0.3), the other three far: not the same person.
    E, ids = _people(60, 2, spread=0.9, noise=0.15, seed=6)
    E[2] = E[0] + 0.3 / np.sqrt(E.shape[1])  # record 2 (id 1) near record 0 (id 0), records 1 and 3 far
    res = resolve_people(ids, embeddings=E)
    assert res.person[0] != res.person[2] and not res.face_merges
    E[3] = E[1] + 0.01  # a second pair close: two pairs' evidence
    res = resolve_people(ids, embeddings=E)
    assert res.person[0] == res.person[2] and res.face_merges[0]["matching_pairs"] >= 2


def _split_by(tree, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Which pairs (a[i], b[i]) a tree's buckets separate."""
    bucket = np.zeros(max(a.max(), b.max()) + 1, np.int64)
    for i, g in enumerate(tree):
        bucket[g] = i
    return bucket[a] != bucket[b]


def test_the_search_above_the_exact_limit_finds_near_pairs_one_tree_splits(monkeypatch):
    import deid.anonymise.identity as ident

    monkeypatch.setattr(ident, "_EXACT_LIMIT", 500)
    rng = np.random.default_rng(12)
    X = rng.normal(0, 1, (4000, 16))
    X[2000:] = X[:2000] + rng.normal(0, 0.02, (2000, 16))  # 2,000 near pairs under different ids
    codes, a, b = np.arange(4000), np.arange(2000), np.arange(2000, 4000)
    found = ident._knn_other(X, codes, 2)[0][a, 0] == b
    trees = ident._search_groups(X)
    principal = _split_by(trees[0], a, b)
    every = np.logical_and.reduce([_split_by(t, a, b) for t in trees])
    assert len(trees) >= 2 and principal.sum() >= 10  # the principal-direction tree alone separates some pairs
    assert found[~every].all()  # a pair is missed only where every tree splits it
    assert (~found).sum() <= every.sum() < principal.sum() / 4

    # The near-duplicate rule searches every tree too: 400 copies among 4,000 rows (the median nearest-other
    # distance is that of different rows), buckets of 200.
    monkeypatch.setattr(ident, "_BUCKET", 200)
    X[400:3600] = rng.normal(0, 1, (3200, 16))
    X[3600:] = X[:400] + rng.normal(0, 0.02, (400, 16))
    a, b = np.arange(400), np.arange(3600, 4000)
    trees = ident._search_groups(X)
    every = np.logical_and.reduce([_split_by(t, a, b) for t in trees])
    assert _split_by(trees[0], a, b).sum() >= 5
    res = resolve_people([str(c) for c in codes], X)
    assert len(res.face_merges) >= 400 - every.sum() and res.n_people == 4000 - len(res.face_merges)
    assert all(m["records"][1] - m["records"][0] == 3600 for m in res.face_merges)  # only the copies


def test_cheap_first_pass_flags_the_planted_pair_within_budget():
    rng = np.random.default_rng(7)
    C = rng.normal(0, 1, (3000, 16))
    C[2999] = C[10] + 0.001  # a near copy under another id
    codes = np.arange(3000) // 2
    codes[2999] = 5000
    rows, flagged = cheap_candidates(C, codes, 200, references=50)
    assert {10, 2999} <= set(rows.tolist()) and len(rows) <= 200 and flagged <= 150
    seen = []
    res = resolve_people([str(c) for c in codes], cheap=C, embed=lambda idx: (seen.append(len(idx)),
                         _unit(C[idx] @ rng.normal(0, 1, (16, 16))) * 2)[1], embed_budget=200)
    assert seen == [len(rows)] and res.calibration["records_embedded"] == len(rows)


def _clusters(n: int, k: int):
    return [i // k for i in range(n)]


def test_within_cluster_check_fails_a_one_person_cluster_and_a_release_at_one_member():
    rng = np.random.default_rng(8)
    members = _unit(rng.normal(0, 1, (20, 32)))  # 4 clusters of 5 different people (~1.41 apart)
    released = np.repeat(_unit(members.reshape(4, 5, 32).mean(1)), 5, axis=0)
    people = [f"p{i}" for i in range(20)]
    figs = identity_checks.cluster_figures(_clusters(20, 5), people, members, released, 0.45)
    assert not any(f["one_person"] or f["at_one_member"] for f in figs)
    sybil = members.copy()
    sybil[5:10] = members[5] + rng.normal(0, 0.01, (5, 32))  # cluster 1: one person under five ids
    released2 = released.copy()
    released2[15:20] = members[15] + 0.001  # cluster 3's image is member 15's face
    figs = identity_checks.cluster_figures(_clusters(20, 5), people, sybil, released2, 0.45)
    assert [f["one_person"] for f in figs] == [False, True, False, False]
    assert [f["at_one_member"] for f in figs] == [False, False, False, True]
    check = identity_checks._decide(figs, space="test", threshold_text="0.45", checked=20, total=20, confidence=0.95)
    assert not check.passed and check.value == 2 and check.n == 4 and check.interval[0] > 0


def test_feature_check_fails_noisy_copies_of_one_vector_only():
    rng = np.random.default_rng(9)
    X = rng.normal(0, 1, (40, 8))
    scale = np.median(np.sort(np.linalg.norm(X[:, None] - X[None], axis=2), axis=1)[:, 1])
    X[:5] = X[0] + rng.normal(0, 0.4 * scale / np.sqrt(8), (5, 8))  # noise 0.4 x the typical distance
    released = np.repeat(X.reshape(8, 5, 8).mean(1), 5, axis=0)
    check = identity_checks.feature_check(_clusters(40, 5), [f"p{i}" for i in range(40)], X, released)
    assert not check.passed and check.value == 1 and check.n == 8


@pytest.mark.parametrize("budget", [0])
def test_image_check_is_off_without_the_recogniser(budget):
    z = np.zeros((10, 92 * 81), np.uint8)
    check = identity_checks.image_check(_clusters(10, 5), list("abcdefghij"), z, z, shape=(92, 81), budget=budget)
    assert check.passed and check.status == "not_applicable" and "DEID_IDENTITY_EMBED_MAX" in check.detail


def test_large_drop_first_pass_streams_parts_and_embeds_only_what_it_flags(tmp_path, monkeypatch):
    """Above DEID_IDENTITY_EMBED_MAX featurize computes the cheap pass part by part, the partition stage reads
    it and embeds the flagged faces only (the recogniser replaced by a stand-in: its descriptors are the faces'
    own cheap features)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from deid.contracts import Aligned, Featurized
    from deid.operations import featurize_partition, worker_featurize
    from deid.operations.executors import LocalExecutor

    rng = np.random.default_rng(10)
    h, w = 24, 20
    base = rng.integers(0, 256, (60, h, w)).astype(np.float64)
    ramp = np.linspace(0.7, 1.3, w)[None, None, :]
    faces = np.vstack([base, base[:1] * ramp]).clip(0, 255).astype(np.uint8).reshape(61, -1)  # a re-lit copy
    ids = [f"r{i:03d}" for i in range(61)]
    parts = []
    for a, b in ((0, 30), (30, 61)):
        parts.append(tmp_path / f"part-{a}.parquet")
        pq.write_table(pa.table({"record_id": ids[a:b], "pixels": [f.tobytes() for f in faces[a:b]]}), parts[-1])
    asked = []

    def fake_embed(table, shape, executor):
        got = np.frombuffer(b"".join(table.column("pixels").to_pylist()), np.uint8).reshape(table.num_rows, -1)
        asked.append(table.column("record_id").to_pylist())
        return worker_featurize.identity_cheap_features(got, shape, dims=8)

    monkeypatch.setattr(featurize_partition, "embed_faces", fake_embed)
    eigen = worker_featurize.fit_eigenfaces([str(p) for p in parts], n_components=4)
    identity = worker_featurize.fit_identity_features(str(parts[0]), (h, w))
    feats = [tmp_path / f"feat-{i}.parquet" for i in range(len(parts))]
    for part, feat in zip(parts, feats):
        worker_featurize.project_part(str(part), eigen, str(feat), identity=identity)
    featurized = Featurized(parts=tuple(feats), n_components=4, identity_dims=identity.n_components)

    def first_pass(order):
        return featurize_partition.identity_first_pass(pa.chunked_array([pa.array([ids[i] for i in order])]),
                                            Aligned(parts=tuple(parts)), featurized, (h, w), LocalExecutor())

    # The model's features of the faces in memory, a part at a time, in the order of the ids asked for.
    direct = np.vstack([identity.transform(faces[:30]), identity.transform(faces[30:])])
    order = np.r_[30:61, 0:30]
    np.testing.assert_array_equal(first_pass(order)["cheap"], direct[order])
    out = first_pass(np.arange(61))
    assert out["cheap"].shape == (61, worker_featurize.IDENTITY_CHEAP_DIMS) and np.isfinite(out["cheap"]).all()
    rows, _ = cheap_candidates(out["cheap"], np.arange(61), 10)
    assert {0, 60} <= set(rows.tolist())  # the re-lit copy is its original's nearest face in the cheap space
    E = out["embed"](np.array([60, 0, 5]))
    assert asked == [["r060", "r000", "r005"]] and E.shape == (3, 8)


def test_a_subset_without_ids_of_several_faces_is_judged_by_its_median_distance_between_ids():
    rng = np.random.default_rng(11)
    apart = _unit(rng.normal(0, 1, (80, 32)))  # one face per id, ~1.41 apart: informative
    alike = apart[:1] * 3 + rng.normal(0, 0.3 / 8, (80, 32))  # one face per id, ~0.3 apart, far away: not
    cal = calibrate_recogniser(np.vstack([apart, alike]), np.arange(160))
    assert cal.informative[:80].all() and not cal.informative[80:].any()
    assert all(s["ids_with_several_faces"] == 0 for s in cal.subsets)


def test_a_run_above_the_embedding_budget_reads_the_first_pass_featurize_computed(tmp_path):
    """A release of more faces than DEID_IDENTITY_EMBED_MAX: featurize writes the first pass's features beside the
    eigenfaces, the partition stage reads them and the recogniser embeds at most the budget's faces."""
    import json

    from deid.intake.synth import make_synthetic_drop
    from deid.operations.runner import run_release
    from deid.run_config import RunConfig
    from deid.settings import Settings

    drop = make_synthetic_drop(tmp_path / "drop", people=30, images_per_person=2, seed=3)
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", identity_embed_max=24, deep_attack_sample=20,
                                        min_probes=4, cv_repeats=1), k=3)
    run_release(drop, config)
    [report_dir] = [p for p in config.reports_path.iterdir() if p.is_dir()]
    recogniser = json.loads((report_dir / "report.json").read_text())["configuration"]["identity"]["recogniser"]
    assert recogniser["records"] == 60 and 0 < recogniser["records_embedded"] <= 24


def test_self_quotient_images_are_the_formula_exactly_for_grey_and_colour_faces():
    """The first pass's self-quotient images (a face's own log term looked up for grey uint8 faces) equal
    log1p(face) - log1p(blur(face)), halved and standardised, computed directly: every grey level, every offset."""
    import cv2

    from deid.alignment.features import IlluminationFeatures

    h, w = 23, 19
    rng = np.random.default_rng(5)
    grey = rng.integers(0, 256, (40, h * w), dtype=np.uint8)
    grey[0] = np.arange(h * w) % 256  # every level, at offsets that cycle through the row
    colour = rng.integers(0, 256, (5, h * w * 3), dtype=np.uint8)
    model = IlluminationFeatures((h, w))

    def direct(r):
        f = r.reshape(h, w, -1).mean(axis=2, dtype=np.float32) if r.size != h * w else r.reshape(h, w).astype(np.float32)
        q = np.log1p(f) - np.log1p(cv2.GaussianBlur(f, (0, 0), model.sigma))
        q = cv2.resize(q, (w // 2, h // 2), interpolation=cv2.INTER_AREA).ravel()
        return (q - q.mean()) / (q.std() + 1e-6)

    for rows in (grey, colour):
        np.testing.assert_array_equal(model.quotient(rows), np.vstack([direct(r) for r in rows]))


def test_near_misses_name_the_copies_resolution_did_not_merge():
    # 10 victims x 5 copies 0.2 from her photograph (copies ~0.28 apart): 50 of 170 faces, enough to drag the
    # calibrated threshold under them. Resolution leaves them apart; its near misses name every one.
    X, all_ids = _sybil_drop(0.2)
    res = resolve_people(all_ids, embeddings=X)
    unmerged = [r for r in range(120, 170) if res.person[r] != res.person[2 * ((r - 120) // 5)]]
    assert unmerged  # the attack beats resolution here
    assert set(unmerged) <= set(res.suspects)
    d = np.linalg.norm(X[list(res.suspects)][:, None] - X[None], axis=2)
    assert np.all(np.diff([min(d[i][[j for j in range(170) if res.person[j] != res.person[s]]])
                           for i, s in enumerate(res.suspects)]) >= -1e-12)  # closest first
    clean, clean_ids = _people(200, 2, spread=0.8, noise=0.3, seed=10)
    assert resolve_people(clean_ids, embeddings=clean).suspects == ()  # distinct people: no near misses


@pytest.mark.parametrize("spread, noise, merged", [(0.8, 0.3, True), (0.25, 0.1, False)])
def test_one_near_copy_pair_joins_two_ids_only_where_different_people_lie_far_apart(spread, noise, merged):
    # Ids 0 and 1 (two faces each) share one pair 0.11 apart, their other pairs far. Among real faces (nearest other
    # id ~0.6 away) that is one photograph twice: joined. Where different people lie ~0.2 apart (cartoons) it is
    # two people who look alike to the recogniser: not joined.
    E, ids = _people(100, 2, spread=spread, noise=noise, seed=13)
    u = np.random.default_rng(14).normal(0, 1, E.shape[1])
    E[2] = E[0] + 0.11 * u / np.linalg.norm(u)
    res = resolve_people(ids, embeddings=E)
    medians = [s["median_nearest_other"] for s in res.calibration["subsets"]]
    assert (min(medians) > 0.44) if merged else (max(medians) < 0.44)  # the premise: 0.11 / median vs 0.25
    assert (res.person[0] == res.person[2]) is merged
    assert res.n_people == 100 - merged  # nobody else
