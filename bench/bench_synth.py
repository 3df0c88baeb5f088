"""Synthetic drop generation throughput: images per second with N worker processes, extrapolated to 1M.

Writes a JPEG drop of ``--people`` x 2 faces into a temporary directory (deleted afterwards),
prints images/s, ms per image per worker, bytes per image, and the time and disk space
1,000,000 faces would take at that rate (generation is embarrassingly parallel per person
and streams the manifest, so the rate is flat in N; the printed extrapolation assumes that).

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/bench_synth.py --people 10000 --workers 2
"""
from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path

from deid.intake.synth import make_synthetic_drop


def _cpu() -> float:
    """User + system CPU seconds of this process and its finished children (the workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--people", type=int, default=10_000, help="people (x 2 images each)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size", type=int, nargs="*", default=[200])
    ap.add_argument("--format", default="jpeg")
    ap.add_argument("--tmp", default=None, help="parent directory for the temporary drop")
    ap.add_argument("--quick-noise", action="store_true")
    a = ap.parse_args()
    for size in a.size:
        tmp = Path(tempfile.mkdtemp(prefix="deid-synth-bench-", dir=a.tmp))
        try:
            t0 = time.perf_counter()
            cpu0 = _cpu()
            drop = make_synthetic_drop(tmp / "drop", people=a.people, images_per_person=2, seed=0,
                                       image_size=size, image_format=a.format, workers=a.workers,
                                       quick_noise=a.quick_noise)
            dt = time.perf_counter() - t0
            cpu = _cpu() - cpu0
            n = 2 * a.people
            nbytes = sum(p.stat().st_size for p in (drop / "images").iterdir())
            rate = n / dt
            print(f"{n:,} {a.format} faces {size}px{' quick noise' if a.quick_noise else ''}, {a.workers} workers: {dt:.1f} s = {rate:.0f} images/s "
                  f"({1000 * dt * a.workers / n:.2f} ms per image per worker), {nbytes / n / 1024:.1f} KiB/image; "
                  f"1,000,000 faces at this rate: {1e6 / rate / 60:.1f} min, {nbytes / n * 1e6 / 2**30:.1f} GiB",
                  flush=True)
            # On a shared machine wall time mixes in other load; CPU time per image does not.
            print(f"    CPU {1000 * cpu / n:.2f} ms per image (all processes); 1,000,000 faces on {a.workers} "
                  f"otherwise idle cores: {1e6 * cpu / n / a.workers / 60:.1f} min", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
