"""Build ``build/layout/deid``: the package as installed, for the tools that read it from the file system.

flows/, tasks/ and schemas/ install as deid.flows, deid.tasks and deid.schemas (``[tool.setuptools.package-dir]``
in pyproject.toml). An editable install maps them with an import hook, which mypy and import-linter do not run
(they look for ``deid/flows/`` on disk), so ``make check`` points them at this view: a directory of symlinks to
deid/'s entries and to the mapped directories, rebuilt on every run (a module added since is in it). Nothing is
copied: an error names ``build/layout/deid/<path>``, the file at ``deid/<path>`` or the mapped directory.

Usage: ``python .ci/layout_view.py`` from the repository root.
"""
import os
import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIEW = ROOT / "build" / "layout" / "deid"


def main() -> int:
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(VIEW.parent, ignore_errors=True)
    VIEW.mkdir(parents=True)
    for entry in sorted((ROOT / "deid").iterdir()):
        if entry.name != "__pycache__":
            (VIEW / entry.name).symlink_to(os.path.relpath(entry, VIEW))
    for package, directory in mapped.items():
        parent, _, name = package.rpartition(".")
        if parent != "deid" or (ROOT / "deid" / name).exists():
            print(f"layout_view: package-dir {package!r} = {directory!r}: only deid.<name> with no deid/<name> of "
                  "its own can be mapped here; map a direct subpackage of deid", file=sys.stderr)
            return 2
        (VIEW / name).symlink_to(os.path.relpath(ROOT / directory, VIEW))
    return 0


if __name__ == "__main__":
    sys.exit(main())
