"""Issue 27 item 4: a lineage no one can roll back.

The registry head is bound into every signed report; a registry restored from an earlier copy (or
deleted) is refused before a run with a signed ``state`` rejection (exit 70). The differencing attack
also runs against the dataset's published releases on disk, so a bypassed registry still has its
releases attacked.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from deid.cli import EXIT_STATE, exit_code_for
from deid.errors import StateError
from deid.intake.synth import make_synthetic_drop
from deid.operations import pipeline
from deid.operations.runner import run_release
from deid.release.lineage import GENESIS_PREV, LineageError, LineageState
from deid.release.lineage_anchor import SignedHead, check_registry_head
from deid.release.lineage_registry import lineage_dir
from deid.release.verify import verify_report
from deid.run_config import RunConfig
from deid.settings import Settings

QUICK = dict(identity_embed_max=0, deep_attack_sample=20, min_probes=4, cv_repeats=1)
DATASET = "ward"


def _drop(path: Path, people: int) -> Path:
    # Person n is the same (same bytes) in every drop of a seed: drop 2 is drop 1 with the last person gone.
    drop = make_synthetic_drop(path, people=people, images_per_person=2, seed=11, labels=False, image_size=96)
    with open(drop / "drop.yaml", "a", encoding="utf-8") as fh:
        fh.write(f"dataset: {DATASET}\n")
    return drop


def _reports(config: RunConfig) -> dict[str, dict]:
    return {p.name: json.loads((p / "report.json").read_text()) for p in config.reports_path.iterdir()
            if (p / "report.json").is_file()}


def test_a_registry_restored_from_an_earlier_copy_or_deleted_is_refused_with_a_signed_rejection(tmp_path):
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", **QUICK), k=3)
    r1 = run_release(_drop(tmp_path / "d1", 9), config)
    assert r1.verdict == "released", r1.report.reasons
    head1 = r1.report.lineage["registry_head"]
    reg_dir = lineage_dir(config.data_path, DATASET)
    backup = tmp_path / "registry-after-release-1"
    shutil.copytree(reg_dir, backup)

    d2 = _drop(tmp_path / "d2", 8)   # one person leaves
    r2 = run_release(d2, config)
    assert r2.verdict == "released", r2.report.reasons
    head2 = r2.report.lineage["registry_head"]
    # The signed report binds the head after its own (pending) entry: past the head release 2 was planned on.
    assert head2["seq"] > r2.report.lineage["based_on_entry"] >= head1["seq"]
    pub = config.data_path / "keys" / "dev_signing.pub.pem"
    assert verify_report(r2.report_path.parent, public_key=pub).ok

    shutil.rmtree(reg_dir)
    shutil.copytree(backup, reg_dir)   # the registry as it was after release 1: a valid, shorter chain
    before = set(_reports(config))
    with pytest.raises(StateError, match="rolled back") as exc:
        run_release(d2, config)
    assert exit_code_for(exc.value) == EXIT_STATE == 70
    [rid] = set(_reports(config)) - before
    report = _reports(config)[rid]
    assert report["verdict"] == "rejected" and report["release_dir"] is None
    [check] = report["checks"]
    assert check["name"] == "state" and not check["passed"]
    assert f"entry {head2['seq']:08d}" in check["detail"] and r2.release_id in check["detail"]
    assert verify_report(config.reports_path / rid, public_key=pub).ok
    assert sorted(p.name for p in config.releases_dir.iterdir()) == sorted([r1.release_id, r2.release_id])

    shutil.rmtree(reg_dir)   # deleted outright: refused as well
    with pytest.raises(StateError, match="is missing"):
        run_release(d2, config)
    assert sorted(p.name for p in config.releases_dir.iterdir()) == sorted([r1.release_id, r2.release_id])


def test_check_registry_head_accepts_the_signed_chain_and_refuses_older_or_other_chains():
    s = LineageState("ward").with_entry({"kind": "genesis"})
    for n in (1, 2):
        s = s._appended({"kind": "note", "n": n})[0]
    heads = [e["prev"] for e in s.entries[1:]] + [s.head]   # chain hash after entries 0, 1, 2
    for seq, h in enumerate(heads):
        check_registry_head(s, SignedHead(seq, h, "rel-x"))           # a head the chain reaches: accepted
    check_registry_head(s, None)                                        # no signed report names a head
    with pytest.raises(LineageError, match="rolled back"):
        check_registry_head(s, SignedHead(3, "ab" * 32, "rel-x"))
    with pytest.raises(LineageError, match="replaced"):
        check_registry_head(s, SignedHead(1, "ab" * 32, "rel-x"))
    with pytest.raises(LineageError, match="missing"):
        check_registry_head(LineageState("ward"), SignedHead(0, heads[0], "rel-x"))
    assert GENESIS_PREV not in heads
