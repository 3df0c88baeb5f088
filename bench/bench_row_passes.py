"""The per-record passes issue 32 made cheaper, each against the definition it replaced (CPU, one process).

Usage:
    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_row_passes.py [--faces 20000] [--rows 100000]

Every pass below runs once per record of a release, several of them more than once (de-identify, the lineage,
the stage, the gate). For each: the CPU microseconds per record of the former code (reproduced here) and of
the current function, the best of ``--repeats`` runs, and whether the two give identical results:

* ``mean_abs_difference``: the near-copy distance (de-identify's repair, the gate's per-record pass);
* ``cluster_sums``: k-Same's per-cluster pixel sums (de-identify's averages), clusters of 5-9 faces;
* ``image_digest``: the key of a record's image (distinct_rows in the lineage and the stage, the gate);
* ``release_csv``: ``release.csv`` from a release table of ``--rows`` rows (per row, both CSVs are written).

Random 81 x 92 grey faces; the figures depend on the machine and its load (print ``uptime`` beside them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from deid.evaluation.leaks import mean_abs_difference
from deid.operations.worker_deidentify import _cluster_sums
from deid.release.hashing import image_digest
from deid.release.publish import _write_csv, _write_table_csv

P = 92 * 81


def best(fn, repeats: int) -> tuple[object, float]:
    """(result, best CPU seconds) of ``repeats`` calls."""
    out, t_best = None, float("inf")
    for _ in range(repeats):
        t = time.process_time()
        out = fn()
        t_best = min(t_best, time.process_time() - t)
    return out, t_best


def old_mean_abs_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty(len(a), dtype=np.float64)
    for s in range(0, len(a), 4096):
        out[s:s + 4096] = np.abs(a[s:s + 4096].astype(np.int16) - b[s:s + 4096].astype(np.int16)).mean(axis=1)
    return out


def row(name: str, n: int, old: tuple, new: tuple, same: bool) -> dict:
    return {"pass": name, "records": n, "before_us": round(1e6 * old[1] / n, 2), "after_us": round(1e6 * new[1] / n, 2),
            "identical": bool(same)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faces", type=int, default=20000)
    ap.add_argument("--rows", type=int, default=100000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (args.faces, P), dtype=np.uint8)
    b = rng.integers(0, 256, (args.faces, P), dtype=np.uint8)
    out = []
    old, new = best(lambda: old_mean_abs_difference(a, b), args.repeats), best(lambda: mean_abs_difference(a, b),
                                                                                  args.repeats)
    out.append(row("mean_abs_difference", args.faces, old, new, np.array_equal(old[0], new[0])))

    sizes = rng.integers(5, 10, 64)
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    chunk = a[:int(sizes.sum())]
    reps = max(1, args.repeats * 10)
    old = best(lambda: np.add.reduceat(chunk, starts, axis=0, dtype=np.uint32), reps)
    new = best(lambda: _cluster_sums(chunk, starts, starts + sizes), reps)
    out.append(row("cluster_sums", len(chunk), old, new, np.array_equal(old[0], new[0])))

    keys = a[:5000]
    old = best(lambda: [hashlib.blake2b(r, digest_size=16).digest() for r in keys], args.repeats)
    new = best(lambda: [image_digest(r) for r in keys], args.repeats)
    same = len(set(old[0])) == len(set(new[0])) == len(keys)  # keys: equal classes (all distinct here)
    out.append(row("image_digest", len(keys), old, new, same))

    n = args.rows
    ids = [f"{i:016x}" for i in range(n)]
    table = pa.table({"record_id": ids, "image": [f"images/{i}.png" for i in ids],
                      "cluster_id": [f"c-{i // 5:012x}" for i in range(n)],
                      "gender": rng.choice(["female", "male", "=x"], n).tolist(),
                      "expression": rng.choice(["smile", "neutral"], n).tolist()})
    names = table.schema.names
    d = Path(tempfile.mkdtemp())

    def rows():
        for batch in table.to_batches(max_chunksize=4096):
            yield from batch.to_pylist()

    old = best(lambda: _write_csv(d / "old.csv", names, rows()), args.repeats)
    new = best(lambda: _write_table_csv(d / "new.csv", table, names, names), args.repeats)
    out.append(row("release_csv", n, old, new, (d / "old.csv").read_bytes() == (d / "new.csv").read_bytes()))
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    for r in out:
        print(json.dumps(r))
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
