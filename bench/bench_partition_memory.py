"""Memory of the partition and de-identify stages (issue 13), per process, from a finished run's staging.

Usage:
    # Once: ingest, align and featurize a drop into STAGING (on a local Dask cluster; 200,000 faces ~4 min):
    DEID_PROJECT_DIR=/tmp/x .venv/bin/python bench/bench_partition_memory.py --prepare /tmp/m200k/drop \
        --staging /tmp/memrun/s200k --out /tmp/memrun/prep
    # Reads STAGING's ingested.parquet, aligned/ and features/ (or a bench_lineage_memory.py run's
    # data/staging/rel-*), writes partitions and de-identified parts under OUT, on a local Dask cluster:
    DEID_PROJECT_DIR=/tmp/x .venv/bin/python bench/bench_partition_memory.py --staging STAGING --out OUT \
        --labels gender expression [--k 5] [--stop-after partition] [--sizes] [--trim]

Prints, every second to OUT/rss.log, the resident memory of this process and of each child process
(Dask workers); at the end the peak per stage of this process, of the largest child and of the sum,
this process's CPU seconds per stage, the Arrow pool's allocated bytes after each stage and, with
``--sizes``, the deep size of what the partition stage's result holds (``Partitioned``). ``--trim``
also prints this process's RSS after ``malloc_trim(0)`` (memory glibc holds free).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path and "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(ROOT))

STAGE = ["start"]
PEAKS: dict[str, dict[str, float]] = {}
MiB = 2 ** 20


def sample(fh) -> None:
    me = psutil.Process()
    own = me.memory_info().rss / MiB
    kids = {}
    for c in me.children(recursive=True):
        try:
            kids[c.pid] = c.memory_info().rss / MiB
        except psutil.Error:
            pass
    p = PEAKS.setdefault(STAGE[0], {"own": 0.0, "child": 0.0, "total": 0.0})
    p["own"] = max(p["own"], own)
    p["child"] = max(p["child"], max(kids.values(), default=0.0))
    p["total"] = max(p["total"], own + sum(kids.values()))
    fh.write(f"{time.strftime('%H:%M:%S')} stage={STAGE[0]} own={own:.0f} "
             + " ".join(f"{pid}:{v:.0f}" for pid, v in sorted(kids.items())) + f" total={own + sum(kids.values()):.0f}\n")
    fh.flush()


def sampler(path: Path, stop: threading.Event) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        while not stop.is_set():
            sample(fh)
            stop.wait(1.0)


def deep_size(obj, seen: set | None = None) -> int:
    """Bytes of ``obj`` and what it references (containers, dataclasses, numpy and Arrow buffers), once each."""
    import dataclasses

    import numpy as np
    import pyarrow as pa

    seen = set() if seen is None else seen
    todo, total = [obj], 0
    while todo:
        o = todo.pop()
        if id(o) in seen or o is None or isinstance(o, (type, Path)):
            continue
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            total += o.nbytes + sys.getsizeof(np.empty(0))
            if o.dtype == object:
                todo.extend(o.ravel().tolist())
            continue
        if isinstance(o, (pa.Array, pa.ChunkedArray, pa.Table)):
            total += o.nbytes
            continue
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            todo.extend(o.keys())
            todo.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo.extend(o)
        elif dataclasses.is_dataclass(o):
            todo.extend(getattr(o, f.name) for f in dataclasses.fields(o))
        elif hasattr(o, "__dict__") and not callable(o):
            todo.append(vars(o))
    return total


def prepare(drop: str, staging: Path, k: int) -> None:
    """The stages before partition, into ``staging`` (what the measurement reads)."""
    from deid.contracts import StagingLayout
    from deid.operations import featurize_partition, ingest_align
    from deid.orchestration.cluster import dask_executor
    from deid.run_config import RunConfig
    from deid.settings import Settings

    layout = StagingLayout(staging)
    staging.mkdir(parents=True, exist_ok=True)
    config = RunConfig.resolve(Settings(), k=k)
    with dask_executor(config, drop=drop) as executor:
        ingested = ingest_align.ingest_drop(drop, layout, config, executor=executor)
        aligned = ingest_align.align(ingested, layout, config, executor)
        featurize_partition.featurize(aligned, layout, config, executor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--staging", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--labels", nargs="*", default=[])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--stop-after", choices=("partition", "deidentify"), default="deidentify")
    ap.add_argument("--sizes", action="store_true")
    ap.add_argument("--trim", action="store_true")
    ap.add_argument("--prepare", metavar="DROP", help="ingest, align and featurize DROP into --staging, then stop")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.prepare:
        prepare(args.prepare, Path(args.staging), args.k)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    from deid.contracts import Aligned, Featurized, StagingLayout
    from deid.operations import deidentify_lineage, featurize_partition
    from deid.orchestration.cluster import dask_executor
    from deid.run_config import RunConfig
    from deid.settings import Settings

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = StagingLayout(Path(args.staging))
    layout = StagingLayout(out / "staging")
    layout.root.mkdir(parents=True, exist_ok=True)
    config = RunConfig.resolve(Settings(), k=args.k)
    names = pq.read_schema(src.ingested).names
    ingested = SimpleNamespace(metadata=pq.read_table(src.ingested, columns=[c for c in names if c != "data"]),
                               labels=tuple(args.labels), dataset="drop")
    parts = tuple(sorted(src.aligned_dir.glob("part-*.parquet")))
    aligned = Aligned(parts=parts)
    feats = Featurized(parts=tuple(src.feature_part(p) for p in parts), n_components=config.pca_components)
    stop = threading.Event()
    th = threading.Thread(target=sampler, args=(out / "rss.log", stop), daemon=True)
    th.start()
    report: dict = {"cpu_s": {}, "arrow_allocated_MiB": {}}
    log = logging.getLogger("bench")

    def stage(name, fn, *a, **kw):
        STAGE[0] = name
        c0, t0 = time.process_time(), time.perf_counter()
        res = fn(*a, **kw)
        report["cpu_s"][name] = round(time.process_time() - c0, 1)
        report.setdefault("wall_s", {})[name] = round(time.perf_counter() - t0, 1)
        report["arrow_allocated_MiB"][name] = round(pa.total_allocated_bytes() / MiB, 1)
        STAGE[0] = f"after-{name}"
        return res

    try:
        with dask_executor(config) as executor:
            state = deidentify_lineage.open_lineage("drop", config) if config.lineage_applies else None
            report["rss_before_partition_MiB"] = round(psutil.Process().memory_info().rss / MiB)
            part = stage("partition", featurize_partition.partition, ingested, aligned, feats, layout, config, executor,
                         lineage_state=state)
            time.sleep(1.5)
            report["rss_after_partition_MiB"] = round(psutil.Process().memory_info().rss / MiB)
            if args.sizes:
                report["partitioned_deep_MiB"] = round(deep_size(part) / MiB, 1)
                if part.lineage is not None:
                    report["lineage_plan_fields_MiB"] = {
                        f: round(deep_size(getattr(part.lineage.plan, f)) / MiB, 1)
                        for f in ("pseudonyms", "fingerprints", "partitions", "record_labels", "new_records",
                                  "suppressed", "republish")}
                    report["lineage_record_ids_MiB"] = round(deep_size(part.lineage.record_ids) / MiB, 1)
                report["metadata_MiB"] = round(ingested.metadata.nbytes / MiB, 1)
            if args.trim:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                report["rss_after_partition_trimmed_MiB"] = round(psutil.Process().memory_info().rss / MiB)
            if args.stop_after == "deidentify":
                deid = stage("deidentify", deidentify_lineage.deidentify, part, ingested.labels, layout, config, executor)
                report["records"] = deid.records
                report["clusters"] = len(deid.clusters)
    finally:
        stop.set()
        th.join()
    report["peaks_MiB"] = {k: {a: round(b) for a, b in v.items()} for k, v in PEAKS.items()}
    report["load_avg"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    (out / "summary.json").write_text(json.dumps(report, indent=1))
    log.info("done")


if __name__ == "__main__":
    main()
