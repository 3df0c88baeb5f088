"""Peak memory of ingesting one long 1080p recording through the video intake path, against its length.

Usage: OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_video_memory.py [--minutes 1 10] [--height 1080]
       [--fps 15] [--sample-fps RATE] [--workdir DIR]

For each length, in fresh processes: (1) writes a synthetic recording (one talking person,
``deid.intake.synth_videos``; 1440x1080 Motion-JPEG AVI at ``--fps``; the first ``--loop`` seconds
of frames are drawn and then repeated, so writing an hour costs encoding only) and a one-row drop
naming it; (2) ingests the drop (``deid.intake.ingest.ingest``: decode, track, crop, stage, the
same path as ``deid run``'s ingest stage) and reports its peak resident memory
(``getrusage(RUSAGE_SELF).ru_maxrss``) and its resident memory once the detector was built, before
the video was opened. With ``--sample-fps`` the drop declares that rate (``fps:`` in drop.yaml):
every source frame is still decoded, only the samples are tracked and staged (an hour-long
recording in a few minutes of CPU). Each length's files are deleted before the next.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write(drop: Path, minutes: float, height: int, fps: float, loop: float, sample_fps: float | None) -> None:
    from deid.intake.synth_videos import recording_frames  # noqa: PLC0415
    from deid.intake.video import write_video  # noqa: PLC0415

    width = height * 4 // 3
    frames = list(recording_frames(7, 1, 0, frames=round(loop * fps), width=width, height=height))
    total = round(minutes * 60 * fps)
    (drop / "videos").mkdir(parents=True)
    write_video(drop / "videos" / "rec.avi", (frames[i % len(frames)] for i in range(total)), fps=fps)
    (drop / "manifest.csv").write_text("image,subject_id\nvideos/rec.avi,p1\n")
    (drop / "drop.yaml").write_text("name: long\n" + (f"fps: {sample_fps}\n" if sample_fps else ""))
    (drop / "_READY").write_bytes(b"")


def ingest(drop: Path, out: Path) -> dict:
    import cv2  # noqa: PLC0415

    from deid.intake.drop import read_drop  # noqa: PLC0415
    from deid.intake.ingest import ingest as run  # noqa: PLC0415
    from deid.intake.video import FaceTracker  # noqa: PLC0415

    cv2.setNumThreads(1)
    FaceTracker()  # build dlib's detector first: its memory is not the recording's
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.process_time()
    res = run(read_drop(drop), out)
    cpu = time.process_time() - t0
    return {"rss_before_mib": round(before, 1), "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "frames": res.video_frames, "staged": res.n_records, "quarantined": len(res.quarantined),
            "cpu_s": round(cpu, 1), "staged_bytes": out.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--height", type=int, default=1080)
    ap.add_argument("--fps", type=float, default=15.0)
    ap.add_argument("--loop", type=float, default=4.0, help="seconds of distinct frames, repeated")
    ap.add_argument("--sample-fps", type=float, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--child", choices=["write", "ingest"], help=argparse.SUPPRESS)
    ap.add_argument("--drop", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "write":
        write(args.drop, args.minutes[0], args.height, args.fps, args.loop, args.sample_fps)
        return
    if args.child == "ingest":
        print(json.dumps(ingest(args.drop, args.drop.parent / "ingested.parquet")))
        return
    base = [sys.executable, __file__, "--height", str(args.height), "--fps", str(args.fps), "--loop", str(args.loop)]
    if args.sample_fps:
        base += ["--sample-fps", str(args.sample_fps)]
    print(f"{args.height * 4 // 3}x{args.height} MJPEG at {args.fps:g} fps"
          + (f", sampled at {args.sample_fps:g} fps" if args.sample_fps else ""))
    for minutes in args.minutes:
        work = Path(tempfile.mkdtemp(dir=args.workdir))
        try:
            drop = work / "drop"
            subprocess.run([*base, "--child", "write", "--minutes", str(minutes), "--drop", str(drop)], check=True)
            size = (drop / "videos" / "rec.avi").stat().st_size
            out = subprocess.run([*base, "--child", "ingest", "--drop", str(drop)], check=True, capture_output=True,
                                 text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{minutes:g} min ({size / 2**20:.0f} MiB file): peak RSS {r['peak_rss_mib']:.0f} MiB "
                  f"(before opening the video {r['rss_before_mib']:.0f} MiB); {r['frames']} frames, {r['staged']} staged "
                  f"({r['staged_bytes'] / 2**20:.0f} MiB), {r['quarantined']} quarantined; {r['cpu_s']:.0f} s CPU")
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
