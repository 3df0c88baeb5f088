"""Throughput of ingest + align + featurize against plain reduced-resolution JPEG decoding.

Usage: .venv/bin/python bench/bench_ingest_align.py [--n 20000] [--rss-n 100000] [--no-dask] [--no-london]
    [--london PATH]

Prints, for the London drop and a synthetic JPEG drop of N faces, seconds per image for decode,
detect, warp and featurize (decode at the reduction align_records uses: by the manifest eye distance,
or by the image size for detection; detect on that reduced image; warp from it), and the ratio (ingest + align + featurize) / (IMREAD_REDUCED_GRAYSCALE_4
decode of the same files); the peak RSS of ingest on a synthetic drop (child process, ru_maxrss);
and the speed-up of 2 Dask workers over 1 for the align stage (deid.operations.worker_align.align_batch per row group).
"""
from __future__ import annotations

import argparse
import csv
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from london_set import add_london_option, london_dir  # noqa: E402


def london_drop(london: Path, dst: Path) -> Path:
    """A London drop in a temp dir (copies; eye points of the neutral photos from the .tem files)."""
    rows = []
    for folder, expr in (("neutral_front", "neutral"), ("smiling_front", "smile")):
        (dst / folder).mkdir(parents=True)
        for p in sorted((london / folder).glob("*.jpg")):
            shutil.copyfile(p, dst / folder / p.name)
            eyes = ["", "", "", ""]
            if p.with_suffix(".tem").exists():
                lines = p.with_suffix(".tem").read_text().splitlines()
                eyes = lines[1].split()[:2] + lines[2].split()[:2]
            rows.append([f"{folder}/{p.name}", p.name[:3], expr, *eyes])
    with open(dst / "manifest.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["image", "subject_id", "expression", "eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y"])
        w.writerows(rows)
    (dst / "drop.yaml").write_text("name: london\nlabels: [expression]\n")
    return dst


def aligner_params() -> dict:
    from deid.run_config import AlignerParams
    from deid.settings import Settings

    return {**AlignerParams.from_settings(Settings()).to_dict(), "color": False}


def bench_drop(label: str, drop_dir: Path, work: Path, detect_sample: int) -> dict:
    import cv2
    import numpy as np
    import pyarrow.parquet as pq

    from deid.alignment.eyes import EyePair, HaarEyeDetector
    from deid.alignment.canonical import _scale_eyes
    from deid.alignment.align import align_records
    from deid.intake.drop import read_drop
    from deid.alignment.features import Eigenfaces
    from deid.intake.imaging import decode_gray_reduced, upright_size
    from deid.intake.ingest import ingest
    from deid.operations.worker_align import make_aligner

    cv2.setNumThreads(1)  # as a Dask worker (align_records caps it too): the baseline gets the same
    drop = read_drop(drop_dir)
    n = len(drop.rows)
    blobs = [r.path.read_bytes() for r in drop.rows]  # warm the page cache for every timing below

    t0 = time.perf_counter()
    for b in blobs:
        cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_REDUCED_GRAYSCALE_4)
    t_base = time.perf_counter() - t0

    import pandas  # noqa: F401 - pyarrow imports it lazily on first table build: a one-off 0.5 s start-up cost
    t0 = time.perf_counter()
    res = ingest(drop, work / f"{label}-ingested.parquet", batch_size=64)
    t_ingest = time.perf_counter() - t0

    # The align stage as the flow runs it (decode + detect-or-manifest-eyes + warp), one process.
    pf = pq.ParquetFile(res.path)
    aligner = make_aligner(aligner_params())
    t_align, pixels = 0.0, []
    for g in range(pf.num_row_groups):
        cols = pf.read_row_group(g).to_pydict()
        recs = [{"record_id": cols["record_id"][i], "image": cols["image"][i], "data": cols["data"][i],
                 "eyes": EyePair((cols["eye_left_x"][i], cols["eye_left_y"][i]),
                                 (cols["eye_right_x"][i], cols["eye_right_y"][i]))
                 if cols["eye_left_x"][i] is not None else None} for i in range(len(cols["record_id"]))]
        t0 = time.perf_counter()
        done, _ = align_records(recs, aligner)
        t_align += time.perf_counter() - t0
        pixels += [d["pixels"] for d in done]

    X = np.frombuffer(b"".join(pixels), np.uint8).reshape(len(pixels), -1)
    t0 = time.perf_counter()
    model = Eigenfaces(50).fit(X)
    model.transform(X)
    t_feat = time.perf_counter() - t0

    # Component costs on a sample, as align_records does them: decode at the detection reduction and
    # detect (ignoring manifest eyes); decode at the manifest-eye reduction when there are eyes; warp.
    sample = list(range(0, n, max(1, n // detect_sample)))[:detect_sample]
    detector = HaarEyeDetector()
    t_dec = t_det = t_warp = 0.0
    found, factors = 0, {}
    for i in sample:
        size = upright_size(blobs[i])
        f_det = detector.reduction(*size)
        row = drop.rows[i]
        t0 = time.perf_counter()
        gray = decode_gray_reduced(blobs[i], f_det)
        t1 = time.perf_counter()
        try:
            eyes = _scale_eyes(detector.detect(gray), f_det)
            found += 1
        except Exception:  # noqa: BLE001 - a miss is counted, not fatal
            eyes = None
        t2 = time.perf_counter()
        t_det += t2 - t1
        f = f_det
        if row.eyes:  # the flow decodes once, at the manifest-eye reduction, and does not detect
            eyes = EyePair(*row.eyes)
            f = aligner.reduction_for(eyes.distance)
            t0 = time.perf_counter()
            gray = decode_gray_reduced(blobs[i], f)
            t_dec += time.perf_counter() - t0
        else:
            t_dec += t1 - t0
        factors[f] = factors.get(f, 0) + 1
        t0 = time.perf_counter()
        if eyes is not None:
            try:
                aligner.align(gray, eyes, factor=f, full_size=size)
            except Exception:  # noqa: BLE001
                pass
        t_warp += time.perf_counter() - t0
    m = len(sample)
    out = {
        "images": n,
        "baseline_reduced4_decode_s_per_image": t_base / n,
        "ingest_s_per_image": t_ingest / n,
        "align_s_per_image": t_align / n,
        "featurize_s_per_image": t_feat / n,
        "decode_s_per_image": t_dec / m,
        "decode_reductions": dict(sorted(factors.items())),
        "detect_s_per_image": t_det / m,
        "detect_found": f"{found}/{m}",
        "warp_s_per_image": t_warp / m,
        "ratio_pipeline_to_reduced_decode": (t_ingest + t_align + t_feat) / t_base,
        "row_groups": res.row_groups,
        "ingested": str(res.path),
    }
    print(f"\n== {label}: {n} images")
    for k, v in out.items():
        if k == "ingested":
            continue
        print(f"  {k:40s} {v * 1000:9.3f} ms" if isinstance(v, float) and "s_per_image" in k else f"  {k:40s} {v}")
    return out


def ingest_rss(drop_dir: Path, work: Path) -> float:
    """Peak RSS (MiB) of a child process that only ingests the drop.

    Read from /proc/self/status VmHWM: ru_maxrss survives fork+exec on Linux, so in a child it would
    report this (bigger) benchmark process's peak instead.
    """
    code = ("import sys, resource; sys.path.insert(0, %r)\n"
            "from pathlib import Path\nfrom deid.intake.drop import read_drop\nfrom deid.intake.ingest import ingest\n"
            "d = read_drop(%r)\nr = ingest(d, Path(%r), batch_size=64)\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
            "print(r.n_records, hwm)\n"
            % (str(ROOT), str(drop_dir), str(work / "rss-ingested.parquet")))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    print(f"  ingest of {out[0]} records: peak RSS {int(out[1]) / 1024:.0f} MiB in {time.perf_counter() - t0:.1f} s")
    return int(out[1]) / 1024


def dask_speedup(ingested: str, row_groups: int, work: Path) -> dict:
    from dask.distributed import Client, LocalCluster

    from deid.operations.worker_align import align_batch

    times = {}
    for workers in (1, 2):
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as c, \
                Client(c) as client:
            client.submit(lambda: 0).result()  # workers up before timing
            t0 = time.perf_counter()
            futs = [client.submit(align_batch, ingested, [g], str(work / f"dask{workers}" / f"part-{g:05d}.parquet"),
                                  aligner_params(), pure=False) for g in range(row_groups)]
            client.gather(futs)
            times[workers] = time.perf_counter() - t0
    print(f"  align on Dask: 1 worker {times[1]:.1f} s, 2 workers {times[2]:.1f} s, "
          f"speed-up {times[1] / times[2]:.2f}x")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="synthetic faces (default 20000)")
    ap.add_argument("--rss-n", type=int, default=0, help="synthetic drop size for the ingest RSS (0 = reuse --n)")
    ap.add_argument("--detect-sample", type=int, default=200, help="images sampled for decode/detect/warp timings")
    ap.add_argument("--no-dask", action="store_true")
    ap.add_argument("--no-london", action="store_true")
    add_london_option(ap)
    args = ap.parse_args()

    from deid.intake.synth import make_synthetic_drop

    with tempfile.TemporaryDirectory(prefix="deid-bench-") as tmp:
        work = Path(tmp)
        if not args.no_london:
            bench_drop("london", london_drop(london_dir(args.london), work / "london"), work, args.detect_sample)
        t0 = time.perf_counter()
        synth = make_synthetic_drop(work / "synth", people=max(1, args.n // 2), images_per_person=2, seed=0,
                                    image_format="jpg")
        print(f"\nsynthetic drop of {args.n} JPEG faces written in {time.perf_counter() - t0:.1f} s")
        res = bench_drop("synthetic", synth, work, args.detect_sample)
        print("\n== ingest peak RSS")
        if args.rss_n and args.rss_n != args.n:
            big = make_synthetic_drop(work / "synth-rss", people=max(1, args.rss_n // 2), images_per_person=2,
                                      seed=1, image_format="jpg")
            ingest_rss(big, work)
        else:
            ingest_rss(synth, work)
        if not args.no_dask:
            print("\n== Dask speed-up (synthetic align)")
            dask_speedup(res["ingested"], res["row_groups"], work)
    print(f"\nbench process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
