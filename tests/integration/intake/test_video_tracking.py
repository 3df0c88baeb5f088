"""Following a face between full detections (deid.intake.video.FaceTracker): what it may skip and what it may not.

Scripted frames (textured patches, a detector that reports the patches present) test the rules
exactly; a small synthetic recording tests them with dlib's detector.
"""
from __future__ import annotations

import math

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from deid.errors import ConfigError
from deid.intake import video
from deid.intake.synth_videos import recording_frames
from deid.intake.video import DETECT_EVERY, FaceTracker, TrackedFrame, staged_crop, write_video

W, H = 320, 240
SUBJECT = (110, 70, 90, 90)  # x, y, w, h
STRANGER = (205, 40, 60, 60)  # overlaps the subject's crop margin, not its face box


def _texture(seed: int, w: int, h: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 6 + 1, w // 6 + 1, 3), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_LINEAR)


def _frame(stranger: bool, shift: int = 0, subject: bool = True) -> np.ndarray:
    f = np.broadcast_to(np.linspace(90, 140, W, dtype=np.uint8)[None, :, None], (H, W, 3)).copy()
    for (x, y, w, h), seed, on in ((SUBJECT, 1, subject), (STRANGER, 2, stranger)):
        if on:
            f[y:y + h, x + shift:x + shift + w] = _texture(seed, w, h)
    return f


class _Patches(FaceTracker):
    """A tracker whose detector reports the patches drawn in the frame (set by the test) and counts its calls."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0
        self.scene: list[tuple[float, float, float, float]] = []

    def faces(self, bgr):
        self.calls += 1
        return list(self.scene)

    def show(self, i: int, stranger: bool, shift: int = 0) -> TrackedFrame:
        """Step frame ``i`` with the subject (and the stranger) drawn ``shift`` px to the right."""
        self.scene = [(float(x + shift), float(y), float(w), float(h))
                      for (x, y, w, h), on in ((SUBJECT, True), (STRANGER, stranger)) if on]
        return self.step(i, i / 15, _frame(stranger, shift))


def _stranger_pixels(tf: TrackedFrame, shift: int) -> np.ndarray:
    """The part of the crop that shows the stranger's patch (empty when none does)."""
    x, y, w, h = STRANGER
    x0, y0, x1, y1 = tf.box
    a0, b0, a1, b1 = max(x + shift, x0), max(y, y0), min(x + shift + w, x1), min(y + h, y1)
    return tf.crop[b0 - y0:b1 - y0, a0 - x0:a1 - x0] if a0 < a1 and b0 < b1 else tf.crop[:0, :0]


def test_a_face_entering_the_crop_between_detections_is_detected_and_masked(monkeypatch):
    tr = _Patches(detect_every=50)
    out = [tr.show(i, stranger=i >= 4) for i in range(8)]
    # Frames 1-3 are followed (no detector call); the stranger entering the crop at frame 4 forces the full
    # detection, which finds it and masks it: none of its pixels is in any kept crop.
    assert [o.detected for o in out[:5]] == [True, False, False, False, True]
    assert all(o.crop is not None for o in out) and out[4].faces == 2 and out[4].masked == 1
    for o in out[4:]:
        patch = _stranger_pixels(o, 0)
        assert patch.size and patch.reshape(-1, 3).std(axis=0).max() == 0, o.index
    assert tr.calls < len(out)
    # Without the check of the crop around the face the same frames would release the stranger: the
    # check is what catches it (the face box itself is unchanged).
    monkeypatch.setattr(video, "CHANGE_MAX", math.inf)
    blind = _Patches(detect_every=50)
    leaked = [blind.show(i, stranger=i >= 4) for i in range(8)]
    assert not leaked[4].detected and _stranger_pixels(leaked[4], 0).reshape(-1, 3).std(axis=0).max() > 0


def test_masks_move_with_the_face_when_the_view_pans():
    # The subject alone, then the stranger beside it (detected and masked), then the camera pans 3 px a
    # frame: the frames are followed and the mask goes where the stranger went.
    tr = _Patches(detect_every=50)
    out = [tr.show(0, stranger=False)] + [tr.show(i, stranger=True, shift=3 * (i - 1)) for i in range(1, 7)]
    assert [o.detected for o in out] == [True, True] + [False] * 5
    for i, o in enumerate(out[1:], 1):
        patch = _stranger_pixels(o, 3 * (i - 1))
        assert o.masked == 1 and patch.size and patch.reshape(-1, 3).std(axis=0).max() == 0, i
    assert out[-1].box[0] - out[1].box[0] == 15


def test_the_detector_runs_at_least_every_detect_every_frames_and_on_any_doubt():
    tr = _Patches(detect_every=3)
    out = [tr.show(i, stranger=False) for i in range(9)]
    assert [o.detected for o in out] == [True, False, False] * 3
    # A flat face box cannot be followed (nothing to correlate): every frame is detected.
    flat = _Patches(detect_every=50)
    flat.faces = lambda bgr: [tuple(map(float, SUBJECT))]
    grey = np.full((H, W, 3), 128, np.uint8)
    assert all(flat.step(i, i / 15, grey).detected for i in range(4))
    # The subject gone from the box: the correlation fails, the detector runs and quarantines the frame.
    tr = _Patches(detect_every=50)
    tr.show(0, stranger=False)
    tr.scene = []
    gone = tr.step(1, 1 / 15, _frame(False, subject=False))
    assert gone.detected and gone.crop is None and gone.reason == "video_no_face"
    with pytest.raises(ConfigError, match="detect_every=0 must be an integer >= 1"):
        FaceTracker(detect_every=0)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "talk.avi"
    return write_video(path, recording_frames(5, 1, 0, frames=40, width=W, height=H), fps=15)


def test_a_followed_recording_keeps_the_subject_as_detection_on_every_frame_does(recording):
    every = list(video.track_video(recording, tracker=FaceTracker(detect_every=1)))
    followed = list(video.track_video(recording))
    assert [o.crop is None for o in followed] == [o.crop is None for o in every] and followed[0].crop is not None
    detected = [o.index for o in followed if o.detected]
    assert len(detected) < len(followed) / 3
    assert max(b - a for a, b in zip(detected, detected[1:] + [len(followed)])) <= DETECT_EVERY
    # Followed crops stay on the face: their centre within a fifth of the face box of the centre of the crop
    # detected on that frame (the detector's own box jumps by ~0.1 between its pyramid levels).
    for f, e in zip(followed, every):
        if f.crop is not None:
            (a0, b0, a1, b1), (c0, d0, c1, d1) = f.box, e.box
            assert abs(a0 + a1 - c0 - c1) / 2 + abs(b0 + b1 - d0 - d1) / 2 < 0.2 * f.face[2], f.index


def test_staged_crops_carry_their_face_box_and_align_from_it(tmp_path):
    from deid.alignment.align import align_records
    from deid.alignment.canonical import FaceAligner
    from deid.alignment.eyes import HaarEyeDetector

    big = next(iter(video.track_video(write_video(
        tmp_path / "big.avi", recording_frames(5, 1, 0, frames=2, width=1280, height=960), fps=15))))
    data, face = staged_crop(big)
    staged = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    n = math.ceil(max(big.face[2:]) / video.STAGED_FACE_MAX)
    assert n == 2 and staged.shape[:2] == (big.crop.shape[0] // 2, big.crop.shape[1] // 2)
    assert face == pytest.approx(tuple(v / 2 for v in big.face)) and max(face[2:]) <= video.STAGED_FACE_MAX
    assert np.abs(staged.astype(int) - cv2.resize(big.crop, staged.shape[1::-1], interpolation=cv2.INTER_AREA)).max() <= 1
    aligner = FaceAligner(detector=HaarEyeDetector())
    done, bad = align_records([{"record_id": "a", "image": "a", "data": data, "eyes": None, "face_box": face},
                               {"record_id": "b", "image": "b", "data": data, "eyes": None}], aligner)
    assert not bad and [d["eye_source"] for d in done] == ["landmarks_tracked", "landmarks"]
    # The eyes found in the tracked box are where the still's own search puts them (within 5% of their distance).
    (a, b) = done
    d = math.dist((b["eye_left_x"], b["eye_left_y"]), (b["eye_right_x"], b["eye_right_y"]))
    assert math.dist((a["eye_left_x"], a["eye_left_y"]), (b["eye_left_x"], b["eye_left_y"])) < 0.05 * d
    assert math.dist((a["eye_right_x"], a["eye_right_y"]), (b["eye_right_x"], b["eye_right_y"])) < 0.05 * d


def test_ingest_stages_each_frames_face_box(tmp_path):
    from deid.intake.drop import read_drop
    from deid.intake.ingest import ingest
    from deid.intake.synth_videos import make_video_drop

    drop = read_drop(make_video_drop(tmp_path / "d", people=1, recordings=1, seconds=1.0, fps=5.0, width=W,
                                     height=H, seed=3, extras=False))
    res = ingest(drop, tmp_path / "i.parquet")
    t = pq.read_table(res.path, columns=["data", "face_box"])
    assert t.num_rows == res.n_records == 5
    for data, box in zip(t.column("data").to_pylist(), t.column("face_box").to_pylist()):
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        x, y, w, h = box
        assert 0 <= x and 0 <= y and x + w <= img.shape[1] + 1 and y + h <= img.shape[0] + 1 and w > 40
