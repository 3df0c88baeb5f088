"""Typed exit codes (issue 11): `deid`'s exit code follows the exception type (deid.cli.exit_code_for)."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from deid.errors import ConfigError, DataError, DropError, EnvironmentFailure, StateError
from deid.cli import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_STATE, exit_code_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("exc", "code"), [
    (EnvironmentFailure("disk full"), EXIT_ENVIRONMENT),
    (OSError(errno.ENOSPC, "No space left on device"), EXIT_ENVIRONMENT),
    (OSError(errno.EIO, "Input/output error"), EXIT_ENVIRONMENT),
    (DataError("bad manifest"), EXIT_BAD_INPUT),
    (DropError("bad manifest"), EXIT_BAD_INPUT),
    (ConfigError("bad k"), EXIT_BAD_INPUT),
    (FileNotFoundError("no such drop"), EXIT_BAD_INPUT),
    (StateError("publish undone"), EXIT_STATE),
    (RuntimeError("a bug"), EXIT_STATE),
])
def test_exit_code_follows_the_exception_type(exc, code):
    assert exit_code_for(exc) == code
