"""The bad-input matrix of issue 3 through the Prefect flow: a manifest that is not CSV exits 2, releasing nothing.

The matrix through the core pipeline (manifest -> ingest -> align) is tests/integration/test_bad_inputs.py.
"""
from __future__ import annotations

import json

import pytest
from helpers import assert_nothing_published



@pytest.mark.slow
def test_manifest_that_is_not_csv_exits_2_and_writes_no_release(project, prefect_server, capsys):
    from deid.cli import main

    drop = project / "drop"
    drop.mkdir()
    (drop / "manifest.csv").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10")
    (drop / "drop.yaml").write_text("labels: [gender]\n")
    assert main(["run", str(drop), "--k", "2"]) == 2
    assert "not" in capsys.readouterr().err
    releases = project / "data" / "releases"
    assert_nothing_published(releases)
    # The run started, so it signed a rejection naming the reason (issue 11).
    (report,) = (project / "reports").glob("*/report.json")
    assert json.loads(report.read_text())["verdict"] == "rejected"
