"""Operations end to end: a real Prefect server, `deid serve` and `deid watch` processes, the UI in Chromium.

Everything is on loopback, bounded in time, and every process started here is stopped in a
fixture teardown (process groups: SIGTERM, then SIGKILL).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deid.operations.ledger import Ledger
from deid.intake.synth import make_synthetic_drop
from deid.release.verify import verify_report


pytestmark = [pytest.mark.slow, pytest.mark.ops]
ROOT = Path(__file__).resolve().parents[1]
DEID = [sys.executable, "-m", "deid.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A started process group with its log file; ``stop()`` is idempotent."""

    def __init__(self, name: str, cmd: list[str], *, env: dict, logs: Path, cwd: Path = ROOT):
        self.name = name
        self.log = logs / f"{name}.log"
        self._fh = open(self.log, "wb")
        self.p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self._fh, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)

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


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A Prefect server on a free port, `deid serve` and `deid watch` against it, in a fresh project dir."""
    base = tmp_path_factory.mktemp("ops")
    project, logs = base / "project", base / "logs"
    incoming = project / "data" / "incoming"
    incoming.mkdir(parents=True)
    logs.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DEID_"))}
    # Operations, not the gate's figures: deep recogniser on a small sample, no recogniser identity check.
    env.update(DEID_IDENTITY_EMBED_MAX="0", DEID_DEEP_ATTACK_SAMPLE="20")
    env.update(DEID_PROJECT_DIR=str(project), DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_HOME=str(base / "prefect-client"), PYTHONUNBUFFERED="1", DEID_DASK_WORKERS="1",
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    procs: list[Proc] = []
    try:
        t0 = time.monotonic()
        server = Proc("server", [*DEID, "server", "--port", str(port)], env=env, logs=logs)
        procs.append(server)

        def healthy():
            try:
                return api(url, "/health") is True
            except OSError:
                return False

        wait_for("the Prefect server's /api/health", healthy, 90, [server])
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
        yield {"url": url, "port": port, "project": project, "incoming": incoming, "procs": procs,
               "watch": watch, "serve": serve, "base": base, "server_seconds": round(server_s, 1)}
    finally:
        # Clients first: serve pauses its deployments on SIGTERM, which needs the server.
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def two_releases(stack, tmp_path_factory):
    """Two different drops dropped at once; waits until both on-drop runs completed."""
    src = tmp_path_factory.mktemp("drops")
    a = make_synthetic_drop(src / "a", people=60, images_per_person=2, seed=7)
    b = make_synthetic_drop(src / "b", people=60, images_per_person=2, seed=8)
    t_a = drop_into(stack["incoming"], a, "site-a-2026-01")
    t_b = drop_into(stack["incoming"], b, "site-b-2026-01")
    url = stack["url"]
    done = wait_for("two completed release-on-drop runs",
                    lambda: (r := flow_runs(url, "release-on-drop", state="COMPLETED")) and len(r) >= 2 and r,
                    120, stack["procs"], interval=1.0)
    return {"src": a, "dropped_at": {"site-a-2026-01": t_a, "site-b-2026-01": t_b}, "runs": done}


def _iso(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def test_drops_are_released_once_each(stack, two_releases):
    url, project = stack["url"], stack["project"]
    runs = two_releases["runs"]
    assert len(runs) == 2 and all(r["state_type"] == "COMPLETED" for r in runs)
    assert {Path(r["parameters"]["drop"]).name for r in runs} == {"site-a-2026-01", "site-b-2026-01"}
    ledger = Ledger(project / "data" / "ledger.sqlite")
    entries = {Path(e.drop_path).name: e for e in ledger.entries()}
    assert set(entries) == {"site-a-2026-01", "site-b-2026-01"}
    figures = {}
    for name, e in entries.items():
        assert e.status == "released" and e.verdict == "released", e
        report = Path(e.report)
        assert report.is_file() and report.with_name("report.json.sig").is_file()
        res = verify_report(report.parent, public_key=project / "data" / "keys" / "dev_signing.pub.pem")
        assert res.ok and res.authenticated, res.problems
        body = json.loads(report.read_text())
        assert body["verdict"] == "released" and body["release_id"] == e.release_id
        ds = body["dataset"]
        assert ds["records_in"] == 120 == ds["records_released"] + ds["records_suppressed"] + ds["records_quarantined"]
        run = next(r for r in runs if Path(r["parameters"]["drop"]).name == name)
        t_drop = two_releases["dropped_at"][name]
        figures[name] = {"drop_to_flow_start_s": round(_iso(run["start_time"]) - t_drop, 1),
                         "drop_to_report_s": round(report.stat().st_mtime - t_drop, 1)}
        assert figures[name]["drop_to_report_s"] < 60, figures
    print(f"\nops figures: server healthy after {stack['server_seconds']} s; {json.dumps(figures)}")

    # The same content again under another name: reported as a duplicate, never released twice.
    t_dup = drop_into(stack["incoming"], two_releases["src"], "site-a-2026-01-resent")
    wait_for("the watcher's duplicate report",
             lambda: any(s["outcome"] == "duplicate" and s["drop_path"].endswith("-resent")
                         for s in ledger.sightings()), 30, stack["procs"])
    assert "duplicate:" in stack["watch"].log.read_text()
    time.sleep(4)  # two runner polls: a wrongly triggered run would exist by now
    assert len(flow_runs(url, "release-on-drop")) == 2
    assert len(flow_runs(url, "release")) == 2
    assert len(list((project / "reports").glob("*/report.json"))) == 2
    assert len(ledger.entries()) == 2
    print(f"duplicate detected {round(time.time() - t_dup, 1)} s after drop (upper bound)")

    # A duplicate event (e.g. replayed) reaching release-on-drop does not release either.
    dup = api(url, "/deployments/name/release-on-drop/release-on-drop", None)
    fr = api(url, f"/deployments/{dup['id']}/create_flow_run",
             {"parameters": {"drop": str(stack["incoming"] / "site-a-2026-01-resent")}})
    final = wait_for("the replayed run", lambda: (r := api(url, f"/flow_runs/{fr['id']}"))["state_type"] in (
        "COMPLETED", "FAILED", "CRASHED") and r, 60, stack["procs"])
    assert final["state_type"] == "COMPLETED"
    assert len(flow_runs(url, "release")) == 2 and len(ledger.entries()) == 2


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("headless Chromium is missing: install it with `apt-get install -y chromium` (.ci/run does)")
    return exe


def _browser(exe: str, profile: Path, url: str, *, screenshot: Path | None = None) -> str:
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", "--virtual-time-budget=15000", "--window-size=1400,1000"]
    cmd += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    res = subprocess.run([*cmd, url], capture_output=True, timeout=90, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr.decode(errors="replace")[-2000:]
    return res.stdout.decode(errors="replace")


def test_flow_run_page_in_a_real_browser(stack, two_releases, tmp_path):
    exe = _chromium()
    url, port = stack["url"], stack["port"]
    run = two_releases["runs"][0]
    page = f"http://127.0.0.1:{port}/runs/flow-run/{run['id']}"
    dom = _browser(exe, tmp_path / "profile", page)
    assert run["name"] in dom, f"flow run name {run['name']!r} not in the UI page's DOM"
    assert "Completed" in dom and "release-on-drop" in dom
    shot = tmp_path / "flow-run.png"
    _browser(exe, tmp_path / "profile", page, screenshot=shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    # Artifacts of the run and of its release subflow, when the API says there are any.
    subflows = api(url, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run["id"]]}}})
    ids = [run["id"], *(s["id"] for s in subflows)]
    artifacts = api(url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": ids}}})
    for art in artifacts:
        dom = _browser(exe, tmp_path / "profile", f"http://127.0.0.1:{port}/artifacts/artifact/{art['id']}")
        assert (art["key"] or art["id"]) in dom, f"artifact {art['key']} not shown"
        if art["key"] == "deid-ledger":
            release_id = re.search(r"rel-[0-9a-f]+", art["data"]).group(0)
            assert release_id in dom, f"the ledger artifact's release id {release_id} is not shown"
    print(f"\nUI: {page} ({len(artifacts)} artifact(s)); screenshot {shot}")
