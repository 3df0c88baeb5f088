"""A process pool for small drops and the gate's helper: this process plus spawned ones, calls in list order.

A base module (no deid import): the operations layer runs a small drop's stages on it
(:mod:`deid.operations.executors` re-exports it with the Dask executor), and the gate
(:mod:`deid.evaluation.gate`, a lower layer) runs a large release's checks on a helper process of
its own. ``warm`` is what each pool process runs first (the stages' imports:
:func:`deid.operations.executors.warm_worker`); None (the default) warms nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

__all__ = ["Executor", "LocalExecutor", "PoolExecutor", "exit_without_teardown"]


class Executor(Protocol):
    """Runs ``fn(**kwargs)`` for each call; results come back in the order of ``calls``.

    ``ahead``: calls each worker process may hold queued behind its running one (for many calls
    of about equal cost: see :meth:`PoolExecutor.map`); executors that queue everything ignore it.
    """

    workers: int

    def map(self, fn: Callable[..., Any], calls: Sequence[Mapping[str, Any]], *,
            on_done: Callable[[Any], None] | None = None, ahead: int = 0) -> list[Any]: ...

    def share(self, obj: Any) -> Any: ...


class LocalExecutor:
    """Every call in this process, one after the other (the Prefect-free runner, tests, notebooks)."""

    workers = 1

    def map(self, fn, calls, *, on_done=None, ahead=0):
        out = []
        for kwargs in calls:
            out.append(fn(**kwargs))
            if on_done is not None:
                on_done(out[-1])
        return out

    def share(self, obj):
        return obj


def exit_without_teardown(code: int = 0) -> None:
    """End this process now with ``code``: logs shut down and stdio flushed, the interpreter not torn down.

    For a process's last exit handler (a pool process, a ``deid run``): tearing down what it
    imported (dlib, Great Expectations, scikit-learn, Prefect...) costs seconds of CPU on a busy
    machine, and whoever waits for the process waits for that.
    """
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - a closed stream: nothing to flush
            pass
    os._exit(code)


def _worker_start(parent: int) -> None:
    """Initializer of a :class:`PoolExecutor` process: die with the run (Linux), one BLAS thread, a quick exit."""
    import atexit  # noqa: PLC0415
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    atexit.register(exit_without_teardown)  # before anything the process imports: runs after their exit handlers
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    if sys.platform.startswith("linux"):
        import ctypes  # noqa: PLC0415
        import signal  # noqa: PLC0415

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: a killed run leaves no worker
        if os.getppid() != parent:
            os._exit(1)


class PoolExecutor:
    """``workers`` cores' worth of calls for small drops: this process plus ``workers - 1`` spawned ones.

    A Dask ``LocalCluster`` costs a scheduler, a nanny and a worker process per core, each importing
    distributed and the stages (measured ~6 s of CPU on 2 cores), before its first task; a drop
    of a few hundred faces is done in less. Here the calls go to a ``concurrent.futures`` process
    pool (``spawn``: this process has Prefect's threads, never fork it) and this process takes
    calls too, so it works instead of waiting: calls start in list order on whichever process is
    free. Results come back in the order of ``calls`` and are what the same functions return on Dask.
    """

    warm_wait = 1.0  # seconds call_remote waits for a pool process's validate warm-up

    def __init__(self, workers: int = 2, *, warm: Callable[[], None] | None = None,
                 validate: Callable[[], None] | None = None):
        import os  # noqa: PLC0415

        self.workers = max(1, int(workers))
        self._pool = None
        self._warming: list = []
        self._submitted: list = []  # calls submit() queued: map hands a pool process nothing before they are done
        if self.workers > 1:
            import multiprocessing  # noqa: PLC0415
            from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

            self._pool = ProcessPoolExecutor(self.workers - 1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_worker_start, initargs=(os.getpid(),))
            if validate is not None:
                # First: the run's first validation suite comes soon after it starts (call_remote).
                self._warming = [self._pool.submit(validate) for _ in range(self.workers - 1)]
            if warm is not None:
                for _ in range(self.workers - 1):
                    self._pool.submit(warm)

    def map(self, fn, calls, *, on_done=None, ahead=0):
        """``fn(**kwargs)`` for each call, here and on the pool processes; results in the order of ``calls``.

        ``ahead``: calls a pool process gets queued behind its running one. With 0 (the default) a
        pool process is handed its next call only when it returns its last: calls start in list
        order on whichever process is free, the best for calls of unequal cost (longest first).
        But a call that holds the GIL here (dlib holds it for a whole network pass) delays the
        threads of this process that hand calls on, and the pool process waits that long between
        two calls (measured up to 2.4 s at load 8 with 20-face embedding chunks). With ``ahead=1``
        the next call is already in the pool process's pipe; the price is that a queued call can
        no longer run here, so use it for many calls of about equal, small cost.
        """
        calls = list(calls)
        if self._pool is None or len(calls) < 2:
            return LocalExecutor().map(fn, calls, on_done=on_done)
        import queue  # noqa: PLC0415
        import threading  # noqa: PLC0415
        from collections import deque  # noqa: PLC0415

        # Calls start in list order on whichever process is free: each pool process is fed by a
        # thread that hands it the next call only when its last one is done (a pool queues calls
        # ahead, and a queued call can no longer run here; ``ahead`` allows that many), and this
        # process takes the next call between its own. Callers put their longest calls first.
        todo = deque(range(len(calls)))
        out: list[Any] = [None] * len(calls)
        finished: queue.SimpleQueue = queue.SimpleQueue()

        feeders = [threading.Thread(target=self._feed, args=(self._pool, fn, calls, todo, out, finished, ahead),
                                    daemon=True)
                   for _ in range(self.workers - 1)]
        for t in feeders:
            t.start()
        reported = 0

        def report(block: bool) -> None:
            nonlocal reported
            while reported < len(calls):
                try:
                    i, exc = finished.get(block=block)
                except queue.Empty:
                    return
                if exc is not None:
                    raise exc
                reported += 1
                if on_done is not None:
                    on_done(out[i])

        try:
            while True:
                report(block=False)
                try:
                    i = todo.popleft()
                except IndexError:
                    break
                try:
                    out[i] = fn(**calls[i])
                finally:
                    finished.put((i, None))
            report(block=True)
        except BaseException:
            todo.clear()
            raise
        finally:
            for t in feeders:
                t.join()
        return out

    def _feed(self, pool, fn, calls, todo, out, finished, ahead) -> None:
        """One feeder thread of :meth:`map`: hands one pool process the next call when its last is done.

        Submits to ``pool`` (this executor's process pool). Takes call indices from ``todo`` (shared with the calling thread, which runs calls too), keeps
        at most ``ahead`` calls queued behind the running one, stores results in ``out`` and puts
        ``(index, None)`` on ``finished`` per result, or ``(index, exception)`` once on a failure (after
        clearing ``todo`` and cancelling what it had queued), for the caller's thread to raise.
        """
        import concurrent.futures  # noqa: PLC0415
        from collections import deque  # noqa: PLC0415

        sent: deque = deque()  # (index, future): the running call first, then those queued behind it
        i = -1
        try:
            # A call queued behind submit()'s would wait there while this process could run it.
            concurrent.futures.wait(self._submitted)
            while True:
                while len(sent) <= max(0, int(ahead)):
                    try:
                        i = todo.popleft()
                    except IndexError:
                        break
                    sent.append((i, pool.submit(fn, **calls[i])))
                if not sent:
                    return
                i, fut = sent.popleft()
                out[i] = fut.result()
                finished.put((i, None))
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            todo.clear()
            for _, f in sent:
                f.cancel()
            finished.put((i, exc))

    def share(self, obj):
        return obj  # sent with each call (few calls per stage on a small drop)

    def submit(self, fn, /, **kwargs):
        """``fn(**kwargs)`` queued on the pool process now, as a future (done here, at once, without a pool).

        With one pool process (``workers=2``) submitted calls run in submission order, and :meth:`map`
        hands that process no call before they are done (this process takes the calls meanwhile).
        """
        if self._pool is None:
            from concurrent.futures import Future  # noqa: PLC0415

            fut: Future = Future()
            try:
                fut.set_result(fn(**kwargs))
            except Exception as exc:  # noqa: BLE001 - raised by the future's result(), like a pool's
                fut.set_exception(exc)
            return fut
        fut = self._pool.submit(fn, **kwargs)
        self._submitted = [f for f in self._submitted if not f.done()] + [fut]
        return fut

    def call_remote(self, fn, /, **kwargs):
        """``fn(**kwargs)`` on a pool process once its ``validate`` warm-up is done, else here.

        For the validation suites (``validate=warm_validation``: the pool processes import Great
        Expectations first, while this process starts the run), so this process does not pay for
        it. A warm-up still running is waited for up to ``warm_wait`` seconds: it started with the
        run, so it is usually nearly done, and importing here costs this process the whole ~2.4
        CPU-s (measured: a run whose ingest came 0.56 s before the pool's warm-up ended spent 2.4
        CPU-s on it here, at load 8). A pool further behind (a busy machine) is not waited for
        longer. Here too without a pool, or without ``validate``.
        """
        if self._pool is None or not self._warming:
            return fn(**kwargs)
        if not all(f.done() for f in self._warming):
            import concurrent.futures  # noqa: PLC0415

            concurrent.futures.wait(self._warming, timeout=self.warm_wait)
            if not all(f.done() for f in self._warming):
                return fn(**kwargs)
        return self._pool.submit(fn, **kwargs).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __repr__(self) -> str:
        return f"PoolExecutor(workers={self.workers})"
