"""Memory of the de-identify stage's workers (issue 13), on partitions a partition stage already wrote.

Usage:
    # Partitions of a 200,000-face staging at three partition sizes (bench_partition_memory.py, ~30 s each):
    #   --labels gender expression: 4 x 50,000; --labels gender: 2 x 100,000; no labels: 1 x 200,000
    DEID_PROJECT_DIR=/tmp/x .venv/bin/python bench/bench_partition_memory.py --staging S --out /tmp/p4 \
        --labels gender expression --stop-after partition
    # One partition in a fresh process (no Dask; blocks grouped serially), its RSS sampled every 10 ms
    # with the deid function then running, so each step's growth is attributed:
    .venv/bin/python bench/bench_deidentify_memory.py direct /tmp/p4/staging/partitions --out OUT [--partition p000]
    # The stage as a run does it (deidentify_lineage.deidentify on a 2-worker LocalCluster), each worker's peak
    # RSS during the stage and its RSS after it:
    .venv/bin/python bench/bench_deidentify_memory.py dask /tmp/p4/staging/partitions --out OUT --labels gender expression
    # Proof of no change: released pixels per record and the clustering (cluster names are random,
    # so clusters are compared as sets of record ids) of two OUTs' de-identified parts:
    .venv/bin/python bench/bench_deidentify_memory.py compare OUT_A OUT_B

Prints JSON: peak and final RSS (MiB), the main-thread deid function at each new RSS high
(direct), CPU seconds, and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path and "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(ROOT))

MiB = 2 ** 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * PAGE / MiB


def _where(frame) -> str:
    """The innermost deid frame of a stack as ``function:line`` (and the deid functions around it)."""
    chain = []
    while frame is not None:
        code = frame.f_code
        if "/deid/" in code.co_filename and "/bench/" not in code.co_filename:
            chain.append(f"{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(chain[:3]) or "-"


def _calls(partitions: Path, labels: list[str], k: int) -> list[dict]:
    """The calls deidentify_lineage.deidentify makes for the partitions of ``partitions`` (its _index.json)."""
    from deid.run_config import RunConfig
    from deid.settings import Settings

    config = RunConfig.resolve(Settings(), k=k)
    index = json.loads((partitions / "_index.json").read_text())
    return [dict(partition_dir=str(partitions / Path(e["dir"]).name), k=config.k, method=config.method,
                 shape=config.shape_hw, sigma=config.sigma, block=config.block, labels=list(labels), color_dir=None,
                 block_size=config.ksame_block_size, near_copy_threshold=config.gate.leak_threshold,
                 records=e["records"]) for e in index]


def direct(args) -> dict:
    """One partition's deidentify_partition in this process, RSS sampled with the running deid function."""
    import gc

    import pyarrow as pa

    from deid.heap import release_free_memory
    from deid.operations import worker_deidentify

    calls = _calls(Path(args.partitions), args.labels, args.k)
    call = next(c for c in calls if Path(c["partition_dir"]).name == f"partition={args.partition}") \
        if args.partition else max(calls, key=lambda c: c["records"])
    records = call.pop("records")
    if args.threshold is not None:  # a higher near-copy threshold: the repair path (merges, suppression) runs
        call["near_copy_threshold"] = args.threshold
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    call["out_path"] = str(out / f"{Path(call['partition_dir']).name}.parquet")
    main = threading.main_thread().ident
    highs: list[tuple[float, str]] = []
    peak = [rss_mib()]
    stop = threading.Event()
    base = rss_mib()
    mark = [base]

    def sample() -> None:
        while not stop.is_set():
            r = rss_mib()
            if r > mark[0] + 4:  # a new high (4 MiB steps): where the main thread is
                mark[0] = r
                highs.append((round(r), _where(sys._current_frames().get(main))))
            peak[0] = max(peak[0], r)
            stop.wait(0.01)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    c0, t0 = time.process_time(), time.perf_counter()
    res = worker_deidentify.deidentify_partition(**call)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    stop.set()
    th.join()
    after = rss_mib()
    summary = {"clusters": len(res.clusters), "suppressed": len(res.suppressed),
               "near_copies": res.near_copies and res.near_copies.to_dict()}
    del res
    gc.collect()
    after_gc = rss_mib()
    release_free_memory()
    return {"partition": Path(call["partition_dir"]).name, "records": records,
            "rss_before_MiB": round(base), "peak_MiB": round(peak[0]), "growth_MiB": round(peak[0] - base),
            "after_MiB": round(after), "after_gc_MiB": round(after_gc), "after_trim_MiB": round(rss_mib()),
            "arrow_pool": pa.default_memory_pool().backend_name,
            "arrow_allocated_MiB": round(pa.total_allocated_bytes() / MiB, 1),
            "arrow_pool_max_MiB": round(pa.default_memory_pool().max_memory() / MiB, 1),
            "cpu_s": round(cpu, 1), "wall_s": round(wall, 1), **summary, "highs": highs}


def _worker_state() -> dict:
    """A worker's RSS after the stage, then after a garbage collection and releasing free memory, its threads."""
    import gc

    from deid.heap import release_free_memory

    import dask

    out = {"rss_MiB": round(rss_mib()), "threads": threading.active_count(),
           "message_log": dask.config.get("distributed.admin.low-level-log-length")}
    gc.collect()
    out["after_gc_MiB"] = round(rss_mib())
    release_free_memory()
    out["after_release_MiB"] = round(rss_mib())
    return out


def dask(args) -> dict:
    """deidentify_lineage.deidentify on a LocalCluster (2 workers), every child process's RSS sampled every 0.2 s."""
    import psutil

    from deid.contracts import Partitioned, PartitionInfo, StagingLayout
    from deid.operations import deidentify_lineage
    from deid.orchestration.cluster import dask_executor
    from deid.run_config import RunConfig
    from deid.settings import Settings

    src = Path(args.partitions)
    index = json.loads((src / "_index.json").read_text())
    parts = tuple(PartitionInfo(name=Path(e["dir"]).name.split("=")[1], key=tuple(e["key"]), dir=src / Path(e["dir"]).name,
                                records=e["records"], people=e["people"]) for e in index)
    out = Path(args.out)
    layout = StagingLayout(out / "staging")
    layout.root.mkdir(parents=True, exist_ok=True)
    config = RunConfig.resolve(Settings(), k=args.k)
    me = psutil.Process()
    phase = ["start"]
    peaks: dict[str, dict[int, float]] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for c in me.children(recursive=True):
                try:
                    r = c.memory_info().rss / MiB
                except psutil.Error:
                    continue
                d = peaks.setdefault(phase[0], {})
                d[c.pid] = max(d.get(c.pid, 0.0), r)
            d = peaks.setdefault(phase[0], {})
            d[0] = max(d.get(0, 0.0), me.memory_info().rss / MiB)  # pid 0: this process (scheduler, client)
            stop.wait(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    with dask_executor(config) as ex:
        from deid.operations.executors import warm_worker

        # The cluster started, the stages imported on its workers (as after the run's earlier stages).
        ex.map(warm_worker, [dict(recognizer=False)] * 2)
        time.sleep(1.0)
        phase[0] = "idle"
        time.sleep(1.0)
        phase[0] = "deidentify"
        if args.serial_blocks:  # each partition's blocks grouped inside its own task (no block tasks)
            deidentify_lineage.map_on_cluster = None
        c0, t0 = time.process_time(), time.perf_counter()
        d = deidentify_lineage.deidentify(Partitioned(root=src, partitions=parts), tuple(args.labels), layout, config, ex)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        phase[0] = "after"
        time.sleep(2.0)
        phase[0] = "end"
        diag = ex.client.run(_worker_state) if hasattr(ex, "client") else {}
        stop.set()
        th.join()
    workers = sorted(p for p in peaks.get("deidentify", {}) if p)
    return {"records": d.records, "partitions": [p.records for p in parts], "clusters": len(d.clusters),
            "run_process_cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
            "peak_MiB": {ph: {("run" if p == 0 else f"child{n}"): round(v) for n, (p, v) in enumerate(sorted(peaks[ph].items()))}
                         for ph in ("idle", "deidentify", "after") if ph in peaks},
            "workers": len(workers), "after_stage_workers": diag}


def compare(args) -> dict:
    """Same released pixels per record and the same clusters (as sets of records) in two benches' outputs."""
    import hashlib

    import pyarrow.parquet as pq

    def load(out: Path):
        parts = sorted(out.rglob("partition=*.parquet"))
        pixels, clusters, order = {}, {}, []
        for p in parts:
            t = pq.read_table(p)
            ids = t.column("record_id").to_pylist()
            order.append((p.name, hashlib.sha256("\n".join(ids).encode()).hexdigest()))
            for rid, c, px in zip(ids, t.column("cluster").to_pylist(), t.column("pixels").to_pylist()):
                pixels[rid] = hashlib.blake2b(px, digest_size=16).digest()
                clusters.setdefault((p.name, c), []).append(rid)
        return pixels, {frozenset(v) for v in clusters.values()}, order

    a, b = load(Path(args.a)), load(Path(args.b))
    return {"records": [len(a[0]), len(b[0])], "clusters": [len(a[1]), len(b[1])],
            "same_pixels": a[0] == b[0], "same_clusters": a[1] == b[1], "same_record_order": a[2] == b[2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("direct", "dask"):
        p = sub.add_parser(name)
        p.add_argument("partitions")
        p.add_argument("--out", required=True)
        p.add_argument("--labels", nargs="*", default=[])
        p.add_argument("--k", type=int, default=5)
        if name == "dask":
            p.add_argument("--serial-blocks", action="store_true", help="no block tasks (map_blocks=None)")
        if name == "direct":
            p.add_argument("--partition", help="the partition's key (p000...); default: the largest")
            p.add_argument("--threshold", type=float, help="near-copy threshold (default: the gate's)")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    args = ap.parse_args()
    res = {"direct": direct, "dask": dask, "compare": compare}[args.mode](args)
    res["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
