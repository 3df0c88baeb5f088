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

``--label-groups`` adds a candidate for continuous expression with privacy, ``label-groups``: the
"frames" factor (label effects plus the frame's own residual in the label-effect span), then
k-Same on that factor within each (identity cluster x expression label) cell
(:func:`deid.anonymise.methods_factor.group_within_clusters`: every group holds one frame of each of
the cluster's >= k people, matched by nearest factor), so a group's frames get one identical image
(the k-Same structure, exact bound) while the groups of a cell still differ in how far the mouth is
open. It reports the gate on it (re-run by the parrot with the same grouping) and how well the
released frames keep the synthetic mouth openness within a label (a ridge regressor trained on other
people's source frames; Pearson r with the drawn openness, within the talking frames).
Measured (30 people x 2 sequences x 12 frames, k=3, 42 CPU s): 216 groups of 3 people, exact bound,
max person share 1/3; parrot 0.300 [0.214, 0.394] on 216 distinct probes (every attacker but
dlib, which gets 0.175 [0.034, 0.474] on 29), so re-identification passes; openness within 'talk'
r = +0.58 (labels mode: 0.00, source frames: +0.30); but the gate's expression utility fails (a
classifier trained on the release reads held-out originals at 0.467 vs 0.899, delta [+0.337,
+0.527]; labels mode 0.836, inconclusive), as "frames" and "grouped" do: not the default.

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_sequence_modes.py --people 30 --k 3
"""
from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_sequences import SHAPE, aligned_sequence_drop  # noqa: E402

from deid.anonymise.methods import deidentify, method_runner  # noqa: E402
from deid.anonymise.methods_factor import MultiFactor, group_means, group_within_clusters  # noqa: E402
from deid.anonymise.methods_ksame import to_uint8  # noqa: E402
from deid.evaluation.gate_rows import AttackRow  # noqa: E402
from deid.intake.synth_sequences import SEQUENCE_KINDS, frame_states  # noqa: E402
from deid.evaluation.gate_types import GateConfig, GateInputs  # noqa: E402
from deid.evaluation.gate import evaluate  # noqa: E402
from deid.evaluation.sequences import label_agreement  # noqa: E402
from deid.evaluation.utility_classifier import svm_pipeline  # noqa: E402


def sequence_gate(X, col, k: int, method: str, released, clusters, deidentify, *, extra_checks=()):
    """The gate (default settings) on a sequence release with the drop's two labels, as the release flow runs it.

    ``deidentify``: the method re-applied by the parrot attacker and the utility folds.
    """
    labels = {"gender": col["gender"], "expression": col["expression"]}
    inputs = GateInputs.from_arrays(
        shape=SHAPE, people=col["subject_id"], released=released, originals=X,
        clusters=np.asarray(clusters, dtype=object),
        labels={x: np.asarray(v, dtype=object) for x, v in labels.items()}, records_in=len(X),
        extra_checks=tuple(extra_checks), deidentify=deidentify)
    return evaluate(inputs, GateConfig(k=k, method=method, labels=tuple(labels)))


def worst_attack(res) -> AttackRow:
    """The attack row with the highest upper bound (the one the gate decides on)."""
    return max(res.reidentification, key=lambda r: r.upper)


def print_gate_rows(res, *, parrot: bool) -> None:
    """The gate's parrot attack rows (if ``parrot``), then its cross-fit utility rows, one line each."""
    if parrot:
        for r in res.reidentification:
            if r.mode == "parrot":
                print(f"    parrot {r.attacker}: {r.rate:.3f} [{r.lower:.3f}, {r.upper:.3f}] n={r.n_probes}")
    for u in res.utility:
        ev = u.evidence
        if ev.get("status") and (u.protocol or "cross-fit") == "cross-fit":
            print(f"    utility {u.label}: {ev['status']}, originals {ev['accuracy_original']:.3f} vs release "
                  f"{ev['accuracy_release']:.3f}, delta [{ev['delta_lower']:+.3f}, {ev['delta_upper']:+.3f}]")


def gate(X, col, k: int, mode: str) -> None:
    labels = {"gender": col["gender"], "expression": col["expression"]}
    opts = {"non_identity": mode}
    t0 = time.process_time()
    rel, clusters = deidentify(X, shape=SHAPE, people=col["subject_id"], method="multi-factor", k=k, labels=labels,
                               sequences=col["sequence"], frames=col["frame"], options=opts)
    res = sequence_gate(X, col, k, "multi-factor", rel, clusters,
                        method_runner("multi-factor", shape=SHAPE, k=k, seed=1, options=opts))
    worst = worst_attack(res)
    print(f"k={k} {mode}: gate {'passed' if res.passed else 'failed'} ({time.process_time() - t0:.0f} cpu s); "
          f"exact bound {res.exact_bound}; worst attack {worst.attacker}/{worst.mode} {worst.rate:.3f} "
          f"[{worst.lower:.3f}, {worst.upper:.3f}] on {worst.n_probes} distinct probes")
    print_gate_rows(res, parrot=False)
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
        acc = [np.mean(svm_pipeline(50, len(R), X.shape[1], 0).fit(R, y[tr]).predict(X[te].astype(float)) == y[te])
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


def label_groups(X, *, people, labels, k: int, partitions=None, points=None) -> tuple[np.ndarray, np.ndarray]:
    """The ``label-groups`` candidate: (released uint8, group of every frame); a gate ``deidentify`` callable too."""
    m = MultiFactor(k, non_identity="frames").fit(X, people=list(people), labels=labels)
    pcodes = np.unique(np.asarray(people, dtype=object).astype(str), return_inverse=True)[1]
    lab = np.zeros(len(X), dtype=np.intp)
    for name in m.non_identity_labels_:  # the labels that vary within people (expression), jointly
        codes = np.unique(np.asarray(labels[name], dtype=object).astype(str), return_inverse=True)[1]
        lab = lab * (codes.max() + 1) + codes
    cell = np.unique(np.stack([m.labels_, lab], axis=1), axis=0, return_inverse=True)[1].ravel()
    groups = group_within_clusters(m.non_identity_, pcodes, cell)
    V = group_means(m.non_identity_, groups, int(groups.max()) + 1)[groups]
    e = m.eigenfaces_
    coef = m.cluster_identity_[m.labels_] + V
    return to_uint8(e.mean_.astype(np.float64) + coef @ e.components_.astype(np.float64)), groups


def _label_groups_runner(images, *, k: int, people, partitions=None, labels=None, points=None) -> np.ndarray:
    """The gate's ``deidentify``: the candidate re-applied (parrot gallery, utility folds)."""
    return label_groups(np.asarray(images), people=people, labels=labels, k=k)[0]


def openness(col) -> np.ndarray:
    """The drawn mouth openness of every frame (NaN: a smiling sequence's frame), from the generator's rules."""
    n_frames = max(col["frame"]) + 1
    out = np.full(len(col["frame"]), np.nan)
    for i, (key, t) in enumerate(zip(col["sequence"], col["frame"])):
        number, q = int(key.split("-q")[0][1:]), int(key.split("-q")[1])
        kind = SEQUENCE_KINDS[(q + number) % 2]
        o = frame_states(kind, n_frames)[t][2]
        out[i] = np.nan if o is None else o
    return out


def openness_kept(X, released, col, *, seeds=3) -> tuple[float, float, int]:
    """Pearson r between the drawn openness and a source-trained ridge regressor's reading of the released
    talking frames of held-out people: over all talking frames, and within the 'talk' label (mean of splits)."""
    from sklearn.linear_model import Ridge  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415

    from deid.alignment.features import Eigenfaces  # noqa: PLC0415

    o = openness(col)
    P = np.asarray(col["subject_id"], dtype=object)
    y = np.asarray(col["expression"]).astype(str)
    who = np.array(sorted(set(P.tolist())), dtype=object)
    r_all, r_talk, n = [], [], 0
    for seed in range(seeds):
        test = set(np.random.default_rng(seed).permutation(who)[: len(who) // 2].tolist())
        te = np.array([p in test for p in P]) & ~np.isnan(o)
        tr = np.array([p not in test for p in P]) & ~np.isnan(o)
        reg = make_pipeline(Eigenfaces(30, random_state=seed), Ridge(1.0)).fit(X[tr], o[tr])
        pred = reg.predict(released[te])
        r_all.append(np.corrcoef(pred, o[te])[0, 1] if np.std(pred) > 0 else 0.0)
        talk = y[te] == "talk"
        pt = pred[talk]
        r_talk.append(np.corrcoef(pt, o[te][talk])[0, 1] if np.std(pt) > 1e-9 else 0.0)
        n = int(talk.sum())
    return float(np.mean(r_all)), float(np.mean(r_talk)), n


def label_groups_gate(X, col, k: int) -> None:
    labels = {"gender": col["gender"], "expression": col["expression"]}
    t0 = time.process_time()
    rel, groups = label_groups(X, people=col["subject_id"], labels=labels, k=k)
    P = np.asarray(col["subject_id"], dtype=object)
    sizes = [len(set(P[groups == g])) for g in np.unique(groups)]
    res = sequence_gate(X, col, k, "multi-factor", rel, groups.astype(str).astype(object),
                        functools.partial(_label_groups_runner, k=k))
    worst = worst_attack(res)
    print(f"k={k} label-groups: {len(sizes)} groups of >= {min(sizes)} people; gate "
          f"{'passed' if res.passed else 'failed'} ({time.process_time() - t0:.0f} cpu s); exact bound "
          f"{res.exact_bound}, max person share {res.max_person_share}; worst attack {worst.attacker}/"
          f"{worst.mode} {worst.rate:.3f} [{worst.lower:.3f}, {worst.upper:.3f}] on {worst.n_probes} "
          "distinct probes")
    print_gate_rows(res, parrot=True)
    print("    failed: " + (", ".join(c.name for c in res.checks if not c.passed) or "nothing"))
    for name, R in (("source frames", X), ("label-groups", rel),
                    *((mode, deidentify(X, shape=SHAPE, people=col["subject_id"], method="multi-factor", k=k,
                                        labels=labels, sequences=col["sequence"], frames=col["frame"],
                                        options={"non_identity": mode})[0]) for mode in ("labels", "frames"))):
        r_all, r_talk, n = openness_kept(X, R, col)
        print(f"    openness kept, {name:13s}: r {r_all:+.3f} over talking frames, {r_talk:+.3f} within 'talk' "
              f"({n} held-out 'talk' frames per split)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--people", type=int, default=30)
    ap.add_argument("--frames", type=int, default=12)
    ap.add_argument("--k", type=int, nargs="+", default=[3])
    ap.add_argument("--modes", default="frames,grouped,labels")
    ap.add_argument("--label-groups", action="store_true", help="also the label-groups candidate (see the docstring)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_sequence_modes_"))
    try:
        X, col = aligned_sequence_drop(work, people=args.people, frames=args.frames)
        print(f"drop: {len(X)} frames, {args.people} people x 2 sequences x {args.frames} frames")
        for k in args.k:
            if args.label_groups:
                label_groups_gate(X, col, k)
            for mode in [m for m in args.modes.split(",") if m]:
                gate(X, col, k, mode)
                directions(X, col, k, mode)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
