"""Synthetic video files released at k=5 with multi-factor through the runner: the gate's verdict and figures.

Usage: OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_video_release.py OUT_DIR [--people 30]
[--method multi-factor-expression]

Writes ``make_video_drop`` (PEOPLE x 2 recordings of 2 s at 5 fps, 240x180, plus the two-faces and
face-leaves recordings) under OUT_DIR, runs ``run_release`` (k=5, multi-factor; the quick gate
settings of the flow tests) and prints the verdict, CPU and wall time, the dataset counts and every check.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deid.intake.synth_videos import make_video_drop  # noqa: E402
from deid.operations.runner import run_release  # noqa: E402
from deid.run_config import RunConfig  # noqa: E402
from deid.settings import Settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--people", type=int, default=30)
    ap.add_argument("--method", default="multi-factor", help="multi-factor (default) or multi-factor-expression")
    args = ap.parse_args()
    t0, w0 = time.process_time(), time.time()
    drop = make_video_drop(args.out / "drop", people=args.people, recordings=2, seconds=2, fps=5, width=240,
                           height=180, seed=2)
    settings = Settings(project_dir=args.out / "project", identity_embed_max=0, deep_attack_sample=20, min_probes=4,
                        cv_repeats=1)
    result = run_release(drop, RunConfig.resolve(settings, k=5, method=args.method))
    report = json.loads(result.report_path.read_text())
    print(f"verdict {result.verdict}: {time.process_time() - t0:.0f} s CPU (this process), {time.time() - w0:.0f} s wall")
    print(json.dumps(report["dataset"]))
    for c in report["checks"]:
        print(f"{c['name']}: {c['status']} {c.get('value')} -- {c['detail'][:220]}")


if __name__ == "__main__":
    main()
