"""Time :meth:`deid.release.lineage.LineageRelease.republished_labels` on a re-release of returning clusters (issue 32).

Usage:
    PYTHONPATH=$PWD .venv/bin/python bench/bench_republished_labels.py 20000   # 20,000 clusters of 5 records

Every record of N registered clusters of 5 returns; prints the CPU seconds of giving every republished
cluster's rows their registered labels (the staging of returning records calls it once per release, and
once more for the counterfeits). A scan of every record per cluster made it quadratic (98.8 CPU-s at
20,000 clusters before issue 32); run with ``PYTHONPATH`` of an older checkout for its figure.
"""
from __future__ import annotations

import sys
import time
from types import SimpleNamespace as NS

from deid.release.lineage import LineageRelease


def main() -> int:
    n_clusters, per = int(sys.argv[1]) if len(sys.argv) > 1 else 20000, 5
    keys = [f"c{i}" for i in range(n_clusters)]
    fps = [f"f{i}" for i in range(n_clusters * per)]
    record_cluster = tuple(keys[i // per] for i in range(len(fps)))
    clusters = {k: NS(labels_for=lambda names, k=k: {f"f{int(k[1:]) * per + j}": ("a",) for j in range(per)})
                for k in keys}
    rel = NS(republished=[NS(key=k, n_released=per, n_counterfeit=0) for k in keys],
             record_cluster=record_cluster, fingerprints=fps)
    t = time.process_time()
    out = LineageRelease.republished_labels(rel, NS(clusters=clusters), ["x"])
    assert len(out) == n_clusters
    print(f"{n_clusters} republished clusters, {len(fps)} records: republished_labels "
          f"{time.process_time() - t:.2f} CPU-s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
