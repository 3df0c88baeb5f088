"""A small run starts fast: a running `deid server` is found and reused, small drops skip the Dask cluster."""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from deid.operations.executors import PoolExecutor
from deid.orchestration.cluster import manifest_rows, uses_pool
from deid.orchestration.prefect_api import (
    clear_server_file,
    reports_server,
    running_deid_server,
    server_file,
    write_server_file,
)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        ok = self.path == "/api/health"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b"true" if ok else b"")

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_a_running_deid_server_is_found_through_its_port_file(tmp_path, health_server):
    assert running_deid_server(tmp_path) is None  # no file
    write_server_file(tmp_path, port=health_server, pid=os.getpid())
    assert running_deid_server(tmp_path) == f"http://127.0.0.1:{health_server}/api"
    assert json.loads(server_file(tmp_path).read_text())["pid"] == os.getpid()
    # Its reports server, which runs link their report artifact to: known only when the server announced one.
    assert reports_server(tmp_path) is None
    write_server_file(tmp_path, port=health_server, pid=os.getpid(), reports_port=4321, reports_dir=tmp_path / "r")
    assert reports_server(tmp_path) == ("http://127.0.0.1:4321", (tmp_path / "r").resolve())
    assert running_deid_server(tmp_path) == f"http://127.0.0.1:{health_server}/api"


def test_a_dead_or_silent_server_is_not_reused(tmp_path, health_server):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_server_file(tmp_path, port=health_server, pid=dead.pid, reports_port=4321, reports_dir=tmp_path)
    assert running_deid_server(tmp_path) is None  # answers, but its process is gone
    assert reports_server(tmp_path) is None  # nor is its reports server linked
    silent = http.server.HTTPServer(("127.0.0.1", 0), _Health)  # bound, never answers
    try:
        write_server_file(tmp_path, port=silent.server_address[1], pid=os.getpid())
        assert running_deid_server(tmp_path, timeout=0.3) is None
    finally:
        silent.server_close()


def test_a_server_removes_only_its_own_port_file(tmp_path):
    write_server_file(tmp_path, port=4200, pid=os.getpid())
    clear_server_file(tmp_path, pid=os.getpid() + 1)  # another server's exit leaves it
    assert server_file(tmp_path).is_file()
    clear_server_file(tmp_path, pid=os.getpid())
    assert not server_file(tmp_path).exists()


_PREFERENCE = """
import os, sys
from pathlib import Path
import prefect.context
from deid.orchestration.prefect_api import connect

tmp, port = Path(sys.argv[1]), int(sys.argv[2])
os.environ["PREFECT_API_URL"] = "http://127.0.0.1:9/api"
prefect.context.refresh_global_settings_context()
api = connect(tmp, log_path=tmp / "server.log")
assert (api.kind, api.url, api.process) == ("configured", "http://127.0.0.1:9/api", None), api
del os.environ["PREFECT_API_URL"]
prefect.context.refresh_global_settings_context()
api = connect(tmp, log_path=tmp / "server.log")
url = f"http://127.0.0.1:{port}/api"
assert (api.kind, api.url, api.process) == ("deid-server", url, None), api
assert os.environ["PREFECT_API_URL"] == url
from prefect.settings import get_current_settings
assert get_current_settings().api.url == url  # what this process's Prefect now talks to
assert "reusing the running `deid server`" in api.describe()
print("ok")
"""


def test_run_prefers_the_configured_api_then_the_running_deid_server(tmp_path, health_server):
    # In a fresh process: the test process may already talk to the session's Prefect test server.
    write_server_file(tmp_path, port=health_server, pid=os.getpid())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    proc = subprocess.run([sys.executable, "-c", _PREFERENCE, str(tmp_path), str(health_server)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_small_drops_use_the_pool_unless_a_dask_address_is_set(tmp_path):
    (tmp_path / "manifest.csv").write_text("image,subject_id\n" + "".join(f"{i}.png,p{i}\n" for i in range(5)))
    assert manifest_rows(tmp_path, stop_after=100) == 5
    assert manifest_rows(tmp_path, stop_after=2) == 3  # stops counting past the threshold
    assert manifest_rows(tmp_path / "missing", stop_after=100) is None
    assert uses_pool(tmp_path, address=None, max_records=5)
    assert not uses_pool(tmp_path, address=None, max_records=4)
    assert not uses_pool(tmp_path, address=None, max_records=0)  # 0: always Dask
    assert not uses_pool(tmp_path, address="tcp://127.0.0.1:8786", max_records=1000)
    assert not uses_pool(tmp_path / "missing", address=None, max_records=1000)


def whoami(i: int) -> tuple[int, int]:
    return i, os.getpid()


def test_the_pool_returns_results_in_call_order_and_this_process_works_too():
    pool = PoolExecutor(2, warm=None)
    try:
        done = []
        out = pool.map(whoami, [dict(i=i) for i in range(8)], on_done=done.append)
    finally:
        pool.close()
    assert [i for i, _ in out] == list(range(8))
    assert sorted(done) == sorted(out)
    pids = {pid for _, pid in out}
    assert os.getpid() in pids and len(pids) == 2  # the calls no pool process had started ran here


def test_one_worker_is_this_process_alone():
    pool = PoolExecutor(1)
    assert pool.map(whoami, [dict(i=0), dict(i=1)]) == [(0, os.getpid()), (1, os.getpid())]
    pool.close()


def test_serve_and_watch_find_the_projects_deid_server(tmp_path, health_server, monkeypatch):
    import deid.orchestration.prefect_api as prefect_api
    import deid.orchestration.watch as watch
    from deid.errors import ConfigError

    used = []
    monkeypatch.setattr(watch, "configured_api_url", lambda: None)
    monkeypatch.setattr(prefect_api, "use_api", used.append)
    with pytest.raises(ConfigError, match="deid server"):
        watch.api_url(tmp_path)
    write_server_file(tmp_path, port=health_server, pid=os.getpid())
    url = f"http://127.0.0.1:{health_server}/api"
    assert watch.api_url(tmp_path) == url and used == [url]  # this process's Prefect now talks to it
    monkeypatch.setattr(watch, "configured_api_url", lambda: "http://127.0.0.1:9/api")
    assert watch.api_url(tmp_path) == "http://127.0.0.1:9/api"  # a configured API comes first
