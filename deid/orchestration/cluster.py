"""The Dask cluster the heavy stages run on: a LocalCluster by default, or DEID_DASK_ADDRESS.

A small drop (at most ``DEID_LOCAL_POOL_MAX_RECORDS`` manifest rows) runs on a
:class:`~deid.pool.PoolExecutor` instead: the same stage functions on
``DEID_DASK_WORKERS`` local processes, without a scheduler and nannies to start.
"""
from __future__ import annotations

import contextlib
import csv
import logging
import os
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from deid.operations.executors import (  # noqa: F401 (client_for re-exported)
    DaskExecutor,
    PoolExecutor,
    bound_message_logs,
    client_for,
    close_client,
    warm_validation,
    warm_worker,
)

log = logging.getLogger(__name__)
_prestarted: dict[int, PoolExecutor] = {}  # workers -> a pool started early by `deid run`, not yet used


@contextlib.contextmanager
def dask_cluster(address: str | None, *, workers: int = 2) -> Iterator[str]:
    """Yield a scheduler address: the configured one, or a LocalCluster's for the run's lifetime.

    Workers are processes with one thread each: OpenCV and NumPy hold the GIL in places, and
    one thread per core avoids oversubscription on small machines.
    """
    if address:
        yield address
        return
    from distributed import LocalCluster  # noqa: PLC0415 - ~1 s of imports; `deid run` imports this module early

    # The scheduler lives in this process; its start-up and per-connection INFO lines would bury
    # the run's progress.
    for name in ("distributed", "distributed.scheduler", "distributed.core", "distributed.nanny",
                 "distributed.http.proxy", "distributed.diskutils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    bound_message_logs()  # the scheduler here and the workers' streams keep no block payloads (issue 13)
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=logging.WARNING)
    try:
        yield cluster.scheduler_address
    finally:
        close_client(cluster.scheduler_address)
        cluster.close()


def manifest_rows(drop: str | Path | None, *, stop_after: int) -> int | None:
    """Rows of the drop's manifest.csv, counting at most ``stop_after + 1``; None if it cannot be read.

    Opened as every drop file is (:func:`deid.intake.drop_files.open_drop_file`): a FIFO, device or
    symlink is None here at once (the ingest then signs the rejection naming it), never a wait.
    """
    from deid.errors import RecordError  # noqa: PLC0415
    from deid.intake.drop import MANIFEST  # noqa: PLC0415
    from deid.intake.drop_files import open_drop_file  # noqa: PLC0415

    if drop is None:
        return None
    try:
        fd = open_drop_file(Path(drop), MANIFEST)
    except (RecordError, OSError):
        return None
    try:
        with os.fdopen(fd, newline="", encoding="utf-8", errors="replace") as f:
            rows = -1  # the header
            for rows, _ in enumerate(csv.reader(f)):
                if rows > stop_after:
                    break
            return max(rows, 0)
    except (OSError, csv.Error):
        return None


def uses_pool(drop: str | Path | None, *, address: str | None, max_records: int) -> bool:
    """True when the drop's heavy stages run on a local pool: no Dask address and a small enough drop."""
    if address or max_records <= 0:
        return False
    rows = manifest_rows(drop, stop_after=max_records)
    return rows is not None and rows <= max_records


def needs_recognizer(config, drop: str | Path | None) -> bool:
    """Does the run embed its faces with the dlib recogniser (the identity check of an image drop this small)?"""
    if getattr(config, "kind", "images") != "images" or config.identity_embed_max <= 0:
        return False
    rows = manifest_rows(drop, stop_after=config.identity_embed_max)
    return rows is not None and 0 < rows <= config.identity_embed_max


def _pool(workers: int, *, recognizer: bool) -> PoolExecutor:
    # The pool validates only for a process that has not imported Great Expectations (a served
    # process keeps it from its first run).
    validate = None if "great_expectations" in sys.modules else warm_validation
    return PoolExecutor(workers, warm=partial(warm_worker, recognizer=recognizer), validate=validate)


def prestart_pool(workers: int, *, recognizer: bool = True) -> PoolExecutor:
    """Start (and warm up) the pool a small run will use, before the run's own imports and server start.

    ``recognizer``: its processes load the dlib recogniser while warming (:func:`needs_recognizer`).
    """
    pool = _prestarted.get(workers)
    if pool is None:
        pool = _prestarted[workers] = _pool(workers, recognizer=recognizer)
    return pool


def close_prestarted() -> None:
    """Shut down a prestarted pool that no run took."""
    while _prestarted:
        _prestarted.popitem()[1].close()


def _run_logger():
    from prefect import get_run_logger  # noqa: PLC0415
    from prefect.exceptions import MissingContextError  # noqa: PLC0415

    try:
        return get_run_logger()
    except MissingContextError:
        return log


@contextlib.contextmanager
def dask_executor(config, *, drop: str | Path | None = None) -> Iterator[DaskExecutor | PoolExecutor]:
    """The run's executor (``cluster`` of :func:`~deid.operations.runner.run_release`): Dask, or a small drop's pool."""
    from deid.settings import Settings  # noqa: PLC0415

    if uses_pool(drop, address=config.dask_address, max_records=Settings().local_pool_max_records):
        pool = (_prestarted.pop(config.dask_workers, None)
                or _pool(config.dask_workers, recognizer=needs_recognizer(config, drop)))
        _run_logger().info("heavy stages on %d local processes (this drop has at most DEID_LOCAL_POOL_MAX_RECORDS="
                           "%d records; no Dask cluster started)", pool.workers, Settings().local_pool_max_records)
        try:
            yield pool
        finally:
            pool.close()
        return
    with contextlib.ExitStack() as stack:
        yield _LazyDaskExecutor(lambda: stack.enter_context(dask_cluster(config.dask_address,
                                                                          workers=config.dask_workers)))


class _LazyDaskExecutor(DaskExecutor):
    """A :class:`DaskExecutor` whose cluster starts at its first use (a drop found unreadable starts none)."""

    def __init__(self, start):  # noqa: D107 - no super().__init__: the address comes from start()
        self._start = start
        self._address = None

    @property
    def address(self) -> str:
        if self._address is None:
            self._address = self._start()
        return self._address

    def __repr__(self) -> str:
        return f"DaskExecutor({self._address or 'not started'!r})"
