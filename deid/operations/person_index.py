"""One person index per project, across datasets: the same people never start a second lineage.

The lineage (:mod:`deid.release.lineage`) keeps successive releases of *one dataset* from leaking
by differencing (m-invariance, Xiao & Tao, SIGMOD 2007). Its unit is a dataset name, so the same
people dropped under another name would start a second, independent lineage, and two releases
of overlapping clusters give faces away (``|C2| M2 - |C1| M1``; Ganta, Kasiviswanathan & Smith,
KDD 2008). This index is looked up by every run whatever its dataset name:

- every record a lineage run takes in is registered with its dataset: the keyed digest of its
  source bytes' SHA-256 (the record fingerprint) and of its normalised steward id
  (:func:`deid.anonymise.identity.normalize_subject_id`); the subject id it was listed under is
  kept sealed (AES-256-GCM) beside its fingerprint, so a re-keyed record (the same bytes under a
  new id) is recognised as that person and can be listed under the registered id again;
- a drop whose records (or, with ``DEID_CROSS_DATASET_IDS=project``, whose steward ids) are
  registered under another dataset is, by ``DEID_CROSS_DATASET``, refused naming that dataset
  (``refuse``, the default) or planned in that dataset's lineage (``route``, said in the report);
- a released face run also registers its faces' dlib descriptors (sealed with the subject id), and
  every face run searches its people the lookup did not find among them (:meth:`PersonIndex.route_faces`,
  :func:`decide_faces`) at identity resolution's calibrated threshold: other photographs of a
  registered person under a new id are that person, refused or routed as above (the claim
  withdrawn, or moved to that lineage: :meth:`PersonIndex.withdraw`, :meth:`PersonIndex.resettle`).

Identical bytes are the same person whatever the id. Steward ids are taken as project-wide only
with ``DEID_CROSS_DATASET_IDS=project``; by default (``linked``) an id counts across datasets only
towards a dataset the drop already shares a photograph with (the sites of one project often number
their participants from 1 each).

The drop's people are claimed in the same transaction as the lookup (before the run's stages), so
two concurrent runs under different names cannot both miss each other; a refused drop claims
nothing. Storage: ``<data>/private/person_index.sqlite`` (0600), or the table
``deid_person_index`` of ``DEID_DATABASE_URL`` (several machines; the same server as the run
ledger and the lineage registries). Nothing is stored in clear but dataset names: digests are
HMAC-SHA256 under a key derived (HKDF-SHA256) from the steward's linkage key, so without the key the
index cannot be joined with a manifest. A lookup is a primary-key (B-tree) probe per digest:
``O(log n)`` per record (``bench/bench_person_index.py``).

This module is the store (:class:`PersonIndex`); what a lookup decides (refuse or route, by records,
ids or faces) is :mod:`deid.operations.person_routing`, the face search :mod:`deid.operations.descriptor_search`.

References
----------
X. Xiao, Y. Tao. m-Invariance: towards privacy preserving re-publication of dynamic datasets.
SIGMOD 2007, 689-700.
S. R. Ganta, S. P. Kasiviswanathan, A. Smith. Composition attacks and auxiliary information in
data privacy. KDD 2008, 265-273.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar, overload

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from deid.anonymise.identity import normalize_subject_id
from deid.errors import ConfigError, StateError
from deid.operations.descriptor_search import DescriptorSearch
from deid.operations.person_routing import (COPY_DISTANCE, CrossDatasetRefusal, FaceMatch, FaceRouting, Matches, Routing,
                                            check_policy, decide, decide_faces)
from deid.sqlstore import PostgresStore, SQLiteStore, Tx, run_tx

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["INDEX_FILE", "PersonIndex"]

INDEX_FILE = "person_index.sqlite"
FINGERPRINT, STEWARD_ID, KEY_CHECK = "fp", "id", "key"
KEY_BYTES = 32
NONCE_BYTES = 12
_BATCH = 500  # digests per IN (...) probe: far below SQLite's and PostgreSQL's parameter limits
# HMAC-SHA256 truncated to 128 bits: a chance collision among a billion digests is ~1e-21; half the key bytes
# of the full digest, so more of the B-tree stays in the page cache.
DIGEST_BYTES = 16

_SQLITE_SCHEMA = ("CREATE TABLE IF NOT EXISTS deid_person_index (kind TEXT NOT NULL, digest BLOB NOT NULL, "
                  "dataset TEXT NOT NULL, person BLOB, PRIMARY KEY (kind, digest, dataset)) WITHOUT ROWID")
_POSTGRES_SCHEMA = ("CREATE TABLE IF NOT EXISTS deid_person_index (kind TEXT NOT NULL, digest BYTEA NOT NULL, "
                    "dataset TEXT NOT NULL, person BYTEA, PRIMARY KEY (kind, digest, dataset))")
# Face descriptors (dlib's 128-d, where a run computed them), each sealed with the subject id it was listed under.
_SQLITE_DESCRIPTORS = ("CREATE TABLE IF NOT EXISTS deid_person_descriptors (id INTEGER PRIMARY KEY, dataset TEXT NOT "
                       "NULL, sealed BLOB NOT NULL)")
_POSTGRES_DESCRIPTORS = ("CREATE TABLE IF NOT EXISTS deid_person_descriptors (id BIGSERIAL PRIMARY KEY, dataset TEXT "
                         "NOT NULL, sealed BYTEA NOT NULL)")
_INSERT = "INSERT INTO deid_person_index (kind, digest, dataset, person) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"


def _derive(key: bytes, purpose: str) -> bytes:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else type(key).__name__
        raise ConfigError(f"person index key must be {KEY_BYTES} bytes (the linkage key), got {got}; load it with "
                          "deid.release.linkage.ensure_linkage_key")
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=b"deid-person-index",
                info=f"deid-person-index-v1|{purpose}".encode()).derive(bytes(key))


# --------------------------------------------------------------------------- face descriptors (pure)


class Owners(Sequence[tuple[str, str]]):
    """(dataset, subject id) of each registered descriptor, compactly: a dataset name is held once, a row keeps its
    code (a million registered faces: one str per subject id, not a tuple and a str per dataset too)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._code: dict[str, int] = {}
        self._rows = array("i")
        self._subjects: list[str] = []

    def append(self, dataset: str, subject_id: str) -> None:
        self._rows.append(self._code.setdefault(dataset, len(self._code)))
        if len(self._code) > len(self._names):
            self._names.append(dataset)
        self._subjects.append(subject_id)

    def __len__(self) -> int:
        return len(self._subjects)

    @overload
    def __getitem__(self, i: int) -> tuple[str, str]: ...

    @overload
    def __getitem__(self, i: slice) -> list[tuple[str, str]]: ...

    def __getitem__(self, i: int | slice) -> tuple[str, str] | list[tuple[str, str]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._names[self._rows[i]], self._subjects[i]


# --------------------------------------------------------------------------- storage


class PersonIndex:
    """The project's person index (see the module docstring).

    Parameters
    ----------
    location : path or str
        A SQLite file (created 0600 with its parent), or a PostgreSQL URL (``DEID_DATABASE_URL``).
    key : bytes
        The steward's 32-byte linkage key; the digest and sealing keys are derived from it.
    """

    def __init__(self, location: str | os.PathLike, key: bytes):
        self._aead = AESGCM(_derive(key, "seal"))
        # Keyed once; each digest copies it (the key's pads are not recomputed per record).
        self._hmac = hmac.new(_derive(key, "digest"), digestmod=hashlib.sha256)
        if isinstance(location, str) and "://" in location:
            self._store: SQLiteStore | PostgresStore = PostgresStore(
                location, (_POSTGRES_SCHEMA, _POSTGRES_DESCRIPTORS), lock="deid.person_index.schema",
                application="deid-person-index", what="lineage database {url} (DEID_DATABASE_URL; the person index)")
        else:
            # WAL: NORMAL syncs at checkpoints (a committed claim survives a process crash, as the ledger's do);
            # a 64 MiB page cache holds the upper B-tree levels of a million-face index.
            self._store = SQLiteStore(Path(location), (_SQLITE_SCHEMA, _SQLITE_DESCRIPTORS), private=True,
                                      pragmas=("PRAGMA synchronous=NORMAL", "PRAGMA cache_size=-65536"))

    @classmethod
    def open(cls, data_dir: str | os.PathLike, key: bytes, *, database_url: str | None = None) -> PersonIndex:
        """``<data_dir>/private/person_index.sqlite``, or the database at ``database_url`` when set."""
        return cls(database_url or Path(data_dir) / "private" / INDEX_FILE, key)

    @property
    def where(self) -> str:
        return self._store.describe()

    def _digest(self, kind: str, value: str) -> bytes:
        h = self._hmac.copy()
        h.update(f"{kind}|{value}".encode())
        return h.digest()[:DIGEST_BYTES]

    def _seal(self, digest: bytes, dataset: str, subject_id: str) -> bytes:
        # Bound to its digest and dataset: a sealed id moved to another row does not open.
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, subject_id.encode(), digest + dataset.encode())

    def _open(self, digest: bytes, dataset: str, blob: bytes) -> str:
        try:
            return self._aead.decrypt(bytes(blob[:NONCE_BYTES]), bytes(blob[NONCE_BYTES:]),
                                      bytes(digest) + dataset.encode()).decode()
        except InvalidTag:
            raise StateError(f"person index {self.where}: an entry does not authenticate under this project's linkage "
                             "key (tampered, or another key); restore the index from backup") from None

    def _run(self, op: Callable[[Tx], T]) -> T:
        """``op`` in one transaction (lookup and claim under one writer lock), re-run when the database aborted it."""
        def exhausted(attempt: int, exc: BaseException) -> StateError:
            return StateError(f"person index {self.where}: aborted {attempt} times by concurrent writers "
                              f"({type(exc).__name__}); run again")
        return run_tx(self._store, op, exhausted=exhausted)

    def _check_key(self, tx: Tx, *, write: bool) -> None:
        """The index was written under this project's linkage key (another key would find no one: a silent miss)."""
        mine = self._digest(KEY_CHECK, "deid-person-index-v1")
        got = [bytes(d) for (d,) in tx.all("SELECT digest FROM deid_person_index WHERE kind = ?", (KEY_CHECK,))]
        if got and mine not in got:
            raise StateError(f"person index {self.where} was written under another linkage key: with this key no "
                             "registered person would be found; configure the project's linkage key (DEID_LINKAGE_KEY)")
        if not got and write:
            tx.run(_INSERT, (KEY_CHECK, mine, "", None))

    def _lookup(self, tx: Tx, fp_digests: list[bytes], id_digests: dict[bytes, list[str]]) -> Matches:
        self._check_key(tx, write=False)
        by_fp: dict[bytes, list[int]] = defaultdict(list)
        for row, d in enumerate(fp_digests):
            by_fp[d].append(row)
        records: dict[str, dict[int, str]] = defaultdict(dict)
        ids: dict[str, set[str]] = defaultdict(set)
        for kind, wanted in ((FINGERPRINT, list(by_fp)), (STEWARD_ID, list(id_digests))):
            for a in range(0, len(wanted), _BATCH):
                chunk = wanted[a:a + _BATCH]
                got = tx.all(f"SELECT digest, dataset, person FROM deid_person_index WHERE kind = ? AND digest IN "
                             f"({', '.join('?' * len(chunk))})", (kind, *chunk))
                for digest, ds_name, person in got:
                    digest = bytes(digest)
                    if kind == FINGERPRINT:
                        who = self._open(digest, ds_name, person)
                        for row in by_fp[digest]:
                            records[ds_name][row] = who
                    else:
                        ids[ds_name].update(id_digests[digest])
        return Matches(records=dict(records), ids=dict(ids))

    def _digests(self, subject_ids: Sequence[str], fingerprints: Sequence[str]):
        if len(subject_ids) != len(fingerprints):
            raise ConfigError(f"fingerprints has {len(fingerprints)} entries but subject_ids has {len(subject_ids)}; "
                              "pass the source_sha256 of every record")
        return [self._digest(FINGERPRINT, str(f)) for f in fingerprints], self._id_digests(subject_ids)

    def _id_digests(self, subject_ids: Sequence[str]) -> dict[bytes, list[str]]:
        """Digest of each distinct normalised id -> the ids as listed that normalise to it."""
        id_digests: dict[bytes, list[str]] = defaultdict(list)
        for s in dict.fromkeys(map(str, subject_ids)):
            id_digests[self._digest(STEWARD_ID, normalize_subject_id(s))].append(s)
        return dict(id_digests)

    def lookup(self, subject_ids: Sequence[str], fingerprints: Sequence[str]) -> Matches:
        """What the index holds for these records (subject id as listed, source SHA-256 each), in any dataset."""
        fps, id_digests = self._digests(subject_ids, fingerprints)
        return self._run(lambda tx: self._lookup(tx, fps, id_digests))

    def _insert(self, tx: Tx, dataset: str, subject_ids: Sequence[str], fps: list[bytes],
                id_digests: dict[bytes, list[str]]) -> None:
        self._check_key(tx, write=True)
        rows: list[tuple[str, bytes, str, bytes | None]] = [
            (FINGERPRINT, d, dataset, self._seal(d, dataset, str(s))) for d, s in dict(zip(fps, subject_ids)).items()]
        rows += [(STEWARD_ID, d, dataset, None) for d in id_digests]
        rows.sort(key=lambda r: (r[0], r[1]))  # in key order: B-tree appends, not a random page per row
        for a in range(0, len(rows), 5000):
            tx.many(_INSERT, rows[a:a + 5000])

    def register(self, dataset: str, subject_ids: Sequence[str], fingerprints: Sequence[str]) -> None:
        """Register records (subject id, source SHA-256 each) under ``dataset``; already registered ones are kept."""
        fps, id_digests = self._digests(subject_ids, fingerprints)
        self._run(lambda tx: self._insert(tx, dataset, list(map(str, subject_ids)), fps, id_digests))

    def claim(self, dataset: str, subject_ids: Sequence[str], fingerprints: Sequence[str], *,
              policy: str = "refuse", id_scope: str = "linked") -> Routing:
        """Look the drop up, decide its lineage (:func:`decide`) and register its people there, in one transaction.

        A refused drop (:class:`~deid.errors.DataError`) registers nothing. Re-keyed records are
        registered under the id they were aliased to. The routing carries what was added
        (:attr:`Routing.claimed`), so a stage that refuses the drop later takes it back (:meth:`withdraw`).
        """
        check_policy(policy, id_scope)
        ids = list(map(str, subject_ids))
        fps, id_digests = self._digests(ids, fingerprints)
        return self._run(lambda tx: self._claim(tx, dataset, ids, fps, id_digests, policy=policy, id_scope=id_scope))

    def _claim(self, tx: Tx, dataset: str, ids: list[str], fps: list[bytes], id_digests: dict[bytes, list[str]], *,
               policy: str, id_scope: str) -> Routing:
        matches = self._lookup(tx, fps, id_digests)
        routing = decide(matches, ids, dataset=dataset, policy=policy, id_scope=id_scope)
        # Records registered there already are not sealed and written again (a re-drop: most of them).
        known = matches.records.get(routing.dataset, {})
        keep = [r for r in range(len(ids)) if r not in known]
        final = [routing.aliases.get(ids[r], ids[r]) for r in keep]
        new_fps = [fps[r] for r in keep]
        final_ids = self._id_digests(final) if routing.aliases or len(keep) < len(ids) else id_digests
        self._insert(tx, routing.dataset, final, new_fps, final_ids)
        # What this claim added: ids neither found there by the lookup nor the registered ids re-keyed records took.
        found, targets = matches.ids.get(routing.dataset, set()), set(routing.aliases.values())
        added_ids = [d for d, names in final_ids.items() if not any(n in found or n in targets for n in names)]
        return replace(routing, claimed=b"".join(dict.fromkeys(new_fps)), claimed_ids=b"".join(added_ids))

    def _delete(self, tx: Tx, routing: Routing) -> None:
        for kind, blob in ((FINGERPRINT, routing.claimed), (STEWARD_ID, routing.claimed_ids)):
            digests = [blob[a:a + DIGEST_BYTES] for a in range(0, len(blob), DIGEST_BYTES)]
            for a in range(0, len(digests), _BATCH):
                chunk = digests[a:a + _BATCH]
                tx.run(f"DELETE FROM deid_person_index WHERE kind = ? AND dataset = ? AND digest IN "
                       f"({', '.join('?' * len(chunk))})", (kind, routing.dataset, *chunk))

    def withdraw(self, routing: Routing) -> None:
        """Take back what :meth:`claim` added (:attr:`Routing.claimed`): a drop refused after its claim claims nothing.

        Rows registered before the claim (people the lineage held) stay.
        """
        self._run(lambda tx: self._delete(tx, routing))

    def resettle(self, routing: Routing, dataset: str, subject_ids: Sequence[str], fingerprints: Sequence[str], *,
                 id_scope: str = "linked") -> Routing:
        """Move a claim to the lineage of ``dataset`` (a drop routed there after its claim, e.g. by face), in one
        transaction: what the claim added is withdrawn and the drop claimed in ``dataset`` (``subject_ids``: as
        the drop is now listed, e.g. under registered ids)."""
        check_policy("route", id_scope)
        ids = list(map(str, subject_ids))
        fps, id_digests = self._digests(ids, fingerprints)

        def op(tx: Tx) -> Routing:
            self._delete(tx, routing)
            moved = self._claim(tx, dataset, ids, fps, id_digests, policy="route", id_scope=id_scope)
            if moved.dataset != dataset:  # the drop's records are registered in a third lineage: never planned twice
                raise CrossDatasetRefusal(f"the drop's records are registered under dataset {moved.dataset!r}, not "
                                          f"{dataset!r}: one run plans in one lineage; split the drop")
            return replace(moved, routed_from=routing.own_dataset, note=routing.note)
        return self._run(op)

    def route_faces(self, routing: Routing, people: Sequence[str], descriptors: np.ndarray, *, threshold: float,
                    known: frozenset[str] | set[str] = frozenset(), held: int = 0, policy: str = "refuse",
                    nprobe: int = 16) -> FaceRouting:
        """Search a drop's faces among the registered ones and decide (:func:`decide_faces`).

        Parameters
        ----------
        routing : Routing
            The drop's :meth:`claim`.
        people, descriptors
            The drop person (identity resolution's effective id) and dlib descriptor of each embedded face.
        threshold : float
            Identity resolution's calibrated same-person distance.
        known, held, policy
            As :func:`decide_faces`; ``held`` adds to the people the claim found in its lineage.

        Returns
        -------
        FaceRouting
            When it routes the drop (``routed_from``), move the claim with :meth:`resettle`.

        Raises
        ------
        CrossDatasetRefusal
            As :func:`decide_faces`; the claim is withdrawn first (a refused drop claims nothing).
        """
        search, owners = self.face_search(nprobe=nprobe)
        D = np.asarray(descriptors, np.float32)
        probe, reg, dist = search.within(D, max(float(threshold), COPY_DISTANCE))
        pairs = [(int(p), int(j), float(d)) for p, j, d in zip(probe, reg, dist) if d < threshold]
        copies = set(probe[dist < COPY_DISTANCE].tolist())
        try:
            faces = decide_faces(pairs, [str(p) for p in people], owners, lineage=routing.dataset,
                                 dataset=routing.own_dataset, threshold=threshold, known=known,
                                 held=routing.held + held, policy=policy)
        except CrossDatasetRefusal:
            self.withdraw(routing)
            raise
        return replace(faces, fresh=tuple(i for i in range(len(D)) if i not in copies))

    def register_faces(self, dataset: str, subject_ids: Sequence[str], descriptors: np.ndarray) -> None:
        """Register face descriptors (one per record, with the subject id it is listed under) under ``dataset``."""
        D = np.asarray(descriptors, dtype="<f4")
        if D.ndim != 2 or len(D) != len(subject_ids):
            raise ConfigError(f"descriptors has shape {D.shape} for {len(subject_ids)} subject ids; pass one (d,) "
                              "descriptor per record")
        rows = []
        for s, v in zip(map(str, subject_ids), D):
            nonce = secrets.token_bytes(NONCE_BYTES)
            body = len(s.encode()).to_bytes(2, "big") + s.encode() + v.tobytes()
            rows.append((dataset, nonce + self._aead.encrypt(nonce, body, b"descriptor|" + dataset.encode())))

        def op(tx: Tx) -> None:
            self._check_key(tx, write=True)
            for a in range(0, len(rows), 5000):
                tx.many("INSERT INTO deid_person_descriptors (dataset, sealed) VALUES (?, ?)", rows[a:a + 5000])
        self._run(op)

    def face_search(self, *, nprobe: int = 16) -> tuple[DescriptorSearch, "Owners"]:
        """The registered descriptors opened and indexed; (search, (dataset, subject id) of each).

        Rows are read a batch at a time and each descriptor decrypted into one float32 array sized by a count
        first: at 1M registered faces the rows, their sealed blobs and a vector object per face never sit in
        memory together (peak 2.8 GiB before, bench/bench_person_index.py --faces).
        """
        def op(tx: Tx) -> tuple[np.ndarray, Owners]:
            self._check_key(tx, write=False)
            (n_rows,) = tx.one("SELECT count(*) FROM deid_person_descriptors")
            X = np.zeros((int(n_rows), 128), np.float32)
            owners = Owners()
            for i, (ds_name, blob) in enumerate(tx.each("SELECT dataset, sealed FROM deid_person_descriptors "
                                                        "ORDER BY id")):
                if i >= len(X):  # rows added since the count (another writer): grown, never cut short
                    X = np.vstack([X, np.zeros((len(X) // 2 + 1, 128), np.float32)])
                subject, vector = self._open_descriptor(ds_name, bytes(blob))
                if len(vector) != X.shape[1]:
                    raise StateError(f"person index {self.where}: a registered descriptor has {len(vector)} values, "
                                     f"not {X.shape[1]}; restore the index from backup")
                owners.append(ds_name, subject)
                X[i] = vector
            return X[:len(owners)], owners
        X, owners = self._run(op)
        return DescriptorSearch(X, nprobe=nprobe), owners

    def _open_descriptor(self, ds_name: str, blob: bytes) -> tuple[str, np.ndarray]:
        """One sealed descriptor row opened: (the subject id it was registered under, its float32 vector)."""
        try:
            body = self._aead.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], b"descriptor|" + ds_name.encode())
        except InvalidTag:
            raise StateError(f"person index {self.where}: a face descriptor does not authenticate under this "
                             "project's linkage key; restore the index from backup") from None
        n = int.from_bytes(body[:2], "big")
        return body[2:2 + n].decode(), np.frombuffer(body[2 + n:], "<f4")

    def match_faces(self, descriptors: np.ndarray, *, threshold: float | None = None,
                    nprobe: int = 16) -> list[FaceMatch]:
        """Drop faces whose nearest registered face is within ``threshold`` (default: the recogniser's
        same-person distance, :data:`deid.evaluation.recognizer.SAME_PERSON_THRESHOLD`)."""
        if threshold is None:
            from deid.evaluation.recognizer import SAME_PERSON_THRESHOLD  # noqa: PLC0415 - dlib only when needed
            threshold = SAME_PERSON_THRESHOLD
        search, owners = self.face_search(nprobe=nprobe)
        idx, dist = search.search(np.asarray(descriptors, np.float32))
        return [FaceMatch(row=i, dataset=owners[j][0], subject_id=owners[j][1], distance=float(d))
                for i, (j, d) in enumerate(zip(idx.tolist(), dist.tolist())) if j >= 0 and d < threshold]

    def count(self) -> int:
        """Rows held (fingerprints and ids of every dataset)."""
        return int(self._run(lambda tx: tx.all("SELECT count(*) FROM deid_person_index WHERE kind <> ?",
                                               (KEY_CHECK,)))[0][0])
