"""Release lineage: planning, structural checks, the encrypted hash-chained registry, the CLI (issue 10)."""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deid.anonymise.ksame import KSame, KSameSelect
from deid.anonymise.partition import plan_partitions
from deid.errors import ConfigError
from deid.release.lineage import build_release, release_from_clusters
from deid.release.lineage_plan import plan_release
from deid.release.lineage_state import LineageError, describe_lineage, empty_state, image_sha256
from deid.release.lineage_checks import check_structure
from deid.release.lineage_differencing import differencing_attack
from deid.release.lineage_registry import Registry, lineage_dir

ROOT = Path(__file__).resolve().parents[3]
KEY = bytes(range(32))
SHAPE = (4, 5)


class World:
    """Synthetic people, each with a few photos: features, tiny images, a fingerprint per photo."""

    def __init__(self, n_people: int = 24, photos: int = 3, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.people, self.images, self.feats, self.fps, self.parts = [], [], [], [], []
        for p in range(n_people):
            centre = rng.normal(size=6) * 3
            for j in range(photos):
                self.people.append(f"p{p:03d}")
                self.images.append(rng.integers(0, 256, SHAPE[0] * SHAPE[1], dtype=np.uint8))
                self.feats.append(centre + rng.normal(size=6) * 0.3)
                self.parts.append(("neutral",) if j % 2 == 0 else ("smiling",))
        self.images = np.array(self.images)
        self.feats = np.array(self.feats)
        self.fps = [hashlib.sha256(x.tobytes() + str(i).encode()).hexdigest() for i, x in enumerate(self.images)]

    def drop(self, idx):
        idx = list(idx)
        return ([self.people[i] for i in idx], [self.fps[i] for i in idx], [self.parts[i] for i in idx])


def _release(world: World, idx, state, *, rid: str, k: int, policy="invariant", absent="republish",
             select: bool = True):
    """Plan, cluster the new people with k-Same(-Select), build the lineage release (the flow's steps)."""
    plan, labels, images = _clustered(world, idx, state, k=k, policy=policy, absent=absent, select=select)
    rel = build_release(plan, state, release_id=rid, method="k-same-select", new_labels=labels, new_images=images,
                        shape=SHAPE)
    return plan, rel


def _clustered(world: World, idx, state, *, k: int, policy="invariant", absent="republish", select: bool = True):
    """The plan, and each new record's cluster and released grey image (what :func:`_release` builds from)."""
    idx = list(idx)
    people, fps, parts = world.drop(idx)
    plan = plan_release(state, people, fps, key=KEY, k=k, policy=policy, absent=absent,
                        partitions=parts if select else None)
    new = [idx[i] for i in plan.new_records]
    labels = np.full(len(new), -1, dtype=np.intp)
    images = np.zeros((len(new), world.images.shape[1]), np.uint8)
    # As the flow does: label partitions first (small ones and a person's images above 1/k of
    # a partition are withheld), then k-Same on what is kept.
    pplan = plan_partitions([{"p": world.parts[i]} for i in new], [world.people[i] for i in new], k=k,
                            label_names=["p"], select=select)
    keep = sorted(j for g in pplan.groups.values() for j in g)
    if keep:
        kept = [new[j] for j in keep]
        if select:
            model = KSameSelect(k).fit(world.feats[kept], people=[world.people[i] for i in kept],
                                       images=world.images[kept], partitions=[world.parts[i] for i in kept])
        else:
            model = KSame(k).fit(world.feats[kept], people=[world.people[i] for i in kept],
                                 images=world.images[kept])
        labels[keep] = model.labels_
        images[keep] = np.clip(np.rint(model.averages_[model.labels_]), 0, 255).astype(np.uint8)
    return plan, labels, images


def _independent(world: World, idx, state, *, rid: str, k: int):
    idx = list(idx)
    people, fps, parts = world.drop(idx)
    model = KSame(k).fit(world.feats[idx], people=people, images=world.images[idx])
    images = np.clip(np.rint(model.averages_[model.labels_]), 0, 255).astype(np.uint8)
    return release_from_clusters(state, people, fps, key=KEY, release_id=rid, k=k, method="k-same",
                                 labels=model.labels_, images=images, shape=SHAPE)


def _image_of(rel, state, i):
    ckey = rel.record_cluster[i]
    return None if ckey is None else rel.released_clusters(state)[ckey][0].image


# --------------------------------------------------------------------------- planning


def test_returning_people_keep_their_cluster_bit_identical_and_new_people_cluster_alone():
    w = World(n_people=20, photos=1)
    first = range(0, 15)
    s0 = empty_state("synthetic")
    _, r1 = _release(w, first, s0, rid="rel-a", k=3, select=False)
    s1 = s0.with_entry(r1.to_entry())
    second = range(0, 20)  # 5 new people arrive
    plan, r2 = _release(w, second, s1, rid="rel-b", k=3, select=False)
    assert len(plan.republish) == len(s1.clusters) and plan.n_counterfeit == 0
    assert sorted(plan.new_records) == list(range(15, 20))
    assert {p for c in r2.new_clusters for p in c.people}.isdisjoint(
        set().union(*[c.people for c in s1.clusters.values()]))
    for i in range(15):
        assert np.array_equal(_image_of(r2, s1, i), _image_of(r1, s0, i))
    assert all(c.passed for c in check_structure(s1, r2))


def test_absent_members_republish_with_counterfeits_or_suppress_whole_cluster():
    w = World(n_people=12, photos=1)
    s0 = empty_state("synthetic")
    _, r1 = _release(w, range(12), s0, rid="rel-a", k=3, select=False)
    s1 = s0.with_entry(r1.to_entry())
    gone = 4
    ckey = r1.record_cluster[gone]
    size = s1.clusters[ckey].n_released
    stay = [i for i in range(12) if i != gone]
    plan, r2 = _release(w, stay, s1, rid="rel-b", k=3, absent="republish", select=False)
    rep = {r.key: r for r in r2.republished}
    assert rep[ckey].n_counterfeit == 1 and rep[ckey].n_released == size  # looks the same as before
    assert all(r.n_released == s1.clusters[r.key].n_released for r in r2.republished)
    assert len(r2.counterfeits(s1)) == 1 and np.array_equal(r2.counterfeits(s1)[0][0], s1.clusters[ckey].image)
    assert r2.counts["counterfeit_records"] == 1
    plan, r3 = _release(w, stay, s1, rid="rel-c", k=3, absent="suppress", select=False)
    assert (ckey, "member_absent") in plan.suppressed_clusters
    assert ckey not in {r.key for r in r3.republished}
    assert all(reason == "registered_cluster_suppressed" for _, reason in plan.suppressed)
    assert len(plan.suppressed) == size - 1
    for rel in (r2, r3):
        assert all(c.passed for c in check_structure(s1, rel))


def test_returning_person_new_photo_gets_registered_image_and_fewer_than_k_new_wait():
    w = World(n_people=14, photos=2)
    first = [2 * p for p in range(12)]  # first photo of 12 people
    s0 = empty_state("synthetic")
    _, r1 = _release(w, first, s0, rid="rel-a", k=3, select=False)
    s1 = s0.with_entry(r1.to_entry())
    # person 0 brings a second photo; people 12 and 13 (2 < k) arrive
    second = [*first, 1, 24, 26]
    plan, r2 = _release(w, second, s1, rid="rel-b", k=3, select=False)
    pos = second.index(1)
    assert np.array_equal(_image_of(r2, s1, pos), _image_of(r1, s0, 0))
    assert plan.n_waiting_people == 2
    assert {reason for _, reason in plan.suppressed} == {"waiting_for_k_new_people"}
    assert all(c.passed for c in check_structure(s1, r2))
    assert r2.republished and any(r.added_records == (w.fps[1],) for r in r2.republished)


def test_release_once_suppresses_returning_people():
    w = World(n_people=12, photos=1)
    s0 = empty_state("synthetic")
    _, r1 = _release(w, range(9), s0, rid="rel-a", k=3, select=False)
    s1 = s0.with_entry(r1.to_entry())
    plan, r2 = _release(w, range(12), s1, rid="rel-b", k=3, policy="release-once", select=False)
    assert not plan.republish and sorted(plan.new_records) == [9, 10, 11]
    assert sum(reason == "released_before" for _, reason in plan.suppressed) == 9
    assert plan.summary()["suppressed_by_reason"] == {"released_before": 9}
    assert all(c.passed for c in check_structure(s1, r2))


def test_independent_reclustering_fails_the_structural_checks():
    w = World(n_people=20, photos=1, seed=0)
    s0 = empty_state("synthetic")
    r1 = _independent(w, [i for i in range(20) if i != 5], s0, rid="rel-a", k=4)  # person 5 arrives later
    s1 = s0.with_entry(r1.to_entry())
    r2 = _independent(w, range(20), s1, rid="rel-b", k=4)
    diff, same = check_structure(s1, r2)
    assert not same.passed and same.value > 0
    assert not diff.passed and diff.findings and all(f["people"] < 4 for f in diff.findings)


def test_raised_k_suppresses_registered_clusters_below_it():
    w = World(n_people=8, photos=1)
    s0 = empty_state("synthetic")
    _, r1 = _release(w, range(8), s0, rid="rel-a", k=2, select=False)
    s1 = s0.with_entry(r1.to_entry())
    small = {c.key for c in s1.clusters.values() if len(c.people) < 3}
    assert small
    plan, r2 = _release(w, range(8), s1, rid="rel-b", k=3, select=False)
    assert {key for key, reason in plan.suppressed_clusters if reason == "registered_cluster_below_k"} == small
    assert small.isdisjoint(r.key for r in r2.republished)
    assert all(c.passed for c in check_structure(s1, r2))


def test_abandoned_release_no_longer_constrains(tmp_path):
    w = World(n_people=9, photos=1)
    reg = Registry.open(tmp_path, "synthetic", KEY)
    s0 = reg.load()
    _, r1 = _release(w, range(9), s0, rid="rel-a", k=3, select=False)
    s1 = reg.append_release(s0, r1)
    assert len(s1.clusters) == 3
    s2 = reg.mark_abandoned(s1, "rel-a")  # e.g. the publish step failed after registering
    assert not s2.clusters and [r.status for r in reg.load().releases] == ["abandoned"]
    plan = plan_release(s2, w.people, w.fps, key=KEY, k=3)
    assert len(plan.new_records) == 9 and not plan.republish
    with pytest.raises(LineageError, match="only a pending release"):
        reg.mark_published(s2, "rel-a")


def test_reconcile_settles_pending_releases(tmp_path):
    w, reg, s2 = _two_releases(tmp_path)  # rel-a published, rel-b pending (run interrupted)
    s3 = reg.reconcile(s2, lambda rid: rid == "rel-b")
    assert [r.status for r in reg.load().releases] == ["published", "published"] and s3.head == reg.load().head
    _, rel = _release(w, range(12), s3, rid="rel-c", k=3, select=False)
    s4 = reg.append_release(s3, rel)
    s5 = reg.reconcile(s4, lambda rid: False)
    assert [r.status for r in s5.releases] == ["published", "published", "abandoned"]
    assert [(i, key) for i, key, _ in rel.released_records(s4)][:1] == [(0, rel.record_cluster[0])]


def test_bad_parameters_are_named():
    s0 = empty_state("synthetic")
    with pytest.raises(Exception, match="DEID_LINEAGE_POLICY"):
        plan_release(s0, ["a"], ["f"], key=KEY, k=3, policy="forever")
    with pytest.raises(Exception, match="DEID_LINEAGE_ABSENT"):
        plan_release(s0, ["a"], ["f"], key=KEY, k=3, absent="hide")
    with pytest.raises(Exception, match="dataset="):
        empty_state("../etc")
    with pytest.raises(Exception, match="32 bytes"):
        plan_release(s0, ["a"], ["f"], key=b"short", k=3)


# --------------------------------------------------------------------------- differencing attack (synthetic)


def test_differencing_attack_finds_a_swapped_and_an_added_face():
    rng = np.random.default_rng(7)
    X = rng.integers(0, 256, (40, 30), dtype=np.uint8)
    people = [f"p{i}" for i in range(40)]
    fps = [hashlib.sha256(x.tobytes()).hexdigest() for x in X]
    s0 = empty_state("synthetic")
    # release 1: {0..4}, {10..14}; release 2: {0..3, 5} (one swap), {10..15} (one added)
    lab1 = np.full(40, -1)
    lab1[[0, 1, 2, 3, 4]] = 0
    lab1[[10, 11, 12, 13, 14]] = 1
    lab2 = np.full(40, -1)
    lab2[[0, 1, 2, 3, 5]] = 0
    lab2[[10, 11, 12, 13, 14, 15]] = 1

    def imgs(lab):
        out = np.zeros_like(X)
        for c in set(lab[lab >= 0].tolist()):
            out[lab == c] = np.clip(np.rint(X[lab == c].mean(axis=0)), 0, 255).astype(np.uint8)
        return out

    r1 = release_from_clusters(s0, people, fps, key=KEY, release_id="r1", k=5, method="k-same", labels=lab1,
                               images=imgs(lab1), shape=(5, 6))
    s1 = s0.with_entry(r1.to_entry())
    r2 = release_from_clusters(s1, people, fps, key=KEY, release_id="r2", k=5, method="k-same", labels=lab2,
                               images=imgs(lab2), shape=(5, 6))
    res = differencing_attack(s1, r2, X, original_people=people)
    assert not res.passed
    kinds = {(m.kind, m.originals) for m in res.matches}
    assert ("pair", (5, 4)) in kinds and ("single", (15,)) in kinds
    assert {"p4", "p5", "p15"} <= res.people_identified
    # One test per block, the blocks on two threads: the same tests, matches (in order) and errors.
    assert differencing_attack(s1, r2, X.astype(np.float32), original_people=people, block=1, threads=2) == res
    assert all(m.mae < 1.0 for m in res.matches)
    assert not check_structure(s1, r2)[0].passed
    # The second drop through the planner: the two newcomers wait (fewer than k), nothing to find.
    drop = [0, 1, 2, 3, 5, 10, 11, 12, 13, 14, 15]
    plan = plan_release(s1, [people[i] for i in drop], [fps[i] for i in drop], key=KEY, k=5)
    assert not plan.new_records and plan.n_waiting_people == 2
    r3 = build_release(plan, s1, release_id="r3", method="k-same", new_labels=np.zeros(0, int),
                       new_images=np.zeros((0, 30), np.uint8), shape=(5, 6))
    assert differencing_attack(s1, r3, X, original_people=people).passed


def test_differencing_attack_finds_copies_shared_by_two_clusters_of_the_first_release():
    # A first release: people 0-3 each have two byte-identical photos (frames of a video, a re-scanned
    # print), one in each cluster; the fifth members differ. No earlier release, yet
    # 5 (M0 - M1) = x4 - x5 exactly: the attacker recovers person 4's face from person 5's.
    rng = np.random.default_rng(11)
    faces = rng.integers(0, 256, (6, 30), dtype=np.uint8)
    X = np.vstack([faces[[0, 1, 2, 3, 4]], faces[[0, 1, 2, 3, 5]]])
    people = ["p0", "p1", "p2", "p3", "p4", "p0", "p1", "p2", "p3", "p5"]
    fps = [f"record-{i}" for i in range(10)]  # ten records (their files differ, e.g. in metadata)
    lab = np.array([0] * 5 + [1] * 5)
    imgs = np.zeros_like(X)
    for c in (0, 1):
        imgs[lab == c] = np.clip(np.rint(X[lab == c].mean(axis=0)), 0, 255).astype(np.uint8)
    s0 = empty_state("synthetic")
    r1 = release_from_clusters(s0, people, fps, key=KEY, release_id="r1", k=5, method="k-same", labels=lab,
                               images=imgs, shape=(5, 6))
    res = differencing_attack(s0, r1, X, original_people=people)
    assert not res.passed
    assert {"p4", "p5"} <= res.people_identified
    # Two clusters of different people have nothing to find.
    other = rng.integers(0, 256, (5, 30), dtype=np.uint8)
    Y = np.vstack([faces[:5], other])
    lab_y = np.array([0] * 5 + [1] * 5)
    imgs_y = np.zeros_like(Y)
    for c in (0, 1):
        imgs_y[lab_y == c] = np.clip(np.rint(Y[lab_y == c].mean(axis=0)), 0, 255).astype(np.uint8)
    ry = release_from_clusters(s0, [f"q{i}" for i in range(10)], fps, key=KEY, release_id="ry", k=5,
                               method="k-same", labels=lab_y, images=imgs_y, shape=(5, 6))
    assert differencing_attack(s0, ry, Y).passed


# --------------------------------------------------------------------------- property over sequences of drops


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), k=st.integers(2, 3), policy=st.sampled_from(["invariant", "release-once"]),
       absent=st.sampled_from(["republish", "suppress"]), select=st.booleans(), n_drops=st.integers(2, 4))
def test_property_no_cluster_pair_differs_by_fewer_than_k_and_returning_images_are_identical(
        data, k, policy, absent, select, n_drops):
    w = World(n_people=16, photos=2, seed=data.draw(st.integers(0, 3)))
    n = len(w.people)
    state = empty_state("synthetic")
    first_image: dict[str, str] = {}        # record -> sha of its first released image
    person_images: dict[str, set] = {}      # person -> shas of images they were first released with
    bases: list[tuple[int, frozenset, str]] = []  # (release no, basis records, image sha), every release
    ever: set[str] = set()
    for r in range(n_drops):
        idx = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
        plan, rel = _release(w, idx, state, rid=f"rel-{r}", k=k, policy=policy, absent=absent, select=select)
        assert all(c.passed for c in check_structure(state, rel)), [c.detail for c in check_structure(state, rel)]
        released = rel.released_clusters(state)
        new_people_images: dict[str, set] = {}
        for pos, i in enumerate(idx):
            img = _image_of(rel, state, pos)
            if img is None:
                continue
            sha = image_sha256(img)
            fp, person = w.fps[i], w.people[i]
            if policy == "release-once":
                assert person not in ever  # at most one release per person
            if fp in first_image:
                assert sha == first_image[fp]
            elif person in person_images:
                assert sha in person_images[person]
            first_image.setdefault(fp, sha)
            new_people_images.setdefault(person, set()).add(sha)
        for person, shas in new_people_images.items():
            person_images.setdefault(person, shas)
        ever |= set(new_people_images)
        for c, _ in released.values():
            bases.append((r, c.records, c.image_sha256))
        if absent == "republish" and policy == "invariant":
            assert all(x.n_released >= state.clusters[x.key].n_released for x in rel.republished)
        state = state.with_entry(rel.to_entry())
    for a in range(len(bases)):
        for b in range(a + 1, len(bases)):
            ra, ba, ha = bases[a]
            rb, bb, hb = bases[b]
            if ra == rb:
                continue
            d = len(ba ^ bb)
            assert d == 0 or d >= k, f"clusters of releases {ra} and {rb} differ by {d} records (k={k})"
            if d == 0:
                assert ha == hb


# --------------------------------------------------------------------------- registry


def _two_releases(tmp_path):
    w = World(n_people=12, photos=1)
    reg = Registry.open(tmp_path, "synthetic", KEY)
    s0 = reg.load()
    _, r1 = _release(w, range(9), s0, rid="rel-a", k=3, select=False)
    s1 = reg.append_release(s0, r1)
    s1 = reg.mark_published(s1, "rel-a")
    _, r2 = _release(w, range(12), s1, rid="rel-b", k=3, select=False)
    s2 = reg.append_release(s1, r2)
    return w, reg, s2


def test_registry_round_trip_is_encrypted_and_chained(tmp_path):
    w, reg, s2 = _two_releases(tmp_path)
    assert reg.root == lineage_dir(tmp_path, "synthetic")
    assert oct(reg.root.stat().st_mode & 0o777) == "0o700"
    files = sorted(p.name for p in reg.root.iterdir() if p.is_file())
    assert files == ["00000000.entry", "00000001.entry", "00000002.entry", "00000003.entry", "HEAD"]
    packs = sorted((reg.root / "images").iterdir())   # the stored averages of each release, beside the entries
    assert len(packs) == 2 and all(p.name.endswith(".pack") for p in packs)
    blob = b"".join((reg.root / f).read_bytes() for f in files) + b"".join(p.read_bytes() for p in packs)
    assert w.fps[0].encode() not in blob and b"p000" not in blob and b"rel-a" not in blob
    loaded = reg.load()
    assert loaded.head == s2.head and loaded.seq == 3
    assert [r.status for r in loaded.releases] == ["published", "pending"]
    assert set(loaded.clusters) == set(s2.clusters)
    for key, c in loaded.clusters.items():
        assert np.array_equal(c.image, s2.clusters[key].image) and c.members == s2.clusters[key].members
    with pytest.raises(LineageError, match="does not authenticate: wrong key"):
        Registry.open(tmp_path, "synthetic", bytes(32)).load()
    with pytest.raises(LineageError, match="already registered"):
        reg.append_release(loaded, _release(w, range(12), loaded, rid="rel-b", k=3, select=False)[1])
    with pytest.raises(LineageError, match="planned on another lineage state"):
        reg.append_release(loaded, _release(w, range(12), s2.with_entry({"kind": "genesis"}), rid="rel-z", k=3,
                                            select=False)[1])


def _colour_release(world: World, idx, state, *, rid: str, seed: int):
    """A colour release: each new cluster's colour average (3 values per pixel) beside its grey."""
    plan, labels, images = _clustered(world, idx, state, k=3, select=False)
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, (labels.max(initial=-1) + 1, 3 * images.shape[1]), dtype=np.uint8)
    new_colors = np.zeros((len(labels), 3 * images.shape[1]), np.uint8)
    new_colors[labels >= 0] = colours[labels[labels >= 0]]
    return plan, build_release(plan, state, release_id=rid, method="k-same-select", new_labels=labels,
                               new_images=images, shape=SHAPE, new_colors=new_colors)


def test_registry_round_trip_in_colour_keeps_each_released_colour_average_and_the_mode(tmp_path):
    w = World(n_people=12, photos=1)
    reg = Registry.open(tmp_path, "synthetic", KEY)
    s0 = reg.load()
    assert s0.color_mode is None
    _, r1 = _colour_release(w, range(9), s0, rid="rel-a", seed=1)
    assert r1.color and all(c.color is not None and c.color.shape == (3 * SHAPE[0] * SHAPE[1],) for c in r1.new_clusters)
    s1 = reg.mark_published(reg.append_release(s0, r1), "rel-a")
    loaded = reg.load()
    assert loaded.color_mode == "colour" and describe_lineage(loaded)["color_mode"] == "colour"
    for c in r1.new_clusters:   # sealed beside the grey one, read back bit for bit (and not in clear on disk)
        got = loaded.clusters[c.key]
        assert np.array_equal(np.asarray(got.color), c.color) and np.array_equal(np.asarray(got.image), c.image)
        assert got.released(True) is got.color and got.released(False) is got.image
        blob = b"".join(p.read_bytes() for p in (reg.root / "images").iterdir())
        assert c.color.tobytes() not in blob
    # The inline form (a registry entry without sealed packs) round-trips too, and a changed byte is refused.
    entry = r1.to_entry()
    inline = s0.with_entry(entry)
    assert inline.color_mode == "colour"
    assert all(np.array_equal(inline.clusters[c.key].color, c.color) for c in r1.new_clusters)
    bad = json.loads(json.dumps(entry))
    colour = bytearray(base64.b64decode(bad["new_clusters"][0]["color"]))
    colour[0] ^= 1
    bad["new_clusters"][0]["color"] = base64.b64encode(bytes(colour)).decode()
    with pytest.raises(LineageError, match="colour average does not match its hash"):
        s0.with_entry(bad)
    # Returning people get their registered colour average back; three new people form a new colour cluster.
    plan, r2 = _colour_release(w, range(12), s1, rid="rel-b", seed=2)
    assert plan.republish and len(r2.new_clusters) == 1
    for i in range(9):
        key = r2.record_cluster[i]
        assert key == r1.record_cluster[i]
        first = next(c for c in r1.new_clusters if c.key == key)
        assert np.array_equal(np.asarray(loaded.clusters[key].released(r2.color)), first.color)
    s2 = reg.append_release(loaded, r2)
    assert reg.load().color_mode == "colour" and s2.color_mode == "colour"
    # A member absent: the counterfeit covering them carries the stored colour average, as the flow stages it.
    from deid.operations.worker_lineage import counterfeit_rows
    plan, r3 = _colour_release(w, range(1, 12), s2, rid="rel-d", seed=4)
    fakes = counterfeit_rows(r3, s2, [], {}, {})
    assert plan.n_counterfeit == len(fakes) >= 1
    assert all(np.array_equal(f.average, np.asarray(s2.clusters[f.cluster].color)) for f in fakes)
    # A grey release of this colour lineage is refused, naming the setting (never a state error).
    with pytest.raises(ConfigError, match="released in colour; this release is in grey"):
        _release(w, range(12), s2, rid="rel-c", k=3, select=False)
    # And a grey lineage refuses a colour release.
    _, g1 = _release(w, range(9), s0, rid="rel-g", k=3, select=False)
    grey = s0.with_entry(g1.to_entry())
    assert grey.color_mode == "grey"
    with pytest.raises(ConfigError, match="released in grey; this release is in colour"):
        _colour_release(w, range(12), grey, rid="rel-h", seed=3)
    with pytest.raises(ConfigError, match="was released in grey; a colour release cannot republish it"):
        next(iter(grey.clusters.values())).released(True)


@pytest.mark.parametrize("tamper", ["flip", "delete_middle", "delete_tail", "reorder", "rename", "head"])
def test_tampered_registry_is_refused_with_a_clear_message(tmp_path, tamper):
    _, reg, _ = _two_releases(tmp_path)
    root = reg.root
    e1, e2, e3 = (root / f"0000000{i}.entry" for i in (1, 2, 3))
    if tamper == "flip":
        data = bytearray(e2.read_bytes())
        data[len(data) // 2] ^= 0x01
        e2.write_bytes(bytes(data))
        msg = "entry 00000002 does not authenticate"
    elif tamper == "delete_middle":
        e2.unlink()
        msg = "entry 00000002 is missing"
    elif tamper == "delete_tail":
        e3.unlink()
        msg = "HEAD names entry 00000003 but the last entry is 00000002"
    elif tamper == "reorder":
        a, b = e1.read_bytes(), e2.read_bytes()
        e1.write_bytes(b)
        e2.write_bytes(a)
        msg = "moved or reordered"
    elif tamper == "rename":
        os.rename(e3, root / "00000004.entry")
        msg = "entry 00000003 is missing"
    else:
        (root / "HEAD").unlink()
        msg = "HEAD is missing"
    with pytest.raises(LineageError, match=msg):
        reg.load()


_CRASH = textwrap.dedent("""
    import json, os, sys
    import deid.release.lineage_registry as lr
    where, body = sys.argv[1], json.loads(open(sys.argv[2]).read())
    reg = lr.Registry.open({data!r}, "synthetic", bytes(range(32)))
    state = reg.load()
    if where == "link":      # killed after the temp file is written and fsynced, before it gets its name
        lr.os.link = lambda *a, **kw: os._exit(9)
    else:                    # killed after the entry got its name, before HEAD moved
        lr.os.replace = lambda *a, **kw: os._exit(9)
    reg._append(state, body)
""")


@pytest.mark.parametrize("where", ["link", "head"])
def test_registry_survives_a_killed_append_and_continues_the_chain(tmp_path, where):
    w, reg, s2 = _two_releases(tmp_path)
    _, rel = _release(w, range(12), s2, rid="rel-crash", k=3, select=False)
    body = tmp_path / "entry.json"
    body.write_text(json.dumps(rel.to_entry()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _CRASH.format(data=str(tmp_path)), where, str(body)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    after = reg.load()  # the chain is still valid
    if where == "link":
        assert list(reg.root.glob(".*.tmp")), "the crash should leave its temporary file behind"
        assert after.head == s2.head and "rel-crash" not in {r.release_id for r in after.releases}
    else:
        assert after.seq == s2.seq + 1 and "rel-crash" in {r.release_id for r in after.releases}
    s3 = reg.mark_published(after, "rel-b")  # the next run continues the chain
    assert reg.load().head == s3.head and not list(reg.root.glob(".*.tmp"))


# --------------------------------------------------------------------------- listing and CLI


def test_describe_and_cli_list_releases_and_members_only_with_key(tmp_path, capsys, monkeypatch):
    from deid.cli import lineage as cli_lineage

    _, reg, s2 = _two_releases(tmp_path)
    desc = describe_lineage(s2)
    assert [r["release_id"] for r in desc["releases"]] == ["rel-a", "rel-b"]
    assert desc["releases"][1]["new_people"] == 3 and desc["releases"][1]["returning_people"] == 9
    assert "clusters" not in desc and "clusters" in describe_lineage(s2, members=True)

    keyfile = tmp_path / "steward.key"
    keyfile.write_bytes(KEY)
    keyfile.chmod(0o600)
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path))
    parser = argparse.ArgumentParser()
    cli_lineage.register(parser.add_subparsers(dest="command"))

    def run(*argv):
        args = parser.parse_args(["lineage", *argv, "--data-dir", str(tmp_path)])
        return args.func(args)

    assert run("synthetic", "--key", str(keyfile)) == 0
    out = capsys.readouterr().out
    assert "rel-a [published]" in out and "rel-b [pending]" in out and "3 new, 9 returning" in out
    assert "person" not in out
    assert run("synthetic", "--members") == 2
    assert "--members needs the steward's key" in capsys.readouterr().err
    assert run("synthetic", "--members", "--key", str(keyfile)) == 0
    assert "person " in capsys.readouterr().out
    assert run("nothing-here", "--key", str(keyfile)) == 2
    assert "no lineage registry" in capsys.readouterr().err
    bad = tmp_path / "other.key"
    bad.write_bytes(bytes(32))
    bad.chmod(0o600)
    # A registry that does not authenticate is a state problem: `deid lineage` leaves it to the CLI's
    # type-based exit mapping (70, tests/unit/cli/test_cli_tables.py).
    with pytest.raises(LineageError, match="does not authenticate"):
        run("synthetic", "--key", str(bad))


def test_marking_published_appends_to_the_registered_state_without_reading_the_registry_again(tmp_path, monkeypatch):
    # Issue 13: at 1M faces, reading and replaying the whole registry to append a one-line status entry held
    # 1.9 GiB; the run passes the state its registration returned. A stale state falls back to reading it.
    from deid.operations import deidentify_lineage

    _, reg, s2 = _two_releases(tmp_path)  # rel-b registered, pending
    _, reg_b, _ = _two_releases(tmp_path / "b")
    loads = []
    real_load = Registry.load
    monkeypatch.setattr(Registry, "load", lambda self: loads.append(self.root) or real_load(self))
    monkeypatch.setattr(deidentify_lineage, "_registry", lambda dataset, config: reg)
    marked = deidentify_lineage.register_lineage("synthetic", s2, None, mark="published", release_id="rel-b")
    assert loads == []
    assert {r.release_id: r.status for r in marked.releases} == {"rel-a": "published", "rel-b": "published"}
    again = real_load(reg)
    assert (again.seq, again.head) == (marked.seq, marked.head)
    assert {r.release_id: r.status for r in again.releases}["rel-b"] == "published"
    # A state from before rel-b was registered: the registry is read again and rel-b marked on it.
    monkeypatch.setattr(deidentify_lineage, "_registry", lambda dataset, config: reg_b)
    stale = real_load(reg_b)
    stale = type(stale)(dataset=stale.dataset)  # an empty state: not the registry's head
    marked_b = deidentify_lineage.register_lineage("synthetic", stale, None, mark="published", release_id="rel-b")
    assert loads, "a stale state must send the mark through a fresh read of the registry"
    assert {r.release_id: r.status for r in marked_b.releases}["rel-b"] == "published"
    assert (real_load(reg_b).seq, real_load(reg_b).head) == (marked_b.seq, marked_b.head)
