"""What every release stage shares: the run's keys (signing, linkage), the preflight and the recovery
of killed runs' leftovers, the report's timestamps, and where a validation suite runs.
"""
from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path

from deid.operations.executors import Executor
from deid.run_config import RunConfig


log = logging.getLogger(__name__)


Logger = logging.Logger | logging.LoggerAdapter


def now_iso() -> str:
    """Current UTC time, second precision, ``Z`` suffix (the report's timestamps)."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


# --------------------------------------------------------------------------- keys and locations


def signing_key(config: RunConfig):
    """The run's :class:`~deid.release.signing.SigningKey` (configured, or the development key created once)."""
    from deid.release.signing import ensure_signing_key  # noqa: PLC0415

    secret = config.signing_passphrase
    return ensure_signing_key(configured=config.signing_key, keys_dir=config.keys_dir,
                              passphrase_env_value=secret.get_secret_value().encode() if secret else None)


def linkage_key(config: RunConfig) -> tuple[bytes, Path, str]:
    """(key, path, origin) of the steward's linkage key; the key itself never leaves this process."""
    from deid.release.linkage import ensure_linkage_key  # noqa: PLC0415

    return ensure_linkage_key(configured=config.linkage_key, keys_dir=config.keys_dir)


def preflight(config: RunConfig):
    """Before any work: every location is writable and the signing key loads (readable, 0600, passphrase).

    Returns the key's :class:`~deid.reporting.report.SigningInfo` (fingerprint and origin; the key stays here).
    """
    from deid.reporting.report import SigningInfo  # noqa: PLC0415
    from deid.operations.safety import preflight_locations  # noqa: PLC0415

    preflight_locations(config.data_path, config.reports_path)
    return SigningInfo.from_key(signing_key(config))


def recover_leftovers(config: RunConfig, *, logger: Logger | None = None) -> tuple[str, ...]:
    """Remove what killed runs left (temporary releases, dead runs' staging, partial files); returns what went."""
    from deid.operations.safety import recover, write_signed_addendum  # noqa: PLC0415

    def unpublished(release_id: str, report_dir: Path) -> None:
        write_signed_addendum(report_dir, {
            "release_id": release_id, "event": "not_published", "release_published": False,
            "created_at": now_iso(),
            "detail": "the run died after signing its report and before publishing; its staged release was "
                      "removed by recovery and nothing was published"}, signing_key(config))

    rec = recover(config.data_path, config.reports_path, on_unpublished=unpublished)
    if rec.removed:
        (logger or log).warning("recovery: removed %d leftovers of killed runs: %s", len(rec.removed), ", ".join(rec.removed))
    return tuple(rec.removed)


def validate_off_main(executor: Executor | None, fn, /, **kwargs):
    """A validation suite ``fn(**kwargs)`` on a small run's pool process (Great Expectations imported there
    while this process started the run), else here."""
    remote = getattr(executor, "call_remote", None)
    return remote(fn, **kwargs) if remote is not None else fn(**kwargs)
