"""Run safety: pre-flight checks, the run lock, recovery after killed runs, signed addenda, fault hooks.

The order of commitment of a run (``deid/operations/runner.py``) is: pre-flight (configuration, signing
key, writable data and reports locations on the right filesystems) -> lock the run's staging
directory -> recover what dead runs left -> work, staging the would-be release *inside* the
run's staging directory -> write, validate and sign the report -> publish by one ``rename``
into ``data/releases/``. A release therefore never exists without its signed report, and a
killed run leaves nothing in ``data/releases/``.

Liveness rule (which staging directories recovery may delete): every run holds an exclusive
``flock`` on ``<staging>/.run.lock`` for its whole life. The kernel drops the lock when the
process dies, also on SIGKILL, so a lock file that can be locked belongs to a dead run. A run
that finished normally writes ``.complete`` (its verdict) and keeps what ``DEID_KEEP_STAGING`` keeps of its
staging (:mod:`deid.operations.retention`, applied after the lock is released). Recovery deletes only directories that have a lock file, no ``.complete`` marker and
no live holder; a directory without a lock file (a run between ``mkdir`` and locking, or an
older deid version) is never touched. ``flock`` is per host (and emulated over NFSv4): runs
sharing a staging directory must run on one host or on a filesystem with working locks.
"""
from __future__ import annotations

import base64
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from deid.errors import ConfigError, EnvironmentFailure
# The file names and the fault hooks are base facts (the lower layers name and call them too): re-exported here.
from deid.faults import FAULT_ENV, FAULT_STAGES, fault_enospc, fault_point
from deid.run_files import ADDENDUM_NAME, ADDENDUM_SIG_NAME, COMPLETE_MARKER, LOCK_NAME

log = logging.getLogger(__name__)

__all__ = [
    "ADDENDUM_NAME", "ADDENDUM_SIG_NAME", "COMPLETE_MARKER", "FAULT_ENV", "LOCK_NAME", "FAULT_STAGES",
    "Recovery", "RunLock", "fault_enospc", "fault_point", "is_live", "preflight_locations", "recover",
    "write_signed_addendum",
]

# --------------------------------------------------------------------------- pre-flight

def _probe_writable(d: Path, what: str) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}-{time.monotonic_ns()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        raise EnvironmentFailure.from_oserror(exc, doing=f"the {what} {d} is not writable") from None


def preflight_locations(data_path: Path, reports_path: Path) -> None:
    """Check the staging, releases and reports locations before any work.

    Raises EnvironmentFailure when one is not writable, ConfigError when staging and releases
    are on different filesystems (the publishing rename would then not be atomic).
    """
    staging, releases = Path(data_path) / "staging", Path(data_path) / "releases"
    for d, what in ((staging, "staging directory"), (releases, "releases directory"),
                    (Path(reports_path), "reports directory")):
        _probe_writable(d, what)
    if os.stat(staging).st_dev != os.stat(releases).st_dev:
        raise ConfigError(
            f"staging {staging} and releases {releases} are on different filesystems; publishing must be one "
            "atomic rename: keep both under DEID_DATA_DIR on one filesystem")


# --------------------------------------------------------------------------- the run lock

@dataclass
class RunLock:
    """The staging directory of one live run, created fresh and flock-ed until :meth:`close`."""

    path: Path
    _fd: int = -1

    @classmethod
    def create(cls, staging: Path) -> RunLock:
        staging = Path(staging)
        staging.mkdir(parents=True)  # a fresh release id: never reuse a directory
        fd = os.open(staging / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.time()}).encode())
        return cls(staging, fd)

    def complete(self) -> None:
        """Mark the run finished normally: recovery keeps this staging directory."""
        (self.path / COMPLETE_MARKER).touch()

    def close(self) -> None:
        if self._fd != -1:
            os.close(self._fd)
            self._fd = -1


def is_live(staging: Path) -> bool | None:
    """True when a live process holds the run lock, False when its holder died, None without a lock file."""
    try:
        fd = os.open(Path(staging) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # cannot tell: treat as live, never delete what might be in use
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe lock
    return False


# --------------------------------------------------------------------------- recovery

@dataclass
class Recovery:
    """What :func:`recover` removed (and which unpublished signed reports it annotated)."""

    removed: list[str] = field(default_factory=list)
    annotated: list[str] = field(default_factory=list)


def remove_path(path: Path) -> bool:
    """Remove a file, a link (never its target) or a directory tree; False when it is already gone
    (another run or process removed it first). Other ``OSError`` exceptions propagate."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return False
    return True


def _remove(path: Path, why: str, out: Recovery) -> None:
    try:
        if not remove_path(path):
            return  # another run recovered it first
    except OSError as exc:
        log.warning("recovery: could not remove %s (%s): %s", path, why, exc)
        return
    out.removed.append(str(path))
    log.warning("recovery: removed %s (%s)", path, why)


def recover(data_path: Path, reports_path: Path, *,
            on_unpublished: Callable[[str, Path], None] | None = None) -> Recovery:
    """Remove what killed runs left behind and log it.

    - ``data/releases/.tmp-*`` and ``.*`` entries: temporary releases of older deid versions or
      a torn rename; never a complete, reported release (those have plain release-id names);
    - ``data/staging/<id>/`` of dead runs (see the module docstring for the liveness rule),
      including any would-be release staged inside;
    - partial files ``.*.tmp`` left by interrupted atomic writes in ``data/private/*`` and
      ``reports/*``.

    ``on_unpublished(release_id, report_dir)`` is called for a dead run whose signed report says
    ``released`` but whose release was never published (killed between signing and the rename),
    so the caller can sign an addendum saying so.
    """
    out = Recovery()
    data_path, reports_path = Path(data_path), Path(reports_path)
    releases = data_path / "releases"
    if releases.is_dir():
        for p in sorted(releases.iterdir()):
            if p.name.startswith("."):
                _remove(p, "temporary release of an interrupted run: never gated or never reported", out)
    staging_root = data_path / "staging"
    if staging_root.is_dir():
        for d in sorted(staging_root.iterdir()):
            if not d.is_dir() or d.is_symlink() or (d / COMPLETE_MARKER).exists():
                continue
            if is_live(d) is not False:
                continue
            report_dir = reports_path / d.name
            if (on_unpublished is not None and not (releases / d.name).exists()
                    and _says_released(report_dir) and not (report_dir / ADDENDUM_NAME).exists()):
                try:
                    on_unpublished(d.name, report_dir)
                    out.annotated.append(str(report_dir))
                except Exception as exc:  # noqa: BLE001 - recovery must go on; the addendum is best effort
                    log.warning("recovery: could not sign an addendum for %s: %s", report_dir, exc)
            _remove(d, "staging of a run that died before finishing", out)
    for parent in (data_path / "private", reports_path):
        if parent.is_dir():
            for p in parent.glob("*/.*.tmp"):
                if time.time() - p.lstat().st_mtime > 60:  # an atomic write in progress takes far less
                    _remove(p, "partial file of an interrupted write", out)
    return out


def _says_released(report_dir: Path) -> bool:
    try:
        return json.loads((report_dir / "report.json").read_bytes()).get("verdict") == "released"
    except (OSError, ValueError, AttributeError):
        return False


# --------------------------------------------------------------------------- signed addenda

def write_signed_addendum(report_dir: Path, addendum: dict, signing_key) -> Path:
    """Write ``addendum.json`` (canonical JSON) and its Ed25519 signature next to a signed report.

    Used when something happens after the report was signed that the report cannot say (its
    release was not published after all). ``signing_key`` is a :class:`deid.release.signing.SigningKey`.
    """
    from deid.release.signing import canonical_json, sign_bytes  # noqa: PLC0415

    body = {**addendum, "signing": {"algorithm": "ed25519", "public_key_fingerprint": signing_key.fingerprint,
                                    "key_origin": signing_key.origin}}
    payload = canonical_json(body)
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    for name, data in ((ADDENDUM_NAME, payload),
                       (ADDENDUM_SIG_NAME, base64.b64encode(sign_bytes(payload, signing_key.private_key)) + b"\n")):
        tmp = report_dir / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, report_dir / name)
    log.warning("signed addendum %s: %s", report_dir / ADDENDUM_NAME, addendum.get("event"))
    return report_dir / ADDENDUM_NAME
