"""The core package must not import Prefect: it runs on Dask workers and in other orchestrators."""
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import deid

# The Prefect layer and the command line: the only parts of the package allowed to import Prefect
# (the command line only lazily, for the commands that run flows) and to print.
NOT_CORE = ("deid.orchestration", "deid.cli")
CORE_DIR = Path(deid.__file__).resolve().parent


def _exempt(module: str) -> bool:
    return any(module == x or module.startswith(x + ".") for x in NOT_CORE)


def _modules(pkg) -> list[str]:
    """Every module and subpackage of ``pkg``, recursively, but the exempted ones and their contents."""
    return [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{pkg.__name__}.") if not _exempt(m.name)]


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
    mods = _modules(deid)
    # the walk found the real modules, in the subpackages too
    assert {"deid.anonymise.ksame", "deid.alignment.align", "deid.schemas.arrow", "deid.errors",
            "deid.operations.runner"} <= set(mods)
    exempt = {m.name for m in pkgutil.iter_modules(deid.__path__) if m.ispkg} & {x.split(".")[1] for x in NOT_CORE}
    assert exempt == {"orchestration", "cli"}  # exactly these two are exempt, and both exist
    loaded = _prefect_loaded_by(mods)
    assert loaded == [], f"core modules imported prefect: {loaded[:5]}"


def test_the_command_line_imports_prefect_only_when_a_command_needs_it():
    assert _prefect_loaded_by(["deid.cli"]) == []
    assert "prefect" in _prefect_loaded_by(["deid.orchestration.flow"])


def test_no_print_in_core():
    offenders = []
    for path in CORE_DIR.rglob("*.py"):
        parts = ("deid",) + path.relative_to(CORE_DIR).with_suffix("").parts
        if _exempt(".".join(parts)):  # the command line prints to its user
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*print\(", line):
                offenders.append(f"{path.relative_to(CORE_DIR)}:{n}")
    assert offenders == [], f"library code must log, not print: {offenders}"


def test_the_exemption_is_by_name_only():
    assert _exempt("deid.orchestration") and _exempt("deid.orchestration.flow") and _exempt("deid.cli.ops")
    assert not _exempt("deid.orchestration_extra") and not _exempt("deid.operations.worker_align")
