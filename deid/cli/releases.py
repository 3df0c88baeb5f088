"""``deid releases``: the catalogue of every release and rejection, and the static reports/index.html."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def cmd_releases(args) -> int:
    from deid.reporting.catalogue_page import catalogue_text, read_catalogue, write_index
    from deid.errors import ConfigError

    if args.reports_dir:
        reports_dir = Path(args.reports_dir)
    else:
        from deid.settings import Settings

        reports_dir = Settings().reports_path
    try:
        entries = read_catalogue(reports_dir)
    except ConfigError as exc:
        print(f"deid releases: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        sys.stdout.write(json.dumps([dataclasses.asdict(e) for e in entries], indent=2, default=str) + "\n")
    else:
        sys.stdout.write(catalogue_text(entries))
    if not args.no_index:
        try:
            index = write_index(reports_dir, entries)
        except OSError as exc:
            print(f"deid releases: could not write {reports_dir / 'index.html'}: {exc.strerror or exc}; "
                  "check the reports directory is writable, or pass --no-index", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"catalogue page: {index}", file=sys.stderr)
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("releases", help="list every release and rejection; write reports/index.html")
    p.add_argument("--reports-dir", default=None, help="reports directory (default: the DEID_REPORTS_DIR setting)")
    p.add_argument("--json", action="store_true", help="print the catalogue as JSON instead of text")
    p.add_argument("--no-index", action="store_true", help="do not write index.html")
    p.set_defaults(func=cmd_releases)
