"""The release's own signed attestation: what a recipient verifies with the release directory alone.

The signed report (``reports/<release id>/report.json``) is the steward's record and is not shipped.
A release carries ``ATTESTATION.json``, the public part of that report (verdict, k, method,
guarantee, the gate's checks and key figures, the sha256 of every release file outside the
images and of ``MANIFEST.sha256``, which lists every image, the signer's public-key fingerprint,
``created_at``) and ``ATTESTATION.json.sig``, the raw 64-byte Ed25519 signature of its exact bytes
(canonical JSON, :func:`deid.release.signing.canonical_json`). It is written into the staged release
after the dataset card and the manifest and before the report is signed (the report lists both
files' sha256) and before the one ``rename`` that publishes.

It names no subject, source path, linkage or seed: only what the dataset card already says
publicly, plus file hashes; ``schemas/attestation.schema.json`` (closed objects) is checked
before it is signed and when it is verified. ``deid verify RELEASE_DIR --public-key KEY`` checks it
(:func:`deid.reporting.verify.verify_release`); :data:`NO_DEID_CHECK` does the same with ``openssl``
and ``sha256sum`` (:data:`PYTHON_SIGNATURE_CHECK`: the signature with Python's ``cryptography``
where ``openssl`` is missing), the commands the dataset card and README.md show.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from deid.errors import StateError
from deid.release.signing import SigningKey, canonical_json, sign_bytes

__all__ = ["ATTESTATION_FORMAT", "ATTESTATION_NAME", "ATTESTATION_SIG_NAME", "NO_DEID_CHECK",
           "PYTHON_SIGNATURE_CHECK", "attestation_problems", "load_schema", "write_attestation"]

ATTESTATION_NAME = "ATTESTATION.json"
ATTESTATION_SIG_NAME = "ATTESTATION.json.sig"
ATTESTATION_FORMAT = "deid-attestation/1"
SCHEMA_NAME = "attestation.schema.json"  # in deid.schemas: closed objects, so no field beyond the allow-list

# Run in the release directory with the steward's public key saved as STEWARD.pub.pem (obtained from the
# steward, never from the release: a key shipped with the data proves nothing). Each command exits non-zero
# on a failure: the signature, then the files the attestation lists (MANIFEST.sha256 among them), then
# every image MANIFEST.sha256 lists.
NO_DEID_CHECK = (
    f"openssl pkeyutl -verify -pubin -inkey STEWARD.pub.pem -rawin -in {ATTESTATION_NAME} "
    f"-sigfile {ATTESTATION_SIG_NAME}",
    "python3 -c 'import json; [print(f[\"sha256\"] + \"  \" + f[\"path\"]) for f in "
    f"json.load(open(\"{ATTESTATION_NAME}\"))[\"files\"]]' | sha256sum -c --quiet -",
    "sha256sum -c --quiet MANIFEST.sha256",
)
# The first command's equivalent where openssl (>= 3.0 for -rawin) is missing: Python's cryptography package.
PYTHON_SIGNATURE_CHECK = (
    "python3 -c 'from cryptography.hazmat.primitives.serialization import load_pem_public_key as k; "
    f"k(open(\"STEWARD.pub.pem\", \"rb\").read()).verify(open(\"{ATTESTATION_SIG_NAME}\", \"rb\").read(), "
    f"open(\"{ATTESTATION_NAME}\", \"rb\").read()); print(\"Signature Verified Successfully\")'"
)


@functools.lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    """The attestation's JSON Schema (draft 2020-12), shipped in ``deid.schemas``."""
    schema = json.loads(resources.files("deid.schemas").joinpath(SCHEMA_NAME).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def attestation_problems(attestation: Any) -> list[str]:
    """Every way ``attestation`` breaks ``schemas/attestation.schema.json`` (empty list: valid)."""
    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(attestation), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    return [f"$.{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_attestation(root: Path, attestation: Mapping[str, Any], key: SigningKey) -> tuple[Path, Path]:
    """Write ``ATTESTATION.json`` (canonical JSON) and ``ATTESTATION.json.sig`` (raw Ed25519) into ``root``.

    Parameters
    ----------
    root : path
        The staged release directory (before it is published).
    attestation : mapping
        The attestation (:func:`deid.reporting.attestation.attestation_from_report`); its ``signer``
        must name ``key``'s fingerprint, so a verifier can tell a wrong key from a forged file.
    key : SigningKey
        The run's signing key (the one that signs the report).

    Returns
    -------
    (attestation path, signature path)
    """
    root = Path(root)
    payload = canonical_json(dict(attestation))  # also refuses NaN / infinity
    # Validated as it will be read (its JSON form): a field outside the schema's allow-list stops the run
    # before anything is signed or published.
    problems = attestation_problems(json.loads(payload))
    if problems:
        raise StateError(f"the release attestation does not match {SCHEMA_NAME}: {'; '.join(problems[:5])}; "
                         "nothing was signed or published (a bug: report it)")
    claimed = attestation["signer"]["public_key_fingerprint"]
    if claimed != key.fingerprint:
        raise StateError(f"attestation signer {claimed} is not the signing key {key.fingerprint}; "
                         "build it from the report this key signs")
    path, sig_path = root / ATTESTATION_NAME, root / ATTESTATION_SIG_NAME
    _write_atomic(path, payload)
    # Raw bytes, not base64 (unlike report.json.sig): `openssl pkeyutl -verify -sigfile` reads raw signatures.
    _write_atomic(sig_path, sign_bytes(payload, key.private_key))
    return path, sig_path
