"""Operations test helpers: started processes, the Prefect REST API, and one ops stack per session.

The ``stack`` fixture (a Prefect server, `deid serve` and `deid watch`) is registered in
conftest.py, so every ops module shares one: mark its tests ``xdist_group("ops")`` (one worker).
Everything is on loopback, bounded in time, and every process started here is stopped in a
fixture teardown (process groups: SIGTERM, then SIGKILL). A test process killed before its teardown
(SIGKILL, a CI timeout) takes them with it: each is started with the kernel's parent-death signal, so no
stack outlives its test session to watch a later session's directories.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEID = [sys.executable, "-m", "deid.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM this process when the test process that started it dies.

    Without it a killed pytest leaves its stack running: a leftover ``deid watch`` keeps scanning its
    incoming directory, which a later session with the same ``--basetemp`` recreates, and races that
    session's watcher for its drops (seen: a drop released by a stale stack's ``deid serve``, which the
    new session's Prefect server never heard of).
    """
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Proc:
    """A started process group with its log file; ``stop()`` is idempotent."""

    def __init__(self, name: str, cmd: list[str], *, env: dict, logs: Path, cwd: Path = ROOT):
        self.name = name
        self.log = logs / f"{name}.log"
        self._fh = open(self.log, "wb")
        self.p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self._fh, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return f"--- {self.name} (last {n} lines) ---\n" + "\n".join(lines[-n:])

    def stop(self, timeout: float = 15.0) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout=timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=10)
        # Children left in the group (uvicorn, Dask workers of a flow run) go too.
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._fh.close()


def api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def wait_for(what: str, predicate, timeout: float, procs=(), interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if not p.alive():
                pytest.fail(f"{p.name} exited ({p.p.returncode}) while waiting for {what}\n{p.tail()}")
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n" + "\n".join(p.tail() for p in procs))


def drop_into(incoming: Path, src: Path, name: str) -> float:
    """Copy a drop the way producers must: everything, then _READY last; returns when _READY appeared."""
    dest = incoming / name
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("_READY"))
    (dest / "_READY").write_bytes(b"")
    return time.time()


def flow_runs(url: str, flow_name: str, *, state: str | None = None) -> list[dict]:
    body: dict = {"flows": {"name": {"any_": [flow_name]}}, "sort": "START_TIME_ASC"}
    if state:
        body["flow_runs"] = {"state": {"type": {"any_": [state]}}}
    return api(url, "/flow_runs/filter", body)


# Operations tests check processes, not the gate's figures: the deep recogniser on a small sample, no
# recogniser identity check, the earlier utility protocols (report evidence only) once.
QUICK_GATE = {"DEID_IDENTITY_EMBED_MAX": "0", "DEID_DEEP_ATTACK_SAMPLE": "20", "DEID_MIN_PROBES": "4",
              "DEID_CV_REPEATS": "1"}


def clean_env(project: Path, prefect_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a deid subprocess: no inherited PREFECT_*/DEID_*, no telemetry, one BLAS thread."""
    # The session's descriptor store (tests/conftest.py) stays: it changes no result, only what is computed again.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "DEID_")) or k == "DEID_DESCRIPTOR_CACHE"}
    env.update(DEID_PROJECT_DIR=str(project), DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_HOME=str(prefect_home), PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1", **extra)
    return env


def start_server(port: int, env: dict, logs: Path, procs: list, *, reports_port: int | None = None) -> Proc:
    """`deid server` on ``port``, added to ``procs`` (stopped by the caller), once its /api/health answers.

    Its read-only reports server on ``reports_port`` (default: a free port, never a guessed one).
    """
    url = f"http://127.0.0.1:{port}/api"
    reports_port = reports_port or free_port()
    server = Proc("server", [*DEID, "server", "--port", str(port), "--reports-port", str(reports_port)], env=env,
                  logs=logs)
    server.reports_port = reports_port
    procs.append(server)

    def healthy():
        try:
            return api(url, "/health") is True
        except OSError:
            return False

    wait_for("the Prefect server's /api/health", healthy, 90, [server])
    return server


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """A Prefect server on a free port, `deid serve` and `deid watch` against it, in a fresh project dir.

    One per test session (per xdist worker): the ops modules share it (their tests carry
    ``xdist_group("ops")``), so each test finds its own runs by drop name, never by counting all runs.
    """
    base = tmp_path_factory.mktemp("ops")
    project, logs = base / "project", base / "logs"
    incoming = project / "data" / "incoming"
    incoming.mkdir(parents=True)
    logs.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = clean_env(project, base / "prefect-client", **QUICK_GATE, DEID_DASK_WORKERS="1")
    procs: list[Proc] = []
    try:
        t0 = time.monotonic()
        server = start_server(port, env, logs, procs)
        server_s = time.monotonic() - t0
        client_env = dict(env, PREFECT_API_URL=url)
        serve = Proc("serve", [*DEID, "serve"], env=client_env, logs=logs)
        procs.insert(0, serve)
        watch = Proc("watch", [*DEID, "watch", str(incoming), "--interval", "0.5"], env=client_env, logs=logs)
        procs.insert(0, watch)

        def deployments_ready():
            names = {d["name"] for d in api(url, "/deployments/filter", {})}
            return {"release", "release-on-drop"} <= names

        wait_for("both deployments", deployments_ready, 60, procs)
        wait_for("the watcher", lambda: "deid watch:" in watch.log.read_text(), 30, procs)
        yield {"url": url, "port": port, "reports_port": server.reports_port, "project": project, "incoming": incoming, "procs": procs,
               "watch": watch, "serve": serve, "base": base, "server_seconds": round(server_s, 1)}
    finally:
        from cpu_report import fixture_teardown  # `--cpu-report`: the stack's processes, reaped here

        # Clients first: serve pauses its deployments on SIGTERM, which needs the server.
        with fixture_teardown("stack"):
            for p in procs:
                p.stop()


SITES = ("site-a-2026-01", "site-b-2026-01")
DATASET = "site-clinic"  # drop a's dataset: tests/ops/test_ops_lineage.py drops its second release


def synthetic_drop(path: Path, people: int, seed: int, *, dataset: str | None = None) -> Path:
    """A synthetic drop (two photos per person), optionally declaring its ``dataset:`` (release lineage)."""
    from deid.intake.synth import make_synthetic_drop

    drop = make_synthetic_drop(path, people=people, images_per_person=2, seed=seed)
    if dataset:
        with open(drop / "drop.yaml", "a", encoding="utf-8") as fh:
            fh.write(f"dataset: {dataset}\n")
    return drop


@pytest.fixture(scope="session")
def two_releases(stack, tmp_path_factory):
    """Two different drops dropped at once; waits until both on-drop runs completed.

    Drop a (60 people, seed 7) is the first release of the dataset ``DATASET``: the ops tests of
    lineage redrop that dataset instead of releasing a third 60-person drop of their own.
    """
    src = tmp_path_factory.mktemp("drops")
    a = synthetic_drop(src / "a", 60, 7, dataset=DATASET)
    b = synthetic_drop(src / "b", 60, 8)
    t_a = drop_into(stack["incoming"], a, SITES[0])
    t_b = drop_into(stack["incoming"], b, SITES[1])
    url = stack["url"]
    done = wait_for("two completed release-on-drop runs",
                    lambda: (r := runs_for(url, "release-on-drop", SITES, state="COMPLETED")) and len(r) >= 2 and r,
                    600, stack["procs"], interval=1.0)  # two 60-person runs at once; wide for a loaded machine
    return {"src": a, "dropped_at": {SITES[0]: t_a, SITES[1]: t_b}, "runs": done}


def runs_for(url: str, flow_name: str, names, *, state: str | None = None) -> list[dict]:
    """The runs of ``flow_name`` whose ``drop`` parameter is one of the drop directory ``names``."""
    return [r for r in flow_runs(url, flow_name, state=state) if Path(r["parameters"].get("drop", "")).name in names]


def chromium() -> str:
    """The headless Chromium executable (the ops browser tests fail clearly without it)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("headless Chromium is missing: install it with `apt-get install -y chromium` (.ci/run does)")
    return exe


def browser(exe: str, profile: Path, url: str, *, screenshot: Path | None = None) -> str:
    """Load ``url`` in headless Chromium: its DOM, or a screenshot."""
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", "--virtual-time-budget=15000", "--window-size=1400,1000"]
    cmd += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    res = subprocess.run([*cmd, url], capture_output=True, timeout=90, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr.decode(errors="replace")[-2000:]
    return res.stdout.decode(errors="replace")
