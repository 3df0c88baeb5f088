"""Eyes staged with a video's frames (deid.intake.video.StagedEyes): found on detected frames, moved on followed ones.

Alignment then runs no landmark pass on a followed frame; these tests show the moved eyes are where a
landmark pass on that very frame puts them, that a frame whose eye band changed gets none, and that
alignment uses staged eyes as given (and searches when they are unusable).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from deid.alignment.align import align_records, tracked_eyes_finder
from deid.alignment.canonical import FaceAligner
from deid.alignment.eyes import HaarEyeDetector
from deid.intake import video
from deid.intake.synth_videos import recording_frames
from deid.intake.synth_sequences import draw_sequence
from deid.intake.video import FaceTracker, StagedEyes, staged_crop, staged_factor, write_video


def _staged(path):
    """(tracked frame, staged bytes, face box, staged eyes, a landmark pass's eyes on those bytes) per kept frame."""
    find = tracked_eyes_finder()
    eyes = StagedEyes(find)
    out = []
    for tf in video.track_video(path, tracker=FaceTracker()):
        if tf.crop is not None:
            data, face = staged_crop(tf)
            out.append((tf, data, face, eyes(tf, data, face), find(data, face)))
    return out


@pytest.mark.parametrize("width,height", [(320, 240), (1280, 960)])
def test_followed_frames_eyes_move_as_the_face_did(tmp_path, width, height):
    path = write_video(tmp_path / "talk.avi", recording_frames(5, 1, 0, frames=20, width=width, height=height), fps=15)
    side = int(0.75 * height) // 2 * 2  # the generator's face size (synth_videos.recording_frames)
    truth = [np.array(sorted(e)) for *_, e in draw_sequence(5, 1, 0, frames=20, image_size=side)]
    rows = _staged(path)
    assert len(rows) == 20
    moved, landmarks, ref = [], [], None
    for tf, _, _, staged, found in rows:
        n = staged_factor(tf.face)

        def in_frame(eyes):  # staged crop pixels -> frame pixels (a staged pixel is the mean of n x n)
            return np.reshape(eyes[:4], (2, 2)) * n + (n - 1) / 2 + np.array(tf.box[:2])

        if tf.detected:  # a detected frame's eyes are the landmark pass's, as alignment would find them
            assert staged == (*found, 0.0)
            ref = (tf.index, in_frame(found))
            continue
        if staged is None:
            continue
        # How far the eyes moved since the detection, against how far the generator moved them, in eye distances.
        true_move, d = truth[tf.index] - truth[ref[0]], math.dist(*truth[tf.index])
        moved.append(np.abs(in_frame(staged) - ref[1] - true_move).max() / d)
        landmarks.append(np.abs(in_frame(found) - ref[1] - true_move).max() / d)
    assert len(moved) >= 5
    # Within 3% of the eye distance on every followed frame, and closer on average than a fresh landmark
    # pass on that frame (which jitters: its own move errs by 1-5% on average here, up to 20%).
    assert max(moved) < 0.03 and np.mean(moved) < np.mean(landmarks), (moved, landmarks)


def _run(frames) -> list:
    tracker = FaceTracker()
    return [tracker.step(i, i / 15, f) for i, f in enumerate(frames)]


def test_a_followed_frame_whose_eye_band_changed_gets_no_moved_eyes():
    frames = list(recording_frames(5, 1, 0, frames=10, width=320, height=240))
    out = _run(frames)
    assert all(o.crop is not None for o in out) and all(o.moved is None for o in out if o.detected)
    k = next(o.index for o in out if o.moved is not None)  # the first frame followed with its eyes moved
    ref = max(o.index for o in out[:k] if o.detected)
    tracker = FaceTracker()
    for i in range(ref + 1):
        tracker.step(i, i / 15, frames[i])
    x, y, w, h = tracker.track
    # Frame k again, the eyes closed (the band painted with the skin between the eyes), the rest as it was.
    skin = frames[k][int(y + 0.45 * h), int(x + 0.5 * w)].copy()
    frames[k][int(y + 0.3 * h):int(y + 0.45 * h), int(x + 0.2 * w):int(x + 0.8 * w)] = skin
    again = _run(frames)
    assert [o.moved for o in again[:k]] == [o.moved for o in out[:k]]
    assert again[k].crop is not None and again[k].moved is None  # followed or detected, not the detection's eyes moved


def test_alignment_uses_staged_eyes_and_searches_when_they_are_unusable(tmp_path):
    path = write_video(tmp_path / "talk.avi", recording_frames(5, 1, 0, frames=10, width=320, height=240), fps=15)
    tf, data, face, staged, found = next(r for r in _staged(path) if r[3] is not None and r[3][4] == 1.0)
    aligner = FaceAligner(detector=HaarEyeDetector())
    bad_eyes = (-5.0, 10.0, 40.0, 10.0, 1.0)  # outside the crop
    done, bad = align_records([{"record_id": "a", "image": "a", "data": data, "eyes": None, "face_box": face,
                                "frame_eyes": staged},
                               {"record_id": "b", "image": "b", "data": data, "eyes": None, "face_box": face,
                                "frame_eyes": bad_eyes}], aligner)
    assert not bad and [d["eye_source"] for d in done] == ["landmarks_followed", "landmarks_tracked"]
    a, b = done
    assert (a["eye_left_x"], a["eye_left_y"], a["eye_right_x"], a["eye_right_y"]) == pytest.approx(staged[:4])
    assert (b["eye_left_x"], b["eye_left_y"], b["eye_right_x"], b["eye_right_y"]) == pytest.approx(found)
