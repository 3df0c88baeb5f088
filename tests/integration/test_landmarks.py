"""Landmark points: the manifest's points column, alignment to canonical pixels, k-Same-M's shape from points."""
from __future__ import annotations

import csv
import json
import math
from collections import Counter

import cv2
import numpy as np
import pytest

from deid.alignment.align import align_records
from deid.alignment.canonical import FaceAligner
from deid.alignment.eyes import EyePair
from deid.anonymise.methods import deidentify
from deid.anonymise.methods_ksame import KSameM, landmark_average, sharpness
from deid.errors import REASONS, ConfigError, RecordError
from deid.intake.drop import read_drop
from deid.intake.ingest import ingest
from deid.intake.points import parse_points

CANON = FaceAligner().canonical_eyes
SHAPE = (92, 81)


def _png(img: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", img)
    assert ok
    return buf.tobytes()


# ----------------------------------------------------------------------------------------- points files


@pytest.mark.parametrize("name,text", [
    ("a.tem", "3\n1\t2\n3\t4\n5.5\t6\n0\n2\n0 1\n"),  # Psychomorph: line definitions after the points ignored
    ("a.json", json.dumps([[1, 2], [3, 4], [5.5, 6]])),
    ("a.json", json.dumps({"points": [[1, 2], [3, 4], [5.5, 6]]})),
    ("a.pts", "version: 1\nn_points: 3\n{\n1 2\n3 4\n5.5 6\n}\n"),
    ("a.txt", "# x y\n1 2\n\n3,4\n5.5 6\n"),
])
def test_points_formats(name, text):
    assert parse_points(text.encode(), name).tolist() == [[1, 2], [3, 4], [5.5, 6]]


@pytest.mark.parametrize("name,text,match", [
    ("a.tem", "5\n1 2\n3 4\n", "declares 5 points"),
    ("a.json", "[[1, 2], [3]]", "point 1"),
    ("a.json", "{", "not valid JSON"),
    ("a.txt", "1 2\n3 4\n", "has 2 points"),
    ("a.txt", "1 2\n3 x\n5 6\n", "not two numbers"),
    ("a.txt", "1 2\n3 nan\n5 6\n", "not a finite"),
    ("a.pts", "1 2\n3 4\n5 6\n", "between"),
])
def test_bad_points_files_name_the_problem(name, text, match):
    with pytest.raises(RecordError, match=match) as exc:
        parse_points(text.encode(), name)
    assert exc.value.code == "bad_points"


def _drop(root, rows, files):
    root.mkdir()
    with open(root / "manifest.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["image", "subject_id", "gender", "points"])
        w.writerows(rows)
    (root / "drop.yaml").write_text("name: t\nlabels: [gender]\n")
    for name, data in files.items():
        (root / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return root


def test_points_column_quarantines_unusable_files_and_keeps_empty_cells(tmp_path):
    imgs = {f"{c}.png": _png(np.full((40, 40), 100 + i, np.uint8)) for i, c in enumerate("abcdefg")}
    three, four = "1 2\n3 4\n5 6\n", "1 2\n3 4\n5 6\n7 8\n"
    drop = _drop(tmp_path / "drop", [
        ["a.png", "s1", "f", "a.txt"], ["b.png", "s2", "f", "b.txt"], ["c.png", "s3", "m", ""],
        ["d.png", "s4", "m", "nowhere.txt"], ["e.png", "s5", "m", "e.txt"], ["f.png", "s6", "f", "f.txt"],
        ["g.png", "s7", "f", "../a.txt"],
    ], {**imgs, "a.txt": three, "b.txt": three, "e.txt": "1 2\nbad\n5 6\n",
        "f.txt": four})
    d = read_drop(drop)
    assert d.has_points and not d.has_sequences
    assert [r.image for r in d.rows] == ["a.png", "b.png", "c.png"]
    assert d.rows[0].points == ((1.0, 2.0), (3.0, 4.0), (5.0, 6.0)) and d.rows[2].points is None
    codes = {q.image: q.code for q in d.quarantined}
    assert codes == {"d.png": "missing_points_file", "e.png": "bad_points", "f.png": "bad_points",
                     "g.png": "bad_points"}
    assert all(c in REASONS for c in codes.values())
    assert "4 points" in next(q.message for q in d.quarantined if q.image == "f.png")
    # The staged table carries them flattened (null where none); "points" is not an extra column.
    res = ingest(d, tmp_path / "ing.parquet")
    import pyarrow.parquet as pq

    t = pq.read_table(res.path, columns=["image", "points"]).to_pydict()
    assert dict(zip(t["image"], t["points"])) == {"a.png": [1, 2, 3, 4, 5, 6], "b.png": [1, 2, 3, 4, 5, 6],
                                                  "c.png": None}
    assert "points" not in d.extra_columns


# ------------------------------------------------------------------------------------------- alignment


def test_alignment_carries_points_to_where_their_features_land(tmp_path):
    # A big source image (reduced JPEG-free path: PNG, area pre-shrink) with dots at 5 landmarks.
    a = math.radians(14.0)
    scale, tx, ty = 5.0, 160.0, 30.0
    fwd = np.array([[scale * math.cos(a), -scale * math.sin(a), tx], [scale * math.sin(a), scale * math.cos(a), ty]])
    canon = np.array([CANON.left, CANON.right, (40.5, 55.0), (30.0, 72.0), (51.0, 72.0)])
    src_pts = canon @ fwd[:, :2].T + fwd[:, 2]
    h, w = 620, 640
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.full((h, w), 20.0)
    for x, y in src_pts:
        img += 220.0 * np.exp(-((xx - x) ** 2 + (yy - y) ** 2) / (2 * (1.6 * scale) ** 2))
    data = _png(np.clip(np.rint(img), 0, 255).astype(np.uint8))
    eyes = EyePair(tuple(src_pts[0]), tuple(src_pts[1]))
    ok, bad = align_records([{"record_id": "r", "image": "x", "data": data, "eyes": eyes,
                              "points": src_pts.ravel().tolist()},
                             {"record_id": "q", "image": "y", "data": data, "eyes": eyes, "points": None}],
                            FaceAligner())
    assert not bad and ok[1]["points"] is None
    got = np.asarray(ok[0]["points"]).reshape(-1, 2)
    np.testing.assert_allclose(got, canon, atol=1e-6)  # the same similarity: exact on the eyes and the rest
    face = np.frombuffer(ok[0]["pixels"], np.uint8).reshape(SHAPE).astype(np.float64)
    for x, y in got[2:]:  # and the dots of the other landmarks are there in the canonical face
        weight = np.clip(face - 20.0, 0, None)
        gy, gx = np.mgrid[0:SHAPE[0], 0:SHAPE[1]]
        weight[(gx - x) ** 2 + (gy - y) ** 2 > 25] = 0
        cx, cy = (weight * gx).sum() / weight.sum(), (weight * gy).sum() / weight.sum()
        assert math.hypot(cx - x, cy - y) < 0.5


# ------------------------------------------------------------------------------------------ k-Same-M


def _texture(seed: int = 0) -> np.ndarray:
    """A face-sized test card with sharp edges (blocks and disks) on a smooth ramp."""
    rng = np.random.default_rng(seed)
    img = np.add.outer(np.linspace(40, 120, SHAPE[0]), np.linspace(0, 40, SHAPE[1])).astype(np.float32)
    for _ in range(14):
        x, y = (int(v) for v in rng.integers(8, [SHAPE[1] - 8, SHAPE[0] - 8]))
        cv2.circle(img, (x, y), int(rng.integers(3, 7)), float(rng.uniform(150, 250)), -1)
    img[40:44, 10:70] = 250
    return img


def _affine_members(m: int, seed: int = 1):
    """Members = one texture under m known affine maps; their landmarks move with it."""
    rng = np.random.default_rng(seed)
    tex = _texture()
    grid = np.array([(x, y) for x in np.linspace(8, 72, 5) for y in np.linspace(10, 82, 5)])
    faces, pts, maps = [], [], []
    for _ in range(m):
        s = rng.uniform(0.94, 1.06)
        A = np.array([[s, rng.uniform(-0.03, 0.03)], [rng.uniform(-0.03, 0.03), s]])
        t = rng.uniform(-3, 3, 2) + (np.eye(2) - A) @ np.array([40.0, 46.0])
        M = np.hstack([A, t[:, None]])
        faces.append(cv2.warpAffine(tex, M, (SHAPE[1], SHAPE[0]), flags=cv2.INTER_CUBIC,
                                    borderMode=cv2.BORDER_REPLICATE))
        pts.append(grid @ A.T + t)
        maps.append(M)
    return tex, np.stack(faces), np.stack(pts), np.mean(maps, axis=0)


def test_landmark_average_recovers_the_texture_at_the_mean_shape():
    # Ground truth: the landmarks are linear in the affine map, so the mean shape is the mean map applied
    # to the grid and the right average is the texture under the mean map; the pixel mean ghosts.
    tex, faces, pts, mean_map = _affine_members(5)
    want = cv2.warpAffine(tex, mean_map, (SHAPE[1], SHAPE[0]), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE)
    got = landmark_average(faces, pts)
    inner = (slice(6, -6), slice(6, -6))  # away from the replicated borders
    err_points = np.abs(got - want)[inner].mean()
    err_pixel = np.abs(faces.mean(axis=0) - want)[inner].mean()
    # Measured 1.9 vs 12.8 grey levels (two cubic resamplings against one).
    assert err_points < 3.0 and err_points < err_pixel / 4, (err_points, err_pixel)
    s = sharpness(np.stack([got.ravel(), faces.mean(axis=0).ravel()]), shape=SHAPE)
    assert s[0] > 1.5 * s[1]


def test_landmark_average_of_one_face_is_that_face():
    tex, faces, pts, _ = _affine_members(1)
    np.testing.assert_allclose(landmark_average(faces, pts), faces[0], atol=1e-3)


def test_k_same_m_uses_points_where_every_member_has_them_and_flow_elsewhere():
    rng = np.random.default_rng(3)
    _, faces, pts, _ = _affine_members(12, seed=4)
    faces = np.clip(faces + rng.normal(0, 4, faces.shape), 0, 255).reshape(12, -1)
    people = [f"p{i}" for i in range(12)]
    points = list(pts)
    model = KSameM(3, shape=SHAPE, n_components=5).fit(faces, people=people, points=points)
    assert model.shape_sources_ == ["points"] * len(model.averages_)
    points[0] = None  # one member without points: its cluster falls back to optical flow
    model2 = KSameM(3, shape=SHAPE, n_components=5).fit(faces, people=people, points=points)
    c0 = model2.labels_[0]
    assert model2.shape_sources_[c0] == "flow"
    assert Counter(model2.shape_sources_) == Counter({"points": len(model2.averages_) - 1, "flow": 1})
    released = KSameM(3, shape=SHAPE, n_components=5).fit_transform(faces, people=people, points=points)
    for c in set(model2.labels_):  # the k-Same guarantee: members get the identical image
        rows = released[model2.labels_ == c]
        assert len({r.tobytes() for r in rows}) == 1 and len(rows) >= 3
    with pytest.raises(ConfigError, match="points has 2 entries"):
        KSameM(3, shape=SHAPE).fit(faces, people=people, points=points[:2])
    with pytest.raises(ConfigError, match=r"points\[1\]"):
        KSameM(3, shape=SHAPE).fit(faces, people=people, points=[pts[0], np.zeros((2, 2)), *pts[2:]])


def test_deidentify_passes_points_into_label_partitions():
    _, faces, pts, _ = _affine_members(12, seed=5)
    faces = faces.reshape(12, -1)
    keys = ["a"] * 6 + ["b"] * 6
    points = [p if i < 6 else None for i, p in enumerate(pts)]  # partition a has points, b has none
    rel, labels_ = deidentify(faces, shape=SHAPE, people=[f"p{i}" for i in range(12)], partitions=keys,
                              method="k-same-m", k=3, n_components=4, points=points)
    ref, _ = deidentify(faces, shape=SHAPE, people=[f"p{i}" for i in range(12)], partitions=keys,
                        method="k-same-m", k=3, n_components=4)
    assert not np.array_equal(rel[:6], ref[:6]) and np.array_equal(rel[6:], ref[6:])
    assert set(labels_[:6]).isdisjoint(labels_[6:])


@pytest.mark.slow
@pytest.mark.london
def test_london_landmark_k_same_m_ghosts_less_than_pixel_k_same(london_dir, tmp_path):
    from deid.study import _aligner_params
    from deid.intake.london import import_london
    from deid.operations.worker_align import align_batch
    from deid.operations.worker_rows import read_pixels
    import pyarrow.parquet as pq

    d = read_drop(import_london(london_dir, tmp_path / "drop"))
    assert sum(r.points is not None for r in d.rows) == 102 and not d.quarantined
    res = ingest(d, tmp_path / "ing.parquet")
    align_batch(str(res.path), list(range(res.row_groups)), str(tmp_path / "al.parquet"), _aligner_params())
    ids, X = read_pixels([str(tmp_path / "al.parquet")])
    pts = pq.read_table(tmp_path / "al.parquet", columns=["points"]).column("points").to_pylist()
    meta = {r.record_id: r for r in d.rows}
    idx = [i for i, r in enumerate(ids) if pts[i] is not None and meta[r].labels["gender"] == "female"]
    P = [np.asarray(pts[i]).reshape(-1, 2) for i in idx]
    assert np.allclose([p[:2] for p in P], [CANON.left, CANON.right])  # pupils: exactly the canonical eyes
    model = KSameM(5, shape=SHAPE).fit(X[idx], people=[meta[ids[i]].subject_id for i in idx], points=P)
    assert set(model.shape_sources_) == {"points"}
    pixel = np.stack([X[idx][model.labels_ == c].mean(axis=0) for c in range(len(model.averages_))])
    s_points, s_pixel = sharpness(model.averages_, shape=SHAPE), sharpness(pixel, shape=SHAPE)
    # Measured (bench/bench_landmarks.py, both genders): 203 vs 158 at k=5, sharper in 95% of clusters.
    assert s_points.mean() > 1.15 * s_pixel.mean() and np.mean(s_points > s_pixel) >= 0.75, (s_points, s_pixel)
