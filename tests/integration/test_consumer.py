"""Releases load where consumers work: Hugging Face imagefolder + pandas, and a dataset card with a YAML header.

``datasets`` is the optional ``consumer`` extra (``pip install -e '.[consumer]'``; ``make test``
installs it): only the test that needs it is skipped when it is absent, with the reason.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from deid.release.card import CARD_NAME, DatasetCard, split_card, write_card
from deid.intake.drop import DropError, read_drop
from deid.errors import ConfigError, DataError
from deid.release.publish import METADATA_CSV, RELEASE_TABLE, stage_release
from deid.release.attestation import NO_DEID_CHECK
from deid.release.manifest import MANIFEST_NAME, list_release

SHAPE = (10, 8)


def _report(release_id: str, n: int, *, license: str | None = "cc-by-4.0") -> dict:
    """A released report as the flow builds it before signing (the card's only input)."""
    return {
        "release_id": release_id, "verdict": "released", "k": 3, "method": "k-same-select",
        "guarantee": "k-anonymity (k=3) against face recognition (k-Same-Select, Gross et al. 2005)",
        "created_at": "2026-11-22T12:00:00Z", "reasons": [],
        "warnings": ["utility gender inconclusive: 12 test images of 6 people can only test a margin of 0.3"],
        "dataset": {"name": "lab | faces <b>", "records_in": n + 2, "records_released": n},
        "privacy": {"bound": 1 / 3, "max_rate": 0.25, "min_distinct_people_per_cluster": 3,
                    "reidentification": [{"attacker": "pca-mahalanobis", "mode": "parrot", "rate": 0.25,
                                          "lower": 0.05, "upper": 0.57, "n_probes": 12}]},
        "utility": [{"label": "gender", "protocol": "cross-fit", "original_accuracy": 0.75,
                     "deidentified_accuracy": 0.7, "delta_lower": -0.2, "delta_upper": 0.3, "n_test_images": 12,
                     "status": "inconclusive", "tolerance": 0.05}],
        "configuration": {"labels": ["gender", "expression"], "license": license, "canonical_size": [8, 10],
                          "clusters": {"count": 4, "sizes": [3, 3, 3, 3]}, "utility_protocol": "cross-fit"},
    }


@pytest.fixture
def release(tmp_path):
    rng = np.random.default_rng(3)
    n = 12
    images = rng.integers(0, 256, size=(n, SHAPE[0] * SHAPE[1]), dtype=np.uint8)
    gender = list("fmfmfmfmfmff")
    expression = ["neutral", "smiling", "=1+1", "neutral"] * 3
    clusters = [f"part/c{i // 3}" for i in range(n)]
    staged = stage_release(tmp_path / "release", images=images, shape=SHAPE, clusters=clusters,
                           labels={"gender": gender, "expression": expression})
    write_card(staged.path, DatasetCard.from_report(_report("rel-0123456789abcdef", n)))
    list_release(staged.path, known=staged.images)  # MANIFEST.sha256, as in a published release
    return staged.path, images, gender, expression


def test_pandas_reads_the_release_and_the_imagefolder_metadata(release):
    root, images, gender, expression = release
    table = pd.read_parquet(root / RELEASE_TABLE)
    meta = pd.read_csv(root / METADATA_CSV, dtype=str, keep_default_na=False)
    assert len(table) == len(meta) == len(images)
    assert list(meta.columns) == ["file_name", "record_id", "cluster_id", "gender", "expression"]
    merged = table.merge(meta, left_on="image", right_on="file_name", suffixes=("", "_m"))
    assert len(merged) == len(images) and (merged.record_id == merged.record_id_m).all()
    assert sorted(table.gender) == sorted(gender) and sorted(table.expression) == sorted(expression)
    # The CSV neutralises the formula; the Parquet keeps the exact value.
    assert "'=1+1" in set(meta.expression) and "=1+1" in set(table.expression)
    assert meta.groupby("cluster_id").size().min() == 3
    assert all((root / f).is_file() for f in meta.file_name)


def test_datasets_load_dataset_imagefolder_reads_images_and_labels(release, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the optional 'consumer' extra (pip install -e '.[consumer]')")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    root, images, gender, _ = release
    ds = datasets.load_dataset("imagefolder", data_dir=str(root), split="train", cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == len(images)
    assert {"image", "record_id", "cluster_id", "gender", "expression"} <= set(ds.column_names)
    parquet = pq.read_table(root / RELEASE_TABLE).to_pandas().set_index("record_id")
    pixels = {bytes(img) for img in images}
    for row in ds:
        assert row["gender"] == parquet.loc[row["record_id"], "gender"]
        assert row["cluster_id"] == parquet.loc[row["record_id"], "cluster_id"]
        face = np.asarray(row["image"])
        assert face.shape == SHAPE and bytes(face.reshape(-1)) in pixels
    assert sorted(ds["gender"]) == sorted(gender)
    # A consumer may also point load_dataset at the directory itself.
    again = datasets.load_dataset(str(root), split="train", cache_dir=str(tmp_path / "hf2"))
    assert again.num_rows == len(images)


def test_card_has_a_yaml_header_and_renders_as_markdown(release):
    from markdown_it import MarkdownIt

    root = release[0]
    text = (root / CARD_NAME).read_text()
    header, body = split_card(text)
    assert yaml.safe_load(text.split("---\n")[1]) == header
    assert header["license"] == "cc-by-4.0" and header["size_categories"] == ["n<1K"]
    d = header["deid"]
    assert (d["k"], d["method"], d["records"], d["clusters"]) == (3, "k-same-select", 12, 4)
    assert (d["max_reidentification_rate"], d["worst_attack"]["upper"], d["worst_attack"]["probes"]) == (0.25, 0.57, 12)
    assert d["utility"][0]["decision"] == "inconclusive" and d["report"] == "reports/rel-0123456789abcdef/report.json"
    page = MarkdownIt("commonmark").enable("table").render(body)
    assert "<h1>" in page and page.count("<table>") == 2 and "<h2>Guarantee</h2>" in page
    # A recipient verifies the directory they have (its ATTESTATION.json), with deid or openssl + sha256sum.
    assert "deid verify . --public-key STEWARD.pub.pem" in page and "k-anonymity (k=3)" in page
    assert "```\n" + "\n".join(NO_DEID_CHECK) + "\n```" in body and "deid verify reports/" not in page
    # Steward text stays inert: no raw HTML, and its '|' does not break the table.
    assert "<b>" not in page and "&lt;b&gt;" in page
    assert "http://" not in text and "https://" not in text
    # Nothing that identifies people or sources.
    assert "subject_id" not in text and "record_id" in text


def test_card_without_a_licence_says_so_and_only_released_runs_get_one(tmp_path):
    card = DatasetCard.from_report(_report("rel-x", 12, license=None))
    header, body = split_card(card.render())
    assert header["license"] == "other" and "set no licence" in body
    rejected = {**_report("rel-y", 12), "verdict": "rejected"}
    with pytest.raises(ConfigError, match="only a released run"):
        DatasetCard.from_report(rejected)


def test_the_report_hashes_list_the_card(release):
    root = release[0]
    _, listing = list_release(root)
    assert {a.path for a in listing.artifacts} == {CARD_NAME, METADATA_CSV, RELEASE_TABLE, "release.csv", MANIFEST_NAME}


@pytest.mark.parametrize("yaml_text, expected", [
    ("name: x\nlicense: cc-by-nc-4.0\n", "cc-by-nc-4.0"),
    ("name: x\n", None),
])
def test_drop_yaml_license(tmp_path, yaml_text, expected):
    (tmp_path / "manifest.csv").write_text("image,subject_id\n")
    (tmp_path / "drop.yaml").write_text(yaml_text)
    assert read_drop(tmp_path).license == expected


@pytest.mark.parametrize("bad", ["[cc, by]", "'see https://x'", "'a b'"])
def test_drop_yaml_bad_license_names_the_field(tmp_path, bad):
    (tmp_path / "manifest.csv").write_text("image,subject_id\n")
    (tmp_path / "drop.yaml").write_text(f"license: {bad}\n")
    with pytest.raises(DropError, match="'license' must be a licence id"):
        read_drop(tmp_path)


def test_a_label_named_like_a_release_column_is_refused(tmp_path):
    with pytest.raises(DataError, match="clash with the release columns"):
        stage_release(tmp_path / "r", images=np.zeros((3, 80), np.uint8), shape=SHAPE, clusters=["a"] * 3,
                      labels={"file_name": ["x"] * 3})
