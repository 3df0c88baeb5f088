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
import random
import sqlite3
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlsplit, urlunsplit

from deid.intake.drop import DROP_YAML, MANIFEST, READY
from deid.intake.features import run_kind
from deid.errors import ConfigError, DropError, EnvironmentFailure, StateError
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


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def postgres_conninfo(url: str) -> str:
    """The libpq URL of ``DEID_DATABASE_URL``: ``postgresql://`` as is, a SQLAlchemy ``+driver`` suffix dropped.

    So the URL Prefect's server is given (``postgresql+asyncpg://...``) can be given to deid too.
    """
    scheme, sep, rest = url.partition("://")
    base = scheme.split("+", 1)[0].lower()
    if not sep or base not in ("postgresql", "postgres"):
        raise ConfigError(f"DEID_DATABASE_URL={redact_url(url)!r} must be a PostgreSQL URL, "
                          "postgresql://user:password@host:5432/dbname (or postgresql+asyncpg://..., the form "
                          "Prefect takes); leave it unset for the embedded SQLite ledger")
    return f"postgresql://{rest}"


class _Query:
    """One open transaction: ``?`` placeholders, rows as dicts, on either backend."""

    def __init__(self, cursor: Any, paramstyle: str):
        self._cur = cursor
        self._pg = paramstyle == "format"

    def run(self, sql: str, params: tuple = ()) -> None:
        self._cur.execute(sql.replace("?", "%s") if self._pg else sql, params)

    def one(self, sql: str, params: tuple = ()) -> dict | None:
        self.run(sql, params)
        row = self._cur.fetchone()
        return None if row is None else dict(row)

    def all(self, sql: str, params: tuple = ()) -> list[dict]:
        self.run(sql, params)
        return [dict(r) for r in self._cur.fetchall()]


class _SQLiteStore:
    """The embedded ledger: one file; ``BEGIN IMMEDIATE`` makes every operation the only writer."""

    retryable: tuple[type[BaseException], ...] = ()
    attempts = 1  # SQLite waits for the lock (30 s busy timeout) instead of aborting

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(path, timeout=30.0)) as db:
            db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            db.executescript(_SCHEMA)

    def describe(self) -> str:
        return str(self.path)

    @contextmanager
    def tx(self) -> Iterator[_Query]:
        # One connection per operation: the watcher, the server's flow runs and the nightly
        # run are separate processes; SQLite's file locks serialise them.
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        db.row_factory = sqlite3.Row
        with closing(db):
            db.execute("BEGIN IMMEDIATE")
            try:
                yield _Query(db.cursor(), "qmark")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")


class _PostgresStore:
    """The shared ledger on PostgreSQL (``DEID_DATABASE_URL``), for runs on several machines.

    Every operation is one ``SERIALIZABLE`` transaction, retried when PostgreSQL aborts it as a
    serialization failure or deadlock (and on a unique violation: two first inserts of one key).
    Why SERIALIZABLE, and not row locks: each operation reads an entry and decides from it
    (claim, sight), and the entry may not exist yet -- ``SELECT ... FOR UPDATE`` cannot lock a
    row that is not there, so two claims of a new fingerprint would both see nothing. Under
    serializable snapshot isolation the outcome is that of some serial order of the operations,
    like SQLite's one writer at a time, without a lock on the whole table; the primary keys stay
    as the last line (one row per fingerprint, one per sighting). Operations are short and
    re-run from the start (``now`` read again), so a retry is always safe.
    """

    attempts = 30

    def __init__(self, url: str):
        try:
            import psycopg  # noqa: PLC0415 - only when PostgreSQL is configured
            from psycopg import errors  # noqa: PLC0415
            from psycopg.rows import dict_row  # noqa: PLC0415
        except ImportError as exc:  # pragma: no cover - psycopg is a pinned dependency
            raise EnvironmentFailure("DEID_DATABASE_URL is set but the PostgreSQL driver is missing; "
                              "pip install 'psycopg[binary]==3.3.9' (a deid dependency)") from exc
        self._psycopg = psycopg
        self._dict_row = dict_row
        self.conninfo = postgres_conninfo(url)
        self.url = url
        self.retryable = (errors.SerializationFailure, errors.DeadlockDetected, errors.UniqueViolation)
        with self._connect() as conn:
            # CREATE TABLE IF NOT EXISTS is not safe against itself run concurrently (catalog
            # unique violations): the first process creates, the others wait and find the tables.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('deid.ledger.schema'))")
            for stmt in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(stmt)

    def describe(self) -> str:
        return redact_url(self.url)

    def _connect(self):
        try:
            return self._psycopg.connect(self.conninfo, row_factory=self._dict_row, connect_timeout=30,
                                         application_name="deid-ledger")
        except self._psycopg.OperationalError as exc:
            raise EnvironmentFailure(f"ledger database {redact_url(self.url)} (DEID_DATABASE_URL) is unreachable: "
                                     f"{str(exc).strip()}; start PostgreSQL or fix the URL") from None

    @contextmanager
    def tx(self) -> Iterator[_Query]:
        with self._connect() as conn:  # commits on a clean exit (a serialization failure may surface here)
            conn.isolation_level = self._psycopg.IsolationLevel.SERIALIZABLE
            with conn.cursor() as cur:
                yield _Query(cur, "format")


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
            self._store: _SQLiteStore | _PostgresStore = _PostgresStore(location)
            self.path: Path | None = None
        else:
            self.path = Path(location)
            self._store = _SQLiteStore(self.path)

    @property
    def location(self) -> str:
        """Where the ledger lives (file path, or the database URL without its password)."""
        return self._store.describe()

    def _run(self, op: Callable[[_Query], T]) -> T:
        """Run ``op`` in one transaction; re-run it from the start when the database aborted it."""
        for attempt in range(1, 1 + self._store.attempts):
            try:
                with self._store.tx() as db:
                    return op(db)
            except self._store.retryable as exc:
                if attempt == self._store.attempts:
                    raise
                log.debug("ledger transaction retried (%s, attempt %d)", type(exc).__name__, attempt)
                time.sleep(random.uniform(0.005, 0.02 * attempt))  # noqa: S311 - jitter, not a secret
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _entry(row: dict | None) -> Entry | None:
        return None if row is None else Entry(**row)

    def _get(self, db: _Query, fingerprint: str) -> Entry | None:
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

        def op(db: _Query) -> str:
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

        def op(db: _Query) -> Claim:
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
        def op(db: _Query) -> Entry:
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
