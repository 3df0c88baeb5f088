"""The core package must not import Prefect: it runs on Dask workers and in other orchestrators."""
import json
import pkgutil
import subprocess
import sys

import deid
import schemas


def _modules(pkg) -> list[str]:
    return [f"{pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]


def test_core_modules_do_not_import_prefect():
    mods = _modules(deid) + _modules(schemas)
    assert "deid.anonymise.ksame" in mods and "deid.alignment.align" in mods  # the walk found the real modules
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
    import pathlib
    import re

    offenders = []
    for path in pathlib.Path(deid.__file__).parent.glob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*print\(", line):
                offenders.append(f"{path.name}:{n}")
    assert offenders == [], f"library code must log, not print: {offenders}"
