"""``pytest --cpu-report[=N]``: CPU seconds (user + sys) per test, the top N (default 40) at the end.

A test's CPU is what its process tree used from the start of its setup to the end of its teardown:
the test process, the children it waited for (``deid run`` subprocesses, stopped servers), and
what its live descendants used meanwhile (read from ``/proc`` with psutil before and after each
test): the session's Dask worker running an in-process flow's stages, the ops stack's Prefect
server, `deid serve` (with the flow runs it reaped) and `deid watch`, a ``ForkedCli`` zygote's
commands. A process started earlier and used by several tests is so booked to each test for
the CPU it used while that test ran. The first test to use a session fixture pays the fixture's
setup. A fixture that stops a session-long process records that teardown as its own line
(``fixture:<name>``), not the test's. Not counted: the xdist controller's shared Prefect server
(printed on its own line, conftest.py), and grandchildren orphaned by a SIGKILL of their parent's
group (the kernel books them to no one). Under pytest-xdist every worker reports its figures to the
controller, which prints one table. Off by default (the hooks then do nothing).

``--write-durations PATH`` (implies ``--cpu-report``) also writes the figures to PATH, the JSON file
(node id -> CPU seconds) tests/conftest.py orders the queue by: every test of the run that used at
least ``MIN_SECONDS``, merged into the file's other entries (a run of one tier refreshes that tier; an
entry the run measured a test under, the test's own id or a prefix of it, is replaced).
"""
from __future__ import annotations

import json
import resource
from contextlib import contextmanager
from pathlib import Path

import pytest

_TESTS: dict[str, float] = {}
_FIXTURES: dict[str, float] = {}
_ENABLED = False
_REMOTE: list[dict] = []  # what each xdist worker reported (controller side)
MIN_SECONDS = 1.0  # --write-durations keeps the tests that cost at least this: the rest weigh by their tier


def cpu() -> float:
    """User + sys CPU seconds of this process and of its reaped children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


Snapshot = tuple[float, dict[tuple[int, float], float]]


def snapshot() -> Snapshot:
    """(:func:`cpu`, {(pid, start time): CPU so far} of every live descendant of this process).

    A descendant's CPU is its own plus its reaped children's (a `deid serve` and the flow-run
    processes it waited for). psutil comes with distributed (a dependency of deid).
    """
    import psutil  # noqa: PLC0415

    tree: dict[tuple[int, float], float] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                tree[(proc.pid, proc.create_time())] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:  # ended (or a zombie) between listing and reading: its parent's figures hold it
            continue
    return cpu(), tree


def used(start: Snapshot, end: Snapshot) -> float:
    """CPU seconds the process tree used between two snapshots.

    This process and its reaped children (``RUSAGE_CHILDREN`` holds a reaped child's whole life), plus
    what every descendant alive at the end used since the start (all of it for a new one). A
    descendant alive at the start and gone at the end was reaped by this process or by a live
    descendant, whose figures now hold its whole life: its CPU before the start was booked already.
    """
    (own0, tree0), (own1, tree1) = start, end
    live = sum(seconds - tree0.get(key, 0.0) for key, seconds in tree1.items())
    gone = sum(seconds for key, seconds in tree0.items() if key not in tree1)
    return own1 - own0 + live - gone


@contextmanager
def fixture_teardown(name: str):
    """Book the CPU of the block (a session fixture's teardown, reaping its server) to ``fixture:<name>``."""
    start = snapshot() if _ENABLED else None
    try:
        yield
    finally:
        if _ENABLED and start is not None:
            _FIXTURES[name] = _FIXTURES.get(name, 0.0) + used(start, snapshot())


def pytest_addoption(parser):
    parser.addoption("--cpu-report", action="store", nargs="?", const="40", default=None, metavar="N",
                     help="print the N tests (default 40) that used the most CPU (user+sys, the test process's tree)")
    parser.addoption("--write-durations", action="store", default=None, metavar="PATH",
                     help="also write every test's CPU seconds (>= 1 s) to PATH, merged into it (tests/durations.json "
                          "orders the queue, tests/conftest.py); implies --cpu-report")


def pytest_configure(config):
    global _ENABLED
    if config.getoption("--write-durations") and config.getoption("--cpu-report") is None:
        config.option.cpu_report = "40"
    _ENABLED = config.getoption("--cpu-report") is not None
    if _ENABLED:
        _TESTS.clear()
        _FIXTURES.clear()
        config._cpu_report_start = snapshot()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _ENABLED:
        yield
        return
    start, booked = snapshot(), sum(_FIXTURES.values())
    yield
    # Fixture teardowns inside this test's protocol (the session's last test) are not its CPU.
    _TESTS[item.nodeid] = used(start, snapshot()) - (sum(_FIXTURES.values()) - booked)


def pytest_sessionfinish(session):
    config = session.config
    if not _ENABLED:
        return
    figures = {"tests": dict(_TESTS), "fixtures": dict(_FIXTURES),
               "total": used(config._cpu_report_start, snapshot())}
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
    tr.section(f"CPU per test (user+sys, its process tree), top {top} of {len(tests)}")
    for nodeid, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:top]:
        tr.write_line(f"{seconds:8.1f} s  {nodeid}")
    for r in reports:
        who = r.get("worker", "main")
        fixtures = ", ".join(f"fixture:{k} {v:.1f} s" for k, v in sorted(r.get("fixtures", {}).items()))
        tr.write_line(f"[{who}] tests {sum(r.get('tests', {}).values()):.1f} s, {fixtures or 'no fixture line'}, "
                      f"process tree total {r.get('total', 0.0):.1f} s")
    tr.write_line(f"all tests {sum(tests.values()):.1f} s CPU")
    target = config.getoption("--write-durations")
    if target:
        written = write_durations(Path(target), tests)
        tr.write_line(f"wrote {written} durations to {target}")


def plain_nodeid(nodeid: str) -> str:
    """The node id without the ``@<xdist group>`` pytest-xdist's ``loadgroup`` appends (after the parameters).

    tests/conftest.py weighs a test by its node id at collection, before the group is appended.
    """
    head, bracket, tail = nodeid.rpartition("]")
    return head + bracket + tail.split("@", 1)[0]


def write_durations(path: Path, tests: dict[str, float]) -> int:
    """Merge the measured tests (>= ``MIN_SECONDS``) into the durations file at ``path``; return its size.

    An old entry goes when this run measured a test under it (the same id, or a prefix of a measured id such
    as a module's ``path::``): the run's figures replace it. The others stay (tests this run did not run).
    """
    old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    tests = {plain_nodeid(nodeid): seconds for nodeid, seconds in tests.items()}
    kept = {key: seconds for key, seconds in old.items() if not any(nodeid.startswith(key) for nodeid in tests)}
    kept.update({nodeid: round(seconds, 1) for nodeid, seconds in tests.items() if seconds >= MIN_SECONDS})
    path.write_text(json.dumps(dict(sorted(kept.items())), indent=1) + "\n", encoding="utf-8")
    return len(kept)
