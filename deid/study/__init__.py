"""The comparison study: every de-identification method over its range of strengths, judged by the gate.

For each method of :data:`deid.anonymise.methods.REGISTRY` and each strength the aligned faces of a
drop (or, for a feature drop, each of :data:`deid.anonymise.methods.FEATURE_METHODS` on its
vectors, judged by the feature-space attackers) are de-identified and passed to the release gate
itself (:func:`deid.evaluation.gate.evaluate`):
every attacker x mode rate with its one-sided Clopper-Pearson interval (Bonferroni over the
family), the exact max person share where clusters are identical copies, the leak checks and
the cross-fitted utility per label. The plots reproduce the shape of Gross et al. (2005)
Fig. 6 (re-identification against strength, with the 1/k curve) and Fig. 8 (utility per
label), the privacy-utility map of Gross et al. (2009) Fig. 12, and a grid of released
faces (never originals): :mod:`deid.study.plots`.
"""
from __future__ import annotations

import csv
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from deid.anonymise.randomness import ReleaseSeed
from deid.contracts import MethodInputs
from deid.evaluation.checks import Check
from deid.errors import ConfigError, DataError
from deid.evaluation.gate_types import GateConfig, GateInputs, GateResult
from deid.evaluation.gate import evaluate
from deid.bound import within_bound

logger = logging.getLogger(__name__)

CACHE = "aligned.npz"
CACHE_VERSION = 3  # 2: the landmark points and the sequence/frame columns are cached with the faces; 3: video
# frames aligned on the eyes ingest staged (as the flow aligns them)
# Long format: one row per gate check, attacker x mode, label x utility protocol, and one
# verdict row per (method, strength). ``lower``/``upper``/``n`` are a rate's one-sided
# Clopper-Pearson bounds (Bonferroni over ``bonferroni`` pairs) and distinct probes, or the
# cross-fitted accuracy drop's bootstrap bounds and held-out test images.
CSV_COLUMNS = ("method", "strength_name", "strength", "k", "kind", "check", "attacker", "mode", "label", "protocol",
               "rate", "lower", "upper", "n", "records", "confidence", "bonferroni", "bound", "status", "verdict",
               "value", "threshold", "accuracy", "original_accuracy", "delta", "max_person_share", "exact_bound",
               "min_distance", "seconds", "detail")


def _aligner_params() -> dict:
    from deid.run_config import AlignerParams  # noqa: PLC0415 - settings read only when aligning
    from deid.settings import Settings  # noqa: PLC0415

    # Grey only: the study measures what the gate measures.
    return {**AlignerParams.from_settings(Settings()).to_dict(), "color": False}


@dataclass(frozen=True)
class StudyDrop:
    """The usable records of a drop as the study de-identifies them: what the flow's partitions hold.

    ``pixels`` (n, height * width) uint8 aligned faces, or (n, d) float32 feature vectors;
    ``people`` (n,) subject ids; ``labels`` label name -> (n,) values; ``shape`` (height, width)
    or (d,). ``points``: per record its landmarks in canonical pixels, flattened (None: none),
    or None for a drop without a points column; ``sequences``/``frames``: per record its
    sequence key and frame number (None: a still image), or None for a drop without them.
    """

    pixels: np.ndarray
    people: np.ndarray
    labels: dict[str, np.ndarray]
    shape: tuple[int, ...]
    points: list | None = None
    sequences: list | None = None
    frames: list | None = None

    @property
    def inputs(self) -> MethodInputs:
        """What the records give the method beyond pixels and labels (the flow's ``Partitioned.inputs``)."""
        return MethodInputs.of(points=self.points, sequences=self.sequences)


def load_aligned(drop_dir: str | Path, workdir: str | Path, *, labels: list[str] | None = None) -> StudyDrop:
    """Aligned faces of a drop, via the release pipeline's own read, ingest and align steps.

    The result is cached in ``workdir/aligned.npz``, keyed by the manifest bytes, the labels
    and the canonical geometry, so reruns skip decoding and alignment. Quarantined records
    are left out (their count is logged). The landmark points (moved to canonical pixels by the
    alignment, as the flow's aligned faces carry them) and the sequence/frame columns come with
    the faces, so every method gets the inputs ``deid run`` gives it.
    """
    from deid.intake.drop import read_drop  # noqa: PLC0415
    from deid.alignment.align import tracked_eyes_finder  # noqa: PLC0415
    from deid.intake.ingest import ingest  # noqa: PLC0415
    from deid.operations.worker_align import align_batch  # noqa: PLC0415
    from deid.operations.worker_rows import read_pixels  # noqa: PLC0415

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    drop = read_drop(drop_dir, labels=labels)
    params = _aligner_params()
    key = hashlib.sha256(drop.manifest_bytes + json.dumps([drop.labels, params, CACHE_VERSION],
                                                          sort_keys=True).encode()).hexdigest()
    cache = work / CACHE
    if cache.is_file():
        with np.load(cache, allow_pickle=False) as z:
            if str(z["key"]) == key:
                logger.info("study: aligned faces from cache %s", cache)
                return _from_cache(z)
    t0 = time.perf_counter()
    ingested = work / "ingested.parquet"
    aligned = work / "aligned.parquet"
    try:
        # A video's frames are staged with their eyes, as the release flow stages them (deid.operations.ingest_align):
        # the study judges the faces the flow would release.
        res = ingest(drop, ingested, eyes_finder=tracked_eyes_finder() if drop.has_videos else None)
        out = align_batch(str(ingested), list(range(res.row_groups)), str(aligned), params)
        import pyarrow.parquet as pq  # noqa: PLC0415

        ids, pixels = read_pixels([str(aligned)])
        # The canonical landmarks as the aligned faces carry them (the flow's partitions read the same column).
        has_points = "points" in pq.read_schema(aligned).names
        canon = (dict(zip(*pq.read_table(aligned, columns=["record_id", "points"]).to_pydict().values()))
                 if has_points else None)
        seq_cols = ["sequence", "frame"] if "sequence" in pq.read_schema(ingested).names else []
        meta = pq.read_table(ingested, columns=["record_id", "subject_id", *drop.labels, *seq_cols]).to_pydict()
    finally:
        ingested.unlink(missing_ok=True)  # it holds a copy of every source image
        aligned.unlink(missing_ok=True)
    row = {rid: i for i, rid in enumerate(meta["record_id"])}
    take = [row[r] for r in ids]
    people = np.asarray([meta["subject_id"][i] for i in take], dtype=object)
    labs = {n: np.asarray([meta[n][i] for i in take], dtype=object) for n in drop.labels}
    points = None if canon is None else [canon[r] for r in ids]
    sequences = [meta["sequence"][i] for i in take] if seq_cols else None
    frames = [meta["frame"][i] for i in take] if seq_cols else None
    w, h = params["size"]
    n_bad = len(drop.quarantined) + len(res.quarantined) + len(out.quarantined)
    logger.info("study: %d faces aligned, %d quarantined, in %.1f s", len(ids), n_bad, time.perf_counter() - t0)
    if len(ids) == 0:
        raise DataError(f"no face of drop {drop_dir} could be aligned ({n_bad} quarantined); check the drop")
    out = StudyDrop(pixels, people, labs, (h, w), points=points, sequences=sequences, frames=frames)
    _to_cache(cache, key, out)
    return out


def _to_cache(path: Path, key: str, d: StudyDrop) -> None:
    """``d`` as one npz without pickles: optional columns as arrays plus a mask of the records that have a value."""
    extra: dict[str, np.ndarray] = {}
    if d.points is not None:
        have = np.array([p is not None for p in d.points], dtype=bool)
        width = max((len(p) for p in d.points if p is not None), default=0)
        # Points per record all have the drop's count (read_drop quarantines others).
        pts = np.zeros((len(d.points), width), np.float64)
        for i, p in enumerate(d.points):
            if p is not None:
                pts[i] = p
        extra.update(points=pts, points_mask=have)
    if d.sequences is not None:
        extra.update(sequences=np.array(["" if q is None else str(q) for q in d.sequences]),
                     frames=np.array([-1 if f is None else int(f) for f in d.frames], dtype=np.int64),
                     sequences_mask=np.array([q is not None for q in d.sequences], dtype=bool))
    np.savez(path, key=np.array(key), pixels=d.pixels, people=d.people.astype(str), shape=np.array(d.shape),
             label_names=np.array(list(d.labels)), **{f"label_{n}": v.astype(str) for n, v in d.labels.items()},
             **extra)


def _from_cache(z) -> StudyDrop:
    names = [str(x) for x in z["label_names"]]
    points = sequences = frames = None
    if "points" in z.files:
        points = [row.tolist() if ok else None for row, ok in zip(z["points"], z["points_mask"])]
    if "sequences" in z.files:
        ok = z["sequences_mask"]
        sequences = [str(q) if o else None for q, o in zip(z["sequences"], ok)]
        frames = [int(f) if o else None for f, o in zip(z["frames"], ok)]
    return StudyDrop(z["pixels"], z["people"].astype(object), {n: z[f"label_{n}"].astype(object) for n in names},
                     (int(z["shape"][0]), int(z["shape"][1])), points=points, sequences=sequences, frames=frames)


def load_features(drop_dir: str | Path, *, labels: list[str] | None = None) -> StudyDrop:
    """The usable records of a feature drop (:func:`deid.intake.features.read_feature_drop`; bad rows left out).

    ``pixels`` are the vectors (n, d) float32 and ``shape`` is ``(d,)``, as :func:`load_aligned` returns faces.
    """
    from deid.intake.features import read_feature_drop  # noqa: PLC0415

    drop = read_feature_drop(drop_dir, labels=labels)
    logger.info("study: %d feature records (dim %d), %d quarantined", len(drop.record_ids), drop.dim,
                len(drop.quarantined))
    if not drop.record_ids:
        raise DataError(f"no record of feature drop {drop_dir} is usable ({len(drop.quarantined)} quarantined); "
                        "check the drop")
    people = np.asarray(drop.subject_ids, dtype=object)
    labs = {x: np.asarray(drop.label_values[x], dtype=object) for x in drop.labels}
    return StudyDrop(np.asarray(drop.vectors, dtype=np.float32), people, labs, (drop.dim,))


@dataclass(frozen=True)
class StudyConfig:
    """The strengths to study and the gate that judges every point.

    ``gate`` is a template :class:`deid.evaluation.gate_types.GateConfig` (confidence, sample caps, attackers,
    modes, folds, repeats, seed, ...); its ``k``, ``method`` and ``labels`` are replaced per
    point. Methods whose strength is not k (blur, pixelate) are judged against the smallest
    k studied, the most lenient 1/k bound. ``methods=None`` studies every method of
    :data:`deid.anonymise.methods.REGISTRY` (of :data:`deid.anonymise.methods.FEATURE_METHODS` for a feature
    drop), each with its default options. ``workers`` > 1 studies points in that many forked
    processes (each embeds the originals for the deep attacker once).

    ``seed``: the methods' random state, under the release flow's policy
    (:class:`deid.anonymise.randomness.ReleaseSeed`): None draws a secret seed from the OS for every
    point's release and the parrot attacker re-runs the method with an independent one; an integer
    (``deid study --seed``, ``DEID_SEED``) fixes it, not secret, and the parrot uses that same seed.
    """

    ks: Sequence[int] = (2, 3, 5, 10)
    sigmas: Sequence[float] = (1, 2, 4, 8)
    blocks: Sequence[int] = (2, 4, 8, 16)
    methods: Sequence[str] | None = None
    labels: Sequence[str] | None = None
    gate: GateConfig = field(default_factory=lambda: GateConfig(k=2, method="k-same"))
    examples: int = 3
    workers: int = 1
    seed: int | None = None


@dataclass(frozen=True)
class StudyResult:
    """Long-format rows (:data:`CSV_COLUMNS`) and a few released faces per point for the example grid.

    ``examples`` maps ``(method, strength_name, strength)`` to the released faces of the
    records ``example_records`` (de-identified faces only; never originals).
    """

    rows: list[dict]
    examples: dict[tuple[str, str, float], np.ndarray]
    example_records: np.ndarray
    shape: tuple[int, int]


def _points(cfg: StudyConfig, kind: str = "images") -> list[tuple[str, str, float, int]]:
    """(method, strength name, strength, k of the gate) for every point of the study."""
    from deid.method_registry import IMAGE_ONLY_METHODS  # noqa: PLC0415
    from deid.anonymise.methods import FEATURE_METHODS, METHODS, method_spec  # noqa: PLC0415

    valid = list(FEATURE_METHODS) if kind == "features" else list(METHODS)
    methods = list(valid) if cfg.methods is None else list(cfg.methods)
    bad = [m for m in methods if m not in valid]
    if bad or not methods:
        raise ConfigError(f"methods={methods!r} must be a non-empty subset of {valid}"
                          + (f" (a feature drop: {', '.join(IMAGE_ONLY_METHODS)} need face images)"
                             if kind == "features" else ""))
    ranges = {"k": list(cfg.ks), "sigma": list(cfg.sigmas), "block": list(cfg.blocks)}
    bad_k = [k for k in ranges["k"] if isinstance(k, bool) or int(k) != k or k < 2]
    if bad_k:
        raise ConfigError(f"ks={ranges['k']!r}: every k must be an integer >= 2, e.g. --k 2,3,5,10")
    reference_k = int(min(ranges["k"])) if ranges["k"] else 2
    out = []
    for m in methods:
        name = method_spec(m).strength
        if not ranges[name]:
            raise ConfigError(f"method {m!r} needs at least one --{name} value")
        out.extend((m, name, v, int(v) if name == "k" else reference_k) for v in ranges[name])
    return out


def _partition_keys(labels: dict[str, np.ndarray], names: list[str], n: int) -> np.ndarray:
    """One string key per face: its joint utility-label values (the flow's label partitions)."""
    keys = np.empty(n, dtype=object)
    keys[:] = ["|".join(str(labels[x][i]) for x in names) for i in range(n)] if names else [""] * n
    return keys


def _example_records(people: np.ndarray, count: int, seed: int) -> np.ndarray:
    """``count`` records of different people, seeded (the faces shown in the example grid)."""
    rng = np.random.default_rng(seed)
    first = {}
    for i, p in enumerate(people):
        first.setdefault(p, i)
    pool = np.array(sorted(first.values()))
    return np.sort(rng.choice(pool, size=min(count, len(pool)), replace=False)) if len(pool) else pool


def _interval(c: Check) -> tuple[float | None, float | None]:
    return (None, None) if c.interval is None else (float(c.interval[0]), float(c.interval[1]))


def gate_rows(result: GateResult, base: dict, *, k: int, confidence: float) -> list[dict]:
    """The gate's result for one point as study rows: checks, attacks, utility and the verdict."""
    rows: list[dict] = []
    m = len(result.reidentification)
    bound = 1.0 / k
    for c in result.checks:
        lo, hi = _interval(c)
        rows.append({**base, "kind": "check", "check": c.name, "status": c.status, "value": c.value,
                     "threshold": c.threshold, "lower": lo, "upper": hi, "n": c.n, "detail": c.detail})
    for r in result.reidentification:
        # The gate's rule: with identical copies per cluster a rate fails only if its lower
        # bound exceeds 1/k (the exact share decides); otherwise its upper bound must not.
        failing = not within_bound(r.lower if result.exact_bound else r.upper, limit=bound)
        rows.append({**base, "kind": "privacy", "attacker": r.attacker, "mode": r.mode, "rate": r.rate,
                     "lower": r.lower, "upper": r.upper, "n": r.n_probes, "records": r.records,
                     "confidence": confidence, "bonferroni": m, "bound": bound,
                     "status": r.status or ("fail" if failing else "pass")})
    for u in result.utility:
        ev = u.evidence
        if u.protocol == "cross-fit":
            rows.append({**base, "kind": "utility", "label": u.label, "protocol": "cross-fit",
                         "accuracy": ev["accuracy_release"], "original_accuracy": ev["accuracy_original"],
                         "delta": ev["delta"], "lower": ev["delta_lower"], "upper": ev["delta_upper"],
                         "n": ev["n_test_images"], "threshold": u.tolerance, "status": ev["decision"],
                         "confidence": ev["confidence"], "detail": u.detail})
        else:
            rows.append({**base, "kind": "utility", "label": u.label, "protocol": u.protocol,
                         "accuracy": u.deidentified_accuracy, "original_accuracy": u.original_accuracy,
                         "status": "evidence", "detail": u.detail})
    leak = next((c for c in result.checks if c.name == "no_near_copies"), None)
    worst = max(result.reidentification, key=lambda r: r.upper or 0.0, default=None)
    rows.append({**base, "kind": "verdict", "verdict": "pass" if result.passed else "fail",
                 "status": "pass" if result.passed else "fail", "rate": result.max_rate,
                 "upper": None if worst is None else worst.upper, "bonferroni": m, "confidence": confidence,
                 "bound": bound, "max_person_share": result.max_person_share, "exact_bound": result.exact_bound,
                 "min_distance": None if leak is None else leak.value,
                 "detail": "; ".join(result.reasons) if not result.passed else "; ".join(result.warnings)})
    return rows


def run_study(pixels: np.ndarray, people: Sequence, labels: dict[str, np.ndarray], shape: tuple[int, ...],
              cfg: StudyConfig | None = None, *, kind: str = "images", points: Sequence | None = None,
              sequences: Sequence | None = None, frames: Sequence | None = None) -> StudyResult:
    """Every method at every strength, judged by the release gate itself.

    ``kind="features"``: ``pixels`` are a feature drop's vectors and ``shape`` is ``(d,)``; the
    methods are :func:`deid.anonymise.features.deidentify_vectors`, the gate's feature-space
    attackers judge them and the study has no example faces.

    Each point de-identifies the aligned faces with :func:`deid.anonymise.methods.deidentify` (label
    partitions, labels, landmark ``points`` and ``sequences``/``frames`` passed as the release flow
    passes them: :class:`deid.contracts.MethodInputs` decides, as in the flow's gate, whether the
    gate's re-runs get the points and the sequence model), then calls
    :func:`deid.evaluation.gate.evaluate` on :meth:`deid.evaluation.gate_types.GateInputs.from_arrays` with the run's
    method runner (parrot attacker, cross-fitted utility) and the template gate config, so
    every point carries exactly the gate's verdict: every attacker x mode rate with its
    one-sided Clopper-Pearson interval (Bonferroni over the attacker x mode family), the
    exact max person share where clusters are identical copies, the leak checks and the
    cross-fitted utility per label (with the older protocols as evidence).

    Returns
    -------
    StudyResult
        ``rows`` with :data:`CSV_COLUMNS` (``kind`` is ``check``, ``privacy``, ``utility``,
        ``verdict`` or ``skipped``) and the example faces.

    References
    ----------
    R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility into face
    de-identification. PET 2005 (Figs. 6 and 8). R. Gross, L. Sweeney, J. Cohn, F. de la
    Torre, S. Baker. Face de-identification. In Protecting Privacy in Video Surveillance,
    Springer, 2009 (Fig. 12, the privacy-utility map).
    """
    cfg = cfg or StudyConfig()
    pixels = np.asarray(pixels)
    n = len(pixels)
    names = _checked_study_inputs(cfg, labels, kind, n, {"points": points, "sequences": sequences, "frames": frames})
    people = np.asarray(people, dtype=object)
    labs = {x: np.asarray(labels[x], dtype=object) for x in names}
    chosen = _example_records(people, cfg.examples, cfg.gate.seed)
    data = _PointData(pixels=pixels, people=people, labels=labs, shape=tuple(shape),
                      partitions=_partition_keys(labs, names, n), examples=chosen, gate=cfg.gate, kind=kind,
                      seed=cfg.seed,
                      points=None if points is None else list(points),
                      sequences=None if sequences is None else list(sequences),
                      frames=None if frames is None else list(frames))
    points = _points(cfg, kind)
    logger.info("study: %s", ReleaseSeed.draw(cfg.seed).statement)  # the flow's policy, as its report says
    results = _study_all_points(data, points, cfg.workers)
    rows: list[dict] = []
    examples: dict[tuple[str, str, float], np.ndarray] = {}
    for (method, sname, strength, _), (point_rows, faces) in zip(points, results):
        rows.extend(point_rows)
        if faces is not None:
            examples[(method, sname, strength)] = faces
    return StudyResult(rows=rows, examples=examples, example_records=chosen[:0] if kind == "features" else chosen,
                       shape=tuple(shape))


def _checked_study_inputs(cfg: StudyConfig, labels: dict[str, np.ndarray], kind: str, n: int,
                          columns: dict[str, Sequence | None]) -> list[str]:
    """The label names the study judges, after checking ``kind``, ``cfg.workers`` and the per-record ``columns``.

    Raises
    ------
    DataError
        A label of ``cfg.labels`` the drop does not have.
    ConfigError
        An unknown ``kind``, ``workers`` not an integer >= 1, a column not one entry per record, or points or
        sequences given for a feature drop.
    """
    names = list(cfg.labels) if cfg.labels else list(labels)
    missing = [x for x in names if x not in labels]
    if missing:
        raise DataError(f"labels {missing} are not in the drop's labels {sorted(labels)}")
    if kind not in ("images", "features"):
        raise ConfigError(f"kind={kind!r} must be 'images' (aligned faces) or 'features' (feature vectors)")
    if isinstance(cfg.workers, bool) or not isinstance(cfg.workers, int) or cfg.workers < 1:
        raise ConfigError(f"workers={cfg.workers!r} must be an integer >= 1 (processes studying points in parallel)")
    for name, col in columns.items():
        if col is not None and len(col) != n:
            raise ConfigError(f"{name} has {len(col)} entries but pixels has {n} rows; one entry per record")
    if kind == "features" and (columns["points"] is not None or columns["sequences"] is not None):
        raise ConfigError("points and sequences are face-image inputs; a feature drop has neither")
    return names


def _study_all_points(data: _PointData, points: list, workers: int) -> list:
    """Each point's ``(rows, example faces)``, in the points' order: here, or on ``workers`` forked processes."""
    if workers == 1 or len(points) == 1:
        return [_study_point(data, point) for point in points]
    import multiprocessing  # noqa: PLC0415
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

    _prime_descriptors(data, n_points=len(points))
    # Forked workers inherit the faces (and the originals' descriptors); each studies whole
    # points, the costliest first so that no worker is left with a long one at the end
    # (longest-processing-time-first; results are put back in the points' order).
    order = sorted(range(len(points)), key=lambda i: _expected_cost(points[i]), reverse=True)
    with ProcessPoolExecutor(min(workers, len(points)), mp_context=multiprocessing.get_context("fork"),
                             initializer=_set_worker_data, initargs=(data,)) as pool:
        done = list(pool.map(_study_worker_point, [points[i] for i in order], chunksize=1))
    results: list = [None] * len(points)
    for i, r in zip(order, done):
        results[i] = r
    return results


@dataclass(frozen=True, kw_only=True)
class _PointData(StudyDrop):
    """What every point of a study shares: the drop's records plus their partitions, examples and gate."""

    partitions: np.ndarray
    examples: np.ndarray
    gate: GateConfig
    kind: str = "images"
    seed: int | None = None  # StudyConfig.seed: None = a secret seed per point's release


_WORKER_DATA: _PointData | None = None


def _expected_cost(point: tuple[str, str, float, int]) -> tuple[int, float]:
    """A rank of a point's cost: methods giving every face its own image first (the deep recogniser
    embeds each of them, and their parrot galleries), then the k methods by increasing k (more
    distinct images)."""
    from deid.anonymise.methods import method_spec  # noqa: PLC0415

    method, sname, strength, _ = point
    per_face = not method_spec(method).identical_within_cluster
    return (int(per_face), -float(strength) if sname == "k" else 0.0)


def _prime_descriptors(data: _PointData, *, n_points: int) -> None:
    """Embed the originals once in the parent, so forked workers share their dlib descriptors.

    Every point's deep attack embeds the originals of its sample; the descriptor cache is per
    process, so without this each worker would embed them again (~0.1 s of CPU per face). Only
    when the deep attacker runs and the points' samples would cover most originals anyway.
    """
    from deid.evaluation.attacks import DEEP_ATTACKERS  # noqa: PLC0415

    g = data.gate
    deep = g.attackers is None or any(a in DEEP_ATTACKERS for a in g.attackers)
    if data.kind != "images" or not deep or len(data.pixels) > n_points * g.deep_attack_sample:
        return
    from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415

    t0 = time.process_time()
    DlibEmbedder(tuple(data.shape)).transform(data.pixels)
    logger.info("study: dlib descriptors of the %d originals computed once for the workers (%.1f CPU s)",
                len(data.pixels), time.process_time() - t0)


def _set_worker_data(data: _PointData) -> None:
    global _WORKER_DATA  # noqa: PLW0603 - one study's data per worker process
    _WORKER_DATA = data


def _study_worker_point(point: tuple[str, str, float, int]) -> tuple[list[dict], np.ndarray | None]:
    return _study_point(_WORKER_DATA, point)


def _study_point(data: _PointData, point: tuple[str, str, float, int]) -> tuple[list[dict], np.ndarray | None]:
    """One (method, strength): de-identify as the flow does, then the gate's verdict as rows."""
    from deid.anonymise.features import deidentify_vectors, vector_method_runner  # noqa: PLC0415
    from deid.anonymise.methods import deidentify, method_runner  # noqa: PLC0415

    method, sname, strength, k = point
    t0 = time.perf_counter()
    kw = {sname: strength}
    g = data.gate
    base = {"method": method, "strength_name": sname, "strength": strength, "k": k}
    # The release flow's policy (deid.anonymise.randomness): a secret seed per release unless fixed.
    seed = ReleaseSeed.draw(data.seed)
    common = dict(people=list(data.people), partitions=list(data.partitions), method=method,
                  labels={x: list(v) for x, v in data.labels.items()} or None, seed=seed.value, **kw)
    features = data.kind == "features"
    try:
        if features:
            released, clusters = deidentify_vectors(data.pixels, **common)
            released = released.astype(np.float32)  # as a feature release stores them
        else:
            released, clusters = deidentify(data.pixels, shape=data.shape, n_components=g.n_components,
                                            points=data.points, sequences=data.sequences, frames=data.frames, **common)
    except ConfigError as exc:  # e.g. a label partition with fewer than k people
        logger.warning("study: %s %s=%s skipped: %s", method, sname, strength, exc)
        return [{**base, "kind": "skipped", "verdict": "skipped", "detail": str(exc)}], None
    given = data.inputs  # the flow's contract: what the gate's re-runs of the method get
    extra = ()
    if given.frames:  # as the flow's stage: every released video must fit >= k people
        from deid.evaluation.sequences import sequence_linkage_check  # noqa: PLC0415

        own = np.arange(len(data.pixels)) if clusters is None else clusters  # no clusters: one per record
        extra = (sequence_linkage_check(data.sequences, list(own), list(data.people), k=k),)
    parrot_seed = seed.for_parrot()  # what the attacker is assumed to know: as the flow's gate
    runner = (vector_method_runner(method, seed=parrot_seed, **kw) if features
              else method_runner(method, shape=data.shape, n_components=g.n_components, seed=parrot_seed,
                                 options=given.gate_options(method), **kw))
    inputs = GateInputs.from_arrays(
        shape=data.shape, people=data.people, released=released, originals=data.pixels, clusters=clusters,
        partitions=data.partitions, labels=data.labels, records_in=len(data.pixels), deidentify=runner,
        kind=data.kind, points=data.points if given.gate_points(method) else None, extra_checks=extra)
    result = evaluate(inputs, replace(g, k=k, method=method, labels=tuple(data.labels)))
    seconds = round(time.perf_counter() - t0, 2)
    rows = gate_rows(result, base, k=k, confidence=g.confidence)
    rows[-1]["seconds"] = seconds
    logger.info("study: %s %s=%s gate %s, max re-id %.3f, share %s (%.1f s)", method, sname, strength,
                "passed" if result.passed else "failed", result.max_rate or 0.0, result.max_person_share, seconds)
    return rows, None if features else released[data.examples].copy()  # de-identified faces only


def write_csv(rows: list[dict], path: str | Path) -> Path:
    """Write study rows (:data:`CSV_COLUMNS`, empty cells where not applicable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in CSV_COLUMNS})
    return path


def summary(rows: list[dict]) -> list[dict]:
    """One dict per (method, strength): the gate's verdict, the worst attack with its interval,
    the exact share, the cross-fitted utility per label and the older protocols' accuracies."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["method"], r["strength_name"], r["strength"])
        s = out.setdefault(key, {"method": r["method"], "strength_name": r["strength_name"],
                                 "strength": r["strength"], "k": r.get("k"), "verdict": None, "failed": [],
                                 "max_rate": None, "worst": None, "lower": None, "upper": None, "n": None,
                                 "max_upper": None, "max_person_share": None, "exact_bound": False,
                                 "utility": {}, "evidence": {}, "seconds": None})
        kind = r["kind"]
        if kind == "privacy" and r.get("status") == "insufficient_evidence":
            continue  # too few distinct probes: never the worst attack (deid.evaluation.gate_privacy.privacy_checks)
        if kind == "privacy":
            if s["max_rate"] is None or r["rate"] > s["max_rate"]:
                s.update(max_rate=r["rate"], worst=f"{r['attacker']}/{r['mode']}", lower=r["lower"],
                         upper=r["upper"], n=r["n"])
            s["max_upper"] = max(s["max_upper"] or 0.0, r["upper"])
        elif kind == "check" and r["status"] == "fail":
            s["failed"].append(r["check"])
        elif kind == "utility" and r["protocol"] == "cross-fit":
            s["utility"][r["label"]] = {x: r[x] for x in ("delta", "lower", "upper", "status", "accuracy",
                                                          "original_accuracy", "n")}
        elif kind == "utility":
            s["evidence"][(r["label"], r["protocol"])] = r["accuracy"]
        elif kind == "verdict":
            s.update(verdict=r["verdict"], max_person_share=r["max_person_share"], exact_bound=r["exact_bound"],
                     seconds=r.get("seconds"))
        elif kind == "skipped":
            s.update(verdict="skipped", skipped=r["detail"])
    return list(out.values())


def privacy_x(s: dict) -> float | None:
    """Where a point sits on the privacy axis: the exact max person share when every cluster
    is one identical image (it bounds every recogniser), else the largest upper bound of the attacks."""
    if s["exact_bound"] and s["max_person_share"] is not None:
        return float(s["max_person_share"])
    return s["max_upper"]


def study_drop(drop_dir: str | Path, out_dir: str | Path, cfg: StudyConfig | None = None) -> dict:
    """Align a drop (cached in ``out_dir``), or read a feature drop, run the study, write ``study.csv`` and the plots.

    Returns
    -------
    dict
        ``csv`` path, ``plots`` paths, ``rows``, ``n_faces`` (records), ``kind``, ``seconds``.
    """
    from deid.intake.features import drop_kind  # noqa: PLC0415
    from deid.study.plots import plot_study  # noqa: PLC0415 - the plots module reads this one's rows

    t0 = time.perf_counter()
    cfg = cfg or StudyConfig()
    labels = list(cfg.labels) if cfg.labels else None
    kind = drop_kind(drop_dir)
    d = load_features(drop_dir, labels=labels) if kind == "features" else load_aligned(drop_dir, out_dir,
                                                                                          labels=labels)
    if d.inputs.points or d.inputs.frames:
        logger.info("study: method inputs %s", d.inputs.to_dict())
    result = run_study(d.pixels, d.people, d.labels, d.shape, cfg, kind=kind, points=d.points,
                       sequences=d.sequences, frames=d.frames)
    path = write_csv(result.rows, Path(out_dir) / "study.csv")
    plots = plot_study(result, out_dir)
    return {"csv": path, "plots": plots, "rows": result.rows, "n_faces": len(d.pixels), "kind": kind,
            "inputs": d.inputs.to_dict(), "seconds": round(time.perf_counter() - t0, 1)}
