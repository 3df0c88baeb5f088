"""The user's layout: flows/, tasks/ and schemas/ at the top of the repository, installed as deid.flows, deid.tasks
and deid.schemas (pyproject's package-dir), and each flow file a ``prefect deploy`` entrypoint loadable by path."""
import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from prefect import Flow

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _load_by_path(path: Path, monkeypatch) -> object:
    """Execute ``path`` as a module of its own (what ``prefect deploy flows/x.py:flow`` and a deployment's runner
    do): a relative import in it fails here, an absolute one resolves to the installed deid."""
    name = f"_by_path_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # removed again after the test
    # flows/serve.py sets its poll frequency with setdefault before Prefect loads: left as it was found.
    monkeypatch.setenv("PREFECT_RUNNER_POLL_FREQUENCY", "2")
    spec.loader.exec_module(module)
    return module


def _flows(module) -> dict[str, str]:
    """The Prefect flows a module defines: flow name -> attribute name."""
    return {v.name: k for k, v in vars(module).items() if isinstance(v, Flow)}


def test_the_release_flow_file_loads_by_path(monkeypatch):
    module = _load_by_path(ROOT / "flows" / "release.py", monkeypatch)
    assert _flows(module) == {"release": "release"}
    assert callable(module.run_flow)
    import deid.flows.release as installed

    assert module.release is not installed.release  # its own copy, as Prefect's loader makes
    assert module.release.fn.__code__.co_filename == installed.release.fn.__code__.co_filename


def test_the_on_drop_and_nightly_flow_file_loads_by_path(monkeypatch):
    module = _load_by_path(ROOT / "flows" / "serve.py", monkeypatch)
    assert _flows(module) == {"release-on-drop": "release_on_drop", "release-incoming": "release_incoming"}
    assert callable(module.deployments)


@pytest.mark.parametrize("entrypoint, name", [("flows/release.py:release", "release"),
                                               ("flows/serve.py:release_on_drop", "release-on-drop"),
                                               ("flows/serve.py:release_incoming", "release-incoming")])
def test_prefect_loads_each_entrypoint(entrypoint, name, monkeypatch):
    from prefect.flows import load_flow_from_entrypoint

    monkeypatch.chdir(ROOT)  # `prefect deploy` is run from the repository: the entrypoint is relative to it
    monkeypatch.setenv("PREFECT_RUNNER_POLL_FREQUENCY", "2")
    flow = load_flow_from_entrypoint(entrypoint)
    assert isinstance(flow, Flow) and flow.name == name


def test_the_deployments_point_at_the_flow_files(tmp_path, monkeypatch):
    """``deid serve``'s deployments: their entrypoints are the flow files (loaded by path by the runner)."""
    from deid.flows.serve import deployments
    from deid.settings import Settings

    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path))
    by_name = {d.name: d for d in deployments(Settings())}
    assert set(by_name) == {"release", "release-on-drop"}
    for dep, flow in [(by_name["release"], "release_incoming"), (by_name["release-on-drop"], "release_on_drop")]:
        path, _, attr = dep.entrypoint.rpartition(":")
        assert attr == flow and Path(path).resolve() == ROOT / "flows" / "serve.py", dep.entrypoint


def test_installed_under_the_project_name_only(tmp_path):
    """deid.flows, deid.tasks and deid.schemas resolve to the top-level directories; no top-level ``flows``,
    ``tasks`` or ``schemas`` package is installed (checked isolated, away from the repository)."""
    code = (
        "import importlib, importlib.util, importlib.resources, json\n"
        "out = {n: importlib.import_module(n).__file__ for n in ('deid.flows', 'deid.tasks', 'deid.schemas')}\n"
        "out['top'] = [n for n in ('flows', 'tasks', 'schemas') if importlib.util.find_spec(n)]\n"
        "s = importlib.resources.files('deid.schemas')\n"
        "out['data'] = sorted(p.name for p in s.iterdir() if p.name.endswith('.json'))\n"
        "out['suites'] = sorted(p.name for p in s.joinpath('expectations').iterdir())\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    got = json.loads(out.stdout)
    for package, directory in [("deid.flows", "flows"), ("deid.tasks", "tasks"), ("deid.schemas", "schemas")]:
        assert Path(got[package]) == ROOT / directory / "__init__.py"
    assert got["top"] == []
    assert got["data"] == ["attestation.schema.json", "report.schema.json"]
    assert got["suites"] == sorted(p.name for p in (ROOT / "schemas" / "expectations").glob("*.json"))
    assert len(got["suites"]) == 6


def test_pyproject_lists_every_package():
    """``packages`` is a list (setuptools' find names a package after its directory): one missing would be left
    out of the wheel. Every directory with an ``__init__.py`` under deid/ and the mapped directories is listed."""
    mapped = SETUPTOOLS["package-dir"]
    assert mapped == {"deid.flows": "flows", "deid.tasks": "tasks", "deid.schemas": "schemas"}
    on_disk = {".".join(("deid", *p.parent.relative_to(ROOT / "deid").parts)).rstrip(".")
               for p in (ROOT / "deid").rglob("__init__.py")}
    for package, directory in mapped.items():
        on_disk |= {".".join((package, *p.parent.relative_to(ROOT / directory).parts)).rstrip(".")
                    for p in (ROOT / directory).rglob("__init__.py")}
    assert sorted(SETUPTOOLS["packages"]) == sorted(on_disk)
