"""Fault matrix (issue 11): kill `deid run` at every stage boundary and fill the data and reports disks.

After every fault, ``data/releases/`` must hold only complete releases whose signed report
verifies against the signer's key, and a rerun must succeed. Kills are real SIGKILLs of a
`deid run` process (forked from one that imported the run's packages: tests/forked_cli.py), placed deterministically by the test-only hook
``DEID_FAULT_INJECT=kill:after:<stage>``; a full disk is ``DEID_FAULT_INJECT=enospc:<location>``
(an ``OSError(ENOSPC)`` at the first write there). One Prefect server serves every run.
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
from helpers import identifying_text_in_reports, assert_nothing_published

from deid.operations.safety import ADDENDUM_NAME, FAULT_ENV
from deid.intake.synth import make_synthetic_drop
from deid.reporting.verify import verify_report

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KILLS = ["kill:after:ingest", "kill:after:align", "kill:after:gate", "kill:after:sign", "kill:after:publish"]
DISK_FULL = ["enospc:data", "enospc:stage", "enospc:reports"]
# Operations tests check processes, commitment order and recovery, not the gate's figures: the
# gate still runs every check and attacker, with the deep recogniser on a small sample and
# without the (per-face, ~0.09 s) recogniser identity check.
_QUICK = {"DEID_IDENTITY_EMBED_MAX": "0", "DEID_DEEP_ATTACK_SAMPLE": "20", "DEID_MIN_PROBES": "4"}
FAST = {"DEID_CV_REPEATS": "1", "DEID_DASK_WORKERS": "1", **_QUICK}


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


def test_rare_labels_stay_out_of_the_report_and_formulas_out_of_release_csv(project, prefect_server, tmp_path,
                                                                           monkeypatch):
    """A suppressed partition is described by counts only; a formula label is neutralised in release.csv."""
    import csv

    from deid.flows.release import run_flow
    from deid.reporting.catalogue_page import write_index

    for key, value in FAST.items():
        monkeypatch.setenv(key, value)
    # 30 people: label cells of ~7 people, so the cross-fitted utility check (which
    # de-identifies 4/5 of the people per fold) is not starved of whole cells.
    def rare_drop(name: str, seed: int) -> tuple[Path, list[str]]:
        drop = make_synthetic_drop(tmp_path / name, people=30, images_per_person=2, seed=seed)
        lines = (drop / "manifest.csv").read_text().splitlines()
        out = [lines[0]]
        for line in lines[1:]:
            cells = line.split(",")
            if cells[1] == "s00001":
                cells[3] = "RAREVALUE"  # one person: a partition of 1 < k people, suppressed
            if cells[2] == "female":
                cells[2] = '=HYPERLINK("http://x")'.replace(",", ";")
            out.append(",".join(cells))
        (drop / "manifest.csv").write_text("\n".join(out) + "\n")
        return drop, out

    drop, out = rare_drop("drop", 1)
    result = run_flow(str(drop), k=3).summary()
    assert result["verdict"] == "released", result["reasons"]
    assert result["dataset"]["records_suppressed"] >= 1
    report_dir = Path(result["report_dir"])
    leaked = [p.relative_to(report_dir).as_posix() for p in report_dir.rglob("*")
              if p.is_file() and b"RAREVALUE" in p.read_bytes()]
    assert not leaked, f"a suppressed partition's label value appears in {leaked}"
    report = json.loads((report_dir / "report.json").read_text())
    small = report["configuration"]["small_partitions_detail"]
    assert all(set(e) == {"records", "people", "action"} for e in small)
    # The one-person partition is held back either by the partition policy or, for a dataset's
    # lineage, by the release plan (newcomers wait until k of them share a partition): by counts.
    lineage = report.get("lineage") or {}
    by_reason = lineage.get("suppressed_by_reason", {})
    assert small or (lineage.get("suppressed_records", 0) >= 1 and by_reason), (small, lineage)
    assert all(isinstance(v, int) for v in by_reason.values())
    with open(Path(result["release_dir"]) / "release.csv", newline="", encoding="utf-8") as fh:
        genders = {r["gender"] for r in csv.DictReader(fh)}
    assert "'=HYPERLINK(\"http://x\")" in genders and not any(g.startswith("=") for g in genders)
    # Issue 28: merging the small partition instead kept the rare value in the would-be release, and the
    # rejection's reasons, report.html and validation page named it; now counted, never named. No report
    # (the released one, the rejection, the validation pages, the catalogue) names a subject id either.
    # A first release: other people (another seed, the same ids and labels). The same photographs under another
    # dataset name would be refused by the project's person index (issue 27), before the gate.
    other, out2 = rare_drop("other", 2)
    merged = run_flow(str(other), k=3, small_partitions="merge", name="rare-merge").summary()
    assert merged["verdict"] == "rejected" and any("expectations_release" in r for r in merged["reasons"])
    subjects = {line.split(",")[1] for line in out[1:] + out2[1:]}
    write_index(project / "reports")
    # Every kind of file the issue names was written and read: both runs' reports and pages, a validation
    # page of each, and the catalogue.
    reports = sorted(p.parent.name for p in (project / "reports").glob("*/report.json"))
    assert len(reports) == 2, reports
    kinds = [f"{rid}/{name}" for rid in reports for name in ("report.json", "report.html", "validation/*.html")]
    leaked = identifying_text_in_reports(project / "reports", ["RAREVALUE", *sorted(subjects)],
                                         must_read=[*kinds, "index.html"])
    assert not leaked, f"a rare label value or a subject id in a report: {leaked[:10]}"


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


def test_publish_failing_after_signing_leaves_a_signed_addendum_and_nothing_published(project, prefect_server,
                                                                                       tmp_path, monkeypatch):
    import errno

    import deid.release.publish
    from deid.errors import EnvironmentFailure
    from deid.flows.release import run_flow

    for key, value in FAST.items():
        monkeypatch.setenv(key, value)

    def refuse(staged, final):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(final))

    monkeypatch.setattr(deid.release.publish, "commit_release", refuse)
    drop = make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=1)
    with pytest.raises(EnvironmentFailure, match="after its report was signed"):
        run_flow(str(drop), k=3)
    (report_dir,) = list((project / "reports").iterdir())
    pub = project / "data" / "keys" / "dev_signing.pub.pem"
    assert json.loads((report_dir / "report.json").read_text())["verdict"] == "released"
    add = json.loads((report_dir / ADDENDUM_NAME).read_text())
    assert add["event"] == "publish_failed" and add["release_published"] is False
    res = verify_report(report_dir, public_key=pub)
    # The report is genuine, the release it describes was never published, and verify says both.
    assert not res.ok and res.authenticated and any("not found" in p for p in res.problems)
    assert any(n.startswith("addendum: publish_failed") for n in res.notes)
    assert_nothing_published(project / "data" / "releases")
    assert not list((project / "data" / "staging").iterdir())
    assert not (project / "data" / "private").exists() or not list((project / "data" / "private").rglob("*.bin"))
    # A forged addendum does not verify.
    (report_dir / ADDENDUM_NAME).write_text((report_dir / ADDENDUM_NAME).read_text().replace("publish_failed", "x"))
    assert any("bad signature: addendum" in p for p in verify_report(report_dir, public_key=pub).problems)
