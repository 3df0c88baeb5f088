"""Integration: two drops of one dataset through the real release flow (issue 10, release lineage).

Drop 2 is drop 1 plus more people (same synth seed: person n is the same in both, image bytes
too), declared under another ``dataset:`` name with ``DEID_CROSS_DATASET=route``: the project's
person index routes it into drop 1's lineage (issue 27), as if it had declared the same name. The
second release must reuse every earlier cluster bit for bit, pass the gate's lineage checks (the
differencing attack finds nothing), and the registry must list both releases; the same people
under a third name with the default ``refuse`` are refused naming the dataset; a tampered registry
stops the next run (StateError).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import cv2
import pytest

from deid.errors import StateError
from deid.release.linkage import load_linkage_key, read_linkage
from deid.intake.synth import make_synthetic_drop

pytestmark = pytest.mark.slow
DATASET = "clinic-faces"


def _drop(path: Path, people: int, dataset: str = DATASET) -> Path:
    drop = make_synthetic_drop(path, people=people, images_per_person=2, seed=11)
    with open(drop / "drop.yaml", "a", encoding="utf-8") as fh:
        fh.write(f"dataset: {dataset}\n")
    return drop


def _released_by_source(result: dict, key: bytes) -> dict[str, bytes]:
    """source image -> released pixels (decoded PNG), from the private linkage record."""
    rows = read_linkage(Path(result["linkage"]), key)
    out = {}
    for r in rows:
        if r.get("counterfeit"):
            continue
        img = cv2.imread(str(Path(result["release_dir"]) / r["released_image"]), cv2.IMREAD_UNCHANGED)
        out[r["source_image"]] = img.tobytes()
    return out


def test_second_drop_of_a_dataset_reuses_every_cluster_bit_for_bit(project, prefect_server, tmp_path, capsys,
                                                                    monkeypatch):
    from deid.cli.lineage import cmd_lineage
    from deid.flows.release import run_flow

    # Lineage is the subject (who returns is known by subject id): the recogniser identity check,
    # which on synthetic faces only looks for near-copies, is skipped (tests/flow/test_flow.py runs it), the
    # deep recogniser attacks a 20-record sample and the earlier utility protocols run once.
    monkeypatch.setenv("DEID_IDENTITY_EMBED_MAX", "0")
    monkeypatch.setenv("DEID_DEEP_ATTACK_SAMPLE", "20")
    monkeypatch.setenv("DEID_MIN_PROBES", "4")  # the 20-record deep sample: 4 clusters, not grown
    monkeypatch.setenv("DEID_CV_REPEATS", "1")
    r1 = run_flow(str(_drop(tmp_path / "d1", 15)), k=3).summary()
    assert r1["verdict"] == "released", r1["reasons"]
    # Renamed (issue 27): the person index finds drop 1's photographs and plans drop 2 in its lineage.
    monkeypatch.setenv("DEID_CROSS_DATASET", "route")
    r2 = run_flow(str(_drop(tmp_path / "d2", 24, "clinic-faces-renamed")), k=3).summary()
    assert r2["verdict"] == "released", r2["reasons"]
    monkeypatch.delenv("DEID_CROSS_DATASET")

    key = load_linkage_key(project / "data" / "keys" / "dev_linkage.key")
    first, second = _released_by_source(r1, key), _released_by_source(r2, key)
    assert first and set(first) <= set(second)
    # Every record released the first time is released again with the bit-identical image.
    assert all(second[src] == first[src] for src in first)
    # New people got new images (no earlier cluster average among them).
    earlier = set(first.values())
    new_sources = set(second) - set(first)
    assert new_sources and not any(second[s] in earlier for s in new_sources)

    rep1 = json.loads(Path(r1["report"]).read_text())
    rep2 = json.loads(Path(r2["report"]).read_text())
    lin1, lin2 = rep1["lineage"], rep2["lineage"]
    assert lin1["applied"] and lin1["dataset"] == DATASET and lin1["returning_people"] == 0
    assert lin2["policy"] == "invariant" and lin2["returning_people"] == 15 and lin2["new_people"] == 9
    assert lin2["based_on_head"] != lin1["based_on_head"] and lin2["counterfeit_records"] == 0
    assert lin2["dataset"] == DATASET and any(
        f"registered under dataset {DATASET!r}" in n and "clinic-faces-renamed" in n
        for n in rep2["configuration"]["notes"])
    checks = {c["name"]: c for c in rep2["checks"]}
    for name in ("lineage_cluster_differences", "lineage_returning_identical", "lineage_differencing_attack"):
        assert checks[name]["passed"], checks[name]
    assert "counted on their registered members" in checks["min_distinct_people_per_cluster"]["detail"]
    assert checks["lineage_differencing_attack"]["value"] == 0
    assert "pairs of released averages" in checks["lineage_differencing_attack"]["detail"]

    capsys.readouterr()
    args = SimpleNamespace(dataset=DATASET, key=None, members=False, json=True, data_dir=str(project / "data"))
    assert cmd_lineage(args) == 0
    desc = json.loads(capsys.readouterr().out)
    assert [(r["release_id"], r["status"]) for r in desc["releases"]] == [
        (r1["release_id"], "published"), (r2["release_id"], "published")]
    assert desc["releases"][1]["republished_clusters"] == lin2["republished_clusters"] > 0

    # The same people under a third name, DEID_CROSS_DATASET=refuse (the default): a signed rejection naming the
    # dataset that holds them, before any stage past the ingest; nothing published, nothing claimed.
    r3 = run_flow(str(_drop(tmp_path / "d3", 15, "clinic-faces-third")), k=3).summary()
    assert r3["verdict"] == "rejected" and f"registered under dataset {DATASET!r}" in " ".join(r3["reasons"])
    assert not (project / "data" / "private" / "lineage" / "clinic-faces-third").exists()

    # One modified byte in the registry: the next run stops before any work, with the reason.
    entry = sorted((project / "data" / "private" / "lineage" / DATASET).glob("*.entry"))[1]
    blob = bytearray(entry.read_bytes())
    blob[-5] ^= 0x01
    entry.write_bytes(bytes(blob))
    with pytest.raises(StateError, match="does not authenticate"):
        run_flow(str(tmp_path / "d1"), k=3)  # d1 declares DATASET (d2 is routed there only under route)
    assert sorted(p.name for p in (project / "data" / "releases").iterdir()) == sorted(
        [r1["release_id"], r2["release_id"]])
