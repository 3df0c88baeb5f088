"""Identity resolution at 10k / 100k / 1M faces, by step, with planted Sybil copies (issue 27's bench line).

Usage:
    .venv/bin/python bench/bench_identity.py [--sizes 10000 100000 1000000] [--input vectors|faces] [--json OUT]
    .venv/bin/python bench/bench_identity.py --staging DATA/staging/RELEASE_ID      # a staged run's own faces

Each size runs in a child process of its own (its peak RSS is its own) and prints one JSON row; the
parent prints them all at the end. :func:`deid.anonymise.identity.resolve_people` runs as the partition
stage calls it above ``DEID_IDENTITY_EMBED_MAX`` (``--budget``, default 2,000): eigenface features
(near-duplicate rule), the cheap first pass's features (``cheap``) and ``embed(positions)``. Its
steps are timed (wall and CPU seconds, each counted once, exclusive of the steps it calls):

* ``near_duplicate``: the eigenface near-duplicate rule (bucket split above 20,000 rows, nearest other id);
* ``first_pass_knn``: the cheap first pass's nearest-neighbour search (4 nearest other ids per record);
* ``first_pass_rank``: ranking those pairs and adding the calibration's references, up to the budget;
* ``embedding``: the descriptors of the records the first pass chose;
* ``calibration``: the recogniser's threshold on those descriptors (k-means subsets);
* ``merging``: joining ids on the matching pairs' evidence;
* ``other``: id normalisation, union-find, the rest of ``resolve_people``.

Inputs (``--input``):

* ``vectors`` (default; any size, no pixels, no dlib): arrays of the shapes the code path takes,
  generated in float32 chunks: N/2 people x 2 photographs; eigenface features (50-d, person centre
  N(0, 1), photo N(0, 0.6^2)), first-pass features (48-d, N(0, 1) and N(0, 0.5^2)), and descriptors
  generated when ``embed`` asks for them (128-d, people N(0, 0.05^2) per dimension: ~0.8 apart;
  photographs N(0, 0.02^2): one person's two ~0.32 apart, as dlib's). ``embedding`` is then
  the generator's time: a real run pays dlib's ~0.094 CPU-s per face on top (``dlib_estimate_cpu_s``).
* ``faces``: ``deid synth --fast`` cartoon faces drawn and aligned in memory (92 x 81 grey, ~7.5 kB a
  face: 10k-100k), eigenfaces fitted as featurize does, first-pass features
  (:class:`deid.alignment.features.IlluminationFeatures`, fitted on 4,000 faces), real dlib descriptors
  (one process). dlib does not separate these cartoons: its calibration declares them undecided and
  only near-copies (descriptor distance < 0.12) merge there.
* ``--staging DIR``: a staged run's directory (``data/staging/<release id>``, kept with
  ``DEID_KEEP_STAGING``; it must hold the feature parts' ``identity`` column, written above
  ``DEID_IDENTITY_EMBED_MAX``): its eigenface and first-pass features and subject ids, and dlib on its
  aligned faces. The only way to a 1M run on real aligned faces without 7.5 GB of pixels in memory;
  no planted copies.

Planted Sybil copies (``--victims V``, default 20, ``--copies C`` per victim, default 5; vectors and
faces): copies of a victim's first photograph under C new ids (one id each), half of the victims
``noisy``, half ``ramp``-lit. Faces: ``ramp`` is five linear light ramps averaging to the original
(bench/identity_scenarios.py's), ``noisy`` Gaussian pixel noise sigma 3. Vectors, by what London
measured (docs/pipeline.md): ``noisy`` 0.05 x the median nearest-other-person distance from the victim
in eigenface and first-pass space, 0.03 in descriptor space; ``ramp`` 0.6 x in eigenface space (beyond
the near-duplicate rule's 0.2), 0.05 x in first-pass space (self-quotient images cancel a smooth light),
0.10 in descriptor space. The copies count in the N records. A copy is *found* when it resolves to
its victim's person; intervals are 95% two-sided Clopper-Pearson, over copies and over victims (all C
copies and the victim one person). ``false_merges``: merges joining records of different real people.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path and "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench_identity")
SHAPE = (92, 81)
DLIB_CPU_S = 0.094  # one face, one core (docs/pipeline.md, measured on this machine)
STEPS = ("near_duplicate", "first_pass_knn", "first_pass_rank", "embedding", "calibration", "merging")
EIGEN_DIM, CHEAP_DIM, DESC_DIM = 50, 48, 128
KINDS = {  # (eigenface x median, first pass x median, descriptor distance)
    "noisy": (0.05, 0.05, 0.03),
    "ramp": (0.6, 0.05, 0.10),
}


@dataclass
class Input:
    """What resolve_people takes, and the truth to score it: each record's real person, the planted copies."""

    ids: list[str]
    features: np.ndarray
    cheap: np.ndarray
    embed: Callable[[np.ndarray], np.ndarray]
    truth: np.ndarray  # int per record: the real person
    planted: list[dict] = field(default_factory=list)  # {"kind", "victim": row, "copies": [rows]}
    note: str = ""


# ------------------------------------------------------------------------------------------ the steps' clocks


class Clocks:
    """Wall and CPU seconds per step, each counted once: a step's time excludes the wrapped steps it calls."""

    def __init__(self) -> None:
        self.wall = dict.fromkeys(STEPS, 0.0)
        self.cpu = dict.fromkeys(STEPS, 0.0)
        self.calls = dict.fromkeys(STEPS, 0)
        self.stack: list[list] = []

    def wrap(self, fn: Callable, label: str | None, keep: dict | None = None, key: str = "") -> Callable:
        """``fn`` timed under ``label`` (None: inside another step, its caller's; at top level ``near_duplicate``)."""
        def timed(*a, **kw):
            if label is None and self.stack:
                return fn(*a, **kw)
            frame = [label or "near_duplicate", time.perf_counter(), time.process_time(), 0.0, 0.0]
            self.stack.append(frame)
            try:
                out = fn(*a, **kw)
            finally:
                self.stack.pop()
                w, c = time.perf_counter() - frame[1], time.process_time() - frame[2]
                self.wall[frame[0]] += w - frame[3]
                self.cpu[frame[0]] += c - frame[4]
                self.calls[frame[0]] += 1
                if self.stack:
                    self.stack[-1][3] += w
                    self.stack[-1][4] += c
            if keep is not None:
                keep[key] = out
            return out
        return timed


class PeakRss:
    """This process's peak resident memory between start and stop (sampled every 20 ms), MiB."""

    def __init__(self) -> None:
        import psutil  # noqa: PLC0415

        self.proc = psutil.Process()
        self.peak = self.base = self.proc.memory_info().rss / 2**20
        self.done = threading.Event()
        self.th = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss / 2**20)
            self.done.wait(0.02)

    def __enter__(self) -> "PeakRss":
        self.th.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.th.join()
        self.peak = max(self.peak, self.proc.memory_info().rss / 2**20)


# ------------------------------------------------------------------------------------------------- inputs


def _unit(rng: np.random.Generator, d: int) -> np.ndarray:
    v = rng.standard_normal(d)
    return v / np.linalg.norm(v)


def _median_nearest_other(X: np.ndarray, truth: np.ndarray, sample: int = 256, seed: int = 0) -> float:
    """Median distance from ``sample`` rows to their nearest row of another person (exact, against every row)."""
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(len(X), min(sample, len(X)), replace=False))
    q = X[rows].astype(np.float32)
    best = np.full(len(rows), np.inf, np.float32)
    qq = np.einsum("ij,ij->i", q, q)
    for a in range(0, len(X), 65_536):
        B = X[a:a + 65_536]
        d2 = qq[:, None] + np.einsum("ij,ij->i", B, B)[None, :] - 2.0 * (q @ B.T)
        d2[truth[rows][:, None] == truth[a:a + len(B)][None, :]] = np.inf
        best = np.minimum(best, d2.min(axis=1))
    return float(np.median(np.sqrt(np.maximum(best, 0.0))))


def _plan_copies(n: int, victims: int, copies: int) -> tuple[int, list[tuple[str, int]]]:
    """Records of real people and the planted (kind, victim person) list: the copies count in the n records."""
    base = n - victims * copies
    if base < 4 * max(victims, 1):
        raise SystemExit(f"--sizes {n} is too small for {victims} victims x {copies} copies; plant fewer")
    people = base // 2
    kinds = list(KINDS)
    return base, [(kinds[v % len(kinds)], (v * 7919 + 13) % people) for v in range(victims)]


def vectors_input(n: int, victims: int, copies: int, seed: int = 0) -> Input:
    """Generated arrays of the shapes the code path takes (see the module docstring)."""
    base, plan = _plan_copies(n, victims, copies)
    truth = np.empty(n, np.int64)
    truth[:base] = np.arange(base) // 2
    F = np.empty((n, EIGEN_DIM), np.float32)
    H = np.empty((n, CHEAP_DIM), np.float32)
    rng = np.random.default_rng(seed)
    for X, spread in ((F, 0.6), (H, 0.5)):
        for a in range(0, base, 131_072):
            b = min(base, a + 131_072)
            # Person centres drawn for whole people: a chunk boundary is even (131,072), so a person's rows share it.
            centre = rng.standard_normal(((b - a + 1) // 2, X.shape[1]), dtype=np.float32)
            X[a:b] = np.repeat(centre, 2, axis=0)[:b - a] + spread * rng.standard_normal((b - a, X.shape[1]),
                                                                                         dtype=np.float32)
    ids = [f"p{p:07d}" for p in truth[:base].tolist()]
    scale_f = _median_nearest_other(F[:base], truth[:base])
    scale_h = _median_nearest_other(H[:base], truth[:base])
    offsets: dict[int, np.ndarray] = {}  # record -> its descriptor's offset from its victim's
    planted, row = [], base
    for v, (kind, person) in enumerate(plan):
        victim = 2 * person
        r_f, r_h, r_e = KINDS[kind]
        crng = np.random.default_rng([seed, 1, v])
        rows = []
        for c in range(copies):
            F[row] = F[victim] + r_f * scale_f * _unit(crng, EIGEN_DIM)
            H[row] = H[victim] + r_h * scale_h * _unit(crng, CHEAP_DIM)
            offsets[row] = r_e * _unit(crng, DESC_DIM)
            truth[row] = truth[victim]
            ids.append(f"sybil-{v:03d}-{c}")
            rows.append(row)
            row += 1
        planted.append({"kind": kind, "victim": victim, "copies": rows})

    def descriptor(r: int) -> np.ndarray:
        src = r if r < base else next(p["victim"] for p in planted if r in p["copies"])
        person = int(truth[src])
        centre = np.random.default_rng([seed, 2, person]).normal(0, 0.05, DESC_DIM)
        photo = centre + np.random.default_rng([seed, 3, src]).normal(0, 0.02, DESC_DIM)
        return photo + offsets.get(r, 0.0)

    def embed(positions: np.ndarray) -> np.ndarray:
        return np.array([descriptor(int(r)) for r in positions], dtype=np.float32).reshape(-1, DESC_DIM)

    note = (f"generated vectors: {base // 2} people x 2 photographs + {victims} victims x {copies} copies; median "
            f"nearest-other-person distance {scale_f:.3f} (eigenface), {scale_h:.3f} (first pass), 256 rows sampled")
    return Input(ids, F, H, embed, truth, planted, note)


def _synth_aligned(people: int, seed: int, spare: int = 0) -> tuple[np.ndarray, list[str]]:
    """``people`` x 2 ``deid synth --fast`` faces, drawn and aligned in memory: uint8 (2 people + spare, h*w)
    (``spare`` rows left for the copies: no second copy of the pixels), ids."""
    import cv2  # noqa: PLC0415

    from deid.alignment.canonical import FaceAligner  # noqa: PLC0415
    from deid.alignment.eyes import EyePair  # noqa: PLC0415
    from deid.intake.synth import SynthSpec, _faces_of  # noqa: PLC0415

    spec = SynthSpec(seed=seed, images_per_person=2, fast=True)
    aligner = FaceAligner()  # the canonical 92 x 81 frame
    out = np.empty((2 * people + spare, SHAPE[0] * SHAPE[1]), np.uint8)
    ids, i = [], 0
    for n in range(1, people + 1):
        for person, _, _, img, eyes in _faces_of(spec, n):
            grey = img if img.ndim == 2 else cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
            out[i] = aligner.align(grey, EyePair(*eyes)).image.reshape(-1)
            ids.append(person.subject_id)
            i += 1
    if i != 2 * people:
        raise SystemExit(f"deid synth drew {i} faces for {people} people; expected 2 each")
    return out, ids


def faces_input(n: int, victims: int, copies: int, seed: int = 0) -> Input:
    """``deid synth --fast`` faces aligned in memory, with ramp-lit and noisy copies; real dlib (see the docstring)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from identity_scenarios import ramp_copies  # noqa: PLC0415

    from deid.alignment.features import Eigenfaces  # noqa: PLC0415
    from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415
    from deid.operations.worker_featurize import IDENTITY_CHEAP_DIMS, CheapIdentityFeatures  # noqa: PLC0415

    base, plan = _plan_copies(n, victims, copies)
    base -= base % 2
    t = time.perf_counter()
    faces, ids = _synth_aligned(base // 2, seed, spare=victims * copies)
    truth = np.concatenate([np.arange(base) // 2, np.zeros(victims * copies, np.int64)])
    drawn = time.perf_counter() - t
    rng = np.random.default_rng(seed)
    planted, row = [], base
    for v, (kind, person) in enumerate(plan):
        victim = 2 * person
        if kind == "ramp":
            faces[row:row + copies] = ramp_copies(faces[victim], SHAPE, n=copies)
        else:
            faces[row:row + copies] = np.clip(faces[victim][None].astype(np.float64)
                                              + rng.normal(0, 3, (copies, faces.shape[1])), 0, 255).round()
        rows = list(range(row, row + copies))
        truth[rows] = truth[victim]
        ids += [f"sybil-{v:03d}-{c}" for c in range(copies)]
        planted.append({"kind": kind, "victim": victim, "copies": rows})
        row += copies
    # As featurize: eigenfaces fitted on a seeded subset, the first pass's model on ~4,000 faces, both transformed
    # a chunk at a time.
    t = time.perf_counter()
    F = Eigenfaces(50).fit(faces).transform(faces).astype(np.float32)
    model = CheapIdentityFeatures(SHAPE, n_components=IDENTITY_CHEAP_DIMS).fit(faces[:: max(1, len(faces) // 4000)])
    H = np.vstack([model.transform(faces[a:a + 4096]) for a in range(0, len(faces), 4096)])
    featurized = time.perf_counter() - t
    embedder = DlibEmbedder(SHAPE)

    def embed(positions: np.ndarray) -> np.ndarray:
        return embedder.transform(faces[np.asarray(positions, np.int64)])

    note = (f"deid synth --fast faces, aligned in memory: {base // 2} people x 2 + {victims} victims x {copies} "
            f"copies ({faces.nbytes / 2**20:.0f} MiB of pixels); drawn and aligned in {drawn:.0f} s, eigenfaces and "
            f"first-pass features in {featurized:.0f} s (wall; not in the step figures)")
    return Input(ids, F, H, embed, truth, planted, note)


def staging_input(staging: Path) -> Input:
    """A staged run's features, first-pass features and subject ids, and dlib on its aligned faces."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415

    parts = sorted((staging / "features").glob("part-*.parquet"))
    if not parts:
        raise SystemExit(f"--staging {staging}: no features/part-*.parquet; give data/staging/<release id> of a run "
                         "kept with DEID_KEEP_STAGING")
    if "identity" not in pq.read_schema(parts[0]).names:
        raise SystemExit(f"--staging {staging}: the feature parts hold no 'identity' column (featurize writes it only "
                         "above DEID_IDENTITY_EMBED_MAX faces)")
    sizes = [pq.ParquetFile(p).metadata.num_rows for p in parts]
    n = sum(sizes)
    F = H = None
    rid: list = []
    at = 0
    for p, m in zip(parts, sizes):
        t = pq.read_table(p, columns=["record_id", "features", "identity"])
        f = np.asarray(t.column("features").combine_chunks().flatten(), np.float32).reshape(m, -1)
        h = np.asarray(t.column("identity").combine_chunks().flatten(), np.float32).reshape(m, -1)
        if F is None:
            F, H = np.empty((n, f.shape[1]), np.float32), np.empty((n, h.shape[1]), np.float32)
        F[at:at + m], H[at:at + m] = f, h
        rid.append(t.column("record_id"))
        at += m
    order = pa.table({"record_id": pa.chunked_array([c for r in rid for c in r.chunks], pa.string()),
                      "pos": pa.array(np.arange(n))})
    meta = pq.read_table(staging / "ingested.parquet", columns=["record_id", "subject_id"])
    joined = order.join(meta, "record_id", join_type="inner").sort_by("pos")
    if joined.num_rows != n:
        raise SystemExit(f"--staging {staging}: {n - joined.num_rows} feature rows have no ingested record")
    ids = [str(s) for s in joined.column("subject_id").to_pylist()]
    record_ids = joined.column("record_id")
    del meta, joined, order, rid
    aligned = sorted((staging / "aligned").glob("part-*.parquet"))
    embedder = DlibEmbedder(SHAPE)

    def embed(positions: np.ndarray) -> np.ndarray:
        want = {r: j for j, r in enumerate(record_ids.take(pa.array(np.asarray(positions, np.int64))).to_pylist())}
        pixels: list = [None] * len(want)
        for p in aligned:
            part = pq.read_table(p, columns=["record_id", "pixels"])
            for r, px in zip(part.column("record_id").to_pylist(), part.column("pixels").to_pylist()):
                if r in want:
                    pixels[want[r]] = px
        return embedder.transform(np.frombuffer(b"".join(pixels), np.uint8).reshape(len(pixels), -1))

    truth = np.unique(np.asarray(ids, dtype=object).astype(str), return_inverse=True)[1].ravel()
    return Input(ids, F, H, embed, truth, [], f"staged run {staging}: {n} faces (subject ids as truth)")


# --------------------------------------------------------------------------------------------------- one size


def measure(inp: Input, budget: int) -> dict:
    """Run resolve_people on ``inp`` with its steps clocked; the figures of one size."""
    from deid.anonymise import identity  # noqa: PLC0415

    clocks = Clocks()
    kept: dict = {}
    saved = {name: getattr(identity, name) for name in
             ("_buckets", "_nearest_other", "_knn_other", "cheap_candidates", "calibrate_recogniser",
              "_evidence_merges")}
    identity._buckets = clocks.wrap(saved["_buckets"], None)
    identity._nearest_other = clocks.wrap(saved["_nearest_other"], "near_duplicate")
    identity._knn_other = clocks.wrap(saved["_knn_other"], "first_pass_knn", kept, "knn")
    identity.cheap_candidates = clocks.wrap(saved["cheap_candidates"], "first_pass_rank", kept, "chosen")
    identity.calibrate_recogniser = clocks.wrap(saved["calibrate_recogniser"], "calibration", kept, "cal")
    identity._evidence_merges = clocks.wrap(saved["_evidence_merges"], "merging")
    embed = clocks.wrap(inp.embed, "embedding")
    try:
        with PeakRss() as rss:
            w, c = time.perf_counter(), time.process_time()
            res = identity.resolve_people(inp.ids, inp.features, cheap=inp.cheap, embed=embed, embed_budget=budget)
            wall, cpu = time.perf_counter() - w, time.process_time() - c
    finally:
        for name, fn in saved.items():
            setattr(identity, name, fn)
    n = len(inp.ids)
    steps = {s: {"wall_s": round(clocks.wall[s], 2), "cpu_s": round(clocks.cpu[s], 2)} for s in STEPS}
    steps["other"] = {"wall_s": round(wall - sum(clocks.wall.values()), 2),
                      "cpu_s": round(cpu - sum(clocks.cpu.values()), 2)}
    rows, flagged = kept.get("chosen", (np.arange(n) if res.calibration else np.zeros(0, np.int64), None))
    pairs = None
    if "knn" in kept:
        nb, d2 = kept["knn"]
        i, j = np.nonzero(np.isfinite(d2) & (nb >= 0))
        a, b = i, nb[i, j]
        emb = np.zeros(n, bool)
        emb[rows] = True
        both = emb[a] & emb[b]
        pairs = int(len(np.unique(np.minimum(a, b)[both] * n + np.maximum(a, b)[both])))
    person = np.asarray(res.person, dtype=object)
    by_rule: dict[str, int] = {}
    wrong = 0
    for m in res.face_merges:
        by_rule[m["evidence"]] = by_rule.get(m["evidence"], 0) + 1
        recs = [int(r) for r in m["records"]]
        wrong += len({int(inp.truth[r]) for r in recs}) > 1
    row: dict = {"records": n, "ids": len(set(inp.ids)), "budget": budget, "wall_s": round(wall, 2),
                 "cpu_s": round(cpu, 2), "peak_rss_mib": round(rss.peak), "rss_before_mib": round(rss.base),
                 "steps": steps, "first_pass_flagged_records": flagged, "records_embedded": int(len(rows)),
                 "candidate_pairs_embedded": pairs,
                 "dlib_estimate_cpu_s": round(DLIB_CPU_S * len(rows), 1),
                 "merges": len(res.face_merges), "merges_by_rule": by_rule, "false_merges": wrong,
                 "normalized_merges": res.normalized_merges, "people_after": res.n_people}
    if res.calibration:
        cal = res.calibration
        row["calibration"] = {"threshold": cal["threshold"], "records_informative": cal["records_informative"],
                              "records_undecided": cal["records_undecided"], "subsets": len(cal["subsets"]),
                              "false_merge": cal["false_merge"], "miss": cal["miss"],
                              "undecided_subsets": [{k: v for k, v in sub.items() if k != "informative"}
                                                    for sub in cal["subsets"] if not sub["informative"]]}
    if inp.planted:
        undecided = set()
        if "cal" in kept:
            undecided = {int(r) for r, ok in zip(np.asarray(rows).tolist(), kept["cal"].informative) if not ok}
        row["planted"] = planted_figures(inp, person, set(np.asarray(rows).tolist()), undecided)
    return row


def planted_figures(inp: Input, person: np.ndarray, embedded: set[int], undecided: set[int]) -> dict:
    """How many planted copies resolved to their victim's person, by kind, with intervals (``undecided``: the
    embedded records in subsets the calibration found the recogniser does not separate)."""
    from deid.anonymise.identity_calibration import rate_interval as _interval  # noqa: PLC0415

    out: dict = {}
    for kind in sorted({p["kind"] for p in inp.planted}) + ["all"]:
        mine = [p for p in inp.planted if kind in ("all", p["kind"])]
        copies = [(p["victim"], r) for p in mine for r in p["copies"]]
        found = sum(person[r] == person[v] for v, r in copies)
        whole = sum(all(person[r] == person[p["victim"]] for r in p["copies"]) for p in mine)
        out[kind] = {"copies_found": _interval(found, len(copies), 0.95),
                     "victims_whole": _interval(whole, len(mine), 0.95),
                     "copies_embedded": sum(r in embedded for _, r in copies),
                     # people the victim and her copies resolved to, per victim (1: found whole)
                     "people_per_victim": [len({person[p["victim"]], *(person[r] for r in p["copies"])})
                                           for p in mine],
                     "victims_embedded": sum(p["victim"] in embedded for p in mine),
                     "copies_undecided": sum(r in undecided for _, r in copies)}
    return out


def one(args: argparse.Namespace, n: int | None) -> dict:
    logging.basicConfig(level=logging.WARNING)
    load = os.getloadavg()
    t = time.perf_counter()
    if args.staging:
        inp = staging_input(args.staging)
    elif args.input == "faces":
        inp = faces_input(n, args.victims, args.copies, args.seed)
    else:
        inp = vectors_input(n, args.victims, args.copies, args.seed)
    built = time.perf_counter() - t
    row = {"input": "staging" if args.staging else args.input, "input_s": round(built, 1),
           "input_mib": round((inp.features.nbytes + inp.cheap.nbytes) / 2**20), **measure(inp, args.budget),
           "process_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "load_before": [round(x, 2) for x in load], "load_after": [round(x, 2) for x in os.getloadavg()],
           "note": inp.note}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int, default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--input", choices=("vectors", "faces"), default="vectors")
    ap.add_argument("--staging", type=Path, help="a staged run's directory (data/staging/<release id>)")
    ap.add_argument("--budget", type=int, default=2000, help="DEID_IDENTITY_EMBED_MAX: faces the recogniser embeds")
    ap.add_argument("--victims", type=int, default=20)
    ap.add_argument("--copies", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="append each size's row to this file (JSON lines)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process of one size
    args = ap.parse_args()
    if args.one is not None or args.staging:
        print(json.dumps(one(args, args.one)), flush=True)
        return
    rows = []
    for n in args.sizes:
        cmd = [sys.executable, __file__, "--one", str(n), "--input", args.input, "--budget", str(args.budget),
               "--victims", str(args.victims), "--copies", str(args.copies), "--seed", str(args.seed)]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    print(f"{'records':>9} {'wall s':>7} {'CPU s':>7} {'peak MiB':>8} " + " ".join(f"{s[:10]:>10}" for s in
                                                                                   (*STEPS, "other"))
          + "  merges  found")
    for r in rows:
        p = r.get("planted", {}).get("all", {}).get("copies_found", {})
        print(f"{r['records']:>9} {r['wall_s']:>7} {r['cpu_s']:>7} {r['peak_rss_mib']:>8} "
              + " ".join(f"{r['steps'][s]['wall_s']:>10}" for s in (*STEPS, "other"))
              + f"  {r['merges']:>6}  {p.get('count')}/{p.get('n')} {p.get('interval')}")


if __name__ == "__main__":
    main()
