"""Near-copy clusters repaired per cluster (issue 13): merged with their nearest cluster, else suppressed."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deid.anonymise.near_copy import NearCopyRepair, repair_in_memory
from deid.anonymise.clusters import cluster_shares
from deid.evaluation.gate_types import GateConfig
from deid.evaluation.leaks import mean_abs_difference
from deid.operations import worker_deidentify, worker_gate
from deid.reporting.report import Report

P = 64  # pixels per face
THRESHOLD = GateConfig(k=5, method="k-same").leak_threshold  # the gate's own threshold, not a copy of it


def _mean_image(pix: np.ndarray):
    return lambda m: np.clip(np.rint(pix[m].mean(axis=0, dtype=np.float64)), 0, 255).astype(np.uint8)


def _planted(seed: int, *, groups: int = 4, same_centre: bool = False):
    """``groups`` clusters of 5 people; cluster 0 is f, f+d, f-d, f+e, f-e (its mean is exactly f).

    ``same_centre``: cluster 1 is built the same way around the same f, so merging 0 with 1 keeps f.
    """
    rng = np.random.default_rng(seed)
    f = rng.integers(60, 196, P)
    d, e = rng.integers(-40, 41, P), rng.integers(-40, 41, P)
    rows = [f, f + d, f - d, f + e, f - e]
    if same_centre:
        d2, e2 = rng.integers(-40, 41, P), rng.integers(-40, 41, P)
        rows += [f, f + d2, f - d2, f + e2, f - e2]
    while len(rows) < 5 * groups:
        rows.append(rng.integers(0, 256, P))
    pix = np.clip(np.asarray(rows), 0, 255).astype(np.uint8)
    labels = np.repeat(np.arange(groups), 5)
    X = labels[:, None] * 10.0 + rng.normal(0, 0.1, (len(labels), 3))  # cluster 1 nearest to 0, then 2 ...
    people = [f"p{i:02d}" for i in range(len(labels))]
    return pix, labels, X, people


def _released(pix, labels):
    img = _mean_image(pix)
    out = np.empty_like(pix)
    for c in np.unique(labels):
        out[labels == c] = img(np.flatnonzero(labels == c))
    return out


def _repair(pix, labels, X, people):
    return repair_in_memory(labels, X, people, _released(pix, labels), pix, _mean_image(pix), k=5,
                            threshold=THRESHOLD, distance=mean_abs_difference)


def _own(pix, labels):
    keep = labels >= 0
    return mean_abs_difference(_released(pix[keep], labels[keep]), pix[keep])


def test_a_cluster_whose_mean_is_a_member_is_merged_with_its_nearest_cluster():
    pix, labels, X, people = _planted(0)
    assert _own(pix, labels).min() == 0  # the planted member is its cluster's released image
    new, rep = _repair(pix, labels, X, people)
    assert np.array_equal(new[:10], np.ones(10)) and np.array_equal(new[10:], labels[10:])  # 0 joined 1
    assert (rep.near_copy_clusters, rep.clusters_merged, rep.clusters_suppressed, rep.records_suppressed) == (1, 1, 0, 0)
    assert rep.clusters_checked == 4 and rep.min_distance_before == 0 and rep.min_distance_after >= THRESHOLD
    assert _own(pix, new).min() >= THRESHOLD
    _, distinct, shares = cluster_shares(list(new), people)
    assert min(distinct.values()) >= 5 and max(shares.values()) <= 1 / 5


def test_merging_that_cannot_help_suppresses_and_a_lone_cluster_is_suppressed():
    pix, labels, X, people = _planted(1, same_centre=True)
    new, rep = _repair(pix, labels, X, people)
    # 0 and 1 both average to f: 0 is suppressed; 1 then merges with 2 (0 is no partner any more).
    assert (new[:5] == -1).all() and (new[5:15] == 2).all() and (new[15:] == 3).all()
    assert (rep.near_copy_clusters, rep.clusters_merged, rep.clusters_suppressed, rep.records_suppressed) == (2, 1, 1, 5)
    assert _own(pix, new).min() >= THRESHOLD
    pix, labels, X, people = _planted(2, groups=1)  # one cluster in the partition: no partner
    new, rep = _repair(pix, labels, X, people)
    assert (new == -1).all() and (rep.clusters_suppressed, rep.records_suppressed, rep.min_distance_after) == (1, 5, None)


def test_no_near_copy_leaves_the_clusters_as_made_and_the_warning_rule():
    pix, labels, X, people = _planted(3)
    pix[:5] = np.random.default_rng(9).integers(0, 256, (5, P))  # no planted cluster
    new, rep = _repair(pix, labels, X, people)
    assert np.array_equal(new, labels) and rep.near_copy_clusters == 0 and rep.min_distance_after == rep.min_distance_before
    assert NearCopyRepair(THRESHOLD, records_suppressed=1).warning(999) is None  # 0.1%: no warning
    warn = NearCopyRepair(THRESHOLD, records_suppressed=5).warning(95)
    assert warn and "5 of 100 records" in warn and f"{THRESHOLD:g} grey levels" in warn


def _write_partition(root, pix, labels, people):
    root.mkdir()
    X = labels[:, None] * 10.0 + np.random.default_rng(4).normal(0, 0.1, (len(labels), 3))
    order = np.random.default_rng(5).permutation(len(labels))  # records not grouped by cluster
    pq.write_table(pa.table({
        "record_id": [f"r{i:03d}" for i in order], "subject_id": [people[i] for i in order],
        "features": pa.array([X[i].tolist() for i in order], pa.list_(pa.float32())),
        "pixels": [pix[i].tobytes() for i in order]}), root / "part-0.parquet")
    return [f"r{i:03d}" for i in order]


@pytest.mark.parametrize("method", ["k-same", "k-same-naive", "blur", "pixelate"])
def test_the_out_of_core_stage_repairs_only_the_identical_image_family(tmp_path, monkeypatch, method):
    pix, labels, _, people = _planted(1, groups=5, same_centre=True)
    ids = _write_partition(tmp_path / "partition=p000", pix, labels, people)
    monkeypatch.setattr(worker_deidentify, "AVERAGE_BUCKET_BYTES", 7 * P)  # several buckets: members read back from them
    monkeypatch.setattr(worker_deidentify, "_DISTANCE_ROWS", 3)  # and each bucket measured in several pieces
    part = worker_deidentify.deidentify_partition(str(tmp_path / "partition=p000"), str(tmp_path / "out" / "partition=p000.parquet"),
                                       k=5, method=method,
                                       shape=(8, 8), sigma=2.0, block=2, block_size=None,
                                       near_copy_threshold=THRESHOLD)
    got = pq.read_table(part.path).to_pydict()
    if method != "k-same":  # no repair: every record released as the method made it; the gate judges it
        assert part.near_copies is None and part.suppressed == () and len(got["record_id"]) == 25
        return
    rep = part.near_copies
    assert (rep.near_copy_clusters, rep.clusters_merged, rep.clusters_suppressed, rep.records_suppressed) == (2, 1, 1, 5)
    # One of the two clusters averaging to f is suppressed (the first made), the other merged.
    assert sorted(part.suppressed) in ([f"r{i:03d}" for i in range(5)], [f"r{i:03d}" for i in range(5, 10)])
    assert got["record_id"] == [r for r in ids if r not in part.suppressed]  # partition order, near copies left out
    where = {f"r{i:03d}": i for i in range(25)}
    orig = pix[[where[r] for r in got["record_id"]]]
    released = np.frombuffer(b"".join(got["pixels"]), np.uint8).reshape(len(orig), P)
    assert mean_abs_difference(released, orig).min() >= THRESHOLD
    sizes = {c.cluster: (c.size, c.people) for c in part.clusters}
    assert part.records == 20 and sorted(sizes.values()) == [(5, 5), (5, 5), (10, 10)]
    _, distinct, shares = cluster_shares(got["cluster"], [people[where[r]] for r in got["record_id"]])
    assert min(distinct.values()) >= 5 and max(shares.values()) <= 1 / 5
    # The gate pairs the partition with its part, skipping the suppressed records.
    rec = worker_gate.gate_records(str(tmp_path), [part.path], labels=[], skip=part.suppressed)
    assert list(rec.record_ids) == got["record_id"] and rec.own_distance.min() >= THRESHOLD


def test_the_colour_path_repairs_on_the_grey_the_gate_attacks(tmp_path):
    from deid.schemas import arrow as schemas

    pix, labels, _, people = _planted(7, groups=4)
    colour = np.repeat(pix, 3, axis=1)  # cluster 0: f, f+-d, f+-e in all three channels, its colour mean is f
    colour[5:] = np.random.default_rng(6).integers(0, 256, (15, 3 * P))  # the other clusters in colour
    grey = worker_deidentify.colour_to_grey(colour)
    ids = _write_partition(tmp_path / "partition=p000", grey, labels, people)
    (tmp_path / "colour").mkdir()
    pq.write_table(pa.table({"record_id": [f"r{i:03d}" for i in range(20)], "color": [c.tobytes() for c in colour]},
                            schema=schemas.aligned_color()), tmp_path / "colour" / "part-0.parquet")
    part = worker_deidentify.deidentify_partition(str(tmp_path / "partition=p000"), str(tmp_path / "out" / "partition=p000.parquet"),
                                       k=5, method="k-same", color_dir=str(tmp_path / "colour"), block_size=None,
                                       near_copy_threshold=THRESHOLD)
    rep = part.near_copies
    assert (rep.near_copy_clusters, rep.clusters_merged, rep.records_suppressed) == (1, 1, 0) and part.records == 20
    got = pq.read_table(part.path).to_pydict()
    assert got["record_id"] == ids and len(part.clusters) == 3
    released = np.frombuffer(b"".join(got["pixels"]), np.uint8).reshape(20, P)
    where = [int(r[1:]) for r in got["record_id"]]
    assert mean_abs_difference(released, grey[where]).min() >= THRESHOLD
    # The released grey is the grey of the released colour (what the gate attacks is what is published).
    np.testing.assert_array_equal(released, worker_deidentify.colour_to_grey(
        np.frombuffer(b"".join(got["color"]), np.uint8).reshape(20, -1)))


def test_report_html_shows_the_repair_with_its_threshold():
    from deid.reporting.html_report import render_report_html
    from deid.reporting.report import DatasetSummary

    rep = NearCopyRepair(THRESHOLD, clusters_checked=200, near_copy_clusters=2, clusters_merged=1,
                         clusters_suppressed=1, records_suppressed=5, min_distance_before=0.4, min_distance_after=3.2)
    ds = DatasetSummary(name="d", fingerprint="sha256:" + "0" * 64, records_in=1000, records_released=995,
                        records_suppressed=5, records_quarantined=0, near_copy_repair=rep.to_dict())
    report = {"release_id": "rel-x", "run_id": "run-x", "verdict": "released", "reasons": [], "k": 5,
              "method": "k-same", "created_at": "2026-01-01T00:00:00Z", "dataset": vars(ds), "checks": [],
              "privacy": {"bound": 0.2, "max_rate": 0.1, "min_distinct_people_per_cluster": 5, "reidentification": []},
              "utility": [], "artifacts": [], "release_dir": None, "versions": {}, "configuration": {},
              "signing": {"algorithm": "ed25519", "public_key_fingerprint": "sha256:" + "0" * 64,
                          "key_origin": "development"}}
    doc = render_report_html(Report.from_dict(report))
    assert "Near-copy repair" in doc and "2 of 200 clusters" in doc and "1 merged" in doc and "(5 records)" in doc
    assert f"within {THRESHOLD:g} grey levels" in doc or f"within {THRESHOLD} grey levels" in doc


def test_only_the_identical_mean_people_counting_methods_are_repaired():
    from deid.method_registry import REGISTRY

    assert {m for m, s in REGISTRY.items() if s.repairs_near_copies} == {"k-same", "k-same-select"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), groups=st.integers(1, 6), k=st.integers(2, 4),
       threshold=st.sampled_from([THRESHOLD, 45.0, 60.0]))
def test_repair_keeps_every_invariant_and_leaves_no_near_copy(seed, groups, k, threshold):
    """Valid k-Same clusters in, valid clusters out, none of them a near copy, every record accounted for."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(k, 2 * k, groups)  # one image per person per cluster, some people in two clusters
    labels = np.repeat(np.arange(groups), sizes)
    people = [f"p{j}" if rng.random() < 0.7 else f"q{c}-{j}" for c in range(groups) for j in range(sizes[c])]
    pix = rng.integers(0, 256, (len(labels), P)).astype(np.uint8)
    if rng.random() < 0.5:  # plant: a member at its cluster's mean
        members = np.flatnonzero(labels == 0)
        pix[members[0]] = _mean_image(pix)(members[1:])
    X = rng.normal(size=(len(labels), 3))
    new, rep = repair_in_memory(labels, X, people, _released(pix, labels), pix, _mean_image(pix), k=k,
                                threshold=threshold, distance=mean_abs_difference)
    kept = new >= 0
    assert rep.records_suppressed == int((~kept).sum()) and rep.clusters_merged + rep.clusters_suppressed <= \
        rep.near_copy_clusters
    assert set(new[kept]) <= set(labels)  # a merged cluster took its partner's index
    if kept.any():
        assert _own(pix, new).min() >= threshold
        _, distinct, shares = cluster_shares(list(new[kept]), [p for p, ok in zip(people, kept) if ok])
        assert min(distinct.values()) >= k and max(shares.values()) <= 1 / k + 1e-12
