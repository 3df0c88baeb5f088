"""Feature drops at k=5: the gate's figures and CPU time, synthetic and (with --london) London's dlib embeddings.

    PYTHONPATH=$PWD python bench/bench_features.py [--people 150 --per-person 2 --dim 32] [--london [PATH]]

Prints, per run: verdict, every attacker x mode rate with its one-sided Clopper-Pearson interval
and number of distinct probes, the cross-fitted utility per label, and CPU seconds. Everything is
written under a temporary directory (the London embeddings too: derived data, never kept). The default
synthetic drop is the one ``tests/integration/test_features_release.py`` releases (150 people x 2, seed 3).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from deid.intake.features import write_feature_drop  # noqa: E402
from deid.intake.synth_features import make_feature_drop  # noqa: E402
from deid.operations.runner import run_release  # noqa: E402
from deid.run_config import RunConfig  # noqa: E402
from deid.settings import Settings  # noqa: E402
from london_set import add_london_option, london_dir  # noqa: E402


def run(drop: Path, root: Path, title: str, **kw) -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    config = RunConfig.resolve(Settings(project_dir=root, seed=None), k=5, kind="features", **kw)
    res = SimpleNamespace(**run_release(drop, config).summary())
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    ds = res.dataset
    print(f"\n{title}: {res.verdict} ({ds['records_released']}/{ds['records_in']} released); "
          f"cpu {cpu:.1f} s, wall {wall:.1f} s; exact bound {res.privacy.get('exact_bound')}, "
          f"max person share {res.privacy.get('max_person_share')}")
    for r in res.privacy.get("reidentification", []):
        print(f"  {r['attacker']:>24}/{r['mode']:<7} {r['rate']:.3f} [{r['lower']:.3f}, {r['upper']:.3f}] "
              f"n={r['n_probes']} of {r['records']} records")
    for u in res.utility:
        if u.get("protocol") == "cross-fit":
            print(f"  utility {u['label']}: originals {u['original_accuracy']:.3f} -> release "
                  f"{u['deidentified_accuracy']:.3f}, delta [{u['delta_lower']:+.3f}, {u['delta_upper']:+.3f}] "
                  f"n={u['n_test_images']}: {u['gate_status']}")
    for reason in res.reasons:
        print(f"  reason: {reason[:160]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--people", type=int, default=150)
    p.add_argument("--per-person", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    add_london_option(p, optional=True)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        drop = make_feature_drop(tmp / "synth", people=args.people, per_person=args.per_person, dim=args.dim, seed=3)
        title = f"synthetic {args.people} people x {args.per_person}, {args.dim}-d"
        run(drop, tmp / "a", f"{title}, k-same-select")
        run(drop, tmp / "b", f"{title}, noise sigma 0.1 (control)", method="noise", sigma=0.1)
        if args.london is not None:
            from deid.alignment.london import align_london
            from deid.evaluation.recognizer import DlibEmbedder

            london = london_dir(args.london)
            c0 = time.process_time()
            faces, people, gender, expression = align_london(london)
            vectors = DlibEmbedder().transform(faces)
            print(f"\nLondon: {len(faces)} faces aligned and embedded in {time.process_time() - c0:.1f} s cpu")
            ldrop = write_feature_drop(tmp / "london", vectors=vectors, subject_ids=people,
                                       labels={"gender": gender, "expression": expression}, name="london-dlib")
            run(ldrop, tmp / "c", "London dlib embeddings (204 x 128), k-same-select", method="k-same-select")
            run(ldrop, tmp / "d", "London dlib embeddings, noise sigma 0.5 (control)", method="noise", sigma=0.5)


if __name__ == "__main__":
    main()
