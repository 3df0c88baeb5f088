"""Which non-identity mode can a sequence release use? The gate's verdict and the two utility directions per mode.

On a synthetic sequence drop (aligned with the pipeline's own steps, as bench_sequences.py), for
each ``non_identity`` mode of multi-factor on sequences:

* the gate (:func:`deid.evaluation.gate.evaluate`, default settings) on the release, with the
  method re-applied with the same mode (parrot attacker, utility folds), as the release flow does;
* the gate's utility direction by hand: a classifier (the gate's SVM) trained on the release of
  half the people, tested on the other half's originals, on the uint8 release and on the float
  release before rounding (3 person splits);
* the Must-show direction: a classifier trained on source frames reads the released frames
  (:func:`deid.evaluation.sequences.label_agreement`, 3 splits).

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_sequence_modes.py --people 30 --k 3
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
from bench_sequences import SHAPE, aligned_sequence_drop  # noqa: E402

from deid.anonymise.methods import deidentify, method_runner  # noqa: E402
from deid.anonymise.methods_factor import MultiFactor  # noqa: E402
from deid.evaluation.gate import GateConfig, GateInputs, evaluate  # noqa: E402
from deid.evaluation.sequences import label_agreement  # noqa: E402
from deid.evaluation.utility import _svm  # noqa: E402


def gate(X, col, k: int, mode: str) -> None:
    labels = {"gender": col["gender"], "expression": col["expression"]}
    opts = {"non_identity": mode}
    t0 = time.process_time()
    rel, clusters = deidentify(X, shape=SHAPE, people=col["subject_id"], method="multi-factor", k=k, labels=labels,
                               sequences=col["sequence"], frames=col["frame"], options=opts)
    inputs = GateInputs.from_arrays(
        shape=SHAPE, people=col["subject_id"], released=rel, originals=X, clusters=np.asarray(clusters, dtype=object),
        labels={x: np.asarray(v, dtype=object) for x, v in labels.items()}, records_in=len(X),
        deidentify=method_runner("multi-factor", shape=SHAPE, k=k, seed=1, options=opts))
    res = evaluate(inputs, GateConfig(k=k, method="multi-factor", labels=("gender", "expression")))
    worst = max(res.reidentification, key=lambda r: r["upper"])
    print(f"k={k} {mode}: gate {'passed' if res.passed else 'failed'} ({time.process_time() - t0:.0f} cpu s); "
          f"exact bound {res.exact_bound}; worst attack {worst['attacker']}/{worst['mode']} {worst['rate']:.3f} "
          f"[{worst['lower']:.3f}, {worst['upper']:.3f}] on {worst['n_probes']} distinct probes")
    for u in res.utility:
        if u.get("status") and u.get("protocol", "cross-fit") == "cross-fit":
            print(f"    utility {u['label']}: {u['status']}, originals {u['accuracy_original']:.3f} vs release "
                  f"{u['accuracy_release']:.3f}, delta [{u['delta_lower']:+.3f}, {u['delta_upper']:+.3f}]")
    print("    failed: " + (", ".join(c.name for c in res.checks if not c.passed) or "nothing"))


def directions(X, col, k: int, mode: str) -> None:
    P = np.asarray(col["subject_id"], dtype=object)
    y = np.asarray(col["expression"]).astype(str)
    who = np.array(sorted(set(P.tolist())), dtype=object)
    rows = []
    for seed in range(3):
        test = set(np.random.default_rng(seed).permutation(who)[: len(who) // 2].tolist())
        te = np.array([p in test for p in P])
        tr = ~te
        lab = {"gender": [col["gender"][i] for i in np.flatnonzero(tr)], "expression": list(y[tr])}
        f = MultiFactor(k, non_identity=mode).fit(X[tr], people=list(P[tr]), labels=lab).released_
        acc = [np.mean(_svm(50, len(R), X.shape[1], 0).fit(R, y[tr]).predict(X[te].astype(float)) == y[te])
               for R in (np.clip(np.rint(f), 0, 255), f, X[tr].astype(float))]
        full = deidentify(X, shape=SHAPE, people=list(P), method="multi-factor", k=k,
                          labels={"gender": col["gender"], "expression": list(y)}, sequences=col["sequence"],
                          frames=col["frame"], options={"non_identity": mode})[0]
        a = label_agreement(X, full, list(y), list(P), seed=seed)
        rows.append([*acc, a["source_accuracy"], a["released_accuracy"], a["agreement"]])
    m = np.mean(rows, axis=0)
    print(f"    trained on the release -> held-out originals: uint8 {m[0]:.3f}, float before rounding {m[1]:.3f} "
          f"(trained on originals {m[2]:.3f}); source-trained classifier on source {m[3]:.3f}, on release "
          f"{m[4]:.3f}, agreement {m[5]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--people", type=int, default=30)
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--k", type=int, nargs="+", default=[3])
    ap.add_argument("--modes", default="frames,grouped,labels")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_sequence_modes_"))
    try:
        X, col = aligned_sequence_drop(work, people=args.people, frames=args.frames)
        print(f"drop: {len(X)} frames, {args.people} people x 2 sequences x {args.frames} frames")
        for k in args.k:
            for mode in args.modes.split(","):
                gate(X, col, k, mode)
                directions(X, col, k, mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
