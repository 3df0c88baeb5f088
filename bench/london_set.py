"""Where the benchmarks find the Face Research Lab London Set: one place for every bench script.

Every bench script that reads London takes ``--london PATH`` (:func:`add_london_option`). Its default is the
tests' London path, ``tests/helpers.py``'s ``LONDON``, read from there (its one definition), so the benchmarks
and the tests look in the same place, and a clone whose London set is elsewhere points a benchmark to it with
``--london``. :func:`london_dir` checks the directory and exits with a message naming it when the set is not there.

    from london_set import add_london_option, london_dir   # bench/ is on sys.path when a bench script runs
    add_london_option(ap)
    london = london_dir(ap.parse_args().london)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def default_london() -> Path:
    """The tests' London path (``tests/helpers.py``'s ``LONDON``: ``../shared/datasets/london`` beside the clone)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from helpers import LONDON  # noqa: PLC0415 - tests/helpers.py holds the one definition

    return Path(LONDON)


def add_london_option(parser: argparse.ArgumentParser, *, optional: bool = False) -> None:
    """Add ``--london PATH`` to a bench script's parser (read it with :func:`london_dir`).

    Parameters
    ----------
    parser : argparse.ArgumentParser
    optional : bool
        False: London is what the script measures; ``--london PATH`` points elsewhere than the default.
        True: London is an extra part of the script, run only when asked: ``--london`` alone runs it on the
        default path, ``--london PATH`` on that one; without ``--london`` the argument is None.
    """
    where = f"the London set's directory (default: the tests' {default_london()})"
    if optional:
        parser.add_argument("--london", nargs="?", const="", default=None, metavar="PATH",
                            help=f"run the London part; PATH: {where}")
    else:
        parser.add_argument("--london", default="", metavar="PATH", help=where)


def london_dir(path: str | Path | None = None) -> Path:
    """The London set's directory: ``path``, or the tests' (:func:`default_london`) when it is None or empty.

    Raises
    ------
    SystemExit
        No London set there (no ``london_info.csv``): the message names the directory and how to point to it.
    """
    where = Path(path) if path else default_london()
    if not (where / "london_info.csv").is_file():
        raise SystemExit(f"the London set is missing at {where} (no london_info.csv there); pass --london PATH, the "
                         "directory of the Face Research Lab London Set (london_info.csv, neutral_front/, "
                         f"smiling_front/), or put it at the tests' default {default_london()}")
    return where
