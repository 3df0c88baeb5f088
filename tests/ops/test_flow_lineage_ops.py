"""Operations on a dataset's lineage registry through the real flow (issue 10): kills.

A run SIGKILLed right after registering its pending entry (no report signed yet), then one killed
right after publishing (entry still pending): the next run reconciles (abandoned / published), the
chain continues, no half-written entry, nothing published without a verifying signed report.
A run racing another of its dataset (no process killed) is tests/flow/test_flow_lineage_race.py.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from forked_cli import ForkedCli
from ops.test_faults import FAST, _leftovers, _releases_without_verified_report

from deid.release.lineage_registry import Registry, lineage_dir
from deid.release.linkage import linkage_path, load_linkage_key, read_linkage
from deid.operations.safety import FAULT_ENV
from deid.intake.synth import make_synthetic_drop

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DATASET = "lab-faces"
# The subject is the registry and the ledger, not the gate's figures: 12 people are too few for the
# cross-fitted utility folds to decide, so utility may not block here.
OPS = {**FAST, "DEID_UTILITY_TOLERANCE": "1.0"}


def _drop(path: Path, people: int = 12) -> Path:
    drop = make_synthetic_drop(path, people=people, images_per_person=2, seed=5)
    with open(drop / "drop.yaml", "a", encoding="utf-8") as fh:
        fh.write(f"dataset: {DATASET}\n")
    return drop


def _registry(project: Path) -> Registry:
    return Registry.open(project / "data", DATASET, load_linkage_key(project / "data" / "keys" / "dev_linkage.key"))


def _kinds(state) -> list[tuple[str, str | None]]:
    return [(d["kind"], d.get("release_id")) for d in state.entries]


def _no_partial_entry(project: Path) -> None:
    root = lineage_dir(project / "data", DATASET)
    files = sorted(p.name for p in root.iterdir() if p.is_file())
    assert files[-1] == "HEAD" and all(f.endswith(".entry") and len(f) == 14 for f in files[:-1]), files
    # The sealed averages beside the entries: whole packs only (a pack is written to a temporary name first).
    assert all(p.suffix == ".pack" and not p.name.startswith(".") for p in (root / "images").iterdir())


def test_kills_between_registering_and_publishing_are_reconciled_by_the_next_run(project, prefect_server, tmp_path,
                                                                                 monkeypatch, request):
    from prefect.settings import PREFECT_API_URL

    from deid.flows.release import run_flow

    for name, value in OPS.items():
        monkeypatch.setenv(name, value)
    drop = _drop(tmp_path / "drop")
    env = {**os.environ, "DEID_PROJECT_DIR": str(project), "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PYTHONPATH": str(ROOT)}

    # The killed runs are `deid run` processes forked from one that imported the run's packages once.
    cli = ForkedCli(env, ROOT, tmp_path / "cli")
    request.addfinalizer(cli.close)

    def killed_run(fault: str) -> None:
        proc = cli.run(["run", drop, "--k", "3"], env={FAULT_ENV: fault})
        assert proc.returncode == -signal.SIGKILL, f"{fault}: exit {proc.returncode}\n{proc.stderr[-3000:]}"

    # 1. Killed right after its entry was registered (pending), before its report was signed.
    killed_run("kill:after:register")
    state = _registry(project).load()
    (r1,) = state.releases
    assert r1.status == "pending" and r1.new_clusters > 0
    assert not (project / "data" / "releases" / r1.release_id).exists()
    assert not (project / "reports" / r1.release_id / "report.json.sig").exists()
    _no_partial_entry(project)

    # 2. The next run abandons it (dead run, nothing published), registers its own, and is killed right
    #    after publishing, before marking it published.
    killed_run("kill:after:publish")
    state = _registry(project).load()
    assert [(r.release_id, r.status) for r in state.releases][0] == (r1.release_id, "abandoned")
    r2 = state.releases[1]
    assert r2.status == "pending" and r2.new_clusters > 0  # planned afresh: the abandoned clusters bind nobody
    assert (project / "data" / "releases" / r2.release_id).is_dir()
    assert not _releases_without_verified_report(project)

    # 3. The next run marks it published (its release exists) and republishes every cluster bit for bit.
    r3 = run_flow(str(drop), k=3).summary()
    assert r3["verdict"] == "released", r3["reasons"]
    state = _registry(project).load()  # verifies the whole chain and HEAD
    assert _kinds(state) == [("genesis", None), ("release", r1.release_id), ("abandoned", r1.release_id),
                             ("release", r2.release_id), ("published", r2.release_id),
                             ("release", r3["release_id"]), ("published", r3["release_id"])]
    assert state.releases[2].republished_clusters == r2.new_clusters and state.releases[2].new_clusters == 0
    _no_partial_entry(project)
    assert not _releases_without_verified_report(project) and not _leftovers(project)
    key = load_linkage_key(project / "data" / "keys" / "dev_linkage.key")

    def images(release_id: str) -> dict[str, bytes]:
        rows = read_linkage(linkage_path(project / "data", release_id), key)
        rel = project / "data" / "releases" / release_id
        return {r["source_image"]: (rel / r["released_image"]).read_bytes() for r in rows if not r.get("counterfeit")}

    two, three = images(r2.release_id), images(r3["release_id"])
    assert two and set(two) == set(three)
    import cv2  # noqa: PLC0415

    def px(b: bytes) -> bytes:
        return cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_UNCHANGED).tobytes()

    assert all(px(three[s]) == px(two[s]) for s in two)
    print(f"\nkills: register -> {r1.release_id} abandoned; publish -> {r2.release_id} published by the next run; "
          f"{len(state.entries)} chained entries, {len(two)} records bit-identical in the third release")
