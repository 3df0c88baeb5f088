"""Which Prefect API server a ``deid run`` talks to, decided (and started) before the heavy imports.

In order of preference:

1. ``configured``: Prefect's settings name one (``PREFECT_API_URL``, a profile, ``prefect.toml``);
2. ``deid-server``: a ``deid server`` of this project is up: it writes
   ``<data dir>/prefect/server.json`` (its URL and process id) while it runs, and the run uses it
   when that process is alive and the API answers ``/health`` within a second;
3. ``temporary``: otherwise (Prefect's *ephemeral mode*) deid starts Prefect's temporary API
   server itself (Prefect's ``SubprocessASGIServer``, in a thread), but at once, so its start-up
   (6-15 s on 2 cores) runs while this process imports the flow and its libraries, instead of
   after them. The child gets ``PR_SET_PDEATHSIG``: it dies with the run, however the run dies
   (``kill -9`` included), and it is stopped when the run ends.

Measured with ``bench/bench_small_run.py`` (the README has the figures).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from deid.errors import EnvironmentFailure

SERVER_FILE = "server.json"
HEALTH_TIMEOUT = 1.0  # seconds a running `deid server` has to answer /health before the run starts its own


def server_file(data_path: Path) -> Path:
    """Where a running ``deid server`` of the project with this data directory announces itself."""
    return Path(data_path) / "prefect" / SERVER_FILE


def write_server_file(data_path: Path, *, port: int, pid: int, reports_port: int | None = None,
                      reports_dir: Path | None = None) -> Path:
    """Announce a ``deid server`` (its API URL, process id and reports server); written atomically."""
    path = server_file(data_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{pid}.tmp")
    info: dict[str, Any] = {"url": f"http://127.0.0.1:{port}/api", "port": port, "pid": pid}
    if reports_port is not None and reports_dir is not None:
        info.update(reports_url=f"http://127.0.0.1:{reports_port}", reports_dir=str(Path(reports_dir).resolve()))
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
    return path


def reports_server(data_path: Path) -> tuple[str, Path] | None:
    """The running ``deid server``'s reports server: (its base URL, the directory it serves), or None."""
    try:
        info = json.loads(server_file(data_path).read_text())
        url, served, pid = str(info["reports_url"]), Path(info["reports_dir"]), int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (url, served) if _alive(pid) else None


def clear_server_file(data_path: Path, *, pid: int) -> None:
    """Remove the announcement if it is this server's (a newer server may have replaced it)."""
    path = server_file(data_path)
    with contextlib.suppress(OSError, ValueError, KeyError):
        if json.loads(path.read_text())["pid"] == pid:
            path.unlink()


def healthy(url: str, *, timeout: float = HEALTH_TIMEOUT) -> bool:
    """True when the Prefect API at ``url`` answers ``GET /health`` with 200."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:  # noqa: S310 - loopback URL
            return r.status == 200
    except (OSError, ValueError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def running_deid_server(data_path: Path, *, timeout: float = HEALTH_TIMEOUT) -> str | None:
    """The API URL of this project's running ``deid server``, or None (no file, dead process, no answer)."""
    try:
        info = json.loads(server_file(data_path).read_text())
        url, pid = str(info["url"]), int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not _alive(pid) or not healthy(url, timeout=timeout):
        return None
    return url


def _die_with_parent(parent: int):
    """preexec_fn: the child gets SIGKILL when the process that started it dies (Linux PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: nothing to load in the child

    def preexec() -> None:
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def use_api(url: str) -> None:
    """Make this process's Prefect talk to ``url`` (also threads that fall back to the global settings)."""
    from prefect.context import refresh_global_settings_context  # noqa: PLC0415

    os.environ["PREFECT_API_URL"] = url
    refresh_global_settings_context()


@dataclass
class PrefectApi:
    """The Prefect API of a run: ``kind`` is configured, deid-server, temporary or prefect (left to Prefect)."""

    kind: str
    url: str | None = None
    started: float = field(default_factory=time.perf_counter)
    ready_after: float | None = None
    log_path: Path | None = None
    _server: Any = None
    _thread: threading.Thread | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None

    @property
    def process(self) -> subprocess.Popen | None:
        """The temporary server's process (None for the other kinds, and before it is spawned)."""
        return getattr(self._server, "server_process", None)

    @property
    def ready(self) -> bool:
        """Has the temporary server answered (or failed)? Always True for the other kinds."""
        return self.kind != "temporary" or self._ready.is_set()

    def _start(self, *, timeout: float) -> None:
        self._thread = threading.Thread(target=self._serve, args=(timeout,), name="deid-prefect-server", daemon=True)
        self._thread.start()

    def _serve(self, timeout: float) -> None:
        """Thread: start Prefect's temporary server, say when it answers, then stay until the run ends.

        The child's ``PR_SET_PDEATHSIG`` follows the thread that spawned it, so this thread lives
        as long as the server should.
        """
        try:
            import prefect.server.api.server as prefect_server  # noqa: PLC0415 - while the run imports

            self._server = prefect_server.SubprocessASGIServer()
            out = open(self.log_path, "ab")  # noqa: SIM115 - the child's output for its lifetime
            real = prefect_server.subprocess
            # Prefect's own command and environment; its output to the log and PR_SET_PDEATHSIG added.
            prefect_server.subprocess = SimpleNamespace(
                Popen=functools.partial(real.Popen, stdout=out, stderr=out, preexec_fn=_die_with_parent(os.getpid())),
                TimeoutExpired=real.TimeoutExpired)
            quiet = logging.getLogger(prefect_server.subprocess_server_logger.name)
            level = quiet.level
            quiet.setLevel(logging.WARNING)  # its "Starting temporary server" line: deid run says which server
            try:
                self._server.start(timeout=int(timeout))
            finally:
                prefect_server.subprocess = real
                quiet.setLevel(level)
            self.url = self._server.api_url
            self.ready_after = round(time.perf_counter() - self.started, 2)
        except BaseException as exc:  # noqa: BLE001 - raised again by wait() in the run's thread
            self._error = exc
        finally:
            self._ready.set()
        self._done.wait()
        if self._server is not None:
            self._server.stop()

    def wait(self, *, timeout: float = 90.0) -> float:
        """Block until a temporary server answers /health; the seconds since it was started."""
        if self.kind != "temporary":
            return self.ready_after or 0.0
        if not self._ready.wait(timeout + 5):
            self.stop()
            raise EnvironmentFailure(f"Prefect's temporary API server did not answer within {timeout:.0f} s; start "
                                     "one with `deid server` (then runs reuse it) or set PREFECT_API_URL")
        if self._error is not None:
            self.stop()
            raise EnvironmentFailure(f"Prefect's temporary API server did not start ({self._error}); its output is "
                                     f"in {self.log_path}; start one with `deid server` (then runs reuse it)"
                                     ) from self._error
        use_api(self.url)
        return self.ready_after

    def describe(self) -> str:
        """One line for ``deid run``'s output: which server the run uses."""
        if self.kind == "configured":
            return f"using the configured Prefect API {self.url}"
        if self.kind == "deid-server":
            return f"reusing the running `deid server` at {self.url}"
        if self.kind == "temporary":
            ready = f", ready {self.ready_after:.1f} s after start" if self.ready_after is not None else ""
            return (f"temporary Prefect server started by deid at {self.url}{ready} (start `deid server` once and "
                    "later runs reuse it)")
        return "Prefect's own ephemeral mode"

    @property
    def has_ui(self) -> bool:
        """Does the server serve Prefect's UI? Temporary servers (deid's or Prefect's own) run without it."""
        return self.kind in ("configured", "deid-server")

    def stop(self) -> None:
        """Stop a temporary server (nothing to do for the others), once this process's logs and events reached it."""
        if self.kind == "temporary" and self.url is not None:
            flush_to_api()
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=15)
            self._thread = None


def flush_to_api(timeout: float = 10.0) -> None:
    """Send this process's queued Prefect logs and events now, and stop Prefect's workers that send them.

    Prefect drains these workers at interpreter exit with no time limit; after a temporary server
    has stopped, they retry its closed port there instead (measured: the process took ~70 s to
    exit after the run had finished).
    """
    from prefect.events.worker import EventsWorker  # noqa: PLC0415
    from prefect.logging.handlers import APILogWorker  # noqa: PLC0415

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout, at_exit=False)
        except Exception as exc:  # noqa: BLE001 - the run is over; a lost log line must not fail it
            logging.getLogger(__name__).debug("could not flush Prefect's %s: %s", worker.__name__, exc)


def abandon_api(timeout: float = 1.0) -> None:
    """Stop talking to a Prefect API that stopped answering: nothing queued is retried, nothing new is sent.

    Called once a run's outcome is signed and the API is found lost (issue 28). Without it a run killed
    server mid-gate took 139-200 s to exit (measured, ``tests/ops/test_ops_api_lost.py``): the flow engine
    retried each final-state call ``PREFECT_CLIENT_MAX_RETRIES`` (5) times with 2-32 s back-off, twice
    (Completed, then the failure of that), and the events worker spent ~7 s on each queued event
    (10 websocket reconnections) and drained the rest at interpreter exit without a time limit.
    Here: client calls are tried once, logs are no longer sent to the API, new events go to Prefect's
    ``NullEventsClient`` and the events and logs already queued are dropped (they described a run whose
    outcome the signed report holds). The process's global Prefect settings change (a run ends after this).
    """
    from prefect.context import refresh_global_settings_context  # noqa: PLC0415
    from prefect.events.clients import NullEventsClient  # noqa: PLC0415
    from prefect.events.worker import EventsWorker  # noqa: PLC0415
    from prefect.logging.handlers import APILogWorker  # noqa: PLC0415

    os.environ.update(PREFECT_CLIENT_MAX_RETRIES="0", PREFECT_LOGGING_TO_API_ENABLED="false")
    refresh_global_settings_context()
    EventsWorker.set_client_override(NullEventsClient)
    for worker in (APILogWorker, EventsWorker):
        try:
            with worker._instance_lock:  # Prefect's private state: its public drain waits for every item
                instances = tuple(worker._instances.values())
            for instance in instances:
                client = getattr(instance, "_client", None)
                if hasattr(client, "_reconnection_attempts"):
                    client._reconnection_attempts = 0  # the item in flight: one attempt, not ten
                _discard_queued(instance._queue)
            worker.drain_all(timeout=timeout, at_exit=False)
        except Exception as exc:  # noqa: BLE001 - the run is over; a lost log line must not fail it
            logging.getLogger(__name__).debug("could not stop Prefect's %s: %s", worker.__name__, exc)


def _discard_queued(queue) -> None:
    """Empty a ``queue.Queue`` (each item marked done, so a ``join`` on it does not wait for them)."""
    import queue as queue_module  # noqa: PLC0415

    while True:
        try:
            queue.get_nowait()
        except queue_module.Empty:
            return
        queue.task_done()


def connect(data_path: Path, *, log_path: Path) -> PrefectApi:
    """Decide the run's Prefect API (configured > running ``deid server`` > temporary) and start a temporary one.

    A temporary server is Prefect's own (``SubprocessASGIServer``, what Prefect's ephemeral mode
    starts), started here in a thread, not waited for: call :meth:`PrefectApi.wait` after the
    heavy imports. Its output goes to ``log_path``.
    """
    from prefect.settings import get_current_settings  # noqa: PLC0415 - the light part of Prefect

    settings = get_current_settings()
    if settings.api.url:
        return PrefectApi("configured", str(settings.api.url))
    url = running_deid_server(data_path)
    if url is not None:
        use_api(url)
        return PrefectApi("deid-server", url)
    if not settings.server.ephemeral.enabled or not sys.platform.startswith("linux"):
        return PrefectApi("prefect")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    api = PrefectApi("temporary", log_path=log_path)
    api._start(timeout=90.0)
    return api


# What a run imports later anyway (validation, the gate, dlib, report.html): imported while a temporary
# server boots, when this process would otherwise only wait.
WARM_MODULES = ("great_expectations", "great_expectations.data_context.types.base", "deid.operations.worker_align",
                "deid.operations.worker_deidentify", "deid.operations.worker_featurize", "deid.operations.worker_gate",
                "deid.operations.worker_lineage", "deid.operations.worker_partition",
                "deid.evaluation.gate", "deid.evaluation.recognizer", "deid.reporting.html_report")


def warm_imports(api: PrefectApi, *, validation: bool = True) -> list[str]:
    """Import :data:`WARM_MODULES` while ``api``'s temporary server is still starting; the modules imported.

    ``validation=False``: not Great Expectations (a small run's pool process validates).
    """
    done: list[str] = []
    if api.kind != "temporary":
        return done
    for name in WARM_MODULES:
        if not validation and name.startswith("great_expectations"):
            continue
        if api.ready:
            break
        importlib.import_module(name)
        done.append(name)
    return done
