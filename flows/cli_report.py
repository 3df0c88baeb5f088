"""``deid linkage`` and ``deid linkage-keygen``: the steward's private linkage record (see deid.release.linkage)."""
from __future__ import annotations

import sys
from pathlib import Path

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def cmd_linkage(args) -> int:
    from deid.errors import ConfigError, VerificationError
    from deid.release.linkage import linkage_path, linkage_to_csv, load_linkage_key, read_linkage

    try:
        if args.data_dir:
            data_dir = Path(args.data_dir)
        else:
            from deid.settings import Settings

            data_dir = Settings().data_path
        path = linkage_path(data_dir, args.release_id)
        if not path.is_file():
            print(f"deid linkage: no linkage record for release {args.release_id}: {path} does not exist "
                  "(check the release id and --data-dir)", file=sys.stderr)
            return EXIT_BAD_INPUT
        records = read_linkage(path, load_linkage_key(Path(args.key)))
    except (ConfigError, VerificationError) as exc:
        print(f"deid linkage: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sys.stdout.write(linkage_to_csv(records))
    print(f"deid linkage: {len(records)} records from {path}", file=sys.stderr)
    return EXIT_OK


def cmd_linkage_keygen(args) -> int:
    from deid.errors import ConfigError
    from deid.release.linkage import generate_linkage_key

    try:
        path = generate_linkage_key(Path(args.out))
    except ConfigError as exc:
        print(f"deid linkage-keygen: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"linkage key: {path} (mode 0600; the steward keeps it, point DEID_LINKAGE_KEY at it)")
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("linkage", help="decrypt a release's private linkage record and print it as CSV")
    p.add_argument("release_id", help="the release id, e.g. rel-0123456789abcdef")
    p.add_argument("--key", required=True, help="the linkage key file (from deid linkage-keygen)")
    p.add_argument("--data-dir", default=None, help="runtime data directory (default: the DEID_DATA_DIR setting)")
    p.set_defaults(func=cmd_linkage)

    g = subparsers.add_parser("linkage-keygen", help="create a symmetric key for linkage records")
    g.add_argument("--out", required=True, help="key file to create (mode 0600; never overwritten)")
    g.set_defaults(func=cmd_linkage_keygen)
