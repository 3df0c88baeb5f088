"""The frames case of issue 26: k-Same-Select on near-identical consecutive frames, person-sets and utility.

On a real 48 x 48 set with 3 near-identical frames per sequence, 56 of 183 clusters held exactly the same
people as another cluster, and the run was rejected on expression utility. This bench draws the shape with
`deid synth` (``make_synthetic_drop``: ``--crop tight --size 48 --frames-per-sequence F --frame-jitter small``,
gender x expression labels; ``--frames 1`` is the same drop's first frames only), ingests and aligns it with
the pipeline's own steps (manifest eyes, the run's canonical face), projects it on 50 eigenfaces fitted on the
set (the featurize stage) and runs, per seed:

* the release's grouping (:class:`deid.anonymise.ksame.KSameSelect` over gender x expression, partitions with
  fewer than k people left out, the flow's ``suppress``): clusters, clusters whose person-set another cluster
  also has, and the sequence linkage figure the gate checks when the drop declares sequences
  (:func:`deid.evaluation.sequences.sequence_linkage_check`: the fewest people common to all the clusters
  of one sequence's frames, and how many sequences fall below k);
* the gate's utility check (:func:`deid.evaluation.utility.cross_fit_utility` with the k-Same-Select
  method re-run on each fold's training people, as :mod:`deid.evaluation.gate_utility` calls it): per label
  the accuracy drop delta (originals-trained minus release-trained, on held-out people's originals) with its
  one-sided 95% bootstrap bounds over people, and the actual release's rows' accuracy.

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_frames_grouping.py --people 60 --images 5
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

import deid.anonymise.ksame_greedy as ksame_greedy
from deid.anonymise.ksame import KSameSelect
from deid.anonymise.ksame_sets import distinct_person_sets
from deid.anonymise.methods import method_runner
from deid.evaluation.sequences import sequence_linkage_check
from deid.evaluation.utility import cross_fit_utility
from deid.intake.drop import read_drop
from deid.intake.ingest import ingest
from deid.intake.synth import make_synthetic_drop
from deid.operations.worker_align import align_batch
from deid.study import _aligner_params

SHAPE = (92, 81)


def aligned_frames(work: Path, *, people: int, images: int, frames: int, seed: int) -> dict:
    """The aligned faces of a synthetic 48-pixel frames drop and their manifest columns, in record order."""
    drop = make_synthetic_drop(work / "drop", people=people, images_per_person=images, seed=seed, crop="tight",
                               image_size=48, frames_per_sequence=max(frames, 2), frame_jitter="small")
    res = ingest(read_drop(drop), work / "ing.parquet")
    align_batch(str(res.path), list(range(res.row_groups)), str(work / "al.parquet"), _aligner_params())
    al = pq.read_table(work / "al.parquet", columns=["record_id", "pixels"]).to_pydict()
    meta = pq.read_table(res.path, columns=["record_id", "subject_id", "gender", "expression", "sequence",
                                            "frame"]).to_pydict()
    where = {r: i for i, r in enumerate(meta["record_id"])}
    rows = [where[r] for r in al["record_id"]]
    keep = [j for j, i in enumerate(rows) if meta["frame"][i] < frames]
    pix = np.frombuffer(b"".join(al["pixels"]), np.uint8).reshape(len(rows), -1)[keep]
    cols = {c: [meta[c][rows[j]] for j in keep] for c in ("subject_id", "gender", "expression", "sequence", "frame")}
    shutil.rmtree(work / "drop")
    return {"pixels": pix, **cols}


def shared_person_sets(labels: np.ndarray, people: np.ndarray) -> int:
    """Clusters whose set of people another cluster also has."""
    sets = Counter(frozenset(people[labels == c].tolist()) for c in np.unique(labels))
    return sum(n for n in sets.values() if n > 1)


def measure(d: dict, *, k: int, seed: int, utility: bool) -> dict:
    people = np.asarray(d["subject_id"], dtype=object)
    keys = [(g, e) for g, e in zip(d["gender"], d["expression"])]
    by_key: dict = {}
    for p, c in zip(people, keys):
        by_key.setdefault(c, set()).add(p)
    ok = np.array([len(by_key[c]) >= k for c in keys])
    pix = d["pixels"][ok]
    people = people[ok]
    keys = [c for c, o in zip(keys, ok) if o]
    seqs = [q for q, o in zip(d["sequence"], ok) if o]
    X = fit_eigenfaces_matrix(pix)
    model = KSameSelect(k).fit(X, people=people, images=pix, partitions=keys)
    labels = model.labels_
    link = sequence_linkage_check(seqs, labels.tolist(), people.tolist(), k=k)
    part = np.asarray([model.cluster_partition_[c] for c in labels], dtype=object)
    within = sum(shared_person_sets(labels[m], people[m]) for m in
                 (np.array([p == c for p in part]) for c in dict.fromkeys(model.cluster_partition_)))
    out = {"records": len(pix), "clusters": int(model.n_clusters_), "shared": shared_person_sets(labels, people),
           "shared_in_partition": within,
           "linkage_min": link.value, "linkage_detail": link.detail}
    if utility:
        released = np.clip(np.rint(model.averages_[labels]), 0, 255).astype(np.uint8)
        ev = cross_fit_utility(pix, people=people.tolist(), labels={"gender": [c[0] for c in keys],
                                                                      "expression": [c[1] for c in keys]},
                               deidentify=method_runner("k-same-select", shape=SHAPE, k=k, seed=seed),
                               partitions=keys, k=k, released=released, seed=seed)
        for e in ev:
            out[e.label] = (f"delta {e.delta:+.3f} [{e.delta_lower:+.3f}, {e.delta_upper:+.3f}] {e.status}; original "
                            f"{e.accuracy_original:.3f} release {e.accuracy_release:.3f} actual rows "
                            f"{e.actual_accuracy if e.actual_accuracy is None else round(e.actual_accuracy, 3)}")
    return out


def fit_eigenfaces_matrix(pix: np.ndarray) -> np.ndarray:
    """50 eigenface coefficients of ``pix`` (the featurize stage's model, fitted on these faces)."""
    from deid.alignment.features import Eigenfaces  # noqa: PLC0415

    return Eigenfaces(50, random_state=0).fit(pix).transform(pix)


def staging_figures(staging: Path, k: int) -> dict:
    """The same grouping figures from a ``deid run``'s kept staging (``DEID_KEEP_STAGING=last:1``)."""
    import pyarrow.dataset as ds  # noqa: PLC0415

    parts = ds.dataset(staging / "partitions", format="parquet", partitioning="hive")
    cols = ["record_id", "subject_id", *(["sequence"] if "sequence" in parts.schema.names else [])]
    t = parts.to_table(columns=cols).to_pydict()
    person = dict(zip(t["record_id"], t["subject_id"]))
    seq = dict(zip(t["record_id"], t.get("sequence", [None] * len(t["record_id"]))))
    rel = ds.dataset(staging / "deidentified", format="parquet").to_table(columns=["record_id", "cluster"]).to_pydict()
    people = np.array([person[r] for r in rel["record_id"]], dtype=object)
    codes = {c: i for i, c in enumerate(dict.fromkeys(rel["cluster"]))}
    labels = np.array([codes[c] for c in rel["cluster"]])
    link = sequence_linkage_check([seq[r] for r in rel["record_id"]], labels.tolist(), people.tolist(), k=k)
    return {"records": len(labels), "clusters": len(codes), "shared": shared_person_sets(labels, people),
            "linkage_min": link.value, "linkage_detail": link.detail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--staging", type=Path, default=None,
                    help="only print the grouping figures of a deid run's kept staging directory")
    ap.add_argument("--people", type=int, default=60)
    ap.add_argument("--images", type=int, default=5)
    ap.add_argument("--frames", type=int, nargs="+", default=[3, 1])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--no-utility", action="store_true")
    ap.add_argument("--distinct", choices=["off", "on", "both"], default="both",
                    help="the greedy's distinct person-sets pass (deid.anonymise.ksame_sets) in the release and in "
                         "every fold's re-run of the method (off: the grouping before it)")
    args = ap.parse_args()
    if args.staging is not None:
        print(staging_figures(args.staging, args.k))
        return
    for seed in args.seeds:
        work = Path(tempfile.mkdtemp(prefix="bench_frames_"))
        try:
            for frames in args.frames:
                d = aligned_frames(work / f"f{frames}", people=args.people, images=args.images, frames=frames,
                                   seed=seed)
                for distinct in ([False, True] if args.distinct == "both" else [args.distinct == "on"]):
                    # The greedy's last pass, for the release and every fold's re-run of the method ("off": as
                    # before issue 26's frames fix).
                    ksame_greedy.distinct_person_sets = distinct_person_sets if distinct else lambda *a: 0
                    out = measure(d, k=args.k, seed=seed, utility=not args.no_utility)
                    print(f"seed {seed} frames {frames} distinct sets {distinct}: {out}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
