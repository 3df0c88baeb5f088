"""Per-frame expression with privacy: multi-factor-expression against multi-factor ("labels" mode) on sequences.

On a synthetic sequence drop (30 people x 2 sequences x 12 frames, talking and smiling, aligned
with the pipeline's own steps as bench_sequences.py; ``--drop-frames P`` drops a random share P of
the frames, as quarantined frames of a real video would), for each method:

* the gate (:func:`deid.evaluation.gate.evaluate`, default settings) on the release, the parrot
  attacker and the utility folds re-running the *whole* method with the options a sequence drop
  gives it (:func:`deid.anonymise.sequences.sequence_options`), plus the release flow's
  ``sequence_linkage_people`` check on the release's clusters;
* per-frame expression agreement: a classifier (eigenfaces + logistic regression, as
  :func:`deid.evaluation.sequences.label_agreement`) trained on the *source* frames of the other
  half of the people (2-fold cross-fit over people, so every frame is read once) reads each
  released frame: ``agreement`` = it gives the released frame the label it gives the same
  frame's source, ``accuracy`` = the released frame's true label; each with a bootstrap over
  people (one-sided 95% bounds: a 90% two-sided interval, :func:`deid.evaluation.utility_evidence.paired_bootstrap`),
  and the difference between the two methods, paired frame by frame;
* continuous expression: Pearson r between the drawn mouth openness and a ridge regressor trained on
  other people's source frames, over the talking frames and within the 'talk' label (as
  bench_sequence_modes.py).

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_expression_frames.py --people 30 --k 5
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_sequence_modes import openness_kept, print_gate_rows, sequence_gate, worst_attack  # noqa: E402
from bench_sequences import SHAPE, aligned_sequence_drop  # noqa: E402

from deid.anonymise.methods import deidentify, method_runner  # noqa: E402
from deid.anonymise.sequences import sequence_options  # noqa: E402
from deid.evaluation.sequences import sequence_linkage_check  # noqa: E402
from deid.evaluation.utility_evidence import paired_bootstrap  # noqa: E402

METHODS = ("multi-factor", "multi-factor-expression")
SVMS = ("gate SVM", "no pixel scaling", "PCA 10")


def release(X, col, k: int, method: str):
    labels = {"gender": col["gender"], "expression": col["expression"]}
    return deidentify(X, shape=SHAPE, people=col["subject_id"], method=method, k=k, labels=labels,
                      sequences=col["sequence"], frames=col["frame"])


def gate(X, col, k: int, method: str, rel, clusters) -> None:
    t0 = time.process_time()
    linkage = sequence_linkage_check(col["sequence"], list(clusters), col["subject_id"], k=k)
    res = sequence_gate(X, col, k, method, rel, clusters,
                        method_runner(method, shape=SHAPE, k=k, seed=1, options=sequence_options(method)),
                        extra_checks=(linkage,))
    P = np.asarray(col["subject_id"], dtype=object)
    sizes = [len(set(P[np.asarray(clusters) == c])) for c in np.unique(clusters)]
    print(f"  {method} k={k}: {len(sizes)} clusters of >= {min(sizes)} people; gate "
          f"{'RELEASES' if res.passed else 'REJECTS'} ({time.process_time() - t0:.0f} cpu s); exact bound "
          f"{res.exact_bound}, max person share {res.max_person_share}; {linkage.name} {linkage.value}")
    worst = worst_attack(res)
    print(f"    worst attack {worst.attacker}/{worst.mode} {worst.rate:.3f} [{worst.lower:.3f}, "
          f"{worst.upper:.3f}] on {worst.n_probes} distinct probes (1/k = {1 / k:.3f})")
    print_gate_rows(res, parrot=True)
    print("    failed: " + ("; ".join(f"{c.name} ({c.detail[:160]})" for c in res.checks if not c.passed)
                            or "nothing"))


def frame_reads(X, released: dict[str, np.ndarray], col, *, seed: int = 0, n_components: int = 30):
    """Per frame: the source-trained classifier's label on the source and on each release (2-fold over people)."""
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415

    from deid.alignment.features import Eigenfaces  # noqa: PLC0415

    y = np.asarray(col["expression"]).astype(str)
    P = np.asarray(col["subject_id"], dtype=object)
    who = np.array(sorted(set(P.tolist())), dtype=object)
    half = set(np.random.default_rng(seed).permutation(who)[: len(who) // 2].tolist())
    fold = np.array([p in half for p in P])
    on_src = np.empty(len(y), dtype=object)
    on_rel = {m: np.empty(len(y), dtype=object) for m in released}
    for te in (fold, ~fold):
        clf = make_pipeline(Eigenfaces(n_components, random_state=seed), LogisticRegression(max_iter=2000))
        clf.fit(X[~te], y[~te])
        on_src[te] = clf.predict(X[te])
        for m, R in released.items():
            on_rel[m][te] = clf.predict(R[te])
    return y, P, on_src, on_rel


def _ci(P, a, b=None) -> str:
    est, lo, hi = paired_bootstrap(list(P), np.asarray(a, float), np.zeros(len(a)) if b is None else np.asarray(b, float))
    return f"{est:+.3f} [{lo:+.3f}, {hi:+.3f}]" if b is not None else f"{est:.3f} [{lo:.3f}, {hi:.3f}]"


def agreement(X, released: dict[str, np.ndarray], col) -> None:
    y, P, on_src, on_rel = frame_reads(X, released, col)
    print(f"  source-trained classifier on held-out source frames: accuracy {_ci(P, on_src == y)} ({len(y)} frames, "
          f"{len(set(P.tolist()))} people)")
    for m, pred in on_rel.items():
        print(f"  {m:24s} per-frame agreement with source {_ci(P, pred == on_src)}, accuracy {_ci(P, pred == y)}")
    a, b = METHODS
    if a in on_rel and b in on_rel:
        print(f"  {b} - {a}: agreement {_ci(P, on_rel[b] == on_src, on_rel[a] == on_src)}, accuracy "
              f"{_ci(P, on_rel[b] == y, on_rel[a] == y)} (paired by frame, bootstrap over people)")


def diagnose_utility(X, col, k: int, folds: int = 5) -> None:
    """Why a classifier trained on a release reads held-out originals worse: the gate's SVM on ladders of releases.

    For 5 folds over people, trained on the training people's (a) originals, (b) person-mean images
    (identity kept, no expression), (c) k-Same identity only (each frame its identity cluster's mean
    image, :class:`deid.anonymise.methods_factor.MultiFactor` clusters), (d) each method's release
    re-run on the training people (as the gate's cross-fit does), and multi-factor-expression's before
    its uint8 rounding; tested on the held-out people's
    originals, with the gate's SVM (:func:`deid.evaluation.utility_classifier.svm_pipeline`: standardise pixels, PCA 50,
    standardise, linear SVM) and without its first, per-pixel, standardisation (fitted on a release
    whose pixels barely vary, it blows up the held-out originals' variation there), and with 10
    instead of 50 components (a release spanning few directions, rounded to uint8, gives PCA 50
    components of rounding noise that the second standardisation whitens to unit variance).
    """
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415

    from deid.anonymise.methods_factor import MultiFactor  # noqa: PLC0415
    from deid.evaluation.utility_classifier import svm_pipeline  # noqa: PLC0415

    P = np.asarray(col["subject_id"], dtype=object)
    who = np.array(sorted(set(P.tolist())), dtype=object)
    fold_of = dict(zip(np.random.default_rng(0).permutation(who).tolist(), np.arange(len(who)) % folds))
    f = np.array([fold_of[p] for p in P])
    ys = {x: np.asarray(col[x]).astype(str) for x in ("gender", "expression")}
    hits: dict[tuple[str, str, str], list[bool]] = {}
    for j in range(folds):
        tr, te = f != j, f == j
        lab = {x: list(ys[x][tr]) for x in ys}
        Xtr = X[tr].astype(np.float64)
        mf = MultiFactor(k).fit(X[tr], people=list(P[tr]), labels=lab)
        pc = np.unique(P[tr].astype(str), return_inverse=True)[1]
        person_mean = np.stack([Xtr[pc == c].mean(axis=0) for c in range(pc.max() + 1)])[pc]
        cl = mf.person_clusters_[[mf.people_.index(p) for p in P[tr]]]
        cluster_mean = np.stack([Xtr[cl == c].mean(axis=0) for c in range(cl.max() + 1)])[cl]
        train = {"originals": Xtr, "person means": person_mean, "k-Same identity": cluster_mean}
        for m in METHODS:
            run = method_runner(m, shape=SHAPE, k=k, seed=1, options=sequence_options(m))
            train[m] = run(X[tr], people=list(P[tr]), labels=lab).astype(np.float64)
        # The same release before its uint8 rounding: exactly low-rank, so the PCA keeps no noise direction.
        train["multi-factor-expression, float"] = MultiFactor(k, non_identity="label-groups", random_state=1).fit(
            X[tr], people=list(P[tr]), labels=lab).released_
        for name, R in train.items():
            for svm in SVMS:
                model = svm_pipeline(10 if svm == "PCA 10" else 50, len(R), R.shape[1], 0)
                if svm == "no pixel scaling":
                    model = make_pipeline(*[s for _, s in model.steps[1:]])
                for x, y in ys.items():
                    pred = model.fit(R, y[tr]).predict(X[te].astype(np.float64))
                    hits.setdefault((name, svm, x), []).extend((pred == y[te]).tolist())
    print(f"  utility ladder at k={k} (trained on the training people's X, tested on held-out originals, {folds} "
          "folds; accuracy gender / expression):")
    names = list(dict.fromkeys(n for n, _, _ in hits))
    for name in names:
        row = [f"{svm}: {np.mean(hits[(name, svm, 'gender')]):.3f} / {np.mean(hits[(name, svm, 'expression')]):.3f}"
               for svm in SVMS]
        print(f"    {name:32s} " + "   ".join(row))


def drop_frames(X, col, share: float, seed: int = 0):
    if share <= 0:
        return X, col
    keep = np.random.default_rng(seed).random(len(X)) >= share
    return X[keep], {c: [v for v, kept in zip(vals, keep) if kept] for c, vals in col.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--people", type=int, default=30)
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--k", type=int, nargs="+", default=[5])
    ap.add_argument("--drop-frames", type=float, default=0.0, help="share of frames dropped at random (e.g. 0.1)")
    ap.add_argument("--no-gate", action="store_true", help="only the expression figures")
    ap.add_argument("--diagnose", action="store_true", help="only the utility ladder (see diagnose_utility)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_expression_frames_"))
    try:
        X, col = drop_frames(*aligned_sequence_drop(work, people=args.people, frames=args.frames), args.drop_frames)
        print(f"drop: {len(X)} frames, {args.people} people x 2 sequences x {args.frames} frames"
              + (f", {args.drop_frames:.0%} of frames dropped" if args.drop_frames else ""))
        for k in args.k:
            if args.diagnose:
                diagnose_utility(X, col, k)
                continue
            out = {m: release(X, col, k, m) for m in METHODS}
            agreement(X, {m: r for m, (r, _) in out.items()}, col)
            for name, R in (("source frames", X), *((m, r) for m, (r, _) in out.items())):
                r_all, r_talk, n = openness_kept(X, R, col)
                print(f"  openness kept, {name:24s}: r {r_all:+.3f} over talking frames, {r_talk:+.3f} within "
                      f"'talk' ({n} held-out 'talk' frames per split)")
            if not args.no_gate:
                for m, (r, clusters) in out.items():
                    gate(X, col, k, m, r, clusters)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
