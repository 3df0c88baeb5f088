"""k-Same blocks as Dask tasks: a scheduler + 3 worker processes give the release of one local worker."""
from __future__ import annotations

import hashlib
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from deid.anonymise.ksame import KSame, plan_blocks
from deid.intake.synth import make_synthetic_drop

pytestmark = [pytest.mark.slow, pytest.mark.ops]

K = 5
BLOCK_SIZE = 40  # 120 faces of 60 people -> 4 blocks of 30 (each side of a cut keeps >= 2k people)


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


def test_three_dask_workers_release_what_one_local_worker_releases(tmp_path, monkeypatch, prefect_server):
    from distributed import Client, LocalCluster, get_task_stream

    from deid.orchestration.flow import run_flow

    drop = make_synthetic_drop(tmp_path / "drop", people=60, images_per_person=2, seed=11, labels=False)
    monkeypatch.delenv("DEID_SIGNING_KEY", raising=False)
    monkeypatch.delenv("DEID_DASK_ADDRESS", raising=False)
    monkeypatch.setenv("DEID_KSAME_BLOCK_SIZE", str(BLOCK_SIZE))
    # Operations, not the gate's figures: no recogniser identity check, a small deep-attack sample.
    monkeypatch.setenv("DEID_IDENTITY_EMBED_MAX", "0")
    monkeypatch.setenv("DEID_DEEP_ATTACK_SAMPLE", "10")

    # Reference: the flow's own local cluster with a single worker. Separate projects, so the second
    # run is not a successive release of the same dataset (lineage would reuse the first's clusters).
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path / "one"))
    monkeypatch.setenv("DEID_DASK_WORKERS", "1")
    one = run_flow(str(drop), k=K, method="k-same").summary()

    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path / "three"))
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=logging.WARNING) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=60)
        monkeypatch.setenv("DEID_DASK_ADDRESS", cluster.scheduler_address)
        with get_task_stream(client) as stream:
            three = run_flow(str(drop), k=K, method="k-same").summary()
    block_tasks = [t for t in stream.data if str(t["key"]).startswith("group_block-")]

    # The partition really was grouped blockwise, one Dask task per block, on several workers.
    partition = ds.dataset(Path(three["staging"]) / "partitions" / "partition=p000", format="parquet")
    t = partition.to_table(columns=["record_id", "subject_id", "features"])  # the order the stage reads
    ids = np.asarray(t.column("record_id").to_pylist(), dtype=object)
    people = np.asarray(t.column("subject_id").to_pylist(), dtype=object)
    X = np.asarray(t.column("features").to_pylist(), dtype=np.float32).astype(np.float64)
    codes = np.unique(people, return_inverse=True)[1]
    n_blocks = len(plan_blocks(X, codes, k=K, block_size=BLOCK_SIZE))
    assert n_blocks >= 3
    assert len(block_tasks) >= n_blocks  # the first pass, plus the refinement rounds' regroupings
    assert len({t["worker"] for t in block_tasks}) >= 2, {t["worker"] for t in block_tasks}

    c1, p1, f1, s1 = _release_facts(one)
    c3, p3, f3, s3 = _release_facts(three)
    assert c3 == c1  # the same clusters (by source record)
    assert p3 == p1  # every record's released face, byte for byte
    assert f3 == f1 and sum(f1.values()) == 120  # the published PNG files, byte for byte
    assert s3 == s1
    assert all(len(c) >= K for c in c1)
    # And they are the clusters the serial estimator makes on the same features.
    serial = KSame(K, block_size=BLOCK_SIZE).fit(X, people=people, images=X)
    expected = {frozenset(ids[serial.labels_ == c].tolist()) for c in range(serial.n_clusters_)}
    assert expected == c1
    print(f"\n{n_blocks} blocks, {len(block_tasks)} block tasks on {len({t['worker'] for t in block_tasks})} "
          f"workers; {len(c1)} clusters, identical to the 1-worker run")


def test_map_on_cluster_outside_a_worker_is_the_builtin_map():
    from deid.operations.executors import map_on_cluster

    assert map_on_cluster(pow, [2, 3], [3, 2]) == [8, 9]


def test_map_blocks_must_be_callable():
    from deid.errors import ConfigError

    X = np.random.default_rng(0).normal(size=(12, 3))
    with pytest.raises(ConfigError, match="map_blocks=.*must be None or a callable"):
        KSame(2, map_blocks="dask").fit(X, people=np.arange(12), images=X)
