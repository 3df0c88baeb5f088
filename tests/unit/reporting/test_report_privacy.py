"""Issue 28: nothing identifying in any report -- no rare label value, no subject id, no absolute path."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from deid.anonymise.identity import resolve_people
from deid.evaluation.validation import ExpectationResult, suite_check, SuiteResult
from deid.reporting.report_build import public_text


def _gx_result(column: str, unexpected: list[str], *, kind: str = "expect_column_values_to_be_in_set"):
    """A GX 1.x ExpectationValidationResult as ExpectationResult.from_gx reads it."""
    cfg = SimpleNamespace(type=kind, kwargs={"column": column, "value_set": ["neutral", "smile"], "batch_id": "b"},
                          meta={}, description=None)
    result = {"element_count": 60, "unexpected_count": len(unexpected), "unexpected_percent": 100 * len(unexpected) / 60,
              "partial_unexpected_list": unexpected}
    return SimpleNamespace(expectation_config=cfg, result=result, success=not unexpected, exception_info={})


def test_a_label_value_outside_the_releasable_set_is_counted_never_named():
    """With --small-partitions merge a rare value reached the release suite, whose examples named it."""
    got = ExpectationResult.from_gx(_gx_result("expression", ["RAREVALUE_HIVPOS", "RAREVALUE_HIVPOS"]))
    assert got.partial_unexpected == () and "RAREVALUE" not in str(got.to_dict())
    text = got.observed_text()
    assert text.startswith("2 unexpected of 60 (3.3%)") and "values not named" in text and "RAREVALUE" not in text
    check = suite_check(SuiteResult("release", (got,)))
    assert not check.passed and "RAREVALUE" not in check.detail
    # Subject ids and image paths (which often hold them) are the drop's own cells too.
    for column, value in (("subject_id", "s00001"), ("image", "images/s00001_1.png"), ("sequence", "visit-s00001")):
        res = ExpectationResult.from_gx(_gx_result(column, [value], kind="expect_column_values_to_be_unique"))
        assert value not in res.observed_text() and value not in str(res.to_dict())
    # Values deid made itself (staging ids, derived lengths) are still shown: they help and identify nobody.
    own = ExpectationResult.from_gx(_gx_result("_pixels_length", ["7452"], kind="expect_column_values_to_be_between"))
    assert own.partial_unexpected == ("7452",) and "e.g. 7452" in own.observed_text()


def test_identity_merges_are_named_by_record_never_by_subject_id():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(12, 6))
    X[5] = X[0] + 1e-4  # one face under a second id
    ids = [f"s{i:05d}" for i in range(12)]
    res = resolve_people(ids, X)
    assert res.face_merges and sorted(res.face_merges[0]["ids"]) == ["s00000", "s00005"]
    assert res.summary()["examples"][0]["records"] == [0, 5]  # positions until named
    named = res.named([f"r{i + 1:08d}" for i in range(12)])
    summary = named.summary()
    assert summary["examples"][0]["records"] == ["r00000001", "r00000006"]
    assert summary["examples"][0]["evidence"] == "eigenface near-duplicate"
    assert not any(s in str(summary) for s in ids)
    assert named.person == res.person and summary["people"] == 11


def test_public_text_leaves_no_absolute_path():
    reason = ("unreadable drop: /home/ann/drops/clinic/manifest.csv: 'manifest.csv' is a FIFO; bound 1/k; staging "
              "/srv/deid/data/staging/rel-1/x.parquet; key /etc/deid/key.pem")
    got = public_text(reason, drop="/home/ann/drops/clinic", roots=["/srv/deid"])
    assert got == ("unreadable drop: clinic/manifest.csv: 'manifest.csv' is a FIFO; bound 1/k; staging "
                   "data/staging/rel-1/x.parquet; key key.pem")
