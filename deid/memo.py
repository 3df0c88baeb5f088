"""Content-keyed memoisation of pure computations that are repeated on identical inputs.

The comparison study (:mod:`deid.study`) judges every method at every strength with
the whole gate, so the same computations on the same originals come back at every point: the
eigenface fit of the drop, the originals' side of every utility protocol, the attackers fitted
on the originals, and the parrot attacker's re-run of the method on the very originals the
release was made from. A :class:`Memo` keys a result by a digest of its inputs' *content*
(never object identity), so a hit returns exactly what recomputing would: callers memoise only
deterministic functions of the keyed inputs. Memos are per process, bounded in bytes, and skip
inputs above :data:`MAX_KEY_BYTES` (a release flow's large drops gain nothing from hashing).
"""
from __future__ import annotations

import copy
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

logger = logging.getLogger(__name__)

# Inputs larger than this are not hashed or memoised (20 MB: a few thousand aligned faces).
MAX_KEY_BYTES = 20_000_000
# DEID_MEMO=0 turns every memo off (e.g. to time the unmemoised computations).
ENABLED = os.environ.get("DEID_MEMO", "1") != "0"


def _feed(h: Any, part: Any) -> None:
    if isinstance(part, np.ndarray):
        a = np.ascontiguousarray(part)
        h.update(f"nd{a.dtype.str}{a.shape}".encode())
        if a.dtype == object:
            h.update(repr([plain(v) for v in a.ravel().tolist()]).encode())
        else:
            h.update(a.data)
    elif isinstance(part, (list, tuple)):
        h.update(f"seq{type(part).__name__}{len(part)}(".encode())
        for p in part:
            _feed(h, p)
        h.update(b")")
    elif isinstance(part, dict):
        h.update(f"map{len(part)}(".encode())
        for k in sorted(part, key=repr):
            _feed(h, k)
            _feed(h, part[k])
        h.update(b")")
    else:
        h.update(repr(plain(part)).encode())
    h.update(b"|")


def plain(v: Any) -> Any:
    """numpy scalars as the Python values they hold, so np.str_('a') and 'a' key alike."""
    return v.item() if isinstance(v, np.generic) else v


def size_of(*parts: Any) -> int:
    """Bytes of the array parts (what hashing them costs)."""
    return sum(p.nbytes for p in parts if isinstance(p, np.ndarray))


def digest(*parts: Any) -> bytes:
    """A 20-byte digest of arrays (dtype, shape, bytes), sequences, mappings and plain values."""
    h = hashlib.blake2b(digest_size=20, person=b"deid-memo")
    for p in parts:
        _feed(h, p)
    return h.digest()


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 64


class Memo:
    """A thread-safe LRU of results keyed by :func:`digest`, holding at most ``max_bytes`` of arrays.

    Values are deep-copied in and out, so a caller mutating a result cannot change the memo.
    ``hits`` and ``misses`` count lookups (for timing reports and tests).
    """

    def __init__(self, name: str, *, max_bytes: int = 64_000_000):
        self.name = name
        self.max_bytes = max_bytes
        self._data: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_compute(self, key: bytes | None, compute: Callable[[], Any]) -> Any:
        """The memoised value for ``key``, computing (and remembering) it on a miss; None key = no memo."""
        if key is None or not ENABLED:
            return compute()
        with self._lock:
            hit = self._data.get(key)
            if hit is not None:
                self._data.move_to_end(key)
                self.hits += 1
                return copy.deepcopy(hit[0])
            self.misses += 1
        value = compute()
        size = _nbytes(value)
        if size <= self.max_bytes // 4:
            with self._lock:
                if key not in self._data:
                    self._data[key] = (copy.deepcopy(value), size)
                    self._bytes += size
                while self._bytes > self.max_bytes and self._data:
                    _, (_, s) = self._data.popitem(last=False)
                    self._bytes -= s
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0
            self.hits = self.misses = 0


def key_for_size(*parts: Any) -> bool | None:
    """True when ``parts`` may be memoised (memos on, arrays within :data:`MAX_KEY_BYTES`), else None."""
    return True if ENABLED and size_of(*parts) <= MAX_KEY_BYTES else None


def key_for(*parts: Any) -> bytes | None:
    """:func:`digest` of ``parts``, or None (do not memoise) when their arrays exceed :data:`MAX_KEY_BYTES`."""
    if not ENABLED or size_of(*parts) > MAX_KEY_BYTES:
        return None
    return digest(*parts)


class RowCache:
    """A process-wide LRU of per-row results (one face's descriptor, histogram...) keyed by the row's bytes.

    A row's result that depends on that row alone is computed once per process, whatever copies
    of the row the callers pass: each row is keyed by ``base`` (a hash object already fed the
    computation's parameters) extended with the row's bytes.
    """

    def __init__(self, max_items: int):
        self.max_items = max_items
        self._data: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            v = self._data.get(key)
            if v is not None:
                self._data.move_to_end(key)
            return v

    def put(self, key: bytes, value: np.ndarray) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.max_items:
                self._data.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    @staticmethod
    def keys(rows: np.ndarray, base: Any) -> list[bytes]:
        """Each row's key: ``base`` (a hashlib object) extended with the row's bytes."""
        out = []
        for row in np.ascontiguousarray(rows):
            h = base.copy()
            h.update(row.data)
            out.append(h.digest())
        return out

    def fill(self, out: np.ndarray, keys: list[bytes]) -> dict[bytes, list[int]]:
        """Copy the cached results into ``out``'s rows; the rest as {key: rows with that key}, first seen first."""
        todo: dict[bytes, list[int]] = {}
        for i, k in enumerate(keys):
            hit = self.get(k) if k not in todo else None
            if hit is not None:
                out[i] = hit
            else:
                todo.setdefault(k, []).append(i)
        return todo



class RowStore:
    """Per-row results kept on disk between processes and runs, keyed as :class:`RowCache` keys them (opt-in).

    Off unless the environment variable ``env`` names a directory. For work that embeds the same faces
    again in other processes: a comparison study, a test suite, a steward re-running a drop with another
    setting. A row found here is not recomputed; only results that are a deterministic function of the
    key (the computation's parameters and the row's bytes) may be stored, so a hit is what recomputing
    would give. One SQLite file per ``name`` (the computation and its model's version), shared by
    concurrent processes. A store that cannot be read or written (locked past its timeout, a full disk, a
    damaged file) counts as a miss and is logged: it never fails or changes the computation.

    What it holds are the results themselves: for face descriptors, biometric templates of the faces.
    Point ``env`` at private storage and remove the directory when the work is done.
    """

    TIMEOUT = 10.0  # seconds a process waits for another's write before counting a miss
    CHUNK = 500  # keys per query (SQLite's bound-parameter limit is far above)

    def __init__(self, name: str, env: str):
        self.name = name
        self.env = env

    def path(self) -> str | None:
        """The store's file, or None when the store is off (read from the environment at each call)."""
        directory = os.environ.get(self.env, "").strip()
        return os.path.join(directory, f"{self.name}.sqlite") if directory else None

    def _connect(self, path: str):
        import sqlite3  # noqa: PLC0415 - only when the store is on

        os.makedirs(os.path.dirname(path), exist_ok=True)
        con = sqlite3.connect(path, timeout=self.TIMEOUT)
        con.execute("CREATE TABLE IF NOT EXISTS rows (key BLOB PRIMARY KEY, value BLOB NOT NULL)")
        return con

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """The stored values of those ``keys`` the store holds ({} when it is off or cannot be read)."""
        path = self.path()
        if path is None or not keys:
            return {}
        import sqlite3  # noqa: PLC0415

        found: dict[bytes, bytes] = {}
        try:
            con = self._connect(path)
            try:
                for s in range(0, len(keys), self.CHUNK):
                    part = keys[s:s + self.CHUNK]
                    rows = con.execute(f"SELECT key, value FROM rows WHERE key IN ({','.join('?' * len(part))})",
                                       part).fetchall()
                    found.update((bytes(k), bytes(v)) for k, v in rows)
            finally:
                con.close()
        except (sqlite3.Error, OSError) as exc:
            logger.warning("row store %s not read (%s): computing instead", path, exc)
            return {}
        return found

    def put_many(self, items: dict[bytes, bytes]) -> None:
        """Store ``items`` (key -> value bytes); a key already stored keeps its value. Nothing when off."""
        path = self.path()
        if path is None or not items:
            return
        import sqlite3  # noqa: PLC0415

        try:
            con = self._connect(path)
            try:
                with con:
                    con.executemany("INSERT OR IGNORE INTO rows (key, value) VALUES (?, ?)", list(items.items()))
            finally:
                con.close()
        except (sqlite3.Error, OSError) as exc:
            logger.warning("row store %s not written (%s): its rows will be computed again", path, exc)
