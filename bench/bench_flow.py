"""Benchmark the whole `deid run` on the London drop (or a synthetic one): per-stage seconds per image.

Usage:
    .venv/bin/python bench/bench_flow.py                       # London set, k=5
    .venv/bin/python bench/bench_flow.py --synthetic 2000      # synthetic drop of 2000 faces

Prints the wall time of the whole command (start-up included), each stage's seconds per image,
and the ratio of (ingest + align + featurize) to plain grey JPEG/PNG decoding of the same files
on one core (full resolution and OpenCV's reduced 1/4 decoding for JPEG).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LONDON = ROOT.parent / "shared" / "datasets" / "london"


def decode_cost(files: list[Path]) -> tuple[float, float]:
    """Seconds per image for plain grey decoding: full resolution, and reduced 1/4 where possible."""
    cv2.setNumThreads(1)
    blobs = [f.read_bytes() for f in files]
    t = time.perf_counter()
    for b in blobs:
        cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_GRAYSCALE)
    full = (time.perf_counter() - t) / len(blobs)
    t = time.perf_counter()
    for b in blobs:
        cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_REDUCED_GRAYSCALE_4)
    reduced = (time.perf_counter() - t) / len(blobs)
    return full, reduced


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", type=int, default=0, help="faces in a synthetic drop instead of London")
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deid-bench-"))
    deid = [str(ROOT / ".venv" / "bin" / "deid")]
    env = {**os.environ, "DEID_PROJECT_DIR": str(work), "PREFECT_HOME": str(work / "prefect")}
    drop = work / "drop"
    if args.synthetic:
        people = max(args.synthetic // 2, 1)
        subprocess.run([*deid, "synth", str(drop), "--people", str(people), "--seed", "1", "--format", "jpg"],
                       check=True, env=env)
    else:
        if not LONDON.is_dir():
            print(f"London set missing at {LONDON}", file=sys.stderr)
            return 2
        subprocess.run([*deid, "import", "london", str(LONDON), str(drop)], check=True, env=env)
    files = sorted(p for p in drop.rglob("*") if p.suffix.lower() in (".jpg", ".png"))
    n = len(files)
    full, reduced = decode_cost(files)

    t = time.perf_counter()
    run = subprocess.run([*deid, "run", str(drop), "--k", str(args.k)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    report_line = [ln for ln in run.stdout.splitlines() if ln.startswith("report: ")]
    if not report_line:
        print(run.stdout, run.stderr[-4000:], sep="\n")
        return 1
    report = json.loads(Path(report_line[0].split(": ", 1)[1]).read_text())
    stages = report["configuration"]["stage_seconds"]
    print(f"drop: {'synthetic' if args.synthetic else 'London'}, {n} images, k={args.k}, verdict {report['verdict']}")
    print(f"deid run wall time (start-up included): {wall:.1f} s  ({wall / n * 1000:.1f} ms/image)")
    print(f"plain grey decode, one core: full {full * 1000:.2f} ms/image, reduced 1/4 {reduced * 1000:.2f} ms/image")
    print(f"{'stage':<14}{'seconds':>10}{'ms/image':>12}")
    for stage, sec in stages.items():
        print(f"{stage:<14}{sec:>10.2f}{sec / n * 1000:>12.2f}")
    core = sum(stages.get(s, 0.0) for s in ("ingest", "align", "featurize"))
    print(f"(ingest + align + featurize) / full decode    = {core / n / full:.1f}")
    print(f"(ingest + align + featurize) / reduced decode = {core / n / reduced:.1f}")
    print(f"work dir: {work}")
    return 0 if run.returncode in (0, 1) else run.returncode


if __name__ == "__main__":
    sys.exit(main())
