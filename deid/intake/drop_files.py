"""Opening a drop's files safely: every path component opened without following a link, a FIFO or
device never blocking (:func:`open_drop_file`), whole files read with one ``read`` (:func:`read_drop_file`),
and a drop's directory descriptors kept for the next file (:class:`DropDirectories`).

A problem with one file is a :class:`~deid.errors.RecordError` (its record is quarantined);
:func:`read_drop_text` makes one of ``manifest.csv`` / ``drop.yaml`` a :class:`~deid.errors.DropError`.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from deid.errors import DropError, RecordError


class DropDirectories:
    """Directory descriptors of one drop, each opened as :func:`open_drop_file` opens it, kept for the next file.

    Reading a drop of a million files component by component opens every directory on every path
    again (three ``open`` calls a file for ``images/x.jpg``): the ingest keeps the directories it
    opened, at most ``size`` of them (least recently used closed first). A kept directory was opened
    with ``O_NOFOLLOW`` at its first use; every file is still opened afresh, without following a link,
    at the moment it is read. One cache per thread: descriptors are not shared between threads.
    """

    def __init__(self, *, size: int = 64):
        self.size = max(1, int(size))
        self._fds: dict[tuple[str, ...], int] = {}  # insertion order = least recently used first

    def nearest(self, parts: tuple[str, ...]) -> tuple[int, int | None]:
        """(i, fd): the longest kept prefix ``parts[:i]`` of a directory path and its descriptor (or (0, None))."""
        for i in range(len(parts), -1, -1):
            fd = self._fds.pop(parts[:i], None)
            if fd is not None:
                self._fds[parts[:i]] = fd  # most recently used
                return i, fd
        return 0, None

    def keep(self, parts: tuple[str, ...], fd: int) -> None:
        """Keep ``fd``, the directory ``parts`` (the cache owns it from now on)."""
        self._fds[parts] = fd
        while len(self._fds) > self.size:
            oldest = next(iter(self._fds))
            os.close(self._fds.pop(oldest))

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __enter__(self) -> "DropDirectories":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_drop_file(root: str | os.PathLike, relative: str, *, dirs: DropDirectories | None = None) -> int:
    """Open the drop file ``root/relative`` read-only as a regular file; return the fd (the caller closes it).

    The one way a drop file is opened (manifest, drop.yaml, images, points, feature tables; also
    by the orchestration's row count and the rejection's fingerprint). Each component is opened
    with ``O_NOFOLLOW`` relative to its parent's descriptor, so a file swapped for a symlink after
    the manifest was read is refused at the moment of reading; the last one with ``O_NONBLOCK`` and
    checked with ``fstat`` to be a regular file, so a FIFO or device is refused at once instead of
    blocking the run forever waiting for a writer. ``dirs`` (the ingest's, for ``root``) keeps the
    directories on the way open for the next file (:class:`DropDirectories`).

    Raises
    ------
    RecordError
        ``unsafe_path`` (``..``, absolute, a symlink), ``missing_file``, ``not_regular_file``
        (FIFO, device, directory), ``unreadable_file``.
    """
    return _open_drop_file(root, relative, dirs=dirs)[0]


def _open_drop_file(root: str | os.PathLike, relative: str, *,
                    dirs: DropDirectories | None = None) -> tuple[int, int]:
    """:func:`open_drop_file`, with the size ``fstat`` gave at opening."""
    parts = tuple(p for p in str(relative).split("/") if p and p != ".")  # PurePosixPath's parts, once per file
    if not parts or str(relative).startswith("/") or ".." in parts:
        raise RecordError("unsafe_path", f"path {relative!r} must be a relative path inside the drop")
    start, fd = dirs.nearest(parts[:-1]) if dirs is not None else (0, None)
    owned = fd is None  # a descriptor from ``dirs`` belongs to it and is never closed here
    if fd is None:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        if dirs is not None:
            dirs.keep((), fd)
            owned = False
    try:
        for i in range(start, len(parts)):
            part, last = parts[i], i == len(parts) - 1
            # O_NONBLOCK: opening a FIFO must not wait for a writer.
            flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                nfd = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                where = "/".join(parts[: i + 1])
                if exc.errno == errno.ENOENT:
                    raise RecordError("missing_file", f"{relative!r} does not exist in the drop") from None
                if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(Path(root).joinpath(*parts[: i + 1]))):
                    raise RecordError("unsafe_path", f"{where!r} is a symlink; drop files are read without "
                                                     "following links (copy the file into the drop)") from None
                if exc.errno == errno.ENOTDIR:
                    raise RecordError("missing_file", f"{relative!r} does not exist in the drop ({where!r} is not a directory)") from None
                raise RecordError("unreadable_file", f"{relative!r} could not be opened: {os.strerror(exc.errno)}") from None
            if owned:
                os.close(fd)
            fd, owned = nfd, True
            if dirs is not None and not last:
                dirs.keep(parts[: i + 1], fd)
                owned = False
        st = os.fstat(fd)
        mode = st.st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise RecordError("not_regular_file", f"{relative!r} is {kind}, not a regular file")
        out, fd = fd, -1
        return out, st.st_size
    finally:
        if fd != -1 and owned:
            os.close(fd)


def read_drop_file(root: Path, relative: str, *, dirs: DropDirectories | None = None) -> bytes:
    """The bytes of one drop file, opened with :func:`open_drop_file` (no symlink followed, never blocking)."""
    fd, size = _open_drop_file(root, relative, dirs=dirs)
    try:
        # One read of the size fstat gave, no buffered file object per file; a file that grew, shrank
        # or was read short is read to its end.
        data = os.read(fd, size + 1)
        if len(data) == size:
            return data
        chunks = [data]
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise RecordError("unreadable_file", f"{relative!r} could not be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_drop_text(root: Path, name: str) -> bytes | None:
    """``manifest.csv`` / ``drop.yaml`` bytes (None if absent); a symlink or non-file is a DropError."""
    try:
        return read_drop_file(root, name)
    except RecordError as exc:
        if exc.code == "missing_file":
            return None
        raise DropError(f"{root / name}: {exc.message}; it must be a regular file inside the drop") from None
