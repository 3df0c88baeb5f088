"""Benchmark a first release and a re-release of the same drop (every record returning), against plain decoding.

Usage (issue 32):
    .venv/bin/python bench/bench_rerelease.py --people 5000              # a 10k default synthetic drop
    .venv/bin/python bench/bench_rerelease.py --people 50000 --code /work/main --code .   # baseline, then this

For each checkout given with ``--code`` (default: this one), in a fresh project: ``deid run D --k 5``
(the first release) and the same command again (a re-release in which every record returns). It
prints each run's wall seconds, its stage seconds, the load average (``uptime``) when the run began,
and the ratio to decoding every file of the drop with ``cv2.imdecode`` on 2 processes, measured in
the same script before each pair of runs. With ``--seed`` (``DEID_SEED``: not secret, for
comparison only) two checkouts make the same release, and the script compares their release
digests (the sha256 of ``MANIFEST.sha256``); it always checks that the re-release's images are the
first release's, bit for bit (the multiset of image sha256s in the two manifests).

The drop is ``deid synth D --people N --images-per-person 2 --seed 9`` (default images, not ``--fast``)
unless ``--drop`` names an existing one. Work directories are deleted unless ``--keep``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flow import parallel_decode_wall  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load() -> str:
    """The 1/5/15-minute load averages (what ``uptime`` prints)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(code: Path, project: Path, args: list[str], env0: dict) -> tuple[subprocess.CompletedProcess, float]:
    env = {**env0, "DEID_PROJECT_DIR": str(project), "PREFECT_HOME": str(project / "prefect"),
           "PYTHONPATH": str(code)}
    t = time.perf_counter()
    # cwd=code: ``python -m`` puts the working directory first on the path, before PYTHONPATH.
    proc = subprocess.run([sys.executable, "-m", "deid.cli", *args], env=env, capture_output=True, text=True,
                          cwd=code)
    return proc, time.perf_counter() - t


def git_head(code: Path) -> str:
    """The checkout's commit (``-`` when it is not a git checkout)."""
    got = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return got.stdout.strip() or "-"


def printed(proc: subprocess.CompletedProcess, prefix: str) -> str | None:
    """The value of the run's output line ``prefix: value`` (None: no such line)."""
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith(prefix + ": ")]
    return line[0].split(": ", 1)[1].strip() if line else None


def report_of(proc: subprocess.CompletedProcess) -> dict:
    path = printed(proc, "signed report")
    if not path:
        raise SystemExit(f"no report:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    return json.loads(Path(path).read_text())


def stage_wall(v) -> float:
    return float(v["wall"]) if isinstance(v, dict) else float(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--people", type=int, default=5000)
    ap.add_argument("--drop", default=None, help="an existing drop (default: a new synthetic one)")
    ap.add_argument("--code", action="append", default=None, help="checkout to run (repeat: each in turn)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--seed", default=None, help="DEID_SEED for both checkouts (then release digests compare)")
    ap.add_argument("--workers", type=int, default=2, help="processes of the plain decode (as the run's workers)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    codes = [Path(c).resolve() for c in (args.code or [str(ROOT)])]
    work = Path(tempfile.mkdtemp(prefix="deid-rerelease-"))
    env0 = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **({"DEID_SEED": args.seed} if args.seed else {})}
    try:
        drop = Path(args.drop) if args.drop else work / "drop"
        if not args.drop:
            t = time.perf_counter()
            proc, _ = run(codes[0], work / "synth", ["synth", str(drop), "--people", str(args.people),
                                                      "--images-per-person", "2", "--seed", "9", "--workers", "2"],
                          env0)
            if proc.returncode:
                print(proc.stdout, proc.stderr[-4000:])
                return 1
            print(f"synth {args.people} people: {time.perf_counter() - t:.0f} s", flush=True)
        files = sorted(p for p in drop.rglob("*") if p.suffix.lower() in (".jpg", ".png", ".gif"))
        digests = {}
        for code in codes:
            project = work / f"project-{len(digests)}"
            dec, _ = parallel_decode_wall(files, args.workers)
            print(f"== {code} (git {git_head(code)}): plain decode of {len(files)} files on {args.workers} processes {dec:.1f} s "
                  f"(load {load()})", flush=True)
            manifests = []
            for what in ("first release", "re-release"):
                at = load()
                proc, wall = run(code, project, ["run", str(drop), "--k", str(args.k)], env0)
                rep = report_of(proc)
                stages = {k: stage_wall(v) for k, v in rep["configuration"]["stage_seconds"].items()}
                rel = printed(proc, "release")
                manifests.append(Path(rel) / "MANIFEST.sha256" if rel else None)
                print(f"{what}: verdict {rep['verdict']}, wall {wall:.1f} s = {wall / dec:.2f}x decode, load at start "
                      f"{at}; stages " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()), flush=True)
                for line in proc.stdout.splitlines() + proc.stderr.splitlines():
                    if "differencing attack" in line or "lineage-release" in line:
                        print("   ", line.strip()[-200:])
            if all(manifests):
                first, again = (Counter(ln.split()[0] for ln in m.read_text().splitlines() if ln.strip())
                                for m in manifests)
                print(f"re-release images bit-identical to the first release's: {first == again} "
                      f"({sum(again.values())} images)")
                digests[code] = [hashlib.sha256("\n".join(sorted(ln.split()[0] for ln in m.read_text().splitlines() if ln.strip())).encode()).hexdigest()[:16] for m in manifests]
                print(f"release digests (sha256 of the sorted image sha256s in MANIFEST.sha256): {digests[code]}")
        if args.seed and len(digests) > 1:
            print(f"release digests equal across checkouts: {len({tuple(v) for v in digests.values()}) == 1}")
    finally:
        if args.keep:
            print(f"work dir: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
