"""The London importer: the published layout becomes a canonical drop."""
from __future__ import annotations

import csv
from collections import Counter

import cv2
import numpy as np
import pytest

from deid.intake.drop import read_drop
from deid.errors import ConfigError, DropError
from deid.intake.london import import_london, london_photos, read_tem_eyes


def _fake_london(root, n=3):
    (root / "neutral_front").mkdir(parents=True)
    (root / "smiling_front").mkdir()
    rows = ["face_id,face_age,face_gender,face_eth"]
    for i in range(1, n + 1):
        sid = f"{i:03d}"
        rows.append(f"{i},30,{'female' if i % 2 else 'male'},x")
        img = np.full((60, 60), 100 + i, np.uint8)
        for folder, suffix in (("neutral_front", "03"), ("smiling_front", "08")):
            cv2.imwrite(str(root / folder / f"{sid}_{suffix}.jpg"), img)
        (root / "neutral_front" / f"{sid}_03.tem").write_text(f"3\n{20 + i}\t30\n{40 + i}\t31\n1\t1\n0\n")
    (root / "london_info.csv").write_text("\n".join(rows) + "\n")
    return root


def test_import_fake_layout(tmp_path):
    drop = import_london(_fake_london(tmp_path / "src"), tmp_path / "drop")
    d = read_drop(drop)
    assert d.labels == ["gender", "expression"] and d.name == "london"
    assert len(d.rows) == 6 and not d.quarantined
    neutral = [r for r in d.rows if r.labels["expression"] == "neutral"]
    assert [r.eyes for r in neutral] == [((21.0, 30.0), (41.0, 31.0)), ((22.0, 30.0), (42.0, 31.0)),
                                         ((23.0, 30.0), (43.0, 31.0))]
    assert all(r.eyes is None for r in d.rows if r.labels["expression"] == "smile")
    assert (drop / "_READY").exists()
    assert not any(p.is_symlink() for p in drop.rglob("*"))


def test_london_photos_reads_the_layout_in_place(tmp_path):
    """The in-memory loader's view (tests/helpers.py, bench/): neutral photos first, by name; .tem pupils or None."""
    src = _fake_london(tmp_path / "src")
    (src / "neutral_front" / "002_03.tem").write_text("2\n50\t31\n30\t30\n")  # points given right eye first
    photos = london_photos(src)
    assert [(p.path.relative_to(src).as_posix(), p.person, p.gender, p.expression) for p in photos] == [
        ("neutral_front/001_03.jpg", "001", "female", "neutral"), ("neutral_front/002_03.jpg", "002", "male", "neutral"),
        ("neutral_front/003_03.jpg", "003", "female", "neutral"), ("smiling_front/001_08.jpg", "001", "female", "smile"),
        ("smiling_front/002_08.jpg", "002", "male", "smile"), ("smiling_front/003_08.jpg", "003", "female", "smile")]
    assert [p.eyes for p in photos] == [((21.0, 30.0), (41.0, 31.0)), ((30.0, 30.0), (50.0, 31.0)),
                                        ((23.0, 30.0), (43.0, 31.0)), None, None, None]


def test_import_refuses_wrong_layout_and_non_empty_target(tmp_path):
    src = _fake_london(tmp_path / "src")
    (src / "london_info.csv").unlink()
    with pytest.raises(DropError, match="london_info.csv"):
        import_london(src, tmp_path / "drop")
    src2 = _fake_london(tmp_path / "src2")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        import_london(src2, tmp_path / "busy")


@pytest.mark.slow
@pytest.mark.london
def test_import_real_london(london_dir, tmp_path):
    drop = import_london(london_dir, tmp_path / "london")
    with open(drop / "manifest.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 204
    per_person = Counter(r["subject_id"] for r in rows)
    assert len(per_person) == 102 and set(per_person.values()) == {2}
    genders = {r["subject_id"]: r["gender"] for r in rows}
    assert Counter(genders.values()) == {"male": 53, "female": 49}
    with_eyes = [r for r in rows if r["eye_left_x"]]
    assert len(with_eyes) == 102 and all(r["expression"] == "neutral" for r in with_eyes)
    for r in with_eyes:
        tem = (london_dir / r["image"]).with_suffix(".tem").read_text().split("\n")
        p0, p1 = [float(v) for v in tem[1].split()[:2]], [float(v) for v in tem[2].split()[:2]]
        got = [float(r[c]) for c in ("eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y")]
        assert got == pytest.approx([*p0, *p1], abs=0.006), r["image"]
    assert all(r["eye_left_x"] == r["eye_right_y"] == "" for r in rows if r["expression"] == "smile")
    # Self-contained: every image is a regular file inside the drop with the source's bytes.
    assert not any(p.is_symlink() for p in drop.rglob("*"))
    for r in rows[:4]:
        assert (drop / r["image"]).read_bytes() == (london_dir / r["image"]).read_bytes()


def test_hard_links_on_the_same_filesystem_and_manifest_cells(tmp_path):
    src = _fake_london(tmp_path / "src", n=2)
    drop = import_london(src, tmp_path / "drop", name="fake london")
    for rel in ("neutral_front/001_03.jpg", "smiling_front/002_08.jpg"):
        assert (drop / rel).samefile(src / rel), "same filesystem: the image should be hard linked, not copied"
        assert not (drop / rel).is_symlink()
    with open(drop / "manifest.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["image"], r["subject_id"], r["gender"], r["expression"]) for r in rows] == [
        ("neutral_front/001_03.jpg", "001", "female", "neutral"),
        ("smiling_front/001_08.jpg", "001", "female", "smile"),
        ("neutral_front/002_03.jpg", "002", "male", "neutral"),
        ("smiling_front/002_08.jpg", "002", "male", "smile"),
    ]
    assert [r["eye_left_x"] for r in rows] == ["21.00", "", "22.00", ""]
    assert "fake london" in (drop / "drop.yaml").read_text()
    # The neutral images' landmark templates come along, named in the points column (k-Same-M's shape).
    assert [r["points"] for r in rows] == ["neutral_front/001_03.tem", "", "neutral_front/002_03.tem", ""]
    assert sorted(p.name for p in drop.rglob("*.tem")) == ["001_03.tem", "002_03.tem"]


def test_gender_values_are_normalised_and_checked(tmp_path):
    src = _fake_london(tmp_path / "src", n=2)
    (src / "london_info.csv").write_text("face_id,face_age,face_gender,face_eth\n001,30, Female ,x\n002,31,M,y\n")
    drop = import_london(src, tmp_path / "drop")
    with open(drop / "manifest.csv", newline="") as fh:
        assert {r["subject_id"]: r["gender"] for r in csv.DictReader(fh)} == {"001": "female", "002": "male"}
    (src / "london_info.csv").write_text("face_id,face_age,face_gender,face_eth\n001,30,unknown,x\n")
    with pytest.raises(DropError, match="face_gender='unknown'"):
        import_london(src, tmp_path / "drop2")
    (src / "london_info.csv").write_text("face_id,sex\n001,female\n")
    with pytest.raises(DropError, match="face_gender"):
        import_london(src, tmp_path / "drop3")


@pytest.mark.parametrize("remove", ["neutral_front", "smiling_front"])
def test_missing_folder_is_named(tmp_path, remove):
    import shutil

    src = _fake_london(tmp_path / "src")
    shutil.rmtree(src / remove)
    with pytest.raises(DropError, match=remove):
        import_london(src, tmp_path / "drop")
    assert not (tmp_path / "drop").exists()


def test_bad_src_name_and_tem(tmp_path):
    with pytest.raises(DropError, match="not a directory"):
        import_london(tmp_path / "nowhere", tmp_path / "drop")
    src = _fake_london(tmp_path / "src")
    with pytest.raises(ConfigError, match="name"):
        import_london(src, tmp_path / "drop", name="")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        import_london(src, tmp_path / "file")
    tem = src / "neutral_front" / "001_03.tem"
    tem.write_text("2\n50\t30\n20\t31\n")
    assert read_tem_eyes(tem) == ((20.0, 31.0), (50.0, 30.0))  # left = smaller x
    tem.write_text("not a template\n")
    with pytest.raises(DropError, match="001_03.tem"):
        import_london(src, tmp_path / "drop")
    assert not (tmp_path / "drop").exists(), "a bad source must not leave a half-written drop"
