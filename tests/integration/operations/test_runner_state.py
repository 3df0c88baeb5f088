"""A run that fails with StateError publishes nothing and says why in a signed report (invariant 4)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import assert_nothing_published

from deid.errors import StateError
from deid.intake.synth import make_synthetic_drop
from deid.operations import gate_publish, run_setup
from deid.operations.runner import Steps, run_release
from deid.release.lineage_registry import Registry
from deid.reporting.verify import verify_report
from deid.run_config import RunConfig
from deid.settings import Settings

QUICK = dict(identity_embed_max=0, deep_attack_sample=20, min_probes=4, cv_repeats=1)


def _config(tmp_path: Path) -> RunConfig:
    return RunConfig.resolve(Settings(project_dir=tmp_path / "project", **QUICK), k=3)


def _reports(config: RunConfig) -> list[Path]:
    return sorted(p for p in config.reports_path.iterdir() if p.is_dir()) if config.reports_path.is_dir() else []


def test_a_tampered_registry_stops_the_run_with_a_signed_rejection_saying_why(tmp_path):
    drop = make_synthetic_drop(tmp_path / "drop", people=4, images_per_person=2, seed=1)
    with open(drop / "drop.yaml", "a", encoding="utf-8") as fh:
        fh.write("dataset: ward\n")
    config = _config(tmp_path)
    reg = Registry.open(config.data_path, "ward", run_setup.linkage_key(config)[0])
    reg.init()
    entry = reg.root / "00000000.entry"
    blob = bytearray(entry.read_bytes())
    blob[-1] ^= 1  # one flipped bit: the entry no longer authenticates
    entry.write_bytes(bytes(blob))
    with pytest.raises(StateError, match="does not authenticate"):
        run_release(drop, config)
    [report_dir] = _reports(config)
    report = json.loads((report_dir / "report.json").read_text())
    assert report["verdict"] == "rejected" and report["release_dir"] is None
    [check] = report["checks"]
    assert check["name"] == "state" and not check["passed"] and "does not authenticate" in check["detail"]
    assert "lineage of dataset 'ward'" in report["reasons"][0]
    assert verify_report(report_dir, public_key=config.data_path / "keys" / "dev_signing.pub.pem").ok
    assert_nothing_published(config.data_path / "releases")  # nothing published


def test_a_state_error_after_signing_never_replaces_the_signed_report(tmp_path):
    drop = make_synthetic_drop(tmp_path / "drop", people=2, images_per_person=2, seed=1)  # < k people: rejected

    def write_then_fail(*args, **kwargs):
        gate_publish.write_report(*args, **kwargs)
        raise StateError("simulated: the lineage moved on after the report was signed")

    config = _config(tmp_path)
    with pytest.raises(StateError, match="simulated"):
        run_release(drop, config, steps=dataclasses.replace(Steps(), write_report=write_then_fail))
    [report_dir] = _reports(config)
    report = json.loads((report_dir / "report.json").read_text())
    names = {c["name"] for c in report["checks"]}
    assert "enough_people" in names and "state" not in names  # the gate's own signed report, kept
    assert verify_report(report_dir, public_key=config.data_path / "keys" / "dev_signing.pub.pem").ok


def test_an_unreachable_lineage_database_stops_the_run_with_a_signed_rejection(tmp_path):
    from deid.errors import EnvironmentFailure

    drop = make_synthetic_drop(tmp_path / "drop", people=4, images_per_person=2, seed=1)
    url = f"postgresql://deid:s3cr3t-pass@/x?host={tmp_path}/none"
    settings = Settings(project_dir=tmp_path / "project", database_url=url, **QUICK)
    config = RunConfig.resolve(settings, k=3)
    with pytest.raises(EnvironmentFailure, match="lineage database .* unreachable"):
        run_release(drop, config)
    [report_dir] = _reports(config)
    report = json.loads((report_dir / "report.json").read_text())
    assert [c["name"] for c in report["checks"]] == ["environment"] and report["verdict"] == "rejected"
    assert "s3cr3t-pass" not in (report_dir / "report.json").read_text()  # the password never reaches a report
