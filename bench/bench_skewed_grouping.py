"""k-Same grouping on skewed photos-per-person: clusters formed vs the feasible maximum, and time.

Real drops hold 2 to 50 photos per person (issue 26). For each size in ``--sizes`` this draws
people with Zipf-distributed photo counts (exponent ``--zipf``, capped at ``--cap``) and, as the
baseline measured in the same run, the same number of faces at 2 photos per person; features are
the PCA-like Gaussian mixture of ``bench_grouping.py``. It prints, per size and shape: seconds,
faces per second, clusters formed, the feasible maximum ``floor(n / k)``
(:func:`deid.anonymise.ksame.feasible_clusters`), their ratio, the time ratio skewed / balanced, and
checks every cluster (>= k distinct people, no person above 1/k).

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/bench_skewed_grouping.py
    OPENBLAS_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/bench_skewed_grouping.py --sizes 10000 100000 1000000
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench_grouping import check
from deid.anonymise.ksame import KSame, feasible_clusters


def skewed_counts(n: int, *, zipf: float, cap: int, seed: int) -> np.ndarray:
    """Photo counts per person summing to ``n``: Zipf(zipf) capped at ``cap`` (>= 1 each)."""
    rng = np.random.default_rng(seed)
    counts = np.minimum(rng.zipf(zipf, size=n), cap)
    cut = int(np.searchsorted(np.cumsum(counts), n))
    counts = counts[:cut + 1].copy()
    counts[-1] -= int(counts.sum()) - n
    return counts[counts > 0]


def features(counts: np.ndarray, *, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    scales = 1.0 / np.sqrt(np.arange(1, dim + 1))
    centres = rng.normal(size=(40, dim)) * 3 * scales
    person = centres[rng.integers(0, 40, size=len(counts))] + rng.normal(size=(len(counts), dim)) * scales
    people = np.repeat(np.arange(len(counts)), counts)
    X = (person[people] + rng.normal(size=(len(people), dim)) * 0.5 * scales).astype(np.float32)
    return X, people


def run(counts: np.ndarray, *, k: int, dim: int, block_size: int, seed: int) -> tuple[float, int, int]:
    X, people = features(counts, dim=dim, seed=seed)
    t0 = time.perf_counter()
    labels, _ = KSame(k, block_size=block_size)._labels(X, people, partition=None)
    dt = time.perf_counter() - t0
    check(labels, people, k)
    return dt, int(labels.max()) + 1, feasible_clusters(counts, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--dim", type=int, default=50)
    ap.add_argument("--block-size", type=int, default=2000)
    ap.add_argument("--zipf", type=float, default=1.8)
    ap.add_argument("--cap", type=int, default=50)
    a = ap.parse_args()
    print(f"{'faces':>9} {'shape':>9} {'people':>8} {'max/person':>10} {'s':>8} {'faces/s':>9} "
          f"{'clusters':>9} {'feasible':>9} {'ratio':>6} {'time vs 2/person':>16}")
    for n in a.sizes:
        balanced = np.full(n // 2, 2)
        skewed = skewed_counts(n, zipf=a.zipf, cap=a.cap, seed=n)
        base = None
        for shape, counts in (("2/person", balanced), ("zipf", skewed)):
            dt, got, best = run(counts, k=a.k, dim=a.dim, block_size=a.block_size, seed=1)
            base = dt if base is None else base
            print(f"{int(counts.sum()):>9} {shape:>9} {len(counts):>8} {int(counts.max()):>10} {dt:>8.2f} "
                  f"{counts.sum() / dt:>9.0f} {got:>9} {best:>9} {got / best:>6.3f} {dt / base:>16.2f}")


if __name__ == "__main__":
    main()
