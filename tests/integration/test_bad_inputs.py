"""The bad-input matrix of issue 3, through the core pipeline: manifest -> ingest -> align.

Every record of a messy drop must end up aligned or quarantined with a stable reason code and a
message; nothing crashes and the counts add up. Fixtures are drawn here with OpenCV (dots for
eyes), never real faces; the face cases that need a real face detector use the London set. A manifest that is not CSV,
through the Prefect flow, is tests/flow/test_bad_inputs.py.
"""
from __future__ import annotations

import math
import os
import struct
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import LONDON

from deid.intake.drop import read_drop
from deid.errors import REASONS
from deid.intake.ingest import ingest, write_quarantine
from deid.settings import Settings
from deid.operations.worker_align import align_batch
from deid.evaluation.validation import drop_checks, quarantine_fraction_check

EYES = ((60.0, 80.0), (140.0, 84.0))
HEADER = "image,subject_id,gender,eye_left_x,eye_left_y,eye_right_x,eye_right_y,notes"


def _dots(seed: int, shape=(220, 200), eyes=EYES) -> np.ndarray:
    """Two bright dots on a dark, slightly noisy background (distinct bytes per seed)."""
    h, w = shape
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.full(shape, 20.0)
    for x, y in eyes:
        img += 220.0 * np.exp(-((xx - x) ** 2 + (yy - y) ** 2) / (2 * 3.0**2))
    img += np.random.default_rng(seed).integers(0, 4, shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _enc(ext: str, img: np.ndarray, params=()) -> bytes:
    ok, buf = cv2.imencode(ext, img, list(params))
    assert ok, ext
    return buf.tobytes()


def _exif_jpeg(img: np.ndarray, orientation: int) -> bytes:
    plain = _enc(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 95])
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1)
    tiff += struct.pack("<HHIHH", 274, 3, 1, orientation, 0) + struct.pack("<I", 0)
    payload = b"Exif\x00\x00" + tiff
    return plain[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + plain[2:]


def _centroid(img: np.ndarray, centre, radius: float = 5.0) -> tuple[float, float]:
    yy, xx = np.mgrid[0 : img.shape[0], 0 : img.shape[1]].astype(np.float64)
    weight = np.clip(img.astype(np.float64) - 40.0, 0, None)
    weight[(xx - centre[0]) ** 2 + (yy - centre[1]) ** 2 > radius**2] = 0
    return float((weight * xx).sum() / weight.sum()), float((weight * yy).sum() / weight.sum())


def _eyes(e=EYES) -> str:
    return ",".join(f"{v:g}" for p in e for v in p)


def _build_matrix_drop(root: Path, outside: Path) -> dict[str, str]:
    """Write the messy drop; return image -> expected outcome ('aligned' or a reason code)."""
    root.mkdir(parents=True)
    alpha = np.full((220, 200), 255, np.uint8)
    alpha[:20, :20] = 0  # a transparent corner, away from the eyes
    upright = _dots(5)
    same = _enc(".png", _dots(99))
    files = {
        "good.png": _enc(".png", _dots(1)),
        "no_extension": _enc(".png", _dots(2)),  # PNG without an extension
        "pgm_named.jpg": _enc(".pgm", _dots(3)),  # PGM under a JPEG name
        "gif_named.png": _enc(".gif", cv2.merge([_dots(4)] * 3)),  # GIF under a PNG name
        # Stored rotated 90 degrees counter-clockwise; EXIF orientation 6 turns it upright again.
        "rotated.jpg": _exif_jpeg(cv2.rotate(upright, cv2.ROTATE_90_COUNTERCLOCKWISE), 6),
        "deep.tif": _enc(".tiff", _dots(6).astype(np.uint16) * 257),  # 16-bit TIFF
        "alpha.png": _enc(".png", cv2.merge([_dots(7)] * 3 + [alpha])),  # BGRA
        "empty.jpg": b"",
        "truncated.jpg": _enc(".jpg", _dots(8))[:1500],
        "random.jpg": np.random.default_rng(9).bytes(512),
        "bomb.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + (60000).to_bytes(4, "big") * 2 + b"\x08\x00\x00\x00\x00",
        "dupA.png": same,
        "dupB.png": same,
        "blank.png": _enc(".png", np.full((240, 240), 90, np.uint8)),
        "eyes_outside.png": _enc(".png", _dots(10)),
        "eyes_close.png": _enc(".png", _dots(11)),
        "tiny_face.png": _enc(".png", _dots(12)),
        "nosubj.png": _enc(".png", _dots(13)),
        "nolabel.png": _enc(".png", _dots(14)),
        "badeyes.png": _enc(".png", _dots(15)),
        "badrow.png": _enc(".png", _dots(16)),
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    os.symlink(outside, root / "link.png")
    rows = [
        ("good.png,s1,f," + _eyes() + ",", "aligned"),
        ("no_extension,s2,m," + _eyes() + ",", "aligned"),
        ("pgm_named.jpg,s3,f," + _eyes() + ",", "aligned"),
        ("gif_named.png,s4,m," + _eyes() + ",", "aligned"),
        ("rotated.jpg,s5,f," + _eyes() + ",", "aligned"),
        ("deep.tif,s6,m," + _eyes() + ",", "aligned"),
        ("alpha.png,s7,f," + _eyes() + ",", "aligned"),
        ("empty.jpg,s8,m,,,,,", "empty_file"),
        ("truncated.jpg,s9,f," + _eyes() + ",", "corrupt_image"),
        ("random.jpg,s10,m,,,,,", "unsupported_format"),
        ("bomb.png,s11,f,,,,,", "image_too_large"),
        ("missing.png,s12,m,,,,,", "missing_file"),
        ("/etc/hosts,s13,f,,,,,", "unsafe_path"),
        ("../outside.png,s14,m,,,,,", "unsafe_path"),
        ("link.png,s15,f,,,,,", "unsafe_path"),
        ("dupA.png,s16,m,,,,,", "duplicate_across_people"),
        ("dupB.png,s17,f,,,,,", "duplicate_across_people"),
        ("blank.png,s18,m,,,,,", "no_face"),
        ("eyes_outside.png,s19,f,10,10,900,10,", "bad_eye_points"),
        ("eyes_close.png,s20,m,50,50,55,51,", "eyes_too_close"),
        ("tiny_face.png,s21,f,50,50,58.05,50,", "face_too_small"),  # 32.4 / 8.05 > 4x upsampling
        ("nosubj.png,,m,,,,,", "missing_subject_id"),
        ("nolabel.png,s23,,,,,,", "missing_label"),
        ("badeyes.png,s24,m,1,2,x,4,", "bad_eye_points"),
        ('badrow.png,s25,f,,,,,"a, b",surplus', "bad_row"),
        ('"good.png",s26,m,,,,,"quoted, comma"', "duplicate_path"),
    ]
    # Written the way spreadsheets do: UTF-8 BOM, CRLF line ends, quoted cells, an unknown column.
    text = "\r\n".join([HEADER] + [r for r, _ in rows]) + "\r\n"
    (root / "manifest.csv").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    (root / "drop.yaml").write_text("name: messy\nlabels: [gender]\n")
    return {r.split(",")[0].strip('"'): want for r, want in rows[:-1]} | {"good.png#2": "duplicate_path"}


def _aligner_params(s: Settings) -> dict:
    left, right = s.canonical_eyes()
    return {"size": list(s.canonical_size), "eye_left": list(left), "eye_right": list(right),
            "max_upsample": s.max_upsample, "min_eye_distance": s.min_eye_distance_px}


def test_every_record_of_a_messy_drop_is_aligned_or_quarantined_with_a_reason(tmp_path):
    outside = tmp_path / "outside.png"
    outside.write_bytes(_enc(".png", _dots(0)))
    expected = _build_matrix_drop(tmp_path / "drop", outside)
    settings = Settings(project_dir=tmp_path)

    drop = read_drop(tmp_path / "drop")
    assert drop.extra_columns == ["notes"]
    res = ingest(drop, tmp_path / "st" / "ingested.parquet", max_pixels=10_000_000, batch_size=4)
    groups = list(range(res.row_groups))
    out = align_batch(str(res.path), groups, str(tmp_path / "st" / "aligned" / "part-0.parquet"),
                      _aligner_params(settings))
    quarantined = [q.__dict__ for q in [*drop.quarantined, *res.quarantined, *out.quarantined]]

    # The counts add up: every record in is aligned or quarantined, exactly once.
    assert drop.records_in == len(expected) == out.aligned + len(quarantined)
    aligned_ids = set(pq.read_table(out.path).column("record_id").to_pylist())
    assert len(aligned_ids) == out.aligned
    assert aligned_ids.isdisjoint(q["record_id"] for q in quarantined)
    assert len({q["record_id"] for q in quarantined}) == len(quarantined)

    got = {}
    for q in quarantined:
        assert q["code"] in REASONS and q["message"], q
        # The second listing of good.png is the duplicate; the first one is aligned.
        got[q["image"] + ("#2" if q["code"] == "duplicate_path" else "")] = q["code"]
    by_rid = {r.record_id: r.image for r in drop.rows}
    for rid in aligned_ids:
        got[by_rid[rid]] = "aligned"
    assert got == expected
    assert Counter(got.values())["aligned"] == 7

    # The decoded formats land on the canonical eyes: EXIF rotation, 16 bits and alpha were applied.
    table = pq.read_table(out.path).to_pydict()
    pixels = dict(zip(table["record_id"], table["pixels"]))
    canon = settings.canonical_eyes()
    w, h = settings.canonical_size
    for name in ("good.png", "no_extension", "pgm_named.jpg", "rotated.jpg", "deep.tif", "alpha.png"):
        rid = next(r for r, img in by_rid.items() if img == name)
        img = np.frombuffer(pixels[rid], np.uint8).reshape(h, w)
        for want in canon:
            cx, cy = _centroid(img, want)
            assert math.hypot(cx - want[0], cy - want[1]) < 1.0, (name, want, (cx, cy))

    # The quarantine table carries them all; the drop-level gate check then rejects the drop.
    qpath = write_quarantine([type(drop.quarantined[0])(**q) for q in quarantined], tmp_path / "st" / "q.parquet")
    assert pq.read_table(qpath).num_rows == len(quarantined)
    check = quarantine_fraction_check(drop.records_in, len(quarantined), 0.05)
    assert not check.passed and check.name == "quarantine_fraction"
    assert check.value == pytest.approx(len(quarantined) / drop.records_in, abs=1e-6)


def test_quarantine_fraction_check_threshold_and_errors():
    assert quarantine_fraction_check(100, 5, 0.05).passed
    fail = quarantine_fraction_check(100, 6, 0.05)
    assert not fail.passed and fail.value == 0.06 and "6 of 100" in fail.detail
    assert "DEID_MAX_QUARANTINE_FRACTION" in fail.detail
    assert quarantine_fraction_check(10, 10, 1.0).passed
    assert quarantine_fraction_check(0, 0).passed  # an empty drop is drop_not_empty's job
    from deid.errors import ConfigError

    with pytest.raises(ConfigError, match="max_quarantine_fraction"):
        quarantine_fraction_check(10, 1, 1.5)
    with pytest.raises(ConfigError, match="quarantined"):
        quarantine_fraction_check(10, 11)


def test_empty_drop_is_read_and_rejected_by_drop_checks(tmp_path):
    root = tmp_path / "drop"
    root.mkdir()
    (root / "manifest.csv").write_text("image,subject_id,gender\r\n")
    (root / "drop.yaml").write_text("labels: [gender]\n")
    drop = read_drop(root)
    assert drop.records_in == 0 and drop.rows == []
    res = ingest(drop, tmp_path / "st" / "ingested.parquet")
    assert res.n_records == 0 and res.row_groups == 0
    assert pq.read_table(res.path).num_rows == 0
    checks = {c.name: c for c in drop_checks(records_in=drop.records_in, people=0, k=5)}
    assert not checks["drop_not_empty"].passed and "header only" in checks["drop_not_empty"].detail
    assert not checks["enough_people"].passed


def test_fewer_than_k_people_fails_the_drop_check(tmp_path):
    root = tmp_path / "drop"
    root.mkdir()
    rows = []
    for i in range(6):  # 3 people x 2 images
        (root / f"{i}.png").write_bytes(_enc(".png", _dots(i)))
        rows.append(f"{i}.png,p{i // 2},f")
    (root / "manifest.csv").write_text("image,subject_id,gender\n" + "\n".join(rows) + "\n")
    drop = read_drop(root, labels=["gender"])
    people = len({r.subject_id for r in drop.rows})
    checks = {c.name: c for c in drop_checks(records_in=drop.records_in, people=people, k=5)}
    assert checks["drop_not_empty"].passed
    assert not checks["enough_people"].passed and checks["enough_people"].value == 3
    assert "fewer than k=5" in checks["enough_people"].detail
    assert all(c.passed for c in drop_checks(records_in=6, people=3, k=3))


# ------------------------------------------------------------------------------- faces (London)


def _london_gray(n: int) -> np.ndarray:
    if not (LONDON / "neutral_front").is_dir():
        pytest.fail(f"the London dataset is missing: expected it at {LONDON} (see its README.md)")
    path = sorted((LONDON / "neutral_front").glob("*.jpg"))[n]
    return cv2.imread(str(path), cv2.IMREAD_REDUCED_GRAYSCALE_2)


@pytest.mark.london
@pytest.mark.slow
def test_london_no_face_and_two_faces_with_and_without_eye_points():
    from deid.alignment.eyes import EyePair
    from deid.alignment.canonical import FaceAligner
    from deid.alignment.align import align_records

    a, b = _london_gray(0), _london_gray(1)  # 675 x 675 each
    pair = np.hstack([a, b])
    no_face = np.ascontiguousarray(a[:120, :])  # a strip of background above the head
    eyes_b = EyePair((675 + 250.0, 330.0), (675 + 420.0, 330.0))  # roughly face b's eyes
    records = [
        {"record_id": "two", "image": "two.png", "data": _enc(".png", pair), "eyes": None},
        {"record_id": "two_eyes", "image": "two_eyes.png", "data": _enc(".png", pair), "eyes": eyes_b},
        {"record_id": "none", "image": "none.png", "data": _enc(".png", no_face), "eyes": None},
        {"record_id": "one", "image": "one.png", "data": _enc(".png", a), "eyes": None},
    ]
    done, bad = align_records(records, FaceAligner())
    assert {q.record_id: q.code for q in bad} == {"two": "multiple_faces", "none": "no_face"}
    sources = {d["record_id"]: d["eye_source"] for d in done}
    # Detected eyes: dlib's landmarks (primary) or the Haar eye cascade.
    assert sources["two_eyes"] == "manifest" and sources["one"] in ("landmarks", "landmarks_hog", "detected")
