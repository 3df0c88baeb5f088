"""Run a command and measure the memory of its whole process tree: the issue-13 figure for a real run.

Usage:
    .venv/bin/python bench/run_rss.py --out /tmp/m1/runH -- .venv/bin/deid run /tmp/m1/drop --k 5

Samples, every ``--interval`` seconds (default 2), the resident memory of the command's process and
of every process it started (Dask workers, the gate's helper, the Prefect server), summed: no other
process on the machine is counted. Each sample is labelled with the stage the command's log last
named (a log line ``INFO <logger>: <stage>: ...``). Writes OUT/tree.log (one line per sample: time,
stage, total MiB, then pid:name:MiB of each process) and OUT/log.txt (the command's stdout and
stderr), and prints the command's wall and CPU seconds (user + system of it and its waited-for
children), the peak of the summed RSS with its stage and breakdown, and the peak per stage.
"""
from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

MiB = 2 ** 20
STAGE_LINE = re.compile(r"\b(?:INFO|WARNING) [\w.]+: ([a-z][a-z_ -]*?):")


def tree_rss(root: psutil.Process) -> list[tuple[int, str, float]]:
    """(pid, name, MiB) of ``root`` and its descendants that are still alive."""
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            out.append((p.pid, p.name(), p.memory_info().rss / MiB))
        except psutil.Error:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command after --")
    args.out.mkdir(parents=True, exist_ok=True)
    stage = ["start"]
    peaks: dict[str, tuple[float, str, str]] = {}
    t0 = time.perf_counter()
    with open(args.out / "log.txt", "w", encoding="utf-8") as log, \
            open(args.out / "tree.log", "w", encoding="utf-8") as tree:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        root = psutil.Process(proc.pid)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                rows = tree_rss(root)
                total = sum(r for _, _, r in rows)
                now = time.strftime("%H:%M:%S")
                detail = " ".join(f"{pid}:{name}:{r:.0f}" for pid, name, r in rows)
                tree.write(f"{now} {stage[0]} total={total:.0f} {detail}\n")
                tree.flush()
                if total > peaks.get(stage[0], (0.0,))[0]:
                    peaks[stage[0]] = (total, now, detail)
                done.wait(args.interval)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            m = STAGE_LINE.search(line)
            if m:
                stage[0] = m.group(1).split(":")[0].strip()
        rc = proc.wait()
        done.set()
        th.join()
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"command: {' '.join(cmd)}")
    print(f"exit code {rc}; wall {wall:.1f} s ({wall / 60:.1f} min); CPU {ru.ru_utime + ru.ru_stime:.0f} s "
          f"(user {ru.ru_utime:.0f} + sys {ru.ru_stime:.0f}, waited-for processes)")
    if peaks:
        top = max(peaks.items(), key=lambda kv: kv[1][0])
        print(f"peak RSS summed over the process tree: {top[1][0]:.0f} MiB = {top[1][0] / 1024:.2f} GiB "
              f"at {top[1][1]} in stage {top[0]!r}: {top[1][2]}")
        print("peak per stage (MiB, in the order the stages began):")
        for name, (total, when, _) in peaks.items():
            print(f"  {name:24s} {total:7.0f}  at {when}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
