"""Issue 11 through the Prefect flow: an unreadable drop exits 2 with one message and a signed rejection.

The ordinary items of issue 11 (recovery, pre-flight, exit codes, safe drop reading, decode limits...) are
tests/integration/test_safety.py; the fault matrix is tests/ops/test_faults.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_nothing_published
from integration.test_safety import _drop, _png

from deid.cli import EXIT_BAD_INPUT, main

ROOT = Path(__file__).resolve().parents[2]


BAD_MANIFESTS = {
    "missing_column": (b"image,gender\na.png,f\n", "missing required column"),
    "semicolons": (b"image;subject_id;gender\na.png;s1;f\n", "missing required column"),
    "duplicate_header": (b"image,subject_id,gender,gender\na.png,s1,f,f\n", "duplicate column names"),
    "latin1": ("image,subject_id,gender\na.png,s1,f\u00e9minin\n".encode("latin-1"), "not UTF-8"),
    "empty": (b"", "is empty"),
    "bad_quote": (b'image,subject_id,gender\n"a.png,s1,f\n', "not valid CSV"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_unreadable_drop_exits_2_with_one_message_and_a_signed_rejection(case, project, prefect_server, capsys):
    from deid.reporting.verify import verify_report

    raw, message = BAD_MANIFESTS[case]
    drop = _drop(project / "drop", [], {"a.png": _png()})
    (drop / "manifest.csv").write_bytes(raw)
    assert main(["run", str(drop), "--k", "2"]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    # (Tracebacks are checked through the real CLI below: in-process, Prefect's console handler
    # may still hold a stream pytest has closed, and reports that as a logging error.)
    assert message in captured.err.strip().splitlines()[-1]
    (report_dir,) = [p for p in (project / "reports").iterdir() if p.is_dir()]  # (and the catalogue, index.html)
    report = json.loads((report_dir / "report.json").read_text())
    assert report["verdict"] == "rejected" and message in report["reasons"][0]
    res = verify_report(report_dir, public_key=project / "data" / "keys" / "dev_signing.pub.pem")
    assert res.ok and res.authenticated, res.problems
    # No empty staging directory left behind, nothing released.
    assert not list((project / "data" / "staging").iterdir())
    assert_nothing_published(project / "data" / "releases")


@pytest.mark.slow
def test_unreadable_drop_through_the_real_cli_prints_no_traceback(project, prefect_server):
    from prefect.settings import PREFECT_API_URL

    drop = _drop(project / "drop", [], {"a.png": _png()})
    (drop / "manifest.csv").write_bytes(BAD_MANIFESTS["semicolons"][0])
    env = {**os.environ, "DEID_PROJECT_DIR": str(project), "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "deid.cli", "run", str(drop), "--k", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "missing required column" in line]
    assert len(errors) == 1 and errors[0].startswith("deid run: "), proc.stderr[-3000:]
    assert "verdict: REJECTED" in proc.stdout and "report: " in proc.stdout
