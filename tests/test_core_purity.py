"""The core package must not import Prefect: it runs on Dask workers and in other orchestrators."""
import json
import re
import subprocess
import sys
from pathlib import Path

import deid

# The Prefect layer's subpackage: the one part of deid allowed to import Prefect (and to print).
ORCHESTRATION = "deid.orchestration"
CORE_DIR = Path(deid.__file__).resolve().parent


def _is_orchestration(module: str) -> bool:
    return module == ORCHESTRATION or module.startswith(ORCHESTRATION + ".")


def _core_files() -> dict[str, Path]:
    """Every module under deid/ (recursively, found on disk without importing), but the Prefect layer."""
    out = {}
    for path in sorted(CORE_DIR.rglob("*.py")):
        parts = ("deid",) + path.relative_to(CORE_DIR).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if "__pycache__" not in parts and not _is_orchestration(module):
            out[module] = path
    return out


def test_core_modules_do_not_import_prefect():
    mods = sorted(_core_files())
    # the walk found the real modules, in the subpackages too
    assert {"deid.anonymise.ksame", "deid.alignment.align", "deid.schemas.arrow", "deid.errors"} <= set(mods)
    code = (
        "import importlib, json, sys\n"
        f"mods = {mods!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "print(json.dumps(sorted(n for n in sys.modules if n == 'prefect' or n.startswith('prefect.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"core modules imported prefect: {loaded[:5]}"


def test_no_print_in_core():
    offenders = []
    for module, path in _core_files().items():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*print\(", line):
                offenders.append(f"{path.relative_to(CORE_DIR)}:{n}")
    assert offenders == [], f"library code must log, not print: {offenders}"


def test_orchestration_exemption_is_by_name_only():
    assert _is_orchestration(ORCHESTRATION) and _is_orchestration(ORCHESTRATION + ".flow")
    assert not _is_orchestration(ORCHESTRATION + "_extra") and not _is_orchestration("deid.operations.stages")
