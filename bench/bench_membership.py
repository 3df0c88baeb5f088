"""Membership disclosure (issue 28) on London at k=5 and k=10 and on a synthetic drop, beside two controls.

The figure is the gate's (:func:`deid.evaluation.membership.measure_membership`, what
``deid run`` reports in ``privacy.membership``): the people are split at random into members
and non-members, the method re-makes a release from the members alone, and each attacker
scores every person by their photos' similarity to the nearest released face; AUC and TPR at
1% FPR of members vs non-members with one-sided 95% bootstrap bounds over people (Bonferroni
over the attackers, the strongest one the headline). The drops are aligned by the release
pipeline's own steps (:func:`deid.study.load_aligned`), the method is the run's default
(k-Same-Select over the drop's labels, gender x expression), and the attackers are the gate's
own at this sample size (every image attacker but the deep one, which the gate runs only up to
``DEID_DEEP_ATTACK_SAMPLE`` = 100 records; ``--deep`` adds it).

Two controls on the same people and attackers bracket the scale:

* **originals**: the "release" is the members' own photos: AUC should be near 1;
* **noise**: the "release" is uniform random pixels of the same shape: AUC should be near 0.5,
  its interval covering 0.5.

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_membership.py \
        [--ks 5,10] [--synth-people 100] [--deep] [--only london|synth] [--london PATH]

London is read in place from ``--london`` (default: the tests' London path, bench/london_set.py;
imported to a temporary drop, removed after alignment); the synthetic drop is ``deid synth``'s (drawn by OpenCV, no real faces). Prints
one row per (drop, release): members vs non-members, the strongest attacker, AUC [lower, upper],
advantage 2 AUC - 1 and TPR at 1% FPR [lower, upper], and the CPU seconds.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from london_set import add_london_option, london_dir  # noqa: E402


def aligned(which: str, work: Path, synth_people: int, london: Path | None):
    """The aligned faces of London or of a synthetic drop (the drop's copies removed after alignment)."""
    from deid.intake.london import import_london
    from deid.intake.synth import make_synthetic_drop
    from deid.study import load_aligned

    try:
        if which == "london":
            drop = import_london(london, work / "drop")
        else:
            drop = make_synthetic_drop(work / "drop", people=synth_people, images_per_person=2, seed=28, fast=True)
        return load_aligned(drop, work / "aligned")
    finally:
        shutil.rmtree(work, ignore_errors=True)  # London's drop and ingested table hold copies of the photos


def row(name: str, release: str, out: dict, cpu: float) -> str:
    if out.get("status") != "measured":
        return f"{name:<8} {release:<22} not measured: {out.get('reason')}"
    a_lo, a_hi = out["auc_interval"]
    t_lo, t_hi = out["tpr_interval"]
    return (f"{name:<8} {release:<22} {out['members']:>3} vs {out['non_members']:<3} {out['attacker']:<20} "
            f"{out['auc']:.3f} [{a_lo:.3f}, {a_hi:.3f}]  {out['advantage']:+.3f}  "
            f"{out['tpr_at_fpr']:.2f} [{t_lo:.2f}, {t_hi:.2f}]  {cpu:6.1f}")


def main() -> None:
    from deid.anonymise.methods import method_runner
    from deid.evaluation.attacks import ATTACKERS, DEEP_ATTACKERS
    from deid.evaluation.membership import measure_membership

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ks", default="5,10")
    ap.add_argument("--synth-people", type=int, default=100)
    ap.add_argument("--deep", action="store_true", help="add the deep recogniser (dlib-resnet)")
    ap.add_argument("--only", choices=("london", "synth"))
    ap.add_argument("--seed", type=int, default=0, help="member split, bootstrap and the method's seed")
    add_london_option(ap)
    args = ap.parse_args()
    london = None if args.only == "synth" else london_dir(args.london)
    ks = [int(k) for k in args.ks.split(",")]
    attackers = {a: f for a, f in ATTACKERS.items() if args.deep or a not in DEEP_ATTACKERS}
    print(f"attackers: {', '.join(attackers)}; one-sided 95% bounds, Bonferroni over {len(attackers)}")
    print(f"{'drop':<8} {'release':<22} {'mem vs non':<10} {'strongest attacker':<20} {'AUC [lower, upper]':<22} "
          f"{'adv':>6}  {'TPR@1%FPR':<17} {'CPU s':>6}")
    for which in ("london", "synth"):
        if args.only and which != args.only:
            continue
        d = aligned(which, Path(tempfile.mkdtemp(prefix=f"bench_membership_{which}_")), args.synth_people, london)
        x, people, shape = d.pixels, np.asarray(d.people, dtype=object), d.shape
        names = list(d.labels)
        # The partition keys the flow gives k-Same-Select: one per combination of the drop's labels.
        keys = np.array(["|".join(str(d.labels[n][i]) for n in names) for i in range(len(x))], dtype=object)
        common = dict(originals=x, people=people, shape=shape, attackers=attackers, partitions=keys,
                      labels={n: np.asarray(v) for n, v in d.labels.items()}, points=d.points, seed=args.seed)
        print(f"# {which}: {len(x)} aligned faces of {len(set(people.tolist()))} people, labels {names}")
        noise_rng = np.random.default_rng(args.seed + 1)
        releases = {f"k-same-select k={k}": method_runner("k-same-select", shape=shape, k=k, seed=args.seed)
                    for k in ks}
        releases["control: originals"] = lambda imgs, **_: np.array(imgs, copy=True)
        releases["control: noise"] = lambda imgs, **_: noise_rng.integers(0, 256, size=imgs.shape).astype(np.uint8)
        for release, deidentify in releases.items():
            t0 = time.process_time()
            out = measure_membership(deidentify=deidentify, **common)
            print(row(which, release, out, time.process_time() - t0), flush=True)


if __name__ == "__main__":
    main()
