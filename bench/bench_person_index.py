"""Person index lookup time at 10k / 100k / 1M registered faces (issue 27 item 2).

Usage:
    .venv/bin/python bench/bench_person_index.py --out /tmp/pidx [--sizes 10000 100000 1000000] [--probe 1000]
    .venv/bin/python bench/bench_person_index.py --out /tmp/pidx --faces [--sizes ...]   # face descriptors

``--faces``: N synthetic 128-d descriptors shaped like dlib's (people ~0.8 apart, two photographs of
one person ~0.3) are registered (sealed); then the index is opened (every descriptor decrypted) and
its inverted file built, and ``--probe`` new photographs (half of registered people, returning under
new ids; half of strangers) are searched. Prints the seconds to register (and per face), to open and
build, to search (and per probe), wall and CPU, the recall of the returning people at the same-person
distance 0.45 and the strangers' false matches, each with a 95% two-sided Clopper-Pearson interval, the
same for ``within`` (every registered face within 0.45 of a probe: what a run's ``route_faces``
calls), the agreement with an exact search on 100 of the probes, and the process's peak RSS
(registration, open, searches: before that exact search). Several sizes run in a process each.

``--claim N``: what a run of an N-record drop (two photographs per person) pays at its start: the
drop claimed in an empty index (every record looked up and registered), then claimed again by its
next run (every record found); wall and CPU seconds of each.

``--london [PATH]``: the real recogniser on the London set (default: the tests' London path, see
bench/london_set.py; aligned and embedded with dlib as the tests do, ~30 s): the people split in two halves; each half's neutral photographs
are registered under one dataset, then every smiling photograph is looked up under a new id. Recall:
smiling photographs of registered people matched to their own registered id (distance < 0.45);
false matches: smiling photographs of the other half matched to anyone. Both with Clopper-Pearson
95% intervals, over both halves.

For each size N: a fresh index (SQLite under OUT/N/, as a run without DEID_DATABASE_URL has it) is
filled with N registered faces (two photographs per person, spread over 10 datasets), then a drop
of ``--probe`` records (half of them registered photographs under re-keyed ids, half new) is looked
up five times, as a run's claim does (digests, one primary-key probe per distinct digest, sealed ids
opened for the hits). Prints per size: registration seconds, index size on disk, the first lookup's
time, the median lookup time of the drop (of five after it) and per record, the hits found (must be probe/2); and the ratio of per-record lookup
time at the largest to the smallest size (a linear scan would grow with N; a B-tree probe by log N).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path and "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(ROOT))

from deid.operations.person_index import PersonIndex  # noqa: E402
from london_set import add_london_option, london_dir  # noqa: E402

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
    t = time.perf_counter()
    index.lookup(ids, fps)  # the first lookup after registering: pages read from disk or the WAL (reported apart)
    cold = time.perf_counter() - t
    times, hits = [], 0
    for _ in range(5):
        t = time.perf_counter()
        m = index.lookup(ids, fps)
        times.append(time.perf_counter() - t)
        hits = sum(len(v) for v in m.records.values())
    med = statistics.median(times)
    row = {"registered": n, "register_s": round(t_reg, 2), "index_mib": round(size / 2**20, 1),
           "probe_records": probe, "first_lookup_s": round(cold, 4), "lookup_s": round(med, 4), "lookup_us_per_record": round(med / probe * 1e6, 1),
           "hits": hits}
    print(json.dumps(row), flush=True)
    return row


def bench_faces(out: Path, n: int, probe: int, nprobe: int = 16) -> dict:
    import numpy as np  # noqa: PLC0415

    from deid.anonymise.identity_calibration import rate_interval as _interval  # noqa: PLC0415
    from deid.operations.descriptor_search import DescriptorSearch  # noqa: PLC0415

    where = out / f"faces-{n}"
    where.mkdir(parents=True, exist_ok=True)
    for p in (where / "private").glob("person_index.sqlite*"):
        p.unlink()
    index = PersonIndex.open(where, KEY)
    rng = np.random.default_rng(0)
    people = n // 2
    centres = rng.normal(0, 0.05, (people, 128)).astype(np.float32)
    t0, c0 = time.perf_counter(), time.process_time()
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        who = np.arange(a, b) // 2
        index.register_faces(f"site-{a // CHUNK % DATASETS}", [f"person-{i:07d}" for i in who],
                             centres[who] + rng.normal(0, 0.02, (b - a, 128)).astype(np.float32))
    t_reg, c_reg = time.perf_counter() - t0, time.process_time() - c0
    t1, c1 = time.perf_counter(), time.process_time()
    search, owners = index.face_search(nprobe=nprobe)
    t_open, c_open = time.perf_counter() - t1, time.process_time() - c1
    half = probe // 2
    known = rng.choice(people, half, replace=False)
    probes = np.vstack([centres[known] + rng.normal(0, 0.02, (half, 128)),
                        rng.normal(0, 0.05, (probe - half, 128))]).astype(np.float32)
    t2, c2 = time.perf_counter(), time.process_time()
    idx, dist = search.search(probes)
    t_search, c_search = time.perf_counter() - t2, time.process_time() - c2
    found = [owners[j][1] if d < 0.45 else None for j, d in zip(idx.tolist(), dist.tolist())]
    hits = sum(found[i] == f"person-{known[i]:07d}" for i in range(half))
    recall = hits / half
    false = sum(f is not None for f in found[half:])
    # What a run calls (PersonIndex.route_faces): every registered face within the threshold of each probe.
    t3, c3 = time.perf_counter(), time.process_time()
    wp, wj, _ = search.within(probes, 0.45)
    t_within, c_within = time.perf_counter() - t3, time.process_time() - c3
    near = {(int(p), owners[int(j)][1]) for p, j in zip(wp.tolist(), wj.tolist())}
    w_hits = sum((i, f"person-{known[i]:07d}") in near for i in range(half))
    w_false = len({p for p, _ in near if p >= half})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the bench's own exact search below
    vectors = search.vectors()
    exact = DescriptorSearch(vectors, exact_below=len(vectors) + 1)
    ei, _ = exact.search(probes[:100])
    agree = float(np.mean(ei // 2 == idx[:100] // 2))
    row = {"registered_faces": n, "nprobe": nprobe, "register_s": round(t_reg, 1),
           "register_ms_per_face": round(t_reg / n * 1e3, 4), "register_cpu_s": round(c_reg, 1),
           "open_and_build_s": round(t_open, 1), "open_and_build_cpu_s": round(c_open, 1),
           "lists": None if search.lists is None else len(search.lists), "probes": probe,
           "search_s": round(t_search, 3), "search_ms_per_probe": round(t_search / probe * 1e3, 3),
           "search_cpu_ms_per_probe": round(c_search / probe * 1e3, 3),
           "recall_at_0.45": recall, "recall_ci95": _interval(hits, half, 0.95)["interval"],
           "false_matches": false, "false_match_ci95": _interval(false, probe - half, 0.95)["interval"],
           "within_ms_per_probe": round(t_within / probe * 1e3, 3),
           "within_cpu_ms_per_probe": round(c_within / probe * 1e3, 3), "within_recall": round(w_hits / half, 4),
           "within_recall_ci95": _interval(w_hits, half, 0.95)["interval"], "within_false_matches": w_false,
           "agrees_with_exact": agree,
           "peak_rss_mib": round(peak),
           "load": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(row), flush=True)
    return row


def bench_london(out: Path, london: Path) -> dict:
    import numpy as np  # noqa: PLC0415

    from deid.alignment.london import align_london  # noqa: PLC0415
    from deid.evaluation.gate_privacy import clopper_pearson  # noqa: PLC0415
    from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415

    faces, people, _, expr = align_london(london)
    E, people, expr = DlibEmbedder().transform(faces), np.array(people), np.array(expr)
    persons = sorted(set(people.tolist()))
    hits = n_known = false = n_other = 0
    for half in (0, 1):
        mine = set(persons[half::2])
        where = out / f"london-{half}"
        where.mkdir(parents=True, exist_ok=True)
        for p in (where / "private").glob("person_index.sqlite*"):
            p.unlink()
        index = PersonIndex.open(where, KEY)
        reg = np.flatnonzero((expr == "neutral") & np.isin(people, list(mine)))
        index.register_faces("cohort-a", people[reg].tolist(), E[reg])
        probe = np.flatnonzero(expr != "neutral")
        found = {m.row: m.subject_id for m in index.match_faces(E[probe])}
        for r, i in enumerate(probe):
            if people[i] in mine:
                n_known += 1
                hits += found.get(r) == people[i]
            else:
                n_other += 1
                false += r in found
    row = {"london_recall": round(hits / n_known, 3), "recall_ci95": [round(x, 3) for x in clopper_pearson(hits, n_known)],
           "registered_people_probed": n_known, "false_matches": false, "false_match_rate_ci95":
           [round(x, 4) for x in clopper_pearson(false, n_other)], "strangers_probed": n_other}
    print(json.dumps(row), flush=True)
    return row


def bench_claim(out: Path, n: int) -> dict:
    where = out / f"claim-{n}"
    where.mkdir(parents=True, exist_ok=True)
    for p in (where / "private").glob("person_index.sqlite*"):
        p.unlink()
    ids = [f"person-{i // 2:07d}" for i in range(n)]
    fps = [_fp(i) for i in range(n)]
    row: dict = {"records": n}
    for what in ("first_claim", "next_claim"):
        w, c = time.perf_counter(), time.process_time()
        routing = PersonIndex.open(where, KEY).claim("cohort-a", ids, fps)
        row[f"{what}_wall_s"] = round(time.perf_counter() - w, 1)
        row[f"{what}_cpu_s"] = round(time.process_time() - c, 1)
        assert routing.dataset == "cohort-a" and not routing.aliases
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sizes", nargs="+", type=int, default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--probe", type=int, default=1000)
    ap.add_argument("--faces", action="store_true", help="face descriptors (nearest-neighbour search)")
    ap.add_argument("--nprobe", type=int, default=16, help="--faces: inverted lists searched per probe")
    add_london_option(ap, optional=True)
    ap.add_argument("--claim", type=int, default=0, help="records of a drop claimed twice (a run's own cost)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    if a.claim:
        bench_claim(a.out, a.claim)
        return
    if a.london is not None:
        bench_london(a.out, london_dir(a.london))
        return
    if a.faces:
        if len(a.sizes) == 1:
            bench_faces(a.out, a.sizes[0], a.probe, a.nprobe)
            return
        for n in a.sizes:  # each size in a process of its own: its peak RSS is its own
            subprocess.run([sys.executable, __file__, "--out", str(a.out), "--faces", "--sizes", str(n),
                            "--probe", str(a.probe), "--nprobe", str(a.nprobe)], check=True)
        return
    rows = [bench(a.out, n, a.probe) for n in a.sizes]
    bad = [r for r in rows if r["hits"] != a.probe // 2]
    first, last = rows[0], rows[-1]
    print(json.dumps({"per_record_ratio": round(last["lookup_us_per_record"] / first["lookup_us_per_record"], 2),
                      "size_ratio": last["registered"] / first["registered"], "wrong_hits": len(bad)}))
    if bad:
        raise SystemExit(f"{len(bad)} sizes found the wrong number of registered photographs")


if __name__ == "__main__":
    main()
