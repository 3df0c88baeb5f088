"""Tests of the comparison study (deid.study, ``deid study``) and the leak checks (deid.leaks)."""
from __future__ import annotations

import csv
import struct
import zlib

import cv2
import numpy as np
import pytest

from deid.errors import ConfigError
from deid.leaks import near_copy_check, nearest_original_distance, png_has_metadata, release_files_metadata
from helpers import load_london_aligned


# --------------------------------------------------------------------------- leak checks


def _chunk(ctype: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + ctype + payload + struct.pack(">I", zlib.crc32(ctype + payload))


def _png(img: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", img)
    assert ok
    return buf.tobytes()


def test_png_metadata_chunks_are_found():
    clean = _png(np.arange(64, dtype=np.uint8).reshape(8, 8))
    assert png_has_metadata(clean) == []
    iend = clean.rindex(b"IEND") - 4
    tagged = clean[:iend] + _chunk(b"tEXt", b"Source\x00/home/lab/001_03.jpg") + _chunk(b"tIME", b"\x07\xe1\x01\x01\x00\x00\x00") + clean[iend:]
    assert png_has_metadata(tagged) == ["tEXt", "tIME"]
    assert png_has_metadata(clean + b"EXIF-tail") == ["data after IEND"]
    odd = clean[:iend] + _chunk(b"prVt", b"secret") + clean[iend:]
    assert png_has_metadata(odd) == ["unknown ancillary chunk prVt"]
    with pytest.raises(ConfigError, match="not a PNG"):
        png_has_metadata(b"\xff\xd8\xff\xe0 jpeg")


def test_release_files_metadata_lists_only_dirty_files(tmp_path):
    (tmp_path / "images").mkdir()
    clean = _png(np.zeros((4, 4), np.uint8))
    (tmp_path / "images" / "a.png").write_bytes(clean)
    iend = clean.rindex(b"IEND") - 4
    (tmp_path / "images" / "b.png").write_bytes(clean[:iend] + _chunk(b"eXIf", b"MM\x00*") + clean[iend:])
    assert release_files_metadata(tmp_path) == {"images/b.png": ["eXIf"]}


def test_nearest_original_distance_finds_copies_and_near_copies():
    rng = np.random.default_rng(0)
    originals = rng.integers(0, 256, size=(6, 50), dtype=np.uint8)
    released = np.stack([originals[3], np.clip(originals[1].astype(int) + 1, 0, 255), 255 - originals[0]]).astype(np.uint8)
    d, t = nearest_original_distance(released, originals, threshold=2.0)
    assert t == 2.0
    assert d[0] == 0.0
    assert 0 < d[1] <= 1.0
    assert d[2] > 20
    summary = near_copy_check(released, originals)
    assert summary == {"passed": False, "identical": 1, "below_threshold": 2, "min_distance": 0.0, "threshold": 2.0}
    assert near_copy_check(released[2:], originals)["passed"]
    with pytest.raises(ConfigError, match="threshold="):
        nearest_original_distance(released, originals, threshold=-1)


# --------------------------------------------------------------------------- the study


def test_study_cli_on_a_small_synthetic_drop(tmp_path, capsys):
    from deid.synth import make_synthetic_drop
    from flows.cli import main

    drop = make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=0)
    out = tmp_path / "study"
    argv = ["study", str(drop), "--k", "2", "--sigma", "2", "--block", "4", "--out", str(out), "--repeats", "1",
            "--methods", "k-same-select,blur", "--attackers", "pca-whitened-cosine,lbp-chi2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "k-same-select | k=2" in printed and "blur | sigma=2" in printed
    with open(out / "study.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    privacy = [r for r in rows if r["kind"] == "privacy"]
    assert {(r["method"], r["attacker"], r["mode"]) for r in privacy} == {
        (m, a, mode) for m in ("k-same-select", "blur") for a in ("pca-whitened-cosine", "lbp-chi2")
        for mode in ("naive", "reverse", "parrot")}
    for r in privacy:
        if r["method"] == "k-same-select":
            assert float(r["rate"]) <= 0.5 + 1e-9 and float(r["bound"]) == 0.5
        elif r["mode"] == "parrot":
            assert float(r["rate"]) >= 0.9
    utility = [r for r in rows if r["kind"] == "utility"]
    assert {(r["label"], r["protocol"]) for r in utility} == {
        (lab, p) for lab in ("gender", "expression") for p in ("cv", "train-original-test-release",
                                                               "train-release-test-heldout")}
    leaks = [r for r in rows if r["kind"] == "leak"]
    assert len(leaks) == 2 and all(float(r["min_distance"]) > 0 for r in leaks)
    for name in ("reidentification.png", "utility.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    assert (out / "aligned.npz").is_file() and not (out / "ingested.parquet").exists()

    # Bad input: exit code 2 with a message naming the parameter.
    assert main(["study", str(drop), "--k", "2", "--methods", "median", "--out", str(out)]) == 2
    assert "methods=" in capsys.readouterr().err


def test_load_aligned_uses_its_cache(tmp_path, monkeypatch):
    import deid.study as study
    from deid.synth import make_synthetic_drop

    drop = make_synthetic_drop(tmp_path / "drop", people=3, images_per_person=2, seed=1)
    pixels, people, labels, shape = study.load_aligned(drop, tmp_path / "w")
    assert pixels.shape == (6, shape[0] * shape[1]) and pixels.dtype == np.uint8
    assert len(set(people)) == 3 and all(isinstance(p, str) for p in people)
    assert set(labels) == {"gender", "expression"}

    def boom(*a, **k):
        raise AssertionError("should have been served from the cache")

    monkeypatch.setattr("deid.stages.align_batch", boom)
    again = study.load_aligned(drop, tmp_path / "w")
    np.testing.assert_array_equal(again[0], pixels)
    assert list(again[1]) == list(people) and again[3] == shape


def _london_aligned():
    """Aligned London faces, read in place (pupils from .tem for neutral, Haar for smiling)."""
    faces, people, gender, expr = load_london_aligned()
    return (faces, np.array(people, dtype=object),
            {"gender": np.array(gender, dtype=object), "expression": np.array(expr, dtype=object)}, (92, 81))


@pytest.mark.london
@pytest.mark.slow
def test_london_study_supports_the_issue_claims():
    from deid.study import StudyConfig, run_study, summary

    pixels, people, labels, shape = _london_aligned()
    assert len(pixels) >= 190
    k = 5
    rows = run_study(pixels, people, labels, shape, StudyConfig(ks=(k,), sigmas=(4.0,), blocks=(8,), utility_repeats=3))
    priv = [r for r in rows if r["kind"] == "privacy"]
    by = {s["method"]: s for s in summary(rows)}
    # Every k-Same-Select point at or below 1/k, for every attacker and mode.
    assert all(r["rate"] <= 1 / k + 1e-9 for r in priv if r["method"] == "k-same-select")
    assert all(r["rate"] <= 1 / k + 1e-9 for r in priv if r["method"] == "k-same")
    # Parrot keeps blur and pixelation far above 1/k.
    for method in ("blur", "pixelate"):
        parrot = [r["rate"] for r in priv if r["method"] == method and r["mode"] == "parrot"]
        assert max(parrot) >= 0.8 and min(parrot) >= 3 / k, (method, parrot)
    # Newton's image-counting k-Same breaks the bound.
    assert by["k-same-naive"]["max_rate"] > 1 / k + 0.05
    # k-Same-Select keeps gender at least as well as k-Same (protocol 1).
    assert by["k-same-select"]["utility"][("gender", "cv")] >= by["k-same"]["utility"][("gender", "cv")]
    # No release is a near copy of an original at k=5.
    leaks = {r["method"]: r["min_distance"] for r in rows if r["kind"] == "leak"}
    assert leaks["k-same-select"] > 2.0 and leaks["k-same"] > 2.0
