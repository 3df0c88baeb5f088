"""``pytest --cpu-report[=N]``: CPU seconds (user + sys) per test, the top N (default 40) at the end.

A test's CPU is what its process and the children it waited for (``deid run`` subprocesses,
stopped servers) used from the start of its setup to the end of its teardown: the first test to
use a session fixture pays the fixture's setup. A server that runs for the whole session (the
Prefect test server, the Dask scheduler's worker) is only reaped at the last teardown; the
fixtures that start them record that teardown as their own line (``fixture:<name>``), not the
test's. Grandchildren orphaned by a SIGKILL of their parent's group are not counted by the kernel.
Under pytest-xdist every worker reports its figures to the controller, which prints one table.
Off by default (the hooks then do nothing).
"""
from __future__ import annotations

import resource
from contextlib import contextmanager

import pytest

_TESTS: dict[str, float] = {}
_FIXTURES: dict[str, float] = {}
_ENABLED = False
_REMOTE: list[dict] = []  # what each xdist worker reported (controller side)


def cpu() -> float:
    """User + sys CPU seconds of this process and of its reaped children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@contextmanager
def fixture_teardown(name: str):
    """Book the CPU of the block (a session fixture's teardown, reaping its server) to ``fixture:<name>``."""
    start = cpu()
    try:
        yield
    finally:
        if _ENABLED:
            _FIXTURES[name] = _FIXTURES.get(name, 0.0) + cpu() - start


def pytest_addoption(parser):
    parser.addoption("--cpu-report", action="store", nargs="?", const="40", default=None, metavar="N",
                     help="print the N tests (default 40) that used the most CPU (user+sys, own + waited children)")


def pytest_configure(config):
    global _ENABLED
    _ENABLED = config.getoption("--cpu-report") is not None
    if _ENABLED:
        _TESTS.clear()
        _FIXTURES.clear()
        config._cpu_report_start = cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _ENABLED:
        yield
        return
    start, booked = cpu(), sum(_FIXTURES.values())
    yield
    # Fixture teardowns inside this test's protocol (the session's last test) are not its CPU.
    _TESTS[item.nodeid] = cpu() - start - (sum(_FIXTURES.values()) - booked)


def pytest_sessionfinish(session):
    config = session.config
    if not _ENABLED:
        return
    figures = {"tests": dict(_TESTS), "fixtures": dict(_FIXTURES),
               "total": cpu() - config._cpu_report_start}
    if hasattr(config, "workeroutput"):  # an xdist worker: hand the figures to the controller
        figures["worker"] = config.workerinput.get("workerid", "?")
        config.workeroutput["cpu_report"] = figures
    else:
        config._cpu_report_local = figures


def pytest_testnodedown(node, error):
    figures = getattr(node, "workeroutput", {}).get("cpu_report")
    if figures:
        _REMOTE.append(figures)


def pytest_terminal_summary(terminalreporter, config):
    if not _ENABLED or hasattr(config, "workeroutput"):
        return
    reports = list(_REMOTE) or [getattr(config, "_cpu_report_local", None) or {}]
    top = int(config.getoption("--cpu-report"))
    tests = {k: v for r in reports for k, v in r.get("tests", {}).items()}
    tr = terminalreporter
    tr.section(f"CPU per test (user+sys, own + waited children), top {top} of {len(tests)}")
    for nodeid, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:top]:
        tr.write_line(f"{seconds:8.1f} s  {nodeid}")
    for r in reports:
        who = r.get("worker", "main")
        fixtures = ", ".join(f"fixture:{k} {v:.1f} s" for k, v in sorted(r.get("fixtures", {}).items()))
        tr.write_line(f"[{who}] tests {sum(r.get('tests', {}).values()):.1f} s, {fixtures or 'no fixture line'}, "
                      f"process total {r.get('total', 0.0):.1f} s")
    tr.write_line(f"all tests {sum(tests.values()):.1f} s CPU")
