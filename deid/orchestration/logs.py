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


FLOW_RUN_LOGGER = "prefect.flow_runs"  # where Prefect's flow engine says "View at <flow run URL>"


class ViewLink(logging.Filter):
    """Prefect's ``View at <url>`` line replaced by ``text`` (a server without a UI has nothing at that URL)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("View at "):
            record.msg, record.args = self.text, ()
        return True


@contextlib.contextmanager
def report_instead_of_ui(reports_path) -> Iterator[ViewLink]:
    """While a run talks to a server whose UI is off: its ``View at`` line says where the report will be."""
    link = ViewLink(f"no Prefect UI for this run (temporary server, UI off; `deid server` gives one): the report will "
                    f"be {reports_path}/<release id>/report.html")
    logger = logging.getLogger(FLOW_RUN_LOGGER)
    logger.addFilter(link)
    try:
        yield link
    finally:
        logger.removeFilter(link)
