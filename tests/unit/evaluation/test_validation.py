"""Great Expectations suites (stored as JSON) over the manifest, staged tables and release table."""
from __future__ import annotations

import hashlib
import json
from importlib import resources

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deid.intake.drop import read_drop
from deid.errors import ConfigError
from deid.evaluation.validation import (
    SUITES,
    SuiteResult,
    expand_suite,
    load_suite,
    observed_label_sets,
    run_suite,
    suite_check,
    validate_aligned,
    validate_ingested,
    validate_manifest,
    validate_release,
)
from deid.schemas import arrow as schemas


def _failed(summary: SuiteResult) -> dict[tuple[str, str | None], int | None]:
    return {(e.type, e.column): e.unexpected_count for e in summary.expectations if not e.success}


def test_stored_suites_round_trip_through_great_expectations():
    import great_expectations as gx

    for name in SUITES:
        text = resources.files("deid.schemas").joinpath("expectations", f"{name}.json").read_text()
        d = json.loads(text)
        assert d["name"] == name and d["expectations"]
        again = gx.ExpectationSuite(**d).to_json_dict()
        assert [e["type"] for e in again["expectations"]] == [e["type"] for e in d["expectations"]]
        assert [e["kwargs"] for e in again["expectations"]] == [e["kwargs"] for e in d["expectations"]]
    expanded = expand_suite("release", labels=["gender", "expression"], label_sets={})
    cols = [e["kwargs"].get("column") for e in expanded["expectations"]]
    assert cols.count("gender") == 2 and cols.count("expression") == 2
    assert len(expand_suite("release", labels=["gender"])["expectations"]) == len(load_suite("release")["expectations"]) + 1


def test_manifest_suite_reports_nulls_and_duplicates(tmp_path):
    root = tmp_path / "drop"
    root.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (root / name).write_bytes(b"x")
    (root / "manifest.csv").write_bytes(
        "\ufeffimage,subject_id,gender\r\na.png,s1,f\r\nb.png,,m\r\nc.png,s3,\r\na.png,s4,f\r\n".encode())
    drop = read_drop(root, labels=["gender"])
    summary = validate_manifest(drop)
    assert summary.suite == "manifest" and summary.success is False
    assert _failed(summary) == {
        ("expect_column_values_to_not_be_null", "subject_id"): 1,
        ("expect_column_values_to_not_be_null", "gender"): 1,
        ("expect_column_values_to_be_unique", "image"): 2,
    }
    assert SuiteResult.from_dict(json.loads(json.dumps(summary.to_dict()))) == summary  # report.json round trip
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "a.png").write_bytes(b"x")
    (clean / "manifest.csv").write_text("image,subject_id,gender\na.png,s1,f\n")
    assert validate_manifest(read_drop(clean, labels=["gender"])).success
    header_only = tmp_path / "empty"
    header_only.mkdir()
    (header_only / "manifest.csv").write_text("image,subject_id,gender\n")
    empty = validate_manifest(read_drop(header_only, labels=["gender"]))
    assert ("expect_table_row_count_to_be_between", None) in _failed(empty)


def _ingested(tmp_path, rows, labels=("gender",)):
    cols = {c: [] for c in schemas.ingested(list(labels)).names}
    for rid, subject, gender, data in rows:
        cols["record_id"].append(rid)
        cols["image"].append(f"{rid}.png")
        cols["subject_id"].append(subject)
        cols["gender"].append(gender)
        for c in ("eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y"):
            cols[c].append(None)
        cols["source_sha256"].append(hashlib.sha256(data).hexdigest())
        cols["size"].append(len(data))
        cols["data"].append(data)
    path = tmp_path / "ingested.parquet"
    pq.write_table(pa.table(cols, schema=schemas.ingested(list(labels))), path)
    return path


def test_ingested_suite_types_uniqueness_and_label_sets(tmp_path):
    path = _ingested(tmp_path, [("r1", "s1", "f", b"aa"), ("r2", "s2", "m", b"bb"), ("r3", "s2", "x", b"cc")])
    ok = validate_ingested(path, ["gender"])
    assert ok.success, _failed(ok)
    assert ok.evaluated == len(load_suite("ingested")["expectations"]) + 1
    sets = observed_label_sets(path, ["gender"])
    assert sets == {"gender": ["f", "m", "x"]}
    restricted = validate_ingested(path, ["gender"], label_sets={"gender": ["f", "m"]})
    assert _failed(restricted) == {("expect_column_values_to_be_in_set", "gender"): 1}
    # A table written by mistake with a duplicate record id and a zero size fails.
    bad = pq.read_table(path).to_pandas()
    bad.loc[2, "record_id"] = "r1"
    bad.loc[1, "size"] = 0
    bad.loc[0, "source_sha256"] = "not-a-hash"
    summary = run_suite("ingested", bad, labels=["gender"])
    assert _failed(summary) == {
        ("expect_column_values_to_be_unique", "record_id"): 2,
        ("expect_column_values_to_be_between", "size"): 1,
        ("expect_column_values_to_match_regex", "source_sha256"): 1,
    }


def test_aligned_suite_checks_pixel_length(tmp_path):
    ok = pa.table({"record_id": ["a", "b"], "pixels": [bytes(81 * 92), bytes(81 * 92)],
                   "eye_source": ["manifest", "detected"], "eye_left_x": [1.0, 2.0], "eye_left_y": [1.0, 2.0],
                   "eye_right_x": [3.0, 4.0], "eye_right_y": [1.0, 2.0]}, schema=schemas.aligned())
    pq.write_table(ok, tmp_path / "part-0.parquet")
    bad = ok.set_column(1, "pixels", pa.array([bytes(81 * 92), bytes(100)], pa.binary()))
    bad = bad.set_column(2, "eye_source", pa.array(["manifest", "guessed"]))
    pq.write_table(bad, tmp_path / "part-1.parquet")
    assert validate_aligned([tmp_path / "part-0.parquet"], pixel_bytes=81 * 92).success
    summary = validate_aligned([tmp_path / "part-0.parquet", tmp_path / "part-1.parquet"], pixel_bytes=81 * 92)
    assert _failed(summary) == {
        ("expect_column_values_to_be_unique", "record_id"): 4,
        ("expect_column_values_to_be_between", "_pixels_length"): 1,
        ("expect_column_values_to_be_in_set", "eye_source"): 1,
    }


def _release(n_clusters=3, k=3, seed=0):
    rng = np.random.default_rng(seed)
    n = n_clusters * k
    return pd.DataFrame({
        "record_id": [f"{i:04x}" for i in range(n)],
        "image": [f"images/{i}.png" for i in range(n)],
        "cluster_id": [f"c{i // k}" for i in range(n)],
        "gender": rng.choice(["f", "m"], n),
    })


def test_release_suite_k_forbidden_columns_and_labels(tmp_path):
    sets = {"gender": ["f", "m"]}
    good = _release()
    pq.write_table(pa.Table.from_pandas(good, preserve_index=False), tmp_path / "release.parquet")
    summary = validate_release(tmp_path / "release.parquet", ["gender"], label_sets=sets, k=3)
    assert summary.success, _failed(summary)
    check = suite_check(summary)
    assert check.passed and check.name == "expectations_release"

    small = good.iloc[:-1]  # the last cluster now has k - 1 records
    assert _failed(validate_release(small, ["gender"], label_sets=sets, k=3)) == {
        ("expect_column_values_to_be_between", "_cluster_size"): 2}
    # A method without clusters (blur, the selective mean) releases one record per cluster id: floor 1.
    singletons = good.assign(cluster_id=[f"c{i}" for i in range(len(good))])
    assert validate_release(singletons, ["gender"], label_sets=sets, k=3, clustered=False).success
    assert not validate_release(singletons, ["gender"], label_sets=sets, k=3).success

    leaky = good.assign(subject_id="p1", gender=["x"] + list(good["gender"][1:]))
    failed = _failed(validate_release(leaky, ["gender"], label_sets=sets, k=3))
    assert set(failed) == {("expect_table_columns_to_match_set", None), ("expect_column_values_to_be_in_set", "gender")}
    bad_check = suite_check(validate_release(leaky, ["gender"], label_sets=sets, k=3))
    assert not bad_check.passed and "subject_id" in bad_check.detail


def test_a_validation_leaves_no_table_in_the_context():
    """issue 32: the pandas engine's batch caches are emptied after each suite (a run's process held the last
    validated table, a million rows, until the next validation); the next suite still validates its own table."""
    from deid.evaluation import validation

    sets = {"gender": ["f", "m"]}
    assert validate_release(_release(), ["gender"], label_sets=sets, k=3).success
    batches = validation._gx_state["source"].get_execution_engine().batch_manager
    assert not batches.batch_data_cache and not batches.batch_cache and batches.active_batch_data is None
    assert _failed(validate_release(_release().iloc[:-1], ["gender"], label_sets=sets, k=3)) == {
        ("expect_column_values_to_be_between", "_cluster_size"): 2}


def test_run_suite_parameter_errors():
    with pytest.raises(ConfigError, match="suite='nope'"):
        run_suite("nope", pd.DataFrame())
    with pytest.raises(ConfigError, match="k"):
        run_suite("release", _release(), labels=["gender"], label_sets={"gender": ["f", "m"]})
    with pytest.raises(ConfigError, match="label_sets has no value set"):
        run_suite("release", _release(), labels=["gender"], label_sets={}, k=3)
