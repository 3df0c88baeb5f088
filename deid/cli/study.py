"""``deid study DROP``: every de-identification method over its range of strengths, attacked and scored."""
from __future__ import annotations

import argparse
import logging
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


def _fmt(x, digits: int = 3) -> str:
    return "-" if x is None or x == "" else f"{float(x):.{digits}f}"


def _privacy_cell(s: dict) -> str:
    if s["max_rate"] is None:
        return "-"
    return f"{s['max_rate']:.3f} [{s['lower']:.3f}, {s['upper']:.3f}] n={s['n']} ({s['worst']})"


def _utility_cell(u: dict | None) -> str:
    if not u or u["delta"] is None:
        return "-"
    return f"{u['accuracy']:.3f} (delta {u['delta']:+.3f} [{_fmt(u['lower'])}, {_fmt(u['upper'])}] {u['status']})"


def summary_table(rows: list[dict]) -> list[str]:
    """The study's summary as markdown lines: one row per method and strength, the k-based
    methods grouped by k, with the gate's verdict, the worst attack with its interval, the
    exact share and the cross-fitted utility per label."""
    from deid.study import summary  # noqa: PLC0415

    points = summary(rows)
    labels = list(dict.fromkeys(lab for s in points for lab in s["utility"]))
    head = ["method", "strength", "gate", "failing checks", "max re-id [interval] n (attacker/mode)",
            "exact share"] + [f"{lab} acc (cross-fit delta [bounds] status)" for lab in labels] + ["s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(points, key=lambda s: (s["strength_name"] != "k", s["strength_name"],
                                          s["strength"] if s["strength_name"] == "k" else 0, s["method"],
                                          s["strength"]))
    for s in order:
        strength = f"{s['strength_name']}={s['strength']:g}"
        if s["verdict"] == "skipped":
            lines.append(f"| {s['method']} | {strength} | skipped | {s.get('skipped', '')} |")
            continue
        share = _fmt(s["max_person_share"]) + (" (exact)" if s["exact_bound"] else "")
        cells = [s["method"], strength, s["verdict"] or "-", ", ".join(s["failed"]) or "-", _privacy_cell(s),
                 share] + [_utility_cell(s["utility"].get(lab)) for lab in labels] + [_fmt(s["seconds"], 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _progress() -> None:
    """One log line per studied point (deid.study at INFO) even when the CLI logs only warnings."""
    log = logging.getLogger("deid.study")
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)


def cmd_study(args) -> int:
    from dataclasses import replace  # noqa: PLC0415

    from deid.errors import ConfigError  # noqa: PLC0415
    from deid.evaluation.gate_types import GateConfig  # noqa: PLC0415
    from deid.settings import Settings  # noqa: PLC0415 - keep `deid --help` fast
    from deid.study import StudyConfig, study_drop  # noqa: PLC0415

    drop = Path(args.drop)
    if not drop.is_dir():
        print(f"deid study: drop directory {drop} does not exist", file=sys.stderr)
        return EXIT_BAD_INPUT
    settings = Settings()
    out = Path(args.out) if args.out else settings.data_path / "study" / drop.resolve().name
    try:
        # The gate the release flow would run (deid/operations/gate_publish.py), with the study's overrides.
        overrides = {"leak_threshold": args.leak_threshold, "deep_attack_sample": args.deep_sample,
                     "repeats": args.repeats, "seed": args.seed}
        gate = GateConfig.from_settings(settings, k=2, method="k-same",
                                        **{name: v for name, v in overrides.items() if v is not None})
        if args.attackers:
            gate = replace(gate, attackers=tuple(args.attackers))
        cfg = StudyConfig(ks=args.k, sigmas=args.sigma, blocks=args.block, gate=gate,
                          methods=tuple(args.methods) if args.methods else None,
                          labels=tuple(args.labels) if args.labels else None, workers=args.workers,
                          # The release flow's seed policy: secret per point unless --seed / DEID_SEED fixes it.
                          seed=args.seed if args.seed is not None else settings.seed)
        print(f"deid study: {drop} -> {out}", file=sys.stderr)
        _progress()
        res = study_drop(drop, out, cfg)
    except ConfigError as exc:
        print(f"deid study: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("\n".join(summary_table(res["rows"])))
    print(f"{res['n_faces']} {'feature records' if res.get('kind') == 'features' else 'faces'}, {res['seconds']} s")
    print(f"csv: {res['csv']}")
    for p in res["plots"]:
        print(f"plot: {p}")
    return EXIT_OK


def register(subparsers) -> None:
    """Add ``deid study`` to the ``deid`` command line."""
    p = subparsers.add_parser("study", help="compare de-identification methods on a drop (CSV + plots)",
                              description="Run every method of the registry over its strengths on the aligned faces "
                                          "of a drop and judge each point with the release gate (attacks with "
                                          "intervals, exact share, cross-fitted utility); write study.csv, PNG plots "
                                          "and a grid of released faces to --out (keep it outside the repository). "
                                          "On a feature drop (drop.yaml kind: features) the feature methods run on "
                                          "its vectors, judged by the feature-space attackers; no faces are drawn.")
    p.add_argument("drop")
    p.add_argument("--k", type=_numbers(int, "k", 2), default=[2, 3, 5, 10], help="k values, e.g. 2,3,5,10")
    p.add_argument("--sigma", type=_numbers(float, "sigma", 0.1), default=[1.0, 2.0, 4.0, 8.0],
                   help="blur standard deviations in canonical pixels (feature drops: the noise method's, in "
                        "feature standard deviations), e.g. 1,2,4,8")
    p.add_argument("--block", type=_numbers(int, "block", 1), default=[2, 4, 8, 16],
                   help="pixelation block sides in canonical pixels, e.g. 2,4,8,16")
    p.add_argument("--out", default=None, help="output directory (default: <data dir>/study/<drop name>)")
    p.add_argument("--methods", type=_names, default=None,
                   help="subset of the registry's methods, comma-separated (default: all of them)")
    p.add_argument("--attackers", type=_names, default=None,
                   help="subset of the attackers (default all, dlib-resnet included on the gate's deep_attack_sample)")
    p.add_argument("--deep-sample", type=int, default=None,
                   help="records attacked by the deep recogniser per point (default: settings deep_attack_sample)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes studying points in parallel (default 1; the machine's cores at most)")
    p.add_argument("--labels", type=_names, default=None, help="utility labels (default: the drop's)")
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats of the older utility protocols per point (default: settings cv_repeats)")
    p.add_argument("--seed", type=int, default=None,
                   help="fix the methods' random seed (not secret: the parrot attacker then re-runs a random method "
                        "with it) and the gate's samples; default: DEID_SEED, else a secret seed per point from the "
                        "OS, as a release")
    p.add_argument("--leak-threshold", type=float, default=None,
                   help="mean absolute grey-level difference below which a released face is a near copy "
                        "(default: settings leak_threshold)")
    p.set_defaults(func=cmd_study)
