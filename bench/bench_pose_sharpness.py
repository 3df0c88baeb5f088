"""Released-face edge sharpness with head pose: a frontal drop, a pose-spread drop, and that drop grouped by pose.

Issue 26: "a drop with pose spread releases faces whose edge-sharpness is within 20% of a frontal drop's".
For every seed this draws two `deid synth` drops of the same people and images (``make_synthetic_drop``,
``--no-eyes`` so that alignment detects the eyes and the pose estimator runs): one frontal and one with
``--pose-spread DEG`` (each image's yaw uniform in [-DEG, DEG]; its own random stream, so the drops differ
only in pose). Each is ingested and aligned with the pipeline's own steps (``align_batch`` with the run's
aligner settings and ``--max-yaw``: faces beyond it quarantined with reason ``pose``, as the flow does;
``--max-yaw 90`` estimates the yaw and quarantines nothing), projected on 50 eigenfaces fitted on the set
(the featurize stage's ``fit_eigenfaces``), and grouped by k-Same-Select over gender x expression at ``k``
(partitions with fewer than k people left out, the flow's ``suppress``). The pose drop is grouped on the
eigenface features alone and, for each ``--degrees`` value D, on the features with the signed yaw appended
(:func:`deid.anonymise.ksame_pose.pose_features`: D degrees of yaw count as much as a typical distance
between two faces of the partition).

Sharpness of a release: the Sobel gradient magnitude sqrt(gx^2 + gy^2) (``cv2.Sobel``, 3x3 kernels, on the
float64 grey face) over every pixel of each distinct released face (one per cluster, the grey canonical
81 x 92 mean rounded to uint8 as released), as its mean (last session's figure) and its root mean square
(gradient energy: unlike the mean, it falls when an edge is doubled, see :func:`sharpness`), averaged over
the clusters. Also printed: the mean yaw range
(max - min) inside a cluster, and the clusters formed. Per condition: the value for every seed, the mean with a
95% t interval over seeds, and the ratio to the frontal drop of the same seed (paired) with its t interval.

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_pose_sharpness.py --seeds 0 1 2 3 4
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
from scipy import stats

from deid.anonymise.ksame import KSameSelect
from deid.anonymise.ksame_pose import pose_features
from deid.intake.drop import read_drop
from deid.intake.ingest import ingest
from deid.intake.synth import make_synthetic_drop
from deid.operations.worker_align import align_batch
from deid.operations.worker_featurize import fit_eigenfaces
from deid.study import _aligner_params

SHAPE = (92, 81)  # (height, width) of the canonical face


def aligned_drop(work: Path, *, people: int, images: int, seed: int, pose_spread: float, max_yaw: float):
    """(pixels n x p uint8, yaw n (NaN: not estimated), people, partition keys) of one synthetic drop."""
    drop = make_synthetic_drop(work / "drop", people=people, images_per_person=images, seed=seed,
                               pose_spread=pose_spread, eyes=False)
    res = ingest(read_drop(drop), work / "ing.parquet")
    params = {**_aligner_params(), "max_yaw": max_yaw}
    align_batch(str(res.path), list(range(res.row_groups)), str(work / "al.parquet"), params)
    al = pq.read_table(work / "al.parquet", columns=["record_id", "pixels", "yaw"]).to_pydict()
    meta = pq.read_table(res.path, columns=["record_id", "subject_id", "gender", "expression"]).to_pydict()
    where = {r: i for i, r in enumerate(meta["record_id"])}
    rows = [where[r] for r in al["record_id"]]
    pix = np.frombuffer(b"".join(al["pixels"]), np.uint8).reshape(len(rows), -1)
    yaw = np.array([np.nan if v is None else v for v in al["yaw"]], dtype=np.float64)
    who = np.array([meta["subject_id"][i] for i in rows], dtype=object)
    key = [(meta["gender"][i], meta["expression"][i]) for i in rows]
    shutil.rmtree(work / "drop")
    return pix, yaw, who, key, work / "al.parquet"


def releasable(who: np.ndarray, key: list, k: int) -> np.ndarray:
    """Rows of the partitions with >= k people (the flow suppresses the others)."""
    people_of: dict = {}
    for p, c in zip(who, key):
        people_of.setdefault(c, set()).add(p)
    return np.array([len(people_of[c]) >= k for c in key], dtype=bool)


def release(pix: np.ndarray, X: np.ndarray, yaw: np.ndarray, who, key, k: int, degrees: float | None):
    """k-Same-Select per partition on the features (with pose when ``degrees``): (released faces, labels)."""
    labels = np.empty(len(pix), dtype=np.intp)
    offset = 0
    for c in dict.fromkeys(key):
        m = np.flatnonzero([kk == c for kk in key])
        Z = pose_features(X[m], yaw[m], degrees=degrees)
        lab = KSameSelect(k).fit(Z, people=who[m], images=None, partitions=[c] * len(m)).labels_
        labels[m] = lab + offset
        offset += int(lab.max()) + 1
    faces = np.stack([np.rint(pix[labels == g].mean(axis=0)) for g in range(offset)]).astype(np.uint8)
    return faces, labels


def sharpness(faces: np.ndarray) -> tuple[float, float]:
    """(mean, root mean square) of the Sobel gradient magnitude over every pixel of each face, averaged over the faces.

    The mean is last session's figure. It barely sees ghosting: an edge drawn twice at half contrast, a few
    pixels apart, keeps its summed gradient magnitude. The root mean square (Tenengrad's gradient energy, in
    the same units) halves the energy of such an edge, so it measures ghosting and blur both.
    """
    mean, rms = [], []
    for f in faces:
        img = f.reshape(SHAPE).astype(np.float64)
        gx = cv2.Sobel(img, cv2.CV_64F, 1, 0, ksize=3)
        gy = cv2.Sobel(img, cv2.CV_64F, 0, 1, ksize=3)
        g2 = gx * gx + gy * gy
        mean.append(float(np.sqrt(g2).mean()))
        rms.append(float(np.sqrt(g2.mean())))
    return float(np.mean(mean)), float(np.mean(rms))


def yaw_range(yaw: np.ndarray, labels: np.ndarray) -> float:
    """Mean over clusters of the range (max - min) of their members' yaw (unestimated faces left out)."""
    spans = [np.ptp(y[np.isfinite(y)]) for g in np.unique(labels) if np.isfinite(y := yaw[labels == g]).sum() > 1]
    return float(np.mean(spans)) if spans else float("nan")


def interval(values: list[float]) -> str:
    a = np.asarray(values, dtype=np.float64)
    if len(a) < 2:
        return f"{a.mean():.3f}"
    h = stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / np.sqrt(len(a))
    return f"{a.mean():.3f} [{a.mean() - h:.3f}, {a.mean() + h:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--people", type=int, default=30)
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--pose-spread", type=float, default=40.0)
    ap.add_argument("--max-yaw", type=float, default=30.0, help="DEID_MAX_YAW_DEGREES (90: quarantine nothing)")
    ap.add_argument("--degrees", type=float, nargs="+", default=[5.0, 10.0, 20.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    rows: dict[str, dict[str, list[float]]] = {}

    def put(name: str, **figures: float) -> None:
        for key, v in figures.items():
            rows.setdefault(name, {}).setdefault(key, []).append(v)

    for seed in args.seeds:
        work = Path(tempfile.mkdtemp(prefix="bench_pose_"))
        try:
            base = None
            for spread in (0.0, args.pose_spread):
                pix, yaw, who, key, part = aligned_drop(work / f"p{spread:g}", people=args.people, images=args.images,
                                                        seed=seed, pose_spread=spread, max_yaw=args.max_yaw)
                X = fit_eigenfaces([str(part)], 50, seed=0).transform(pix)
                ok = releasable(who, key, args.k)
                pix, X, yaw, who = pix[ok], X[ok], yaw[ok], who[ok]
                key = [c for c, o in zip(key, ok) if o]
                for degrees in ([None] if spread == 0 else [None, *args.degrees]):
                    faces, labels = release(pix, X, yaw, who, key, args.k, degrees)
                    s, e = sharpness(faces)
                    name = "frontal" if spread == 0 else (f"pose {spread:g}, appearance only" if degrees is None
                                                          else f"pose {spread:g}, pose grouping {degrees:g} deg")
                    if spread == 0:
                        base, base_e = s, e
                    put(name, sharpness=s, ratio=s / base, rms=e, rms_ratio=e / base_e, yaw_range=yaw_range(yaw, labels),
                        clusters=float(labels.max() + 1), faces=float(len(pix)),
                        estimated=float(np.isfinite(yaw).mean()))
                    print(f"seed {seed} {name:38s} sharpness {s:7.3f}  ratio {s / base:.3f}  rms {e:7.3f}  "
                          f"ratio {e / base_e:.3f}  "
                          f"yaw range in a cluster {yaw_range(yaw, labels):5.1f}  clusters {labels.max() + 1}  "
                          f"faces {len(pix)} (yaw estimated {np.isfinite(yaw).mean():.0%}; "
                          f"sizes {dict(Counter(np.bincount(labels).tolist()))})", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{len(args.seeds)} seeds, {args.people} people x {args.images} images, k={args.k}, "
          f"max yaw {args.max_yaw:g}; mean [95% t interval over seeds]")
    for name, figs in rows.items():
        print(f"{name:38s} mean |grad| {interval(figs['sharpness'])}  ratio to frontal {interval(figs['ratio'])}\n"
              f"{'':38s} rms |grad| {interval(figs['rms'])}  ratio to frontal {interval(figs['rms_ratio'])}\n"
              f"{'':38s} yaw range {interval(figs['yaw_range'])}  clusters {np.mean(figs['clusters']):.1f}")


if __name__ == "__main__":
    main()
