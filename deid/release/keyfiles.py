"""Checks shared by the files that hold secret keys (the signing key and the linkage key)."""
from __future__ import annotations

import stat
from pathlib import Path

from deid.errors import ConfigError


def check_private_key_file(path: Path, *, kind: str, create_hint: str, regular_hint: str, noun: str = "key") -> None:
    """Refuse a missing, non-regular, or group/other readable or writable key file.

    ``kind`` names the key in the errors ("signing", "linkage"); ``create_hint`` and
    ``regular_hint`` say what to do when the file is missing or not a regular file;
    ``noun`` is what must be 0600 ("key", "private key").
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{kind} key file {path} does not exist; {create_hint}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{kind} key {path} is not a regular file; {regular_hint}")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"{kind} key file {path} has mode {mode:04o}, readable or writable by group or others; "
            f"a {noun} must be 0600: run `chmod 600 {path}`"
        )
