"""k-Same-M on a fitted AAM (``k-same-aam``) against today's k-Same-M (``k-same-m``) on London, at k=5.

The London set is imported to a temporary drop and aligned by the release pipeline's own steps
(:func:`deid.study.load_aligned`: the neutral photos carry their 189 .tem landmarks in
canonical pixels, the smiling ones none). Both methods run as ``deid run`` runs them (label
partitions gender x expression, the points where given: shape from points in the neutral
partitions, optical flow in the smiling ones) and are judged by the release gate itself
(:func:`deid.study.run_study`: exact k checks, every attacker x mode with the parrot
re-running the method, cross-fitted utility). Printed per method: the gate's verdict, its worst
attack with the one-sided interval, the exact max person share, the cross-fitted utility per
label (original -> release accuracy, the drop with its interval, held-out test images), and the
sharpness of the released faces (variance of the Laplacian, one face per cluster; mean with a
95% bootstrap interval over clusters), per shape source, with the AAM - k-Same-M difference.

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_aam.py [--k 5] [--attackers fast|all] \
        [--london PATH]

``--attackers fast`` (default) runs the eigenface, LBP and release-refit attackers without dlib;
``all`` adds dlib-resnet (~20 s more CPU per method). ``--seed`` fixes the methods' seed (default
0, so the figures repeat; the gate's utility folds use the gate's own seed).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from london_set import add_london_option, london_dir  # noqa: E402

METHODS = ("k-same-m", "k-same-aam")
FAST = ("pca-mahalanobis", "pca-whitened-cosine", "fisherfaces", "lbp-chi2", "release-refit-pca")


def bootstrap(values: np.ndarray, *, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``values``."""
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(reps, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def bootstrap_diff(a: np.ndarray, b: np.ndarray, *, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(a) - mean(b), clusters resampled independently."""
    rng = np.random.default_rng(seed)
    d = (a[rng.integers(0, len(a), size=(reps, len(a)))].mean(axis=1)
         - b[rng.integers(0, len(b), size=(reps, len(b)))].mean(axis=1))
    return float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))


def main() -> None:
    from deid.anonymise.methods import deidentify
    from deid.anonymise.methods_ksame import sharpness
    from deid.evaluation.gate_types import GateConfig
    from deid.study import StudyConfig, load_aligned, run_study, summary
    from deid.intake.london import import_london
    from deid.settings import Settings

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--attackers", choices=("fast", "all"), default="fast")
    ap.add_argument("--seed", type=int, default=0)
    add_london_option(ap)
    args = ap.parse_args()
    london = london_dir(args.london)
    work = Path(tempfile.mkdtemp(prefix="bench_aam_"))
    try:
        d = load_aligned(import_london(london, work / "drop"), work / "aligned")
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the drop and the ingested table hold copies of the photos
    x, people, shape = d.pixels, d.people, d.shape
    # The study's partition keys (its label order), so its de-identification call is the memoised one below.
    keys = ["|".join(str(d.labels[n][i]) for n in d.labels) for i in range(len(x))]
    with_points = np.array([p is not None for p in d.points]) if d.points is not None else np.zeros(len(x), bool)
    print(f"London: {len(x)} aligned faces of {len(set(people))} people, {int(with_points.sum())} with landmarks; "
          f"k={args.k}, partitions gender x expression, seed {args.seed}")
    src = sharpness(x, shape=shape)
    print(f"originals' sharpness (variance of Laplacian): with points {src[with_points].mean():.1f}, "
          f"without {src[~with_points].mean():.1f}")

    gate = GateConfig.from_settings(Settings(), k=args.k, method="k-same-m", seed=args.seed)
    if args.attackers == "fast":
        gate = replace(gate, attackers=FAST)
    sharp: dict[str, dict[str, np.ndarray]] = {}
    for method in METHODS:
        t0 = time.process_time()
        released, clusters = deidentify(x, shape=shape, people=list(people), partitions=keys, method=method,
                                        k=args.k, n_components=gate.n_components, seed=args.seed,
                                        labels={n: list(v) for n, v in d.labels.items()}, points=d.points)
        cpu = time.process_time() - t0
        first = np.unique(clusters, return_index=True)[1]
        s = sharpness(released[first], shape=shape)
        sharp[method] = {"points": s[with_points[first]], "flow": s[~with_points[first]]}
        print(f"\n{method}: {len(first)} clusters, de-identification {cpu:.1f} CPU s")
        for source, v in sharp[method].items():
            lo, hi = bootstrap(v)
            print(f"  sharpness, shape from {source:<6}: {v.mean():7.1f} [{lo:.1f}, {hi:.1f}] over {len(v)} clusters")
        t0 = time.perf_counter()
        # The same call (same seed) is memoised: the study judges exactly these released faces.
        res = run_study(x, people, d.labels, shape, StudyConfig(ks=(args.k,), methods=(method,), gate=gate,
                                                                seed=args.seed), points=d.points)
        (s_,) = summary(res.rows)
        print(f"  gate: {s_['verdict']} ({time.perf_counter() - t0:.0f} s); worst attack {s_['worst']} "
              f"{s_['max_rate']:.3f} [{s_['lower']:.3f}, {s_['upper']:.3f}] n={s_['n']}; max person share "
              f"{s_['max_person_share']}, exact bound {s_['exact_bound']}; failed checks {s_['failed'] or 'none'}")
        for label, u in s_["utility"].items():
            print(f"  utility {label:<10} cross-fit accuracy {u['original_accuracy']:.3f} -> {u['accuracy']:.3f}, "
                  f"drop {u['delta']:+.3f} [{u['lower']:+.3f}, {u['upper']:+.3f}] n={u['n']}: {u['status']}")
    print("\nsharpness k-same-aam - k-same-m (95% bootstrap interval, clusters resampled):")
    for source in ("points", "flow"):
        a, b = sharp["k-same-aam"][source], sharp["k-same-m"][source]
        lo, hi = bootstrap_diff(a, b)
        print(f"  shape from {source:<6}: {a.mean() - b.mean():+.1f} [{lo:+.1f}, {hi:+.1f}]")


if __name__ == "__main__":
    main()
