"""The core package must not import Prefect: it runs on Dask workers and in other orchestrators."""
import importlib
import json
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import deid

# The Prefect layer (the flows, the tasks and the Prefect plumbing) and the command line: the only parts of the
# package allowed to import Prefect (the command line only lazily, for the commands that run flows) and to print.
NOT_CORE = ("deid.orchestration", "deid.flows", "deid.tasks", "deid.cli")
ROOT = Path(__file__).resolve().parents[2]
# deid's subpackages that live outside deid/ (schemas/ is deid.schemas, ...): pyproject's package-dir, one place.
MAPPED = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _package_dirs() -> dict[str, Path]:
    """deid's own directory and each mapped subpackage's, by package name, as installed."""
    dirs = {"deid": Path(deid.__file__).resolve().parent}
    for name in MAPPED:
        dirs[name] = Path(importlib.import_module(name).__file__).resolve().parent
    return dirs


def _exempt(module: str) -> bool:
    return any(module == x or module.startswith(x + ".") for x in NOT_CORE)


def _modules() -> list[str]:
    """Every module and subpackage of deid, its mapped subpackages too, recursively, but the exempted ones and their
    contents (a mapped package is not under ``deid.__path__``, so a walk of deid alone would miss it)."""
    found = []
    for name, path in _package_dirs().items():
        found += [m.name for m in pkgutil.walk_packages([str(path)], prefix=f"{name}.")]
    return [m for m in [*MAPPED, *found] if not _exempt(m)]


def _prefect_loaded_by(mods: list[str]) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"mods = {mods!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "print(json.dumps(sorted(n for n in sys.modules if n == 'prefect' or n.startswith('prefect.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_core_modules_do_not_import_prefect():
    mods = _modules()
    # the walk found the real modules, in the subpackages and the mapped packages too
    assert {"deid.anonymise.ksame", "deid.alignment.align", "deid.schemas", "deid.schemas.arrow", "deid.errors",
            "deid.operations.runner"} <= set(mods)
    subpackages = {m.name for m in pkgutil.iter_modules(deid.__path__) if m.ispkg} | {n.split(".")[1] for n in MAPPED}
    exempt = subpackages & {x.split(".")[1] for x in NOT_CORE}
    assert exempt == {"orchestration", "flows", "tasks", "cli"}  # exactly these four are exempt, and all exist
    loaded = _prefect_loaded_by(mods)
    assert loaded == [], f"core modules imported prefect: {loaded[:5]}"


def test_the_command_line_imports_prefect_only_when_a_command_needs_it():
    assert _prefect_loaded_by(["deid.cli"]) == []
    assert "prefect" in _prefect_loaded_by(["deid.flows.release"])
    assert "prefect" in _prefect_loaded_by(["deid.tasks.stages"])


def test_no_print_in_core():
    offenders, seen = [], 0
    for package, pkg_dir in _package_dirs().items():
        for path in pkg_dir.rglob("*.py"):
            parts = tuple(package.split(".")) + path.relative_to(pkg_dir).with_suffix("").parts
            if _exempt(".".join(parts)):  # the command line prints to its user
                continue
            seen += parts[:3] == ("deid", "schemas", "arrow")
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.match(r"\s*print\(", line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert seen == 1  # the mapped packages were read too
    assert offenders == [], f"library code must log, not print: {offenders}"


def test_the_exemption_is_by_name_only():
    assert _exempt("deid.orchestration") and _exempt("deid.flows.release") and _exempt("deid.cli.ops")
    assert _exempt("deid.tasks.stages") and not _exempt("deid.tasks_extra") and not _exempt("deid.schemas.arrow")
    assert not _exempt("deid.orchestration_extra") and not _exempt("deid.operations.worker_align")
