"""Ghosting of k-Same averages on London: landmark k-Same-M vs optical-flow k-Same-M vs pixel k-Same.

The London importer names each neutral image's .tem template (189 hand-placed landmarks) in the
points column; the smiling images have none. The script imports London to a temporary drop,
ingests and aligns it with the release pipeline's own steps (the landmarks go to canonical
pixels with their face), then, on the neutral faces of each gender (the label partitions
k-Same-M runs in), forms the *same* clusters three ways and reports the sharpness (variance of
the Laplacian) of the cluster faces: higher is sharper, ghosted averages score low.

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_landmarks.py --k 2,3,5,10 [--london PATH]
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from deid.anonymise.methods import deidentify
from deid.anonymise.methods_ksame import KSameM, landmark_average, model_average, sharpness
from deid.study import _aligner_params
from deid.intake.drop import read_drop
from deid.intake.ingest import ingest
from deid.intake.london import import_london
from deid.operations.worker_align import align_batch
from deid.operations.worker_rows import read_pixels
from london_set import add_london_option, london_dir


def aligned_london(london: Path, work: Path):
    drop = import_london(london, work / "drop")
    d = read_drop(drop)
    res = ingest(d, work / "ingested.parquet")
    params = _aligner_params()
    align_batch(str(work / "ingested.parquet"), list(range(res.row_groups)), str(work / "aligned.parquet"), params)
    ids, X = read_pixels([str(work / "aligned.parquet")])
    pts = pq.read_table(work / "aligned.parquet", columns=["points"]).column("points").to_pylist()
    meta = pq.read_table(work / "ingested.parquet", columns=["record_id", "subject_id", "gender", "expression"])
    row = {r: i for i, r in enumerate(meta.column("record_id").to_pylist())}
    cols = meta.to_pydict()
    take = [row[r] for r in ids]
    people = [cols["subject_id"][i] for i in take]
    gender = [cols["gender"][i] for i in take]
    expression = [cols["expression"][i] for i in take]
    points = [None if p is None else np.asarray(p).reshape(-1, 2) for p in pts]
    w, h = params["size"]
    return X, people, gender, expression, points, (h, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", default="5", help="comma-separated k values (default 5)")
    add_london_option(ap)
    args = ap.parse_args()
    london = london_dir(args.london)
    ks = [int(v) for v in args.k.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_landmarks_"))
    try:
        X, people, gender, expression, points, shape = aligned_london(london, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the ingested table holds copies of the photos
    h, w = shape
    neutral = [i for i, e in enumerate(expression) if e == "neutral"]
    print(f"London: {len(X)} aligned faces, {sum(p is not None for p in points)} with landmarks "
          f"({len(points[neutral[0]])} each); originals' sharpness (neutral) "
          f"{sharpness(X[neutral], shape=shape).mean():.1f}")
    print("k  clusters  pixel k-Same  flow k-Same-M  points k-Same-M  (mean variance of Laplacian of the cluster "
          "faces; neutral faces, per gender)   cpu s flow / points")
    for k in ks:
        sharp = {"pixel": [], "flow": [], "points": []}
        cpu = {"flow": 0.0, "points": 0.0}
        n_clusters = 0
        for g in sorted(set(gender)):
            idx = np.array([i for i in neutral if gender[i] == g])
            model = KSameM(k, shape=shape).fit(X[idx], people=[people[i] for i in idx],
                                              points=[points[i] for i in idx])
            assert set(model.shape_sources_) == {"points"}
            faces = X[idx].reshape(len(idx), h, w).astype(np.float64)
            for c in range(len(model.averages_)):
                members = model.labels_ == c
                sharp["pixel"].append(faces[members].mean(axis=0))
                t0 = time.process_time()
                sharp["flow"].append(model_average(faces[members]))
                cpu["flow"] += time.process_time() - t0
                t0 = time.process_time()
                sharp["points"].append(landmark_average(faces[members], np.stack([points[i] for i in idx[members]])))
                cpu["points"] += time.process_time() - t0
                n_clusters += 1
            assert np.allclose(np.stack(sharp["points"][-len(model.averages_):]).reshape(len(model.averages_), -1),
                               model.averages_)
        m = {kind: sharpness(np.stack(v).reshape(len(v), -1), shape=shape) for kind, v in sharp.items()}
        print(f"{k:<3}{n_clusters:>6}   {m['pixel'].mean():>10.1f}   {m['flow'].mean():>12.1f}   "
              f"{m['points'].mean():>13.1f}      points sharper than pixel in {np.mean(m['points'] > m['pixel']):.0%}"
              f", than flow in {np.mean(m['points'] > m['flow']):.0%} of clusters   "
              f"{cpu['flow']:.1f} / {cpu['points']:.1f}")
    # The whole drop through deidentify as the flow runs it: label partitions, points where there are some.
    keys = [f"{g}|{e}" for g, e in zip(gender, expression)]
    t0 = time.process_time()
    rel, labels_ = deidentify(X, shape=shape, people=people, partitions=keys, method="k-same-m", k=5, points=points)
    print(f"deidentify(k-same-m, k=5, London 204 faces, points where given): {len(set(labels_))} clusters, "
          f"{time.process_time() - t0:.1f} cpu s; identical image per cluster: "
          f"{all(len({rel[i].tobytes() for i in np.flatnonzero(labels_ == c)}) == 1 for c in set(labels_))}")


if __name__ == "__main__":
    main()
