"""The comparison study: every de-identification method over its range of strengths.

For each method and strength the aligned faces of a drop are de-identified, attacked by
every recogniser in every mode (:func:`deid.attacks.attack_all`) and checked for utility
with the three protocols (:func:`deid.utility.utility_protocols`). The results reproduce
the shape of Gross et al. (2005) Fig. 6 (re-identification against strength, with the
1/k curve) and Fig. 8 (utility per label).
"""
from __future__ import annotations

import csv
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from deid.errors import ConfigError

logger = logging.getLogger(__name__)

CACHE = "aligned.npz"
CSV_COLUMNS = ("method", "strength_name", "strength", "kind", "attacker", "mode", "rate", "bound", "label",
               "protocol", "accuracy", "original_accuracy", "min_distance", "detail")


def _aligner_params() -> dict:
    from deid.settings import Settings  # noqa: PLC0415 - settings read only when aligning

    s = Settings()
    w, h = s.canonical_size
    left, right = s.canonical_eyes()
    return {"size": [w, h], "eye_left": list(left), "eye_right": list(right), "max_upsample": s.max_upsample,
            "min_eye_distance": s.min_eye_distance_px}


def load_aligned(drop_dir: str | Path, workdir: str | Path, *, labels: list[str] | None = None
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], tuple[int, int]]:
    """Aligned faces of a drop, via the release pipeline's own read, ingest and align steps.

    The result is cached in ``workdir/aligned.npz``, keyed by the manifest bytes, the labels
    and the canonical geometry, so reruns skip decoding and alignment. Quarantined records
    are left out (their count is logged).

    Returns
    -------
    pixels : ndarray of shape (n, height * width), uint8
    people : ndarray of shape (n,), object (subject ids)
    labels : dict label name -> ndarray of shape (n,), object
    shape : (height, width)
    """
    from deid.drop import read_drop  # noqa: PLC0415
    from deid.ingest import ingest  # noqa: PLC0415
    from deid.stages import align_batch, read_pixels  # noqa: PLC0415

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    drop = read_drop(drop_dir, labels=labels)
    params = _aligner_params()
    key = hashlib.sha256(drop.manifest_bytes + json.dumps([drop.labels, params], sort_keys=True).encode()).hexdigest()
    cache = work / CACHE
    if cache.is_file():
        with np.load(cache, allow_pickle=False) as z:
            if str(z["key"]) == key:
                names = [str(x) for x in z["label_names"]]
                logger.info("study: aligned faces from cache %s", cache)
                return (z["pixels"], z["people"].astype(object), {n: z[f"label_{n}"].astype(object) for n in names},
                        (int(z["shape"][0]), int(z["shape"][1])))
    t0 = time.perf_counter()
    ingested = work / "ingested.parquet"
    aligned = work / "aligned.parquet"
    try:
        res = ingest(drop, ingested)
        out = align_batch(str(ingested), list(range(res.row_groups)), str(aligned), params)
        import pyarrow.parquet as pq  # noqa: PLC0415

        ids, pixels = read_pixels([str(aligned)])
        meta = pq.read_table(ingested, columns=["record_id", "subject_id", *drop.labels]).to_pydict()
    finally:
        ingested.unlink(missing_ok=True)  # it holds a copy of every source image
        aligned.unlink(missing_ok=True)
    row = {rid: i for i, rid in enumerate(meta["record_id"])}
    take = [row[r] for r in ids]
    people = np.asarray([meta["subject_id"][i] for i in take], dtype=object)
    labs = {n: np.asarray([meta[n][i] for i in take], dtype=object) for n in drop.labels}
    w, h = params["size"]
    n_bad = len(drop.quarantined) + len(res.quarantined) + len(out["quarantined"])
    logger.info("study: %d faces aligned, %d quarantined, in %.1f s", len(ids), n_bad, time.perf_counter() - t0)
    if len(ids) == 0:
        raise ConfigError(f"no face of drop {drop_dir} could be aligned ({n_bad} quarantined); check the drop")
    np.savez(cache, key=np.array(key), pixels=pixels, people=people.astype(str), shape=np.array([h, w]),
             label_names=np.array(drop.labels), **{f"label_{n}": labs[n].astype(str) for n in drop.labels})
    return pixels, people, labs, (h, w)


@dataclass
class StudyConfig:
    """The strengths to study and how much work to spend on each point."""

    ks: Sequence[int] = (2, 3, 5, 10)
    sigmas: Sequence[float] = (1, 2, 4, 8)
    blocks: Sequence[int] = (2, 4, 8, 16)
    methods: Sequence[str] = ("k-same-select", "k-same", "k-same-naive", "blur", "pixelate")
    attackers: Sequence[str] | None = None
    modes: Sequence[str] = ("naive", "reverse", "parrot")
    utility_repeats: int = 3
    leak_threshold: float = 2.0
    seed: int = 0
    labels: Sequence[str] | None = None


def _points(cfg: StudyConfig) -> list[tuple[str, str, float]]:
    from deid.methods import METHODS, STRENGTH  # noqa: PLC0415

    bad = [m for m in cfg.methods if m not in METHODS]
    if bad or not cfg.methods:
        raise ConfigError(f"methods={list(cfg.methods)!r} must be a non-empty subset of {list(METHODS)}")
    ranges = {"k": cfg.ks, "sigma": cfg.sigmas, "block": cfg.blocks}
    out = []
    for m in cfg.methods:
        name = STRENGTH[m]
        if not ranges[name]:
            raise ConfigError(f"method {m!r} needs at least one --{name} value")
        out.extend((m, name, v) for v in ranges[name])
    return out


def run_study(pixels: np.ndarray, people: Sequence, labels: dict[str, np.ndarray], shape: tuple[int, int],
              cfg: StudyConfig | None = None) -> list[dict]:
    """Every method at every strength: attacks, utility protocols and the near-copy leak check.

    Returns long-format rows with :data:`CSV_COLUMNS` (``kind`` is ``privacy``, ``utility``,
    ``leak`` or ``skipped``); ``bound`` is 1/k for the k-Same family.
    """
    from deid.attacks import attack_all  # noqa: PLC0415
    from deid.leaks import near_copy_check  # noqa: PLC0415
    from deid.methods import K_METHODS, deidentify, parrot_for  # noqa: PLC0415
    from deid.utility import utility_protocols  # noqa: PLC0415

    cfg = cfg or StudyConfig()
    names = list(cfg.labels) if cfg.labels else list(labels)
    missing = [n for n in names if n not in labels]
    if missing:
        raise ConfigError(f"labels {missing} are not in the drop's labels {sorted(labels)}")
    people = np.asarray(people, dtype=object)
    partitions = list(zip(*(labels[n] for n in names)))
    rows: list[dict] = []
    for method, sname, strength in _points(cfg):
        t0 = time.perf_counter()
        kw = {sname: strength}
        base = {"method": method, "strength_name": sname, "strength": strength,
                "bound": (1.0 / strength) if method in K_METHODS else None}
        try:
            released, clusters = deidentify(pixels, shape=shape, people=people, partitions=partitions, method=method,
                                            seed=cfg.seed, **kw)
        except ConfigError as exc:  # e.g. a partition with fewer than k people
            rows.append({**base, "kind": "skipped", "detail": str(exc)})
            logger.warning("study: %s %s=%s skipped: %s", method, sname, strength, exc)
            continue
        parrot = parrot_for(method, shape=shape, people=people, partitions=partitions, seed=cfg.seed, **kw)
        for r in attack_all(originals=pixels, original_people=people, released=released, released_people=people,
                            shape=shape, modes=cfg.modes, parrot=parrot, attackers=cfg.attackers):
            rows.append({**base, "kind": "privacy", **r})
        for u in utility_protocols(labels=names, originals=pixels, original_labels=labels, original_people=people,
                                   released=released, released_labels=labels, released_people=people,
                                   released_groups=clusters, repeats=cfg.utility_repeats, seed=cfg.seed):
            rows.append({**base, "kind": "utility", "label": u["label"], "protocol": u["protocol"],
                         "accuracy": u["deidentified_accuracy"], "original_accuracy": u["original_accuracy"],
                         "detail": u["detail"]})
        leak = near_copy_check(released, pixels, threshold=cfg.leak_threshold)
        rows.append({**base, "kind": "leak", "min_distance": leak["min_distance"],
                     "detail": f"identical={leak['identical']} below_threshold={leak['below_threshold']} "
                               f"threshold={leak['threshold']}"})
        top = max(r["rate"] for r in rows if r.get("kind") == "privacy" and r["method"] == method
                  and r["strength"] == strength)
        logger.info("study: %s %s=%s max re-id %.3f (%.1f s)", method, sname, strength, top, time.perf_counter() - t0)
    return rows


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


def plot_study(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Re-identification (Gross et al. 2005 Fig. 6) and utility (Fig. 8) plots as PNG files."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    priv = [r for r in rows if r.get("kind") == "privacy"]
    util = [r for r in rows if r.get("kind") == "utility"]
    methods = list(dict.fromkeys(r["method"] for r in priv + util))
    ks = sorted({r["strength"] for r in priv if r["bound"] is not None})
    attackers = list(dict.fromkeys(r["attacker"] for r in priv))
    modes = list(dict.fromkeys(r["mode"] for r in priv))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"naive": "-", "reverse": "--", "parrot": ":", "cv": "-", "train-original-test-release": "--",
              "train-release-test-heldout": ":"}
    paths = []

    fig, axes = plt.subplots(1, max(1, len(methods)), figsize=(4.2 * max(1, len(methods)), 4), squeeze=False)
    for ax, method in zip(axes[0], methods):
        mine = [r for r in priv if r["method"] == method]
        if not mine:
            ax.set_visible(False)
            continue
        for i, att in enumerate(attackers):
            for mode in modes:
                pts = sorted((r["strength"], r["rate"]) for r in mine if r["attacker"] == att and r["mode"] == mode)
                if pts:
                    ax.plot(*zip(*pts), styles.get(mode, "-"), marker="o", ms=3, color=colours[i % len(colours)],
                            label=f"{att} / {mode}")
        xs = sorted({r["strength"] for r in mine})
        if mine[0]["bound"] is not None:
            grid = np.linspace(min(xs), max(xs), 100)
            ax.plot(grid, 1.0 / grid, "k-", lw=2, alpha=0.6, label="1/k")
        else:
            for k in ks:
                ax.axhline(1.0 / k, color="grey", lw=0.8, ls="-.")
                ax.text(max(xs), 1.0 / k, f" 1/{k:g}", va="center", fontsize=7, color="grey")
        ax.set_title(method)
        ax.set_xlabel(mine[0]["strength_name"])
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("re-identification rate (people, rank 1)")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(6, max(1, len(names))), fontsize=7)
    fig.tight_layout(rect=(0, 0.12 + 0.02 * (len(names) // 6), 1, 1))
    paths.append(out / "reidentification.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    labels = list(dict.fromkeys(r["label"] for r in util))
    families = [("k", [m for m in methods if any(r["method"] == m and r["strength_name"] == "k" for r in util)]),
                ("sigma", [m for m in methods if any(r["method"] == m and r["strength_name"] == "sigma" for r in util)]),
                ("block", [m for m in methods if any(r["method"] == m and r["strength_name"] == "block" for r in util)])]
    families = [f for f in families if f[1]]
    if labels and families:
        fig, axes = plt.subplots(len(labels), len(families), figsize=(4.5 * len(families), 3.6 * len(labels)),
                                 squeeze=False)
        for i, label in enumerate(labels):
            for j, (sname, fam) in enumerate(families):
                ax = axes[i][j]
                for mi, method in enumerate(fam):
                    for protocol in dict.fromkeys(r["protocol"] for r in util):
                        pts = sorted((r["strength"], r["accuracy"]) for r in util if r["method"] == method
                                     and r["label"] == label and r["protocol"] == protocol and r["accuracy"] is not None)
                        if pts:
                            ax.plot(*zip(*pts), styles.get(protocol, "-"), marker="o", ms=3,
                                    color=colours[methods.index(method) % len(colours)], label=f"{method} / {protocol}")
                ref = [r["original_accuracy"] for r in util if r["label"] == label and r["protocol"] == "cv"
                       and r["original_accuracy"] is not None]
                if ref:
                    ax.axhline(ref[0], color="k", lw=1.5, alpha=0.6, label="originals (cv)")
                ax.set_title(f"{label}: {', '.join(fam)}", fontsize=9)
                ax.set_xlabel(sname)
                ax.set_ylabel("accuracy")
                ax.set_ylim(0.4, 1.02)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=6, loc="lower left")
        fig.tight_layout()
        paths.append(out / "utility.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def study_drop(drop_dir: str | Path, out_dir: str | Path, cfg: StudyConfig | None = None) -> dict:
    """Align a drop (cached in ``out_dir``), run the study, write ``study.csv`` and the plots.

    Returns
    -------
    dict
        ``csv`` path, ``plots`` paths, ``rows``, ``n_faces``, ``seconds``.
    """
    t0 = time.perf_counter()
    cfg = cfg or StudyConfig()
    pixels, people, labels, shape = load_aligned(drop_dir, out_dir, labels=list(cfg.labels) if cfg.labels else None)
    rows = run_study(pixels, people, labels, shape, cfg)
    path = write_csv(rows, Path(out_dir) / "study.csv")
    plots = plot_study(rows, out_dir)
    return {"csv": path, "plots": plots, "rows": rows, "n_faces": len(pixels),
            "seconds": round(time.perf_counter() - t0, 1)}


def summary(rows: list[dict]) -> list[dict]:
    """Per method and strength: the largest re-identification rate (and where), the bound, utility per label/protocol."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["method"], r["strength"])
        s = out.setdefault(key, {"method": r["method"], "strength_name": r["strength_name"], "strength": r["strength"],
                                 "bound": r["bound"], "max_rate": None, "worst": None, "utility": {}})
        if r["kind"] == "privacy" and (s["max_rate"] is None or r["rate"] > s["max_rate"]):
            s["max_rate"], s["worst"] = r["rate"], f"{r['attacker']}/{r['mode']}"
        elif r["kind"] == "utility":
            s["utility"][(r["label"], r["protocol"])] = r["accuracy"]
        elif r["kind"] == "skipped":
            s["skipped"] = r["detail"]
    return list(out.values())

