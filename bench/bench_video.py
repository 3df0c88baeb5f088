"""Benchmark video ingest: decode + track + crop + align vs plain decoding of the same file, one core.

Usage: OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_video.py [--seconds 10] [--fps 15] [--height 480]

Writes a synthetic recording (one talking person, ``deid.intake.synth_videos``; 640x480 at the
default height, Motion-JPEG AVI, in a temporary directory), then in the same process times
(process CPU time, so per core) (1) plain decoding of every frame (``deid.intake.video.iter_frames``)
and (2) what ingest plus alignment do per frame: decode, dlib HOG face detection and track
association (``FaceTracker``), the crop with other faces masked, its PNG encoding (the staged
bytes) and alignment (``FaceAligner``: eye finding and the canonical warp). Prints frames per
second of both and the ratio.
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

from deid.alignment.canonical import FaceAligner  # noqa: E402
from deid.errors import RecordError  # noqa: E402
from deid.intake.synth_videos import recording_frames  # noqa: E402
from deid.intake.video import FaceTracker, encode_png, iter_frames, write_video  # noqa: E402


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
        t0 = time.process_time()
        n_plain = sum(1 for _ in iter_frames(path))
        plain = time.process_time() - t0

        tracker, aligner = FaceTracker(), FaceAligner()
        tracker.faces(next(iter_frames(path))[2])  # build the detector before timing
        t0 = time.process_time()
        n_full = aligned = 0
        for index, seconds, frame in iter_frames(path):
            n_full += 1
            tf = tracker.step(index, seconds, frame)
            if tf.crop is None:
                continue
            encode_png(tf.crop)
            try:
                aligner.align(cv2.cvtColor(tf.crop, cv2.COLOR_BGR2GRAY))
                aligned += 1
            except RecordError:
                pass
        full = time.process_time() - t0
    print(f"{w}x{h}, {frames} frames at {args.fps:g} fps ({path.suffix[1:].upper()}/MJPEG)")
    print(f"plain decode:                 {n_plain / plain:8.1f} frames/s per core ({plain:.2f} s CPU)")
    print(f"decode+track+crop+png+align:  {n_full / full:8.1f} frames/s per core ({full:.2f} s CPU; "
          f"{aligned} of {n_full} frames aligned)")
    print(f"ratio (full / plain time):    {full / plain:8.2f}x")


if __name__ == "__main__":
    main()
