"""Stage contracts, the staging layout, the run configuration and the report built from them (no Prefect)."""
from __future__ import annotations

import dataclasses

import pytest

from deid.evaluation.checks import Check as GateCheck
from deid.contracts import Partitioned, PartitionInfo, RecordCounts, SmallPartition, StagingLayout
from deid.errors import ConfigError
from deid.method_registry import COLOR_METHODS, REGISTRY
from deid.reporting.report import Check, Report, Utility, report_problems
from deid.reporting.report_build import build_rejection, dataset_summary
from deid.run_config import RunConfig
from deid.run_files import COMPLETE_MARKER, LOCK_NAME, RELEASE_SUBDIR
from deid.settings import Settings


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(project_dir=tmp_path)


def test_staging_layout_names_every_path_under_the_run_directory(tmp_path):
    layout = StagingLayout.for_run(tmp_path / "data", "rel-0123")
    root = tmp_path / "data" / "staging" / "rel-0123"
    assert layout.root == root
    part = layout.aligned_part(7)
    assert part == root / "aligned" / "part-00007.parquet"
    assert layout.feature_part(part) == root / "features" / "part-00007.parquet"
    assert layout.color_part(part) == root / "aligned_color" / "part-00007.parquet"
    pdir = layout.partition_dir("p002")
    assert pdir == root / "partitions" / "partition=p002"
    assert layout.deidentified_part(pdir) == root / "deidentified" / "partition=p002.parquet"
    assert layout.partition_index == root / "partitions" / "_index.json"
    assert (layout.release_dir.name, layout.lock.name, layout.complete.name) == (RELEASE_SUBDIR, LOCK_NAME,
                                                                                  COMPLETE_MARKER)
    named = [layout.ingested, layout.linkage, layout.quarantine, layout.aligned_dir, layout.features_dir,
             layout.partitions_dir, layout.deidentified_dir, layout.release_dir, layout.aligned_color_dir]
    assert all(p.parent == root for p in named) and len(set(named)) == len(named)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.root = tmp_path  # type: ignore[misc]


def test_the_colour_part_of_the_worker_follows_the_layout(tmp_path):
    from deid.operations.worker_align import color_part

    layout = StagingLayout(tmp_path)
    assert color_part(layout.aligned_part(3)) == layout.color_part(layout.aligned_part(3))


def test_run_config_resolves_defaults_from_settings_and_overrides_win(settings):
    c = RunConfig.resolve(settings)
    assert (c.k, c.method, c.small_partitions, c.labels) == (settings.k, settings.method, "suppress", None)
    assert c.shape_hw == (settings.canonical_height, settings.canonical_width)
    assert c.aligner.to_dict()["size"] == [settings.canonical_width, settings.canonical_height]
    c = RunConfig.resolve(settings, k=3, method="blur", labels=["gender"], sigma=2.5)
    assert c.parameters() == {"k": 3, "method": "blur", "labels": ["gender"], "small_partitions": "suppress",
                              "name": None, "sigma": 2.5, "block": settings.block}
    assert c.gate_config(("gender",)).k == 3 and c.gate_config(("gender",)).labels == ("gender",)
    # The flow run's Parameters tab: only what the method takes; the override beats drop.yaml's labels.
    assert c.used_parameters(labels=("age",), name="faces") == {
        "k": 3, "method": "blur", "labels": ["gender"], "small_partitions": "suppress", "name": "faces", "sigma": 2.5}
    ks = RunConfig.resolve(settings, k=4, method="k-same-select")
    assert ks.used_parameters(labels=("gender", "expression"), name="faces") == {
        "k": 4, "method": "k-same-select", "labels": ["gender", "expression"], "small_partitions": "suppress",
        "name": "faces"}
    assert RunConfig.resolve(settings, method="pixelate").used_parameters()["block"] == settings.block
    assert "passphrase" not in repr(c)


@pytest.mark.parametrize("override, parameter, hint", [
    ({"k": 1}, "k=1", "--k 5"),
    ({"k": True}, "k=True", "integer"),
    ({"method": "k-same-slect"}, "method='k-same-slect'", "k-same-select"),
    ({"small_partitions": "drop"}, "small_partitions='drop'", "suppress"),
    ({"sigma": 0.0}, "sigma=0.0", "--sigma"),
    ({"block": 0}, "block=0", "--block"),
    ({"labels": []}, "labels=[]", "--labels"),
    ({"labels": ["gender", " "]}, "labels=", "column names"),
])
def test_run_config_errors_name_parameter_value_range_and_fix(settings, override, parameter, hint):
    with pytest.raises(ConfigError) as err:
        RunConfig.resolve(settings, **override)
    assert parameter in str(err.value) and hint in str(err.value)


def test_colour_needs_a_method_whose_face_is_a_cluster_mean(tmp_path):
    s = Settings(project_dir=tmp_path, color=True)
    for method, spec in REGISTRY.items():
        if method in COLOR_METHODS:
            assert RunConfig.resolve(s, method=method).color
        else:
            with pytest.raises(ConfigError, match="cannot release colour"):
                RunConfig.resolve(s, method=method)
    assert set(COLOR_METHODS) == {"k-same", "k-same-select", "k-same-naive"}


def test_lineage_and_label_partitions_follow_the_registry(settings):
    for method, spec in REGISTRY.items():
        c = RunConfig.resolve(settings, method=method)
        assert c.select(["gender"]) == spec.partitions_by_labels and not c.select([])
        assert c.lineage_applies == (spec.identical_within_cluster and spec.clustered)


def test_record_counts_split_what_the_gate_judged_by_its_verdict():
    c = RecordCounts(records_in=100, judged=90, suppressed=6, quarantined=4)
    assert (c.released(True), c.withheld(True)) == (90, 0)
    assert (c.released(False), c.withheld(False)) == (0, 90)
    # A drop refused before de-identification: its staged records were never judged, all withheld.
    early = RecordCounts(records_in=4)
    assert (early.unjudged, early.withheld(False)) == (4, 4)
    for passed in (True, False):
        ds = dataset_summary("toy", "sha256:" + "0" * 64, c, passed=passed, quarantine_by_reason={"no_face": 4})
        assert ds.records_released + ds.records_withheld + ds.records_suppressed + ds.records_quarantined == 100


def test_partitioned_gives_the_gate_its_label_mapping_and_counts_only_detail(tmp_path):
    p = Partitioned(root=tmp_path, partitions=(PartitionInfo("p000", ("female", "smile"), tmp_path / "a", 10, 5),
                                               PartitionInfo("p001", ("male", "smile"), tmp_path / "b", 12, 6)),
                    small=(SmallPartition(2, 1, "suppressed"),))
    assert p.gate_keys == {("female", "smile"): "p000", ("male", "smile"): "p001"}
    assert p.small_detail == "a partition of 2 records has 1 people: suppressed"
    assert "female" not in p.small_detail


def _signing():
    from deid.reporting.report import SigningInfo

    return SigningInfo(public_key_fingerprint="sha256:" + "1" * 64, key_origin="development")


def test_rejection_of_an_unreadable_drop_validates_and_round_trips(settings, tmp_path):
    config = RunConfig.resolve(settings, k=3)
    r = build_rejection(release_id="rel-1", run_id="run-1", created_at="2026-01-01T00:00:00Z", config=config,
                        drop=tmp_path / "drop", reason="unreadable drop: no manifest.csv",
                        fingerprint="sha256:" + "2" * 64, signing=_signing(), versions={"deid": "0.1.0"})
    d = r.to_dict()
    assert report_problems(d) == []
    assert d["guarantee"] and d["dataset"]["records_withheld"] == 0 and d["checks"][0]["status"] == "fail"
    assert Report.from_dict(d).to_dict() == d


def _consistent_report(verdict: str) -> dict:
    passed = verdict == "released"
    counts = RecordCounts(records_in=20, judged=18, suppressed=2)
    gate_checks = [GateCheck("release_not_empty", True, 18, ">= 1"),
                   GateCheck("records_accounted", True, 20, 20),
                   *([] if passed else [GateCheck("reidentification_rate", False, 0.9, "<= 0.3333", "too high")])]
    r = Report(release_id="rel-2", run_id="run-2", verdict=verdict, k=3, method="blur", signing=_signing(),
               reasons=[] if passed else ["reidentification_rate: too high"],
               dataset=dataset_summary("toy", "sha256:" + "3" * 64, counts, passed=passed, quarantine_by_reason={}),
               checks=[Check.from_gate(c) for c in gate_checks], release_dir="/r" if passed else None,
               artifacts=[])
    return r.to_dict()


def test_tiles_and_checks_of_a_rejected_report_agree_and_a_contradiction_is_refused():
    d = _consistent_report("rejected")
    assert d["dataset"]["records_released"] == 0 and d["dataset"]["records_withheld"] == 18
    assert report_problems(d) == []
    # What the issue showed: the would-be release counted as suppressed, not withheld.
    bad = {**d, "dataset": {**d["dataset"], "records_withheld": 0, "records_suppressed": 20}}
    assert any("release_not_empty judged 18" in p for p in report_problems(bad))
    bad = {**d, "dataset": {**d["dataset"], "records_released": 18, "records_withheld": 0}}
    assert any("verdict 'rejected' but $.dataset.records_released = 18" in p for p in report_problems(bad))
    bad = {**d, "dataset": {**d["dataset"], "records_withheld": 17}}
    assert any("records_in = 20" in p for p in report_problems(bad))


def test_report_model_keeps_the_gate_fields_and_utility_extras():
    row = {"label": "gender", "original_accuracy": 0.9, "deidentified_accuracy": 0.85, "tolerance": 0.05,
           "protocol": "cross-fit", "gate_status": "pass", "delta_upper": 0.04}
    u = Utility.from_row(row)
    assert u.extra == {"gate_status": "pass", "delta_upper": 0.04}
    d = _consistent_report("rejected")
    d["utility"] = [row]
    d["warnings"] = ["utility_expression: inconclusive"]
    d["privacy"].update(max_person_share=0.25, exact_bound=True, attack_sample={"records": 18, "of": 18})
    d["privacy"]["reidentification"] = [{"attacker": "pca", "mode": "naive", "rate": 0.2, "n_probes": 18,
                                         "records": 18, "lower": 0.1, "upper": 0.4}]
    assert report_problems(d) == []
    again = Report.from_dict(d).to_dict()
    assert again == d
