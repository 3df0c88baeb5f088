"""One temporary Prefect API for all pytest-xdist workers (conftest's ``_prefect_harness``).

Under ``-n N`` the controller starts the same server ``prefect_test_harness`` would (uvicorn on
``prefect.server.api.server:create_app``, ephemeral, no UI, a fresh SQLite database in a temporary
directory) without waiting for it, hands its URL to every worker, and stops it when the session
ends. A worker waits for its health check on first use. One server instead of one per worker: a
server costs ~12 s of CPU to start and ~2% of a core while it idles. The tests it serves look
their runs up by id (or by their own drop's name), never by counting all runs on the server.
Without xdist (plain ``pytest``), the fixture falls back to ``prefect_test_harness``.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

WORKER_KEY = "deid_prefect_api"


class SharedServer:
    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="deid-test-prefect-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/api"
        self.log = self.base / "server.log"
        package = Path(importlib.util.find_spec("prefect").origin).parent  # without importing prefect here
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.update(PREFECT_HOME=str(self.base / "home"), PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1",
                   PREFECT__SERVER_FINAL="1", DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{self.base / 'prefect.db'}")
        self._fh = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(package.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on"],
            env=env, stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def cpu_seconds(self) -> float:
        """CPU the server used so far (its process and reaped children), from /proc."""
        try:
            f = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return sum(int(v) for v in f[11:15]) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._fh.close()
        shutil.rmtree(self.base, ignore_errors=True)


def wait_healthy(url: str, log: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            tail = Path(log).read_text(errors="replace")[-3000:] if Path(log).is_file() else "(no log)"
            raise RuntimeError(f"the suite's shared Prefect server {url} is not healthy after {timeout:.0f} s; "
                               f"its log ({log}):\n{tail}")
        time.sleep(0.25)


@contextmanager
def use_server(url: str, log: str):
    """What ``prefect_test_harness`` does in the client, pointed at the shared server."""
    import prefect.context
    import prefect.settings
    from prefect.utilities.asyncutils import run_coro_as_sync

    wait_healthy(url, log)
    with ExitStack() as stack:
        stack.enter_context(prefect.settings.temporary_settings(updates={prefect.settings.PREFECT_API_URL: url}))
        stack.enter_context(prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()))
        yield

        async def drain():  # the worker's pending logs and events, before its client goes (as the harness does)
            import inspect

            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            try:
                result = APILogWorker.instance().drain()
                if inspect.isawaitable(result):
                    await result
            except RuntimeError:
                pass
            result = EventsWorker.drain_all()
            if inspect.isawaitable(result):
                await result

        run_coro_as_sync(drain())
