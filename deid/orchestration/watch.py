"""``deid watch``: notice complete drops in an incoming directory and announce them as ``deid.drop.ready``.

The watcher polls (no inotify: incoming directories are often network mounts). A drop is
fingerprinted once per appearance of its ``_READY`` marker; the ledger decides whether it is
new (queued, event emitted), already announced, or a duplicate of released content.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from deid.intake.drop import READY
from deid.errors import ConfigError
from deid.operations.ledger import FAILED, Ledger, drop_fingerprint, ready_drops

log = logging.getLogger(__name__)
EVENT = "deid.drop.ready"
RESOURCE_PREFIX = "deid.drop."


def configured_api_url() -> str | None:
    """The Prefect API that Prefect's settings name (``PREFECT_API_URL``, a profile), or None."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def api_url(data_path: Path | None = None) -> str:
    """The shared Prefect API the events and deployments go to: the configured one, else this project's ``deid server``.

    Like ``deid run`` (:func:`deid.orchestration.prefect_api.connect`), a running ``deid server`` of
    the project is found through its server file (``<data dir>/prefect/server.json``); this
    process's Prefect is then pointed at it. A clear error when there is neither.
    """
    from deid.orchestration.prefect_api import running_deid_server, server_file, use_api
    from deid.settings import Settings

    url = configured_api_url()
    if url:
        return url
    data_path = Settings().data_path if data_path is None else Path(data_path)
    url = running_deid_server(data_path)
    if url is None:
        raise ConfigError(
            f"no shared Prefect server: no running `deid server` of this project ({server_file(data_path)} missing, "
            "or its server does not answer) and PREFECT_API_URL is not set. `deid watch` and `deid serve` must "
            "talk to one shared server (without it each starts a private temporary server and no event triggers "
            "a run): start one with `deid server` in this project, or set PREFECT_API_URL")
    use_api(url)
    return url


def prefect_emitter(drop: Path, fingerprint: str) -> str:
    """Send one ``deid.drop.ready`` event and wait until the server has it; return the event id."""
    from prefect.events import Event
    from prefect.events.clients import get_events_client

    event = Event(event=EVENT,
                  resource={"prefect.resource.id": RESOURCE_PREFIX + fingerprint.removeprefix("sha256:"),
                            "prefect.resource.name": drop.name, "deid.drop.path": str(drop)},
                  payload={"drop": str(drop), "fingerprint": fingerprint})

    async def send() -> None:
        async with get_events_client() as client:
            await client.emit(event)

    asyncio.run(send())
    return str(event.id)


class Watcher:
    """Scan ``incoming`` for complete drops; announce new ones through ``emit(drop, fingerprint)``.

    Parameters
    ----------
    incoming : path
        The directory producers drop into (one subdirectory per drop, ``_READY`` written last).
    ledger : Ledger
        The project's ledger.
    emit : callable, keyword-only
        ``emit(drop_path, fingerprint)``; default: a Prefect event.
    """

    def __init__(self, incoming: str | os.PathLike, ledger: Ledger, *,
                 emit: Callable[[Path, str], object] = prefect_emitter):
        self.incoming = Path(incoming)
        self.ledger = ledger
        self.emit = emit
        # (path, _READY identity) already handled: a drop is hashed once per _READY it shows.
        self._done: set[tuple[str, int, int]] = set()
        self._unsent: set[tuple[str, str]] = set()
        # Announced drops whose verdict is not in the ledger yet: fingerprint -> drop path.
        self._awaiting: dict[str, str] = {}

    def scan(self) -> list[dict]:
        """One pass; returns what happened to each drop examined (``outcome``: announce/duplicate/...)."""
        out = []
        for drop in ready_drops(self.incoming):
            try:
                st = (drop / READY).stat()
            except FileNotFoundError:  # withdrawn while we looked
                continue
            key = (str(drop), st.st_ino, st.st_mtime_ns)
            if key in self._done:
                continue
            t0 = time.perf_counter()
            try:
                fp = drop_fingerprint(drop)
            except Exception as exc:  # a broken drop must not stop the watcher
                log.error("cannot fingerprint %s: %s", drop, exc)
                self._done.add(key)
                out.append({"drop": str(drop), "outcome": "error", "error": str(exc)})
                continue
            outcome = self.ledger.sight(drop, fp)
            row = {"drop": str(drop), "fingerprint": fp, "outcome": outcome,
                   "hash_seconds": round(time.perf_counter() - t0, 3)}
            if outcome == "announce" or (outcome == "pending" and (str(drop), fp) in self._unsent):
                try:
                    row["event_id"] = self.emit(drop, fp)
                    row["outcome"] = "announce"
                    self._unsent.discard((str(drop), fp))
                    self._awaiting[fp] = str(drop)
                except Exception as exc:  # server down: retry on the next pass
                    log.error("could not announce %s (%s): %s; retrying", drop, fp, exc)
                    self._unsent.add((str(drop), fp))
                    row["outcome"], row["error"] = "unsent", str(exc)
                    out.append(row)
                    continue
            elif outcome == "duplicate":
                e = self.ledger.get(fp)
                row.update(duplicate_of=e.drop_path, status=e.status, release_id=e.release_id)
            self._done.add(key)
            out.append(row)
        return out + self.verdicts()

    def verdicts(self) -> list[dict]:
        """The announced drops whose run has ended since the last pass (``outcome`` ``verdict`` or ``failed``).

        A ``verdict`` row names the signed report (``report``: report.json) and the ledger's
        ``status`` (released or rejected); a ``failed`` row, the run's error (no verdict: another
        run may claim the drop again).
        """
        out = []
        for fp, drop in list(self._awaiting.items()):
            e = self.ledger.get(fp)
            if e is None or not (e.settled or e.status == FAILED):
                continue
            del self._awaiting[fp]
            if e.status == FAILED:
                out.append({"drop": drop, "fingerprint": fp, "outcome": "failed", "error": e.error or ""})
            else:
                out.append({"drop": drop, "fingerprint": fp, "outcome": "verdict", "status": e.status,
                            "release_id": e.release_id, "report": e.report})
        return out

    def run(self, *, interval: float = 2.0, once: bool = False, report: Callable[[dict], None] = lambda r: None):
        """Scan every ``interval`` seconds until interrupted (or once)."""
        if not interval > 0:
            raise ConfigError(f"interval={interval!r} must be a positive number of seconds, e.g. 2")
        while True:
            for row in self.scan():
                report(row)
            if once:
                return
            time.sleep(interval)
