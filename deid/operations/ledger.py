"""Drop fingerprints and the release ledger that makes dropped datasets idempotent.

A drop is *complete* when its producer has written ``_READY`` (last). Its fingerprint is a
SHA-256 over its manifest (a feature drop's: ``drop.yaml``) and every other file's bytes, so the same content dropped again under
another name is recognised, and a changed drop under the same name is not. The ledger (SQLite
under the data dir, or PostgreSQL when ``DEID_DATABASE_URL`` is set: several machines) records
one row per fingerprint and moves it through::

    queued (the watcher emitted an event) -> running (a flow claimed it) -> released | rejected
                                                                       \\-> failed (may be claimed again)

``claim`` is one serializable transaction (SQLite: ``BEGIN IMMEDIATE``, one writer at a time;
PostgreSQL: ``SERIALIZABLE``, retried on a serialization failure), so two flows given the same
fingerprint (a duplicate event, the nightly run overlapping a drop-triggered one, two machines)
cannot both run it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from deid.intake.drop import DROP_YAML, MANIFEST, READY
from deid.intake.features import run_kind
from deid.errors import ConfigError, DropError, StateError
from deid.sqlstore import PostgresStore, SQLiteStore, Tx, run_tx
# Re-exported: the lineage registries and the tests take the URL helpers from here.
from deid.sqlstore import postgres_conninfo as postgres_conninfo, redact_url as redact_url
from deid.reporting.report import hash_file, scan_tree

log = logging.getLogger(__name__)

QUEUED, RUNNING, RELEASED, REJECTED, FAILED = "queued", "running", "released", "rejected", "failed"
SETTLED = (RELEASED, REJECTED)
STATUSES = (QUEUED, RUNNING, RELEASED, REJECTED, FAILED)

LEDGER_FILE = "ledger.sqlite"
T = TypeVar("T")

# Times are epoch seconds: REAL is a double in SQLite but a 4-byte float in PostgreSQL.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS drops (
    fingerprint TEXT PRIMARY KEY,
    status      TEXT NOT NULL,
    drop_path   TEXT NOT NULL,
    first_seen  DOUBLE PRECISION NOT NULL,
    updated     DOUBLE PRECISION NOT NULL,
    claimed_by  TEXT,
    release_id  TEXT,
    verdict     TEXT,
    report      TEXT,
    error       TEXT
);
CREATE TABLE IF NOT EXISTS sightings (
    drop_path   TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    seen        DOUBLE PRECISION NOT NULL,
    outcome     TEXT NOT NULL,
    PRIMARY KEY (drop_path, fingerprint)
);
"""
_STATEMENTS = tuple(s.strip() for s in _SCHEMA.split(";") if s.strip())


def drop_fingerprint(drop_dir: str | os.PathLike) -> str:
    """``"sha256:" + hex`` over the manifest bytes and the relative path and SHA-256 of every other file.

    The manifest is ``manifest.csv``, or for a feature drop (``drop.yaml`` ``kind: features``,
    no manifest.csv) ``drop.yaml``, whose vectors file is then one of the other files. Files
    are hashed in 1 MiB chunks (never read whole). ``_READY`` is left out: it only says the drop
    is complete. Anything that is not a regular file (symlinks, fifos) is named in the digest
    but never followed.

    Raises
    ------
    DropError
        When ``drop_dir`` is not a directory, or has no ``manifest.csv`` and is not a feature drop.
    """
    root = Path(drop_dir)
    if not root.is_dir():
        raise DropError(f"drop directory {root} does not exist or is not a directory")
    files, others = scan_tree(root)
    manifest = MANIFEST if MANIFEST in files or DROP_YAML not in files or run_kind(root) != "features" else DROP_YAML
    if manifest not in files and manifest in others:
        # A FIFO, device or symlink named manifest.csv: it is there, but it is never read (nor followed).
        raise DropError(f"{root}: {manifest} is not a regular file (a symlink, FIFO or device; drop files are read "
                        f"without following links or waiting on a pipe); copy the real {manifest} into the drop")
    if manifest not in files:
        raise DropError(f"{root} has no {MANIFEST} (nor a {DROP_YAML} saying kind: features); only complete drops "
                        f"(manifest + {READY}) can be fingerprinted")
    digest = hashlib.sha256(b"deid-drop-v1\n")
    manifest_hash, size = hash_file(files.pop(manifest))
    digest.update(f"{manifest}\0{manifest_hash}\0{size}\n".encode())
    files.pop(READY, None)
    for rel, path in files.items():  # sorted by relative path
        h, size = hash_file(path)
        digest.update(f"{rel}\0{h}\0{size}\n".encode())
    for rel in others:
        digest.update(f"{rel}\0other\n".encode())
    return "sha256:" + digest.hexdigest()


def ready_drops(incoming: str | os.PathLike) -> list[Path]:
    """Subdirectories of ``incoming`` holding a ``_READY`` marker, sorted by name (hidden ones skipped)."""
    root = Path(incoming)
    if not root.is_dir():
        return []
    return sorted(p.resolve() for p in root.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and (p / READY).is_file())


@dataclass(frozen=True)
class Entry:
    """One ledger row: a fingerprint and what happened to it."""

    fingerprint: str
    status: str
    drop_path: str
    first_seen: float
    updated: float
    claimed_by: str | None = None
    release_id: str | None = None
    verdict: str | None = None
    report: str | None = None
    error: str | None = None

    @property
    def settled(self) -> bool:
        return self.status in SETTLED


@dataclass(frozen=True)
class Claim:
    """Result of :meth:`Ledger.claim`: ``granted`` is False for a duplicate, with the existing entry."""

    granted: bool
    entry: Entry


def open_ledger(settings=None) -> "Ledger":
    """The project's ledger: PostgreSQL at ``DEID_DATABASE_URL`` if set, else ``<data dir>/ledger.sqlite``."""
    from deid.settings import Settings  # noqa: PLC0415

    settings = settings or Settings()
    url = settings.database_url.get_secret_value() if settings.database_url else None
    return Ledger(url or settings.data_path / LEDGER_FILE, stale_after=settings.ledger_stale_after)


class Ledger:
    """The ledger of dropped datasets, keyed by :func:`drop_fingerprint`.

    Parameters
    ----------
    location : path or str
        A SQLite database file (created with its parent directory), or a PostgreSQL URL
        (``postgresql://user:password@host:5432/db``; the tables are created if missing).
    stale_after : float, keyword-only
        Seconds after which a ``queued`` or ``running`` entry whose flow never reported back
        (killed process, lost event) may be claimed again. Default 6 hours.
    """

    def __init__(self, location: str | os.PathLike, *, stale_after: float = 6 * 3600.0):
        if not (isinstance(stale_after, (int, float)) and stale_after > 0):
            raise ConfigError(f"stale_after={stale_after!r} must be a positive number of seconds, e.g. 21600")
        self.stale_after = stale_after
        if isinstance(location, str) and "://" in location:
            # SERIALIZABLE, not row locks: claim and sight read an entry that may not exist yet and decide from
            # it; the primary keys stay as the last line (one row per fingerprint, one per sighting).
            self._store: SQLiteStore | PostgresStore = PostgresStore(
                location, _STATEMENTS, lock="deid.ledger.schema", application="deid-ledger",
                what="ledger database {url} (DEID_DATABASE_URL)", dict_rows=True)
            self.path: Path | None = None
        else:
            self.path = Path(location)
            self._store = SQLiteStore(self.path, _STATEMENTS, dict_rows=True)

    @property
    def location(self) -> str:
        """Where the ledger lives (file path, or the database URL without its password)."""
        return self._store.describe()

    def _run(self, op: Callable[[Tx], T]) -> T:
        """Run ``op`` in one transaction; re-run it from the start when the database aborted it (``now`` read
        again: a retry is always safe)."""
        return run_tx(self._store, op)

    @staticmethod
    def _entry(row: dict | None) -> Entry | None:
        return None if row is None else Entry(**row)

    def _get(self, db: Tx, fingerprint: str) -> Entry | None:
        return self._entry(db.one("SELECT * FROM drops WHERE fingerprint=?", (fingerprint,)))

    def get(self, fingerprint: str) -> Entry | None:
        """The entry of ``fingerprint``, or None."""
        return self._run(lambda db: self._get(db, fingerprint))

    def entries(self) -> list[Entry]:
        """Every entry, oldest first."""
        return self._run(lambda db: [Entry(**r) for r in db.all("SELECT * FROM drops ORDER BY first_seen, fingerprint")])

    def _open(self, entry: Entry | None, now: float) -> bool:
        """Whether a new run may take this fingerprint."""
        if entry is None or entry.status == FAILED:
            return True
        return entry.status in (QUEUED, RUNNING) and now - entry.updated > self.stale_after

    def sight(self, drop_path: str | os.PathLike, fingerprint: str) -> str:
        """Record that the watcher saw ``drop_path`` with ``fingerprint``; say what to do about it.

        Returns
        -------
        str
            ``"announce"``: unknown (or failed, or stale) fingerprint, now queued; emit the event.
            ``"pending"``: this path was already announced and is still queued.
            ``"duplicate"``: the content is already released, rejected, running or queued under
            another sighting; reported once per path.
            ``"known"``: this path and fingerprint were already reported as a duplicate.
        """
        path = str(drop_path)

        def op(db: Tx) -> str:
            now = time.time()
            seen = db.one("SELECT outcome FROM sightings WHERE drop_path=? AND fingerprint=?", (path, fingerprint))
            entry = self._get(db, fingerprint)
            if entry is None:
                db.run("INSERT INTO drops (fingerprint, status, drop_path, first_seen, updated) "
                       "VALUES (?, ?, ?, ?, ?)", (fingerprint, QUEUED, path, now, now))
                outcome = "announce"
            elif self._open(entry, now):
                db.run("UPDATE drops SET status=?, drop_path=?, updated=?, error=NULL WHERE fingerprint=?",
                       (QUEUED, path, now, fingerprint))
                outcome = "announce"
            elif seen is not None:
                return "pending" if seen["outcome"] == "announce" and entry.status == QUEUED else "known"
            else:
                outcome = "duplicate"
            db.run("INSERT INTO sightings (drop_path, fingerprint, seen, outcome) VALUES (?, ?, ?, ?) "
                   "ON CONFLICT (drop_path, fingerprint) DO UPDATE SET seen=excluded.seen, outcome=excluded.outcome",
                   (path, fingerprint, now, outcome))
            return outcome

        return self._run(op)

    def claim(self, fingerprint: str, drop_path: str | os.PathLike, *, by: str) -> Claim:
        """Atomically take ``fingerprint`` for a run (``by``: e.g. the flow run id).

        Granted when the fingerprint is unknown, queued, failed, or stale; refused (a duplicate)
        when it is released, rejected, or running elsewhere.
        """

        def op(db: Tx) -> Claim:
            now = time.time()
            entry = self._get(db, fingerprint)
            if entry is not None and entry.status != QUEUED and not self._open(entry, now):
                return Claim(False, entry)
            if entry is None:
                db.run("INSERT INTO drops (fingerprint, status, drop_path, first_seen, updated, claimed_by) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (fingerprint, RUNNING, str(drop_path), now, now, by))
            else:
                db.run("UPDATE drops SET status=?, drop_path=?, updated=?, claimed_by=?, error=NULL "
                       "WHERE fingerprint=?", (RUNNING, str(drop_path), now, by, fingerprint))
            return Claim(True, self._get(db, fingerprint))

        return self._run(op)

    def finish(self, fingerprint: str, *, by: str, release_id: str, verdict: str, report: str) -> Entry:
        """Record a finished run: status ``released`` or ``rejected`` (from ``verdict``)."""
        if verdict not in SETTLED:
            raise ConfigError(f"verdict={verdict!r} must be one of {list(SETTLED)}")
        return self._set(fingerprint, by, status=verdict, release_id=release_id, verdict=verdict, report=report)

    def fail(self, fingerprint: str, *, by: str, error: str) -> Entry:
        """Record a run that raised: the fingerprint may be claimed again."""
        return self._set(fingerprint, by, status=FAILED, error=error[:2000])

    def _set(self, fingerprint: str, by: str, **fields) -> Entry:
        def op(db: Tx) -> Entry:
            entry = self._get(db, fingerprint)
            if entry is None or entry.status != RUNNING or entry.claimed_by != by:
                raise StateError(f"fingerprint {fingerprint} is not running under claim {by!r} "
                                  f"(ledger has {entry}); claim it first")
            cols = ", ".join(f"{k}=?" for k in fields)
            db.run(f"UPDATE drops SET {cols}, updated=? WHERE fingerprint=?",  # noqa: S608 - column names are ours
                   (*fields.values(), time.time(), fingerprint))
            return self._get(db, fingerprint)

        return self._run(op)

    def sightings(self) -> list[dict]:
        """Every (drop_path, fingerprint, seen, outcome) the watcher recorded, oldest first."""
        return self._run(lambda db: db.all("SELECT * FROM sightings ORDER BY seen"))
