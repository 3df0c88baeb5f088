"""The would-be release inside the staging directory (:class:`Staged`): the stage step's output, which the gate,
the report and the publish step read.

It lives in the release layer, not in :mod:`deid.contracts`, because it holds the release's file records
(:mod:`deid.release.hashing`, :mod:`deid.release.manifest`): a base module naming them would make every layer
below depend on the release layer.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deid.evaluation.checks import Check
from deid.release.hashing import Artifact, FileManifest
from deid.release.manifest import ReleaseFiles


@dataclass(frozen=True)
class Staged:
    """The would-be release inside the staging directory, validated, with its linkage record beside it.

    ``artifacts`` lists every release file outside the manifest's directories (the manifest
    included), ``manifest`` describes ``MANIFEST.sha256`` (the images) and ``images`` holds the
    images' (path, sha256, bytes) as columns (:class:`~deid.release.manifest.ReleaseFiles`).
    """

    dir: Path
    artifacts: tuple[Artifact, ...]
    columns: tuple[str, ...]
    records: int
    validation: Mapping[str, Any]
    checks: tuple[Check, ...]
    file_metadata: Mapping[str, list[str]]
    linkage: Path
    videos: tuple[str, ...] = ()  # videos/<random id>.avi, one per image sequence
    manifest: FileManifest | None = None
    images: ReleaseFiles | None = None
