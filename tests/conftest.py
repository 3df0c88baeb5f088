"""Shared fixtures: the London set, an isolated project dir, one Prefect API, one Dask worker per process.

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``): every
fixture here is per worker process; the tests of a module that share one of its module-scoped
fixtures run on one worker (automatic ``xdist_group``, so the fixture is built once), tests that
share a session fixture's state carry an explicit ``xdist_group`` mark (``stack``: "ops"), and
the heaviest tests are started first so the two workers finish together. The temporary Prefect API
is one for the whole session (started by the xdist controller, tests/prefect_shared.py).
``pytest --cpu-report`` prints the CPU seconds of the heaviest tests (tests/cpu_report.py).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import pytest
import prefect_shared
from helpers import LONDON  # the London set's one definition
# The session's ops stack (Prefect server, serve, watch) and its first two releases.
from ops_helpers import stack, two_releases  # noqa: F401

pytest_plugins = ["cpu_report"]  # `pytest --cpu-report`: CPU seconds per test (tests/cpu_report.py)


# Keep Prefect's state out of the user's home and quiet, before anything imports prefect.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# One BLAS thread per process (as the CLI does): threaded OpenBLAS next to Dask workers thrashes.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# One Dask worker per flow run's LocalCluster: the suite already runs on two pytest workers (one per
# core), so a second Dask worker per run would only add a process start and a model load. The
# multi-worker path (tasks spread over workers, one killed mid-run) is tested by
# tests/ops/test_remote_dask.py, and the demo test (tests/flow/test_flow.py) runs `deid run` with the defaults.
os.environ.setdefault("DEID_DASK_WORKERS", "1")
# One dlib descriptor store for the session (deid.memo.RowStore, DEID_DESCRIPTOR_CACHE): the same synthetic and
# London faces are embedded in many tests and in many processes (both xdist workers, their Dask workers, `deid run`
# subprocesses and forked commands), each of which would run the network on them again (~0.09 CPU-s a face).
# Set here, in the controller before it starts the workers, so every process of the session inherits one
# directory; a fresh one per session, removed at its end, so nothing rests on an earlier session. A stored
# descriptor is the one the network gives (tests/integration/evaluation/test_recognizer.py checks it).
if "DEID_DESCRIPTOR_CACHE" not in os.environ:
    os.environ["DEID_DESCRIPTOR_CACHE"] = _STORE = tempfile.mkdtemp(prefix="deid-test-descriptors-")
    atexit.register(shutil.rmtree, _STORE, ignore_errors=True)

# CPU seconds of the heaviest tests (keys: node ids or their prefixes, e.g. a module's "path::"), written by
# `pytest --cpu-report --write-durations tests/durations.json` (tests/cpu_report.py; docs/development.md).
# Order only: the heaviest start first (a group counts the sum of its tests), so no worker is left with a
# long test at the end. A test not in the file is weighted by its tier (and `slow`): a new or renamed test
# just loses its place in the queue until the file is refreshed.
DURATIONS = Path(__file__).resolve().parent / "durations.json"
TIER_WEIGHTS = {"unit": 0.0, "integration": 0.5, "flow": 5.0, "ops": 10.0}


def _durations() -> dict[str, float]:
    return json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.is_file() else {}


def _weight(item: pytest.Item, durations: dict[str, float]) -> float:
    """The item's longest matching prefix in the durations file, else its tier's weight (5 s at least if slow)."""
    match = max((prefix for prefix in durations if item.nodeid.startswith(prefix)), key=len, default=None)
    if match is not None:
        return durations[match]
    tier = next((TIER_WEIGHTS[m.name] for m in item.iter_markers() if m.name in TIER_WEIGHTS), 0.0)
    return max(tier, 5.0) if item.get_closest_marker("slow") else tier


def _module_fixtures(item: pytest.Item) -> list[str]:
    """Names of the module- or class-scoped fixtures defined in the item's own module that it uses."""
    info = getattr(item, "_fixtureinfo", None)  # test functions only (pytest's closure of fixtures)
    module = item.nodeid.split("::", 1)[0]
    return sorted(name for name, defs in (info.name2fixturedefs.items() if info else ())
                  if defs and defs[-1].scope in ("module", "class") and defs[-1].baseid == module)


TESTS = Path(__file__).resolve().parent
# The tiers, one directory each under tests/ (pyproject's markers say what each holds).
TIERS = ("unit", "integration", "flow", "ops")


def _tier(path: Path) -> str | None:
    """The tier of a test file: the first directory under tests/ when it is a tier, else None."""
    parts = Path(path).resolve().relative_to(TESTS).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def _mark_tiers(items: list[pytest.Item]) -> None:
    """Give every test exactly one tier, its directory's; refuse a test outside a tier directory.

    A tier mark written in a test file must be its directory's (e.g. ``pytest.mark.ops`` in tests/ops/):
    a file whose tests change tier moves to that tier's directory.
    """
    outside = sorted({str(item.path.relative_to(TESTS.parent)) for item in items if _tier(item.path) is None})
    if outside:
        raise pytest.UsageError(
            f"test files outside a tier directory: {', '.join(outside)}; every test file lives under "
            f"tests/<tier>/ with <tier> one of {', '.join(TIERS)} (pyproject.toml [tool.pytest.ini_options] "
            "markers says what each holds): git mv the file there")
    wrong = []
    for item in items:
        tier = _tier(item.path)
        written = {m.name for m in item.iter_markers() if m.name in TIERS} - {tier}
        if written:
            wrong.append(f"{item.nodeid} is marked {'/'.join(sorted(written))} but lives in tests/{tier}/")
        item.add_marker(tier)
    if wrong:
        raise pytest.UsageError("a tier mark that contradicts its directory (move the file or drop the mark): "
                                + "; ".join(wrong[:5]) + (f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tier marks; heaviest tests first; tests sharing a module-scoped fixture of their module go to one worker.

    The sort is stable (equal weights keep the file order, so a module's tests stay together). A
    test that already carries an ``xdist_group`` mark keeps it (e.g. the ops stack's "ops").
    """
    _mark_tiers(items)
    for item in items:
        shared = _module_fixtures(item)
        if shared and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(f"{item.nodeid.split('::', 1)[0]}::{'+'.join(shared)}"))

    def unit(item: pytest.Item) -> str:  # what must run together: its group, or the test alone
        marks = sorted(str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                       for m in item.iter_markers("xdist_group"))
        return "@".join(marks) or item.nodeid

    durations = _durations()
    weight: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        u = unit(item)
        weight[u] = weight.get(u, 0.0) + _weight(item, durations)
        first.setdefault(u, i)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-weight[unit(item)], first[unit(item)], order[id(item)]))


@pytest.hookimpl(specname="pytest_collection_modifyitems", trylast=True)  # after xdist's own hook
def pytest_collection_modifyitems_xdist_groups(config, items):
    """pytest-xdist 3.8's ``loadgroup`` tags a grouped test by rewriting ``item._nodeid``, which pytest 9.2
    no longer reads (structured node ids): the groups are silently ignored (pytest-dev/pytest-xdist#1386).
    Do what its proposed fix (#1388) does: set the structured id. Drop this once xdist is fixed.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid.rpartition("]")[2] and hasattr(item, "_id"):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


@pytest.fixture(scope="session")
def london_dir() -> Path:
    """The real London set; its absence is a failure, never a skip (CI always has it)."""
    if not (LONDON / "london_info.csv").is_file():
        pytest.fail(f"the London face set is missing: expected {LONDON} (README.md, Data and credits)")
    return LONDON


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """An isolated project dir: data/ and reports/ under tmp, no configured signing key."""
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path))
    monkeypatch.delenv("DEID_SIGNING_KEY", raising=False)
    monkeypatch.delenv("DEID_DASK_ADDRESS", raising=False)
    return tmp_path


def _xdist_controller(config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and getattr(config.option, "dist", "no") != "no" \
        and not hasattr(config, "workerinput") and not config.option.collectonly


def pytest_configure(config):
    """Under xdist, the controller starts the suite's one temporary Prefect API (tests/prefect_shared.py)."""
    if _xdist_controller(config):
        config._deid_prefect = prefect_shared.SharedServer()


def pytest_configure_node(node):
    server = getattr(node.config, "_deid_prefect", None)
    if server is not None:
        node.workerinput[prefect_shared.WORKER_KEY] = [server.url, str(server.log)]


def pytest_terminal_summary(terminalreporter, config):
    server = getattr(config, "_deid_prefect", None)
    if server is not None and config.getoption("--cpu-report") is not None:
        terminalreporter.write_line(f"shared Prefect server (controller's child): {server.cpu_seconds():.1f} s CPU")


def pytest_unconfigure(config):
    server = getattr(config, "_deid_prefect", None)
    if server is not None:
        server.stop()


@pytest.fixture(scope="session")
def _prefect_harness(tmp_path_factory, pytestconfig):
    """The temporary Prefect API (isolated DB, free port): the session's shared one under xdist, else our own."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect_home"))
    shared = getattr(pytestconfig, "workerinput", {}).get(prefect_shared.WORKER_KEY)
    if shared:
        with prefect_shared.use_server(*shared):
            yield
        return
    from cpu_report import fixture_teardown
    from prefect.testing.utilities import prefect_test_harness

    with ExitStack() as harness:
        harness.enter_context(prefect_test_harness(server_startup_timeout=120))
        yield
        with fixture_teardown("_prefect_harness"):  # stopping (reaping) the server: its CPU for the session
            harness.close()


@pytest.fixture(scope="session")
def _dask_scheduler():
    """One Dask LocalCluster (one worker process) per test process, for the in-process flow runs."""
    import logging

    from cpu_report import fixture_teardown
    from distributed import LocalCluster

    with ExitStack() as resources:
        cluster = resources.enter_context(LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                                       dashboard_address=None, silence_logs=logging.WARNING))
        yield cluster.scheduler_address
        with fixture_teardown("_dask_scheduler"):  # reaping the worker: the CPU of every task it ran
            resources.close()


@pytest.fixture
def prefect_server(project, _prefect_harness, _dask_scheduler, monkeypatch):
    """Where a test's in-process flow runs: the session's Prefect API and the session's Dask scheduler.

    The flows run on the test process's one Dask worker (``DEID_DASK_ADDRESS``) instead of starting
    and stopping a LocalCluster each (~2 s of CPU a run). A flow's own LocalCluster (no address) is
    what every `deid run` subprocess of the suite uses (demo, fault matrix, operations tests).
    """
    monkeypatch.setenv("DEID_DASK_ADDRESS", _dask_scheduler)
