"""Test-only fault hooks: a run that kills itself at a stage boundary, or a write that finds the disk full.

A base module (no deid import): the intake, release and operations layers all call these hooks
where they write, so they cannot live in any one of them. :mod:`deid.operations.safety` re-exports
them beside the crash-safety machinery they exercise.
"""
from __future__ import annotations

import errno
import logging
import os
import signal

log = logging.getLogger(__name__)

__all__ = ["FAULT_ENV", "FAULT_LOCATIONS", "FAULT_STAGES", "fault_enospc", "fault_point"]

FAULT_ENV = "DEID_FAULT_INJECT"
# Stage boundaries at which `kill:after:<stage>` SIGKILLs the run (the process itself, exactly
# like `kill -9` from outside at that moment, but deterministic).
FAULT_STAGES = ("ingest", "align", "gate", "register", "sign", "publish")
# Locations at which `enospc:<location>` raises ENOSPC as a full disk would.
FAULT_LOCATIONS = ("data", "stage", "reports")


def _faults() -> set[str]:
    # Read directly (not through Settings): a test-only hook that must also work in a bare subprocess.
    return {s.strip() for s in os.environ.get(FAULT_ENV, "").split(",") if s.strip()}


def fault_point(stage: str) -> None:
    """Test hook: with ``DEID_FAULT_INJECT=kill:after:<stage>`` the run kills itself (SIGKILL) here."""
    if f"kill:after:{stage}" in _faults():
        log.warning("fault injection: SIGKILL after %s", stage)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def fault_enospc(location: str, path: os.PathLike | str) -> None:
    """Test hook: with ``DEID_FAULT_INJECT=enospc:<location>`` raise ENOSPC for a write to ``path``."""
    if f"enospc:{location}" in _faults():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
