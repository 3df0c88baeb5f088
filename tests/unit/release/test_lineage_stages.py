"""The flow's lineage glue (deid.operations.worker_lineage, deid.intake.drop, deid.release.linkage) on tiny in-memory tables (issue 10)."""
from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deid.operations import worker_lineage
from deid.intake.drop import read_drop
from deid.errors import DropError, StateError
from deid.evaluation.gate_structure import registered_rows
from deid.release.lineage import build_release
from deid.release.lineage_state import empty_state
from deid.release.linkage import COUNTERFEIT_PREFIX, build_linkage

KEY = bytes(range(32))
K = 3
SHAPE = (2, 3)


def _faces(people: list[str], *, offset: int = 0) -> pa.Table:
    ids = [f"r{offset + i:08d}" for i in range(len(people))]
    rng = np.random.default_rng(offset)
    pixels = [rng.integers(0, 256, 6, dtype=np.uint8).tobytes() for _ in ids]
    return pa.table({"record_id": ids, "subject_id": people, "pixels": pixels,
                     "gender": ["f" if p < "p3" else "m" for p in people]})


def _sources(faces: pa.Table) -> dict[str, str]:
    # The fingerprint is the source bytes' hash: same person and photo -> same fingerprint in every drop.
    return {r: hashlib.sha256(f"{p}|{px}".encode()).hexdigest()
            for r, p, px in zip(*faces.select(["record_id", "subject_id", "pixels"]).to_pydict().values())}


def _first_release(tmp_path):
    people = [f"p{i}" for i in range(6)]
    faces = _faces(people)
    state = empty_state("ds")
    plan = worker_lineage.plan_lineage(faces, _sources(faces), state, key=KEY, k=K, policy="invariant", absent="republish",
                               labels=["gender"], select=False)
    assert list(plan.new_records) == list(range(6)) and not plan.republish
    ids = faces.column("record_id").to_pylist()
    # Two clusters of 3 people, as k-Same would make them; written like a de-identified part.
    part = tmp_path / "deid.parquet"
    img = [np.full(6, 10, np.uint8).tobytes()] * 3 + [np.full(6, 200, np.uint8).tobytes()] * 3
    pq.write_table(pa.table({"record_id": ids, "cluster": ["a"] * 3 + ["b"] * 3, "pixels": img}), part)
    labels, images = worker_lineage.lineage_new_labels(plan, ids, [str(part)])
    assert labels.tolist() == [0, 0, 0, 1, 1, 1] and images[0, 0] == 10 and images[5, 0] == 200
    rel = build_release(plan, state, release_id="rel-1", method="k-same", new_labels=labels, new_images=images,
                        shape=SHAPE)
    return faces, state.with_entry(rel.to_entry())


def test_returning_records_carry_the_registered_average_and_new_people_are_planned_alone(tmp_path):
    faces1, state = _first_release(tmp_path)
    # Drop 2: the same six photos (same fingerprints) and four new people.
    faces2 = pa.concat_tables([faces1, _faces([f"p{i}" for i in range(6, 10)], offset=100)])
    plan = worker_lineage.plan_lineage(faces2, _sources(faces2), state, key=KEY, k=K, policy="invariant",
                               absent="republish", labels=["gender"], select=False)
    assert sorted(i for r in plan.republish for i in r.records) == list(range(6))
    assert list(plan.new_records) == [6, 7, 8, 9] and plan.n_counterfeit == 0
    ids = faces2.column("record_id").to_pylist()
    rel = build_release(plan, state, release_id="rel-2", method="k-same", new_labels=[0, 0, 0, 0],
                        new_images=np.full((4, 6), 90, np.uint8), shape=SHAPE)
    # The partition stage wrote the returning records as partition=lineage; their part carries stored averages.
    pdir = tmp_path / "partitions" / "partition=lineage"
    pdir.mkdir(parents=True)
    pq.write_table(faces2.take(pa.array([5, 0, 3], pa.int64())), pdir / "part-0.parquet")
    out = worker_lineage.write_lineage_part(str(pdir), str(tmp_path / "out.parquet"), rel, state, ids)
    got = pq.read_table(out.path).to_pydict()
    assert got["record_id"] == ["r00000005", "r00000000", "r00000003"]
    for rid, px in zip(got["record_id"], got["pixels"]):
        key = rel.record_cluster[ids.index(rid)]
        assert px == state.clusters[key].image.tobytes()  # bit-identical to the registered average
    assert sorted(c.size for c in out.clusters) == [1, 2]
    # The gate's k checks count the registered members of a republished cluster, not its released rows.
    rep = worker_lineage.republished_for_gate(rel, state)
    members = rep.members
    assert sorted(map(len, members.values())) == [3, 3] and not any(rep.counterfeits.values())
    a, b = sorted(members)
    c, p = registered_rows([a, "new", "new", "new"], ["x", "n1", "n2", "n3"], members)
    assert sorted(zip(c, p)) == sorted([("new", "n1"), ("new", "n2"), ("new", "n3"),
                                        *[(key, q) for key, ps in members.items() for q in ps]])


def test_absent_members_get_counterfeits_with_their_partition_labels(tmp_path):
    faces1, state = _first_release(tmp_path)
    faces2 = faces1.take(pa.array([0, 3], pa.int64()))  # one member of each cluster returns
    plan = worker_lineage.plan_lineage(faces2, _sources(faces2), state, key=KEY, k=K, policy="invariant",
                               absent="republish", labels=["gender"], select=False)
    assert plan.n_counterfeit == 4
    rel = build_release(plan, state, release_id="rel-2", method="k-same", new_labels=[], new_images=np.zeros(
        (0, 6), np.uint8), shape=SHAPE)
    rows = worker_lineage.counterfeit_rows(rel, state, ["gender"], {}, {"gender": "f"})
    assert len(rows) == 4 and all(r.record_id.startswith(COUNTERFEIT_PREFIX) for r in rows)
    assert {r.average.tobytes() for r in rows} == {c.image.tobytes() for c in state.clusters.values()}
    # The absent members' registered labels (p1, p2 "f" in the first cluster; p4, p5 "m"), not the fallback.
    first = min(state.clusters)
    assert sorted((r.cluster == first, r.labels["gender"]) for r in rows) == [
        (False, "m"), (False, "m"), (True, "f"), (True, "f")]
    # The linkage record accepts counterfeits (marked there only) and still refuses unknown records.
    mapping = [{"record_id": r.record_id, "released_record_id": f"x{n}", "image": f"images/x{n}.png",
                "cluster": r.cluster, "cluster_id": "c-1"} for n, r in enumerate(rows)]
    linked = build_linkage(mapping, {})
    assert all(r["counterfeit"] and r["subject_id"] is None for r in linked)
    with pytest.raises(StateError, match="no source row"):
        build_linkage([{**mapping[0], "record_id": "r00000099"}], {})


def test_a_pending_release_with_a_later_release_is_never_abandoned(tmp_path):
    _, state = _first_release(tmp_path)
    assert worker_lineage.lineage_can_abandon(state, "rel-1")
    later = state.with_entry({"kind": "release", "release_id": "rel-2", "k": K, "method": "k-same",
                              "policy": "invariant", "absent": "republish", "based_on_seq": state.seq,
                              "based_on_head": state.head, "new_clusters": [], "republished": [],
                              "suppressed_clusters": [], "counts": dict.fromkeys(
                                  ("new_clusters", "republished_clusters", "suppressed_clusters", "records_released",
                                   "counterfeit_records", "new_people", "returning_people", "waiting_people",
                                   "suppressed_records"), 0)})
    assert not worker_lineage.lineage_can_abandon(later, "rel-1") and worker_lineage.lineage_can_abandon(later, "rel-2")


@pytest.mark.parametrize("yaml_text, name, expected", [
    ("name: My clinic 2024!\n", None, "My-clinic-2024"),
    ("name: x\ndataset: clinic.faces_v1\n", None, "clinic.faces_v1"),
    ("name: x\n", "override name", "override-name"),
])
def test_drop_dataset_defaults_to_a_safe_form_of_its_name(tmp_path, yaml_text, name, expected):
    (tmp_path / "manifest.csv").write_text("image,subject_id\n")
    (tmp_path / "drop.yaml").write_text(yaml_text)
    assert read_drop(tmp_path, name=name).dataset == expected


def test_drop_with_an_unusable_dataset_name_is_unreadable(tmp_path):
    (tmp_path / "manifest.csv").write_text("image,subject_id\n")
    (tmp_path / "drop.yaml").write_text("dataset: ../other\n")
    with pytest.raises(DropError, match="dataset="):
        read_drop(tmp_path)
