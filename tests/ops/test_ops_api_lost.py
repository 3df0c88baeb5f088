"""Ops: the run's Prefect API killed (SIGKILL) while the gate runs (issue 28).

The verdict does not need Prefect: the run signs its report and publishes, warns that the API (named by
its URL) was lost, and exits 0 within seconds -- before the fix it retried the engine's final-state calls
and its queued events for 2-3 minutes (139-200 s measured here on 2 cores) or exited 70.

The server is the suite's cheap one (tests/prefect_shared.py: uvicorn, no UI, a fresh SQLite database),
started for this test alone because the test kills it; the drop is 12 synthetic people on a local pool.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from ops_helpers import QUICK_GATE, ROOT, clean_env
from prefect_shared import SharedServer, wait_healthy

from deid.intake.synth import make_synthetic_drop

pytestmark = [pytest.mark.slow, pytest.mark.ops]
GATE_STARTED = "gate: attacks on"  # the gate's first progress line (deid.progress)
AFTER_VERDICT_MAX_S = 60.0  # the fix: ~5-10 s from the verdict to exit; the old code: 139-200 s


def test_the_prefect_api_killed_mid_gate_still_publishes_a_verifiable_release_and_exits_0(tmp_path):
    from deid.cli import main

    drop = make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=1)
    project = tmp_path / "project"
    server = SharedServer()
    try:
        wait_healthy(server.url, str(server.log), timeout=180)
        env = clean_env(project, tmp_path / "prefect-home", **QUICK_GATE, DEID_DASK_WORKERS="1",
                        PREFECT_API_URL=server.url, PYTHONPATH=str(ROOT))
        err_path = tmp_path / "run.err"
        with open(err_path, "wb") as err:
            run = subprocess.Popen([sys.executable, "-m", "deid.cli", "run", str(drop), "--k", "3"], env=env,
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
            try:
                deadline = time.monotonic() + 600
                while GATE_STARTED not in (log := err_path.read_text(errors="replace")):
                    assert run.poll() is None, f"deid run exited ({run.returncode}) before its gate:\n{log[-3000:]}"
                    assert time.monotonic() < deadline, f"no gate after 600 s:\n{log[-3000:]}"
                    time.sleep(0.1)
                os.killpg(server.proc.pid, signal.SIGKILL)  # the server and its children, at once
                server.proc.wait(timeout=10)
                at_kill = err_path.read_text(errors="replace")
                assert "gate: passed" not in at_kill and "verdict:" not in at_kill, "the gate ended before the kill"
                killed = time.monotonic()
                out, _ = run.communicate(timeout=300)
                after_kill = time.monotonic() - killed
            finally:
                if run.poll() is None:
                    os.killpg(run.pid, signal.SIGKILL)
                    run.wait(timeout=10)
    finally:
        server.stop()
    stderr = err_path.read_text(errors="replace")
    assert run.returncode == 0, f"exit {run.returncode}:\n{stderr[-4000:]}"
    assert "Traceback" not in stderr, stderr[-4000:]
    lost = [line for line in stderr.splitlines() if "stopped answering" in line]
    assert lost and all(f"the Prefect API {server.url} stopped answering" in line for line in lost), lost
    assert "published" in lost[0] and "deid verify" in lost[0], lost[0]
    assert after_kill < AFTER_VERDICT_MAX_S, f"{after_kill:.0f} s from the kill to exit:\n{stderr[-3000:]}"

    # Published and verifiable: the signed report says released, and `deid verify` passes on the release.
    (report,) = list((project / "reports").glob("rel-*/report.json"))
    release_id = report.parent.name
    assert json.loads(report.read_text())["verdict"] == "released"
    assert (report.parent / "report.json.sig").is_file()
    release = project / "data" / "releases" / release_id
    assert release.is_dir() and f"release: {release}" in out.decode()
    pub = project / "data" / "keys" / "dev_signing.pub.pem"
    assert main(["verify", str(release), "--public-key", str(pub)]) == 0
    assert main(["verify", str(report.parent), "--public-key", str(pub)]) == 0
    print(f"\nAPI killed mid-gate: exit 0, {after_kill:.1f} s from the kill to exit, release {release_id} verified")
