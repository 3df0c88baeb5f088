"""``deid gc [--dry-run]``: apply the staging retention policy (DEID_KEEP_STAGING) to existing staging; say what it frees."""
from __future__ import annotations

import sys

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def _size(n: int) -> str:
    for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def cmd_gc(args) -> int:
    from deid.cli import _settings  # noqa: PLC0415 - a bad DEID_* value is a ConfigError naming it
    from deid.errors import ConfigError  # noqa: PLC0415
    from deid.operations.retention import apply_retention  # noqa: PLC0415
    from deid.settings import StagingRetention  # noqa: PLC0415

    try:
        settings = _settings()
        policy = StagingRetention.parse(args.keep) if args.keep else settings.staging_retention
    except (ConfigError, ValueError) as exc:
        print(f"deid gc: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    res = apply_retention(settings.data_path, settings.reports_path, policy, dry_run=args.dry_run)
    verb = "would free" if args.dry_run else "freed"
    print(f"deid gc: DEID_KEEP_STAGING={policy} on {settings.data_path / 'staging'}"
          + (" (dry run: nothing removed)" if args.dry_run else ""))
    for d in res.decisions:
        freed = res.freed.get(d.release_id)
        what = f"{verb} {freed} bytes ({_size(freed)})" if freed is not None else d.action
        print(f"  {d.release_id}: {what}; keeps {res.kept.get(d.release_id, 0)} bytes ({d.reason})")
    print(f"total: {verb} {res.freed_total} bytes ({_size(res.freed_total)}) in {len(res.freed)} run(s); staging "
          f"keeps {res.kept_total} bytes ({_size(res.kept_total)}) in {len(res.decisions)} run(s)")
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "gc", help="trim finished runs' private staging to what DEID_KEEP_STAGING keeps; say what it frees",
        description="Apply the staging retention policy (DEID_KEEP_STAGING: none | failed | last:N | all) to "
                    "data/staging/: a finished run keeps its markers and quarantine table (no later run reads more); "
                    "the policy may keep some runs whole. Live runs (their lock held) and unfinished ones are never "
                    "touched.")
    p.add_argument("--dry-run", action="store_true", help="remove nothing; say what would be freed")
    p.add_argument("--keep", default=None, metavar="POLICY",
                   help="this policy instead of DEID_KEEP_STAGING (none, failed, last:N or all)")
    p.set_defaults(func=cmd_gc)
