"""The lineage registry's sealed entries in PostgreSQL (``DEID_DATABASE_URL``): one dataset, several machines.

Why a database and not the files on shared storage: the file store's compare-and-append is
``link(2)`` failing on an existing name plus a directory fsync, which holds on one machine's local
file system but not on NFS and object-store mounts (``link`` and rename atomicity and fsync of a
directory are not guaranteed there, and a lock file needs working ``flock``, which NFS gives only
with a lock daemon). The run ledger already needs PostgreSQL for several machines
(:mod:`deid.operations.ledger`), so the registry uses the same server.

What is stored is exactly what the file store holds: each entry sealed by
:class:`deid.release.lineage_registry.Registry` (AES-256-GCM with the steward's key, associated data
binding dataset and sequence number, hash-chained) and the sealed HEAD. The database sees
ciphertext, sequence numbers and dataset names only; tampering is detected by the same checks as
for files. Table ``deid_lineage_entries(dataset, seq, blob)`` with primary key (dataset, seq), and
``deid_lineage_heads(dataset, seq, blob)``; the sealed stored averages are rows of
``deid_lineage_images(dataset, pack, offset, blob)``, written in batches before their entry.

An append is one ``SERIALIZABLE`` transaction: read the dataset's last sequence number, refuse
unless the new entry is the next one (the registry moved on: the caller plans again), insert the
entry and replace HEAD. Under serializable snapshot isolation two appends of one dataset behave as
if one ran after the other: the second sees the first's entry and is refused (or is aborted and,
re-run, refused); the primary key is the last line. Entry and HEAD commit together, so there is no
half-written entry and no HEAD left behind.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Any

from deid.errors import ConfigError, EnvironmentFailure
from deid.release.lineage_state import LineageError

logger = logging.getLogger(__name__)

__all__ = ["PostgresStore"]

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS deid_lineage_entries (dataset TEXT NOT NULL, seq BIGINT NOT NULL, "
    "blob BYTEA NOT NULL, PRIMARY KEY (dataset, seq))",
    "CREATE TABLE IF NOT EXISTS deid_lineage_heads (dataset TEXT PRIMARY KEY, seq BIGINT NOT NULL, "
    "blob BYTEA NOT NULL)",
    # The sealed stored averages, one row per record of a pack (the file store's pack, same offsets).
    "CREATE TABLE IF NOT EXISTS deid_lineage_images (dataset TEXT NOT NULL, pack TEXT NOT NULL, "
    "\"offset\" BIGINT NOT NULL, blob BYTEA NOT NULL, PRIMARY KEY (dataset, pack, \"offset\"))",
)
_PACK_HEADER = 8   # the file store's pack header (PACK_MAGIC): offsets are the same in both stores
_IMAGE_BATCH = 1024


class PostgresStore:
    """Sealed entries and HEAD of one dataset's registry in PostgreSQL (see the module docstring).

    Parameters
    ----------
    url : str
        ``DEID_DATABASE_URL`` (``postgresql://...``, or Prefect's ``postgresql+asyncpg://...`` form).
    dataset : str
        The dataset (already checked by the registry).
    """

    attempts = 30

    def __init__(self, url: str, dataset: str):
        try:
            import psycopg  # noqa: PLC0415 - only when PostgreSQL is configured
            from psycopg import errors  # noqa: PLC0415
        except ImportError as exc:  # pragma: no cover - psycopg is a pinned dependency
            raise ConfigError("DEID_DATABASE_URL is set but the PostgreSQL driver is missing; "
                              "pip install 'psycopg[binary]==3.3.9' (a deid dependency)") from exc
        from deid.sqlstore import postgres_conninfo, redact_url  # noqa: PLC0415

        self._psycopg = psycopg
        self.url, self.dataset = url, dataset
        self.conninfo = postgres_conninfo(url)
        self._redacted = redact_url(url)
        self._retryable = (errors.SerializationFailure, errors.DeadlockDetected, errors.UniqueViolation)
        with self._connect() as conn:
            # CREATE TABLE IF NOT EXISTS is not safe against itself run concurrently: one creates, the others wait.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('deid.lineage.schema'))")
            for stmt in _SCHEMA:
                conn.execute(stmt)

    def describe(self) -> str:
        return f"{self._redacted} (dataset {self.dataset})"

    def _connect(self):
        try:
            return self._psycopg.connect(self.conninfo, connect_timeout=30, application_name="deid-lineage")
        except self._psycopg.OperationalError as exc:
            raise EnvironmentFailure(f"lineage database {self._redacted} (DEID_DATABASE_URL) is unreachable: "
                                     f"{str(exc).strip()}; start PostgreSQL or fix the URL") from None

    def _tx(self, op, *, write: bool) -> Any:
        """Run ``op(cursor)`` in one transaction (SERIALIZABLE to write, a snapshot to read), re-run when aborted."""
        level = self._psycopg.IsolationLevel
        for attempt in range(1, self.attempts + 1):
            try:
                with self._connect() as conn:  # commits on a clean exit (a serialization failure may surface here)
                    conn.isolation_level = level.SERIALIZABLE if write else level.REPEATABLE_READ
                    with conn.cursor() as cur:
                        return op(cur)
            except self._retryable as exc:
                if attempt == self.attempts:
                    raise LineageError(f"lineage registry {self.describe()}: the append was aborted {attempt} times by "
                                       f"concurrent writers ({type(exc).__name__}); run again") from None
                logger.debug("lineage transaction retried (%s, attempt %d)", type(exc).__name__, attempt)
                time.sleep(random.uniform(0.005, 0.02 * attempt))  # noqa: S311 - jitter, not a secret
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ the store interface

    def count(self) -> int:
        return self._tx(lambda cur: cur.execute("SELECT count(*) FROM deid_lineage_entries WHERE dataset = %s",
                                                (self.dataset,)).fetchone()[0], write=False)

    def exists(self) -> bool:
        def op(cur) -> bool:
            cur.execute("SELECT EXISTS (SELECT 1 FROM deid_lineage_entries WHERE dataset = %s) OR "
                        "EXISTS (SELECT 1 FROM deid_lineage_heads WHERE dataset = %s)", (self.dataset, self.dataset))
            return bool(cur.fetchone()[0])
        return self._tx(op, write=False)

    def read(self) -> tuple[list[tuple[int, bytes]], bytes | None]:
        """(seq, sealed entry) of every entry by seq, and the sealed HEAD (or None), from one snapshot."""
        def op(cur):
            cur.execute("SELECT seq, blob FROM deid_lineage_entries WHERE dataset = %s ORDER BY seq", (self.dataset,))
            entries = [(int(seq), bytes(blob)) for seq, blob in cur.fetchall()]
            cur.execute("SELECT blob FROM deid_lineage_heads WHERE dataset = %s", (self.dataset,))
            row = cur.fetchone()
            return entries, None if row is None else bytes(row[0])
        return self._tx(op, write=False)

    def append(self, seq: int, entry: bytes, head: bytes) -> None:
        """Append entry ``seq`` and replace HEAD, atomically, only if ``seq`` is the next entry of the dataset."""
        def op(cur) -> None:
            cur.execute("SELECT max(seq) FROM deid_lineage_entries WHERE dataset = %s", (self.dataset,))
            last = cur.fetchone()[0]
            last = -1 if last is None else int(last)
            if last != seq - 1:
                raise LineageError(f"lineage registry {self.describe()}: entry {seq:08d} was written concurrently "
                                   f"(the registry is at entry {last}); reload and plan again")
            cur.execute("INSERT INTO deid_lineage_entries (dataset, seq, blob) VALUES (%s, %s, %s)",
                        (self.dataset, seq, entry))
            cur.execute("INSERT INTO deid_lineage_heads (dataset, seq, blob) VALUES (%s, %s, %s) ON CONFLICT (dataset) "
                        "DO UPDATE SET seq = EXCLUDED.seq, blob = EXCLUDED.blob", (self.dataset, seq, head))
        self._tx(op, write=True)

    def _insert_images(self, pack: str, rows: list[tuple[int, bytes]]) -> None:
        def op(cur) -> None:
            cur.executemany("INSERT INTO deid_lineage_images (dataset, pack, \"offset\", blob) VALUES (%s, %s, %s, %s) "
                            "ON CONFLICT DO NOTHING", [(self.dataset, pack, o, b) for o, b in rows])
        self._tx(op, write=True)

    def write_pack(self, pack: str, records) -> list[tuple[int, int]]:
        """Insert the sealed ``records`` of ``pack`` (a batch per transaction, never all in memory); (offset, length) each."""
        at: list[tuple[int, int]] = []
        batch: list[tuple[int, bytes]] = []
        offset = _PACK_HEADER
        for blob in records:
            batch.append((offset, blob))
            at.append((offset, len(blob)))
            offset += len(blob)
            if len(batch) >= _IMAGE_BATCH:
                self._insert_images(pack, batch)
                batch = []
        if batch:
            self._insert_images(pack, batch)
        return at

    def import_pack(self, pack: str, rows: list[tuple[int, bytes]]) -> None:
        """Rows (offset, sealed record) of a file registry's pack (an import; existing rows are kept)."""
        for a in range(0, len(rows), _IMAGE_BATCH):
            self._insert_images(pack, rows[a:a + _IMAGE_BATCH])

    def read_images(self, pack: str, at: list[tuple[int, int]]) -> list[bytes]:
        """The sealed records of ``pack`` at (offset, length) each, in one query."""
        def op(cur):
            cur.execute("SELECT \"offset\", blob FROM deid_lineage_images WHERE dataset = %s AND pack = %s AND "
                        "\"offset\" = ANY(%s)", (self.dataset, pack, [o for o, _ in at]))
            return {int(o): bytes(b) for o, b in cur.fetchall()}
        got = self._tx(op, write=False)
        missing = [o for o, _ in at if o not in got]
        if missing:
            raise LineageError(f"lineage registry {self.describe()}: {len(missing)} stored averages of pack {pack} are "
                               "missing; restore the registry from backup")
        return [got[o] for o, _ in at]

    def import_entries(self, entries: list[tuple[int, bytes]], head: bytes) -> None:
        """Insert a verified file registry's entries and HEAD in one transaction, if the dataset has none yet."""
        def op(cur) -> None:
            cur.execute("SELECT count(*) FROM deid_lineage_entries WHERE dataset = %s", (self.dataset,))
            if cur.fetchone()[0]:
                return  # another process imported it first
            for seq, blob in entries:
                cur.execute("INSERT INTO deid_lineage_entries (dataset, seq, blob) VALUES (%s, %s, %s)",
                            (self.dataset, seq, blob))
            cur.execute("INSERT INTO deid_lineage_heads (dataset, seq, blob) VALUES (%s, %s, %s) ON CONFLICT (dataset) "
                        "DO UPDATE SET seq = EXCLUDED.seq, blob = EXCLUDED.blob", (self.dataset, entries[-1][0], head))
        self._tx(op, write=True)
