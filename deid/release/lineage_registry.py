"""The steward's lineage registry of a dataset: encrypted, append-only, hash-chained, crash-safe.

Layout under ``<data_dir>/private/lineage/<dataset>/`` (directory mode 0700, files 0600)::

    00000000.entry      genesis (dataset name, format)
    00000001.entry      one entry per event: a release (its clusters), published, abandoned
    ...
    HEAD                the last entry's sequence number and chain hash
    images/<id>.pack    the stored averages of one release's new clusters, sealed one by one

Each entry file is ``b"DEIDLIN1" + nonce(12) + AES-256-GCM(payload)`` with associated data
``magic + dataset + seq`` (so an entry moved to another name or dataset does not decrypt). The
payload is the canonical JSON of the entry document, which carries ``seq`` and ``prev`` (the
previous entry's chain hash). The chain hash of an entry is
``sha256(bytes.fromhex(prev) + canonical_entry_bytes)``; the genesis entry's ``prev`` is 32 zero
bytes. HEAD is encrypted the same way and names the last entry, so a deleted tail is detected.

Stored averages (issue 13: a million faces register 200,000 of them, 1.5 GB) are not inside the
entries: :meth:`Registry.append_release` seals each one (``b"DEIDLIM1"``-headed pack file, one
``nonce(12) + AES-256-GCM(average bytes)`` record per cluster, associated data binding dataset,
pack id, offset and the average's SHA-256) into a pack written a record at a time and fsynced before the
entry, and the entry records for each cluster ``image_at`` (pack, offset, length) next to
``image_sha256``, so the hash chain covers every average (a colour release's clusters also have their
BGR average sealed right after the grey one, ``color_at`` next to ``color_sha256``). Loading leaves them there: a cluster's
average is read, authenticated and checked against its hash only when asked
(:class:`deid.release.lineage_state.StoredImage`). Registries written before kept the averages inline
(base64 in the entry) and still load. A pack whose entry was never appended (a crash, a concurrent
writer) is an orphan nothing refers to.

Keys: the registry's AES key and HEAD key are derived from the steward's 32-byte key (the
linkage key, :func:`deid.release.linkage.ensure_linkage_key`) by HKDF-SHA256 per purpose and dataset
(:func:`deid.release.lineage_state.derive_key`); the same derivation gives the pseudonym key. A separate key
file with the same format works as well: pass its bytes instead.

Lifecycle of a release: :meth:`Registry.append_release` after the gate passed and *before* the
release directory is committed (status ``pending``); :meth:`Registry.mark_published` once the
release is published and its report signed; :meth:`Registry.mark_abandoned` if publishing failed.
A pending release constrains later plans like a published one, so a crash between publishing and
registering can never let the next run re-cluster people already released; at the start of a run,
:meth:`Registry.reconcile` settles what an interrupted run left pending.

Crash safety: an entry is written to a temporary file, fsynced, then hard-linked to its final
name (which fails if the name exists: two writers cannot both append entry n) and the directory
fsynced; HEAD is then replaced the same way. A crash before the link leaves only a temporary file
(ignored and removed by the next append); a crash between the link and HEAD leaves HEAD one entry
behind, which :meth:`Registry.load` accepts when that entry chains correctly, and the next append
rewrites HEAD. What is *not* detectable locally: the whole directory deleted, or HEAD and the
tail both rolled back to an earlier copy. The signed report should therefore carry the head the
release was planned on (``LineagePlan.based_on_head``), which anchors the chain publicly.

With ``DEID_DATABASE_URL`` (runs of one dataset on several machines) the same sealed entries and
HEAD are rows of PostgreSQL instead of files (:mod:`deid.release.lineage_postgres`): the store is
the only part that changes; encryption, chaining and verification stay here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from deid.errors import ConfigError
from deid.intake.drop import check_dataset_name
from deid.release.lineage import LineageRelease
from deid.release.lineage_state import (ENTRY_FORMAT, GENESIS_PREV, LineageError, LineageState, StoredImage, as_stored,
                                        canonical_bytes, chain_hash, derive_key, replay)

logger = logging.getLogger(__name__)

__all__ = ["FileStore", "Registry", "SealedImages", "lineage_dir"]

MAGIC = b"DEIDLIN1"
HEAD_MAGIC = b"DEIDLHD1"
PACK_MAGIC = b"DEIDLIM1"
IMAGES_DIR = "images"
NONCE_BYTES = 12
HEAD_NAME = "HEAD"
SUFFIX = ".entry"


def lineage_dir(data_dir: Path, dataset: str) -> Path:
    """``<data_dir>/private/lineage/<dataset>`` (never inside releases/ or reports/)."""
    return Path(data_dir) / "private" / "lineage" / check_dataset_name(dataset)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_pack(pack: str) -> str:
    if not (isinstance(pack, str) and 0 < len(pack) <= 64 and all(c in "0123456789abcdef" for c in pack)):
        raise LineageError(f"lineage registry: stored-average pack id {pack!r} is not hex; the registry is corrupt")
    return pack


class SealedImages:
    """Reads the averages a registry sealed beside its entries (the source of their
    :class:`~deid.release.lineage_state.StoredImage`): authenticated, and checked against their SHA-256.

    Holds the registry's location and key only (picklable); the store is opened when first read.
    """

    def __init__(self, registry: "Registry"):
        self.root, self.dataset, self.key, self.database_url = (registry.root, registry.dataset, registry.key,
                                                                registry.database_url)
        self._registry: Registry | None = registry

    def __getstate__(self):
        return {"root": self.root, "dataset": self.dataset, "key": self.key, "database_url": self.database_url}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._registry = None

    @property
    def registry(self) -> "Registry":
        if self._registry is None:
            self._registry = Registry(self.root, self.dataset, self.key, self.database_url)
        return self._registry

    def read_image(self, at: tuple[str, int, int, str]) -> bytes:
        return self.read_images([at])[0]

    def read_images(self, ats: list[tuple[str, int, int, str]]) -> list[bytes]:
        """The averages at ``ats`` ((pack, offset, length, sha256) each), a pack's at once."""
        reg = self.registry
        out: list[bytes | None] = [None] * len(ats)
        by_pack: dict[str, list[int]] = {}
        for n, at in enumerate(ats):
            by_pack.setdefault(at[0], []).append(n)
        for pack, ns in by_pack.items():
            blobs = reg.store.read_images(pack, [(int(ats[n][1]), int(ats[n][2])) for n in ns])
            for n, blob in zip(ns, blobs):
                pack_, offset, _, sha = ats[n]
                raw = reg._open_image(pack_, int(offset), sha, blob)
                if hashlib.sha256(raw).hexdigest() != sha:
                    raise LineageError(f"lineage registry {reg.where}: a stored average does not match its hash; "
                                       "the registry is corrupt; restore it from backup")
                out[n] = raw
        return out  # type: ignore[return-value]


def _write_temp(directory: Path, name: str, data: bytes) -> Path:
    tmp = directory / f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


class FileStore:
    """The registry's entries as files under ``root`` (the default store; see the module docstring)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def describe(self) -> str:
        return str(self.root)

    def _entry_files(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.root.iterdir():
            if p.name.endswith(SUFFIX) and not p.name.startswith("."):
                stem = p.name[:-len(SUFFIX)]
                if not (stem.isdigit() and len(stem) == 8):
                    raise LineageError(f"lineage registry {self.root}: unexpected file {p.name}; the registry was "
                                       "modified; restore it from backup")
                out.append((int(stem), p))
        return sorted(out)

    def exists(self) -> bool:
        return (self.root / HEAD_NAME).exists() or (self.root.is_dir() and bool(self._entry_files()))

    def count(self) -> int:
        """Entry files present (not decrypted)."""
        return len(self._entry_files()) if self.root.is_dir() else 0

    def read(self) -> tuple[list[tuple[int, bytes]], bytes | None]:
        """(seq, sealed entry) of every entry file, by name; the sealed HEAD or None."""
        if not self.root.is_dir():
            return [], None
        entries = [(seq, path.read_bytes()) for seq, path in self._entry_files()]
        head = self.root / HEAD_NAME
        return entries, head.read_bytes() if head.is_file() else None

    def _mkdir(self, path: Path) -> None:
        if not path.exists():
            path.mkdir(parents=True, mode=0o700)
            os.chmod(path, 0o700)

    def write_pack(self, pack: str, records: Iterable[bytes]) -> list[tuple[int, int]]:
        """Write the sealed ``records`` into ``images/<pack>.pack`` a record at a time, fsynced; their (offset, length)."""
        self._mkdir(self.root)
        self._mkdir(self.root / IMAGES_DIR)
        final = self.root / IMAGES_DIR / f"{_check_pack(pack)}.pack"
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(6)}.tmp")
        at: list[tuple[int, int]] = []
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(PACK_MAGIC)
                offset = len(PACK_MAGIC)
                for blob in records:
                    fh.write(blob)
                    at.append((offset, len(blob)))
                    offset += len(blob)
                fh.flush()
                os.fsync(fh.fileno())
            os.link(tmp, final)   # a pack id is random: an existing name is never overwritten
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(final.parent)
        return at

    def read_images(self, pack: str, at: list[tuple[int, int]]) -> list[bytes]:
        """The sealed records of ``pack`` at (offset, length) each (one open file)."""
        path = self.root / IMAGES_DIR / f"{_check_pack(pack)}.pack"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise LineageError(f"lineage registry {self.root}: stored averages {path.name} are missing; the registry "
                               "was modified or copied without its images/ directory; restore it from backup") from None
        try:
            return [os.pread(fd, length, offset) for offset, length in at]
        finally:
            os.close(fd)

    def packs(self) -> list[str]:
        """Ids of the pack files present."""
        d = self.root / IMAGES_DIR
        return sorted(p.name[:-len(".pack")] for p in d.glob("*.pack")) if d.is_dir() else []

    def append(self, seq: int, entry: bytes, head: bytes) -> None:
        """Write entry ``seq`` (refused if it exists: two writers cannot both append it), then HEAD."""
        self._mkdir(self.root)
        for tmp in self.root.glob(".*.tmp"):  # leftovers of an interrupted append: never part of the chain
            tmp.unlink(missing_ok=True)
        final = self.root / f"{seq:08d}{SUFFIX}"
        tmp = _write_temp(self.root, final.name, entry)
        try:
            os.link(tmp, final)  # fails if the name exists: a concurrent append wins, this one is refused
        except FileExistsError:
            raise LineageError(f"lineage registry {self.root}: entry {seq:08d} was written concurrently; "
                               "reload and plan again") from None
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.root)
        tmp = _write_temp(self.root, HEAD_NAME, head)
        os.replace(tmp, self.root / HEAD_NAME)
        _fsync_dir(self.root)


@dataclass(frozen=True)
class Registry:
    """The lineage registry of one dataset under ``root`` (see the module docstring).

    Parameters
    ----------
    root : Path
        ``lineage_dir(data_dir, dataset)``.
    dataset : str
    key : bytes
        The steward's 32-byte key (the linkage key); per-purpose keys are derived from it.
    database_url : str, optional
        ``DEID_DATABASE_URL``: the sealed entries live in PostgreSQL instead of under ``root``
        (:mod:`deid.release.lineage_postgres`), for runs of one dataset on several machines. A file
        registry already under ``root`` is imported into the database by the first :meth:`load`.
    """

    root: Path
    dataset: str
    key: bytes
    database_url: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, data_dir: Path, dataset: str, key: bytes, *, database_url: str | None = None) -> "Registry":
        return cls(lineage_dir(data_dir, dataset), check_dataset_name(dataset), key, database_url or None)

    @cached_property
    def store(self):
        """Where the sealed entries are: :class:`FileStore` or the PostgreSQL store."""
        if self.database_url:
            from deid.release.lineage_postgres import PostgresStore  # noqa: PLC0415 - only when configured

            return PostgresStore(self.database_url, self.dataset)
        return FileStore(self.root)

    @property
    def where(self) -> str:
        """The registry's location for messages (a path, or the database URL without its password)."""
        return self.store.describe()

    # ------------------------------------------------------------------ encryption

    def _aad(self, magic: bytes, seq: int) -> bytes:
        return magic + self.dataset.encode() + b"\0" + seq.to_bytes(8, "big")

    def _seal(self, magic: bytes, purpose: str, seq: int, payload: bytes | list[bytes]) -> bytearray:
        """``magic + nonce + AESGCM(key).encrypt(nonce, payload, aad)``, the same bytes, built in one buffer.

        The one-shot form held the payload, its ciphertext and their concatenation at once: one
        entry-sized copy more (a release entry is ~300 MB at a million faces; issue 13). GCM's streaming
        encryptor writes the ciphertext straight after the header, then the tag. ``payload`` in pieces
        (:func:`~deid.release.lineage_state.canonical_pieces`, the list emptied as they are sealed): each
        piece is let go once encrypted, so the plaintext and the ciphertext are never both whole (issue 32).
        """
        nonce = secrets.token_bytes(NONCE_BYTES)
        enc = Cipher(algorithms.AES(derive_key(self.key, self.dataset, purpose)), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(self._aad(magic, seq))
        if isinstance(payload, list):
            sealed = bytearray(magic + nonce)
            payload.reverse()  # popped from the end: the first piece first
            while payload:
                sealed += enc.update(payload.pop())
            sealed += enc.finalize()
            sealed += enc.tag
            return sealed
        start = len(magic) + NONCE_BYTES
        out = bytearray(start + len(payload) + 15 + 16)  # update_into wants a block's slack beyond the data
        out[:start] = magic + nonce
        with memoryview(out) as view:
            end = start + enc.update_into(payload, view[start:start + len(payload) + 15])
        tail = enc.finalize()  # GCM is a stream mode: nothing is held back, but keep what it returns
        out[end:end + len(tail) + 16] = tail + enc.tag
        del out[end + len(tail) + 16:]
        return out

    def _open(self, magic: bytes, purpose: str, seq: int, blob: bytes, what: str) -> bytes:
        if not blob.startswith(magic) or len(blob) < len(magic) + NONCE_BYTES + 16:
            raise LineageError(f"lineage registry {self.where}: {what} is not a deid lineage file (bad header or "
                               "truncated); the registry was modified; restore it from backup")
        nonce = blob[len(magic):len(magic) + NONCE_BYTES]
        try:
            return AESGCM(derive_key(self.key, self.dataset, purpose)).decrypt(
                nonce, blob[len(magic) + NONCE_BYTES:], self._aad(magic, seq))
        except InvalidTag:
            raise LineageError(
                f"lineage registry {self.where}: {what} does not authenticate: wrong key, a modified byte, or an entry "
                "moved or reordered; refusing to use the registry (restore it from backup, or pass the steward's key)"
            ) from None

    def _image_aad(self, pack: str, offset: int, sha: str) -> bytes:
        return (PACK_MAGIC + self.dataset.encode() + b"\0" + pack.encode() + b"\0" + offset.to_bytes(8, "big")
                + bytes.fromhex(sha))

    def _open_image(self, pack: str, offset: int, sha: str, blob: bytes) -> bytes:
        try:
            return AESGCM(derive_key(self.key, self.dataset, "encrypt")).decrypt(
                blob[:NONCE_BYTES], blob[NONCE_BYTES:], self._image_aad(pack, offset, sha))
        except (InvalidTag, ValueError):
            raise LineageError(f"lineage registry {self.where}: a stored average (pack {pack}) does not authenticate: "
                               "wrong key, a modified byte or a moved record; restore the registry from backup") from None

    @cached_property
    def images(self) -> SealedImages:
        """The reader of the averages sealed beside the entries (what loaded clusters read on demand)."""
        return SealedImages(self)

    def _store_images(self, release: LineageRelease) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """Seal the new clusters' averages into one pack, a record at a time (never all in memory): cluster key ->
        ``image_at``, and for a colour release cluster key -> ``color_at`` (each colour average sealed right after
        its grey one, the same way). Each average is checked against its hash as it is sealed."""
        pack = secrets.token_hex(16)
        aes = AESGCM(derive_key(self.key, self.dataset, "encrypt"))
        offset = [len(PACK_MAGIC)]
        order: list[tuple[str, str]] = []   # (cluster key, "image" | "color") of each record, in pack order

        def seal(c, what: str, average: Any, want: str | None) -> bytes:
            raw = as_stored(np.asarray(average)).tobytes()
            sha = hashlib.sha256(raw).hexdigest()
            if sha != want:
                raise LineageError(f"new cluster {c.key}: its {'colour ' if what == 'color' else ''}average changed "
                                   "since it was released (hash mismatch); run the release again")
            nonce = secrets.token_bytes(NONCE_BYTES)
            blob = nonce + aes.encrypt(nonce, raw, self._image_aad(pack, offset[0], sha))
            offset[0] += len(blob)
            order.append((c.key, what))
            return blob

        def records() -> Iterator[bytes]:
            for c in release.new_clusters:
                yield seal(c, "image", c.image, c.image_sha256)
                if c.color is not None:
                    yield seal(c, "color", c.color, c.color_sha256)

        at = self.store.write_pack(pack, records())
        out: dict[str, dict[str, dict[str, Any]]] = {"image": {}, "color": {}}
        for (key, what), (o, n) in zip(order, at):
            out[what][key] = {"pack": pack, "offset": o, "length": n}
        return out["image"], out["color"]

    # ------------------------------------------------------------------ reading

    def exists(self) -> bool:
        if self.database_url and not self.store.exists():
            return FileStore(self.root).exists()  # not imported yet: the first load() does
        return self.store.exists()

    def _read_head(self, blob: bytes | None) -> tuple[int, str]:
        if blob is None:
            raise LineageError(f"lineage registry {self.where}: HEAD is missing while entries exist; the registry was "
                               "modified or truncated; restore it from backup")
        doc = json.loads(self._open(HEAD_MAGIC, "head", 0, blob, "HEAD"))
        if doc.get("dataset") != self.dataset:
            raise LineageError(f"lineage registry {self.where}: HEAD belongs to dataset {doc.get('dataset')!r}")
        return int(doc["seq"]), str(doc["hash"])

    def _head_blob(self, seq: int, digest: str) -> bytes:
        payload = canonical_bytes({"dataset": self.dataset, "seq": seq, "hash": digest})
        return self._seal(HEAD_MAGIC, "head", 0, payload)

    def load(self) -> LineageState:
        """Decrypt and verify the whole chain; the state of an empty (absent) registry is empty.

        Raises
        ------
        LineageError
            Wrong key, a modified byte, a missing, extra, reordered or moved entry, or a deleted tail.
        """
        if self.database_url:
            self._sync_files_to_database()
        files, head_blob = self.store.read()
        if not files and head_blob is None:
            return replay(self.dataset, [], seq=-1, head=GENESIS_PREV, images=self.images)
        docs: list[dict[str, Any]] = []
        hashes: list[str] = []  # the chain hash after each entry
        prev = GENESIS_PREV
        for expect, (seq, blob) in enumerate(files):
            if seq != expect:
                raise LineageError(f"lineage registry {self.where}: entry {expect:08d} is missing (next is {seq:08d}); "
                                   "an entry was deleted; restore the registry from backup")
            payload = self._open(MAGIC, "encrypt", seq, blob, f"entry {seq:08d}")
            doc = json.loads(payload)
            if doc.get("seq") != seq or doc.get("prev") != prev or doc.get("dataset") != self.dataset:
                raise LineageError(f"lineage registry {self.where}: entry {seq:08d} does not chain to the previous "
                                   "entry (entries reordered or replaced); restore the registry from backup")
            if doc.get("format") != ENTRY_FORMAT:
                raise LineageError(f"lineage registry {self.where}: entry {seq:08d} has format {doc.get('format')!r}, "
                                   f"expected {ENTRY_FORMAT}")
            # The sealed bytes are the canonical bytes the chain hashed when the entry was written: hashed as
            # they are (not serialised again: a million faces' entry is hundreds of MB).
            prev = chain_hash(prev, payload)
            del payload
            docs.append(doc)
            hashes.append(prev)
        head_seq, head_hash = self._read_head(head_blob)
        last = len(docs) - 1
        if head_seq > last:
            raise LineageError(f"lineage registry {self.where}: HEAD names entry {head_seq:08d} but the last entry is "
                               f"{last:08d}; entries were deleted; restore the registry from backup")
        if head_seq < last - 1 or hashes[head_seq] != head_hash:
            raise LineageError(f"lineage registry {self.where}: HEAD (entry {head_seq:08d}) does not match the chain; "
                               "the registry was modified; restore it from backup")
        if head_seq == last - 1:
            logger.warning("lineage registry %s: HEAD one entry behind (interrupted append); entry %08d kept",
                           self.where, last)
        if not docs or docs[0].get("kind") != "genesis":
            raise LineageError(f"lineage registry {self.where}: the first entry is not a genesis entry")
        return replay(self.dataset, docs, seq=last, head=prev, images=self.images)

    def _sync_files_to_database(self) -> None:
        """A file registry of the dataset (made before ``DEID_DATABASE_URL`` was set) goes into the database once.

        Verified first; imported in one transaction only while the database holds no entry of the
        dataset. A file registry with more entries than the database means runs were made without
        the database since: refused (the two would fork the lineage).
        """
        files = FileStore(self.root)
        n_files = files.count()
        if not n_files:
            return
        n_db = self.store.count()
        if n_db >= n_files:
            return
        if n_db:
            raise LineageError(
                f"lineage registry of {self.dataset!r}: the files under {self.root} have {n_files} entries but the "
                f"database {self.where} has {n_db}: runs were made without DEID_DATABASE_URL since the import; "
                "the lineage has forked; keep one (move the other away) and run again")
        state = Registry(self.root, self.dataset, self.key).load()  # verified before it is trusted
        ats: dict[str, list[tuple[int, int]]] = {}
        for d in state.entries:
            for cj in d.get("new_clusters", ()) if d.get("kind") == "release" else ():
                for where in ("image_at", "color_at"):   # a colour release's colour averages too
                    if where in cj:
                        ats.setdefault(cj[where]["pack"], []).append((int(cj[where]["offset"]),
                                                                      int(cj[where]["length"])))
        for pack, at in ats.items():   # the stored averages first: an imported entry never lacks its averages
            self.store.import_pack(pack, [(o, b) for (o, _), b in zip(at, files.read_images(pack, at))])
        blobs = files.read()[0]
        self.store.import_entries(blobs, self._head_blob(state.seq, state.head))
        logger.warning("lineage registry of %s: %d entries imported from %s into %s; the files are no longer used",
                       self.dataset, len(blobs), self.root, self.where)

    # ------------------------------------------------------------------ writing

    def _unchanged_since(self, state: LineageState) -> bool:
        """True when the file store still ends at ``state``'s entry: its HEAD (authenticated) names the
        state's entry and chain hash, and no entry follows. Then ``state``, verified when it was
        loaded, is the registry's state without decrypting and replaying every entry again."""
        if not isinstance(self.store, FileStore) or not state.entries or self.store.count() != state.seq + 1:
            return False
        head = self.store.root / HEAD_NAME
        try:
            return self._read_head(head.read_bytes()) == (state.seq, state.head)
        except (OSError, LineageError):
            return False

    def _append(self, state: LineageState, body: dict[str, Any], *,
                made: dict[str, Any] | None = None) -> LineageState:
        current = state if self._unchanged_since(state) else self.load()
        if current.head != state.head:
            raise LineageError(f"lineage registry {self.where} moved on (entry {current.seq}) since the state used "
                               f"here (entry {state.seq}) was loaded; reload and plan again")
        if not current.entries and body.get("kind") != "genesis":
            raise LineageError(f"lineage registry {self.where} has no genesis entry; call init() first")
        if current.images is None:
            current = dataclasses.replace(current, images=self.images)   # a state built without the registry
        new, payload = current._appended(body, made=made)
        seq, new_hash = new.seq, new.head
        # The store appends entry `seq` only if it is the next one (a file that does not exist yet; a row
        # after the last, in one serializable transaction): two writers never both append it.
        self.store.append(seq, self._seal(MAGIC, "encrypt", seq, payload), self._head_blob(seq, new_hash))
        logger.info("lineage %s: appended entry %08d (%s)", self.dataset, seq, body.get("kind"))
        return new

    def init(self) -> LineageState:
        """Create the registry with its genesis entry (no-op when it exists); returns the state."""
        state = self.load()
        if state.entries:
            return state
        return self._append(state, {"kind": "genesis"})

    def append_release(self, state: LineageState, release: LineageRelease) -> LineageState:
        """Register a release (status pending until :meth:`mark_published`).

        ``state`` must be the state the release was planned on (``release.based_on_head``).
        """
        if release.dataset != self.dataset:
            raise ConfigError(f"release of dataset {release.dataset!r} cannot go into the registry of {self.dataset!r}")
        if not state.entries and release.based_on_head == GENESIS_PREV:
            state = self.init()  # planned on the empty lineage: the genesis entry comes first
            if len(state.entries) > 1:
                # Another run registered first (two first drops of a dataset at once): this release was
                # planned without its clusters and must be planned again, like any later release.
                raise LineageError(f"lineage registry {self.where} moved on (entry {state.seq}) since release "
                                   f"{release.release_id} was planned on the empty lineage; reload and plan again")
        elif release.based_on_head != state.head:
            raise LineageError(f"release {release.release_id} was planned on another lineage state (entry "
                               f"{release.based_on_seq}); the registry is at entry {state.seq}; plan again")
        if any(r.release_id == release.release_id for r in state.releases):
            raise LineageError(f"release {release.release_id} is already registered in {self.dataset!r}")
        # The averages go beside the entry, sealed and fsynced before it (issue 13): the entry holds their hashes.
        image_at, color_at = self._store_images(release)
        # The registered clusters are the release's, reading their averages from the registry from now on.
        made = {c.key: dataclasses.replace(c, image=StoredImage(
                    self.images, (at["pack"], at["offset"], at["length"], c.image_sha256), sha256=c.image_sha256,
                    size=c.image.shape[0], dtype=np.dtype(c.image.dtype).newbyteorder("<")),
                    color=None if c.color is None else StoredImage(
                        self.images, (cat["pack"], cat["offset"], cat["length"], c.color_sha256),
                        sha256=c.color_sha256, size=c.color.shape[0]))
                for c in release.new_clusters for at, cat in ((image_at[c.key], color_at.get(c.key)),)}
        return self._append(state, release.to_entry(image_at=image_at, color_at=color_at), made=made)

    def mark_published(self, state: LineageState, release_id: str) -> LineageState:
        """Record that ``release_id`` was published (after the report is signed)."""
        return self._mark(state, release_id, "published")

    def mark_abandoned(self, state: LineageState, release_id: str) -> LineageState:
        """Record that ``release_id`` was never published: its clusters stop constraining later releases."""
        return self._mark(state, release_id, "abandoned")

    def reconcile(self, state: LineageState, is_published: Callable[[str], bool]) -> LineageState:
        """Settle releases left pending by an interrupted run: published if ``is_published(release_id)``
        (e.g. its release directory exists), else abandoned. Call at the start of a run, before planning."""
        for r in state.releases:
            if r.status == "pending":
                state = (self.mark_published if is_published(r.release_id) else self.mark_abandoned)(state, r.release_id)
        return state

    def _mark(self, state: LineageState, release_id: str, kind: str) -> LineageState:
        status = {r.release_id: r.status for r in state.releases}
        if status.get(release_id) != "pending":
            raise LineageError(f"release {release_id} of {self.dataset!r} is {status.get(release_id, 'not registered')}; "
                               f"only a pending release can be marked {kind}")
        return self._append(state, {"kind": kind, "release_id": release_id})
