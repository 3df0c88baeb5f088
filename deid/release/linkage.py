"""The private linkage record: which sources went into which released record, encrypted for the steward.

Audits and erasure requests need to trace a released face back to the source images averaged
into it; the release and the report must never allow that. The mapping is therefore written
only under ``data/private/<release_id>/linkage.bin``, encrypted with AES-256-GCM to a symmetric
key file the steward holds. GCM authenticates as well as encrypts, so a wrong key and any
modified byte are both detected (and reported as :class:`~deid.errors.VerificationError`).

File layout (``linkage.bin``)::

    b"DEIDLNK1"          8-byte magic (also the GCM associated data)
    nonce                12 random bytes
    ciphertext + tag     AES-256-GCM of the UTF-8 JSON payload

The JSON payload is ``{"format": "deid-linkage-v1", "release_id": ..., "records": [...], "seed": ...}``;
``seed`` is the release's random state (:class:`deid.anonymise.randomness.ReleaseSeed`: ``{"value",
"fixed"}``), kept here only, so the steward can reproduce a random method's release and no one else
can (records written before it was kept have none).
"""
from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import logging
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from deid.errors import ConfigError, StateError, VerificationError
from deid.release.keyfiles import check_private_key_file

logger = logging.getLogger(__name__)

__all__ = [
    "LINKAGE_COLUMNS",
    "build_linkage",
    "ensure_linkage_key",
    "generate_linkage_key",
    "linkage_path",
    "linkage_table",
    "linkage_to_csv",
    "load_linkage_key",
    "read_linkage",
    "read_linkage_seed",
    "sources_from_ingested",
    "write_linkage",
]

MAGIC = b"DEIDLNK1"
FORMAT = "deid-linkage-v1"
KEY_BYTES = 32
NONCE_BYTES = 12
LINKAGE_NAME = "linkage.bin"
DEV_KEY_NAME = "dev_linkage.key"
COUNTERFEIT_PREFIX = "counterfeit-"  # staging id of a lineage counterfeit record (deid.operations.worker_lineage.counterfeit_rows)
# Column order of the CSV export; records may carry more keys, which follow in sorted order.
LINKAGE_COLUMNS = (
    "released_record_id", "released_image", "cluster_id", "source_record_id", "subject_id", "source_image",
    "internal_cluster",
)


def linkage_path(data_dir: Path, release_id: str) -> Path:
    """``<data_dir>/private/<release_id>/linkage.bin`` (outside releases/ and reports/)."""
    if not release_id or "/" in release_id or release_id in {".", ".."}:
        raise ConfigError(f"release_id={release_id!r} must be a plain directory name such as 'rel-0123abcd'")
    return Path(data_dir) / "private" / release_id / LINKAGE_NAME


def _write_new_file(path: Path, data, mode: int = 0o600) -> None:
    """Write ``data`` (bytes, or an iterable of bytes chunks) to a new file ``path``, then fsync."""
    # O_EXCL: a linkage record or key is never silently replaced.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise ConfigError(f"refusing to overwrite existing file {path}; move it away first or choose another path") from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fd = -1
            for chunk in ([data] if isinstance(data, (bytes, bytearray)) else data):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        if fd != -1:
            os.close(fd)
        path.unlink(missing_ok=True)
        raise


def _private_dir(path: Path) -> None:
    if not path.exists():
        path.mkdir(parents=True, mode=0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask


def generate_linkage_key(path: Path) -> Path:
    """Write a fresh 32-byte AES-256 key to ``path`` (base64 text, mode 0600); never overwrites."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise ConfigError(f"refusing to overwrite existing key file {path}; choose another --out or move the old key away")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = AESGCM.generate_key(bit_length=KEY_BYTES * 8)
    _write_new_file(path, base64.b64encode(key) + b"\n", 0o600)
    logger.info("wrote linkage key %s", path)
    return path


def load_linkage_key(path: Path) -> bytes:
    """Read a linkage key file (base64 text or 32 raw bytes), refusing one that group or others may access."""
    path = Path(path)
    check_private_key_file(
        path,
        kind="linkage",
        create_hint=f"create one with `deid linkage-keygen --out {path}`",
        regular_hint="pass the key file written by deid linkage-keygen",
    )
    data = path.read_bytes()
    if len(data) == KEY_BYTES:
        return data
    try:
        key = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(
            f"linkage key file {path} does not hold a {KEY_BYTES}-byte key (base64 text or raw bytes); "
            "create one with deid linkage-keygen"
        )
    return key


def ensure_linkage_key(*, configured: Path | None, keys_dir: Path) -> tuple[bytes, Path, str]:
    """(key, path, origin): the configured key, or the development key ``keys_dir/dev_linkage.key`` (created once)."""
    if configured is not None:
        path = Path(configured).expanduser()
        return load_linkage_key(path), path, "configured"
    keys_dir = Path(keys_dir)
    _private_dir(keys_dir)
    path = keys_dir / DEV_KEY_NAME
    if not path.exists():
        generate_linkage_key(path)
        logger.warning(
            "no linkage key configured: created development key %s; the steward must keep it to read linkage records",
            path,
        )
    return load_linkage_key(path), path, "development"


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else type(key).__name__
        raise ConfigError(f"linkage key must be {KEY_BYTES} bytes (AES-256), got {got}; load it with load_linkage_key")
    return bytes(key)


def write_linkage(path: Path, mapping, key: bytes, *, release_id: str | None = None, seed=None) -> Path:
    """Encrypt ``mapping`` with AES-256-GCM to ``path`` (mode 0600, never overwritten).

    ``seed``: the release's :class:`~deid.anonymise.randomness.ReleaseSeed` (its value is kept here
    and nowhere else; :func:`read_linkage_seed`), or None.

    ``mapping``: JSON-serialisable dicts, or a table of them (:func:`linkage_table`; a null
    ``counterfeit`` is left out of its record). The payload is encoded and encrypted a batch of
    records at a time (issue 13: a million records' JSON is ~300 MB); the bytes are those of one
    ``json.dumps`` of the whole payload and one ``AESGCM.encrypt``.
    """
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes  # noqa: PLC0415

    key = _check_key(key)
    path = Path(path)
    dumps = {"sort_keys": True, "separators": (",", ":"), "ensure_ascii": False, "allow_nan": False}
    nonce = secrets.token_bytes(NONCE_BYTES)
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(MAGIC)
    # json.dumps with sort_keys writes "format", "records", "release_id" in that order.
    head = json.dumps({"format": FORMAT, "records": []}, **dumps)[:-2]
    tail = "]," + json.dumps({"release_id": release_id,
                              **({"seed": seed.to_linkage()} if seed is not None else {})}, **dumps)[1:]

    def chunks():
        yield MAGIC + nonce
        yield enc.update(head.encode("utf-8"))
        first = True
        for batch in _record_batches(mapping):
            if batch:
                yield enc.update((("" if first else ",") + ",".join(json.dumps(r, **dumps) for r in batch)).encode())
                first = False
        yield enc.update(tail.encode("utf-8")) + enc.finalize()
        yield enc.tag

    _private_dir(path.parent)
    _write_new_file(path, chunks(), 0o600)
    logger.info("wrote encrypted linkage record %s (%d records)", path, len(mapping))
    return path


def _record_batches(mapping, size: int = 8192):
    """The linkage records a batch at a time (dicts; a table's null ``counterfeit`` left out)."""
    import pyarrow as pa  # noqa: PLC0415

    if not isinstance(mapping, pa.Table):
        yield list(mapping)
        return
    for b in mapping.to_batches(max_chunksize=size):
        rows = b.to_pylist()
        for r in rows:
            if r.get("counterfeit", 0) is None:
                del r["counterfeit"]
        yield rows


def read_linkage(path: Path, key: bytes) -> list[dict[str, Any]]:
    """Decrypt a linkage record; :class:`~deid.errors.VerificationError` on a wrong key or any modified byte."""
    return _read_payload(path, key)["records"]


def read_linkage_seed(path: Path, key: bytes) -> dict[str, Any] | None:
    """The release's seed ``{"value": int, "fixed": bool}`` from its linkage record (None: not kept)."""
    return _read_payload(path, key).get("seed")


def _read_payload(path: Path, key: bytes) -> dict[str, Any]:
    key = _check_key(key)
    path = Path(path)
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"linkage record {path} does not exist; was the release published by this project?") from None
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + NONCE_BYTES + 16:
        raise VerificationError(f"{path} is not a deid linkage record (bad header or truncated)")
    nonce = blob[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    try:
        payload = AESGCM(key).decrypt(nonce, blob[len(MAGIC) + NONCE_BYTES:], MAGIC)
    except InvalidTag:
        raise VerificationError(
            f"cannot decrypt linkage record {path}: wrong key, or the file was modified"
        ) from None
    doc = json.loads(payload.decode("utf-8"))
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("records"), list):
        raise VerificationError(f"linkage record {path} decrypted but is not in format {FORMAT}")
    return doc


def build_linkage(
    staged_mapping: Iterable[Mapping[str, Any]], sources: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Join publish's mapping with the staging source of each record into linkage rows.

    ``staged_mapping`` is :attr:`deid.release.publish.StagedRelease.mapping`; ``sources`` maps a staging
    record_id to ``{"subject_id", "image"}`` (e.g. from ``ingested.parquet``, see
    :func:`sources_from_ingested`). Rows are sorted by released record id. A counterfeit record
    of a republished lineage cluster (staging id starting with ``counterfeit-``) has no source:
    its row says ``counterfeit: true`` (the release itself does not mark it).
    """
    if hasattr(staged_mapping, "to_pylist"):  # stage_release's table
        staged_mapping = staged_mapping.to_pylist()
    rows = []
    for m in staged_mapping:
        src = sources.get(m["record_id"])
        if src is None and str(m["record_id"]).startswith(COUNTERFEIT_PREFIX):
            src = {"subject_id": None, "image": None, "counterfeit": True}
        if src is None:
            raise StateError(f"released record {m['record_id']!r} has no source row in this run's staging; "
                             "the staged release and the ingested table disagree: re-run the release")
        rows.append({
            "released_record_id": m["released_record_id"],
            "released_image": m["image"],
            "cluster_id": m["cluster_id"],
            "source_record_id": m["record_id"],
            "subject_id": src["subject_id"],
            "source_image": src["image"],
            "internal_cluster": m["cluster"],
            **({"counterfeit": True} if src.get("counterfeit") else {}),
        })
    return sorted(rows, key=lambda r: (r["released_record_id"], r["source_record_id"]))


def linkage_table(mapping, metadata):
    """:func:`build_linkage` as Arrow: ``mapping`` (:attr:`deid.release.publish.StagedRelease.mapping`) joined
    with the ingested table's ``record_id``, ``subject_id`` and ``image``; sorted by released record id.

    The same records as ``build_linkage(mapping, sources_from_ingested(metadata))``, as columns
    (issue 13: a million records' dicts held ~1 GB); a null ``counterfeit`` means "not one".
    """
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    src = metadata.select(["record_id", "subject_id", "image"]).rename_columns(
        ["source_record_id", "subject_id", "source_image"])
    m = mapping.rename_columns(["source_record_id", "released_record_id", "released_image", "internal_cluster",
                                "cluster_id"])
    t = m.join(src, "source_record_id", join_type="left outer")
    missing = pc.is_null(t.column("source_image"))
    counterfeit = pc.and_(missing, pc.starts_with(t.column("source_record_id"), COUNTERFEIT_PREFIX))
    orphan = pc.and_(missing, pc.invert(counterfeit))
    if pc.any(orphan).as_py():
        rid = t.column("source_record_id").filter(orphan)[0].as_py()
        raise StateError(f"released record {rid!r} has no source row in this run's staging; "
                         "the staged release and the ingested table disagree: re-run the release")
    t = t.append_column("counterfeit", pc.if_else(counterfeit, True, pa.scalar(None, pa.bool_())))
    return t.select([*LINKAGE_COLUMNS, "counterfeit"]).sort_by([("released_record_id", "ascending"),
                                                                ("source_record_id", "ascending")])


def sources_from_ingested(ingested) -> dict[str, dict[str, Any]]:
    """staging record_id -> {subject_id, image} from ``ingested.parquet`` (pixels are not read), or from
    its table already read (:attr:`deid.contracts.Ingested.metadata`)."""
    if isinstance(ingested, (str, Path)):
        import pyarrow.parquet as pq  # noqa: PLC0415 - only the flow needs it

        ingested = pq.read_table(ingested, columns=["record_id", "subject_id", "image"])
    table = ingested.select(["record_id", "subject_id", "image"])
    return {r["record_id"]: {"subject_id": r["subject_id"], "image": r["image"]} for r in table.to_pylist()}


def linkage_to_csv(records: list[dict[str, Any]]) -> str:
    """The records as CSV text (known columns first, any others after, sorted)."""
    extra = sorted({k for r in records for k in r} - set(LINKAGE_COLUMNS))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[*LINKAGE_COLUMNS, *extra], lineterminator="\n")
    writer.writeheader()
    for r in records:
        writer.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return out.getvalue()
