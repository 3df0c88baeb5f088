"""Image sequences de-identified with multi-factor: one identity per sequence, expression frame by frame, videos.

Makes a synthetic talking/smiling sequence drop, ingests and aligns it with the pipeline's own
steps, de-identifies it (multi-factor on sequences, and image k-Same for contrast), then reports

* identity consistency: within-sequence spread vs distance between identities (eigenfaces fitted
  on the source frames; and the dlib ResNet descriptor, which is weak on cartoon faces),
* expression: a classifier trained on other people's source frames, scored on source and released
  frames (5 person splits),
* the release: one MJPG video per sequence, read back with OpenCV (frame count, grey error).

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_sequences.py --people 30 --k 5
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq

from deid.alignment.features import Eigenfaces
from deid.anonymise.methods import deidentify
from deid.evaluation.sequences import identity_spread, label_agreement
from deid.study import _aligner_params
from deid.intake.drop import read_drop
from deid.intake.ingest import ingest
from deid.intake.synth_sequences import make_sequence_drop
from deid.operations.worker_align import align_batch
from deid.operations.worker_rows import read_pixels
from deid.release.publish import RELEASE_TABLE, read_video, stage_release

SHAPE = (92, 81)


def _fmt(s) -> str:
    return f"within {s.within:8.3f}  between {s.between:8.3f}  ratio {s.ratio:.3f}  nearest own {s.nearest_own:.3f}"


def aligned_sequence_drop(work: Path, *, people: int, frames: int) -> tuple[np.ndarray, dict[str, list]]:
    """A synthetic sequence drop, ingested and aligned with the pipeline's own steps: (pixels, columns)."""
    make_sequence_drop(work / "drop", people=people, frames=frames, image_size=128)
    d = read_drop(work / "drop")
    res = ingest(d, work / "ing.parquet")
    align_batch(str(res.path), list(range(res.row_groups)), str(work / "al.parquet"), _aligner_params())
    ids, X = read_pixels([str(work / "al.parquet")])
    meta = pq.read_table(res.path).drop_columns(["data"]).to_pydict()
    where = {r: i for i, r in enumerate(meta["record_id"])}
    return X, {c: [meta[c][where[r]] for r in ids] for c in ("subject_id", "gender", "expression", "sequence", "frame")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--people", type=int, default=30)
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--no-dlib", action="store_true", help="skip the dlib descriptors (~95 ms of CPU per face)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_sequences_"))
    try:
        t0 = time.process_time()
        X, col = aligned_sequence_drop(work, people=args.people, frames=args.frames)
        print(f"drop: {len(X)} frames, {args.people} people x 2 sequences x {args.frames} frames "
              f"({time.process_time() - t0:.1f} cpu s to draw, ingest and align)")
        people, seqs = col["subject_id"], col["sequence"]
        labels = {"gender": col["gender"], "expression": col["expression"]}
        t0 = time.process_time()
        rel, clusters = deidentify(X, shape=SHAPE, people=people, method="multi-factor", k=args.k, labels=labels,
                                   sequences=seqs, frames=col["frame"])
        # The release's clusters are cells (identity cluster x labels); a frame's released identity is its
        # identity cluster: the people its cell holds.
        members = {c: frozenset(np.asarray(people, dtype=object)[clusters == c]) for c in set(clusters)}
        identity = [members[c] for c in clusters]
        print(f"multi-factor on sequences, k={args.k}: {len(members)} cells in {len(set(identity))} identity "
              f"clusters, {time.process_time() - t0:.2f} cpu s")
        ks, ks_clusters = deidentify(X, shape=SHAPE, people=people, method="k-same", k=args.k)
        spread = np.mean([len(set(ks_clusters[np.asarray(seqs) == s])) for s in set(seqs)])
        print(f"contrast, image k-Same k={args.k}: a sequence's frames fall in {spread:.1f} clusters on average")
        E = Eigenfaces(30).fit(X)
        print("eigenface identity (30 components fitted on the source frames):")
        print("  source            ", _fmt(identity_spread(E.transform(X), seqs, people)))
        print("  multi-factor      ", _fmt(identity_spread(E.transform(rel), seqs, identity)))
        print("  image k-Same      ", _fmt(identity_spread(E.transform(ks), seqs, list(ks_clusters))))
        if not args.no_dlib:
            from deid.evaluation.recognizer import DlibEmbedder, embedding_distances

            t0 = time.process_time()
            emb = DlibEmbedder(SHAPE)
            D = {"source": emb.transform(X), "multi-factor": emb.transform(rel), "image k-Same": emb.transform(ks)}
            P = np.asarray(people)
            dd = embedding_distances(D["source"], D["source"])
            print(f"dlib descriptors ({time.process_time() - t0:.0f} cpu s): source median distance between "
                  f"different people {np.median(dd[P[:, None] != P[None, :]]):.3f} (below 0.65: weak on these faces),"
                  f" same person {np.median(dd[(P[:, None] == P[None, :]) & ~np.eye(len(P), dtype=bool)]):.3f}")
            print("  source            ", _fmt(identity_spread(D["source"], seqs, people)))
            print("  multi-factor      ", _fmt(identity_spread(D["multi-factor"], seqs, identity)))
            print("  image k-Same      ", _fmt(identity_spread(D["image k-Same"], seqs, list(ks_clusters))))
        print("expression classifier (eigenfaces + logistic regression) trained on half the people's source frames:")
        for seed in range(5):
            a = label_agreement(X, rel, col["expression"], people, seed=seed)
            print(f"  split {seed}: source {a['source_accuracy']:.3f}  released {a['released_accuracy']:.3f}  "
                  f"agreement {a['agreement']:.3f}  ({a['n_test_frames']} frames of {a['n_test_people']} people)")
        staged = stage_release(work / "release", images=rel, shape=SHAPE, clusters=[str(c) for c in clusters],
                               labels=labels, sequences=seqs, frames=col["frame"])
        table = pq.read_table(staged.path / RELEASE_TABLE).to_pydict()
        counts, errs = [], []
        for video in staged.videos:
            sid = Path(video).stem
            rows = sorted((f, img) for f, img, s in zip(table["frame"], table["image"], table["sequence_id"]) if s == sid)
            got = read_video(staged.path / video)
            counts.append(len(got) == len(rows))
            for (_, img), fr in zip(rows, got):
                png = cv2.imread(str(staged.path / img), cv2.IMREAD_GRAYSCALE)
                errs.append(np.abs(cv2.cvtColor(fr, cv2.COLOR_BGR2GRAY)[:, :SHAPE[1]].astype(int) - png).mean())
        size = sum((staged.path / v).stat().st_size for v in staged.videos)
        print(f"release: {len(staged.videos)} videos ({size / 1024:.0f} KiB), frame count right in "
              f"{sum(counts)}/{len(counts)}, MJPG vs PNG frame mean abs grey error {np.mean(errs):.2f} "
              f"(max {np.max(errs):.2f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
