"""Benchmark decoding, Haar eye detection and alignment on the London set (read in place, never copied).

Usage: .venv/bin/python bench/bench_align_london.py [--london PATH] [--limit N]

Prints per-image stage times of the path align_records takes (decode at the detector's JPEG
reduction, detect on that reduced image, warp from it; the full grey decode and the manifest-eye
reduced decode for reference), eye error of the detector on the neutral photos against the manual .tem
pupils (max of the two eyes' distances divided by the true inter-ocular distance), the alignment rate
on the smiling photos (align_records), and how far the manifest-eye faces from the reduced decode are
from the full-resolution ones (mean absolute grey difference).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deid.alignment.eyes import EyePair, HaarEyeDetector  # noqa: E402
from deid.alignment.canonical import FaceAligner, _scale_eyes  # noqa: E402
from deid.alignment.align import align_records  # noqa: E402
from deid.errors import RecordError  # noqa: E402
from deid.intake.imaging import decode_gray, decode_gray_reduced, upright_size  # noqa: E402
from london_set import add_london_option, london_dir  # noqa: E402


def read_tem(path: Path) -> EyePair:
    lines = path.read_text().splitlines()
    pts = [tuple(float(v) for v in lines[1 + i].split()[:2]) for i in range(2)]
    return EyePair(pts[0], pts[1])


def eye_error(found: EyePair, truth: EyePair) -> float:
    d = max(
        np.hypot(found.left[0] - truth.left[0], found.left[1] - truth.left[1]),
        np.hypot(found.right[0] - truth.right[0], found.right[1] - truth.right[1]),
    )
    return float(d / truth.distance)


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_london_option(ap)
    ap.add_argument("--limit", type=int, default=0, help="only the first N images of each folder")
    ap.add_argument("--threads", type=int, default=1, help="cv2.setNumThreads (1 = one core, as a worker)")
    args = ap.parse_args()
    cv2.setNumThreads(args.threads)
    london = london_dir(args.london)
    neutral = sorted((london / "neutral_front").glob("*.jpg"))
    smiling = sorted((london / "smiling_front").glob("*.jpg"))
    if not neutral:
        print(f"London set has no neutral_front/*.jpg at {london}", file=sys.stderr)
        return 2
    if args.limit:
        neutral, smiling = neutral[: args.limit], smiling[: args.limit]

    detector = HaarEyeDetector()
    aligner = FaceAligner(detector=detector)
    times: dict[str, list[float]] = {"decode_full": [], "decode_detect": [], "detect": [], "warp": [],
                                     "decode_manifest": []}
    diffs = []
    errors, sources, failures, fallback_errors = [], [], [], []
    print(f"{'image':<12} {'full':>7} {'red':>7} {'detect':>7} {'warp':>7}  {'error':>6} source")
    for path in neutral:
        data = path.read_bytes()
        full, t_full = timed(decode_gray, data)
        size = upright_size(data)
        f = detector.reduction(*size)
        gray, t_red = timed(decode_gray_reduced, data, f)
        truth = read_tem(path.with_suffix(".tem"))
        fm = aligner.reduction_for(truth.distance)
        man, t_man = timed(decode_gray_reduced, data, fm)
        diffs.append(float(np.abs(aligner.align(man, truth, factor=fm, full_size=size).image.astype(float)
                                  - aligner.align(full, truth).image.astype(float)).mean()))
        try:
            found, t_det = timed(detector.locate, gray)
        except RecordError as exc:
            failures.append((path.name, exc.code))
            print(f"{path.name:<12} {t_full * 1e3:7.1f} {t_red * 1e3:7.1f}  FAILED {exc.code}")
            continue
        eyes = _scale_eyes(found.eyes, f)
        _, t_warp = timed(lambda: aligner.align(gray, eyes, factor=f, full_size=size))
        err = eye_error(eyes, truth)
        # How good would the face-box fallback alone be on this image?
        fx, fy, fw, fh = (v * f for v in found.face)
        geo = EyePair(
            (fx + detector.GEOMETRY_LEFT[0] * fw, fy + detector.GEOMETRY_LEFT[1] * fh),
            (fx + detector.GEOMETRY_RIGHT[0] * fw, fy + detector.GEOMETRY_RIGHT[1] * fh),
        )
        fallback_errors.append(eye_error(geo, truth))
        errors.append(err)
        sources.append(found.source)
        for key, t in zip(times, (t_full, t_red, t_det, t_warp, t_man)):
            times[key].append(t)
        print(f"{path.name:<12} {t_full * 1e3:7.1f} {t_red * 1e3:7.1f} {t_det * 1e3:7.1f} {t_warp * 1e3:7.1f}  {err:6.3f} {found.source}")

    records = [{"record_id": p.stem, "image": p.name, "data": p.read_bytes(), "eyes": None} for p in smiling]
    t0 = time.perf_counter()
    done, bad = align_records(records, aligner)
    t_smile = (time.perf_counter() - t0) / max(1, len(smiling))
    smile_ok, smile_codes, smile_sources = len(done), {}, {}
    for q in bad:
        smile_codes[q.code] = smile_codes.get(q.code, 0) + 1
        print(f"smiling {q.image}: {q.code} ({q.message})")
    for d in done:
        smile_sources[d["eye_source"]] = smile_sources.get(d["eye_source"], 0) + 1

    e = np.array(errors)
    print("\n== stage time per image (ms, one thread) ==")
    for key, vals in times.items():
        v = np.array(vals) * 1e3
        print(f"{key:<16} mean {v.mean():6.1f}  median {np.median(v):6.1f}  max {v.max():6.1f}")
    print("\n== neutral detection vs .tem ==")
    print(f"detected {len(errors)}/{len(neutral)}  failures {failures}")
    print(f"sources {dict((s, sources.count(s)) for s in set(sources))}")
    if len(e):
        print(f"eye error: mean {e.mean():.4f}  median {np.median(e):.4f}  max {e.max():.4f}  fraction<0.10 {(e < 0.10).mean():.3f}")
        g = np.array(fallback_errors)
        print(f"face-box geometry only: mean {g.mean():.4f}  max {g.max():.4f}  fraction<0.10 {(g < 0.10).mean():.3f}")
    print("\n== smiling alignment (no landmarks) ==")
    print(f"aligned {smile_ok}/{len(smiling)}  sources {smile_sources}  refused {smile_codes}  "
          f"{t_smile * 1e3:.1f} ms per photo (align_records: decode + detect + warp)")
    print("\n== manifest eyes: reduced decode vs full resolution ==")
    print(f"mean abs grey difference: mean {np.mean(diffs):.3f}  max {np.max(diffs):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
