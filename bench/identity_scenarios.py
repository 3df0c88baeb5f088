"""Issue 27's Sybil drops and London figures for identity resolution, built in memory.

Usage:
    PYTHONPATH=$PWD .venv/bin/python bench/identity_scenarios.py [--cache /tmp/deid-identity-cache] [--london PATH]

Builds, from the London set (read in place, never copied into the repository) and ``deid synth``
cartoon faces (rendered in memory and aligned by deid), the aligned faces of:

* ``ramps``: London person 001's neutral photo, five copies lit by linear light ramps (gains whose
  average is 1: the copies' average is the original) under five fake ids, padded with 1,850
  synthetic faces and the rest of London (2,057 records in the issue);
* ``variants``: London minus 001, six variants of her photos (smiling, mirrored, blurred, mouth mask,
  forehead band, neutral) under six ids, plus 700 synthetic faces;
* ``london`` and ``london48``: London as it is, and every aligned face taken down to 48 x 48 grey and
  back up (the resolution of a 48 x 48 crop);
* ``feature``: one feature vector under five ids with Gaussian noise of 0.4 x the median
  nearest-other-person distance, among 400 synthetic people x 2.

and runs :func:`deid.anonymise.identity.resolve_people` (cheap first pass on self-quotient images, the
dlib recogniser on what it flags, calibration on the drop's own faces) on each, then prints the merges,
the calibrated threshold with its estimated false-merge and miss rates, and the within-cluster check
(:func:`deid.evaluation.identity_checks.within_cluster_check`) on a k-Same release of each drop.
dlib descriptors are cached per face (content hash) under ``--cache`` (outside the repository).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import time
from pathlib import Path

import cv2
import numpy as np
from london_set import add_london_option, london_dir

VICTIM = "001"


def london_aligned(london: Path) -> tuple[np.ndarray, list[str], list[str]]:
    """Aligned London faces (92 x 81 grey), their person ids and expression (neutral | smile)."""
    from deid.alignment.london import align_london

    faces, people, _, expr = align_london(london)
    return faces, people, expr


def synthetic_aligned(people: int, seed: int = 11) -> tuple[np.ndarray, list[str]]:
    """``people`` x 2 ``deid synth`` cartoon faces, aligned by deid (in memory)."""
    from deid.alignment.canonical import FaceAligner
    from deid.alignment.eyes import EyePair
    from deid.intake.synth import iter_synthetic_faces

    aligner = FaceAligner()
    faces, ids = [], []
    for person, _, _, img, eyes in iter_synthetic_faces(people=people, images_per_person=2, seed=seed):
        grey = img if img.ndim == 2 else cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
        faces.append(aligner.align(grey, EyePair(*eyes)).image.reshape(-1))
        ids.append(f"synth-{person.number}")
    return np.array(faces), ids


def ramp_copies(face: np.ndarray, shape: tuple[int, int], n: int = 5, strength: float = 0.45) -> np.ndarray:
    """``n`` copies of ``face`` lit by linear ramps in n directions (gains 1 + s.r, averaging to 1)."""
    h, w = shape
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    x, y = (x - (w - 1) / 2) / (w / 2), (y - (h - 1) / 2) / (h / 2)
    out = []
    for i in range(n):
        a = 2 * np.pi * i / n
        gain = 1 + strength * (np.cos(a) * x + np.sin(a) * y)
        out.append(np.clip(face.reshape(h, w) * gain, 0, 255).round().reshape(-1))
    return np.array(out, dtype=np.uint8)


def variants(neutral: np.ndarray, smiling: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Her six variants: neutral, smiling, mirrored, blurred, mouth mask, forehead band."""
    h, w = shape
    n = neutral.reshape(h, w)
    mirrored = n[:, ::-1]
    blurred = cv2.GaussianBlur(n, (0, 0), 2.0)
    mask = n.copy()
    mask[int(0.62 * h):int(0.9 * h), int(0.2 * w):int(0.8 * w)] = 200
    band = n.copy()
    band[int(0.05 * h):int(0.25 * h), :] = 40
    return np.array([v.reshape(-1) for v in (n, smiling.reshape(h, w), mirrored, blurred, mask, band)],
                    dtype=np.uint8)


def low_res(faces: np.ndarray, shape: tuple[int, int], side: int = 48) -> np.ndarray:
    h, w = shape
    out = [cv2.resize(cv2.resize(f.reshape(h, w), (side, side), interpolation=cv2.INTER_AREA), (w, h),
                      interpolation=cv2.INTER_LINEAR).reshape(-1) for f in faces]
    return np.array(out, dtype=np.uint8)


class CachedEmbed:
    """dlib descriptors, cached on disk by face content (outside the repository), counted."""

    def __init__(self, cache: Path):
        from deid.evaluation.recognizer import DlibEmbedder

        self.dir = cache
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model = DlibEmbedder()
        self.computed = 0
        self.asked = 0

    def __call__(self, faces: np.ndarray) -> np.ndarray:
        faces = np.ascontiguousarray(faces, dtype=np.uint8)
        out = np.empty((len(faces), 128), np.float32)
        todo = []
        for i, f in enumerate(faces):
            p = self.dir / (hashlib.blake2b(f.tobytes(), digest_size=16).hexdigest() + ".npy")
            if p.is_file():
                out[i] = np.load(p)
            else:
                todo.append(i)
        if todo:
            d = self.model.transform(faces[todo])
            for i, v in zip(todo, d):
                out[i] = v
                np.save(self.dir / (hashlib.blake2b(faces[i].tobytes(), digest_size=16).hexdigest() + ".npy"), v)
        self.asked += len(faces)
        self.computed += len(todo)
        return out


def lbp_features(faces: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    from deid.operations.worker_featurize import identity_cheap_features

    return identity_cheap_features(faces, shape)


def london_rates(faces: np.ndarray, people: list[str], expr: list[str], embed: CachedEmbed, res) -> None:
    """False-merge and miss rates on London at the calibrated threshold: every pair of different participants,
    and every neutral-smiling pair of one participant (the same person), with 95% Clopper-Pearson intervals."""
    from deid.anonymise.identity_calibration import rate_interval as _interval
    from deid.evaluation.recognizer import embedding_distances

    t = res.calibration["threshold"]
    E = embed(faces)
    D = embedding_distances(E, E)
    ids = np.array(people)
    iu = np.triu_indices(len(ids), 1)
    other = ids[iu[0]] != ids[iu[1]]
    same = ~other
    fm = _interval(int(np.count_nonzero(D[iu][other] < t)), int(other.sum()), 0.95)
    miss = _interval(int(np.count_nonzero(D[iu][same] >= t)), int(same.sum()), 0.95)
    print(f"   pairs at threshold {t}: false merges {fm}; misses (neutral vs smiling) {miss}; "
          f"closest different people {D[iu][other].min():.3f}, farthest same person {D[iu][same].max():.3f}")


def resolve(name: str, faces: np.ndarray, ids: list[str], embed: CachedEmbed, shape, *, budget: int,
            truth: list[str] | None = None) -> dict:  # noqa: PLR0913
    """Resolve one drop; print and return its figures (``truth``: the real person of each record)."""
    from deid.anonymise.identity import resolve_people

    t0 = time.process_time()
    cheap = lbp_features(faces, shape)
    t_cheap = time.process_time() - t0
    before = embed.computed + embed.asked
    embed.asked = 0
    res = resolve_people(ids, None, cheap=cheap, embed=lambda idx: embed(faces[idx]), embed_budget=budget)
    cal = res.calibration or {}
    wrong = 0
    if truth is not None:
        for m in res.face_merges:
            recs = [int(r) for r in m["records"]]
            wrong += len({truth[r] for r in recs}) > 1
    print(f"\n== {name}: {len(ids)} records, {len(set(ids))} ids; cheap pass {t_cheap:.1f} s CPU; "
          f"dlib on {embed.asked} faces (budget {budget})")
    print(f"   merges: {len(res.face_merges)} ({wrong} of different real people); people after merges {res.n_people}")
    if cal:
        print(f"   threshold {cal.get('threshold')}; false-merge per record {cal.get('false_merge')}; "
              f"miss {cal.get('miss')}; subsets {cal.get('subsets')}")
    del before
    return {"resolution": res, "wrong": wrong}


def cluster_check(name: str, faces: np.ndarray, people: list[str], partitions: list[str], shape, *,
                  budget: int, k: int = 5, victim_rows: list[int] | None = None,
                  victim_face: np.ndarray | None = None) -> None:
    """k-Same-Select release of the drop (``people`` as resolved), then the within-cluster check on it."""
    from deid.anonymise.methods import deidentify
    from deid.evaluation.identity_checks import image_check
    from deid.evaluation.leaks import mean_abs_difference

    # Partitions with fewer than k people are suppressed (the release flow's small-partition rule).
    per = {}
    for p, q in zip(partitions, people):
        per.setdefault(p, set()).add(q)
    keep = [i for i, p in enumerate(partitions) if len(per[p]) >= k]
    dropped = len(people) - len(keep)
    X, P, Q = faces[keep], [people[i] for i in keep], [partitions[i] for i in keep]
    t0 = time.process_time()
    released, clusters = deidentify(X, shape=shape, people=P, partitions=Q, method="k-same-select", k=k)
    check = image_check(clusters, P, X, released, shape=shape, budget=budget)
    cpu = time.process_time() - t0
    print(f"   [{name}] k={k}: {dropped} records suppressed (partitions of < k people); "
          f"{check.name} {'PASS' if check.passed else 'FAIL'} value={check.value} n={check.n} "
          f"interval={check.interval} ({cpu:.1f} s CPU)")
    print(f"      {check.detail[:600]}")
    if victim_rows is not None and victim_face is not None:
        kept = [keep.index(r) for r in victim_rows if r in keep]
        if kept:
            own = float(mean_abs_difference(released[kept[:1]], victim_face[None])[0])
            normal = mean_abs_difference(released, X)
            print(f"      her cluster's released image: {own:.2f} grey levels from her real face "
                  f"(released vs own original, all records: 1st percentile {np.percentile(normal, 1):.2f})")
        else:
            print("      her records: none released")


def feature_scenario(k: int = 5) -> None:
    """One vector under five ids with Gaussian noise of 0.4 x the median nearest-other-person distance,
    among ``deid synth-features`` people: identity resolution, then k-Same-Select (her copies alone in their
    label partition, as with a label value no one else has) and the within-cluster check in feature space."""
    from deid.anonymise.identity import resolve_people
    from deid.anonymise.methods import deidentify
    from deid.evaluation.identity_checks import feature_check
    from deid.evaluation.leaks import other_person_scale
    from deid.intake.synth_features import synthetic_features

    data = synthetic_features(people=400, per_person=2, dim=32, seed=3)
    X, people = data.vectors.astype(np.float64), list(data.people)
    scale = other_person_scale(X, people)
    rng = np.random.default_rng(4)
    victim = X[0]
    copies = victim + rng.normal(0, 0.4 * scale / np.sqrt(X.shape[1]), (5, X.shape[1]))
    keep = [i for i, p in enumerate(people) if p != people[0]]
    V = np.vstack([X[keep], copies])
    ids = [people[i] for i in keep] + [f"sybil-{i}" for i in range(5)]
    res = resolve_people(ids, V, space="feature")
    merged = len({res.person[i] for i in range(len(keep), len(V))}) == 1
    print(f"\n== feature copies (noise 0.4 x {scale:.3f}): {len(V)} records; identity merges {len(res.face_merges)}; "
          f"copies one person: {merged}")
    for label, who in (("as resolved", list(res.person)), ("identity missed: raw ids", ids)):
        part = ["a"] * len(keep) + ["sybil-label"] * 5
        per: dict[str, set] = {}
        for p, q in zip(part, who):
            per.setdefault(p, set()).add(q)
        rows = [i for i, p in enumerate(part) if len(per[p]) >= k]
        Vk, P, Q = V[rows], [who[i] for i in rows], [part[i] for i in rows]
        # The k-Same-Select grouping; each record released as its cluster's mean vector (the feature path's rule;
        # deidentify's own output is images, clipped to 0..255).
        _, clusters = deidentify(Vk, shape=(1, Vk.shape[1]), people=P, partitions=Q, method="k-same-select", k=k)
        clusters = np.asarray(clusters)
        means = {c: Vk[clusters == c].mean(0) for c in np.unique(clusters)}
        released = np.array([means[c] for c in clusters])
        check = feature_check(clusters, P, Vk, released)
        sybil = [rows.index(i) for i in range(len(keep), len(V)) if i in rows]
        where = (f"her cluster's released vector {np.linalg.norm(released[sybil[0]] - victim) / scale:.2f} x the "
                 f"scale from her true vector" if sybil else "her records: none released")
        print(f"   [{label}] {len(V) - len(rows)} suppressed; {check.name} {'PASS' if check.passed else 'FAIL'} "
              f"value={check.value} n={check.n} interval={check.interval}; {where}")
        print(f"      {check.detail[:400]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/deid-identity-cache"))
    ap.add_argument("--budget", type=int, default=2000)
    ap.add_argument("--only", default="")
    add_london_option(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    shape = (92, 81)
    embed = CachedEmbed(args.cache)
    faces, people, expr = london_aligned(london_dir(args.london))
    want = set(args.only.split(",")) if args.only else None

    if want is None or "london" in want:
        out = resolve("London", faces, people, embed, shape, budget=args.budget, truth=people)
        london_rates(faces, people, expr, embed, out["resolution"])
        cluster_check("London", faces, people, expr, shape, budget=args.budget)
        resolve("London, first pass only (budget 120)", faces, people, embed, shape, budget=120, truth=people)
    if want is None or "feature" in want:
        feature_scenario()
    if want is None or "london48" in want:
        low = low_res(faces, shape)
        out = resolve("London at 48x48 grey", low, people, embed, shape, budget=args.budget, truth=people)
        london_rates(low, people, expr, embed, out["resolution"])
        rng = np.random.default_rng(0)
        noisy = np.clip(low[:5].astype(np.float64) + rng.normal(0, 3, (5, low.shape[1])), 0, 255).astype(np.uint8)
        relit = ramp_copies(low[7], shape)
        X = np.vstack([low, noisy, relit])
        ids = people + [f"noisy-{i}" for i in range(5)] + [f"relit-{i}" for i in range(5)]
        out = resolve("London at 48x48 + 5 noisy copies + 5 re-lit copies under new ids", X, ids, embed, shape,
                      budget=args.budget, truth=people + people[:5] + [people[7]] * 5)
        per = out["resolution"].person
        print(f"   noisy copies merged with their original: {sum(per[204 + i] == per[i] for i in range(5))}/5; "
              f"re-lit copies merged with their original: {sum(per[209 + i] == per[7] for i in range(5))}/5")
    victim_n = faces[[i for i, (p, e) in enumerate(zip(people, expr)) if p == VICTIM and e == "neutral"][0]]
    victim_s = faces[[i for i, (p, e) in enumerate(zip(people, expr)) if p == VICTIM and e == "smile"][0]]
    if want is None or "ramps" in want:
        sf, sid = synthetic_aligned(925)
        keep = [i for i, p in enumerate(people) if p != VICTIM]
        X = np.vstack([faces[keep], ramp_copies(victim_n, shape), sf])
        ids = [people[i] for i in keep] + [f"sybil-{i}" for i in range(5)] + sid
        truth = [people[i] for i in keep] + [VICTIM] * 5 + sid
        out = resolve("five ramp-lit copies", X, ids, embed, shape, budget=args.budget, truth=truth)
        part = ["a"] * len(keep) + ["sybil-label"] * 5 + ["a"] * len(sid)
        rows = list(range(len(keep), len(keep) + 5))
        cluster_check("as resolved", X, list(out["resolution"].person), part, shape, budget=args.budget,
                      victim_rows=rows, victim_face=victim_n)
        cluster_check("identity missed: raw ids", X, ids, part, shape, budget=args.budget, victim_rows=rows,
                      victim_face=victim_n)
    if want is None or "variants" in want:
        sf, sid = synthetic_aligned(350)
        keep = [i for i, p in enumerate(people) if p != VICTIM]
        X = np.vstack([faces[keep], variants(victim_n, victim_s, shape), sf])
        ids = [people[i] for i in keep] + [f"sybil-{i}" for i in range(6)] + sid
        truth = [people[i] for i in keep] + [VICTIM] * 6 + sid
        out = resolve("six variants padded", X, ids, embed, shape, budget=args.budget, truth=truth)
        part = ["a"] * len(keep) + ["sybil-label"] * 6 + ["a"] * len(sid)
        rows = list(range(len(keep), len(keep) + 6))
        cluster_check("as resolved", X, list(out["resolution"].person), part, shape, budget=args.budget,
                      victim_rows=rows, victim_face=victim_n)
        cluster_check("identity missed: raw ids", X, ids, part, shape, budget=args.budget, victim_rows=rows,
                      victim_face=victim_n)


if __name__ == "__main__":
    main()
