"""``deid study DROP``: every de-identification method over its range of strengths, attacked and scored."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def _numbers(kind: type, name: str, low: float):
    def parse(value: str) -> list:
        out = []
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                v = kind(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"--{name}={value!r}: {part!r} is not a{'n integer' if kind is int else ' number'}") from None
            if v < low:
                raise argparse.ArgumentTypeError(f"--{name}={value!r}: every value must be >= {low:g}")
            out.append(v)
        return out
    return parse


def _names(value: str) -> list[str]:
    return [s.strip() for s in value.split(",") if s.strip()]


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def cmd_study(args) -> int:
    from deid.settings import Settings  # noqa: PLC0415 - keep `deid --help` fast
    from deid.study import StudyConfig, study_drop, summary  # noqa: PLC0415

    drop = Path(args.drop)
    if not drop.is_dir():
        print(f"deid study: drop directory {drop} does not exist", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = Path(args.out) if args.out else Settings().data_path / "study" / drop.resolve().name
    cfg = StudyConfig(ks=args.k, sigmas=args.sigma, blocks=args.block, utility_repeats=args.repeats,
                      seed=args.seed, leak_threshold=args.leak_threshold,
                      **({"methods": args.methods} if args.methods else {}),
                      **({"attackers": args.attackers} if args.attackers else {}),
                      **({"labels": args.labels} if args.labels else {}))
    print(f"deid study: {drop} -> {out}", file=sys.stderr)
    res = study_drop(drop, out, cfg)
    rows = summary(res["rows"])
    utility_keys = sorted({key for s in rows for key in s["utility"] if key[1] == "cv"})
    head = ["method", "strength", "max re-id", "1/k", "worst attacker/mode"] + [f"{lab} acc (cv)" for lab, _ in utility_keys]
    print(" | ".join(head))
    for s in rows:
        if "skipped" in s:
            print(f"{s['method']} | {s['strength_name']}={s['strength']:g} | skipped: {s['skipped']}")
            continue
        cells = [s["method"], f"{s['strength_name']}={s['strength']:g}", _fmt(s["max_rate"]), _fmt(s["bound"]),
                 s["worst"] or "-"] + [_fmt(s["utility"].get(key)) for key in utility_keys]
        print(" | ".join(cells))
    print(f"{res['n_faces']} faces, {res['seconds']} s")
    print(f"csv: {res['csv']}")
    for p in res["plots"]:
        print(f"plot: {p}")
    return EXIT_OK


def register(subparsers) -> None:
    """Add ``deid study`` to the ``deid`` command line."""
    p = subparsers.add_parser("study", help="compare de-identification methods on a drop (CSV + plots)",
                              description="Run k-Same-Select, k-Same, k-Same-naive, blur and pixelation over their "
                                          "strengths on the aligned faces of a drop; attack each release with every "
                                          "attacker in every mode and measure utility; write study.csv and PNG plots.")
    p.add_argument("drop")
    p.add_argument("--k", type=_numbers(int, "k", 2), default=[2, 3, 5, 10], help="k values, e.g. 2,3,5,10")
    p.add_argument("--sigma", type=_numbers(float, "sigma", 0.1), default=[1.0, 2.0, 4.0, 8.0],
                   help="blur standard deviations in canonical pixels, e.g. 1,2,4,8")
    p.add_argument("--block", type=_numbers(int, "block", 1), default=[2, 4, 8, 16],
                   help="pixelation block sides in canonical pixels, e.g. 2,4,8,16")
    p.add_argument("--out", default=None, help="output directory (default: <data dir>/study/<drop name>)")
    p.add_argument("--methods", type=_names, default=None,
                   help="subset of k-same-select,k-same,k-same-naive,blur,pixelate (default all)")
    p.add_argument("--attackers", type=_names, default=None, help="subset of the attackers (default all)")
    p.add_argument("--labels", type=_names, default=None, help="utility labels (default: the drop's)")
    p.add_argument("--repeats", type=int, default=3, help="utility CV repeats per point (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--leak-threshold", type=float, default=2.0,
                   help="mean absolute grey-level difference below which a released face is a near copy")
    p.set_defaults(func=cmd_study)
