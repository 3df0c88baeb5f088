"""Which Prefect API server a ``deid run`` talks to, decided (and started) before the heavy imports.

In order of preference:

1. ``configured``: Prefect's settings name one (``PREFECT_API_URL``, a profile, ``prefect.toml``);
2. ``deid-server``: a ``deid server`` of this project is up: it writes
   ``<data dir>/prefect/server.json`` (its URL and process id) while it runs, and the run uses it
   when that process is alive and the API answers ``/health`` within a second;
3. ``temporary``: otherwise (Prefect's *ephemeral mode*) deid starts Prefect's temporary API
   server itself, the same ``uvicorn`` command Prefect would start, but at once, so its start-up
   (6-15 s on 2 cores) runs while this process imports the flow and its libraries, instead of
   after them. The child gets ``PR_SET_PDEATHSIG``: it dies with the run, however the run dies
   (``kill -9`` included), and it is stopped when the run ends.

Measured with ``bench/bench_small_run.py`` (the README has the figures).
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SERVER_FILE = "server.json"
HEALTH_TIMEOUT = 1.0  # seconds a running `deid server` has to answer /health before the run starts its own


def server_file(data_path: Path) -> Path:
    """Where a running ``deid server`` of the project with this data directory announces itself."""
    return Path(data_path) / "prefect" / SERVER_FILE


def write_server_file(data_path: Path, *, port: int, pid: int) -> Path:
    """Announce a ``deid server`` (its API URL and process id); written atomically."""
    path = server_file(data_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{pid}.tmp")
    tmp.write_text(json.dumps({"url": f"http://127.0.0.1:{port}/api", "port": port, "pid": pid}))
    os.replace(tmp, path)
    return path


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


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    process: subprocess.Popen | None = None
    started: float = field(default_factory=time.perf_counter)
    ready_after: float | None = None
    log_path: Path | None = None
    _command: tuple[list[str], dict, object] | None = None

    def wait(self, *, timeout: float = 90.0) -> float:
        """Block until a temporary server answers /health; the seconds since it was started."""
        if self.kind != "temporary" or self.ready_after is not None:
            return self.ready_after or 0.0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code == 3:  # uvicorn: the port was taken in the meantime; start again on another one
                self._spawn()
                continue
            if code is not None:
                raise RuntimeError(f"Prefect's temporary API server exited with code {code} before it was ready; "
                                   f"its output is in {self.log_path}")
            if healthy(self.url, timeout=2.0):
                self.ready_after = round(time.perf_counter() - self.started, 2)
                return self.ready_after
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"Prefect's temporary API server did not answer within {timeout:.0f} s; start one with "
                           "`deid server` (then runs reuse it) or set PREFECT_API_URL")

    def _spawn(self) -> None:
        args, env, out = self._command
        port = _free_port()
        args = [*args[:-5], str(port), *args[-4:]]  # ... --port PORT --log-level error --lifespan on
        self.process = subprocess.Popen(args, env=env, stdout=out, stderr=out,  # noqa: S603
                                        preexec_fn=_die_with_parent(os.getpid()))
        self._command = (args, env, out)
        self.url = f"http://127.0.0.1:{port}/api"
        use_api(self.url)

    @property
    def has_ui(self) -> bool:
        """Does the server serve Prefect's UI? Temporary servers (deid's or Prefect's own) run without it."""
        return self.kind in ("configured", "deid-server")

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

    def stop(self) -> None:
        """Stop a temporary server (nothing to do for the others)."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def connect(data_path: Path, *, log_path: Path) -> PrefectApi:
    """Decide the run's Prefect API (configured > running ``deid server`` > temporary) and start a temporary one.

    A temporary server is only started here, not waited for: call :meth:`PrefectApi.wait` after the
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
    spec = importlib.util.find_spec("prefect")
    app_dir = str(Path(spec.origin).parent.parent)
    # What prefect.server.api.server.SubprocessASGIServer runs, without importing the server here.
    args = [sys.executable, "-m", "uvicorn", "--app-dir", app_dir, "--factory", "prefect.server.api.server:create_app",
            "--host", "127.0.0.1", "--port", "0", "--log-level", "error", "--lifespan", "on"]
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           **settings.to_environment_variables(exclude_unset=True)}
    env.pop("PREFECT_API_URL", None)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_path, "ab")  # noqa: SIM115 - shared with the child for its lifetime
    api = PrefectApi("temporary", log_path=log_path, _command=(args, env, out))
    api._spawn()
    return api


# What a run imports later anyway (validation, the gate, dlib, report.html): imported while a temporary
# server boots, when this process would otherwise only wait.
WARM_MODULES = ("great_expectations", "great_expectations.data_context.types.base", "deid.operations.stages",
                "deid.evaluation.gate", "deid.evaluation.recognizer", "deid.reporting.html_report")


def warm_imports(api: PrefectApi) -> list[str]:
    """Import :data:`WARM_MODULES` while ``api``'s temporary server is still starting; the modules imported."""
    done: list[str] = []
    if api.kind != "temporary":
        return done
    for name in WARM_MODULES:
        if api.process is None or api.process.poll() is not None or healthy(api.url, timeout=0.2):
            break
        importlib.import_module(name)
        done.append(name)
    else:
        from deid.reporting.html_charts import _pyplot  # noqa: PLC0415 - matplotlib with the Agg backend

        _pyplot()
    return done
