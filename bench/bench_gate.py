"""Gate cost at scale: seconds and peak RSS of the gate at 2,000 / 20,000 / 100,000 faces.

Usage: .venv/bin/python bench/bench_gate.py [--sizes 2000,20000,100000] [--k 5] [--attackers all|fast]
[--align-max 20000]

Each size runs in two child processes: one writes the synthetic staging, a fresh one runs the gate,
so the printed peak RSS (VmHWM) is the gate's alone (the writer's is printed beside it): smooth
random 81x92 faces, two per person, grouped into k-Same clusters of k distinct people, written in
the staging layout the flow uses (a Hive label partition + its de-identified part), then
``deid.operations.worker_gate.gate_records`` (streamed) + ``deid.evaluation.gate.evaluate`` exactly as the gate task runs
them. Printed per size: the gate's wall seconds, CPU seconds (user + sys) and peak RSS, and the
align stage's CPU on the same number of faces (a synthetic JPEG drop, the manifest's eye points,
one core; measured at that size up to ``--align-max``, else 1,000 faces' CPU per face x faces),
its wall on the flow's 2 workers (CPU / 2) and the ratios (issue 9: the gate at 100,000 faces
takes less time than aligning them and stays under 2 GiB).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPE = (92, 81)


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu() -> float:
    """User + sys seconds of this process (its threads included)."""
    import resource  # noqa: PLC0415

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def write_staging(work: Path, n_people: int, k: int, seed: int = 0, labels: bool = False) -> tuple[str, list[str]]:
    """Two faces per person; clusters of k distinct people (per image slot); staging layout on disk.

    ``labels``: the originals also carry a per-person ``gender`` label (the gate's utility parts run).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    h, w = SHAPE
    part_dir = work / "partitions" / "partition=p000"
    part_dir.mkdir(parents=True)
    deid_path = work / "deidentified" / "partition=p000.parquet"
    deid_path.parent.mkdir(parents=True)
    pw = dw = None
    chunk = 2000  # people per chunk: memory stays flat as N grows
    for start in range(0, n_people, chunk):
        m = min(chunk, n_people - start)
        m -= m % k
        if m == 0:
            break
        base = rng.normal(128, 40, (m, h // 4 + 1, w // 4 + 1)).astype(np.float32)
        ident = np.repeat(np.repeat(base, 4, axis=1), 4, axis=2)[:, :h, :w].reshape(m, -1)
        for slot in range(2):
            faces = np.clip(ident + rng.normal(0, 8, ident.shape), 0, 255).astype(np.uint8)
            order = rng.permutation(m)
            clusters = np.empty(m, dtype=object)
            released = np.empty_like(faces)
            for c in range(m // k):
                members = order[c * k:(c + 1) * k]
                clusters[members] = f"c{start}-{slot}-{c}"
                released[members] = np.rint(faces[members].mean(axis=0)).astype(np.uint8)
            ids = [f"r{start + i:07d}-{slot}" for i in range(m)]
            cols = {"record_id": ids, "subject_id": [f"p{start + i}" for i in range(m)],
                    "pixels": [f.tobytes() for f in faces]}
            if labels:
                cols["gender"] = ["f" if (start + i) % 2 else "m" for i in range(m)]
            orig = pa.table(cols)
            rel = pa.table({"record_id": ids, "cluster": list(clusters), "pixels": [r.tobytes() for r in released]})
            pw = pw or pq.ParquetWriter(part_dir / "part-000-0.parquet", orig.schema)
            dw = dw or pq.ParquetWriter(deid_path, rel.schema)
            pw.write_table(orig)
            dw.write_table(rel)
    pw.close()
    dw.close()
    return str(work / "partitions"), [str(deid_path)]


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the gate's helper)."""
    import resource  # noqa: PLC0415

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class _ChildPeak:
    """Largest VmHWM of this process's children, polled every 0.2 s (ru_maxrss of a spawned child
    starts from the parent's RSS at fork, so it cannot tell the helper's own peak)."""

    def __init__(self) -> None:
        import threading  # noqa: PLC0415

        self.peak = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for kids in Path("/proc/self/task").glob("*/children"):
                for pid in kids.read_text().split():
                    try:
                        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                            if line.startswith("VmHWM:"):
                                self.peak = max(self.peak, int(line.split()[1]) / 1024)
                    except OSError:
                        pass


def child(n_faces: int, k: int, attackers: str, work: str, labels: bool = False, helper: bool = True) -> None:
    """The gate alone, in a fresh process, on a staging another process wrote (so its peak is the gate's)."""
    from deid.evaluation.gate_types import GateConfig, GateInputs
    from deid.evaluation.gate import evaluate
    from deid.anonymise.methods import method_runner
    from deid.operations.worker_gate import gate_records

    root, parts = str(Path(work) / "partitions"), [str(Path(work) / "deidentified" / "partition=p000.parquet")]
    t0, c0 = time.perf_counter(), _cpu()
    rec = gate_records(root, parts, labels=["gender"] if labels else [])
    t_load, c_load = time.perf_counter() - t0, _cpu() - c0
    load_peak = _peak_rss_mib()
    inputs = GateInputs(shape=SHAPE, people=rec.people, image_index=rec.image_index,
                        own_distance=rec.own_distance, fetch=rec.fetch, clusters=rec.clusters,
                        partitions=None, labels=rec.labels, records_in=len(rec.people),
                        deidentify=method_runner("k-same", shape=SHAPE, k=k))
    names = None if attackers == "all" else ("pca-mahalanobis", "pca-whitened-cosine", "fisherfaces", "lbp-chi2",
                                             "release-refit-pca")
    config = GateConfig(k=k, method="k-same", attackers=names, labels=("gender",) if labels else (),
                        **({} if helper else {"helper_min_records": 0}))
    kids = _ChildPeak()
    t0, c0 = time.perf_counter(), _cpu()
    result = evaluate(inputs, config)
    t_eval, c_eval = time.perf_counter() - t0, _cpu() - c0
    helper_cpu, helper_peak = _children_cpu(), kids.peak
    print(json.dumps({"faces": len(rec.people), "load_s": round(t_load, 2), "evaluate_s": round(t_eval, 2),
                      "cpu_s": round(c_load + c_eval + helper_cpu, 2), "helper_cpu_s": round(helper_cpu, 2),
                      "helper_peak_rss_mib": round(helper_peak, 1), "loadavg": os.getloadavg()[0],
                      "peak_rss_mib": round(_peak_rss_mib(), 1), "load_peak_rss_mib": round(load_peak, 1),
                      "passed": result.passed, "max_rate": result.max_rate, "sample": result.attack_sample}))


def writer(n_faces: int, k: int, work: str, labels: bool = False) -> None:
    write_staging(Path(work), n_faces // 2, k, labels=labels)
    print(json.dumps({"staging_peak_rss_mib": round(_peak_rss_mib(), 1)}))


def align_cost(n: int = 1000) -> tuple[float, float]:
    """The align stage on a synthetic JPEG drop of ``n`` faces (manifest eye points), one core: (wall, CPU) ms per face."""
    import pyarrow.parquet as pq

    from deid.intake.drop import read_drop
    from deid.intake.ingest import ingest
    from deid.settings import Settings
    from deid.operations.worker_align import align_batch
    from deid.intake.synth import make_synthetic_drop

    s = Settings()
    left, right = s.canonical_eyes()
    params = {"size": list(s.canonical_size), "eye_left": list(left), "eye_right": list(right),
              "max_upsample": s.max_upsample, "min_eye_distance": s.min_eye_distance_px}
    with tempfile.TemporaryDirectory() as tmp:
        drop = make_synthetic_drop(Path(tmp) / "drop", people=n // 2, images_per_person=2, seed=1)
        res = ingest(read_drop(drop), Path(tmp) / "ingested.parquet", batch_size=250)
        groups = list(range(pq.ParquetFile(res.path).num_row_groups))
        t0, c0 = time.perf_counter(), _cpu()
        align_batch(str(res.path), groups, str(Path(tmp) / "aligned.parquet"), params)
        return 1000 * (time.perf_counter() - t0) / n, 1000 * (_cpu() - c0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000,20000,100000")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--attackers", choices=("all", "fast"), default="all")
    ap.add_argument("--no-align", action="store_true", help="time the gate only (no align measurement)")
    ap.add_argument("--labels", action="store_true", help="a per-person 'gender' label: the utility parts run")
    ap.add_argument("--no-helper", action="store_true", help="the gate without its helper process (serial)")
    ap.add_argument("--align-max", type=int, default=20000,
                    help="measure align on that many faces up to this size (above: the 1,000-face baseline per face)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--writer", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.writer:
        writer(a.writer, a.k, a.work, labels=a.labels)
        return
    if a.child:
        child(a.child, a.k, a.attackers, a.work, labels=a.labels, helper=not a.no_helper)
        return
    align_ms, align_cpu_ms = (float("nan"), float("nan")) if a.no_align else align_cost()
    print(f"baseline: align stage {align_ms:.3f} ms/face wall, {align_cpu_ms:.3f} ms/face CPU on one core "
          f"(1,000 synthetic JPEG faces, manifest eyes); load average {os.getloadavg()[0]:.1f}")
    print("align at a size <= --align-max is measured on that many faces, one core; above it, the baseline's CPU "
          "per face x faces. 'align 2 workers' = align CPU / 2 (the flow's 2 workers, perfectly shared).")
    print(f"{'faces':>8} {'gate s':>8} {'gate CPU s':>10} {'peak RSS MiB':>12} {'align CPU s':>11} "
          f"{'align 2 workers s':>17} {'gate/align':>10} {'gate CPU/align CPU':>18}  details")
    for n in (int(x) for x in a.sizes.split(",")):
        with tempfile.TemporaryDirectory() as work:
            flags = [*(["--labels"] if a.labels else []), *(["--no-helper"] if a.no_helper else [])]
            w = json.loads(subprocess.run([sys.executable, __file__, "--writer", str(n), "--k", str(a.k), "--work", work,
                                           *flags],
                                          capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            out = subprocess.run([sys.executable, __file__, "--child", str(n), "--k", str(a.k), "--attackers",
                                  a.attackers, "--work", work, *flags], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        gate_s = r["load_s"] + r["evaluate_s"]
        if a.no_align:
            per_face_cpu, how = float("nan"), "not measured"
        elif n <= a.align_max:
            _, per_face_cpu = align_cost(n)
            how = "measured"
        else:
            per_face_cpu, how = align_cpu_ms, "baseline x faces"
        align_cpu = per_face_cpu * n / 1000
        align_s = align_cpu / 2
        print(f"{r['faces']:>8} {gate_s:>8.2f} {r['cpu_s']:>10.2f} {r['peak_rss_mib']:>12.1f} {align_cpu:>11.2f} "
              f"{align_s:>17.2f} {gate_s / align_s:>10.2f} {r['cpu_s'] / align_cpu:>18.2f}  "
              f"(load {r['load_s']:.2f} s + evaluate {r['evaluate_s']:.2f} s; align {how}; RSS after load "
              f"{r['load_peak_rss_mib']:.0f} MiB; writing the staging, another process: "
              f"{w['staging_peak_rss_mib']:.0f} MiB; gate helper process: {r['helper_cpu_s']:.2f} CPU s (in the gate "
              f"CPU), peak {r['helper_peak_rss_mib']:.0f} MiB; passed={r['passed']}, attacked {r['sample']['records']} of "
              f"{r['sample']['of']}; load average {r['loadavg']:.1f})", flush=True)


if __name__ == "__main__":
    main()
