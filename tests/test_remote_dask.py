"""DEID_DASK_ADDRESS: the release flow on an external scheduler + two workers, one killed mid-run."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from ops_helpers import QUICK_GATE, Proc, clean_env, free_port, wait_for

from deid.intake.synth import make_synthetic_drop
from deid.release.verify import verify_report

pytestmark = [pytest.mark.slow, pytest.mark.ops]
ROOT = Path(__file__).resolve().parents[1]

FLOW = """
import json, sys
from deid.orchestration.flow import run_flow
if __name__ == "__main__":
    result = run_flow(sys.argv[1], k=5)
    print("RESULT " + json.dumps(result.summary()))
"""


def _dask() -> list[str]:
    exe = Path(sys.executable).parent / "dask"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dask"]


def test_release_survives_a_worker_killed_mid_run(tmp_path, prefect_server):
    from prefect.settings import PREFECT_API_URL

    logs = tmp_path / "logs"
    logs.mkdir()
    project = tmp_path / "project"
    drop = make_synthetic_drop(tmp_path / "drop", people=60, images_per_person=2, seed=7)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    # The session's Prefect API (the flow would otherwise start an ephemeral server of its own).
    env = clean_env(project, tmp_path / "prefect", **QUICK_GATE, PREFECT_API_URL=PREFECT_API_URL.value())
    procs: list[Proc] = []
    try:
        procs.append(Proc("scheduler", [*_dask(), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                        "--no-dashboard"], env=env, logs=logs))
        workers = {}
        for name in ("wA", "wB"):
            workers[name] = Proc(name, [*_dask(), "worker", address, "--name", name, "--nthreads", "1",
                                        "--nworkers", "1", "--no-dashboard", "--host", "127.0.0.1"],
                                 env=env, logs=logs)
            procs.append(workers[name])
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
        # Small row groups: 30 align tasks spread over both workers, so a kill lands mid-stage.
        run_env = dict(env, DEID_DASK_ADDRESS=address, DEID_ALIGN_BATCH_SIZE="4")
        script = tmp_path / "run_flow.py"
        script.write_text(FLOW)
        t0 = time.monotonic()
        flow = Proc("flow", [sys.executable, str(script), str(drop)], env=run_env, logs=logs)
        procs.append(flow)
        killed: dict = {}

        def kill_when_align_started() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and flow.alive():
                parts = list((project / "data" / "staging").glob("*/aligned/part-*.parquet"))
                if parts:
                    os.killpg(workers["wA"].p.pid, signal.SIGKILL)
                    killed.update(at=time.monotonic() - t0, aligned_parts=len(parts))
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_when_align_started, daemon=True)
        killer.start()
        wait_for("the release flow", lambda: not flow.alive(), 180, interval=0.5)
        killer.join(timeout=5)
        elapsed = time.monotonic() - t0
        out = flow.log.read_text(errors="replace")
        assert flow.p.returncode == 0, flow.tail(60)
        assert killed, "the worker was never killed: the align stage left no part file\n" + flow.tail()
        assert workers["wA"].p.wait(timeout=10) is not None and workers["wB"].alive()
        sched_log = procs[0].log.read_text(errors="replace")
        assert any("Remove worker" in line and "wA" in line for line in sched_log.splitlines()), procs[0].tail()
        result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
        # A correct, complete release: every record accounted for, released, verified.
        assert result["verdict"] == "released", result["reasons"]
        ds = result["dataset"]
        assert ds["records_in"] == 120
        assert ds["records_quarantined"] == 0 and ds["records_suppressed"] == 0
        assert ds["records_released"] == 120
        staging = Path(result["staging"])
        aligned = sorted((staging / "aligned").glob("part-*.parquet"))
        assert len(aligned) == 30
        ids = [r for p in aligned for r in pq.read_table(p, columns=["record_id"]).column("record_id").to_pylist()]
        assert len(ids) == len(set(ids)) == 120  # re-run tasks rewrote their part, never duplicated it
        table = pq.read_table(Path(result["release_dir"]) / "release.parquet")
        assert table.num_rows == 120 and len(set(table.column("record_id").to_pylist())) == 120
        report = json.loads(Path(result["report"]).read_text())
        assert report["configuration"]["dask"] == address
        assert report["privacy"]["max_rate"] <= 1 / 5
        assert verify_report(Path(result["report_dir"]), public_key=Path(result["public_key"])).ok
        print(f"\nremote dask: worker wA killed {killed['at']:.1f} s into the run "
              f"({killed['aligned_parts']}/30 align parts written); release in {elapsed:.1f} s")
    finally:
        for p in reversed(procs):
            p.stop(timeout=5)
        shutil.rmtree(project / "data" / "staging", ignore_errors=True)
