"""``deid lineage DATASET``: the releases of a dataset, their people counts and policy decisions (deid.release.lineage)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def format_lineage(desc: dict) -> str:
    """Plain-text listing of :func:`deid.release.lineage_state.describe_lineage`."""
    lines = [f"dataset {desc['dataset']}: {len(desc['releases'])} releases, {desc['registered_clusters']} registered "
             f"clusters, {desc['registered_people']} registered people; {desc['entries']} registry entries, "
             f"head {desc['head'][:16]}; faces released in {desc.get('color_mode') or '(no release yet)'}"]
    for r in desc["releases"]:
        lines.append(
            f"  {r['release_id']} [{r['status']}] k={r['k']} {r['method']} policy={r['policy']} absent={r['absent']}: "
            f"{r['records_released']} records released ({r['counterfeit_records']} counterfeit), "
            f"{r['new_clusters']} new + {r['republished_clusters']} republished clusters, "
            f"{r['suppressed_clusters']} registered clusters suppressed; people: {r['new_people']} new, "
            f"{r['returning_people']} returning, {r['waiting_people']} waiting; "
            f"{r['suppressed_records']} records suppressed")
    for c in desc.get("clusters", []):
        people = sorted({p for _, p in c["members"]})
        lines.append(f"  cluster {c['key']} {'/'.join(c['partition'])} sizes {c['released_sizes']} image "
                     f"{c['image_sha256'][:16]}: {len(c['members'])} records of {len(people)} people")
        for fingerprint, person in c["members"]:
            lines.append(f"    record {fingerprint}  person {person}")
    return "\n".join(lines) + "\n"


def cmd_lineage(args) -> int:
    from deid.errors import ConfigError, VerificationError
    from deid.release.lineage_state import describe_lineage
    from deid.release.lineage_registry import Registry
    from deid.release.linkage import DEV_KEY_NAME, load_linkage_key

    try:
        from deid.settings import Settings

        settings = Settings()
        data_dir = Path(args.data_dir) if args.data_dir else settings.data_path
        if args.members and not args.key:
            print("deid lineage: --members needs the steward's key: pass --key (the linkage key file)", file=sys.stderr)
            return EXIT_BAD_INPUT
        key_path = Path(args.key) if args.key else (settings.linkage_key or data_dir / "keys" / DEV_KEY_NAME)
        url = settings.database_url.get_secret_value() if settings.database_url else None
        registry = Registry.open(data_dir, args.dataset, load_linkage_key(Path(key_path).expanduser()),
                                 database_url=url)
        if not registry.exists():
            print(f"deid lineage: dataset {args.dataset!r} has no lineage registry at {registry.where} "
                  "(no release of it yet, or check --data-dir)", file=sys.stderr)
            return EXIT_BAD_INPUT
        desc = describe_lineage(registry.load(), members=args.members)
    except (ConfigError, VerificationError) as exc:  # a LineageError (a StateError) exits by its type: 70
        print(f"deid lineage: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sys.stdout.write(json.dumps(desc, indent=2) + "\n" if args.json else format_lineage(desc))
    return EXIT_OK


def register(subparsers) -> None:
    """Add ``lineage`` to the ``deid`` command line."""
    p = subparsers.add_parser("lineage", help="list the releases of a dataset, people counts and policy decisions")
    p.add_argument("dataset", help="the dataset name (drop.yaml `dataset:`, default the drop's name)")
    p.add_argument("--key", default=None,
                   help="the steward's linkage key file (default: DEID_LINKAGE_KEY, else the development key); "
                        "required with --members")
    p.add_argument("--members", action="store_true", help="also list each cluster's member records and pseudonyms")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--data-dir", default=None, help="runtime data directory (default: the DEID_DATA_DIR setting)")
    p.set_defaults(func=cmd_lineage)


add_parser = register  # the name used in the integration notes
