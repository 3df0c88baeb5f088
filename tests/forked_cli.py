"""`deid` commands in processes forked from one that has already imported the run's packages.

A `deid run` subprocess spends ~8 s of CPU importing deid, Prefect, Great Expectations, scikit-learn
and matplotlib before it reads its drop; the fault matrix starts eight of them. ``ForkedCli`` starts
one *zygote* process (the given environment, the imports done once, no thread started) that forks a
child per command: each command is still its own process, with its own pid, stdout, stderr and exit
status, running ``deid.cli.main`` exactly as ``python -m deid.cli`` does, and a SIGKILL fault kills
that child for real. Only the fault's variable differs between the commands (it is read at run time,
deid.operations.safety), so the import-time state the children share is the state each would build.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ZYGOTE = r"""
import json, os, sys
import great_expectations, sklearn  # noqa: F401 - what every `deid run` imports
import deid.cli, deid.flows.release  # noqa: F401
# What every run builds before its first check: Great Expectations' ephemeral context (each forked command
# gets its own copy, as it would build its own).
from deid.evaluation.validation import warm_validation
warm_validation()
import threading
assert threading.active_count() == 1, "the zygote must not fork with threads running"
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the command's process: its environment, stdio and exit status are its own
        os.environ.update(req["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        sys.stdin = open(os.devnull)
        if req.get("script"):  # as `python SCRIPT ARGV...`
            import runpy
            sys.argv = [req["script"], *req["argv"]]
            runpy.run_path(req["script"], run_name="__main__")
            sys.exit(0)
        sys.exit(deid.cli.main(req["argv"]))  # as python -m deid.cli; SystemExit ends this child here
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class ForkedCli:
    """``run(argv, env=..., script=..., timeout=...)`` -> (returncode, stdout, stderr) of a forked `deid`
    command (or of ``python SCRIPT ARGV...``)."""

    def __init__(self, env: dict[str, str], cwd: Path, workdir: Path):
        self._dir = workdir
        self._dir.mkdir(parents=True, exist_ok=True)
        self._n = 0
        self._p = subprocess.Popen([sys.executable, "-c", ZYGOTE], env=env, cwd=cwd, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, start_new_session=True)
        ready = self._reply(120).strip()
        if ready != "ready":
            self.close()
            raise RuntimeError(f"the forking process did not start (said {ready!r}, exit {self._p.poll()})")

    def _reply(self, timeout: float) -> str:
        """The zygote's next line; after ``timeout`` seconds it and every command it forked are killed."""
        if not select.select([self._p.stdout], [], [], timeout)[0]:
            os.killpg(self._p.pid, signal.SIGKILL)
            self._p.wait()
            raise TimeoutError(f"no answer from the forking process in {timeout} s: it and its commands were killed")
        return self._p.stdout.readline()

    def run(self, argv: list[str], *, env: dict[str, str] | None = None, script: Path | None = None,
            timeout: float = 900) -> SimpleNamespace:
        self._n += 1
        out, err = self._dir / f"{self._n}.out", self._dir / f"{self._n}.err"
        self._p.stdin.write(json.dumps({"argv": [str(a) for a in argv], "env": env or {}, "script": str(script or ""), "stdout": str(out),
                                        "stderr": str(err)}) + "\n")
        self._p.stdin.flush()
        reply = self._reply(timeout)
        if not reply:
            raise RuntimeError(f"the forking process died (exit {self._p.poll()})")
        return SimpleNamespace(returncode=json.loads(reply)["code"], stdout=out.read_text(errors="replace"),
                               stderr=err.read_text(errors="replace"))

    def close(self) -> None:
        if self._p.poll() is None:
            self._p.stdin.close()
            try:
                self._p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._p.kill()
                self._p.wait()

    def __enter__(self) -> ForkedCli:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
