"""Person index lookup time at 10k / 100k / 1M registered faces (issue 27 item 2).

Usage:
    .venv/bin/python bench/bench_person_index.py --out /tmp/pidx [--sizes 10000 100000 1000000] [--probe 1000]

For each size N: a fresh index (SQLite under OUT/N/, as a run without DEID_DATABASE_URL has it) is
filled with N registered faces (two photographs per person, spread over 10 datasets), then a drop
of ``--probe`` records (half of them registered photographs under re-keyed ids, half new) is looked
up five times, as a run's claim does (digests, one primary-key probe per distinct digest, sealed ids
opened for the hits). Prints per size: registration seconds, index size on disk, the median lookup
time of the drop and per record, the hits found (must be probe/2); and the ratio of per-record lookup
time at the largest to the smallest size (a linear scan would grow with N; a B-tree probe by log N).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path and "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(ROOT))

from deid.operations.person_index import PersonIndex  # noqa: E402

log = logging.getLogger("bench_person_index")
KEY = bytes(range(32))
DATASETS = 10
CHUNK = 100_000


def _fp(n: int) -> str:
    return hashlib.sha256(f"photo-{n}".encode()).hexdigest()


def bench(out: Path, n: int, probe: int) -> dict:
    where = out / str(n)
    where.mkdir(parents=True, exist_ok=True)
    for p in (where / "private").glob("person_index.sqlite*"):
        p.unlink()
    index = PersonIndex.open(where, KEY)
    t0 = time.perf_counter()
    per = -(-n // DATASETS)
    for d in range(DATASETS):
        for a in range(d * per, min(n, (d + 1) * per), CHUNK):
            b = min(n, (d + 1) * per, a + CHUNK)
            index.register(f"site-{d}", [f"person-{i // 2:07d}" for i in range(a, b)], [_fp(i) for i in range(a, b)])
    t_reg = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in (where / "private").iterdir())
    # The drop: registered photographs (spread over the whole index) under new ids, and new photographs.
    half = probe // 2
    old = [(i * 7919) % n for i in range(half)]
    ids = [f"rekeyed-{i:07d}" for i in range(half)] + [f"new-{i:07d}" for i in range(probe - half)]
    fps = [_fp(i) for i in old] + [_fp(n + i) for i in range(probe - half)]
    times, hits = [], 0
    for _ in range(5):
        t = time.perf_counter()
        m = index.lookup(ids, fps)
        times.append(time.perf_counter() - t)
        hits = sum(len(v) for v in m.records.values())
    med = statistics.median(times)
    row = {"registered": n, "register_s": round(t_reg, 2), "index_mib": round(size / 2**20, 1),
           "probe_records": probe, "lookup_s": round(med, 4), "lookup_us_per_record": round(med / probe * 1e6, 1),
           "hits": hits}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sizes", nargs="+", type=int, default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--probe", type=int, default=1000)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    rows = [bench(a.out, n, a.probe) for n in a.sizes]
    bad = [r for r in rows if r["hits"] != a.probe // 2]
    first, last = rows[0], rows[-1]
    print(json.dumps({"per_record_ratio": round(last["lookup_us_per_record"] / first["lookup_us_per_record"], 2),
                      "size_ratio": last["registered"] / first["registered"], "wrong_hits": len(bad)}))
    if bad:
        raise SystemExit(f"{len(bad)} sizes found the wrong number of registered photographs")


if __name__ == "__main__":
    main()
