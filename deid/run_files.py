"""The names of a run's marker files and of a release's signed addendum.

A base module (no deid import): the typed contracts (:class:`deid.contracts.StagingLayout`), the
release verifier and the crash-safety code (:mod:`deid.operations.safety`, which re-exports them)
all name these files, and only the last one is in the operations layer.
"""
from __future__ import annotations

__all__ = ["ADDENDUM_NAME", "ADDENDUM_SIG_NAME", "COMPLETE_MARKER", "LOCK_NAME", "RELEASE_SUBDIR"]

LOCK_NAME = ".run.lock"
COMPLETE_MARKER = ".complete"
ADDENDUM_NAME = "addendum.json"
ADDENDUM_SIG_NAME = "addendum.json.sig"
RELEASE_SUBDIR = "release"  # the would-be release inside a run's staging directory
