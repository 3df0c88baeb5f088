"""Synthetic drop generation throughput: images per second with N worker processes, extrapolated to 1M.

Writes a JPEG drop of ``--people`` x 2 faces into a temporary directory (deleted afterwards),
prints images/s, ms per image per worker, bytes per image, and the time and disk space
1,000,000 faces would take at that rate (generation is embarrassingly parallel per person
and streams the manifest, so the rate is flat in N; the printed extrapolation assumes that).

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/bench_synth.py --people 10000 --workers 2 --fast

``--profile P`` first draws P people in this process under cProfile and prints the CPU
milliseconds per face of each step (person, background, drawing, lighting + noise, encoding,
file writing, manifest), scaled to the un-profiled CPU time of the same work.
"""
from __future__ import annotations

import argparse
import cProfile
import csv
import io
import pstats
import resource
import shutil
import tempfile
import time
from pathlib import Path

from deid.intake import synth
from deid.intake.synth import SynthSpec, make_synthetic_drop

# step -> functions whose cumulative time is that step (drawing = draw_face minus its parts)
_STEPS = {"person (make_person)": ("make_person",), "background": ("_background", "_background_fast"),
          "lighting + noise": ("_finish", "_finish_fast"), "encoding": ("_encode",),
          "file writing": ("write_bytes",), "manifest rows (csv)": ("writerows",)}


def profile_steps(spec: SynthSpec, people: int, tmp: Path) -> None:
    """Print CPU ms per face by step for ``people`` people drawn in this process (see the module doc)."""
    sink = csv.writer(io.StringIO())

    def work(out: Path) -> None:  # a new directory each time: files are created, not overwritten
        (out / "images").mkdir(parents=True)
        for a in range(1, people + 1, 50):
            sink.writerows(synth._render_people(spec, out, range(a, min(a + 50, people + 1))))

    t = time.process_time()
    work(tmp / "plain")
    plain = time.process_time() - t
    prof = cProfile.Profile()
    prof.runcall(work, tmp / "profiled")
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    cum = {}
    for (_f, _l, name), (_cc, _nc, _tt, ct, _callers) in stats.items():
        cum[name] = cum.get(name, 0.0) + ct
    total = sum(v[2] for v in stats.values())
    faces = people * spec.images_per_person
    scale = plain / total / faces * 1000
    steps = {k: sum(cum.get(f, 0.0) for f in fs) for k, fs in _STEPS.items()}
    steps["drawing (shapes)"] = cum.get("draw_face", 0.0) - steps["background"] - steps["lighting + noise"]
    steps["other"] = total - sum(v for k, v in steps.items() if k != "other")
    print(f"CPU per face by step ({faces} faces, one process, {'fast' if spec.fast else 'default'} "
          f"{spec.image_size}px {spec.image_format}): total {plain / faces * 1000:.2f} ms", flush=True)
    for k, v in sorted(steps.items(), key=lambda kv: -kv[1]):
        print(f"    {k:<22}{v * scale:>7.3f} ms  ({100 * v / total:4.1f} %)", flush=True)


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
    ap.add_argument("--fast", action="store_true", help="make_synthetic_drop(fast=True)")
    ap.add_argument("--profile", type=int, default=0, metavar="P", help="first profile P people by step")
    a = ap.parse_args()
    for size in a.size:
        tmp = Path(tempfile.mkdtemp(prefix="deid-synth-bench-", dir=a.tmp))
        try:
            if a.profile:
                spec = SynthSpec(seed=0, image_size=size, image_format=a.format, quick_noise=a.quick_noise,
                                 fast=a.fast)
                profile_steps(spec, a.profile, tmp / "profile")
            if not a.people:
                continue
            t0 = time.perf_counter()
            cpu0 = _cpu()
            drop = make_synthetic_drop(tmp / "drop", people=a.people, images_per_person=2, seed=0,
                                       image_size=size, image_format=a.format, workers=a.workers,
                                       quick_noise=a.quick_noise, fast=a.fast)
            dt = time.perf_counter() - t0
            cpu = _cpu() - cpu0
            n = 2 * a.people
            nbytes = sum(p.stat().st_size for p in (drop / "images").iterdir())
            rate = n / dt
            mode = (' quick noise' if a.quick_noise else '') + (' fast' if a.fast else '')
            print(f"{n:,} {a.format} faces {size}px{mode}, {a.workers} workers: {dt:.1f} s = {rate:.0f} images/s "
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
