"""Feature drops in: the synthetic generator, the reader's quarantine reasons and its one-line drop errors."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from deid.errors import REASONS, DropError
from deid.intake.features import drop_kind, read_feature_drop, write_feature_drop
from deid.intake.synth_features import make_feature_drop, parse_labels, synthetic_features


def _table(path, **cols):
    pq.write_table(pa.table(cols), path)


def _drop(tmp_path, table: pa.Table | None = None, **meta):
    d = tmp_path / "drop"
    d.mkdir()
    if table is not None:
        pq.write_table(table, d / "vectors.parquet")
    (d / "drop.yaml").write_text(yaml.safe_dump({"kind": "features", "features": "vectors.parquet", **meta}))
    return d


def test_synth_cli_writes_a_feature_drop_the_reader_accepts(tmp_path, capsys):
    from deid.cli import main

    rc = main(["synth", str(tmp_path / "f"), "--kind", "features", "--people", "12", "--per-person", "3",
               "--dim", "8", "--labels", "gender,expression=3", "--seed", "4"])
    assert rc == 0 and "12 people x 3 records, dim 8" in capsys.readouterr().out
    d = read_feature_drop(tmp_path / "f")
    assert drop_kind(tmp_path / "f") == "features" and (tmp_path / "f" / "_READY").exists()
    assert (d.dim, d.records_in, d.people, d.quarantined) == (8, 36, 12, ())
    assert d.vectors.shape == (36, 8) and d.vectors.dtype == np.float32
    assert d.labels == ("gender", "expression")
    # The known structure: gender is constant within a person, expression takes all 3 values.
    by_person: dict[str, set] = {}
    for p, g in zip(d.subject_ids, d.label_values["gender"]):
        by_person.setdefault(p, set()).add(g)
    assert all(len(v) == 1 for v in by_person.values())
    assert set(d.label_values["expression"]) == {"e0", "e1", "e2"}
    assert pq.read_schema(tmp_path / "f" / "vectors.parquet").field("features").type == pa.list_(pa.float32(), 8)


def test_synthetic_features_are_seeded_and_structured():
    a = synthetic_features(people=30, per_person=2, dim=16, seed=7)
    b = synthetic_features(people=30, per_person=2, dim=16, seed=7)
    c = synthetic_features(people=30, per_person=2, dim=16, seed=8)
    assert np.array_equal(a.vectors, b.vectors) and not np.array_equal(a.vectors, c.vectors)
    # Person p is the same in a bigger drop of the same seed.
    big = synthetic_features(people=40, per_person=2, dim=16, seed=7)
    assert np.array_equal(big.vectors[:60], a.vectors)
    # Identity: a record's nearest other record is its own person's (identity 2 > labels 1, noise 0.5).
    v = a.vectors.astype(np.float64)
    d = ((v[:, None] - v[None]) ** 2).sum(-1)
    np.fill_diagonal(d, np.inf)
    people = np.array(a.people)
    assert np.mean(people[d.argmin(1)] == people) > 0.9
    assert parse_labels("gender,expression=3") == {"gender": 2, "expression": 3}
    with pytest.raises(Exception, match="NAME=V"):
        parse_labels("gender=x")


def test_bad_rows_are_quarantined_with_reasons(tmp_path):
    dim = 4
    good = [0.1, 0.2, 0.3, 0.4]
    vectors = [good, good[:3], [0.1, float("nan"), 0.3, 0.4], [0.1, float("inf"), 0.3, 0.4], None,
               [0.1, None, 0.3, 0.4], good, good, good, good]
    table = pa.table({
        "record_id": ["a", "b", "c", "d", "e", "f", "g", "a", None, "j"],
        "subject_id": ["p1", "p2", "p3", "p4", "p5", "p6", "", "p8", "p9", "p10"],
        "gender": ["f", "m", "f", "m", "f", "m", "f", "m", "f", None],
        "features": pa.array(vectors, pa.list_(pa.float64())),
    })
    d = read_feature_drop(_drop(tmp_path, table, labels=["gender"]))
    codes = {q.image: q.code for q in d.quarantined}
    assert codes == {"b": "wrong_length", "c": "non_finite_features", "d": "non_finite_features",
                     "e": "missing_features", "f": "missing_features", "g": "missing_subject_id",
                     "a": "duplicate_record_id", "row 9": "missing_record_id", "j": "missing_label"}
    assert all(q.code in REASONS and q.message and q.stage == "features" for q in d.quarantined)
    wrong = next(q for q in d.quarantined if q.code == "wrong_length")
    assert "holds 3 values" in wrong.message and f"dim={dim}" in wrong.message
    nan = next(q for q in d.quarantined if q.image == "c")
    assert "nan" in nan.message and "position 1" in nan.message
    assert d.records_in == 10 and d.record_ids == ("r00000001",) and d.source_ids == ("a",)
    assert d.dim == dim and np.allclose(d.vectors, [good])


def test_declared_dim_and_most_common_length(tmp_path):
    table = pa.table({"subject_id": ["a", "b", "c"],
                      "features": pa.array([[1.0, 2.0], [1.0, 2.0, 3.0], [4.0, 5.0]], pa.list_(pa.float32()))})
    d = read_feature_drop(_drop(tmp_path, table))
    assert d.dim == 2 and [q.code for q in d.quarantined] == ["wrong_length"]
    assert d.source_ids == ("row 1", "row 3")  # no record_id column: the steward's rows are named by number
    (tmp_path / "drop" / "drop.yaml").write_text(yaml.safe_dump({"kind": "features", "features": "vectors.parquet",
                                                                 "dim": 3}))
    d = read_feature_drop(tmp_path / "drop")
    assert d.dim == 3 and len(d.quarantined) == 2


@pytest.mark.parametrize("table, meta, match", [
    (pa.table({"features": pa.array([[1.0]], pa.list_(pa.float32()))}), {}, "required column 'subject_id' is missing"),
    (pa.table({"subject_id": ["a"], "features": ["1,2"]}), {}, "column 'features' has type string; it must be a list"),
    (pa.table({"subject_id": ["a"], "features": pa.array([["x"]], pa.list_(pa.string()))}), {},
     "is a list of string; feature vectors must hold numbers"),
    (pa.table({"subject_id": ["a"], "emb": pa.array([[1.0]], pa.list_(pa.float32()))}), {},
     "vector column 'features' is missing .* 'vector_column: <name>'"),
    (pa.table({"subject_id": ["a"], "features": pa.array([[1.0]], pa.list_(pa.float32(), 1))}), {"dim": 2},
     "dim=2 but the vector column is a fixed-size list of 1"),
    (pa.table({"subject_id": ["a"], "features": pa.array([[1.0]], pa.list_(pa.float32()))}), {"labels": ["gender"]},
     r"declared label column\(s\) \['gender'\] are missing"),
    (None, {}, "features='vectors.parquet': 'vectors.parquet' does not exist in the drop"),
    (pa.table({"subject_id": ["a"], "features": pa.array([None], pa.list_(pa.float32()))}), {},
     "holds no vector"),
])
def test_drop_errors_are_one_line_and_say_what_to_do(tmp_path, table, meta, match):
    d = _drop(tmp_path, table, **meta)
    with pytest.raises(DropError, match=match) as exc:
        read_feature_drop(d)
    assert "\n" not in str(exc.value)


def test_table_that_is_not_parquet_or_is_a_symlink_is_refused(tmp_path):
    d = _drop(tmp_path)
    (d / "vectors.parquet").write_bytes(b"subject_id,features\na,1\n")
    with pytest.raises(DropError, match="is not a readable Parquet file"):
        read_feature_drop(d)
    real = tmp_path / "elsewhere.parquet"
    _table(real, subject_id=["a"], features=pa.array([[1.0]], pa.list_(pa.float32())))
    (d / "vectors.parquet").unlink()
    os.symlink(real, d / "vectors.parquet")
    with pytest.raises(DropError, match="symlink"):
        read_feature_drop(d)


def test_drop_kind_and_config_errors(tmp_path):
    d = tmp_path / "images"
    d.mkdir()
    assert drop_kind(d) == "images"  # no drop.yaml: a face drop
    (d / "drop.yaml").write_text("kind: audio\n")
    with pytest.raises(DropError, match=r"kind='audio' must be one of \['images', 'features'\]"):
        drop_kind(d)
    (d / "drop.yaml").write_text("kind: features\n")
    with pytest.raises(DropError, match="needs 'features: <table>.parquet'"):
        read_feature_drop(d)
    # The image reader says where a feature drop belongs.
    (d / "manifest.csv").write_text("image,subject_id\n")
    from deid.intake.drop import read_drop

    with pytest.raises(DropError, match="not an image drop"):
        read_drop(d)


def test_write_feature_drop_round_trips(tmp_path):
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_feature_drop(tmp_path / "d", vectors=v, subject_ids=["a", "b", "c"], labels={"x": ["1", "2", "1"]},
                       license="cc-by-4.0")
    d = read_feature_drop(tmp_path / "d")
    assert np.array_equal(d.vectors, v) and d.license == "cc-by-4.0" and d.label_values["x"] == ("1", "2", "1")
    with pytest.raises(DropError, match="not empty"):
        write_feature_drop(tmp_path / "d", vectors=v, subject_ids=["a", "b", "c"])
    assert make_feature_drop(tmp_path / "e", people=3, per_person=1, dim=2, labels=[]).is_dir()
    assert read_feature_drop(tmp_path / "e").labels == ()
