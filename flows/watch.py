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
from deid.operations.ledger import Ledger, drop_fingerprint, ready_drops

log = logging.getLogger(__name__)
EVENT = "deid.drop.ready"
RESOURCE_PREFIX = "deid.drop."


def api_url() -> str:
    """The Prefect API the events go to; a clear error when none is configured."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError(
            "PREFECT_API_URL is not set: `deid watch` and `deid serve` must talk to one shared Prefect server "
            "(without it each starts a private temporary server and no event triggers a run). "
            "Start one with `deid server` and run: export PREFECT_API_URL=http://127.0.0.1:4200/api")
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
