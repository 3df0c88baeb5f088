"""Progress of a long stage as throttled log lines: units done, share, time spent and time left.

A stage that runs for minutes (aligning, featurising, de-identifying, the gate's attacks and
utility folds) says how far it is, through :mod:`logging` at INFO (``deid run`` shows the
``deid.progress`` logger), without flooding: a line when another ``every_fraction`` of the work
is done (but not twice within ``min_seconds``), a heartbeat every ``every_seconds`` otherwise,
and always a last line when the work is complete. The time left is the linear estimate from the
rate so far.

:class:`PartsProgress` is for a few named parts of unequal cost running at once (the gate's
attackers and utility protocols on a small run's processes): a line per part done, a heartbeat
from a thread while parts run (a part may run for half a minute), and the time left from the
parts' measured costs.

Every line carries its figures as ``record.deid_progress`` (stage, done, total, share, final),
so the orchestration layer can show them as a progress bar without parsing text.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from deid.errors import ConfigError

__all__ = ["PartsProgress", "Progress", "format_duration", "track"]

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
        self.logger.info("%s", f"{self.stage}: {self.total} {self.unit} to do",
                         extra=figures(self.stage, 0, self.total, 0.0, self.total == 0))
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
                         + (f" (last: {note})" if note else ""),
                         extra=figures(self.stage, self.done, self.total,
                                       self.done / self.total if self.total and not final else 1.0, final))


def figures(stage: str, done: int, total: int | None, share: float, final: bool) -> dict[str, Any]:
    """The ``extra`` of a progress line: its figures as ``record.deid_progress`` (a progress bar needs no parsing).

    ``share`` is of the work done (1.0 on a stage's last line, also when units were skipped: the stage ended).
    """
    return {"deid_progress": {"stage": stage, "done": done, "total": total, "share": min(1.0, max(0.0, share)),
                              "final": final}}


T = TypeVar("T")


def track(items: Iterable[T], progress: Progress | None) -> Iterator[T]:
    """Yield ``items``, telling ``progress`` one unit done after each item's loop body (also on ``continue``)."""
    for item in items:
        yield item
        if progress is not None:
            progress.advance()


class PartsProgress:
    """Progress of named parts of unequal cost run at once on ``workers`` processes, longest first.

    The parts start in list order on whichever process is free (as
    :meth:`deid.pool.PoolExecutor.map` starts its calls), so which parts run when is
    known from the completions alone. A line when each part is done (its measured seconds), and a
    heartbeat every ``every_seconds`` from a thread while parts run, naming the running parts.

    The time left: each part's expected cost is its prior ``weight`` times the seconds per unit of
    weight measured on the parts done so far; the parts running and waiting are then laid on the
    ``workers`` processes in list order, and the time left is when the last one ends. Before any
    part is measured, no time left is claimed ("time left measured after the first part").

    Parameters
    ----------
    stage : str
        E.g. ``"gate"``: the start of every line.
    parts : sequence of (name, weight)
        The parts in the order they start; ``weight`` is a relative prior cost (> 0).
    workers : int
        Processes running parts at once.
    logger, every_seconds, clock
        As for :class:`Progress`; ``every_seconds`` is the heartbeat period.
    heartbeat : bool
        Start the heartbeat thread (tests drive :meth:`beat` with their own clock instead).
    """

    def __init__(self, stage: str, parts: Sequence[tuple[str, float]], *, workers: int = 1, logger: Any = None,
                 every_seconds: float = 15.0, clock: Callable[[], float] = time.monotonic,
                 heartbeat: bool = True) -> None:
        names = [n for n, _ in parts]
        if len(set(names)) != len(names):
            raise ConfigError(f"parts={names!r}: every part needs its own name ({stage})")
        if any(not w > 0 for _, w in parts):
            raise ConfigError(f"parts={list(parts)!r}: every weight must be > 0 (a relative cost) ({stage})")
        if every_seconds <= 0:
            raise ConfigError(f"every_seconds={every_seconds!r} must be > 0; pass e.g. 15")
        self.stage, self.parts = stage, list(parts)
        self.weight = dict(parts)
        self.workers = max(1, int(workers))
        self.logger = logger if logger is not None else logging.getLogger(LOGGER)
        self.every_seconds, self.clock, self._heartbeat = every_seconds, clock, heartbeat
        self.seconds: dict[str, float] = {}  # measured cost of each part done
        self.started: dict[str, float] = {}  # start time of each part running
        self._waiting: list[str] = []
        self._t0: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PartsProgress":
        """Start the clock (the first ``workers`` parts start now), log the parts, start the heartbeat."""
        self._t0 = now = self.clock()
        names = [n for n, _ in self.parts]
        self.started = {n: now for n in names[:self.workers]}
        self._waiting = names[self.workers:]
        self.logger.info("%s", f"{self.stage}: {len(names)} parts on {self.workers} process(es): {', '.join(names)}",
                         extra=figures(self.stage, 0, len(names), 0.0, not names))
        if self._heartbeat and names:
            self._thread = threading.Thread(target=self._beat_loop, name=f"progress {self.stage}", daemon=True)
            self._thread.start()
        return self

    def done(self, name: str, seconds: float | None = None) -> None:
        """Part ``name`` is done (``seconds``: its measured cost; default the time since it started)."""
        with self._lock:
            now = self.clock()
            if name not in self.weight or name in self.seconds:
                raise ConfigError(f"part={name!r} is not a part of {self.stage} still running; parts: "
                                  f"{[n for n, _ in self.parts]}")
            start = self.started.pop(name, now)
            self.seconds[name] = float(seconds) if seconds is not None else now - start
            if self._waiting:  # its process takes the next part in list order
                self.started[self._waiting.pop(0)] = now
            final = len(self.seconds) == len(self.parts)
            head = f"{self.stage}: part {name} done in {format_duration(self.seconds[name])}"
            self._emit(now, head, final=final)
        if final:
            self.finish()

    def finish(self) -> None:
        """Stop the heartbeat (idempotent; also when parts failed)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def beat(self) -> None:
        """One heartbeat line: parts done, elapsed, time left, the parts running and for how long."""
        with self._lock:
            if len(self.seconds) < len(self.parts):
                now = self.clock()
                self._emit(now, f"{self.stage}: working", final=False)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.every_seconds):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - a progress line must never break the work it reports on
                logging.getLogger(__name__).debug("progress heartbeat failed", exc_info=True)

    def share(self) -> float:
        """The share of the expected work done (by weight)."""
        total = sum(self.weight.values())
        return sum(self.weight[n] for n in self.seconds) / total if total else 1.0

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left (see the class notes); None before any part was measured."""
        measured = sum(self.weight[n] for n in self.seconds)
        if not measured:
            return None
        per_weight = sum(self.seconds.values()) / measured
        now = self.clock() if now is None else now
        lanes = sorted(max(0.0, self.weight[n] * per_weight - (now - t)) for n, t in self.started.items())
        lanes += [0.0] * (self.workers - len(lanes))
        for n in self._waiting:  # each waiting part goes to the process free first
            lanes.sort()
            lanes[0] += self.weight[n] * per_weight
        return max(lanes) if lanes else 0.0

    def _emit(self, now: float, head: str, *, final: bool) -> None:
        n, total = len(self.seconds), len(self.parts)
        elapsed = now - (self._t0 if self._t0 is not None else now)
        if final:
            tail = f"; all {total} parts done in {format_duration(elapsed)}"
        else:
            left = self.eta(now)
            tail = (f"; {n}/{total} parts done, {format_duration(elapsed)} elapsed, "
                    + (f"about {format_duration(left)} left" if left is not None
                       else "time left measured after the first part"))
            running = [f"{p} ({format_duration(now - t)})" for p, t in self.started.items()]
            if running:
                tail += "; running: " + ", ".join(running)
        self.logger.info("%s", head + tail, extra=figures(self.stage, n, total, self.share(), final))
