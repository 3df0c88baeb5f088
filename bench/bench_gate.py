"""Gate cost at scale: seconds and peak RSS of the gate at 2,000 / 20,000 / 100,000 faces.

Usage: .venv/bin/python bench/bench_gate.py [--sizes 2000,20000,100000] [--k 5] [--attackers all|fast]

Each size runs in two child processes: one writes the synthetic staging, a fresh one runs the gate,
so the printed peak RSS (VmHWM) is the gate's alone (the writer's is printed beside it): smooth
random 81x92 faces, two per person, grouped into k-Same clusters of k distinct people, written in
the staging layout the flow uses (a Hive label partition + its de-identified part), then
``deid.operations.stages.gate_records`` (streamed) + ``deid.evaluation.gate.evaluate`` exactly as the gate task runs
them. The baseline measured in the same run is the align stage on a synthetic JPEG drop (the
manifest's eye points, one core): the gate's seconds are printed next to the projected time to
align the same number of faces on the flow's 2 workers.
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


def write_staging(work: Path, n_people: int, k: int, seed: int = 0) -> tuple[str, list[str]]:
    """Two faces per person; clusters of k distinct people (per image slot); staging layout on disk."""
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
            orig = pa.table({"record_id": ids, "subject_id": [f"p{start + i}" for i in range(m)],
                             "pixels": [f.tobytes() for f in faces]})
            rel = pa.table({"record_id": ids, "cluster": list(clusters), "pixels": [r.tobytes() for r in released]})
            pw = pw or pq.ParquetWriter(part_dir / "part-000-0.parquet", orig.schema)
            dw = dw or pq.ParquetWriter(deid_path, rel.schema)
            pw.write_table(orig)
            dw.write_table(rel)
    pw.close()
    dw.close()
    return str(work / "partitions"), [str(deid_path)]


def child(n_faces: int, k: int, attackers: str, work: str) -> None:
    """The gate alone, in a fresh process, on a staging another process wrote (so its peak is the gate's)."""
    from deid.evaluation.gate import GateConfig, GateInputs, evaluate
    from deid.anonymise.methods import method_runner
    from deid.operations.stages import gate_records

    root, parts = str(Path(work) / "partitions"), [str(Path(work) / "deidentified" / "partition=p000.parquet")]
    t0 = time.perf_counter()
    rec = gate_records(root, parts, labels=[])
    t_load = time.perf_counter() - t0
    load_peak = _peak_rss_mib()
    inputs = GateInputs(shape=SHAPE, people=rec.people, image_index=rec.image_index,
                        own_distance=rec.own_distance, fetch=rec.fetch, clusters=rec.clusters,
                        partitions=None, records_in=len(rec.people),
                        deidentify=method_runner("k-same", shape=SHAPE, k=k))
    names = None if attackers == "all" else ("pca-mahalanobis", "pca-whitened-cosine", "fisherfaces", "lbp-chi2",
                                             "release-refit-pca")
    config = GateConfig(k=k, method="k-same", attackers=names)
    t0 = time.perf_counter()
    result = evaluate(inputs, config)
    t_eval = time.perf_counter() - t0
    print(json.dumps({"faces": len(rec.people), "load_s": round(t_load, 2), "evaluate_s": round(t_eval, 2),
                      "peak_rss_mib": round(_peak_rss_mib(), 1), "load_peak_rss_mib": round(load_peak, 1),
                      "passed": result.passed, "max_rate": result.max_rate, "sample": result.attack_sample}))


def writer(n_faces: int, k: int, work: str) -> None:
    write_staging(Path(work), n_faces // 2, k)
    print(json.dumps({"staging_peak_rss_mib": round(_peak_rss_mib(), 1)}))


def align_ms_per_face(n: int = 1000) -> float:
    """The align stage on a synthetic JPEG drop (manifest eye points), one core: ms per face."""
    import pyarrow.parquet as pq

    from deid.intake.drop import read_drop
    from deid.intake.ingest import ingest
    from deid.settings import Settings
    from deid.operations.stages import align_batch
    from deid.intake.synth import make_synthetic_drop

    s = Settings()
    left, right = s.canonical_eyes()
    params = {"size": list(s.canonical_size), "eye_left": list(left), "eye_right": list(right),
              "max_upsample": s.max_upsample, "min_eye_distance": s.min_eye_distance_px}
    with tempfile.TemporaryDirectory() as tmp:
        drop = make_synthetic_drop(Path(tmp) / "drop", people=n // 2, images_per_person=2, seed=1)
        res = ingest(read_drop(drop), Path(tmp) / "ingested.parquet", batch_size=250)
        groups = list(range(pq.ParquetFile(res.path).num_row_groups))
        t0 = time.perf_counter()
        align_batch(str(res.path), groups, str(Path(tmp) / "aligned.parquet"), params)
        return 1000 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000,20000,100000")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--attackers", choices=("all", "fast"), default="all")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--writer", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.writer:
        writer(a.writer, a.k, a.work)
        return
    if a.child:
        child(a.child, a.k, a.attackers, a.work)
        return
    align_ms = align_ms_per_face()
    print(f"baseline: align stage {align_ms:.3f} ms/face on one core (synthetic JPEG, manifest eyes)")
    print(f"{'faces':>8} {'load s':>8} {'evaluate s':>10} {'gate s':>8} {'align s (2 workers)':>20} "
          f"{'gate/align':>10} {'peak RSS MiB':>12} {'after load':>10}")
    for n in (int(x) for x in a.sizes.split(",")):
        with tempfile.TemporaryDirectory() as work:
            w = json.loads(subprocess.run([sys.executable, __file__, "--writer", str(n), "--k", str(a.k), "--work", work],
                                          capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            out = subprocess.run([sys.executable, __file__, "--child", str(n), "--k", str(a.k), "--attackers",
                                  a.attackers, "--work", work], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        gate_s = r["load_s"] + r["evaluate_s"]
        align_s = align_ms * n / 1000 / 2
        print(f"{r['faces']:>8} {r['load_s']:>8.2f} {r['evaluate_s']:>10.2f} {gate_s:>8.2f} {align_s:>20.2f} "
              f"{gate_s / align_s:>10.2f} {r['peak_rss_mib']:>12.1f} {r['load_peak_rss_mib']:>10.1f}   "
              f"(writing the staging, another process: {w['staging_peak_rss_mib']:.0f} MiB; passed={r['passed']}, "
              f"attacked {r['sample']['records']} of {r['sample']['of']})")


if __name__ == "__main__":
    main()
