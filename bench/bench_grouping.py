"""k-Same grouping at scale: blockwise vs the single greedy (time, within-cluster sum of squares).

Synthetic PCA-like features: a Gaussian mixture in ``--dim`` dimensions (40 components with
decaying per-axis scales, like eigenface coefficients), people drawn around mixture
centres, 2 images per person (person centre + image noise). Prints, for each size in
``--sizes``, the seconds and WCSS of both groupings and their ratio, then the blockwise
grouping alone at ``--big`` faces (plan / blocks / total seconds) and seconds per 1,000 faces.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/bench_grouping.py
    OPENBLAS_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/bench_grouping.py --sizes 20000 50000 --big 1000000
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from deid.anonymise.ksame import KSame
from deid.anonymise.ksame_blocks import REFINE_SCHEDULE, blockwise_labels, plan_blocks


def features(n_people: int, *, dim: int, images_per_person: int = 2, seed: int = 0):
    """(X, people): ``images_per_person`` noisy images around each person's point."""
    rng = np.random.default_rng(seed)
    scales = 1.0 / np.sqrt(np.arange(1, dim + 1))  # decaying variance, as PCA coefficients
    centres = rng.normal(size=(40, dim)) * 3 * scales
    comp = rng.integers(0, 40, size=n_people)
    person = centres[comp] + rng.normal(size=(n_people, dim)) * scales
    people = np.repeat(np.arange(n_people), images_per_person)
    X = person[people] + rng.normal(size=(len(people), dim)) * 0.5 * scales
    return X, people


def wcss(X: np.ndarray, labels: np.ndarray) -> float:
    """Within-cluster sum of squared distances to the cluster means."""
    n_c = int(labels.max()) + 1
    cnt = np.bincount(labels, minlength=n_c)
    sums = np.zeros((n_c, X.shape[1]))
    np.add.at(sums, labels, X)
    return float((X ** 2).sum() - ((sums ** 2).sum(axis=1) / cnt).sum())


def check(labels: np.ndarray, people: np.ndarray, k: int) -> None:
    order = np.lexsort((people, labels))
    lab, ppl = labels[order], people[order]
    size = np.bincount(labels)
    first = np.r_[True, (lab[1:] != lab[:-1]) | (ppl[1:] != ppl[:-1])]
    distinct = np.bincount(lab[first])
    assert distinct.min() >= k, "a cluster has fewer than k people"
    run = np.diff(np.r_[np.flatnonzero(first), len(lab)])
    assert np.all(run * k <= size[lab[first]]), "a person holds more than 1/k of a cluster"


def side_by_side(n: int, *, k: int, dim: int, block_size: int) -> None:
    X, people = features(n // 2, dim=dim)
    out = {}
    for name, bs in (("greedy", None), ("blocks", block_size)):
        model = KSame(k, block_size=bs)
        t0 = time.perf_counter()
        labels, _ = model._labels(X, people, partition=None)
        dt = time.perf_counter() - t0
        check(labels, people, k)
        out[name] = (dt, wcss(X, labels))
    (tg, wg), (tb, wb) = out["greedy"], out["blocks"]
    print(f"n={n:>8,} d={dim} k={k}: greedy {tg:7.2f} s WCSS {wg:.6g} | blocks(block_size={block_size}) "
          f"{tb:6.2f} s WCSS {wb:.6g} | WCSS ratio {wb / wg:.4f} ({100 * (wb / wg - 1):+.2f}%), speed-up {tg / tb:.1f}x",
          flush=True)


def big(n: int, *, k: int, dim: int, block_size: int) -> None:
    X, people = features(n // 2, dim=dim)
    t0 = time.perf_counter()
    blocks = plan_blocks(X, people, k=k, block_size=block_size)
    t1 = time.perf_counter()
    labels = blockwise_labels(X, people, k=k, block_size=block_size)  # plans again, then refines
    t2 = time.perf_counter()
    check(labels, people, k)
    sizes = [len(b) for b in blocks]
    print(f"n={n:>9,} d={dim} k={k} blockwise (block_size={block_size}, refinement {REFINE_SCHEDULE}): "
          f"{t2 - t1:.1f} s total (of which the first split {t1 - t0:.1f} s; {len(blocks)} blocks of "
          f"{min(sizes)}-{max(sizes)} faces) = {1000 * (t2 - t1) / n:.3f} s per 1,000 faces; "
          f"{int(labels.max()) + 1:,} clusters", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[20_000, 50_000])
    ap.add_argument("--dims", type=int, nargs="*", default=[48, 50])
    ap.add_argument("--big", type=int, nargs="*", default=[200_000])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=2000)
    a = ap.parse_args()
    for n in a.sizes:
        for d in a.dims:
            side_by_side(n, k=a.k, dim=d, block_size=a.block_size)
    for n in a.big:
        big(n, k=a.k, dim=50, block_size=a.block_size)


if __name__ == "__main__":
    main()
