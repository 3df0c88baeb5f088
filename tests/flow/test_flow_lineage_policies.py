"""Integration: the lineage policies through the real release flow (issue 10), on small synthetic drops.

One dataset, four drops (same synth seed: person n and their photos are the same in every drop):

1. 15 people, released.
2. absent=republish: 10 of them come back, one with a new (third) photo. Released: clusters with
   absent members are republished with counterfeit rows (counted in the report, marked only in the
   private linkage record), every returning record and the new photo carry a drop-1 image bit for
   bit, and the gate attacks the counterfeits as released rows of no one.
3. DEID_LINEAGE_ABSENT=suppress: two people leave. Every registered cluster they were in is
   withheld whole; every cluster released appears exactly as in drop 1 (same image, same rows), so
   nothing partial shows who left.
4. DEID_LINEAGE_POLICY=release-once: the 15 come back with 15 new people; only the new people are
   released and the report says how many returning people were suppressed.
"""
from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import cv2
import pytest

from deid.release.linkage import load_linkage_key, read_linkage
from deid.intake.synth import make_synthetic_drop

pytestmark = pytest.mark.slow
DATASET = "ward-faces"
SEED = 11
# The subject of drops 3 and 4 is the plan, not the gate's figures: the recogniser identity check is
# skipped (eigenface near-duplicates still count) and one cross-validation repeat is enough.
QUICK = {"DEID_IDENTITY_EMBED_MAX": "0", "DEID_CV_REPEATS": "1", "DEID_DASK_WORKERS": "1"}


def _drop(path: Path, people: range | list[int], *, extra_photo: int | None = None) -> Path:
    """A drop of DATASET with persons ``people`` (0-based), two photos each; ``extra_photo`` brings a third."""
    drop = make_synthetic_drop(path, people=max(people) + 1, images_per_person=3, seed=SEED)
    lines = (drop / "manifest.csv").read_text().splitlines()
    keep = {f"s{n + 1:05d}" for n in people}
    out = [lines[0]]
    for line in lines[1:]:
        image, subject = line.split(",")[:2]
        third = image.endswith("_3.png")
        if subject in keep and (not third or subject == f"s{(extra_photo or 0) + 1:05d}" and extra_photo is not None):
            out.append(line)
        else:
            (drop / image).unlink()
    (drop / "manifest.csv").write_text("\n".join(out) + "\n")
    with open(drop / "drop.yaml", "a", encoding="utf-8") as fh:
        fh.write(f"dataset: {DATASET}\n")
    return drop


def _released(result: dict, key: bytes) -> tuple[dict[str, bytes], list[bytes], list[dict]]:
    """(source image -> released pixels, pixels of the counterfeit rows, the release.csv rows)."""
    rows = read_linkage(Path(result["linkage"]), key)
    rel = Path(result["release_dir"])

    def pixels(name: str) -> bytes:
        return cv2.imread(str(rel / name), cv2.IMREAD_UNCHANGED).tobytes()

    real = {r["source_image"]: pixels(r["released_image"]) for r in rows if not r.get("counterfeit")}
    fake = [pixels(r["released_image"]) for r in rows if r.get("counterfeit")]
    with open(rel / "release.csv", newline="", encoding="utf-8") as fh:
        table = list(csv.DictReader(fh))
    return real, fake, table


def _report(result: dict) -> dict:
    return json.loads(Path(result["report"]).read_text())


def test_absent_members_new_photo_suppress_and_release_once_through_the_flow(project, prefect_server, tmp_path,
                                                                              monkeypatch, capsys):
    from deid.cli.lineage import cmd_lineage
    from deid.flows.release import run_flow

    monkeypatch.setenv("DEID_IDENTITY_EMBED_MAX", "0")
    key_path = project / "data" / "keys" / "dev_linkage.key"
    r1 = run_flow(str(_drop(tmp_path / "d1", range(15))), k=3).summary()
    assert r1["verdict"] == "released", r1["reasons"]
    key = load_linkage_key(key_path)
    first, fake1, _ = _released(r1, key)
    assert not fake1
    # DEID_COLOR=auto: the synthetic drop is colour, so is every release of its lineage (colour averages registered).
    assert _report(r1)["configuration"]["color"] and all(len(px) == 92 * 81 * 3 for px in first.values())
    by_person: dict[str, set[bytes]] = {}
    for src, px in first.items():
        by_person.setdefault(Path(src).name.split("_")[0], set()).add(px)

    # ---- 2. republish: five people absent, s00001 brings a third photo.
    r2 = run_flow(str(_drop(tmp_path / "d2", range(10), extra_photo=0)), k=3).summary()
    assert r2["verdict"] == "released", r2["reasons"]
    rep2 = _report(r2)
    lin2 = rep2["lineage"]
    assert lin2["policy"] == "invariant" and lin2["absent"] == "republish"
    assert lin2["returning_people"] == 10 and lin2["new_people"] == 0 and lin2["counterfeit_records"] > 0
    second, fake2, table2 = _released(r2, key)
    # Counterfeits: counted in the report, marked in the private linkage record only. The release has its
    # usual columns, one row per released record (counterfeits included), and no marker.
    assert len(fake2) == lin2["counterfeit_records"]
    assert rep2["configuration"]["color"] and lin2["color_mode"] == "colour" and all(len(px) == 92 * 81 * 3
                                                                                     for px in fake2)
    assert set(table2[0]) == {"record_id", "image", "cluster_id", "gender", "expression"}
    assert len(table2) == rep2["dataset"]["records_released"] + len(fake2)
    assert not any("counterfeit" in json.dumps(r) for r in table2)
    assert set(fake2) <= set(second.values())  # a counterfeit carries the image of a released cluster
    # Every returning record is released with its drop-1 image, bit for bit; the new photo with one of its person's.
    new_photo = "images/s00001_3.png"
    assert new_photo in second and new_photo not in first
    assert all(second[src] == first[src] for src in second if src != new_photo)
    assert second[new_photo] in by_person["s00001"]
    checks2 = {c["name"]: c for c in rep2["checks"]}
    for name in ("min_cluster_size", "min_distinct_people_per_cluster", "max_person_share", "reidentification_rate",
                 "lineage_cluster_differences", "lineage_returning_identical", "lineage_differencing_attack"):
        assert checks2[name]["passed"], (name, checks2[name]["detail"])
    priv = rep2["privacy"]
    assert priv["attack_sample"]["counterfeits"] == len(fake2)
    assert priv["max_person_share"] <= 1 / 3 + 1e-9 and priv["exact_bound"]
    worst = max(priv["reidentification"], key=lambda r: r["rate"])
    figures = [f"drop 2 (republish, 5 of 15 absent, 1 new photo, k=3): {lin2['republished_clusters']} clusters "
               f"republished, {lin2['republished_records']} returning records + {len(fake2)} counterfeits; "
               f"max_person_share {priv['max_person_share']:.3f}; max rate {worst['attacker']}/{worst['mode']} "
               f"{worst['rate']:.3f} [{worst['lower']:.3f}, {worst['upper']:.3f}] n={worst['n_probes']} "
               f"(records {priv['attack_sample']['records']} + {priv['attack_sample']['counterfeits']} counterfeits)"]
    figures += [f"  {r['attacker']}/{r['mode']}: {r['rate']:.3f} [{r['lower']:.3f}, {r['upper']:.3f}] n={r['n_probes']}"
                for r in priv["reidentification"]]

    for name, value in QUICK.items():
        monkeypatch.setenv(name, value)
    # ---- 3. suppress: s00014 and s00015 leave; their registered clusters are withheld whole.
    monkeypatch.setenv("DEID_LINEAGE_ABSENT", "suppress")
    r3 = run_flow(str(_drop(tmp_path / "d3", range(13))), k=3).summary()
    monkeypatch.delenv("DEID_LINEAGE_ABSENT")
    assert r3["verdict"] == "released", r3["reasons"]
    lin3 = _report(r3)["lineage"]
    assert lin3["absent"] == "suppress" and lin3["counterfeit_records"] == 0
    assert lin3["suppressed_registered_clusters"] > 0
    held = lin3["suppressed_by_reason"]["registered_cluster_suppressed"]
    third, fake3, _ = _released(r3, key)
    assert not fake3 and held > 0 and len(third) + held == 26
    # Each cluster released looks exactly as in drop 1: same image on the same number of rows.
    rows1, rows3 = Counter(first.values()), Counter(third.values())
    assert all(rows3[img] == rows1[img] for img in rows3)
    assert all(third[src] == first[src] for src in third)
    figures.append(f"drop 3 (suppress, 2 of 15 absent): {lin3['suppressed_registered_clusters']} registered "
                   f"clusters withheld ({held} records of present members), {len(rows3)} clusters released as "
                   "first released")

    # ---- 4. release-once: the 15 come back with 15 new people; only the new ones are released.
    monkeypatch.setenv("DEID_LINEAGE_POLICY", "release-once")
    r4 = run_flow(str(_drop(tmp_path / "d4", range(30))), k=3).summary()
    monkeypatch.delenv("DEID_LINEAGE_POLICY")
    assert r4["verdict"] == "released", r4["reasons"]
    lin4 = _report(r4)["lineage"]
    assert lin4["policy"] == "release-once" and lin4["returning_people"] == 15 and lin4["new_people"] == 15
    assert lin4["suppressed_by_reason"]["released_before"] == 30 and lin4["republished_clusters"] == 0
    fourth, fake4, _ = _released(r4, key)
    assert not fake4 and fourth and all(int(Path(src).name[1:6]) > 15 for src in fourth)
    assert not set(fourth.values()) & set(first.values())
    figures.append(f"drop 4 (release-once): {lin4['returning_people']} returning people suppressed "
                   f"({lin4['suppressed_by_reason']['released_before']} records), {len(fourth)} records of new "
                   "people released")

    capsys.readouterr()
    args = SimpleNamespace(dataset=DATASET, key=None, members=False, json=True, data_dir=str(project / "data"))
    assert cmd_lineage(args) == 0
    listed = json.loads(capsys.readouterr().out)["releases"]
    assert [(r["status"], r["policy"], r["absent"]) for r in listed] == [
        ("published", "invariant", "republish"), ("published", "invariant", "republish"),
        ("published", "invariant", "suppress"), ("published", "release-once", "republish")]
    assert listed[1]["counterfeit_records"] == len(fake2)
    print("\n" + "\n".join(figures))
