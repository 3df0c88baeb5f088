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
from deid.operations.runner import run_release
from deid.release.lineage_state import GENESIS_PREV, LineageError, LineageState
from deid.release.lineage_anchor import SignedHead, check_registry_head
from deid.release.lineage_registry import lineage_dir
from deid.reporting.verify import verify_report
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


def _faces(n: int, hw=(24, 20), seed=0) -> np.ndarray:
    """Smooth random 'faces' (uint8 rows) with a face-like spread per pixel."""
    import cv2

    rng = np.random.default_rng(seed)
    out = [np.clip(128 + 60 * cv2.GaussianBlur(rng.standard_normal(hw), (0, 0), 2.0) * 4, 0, 255) for _ in range(n)]
    return np.stack(out).reshape(n, -1).astype(np.uint8)


def _average(rows: np.ndarray) -> np.ndarray:
    return np.round(rows.astype(np.float64).mean(axis=0)).astype(np.uint8)


def _publish(root: Path, release_id: str, clusters: list[np.ndarray], hw) -> Path:
    """A published release as deid writes it: release.parquet (image, cluster_id), one PNG per record."""
    import cv2
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = root / release_id
    (d / "images").mkdir(parents=True)
    images, ids = [], []
    for c, members in enumerate(clusters):
        avg = _average(members).reshape(hw)
        for m in range(len(members)):
            name = f"images/{c}-{m}.png"
            cv2.imwrite(str(d / name), avg)
            images.append(name)
            ids.append(f"c-{c:04d}")
    pq.write_table(pa.table({"image": images, "cluster_id": ids}), d / "release.parquet")
    return d


def test_the_differencing_attack_over_published_releases_finds_a_person_when_the_registry_is_bypassed(tmp_path):
    """Two releases of one dataset made on a bypassed registry: a cluster of 6 people in release 2, the same
    cluster without the person who left (5) in release 3. Differencing the published averages gives her face,
    found in the gallery when she is there and as a face image on its own when she is not."""
    from deid.release.lineage_anchor import read_published_averages
    from deid.release.published_differencing import published_differencing_attack

    hw = (24, 20)
    X = _faces(24, hw)
    victim = 5
    # Release 2 (published, unknown to the registry): {0..5} with her, {6..11}; an unrelated release {12..17}, {18..23}.
    rel2 = read_published_averages(_publish(tmp_path, "rel-2", [X[0:6], X[6:12]], hw), hw)
    other = read_published_averages(_publish(tmp_path, "rel-o", [X[12:18], X[18:24]], hw), hw)
    assert rel2.sizes == (6, 6) and rel2.images.shape == (2, hw[0] * hw[1])
    # This release (3): {0..4} without her, {6..11} republished (bit-identical: skipped).
    current = [_average(X[0:5]), _average(X[6:12])]
    keys, sizes = ["new-0", "rep-1"], [[5], [6]]
    people = [f"p{i}" for i in range(len(X))]

    res = published_differencing_attack(keys, current, sizes, [rel2, other], X, original_people=people)
    check = res.to_check()
    assert not check.passed and res.people_identified == {f"p{victim}"}
    [m] = [m for m in res.matches if m.kind == "single"]
    assert m.originals == (victim,) and m.released == "new-0" and m.registered.startswith("rel-2/") and m.mae < 1.0
    assert all(m.registered.startswith("rel-2/") for m in res.matches)   # the unrelated release: no false match
    assert check.value >= 1 and "published releases" in check.detail

    # She left the drop: no original of hers in the gallery; the difference is still a face image on its own.
    gallery = np.delete(X, victim, axis=0)
    res = published_differencing_attack(keys, current, sizes, [rel2, other], gallery,
                                        original_people=[p for i, p in enumerate(people) if i != victim])
    assert not res.passed and not res.people_identified
    [m] = res.matches
    assert m.kind == "image" and m.released == "new-0" and m.registered.startswith("rel-2/") and m.sizes == (5, 6)
    recovered = 6.0 * rel2.images[rel2.cluster_ids.index(m.registered.split("/")[1])] - 5.0 * current[0]
    assert np.abs(recovered - X[victim]).mean() < 6.0   # 6 m2 - 5 m3: her face, up to the averages' rounding

    # Nothing differs by fewer than k records: the same releases give no match.
    res = published_differencing_attack(["rep-1"], [current[1]], [[6]], [rel2, other], X, original_people=people)
    assert res.passed and res.to_check().passed and res.n_tests > 0


def test_only_reports_signed_by_the_project_key_anchor_the_lineage(tmp_path):
    """A forged report (bad signature) naming a later head can neither block nor unblock the lineage."""
    import base64

    from deid.release.lineage_anchor import signed_lineage
    from deid.release.signing import canonical_json, generate_private_key, sign_bytes

    key, other = generate_private_key(), generate_private_key()

    def report(name: str, seq: int, signer, dataset: str = DATASET) -> None:
        d = tmp_path / "reports" / name
        d.mkdir(parents=True)
        payload = canonical_json({"release_id": name, "verdict": "rejected",
                                  "lineage": {"dataset": dataset, "registry_head": {"seq": seq, "hash": "ab" * 32}}})
        (d / "report.json").write_bytes(payload)
        (d / "report.json.sig").write_bytes(base64.b64encode(sign_bytes(payload, signer)))

    report("rel-a", 3, key)
    report("rel-b", 9, other)              # not the project's key: ignored
    report("rel-c", 12, key, dataset="x")  # another dataset
    got = signed_lineage(tmp_path / "reports", tmp_path / "releases", DATASET, key.public_key())
    assert (got.head.seq, got.head.release_id, got.reports, got.unverified) == (3, "rel-a", 1, 1)
    assert got.published == ()
