"""Where the heavy stage functions run: in this process, or on a Dask cluster.

A stage (:class:`deid.operations.runner.Steps`) hands its per-part work (plain functions of the ``worker_*`` modules
with paths and small parameters) to an executor; it never knows which one. Dask workers import
only the core, never Prefect.
"""
from __future__ import annotations

import logging
from typing import Any

# The in-process and process-pool executors are a base module (the gate's helper uses the pool too): re-exported.
from deid.pool import Executor, LocalExecutor, PoolExecutor, exit_without_teardown  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)
_clients: dict[str, Any] = {}


def warm_validation() -> None:
    """Great Expectations imported and its context made: a pool process's first warm-up job
    (:func:`deid.evaluation.validation.warm_validation`)."""
    from deid.evaluation.validation import warm_validation as warm  # noqa: PLC0415 - GX's import is slow: when asked

    warm()


def warm_worker(*, recognizer: bool = True) -> None:
    """What every stage needs, imported before the first call arrives; the dlib recogniser loaded if asked.

    Only a run whose identity check embeds its faces needs the recogniser early (partition); a
    later use (a gate attack in this process) loads it then.
    """
    # Every worker function's module (their imports are what a stage waits for).
    from deid.operations import (worker_align, worker_deidentify, worker_featurize,  # noqa: F401, PLC0415
                                 worker_gate, worker_lineage, worker_partition)

    if recognizer:
        from deid.alignment.dlib_models import dlib_model  # noqa: PLC0415

        dlib_model("recognizer")


class DaskExecutor:
    """Calls submitted to the Dask scheduler at ``address``; ``on_done`` sees results as they finish."""

    def __init__(self, address: str):
        self.address = address

    @property
    def client(self):
        return client_for(self.address)

    @property
    def workers(self) -> int:
        return max(1, len(self.client.scheduler_info()["workers"]))

    def map(self, fn, calls, *, on_done=None, ahead=0):
        from distributed import as_completed  # noqa: PLC0415

        client = self.client
        futures = [client.submit(fn, **kwargs, pure=False) for kwargs in calls]
        if on_done is not None:
            for fut in as_completed(futures, loop=client.loop):
                on_done(fut.result())
        return [f.result() for f in futures]

    def share(self, obj):
        """Send ``obj`` to every worker once (e.g. the fitted eigenface model)."""
        return self.client.scatter(obj, broadcast=True)

    def __repr__(self) -> str:
        return f"DaskExecutor({self.address!r})"


def client_for(address: str):
    """One Dask client per scheduler address per process (connecting is cheap, but not free)."""
    from distributed import Client  # noqa: PLC0415

    client = _clients.get(address)
    if client is None or client.status in ("closed", "closing"):
        client = Client(address, set_as_default=False)
        _clients[address] = client
    return client


def close_client(address: str) -> None:
    """Close this process's client of ``address`` (when its cluster shuts down)."""
    client = _clients.pop(address, None)
    if client is not None:
        client.close()


def map_on_cluster(fn, *iterables) -> list:
    """Order-keeping ``map`` that runs one Dask task per item, callable from inside a Dask task.

    The de-identification stage runs on a worker and passes this as k-Same's ``map_blocks``:
    the worker's client (``worker_client``, which secedes from the worker's thread pool while it
    waits, so a one-thread worker can run block tasks itself) submits one task per block and
    gathers the results in input order. Outside a worker it is the builtin ``map``: the
    clusters are the same either way.

    At most :data:`MAP_WINDOW` items are in flight: an item is taken from ``iterables`` (e.g. a
    lazy sequence of blocks) only when one finishes, so neither this worker nor the scheduler,
    which keeps every submitted task's arguments until it has run, holds all of them (issue 13).
    """
    import itertools  # noqa: PLC0415

    from distributed import as_completed, get_worker, worker_client  # noqa: PLC0415

    try:
        get_worker()
    except ValueError:
        return list(map(fn, *iterables))
    bound_message_logs()  # before the worker's client starts (its stream to the scheduler keeps the log)
    results: dict[int, Any] = {}
    with worker_client() as client:
        items = enumerate(zip(*iterables))
        running = as_completed()
        index = {}

        def submit(i, args):
            fut = client.submit(fn, *args, pure=False)
            index[fut.key] = i
            running.add(fut)

        for i, args in itertools.islice(items, MAP_WINDOW):
            submit(i, args)
        for fut in running:
            results[index.pop(fut.key)] = fut.result()
            fut.release()
            nxt = next(items, None)
            if nxt is not None:
                submit(*nxt)
    return [results[i] for i in range(len(results))]


MAP_WINDOW = 8  # block tasks in flight per map_on_cluster call (a block takes ~0.1-1 s; 2-3 workers stay busy)

# distributed keeps, for debugging, the last ``distributed.admin.low-level-log-length`` (default 1000)
# messages of every batched stream (those under 1 MB) and as many transitions. A block task's message
# carries its block's features (400 KB for 2,000 x 50 float32), so a worker's client and the scheduler
# (in the run process for a LocalCluster) held hundreds of block payloads long after they ran: at
# 200,000 faces +57 MB in the worker after the stage and +41 MB in the run process (issue 13).
MESSAGE_LOG_LENGTH = 20


def bound_message_logs() -> None:
    """Keep at most :data:`MESSAGE_LOG_LENGTH` messages in distributed's debugging logs of streams made from now on
    (in this process, and in the workers a LocalCluster started from it spawns); a lower setting stays."""
    import dask  # noqa: PLC0415

    key = "distributed.admin.low-level-log-length"
    if int(dask.config.get(key, MESSAGE_LOG_LENGTH)) > MESSAGE_LOG_LENGTH:
        dask.config.set({key: MESSAGE_LOG_LENGTH})
