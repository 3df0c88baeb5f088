"""Which front the utility cross-fit's release classifier should use: true held-out accuracy by front (issue 31).

Usage: OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_utility_front.py OUT_DIR [--people 200] [--k 3]
[--method k-same] [--train 10,24,48] [--draws 60] [--video] [--london]

Writes a synthetic drop (``make_synthetic_drop``, 2 photos per person, or with ``--video`` ``make_video_drop``,
2 recordings of 2 s at 5 fps; ``--london``: the London set) under OUT_DIR and runs ``run_release`` on it (the quick
gate settings of the flow tests; gate seed 0), printing the gate's utility checks. At the gate's cross-fit it takes
the aligned faces of the utility sample and the run's de-identification, then, per ``--train`` size N and label,
``--draws`` times: N people at random are de-identified with the method and SVMs (C=1) are trained on their
originals, on the release in the front fitted on their original faces, in the front fitted on the release, and in
the front :func:`deid.evaluation.utility_select.choose` picks; each is tested on the original faces of every other
person of the drop (hundreds of test faces: the "true" accuracy of a release of N people, not the gate's estimate).
Prints the mean accuracy of each, its spread over draws, and the mean difference from the originals' with its
standard error over draws.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import deid.evaluation.gate_parts as gate_parts  # noqa: E402
from deid.evaluation.gate_utility import people_sample  # noqa: E402
from deid.evaluation.utility import _deidentify_fold  # noqa: E402
from deid.evaluation.utility_classifier import fitted_front  # noqa: E402
from deid.evaluation.utility_select import Candidate, choose, fit_svc  # noqa: E402


def capture(drop: Path, out: Path, k: int, method: str) -> dict[str, Any]:
    """Run the release on ``drop``; return the gate's utility sample (faces, people, labels) and de-identification."""
    from deid.operations.runner import run_release
    from deid.run_config import RunConfig
    from deid.settings import Settings

    got: dict[str, Any] = {}
    real = gate_parts.cross_fit_checks

    def hook(inputs, config):
        idx = people_sample(inputs, max_records=config.utility_sample, seed=config.seed, labels=config.labels)
        got.update(X=np.asarray(inputs.fetch(idx)[1], dtype=np.float64), people=np.asarray(inputs.people)[idx],
                   labels={x: np.asarray(inputs.labels[x])[idx] for x in config.labels}, deidentify=inputs.deidentify,
                   n_components=config.n_components)
        checks, rows = real(inputs, config)
        for c in checks:
            print(f"gate {c.name}: {c.status} delta {c.value} interval {c.interval} n={c.n}")
        return checks, rows

    gate_parts.cross_fit_checks = hook
    settings = Settings(project_dir=out / "project", identity_embed_max=0, deep_attack_sample=20, min_probes=4,
                        cv_repeats=1)
    result = run_release(drop, RunConfig.resolve(settings, k=k, method=method))
    gate_parts.cross_fit_checks = real
    print(f"verdict {result.verdict}")
    return got


def draws(d: dict[str, Any], label: str, n_train: int, n_draws: int, k: int) -> None:
    """True held-out accuracy of each classifier for releases of ``n_train`` people (module docstring)."""
    X, nc = d["X"], d["n_components"]
    pc = np.unique(d["people"], return_inverse=True)[1].ravel()
    y = np.unique(d["labels"][label], return_inverse=True)[1].ravel()
    rng = np.random.default_rng(0)
    acc: dict[str, list[float]] = {m: [] for m in ("originals", "release, originals' front", "release, own front",
                                                   "release, chosen front")}
    picks: Counter = Counter()
    t_choose = 0.0
    for _ in range(n_draws):
        who = rng.choice(int(pc.max()) + 1, n_train, replace=False)
        tr, te = np.flatnonzero(np.isin(pc, who)), np.flatnonzero(~np.isin(pc, who))
        run = _deidentify_fold(d["deidentify"], X[tr], pc[tr], None, k,
                               {x: list(v[tr]) for x, v in d["labels"].items()})
        if run.released is None or len(np.unique(y[tr[run.keep]])) < 2:
            continue
        rel, kept = np.asarray(run.released, dtype=np.float64), tr[run.keep]
        fo, fr = fitted_front(X[tr], nc, 0), fitted_front(rel, nc, 0)

        def score(front, Xfit, yfit) -> float:
            return float((fit_svc(front.transform(Xfit), yfit, 1.0, 0).predict(front.transform(X[te])) == y[te]).mean())

        acc["originals"].append(score(fo, X[tr], y[tr]))
        acc["release, originals' front"].append(score(fo, rel, y[kept]))
        acc["release, own front"].append(score(fr, rel, y[kept]))
        t0 = time.process_time()
        c = choose({"originals": Candidate(fo.transform(rel), fo.transform(X[tr])),
                    "release": Candidate(fr.transform(rel), fr.transform(X[tr]))}, y[kept], pc[kept], y[tr], pc[tr], 0)
        t_choose += time.process_time() - t0
        picks[c.front] += 1
        acc["release, chosen front"].append(score(fo if c.front == "originals" else fr, rel, y[kept]))
    o = np.array(acc["originals"])
    print(f"{label}: releases of {n_train} people (k={k}), {len(o)} draws, tested on ~{len(pc) - len(tr)} faces of "
          f"{int(pc.max()) + 1 - n_train} other people each; majority {np.bincount(y).max() / len(y):.3f}; "
          f"choice {dict(picks)} ({t_choose:.1f} s CPU)")
    for name, v in acc.items():
        a = np.array(v)
        print(f"  {name:26s} {a.mean():.3f} (sd over draws {a.std():.3f}); originals minus it {np.mean(o - a):+.3f} "
              f"(se {np.std(o - a) / np.sqrt(len(a)):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--people", type=int, default=200)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--method", default="k-same")
    ap.add_argument("--train", default="10,24,48", help="training people per draw, comma-separated")
    ap.add_argument("--draws", type=int, default=60)
    ap.add_argument("--video", action="store_true", help="a synthetic video drop (make_video_drop, seed 2)")
    ap.add_argument("--london", action="store_true", help="the London set instead of a synthetic drop")
    args = ap.parse_args()
    if args.london:
        from deid.intake.london import import_london
        from london_set import london_dir

        drop = import_london(london_dir(None), args.out / "drop")
    elif args.video:
        from deid.intake.synth_videos import make_video_drop

        drop = make_video_drop(args.out / "drop", people=args.people, recordings=2, seconds=2, fps=5, width=240,
                               height=180, seed=2)
    else:
        from deid.intake.synth import make_synthetic_drop

        drop = make_synthetic_drop(args.out / "drop", people=args.people, images_per_person=2, seed=1)
    d = capture(drop, args.out, args.k, args.method)
    for label in d["labels"]:
        for n in (int(x) for x in args.train.split(",")):
            draws(d, label, n, args.draws, args.k)


if __name__ == "__main__":
    main()
