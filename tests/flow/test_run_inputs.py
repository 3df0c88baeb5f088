"""`deid run` on a wrong drop: one clear message, no traceback, exit 2 (and a signed rejection once the run started)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_nothing_published

from deid.intake.synth import make_synthetic_drop
from deid.reporting.verify import verify_report

ROOT = Path(__file__).resolve().parents[2]
DEID = [sys.executable, "-m", "deid.cli"]


def _cli(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*DEID, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _one_message(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # The run's own information lines (its start, which Prefect API it uses) are not messages.
    info = ("(k=", "deid run: prefect: ")
    lines = [line for line in proc.stderr.splitlines()
             if line.startswith("deid run: ") and not any(x in line for x in info)]
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-3000:]


def test_a_file_instead_of_a_drop_directory(tmp_path):
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("image,subject_id,gender\n")
    env = {**os.environ, "DEID_PROJECT_DIR": str(tmp_path / "project"), "PYTHONPATH": str(ROOT)}
    _one_message(_cli(["run", str(manifest), "--k", "3"], env, tmp_path), "is a file; give the drop directory")
    assert not (tmp_path / "project" / "reports").exists()  # refused before the run started


@pytest.mark.slow
def test_a_drop_without_manifest_and_a_mistyped_label(project, prefect_server, tmp_path):
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "DEID_PROJECT_DIR": str(project), "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PYTHONPATH": str(ROOT)}
    empty = tmp_path / "no-manifest"
    (empty / "images").mkdir(parents=True)
    start = time.monotonic()
    _one_message(_cli(["run", str(empty), "--k", "3"], env, tmp_path), "has no manifest.csv")
    base = time.monotonic() - start  # a refusal at ingest, imports and the run's start included
    drop = make_synthetic_drop(tmp_path / "drop", people=4, images_per_person=1, seed=1)
    proc = _cli(["run", str(drop), "--k", "3", "--labels", "gendr"], env, tmp_path)
    _one_message(proc, "declared label column(s) ['gendr'] are missing")
    assert "verdict: REJECTED" in proc.stdout
    # A FIFO named manifest.csv (issue 28): refused at once as not a regular file, never waited on.
    fifo = tmp_path / "fifo-drop"
    fifo.mkdir()
    os.mkfifo(fifo / "manifest.csv")
    start = time.monotonic()
    proc = subprocess.run([*DEID, "run", str(fifo), "--k", "3"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)  # a hang (the fault) would be forever
    took = time.monotonic() - start
    _one_message(proc, "'manifest.csv' is a FIFO, not a regular file")
    # Within 10 s on an idle machine (measured 4.7 s); on a busy one, no slower than refusing a missing manifest.
    assert took < max(10.0, 2 * base), f"the FIFO drop took {took:.1f} s to be refused ({base:.1f} s without manifest)"
    # Every run started, so each signed a rejection naming the reason; nothing was released.
    reports = sorted((project / "reports").glob("*/report.json"))
    reasons = sorted(json.loads(p.read_text())["reasons"][0] for p in reports)
    assert len(reasons) == 3 and all(r.startswith("unreadable drop: ") for r in reasons)
    pub = project / "data" / "keys" / "dev_signing.pub.pem"
    assert all(verify_report(p.parent, public_key=pub).authenticated for p in reports)
    # No absolute path in a report: the drop is named by its directory name.
    assert not [p for p in reports if str(tmp_path) in p.read_text() or "/tmp/" in p.read_text()], reasons
    assert any(r.startswith("unreadable drop: fifo-drop/manifest.csv: ") for r in reasons), reasons
    assert_nothing_published(project / "data" / "releases")
