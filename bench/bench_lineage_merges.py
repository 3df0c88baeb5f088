"""Issue 27 item 3 on the London set: a merge that holds in one configuration and not the next.

Usage: .venv/bin/python bench/bench_lineage_merges.py [--london PATH] [--out DIR] [--k 5]

Imports London under ``--out`` (never inside the repo) and adds person 001's smiling photograph,
mirrored, under a new subject id ``x-001``: the face recogniser (default settings) merges it with
001, and with ``DEID_IDENTITY_EMBED_MAX=0`` (no recogniser) nothing does. Three ``deid run``s of the
one dataset: default (merge), ``DEID_IDENTITY_EMBED_MAX=0`` (un-merge), default (merge again). Prints
each run's exit code, face merges and the report's ``lineage.merges``. Before the overlay the second
run stopped with exit 70 ("a record ... is now listed under another subject id"); now every run is a
verdict (exit 0 or 1).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import cv2
from london_set import add_london_option, london_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = (("default", {}), ("no recogniser", {"DEID_IDENTITY_EMBED_MAX": "0"}), ("default again", {}))


def _deid(args: list[str], env: dict[str, str]) -> int:
    return subprocess.run([sys.executable, "-m", "deid.cli", *args], env=env, cwd=env["DEID_PROJECT_DIR"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_london_option(ap)
    ap.add_argument("--out", default=None, help="project directory (default: a new temporary one)")
    ap.add_argument("--k", type=int, default=5)
    a = ap.parse_args()
    london = london_dir(a.london)
    out = Path(a.out or tempfile.mkdtemp(prefix="deid-merges-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DEID_PROJECT_DIR": str(out), "PYTHONPATH": str(ROOT), "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    drop = out / "drops" / "london"
    if _deid(["import", "london", str(london), str(drop)], env):
        print("import failed")
        return 1
    (drop / "extra").mkdir(exist_ok=True)
    cv2.imwrite(str(drop / "extra" / "x001.jpg"), cv2.flip(cv2.imread(str(drop / "smiling_front" / "001_08.jpg")), 1))
    with open(drop / "manifest.csv", "a", encoding="utf-8") as fh:
        fh.write("extra/x001.jpg,x-001,female,smile,,,,,\n")
    seen: set[str] = set()
    for name, extra in CONFIGS:
        code = _deid(["run", str(drop), "--k", str(a.k)], {**env, **extra})
        new = sorted(set(os.listdir(out / "reports")) - seen - {"index.html"})
        seen |= set(new)
        reports = [json.loads((out / "reports" / r / "report.json").read_text()) for r in new
                   if (out / "reports" / r / "report.json").exists()]
        rep = reports[-1] if reports else {}
        identity = (rep.get("configuration") or {}).get("identity") or {}
        print(f"{name}: exit {code}, verdict {rep.get('verdict')}, face merges {identity.get('face_merges')}, "
              f"lineage.merges {(rep.get('lineage') or {}).get('merges')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
