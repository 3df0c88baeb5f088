"""PoolExecutor.submit: a job queued on the pool process ahead; map hands that process nothing until it is done."""
from __future__ import annotations

import os
import time

from deid.operations.executors import PoolExecutor


def _nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_map_runs_its_calls_here_while_a_submitted_job_holds_the_pool_process():
    pool = PoolExecutor(2, warm=None)
    try:
        job = pool.submit(_nap, seconds=1.5)
        pids = pool.map(_nap, [dict(seconds=0.05)] * 6)
        assert job.result() != os.getpid()  # the job ran on the pool process
        assert pids == [os.getpid()] * 6  # no call waited behind it there
        assert set(pool.map(_nap, [dict(seconds=0.3)] * 2)) != {os.getpid()}  # once it is done, the pool takes calls
    finally:
        pool.close()
    assert PoolExecutor(1).submit(_nap, seconds=0).result() == os.getpid()  # no pool: done here
