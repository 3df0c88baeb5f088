"""Benchmark the whole `deid run` on the London drop (or a synthetic one): per-stage seconds per image.

Usage:
    .venv/bin/python bench/bench_flow.py                       # London set, k=5 (--london PATH: another copy)
    .venv/bin/python bench/bench_flow.py --synthetic 2000      # synthetic drop of 2000 faces
    .venv/bin/python bench/bench_flow.py --london-records 20000  # London photos reused to make 20,000 records
    .venv/bin/python bench/bench_flow.py --synthetic 100000 --fast-synth  # issue 13's scale runs (10k, 100k, 1M)

Prints the wall time of the whole command (start-up included), each stage's seconds per image,
and the ratio of (ingest + align + featurize) to plain grey JPEG/PNG decoding of the same files
on one core (full resolution and OpenCV's reduced 1/4 decoding for JPEG). It also decodes every
file of the drop once on as many processes as the run's Dask workers (``DEID_DASK_WORKERS``,
default 2) and prints the whole run's wall time over that decode's wall time (issue 13: at most 3).
It prints the run's CPU seconds (all its processes) too, and their ratio to that decode's CPU: on a
shared machine the CPU figures do not depend on the other load, the wall ones do.

``--london-records N`` makes a drop of N records from the London photos: each record a copy of
one photo of its person (a unique trailing byte string after the JPEG's end marker, so no two
records have the same bytes), in the drop's temporary directory, never in the repository.

It also prints the run's CPU time (user + system of every process it started, Dask workers
included) and its peak resident memory summed over all its processes (sampled every 0.5 s),
both per 1,000 faces, so runs at 10k, 100k and 1M show whether cost grows linearly.
Synthetic drops are drawn on ``--synth-workers`` processes (default 2; ``--fast-synth`` for
the cheaper million-face images) and their generation is timed separately.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
from london_set import add_london_option, london_dir

ROOT = Path(__file__).resolve().parents[1]


def decode_cost(files: list[Path]) -> tuple[float, float]:
    """Seconds per image for plain grey decoding: full resolution, and reduced 1/4 where possible."""
    cv2.setNumThreads(1)
    blobs = [f.read_bytes() for f in files]
    t = time.perf_counter()
    for b in blobs:
        cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_GRAYSCALE)
    full = (time.perf_counter() - t) / len(blobs)
    t = time.perf_counter()
    for b in blobs:
        cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_REDUCED_GRAYSCALE_4)
    reduced = (time.perf_counter() - t) / len(blobs)
    return full, reduced


def _decode_one(path: str) -> int:
    img = cv2.imdecode(np.fromfile(path, np.uint8), cv2.IMREAD_GRAYSCALE)
    return 0 if img is None else int(img.shape[0])


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def parallel_decode_wall(files: list[Path], workers: int) -> tuple[float, float]:
    """(wall, CPU) seconds to read and grey-decode every file once on ``workers`` processes (one thread each).

    The CPU is that of the pool's processes, counted once they have exited (a warm-up decode each included).
    """
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

    cv2.setNumThreads(1)
    c0 = _cpu_children()
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_decode_one, [str(files[0])] * workers))  # start-up not counted
        t = time.perf_counter()
        list(pool.map(_decode_one, [str(f) for f in files], chunksize=64))
        wall = time.perf_counter() - t
    return wall, _cpu_children() - c0


def expand_london(drop: Path, records: int) -> None:
    """Rewrite an imported London drop to ``records`` records, cycling through its rows (see the module doc)."""
    import csv  # noqa: PLC0415

    with open(drop / "manifest.csv", newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        fields, rows = reader.fieldnames, list(reader)
    out = drop / "images_x"
    out.mkdir()
    new = []
    for i in range(records):
        row = dict(rows[i % len(rows)])
        src = drop / row["image"]
        dst = out / f"r{i:07d}{src.suffix}"
        dst.write_bytes(src.read_bytes() + b"deid-bench-copy-%d" % i)
        row["image"] = dst.relative_to(drop).as_posix()
        for col in ("points",):  # landmark files are per source photo; copies do not carry them
            if col in row:
                row[col] = ""
        new.append(row)
    with open(drop / "manifest.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(new)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class TreePeak:
    """Peak of the summed resident memory of a process and all its descendants, sampled on a thread."""

    def __init__(self, pid: int, interval: float = 0.5):
        import psutil  # noqa: PLC0415

        self._root, self._interval, self.peak, self.peak_procs = psutil.Process(pid), interval, 0, 0
        self.breakdown: list[tuple[str, int]] = []  # (process, rss) at the peak
        self.t0, self.peak_at = time.perf_counter(), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil  # noqa: PLC0415

        while not self._stop.is_set():
            try:
                procs = [self._root, *self._root.children(recursive=True)]
            except psutil.Error:
                return
            total, parts = 0, []
            for proc in procs:
                try:
                    rss = proc.memory_info().rss
                    parts.append((" ".join(proc.cmdline()[1:4])[:60], rss))
                    total += rss
                except psutil.Error:
                    pass
            if total > self.peak:
                self.peak, self.peak_procs, self.breakdown = total, len(procs), parts
                self.peak_at = time.perf_counter() - self.t0
            self._stop.wait(self._interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_measured(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float, float, TreePeak]:
    """Run ``cmd``; return it with its wall seconds, CPU seconds (all descendants) and memory peak."""
    cpu0, t = _children_cpu(), time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = TreePeak(proc.pid)
    out, err = proc.communicate()
    peak.stop()
    wall, cpu = time.perf_counter() - t, _children_cpu() - cpu0
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), wall, cpu, peak


def _named(doc, name: str):
    """Every dict in the report with ``"name": name`` (the gate's checks, wherever the report puts them)."""
    if isinstance(doc, dict):
        if doc.get("name") == name:
            yield doc
        for v in doc.values():
            yield from _named(v, name)
    elif isinstance(doc, list):
        for v in doc:
            yield from _named(v, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", type=int, default=0, help="faces in a synthetic drop instead of London")
    ap.add_argument("--london-records", type=int, default=0, help="records made from the London photos")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--synth-workers", type=int, default=2, help="processes drawing the synthetic drop")
    ap.add_argument("--fast-synth", action="store_true", help="deid synth --fast (million-face images)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (default: delete it)")
    ap.add_argument("--drop", default=None, help="an existing synthetic drop to run (with --synthetic N: no new one)")
    add_london_option(ap)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deid-bench-"))
    # This checkout's code (a worktree has no .venv of its own), on the interpreter running the bench.
    deid = [sys.executable, "-m", "deid.cli"]
    env = {**os.environ, "DEID_PROJECT_DIR": str(work), "PREFECT_HOME": str(work / "prefect"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    drop = work / "drop"
    if args.drop:
        drop = Path(args.drop)
    elif args.synthetic:
        people = max(args.synthetic // 2, 1)
        cmd = [*deid, "synth", str(drop), "--people", str(people), "--seed", "1", "--format", "jpg",
               "--workers", str(args.synth_workers), *(["--fast"] if args.fast_synth else [])]
        synth, s_wall, s_cpu, s_peak = run_measured(cmd, env)
        if synth.returncode:
            print(synth.stdout, synth.stderr[-4000:], sep="\n")
            return synth.returncode
        print(f"deid synth {2 * people} faces ({args.synth_workers} workers{', fast' if args.fast_synth else ''}): "
              f"{s_wall:.1f} s wall, {s_cpu:.1f} s CPU = {1000 * s_cpu / (2 * people):.2f} ms CPU per face, "
              f"peak RSS {s_peak.peak / 2**20:.0f} MiB", flush=True)
    else:
        london = london_dir(args.london)
        subprocess.run([*deid, "import", "london", str(london), str(drop)], check=True, env=env)
        if args.london_records:
            expand_london(drop, args.london_records)
    files = sorted(p for p in (drop / "images_x" if args.london_records else drop).rglob("*")
                   if p.suffix.lower() in (".jpg", ".png"))
    n = len(files)
    full, reduced = decode_cost(files[:500])
    workers = int(os.environ.get("DEID_DASK_WORKERS", "2"))
    decode_wall, decode_cpu = parallel_decode_wall(files, workers)

    run, wall, cpu, peak = run_measured([*deid, "run", str(drop), "--k", str(args.k)], env)
    report_line = [ln for ln in run.stdout.splitlines() if ln.startswith("report: ")]
    if not report_line:
        print(run.stdout, run.stderr[-4000:], sep="\n")
        return 1
    report = json.loads(Path(report_line[0].split(": ", 1)[1]).read_text())
    from deid.reporting.report import stage_usage_of  # both shapes of stage_seconds (issue 32)

    stages = {k: stage_usage_of(v) for k, v in report["configuration"]["stage_seconds"].items()}
    kind = "synthetic" if args.synthetic else f"London x{n // 204}" if args.london_records else "London"
    print(f"drop: {kind}, {n} images, k={args.k}, verdict {report['verdict']}")
    for check in _named(report, "lineage_differencing_attack"):  # people the lineage differencing attack found
        print(f"lineage differencing attack: {check.get('value')} people identified: {check.get('detail')}")
    print(f"deid run wall time (start-up included): {wall:.1f} s  ({wall / n * 1000:.1f} ms/image, "
          f"{wall / n * 1000:.1f} s per 1,000 faces)")
    print(f"deid run CPU time (user+sys, all its processes): {cpu:.1f} s  ({cpu / n * 1000:.1f} s per 1,000 faces)")
    print(f"plain grey decode, one core: full {full * 1000:.2f} ms/image, reduced 1/4 {reduced * 1000:.2f} ms/image")
    print(f"{'stage':<14}{'seconds':>10}{'ms/image':>12}{'CPU s':>10}{'peak MiB':>10}{'tree MiB':>10}")
    for stage, u in stages.items():
        print(f"{stage:<14}{u['wall']:>10.2f}{u['wall'] / n * 1000:>12.2f}"
              + "".join(f"{'-' if u[k] is None else format(u[k], '.1f'):>10}"
                        for k in ("cpu", "peak_rss_mib", "tree_peak_rss_mib")))
    core = sum(stages[s]["wall"] for s in ("ingest", "align", "featurize") if s in stages)
    print(f"(ingest + align + featurize) / full decode    = {core / n / full:.1f}")
    print(f"(ingest + align + featurize) / reduced decode = {core / n / reduced:.1f}")
    print(f"plain grey decode of all {n} files on {workers} processes: {decode_wall:.1f} s wall, {decode_cpu:.1f} s CPU")
    print(f"whole run wall / parallel decode wall           = {wall / decode_wall:.1f}  (issue 13: at most 3)")
    # The machine may be shared: CPU seconds do not depend on what else runs, wall seconds do.
    print(f"whole run CPU / decode CPU                      = {cpu / decode_cpu:.1f}")
    print(f"whole run: {wall / n * 1000:.2f} s wall and {cpu / n * 1000:.2f} s CPU per 1,000 faces "
          f"({cpu:.0f} s CPU, all processes)")
    print(f"peak RSS, all processes of the run summed (0.5 s samples): {peak.peak / 2**30:.2f} GiB "
          f"over {peak.peak_procs} processes at {peak.peak_at:.0f} s  (issue 13: at most 4 GiB at 1M)")
    for name, rss in sorted(peak.breakdown, key=lambda x: -x[1]):
        print(f"    {rss / 2**20:8.0f} MiB  {name}")
    if args.keep:
        print(f"work dir: {work}")
    else:
        import shutil  # noqa: PLC0415

        shutil.rmtree(work, ignore_errors=True)
    return 0 if run.returncode in (0, 1) else run.returncode


if __name__ == "__main__":
    sys.exit(main())
