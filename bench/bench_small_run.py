"""Benchmark a whole small release run: wall, CPU and per-stage seconds (issue 9: under 20 s).

The drop is the one of issue 9, made by
``deid synth D --people 15 --images-per-person 11 --format gif --condition-values 11 --seed 3``,
released with ``deid run D --k 5``. Three ways of running it:

- ``ephemeral``: ``deid run`` with no Prefect server configured (deid starts Prefect's temporary
  server itself);
- ``reuse``: ``deid run`` while a ``deid server`` of the same project is up (the bench starts
  one first, on ``--port``); ``deid run`` finds it through the server's port file;
- ``plain``: the Prefect-free runner, :func:`deid.operations.runner.run_release`, in one process
  (its default executor), to separate Prefect's cost from deid's;
- ``plain-pool``: the same runner on the :class:`~deid.pool.PoolExecutor` a small
  drop gets in the flow (``DEID_DASK_WORKERS`` processes, this one included).

Usage::

    .venv/bin/python bench/bench_small_run.py                      # all three modes, once each
    .venv/bin/python bench/bench_small_run.py --modes ephemeral --repeat 3 --json out.json

Each run gets a fresh project directory (no lineage from an earlier run), except ``reuse``, which
shares the server's project and gives every run its own dataset name. CPU is user + sys of the
command and every process it waited for (Dask workers, Prefect's temporary server); in ``reuse``
mode the server's own CPU during the run is printed separately. Wall times on a shared machine
are inflated by other jobs: compare CPU seconds, and the machine's load average printed with
each run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from deid.reporting.report import stage_usage_of

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SYNTH = ["--people", "15", "--images-per-person", "11", "--format", "gif", "--condition-values", "11", "--seed", "3"]

PLAIN = r"""
import json, os, sys, time
for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(v, "1")
import logging
logging.basicConfig(level=logging.WARNING)
from deid.operations.runner import run_release
from deid.run_config import RunConfig
from deid.settings import Settings
from deid.reporting.report import stage_usage_of
config = RunConfig.resolve(Settings(), k=int(sys.argv[2]))
if sys.argv[3] == "pool":
    import contextlib
    from deid.operations.executors import PoolExecutor, warm_validation, warm_worker

    @contextlib.contextmanager
    def pool(cfg):
        ex = PoolExecutor(cfg.dask_workers, warm=warm_worker, validate=warm_validation)
        try:
            yield ex
        finally:
            ex.close()

    res = run_release(sys.argv[1], config, cluster=pool)
else:
    res = run_release(sys.argv[1], config)
print("report: " + str(res.report_path))
"""


def _env(project: Path, prefect_home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEID_", "PREFECT_API_URL"))}
    env.update(DEID_PROJECT_DIR=str(project), PREFECT_HOME=str(prefect_home), PYTHONPATH=str(ROOT),
               DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return env


def _tree_cpu(pid: int) -> float:
    """User + sys seconds of a process and its live descendants (the reused server's own cost)."""
    import psutil  # noqa: PLC0415 (a dependency of distributed)

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_once(cmd: list[str], env: dict, *, label: str) -> dict:
    """Run ``cmd``; wall, CPU (rusage of it and its waited-for descendants), stage seconds from its report."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marks: dict[str, float] = {}
    err_lines: list[str] = []

    def read_err() -> None:
        for line in proc.stderr:
            err_lines.append(line)
            now = time.perf_counter() - t0
            if "Beginning flow run" in line:
                marks.setdefault("flow_started", round(now, 2))
            elif line.startswith("deid run: prefect"):
                marks.setdefault("prefect_ready", round(now, 2))
            elif "prefect.flow_runs" in line and "Finished in state" in line:
                marks.setdefault("flow_finished", round(now, 2))
            elif line.startswith("deid run: stage seconds"):
                marks.setdefault("summary", round(now, 2))

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    reader.join(timeout=5)
    proc.returncode = os.waitstatus_to_exitcode(status)
    report_line = [ln for ln in out.splitlines() if ln.startswith("report: ")]
    if not report_line:
        sys.stderr.write("".join(err_lines[-40:]) + out)
        raise SystemExit(f"{label}: no report (exit {proc.returncode})")
    report = json.loads(Path(report_line[0].split(": ", 1)[1]).read_text())
    prefect_line = next((ln.strip() for ln in err_lines if ln.startswith("deid run: prefect")), None)
    return {
        "mode": label, "exit": proc.returncode, "wall": round(wall, 2),
        "cpu": round(usage.ru_utime + usage.ru_stime, 2),
        "user": round(usage.ru_utime, 2), "sys": round(usage.ru_stime, 2), "load": os.getloadavg()[0],
        "marks": marks, "prefect": prefect_line, "stages": {k: stage_usage_of(v)["wall"] for k, v in report["configuration"].get("stage_seconds", {}).items()},
        "verdict": report["verdict"], "privacy": report.get("privacy"),
        "checks": {c["name"]: [c.get("status"), c.get("value")] for c in report["checks"]},
        "utility": [[u["label"], u.get("protocol"), u.get("original_accuracy"), u.get("deidentified_accuracy")]
                    for u in report["utility"]],
    }


def start_server(project: Path, prefect_home: Path, port: int) -> subprocess.Popen:
    env = _env(project, prefect_home)
    proc = subprocess.Popen([PY, "-m", "deid.cli", "server", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"deid server exited with {proc.returncode}")
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("deid server did not become healthy in 180 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def show(r: dict) -> None:
    stages = "  ".join(f"{k} {v:.2f}" for k, v in r["stages"].items())
    extra = f"  server CPU during run {r['server_cpu']:.2f} s" if "server_cpu" in r else ""
    print(f"{r['mode']:<10} wall {r['wall']:6.2f} s  CPU {r['cpu']:6.2f} s (user {r['user']:.2f} sys {r['sys']:.2f})"
          f"{extra}  load {r['load']:.1f}  verdict {r['verdict']} (exit {r['exit']})")
    if r["prefect"]:
        print(f"           {r['prefect']}")
    if r["marks"]:
        print("           " + "  ".join(f"{k} at {v:.2f} s" for k, v in r["marks"].items()))
    print(f"           stages: {stages}  (sum {sum(r['stages'].values()):.2f} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drop", type=Path, default=None, help="the drop (default: synthesise issue 9's drop)")
    ap.add_argument("--modes", default="ephemeral,reuse,plain,plain-pool",
                    help="comma-separated: ephemeral, reuse, plain, plain-pool")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--port", type=int, default=4391, help="port of the reused server (mode reuse)")
    ap.add_argument("--explicit-url", action="store_true",
                    help="mode reuse: also export PREFECT_API_URL (instead of relying on the server's port file)")
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one, removed)")
    ap.add_argument("--json", type=Path, default=None, help="write every run's figures and checks here")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ephemeral", "reuse", "plain", "plain-pool")]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from ephemeral, reuse, plain, plain-pool")
    work = args.work or Path(tempfile.mkdtemp(prefix="deid-bench-small-"))
    work.mkdir(parents=True, exist_ok=True)
    prefect_home = work / "prefect-home"  # one Prefect home: its database exists after the first start
    drop = args.drop
    if drop is None:
        drop = work / "D"
        if not (drop / "manifest.csv").is_file():
            subprocess.run([PY, "-m", "deid.cli", "synth", str(drop), *SYNTH], check=True,
                           env=_env(work / "synth", prefect_home), stdout=subprocess.DEVNULL)
    print(f"drop {drop}; k={args.k}; {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    results = []
    server = None
    try:
        for mode in modes:
            if mode == "reuse":
                shared = work / "reuse-project"
                t = time.perf_counter()
                server = start_server(shared, prefect_home, args.port)
                print(f"deid server on port {args.port} healthy after {time.perf_counter() - t:.1f} s")
            for i in range(args.repeat):
                if mode in ("plain", "plain-pool"):
                    project = work / f"{mode}-{i}"
                    how = "pool" if mode == "plain-pool" else "local"
                    r = run_once([PY, "-c", PLAIN, str(drop), str(args.k), how], _env(project, prefect_home),
                                 label=mode)
                elif mode == "ephemeral":
                    project = work / f"ephemeral-{i}"
                    r = run_once([PY, "-m", "deid.cli", "run", str(drop), "--k", str(args.k)],
                                 _env(project, prefect_home), label=mode)
                else:
                    env = _env(work / "reuse-project", prefect_home)
                    if args.explicit_url:
                        env["PREFECT_API_URL"] = f"http://127.0.0.1:{args.port}/api"
                    before = _tree_cpu(server.pid)
                    r = run_once([PY, "-m", "deid.cli", "run", str(drop), "--k", str(args.k), "--name",
                                  f"D-reuse-{i}"], env, label=mode)
                    r["server_cpu"] = round(_tree_cpu(server.pid) - before, 2)
                show(r)
                results.append(r)
            if server is not None:
                stop_server(server)
                server = None
    finally:
        if server is not None:
            stop_server(server)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
