"""Feature drops through the Prefect flow and `deid run`: released once by content, the noise control rejected.

The runner (run_release), the ledger and the watcher on feature drops are tests/integration/test_feature_runner.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import assert_nothing_published
from integration import test_feature_runner as runner_tests

from deid.reporting.report import report_problems
from deid.settings import Settings

K = runner_tests.K
feature_drop = runner_tests.feature_drop  # the runner tests' module-scoped drop (one definition)


@pytest.mark.slow  # the Prefect flow
def test_the_flow_releases_feature_content_once(feature_drop, project, prefect_server, tmp_path):
    """release-on-drop (deid serve's deployment) -> run_flow -> the runner; the same content again is a duplicate."""
    from prefect.client.orchestration import get_client

    from deid.flows.serve import release_on_drop

    row = release_on_drop(drop=str(feature_drop))
    assert row["status"] == "released", row
    report = json.loads(Path(row["report"]).read_text())
    assert report["verdict"] == "released" and report["configuration"]["kind"] == "features"
    # The release subflow was named and tagged as an image run is (its id is the report's run_id).
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(report["run_id"])
    assert run.name == f"voices k={K} k-same-select" and run.state.name == "Completed"
    assert {"verdict:released", f"release:{row['release_id']}"} <= set(run.tags)
    # Its Parameters tab: the values used, drop.yaml's labels and name included, only those the method takes.
    assert run.parameters == {"drop": str(feature_drop.resolve()), "k": Settings().k, "method": "k-same-select",
                              "labels": report["configuration"]["labels"], "name": "voices",
                              "small_partitions": Settings().small_partitions}, run.parameters
    assert report["configuration"]["labels"] == ["gender", "expression"]
    # The wrapper run (what `deid serve` starts) is named and tagged like its subflow.
    with get_client(sync_client=True) as client:
        wrapper = client.read_flow_run(client.read_task_run(run.parent_task_run_id).flow_run_id)
    assert wrapper.name == run.name and set(run.tags) <= set(wrapper.tags), (wrapper.name, wrapper.tags)
    copy = tmp_path / "voices-again"
    shutil.copytree(feature_drop, copy)
    again = release_on_drop(drop=str(copy))
    assert again["status"] == "duplicate" and again["release_id"] == row["release_id"], again
    assert [p.name for p in (project / "data" / "releases").iterdir()] == [row["release_id"]]


@pytest.mark.slow  # the Prefect flow
def test_the_flow_rejects_the_noise_control(feature_drop, project, prefect_server):
    from deid.flows.release import REJECTED, outcome, release

    state = release(drop=str(feature_drop), k=K, method="noise", sigma=0.1, return_state=True)
    assert state.is_failed() and state.name == REJECTED
    res = outcome(state)
    assert res.verdict == "rejected" and res.release_dir is None
    assert not (res.staging / "release").exists() and not (res.staging / "linkage.bin").exists()
    assert_nothing_published(project / "data" / "releases")
    report = json.loads(res.report_path.read_text())
    assert report_problems(report) == [] and report["dataset"]["records_released"] == 0
    checks = {c["name"]: c for c in report["checks"]}
    assert not checks["reidentification_rate"]["passed"]
    # noise has no clusters: the release suite's cluster-size floor is 1, so it is no second rejection reason
    assert checks["expectations_feature_release"]["passed"], checks["expectations_feature_release"]
    assert report["dataset"]["records_withheld"] == 180  # judged by the gate, withheld by its verdict


@pytest.mark.slow  # the Prefect flow
def test_cli_run_prints_a_feature_run_like_an_image_run(feature_drop, project, prefect_server, capsys):
    from deid.cli import main

    # The synthetic drop plus two bad rows: quarantined with their reasons, the rest released.
    table = pq.read_table(feature_drop / "vectors.parquet")
    bad_rows = pa.table({"record_id": ["bad-1", "bad-2"], "subject_id": ["s000001", "s000002"],
                         "gender": ["g0", "g1"], "expression": ["e0", "e1"],
                         "features": pa.array([[1.0] * 15, [float("nan")] * 16], pa.list_(pa.float32()))})
    table = table.cast(table.schema.set(4, pa.field("features", pa.list_(pa.float32()))))
    drop = project / "with-bad-rows"
    drop.mkdir()
    pq.write_table(pa.concat_tables([table, bad_rows]), drop / "vectors.parquet")
    (drop / "drop.yaml").write_text((feature_drop / "drop.yaml").read_text())
    assert main(["run", str(drop), "--k", "5"]) == 0
    out = capsys.readouterr().out
    assert "verdict: RELEASED" in out and "records: 182 in, 180 released, 0 suppressed, 2 quarantined" in out
    assert "quarantined by reason: non_finite_features=1, wrong_length=1" in out
    assert "re-identification: max" in out and "release: " in out
    bad = project / "bad"
    bad.mkdir()
    (bad / "drop.yaml").write_text("kind: features\nfeatures: vectors.parquet\n")
    (bad / "vectors.parquet").write_text("not parquet")
    assert main(["run", str(bad), "--k", "5"]) == 2
    captured = capsys.readouterr()
    assert "verdict: REJECTED (unreadable drop)" in captured.out and "not a readable Parquet file" in captured.err
    signed = [json.loads((p / "report.json").read_text()) for p in (project / "reports").iterdir()
              if (p / "report.json.sig").exists()]
    assert sorted(r["verdict"] for r in signed) == ["rejected", "released"]
    rejection = next(r for r in signed if r["verdict"] == "rejected")
    assert rejection["configuration"]["kind"] == "features" and "drop.yaml" in rejection["configuration"][
        "fingerprint_scope"] and "vector" in rejection["guarantee"]
