"""Ed25519 keys, canonical JSON and detached signatures for release reports."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from deid.errors import ConfigError, StateError
from deid.release.keyfiles import check_private_key_file

logger = logging.getLogger(__name__)

__all__ = [
    "SigningKey",
    "canonical_json",
    "ensure_signing_key",
    "generate_private_key",
    "load_private_key",
    "load_public_key",
    "public_key_fingerprint",
    "public_path_for",
    "sign_bytes",
    "verify_bytes",
    "warn_development_key",
    "write_keypair",
]

DEV_KEY_NAME = "dev_signing"
SIGNATURE_BYTES = 64


def canonical_json(obj: Any) -> bytes:
    """Serialise ``obj`` to the canonical bytes that are signed: sorted keys, ``(',', ':')``, UTF-8, no NaN/Infinity."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        # json's own message ("Out of range float values are not JSON compliant") does not say what to do.
        raise ValueError(
            f"cannot serialise to canonical JSON: {exc}; every float must be finite "
            "(use None for a value that could not be computed)"
        ) from exc
    return text.encode("utf-8")


def generate_private_key() -> Ed25519PrivateKey:
    """A fresh Ed25519 private key from the OS random generator."""
    return Ed25519PrivateKey.generate()


def public_path_for(private_path: Path) -> Path:
    """``keys/name.pem`` -> ``keys/name.pub.pem`` (the public half written next to a private key)."""
    private_path = Path(private_path)
    return private_path.with_name(private_path.stem + ".pub.pem")


def _write_new_file(path: Path, data: bytes, mode: int) -> None:
    # O_EXCL: never overwrite a key, even if another process created it since we looked.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed or (for 0644) not matter; be exact
        with os.fdopen(fd, "wb") as fh:
            fd = -1
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        if fd != -1:
            os.close(fd)


def write_keypair(
    out_dir: Path,
    *,
    passphrase: bytes | None = None,
    name: str = "deid_signing",
    private_key: Ed25519PrivateKey | None = None,
) -> tuple[Path, Path]:
    """Write ``<name>.pem`` (PKCS8, mode 0600) and ``<name>.pub.pem``; return (private_path, public_path)."""
    out_dir = Path(out_dir)
    if not name or "/" in name or name in {".", ".."}:
        raise ConfigError(f"name={name!r} must be a plain file stem such as 'deid_signing'")
    if passphrase is not None and not isinstance(passphrase, bytes | bytearray):
        raise ConfigError(f"passphrase must be bytes, got {type(passphrase).__name__}; encode it first (e.g. .encode())")
    if passphrase is not None and len(passphrase) == 0:
        raise ConfigError("passphrase=b'' is empty; pass None for an unencrypted key or a non-empty passphrase")
    out_dir.mkdir(parents=True, exist_ok=True)
    private_path = out_dir / f"{name}.pem"
    public_path = out_dir / f"{name}.pub.pem"
    for p in (private_path, public_path):
        if p.exists() or p.is_symlink():
            raise ConfigError(
                f"refusing to overwrite existing key file {p}; choose another name= or out_dir=, "
                "or move the old key away first"
            )
    key = private_key if private_key is not None else generate_private_key()
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(bytes(passphrase)) if passphrase else serialization.NoEncryption()
    )
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new_file(private_path, private_pem, 0o600)
    try:
        _write_new_file(public_path, public_pem, 0o644)
    except BaseException:
        private_path.unlink(missing_ok=True)
        raise
    logger.info("wrote Ed25519 key pair %s, %s", private_path, public_path)
    return private_path, public_path


def load_private_key(path: Path, *, passphrase: bytes | None = None) -> Ed25519PrivateKey:
    """Load an Ed25519 private key PEM, refusing one that group or others may read or write."""
    path = Path(path)
    check_private_key_file(
        path,
        kind="signing",
        create_hint="create one with `deid keygen --out DIR` (then DEID_SIGNING_KEY=DIR/deid_signing.pem) "
        "or point DEID_SIGNING_KEY at an existing key",
        regular_hint="point DEID_SIGNING_KEY at a PEM file",
        noun="private key",
    )
    data = path.read_bytes()
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except TypeError as exc:
        # cryptography says TypeError for both "encrypted but no password" and "password but not encrypted".
        if passphrase is None:
            raise ConfigError(
                f"signing key {path} is encrypted and no passphrase was given; supply the passphrase it was written with"
            ) from exc
        raise ConfigError(
            f"signing key {path} is not encrypted but a passphrase was given; pass passphrase=None"
        ) from exc
    except ValueError as exc:
        if passphrase is not None and b"ENCRYPTED" in data:
            raise ConfigError(f"wrong passphrase for signing key {path}: could not decrypt it") from exc
        raise ConfigError(
            f"signing key {path} is not a readable PEM private key ({exc}); expected an Ed25519 PKCS8 PEM"
        ) from exc
    except Exception as exc:  # UnsupportedAlgorithm and friends
        raise ConfigError(f"signing key {path} could not be loaded: {exc}; expected an Ed25519 PKCS8 PEM") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(
            f"signing key {path} is a {type(key).__name__.lstrip('_')}, not Ed25519; "
            "generate an Ed25519 key with `deid keygen --out DIR` and point DEID_SIGNING_KEY at DIR/deid_signing.pem"
        )
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Load an Ed25519 public key (SubjectPublicKeyInfo PEM)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"public key file {path} does not exist; pass the .pub.pem written next to the signing key") from None
    except IsADirectoryError:
        raise ConfigError(f"public key {path} is a directory; pass the .pub.pem file") from None
    try:
        key = serialization.load_pem_public_key(data)
    except Exception as exc:
        raise ConfigError(
            f"public key {path} is not a readable PEM public key ({exc}); expected an Ed25519 SubjectPublicKeyInfo PEM"
        ) from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"public key {path} is a {type(key).__name__.lstrip('_')}, not Ed25519")
    return key


def public_key_fingerprint(public_key: Ed25519PublicKey) -> str:
    """``"sha256:" + hex(sha256(raw 32-byte public key))``."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def sign_bytes(payload: bytes, private_key: Ed25519PrivateKey) -> bytes:
    """Raw 64-byte Ed25519 signature of ``payload``."""
    return private_key.sign(bytes(payload))


def verify_bytes(payload: bytes, signature: bytes, public_key: Ed25519PublicKey) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``payload`` under ``public_key``."""
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        public_key.verify(bytes(signature), bytes(payload))
    except InvalidSignature:
        return False
    return True


@dataclass(frozen=True)
class SigningKey:
    """A loaded signing key, where it came from, and its public fingerprint."""

    private_key: Ed25519PrivateKey
    public_key: Ed25519PublicKey
    fingerprint: str
    origin: Literal["configured", "development"]
    path: Path
    public_path: Path | None


def _same_public(a: Ed25519PublicKey, b: Ed25519PublicKey) -> bool:
    return public_key_fingerprint(a) == public_key_fingerprint(b)


_WARNED_DEV_KEYS: set[str] = set()  # development keys this process has warned about (once each)


def warn_development_key(path: Path, *, created: bool = False, log: logging.Logger | logging.LoggerAdapter | None = None
                         ) -> bool:
    """Warn that reports are signed with the development key ``path``: once per process and key.

    A run looks the key up more than once (the CLI's preflight, the report stage); one warning says it
    all. Returns whether it warned.
    """
    where = str(Path(path).resolve())
    if where in _WARNED_DEV_KEYS:
        return False
    _WARNED_DEV_KEYS.add(where)
    (log or logger).warning(
        "no signing key configured (DEID_SIGNING_KEY): %s development key %s; reports signed with it are for "
        "development only: create a key with `deid keygen --out DIR` and set DEID_SIGNING_KEY=DIR/deid_signing.pem",
        "created" if created else "signing with", path)
    return True


def ensure_signing_key(
    *,
    configured: Path | None,
    keys_dir: Path,
    passphrase_env_value: bytes | None = None,
) -> SigningKey:
    """Load the configured signing key, or use (creating it once) the development key ``keys_dir/dev_signing.pem``."""
    if configured is not None:
        path = Path(configured).expanduser()
        private_key = load_private_key(path, passphrase=passphrase_env_value)
        public_key = private_key.public_key()
        public_path: Path | None = public_path_for(path)
        if public_path.exists():
            on_disk = load_public_key(public_path)
            if not _same_public(on_disk, public_key):
                raise StateError(
                    f"public key {public_path} does not belong to signing key {path}; "
                    "remove or replace the stale .pub.pem (verifiers would reject every report)"
                )
        else:
            public_path = None
        return SigningKey(private_key, public_key, public_key_fingerprint(public_key), "configured", path, public_path)

    keys_dir = Path(keys_dir)
    if not keys_dir.exists():
        keys_dir.mkdir(parents=True, mode=0o700)
        os.chmod(keys_dir, 0o700)  # mkdir's mode is filtered by the umask
    path = keys_dir / f"{DEV_KEY_NAME}.pem"
    public_path = public_path_for(path)
    if not path.exists():
        if public_path.exists():
            raise StateError(
                f"{public_path} exists without its private key {path}; remove it so a fresh development key can be made"
            )
        write_keypair(keys_dir, name=DEV_KEY_NAME)
        warn_development_key(path, created=True)
    else:
        warn_development_key(path)
    private_key = load_private_key(path)
    public_key = private_key.public_key()
    if public_path.exists():
        if not _same_public(load_public_key(public_path), public_key):
            raise StateError(f"public key {public_path} does not belong to development key {path}; delete both to regenerate")
    else:
        public_pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        _write_new_file(public_path, public_pem, 0o644)
    return SigningKey(private_key, public_key, public_key_fingerprint(public_key), "development", path, public_path)
