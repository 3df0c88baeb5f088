"""Report model, schema validation, fingerprints and the signed write (deid.reporting.report)."""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from deid.errors import ConfigError, StateError
from deid.reporting.report import (
    Artifact,
    Check,
    DatasetSummary,
    Privacy,
    Reidentification,
    Report,
    SigningInfo,
    Utility,
    dataset_fingerprint,
    hash_tree,
    load_schema,
    package_versions,
    validate_report,
    write_signed_report,
)
from deid.release.signing import canonical_json, ensure_signing_key, verify_bytes


@pytest.fixture(scope="module")
def signing_key(tmp_path_factory):
    return ensure_signing_key(configured=None, keys_dir=tmp_path_factory.mktemp("k") / "keys")


def make_report(signing_key, *, verdict="released", release_dir="/data/releases/r1", artifacts=None) -> Report:
    k = 3
    released = verdict == "released"
    return Report(
        release_id="r1",
        verdict=verdict,
        reasons=[] if released else ["re-identification rate 0.5 exceeds 1/k = 0.3333"],
        k=k,
        method="k-same-select",
        run_id="run-0001",
        dataset=DatasetSummary(
            name="toy",
            fingerprint=dataset_fingerprint(b"path,subject_id\n", ["0" * 64]),
            records_in=12,
            records_released=9,
            records_suppressed=1,
            records_quarantined=2,
            quarantine_by_reason={"no_face": 1, "corrupt_image": 1},
        ),
        checks=[Check("min_cluster_size", released, 3, 3, "every cluster has >= k faces")],
        privacy=Privacy(
            bound=1 / k,
            max_rate=0.25 if released else 0.5,
            min_distinct_people_per_cluster=3,
            reidentification=[Reidentification("pca-nearest", "deidentified-vs-original", 0.25 if released else 0.5)],
        ),
        utility=[Utility("gender", 0.9, np.float64(0.88), 0.05)],
        artifacts=(artifacts if artifacts is not None else [Artifact("faces.npy", "a" * 64, 10)]) if released else [],
        release_dir=release_dir if released else None,
        signing=SigningInfo.from_key(signing_key),
        versions=package_versions(["numpy"]),
        configuration={"k": k, "project_dir": Path("/tmp/p"), "eye_left": (0.3, 0.37)},
    )


def test_schema_is_valid_draft_2020_12():
    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_to_dict_is_plain_json_and_validates(signing_key):
    d = make_report(signing_key).to_dict()
    validate_report(d)
    assert d["configuration"] == {"k": 3, "project_dir": "/tmp/p", "eye_left": [0.3, 0.37]}
    assert type(d["utility"][0]["deidentified_accuracy"]) is float
    assert d["signing"] == {"algorithm": "ed25519", "public_key_fingerprint": signing_key.fingerprint, "key_origin": "development"}
    assert json.loads(json.dumps(d)) == d
    assert Report.from_dict(d).to_dict() == d


def test_rejected_report_validates(signing_key):
    d = make_report(signing_key, verdict="rejected").to_dict()
    validate_report(d)
    assert d["release_dir"] is None and d["artifacts"] == [] and d["reasons"]


def test_schema_rejects_missing_verdict(signing_key):
    d = make_report(signing_key).to_dict()
    del d["verdict"]
    with pytest.raises(StateError, match="'verdict' is a required property"):
        validate_report(d)


def test_schema_rejects_rate_above_one(signing_key):
    d = make_report(signing_key).to_dict()
    d["privacy"]["reidentification"][0]["rate"] = 1.5
    with pytest.raises(StateError, match=r"privacy\.reidentification\[0\]\.rate: 1\.5 is greater than the maximum of 1"):
        validate_report(d)


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d.__setitem__("k", 1), r"\$\.k: 1 is less than the minimum of 2"),
        (lambda d: d.__setitem__("verdict", "maybe"), r"\$\.verdict"),
        (lambda d: d["artifacts"][0].__setitem__("sha256", "XYZ"), r"sha256"),
        (lambda d: d["artifacts"][0].__setitem__("path", "../etc/passwd"), r"artifacts\[0\]\.path"),
        (lambda d: d["artifacts"][0].__setitem__("path", "/abs"), r"artifacts\[0\]\.path"),
        (lambda d: d["signing"].__setitem__("algorithm", "rsa"), r"algorithm"),
        (lambda d: d.__setitem__("created_at", "yesterday"), r"created_at"),
        (lambda d: d["utility"][0].__setitem__("original_accuracy", float("nan")), r"not a finite number"),
        (lambda d: d["privacy"].__setitem__("bound", 0.2), r"must equal 1/k"),
        (lambda d: d["dataset"].__setitem__("records_quarantined", 5), r"sums to 2"),
        (lambda d: d["dataset"]["quarantine_by_reason"].__setitem__("made_up", 1), r"unknown reason codes"),
        (lambda d: d["checks"][0].__setitem__("passed", False), r"checks failed"),
        (lambda d: d["privacy"].__setitem__("min_distinct_people_per_cluster", 2), r"at least k = 3 distinct people"),
        # Without the exact bound, every attack's upper bound (here: its rate) must be <= 1/k.
        (lambda d: d["privacy"]["reidentification"][0].__setitem__("rate", 0.4), r"at most 1/k"),
        # With identical images per cluster, the exact largest one-person share decides.
        (lambda d: d["privacy"].update(exact_bound=True, max_person_share=0.5), r"max_person_share = 0.5 exceeds"),
        (lambda d: d["privacy"].update(max_rate=None), r"no attack was measured"),
        (lambda d: d.__setitem__("reasons", ["x"]), r"\$\.reasons"),
        (lambda d: d.__setitem__("release_dir", None), r"\$\.release_dir"),
        (lambda d: d.__setitem__("extra", 1), r"Additional properties"),
    ],
)
def test_schema_and_consistency_rejections(signing_key, mutate, expected):
    d = make_report(signing_key).to_dict()
    mutate(d)
    with pytest.raises(StateError, match=expected):
        validate_report(d)


def test_dataset_fingerprint_layout_and_order_independence():
    manifest = b"path,subject_id\na.jpg,1\n"
    hashes = [hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()]
    fp = dataset_fingerprint(manifest, hashes)
    expected = hashlib.sha256(
        b"deid-dataset-v1\n" + len(manifest).to_bytes(8, "big") + manifest + "".join(h + "\n" for h in sorted(hashes)).encode()
    ).hexdigest()
    assert fp == "sha256:" + expected
    assert dataset_fingerprint(manifest, list(reversed(hashes))) == fp
    assert dataset_fingerprint(manifest, [h.upper() for h in hashes]) == fp
    assert dataset_fingerprint(manifest + b" ", hashes) != fp
    assert dataset_fingerprint(manifest, hashes[:1]) != fp
    with pytest.raises(ConfigError, match="64 hexadecimal"):
        dataset_fingerprint(manifest, ["abc"])


def test_hash_tree_lists_every_file_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.bin").write_bytes(b"zz")
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "b" / "a.bin").write_bytes(b"")
    (tmp_path / "empty_dir").mkdir()
    assert hash_tree(tmp_path) == [
        {"path": "a.txt", "sha256": hashlib.sha256(b"hello").hexdigest(), "bytes": 5},
        {"path": "b/a.bin", "sha256": hashlib.sha256(b"").hexdigest(), "bytes": 0},
        {"path": "b/z.bin", "sha256": hashlib.sha256(b"zz").hexdigest(), "bytes": 2},
    ]


def test_hash_tree_refuses_symlinks(tmp_path):
    (tmp_path / "real.txt").write_bytes(b"x")
    os.symlink(tmp_path / "real.txt", tmp_path / "link.txt")
    with pytest.raises(StateError, match="link.txt"):
        hash_tree(tmp_path)
    other = tmp_path.parent / (tmp_path.name + "_other")
    other.mkdir()
    (tmp_path / "link.txt").unlink()
    os.symlink(other, tmp_path / "linkdir")
    with pytest.raises(StateError, match="linkdir"):
        hash_tree(tmp_path)


def test_write_signed_report_writes_canonical_bytes_and_signature(tmp_path, signing_key):
    report = make_report(signing_key)
    path = write_signed_report(tmp_path / "reports" / "r1", report, signing_key)
    assert path == tmp_path / "reports" / "r1" / "report.json"
    payload = path.read_bytes()
    assert payload == canonical_json(report.to_dict())
    sig_text = (path.parent / "report.json.sig").read_bytes()
    assert sig_text.endswith(b"\n") and sig_text.count(b"\n") == 1
    sig = base64.b64decode(sig_text.strip(), validate=True)
    assert len(sig) == 64
    assert verify_bytes(payload, sig, signing_key.public_key)
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json", "report.json.sig"]  # no temp files left


def test_write_signed_report_refuses_invalid_report_and_writes_nothing(tmp_path, signing_key):
    d = make_report(signing_key).to_dict()
    d["privacy"]["max_rate"] = 1.5
    with pytest.raises(StateError, match="max_rate"):
        write_signed_report(tmp_path / "r", d, signing_key)
    assert not (tmp_path / "r" / "report.json").exists()


def test_write_signed_report_refuses_mismatched_signing_info(tmp_path, signing_key):
    d = make_report(signing_key).to_dict()
    d2 = copy.deepcopy(d)
    d2["signing"]["public_key_fingerprint"] = "sha256:" + "0" * 64
    with pytest.raises(ConfigError, match="does not describe the key"):
        write_signed_report(tmp_path / "r", d2, signing_key)


def test_report_accepts_what_the_gate_and_flow_produce(signing_key):
    """List-valued checks, utility details, missing packages (None) and a rate one ulp above 1/k."""
    d = make_report(signing_key).to_dict()
    d["checks"].append({"name": "no_forbidden_columns", "passed": True, "value": [], "threshold": "none", "detail": ""})
    d["utility"][0]["detail"] = "originals: 5 folds; release: 5 folds"
    d["versions"]["not-installed"] = None
    bound = d["privacy"]["bound"]
    d["privacy"]["max_rate"] = np.nextafter(bound, 1.0).item()
    d["privacy"]["reidentification"][0]["rate"] = d["privacy"]["max_rate"]
    validate_report(d)
    d["privacy"]["max_rate"] = d["privacy"]["reidentification"][0]["rate"] = bound + 1e-9
    with pytest.raises(StateError, match="at most 1/k"):
        validate_report(d)


def test_report_files_and_protocol_round_trip_and_rules(signing_key, tmp_path):
    from deid.reporting.report import hash_report_files

    (tmp_path / "validation").mkdir()
    (tmp_path / "report.html").write_text("<html></html>")
    (tmp_path / "validation" / "index.html").write_text("v")
    (tmp_path / "report.json").write_text("{}")  # never listed: it cannot hold its own hash
    (tmp_path / "report.json.sig").write_text("x")
    files = hash_report_files(tmp_path)
    assert [f["path"] for f in files] == ["report.html", "validation/index.html"]
    assert files[0]["sha256"] == hashlib.sha256(b"<html></html>").hexdigest() and files[0]["bytes"] == 13

    report = make_report(signing_key)
    assert "report_files" not in report.to_dict()  # optional: older reports stay valid
    assert all("protocol" not in u for u in report.to_dict()["utility"])
    report.report_files = [Artifact(**f) for f in files]
    report.utility[0].protocol = "train-original/test-release"
    d = report.to_dict()
    validate_report(d)
    assert Report.from_dict(d).to_dict() == d

    bad = copy.deepcopy(d)
    bad["report_files"].append(dict(bad["report_files"][0]))
    with pytest.raises(StateError, match="report_files lists paths more than once"):
        validate_report(bad)
    bad = copy.deepcopy(d)
    bad["report_files"].append({"path": "report.json", "sha256": "0" * 64, "bytes": 2})
    with pytest.raises(StateError, match="must not list"):
        validate_report(bad)
    bad = copy.deepcopy(d)
    bad["report_files"][0]["path"] = "../escape.html"
    with pytest.raises(StateError, match="report_files"):
        validate_report(bad)
