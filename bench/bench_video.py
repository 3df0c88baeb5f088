"""Benchmark video ingest: decode + track + crop + align vs plain decoding of the same file, one core.

Usage: OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_video.py [--seconds 10] [--fps 15] [--height 480]

Writes a synthetic recording (one talking person, ``deid.intake.synth_videos``; 640x480 at the
default height, 1440x1080 at ``--height 1080``, Motion-JPEG AVI, in a temporary directory), then
in the same process times (process CPU time, so per core):

1. plain decoding of every frame (``deid.intake.video.iter_frames``);
2. "detect every frame": what ingest plus alignment did per frame before following
   (``FaceTracker(detect_every=1)``: dlib HOG face detection and track association on every
   frame; the crop with other faces masked; its PNG encoding, the staged bytes, at full
   resolution; alignment as the align stage does it, ``align_records``: PNG decode, the eye
   search of a still (Haar face cascade, then landmarks), the warp);
3. "followed": what they do now (``FaceTracker()``: the full detection every
   ``DETECT_EVERY`` frames or when following is uncertain, the face followed in between; the
   crop, reduced to a face of at most ``STAGED_FACE_MAX`` px, and its bytes (BMP), ``staged_crop``;
   its eyes as ingest stages them, ``StagedEyes``: one 5-point landmark pass in the box on a
   detected frame, the detection's eyes moved with the face on a followed one whose eye band
   matched; ``align_records`` with the staged eyes and face box: decode, the warp, and the
   landmark pass only where no eyes were staged). Neither estimates head yaw (the align stage
   does, ~0.6 ms, in both).

Prints frames per second of each, the ratio of each to plain decoding, the share of frames that
ran the full detection, and the per-step CPU time of the followed path.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import cv2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deid.alignment.align import align_records, tracked_eyes_finder  # noqa: E402
from deid.alignment.canonical import FaceAligner  # noqa: E402
from deid.alignment.eyes import HaarEyeDetector  # noqa: E402
from deid.intake.synth_videos import recording_frames  # noqa: E402
from deid.intake.video import FaceTracker, StagedEyes, encode_png, iter_frames, staged_crop, write_video  # noqa: E402


def _align(aligner: FaceAligner, data: bytes, face_box=None, frame_eyes=None, sources=None) -> bool:
    """Alignment as the pipeline's align stage does it (deid.alignment.align.align_records, no yaw)."""
    rec = {"record_id": "r", "image": "r.png", "data": data, "eyes": None}
    if face_box is not None:
        rec["face_box"] = face_box
        rec["frame_eyes"] = frame_eyes
    done, _ = align_records([rec], aligner, opencv_threads=None)
    if sources is not None and done:
        sources[done[0]["eye_source"]] = sources.get(done[0]["eye_source"], 0) + 1
    return bool(done)


def detect_every_frame(path: Path) -> tuple[int, int, int]:
    """Frames, frames aligned, frames detected: the per-frame detection and a still's eye search."""
    tracker, aligner = FaceTracker(detect_every=1), FaceAligner(detector=HaarEyeDetector())
    n = aligned = 0
    for index, seconds, frame in iter_frames(path):
        n += 1
        tf = tracker.step(index, seconds, frame)
        if tf.crop is not None:
            aligned += _align(aligner, encode_png(tf.crop))
    return n, aligned, n


def followed(path: Path, steps: dict[str, float] | None = None, sources: dict[str, int] | None = None,
             ) -> tuple[int, int, int]:
    """Frames, frames aligned, frames detected: following between detections, eyes staged by ingest."""
    tracker, aligner = FaceTracker(), FaceAligner(detector=HaarEyeDetector())
    eyes = StagedEyes(tracked_eyes_finder())
    n = aligned = detected = 0
    clock = time.process_time
    t = {"decode": 0.0, "track+crop": 0.0, "stage (reduce+bytes+eyes)": 0.0, "align": 0.0}
    t0 = clock()
    for index, seconds, frame in iter_frames(path):
        t1 = clock()
        n += 1
        tf = tracker.step(index, seconds, frame)
        detected += tf.detected
        t2 = t3 = t4 = clock()
        if tf.crop is not None:
            data, face = staged_crop(tf)
            fe = eyes(tf, data, face)
            t3 = clock()
            aligned += _align(aligner, data, face, fe, sources)
            t4 = clock()
        t["decode"] += t1 - t0
        t["track+crop"] += t2 - t1
        t["stage (reduce+bytes+eyes)"] += t3 - t2
        t["align"] += t4 - t3
        t0 = t4
    if steps is not None:
        steps.update(t)
    return n, aligned, detected


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--fps", type=float, default=15.0)
    ap.add_argument("--height", type=int, default=480)
    args = ap.parse_args()
    cv2.setNumThreads(1)
    h, w = args.height, args.height * 4 // 3
    frames = round(args.seconds * args.fps)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rec.avi"
        write_video(path, recording_frames(7, 1, 0, frames=frames, width=w, height=h), fps=args.fps)
        # Build the detector, the landmark model and the cascades before timing.
        first = next(iter_frames(path))[2]
        FaceTracker().faces(first)
        _align(FaceAligner(detector=HaarEyeDetector()), encode_png(first))
        t0 = time.process_time()
        n_plain = sum(1 for _ in iter_frames(path))
        plain = time.process_time() - t0
        rows = []
        steps: dict[str, float] = {}
        sources: dict[str, int] = {}
        for name, run in (("detect every frame", detect_every_frame),
                          ("followed", lambda p: followed(p, steps, sources))):
            t0 = time.process_time()
            n, aligned, detected = run(path)
            rows.append((name, n, aligned, detected, time.process_time() - t0))
    print(f"{w}x{h}, {frames} frames at {args.fps:g} fps ({path.suffix[1:].upper()}/MJPEG)")
    print(f"plain decode:                 {n_plain / plain:8.1f} frames/s per core ({plain:.2f} s CPU)")
    for name, n, aligned, detected, cpu in rows:
        print(f"{name + ':':29s} {n / cpu:8.1f} frames/s per core ({cpu:.2f} s CPU; {aligned} of {n} aligned, "
              f"{detected} fully detected); ratio to plain decode {cpu / plain:6.2f}x")
    total = sum(steps.values())
    print(f"followed, eye sources: {sources}")
    print("followed, per step (ms/frame): " + ", ".join(f"{k} {v / frames * 1000:.2f}" for k, v in steps.items())
          + f"; total {total / frames * 1000:.2f}")


if __name__ == "__main__":
    main()
