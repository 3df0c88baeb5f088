"""Drop fingerprints and the release ledger that makes dropped datasets idempotent.

A drop is *complete* when its producer has written ``_READY`` (last). Its fingerprint is a
SHA-256 over its manifest and every other file's bytes, so the same content dropped again under
another name is recognised, and a changed drop under the same name is not. The ledger (SQLite
under the data dir) records one row per fingerprint and moves it through::

    queued (the watcher emitted an event) -> running (a flow claimed it) -> released | rejected
                                                                       \\-> failed (may be claimed again)

``claim`` is one SQLite transaction, so two flows given the same fingerprint (a duplicate
event, the nightly run overlapping a drop-triggered one) cannot both run it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from deid.intake.drop import MANIFEST, READY
from deid.errors import ConfigError, DropError
from deid.reporting.report import hash_file, scan_tree

log = logging.getLogger(__name__)

QUEUED, RUNNING, RELEASED, REJECTED, FAILED = "queued", "running", "released", "rejected", "failed"
SETTLED = (RELEASED, REJECTED)
STATUSES = (QUEUED, RUNNING, RELEASED, REJECTED, FAILED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS drops (
    fingerprint TEXT PRIMARY KEY,
    status      TEXT NOT NULL,
    drop_path   TEXT NOT NULL,
    first_seen  REAL NOT NULL,
    updated     REAL NOT NULL,
    claimed_by  TEXT,
    release_id  TEXT,
    verdict     TEXT,
    report      TEXT,
    error       TEXT
);
CREATE TABLE IF NOT EXISTS sightings (
    drop_path   TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    seen        REAL NOT NULL,
    outcome     TEXT NOT NULL,
    PRIMARY KEY (drop_path, fingerprint)
);
"""


def drop_fingerprint(drop_dir: str | os.PathLike) -> str:
    """``"sha256:" + hex`` over the manifest bytes and the relative path and SHA-256 of every other file.

    Files are hashed in 1 MiB chunks (never read whole). ``_READY`` is left out: it only says
    the drop is complete. Anything that is not a regular file (symlinks, fifos) is named in the
    digest but never followed.

    Raises
    ------
    DropError
        When ``drop_dir`` is not a directory or has no ``manifest.csv``.
    """
    root = Path(drop_dir)
    if not root.is_dir():
        raise DropError(f"drop directory {root} does not exist or is not a directory")
    files, others = scan_tree(root)
    if MANIFEST not in files:
        raise DropError(f"{root} has no {MANIFEST}; only complete drops (manifest + {READY}) can be fingerprinted")
    digest = hashlib.sha256(b"deid-drop-v1\n")
    manifest_hash, size = hash_file(files.pop(MANIFEST))
    digest.update(f"{MANIFEST}\0{manifest_hash}\0{size}\n".encode())
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


class Ledger:
    """The SQLite ledger of dropped datasets, keyed by :func:`drop_fingerprint`.

    Parameters
    ----------
    path : path
        The database file (created with its parent directory).
    stale_after : float, keyword-only
        Seconds after which a ``queued`` or ``running`` entry whose flow never reported back
        (killed process, lost event) may be claimed again. Default 6 hours.
    """

    def __init__(self, path: str | os.PathLike, *, stale_after: float = 6 * 3600.0):
        if not (isinstance(stale_after, (int, float)) and stale_after > 0):
            raise ConfigError(f"stale_after={stale_after!r} must be a positive number of seconds, e.g. 21600")
        self.path = Path(path)
        self.stale_after = stale_after
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(self.path, timeout=30.0)) as db:
            db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            db.executescript(_SCHEMA)

    @contextmanager
    def _tx(self):
        # One connection per operation: the watcher, the server's flow runs and the nightly
        # run are separate processes; SQLite's file locks serialise them.
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        db.row_factory = sqlite3.Row
        with closing(db):
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    @staticmethod
    def _entry(row) -> Entry | None:
        return None if row is None else Entry(**dict(row))

    def get(self, fingerprint: str) -> Entry | None:
        """The entry of ``fingerprint``, or None."""
        with self._tx() as db:
            return self._entry(db.execute("SELECT * FROM drops WHERE fingerprint=?", (fingerprint,)).fetchone())

    def entries(self) -> list[Entry]:
        """Every entry, oldest first."""
        with self._tx() as db:
            return [Entry(**dict(r)) for r in db.execute("SELECT * FROM drops ORDER BY first_seen, fingerprint")]

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
        now = time.time()
        path = str(drop_path)
        with self._tx() as db:
            seen = db.execute("SELECT outcome FROM sightings WHERE drop_path=? AND fingerprint=?",
                              (path, fingerprint)).fetchone()
            entry = self._entry(db.execute("SELECT * FROM drops WHERE fingerprint=?", (fingerprint,)).fetchone())
            if entry is None:
                db.execute("INSERT INTO drops (fingerprint, status, drop_path, first_seen, updated) "
                           "VALUES (?, ?, ?, ?, ?)", (fingerprint, QUEUED, path, now, now))
                outcome = "announce"
            elif self._open(entry, now):
                db.execute("UPDATE drops SET status=?, drop_path=?, updated=?, error=NULL WHERE fingerprint=?",
                           (QUEUED, path, now, fingerprint))
                outcome = "announce"
            elif seen is not None:
                return "pending" if seen["outcome"] == "announce" and entry.status == QUEUED else "known"
            else:
                outcome = "duplicate"
            db.execute("INSERT OR REPLACE INTO sightings VALUES (?, ?, ?, ?)", (path, fingerprint, now, outcome))
            return outcome

    def claim(self, fingerprint: str, drop_path: str | os.PathLike, *, by: str) -> Claim:
        """Atomically take ``fingerprint`` for a run (``by``: e.g. the flow run id).

        Granted when the fingerprint is unknown, queued, failed, or stale; refused (a duplicate)
        when it is released, rejected, or running elsewhere.
        """
        now = time.time()
        with self._tx() as db:
            entry = self._entry(db.execute("SELECT * FROM drops WHERE fingerprint=?", (fingerprint,)).fetchone())
            if entry is not None and entry.status != QUEUED and not self._open(entry, now):
                return Claim(False, entry)
            if entry is None:
                db.execute("INSERT INTO drops (fingerprint, status, drop_path, first_seen, updated, claimed_by) "
                           "VALUES (?, ?, ?, ?, ?, ?)", (fingerprint, RUNNING, str(drop_path), now, now, by))
            else:
                db.execute("UPDATE drops SET status=?, drop_path=?, updated=?, claimed_by=?, error=NULL "
                           "WHERE fingerprint=?", (RUNNING, str(drop_path), now, by, fingerprint))
            row = db.execute("SELECT * FROM drops WHERE fingerprint=?", (fingerprint,)).fetchone()
            return Claim(True, self._entry(row))

    def finish(self, fingerprint: str, *, by: str, release_id: str, verdict: str, report: str) -> Entry:
        """Record a finished run: status ``released`` or ``rejected`` (from ``verdict``)."""
        if verdict not in SETTLED:
            raise ConfigError(f"verdict={verdict!r} must be one of {list(SETTLED)}")
        return self._set(fingerprint, by, status=verdict, release_id=release_id, verdict=verdict, report=report)

    def fail(self, fingerprint: str, *, by: str, error: str) -> Entry:
        """Record a run that raised: the fingerprint may be claimed again."""
        return self._set(fingerprint, by, status=FAILED, error=error[:2000])

    def _set(self, fingerprint: str, by: str, **fields) -> Entry:
        with self._tx() as db:
            entry = self._entry(db.execute("SELECT * FROM drops WHERE fingerprint=?", (fingerprint,)).fetchone())
            if entry is None or entry.status != RUNNING or entry.claimed_by != by:
                raise ConfigError(f"fingerprint {fingerprint} is not running under claim {by!r} "
                                  f"(ledger has {entry}); claim it first")
            cols = ", ".join(f"{k}=?" for k in fields)
            db.execute(f"UPDATE drops SET {cols}, updated=? WHERE fingerprint=?",
                       (*fields.values(), time.time(), fingerprint))
            return self._entry(db.execute("SELECT * FROM drops WHERE fingerprint=?", (fingerprint,)).fetchone())

    def sightings(self) -> list[dict]:
        """Every (drop_path, fingerprint, seen, outcome) the watcher recorded, oldest first."""
        with self._tx() as db:
            return [dict(r) for r in db.execute("SELECT * FROM sightings ORDER BY seen")]
