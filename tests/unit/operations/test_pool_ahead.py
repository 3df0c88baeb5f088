"""PoolExecutor.map(..., ahead=1): a pool process holds its next call queued, results still in call order."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from deid.operations.executors import PoolExecutor


def slow_whoami(i: int) -> tuple[int, int]:
    time.sleep(0.03)  # sleeping releases the GIL: the feeder thread gets its share of the calls
    return i, os.getpid()


class _CountingPool:
    """A one-thread stand-in for the process pool that records how many calls were ever outstanding."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1)
        self._lock = threading.Lock()
        self.outstanding = self.most = 0

    def submit(self, fn, /, **kwargs):
        with self._lock:
            self.outstanding += 1
            self.most = max(self.most, self.outstanding)
        fut = self._pool.submit(fn, **kwargs)
        fut.add_done_callback(lambda _: self._settle())
        return fut

    def _settle(self):
        with self._lock:
            self.outstanding -= 1

    def shutdown(self, wait=True, cancel_futures=False):
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def _pool_with(stand_in: _CountingPool) -> PoolExecutor:
    ex = PoolExecutor(1)
    ex.workers, ex._pool = 2, stand_in
    return ex


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_pool_process_gets_ahead_calls_queued_behind_its_running_one(ahead):
    stand_in = _CountingPool()
    ex = _pool_with(stand_in)
    try:
        done = []
        out = ex.map(slow_whoami, [dict(i=i) for i in range(12)], on_done=done.append, ahead=ahead)
    finally:
        ex.close()
    assert [i for i, _ in out] == list(range(12))
    assert sorted(done) == sorted(out)
    assert stand_in.most == 1 + ahead


def fail_off_main_thread(i: int) -> int:
    time.sleep(0.03)
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(f"call {i} failed on the pool")
    return i


def test_a_failing_pool_call_with_queued_calls_is_raised_here():
    ex = _pool_with(_CountingPool())
    try:
        with pytest.raises(ValueError, match="failed on the pool"):
            ex.map(fail_off_main_thread, [dict(i=i) for i in range(12)], ahead=1)
    finally:
        ex.close()


def test_a_real_pool_with_calls_queued_ahead_returns_them_in_call_order():
    pool = PoolExecutor(2, warm=None)
    try:
        out = pool.map(slow_whoami, [dict(i=i) for i in range(10)], ahead=1)
    finally:
        pool.close()
    assert [i for i, _ in out] == list(range(10))
    assert len({pid for _, pid in out}) == 2  # the pool process and this one both worked
