"""The core's progress lines (``deid.progress``) on the flow run's page in the Prefect UI.

Stages that get the run logger log their progress there already; the gate's attacks and
utility folds and the partition's face descriptors log to ``deid.progress`` (the core knows
no Prefect). While a release runs, this forwards those records to Prefect's API log handler,
which files them under the current flow or task run. The console is untouched (the records
still propagate to whatever ``deid run`` or the caller set up).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from prefect.context import get_run_context
from prefect.exceptions import MissingContextError
from prefect.logging.handlers import APILogHandler

from deid.progress import LOGGER


class _InRun(logging.Filter):
    """Only records made inside a flow or task run (a thread outside one has no run to file them under)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            get_run_context()
        except MissingContextError:
            return False
        return True


@contextlib.contextmanager
def progress_to_ui() -> Iterator[logging.Handler]:
    """Send ``deid.progress`` records to the Prefect API for the duration of the block."""
    handler = APILogHandler()
    handler.addFilter(_InRun())
    handler.setLevel(logging.INFO)
    logger = logging.getLogger(LOGGER)
    level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)  # progress is INFO; a library caller's quiet root would drop it before the UI
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)  # what it queued is sent by Prefect's log worker with the run's own lines
