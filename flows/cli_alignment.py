"""``deid eval-alignment DROP``: eye detection against the manifest's manual eye points."""
from __future__ import annotations

import json
import sys


def cmd_eval_alignment(args) -> int:
    from deid.alignment.align_eval import evaluate_alignment  # noqa: PLC0415 - OpenCV only when run

    labels = [s.strip() for s in args.labels.split(",") if s.strip()] if args.labels else None
    from deid.alignment.eyes import HaarEyeDetector  # noqa: PLC0415

    detector = HaarEyeDetector(landmarks=args.landmarks)
    ev = evaluate_alignment(args.drop, detector=detector, include_unlabelled=args.all, labels=labels,
                            threshold=args.threshold)
    if args.json:
        json.dump(ev.to_dict(), sys.stdout, indent=2)
        print()
    else:
        print(f"{'image':40s} {'found':>5s} {'source':>13s} {'error':>7s} {'ms':>7s}  note")
        for r in ev.rows:
            err = "" if r.error is None else f"{r.error:.3f}"
            flag = " >threshold" if r.error is not None and r.error >= args.threshold else ""
            print(f"{r.image[-40:]:40s} {'yes' if r.found else 'no':>5s} {r.source or '-':>13s} {err:>7s} "
                  f"{1000 * r.seconds:7.1f}  {r.code or ''}{flag}")
        for key, part in ev.summary().items():
            if key == "threshold":
                continue
            line = (f"{key.replace('_', ' ')}: {part['found']}/{part['images']} found "
                    f"(detection rate {part['detection_rate']:.3f}), {part['aligned']} aligned, "
                    f"{1000 * part['seconds_per_image']:.1f} ms per image (decode + detect)")
            if "mean_error" in part:
                line += (f"; eye error / inter-ocular distance: mean {part['mean_error']:.3f}, median "
                         f"{part['median_error']:.3f}, max {part['max_error']:.3f}, "
                         f"{part['under_threshold']}/{part['found']} under {args.threshold}")
            print(line)
            shares = ", ".join(f"{src} {n} ({part['source_shares'][src]:.1%})" for src, n in part["sources"].items())
            print(f"  eye sources: {shares or 'none'}")
            for src, e in part["error_by_source"].items():
                print(f"  {src}: n={e['n']}, mean error {e['mean_error']:.3f}, max {e['max_error']:.3f}, "
                      f"{e['under_threshold']}/{e['n']} under {args.threshold}")
    truth = ev.summary().get("with_eye_points")
    if truth is None:
        print("deid eval-alignment: no manifest row has eye points to compare with", file=sys.stderr)
        return 2
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("eval-alignment", help="measure eye detection against the manifest's eye points")
    p.add_argument("drop")
    p.add_argument("--all", action="store_true", help="also detect on rows without eye points (detection rate only)")
    p.add_argument("--labels", default=None, help="label columns, if drop.yaml declares none")
    p.add_argument("--threshold", type=float, default=0.10, help="error reported as 'under' (default 0.10)")
    p.add_argument("--json", action="store_true", help="print the per-image rows and summary as JSON")
    p.add_argument("--landmarks", choices=("primary", "fallback", "off"), default="primary",
                   help="dlib 5-point landmarks before the Haar eye cascade (default), after it, or never")
    p.set_defaults(func=cmd_eval_alignment)
