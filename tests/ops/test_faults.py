"""Fault matrix (issue 11): kill `deid run` at every stage boundary and fill the data and reports disks.

After every fault, ``data/releases/`` must hold only complete releases whose signed report
verifies against the signer's key, and a rerun must succeed. Kills are real SIGKILLs of a
`deid run` process (forked from one that imported the run's packages: tests/forked_cli.py), placed deterministically by the test-only hook
``DEID_FAULT_INJECT=kill:after:<stage>``; a full disk is ``DEID_FAULT_INJECT=enospc:<location>``
(an ``OSError(ENOSPC)`` at the first write there). One Prefect server serves every run.
The faults of the flow in-process (a failing publish, rare labels) are tests/flow/test_faults.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from forked_cli import ForkedCli
from ops_helpers import QUICK_GATE

from deid.operations.safety import ADDENDUM_NAME, FAULT_ENV
from deid.intake.synth import make_synthetic_drop
from deid.reporting.verify import verify_report

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KILLS = ["kill:after:ingest", "kill:after:align", "kill:after:gate", "kill:after:sign", "kill:after:publish"]
DISK_FULL = ["enospc:data", "enospc:stage", "enospc:reports"]
# Operations tests check processes, commitment order and recovery, not the gate's figures: the
# gate still runs every check and attacker, with the deep recogniser on a small sample and
# without the (per-face, ~0.09 s) recogniser identity check (ops_helpers.QUICK_GATE), on one Dask worker.
FAST = {**QUICK_GATE, "DEID_DASK_WORKERS": "1"}


def _releases_without_verified_report(project: Path) -> list[str]:
    """Every entry of data/releases/ that is not a complete release with a verifying signed report."""
    releases = project / "data" / "releases"
    pub = project / "data" / "keys" / "dev_signing.pub.pem"
    bad = []
    for rel in sorted(releases.iterdir()) if releases.is_dir() else []:
        res = verify_report(project / "reports" / rel.name, public_key=pub)
        if rel.name.startswith(".") or not (res.ok and res.authenticated):
            bad.append(f"{rel.name}: {res.problems}")
    return bad


def _leftovers(project: Path) -> list[str]:
    """Staging directories of runs that did not finish, and temporary files anywhere under data/."""
    staging = project / "data" / "staging"
    out = [d.name for d in staging.iterdir() if not (d / ".complete").exists()] if staging.is_dir() else []
    return out + [str(p) for p in (project / "data").rglob("*.tmp")]


def test_fault_matrix_never_a_release_without_its_signed_report(project, prefect_server, tmp_path, monkeypatch,
                                                                  capsys, request):
    from prefect.settings import PREFECT_API_URL

    from deid.cli import EXIT_ENVIRONMENT, EXIT_OK, main

    drop = make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=1)
    for key, value in FAST.items():
        monkeypatch.setenv(key, value)
    # The faulted runs are forked `deid run` processes, the reruns run in this process; all on the session's
    # Dask worker (DEID_DASK_ADDRESS, set by prefect_server): a LocalCluster per run would add two
    # process starts and a model load to each of the 8 faulted runs. A run killed without an address
    # is test_kill_9_of_deid_run_leaves_no_prefect_server_behind; the demo (test_flow.py) runs
    # `deid run` with its default LocalCluster end to end.
    env = dict(os.environ)
    env.update({"DEID_PROJECT_DIR": str(project), "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)})
    # Each faulted `deid run` is its own process, forked from one that imported the run's packages
    # once (tests/forked_cli.py): eight fresh interpreters would spend ~60 s of CPU on imports alone.
    cli = ForkedCli(env, ROOT, tmp_path / "cli")
    request.addfinalizer(cli.close)
    faults = without_report = 0
    figures = []

    def rerun(after: str) -> None:
        monkeypatch.delenv(FAULT_ENV, raising=False)
        code = main(["run", str(drop), "--k", "3"])
        err = capsys.readouterr().err
        assert code == EXIT_OK, f"rerun after {after} failed ({code}): {err[-2000:]}"
        assert not _leftovers(project), f"after the rerun following {after}: {_leftovers(project)}"

    for fault in KILLS:
        proc = cli.run(["run", drop, "--k", "3"], env={FAULT_ENV: fault})
        assert proc.returncode == -signal.SIGKILL, f"{fault}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        faults += 1
        bad = _releases_without_verified_report(project)
        without_report += len(bad)
        assert not bad, f"after {fault}: {bad}"
        assert not list((project / "data" / "releases").glob(".*")), f"temporary release left after {fault}"
        if fault == "kill:after:sign":
            # Signed "released", never published: recovery (in the rerun) signs an addendum saying so.
            signed = [p.parent for p in (project / "reports").glob("*/report.json")
                      if not (project / "data" / "releases" / p.parent.name).exists()
                      and json.loads(p.read_text())["verdict"] == "released"]
            assert len(signed) == 1
        rerun(fault)
        if fault == "kill:after:sign":
            add = json.loads((signed[0] / ADDENDUM_NAME).read_text())
            assert add["event"] == "not_published" and add["release_published"] is False
        figures.append(fault)

    for fault in DISK_FULL:
        proc = cli.run(["run", drop, "--k", "3"], env={FAULT_ENV: fault})
        faults += 1
        err = proc.stderr
        assert proc.returncode == EXIT_ENVIRONMENT, f"{fault}: exit {proc.returncode}: {err[-3000:]}"
        last = err.strip().splitlines()[-1]
        assert last.startswith("deid run: environment failure") and "No space left on device" in last, last
        assert "Traceback" not in err, err[-3000:]
        bad = _releases_without_verified_report(project)
        without_report += len(bad)
        assert not bad, f"after {fault}: {bad}"
        assert not _leftovers(project), f"after {fault}: {_leftovers(project)}"
        if fault != "enospc:reports":
            # The reports disk still works: the failed run signed a rejection naming the environment.
            newest = max((project / "reports").glob("*/report.json"), key=lambda p: p.stat().st_mtime)
            rep = json.loads(newest.read_text())
            assert rep["verdict"] == "rejected" and "environment failure" in rep["reasons"][0]
        rerun(fault)
        figures.append(fault)

    n_releases = len(list((project / "data" / "releases").iterdir()))
    print(f"\nfault matrix: {faults} faults injected ({', '.join(figures)}); {n_releases} releases, "
          f"{without_report} without a verified signed report")
    assert faults == len(KILLS) + len(DISK_FULL) and without_report == 0
    # kill:after:publish leaves a complete release; every rerun adds one.
    assert n_releases == 1 + faults


def _processes_with_env(name: str, value: str) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            stat_ = (proc / "stat").read_text().split()
        except OSError:
            continue
        if f"{name}={value}".encode() in env and stat_[2] != "Z":
            out.append(int(proc.name))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_kill_9_of_deid_run_leaves_no_prefect_server_behind(project, tmp_path):
    """Without PREFECT_API_URL `deid run` starts a temporary Prefect server and a small drop's pool: both die too."""
    import time

    drop = make_synthetic_drop(tmp_path / "drop", people=6, images_per_person=2, seed=3)
    home = tmp_path / "prefect_home"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"DEID_PROJECT_DIR": str(project), "PREFECT_HOME": str(home), "PYTHONPATH": str(ROOT),
                FAULT_ENV: "kill:after:ingest", "DEID_DASK_WORKERS": "2"})  # 2: a pool process too
    proc = subprocess.run([sys.executable, "-m", "deid.cli", "run", str(drop), "--k", "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "temporary Prefect server started by deid" in proc.stderr  # the server really was started by this run
    for _ in range(50):
        left = _processes_with_env("PREFECT_HOME", str(home))
        if not left:
            break
        time.sleep(0.2)
    assert not left, f"processes of the killed run still alive: {left}"
