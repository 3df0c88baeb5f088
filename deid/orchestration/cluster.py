"""The Dask cluster the heavy stages run on: a LocalCluster by default, or DEID_DASK_ADDRESS."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from distributed import LocalCluster

from deid.operations.executors import DaskExecutor, client_for, close_client  # noqa: F401 (client_for re-exported)

log = logging.getLogger(__name__)


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
        close_client(cluster.scheduler_address)
        cluster.close()


@contextlib.contextmanager
def dask_executor(config) -> Iterator[DaskExecutor]:
    """The run's :class:`~deid.operations.executors.DaskExecutor` (``cluster`` of :func:`deid.operations.runner.run_release`)."""
    with dask_cluster(config.dask_address, workers=config.dask_workers) as address:
        yield DaskExecutor(address)
