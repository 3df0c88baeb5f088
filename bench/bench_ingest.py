"""Throughput of the ingest (the drop's files into the staged Parquet table) by reader threads.

Usage: .venv/bin/python bench/bench_ingest.py DROP [--threads 1 4] [--repeat 1] [--cold]

Each variant runs ``deid.intake.ingest.ingest`` in a fresh child process on the same drop (the
files read once before, so every variant reads from the page cache; with ``--cold`` the page cache
is dropped before each variant instead, as root: every file read from the disk) and prints wall seconds, CPU
seconds (user + system of the child), records per second, the child's peak RSS, and the ratio of
wall time to the first variant's, measured in this run. A floor is measured in the same way: the
same files read and hashed (sha256) in one thread, nothing checked or written. The staged tables of
all variants must hold the same records in the same order with the same bytes (checked: the
record ids and source hashes column by column, and the size column).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from deid.intake.drop import read_drop
from deid.intake.ingest import ingest
drop = read_drop({drop!r})
import inspect
threads = dict(read_threads={threads}) if "read_threads" in inspect.signature(ingest).parameters else {{}}
t0 = time.perf_counter()
res = ingest(drop, Path({out!r}), batch_size={batch}, **threads)
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps(dict(wall=wall, n=res.n_records, rss=ru.ru_maxrss * 1024)))
"""

FLOOR = r"""
import csv, hashlib, json, resource, sys, time
from pathlib import Path
root = Path({drop!r})
with open(root / "manifest.csv", newline="") as fh:
    images = [r["image"] for r in csv.DictReader(fh)]
t0 = time.perf_counter()
for image in images:
    with open(root / image, "rb") as fh:
        hashlib.sha256(fh.read()).digest()
wall = time.perf_counter() - t0
print(json.dumps(dict(wall=wall, n=len(images), rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
"""


def run_child(code: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = json.loads(out.strip().splitlines()[-1])
    # The child's whole CPU (start-up included: a second or so of imports, the same for every variant).
    row["cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return row


def staged_digest(path: Path) -> str:
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["record_id", "source_sha256", "size"])
    h = hashlib.sha256()
    for name in t.column_names:
        h.update("\x00".join(map(str, t.column(name).to_pylist())).encode())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drop", type=Path)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--batch", type=int, default=512, help="files per row group (a 1M run's: 512)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each variant (root)")
    args = ap.parse_args()
    drop = args.drop.resolve()

    def prepare() -> None:
        if args.cold:  # every file from the disk (the drop's directory entries too)
            subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
        else:  # every variant reads from the page cache
            subprocess.run(f"cat {drop}/manifest.csv > /dev/null; find {drop} -type f -exec cat {{}} + > /dev/null",
                           shell=True, check=True)
    prepare()
    print(f"drop {drop}  load average {os.getloadavg()[0]:.2f}  {'cold' if args.cold else 'warm'} page cache")
    print(f"{'variant':<22}{'wall s':>9}{'CPU s':>9}{'records/s':>12}{'peak RSS MiB':>14}{'x first':>9}  staged")
    first = None
    with tempfile.TemporaryDirectory(dir=drop.parent) as tmp:
        rows = [("read + sha256 (floor)", FLOOR.format(drop=str(drop)), None)]
        for threads in args.threads:
            out = Path(tmp) / f"ingested_{threads}.parquet"
            rows.append((f"ingest, {threads} thread(s)", CHILD.format(root=str(ROOT), drop=str(drop), out=str(out),
                                                                       batch=args.batch, threads=threads), out))
        for _ in range(args.repeat):
            for name, code, out in rows:
                prepare()
                r = run_child(code)
                if out is None:
                    ratio = ""
                else:
                    first = first or r["wall"]
                    ratio = f"{r['wall'] / first:.2f}"
                print(f"{name:<22}{r['wall']:>9.2f}{r['cpu']:>9.2f}{r['n'] / r['wall']:>12.0f}"
                      f"{r['rss'] / 2**20:>14.0f}{ratio:>9}  {staged_digest(out) if out else ''}", flush=True)
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
