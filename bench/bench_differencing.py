"""Time the lineage differencing attack alone on a synthetic first release (issue 13).

Usage:
    PYTHONPATH=$PWD .venv/bin/python bench/bench_differencing.py --faces 10000
    PYTHONPATH=$PWD .venv/bin/python bench/bench_differencing.py --faces 100000 --exhaustive

N synthetic faces (N/2 people x 2, eigenface-like: a mean, 50 decaying components per person, a
little noise per photo; 81x92 grey levels) are grouped into k=5 clusters of distinct people,
released once, and attacked (:func:`deid.release.lineage_differencing.differencing_attack`, every
cluster against every other one of the release). Planted leaks: ``--leaks`` clusters get a
sibling holding byte-identical copies (new records, same people) of four of its photos and one
new person's photo (a swapped pair: two people found), and as many get a sibling with copies of
all five photos and one new photo (an added face: one person found). Prints the attack's CPU
(user + system of this process) and wall seconds, tests, matches and people identified (expected:
3 per leak). ``--exhaustive`` runs the reference search over the whole gallery
(``exhaustive_below`` above N); run with ``PYTHONPATH`` of an older checkout for its figures.
``--pairs content`` tests only the pairs the content index gives (what a release run does, issue 32).
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import resource
import time

import numpy as np

from deid.release.lineage import release_from_clusters
from deid.release.lineage_state import empty_state
from deid.release.lineage_differencing import differencing_attack

KEY = b"k" * 32


def faces(n_people: int, p: int, rng: np.random.Generator) -> np.ndarray:
    """Two photos per person, rows 2i and 2i+1: uint8 (2 n_people, p)."""
    q = 50
    basis = rng.standard_normal((q, p)).astype(np.float32) / np.sqrt(p)
    mean = rng.uniform(60, 190, p).astype(np.float32)
    out = np.empty((2 * n_people, p), dtype=np.uint8)
    sd = (2500 * np.exp(-np.arange(q) / 15)).astype(np.float32)
    for a in range(0, n_people, 4096):
        m = min(4096, n_people - a)
        person = rng.standard_normal((m, q)).astype(np.float32) * sd
        for ph in range(2):
            coef = person + rng.standard_normal((m, q)).astype(np.float32) * sd * 0.3
            img = mean + coef @ basis + rng.normal(0, 2, (m, p)).astype(np.float32)
            out[2 * a + ph:2 * (a + m):2] = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faces", type=int, default=10000)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--pixels", type=int, default=81 * 92)
    ap.add_argument("--leaks", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--exhaustive", action="store_true", help="search every original for every test (reference)")
    ap.add_argument("--pairs", default="nearest", choices=["nearest", "content"], help="the pair search (issue 32)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n_people = args.faces // 2
    X = faces(n_people + 2 * args.leaks, args.pixels, rng)
    base = X[:2 * n_people]
    people = [f"p{r // 2}" for r in range(len(base))]
    # k-Same-like clusters of distinct people: photo 0 of a permutation of people, then photo 1 of another.
    order = np.concatenate([2 * rng.permutation(n_people), 2 * rng.permutation(n_people) + 1])
    n_cl = len(order) // args.k
    labels = np.full(len(base), -1)
    labels[order[:n_cl * args.k]] = np.repeat(np.arange(n_cl), args.k)
    rows, ppl, lab = [base], list(people), [labels]
    extra = X[2 * n_people:]
    for leak in range(args.leaks):   # planted: a pair leak then a single leak
        for kind in ("pair", "single"):
            src = np.flatnonzero(labels == leak * 2 + (kind == "single"))
            keep = src[:args.k - 1] if kind == "pair" else src
            fresh = extra[2 * leak + (kind == "single")][None]
            rows.append(np.vstack([base[keep], fresh]))
            ppl += [people[r] for r in keep] + [f"new{leak}{kind}"]
            lab.append(np.full(len(keep) + 1, n_cl))
            n_cl += 1
    Xall = np.vstack(rows)
    labels = np.concatenate(lab)
    fps = [f"record-{i}" for i in range(len(Xall))]
    imgs = np.zeros_like(Xall)
    order = np.argsort(labels, kind="stable")
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    for grp in np.split(order, bounds):
        if labels[grp[0]] >= 0:
            imgs[grp] = np.clip(np.rint(Xall[grp].mean(axis=0, dtype=np.float64)), 0, 255).astype(np.uint8)
    s0 = empty_state("bench")
    rel = release_from_clusters(s0, ppl, fps, key=KEY, release_id="r1", k=args.k, method="k-same", labels=labels,
                                images=imgs, shape=(args.pixels,))
    del imgs
    kw = {"original_people": ppl, "threads": args.threads}
    if args.pairs != "nearest":
        kw.update(pairs=args.pairs, original_records=fps)
    if "exhaustive_below" in inspect.signature(differencing_attack).parameters:
        kw["exhaustive_below"] = len(Xall) + 1 if args.exhaustive else 1000
    c0, w0 = os.times(), time.perf_counter()
    res = differencing_attack(s0, rel, Xall, **kw)
    c1, w1 = os.times(), time.perf_counter()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"faces={len(Xall)} clusters={len(rel.new_clusters)} mode={res.mode!r} exhaustive={args.exhaustive}")
    print(f"attack: cpu {cpu:.1f} s  wall {w1 - w0:.1f} s  ({1000 * cpu / len(Xall):.3f} ms CPU/face)  "
          f"load {os.getloadavg()[0]:.1f}  peak RSS {rss:.2f} GiB")
    print(f"pairs {res.n_cluster_pairs}  tests {res.n_tests}  matches {len(res.matches)}  "
          f"people identified {len(res.people_identified)} (planted: {3 * args.leaks})")
    print("digest", hashlib.sha256(repr(sorted((m.released, m.registered, m.sizes, m.kind, m.originals)
                                                for m in res.matches)).encode()).hexdigest()[:16])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
