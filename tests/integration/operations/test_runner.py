"""The Prefect-free runner (deid.operations.runner) end to end on small `deid synth` drops: released, rejected, refused."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import assert_nothing_published

from deid.reporting import report_build
from deid.operations.run_result import RunResult
from deid.errors import StateError
from deid.reporting.report import report_problems
from deid.run_config import RunConfig
from deid.operations.runner import run_release
from deid.settings import Settings
from deid.intake.synth import make_synthetic_drop
from deid.reporting.verify import verify_report

# The runner's subject is the walk and the report, not the gate's figures: the deep recogniser on a
# small sample, no per-face recogniser identity check, one repeat of the older utility protocols.
QUICK = dict(identity_embed_max=0, deep_attack_sample=20, min_probes=4, cv_repeats=1)


def _run(tmp_path: Path, drop: Path, settings: dict | None = None, *, gate_helper: bool = False,
         **params) -> RunResult:
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", **QUICK, **(settings or {})), **params)
    if gate_helper:  # the gate helper a large release starts before staging (gate_publish.start_gate), at this size
        config = dataclasses.replace(config, gate=dataclasses.replace(config.gate, helper_min_records=1))
    return run_release(drop, config)


def _sums(result: RunResult) -> dict:
    d = json.loads(result.report_path.read_text())
    ds, checks = d["dataset"], {c["name"]: c for c in d["checks"]}
    assert report_problems(d) == []
    assert ds["records_released"] + ds["records_withheld"] + ds["records_suppressed"] + ds["records_quarantined"] \
        == ds["records_in"]
    return {"dataset": ds, "checks": checks, "report": d}


def test_a_drop_with_fewer_than_k_people_is_rejected_without_prefect(tmp_path):
    drop = make_synthetic_drop(tmp_path / "drop", people=2, images_per_person=2, seed=1)
    result = _run(tmp_path, drop, k=3)
    assert result.verdict == "rejected" and result.release_dir is None
    got = _sums(result)
    assert got["dataset"]["records_withheld"] == 4 and got["dataset"]["records_released"] == 0
    assert not got["checks"]["enough_people"]["passed"]
    # k above the people is the one reason (issue 28): nothing was de-identified, so the empty release and
    # the records it never judged are not reasons of their own (records_accounted said "0 + 0 + 0 = 0 of 4").
    assert [r.split(":")[0] for r in got["report"]["reasons"]] == ["enough_people"], got["report"]["reasons"]
    assert got["checks"]["records_accounted"]["status"] == "not_applicable"
    assert verify_report(result.report_dir, public_key=result.public_key).ok
    assert result.staging is not None and (result.staging / ".complete").exists()


@pytest.mark.slow
def test_released_and_rejected_runs_agree_with_themselves(tmp_path, monkeypatch):
    from deid.operations import gate_publish

    drop = make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=1)
    # A leak threshold of 14 grey levels makes this drop's closest cluster (13.18 from a member's own face)
    # a near copy: the de-identify stage repairs it (issue 13) and the gate's no_near_copies, on the same
    # threshold, passes instead of rejecting the release.
    near = {"leak_threshold": 14.0}
    helpers = []
    start = gate_publish.start_gate
    monkeypatch.setattr(gate_publish, "start_gate", lambda *a, **kw: helpers.append(start(*a, **kw)) or helpers[-1])
    released = _run(tmp_path, drop, near, k=3, gate_helper=True)
    assert [type(h).__name__ for h in helpers] == ["GateHelper"]  # started before staging, gave the gate its inputs
    assert released.verdict == "released", released.reasons
    got = _sums(released)
    assert got["dataset"]["records_released"] == got["checks"]["release_not_empty"]["value"] == 24
    assert got["dataset"]["records_withheld"] == 0
    rep, leak = got["dataset"]["near_copy_repair"], got["checks"]["no_near_copies"]
    assert (rep["near_copy_clusters"], rep["clusters_merged"], rep["min_distance_before"] < 14) == (1, 1, True)
    assert leak["passed"] and leak["value"] >= 14 == rep["threshold"] and rep["min_distance_after"] >= 14
    assert released.release_dir.is_dir() and released.linkage.is_file()
    assert verify_report(released.report_dir, public_key=released.public_key).ok
    # Blur gives every face its own image: the attacks name nearly everyone, the gate rejects.
    rejected = _run(tmp_path, drop, near, k=3, method="blur")
    assert rejected.verdict == "rejected" and rejected.release_dir is None
    got = _sums(rejected)
    ds, checks = got["dataset"], got["checks"]
    assert "near_copy_repair" not in ds  # no repair outside the identical-image family
    # What the gate judged is withheld: not released, not "suppressed", and the checks say the same numbers.
    assert ds["records_released"] == 0 and ds["records_suppressed"] == 0
    assert ds["records_withheld"] == checks["release_not_empty"]["value"] == 24
    assert checks["records_accounted"]["value"] == ds["records_in"] == 24
    assert not checks["reidentification_rate"]["passed"]
    # No clusters: the structural check is not applicable, and the release suite agrees (its cluster-size
    # expectation asks only for >= 1 record per cluster id) instead of failing every row a second time.
    assert checks["min_cluster_size"]["status"] == "not_applicable"
    assert checks["expectations_release"]["passed"], checks["expectations_release"]
    assert "no formal guarantee" in got["report"]["guarantee"]
    assert not (rejected.staging / "release").exists() and not (rejected.staging / "linkage.bin").exists()
    releases = sorted(p.name for p in (tmp_path / "project" / "data" / "releases").iterdir())
    assert releases == [released.release_id]


@pytest.mark.slow
def test_a_report_the_schema_refuses_stops_the_run_before_anything_is_published(tmp_path, monkeypatch):
    drop = make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=1)
    real = report_build.build_report

    def broken(**kw):
        return dataclasses.replace(real(**kw), k=1)  # the schema's minimum k is 2

    monkeypatch.setattr("deid.operations.runner.build_report", broken)
    with pytest.raises(StateError, match="schema"):
        _run(tmp_path, drop, k=3)
    project = tmp_path / "project"
    assert_nothing_published(project / "data" / "releases")
    # The refused report was never signed; the run's signed rejection says why (invariant 4).
    (signed,) = [json.loads(p.read_text()) for p in (project / "reports").glob("*/report.json")]
    assert signed["verdict"] == "rejected" and signed["k"] == 3 and signed["artifacts"] == []
    assert [c["name"] for c in signed["checks"] if not c["passed"]] == ["state"]
    assert "schema" in signed["reasons"][0]
    assert not any((project / "data" / "staging").iterdir())  # the failed run's staging went too
    # Nor registered in the dataset's lineage: the next release plans as if this run never happened.
    from deid.release.lineage_registry import Registry
    from deid.operations.run_setup import linkage_key

    config = RunConfig.resolve(Settings(project_dir=project))
    assert Registry.open(config.data_path, "drop", linkage_key(config)[0]).load().releases == ()
