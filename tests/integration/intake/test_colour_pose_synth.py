"""Issue 26 items 4-5: DEID_COLOR=auto, the pose estimate and quarantine, and deid synth's messy shapes."""
from __future__ import annotations

import csv
import hashlib
import json
from collections import Counter
from types import SimpleNamespace

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deid.alignment.align import align_records
from deid.alignment.eyes import EyePair
from deid.alignment.pose import estimate_yaw
from deid.intake.imaging import is_colour
from deid.intake.synth import make_synthetic_drop, zipf_counts
from deid.intake.synth_face import draw_face, make_person, seeded_rng
from deid.operations import ingest_align, worker_align
from deid.run_config import RunConfig
from deid.settings import Settings


def _manifest(drop):
    with open(drop / "manifest.csv", newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_explicit_counts_give_exactly_those_images_per_person(tmp_path):
    counts = [6, 1, 3, 1]  # one person with half the drop
    drop = make_synthetic_drop(tmp_path / "d", people=4, counts=counts, seed=2, image_size=64)
    got = Counter(r["subject_id"] for r in _manifest(drop))
    assert [got[f"s{n:05d}"] for n in range(1, 5)] == counts
    assert len(list((drop / "images").iterdir())) == sum(counts)
    with pytest.raises(Exception, match="counts has 3 entries"):
        make_synthetic_drop(tmp_path / "e", people=4, counts=[1, 2, 3])


def test_zipf_counts_fall_as_a_power_law():
    c = zipf_counts(24, top=47)
    assert c[:4] == (47, 24, 16, 12) and min(c) == 2 and list(c) == sorted(c, reverse=True)
    assert zipf_counts(3, top=10, exponent=2.0, minimum=1) == (10, 2, 1)


def test_48_pixel_tight_crops(tmp_path):
    drop = make_synthetic_drop(tmp_path / "d", people=2, images_per_person=1, crop="tight", image_size=48, seed=1)
    for row in _manifest(drop):
        img = cv2.imread(str(drop / row["image"]), cv2.IMREAD_UNCHANGED)
        assert img.shape == (58, 48, 3)
        assert 0 < float(row["eye_left_x"]) < float(row["eye_right_x"]) < 47


def test_colour_drops_have_differing_channels_and_grey_drops_do_not(tmp_path):
    colour = make_synthetic_drop(tmp_path / "c", people=2, images_per_person=1, seed=3, image_size=64,
                                 background="clutter")
    grey = make_synthetic_drop(tmp_path / "g", people=2, images_per_person=1, seed=3, image_size=64, grey=True)
    for row in _manifest(colour):
        img = cv2.imread(str(colour / row["image"]))
        assert np.abs(img[..., 0].astype(int) - img[..., 2]).mean() > 5
        assert is_colour((colour / row["image"]).read_bytes())
    for row in _manifest(grey):
        assert not is_colour((grey / row["image"]).read_bytes())
    # A grey photo stored as three-channel JPEG (chroma noise only) is grey too.
    g = cv2.imread(str(grey / _manifest(grey)[0]["image"]), cv2.IMREAD_GRAYSCALE)
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(g, cv2.COLOR_GRAY2BGR), [cv2.IMWRITE_JPEG_QUALITY, 80])
    assert ok and not is_colour(buf.tobytes())


def _yaws(yaw: float, people=range(1, 7)) -> list[float]:
    out = []
    for n in people:
        img, (le, re_) = draw_face(make_person(0, n), expression="neutral", rng=seeded_rng(0, n, 1), yaw=yaw)
        out.append(estimate_yaw(cv2.cvtColor(img, cv2.COLOR_BGR2GRAY), EyePair(le, re_)))
    return out


def test_pose_drawn_by_synth_is_measured_by_the_estimator():
    frontal, right, left = (np.mean(_yaws(y)) for y in (0, 30, -30))
    assert abs(frontal) < 6
    assert right > frontal + 8 and left < frontal - 8


def test_pose_spread_drop_differs_from_the_frontal_drop_only_in_yaw(tmp_path):
    a = make_synthetic_drop(tmp_path / "a", people=2, images_per_person=1, seed=4, image_size=96)
    b = make_synthetic_drop(tmp_path / "b", people=2, images_per_person=1, seed=4, image_size=96, pose_spread=40)
    ra, rb = _manifest(a), _manifest(b)
    assert [r["subject_id"] for r in ra] == [r["subject_id"] for r in rb]
    assert any(r1["eye_left_x"] != r2["eye_left_x"] for r1, r2 in zip(ra, rb))  # the pupils moved with the yaw


def test_frames_per_sequence_are_nearly_identical(tmp_path):
    drop = make_synthetic_drop(tmp_path / "d", people=2, images_per_person=1, seed=5, image_size=96,
                               frames_per_sequence=3)
    rows = _manifest(drop)
    assert [(r["sequence"], r["frame"]) for r in rows] == [(f"s0000{n}-q1", str(t)) for n in (1, 2) for t in range(3)]
    imgs = [cv2.imread(str(drop / r["image"])).astype(np.float64) for r in rows]
    within = [np.abs(imgs[t] - imgs[t + 1]).mean() for t in (0, 1, 3, 4)]
    between = np.abs(imgs[0] - imgs[3]).mean()
    assert 0 < max(within) < 6 and between > 4 * max(within)


def _align_one(img: np.ndarray, eyes, max_yaw):
    ok, buf = cv2.imencode(".png", img)
    rec = {"record_id": "r1", "image": "x.png", "data": buf.tobytes(), "eyes": None if eyes is None else EyePair(*eyes)}
    aligner = worker_align.make_aligner(RunConfig.resolve(Settings()).aligner.to_dict())
    return align_records([rec], aligner, max_yaw=max_yaw)


def test_a_turned_face_is_quarantined_with_reason_pose(monkeypatch):
    # The pose is estimated for eyes the detector found (the landmarks are cheap beside detection); eyes
    # given in the manifest are aligned without an estimate (its cost per face). Detection is stood in
    # for by the drawn pupils reported as detected (a bare drawn face has no frame for the Haar cascade).
    import deid.alignment.align as align_mod

    real = align_mod._decode_for_alignment
    detected = lambda *a, **kw: (lambda r: (r[0], r[1], "landmarks", *r[3:]))(real(*a, **kw))  # noqa: E731
    img, eyes = draw_face(make_person(0, 1), expression="neutral", rng=seeded_rng(0, 1, 1), yaw=40)
    done, bad = _align_one(img, eyes, max_yaw=10.0)
    assert not bad and "yaw" not in done[0]  # manifest eyes: no estimate
    monkeypatch.setattr(align_mod, "_decode_for_alignment", detected)
    done, bad = _align_one(img, eyes, max_yaw=10.0)
    assert not done and [q.code for q in bad] == ["pose"] and "max_yaw_degrees=10" in bad[0].message
    img, eyes = draw_face(make_person(0, 1), expression="neutral", rng=seeded_rng(0, 1, 1))
    done, bad = _align_one(img, eyes, max_yaw=10.0)
    assert not bad and abs(done[0]["yaw"]) < 10
    done, _ = _align_one(img, eyes, max_yaw=None)
    assert "yaw" not in done[0]


def test_pose_spread_quantiles_from_the_histogram():
    h = worker_align.yaw_histogram([0.4, -1.5, 2.2, None, -30.0])
    assert sum(h) == 4 and h[0] == 1 and h[30] == 1
    spread = worker_align.pose_spread(h, max_yaw=30.0, quarantined=2)
    assert spread["faces"] == 4 and spread["abs_yaw_p50"] == 2 and spread["abs_yaw_max"] == 31
    assert worker_align.pose_spread((), max_yaw=None, quarantined=0) == {"estimated": False, "max_yaw_degrees": None}


def _config(tmp_path, **kw) -> RunConfig:
    return RunConfig.resolve(Settings(project_dir=tmp_path, **kw))


def test_auto_colour_follows_the_drop_then_the_lineage(tmp_path):
    # A dataset's first release follows the drop, under the default (invariant) policy too: the registry
    # stores colour averages, so a returning person's colour image can be republished bit for bit.
    config = _config(tmp_path)
    assert config.color_auto and not config.color and config.lineage_policy == "invariant"
    colour = ingest_align.resolve_color(config, SimpleNamespace(colour_sample=(62, 64)))
    assert colour.color and colour.color_reason == "auto: 97% of 64 sampled images colour: colour"
    grey = ingest_align.resolve_color(config, SimpleNamespace(colour_sample=(3, 64)))
    assert not grey.color and grey.color_reason.endswith(": grey")
    big = ingest_align.resolve_color(config, SimpleNamespace(colour_sample=(64, 64), staged=config.color_auto_max + 1))
    assert not big.color and "DEID_COLOR_AUTO_MAX=20000" in big.color_reason
    assert ingest_align.resolve_color(config, SimpleNamespace(colour_sample=(64, 64), staged=config.color_auto_max)).color
    assert ingest_align.lineage_color_check(colour, None) is None   # no lineage, or nothing registered yet: no mode
    assert ingest_align.lineage_color_check(colour, SimpleNamespace(color_mode=None, dataset="d")) is None
    # Later releases follow the lineage's mode whatever the drop is, and say so.
    greyed = SimpleNamespace(color_mode="grey", dataset="d")
    coloured = SimpleNamespace(color_mode="colour", dataset="d")
    follows = ingest_align.resolve_color(config, SimpleNamespace(colour_sample=(64, 64)), greyed)
    assert not follows.color and "'d' was released in grey" in follows.color_reason
    assert ingest_align.lineage_color_check(follows, greyed).passed
    follows = ingest_align.resolve_color(config, SimpleNamespace(colour_sample=(0, 64)), coloured)
    assert follows.color and follows.color_reason.endswith(": colour")
    assert ingest_align.lineage_color_check(follows, coloured).passed
    # An explicit setting against the lineage's mode, or a grey-only method on a colour lineage: the
    # blocking check fails and says what to set.
    forced = _config(tmp_path, color=False)
    assert ingest_align.resolve_color(forced, SimpleNamespace(colour_sample=(64, 64)), coloured) is forced
    bad = ingest_align.lineage_color_check(forced, coloured)
    assert not bad.passed and (bad.value, bad.threshold) == ("grey", "= colour") and "unset DEID_COLOR" in bad.detail
    assert not ingest_align.lineage_color_check(_config(tmp_path, color=True), greyed).passed
    eigen = ingest_align.resolve_color(RunConfig.resolve(Settings(project_dir=tmp_path), method="k-same-eigen"),
                                   SimpleNamespace(colour_sample=(64, 64)), coloured)
    assert not eigen.color and "method k-same-eigen releases grey" in eigen.color_reason
    bad = ingest_align.lineage_color_check(eigen, coloured)
    assert not bad.passed and "k-same-select" in bad.detail
    blur = ingest_align.resolve_color(RunConfig.resolve(Settings(project_dir=tmp_path), method="blur"),
                                  SimpleNamespace(colour_sample=(64, 64)))
    assert not blur.color and "method blur" in blur.color_reason
    # The canonical size is the lineage's too (a stored average has the size it was released at).
    sized = SimpleNamespace(clusters={"c": SimpleNamespace(shape=(92, 81))}, dataset="d")
    assert ingest_align.lineage_size_check(config, SimpleNamespace(clusters={}, dataset="d")) is None
    assert ingest_align.lineage_size_check(config, sized).passed
    bad = ingest_align.lineage_size_check(_config(tmp_path, canonical_width=128, canonical_height=160), sized)
    assert not bad.passed and (bad.value, bad.threshold) == ("128x160", "= 81x92")
    fixed = _config(tmp_path, color=False)
    assert not fixed.color_auto and fixed.color_reason == "DEID_COLOR=false"
    assert ingest_align.resolve_color(fixed, SimpleNamespace(colour_sample=(64, 64))) is fixed
    assert _config(tmp_path, color=True).color


def test_colour_sample_reads_the_staged_bytes(tmp_path):
    colour = make_synthetic_drop(tmp_path / "c", people=3, images_per_person=1, seed=6, image_size=64)
    grey = make_synthetic_drop(tmp_path / "g", people=2, images_per_person=1, seed=6, image_size=64, grey=True)
    data = [(d / r["image"]).read_bytes() for d in (colour, grey) for r in _manifest(d)]
    path = tmp_path / "ingested.parquet"
    pq.write_table(pa.table({"data": data}), path, row_group_size=2)
    assert ingest_align.colour_sample(path, 3, max_pixels=10**8) == (3, 5)
    assert ingest_align.colour_sample(path, 3, max_pixels=10**8, n=2) == (1, 2)  # first and last row group, one each


def _released_faces(result) -> Counter:
    """How many records of a release carry each face (SHA-256 of its decoded pixels; colour BGR or grey)."""
    faces = [cv2.imread(str(f), cv2.IMREAD_UNCHANGED) for f in sorted((result.release_dir / "images").glob("*.png"))]
    assert faces and all(f is not None for f in faces)
    return Counter((f.shape, hashlib.sha256(f.tobytes()).hexdigest()) for f in faces)


@pytest.mark.slow
def test_a_colour_drop_is_released_in_colour_by_default_and_returning_people_keep_their_colour_face(tmp_path):
    from deid.operations.runner import run_release  # noqa: PLC0415
    from deid.reporting.verify import verify_report  # noqa: PLC0415

    # No manifest eyes: the eyes are detected, so the pose is estimated too (manifest eyes are trusted as given).
    # No labels: six people cannot keep a label learnable at k=3, and the release must pass to be registered.
    drop = make_synthetic_drop(tmp_path / "drop", people=6, images_per_person=2, seed=8, image_size=96, eyes=False,
                               labels=False)
    # The default lineage policy (invariant): the registry stores the colour averages (issue 26 item 4).
    settings = dict(project_dir=tmp_path / "p", identity_embed_max=0, deep_attack_sample=20, cv_repeats=1)
    config = RunConfig.resolve(Settings(**settings), k=3)
    assert config.lineage_policy == "invariant"
    result = run_release(drop, config)
    assert result.released, result.reasons
    report = json.loads((config.reports_path / result.release_id / "report.json").read_text())
    cfg = report["configuration"]
    assert cfg["color"] is True and cfg["color_decision"].startswith("auto: 100% of 12 sampled images colour")
    other = sum(v for reason, v in report["dataset"]["quarantine_by_reason"].items() if reason != "pose")
    assert cfg["pose"]["estimated"] and cfg["pose"]["faces"] + cfg["pose"]["quarantined_pose"] == 12 - other > 0
    first = _released_faces(result)
    assert all(shape == (92, 81, 3) for shape, _ in first)

    # The same drop again with colour switched off (issue 27 item 3's colour re-run): a verdict, never a state
    # error: the blocking check lineage_color rejects it before any work, in a signed report saying what to set.
    grey = run_release(drop, RunConfig.resolve(Settings(**settings, color=False), k=3))
    assert grey.verdict == "rejected" and grey.input_error is None   # the CLI's exit 1
    checks = {c.name: c for c in grey.report.checks}
    assert not checks["lineage_color"].passed and "unset DEID_COLOR" in checks["lineage_color"].detail
    assert (checks["lineage_color"].value, checks["lineage_color"].threshold) == ("grey", "= colour")
    assert grey.release_dir is None and verify_report(grey.report_dir, public_key=grey.public_key).ok
    # Issue 27's colour re-run: colour forced at another canonical size; the size is refused the same way.
    bigger = run_release(drop, RunConfig.resolve(Settings(**settings, color=True, canonical_width=128,
                                                          canonical_height=160), k=3))
    assert bigger.verdict == "rejected" and bigger.input_error is None
    checks = {c.name: c for c in bigger.report.checks}
    assert checks["lineage_color"].passed and not checks["lineage_canonical_size"].passed
    assert "DEID_CANONICAL_WIDTH=81 DEID_CANONICAL_HEIGHT=92" in checks["lineage_canonical_size"].detail

    # And by default: every returning person is republished with the colour face of their first release, bit for bit.
    again = run_release(drop, config)
    assert again.released, again.reasons
    report = json.loads(again.report_path.read_text())
    assert report["configuration"]["color"] is True and "was released in colour" in \
        report["configuration"]["color_decision"]
    assert next(c for c in report["checks"] if c["name"] == "lineage_color")["passed"]
    assert report["lineage"]["release_counts"]["new_clusters"] == 0 < report["lineage"]["release_counts"]["republished_clusters"]
    assert _released_faces(again) == first
