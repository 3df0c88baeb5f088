"""What a stage costs besides wall time: CPU seconds and peak resident memory of the run's process tree (issue 32).

The report's ``configuration.stage_seconds`` holds, per stage, ``{"wall", "cpu", "peak_rss_mib",
"tree_peak_rss_mib"}`` (:func:`deid.operations.runner._timed` measures them):

- ``cpu``: user + system seconds of the run's process and every process it started on this machine (Dask
  workers of a LocalCluster, a small run's pool, the gate's helper, Prefect's temporary server), counted as
  the difference of their totals at the stage's start and end. A process that exited and was waited for is
  in its parent's ``cutime``/``cstime``, so it is not lost. Workers of a remote scheduler
  (``DEID_DASK_ADDRESS``) are not this machine's processes and are not counted.
- ``peak_rss_mib``: the run process's peak resident memory during the stage (Linux resets the peak,
  ``VmHWM``, by writing ``5`` to ``/proc/<pid>/clear_refs``; read back from ``/proc/<pid>/status``).
- ``tree_peak_rss_mib``: the sum of each process's own peak during the stage, over the processes alive at
  its end: an upper bound of the tree's summed peak (each process's peak may come at another moment).

Where ``/proc`` is missing (not Linux) ``cpu`` falls back to :func:`resource.getrusage` of this process and
its waited-for children, and the peaks are None. Reading ``/proc`` for a handful of processes costs well
under a millisecond per stage.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["StageSample", "merge_usage", "sample_start", "stage_usage"]

MiB = 2 ** 20
_PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _tree(pid: int) -> list[int]:
    """``pid`` first, then its live descendants.

    Parents are read from every ``/proc/<n>/stat`` (the kernel's ``task/*/children`` lists are not built on
    every kernel): ~25 ms for 145 processes on a loaded 2-core machine, twice a stage.
    """
    kids: dict[int, list[int]] = {}
    for name in os.listdir(_PROC):
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if stat is None:
            continue  # gone meanwhile
        try:
            ppid = int(stat[stat.rindex(b")") + 2:].split(None, 2)[1])  # after "pid (comm) state "
        except (ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p not in out:
            out.append(p)
            todo.extend(kids.get(p, ()))
    return out


def _cpu(pid: int) -> float:
    """User + system seconds of ``pid`` and of its waited-for children (0 when it is gone)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return 0.0
    fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) ": field 3 (state) is fields[0]
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK  # utime stime cutime cstime


def _reset_peak(pid: int) -> bool:
    try:
        with open(_PROC / str(pid) / "clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes(pid: int) -> int | None:
    try:
        for line in (_PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class StageSample:
    """The state at a stage's start: wall clock, CPU total of the tree, whether the peaks were reset."""

    wall: float
    cpu: float
    proc: bool  # /proc readable: CPU from the tree
    reset: bool = False  # every process's peak was reset: the peaks are the stage's own


def _rusage_cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def sample_start() -> StageSample:
    """Take the stage's starting point (and reset every process's peak RSS in the tree)."""
    pid = os.getpid()
    if not (_PROC / str(pid) / "stat").exists():
        return StageSample(time.perf_counter(), _rusage_cpu(), proc=False)
    tree = _tree(pid)
    reset = all([_reset_peak(p) for p in tree])
    return StageSample(time.perf_counter(), sum(_cpu(p) for p in tree), proc=True, reset=reset)


def _rounded(usage: dict) -> dict[str, float | None]:
    return {k: None if v is None else round(float(v), 4 if k in ("wall", "cpu") else 1) for k, v in usage.items()}


def stage_usage(start: StageSample) -> dict[str, float | None]:
    """``{"wall", "cpu", "peak_rss_mib", "tree_peak_rss_mib"}`` of the stage begun at ``start`` (seconds to
    0.1 ms, MiB to 0.1)."""
    wall = time.perf_counter() - start.wall
    pid = os.getpid()
    if not start.proc:
        return _rounded({"wall": wall, "cpu": max(0.0, _rusage_cpu() - start.cpu), "peak_rss_mib": None,
                         "tree_peak_rss_mib": None})
    tree = _tree(pid)
    cpu = max(0.0, sum(_cpu(p) for p in tree) - start.cpu)
    # A process whose peak could not be reset (not ours to write) would report its lifetime peak: no figure.
    peaks = [_peak_bytes(p) for p in tree] if start.reset else [None]
    own = peaks[0]
    return _rounded({"wall": wall, "cpu": cpu, "peak_rss_mib": None if own is None else own / MiB,
                     "tree_peak_rss_mib": None if own is None else sum(p for p in peaks if p is not None) / MiB})


def merge_usage(before: dict | None, now: dict) -> dict[str, float | None]:
    """A stage timed more than once (``report``, ``register``): seconds add up, peaks take the larger."""
    if not before:
        return dict(now)
    out: dict[str, float | None] = {}
    for key in ("wall", "cpu"):
        out[key] = (before.get(key) or 0.0) + (now.get(key) or 0.0)
    for key in ("peak_rss_mib", "tree_peak_rss_mib"):
        vals = [v for v in (before.get(key), now.get(key)) if v is not None]
        out[key] = max(vals) if vals else None
    return _rounded(out)
