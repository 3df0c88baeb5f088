"""The Dask cluster the heavy stages run on: a LocalCluster by default, or DEID_DASK_ADDRESS."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from distributed import Client, LocalCluster

log = logging.getLogger(__name__)
_clients: dict[str, Client] = {}


@contextlib.contextmanager
def dask_cluster(address: str | None, *, workers: int = 2) -> Iterator[str]:
    """Yield a scheduler address: the configured one, or a LocalCluster's for the run's lifetime.

    Workers are processes with one thread each: OpenCV and NumPy hold the GIL in places, and
    one thread per core avoids oversubscription on small machines.
    """
    if address:
        yield address
        return
    # The scheduler lives in this process; its start-up and per-connection INFO lines would bury
    # the run's progress.
    for name in ("distributed", "distributed.scheduler", "distributed.core", "distributed.nanny",
                 "distributed.http.proxy", "distributed.diskutils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=logging.WARNING)
    try:
        yield cluster.scheduler_address
    finally:
        client = _clients.pop(cluster.scheduler_address, None)
        if client is not None:
            client.close()
        cluster.close()


def client_for(address: str) -> Client:
    """One client per scheduler address per process (connecting is cheap, but not free)."""
    client = _clients.get(address)
    if client is None or client.status in ("closed", "closing"):
        client = Client(address, set_as_default=False)
        _clients[address] = client
    return client


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
