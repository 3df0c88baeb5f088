"""What keeps a small run short (issue 9): validation on the warm pool, no cluster for nothing, a clean exit."""
from __future__ import annotations

import functools
import os
import time

from deid.operations.executors import LocalExecutor, PoolExecutor
from deid.operations.run_setup import validate_off_main


def whoami(**kwargs) -> tuple[int, dict]:
    return os.getpid(), kwargs


def test_call_remote_runs_on_a_pool_process_once_it_is_warm_and_here_otherwise():
    pool = PoolExecutor(2, warm=None, validate=functools.partial(time.sleep, 1.5))
    pool.warm_wait = 0.2
    try:
        assert pool.call_remote(whoami, a=1)[0] == os.getpid()  # far from warm (a busy machine): not waited for
        assert not all(f.done() for f in pool._warming)
        pool.warm_wait = 30.0  # a warm-up within the bound is waited for (here: the rest of the 1.5 s sleep)
        pid, kw = pool.call_remote(whoami, a=1)
        assert all(f.done() for f in pool._warming)
        assert pid != os.getpid() and kw == {"a": 1}
        # The validation suites go there; executors without a pool run them here.
        assert validate_off_main(pool, whoami, b=2)[0] != os.getpid()
    finally:
        pool.close()
    assert PoolExecutor(1).call_remote(whoami, a=1) == (os.getpid(), {"a": 1})
    assert validate_off_main(LocalExecutor(), whoami, b=2) == (os.getpid(), {"b": 2})
    assert validate_off_main(None, whoami) == (os.getpid(), {})


def test_the_dask_cluster_of_a_run_starts_only_when_a_stage_uses_it(tmp_path, monkeypatch):
    import contextlib

    import deid.orchestration.cluster as cluster
    from deid.run_config import RunConfig
    from deid.settings import Settings

    started = []

    @contextlib.contextmanager
    def fake_cluster(address, *, workers):
        started.append(workers)
        yield "tcp://127.0.0.1:1"

    monkeypatch.setattr(cluster, "dask_cluster", fake_cluster)
    config = RunConfig.resolve(Settings(data_dir=tmp_path / "data", reports_dir=tmp_path / "reports"), k=2)
    # No manifest: not a small drop's pool (e.g. an unreadable drop, rejected at ingest).
    with cluster.dask_executor(config, drop=tmp_path / "missing") as executor:
        assert "not started" in repr(executor) and started == []
    assert started == []
    with cluster.dask_executor(config, drop=tmp_path / "missing") as executor:
        assert executor.address == "tcp://127.0.0.1:1" and started == [config.dask_workers]
        assert executor.address == "tcp://127.0.0.1:1" and len(started) == 1  # started once


def test_a_temporary_server_gets_the_runs_logs_and_events_before_it_stops(monkeypatch):
    import deid.orchestration.prefect_api as prefect_api

    flushed = []
    monkeypatch.setattr(prefect_api, "flush_to_api", lambda: flushed.append(True))
    prefect_api.PrefectApi("deid-server", "http://127.0.0.1:1/api").stop()
    prefect_api.PrefectApi("temporary").stop()  # never started: nothing to flush to
    assert flushed == []
    prefect_api.PrefectApi("temporary", "http://127.0.0.1:1/api").stop()
    assert flushed == [True]
