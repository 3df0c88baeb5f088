"""The offline validation page and report.html's validation counts, on REAL Great Expectations output.

Earlier the page expected GX's JSON shape while the flow passed its own summary, and a fixture in
GX's shape hid it (suites ``suite-0..3``, blank names, ``{}`` arguments). Here the suites run for
real: on a synthetic drop through the core stages (fast); in a whole flow run, tests/flow/test_validation_page.py.
"""
from __future__ import annotations

import html
import json
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
from pagecheck import Page, assert_validation_page_names_every_expectation

from deid.intake.drop import read_drop
from deid.reporting.html_report import render_report_html
from deid.reporting.html_validation import build_offline_data_docs
from deid.reporting.report import DatasetSummary, Report, SigningInfo
from deid.intake.ingest import ingest
from deid.release.publish import stage_release
from deid.settings import Settings
from deid.operations.worker_align import align_batch
from deid.intake.synth import make_synthetic_drop
from deid.evaluation.validation import (
    SuiteResult,
    observed_label_sets,
    suite_check,
    suite_results,
    validate_aligned,
    validate_ingested,
    validate_manifest,
    validate_release,
)


def _rejected(release_id: str, *, k: int, method: str) -> Report:
    """A rejected run's report with nothing measured (the dataset "clinic")."""
    return Report(release_id=release_id, verdict="rejected", k=k, method=method, run_id="run-1",
                  dataset=DatasetSummary(name="clinic", fingerprint="sha256:" + "0" * 64, records_in=0,
                                         records_released=0, records_suppressed=0, records_quarantined=0),
                  signing=SigningInfo(public_key_fingerprint="sha256:" + "0" * 64, key_origin="development"))


def _aligner() -> dict:
    s = Settings()
    (w, h), (el, er) = s.canonical_size, s.canonical_eyes()
    return {"size": [w, h], "eye_left": list(el), "eye_right": list(er), "max_upsample": s.max_upsample,
            "min_eye_distance": s.min_eye_distance_px, "color": False}


@pytest.fixture(scope="module")
def real_suites(tmp_path_factory) -> dict[str, SuiteResult]:
    """The four suites as the flow runs them, on a 6-person synthetic drop whose manifest lists one image twice."""
    tmp = tmp_path_factory.mktemp("suites")
    drop_dir = make_synthetic_drop(tmp / "drop", people=6, images_per_person=2, seed=3, image_size=120)
    manifest = drop_dir / "manifest.csv"
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join([*lines, lines[1]]) + "\n")  # a duplicate row: one real failure
    drop = read_drop(drop_dir)
    staged = ingest(drop, tmp / "ingested.parquet")
    aligned = tmp / "aligned.parquet"
    align_batch(str(staged.path), list(range(staged.row_groups)), str(aligned), _aligner())
    t = pq.read_table(aligned, columns=["record_id", "pixels"]).to_pydict()
    meta = pq.read_table(staged.path, columns=["record_id", *drop.labels]).to_pydict()
    where = {r: i for i, r in enumerate(meta["record_id"])}
    w, h = Settings().canonical_size
    images = np.frombuffer(b"".join(t["pixels"]), np.uint8).reshape(len(t["pixels"]), -1)
    release = stage_release(tmp / "release", images=images, shape=(h, w),
                            clusters=[f"c{i // 4}" for i in range(len(images))],
                            labels={x: [meta[x][where[r]] for r in t["record_id"]] for x in drop.labels})
    sets = observed_label_sets(staged.path, drop.labels)
    return {"manifest": validate_manifest(drop), "ingested": validate_ingested(staged.path, drop.labels),
            "aligned": validate_aligned([aligned], pixel_bytes=w * h),
            "release": validate_release(release.path / "release.parquet", drop.labels, label_sets=sets, k=2)}


def test_page_names_every_expectation_of_the_real_suites(real_suites, tmp_path):
    json_path, html_path = build_offline_data_docs(real_suites, tmp_path / "validation")
    suites = suite_results(real_suites)
    assert [s.suite for s in suites] == ["manifest", "ingested", "aligned", "release"]
    assert_validation_page_names_every_expectation(html_path.read_text(), suites)
    # What GX observed, as the page shows it: the row count, the duplicated image, the release's columns.
    manifest = real_suites["manifest"]
    rows = next(e for e in manifest.expectations if e.type == "expect_table_row_count_to_be_between")
    assert rows.observed_text() == "13"  # 12 images + the duplicated row
    dup = next(e for e in manifest.expectations if e.type == "expect_column_values_to_be_unique")
    # The duplicated paths are counted, never named (issue 28: no drop paths or ids in reports).
    assert not dup.success and dup.observed_text().startswith("2 unexpected of 13 (15.4%); values not named")
    assert "images/" not in dup.observed_text()
    assert not manifest.success and real_suites["ingested"].success and real_suites["release"].success
    cols = next(e for e in real_suites["release"].expectations if e.type == "expect_table_columns_to_match_set")
    assert "record_id" in cols.observed_text() and "cluster_id" in cols.observed_text()
    # One shape everywhere: the JSON beside the page and report.json's section read back to the same results.
    assert suite_results(json.loads(json_path.read_text())) == suites
    check = suite_check(manifest)
    assert (check.name, check.passed, check.value, check.threshold) == ("expectations_manifest", False, 1, "= 0 failed")
    assert "2 unexpected of 13" in check.detail


def test_page_says_whose_run_it_is_and_links_back(real_suites, tmp_path):
    """Issue 29 item 10: opened on its own, the page says which run it belongs to and links back to report.html."""
    from deid.reporting.html_report import run_title

    run = run_title(_rejected("rel-1", k=5, method="k-same-select"))
    assert run == "clinic, k = 5, k-same-select, release rel-1 (REJECTED)"
    _, html_path = build_offline_data_docs(real_suites, tmp_path / "validation", run=run, back_href="../report.html")
    doc = html_path.read_text()
    page = Page(doc)
    assert page.headings[0] == ("h1", None, f"Data validation results: {run}")
    assert f"<title>Data validation results: {html.escape(run)}</title>" in doc
    assert '<a href="../report.html">' in doc and doc.index("../report.html") < doc.index("<h1>")
    assert_validation_page_names_every_expectation(doc, suite_results(real_suites))  # the rest unchanged


def test_report_html_counts_are_numbers(real_suites):
    report = replace(_rejected("rel-x", k=2, method="k-same"),
                     validation={name: s.to_dict() for name, s in real_suites.items()})
    page = Page(render_report_html(report, validation_href="validation/index.html"))
    table = page.table_after("suite")
    assert [r[0] for r in table[1:]] == ["manifest", "ingested", "aligned", "release"]
    for row, s in zip(table[1:], suite_results(real_suites), strict=True):
        assert row[3:6] == [str(s.evaluated), str(s.passed), str(s.failed)] and s.evaluated > 0


# --------------------------------------------------------------------------- a real run
