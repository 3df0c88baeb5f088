"""report.html: offline, complete, only released faces; the report bundle verifies and detects tampering."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from xml.etree import ElementTree

import cv2
import numpy as np
import pytest

from deid.reporting.html_report import (
    build_offline_data_docs,
    render_report_html,
    render_validation_html,
    sample_release_images,
    strip_urls,
    write_report_bundle,
)
from deid.release.publish import stage_release
from deid.reporting.report import Report, dataset_fingerprint
from deid.release.signing import ensure_signing_key, write_keypair
from deid.reporting.verify import verify_report

URL = re.compile(r"(?i)(https?|ftp)://")
SHAPE = (92, 81)
RESOURCE_ATTR = re.compile(r"""(?i)\b(?:src|href|srcset|data|action|poster)\s*=\s*["']?([^"'\s>]*)""")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    priv, pub = write_keypair(d, name="trusted")
    _, other_pub = write_keypair(d, name="other")
    return ensure_signing_key(configured=priv, keys_dir=d / "unused"), pub, other_pub


def _faces(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, SHAPE[0] * SHAPE[1]), dtype=np.uint8)


@pytest.fixture
def world(tmp_path):
    """A published release (3 clusters of 3 identical faces) and a staging dir of different 'original' faces."""
    project = tmp_path / "proj"
    centroids = _faces(1, 3)
    images = np.repeat(centroids, 3, axis=0)
    clusters = [f"p000/c{i}" for i in range(3) for _ in range(3)]
    release_dir = project / "data" / "releases" / "rel-test"
    stage_release(release_dir, images=images, shape=SHAPE, clusters=clusters, labels={"gender": list("fmfmfmfmf")})
    staging = project / "data" / "staging" / "rel-test" / "originals"
    staging.mkdir(parents=True)
    originals = _faces(2, 9)
    for i, im in enumerate(originals):
        cv2.imwrite(str(staging / f"{i}.png"), im.reshape(SHAPE))
    return project, release_dir, centroids, originals


def _report(release_dir: Path | None, *, verdict: str = "released", name: str = "toy <faces> & co") -> dict:
    from deid.reporting.report import hash_tree

    released = verdict == "released"
    return {
        "release_id": "rel-test",
        "run_id": "run-42",
        "verdict": verdict,
        "reasons": [] if released else ["re-identification 0.4 > 1/k = 0.333; see https://evil.example/x"],
        "k": 3,
        "method": "k-same-select",
        "created_at": "2026-01-01T00:00:00Z",
        "dataset": {"name": name, "fingerprint": dataset_fingerprint(b"manifest", []), "records_in": 12,
                    "records_released": 9 if released else 0, "records_suppressed": 1 if released else 10,
                    "records_quarantined": 2, "quarantine_by_reason": {"no_face": 1, "corrupt_image": 1}},
        "checks": [
            {"name": "min_people_per_cluster", "passed": True, "value": 3, "threshold": 3, "detail": ""},
            {"name": "reidentification_max_rate", "passed": released, "value": 0.2 if released else 0.4,
             "threshold": 1 / 3, "detail": "whitened cosine"},
            {"name": "utility_gender", "passed": True, "value": {"drop": 0.01}, "threshold": 0.05, "detail": ""},
        ],
        "privacy": {"bound": 1 / 3, "max_rate": 0.2 if released else 0.4, "min_distinct_people_per_cluster": 3,
                    "reidentification": [
                        {"attacker": "whitened_cosine", "mode": "original_vs_release", "rate": 0.2 if released else 0.4},
                        {"attacker": "whitened_cosine", "mode": "release_vs_release", "rate": 0.1},
                    ]},
        "utility": [{"label": "gender", "original_accuracy": 0.9, "deidentified_accuracy": 0.89, "tolerance": 0.05,
                     "detail": "5-fold grouped CV"},
                    {"label": "expression", "protocol": "train-original/test-release", "original_accuracy": 0.8,
                     "deidentified_accuracy": 0.7, "tolerance": 0.05, "detail": ""}],
        "artifacts": hash_tree(release_dir) if released else [],
        "release_dir": str(release_dir) if released else None,
        "signing": {"algorithm": "ed25519", "public_key_fingerprint": "sha256:" + "0" * 64, "key_origin": "development"},
        "versions": {"numpy": "2.4.6", "deid": "0.1.0"},
        "configuration": {"labels": ["gender"], "homepage": "http://example.org/not-allowed",
                          "partitions": [{"key": "gender=f", "records": 5, "people": 4},
                                         {"key": "gender=m", "records": 4, "people": 3}],
                          "clusters": {"count": 3, "sizes": [3, 3, 3]},
                          "small_partitions_detail": [{"partition": "gender=x", "people": 1, "action": "suppressed"}]},
    }


def _data_uris(doc: str, cls: str | None = None) -> list[bytes]:
    pat = r'<img class="%s"[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"' % (re.escape(cls) if cls else "[^\"]*")
    return [base64.b64decode(m) for m in re.findall(pat, doc)]


def _decode(png: bytes) -> np.ndarray:
    return cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_UNCHANGED)


def test_html_is_offline_and_complete(world):
    _, release_dir, _, _ = world
    report = _report(release_dir)
    doc = render_report_html(Report.from_dict(report), sample_images=sample_release_images(release_dir))
    assert not URL.search(doc), URL.search(doc)
    # every resource reference is an inline data: URI (or an in-page anchor)
    for ref in RESOURCE_ATTR.findall(doc):
        assert ref.startswith(("data:image/png;base64,", "#")), ref
    assert "<link" not in doc and "<script" not in doc and "@import" not in doc and "url(" not in doc
    assert "RELEASED" in doc and "k = 3" in doc and "k-same-select" in doc
    assert "toy &lt;faces&gt; &amp; co" in doc and "<faces>" not in doc  # escaped
    for check in report["checks"]:
        assert check["name"] in doc
    assert "train-original/test-release" in doc
    assert "no_face" in doc and "corrupt_image" in doc
    # a partition too small to release is described by counts only, never by its label values
    assert "gender=x" not in doc
    assert report["dataset"]["fingerprint"] in doc and "run-42" in doc
    assert "deid verify" in doc and "--public-key" in doc and report["signing"]["public_key_fingerprint"] in doc
    assert "numpy" in doc and "2.4.6" in doc
    charts = re.findall(r'<svg class="chart".*?</svg>', doc, flags=re.S)
    assert len(charts) == 4  # re-identification, utility, partitions, cluster sizes
    for svg in charts:  # well-formed inline SVG (XML), with a title for screen readers
        root = ElementTree.fromstring(svg)
        assert root.find("title").text and root.findall(".//rect")


def test_sample_grid_contains_only_released_images(world):
    project, release_dir, centroids, originals = world
    samples = sample_release_images(release_dir, n=24, seed=5)
    assert len(samples) == 3  # one per released cluster
    doc = render_report_html(Report.from_dict(_report(release_dir)), sample_images=samples)
    embedded = [_decode(p) for p in _data_uris(doc, "sample")]
    assert len(embedded) == 3
    released = [cv2.imread(str(p), cv2.IMREAD_UNCHANGED) for p in sorted((release_dir / "images").glob("*.png"))]
    staged = [cv2.imread(str(p), cv2.IMREAD_UNCHANGED) for p in (project / "data" / "staging").rglob("*.png")]
    assert len(released) == 9 and len(staged) == 9
    for im in embedded:
        assert any(np.array_equal(im, r) for r in released)
        assert not any(np.array_equal(im, o) for o in staged)
    # the three distinct cluster faces, each exactly once
    found = sorted(int(np.flatnonzero([np.array_equal(im.reshape(-1), c) for c in centroids])[0]) for im in embedded)
    assert found == [0, 1, 2]


def test_sample_release_images_ignores_anything_outside_images(world, tmp_path):
    _, release_dir, _, originals = world
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(release_dir / "release.parquet")
    outside = tmp_path / "secret.png"
    cv2.imwrite(str(outside), originals[0].reshape(SHAPE))
    images = table.column("image").to_pylist()
    images[0] = "../../staging/rel-test/originals/0.png"
    pq.write_table(table.set_column(table.schema.get_field_index("image"), "image", pa.array(images)),
                   release_dir / "release.parquet")
    (release_dir / "images" / "link.png").symlink_to(outside)
    for seed in range(4):
        for im in sample_release_images(release_dir, seed=seed):
            assert not any(np.array_equal(im.reshape(-1), o) for o in originals)
    with pytest.raises(Exception, match="not a published release"):
        sample_release_images(tmp_path / "nowhere")


def test_one_image_per_cluster_draws_what_sorting_and_drawing_in_python_drew(tmp_path):
    """The Arrow grouping (issue 32: no Python dict per row) picks the paths the per-row dicts picked, seed for seed."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from deid.reporting.html_report import _one_image_per_cluster

    rng = np.random.default_rng(3)
    # Cluster ids and paths out of order, of several sizes, with non-ASCII characters (code point = UTF-8 byte order).
    clusters = [f"p{int(rng.integers(0, 3))}/c{int(c)}{'é' if c % 7 == 0 else ''}"
                for c in rng.integers(0, 40, size=300)]
    images = [f"images/{'ü' if i % 5 == 0 else ''}{int(x):08x}.png" for i, x in enumerate(rng.permutation(300))]
    pq.write_table(pa.table({"image": images, "cluster_id": clusters}), tmp_path / "release.parquet")
    for seed in range(5):
        want_rng = random.Random(seed)
        by_cluster: dict[str, list[str]] = {}
        for c, im in zip(clusters, images):
            by_cluster.setdefault(c, []).append(im)
        order = sorted(by_cluster)
        want_rng.shuffle(order)
        want = [want_rng.choice(sorted(by_cluster[c])) for c in order]
        got = list(_one_image_per_cluster(tmp_path / "release.parquet", random.Random(seed)))
        assert got == want and len(got) == len(set(clusters))


def test_rejected_report_shows_reasons_and_no_faces(world):
    _, release_dir, _, _ = world
    report = _report(None, verdict="rejected")
    doc = render_report_html(Report.from_dict(report), sample_images=sample_release_images(release_dir))
    assert "REJECTED" in doc and "re-identification 0.4 &gt; 1/k" in doc
    assert not URL.search(doc) and "[link removed]" in doc
    assert _data_uris(doc, "sample") == []


def test_strip_urls():
    assert strip_urls("see https://a.b/c?d=1 and HTTP://x.y, ftp://z") == "see [link removed] and [link removed], [link removed]"


def _gx_like() -> dict:
    """The flow's validation mapping (table -> SuiteResult), one failing expectation with hostile values."""
    from deid.evaluation.validation import ExpectationResult, SuiteResult

    return {"ingested": SuiteResult("ingested", (
        ExpectationResult("expect_column_values_to_be_unique", {"column": "record_id"}, True, element_count=3,
                          unexpected_count=0, unexpected_percent=0.0),
        ExpectationResult("expect_column_values_to_be_in_set", {"column": "gender", "value_set": ["f", "m"]}, False,
                          element_count=3, unexpected_count=1, unexpected_percent=33.3,
                          partial_unexpected=("<script>https://x</script>",)),
    ), gx_version="1.24.1")}


def test_validation_docs_are_offline(tmp_path):
    paths = build_offline_data_docs(_gx_like(), tmp_path / "validation")
    assert [p.name for p in paths] == ["validation_results.json", "index.html"]
    doc = paths[1].read_text()
    assert not URL.search(doc) and "<script>" not in doc
    assert "expect_column_values_to_be_in_set" in doc and "FAIL" in doc and "1 unexpected of 3" in doc
    assert json.loads(paths[0].read_text())[0]["suite"] == "ingested"
    with pytest.raises(Exception, match="to_json_dict"):  # GX's JSON shape is refused, not shown blank
        build_offline_data_docs({"x": {"results": [{"success": True, "expectation_config": {}}]}}, tmp_path / "v2")


def test_validation_docs_from_a_real_gx_result():
    gx = pytest.importorskip("great_expectations")  # a declared dependency; import costs a few seconds
    import pandas as pd

    ctx = gx.get_context(mode="ephemeral")
    batch = (ctx.data_sources.add_pandas("p").add_dataframe_asset("a").add_batch_definition_whole_dataframe("b")
             .get_batch(batch_parameters={"dataframe": pd.DataFrame({"size": [1, 2, -3]})}))
    suite = gx.ExpectationSuite(name="sizes")
    suite.add_expectation(gx.expectations.ExpectColumnValuesToBeBetween(column="size", min_value=0))
    doc = render_validation_html([batch.validate(suite)])
    assert "sizes" in doc and "expect_column_values_to_be_between" in doc and "1 unexpected of 3" in doc
    assert not URL.search(doc)


def test_bundle_verifies_and_detects_tampering(world, keys):
    project, release_dir, _, _ = world
    signing_key, pub, other_pub = keys
    report_dir = project / "reports" / "rel-test"
    path = write_report_bundle(report_dir, Report.from_dict(_report(release_dir)), signing_key,
                               sample_images=sample_release_images(release_dir), validation_results=_gx_like())
    report = json.loads(path.read_text())
    assert [f["path"] for f in report["report_files"]] == [
        "report.html", "validation/index.html", "validation/validation_results.json"]
    assert report["signing"]["public_key_fingerprint"] == signing_key.fingerprint
    html_doc = (report_dir / "report.html").read_text()
    assert signing_key.fingerprint in html_doc and 'href="validation/index.html"' in html_doc
    assert not URL.search(html_doc)

    ok = verify_report(report_dir, public_key=pub)
    assert ok.ok and ok.authenticated, ok.problems
    wrong = verify_report(report_dir, public_key=other_pub)
    assert not wrong.ok and wrong.problems[0].startswith("wrong key")

    page = report_dir / "report.html"
    original = page.read_bytes()
    page.write_bytes(original.replace(b"RELEASED", b"RELEASEd", 1))
    res = verify_report(report_dir, public_key=pub)
    assert res.problems == ["hash mismatch report.html (report directory): sha256 "
                            + __import__("hashlib").sha256(page.read_bytes()).hexdigest()
                            + ", report lists " + report["report_files"][0]["sha256"]]
    page.write_bytes(original)

    (report_dir / "notes.txt").write_text("added later")
    (report_dir / "validation" / "validation_results.json").unlink()
    res = verify_report(report_dir, public_key=pub)
    assert sorted(res.problems) == ["extra unlisted file notes.txt (report directory)",
                                    "missing file validation/validation_results.json (report directory)"]
