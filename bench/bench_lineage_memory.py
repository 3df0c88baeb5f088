"""Memory of the lineage stage and of the lineage registration (issue 13), per stage, summed over processes.

Usage:
    # The whole run in this process (no Prefect), on a local Dask cluster like `deid run`; the lineage
    # stage's inputs are saved, and the release is registered even when the gate rejects it (into a
    # registry of its own under OUT/forced, so the run's registry is untouched):
    .venv/bin/python bench/bench_lineage_memory.py run --drop /tmp/m200k/drop --out /tmp/memlin/r200k --k 5

    # The lineage stage and the registration alone, on the saved inputs of a run (no other stage):
    .venv/bin/python bench/bench_lineage_memory.py lineage --out /tmp/memlin/r200k [--tracemalloc]

Prints, every 2 s to OUT/rss.log, the resident memory of this process, of its children (Dask workers
and nannies) and their sum, with the stage running; at the end the peak sum per stage, and the
release digest (order- and id-independent: a hash over the sorted (cluster content, labels) of
every released row), which must not change with a memory fix.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import sys
import threading
import time
from functools import partial
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path and "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(ROOT))   # a PYTHONPATH names the code to measure (e.g. an export of another commit)

STAGE = ["start"]
PEAKS: dict[str, float] = {}


def rss_gib() -> tuple[float, float]:
    me = psutil.Process()
    own = me.memory_info().rss
    kids = 0
    for c in me.children(recursive=True):
        try:
            kids += c.memory_info().rss
        except psutil.Error:
            pass
    return own / 2**30, kids / 2**30


def sampler(log_path: Path, stop: threading.Event, every: float = 2.0) -> None:
    with open(log_path, "a", encoding="utf-8") as fh:
        while not stop.is_set():
            own, kids = rss_gib()
            total = own + kids
            PEAKS[STAGE[0]] = max(PEAKS.get(STAGE[0], 0.0), total)
            fh.write(f"{time.strftime('%H:%M:%S')} stage={STAGE[0]} own_GiB={own:.3f} children_GiB={kids:.3f} "
                     f"total_GiB={total:.3f}\n")
            fh.flush()
            stop.wait(every)


def staged(name: str, fn):
    def run(*a, **kw):
        prev = STAGE[0]
        STAGE[0] = name
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*a, **kw)
        finally:
            own, kids = rss_gib()
            PEAKS[name] = max(PEAKS.get(name, 0.0), own + kids)
            logging.getLogger("bench").info("stage %s: %.1f s wall, %.1f s CPU (this process), RSS now %.2f GiB",
                                            name, time.perf_counter() - t0, time.process_time() - c0, own + kids)
            STAGE[0] = prev if ":" in name or name in ("register", "register-forced") else f"after-{name}"
    return run


def release_digest(staged_release: Path) -> str:
    """sha256 over the sorted (image content hash, labels, cluster's sorted row contents) of every row.

    Independent of row order, record ids and cluster ids; changes with any released pixel, label or
    grouping of rows into clusters.
    """
    import pyarrow.parquet as pq

    t = pq.read_table(staged_release / "release.parquet")
    cols = [c for c in t.column_names if c not in ("record_id", "image", "cluster_id", "file_name")]
    imgs = t.column("image").to_pylist()
    clusters = t.column("cluster_id").to_pylist()

    def content(x) -> str:
        if isinstance(x, (bytes, bytearray)):
            return hashlib.sha256(x).hexdigest()
        p = staged_release / str(x)
        return hashlib.sha256(p.read_bytes()).hexdigest()  # a PNG path: the PNG is written from pixels

    rows = []
    labs = [t.column(c).to_pylist() for c in cols]
    for n in range(t.num_rows):
        rows.append((content(imgs[n]), tuple(str(v[n]) for v in labs), clusters[n]))
    by_cluster: dict = {}
    for h, lab, c in rows:
        by_cluster.setdefault(c, []).append((h, lab))
    groups = sorted(tuple(sorted(v)) for v in by_cluster.values())
    return hashlib.sha256(repr((cols, groups)).encode()).hexdigest()


def cmd_run(args) -> None:
    from deid.operations import deidentify_lineage
    from deid.operations.runner import Steps, run_release
    from deid.orchestration.cluster import dask_executor
    from deid.run_config import RunConfig
    from deid.settings import Settings

    out = Path(args.out)
    saved = {}

    def apply_lineage(part, deid, aligned, layout, config, *, release_id, logger=None):
        with open(out / "lineage_inputs.pkl", "wb") as fh:
            pickle.dump(dict(part=part, deid=deid, aligned=aligned, layout=layout, config=config,
                             release_id=release_id), fh, protocol=5)
        lin = deidentify_lineage.apply_lineage(part, deid, aligned, layout, config, release_id=release_id, logger=logger)
        saved["lin"] = lin
        return lin

    names = ("ingest", "align", "featurize", "partition", "deidentify", "stage", "gate", "write_report",
             "register_lineage")
    steps = Steps(**{n: staged(n if n != "register_lineage" else "register", getattr(Steps, n)) for n in names},
                  apply_lineage=staged("lineage", apply_lineage))
    config = RunConfig.resolve(Settings(), k=args.k)
    result = run_release(args.drop, config, steps=steps, cluster=partial(dask_executor, drop=args.drop))
    logging.getLogger("bench").info("verdict %s (%s)", result.verdict,
                                    [c.name for c in result.report.checks if not c.passed])
    lin = saved.get("lin")
    digest = None
    rel_dir = Path(result.report.release_dir) if getattr(result.report, "release_dir", None) else None
    for cand in [rel_dir, config.releases_dir / result.release_id,
                 config.data_path / "staging" / result.release_id / "release"]:
        if cand is not None and (cand / "release.parquet").is_file():
            digest = release_digest(cand)
            break
    if lin is not None and result.verdict != "released":
        forced = dataclasses.replace(config, data_path=out / "forced")
        staged("register-forced", deidentify_lineage.register_lineage)(result.report.dataset.name, lin.state, forced,
                                                             lin.release)
    return digest, result


def substeps() -> None:
    """The lineage stage's steps as sub-stages of the RSS log (``lineage:<step>``)."""
    from deid.operations import deidentify_lineage, worker_lineage, worker_rows
    from deid.release import lineage, lineage_checks, lineage_differencing

    # distinct_rows as worker_lineage calls it (its own name for worker_rows.distinct_rows).
    for mod, name in [(worker_lineage, "lineage_new_labels"), (worker_lineage, "distinct_rows"),
                      (lineage, "build_release"), (worker_lineage, "write_lineage_part"),
                      (lineage_checks, "check_structure"), (lineage_checks, "differencing_attack"), (lineage_differencing, "structural_pairs"),
                      (lineage_differencing, "average_pairs"), (lineage_differencing, "eigenfaces"),
                      (deidentify_lineage, "lineage_checks")]:
        setattr(mod, name, staged(f"lineage:{name}", getattr(mod, name)))
    worker_rows.RowFile.from_aligned = classmethod(staged("lineage:RowFile.from_aligned",
                                                     worker_rows.RowFile.from_aligned.__func__))


def cmd_lineage(args) -> None:
    from deid.operations import deidentify_lineage

    substeps()
    out = Path(args.out)
    with open(out / "lineage_inputs.pkl", "rb") as fh:
        d = pickle.load(fh)
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start(10)
    lin = staged("lineage", deidentify_lineage.apply_lineage)(d["part"], d["deid"], d["aligned"], d["layout"], d["config"],
                                                   release_id=d["release_id"])
    if args.tracemalloc:
        snap = tracemalloc.take_snapshot()
        cur, peak = tracemalloc.get_traced_memory()
        logging.getLogger("bench").info("tracemalloc after lineage: current %.2f GiB, peak %.2f GiB",
                                        cur / 2**30, peak / 2**30)
        for s in snap.statistics("traceback")[:12]:
            logging.getLogger("bench").info("%.1f MiB %d blocks\n  %s", s.size / 2**20, s.count,
                                            "\n  ".join(s.traceback.format()[-8:]))
        tracemalloc.reset_peak()
    reg_root = out / f"forced-{int(time.time())}"
    forced = dataclasses.replace(d["config"], data_path=reg_root)
    dataset = d["part"].lineage.state.dataset
    state = staged("register", deidentify_lineage.register_lineage)(dataset, lin.state, forced, lin.release)
    if args.tracemalloc:
        cur, peak = tracemalloc.get_traced_memory()
        logging.getLogger("bench").info("tracemalloc register: peak %.2f GiB", peak / 2**30)
    if args.reload:
        STAGE[0] = "reload"
        state = staged("reload", deidentify_lineage.open_lineage)(dataset, forced)
        logging.getLogger("bench").info("reloaded: %d clusters", len(state.clusters))
    checks = {c.name: (c.passed, c.value) for c in lin.checks}
    logging.getLogger("bench").info("lineage checks %s; counts %s", checks, dict(lin.release.counts))
    return None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("run", "lineage"))
    ap.add_argument("--drop")
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--reload", action="store_true", help="lineage mode: load the registry again after registering")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    th = threading.Thread(target=sampler, args=(out / "rss.log", stop), daemon=True)
    th.start()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        digest, _ = (cmd_run if args.mode == "run" else cmd_lineage)(args)
    finally:
        stop.set()
        th.join()
    summary = {"mode": args.mode, "wall_s": round(time.perf_counter() - t0, 1),
               "cpu_s_this_process": round(time.process_time() - c0, 1),
               "peak_total_GiB_by_stage": {k: round(v, 3) for k, v in PEAKS.items()},
               "load_avg": os.getloadavg(), "release_digest": digest}
    print(json.dumps(summary, indent=1))
    (out / f"summary-{args.mode}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
