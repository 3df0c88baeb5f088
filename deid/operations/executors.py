"""Where the heavy stage functions run: in this process, or on a Dask cluster.

A stage of :mod:`deid.operations.pipeline` hands its per-part work (plain functions of :mod:`deid.operations.stages`
with paths and small parameters) to an executor; it never knows which one. Dask workers import
only the core, never Prefect.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)
_clients: dict[str, Any] = {}


class Executor(Protocol):
    """Runs ``fn(**kwargs)`` for each call; results come back in the order of ``calls``."""

    workers: int

    def map(self, fn: Callable[..., Any], calls: Sequence[Mapping[str, Any]], *,
            on_done: Callable[[Any], None] | None = None) -> list[Any]: ...

    def share(self, obj: Any) -> Any: ...


class LocalExecutor:
    """Every call in this process, one after the other (the Prefect-free runner, tests, notebooks)."""

    workers = 1

    def map(self, fn, calls, *, on_done=None):
        out = []
        for kwargs in calls:
            out.append(fn(**kwargs))
            if on_done is not None:
                on_done(out[-1])
        return out

    def share(self, obj):
        return obj


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

    def map(self, fn, calls, *, on_done=None):
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
    """
    from distributed import get_worker, worker_client  # noqa: PLC0415

    try:
        get_worker()
    except ValueError:
        return list(map(fn, *iterables))
    with worker_client() as client:
        return client.gather(client.map(fn, *iterables, pure=False))
