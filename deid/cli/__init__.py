"""The ``deid`` command line: run, synth, import, verify, keygen.

Exit codes are chosen by the *type* of what happened, never by message text: :data:`EXIT_BY_TYPE` (exception
type -> code), :data:`VERIFY_EXIT` (``deid verify``'s failure types -> 3-7) and :data:`EXIT_MEANINGS` (what each
code means per command; the docs' exit-code table is generated from the three): 0 released / verified, 1 rejected,
2 bad input or configuration, 3-7 verification failures by type, 8 integrity only, 70 stored state or internal
error, 74 environment failure, 130 interrupted.

Prefect is imported only by ``deid run``, so the other commands start fast.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

# Multi-threaded OpenBLAS spins on its threads and, next to Dask workers on a small machine,
# made a 64x7452 SVD 40x slower (1.1 s vs 0.03 s measured); parallelism comes from Dask instead.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from deid.errors import (  # noqa: E402
    BadSignature,
    ConfigError,
    DataError,
    DeidError,
    EnvironmentFailure,
    HashMismatch,
    MissingFile,
    ReleaseRejected,
    StateError,
    UnlistedFile,
    VerificationError,
    WrongKey,
)
from deid.method_registry import FEATURE_ONLY, METHODS, method_help  # noqa: E402  (light: the CLI keeps heavy imports lazy)
from deid.settings import SMALL_PARTITION_POLICIES, in_declared_range, range_text  # noqa: E402

FEATURE_ONLY_METHODS = tuple(FEATURE_ONLY)  # methods of feature drops only (the registry's FEATURE_ONLY)
EXIT_OK, EXIT_REJECTED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTEGRITY_ONLY = 8
EXIT_STATE = 70  # sysexits EX_SOFTWARE
EXIT_ENVIRONMENT = 74  # sysexits EX_IOERR
EXIT_INTERRUPTED = 130
# Exception type -> exit code, most specific first (see the module docstring).
EXIT_BY_TYPE: tuple[tuple[type[BaseException], int], ...] = (
    (EnvironmentFailure, EXIT_ENVIRONMENT),
    (StateError, EXIT_STATE),
    (DataError, EXIT_BAD_INPUT),
    (ConfigError, EXIT_BAD_INPUT),
    (VerificationError, EXIT_REJECTED),
    (ReleaseRejected, EXIT_REJECTED),
    (DeidError, EXIT_BAD_INPUT),
    # A path the user named that is missing or taken is bad input; any other OS error is the machine's.
    (FileNotFoundError, EXIT_BAD_INPUT),
    (FileExistsError, EXIT_BAD_INPUT),
    (NotADirectoryError, EXIT_BAD_INPUT),
    (IsADirectoryError, EXIT_BAD_INPUT),
    (OSError, EXIT_ENVIRONMENT),
)
# What each exit code means, for `deid run` and for `deid verify` ("" where the command never exits with it);
# the documentation's exit-code table is generated from this, EXIT_BY_TYPE and VERIFY_EXIT (docs/gen_reference.py).
EXIT_MEANINGS: dict[int, tuple[str, str]] = {
    EXIT_OK: ("released: report signed, then the release published (a Prefect API lost after the verdict is a "
              "warning naming the API's URL, not a failure: the outcome on disk stands, and the run stops talking to "
              "the lost API at once, so it exits seconds after its verdict)",
              "verified: signature (report.json's, or a release directory's `ATTESTATION.json`) checked against the "
              "trusted `--public-key`, every file matches"),
    EXIT_REJECTED: ("rejected by the gate (signed rejection)", "another verification problem"),
    EXIT_BAD_INPUT: ("bad input data (`DataError`: no `manifest.csv`, a declared label missing, a file given for the "
                     "drop; an unreadable drop is refused after signing a rejection naming the reason, and so is a "
                     "data error raised later, e.g. inside the gate's attackers: check `gate_error`, \"REJECTED "
                     "(unusable drop)\") or bad configuration (`ConfigError`: a CLI option, a `DEID_*` value, an "
                     "unreadable or wrongly protected key file: before any work)",
                     "bad input (a release, report or `--release` path that is not a directory, e.g. mistyped; "
                     "`--release` with a release directory; an unusable `--public-key`)"),
    EXIT_INTEGRITY_ONLY: ("", "**integrity only**: no `--public-key`, files match, signature *not* checked (a forged "
                              "signature looks the same)"),
    EXIT_STATE: ("stored state or internal error (`StateError`: a tampered, rolled-back or deleted lineage registry, "
                 "after signing a rejection with check `state` naming it; publishing failed after signing, and a "
                 "signed `addendum.json` says it was not published; keys present but inconsistent, e.g. a `.pub.pem` "
                 "of another key; a ledger entry not claimed; a staged release the run cannot hash; an internal error, a "
                 "defect, after signing a rejection with check `internal` naming its type)", ""),
    EXIT_ENVIRONMENT: ("environment failure (`EnvironmentFailure`, `OSError`): disk full, I/O error, permissions, a "
                       "pinned package missing, the lineage database unreachable (never \"rejected\"; a signed "
                       "rejection with check `environment` when the reports disk allows)", ""),
    EXIT_INTERRUPTED: ("interrupted", "interrupted"),
}


def exit_code_for(exc: BaseException) -> int:
    """The exit code of an exception, by its type (EXIT_STATE for anything unexpected)."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    for kind, code in EXIT_BY_TYPE:
        if isinstance(exc, kind):
            return code
    return EXIT_STATE
# Modules adding subcommands (each has register(subparsers) and keeps heavy imports lazy).
EXTENSIONS = ("deid.cli.alignment", "deid.cli.study", "deid.cli.report", "deid.cli.ops", "deid.cli.lineage",
              "deid.cli.releases", "deid.cli.gc")


def _labels(value: str | None) -> list[str] | None:
    if value is None:
        return None
    out = [s.strip() for s in value.split(",") if s.strip()]
    if not out:
        raise argparse.ArgumentTypeError("--labels needs at least one column name, e.g. gender,expression")
    return out


def _k(value: str) -> int:
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k={value!r} must be {range_text('k')}") from None
    if not in_declared_range("k", k):  # the range Settings declares for k, not a copy
        raise argparse.ArgumentTypeError(f"--k={k} must be {range_text('k')}" + (": k=1 is no anonymity" if k == 1 else ""))
    return k


def _quiet_prefect_env() -> None:
    # Telemetry off by default; the user's explicit settings win.
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _settings():
    """Settings from the environment; a bad DEID_* value is a ConfigError naming it."""
    from pydantic import ValidationError  # noqa: PLC0415

    from deid.settings import Settings  # noqa: PLC0415

    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "DEID_" + str(first["loc"][0]).upper() if first.get("loc") else "a DEID_ setting"
        raise ConfigError(f"{field}={first.get('input')!r}: {first['msg']}; fix or unset it") from None


def preflight_run() -> None:
    """Before Prefect starts: settings, the signing key (readable, 0600, passphrase) and writable locations."""
    from deid.operations.safety import preflight_locations  # noqa: PLC0415
    from deid.release.signing import ensure_signing_key  # noqa: PLC0415

    settings = _settings()
    preflight_locations(settings.data_path, settings.reports_path)
    secret = settings.signing_key_passphrase
    ensure_signing_key(configured=settings.signing_key, keys_dir=settings.data_path / "keys",
                       passphrase_env_value=secret.get_secret_value().encode() if secret else None)


class _NoTracebacks(logging.Filter):
    """Console filter: Prefect's failure records lose their traceback (the CLI prints one line instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.name.startswith("prefect"):
            if record.exc_info or "Finished in state Failed" in record.getMessage():
                return False
        return True


def _quiet_prefect_tracebacks() -> None:
    flt = _NoTracebacks()
    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict)
                                       if n.startswith("prefect")]
    for lg in loggers:
        for h in lg.handlers:
            # Console only: the API handler still sends the full failure to the Prefect UI.
            if isinstance(h, logging.StreamHandler):
                h.addFilter(flt)




def cmd_run(args) -> int:
    drop = Path(args.drop)
    if drop.is_file():
        raise DataError(f"drop {drop} is a file; give the drop directory (the one holding manifest.csv and the images)")
    if not drop.is_dir():
        raise DataError(f"drop directory {drop} does not exist or is not a directory")
    from deid.intake.features import run_kind  # noqa: PLC0415
    from deid.orchestration.cluster import close_prestarted, needs_recognizer, prestart_pool, uses_pool  # noqa: PLC0415
    from deid.run_config import RunConfig  # noqa: PLC0415

    kind = run_kind(drop)
    settings = _settings()
    pooled = uses_pool(drop, address=settings.dask_address, max_records=settings.local_pool_max_records)
    if pooled:
        # A small drop's pool first: its processes import (and load what the run needs) while this
        # one resolves the configuration, imports Prefect and the flow, and the server starts.
        prestart_pool(settings.dask_workers, recognizer=needs_recognizer(
            SimpleNamespace(kind=kind, identity_embed_max=settings.identity_embed_max), drop))
    try:
        # The run's configuration, validated once before Prefect starts: its resolved values are the
        # flow run's parameters (no `k: null` in the UI). A feature drop admits the feature methods.
        config = RunConfig.resolve(settings, k=args.k, method=args.method, labels=args.labels,
                                   small_partitions=args.small_partitions, name=args.name, sigma=args.sigma,
                                   block=args.block, kind=kind)
        preflight_run()
        _quiet_prefect_env()
        from deid.orchestration.prefect_api import connect, warm_imports  # noqa: PLC0415

        # The Prefect API next: a temporary server boots in its own process while this one imports.
        api = connect(config.data_path, log_path=config.data_path / "logs" / "prefect-server.log")
    except BaseException:
        close_prestarted()
        raise
    try:
        from deid.flows.release import run_flow  # noqa: PLC0415 - Prefect is heavy; only `run` needs it

        if not args.debug:
            _quiet_prefect_tracebacks()
        # Long stages report records done and time left (deid.progress, throttled) even when other logs are quiet.
        logging.getLogger("deid.progress").setLevel(logging.INFO)
        warm_imports(api, validation=not pooled)
        api.wait()
        print(f"deid run: {drop} ({'feature drop, ' if kind == 'features' else ''}k={config.k}, "
              f"method={config.method})", file=sys.stderr)
        print(f"deid run: prefect: {api.describe()}", file=sys.stderr)
        from deid.orchestration.logs import report_instead_of_ui  # noqa: PLC0415

        with report_instead_of_ui(config.reports_path) if not api.has_ui else contextlib.nullcontext():
            result = run_flow(str(drop.resolve()), **config.parameters())
    finally:
        close_prestarted()
        api.stop()
    print_summary(result)  # an unreadable drop too: its signed rejection and root cause, then exit 2
    if result.input_error:
        raise DataError(result.input_error)
    if result.timings:
        print("deid run: stage seconds (wall/CPU): " + ", ".join(
            f"{k} {v['wall']:.2f}" + (f"/{v['cpu']:.2f}" if v.get("cpu") is not None else "")
            for k, v in result.timings.items()), file=sys.stderr)
    return EXIT_OK if result.released else EXIT_REJECTED


def print_summary(result) -> None:
    """The run's verdict summary (:mod:`deid.reporting.verdict`: the same one report.html and the Prefect UI
    show), then where the release and the signed report are and how to verify them."""
    from deid.reporting.verdict import verdict_summary  # noqa: PLC0415

    for line in verdict_summary(result.report, report_html=result.report_dir / "report.html").text_lines():
        print(line)
    if result.release_dir:
        print(f"release: {result.release_dir}")
    print(f"signed report: {result.report_path}")
    if result.release_dir:
        # What a recipient runs on the release directory alone (its signed ATTESTATION.json), with the key the
        # steward gives them.
        print(f"verify release: deid verify {result.release_dir} --public-key "
              f"{result.public_key or 'STEWARD.pub.pem'}")
    if result.key_origin == "development":
        print(f"signed with the development key; verify with: deid verify {result.report_dir} "
              f"--public-key {result.public_key}")


def cmd_synth(args) -> int:
    if args.people is None and (args.kind == "features" or args.sequences or args.video or args.counts is None):
        raise ConfigError("--people is required (a positive integer, e.g. --people 20) unless --counts gives the "
                          "images of each person")
    if args.kind == "features":
        from deid.intake.synth_features import make_feature_drop  # noqa: PLC0415

        path = make_feature_drop(Path(args.drop), people=args.people, per_person=args.per_person, dim=args.dim,
                                 labels=[] if args.no_labels else args.labels,
                                 person_labels=args.person_labels, seed=args.seed, noise=args.noise)
        print(f"synthetic feature drop: {path} ({args.people} people x {args.per_person} records, dim {args.dim}, "
              f"seed {args.seed})")
        return EXIT_OK
    from deid.intake.synth import make_synthetic_drop

    if args.video:
        from deid.intake.synth_videos import make_video_drop  # noqa: PLC0415

        path = make_video_drop(Path(args.drop), people=args.people, recordings=args.sequences or 2,
                               seconds=args.seconds, fps=args.fps, width=args.width, height=args.height,
                               seed=args.seed, extras=not args.no_extras)
        print(f"synthetic video drop: {path} ({args.people} people x {args.sequences or 2} recordings, "
              f"{args.seconds:g} s at {args.fps:g} fps, {args.width}x{args.height}, seed {args.seed})")
        return EXIT_OK
    if args.sequences:
        from deid.intake.synth_sequences import make_sequence_drop

        path = make_sequence_drop(Path(args.drop), people=args.people, sequences_per_person=args.sequences,
                                  frames=args.frames, seed=args.seed, image_size=args.size)
        print(f"synthetic sequence drop: {path} ({args.people} people x {args.sequences} sequences x "
              f"{args.frames} frames, talking and smiling, seed {args.seed})")
        return EXIT_OK
    from deid.intake.synth import zipf_counts  # noqa: PLC0415

    counts, per = args.counts, args.images_per_person
    if per == "zipf":
        if counts is not None:
            raise ConfigError("--images-per-person zipf and --counts both give the images per person; use one")
        counts, per = list(zipf_counts(args.people, top=args.zipf_top)), 2
    if counts is not None and args.people is not None and len(counts) != args.people:
        raise ConfigError(f"--counts has {len(counts)} entries but --people is {args.people}; give one count per "
                          "person (or leave --people out: it is then the number of counts)")
    people = len(counts) if counts is not None and args.people is None else args.people
    if people is None:
        raise ConfigError("--people is required (or --counts, whose length is the number of people)")
    if args.colour and (args.grey or args.format in ("pgm", "gif")):
        raise ConfigError(f"--colour cannot be combined with --grey or --format {args.format}; drop one of them")
    path = make_synthetic_drop(Path(args.drop), people=people, images_per_person=int(per),
                               seed=args.seed, image_format=args.format, image_size=args.size,
                               condition_values=args.condition_values, crop=args.crop, grey=args.grey,
                               lighting=args.lighting, background="clutter" if args.colour else args.background,
                               labels=not args.no_labels, eyes=not args.no_eyes, workers=args.workers,
                               quick_noise=args.quick_noise, fast=args.fast, counts=counts,
                               pose_spread=args.pose_spread, frames_per_sequence=args.frames_per_sequence,
                               frame_jitter=args.frame_jitter)
    shape = f"{sum(counts)} images ({min(counts)}-{max(counts)} a person)" if counts else f"{per} images"
    print(f"synthetic drop: {path} ({people} people, {shape}, seed {args.seed})")
    return EXIT_OK


def _images_per_person(text: str) -> int | str:
    if text.strip().lower() == "zipf":
        return "zipf"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'zipf'") from None


def _counts(text: str) -> list[int]:
    try:
        out = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers, e.g. 47,40,33") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list at least one count, each >= 1, e.g. 47,40,33")
    return out


def cmd_import(args) -> int:
    if args.source != "london":
        print(f"deid import: unknown source {args.source!r}; known: london", file=sys.stderr)
        return EXIT_BAD_INPUT
    from deid.intake.london import import_london

    path = import_london(Path(args.src), Path(args.drop))
    print(f"London drop: {path} (licence CC BY 4.0: drop.yaml carries its citation into the dataset card)")
    return EXIT_OK


def cmd_verify(args) -> int:
    from deid.release.attestation import ATTESTATION_NAME
    from deid.release.manifest import MANIFEST_NAME
    from deid.release.signing import load_public_key
    from deid.reporting.verify import verify_release, verify_report
    from deid.reporting.report import REPORT_NAME

    # A mistyped path is bad input (exit 2), not a verification failure: nothing was there to check.
    for option, value in (("path", args.report_dir), ("--release", args.release)):
        if value is not None and not Path(value).is_dir():
            raise DataError(f"{option} {value} is not a directory; give a release directory (holding "
                            f"{ATTESTATION_NAME}) or a report directory (reports/<release id>, holding {REPORT_NAME})"
                            if option == "path" else
                            f"{option} {value} is not a directory; give the release directory")
    if args.public_key:
        load_public_key(Path(args.public_key))  # an unusable --public-key is bad input (ConfigError, exit 2), not a failed check
    target = Path(args.report_dir)
    # A release directory (what a recipient has) carries its signed attestation (or, without one, at least its
    # MANIFEST.sha256: verify_release then says the attestation is missing) and no report.json.
    alone = not (target / REPORT_NAME).exists() and ((target / ATTESTATION_NAME).exists()
                                                     or (target / MANIFEST_NAME).exists())
    if alone and args.release:
        raise DataError(f"--release {args.release} is for a report directory; {target} is a release directory "
                        "(holding its attestation): drop --release")
    if alone:
        res = verify_release(target, public_key=Path(args.public_key) if args.public_key else None)
    else:
        res = verify_report(target, public_key=Path(args.public_key) if args.public_key else None,
                            release_dir=Path(args.release) if args.release else None)
    for note in res.notes:
        print(f"note: {note}")
    for problem in res.problems:
        print(f"FAIL: {problem}")
    if res.ok and res.authenticated:
        print("OK: signature and every artifact verified" if not alone else
              f"OK: {ATTESTATION_NAME} signature and every file of the release verified")
        return EXIT_OK
    if res.ok:
        # Never 0: without a trusted key a forged signature looks exactly like a genuine one.
        print(f"INTEGRITY ONLY: every file matches the {'attestation' if alone else 'report'}, but the signature "
              "was NOT checked "
              "(no --public-key); this does not show who made the release")
        return EXIT_INTEGRITY_ONLY
    return verify_exit_code(res.failures)


# One exit code per kind (type) of verification failure, most serious first when several occur.
VERIFY_EXIT: tuple[tuple[type[VerificationError], int], ...] = (
    (WrongKey, 4), (BadSignature, 3), (HashMismatch, 6), (MissingFile, 5), (UnlistedFile, 7))


def verify_exit_help() -> str:
    """``deid verify``'s exit codes, from :data:`VERIFY_EXIT` (each failure type's name in words)."""
    by_type = ", ".join(f"{code} {re.sub(r'(?<!^)(?=[A-Z])', ' ', kind.__name__).lower()}"
                        for kind, code in sorted(VERIFY_EXIT, key=lambda row: row[1]))
    return (f"Exit codes: {EXIT_OK} verified with the trusted key, {EXIT_INTEGRITY_ONLY} integrity only (no "
            f"--public-key: files match, signature not checked), {by_type}, {EXIT_REJECTED} other problem, "
            f"{EXIT_BAD_INPUT} bad input.")


def verify_exit_code(failures: list[VerificationError]) -> int:
    """3 bad signature, 4 wrong key, 5 missing file, 6 hash mismatch, 7 extra unlisted file, 1 other (by type)."""
    for kind, code in VERIFY_EXIT:
        if any(isinstance(f, kind) for f in failures):
            return code
    return EXIT_REJECTED


def cmd_keygen(args) -> int:
    from deid.release.signing import write_keypair

    passphrase = os.environ.get(args.passphrase_env) if args.passphrase_env else None
    if args.passphrase_env and not passphrase:
        print(f"deid keygen: environment variable {args.passphrase_env} is empty or unset", file=sys.stderr)
        return EXIT_BAD_INPUT
    priv, pub = write_keypair(Path(args.out), passphrase=passphrase.encode() if passphrase else None)
    print(f"private key: {priv} (mode 0600; point DEID_SIGNING_KEY at it)")
    print(f"public key:  {pub} (give this to verifiers)")
    return EXIT_OK


def package_version() -> str:
    """The installed ``deid`` package's version (pyproject.toml's, through the package metadata)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("deid")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed; pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deid", description="Release face datasets with a k-anonymity guarantee.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--debug", action="store_true", help="show tracebacks (by default a failure is one line)")
    p.add_argument("--version", action="version", version=f"deid {package_version()}",
                   help="print deid's version (the installed package's) and exit")
    sub = p.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_synth(sub)
    _add_import_verify_keygen(sub)
    # Further command groups live in their own modules; each exposes register(subparsers).
    for name in EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return p


def _add_run(sub: argparse._SubParsersAction) -> None:
    """``deid run DROP``: the release flow's parameters."""
    r = sub.add_parser("run", help="run the release flow on a drop")
    r.add_argument("drop")
    r.add_argument("--k", type=_k, default=None, help="minimum distinct people per cluster (default 5)")
    r.add_argument("--method", choices=[*METHODS, *FEATURE_ONLY_METHODS], default=None,
                   help=method_help())
    r.add_argument("--sigma", type=float, default=None,
                   help="blur strength (canonical pixels), method blur; feature drops, method noise: the noise in "
                        "feature standard deviations (e.g. 0.1)")
    r.add_argument("--block", type=int, default=None, help="pixelation block (canonical pixels), method pixelate")
    r.add_argument("--labels", type=_labels, default=None, help="utility label columns, e.g. gender,expression")
    r.add_argument("--small-partitions", choices=list(SMALL_PARTITION_POLICIES), default=None)
    r.add_argument("--name", default=None, help="dataset name (default: drop.yaml's or the directory name)")
    r.set_defaults(func=cmd_run)


def _add_synth(sub: argparse._SubParsersAction) -> None:
    """``deid synth DROP``: the drop's shape (people, images, pose, frames, colour, crops) and its files."""
    s = sub.add_parser("synth", help="write a synthetic face drop (or, with --kind features, a feature drop)")
    s.add_argument("drop")
    s.add_argument("--kind", choices=["faces", "features"], default="faces",
                   help="features: a Parquet table of vectors (identity + label + noise parts, seeded)")
    s.add_argument("--people", type=int, default=None, help="number of people (required unless --counts)")
    s.add_argument("--images-per-person", type=_images_per_person, default=2, metavar="N|zipf",
                   help="images per person (default 2); zipf: skewed, person r gets max(2, round(TOP / r)) "
                        "(--zipf-top)")
    s.add_argument("--zipf-top", type=int, default=40, metavar="TOP",
                   help="images of the most photographed person with --images-per-person zipf (default 40)")
    s.add_argument("--counts", type=_counts, default=None, metavar="C1,C2,...",
                   help="explicit images per person, in person order (e.g. 47,40,33,...; one person with half a "
                        "partition: 20,4,4,4,4,4); its length is the number of people")
    s.add_argument("--pose-spread", type=float, default=0.0, metavar="DEG",
                   help="head yaw of each image uniform in [-DEG, DEG] (0-60; default 0: frontal)")
    s.add_argument("--frames-per-sequence", type=int, default=1, metavar="N",
                   help="N (1-100) near-identical consecutive frames per image, manifest columns sequence and "
                        "frame (like 48x48 video-frame sets)")
    s.add_argument("--frame-jitter", choices=["small", "none"], default="small",
                   help="between those frames: small (<= 0.6 px, <= 0.8 degrees, fresh noise) or none")
    s.add_argument("--colour", action="store_true",
                   help="colour faces on a cluttered colour background (images are colour BGR unless --grey; "
                        "this adds the clutter, like photos in the wild)")
    s.add_argument("--per-person", type=int, default=2, help="records per person (--kind features)")
    s.add_argument("--dim", type=int, default=32, help="vector dimension (--kind features)")
    s.add_argument("--labels", default="gender,expression",
                   help="label columns, NAME or NAME=V values (--kind features), e.g. gender,expression=3")
    s.add_argument("--person-labels", type=_labels, default=None,
                   help="labels constant within a person (--kind features; default gender)")
    s.add_argument("--noise", type=float, default=0.5,
                   help="per-record noise (identity part 2, label parts 1; --kind features)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--format", choices=["png", "jpg", "jpeg", "pgm", "gif"], default="png",
                   help="pgm and gif are greyscale")
    s.add_argument("--size", type=int, default=200,
                   help="image width in pixels (64-4096; with --crop tight 32-4096, e.g. 48 for 48-pixel crops)")
    s.add_argument("--condition-values", type=int, default=None, metavar="V",
                   help="one label 'condition' with V (2-11) Yale-like values instead of gender/expression")
    s.add_argument("--crop", choices=["none", "tight"], default="none", help="tight: the face fills the frame")
    s.add_argument("--grey", action="store_true", help="single-channel images")
    s.add_argument("--lighting", choices=["normal", "side"], default="normal", help="side: strong side light")
    s.add_argument("--background", choices=["plain", "clutter"], default="plain",
                   help="clutter: indoor-like colour background")
    s.add_argument("--no-labels", action="store_true", help="no label columns in the manifest")
    s.add_argument("--no-eyes", action="store_true", help="no eye columns: alignment must find the eyes")
    _add_synth_files_and_video(s)
    s.set_defaults(func=cmd_synth)


def _add_synth_files_and_video(s: argparse.ArgumentParser) -> None:
    """``deid synth``'s options for how the images are drawn, and for sequences and video recordings."""
    s.add_argument("--workers", type=int, default=1, help="processes drawing images (output is the same)")
    s.add_argument("--quick-noise", action="store_true",
                   help="cheaper sensor noise for million-face benchmarks (different images)")
    s.add_argument("--fast", action="store_true",
                   help="about 4x cheaper images (same faces, eyes and labels; other texture and noise, "
                        "JPEG quality 85): for million-face drops, with --workers 2")
    s.add_argument("--sequences", type=int, nargs="?", const=2, default=None, metavar="S",
                   help="image sequences instead of stills: S (default 2) talking/smiling sequences per person, "
                        "manifest columns sequence and frame (PNG frames; --size applies, other options do not)")
    s.add_argument("--frames", type=int, default=12, help="frames per sequence with --sequences (default 12)")
    s.add_argument("--video", action="store_true",
                   help="talking/smiling recordings as video files (AVI/MJPEG, MP4, WebM, MOV in turn; --sequences S "
                        "recordings per person), plus one with a second face and one where the face leaves")
    s.add_argument("--seconds", type=float, default=2.0, help="length of each recording with --video (default 2)")
    s.add_argument("--fps", type=float, default=5.0, help="frame rate of the recordings with --video (default 5)")
    s.add_argument("--width", type=int, default=320, help="frame width with --video (default 320)")
    s.add_argument("--height", type=int, default=240, help="frame height with --video (default 240)")
    s.add_argument("--no-extras", action="store_true",
                   help="with --video: leave out the two-faces and face-leaves recordings")


def _add_import_verify_keygen(sub: argparse._SubParsersAction) -> None:
    """``deid import``, ``deid verify`` and ``deid keygen``."""
    i = sub.add_parser("import", help="convert a published dataset layout into a drop")
    i.add_argument("source", help="dataset kind: london")
    i.add_argument("src")
    i.add_argument("drop")
    i.set_defaults(func=cmd_import)

    v = sub.add_parser("verify", help="verify a release directory alone (its signed attestation), or a signed "
                       "report and its release", description=verify_exit_help())
    v.add_argument("report_dir", metavar="PATH", help="a release directory (holding ATTESTATION.json: what a recipient "
                   "has) or a report directory (reports/<release id>)")
    v.add_argument("--public-key", default=None, help="the signer's public key PEM you trust")
    v.add_argument("--release", default=None, help="release directory (default: from the report)")
    v.set_defaults(func=cmd_verify)

    kg = sub.add_parser("keygen", help="create an Ed25519 signing key pair")
    kg.add_argument("--out", default="data/keys")
    kg.add_argument("--passphrase-env", default=None, help="encrypt the private key with this env variable's value")
    kg.set_defaults(func=cmd_keygen)


_exit_code: list[int] = []  # this process's own `deid run` (argv None): its exit code, for _exit_without_teardown


def _exit_without_teardown() -> None:
    """Exit handler of a ``deid run`` process, registered before the run imports anything (so it runs last).

    Every other exit handler has run by then (Prefect's log and event workers, the process pools,
    temporary files); what is left is the interpreter's teardown of everything the run imported
    (Prefect, Great Expectations, scikit-learn, matplotlib, ...): 4.3 s measured at load 13 after
    the verdict was printed. The output is flushed and the process ends with its exit code.
    """
    if not _exit_code:
        return
    from deid.operations.executors import exit_without_teardown  # noqa: PLC0415

    exit_without_teardown(_exit_code[0])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None and args.command == "run":
        import atexit  # noqa: PLC0415

        atexit.register(_exit_without_teardown)
    code = _main(args)
    if argv is None and isinstance(code, int):
        _exit_code[:] = [code]
    return code


def _main(args) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("great_expectations").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"deid {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure ends as one line and a typed exit code
        if args.debug:
            traceback.print_exc()
        code = exit_code_for(exc)
        if isinstance(exc, OSError) and code == EXIT_ENVIRONMENT:
            exc = EnvironmentFailure.from_oserror(exc, doing=f"deid {args.command} failed")
        kind = {EXIT_ENVIRONMENT: "environment failure: ", EXIT_STATE: "error: "}.get(code, "")
        if code == EXIT_STATE and not isinstance(exc, DeidError):
            kind = f"internal error ({type(exc).__name__}, rerun with --debug for the traceback): "
        print(f"deid {args.command}: {kind}{exc}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
