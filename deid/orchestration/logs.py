"""The core's progress lines (``deid.progress``) on the flow run's page in the Prefect UI.

Stages that get the run logger log their progress there already; the gate's attacks and
utility folds and the partition's face descriptors log to ``deid.progress`` (the core knows
no Prefect). While a release runs, this forwards those records to Prefect's API log handler,
which files them under the current flow or task run, and :class:`ProgressArtifacts` keeps a
progress artifact per long stage up to date. The console is untouched (the records still
propagate to whatever ``deid run`` or the caller set up).
"""
from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

from prefect.context import get_run_context
from prefect.exceptions import MissingContextError
from prefect.logging.handlers import APILogHandler

from deid.progress import LOGGER


FLOW_RUN_LOGGER = "prefect.flow_runs"  # where Prefect's flow engine says "View at <flow run URL>"
TASK_RUN_LOGGER = "prefect.task_runs"  # the run logger of the stages' tasks


class _InRun(logging.Filter):
    """Only records made inside a flow or task run, or filed under ``flow_run_id`` (a thread of the run's own,
    e.g. the gate's heartbeat, has no Prefect context); records with neither have no run to go to."""

    def __init__(self, flow_run_id: Any = None):
        super().__init__()
        self.flow_run_id = flow_run_id

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            get_run_context()
        except MissingContextError:
            if self.flow_run_id is None:
                return False
            record.flow_run_id = self.flow_run_id
        return True


def _artifact_key(stage: str) -> str:
    """``deid-progress-<stage>``: lowercase letters, digits and dashes (Prefect's rule), sizes dropped."""
    slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r" on \d+ \w+", "", stage.lower())).strip("-")
    return f"deid-progress-{slug[:60] or 'stage'}"


class ProgressArtifacts(logging.Handler):
    """A Prefect progress artifact per long stage (``create_progress_artifact``), updated from its progress lines.

    The core's progress lines carry their figures (``record.deid_progress``, :func:`deid.progress.figures`);
    this handler only queues the latest line of each stage, and a thread sends them, so a slow or lost
    API never holds up the work whose progress it shows (after a failure it stops trying).
    """

    def __init__(self, flow_run_id: Any, *, period: float = 1.0):
        super().__init__(level=logging.INFO)
        self.flow_run_id, self.period = flow_run_id, period
        self.ids: dict[str, Any] = {}  # stage -> artifact id
        self._latest: dict[str, tuple[float, str]] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._failed = False
        self._thread = threading.Thread(target=self._send_loop, name="deid progress artifacts", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        fig = getattr(record, "deid_progress", None)
        if not isinstance(fig, dict) or self._failed:
            return
        with self._cv:
            self._latest[str(fig["stage"])] = (round(100.0 * float(fig["share"]), 1), record.getMessage())
            self._cv.notify()

    def _send_loop(self) -> None:
        client = None
        try:
            while True:
                with self._cv:
                    while not self._latest and not self._closed:
                        self._cv.wait()
                    batch, self._latest = self._latest, {}
                    closed = self._closed
                if batch and not self._failed:
                    client = client or self._client()
                    self.send(batch, client=client)
                if closed and not self._latest:
                    return
                time.sleep(self.period)  # at most one update per stage per period
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.__exit__(None, None, None)

    def _client(self) -> Any:
        """One Prefect API client for the whole run: ``update_progress_artifact`` makes a client (and its TLS
        context, ~20 ms of CPU) per call, once a second per stage for the length of the run (issue 32)."""
        from prefect.client.orchestration import get_client  # noqa: PLC0415

        try:
            return get_client(sync_client=True).__enter__()
        except Exception as exc:  # noqa: BLE001 - a progress bar must never fail or slow the run
            self._stop(exc)
            return None

    def send(self, batch: dict[str, tuple[float, str]], *, client: Any = None) -> None:
        """Create or update each stage's artifact (a failure stops the updates: the run goes on).

        ``client``: an open sync Prefect client to send with (default: one for this call). An update is what
        ``prefect.artifacts.update_progress_artifact`` sends: the share (0-100) and the line.
        """
        from prefect.client.orchestration import get_client  # noqa: PLC0415
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate  # noqa: PLC0415

        if self._failed:
            return
        try:
            with contextlib.nullcontext(client) if client is not None else get_client(sync_client=True) as api:
                for stage, (progress, text) in batch.items():
                    progress = max(0.0, min(float(progress), 100.0))
                    if stage in self.ids:
                        api.update_artifact(artifact_id=self.ids[stage], artifact=ArtifactUpdate(
                            data=progress, **({"description": text} if text else {})))
                        continue
                    self.ids[stage] = api.create_artifact(ArtifactCreate(
                        key=_artifact_key(stage), type="progress", data=progress, description=text,
                        flow_run_id=self.flow_run_id)).id
        except Exception as exc:  # noqa: BLE001 - a progress bar must never fail or slow the run
            self._stop(exc)

    def _stop(self, exc: Exception) -> None:
        self._failed = True
        logging.getLogger(__name__).warning("progress artifacts stopped (the Prefect API refused or is "
                                            "unreachable: %s); the run goes on", exc)

    def close(self, timeout: float = 5.0) -> None:
        """Send the last lines (within ``timeout`` seconds) and stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=timeout)
        super().close()


@contextlib.contextmanager
def progress_to_ui(flow_run_id: Any = None) -> Iterator[logging.Handler]:
    """Send ``deid.progress`` records to the Prefect API for the duration of the block.

    With ``flow_run_id`` (the flow run's id): the lines of the run's own threads outside Prefect's
    context (the gate's heartbeat) are filed under it too, and each long stage gets a progress artifact.
    """
    handler = APILogHandler()
    handler.addFilter(_InRun(flow_run_id))
    handler.setLevel(logging.INFO)
    bars = ProgressArtifacts(flow_run_id) if flow_run_id is not None else None
    logger = logging.getLogger(LOGGER)
    level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)  # progress is INFO; a library caller's quiet root would drop it before the UI
    logger.addHandler(handler)
    # Stages that log to the run logger (align, featurize, de-identify) carry the same figures: their bars too.
    with_bars = [logger, logging.getLogger(TASK_RUN_LOGGER), logging.getLogger(FLOW_RUN_LOGGER)] if bars else []
    for lg in with_bars:
        lg.addHandler(bars)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        for lg in with_bars:
            lg.removeHandler(bars)
        if bars is not None:
            bars.close()
        logger.setLevel(level)  # what it queued is sent by Prefect's log worker with the run's own lines




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
