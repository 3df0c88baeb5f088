"""What anchors a dataset's lineage outside its registry: the registry heads named by signed reports,
and the releases published on disk.

The registry (:mod:`deid.release.lineage_registry`) detects every local tamper but two: the whole
directory deleted, and the directory restored from an earlier copy (HEAD and tail rolled back
together). Both leave a valid, shorter chain. A run that then releases the same people again is
planned without the clusters the lost entries held, and the differencing of two releases recovers
faces (the composition attack, Ganta, Kasiviswanathan & Smith, KDD 2008; measured on London: a
person leaving between two releases made on a restored registry, 6 m2 - 5 m3, 1.8 grey levels).

So every signed report of a lineage run names the registry head it leaves behind
(``lineage.registry_head``: ``{seq, hash}``, the chain hash after entry ``seq``), and before a run
:func:`check_registry_head` compares the registry against the highest head any signed report of the
dataset names (:func:`signed_lineage`, signatures verified with the project's public key): a registry
that does not reach that entry, or reaches it with another chain hash, is refused. A chain hash
commits to every entry before it, so the highest head covers the earlier reports too.

:func:`signed_lineage` also lists the releases of the dataset published on disk (signed
``released``, their directory present): :func:`read_published_averages` reads each one's released
images and cluster ids, so the differencing attack (:func:`deid.release.published_differencing.published_differencing_attack`)
also runs against releases the registry does not remember.
"""
from __future__ import annotations

import base64
import binascii
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deid.errors import ConfigError
from deid.release.lineage_state import GENESIS_PREV, LineageError, LineageState
from deid.release.signing import verify_bytes

logger = logging.getLogger(__name__)

__all__ = ["PublishedAverages", "SignedHead", "SignedLineage", "chain_hash_at", "check_registry_head", "head_doc",
           "read_published_averages", "signed_lineage"]

_REPORT = "report.json"
_SIGNATURE = "report.json.sig"
_ADDENDUM = "addendum.json"
_RELEASE_TABLE = "release.parquet"


@dataclass(frozen=True)
class SignedHead:
    """A registry head (entry ``seq``, chain hash ``hash``) named by the signed report of ``release_id``."""

    seq: int
    hash: str
    release_id: str


@dataclass(frozen=True)
class SignedLineage:
    """What the verified signed reports of one dataset say: the highest registry head any of them names,
    and the releases published (signed ``released``, no addendum annulling them, their directory present)."""

    head: SignedHead | None
    published: tuple[str, ...]
    reports: int          # verified reports of the dataset
    unverified: int       # reports of the dataset whose signature did not verify (ignored)


def signed_lineage(reports_dir: Path, releases_dir: Path, dataset: str, public_key) -> SignedLineage:
    """Scan ``reports_dir`` for the signed reports of ``dataset`` (``lineage.dataset``).

    Parameters
    ----------
    reports_dir, releases_dir : Path
        The project's ``reports/`` and ``data/releases/``.
    dataset : str
        The lineage's dataset name.
    public_key : Ed25519PublicKey
        The project's signing public key: a report whose signature does not verify under it is
        ignored (logged), so a forged report can neither block nor unblock a lineage.
    """
    head: SignedHead | None = None
    published: list[str] = []
    n = bad = 0
    root = Path(reports_dir)
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        path = d / _REPORT
        if not path.is_file():
            continue
        try:
            payload = path.read_bytes()
            report = json.loads(payload)
        except (OSError, ValueError):
            continue
        lin = report.get("lineage") if isinstance(report, dict) else None
        if not isinstance(lin, dict) or lin.get("dataset") != dataset:
            continue
        sig = d / _SIGNATURE
        try:
            ok = sig.is_file() and verify_bytes(payload, base64.b64decode(sig.read_bytes().strip(), validate=True),
                                                public_key)
        except (OSError, ValueError, binascii.Error):
            ok = False
        if not ok:
            bad += 1
            logger.warning("lineage %s: report %s is not signed by the project's key; ignored", dataset, d.name)
            continue
        n += 1
        rid = str(report.get("release_id", d.name))
        h = lin.get("registry_head")
        if (isinstance(h, dict) and isinstance(h.get("seq"), int) and isinstance(h.get("hash"), str)
                and (head is None or h["seq"] > head.seq)):
            head = SignedHead(int(h["seq"]), str(h["hash"]), rid)
        if (report.get("verdict") == "released" and not (d / _ADDENDUM).exists()
                and (Path(releases_dir) / rid / _RELEASE_TABLE).is_file()):
            published.append(rid)
    return SignedLineage(head, tuple(published), n, bad)


def chain_hash_at(state: LineageState, seq: int) -> str | None:
    """The registry's chain hash after entry ``seq`` (None when the registry does not reach it)."""
    if seq > state.seq:
        return None
    if seq < 0:
        return GENESIS_PREV
    if seq == state.seq:
        return state.head
    return str(state.entries[seq + 1].get("prev"))


def check_registry_head(state: LineageState, head: SignedHead | None, *, where: str = "") -> None:
    """Refuse a registry older than the newest head a signed report names (rolled back, or deleted).

    Raises
    ------
    LineageError
        The registry ends before entry ``head.seq`` (missing, or restored from an earlier copy), or its
        chain hash there is not the signed one (replaced by another chain).
    """
    if head is None:
        return
    got = chain_hash_at(state, head.seq)
    if got == head.hash:
        return
    at = where or f"of dataset {state.dataset!r}"
    if state.seq < 0:
        what = "is missing (no entry)"
    elif got is None:
        what = f"ends at entry {state.seq:08d}: it was rolled back (restored from an earlier copy)"
    else:
        what = f"has another chain hash at entry {head.seq:08d} ({got[:12]}...): it was replaced"
    raise LineageError(
        f"lineage registry {at} {what}, but the signed report of release {head.release_id} names registry "
        f"head entry {head.seq:08d} (hash {head.hash[:12]}...); releasing on it would re-cluster people already "
        "released; restore the registry from a backup that reaches that entry (or, to retire the lineage for "
        "good, use a new dataset name)")


@dataclass(frozen=True)
class PublishedAverages:
    """The released averages of one published release as an attacker reads them: one row per cluster id
    (every member carries the same image), and the number of records released with it."""

    release_id: str
    cluster_ids: tuple[str, ...]
    images: np.ndarray            # (n_clusters, n_pixels) uint8, grey
    sizes: tuple[int, ...]


def read_published_averages(release_dir: Path, shape_hw: tuple[int, int]) -> PublishedAverages:
    """Read a published release's ``release.parquet`` and one image per cluster id (greyscale).

    Raises
    ------
    ConfigError
        An image of another size than ``shape_hw`` (the release was made at another canonical size), or unreadable.
    """
    import cv2  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    release_dir = Path(release_dir)
    t = pq.read_table(release_dir / _RELEASE_TABLE, columns=["image", "cluster_id"]).to_pydict()
    first: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for img, cid in zip(t["image"], t["cluster_id"]):
        first.setdefault(cid, img)
        sizes[cid] = sizes.get(cid, 0) + 1
    keys = tuple(sorted(first))
    out = np.zeros((len(keys), int(shape_hw[0]) * int(shape_hw[1])), np.uint8)
    for n, cid in enumerate(keys):
        im = cv2.imread(str(release_dir / first[cid]), cv2.IMREAD_GRAYSCALE)
        if im is None or tuple(im.shape) != tuple(shape_hw):
            raise ConfigError(f"published release {release_dir.name}: image {first[cid]} is "
                              f"{None if im is None else im.shape}, not the canonical {tuple(shape_hw)}; it cannot be "
                              "differenced against this release")
        out[n] = im.reshape(-1)
    return PublishedAverages(release_dir.name, keys, out, tuple(sizes[c] for c in keys))


def head_doc(state: LineageState) -> dict[str, Any]:
    """``lineage.registry_head`` of a report: the registry's entry and chain hash as the run leaves it."""
    return {"seq": int(state.seq), "hash": str(state.head)}
