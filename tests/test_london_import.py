"""The London importer: the published layout becomes a canonical drop."""
from __future__ import annotations

import csv
from collections import Counter

import cv2
import numpy as np
import pytest

from deid.drop import read_drop
from deid.errors import DropError
from deid.london import import_london


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


def test_import_refuses_wrong_layout_and_non_empty_target(tmp_path):
    src = _fake_london(tmp_path / "src")
    (src / "london_info.csv").unlink()
    with pytest.raises(DropError, match="london_info.csv"):
        import_london(src, tmp_path / "drop")
    src2 = _fake_london(tmp_path / "src2")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(DropError, match="not empty"):
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
    first = next(r for r in rows if r["image"] == "neutral_front/001_03.jpg")
    tem = (london_dir / "neutral_front" / "001_03.tem").read_text().split("\n")
    assert float(first["eye_left_x"]) == pytest.approx(float(tem[1].split()[0]))
    assert float(first["eye_right_y"]) == pytest.approx(float(tem[2].split()[1]))
