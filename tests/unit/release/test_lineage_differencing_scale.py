"""The differencing attack's member search (issue 13): the same matches as the exhaustive search, sub-quadratic."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from deid.release.lineage import build_release, release_from_clusters
from deid.release.lineage_plan import plan_release
from deid.release.lineage_state import empty_state
from deid.release.differencing_search import average_pairs, best_pairs
from deid.release.lineage_differencing import differencing_attack

KEY = bytes(range(32))
P = 36   # pixels per tiny face
EXHAUSTIVE = 10 ** 9   # exhaustive_below above any gallery: the reference search over every original
MEMBERS = 0            # member search (plus the k-d tree for clusters with members absent from the gallery)


def averages(X: np.ndarray, lab: np.ndarray) -> np.ndarray:
    out = np.zeros_like(X)
    for c in set(lab[lab >= 0].tolist()):
        out[lab == c] = np.clip(np.rint(X[lab == c].mean(axis=0)), 0, 255).astype(np.uint8)
    return out


def release(state, X, people, fps, lab, rid, k=5):
    return release_from_clusters(state, people, fps, key=KEY, release_id=rid, k=k, method="k-same", labels=lab,
                                 images=averages(X, lab), shape=(P,))


def summary(res):
    return sorted((m.released, m.registered, m.sizes, m.kind) for m in res.matches), res.people_identified


def test_member_search_finds_what_the_exhaustive_search_finds_across_releases_and_within_one():
    # Release 1: 40 clusters of 5 (one photo of 200 people). Release 2, on a drop holding 150 of those photos,
    # 50 new ones and pixel copies of 5 photos under new records: swaps, added faces, copies within the release,
    # and registered clusters with members absent from this drop (searched through the k-d tree).
    rng = np.random.default_rng(3)
    faces = rng.integers(0, 256, (260, P), dtype=np.uint8)
    people = [f"p{i}" for i in range(260)]
    fps = [f"f{i}" for i in range(260)]
    lab1 = np.full(260, -1)
    lab1[:200] = np.arange(200) // 5
    s0 = empty_state("scale")
    s1 = s0.with_entry(release(s0, faces, people, fps, lab1, "r1").to_entry())
    drop = list(range(50, 200)) + list(range(200, 250))
    X2 = np.vstack([faces[drop], faces[[60, 61, 62, 63, 250]], faces[[70, 71, 72, 73, 74, 251]]])
    ppl2 = [people[i] for i in drop] + ["p60", "p61", "p62", "p63", "p250", "p70", "p71", "p72", "p73", "p74", "p251"]
    fps2 = [fps[i] for i in drop] + [f"copy{i}" for i in range(11)]
    lab2 = np.full(len(X2), -1)
    pos = {g: n for n, g in enumerate(drop)}
    groups = [[50, 51, 52, 53, 200], [55, 56, 57, 58, 59, 201],       # a swap, an added face vs release 1
              [90, 91, 92, 93, 94], [202, 203, 204, 205, 206]]         # republished as is (skipped), all new
    for c, g in enumerate(groups):
        lab2[[pos[x] for x in g]] = c
    lab2[200:205] = 4       # copies of 60-63 and a new face: differs from release 1's cluster 12 by 64 vs 250
    lab2[205:211] = 5       # copies of 70-74 and a new face: release 1's cluster 14 plus 251
    lab2[[pos[x] for x in range(100, 150)]] = 6 + np.arange(50) // 5   # release 1's clusters 20-29 again
    r2 = release(s1, X2, ppl2, fps2, lab2, "r2")
    ref = differencing_attack(s1, r2, X2, original_people=ppl2, exhaustive_below=EXHAUSTIVE)
    got = differencing_attack(s1, r2, X2, original_people=ppl2, exhaustive_below=MEMBERS)
    assert summary(got) == summary(ref)
    assert {"p54", "p200", "p201", "p64", "p250", "p251"} <= got.people_identified
    # Neighbour mode (few cluster pairs allowed), threads and one test per block change nothing.
    ref_nn = differencing_attack(s1, r2, X2, original_people=ppl2, exhaustive_below=EXHAUSTIVE, max_pairs=100)
    got_nn = differencing_attack(s1, r2, X2, original_people=ppl2, exhaustive_below=MEMBERS, max_pairs=100,
                                 block=7, threads=2)
    assert "nearest" in got_nn.mode and summary(got_nn) == summary(ref_nn)
    assert got_nn.people_identified >= {"p54", "p200", "p201", "p64", "p250", "p251"}


def test_a_registered_member_absent_from_the_drop_is_matched_through_a_copy_in_the_gallery():
    # Release 1 {0..4}; the drop holds 0-3, a new face 9 and, under another record, the pixels of absent photo 4:
    # 5 (M2 - M1) = x9 - x4 is matched only through the copy (the k-d tree around x9 - d).
    rng = np.random.default_rng(5)
    faces = rng.integers(0, 256, (10, P), dtype=np.uint8)
    people = [f"p{i}" for i in range(10)]
    s0 = empty_state("scale")
    lab1 = np.array([0] * 5 + [-1] * 5)
    s1 = s0.with_entry(release(s0, faces, people, [f"f{i}" for i in range(10)], lab1, "r1").to_entry())
    X2 = faces[[0, 1, 2, 3, 9, 4]]
    ppl2 = ["p0", "p1", "p2", "p3", "p9", "p4"]
    fps2 = ["f0", "f1", "f2", "f3", "f9", "another-file-of-f4"]
    r2 = release(s1, X2, ppl2, fps2, np.array([0, 0, 0, 0, 0, -1]), "r2")
    ref = differencing_attack(s1, r2, X2, original_people=ppl2, exhaustive_below=EXHAUSTIVE)
    got = differencing_attack(s1, r2, X2, original_people=ppl2, exhaustive_below=MEMBERS)
    assert summary(got) == summary(ref)
    assert got.people_identified == {"p4", "p9"}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), k=st.integers(2, 5), extra=st.integers(0, 3),
       kind=st.sampled_from(["swap", "add", "copies-swap", "copies-add"]))
def test_property_a_planted_one_record_difference_is_always_found(seed, k, extra, kind):
    # Background clusters of distinct random faces plus one planted leak, in one release ("copies-": byte-identical
    # pixels under new records) or across two releases; the member search names the differing people.
    rng = np.random.default_rng(seed)
    s = k + extra
    n_bg = 6 * s
    faces = rng.integers(0, 256, (n_bg + s + 2, P), dtype=np.uint8)
    people = [f"p{i}" for i in range(len(faces))]
    fps = [f"f{i}" for i in range(len(faces))]
    lab = np.full(len(faces), -1)
    lab[:n_bg] = np.arange(n_bg) // s
    leak = list(range(n_bg, n_bg + s))     # the planted cluster
    a, b = n_bg + s, n_bg + s + 1          # its swapped-in or added face
    lab[leak] = 6
    sibling = leak[:-1] + [a] if kind.endswith("swap") else leak + [a]
    want = {people[leak[-1]], people[a]} if kind.endswith("swap") else {people[a]}
    s0 = empty_state("scale")
    if kind.startswith("copies"):
        X = np.vstack([faces, faces[sibling]])
        ppl = people + [people[i] for i in sibling]
        fp = fps + [f"copy{i}" for i in range(len(sibling))]
        lab2 = np.concatenate([lab, np.full(len(sibling), 7)])
        lab2[a] = lab2[b] = -1
        state, rel = s0, release(s0, X, ppl, fp, lab2, "r1", k=k)
    else:
        lab[a] = lab[b] = -1
        state = s0.with_entry(release(s0, faces, people, fps, lab, "r1", k=k).to_entry())
        lab2 = np.full(len(faces), -1)
        lab2[sibling] = 0
        X, ppl = faces, people
        rel = release(state, X, ppl, fps, lab2, "r2", k=k)
    got = differencing_attack(state, rel, X, original_people=ppl, exhaustive_below=MEMBERS)
    assert want <= got.people_identified
    assert any(m.kind == ("pair" if kind.endswith("swap") else "single") for m in got.matches)


def test_pairs_through_the_tree_keep_the_structural_pairs_and_all_neighbours_when_asked_for_all():
    rng = np.random.default_rng(0)
    Y1 = rng.normal(size=(60, 8)).astype(np.float32)
    Y2 = rng.normal(size=(50, 8)).astype(np.float32)
    structural = (np.array([0, 3, 59]), np.array([49, 2, 0]))
    i, j = average_pairs(Y1, Y2, False, 50, structural=structural, brute_max=0)    # k-d tree, every neighbour
    assert set(zip(i.tolist(), j.tolist())) == {(x, y) for x in range(60) for y in range(50)}
    i, j = average_pairs(Y1, Y2, False, 3, structural=structural, brute_max=0)
    got = set(zip(i.tolist(), j.tolist()))
    assert {(0, 49), (3, 2), (59, 0)} <= got
    bi, bj = average_pairs(Y1, Y2, False, 3)                                       # exact, by blocks
    exact = set(zip(bi.tolist(), bj.tolist()))
    assert len(got - {(0, 49), (3, 2), (59, 0)}) == 180 and len(exact) == 180
    assert len(exact & got) >= 0.8 * len(exact)   # (1 + eps)-approximate: most of the exact neighbours


# --------------------------------------------------------------------------- the release run's content index (issue 32)


def _two_releases():
    """The scenario of the member-search test above: swaps, added faces, pixel copies under new records."""
    rng = np.random.default_rng(3)
    faces = rng.integers(0, 256, (260, P), dtype=np.uint8)
    people = [f"p{i}" for i in range(260)]
    fps = [f"f{i}" for i in range(260)]
    lab1 = np.full(260, -1)
    lab1[:200] = np.arange(200) // 5
    s0 = empty_state("scale")
    s1 = s0.with_entry(release(s0, faces, people, fps, lab1, "r1").to_entry())
    drop = list(range(50, 200)) + list(range(200, 250))
    X2 = np.vstack([faces[drop], faces[[60, 61, 62, 63, 250]], faces[[70, 71, 72, 73, 74, 251]]])
    ppl2 = [people[i] for i in drop] + ["p60", "p61", "p62", "p63", "p250", "p70", "p71", "p72", "p73", "p74", "p251"]
    fps2 = [fps[i] for i in drop] + [f"copy{i}" for i in range(11)]
    lab2 = np.full(len(X2), -1)
    pos = {g: n for n, g in enumerate(drop)}
    for c, g in enumerate([[50, 51, 52, 53, 200], [55, 56, 57, 58, 59, 201], [90, 91, 92, 93, 94],
                           [202, 203, 204, 205, 206]]):
        lab2[[pos[x] for x in g]] = c
    lab2[200:205] = 4
    lab2[205:211] = 5
    lab2[[pos[x] for x in range(100, 150)]] = 6 + np.arange(50) // 5
    return s1, release(s1, X2, ppl2, fps2, lab2, "r2"), X2, ppl2


def test_the_content_index_finds_every_match_of_all_pairs_and_tests_only_pairs_that_can_differ():
    s1, r2, X2, ppl2 = _two_releases()
    ref = differencing_attack(s1, r2, X2, original_people=ppl2, exhaustive_below=EXHAUSTIVE)   # all pairs
    got = differencing_attack(s1, r2, X2, original_people=ppl2, pairs="content")
    republished = {c.key for c, _ in r2.released_clusters(s1).values() if c.key in s1.clusters}
    assert "content index" in got.mode and got.people_identified == ref.people_identified
    assert {"p54", "p200", "p201", "p64", "p250", "p251"} <= got.people_identified
    # Every match of all pairs whose attacked cluster is first released now; a republished cluster's pairs
    # (tested when it was first released) are not attacked again.
    want = {m for m in summary(ref)[0] if m[0] not in republished}
    assert set(summary(got)[0]) == want
    assert got.n_cluster_pairs < ref.n_cluster_pairs / 20    # the pairs sharing content, not all of them
    # The same release with members' pixels no gallery holds (another drop's records): each pair is its own
    # content, and the swaps and added faces across releases (shared fingerprints) are still tested.
    far = differencing_attack(s1, r2, X2, original_people=ppl2, original_records=[f"x{i}" for i in range(len(X2))],
                              pairs="content")
    assert far.n_cluster_pairs > 0


def test_a_release_of_returning_clusters_only_tests_nothing_and_reads_nothing():
    s1, _, X2, ppl2 = _two_releases()
    faces = np.asarray(X2)[:150]
    fps = [f"f{i}" for i in range(50, 200)]
    plan = plan_release(s1, ppl2[:150], fps, key=KEY, k=5)       # every record returns: no new cluster
    r = build_release(plan, s1, release_id="r3", method="k-same", new_labels=np.zeros(0, int),
                      new_images=np.zeros((0, P), np.uint8), shape=(P,))
    assert not r.new_clusters and r.republished

    class Unread:
        shape = faces.shape

        def __getitem__(self, idx):
            raise AssertionError("no original is read when no cluster is first released")

    res = differencing_attack(s1, r, Unread(), original_people=ppl2[:150], original_records=fps, pairs="content")
    assert res.passed and res.n_cluster_pairs == 0 and "no cluster first released now" in res.mode


def _planted(seed: int, k: int, extra: int, swap: bool, copies: bool):
    """A release with one planted difference: a cluster and its sibling differ by one added face or one swapped
    pair, within one release through pixel copies under new records (``copies``) or across two releases."""
    rng = np.random.default_rng(seed)
    s = k + extra
    n_bg = 6 * s
    faces = rng.integers(0, 256, (n_bg + s + 2, P), dtype=np.uint8)
    people = [f"p{i}" for i in range(len(faces))]
    fps = [f"f{i}" for i in range(len(faces))]
    lab = np.full(len(faces), -1)
    lab[:n_bg] = np.arange(n_bg) // s
    leak = list(range(n_bg, n_bg + s))
    a, b = n_bg + s, n_bg + s + 1
    lab[leak] = 6
    sibling = leak[:-1] + [a] if swap else leak + [a]
    s0 = empty_state("scale")
    if copies:   # pixel copies under new records, in one release
        X = np.vstack([faces, faces[sibling]])
        ppl = people + [people[i] for i in sibling]
        lab2 = np.concatenate([lab, np.full(len(sibling), 7)])
        lab2[a] = lab2[b] = -1
        state, rel = s0, release(s0, X, ppl, fps + [f"copy{i}" for i in range(len(sibling))], lab2, "r1", k=k)
    else:        # across two releases
        lab[a] = lab[b] = -1
        state = s0.with_entry(release(s0, faces, people, fps, lab, "r1", k=k).to_entry())
        lab2 = np.full(len(faces), -1)
        lab2[sibling] = 0
        X, ppl = faces, people
        rel = release(state, X, ppl, fps, lab2, "r2", k=k)
    planted = {people[leak[-1]], people[a]} if swap else {people[a]}
    return state, rel, X, ppl, planted


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 16), k=st.integers(2, 5), extra=st.integers(0, 3), swap=st.booleans(),
       copies=st.booleans())
# Found by this property (session 17): the swap's pair was not among the 16 originals best_pairs preselected on
# each side; both searches missed it until small galleries compared every pair.
@example(seed=38601, k=3, extra=2, swap=True, copies=False)
@example(seed=38619, k=3, extra=2, swap=True, copies=False)
def test_property_the_content_index_finds_a_planted_one_record_difference(seed, k, extra, swap, copies):
    # A swap differs by two people's records: a leak only when 2 < k (lineage_checks.check_structure's rule;
    # at k=2 it gives a - b, two people's faces, and neither the all-pairs search nor the index reports it).
    assume(k >= 3 or not swap)
    state, rel, X, ppl, planted = _planted(seed, k, extra, swap, copies)
    got = differencing_attack(state, rel, X, original_people=ppl, pairs="content")
    assert planted <= got.people_identified
    assert any(m.kind == ("pair" if swap else "single") for m in got.matches)


@pytest.mark.parametrize("pairs", ["content", "nearest"])
def test_a_swap_among_pixel_copies_within_one_release_is_found(pairs):
    # Once a known gap of both searches (~20% of these seeds missed, which ones moving with the BLAS kernels):
    # the swap's pair was not among best_pairs' preselected originals. A gallery this small is now searched over
    # every pair (differencing_search.EXHAUSTIVE_PAIRS_MAX), and forty planted releases are all found.
    missed = []
    for seed in range(40):
        state, rel, X, ppl, planted = _planted(seed, 3, 1, swap=True, copies=True)
        got = differencing_attack(state, rel, X, original_people=ppl, pairs=pairs)
        if not planted <= got.people_identified:
            missed.append(seed)
    assert not missed, f"swaps among pixel copies missed for seeds {missed}"


def test_best_pairs_of_a_small_gallery_is_the_nearest_of_every_pair():
    # Brute force over every ordered pair a != b, in the space the pixel check measures (unwhitened by sd).
    rng = np.random.default_rng(5)
    Z = rng.normal(size=(40, 12)).astype(np.float32)
    sd = rng.uniform(0.5, 2.0, 12).astype(np.float32)
    truth = [(3, 17), (29, 0), (8, 39)]
    D = np.array([Z[a] - Z[b] for a, b in truth]) + rng.normal(0, 0.05, (3, 12)).astype(np.float32)
    D = np.vstack([D, rng.normal(size=(5, 12)).astype(np.float32)])   # and differences no pair explains
    got = best_pairs(D, Z, candidates=4, sd=sd)
    W, E = Z * sd, D * sd
    for row, (a, b) in enumerate(got.tolist()):
        d = ((W[:, None, :] - W[None, :, :] - E[row]) ** 2).sum(-1)
        np.fill_diagonal(d, np.inf)
        assert a != b and d[a, b] <= d.min() * (1 + 1e-5), (row, (a, b), np.unravel_index(np.argmin(d), d.shape))
    assert [tuple(p) for p in got[:3].tolist()] == truth
