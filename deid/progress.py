"""Progress of a long stage as throttled log lines: units done, share, time spent and time left.

A stage that runs for minutes (aligning, featurising, de-identifying, the gate's attacks and
utility folds) says how far it is, through :mod:`logging` at INFO (``deid run`` shows the
``deid.progress`` logger), without flooding: a line when another ``every_fraction`` of the work
is done (but not twice within ``min_seconds``), a heartbeat every ``every_seconds`` otherwise,
and always a last line when the work is complete. The time left is the linear estimate from the
rate so far.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from deid.errors import ConfigError

__all__ = ["Progress", "format_duration", "track"]

LOGGER = "deid.progress"


def format_duration(seconds: float) -> str:
    """``3 s``, ``2 min 05 s``, ``1 h 02 min`` (``< 1 s`` below a second)."""
    if seconds < 1:
        return "< 1 s"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


class Progress:
    """Throttled progress lines for one stage.

    Parameters
    ----------
    stage : str
        What is running, e.g. ``"align"`` or ``"gate: attacks"`` (the start of every line).
    total : int, optional
        Units of work; may be given later with :meth:`start`.
    unit : str
        What is counted (``"records"``, ``"attacker x mode pairs"``, ``"folds"``).
    logger : logging.Logger or logging.LoggerAdapter, optional
        Where lines go; default the ``deid.progress`` logger.
    every_seconds : float
        Heartbeat: a line at least this often while work advances.
    every_fraction : float
        A line each time another such share of the total is done.
    min_seconds : float
        Never two lines within this time (the last line excepted), so fast stages stay short.
    clock : callable
        Monotonic seconds (injectable for tests).
    """

    def __init__(self, stage: str, total: int | None = None, *, unit: str = "records", logger: Any = None,
                 every_seconds: float = 15.0, every_fraction: float = 0.1, min_seconds: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < every_fraction <= 1:
            raise ConfigError(f"every_fraction={every_fraction!r} must be in (0, 1]; pass e.g. 0.1 for every 10%")
        if every_seconds <= 0 or min_seconds < 0 or min_seconds > every_seconds:
            raise ConfigError(f"every_seconds={every_seconds!r} and min_seconds={min_seconds!r} must satisfy "
                              "0 <= min_seconds <= every_seconds, every_seconds > 0; pass e.g. 15 and 2")
        self.stage, self.unit = stage, unit
        self.logger = logger if logger is not None else logging.getLogger(LOGGER)
        self.every_seconds, self.every_fraction, self.min_seconds = every_seconds, every_fraction, min_seconds
        self.clock = clock
        self.total: int | None = None
        self.done = 0
        self._t0: float | None = None
        self._last = 0.0
        self._next_step = 0
        self._finished = False
        if total is not None:
            self._set_total(total)

    def _set_total(self, total: int) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ConfigError(f"total={total!r} must be an integer >= 0 ({self.stage}: units of work)")
        self.total = total

    def start(self, total: int | None = None) -> "Progress":
        """Start the clock and log the first line (``stage: 0/N unit``)."""
        if total is not None:
            self._set_total(total)
        if self.total is None:
            raise ConfigError(f"{self.stage}: start() needs total= (units of work) when Progress was made without it")
        self._t0 = self._last = self.clock()
        self._next_step = 1
        self.logger.info("%s", f"{self.stage}: {self.total} {self.unit} to do")
        if self.total == 0:
            self._finished = True
        return self

    def advance(self, n: int = 1, *, note: str | None = None) -> None:
        """Record ``n`` more units done; log a line if the throttle allows (always at completion)."""
        if self._t0 is None:
            self.start()
        self.done = min(self.done + int(n), self.total) if self.total else self.done + int(n)
        now = self.clock()
        if self.total and self.done >= self.total:
            if not self._finished:
                self._finished = True
                self._emit(now, note, final=True)
            return
        step = math.floor(self.done / self.total / self.every_fraction) if self.total else 0
        since = now - self._last
        if since >= self.every_seconds or (step >= self._next_step and since >= self.min_seconds):
            self._next_step = step + 1
            self._emit(now, note)

    def finish(self) -> None:
        """Log the last line if the work ended short of ``total`` (skipped units) or was never logged."""
        if self._t0 is None:
            self.start()
        if not self._finished:
            self._finished = True
            self._emit(self.clock(), None, final=True)

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left at the rate so far; None before anything is done."""
        if self._t0 is None or not self.done or self.total is None:
            return None
        elapsed = (self.clock() if now is None else now) - self._t0
        return max(0.0, elapsed / self.done * (self.total - self.done))

    def _emit(self, now: float, note: str | None, *, final: bool = False) -> None:
        self._last = now
        elapsed = now - (self._t0 if self._t0 is not None else now)
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        if final:
            tail = f", done in {format_duration(elapsed)}"
        else:
            tail = f", {format_duration(elapsed)} elapsed, about {format_duration(self.eta(now) or 0.0)} left"
        self.logger.info("%s", f"{self.stage}: {self.done}/{self.total} {self.unit}{share}{tail}"
                         + (f" (last: {note})" if note else ""))


T = TypeVar("T")


def track(items: Iterable[T], progress: Progress | None) -> Iterator[T]:
    """Yield ``items``, telling ``progress`` one unit done after each item's loop body (also on ``continue``)."""
    for item in items:
        yield item
        if progress is not None:
            progress.advance()
