"""DEID_DASK_ADDRESS: the release flow on an external scheduler + three workers, one killed mid-run.

The release is byte for byte the release of a local run on the same drop (issue 13: "a test starts
a scheduler and 3 worker processes on loopback and shows the same release"), k-Same's blocks are
Dask tasks spread over the workers, and the killed worker's tasks are re-run without duplicates.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from ops_helpers import QUICK_GATE, Proc, clean_env, free_port, wait_for

from deid.anonymise.ksame import KSame
from deid.anonymise.ksame_blocks import plan_blocks
from deid.intake.synth import make_synthetic_drop
from deid.reporting.verify import verify_report

pytestmark = [pytest.mark.slow, pytest.mark.ops]
ROOT = Path(__file__).resolve().parents[2]
K = 5
BLOCK_SIZE = 40  # 120 faces of 60 people -> 4 blocks of 30 (each side of a cut keeps >= 2k people)
# Small row groups: 30 align tasks spread over the workers, so a kill lands mid-stage. The local
# reference run uses the same settings: the release must not depend on where the work ran.
# DEID_KEEP_STAGING=all: the test reads the finished runs' staging (aligned parts, partitions, de-identified parts),
# which the default retention policy removes at the end of a run (issue 32).
RUN_ENV = {**QUICK_GATE, "DEID_KSAME_BLOCK_SIZE": str(BLOCK_SIZE), "DEID_ALIGN_BATCH_SIZE": "4",
           "DEID_KEEP_STAGING": "all"}

FLOW = """
import json, sys
from deid.flows.release import run_flow
if __name__ == "__main__":
    result = run_flow(sys.argv[1], k=%d, method="k-same")
    print("RESULT " + json.dumps(result.summary()))
""" % K


def _release_facts(result: dict) -> tuple[set, dict, Counter, Counter]:
    """(clusters as sets of staging record ids, record -> released pixels, image file hashes, cluster sizes)."""
    assert result["verdict"] == "released", result["reasons"]
    members: dict[str, set] = {}
    pixels: dict[str, bytes] = {}
    for part in sorted((Path(result["staging"]) / "deidentified").glob("*.parquet")):
        t = pq.read_table(part, columns=["record_id", "cluster", "pixels"]).to_pydict()
        for rid, c, px in zip(t["record_id"], t["cluster"], t["pixels"]):
            members.setdefault(c, set()).add(rid)  # staging ids are the manifest rows: the same in both runs
            pixels[rid] = px
    clusters = {frozenset(m) for m in members.values()}
    rel = Path(result["release_dir"])
    files = Counter(hashlib.sha256(p.read_bytes()).hexdigest() for p in (rel / "images").iterdir())
    sizes = Counter(Counter(pq.read_table(rel / "release.parquet").column("cluster_id").to_pylist()).values())
    return clusters, pixels, files, sizes


def _local_release(drop: Path, project: Path, monkeypatch) -> dict:
    """The reference: the Prefect-free runner in this process, its own project (not a second release)."""
    from deid.operations.runner import run_release
    from deid.run_config import RunConfig
    from deid.settings import Settings

    monkeypatch.delenv("DEID_DASK_ADDRESS", raising=False)
    for key, value in {**RUN_ENV, "DEID_PROJECT_DIR": str(project)}.items():
        monkeypatch.setenv(key, value)
    return run_release(drop, RunConfig.resolve(Settings(), k=K, method="k-same")).summary()


def _dask() -> list[str]:
    exe = Path(sys.executable).parent / "dask"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dask"]


def test_three_workers_one_killed_release_what_a_local_run_releases(tmp_path, prefect_server, monkeypatch):
    from distributed import Client, get_task_stream
    from prefect.settings import PREFECT_API_URL

    logs = tmp_path / "logs"
    logs.mkdir()
    project = tmp_path / "project"
    drop = make_synthetic_drop(tmp_path / "drop", people=60, images_per_person=2, seed=11, labels=False)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    # The session's Prefect API (the flow would otherwise start an ephemeral server of its own).
    env = clean_env(project, tmp_path / "prefect", **RUN_ENV, PREFECT_API_URL=PREFECT_API_URL.value())
    procs: list[Proc] = []
    try:
        procs.append(Proc("scheduler", [*_dask(), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                        "--no-dashboard"], env=env, logs=logs))
        workers = {}
        for name in ("wA", "wB", "wC"):
            workers[name] = Proc(name, [*_dask(), "worker", address, "--name", name, "--nthreads", "1",
                                        "--nworkers", "1", "--no-dashboard", "--host", "127.0.0.1"],
                                 env=env, logs=logs)
            procs.append(workers[name])
        run_env = dict(env, DEID_DASK_ADDRESS=address)
        script = tmp_path / "run_flow.py"
        script.write_text(FLOW)
        killed: dict = {}
        with Client(address, timeout=60) as client:
            client.wait_for_workers(3, timeout=60)
            with get_task_stream(client) as stream:  # every task the scheduler runs meanwhile, the flow's too
                t0 = time.monotonic()
                flow = Proc("flow", [sys.executable, str(script), str(drop)], env=run_env, logs=logs)
                procs.append(flow)

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
                wait_for("the release flow", lambda: not flow.alive(), 240, interval=0.5)
                killer.join(timeout=5)
            block_tasks = [t for t in stream.data if str(t["key"]).startswith("group_block-")]
        elapsed = time.monotonic() - t0
        out = flow.log.read_text(errors="replace")
        assert flow.p.returncode == 0, flow.tail(60)
        assert killed, "the worker was never killed: the align stage left no part file\n" + flow.tail()
        assert workers["wA"].p.wait(timeout=10) is not None and workers["wB"].alive() and workers["wC"].alive()
        sched_log = procs[0].log.read_text(errors="replace")
        assert any("Remove worker" in line and "wA" in line for line in sched_log.splitlines()), procs[0].tail()
        result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
        # A correct, complete release: every record accounted for, released, verified.
        assert result["verdict"] == "released", result["reasons"]
        counts = result["dataset"]
        assert counts["records_in"] == counts["records_released"] == 120
        assert counts["records_quarantined"] == 0 and counts["records_suppressed"] == 0
        staging = Path(result["staging"])
        aligned = sorted((staging / "aligned").glob("part-*.parquet"))
        assert len(aligned) == 30
        ids = [r for p in aligned for r in pq.read_table(p, columns=["record_id"]).column("record_id").to_pylist()]
        assert len(ids) == len(set(ids)) == 120  # re-run tasks rewrote their part, never duplicated it
        table = pq.read_table(Path(result["release_dir"]) / "release.parquet")
        assert table.num_rows == 120 and len(set(table.column("record_id").to_pylist())) == 120
        report = json.loads(Path(result["report"]).read_text())
        assert report["configuration"]["dask"] == address
        assert report["privacy"]["max_rate"] <= 1 / K
        assert verify_report(Path(result["report_dir"]), public_key=Path(result["public_key"])).ok

        # The partition really was grouped blockwise, one Dask task per block, on several workers.
        partition = ds.dataset(staging / "partitions" / "partition=p000", format="parquet")
        t = partition.to_table(columns=["record_id", "subject_id", "features"])  # the order the stage reads
        rids = np.asarray(t.column("record_id").to_pylist(), dtype=object)
        people = np.asarray(t.column("subject_id").to_pylist(), dtype=object)
        X = np.asarray(t.column("features").to_pylist(), dtype=np.float32).astype(np.float64)
        codes = np.unique(people, return_inverse=True)[1]
        n_blocks = len(plan_blocks(X, codes, k=K, block_size=BLOCK_SIZE))
        assert n_blocks >= 3
        assert len(block_tasks) >= n_blocks  # the first pass, plus the refinement rounds' regroupings
        assert len({t["worker"] for t in block_tasks}) >= 2, {t["worker"] for t in block_tasks}

        # The same release as a local run: clusters, every record's face and every published file.
        local = _local_release(drop, tmp_path / "local", monkeypatch)
        c1, p1, f1, s1 = _release_facts(local)
        c3, p3, f3, s3 = _release_facts(result)
        assert c3 == c1  # the same clusters (by source record)
        assert p3 == p1  # every record's released face, byte for byte
        assert f3 == f1 and sum(f1.values()) == 120  # the published PNG files, byte for byte
        assert s3 == s1 and all(len(c) >= K for c in c1)
        # And they are the clusters the serial estimator makes on the same features.
        serial = KSame(K, block_size=BLOCK_SIZE).fit(X, people=people, images=X)
        assert {frozenset(rids[serial.labels_ == c].tolist()) for c in range(serial.n_clusters_)} == c1
        print(f"\nremote dask: worker wA killed {killed['at']:.1f} s into the run "
              f"({killed['aligned_parts']}/30 align parts written); release in {elapsed:.1f} s; {n_blocks} k-Same "
              f"blocks, {len(block_tasks)} block tasks on {len({t['worker'] for t in block_tasks})} workers; "
              f"{len(c1)} clusters, identical to the local run")
    finally:
        for p in reversed(procs):
            p.stop(timeout=5)
        shutil.rmtree(project / "data" / "staging", ignore_errors=True)
