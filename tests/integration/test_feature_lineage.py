"""Successive feature releases of one dataset through the lineage registry, and the feature drops' GX suites.

Synthetic feature drops (:mod:`deid.intake.synth_features`: person ``p`` is the same in every
drop of a seed) released by the Prefect-free runner.
"""
from __future__ import annotations

import base64
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from deid.intake.features import write_feature_drop
from deid.intake.synth_features import synthetic_features
from deid.operations.features import FeatureSteps, partition_features
from deid.operations.runner import Steps, run_release
from deid.errors import ConfigError
from deid.release.lineage import build_release
from deid.release.lineage_plan import plan_release
from deid.release.lineage_state import LineageError, average_sha256, empty_state
from deid.release.lineage_registry import Registry
from deid.release.linkage import load_linkage_key, read_linkage
from deid.release.vectors import read_vector_release
from deid.run_config import RunConfig
from deid.settings import Settings

K = 5
DATASET = "voices"
SYNTH = synthetic_features(people=50, per_person=2, dim=16, seed=3)


def _drop(root: Path, name: str, people: set[int], *, broken: bool = False, dataset: str = DATASET) -> Path:
    """A drop of dataset ``voices`` holding the synthetic people ``people`` (both records each).

    ``broken``: row 5 holds a NaN, row 8 an expression drop.yaml's ``label_values`` does not declare.
    """
    idx = [i for i, p in enumerate(SYNTH.people) if int(p[1:]) in people]
    vectors = SYNTH.vectors[idx].copy()
    labels = {x: [v[i] for i in idx] for x, v in SYNTH.labels.items()}
    extra = {"dataset": dataset}
    if broken:
        vectors[4, 3] = np.nan
        labels["expression"][7] = "e9"
        extra["label_values"] = {"gender": ["g0", "g1"], "expression": ["e0", "e1"]}
    return write_feature_drop(root / "drops" / name, vectors=vectors, subject_ids=[SYNTH.people[i] for i in idx],
                              labels=labels, record_ids=[SYNTH.record_ids[i] for i in idx], name=name,
                              extra_yaml=extra)


def _config(root: Path, policy: str = "invariant", **kw) -> RunConfig:
    settings = Settings(project_dir=root, signing_key=None, linkage_key=None, dask_address=None, seed=None,
                        lineage_policy=policy)
    return RunConfig.resolve(settings, kind="features", **{"k": K, "method": "k-same-select", **kw})


def _released(root: Path, res) -> dict[str, list[tuple[str, bytes]]]:
    """cluster_id -> [(steward's record id or None for a counterfeit, released vector bytes)] of a release."""
    table, vectors = read_vector_release(res.release_dir)
    at = {rid: i for i, rid in enumerate(table.column("record_id").to_pylist())}
    key = load_linkage_key(root / "data" / "keys" / "dev_linkage.key")
    out: dict[str, list[tuple[str, bytes]]] = {}
    for row in read_linkage(res.linkage, key):
        v = np.ascontiguousarray(vectors[at[row["released_record_id"]]], dtype="<f4").tobytes()
        out.setdefault(row["cluster_id"], []).append((row["source_image"], v))
    return out


@pytest.fixture(scope="module")
def two_releases(tmp_path_factory):
    """Release 1: people 0-39; release 2: people 5-49 (5 left, 10 new), one dataset, policy invariant."""
    root = tmp_path_factory.mktemp("featlin")
    first = run_release(_drop(root, "d1", set(range(0, 40))), _config(root))
    second = run_release(_drop(root, "d2", set(range(5, 50))), _config(root))
    return root, first, second


def test_second_feature_release_keeps_every_returning_vector_and_no_cluster_differs_by_fewer_than_k(two_releases):
    root, first, second = two_releases
    assert first.verdict == "released" and second.verdict == "released", (first.reasons, second.reasons)
    r1, r2 = _released(root, first), _released(root, second)
    # Each release's clusters hold one vector each: the k-Same mean, identical for every member.
    for rel in (r1, r2):
        assert all(len({v for _, v in rows}) == 1 for rows in rel.values())
    # Across releases: clusters with different vectors share no record or differ by >= k records.
    basis1 = {rows[0][1]: {r for r, _ in rows} for rows in r1.values()}
    compared = 0
    for rows in r2.values():
        v2, recs2 = rows[0][1], {r for r, _ in rows if r is not None}
        for v1, recs1 in basis1.items():
            if v1 == v2:  # a registered cluster released again: only its own people's records carry it
                assert {r.split("-")[1] for r in recs2} <= {r.split("-")[1] for r in recs1}
                continue
            compared += 1
            assert not 1 <= len(recs1 ^ recs2) <= K - 1, (len(recs1 ^ recs2), sorted(recs1 ^ recs2))
    assert compared > 0
    # A returning person's released vectors are bit-identical to their first ones.
    def by_person(rel):
        out: dict[str, set[bytes]] = {}
        for rows in rel.values():
            for r, v in rows:
                if r is not None:
                    out.setdefault(r.split("-")[1], set()).add(v)
        return out

    p1, p2 = by_person(r1), by_person(r2)
    returning = set(p1) & set(p2)
    assert len(returning) == 35 and all(p2[p] == p1[p] for p in returning)
    # Five people left: their clusters are republished at their first size with counterfeit rows.
    n_fake = sum(r is None for rows in r2.values() for r, _ in rows)
    report = json.loads(second.report_path.read_text())
    lin = report["lineage"]
    assert lin["applied"] is True and lin["registered"] is True and lin["policy"] == "invariant"
    assert lin["returning_people"] == 35 and lin["new_people"] == 10 and lin["counterfeit_records"] == n_fake > 0
    assert lin["based_on_head"] != "0" * 64
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("lineage_cluster_differences", "lineage_returning_identical", "lineage_differencing_attack"):
        assert checks[name]["passed"], checks[name]
    assert "70 released records of 35 returning people" in checks["lineage_returning_identical"]["detail"]
    assert report["privacy"]["max_person_share"] <= 1.0 / K + 1e-12


def test_the_same_vectors_under_another_dataset_name_are_refused_naming_the_dataset(two_releases):
    """Issue 27: the project's person index holds the released people's vector fingerprints, whatever the name."""
    root, first, second = two_releases
    before = sorted(p.name for p in (root / "data" / "releases").iterdir())
    res = run_release(_drop(root, "renamed", set(range(30, 50)), dataset="voices-renamed"), _config(root))
    assert res.verdict == "rejected" and res.release_dir is None
    assert "registered under dataset 'voices' (20 people)" in " ".join(res.report.reasons)
    assert [(c.name, c.passed) for c in res.report.checks] == [("person_index", False)]
    # A refusal, worded as one (not "the drop could not be judged"); the released runs say vectors get no face search.
    assert res.report.reasons[0].startswith("the drop of dataset 'voices-renamed' holds people"), res.report.reasons
    searched = {c["name"]: c for c in json.loads(second.report_path.read_text())["checks"]}["person_index"]
    assert searched["passed"] and "face search: not applicable (a feature drop has no faces)" in searched["detail"]
    assert sorted(p.name for p in (root / "data" / "releases").iterdir()) == before


def _bypass(ingested, identity, config, *, lineage_state=None, logger=None):
    """The lineage policy bypassed: every person clustered as new, the release checked against the real registry."""
    part = partition_features(ingested, identity, config, lineage_state=empty_state(lineage_state.dataset))
    plan = replace(part.lineage.plan, based_on_seq=lineage_state.seq, based_on_head=lineage_state.head)
    return replace(part, lineage=replace(part.lineage, plan=plan, state=lineage_state))


def test_a_feature_release_reclustered_without_the_policy_is_rejected_by_the_lineage_checks(two_releases):
    root, first, second = two_releases
    before = sorted(p.name for p in (root / "data" / "releases").iterdir())
    res = run_release(root / "drops" / "d2", _config(root), steps=Steps(features=FeatureSteps(partition=_bypass)))
    assert res.verdict == "rejected" and res.release_dir is None
    checks = {c.name: c for c in res.report.checks}
    assert not checks["lineage_cluster_differences"].passed, checks["lineage_cluster_differences"]
    assert not checks["lineage_returning_identical"].passed
    # The differencing attack in feature space finds what re-clustering leaks: differences of released
    # means that are exactly an original vector, or a pair of them.
    assert not checks["lineage_differencing_attack"].passed and checks["lineage_differencing_attack"].value >= 1
    assert any(r.startswith("lineage_") for r in res.report.reasons)
    assert sorted(p.name for p in (root / "data" / "releases").iterdir()) == before  # nothing published
    report = json.loads(res.report_path.read_text())
    assert report["lineage"]["registered"] is False


def test_release_once_releases_only_people_never_released_before(tmp_path):
    first = run_release(_drop(tmp_path, "d1", set(range(0, 30))), _config(tmp_path, "release-once"))
    second = run_release(_drop(tmp_path, "d2", set(range(20, 45))), _config(tmp_path, "release-once"))
    assert first.verdict == "released" and second.verdict == "released", second.reasons
    people = [{r.split("-")[1] for rows in _released(tmp_path, res).values() for r, _ in rows if r is not None}
              for res in (first, second)]
    assert len(people[0]) == 30 and people[1] and not people[0] & people[1]  # nobody appears twice
    lin = json.loads(second.report_path.read_text())["lineage"]
    assert lin["policy"] == "release-once" and lin["returning_people"] == 10
    assert lin["suppressed_by_reason"]["released_before"] == 20 and lin["republished_clusters"] == 0


def test_feature_runs_validate_the_table_and_the_release_with_great_expectations(tmp_path):
    drop = _drop(tmp_path, "broken", set(range(0, 30)), broken=True)
    res = run_release(drop, _config(tmp_path))
    assert res.verdict == "released", res.reasons
    report = json.loads(res.report_path.read_text())
    assert report["dataset"]["quarantine_by_reason"] == {"non_finite_features": 1, "undeclared_label": 1}
    val = report["validation"]
    assert set(val) == {"feature_table", "feature_ingested", "feature_release"}
    # The table as the steward wrote it: the NaN vector and the undeclared label are flagged (the reader
    # quarantined their rows) ...
    table = {(r["expectation"], r["column"]): r for r in val["feature_table"]["results"]}
    assert not val["feature_table"]["success"] and val["feature_table"]["failed"] == 2
    assert table[("expect_column_values_to_be_in_set", "_vector_finite")]["unexpected_count"] == 1
    assert table[("expect_column_values_to_be_in_set", "expression")]["unexpected_count"] == 1
    assert table[("expect_column_values_to_be_between", "_vector_length")]["success"]
    assert table[("expect_column_values_to_be_unique", "record_id")]["success"]
    # ... what was staged and what is released pass, and gate the run.
    assert val["feature_ingested"]["success"] and val["feature_release"]["success"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["expectations_feature_ingested"]["passed"] and checks["expectations_feature_release"]["passed"]
    release = {(r["expectation"], r["column"]) for r in val["feature_release"]["results"]}
    assert ("expect_column_values_to_be_between", "_cluster_size") in release
    page = (res.report_dir / "validation" / "index.html").read_text()
    assert "feature_table" in page and "feature_release" in page and "FAIL" in page
    assert all(name in (res.report_dir / "report.html").read_text() for name in val)


def test_the_registry_stores_a_feature_cluster_mean_bit_for_bit(tmp_path):
    """A vector payload: float32 bytes kept and hashed exactly; image entries keep their form; tampering is refused."""
    key = bytes(range(32))
    v = SYNTH.vectors[:10].astype(np.float32)
    state = empty_state(DATASET)
    plan = plan_release(state, list(SYNTH.people[:10]), [f"{i:064x}" for i in range(10)], key=key, k=5)
    mean = np.repeat(v.reshape(2, 5, -1).mean(axis=1).astype(np.float32), 5, axis=0)
    labels = np.repeat([0, 1], 5)
    rel = build_release(plan, state, release_id="rel-1", method="k-same", new_labels=labels, new_images=mean,
                        shape=(16,))
    reg = Registry.open(tmp_path, DATASET, key)
    reg.append_release(state, rel)
    loaded = reg.load()
    got = sorted(loaded.clusters.values(), key=lambda c: c.key)
    assert [c.image.dtype for c in got] == [np.float32, np.float32] and [c.shape for c in got] == [(16,), (16,)]
    assert all(np.array_equal(np.asarray(c.image).view(np.uint32), m.view(np.uint32)) for c, m in zip(got, mean[[0, 5]]))
    assert got[0].image_sha256 == average_sha256(mean[0]) != average_sha256(mean[0].astype(np.float64))
    doc = rel.to_entry()["new_clusters"][0]
    assert doc["dtype"] == "<f4" and doc["shape"] == [16]
    with pytest.raises(LineageError, match="does not have its shape"):  # the same bytes read as float64
        type(got[0]).from_json({**doc, "dtype": "<f8"})
    flipped = bytearray(base64.b64decode(doc["image"]))
    flipped[5] ^= 1
    with pytest.raises(LineageError, match="does not match its hash"):
        type(got[0]).from_json({**doc, "image": base64.b64encode(bytes(flipped)).decode()})
    with pytest.raises(ConfigError, match="float32/float64"):
        build_release(plan, state, release_id="rel-2", method="k-same", new_labels=labels,
                      new_images=mean.astype(np.int32), shape=(16,))


def _label_mix_by_vector(res) -> dict[bytes, list[tuple[str, ...]]]:
    """Released vector bytes -> the sorted label tuples of its rows (a k-Same cluster is its vector)."""
    table, vectors = read_vector_release(res.release_dir)
    cols = [table.column(x).to_pylist() for x in ("gender", "expression")]
    out: dict[bytes, list[tuple[str, ...]]] = {}
    for i in range(table.num_rows):
        out.setdefault(np.ascontiguousarray(vectors[i], dtype="<f4").tobytes(), []).append(tuple(c[i] for c in cols))
    return {v: sorted(t) for v, t in out.items()}


def test_plain_k_same_feature_clusters_keep_their_registered_label_mix_when_people_leave(tmp_path):
    # Plain k-Same mixes labels inside a cluster: the absent members' counterfeits must carry their
    # registered labels, or the cluster's released label mix would show who left.
    first = run_release(_drop(tmp_path, "d1", set(range(0, 30))), _config(tmp_path, method="k-same"))
    second = run_release(_drop(tmp_path, "d2", set(range(0, 30)) - {1, 4, 9, 16, 25}),
                         _config(tmp_path, method="k-same"))
    assert first.verdict == "released" and second.verdict == "released", (first.reasons, second.reasons)
    before, after = _label_mix_by_vector(first), _label_mix_by_vector(second)
    mixed = [v for v in before if len(set(before[v])) > 1]
    assert mixed, "the test needs clusters whose members have different labels"
    assert set(after) == set(before)  # every cluster republished, none re-clustered
    assert all(after[v] == before[v] for v in before)
    check = next(c for c in second.report.checks if c.name == "lineage_label_mix")
    assert check.passed
