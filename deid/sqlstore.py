"""One small SQL backend for the project's private tables: embedded SQLite, or PostgreSQL for several machines.

The run ledger (:mod:`deid.operations.ledger`) and the person index
(:mod:`deid.operations.person_index`) both keep their rows either in a SQLite file under the data
directory or in the database at ``DEID_DATABASE_URL``. Both run every operation as one
transaction that reads and decides before it writes, so both need the same three things, kept
here once:

- a transaction with ``?`` placeholders on either backend (:class:`Tx`);
- SQLite in WAL mode (readers never block the writer) with ``BEGIN IMMEDIATE`` (one writer at a
  time, others wait up to the 30 s busy timeout) (:class:`SQLiteStore`);
- PostgreSQL at ``SERIALIZABLE`` isolation, each operation re-run from the start when the server
  aborts it as a serialization failure, a deadlock or a unique violation (two first inserts of one
  key) (:class:`PostgresStore`, :func:`run_tx`).

Why SERIALIZABLE, and not row locks: an operation reads an entry and decides from it, and the
entry may not exist yet -- ``SELECT ... FOR UPDATE`` cannot lock a row that is not there. Under
serializable snapshot isolation the outcome is that of some serial order of the operations, like
SQLite's one writer at a time, without a lock on the whole table (Cahill, Roehm & Fekete,
SIGMOD 2008).

References
----------
M. J. Cahill, U. Roehm, A. D. Fekete. Serializable isolation for snapshot databases. SIGMOD 2008, 729-738.
"""
from __future__ import annotations

import logging
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from deid.errors import ConfigError, EnvironmentFailure

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["PostgresStore", "SQLiteStore", "Store", "Tx", "postgres_conninfo", "redact_url", "run_tx"]


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


class Tx:
    """One open transaction: ``?`` placeholders on either backend; rows as dicts or tuples (the store's choice)."""

    def __init__(self, cursor: Any, *, postgres: bool, dict_rows: bool):
        self.cur, self.pg, self._dict = cursor, postgres, dict_rows

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.pg else sql

    def run(self, sql: str, params: Sequence = ()) -> None:
        self.cur.execute(self._sql(sql), tuple(params))

    def many(self, sql: str, rows: Sequence[Sequence]) -> None:
        self.cur.executemany(self._sql(sql), rows)

    def _row(self, r: Any) -> Any:
        return dict(r) if self._dict else tuple(r)

    def one(self, sql: str, params: Sequence = ()) -> Any:
        self.run(sql, params)
        row = self.cur.fetchone()
        return None if row is None else self._row(row)

    def all(self, sql: str, params: Sequence = ()) -> list[Any]:
        self.run(sql, params)
        return [self._row(r) for r in self.cur.fetchall()]

    def each(self, sql: str, params: Sequence = (), *, batch: int = 10_000) -> Iterator[Any]:
        """The rows one at a time, fetched ``batch`` at a time: a million rows never sit in memory together."""
        self.run(sql, params)
        while rows := self.cur.fetchmany(batch):
            yield from (self._row(r) for r in rows)


class SQLiteStore:
    """A SQLite file in WAL mode; every transaction ``BEGIN IMMEDIATE`` (the only writer; others wait 30 s).

    Parameters
    ----------
    path : path
        The database file (its parent is created).
    schema : sequence of str
        ``CREATE ... IF NOT EXISTS`` statements, run on open.
    private : bool
        Create the parent directory 0700 and the file 0600 from its first byte (the person index).
    pragmas : sequence of str
        Run at the start of every transaction's connection (e.g. ``PRAGMA synchronous=NORMAL``).
    dict_rows : bool
        Rows as dicts (column name -> value) instead of tuples.
    """

    retryable: tuple[type[BaseException], ...] = ()
    attempts = 1  # SQLite waits for the lock (30 s busy timeout) instead of aborting

    def __init__(self, path: str | os.PathLike, schema: Sequence[str], *, private: bool = False,
                 pragmas: Sequence[str] = (), dict_rows: bool = False):
        self.path = Path(path)
        self.pragmas, self.dict_rows = tuple(pragmas), dict_rows
        if private:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not self.path.exists():
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))  # private from the first byte
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(self.path, timeout=30.0)) as db:
            db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            for stmt in schema:
                db.execute(stmt)
            db.commit()

    def describe(self) -> str:
        return str(self.path)

    @contextmanager
    def tx(self) -> Iterator[Tx]:
        # One connection per operation: the watcher, the server's flow runs and the nightly run are separate
        # processes; SQLite's file locks serialise them.
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        if self.dict_rows:
            db.row_factory = sqlite3.Row
        with closing(db):
            for pragma in self.pragmas:
                db.execute(pragma)
            db.execute("BEGIN IMMEDIATE")
            try:
                yield Tx(db.cursor(), postgres=False, dict_rows=self.dict_rows)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")


class PostgresStore:
    """Tables in the PostgreSQL database at ``DEID_DATABASE_URL``; every transaction ``SERIALIZABLE``.

    Parameters
    ----------
    url : str
        ``postgresql://user:password@host:5432/db`` (a SQLAlchemy ``+driver`` suffix is dropped).
    schema : sequence of str
        ``CREATE ... IF NOT EXISTS`` statements, run on open under an advisory lock named ``lock``:
        they are not safe against themselves run concurrently (catalog unique violations), so the
        first process creates and the others wait and find the tables.
    lock, application, what : str
        The advisory lock's name, the connection's ``application_name``, and what the database
        holds as the start of the message when it is unreachable (``{url}``: the URL without its password).
    dict_rows : bool
        Rows as dicts (column name -> value) instead of tuples.
    """

    attempts = 30

    def __init__(self, url: str, schema: Sequence[str], *, lock: str, application: str, what: str,
                 dict_rows: bool = False):
        try:
            import psycopg  # noqa: PLC0415 - only when PostgreSQL is configured
            from psycopg import errors  # noqa: PLC0415
            from psycopg.rows import dict_row, tuple_row  # noqa: PLC0415
        except ImportError as exc:  # pragma: no cover - psycopg is a pinned dependency
            raise EnvironmentFailure("DEID_DATABASE_URL is set but the PostgreSQL driver is missing; "
                                     "pip install 'psycopg[binary]==3.3.9' (a deid dependency)") from exc
        self._psycopg, self.url = psycopg, url
        self._row_factory = dict_row if dict_rows else tuple_row
        self.dict_rows, self.application, self.what = dict_rows, application, what
        self.conninfo = postgres_conninfo(url)
        self.retryable: tuple[type[BaseException], ...] = (errors.SerializationFailure, errors.DeadlockDetected,
                                                           errors.UniqueViolation)
        with self._connect() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (lock,))
            for stmt in schema:
                conn.execute(stmt)

    def describe(self) -> str:
        return redact_url(self.url)

    def _connect(self) -> Any:
        try:
            return self._psycopg.connect(self.conninfo, row_factory=self._row_factory, connect_timeout=30,
                                         application_name=self.application)
        except self._psycopg.OperationalError as exc:
            where = self.what.format(url=redact_url(self.url))
            raise EnvironmentFailure(f"{where} is unreachable: {str(exc).strip()}; start PostgreSQL or fix "
                                     "the URL") from None

    @contextmanager
    def tx(self) -> Iterator[Tx]:
        with self._connect() as conn:  # commits on a clean exit (a serialization failure may surface here)
            conn.isolation_level = self._psycopg.IsolationLevel.SERIALIZABLE
            with conn.cursor() as cur:
                yield Tx(cur, postgres=True, dict_rows=self.dict_rows)


Store = SQLiteStore | PostgresStore


def run_tx(store: Store, op: Callable[[Tx], T], *,
           exhausted: Callable[[int, BaseException], BaseException] | None = None) -> T:
    """Run ``op`` in one transaction of ``store``; re-run it from the start when the database aborted it.

    Operations are short and read what they decide from inside the transaction, so a re-run is
    always safe. After the last attempt the abort is raised as is, or as ``exhausted(attempts, exc)``.
    """
    for attempt in range(1, store.attempts + 1):
        try:
            with store.tx() as tx:
                return op(tx)
        except store.retryable as exc:
            if attempt == store.attempts:
                if exhausted is None:
                    raise
                raise exhausted(attempt, exc) from None
            log.debug("transaction on %s retried (%s, attempt %d)", store.describe(), type(exc).__name__, attempt)
            time.sleep(random.uniform(0.005, 0.02 * attempt))  # noqa: S311 - jitter, not a secret
    raise AssertionError("unreachable")  # pragma: no cover
