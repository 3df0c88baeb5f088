"""The registered lineage of a dataset: its clusters, their stored averages, its releases and entries.

A dataset's lineage (:mod:`deid.release.lineage`) is replayed from the registry's hash-chained entries
(:func:`replay`; the encrypted store is :mod:`deid.release.lineage_registry`) into a
:class:`LineageState`: every registered cluster (:class:`LineageCluster`: its basis records, its
stored average, kept on disk and read when asked through :class:`StoredImage`), each release's counts
(:class:`ReleaseSummary`), and the maps from records and people to clusters. Identities are keyed
pseudonyms (:func:`pseudonymize`, HMAC-SHA256 under a key HKDF-derived per dataset and purpose from the
steward's linkage key: :func:`derive_key`); records are the SHA-256 of their source bytes. The policy
and reason codes the plan and the report share are defined here too.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import logging
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from deid.errors import ConfigError, StateError
from deid.intake.drop import check_dataset_name

logger = logging.getLogger(__name__)

POLICIES = ("invariant", "release-once")

# How a lineage's faces are released: every release of a dataset keeps the mode of its first registered
# clusters (a returning person's image is bit-identical, so a colour cluster is never republished in grey).
COLOUR_MODES = ("colour", "grey")
ABSENT_POLICIES = ("republish", "suppress")

# A registered cluster that this run's merges (identity resolution, or registered bytes under another steward id)
# leave with fewer than k people, or with one person above 1/k of its averaged records: withheld from this release
# (its records suppressed), or the run refused (the gate's lineage_merges check fails). Either way it is never
# republished while the merge holds.
MERGE_POLICIES = ("withhold", "refuse")
ENTRY_FORMAT = "deid-lineage-entry-v1"
GENESIS_PREV = "0" * 64
KEY_BYTES = 32

# Suppression reasons of single records (stable codes: the report counts them).
WAITING = "waiting_for_k_new_people"
RELEASED_BEFORE = "released_before"  # release-once
PARTITION_MISMATCH = "returning_partition_mismatch"
CLUSTER_SUPPRESSED = "registered_cluster_suppressed"
SURPLUS = "returning_surplus_over_1_k"   # absent=suppress: a returning person's rows above 1/k of the cluster

# Reasons a registered cluster is not republished.
MEMBER_ABSENT = "member_absent"
BELOW_K = "registered_cluster_below_k"
RETIRED = "release_once"
MERGED_BELOW_K = "merged_below_k"          # this run's merges leave fewer than k people among its basis records
MERGED_OVER_SHARE = "merged_over_1_k"      # ... or one person holding more than 1/k of them


class LineageError(StateError):
    """A lineage registry that is corrupt, tampered with, or inconsistent with the release asked for."""


def derive_key(key: bytes, dataset: str, purpose: str) -> bytes:
    """A 32-byte key for one ``purpose`` ("pseudonym", "encrypt", "head") of one dataset.

    HKDF-SHA256 (RFC 5869) of the steward's key: separate keys per purpose, and per dataset so that
    the pseudonym of a person in two datasets differs (the registries cannot be joined).
    """
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else type(key).__name__
        raise ConfigError(f"lineage key must be {KEY_BYTES} bytes (the linkage key), got {got}; "
                          "load it with deid.release.linkage.ensure_linkage_key or load_linkage_key")
    info = f"deid-lineage-v1|{purpose}|{check_dataset_name(dataset)}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=b"deid-lineage", info=info).derive(bytes(key))


def pseudonymize(key: bytes, dataset: str, people: Sequence[Hashable]) -> list[str]:
    """HMAC-SHA256 pseudonym (hex) of each person id, keyed by the dataset's pseudonym key."""
    pkey = derive_key(key, dataset, "pseudonym")
    # One HMAC and one str per distinct person, shared by their records (issue 13: a million records'
    # pseudonyms were a million 113-byte strings kept from the partition stage to the registration).
    memo: dict[str, str] = {}
    out = []
    for p in people:
        s = str(p)
        h = memo.get(s)
        if h is None:
            h = memo[s] = hmac.new(pkey, s.encode("utf-8"), hashlib.sha256).hexdigest()
        out.append(h)
    return out


def image_sha256(image: np.ndarray) -> str:
    """SHA-256 of a released image's uint8 pixel bytes (row-major): PNG bytes may vary, pixels do not."""
    return hashlib.sha256(np.ascontiguousarray(image, dtype=np.uint8).tobytes()).hexdigest()


# Stored averages: a uint8 image (faces) or a float vector (feature drops), kept in its released dtype.
VECTOR_DTYPES = ("<f4", "<f8")


class StoredImage:
    """A stored average kept outside memory and read on demand (issue 13: a million faces register
    200,000 averages, 1.5 GB of pixels, which no stage should hold at once).

    ``source.read_image(key)`` returns the pixels (a row of a :class:`deid.operations.worker_rows.RowFile`
    in the staging directory, or a sealed side file of the registry, verified against ``sha256`` when
    read); ``sha256`` is :func:`average_sha256` of them, known without reading. ``np.asarray`` reads
    it (nothing is cached), so a cluster holding one behaves as one holding the array. Picklable when
    its source is.
    """

    __slots__ = ("source", "key", "sha256", "size", "dtype")
    ndim = 1

    def __init__(self, source: Any, key: Any, *, sha256: str, size: int, dtype: Any = np.uint8):
        self.source, self.key, self.sha256 = source, key, str(sha256)
        self.size, self.dtype = int(size), np.dtype(dtype)

    def __getstate__(self):
        return (self.source, self.key, self.sha256, self.size, self.dtype.str)

    def __setstate__(self, state) -> None:
        self.source, self.key, self.sha256, self.size, dtype = state
        self.dtype = np.dtype(dtype)

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    def __len__(self) -> int:
        return self.size

    def _decode(self, raw: Any) -> np.ndarray:
        if isinstance(raw, bytes | bytearray | memoryview):
            return np.frombuffer(raw, dtype=self.dtype).reshape(self.size)
        return np.asarray(raw, dtype=self.dtype).reshape(self.size)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self._decode(self.source.read_image(self.key))
        return a if dtype is None else a.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"StoredImage({self.sha256[:12]}..., {self.size} x {self.dtype})"


def stored_rows(images: Sequence[Any], idx: Any) -> np.ndarray:
    """The averages ``images[idx]`` stacked (``idx`` a slice or integer indices), each source read once per call.

    :class:`StoredImage` rows of a source with a batch reader (``source.read_images(keys)``: a RowFile,
    the registry's sealed averages) are read in one call per source; other entries through
    ``np.asarray``. Issue 13: a matrix of every released average is never built.
    """
    pos: Any = range(len(images))[idx] if isinstance(idx, slice) else np.asarray(idx, dtype=np.int64).reshape(-1)
    pos = list(pos) if isinstance(pos, range) else pos.tolist()
    if not pos:
        return np.zeros((0, images[0].shape[0] if len(images) else 0), dtype=np.uint8)
    first = images[pos[0]]
    out = np.empty((len(pos), first.shape[0]), dtype=first.dtype)
    by_source: dict[int, tuple[Any, list[int], list[Any]]] = {}
    for n, i in enumerate(pos):
        img = images[i]
        if isinstance(img, StoredImage) and hasattr(img.source, "read_images"):
            _, ns, keys = by_source.setdefault(id(img.source), (img.source, [], []))
            ns.append(n)
            keys.append(img.key)
        else:
            out[n] = np.asarray(img)
    for source, ns, keys in by_source.values():
        for n, raw in zip(ns, source.read_images(keys)):
            out[n] = images[pos[n]]._decode(raw)
    return out


def as_stored(average: np.ndarray) -> np.ndarray:
    """The stored average as kept: uint8 pixels, or a vector in its little-endian float dtype."""
    a = np.asarray(average)
    if a.dtype == np.uint8:
        return a
    if a.dtype.kind != "f" or a.dtype.itemsize not in (4, 8):
        raise ConfigError(f"a stored average has dtype {a.dtype}; pass uint8 images or float32/float64 vectors "
                          "as released")
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))


def average_sha256(average: np.ndarray) -> str:
    """SHA-256 of a released average's exact bytes: uint8 pixels (:func:`image_sha256`), or a feature
    vector's little-endian float32/float64 bytes as released (no rounding: the bytes are the release)."""
    if isinstance(average, StoredImage):
        return average.sha256   # hashed when it was stored (and verified when a sealed one is read)
    a = as_stored(average)
    return image_sha256(a) if a.dtype == np.uint8 else hashlib.sha256(a.tobytes()).hexdigest()


@dataclass(frozen=True, eq=False)
class LineageCluster:
    """One released cluster as the lineage records it.

    ``members`` is the *basis*: (source fingerprint, person pseudonym) of every record averaged
    into ``image``. A republished cluster keeps its basis; records released with it later (new
    photos of returning people) are in :attr:`LineageState.record_cluster` but not averaged.
    """

    key: str                      # stable id "<release_id>/<n>"
    release_id: str               # the release that created it
    members: frozenset[tuple[str, str]]   # (sha256 of source bytes, pseudonym) of each basis record
    image: np.ndarray             # uint8 (n_pixels,), or a float (dim,) feature vector: the released average, stored
    shape: tuple[int, ...]        # (height, width), or (dim,) for a feature vector
    partition: tuple[str, ...]    # utility label values of the cluster (counterfeits carry them)
    n_released: int               # records released with it when it was created
    k: int
    method: str
    label_names: tuple[str, ...] = ()
    # fingerprint -> released label values (in ``label_names`` order) of each basis record; None: registered
    # before the registry kept labels (its label mix cannot be reproduced).
    member_labels: Mapping[str, tuple[str, ...]] | None = None
    # A colour release (DEID_COLOR): the released BGR average, uint8 (height * width * 3,), row-major, stored
    # like ``image``; ``image`` is then its grey (what the gate attacked). None: released in grey.
    color: Any = None

    @property
    def image_sha256(self) -> str:
        return average_sha256(self.image)

    @property
    def color_sha256(self) -> str | None:
        """SHA-256 of the released colour average's bytes; None for a grey cluster."""
        return None if self.color is None else average_sha256(self.color)

    def released(self, color: bool) -> Any:
        """The average a release in ``color`` (True: colour, False: grey) publishes for this cluster.

        Raises
        ------
        ConfigError
            A colour release asks for a cluster registered in grey: its colour was never released, and
            a returning person's image must stay the registered one (invariant 2).
        """
        if not color:
            return self.image
        if self.color is None:
            raise ConfigError(f"registered cluster {self.key} was released in grey; a colour release cannot "
                              "republish it (its people's image would change): release this dataset in grey "
                              "(unset DEID_COLOR: auto follows the lineage's mode)")
        return self.color

    @property
    def records(self) -> frozenset[str]:
        """Fingerprints of the basis records."""
        return frozenset(f for f, _ in self.members)

    @property
    def people(self) -> frozenset[str]:
        """Pseudonyms of the basis people."""
        return frozenset(p for _, p in self.members)

    def labels_for(self, label_names: Sequence[str]) -> dict[str, tuple[str, ...]] | None:
        """Registered labels of each basis record, projected on ``label_names``; None when not registered.

        None for a cluster registered before the registry kept labels, or when a label asked for was
        not a label of the release that registered it.
        """
        if self.member_labels is None or not set(label_names) <= set(self.label_names):
            return None
        pos = [self.label_names.index(x) for x in label_names]
        return {f: tuple(v[j] for j in pos) for f, v in self.member_labels.items()}

    def to_json(self, *, image_at: Mapping[str, Any] | None = None,
                color_at: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The entry's form of the cluster: the stored average inline (base64), or with ``image_at`` where
        the registry sealed it beside the entries (its hash in the entry: the chain covers it). A colour
        cluster adds ``color_sha256`` and its colour average the same way (inline ``color``, or ``color_at``)."""
        dtype = np.dtype(self.image.dtype)
        # A feature vector also records its dtype; an image entry keeps the original form (no "dtype").
        vector = {} if dtype == np.uint8 else {"dtype": dtype.newbyteorder("<").str}
        image = ({"image_at": dict(image_at)} if image_at is not None else
                 {"image": base64.b64encode(as_stored(self.image).tobytes()).decode()})
        out = {"key": self.key, "release_id": self.release_id, "members": sorted(map(list, self.members)),
               "image_sha256": self.image_sha256, **image, **vector,
               "shape": list(self.shape), "partition": list(self.partition), "n_released": self.n_released,
               "k": self.k, "method": self.method}
        if self.member_labels is not None:
            out["label_names"] = list(self.label_names)
            out["member_labels"] = sorted([f, list(v)] for f, v in self.member_labels.items())
        if self.color is not None:
            out["color_sha256"] = self.color_sha256
            if color_at is not None:
                out["color_at"] = dict(color_at)
            else:
                out["color"] = base64.b64encode(as_stored(self.color).tobytes()).decode()
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, images: Any = None) -> "LineageCluster":
        """The cluster of an entry; ``images`` reads averages sealed beside the entries (``image_at``):
        they stay there, read when asked (:class:`StoredImage`); inline ones (older registries) are decoded."""
        dtype = str(d.get("dtype", "|u1"))
        if dtype not in ("|u1", *VECTOR_DTYPES):
            raise LineageError(f"registered cluster {d.get('key')}: stored average dtype {dtype!r} is not uint8, "
                               "float32 or float64; the registry is corrupt")
        image: Any
        if "image" in d:
            image = np.frombuffer(base64.b64decode(d["image"]), dtype=np.dtype(dtype)).copy()
        elif "image_at" in d and images is not None:
            image = StoredImage(images, (str(d["image_at"]["pack"]), int(d["image_at"]["offset"]),
                                         int(d["image_at"]["length"]), str(d["image_sha256"])),
                                sha256=d["image_sha256"], size=int(np.prod([int(x) for x in d["shape"]])),
                                dtype=np.dtype(dtype))
        elif "image_at" in d:
            raise LineageError(f"registered cluster {d.get('key')}: its stored average is sealed beside the registry's "
                               "entries; load the registry with deid.release.lineage_registry.Registry.load")
        else:
            raise LineageError(f"registered cluster {d.get('key')}: no stored average; the registry is corrupt")
        c = cls(key=d["key"], release_id=d["release_id"], members=frozenset((f, p) for f, p in d["members"]),
                image=image, shape=tuple(int(x) for x in d["shape"]),
                partition=tuple(d["partition"]), n_released=int(d["n_released"]), k=int(d["k"]),
                method=str(d["method"]), label_names=tuple(d.get("label_names", ())),
                member_labels=None if "member_labels" not in d else {f: tuple(v) for f, v in d["member_labels"]},
                color=_color_of(d, images, dtype))
        if c.member_labels is not None and set(c.member_labels) != c.records:
            raise LineageError(f"registered cluster {c.key}: labels of records that are not its members; the registry "
                               "is corrupt")
        if c.image_sha256 != d["image_sha256"]:
            raise LineageError(f"registered cluster {c.key}: stored average does not match its hash; the registry is corrupt")
        if c.color is not None and (c.color_sha256 != d["color_sha256"] or c.color.shape[0] != 3 * image.size):
            raise LineageError(f"registered cluster {c.key}: stored colour average does not match its hash or is not "
                               "3 channels of its grey average; the registry is corrupt")
        if dtype != "|u1" and image.size != int(np.prod(c.shape)):
            raise LineageError(f"registered cluster {c.key}: stored vector of {image.size} {dtype} values does not "
                               f"have its shape {list(c.shape)}; the registry is corrupt")
        return c


def _color_of(d: Mapping[str, Any], images: Any, dtype: str) -> Any:
    """The stored colour average of a cluster's entry (inline ``color``, or sealed at ``color_at``); None: grey."""
    if "color_sha256" not in d:
        if "color" in d or "color_at" in d:
            raise LineageError(f"registered cluster {d.get('key')}: a colour average without its hash; the registry "
                               "is corrupt")
        return None
    if dtype != "|u1":
        raise LineageError(f"registered cluster {d.get('key')}: a colour average of a feature vector; the registry "
                           "is corrupt")
    size = 3 * int(np.prod([int(x) for x in d["shape"]]))
    if "color" in d:
        return np.frombuffer(base64.b64decode(d["color"]), dtype=np.uint8).copy()
    if "color_at" in d and images is not None:
        at = d["color_at"]
        return StoredImage(images, (str(at["pack"]), int(at["offset"]), int(at["length"]), str(d["color_sha256"])),
                           sha256=d["color_sha256"], size=size)
    if "color_at" in d:
        raise LineageError(f"registered cluster {d.get('key')}: its colour average is sealed beside the registry's "
                           "entries; load the registry with deid.release.lineage_registry.Registry.load")
    raise LineageError(f"registered cluster {d.get('key')}: no stored colour average; the registry is corrupt")


@dataclass(frozen=True)
class ReleaseSummary:
    """Counts and policy decisions of one registered release (no member details)."""

    release_id: str
    seq: int
    status: str                   # pending | published | abandoned
    k: int
    method: str
    policy: str
    absent: str
    new_clusters: int
    republished_clusters: int
    suppressed_clusters: int
    records_released: int
    counterfeit_records: int
    new_people: int
    returning_people: int
    waiting_people: int
    suppressed_records: int
    color: bool = False           # its faces were released in colour (DEID_COLOR)


@dataclass(frozen=True, eq=False)
class LineageState:
    """The registered lineage of a dataset: what every later release must stay consistent with.

    Built by :func:`replay` from the registry entries; pure and in memory. Clusters of releases
    marked abandoned (never published) are left out; pending ones count (a crash between
    registering and publishing must err on the side of constraint).
    """

    dataset: str
    seq: int = -1                                   # last entry's sequence number (-1: no entry yet)
    head: str = GENESIS_PREV                        # last entry's chain hash
    clusters: Mapping[str, LineageCluster] = field(default_factory=dict)
    releases: tuple[ReleaseSummary, ...] = ()
    record_cluster: Mapping[str, str] = field(default_factory=dict)          # fingerprint -> cluster key
    person_clusters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # pseudonym -> keys
    released_sizes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)   # key -> size in each release
    released_people: frozenset[str] = frozenset()   # every pseudonym released so far (release-once)
    entries: tuple[Mapping[str, Any], ...] = ()     # the entry documents, in order
    # Reads the averages the registry sealed beside its entries (``image_at``); None: every average inline.
    images: Any = field(default=None, compare=False, repr=False)

    @property
    def color_mode(self) -> str | None:
        """How this dataset's faces are released (one of :data:`COLOUR_MODES`): the mode of the releases that
        registered clusters (not abandoned); None while none has. Registries written before colour was
        stored hold grey releases only."""
        modes = {"colour" if r.color else "grey" for r in self.releases if r.status != "abandoned" and r.new_clusters}
        if len(modes) > 1:
            raise LineageError(f"lineage of {self.dataset!r} holds releases in colour and in grey; the registry is "
                               "inconsistent")
        return next(iter(modes), None)

    def with_entry(self, body: Mapping[str, Any]) -> "LineageState":
        """The state after one more entry, chained to this one (the registry persists it).

        ``body`` is e.g. :meth:`LineageRelease.to_entry`; ``format``, ``dataset``, ``seq`` and ``prev``
        are set here. The first entry of a lineage is always the genesis entry.
        """
        state = self
        if not self.entries and body.get("kind") != "genesis":
            state = self.with_entry({"kind": "genesis"})
        return state._appended(body)[0]

    def _appended(self, body: Mapping[str, Any], *,
                  made: Mapping[str, LineageCluster] | None = None) -> tuple["LineageState", list[bytes]]:
        """The state after ``body`` (chained to this state, which has its genesis entry) and the new
        entry's canonical bytes (hashed into the chain; what the registry encrypts), in pieces
        (:func:`canonical_pieces`).

        ``made``: the clusters of a release entry already built (key -> cluster, as registered), used
        instead of decoding the entry again.
        """
        seq = self.seq + 1
        doc = {**body, "format": ENTRY_FORMAT, "dataset": self.dataset, "seq": seq, "prev": self.head}
        payload = canonical_pieces(doc)
        head = chain_hash(self.head, payload)
        if doc.get("kind") == "published" and doc.get("release_id") in {r.release_id for r in self.releases
                                                                        if r.status == "pending"}:
            # A status change only: the clusters stay as replayed (not decoded again from every entry).
            releases = tuple(dataclasses.replace(r, status="published") if r.release_id == doc["release_id"] else r
                             for r in self.releases)
            return dataclasses.replace(self, seq=seq, head=head, releases=releases,
                                       entries=(*self.entries, doc)), payload
        if doc.get("kind") == "release" and self.entries and \
                doc.get("release_id") not in {r.release_id for r in self.releases}:
            # A new release adds to the state as replayed (issue 13: at a million faces, decoding every entry
            # again would hold the lineage twice).
            return self._with_release(doc, seq=seq, head=head, made=made or {}), payload
        return replay(self.dataset, [*self.entries, doc], seq=seq, head=head, images=self.images), payload


    def _with_release(self, doc: Mapping[str, Any], *, seq: int, head: str,
                      made: Mapping[str, LineageCluster]) -> "LineageState":
        """This state plus a new (pending) release entry: what :func:`replay` of every entry gives, built
        from this state's maps (copied, the clusters shared) and the entry's clusters."""
        clusters = dict(self.clusters)
        record_cluster = dict(self.record_cluster)
        person_clusters = dict(self.person_clusters)
        sizes = dict(self.released_sizes)
        released_people = set(self.released_people)
        rid = doc["release_id"]

        def cluster_of(cj: Mapping[str, Any]) -> LineageCluster:  # the clusters this run made, not decoded again
            c = made.get(cj["key"])
            if c is None or c.image_sha256 != cj["image_sha256"]:
                c = LineageCluster.from_json(cj, images=self.images)
            return c

        _add_release(doc, cluster_of, clusters=clusters, record_cluster=record_cluster,
                     person_clusters=person_clusters, sizes=sizes, released_people=released_people)
        summary = ReleaseSummary(release_id=rid, seq=seq, status="pending",
                                 **{f: doc["counts"][f] for f in _COUNT_FIELDS},
                                 k=int(doc["k"]), method=doc["method"], policy=doc["policy"], absent=doc["absent"],
                                 color=bool(doc.get("color", False)))
        return dataclasses.replace(self, seq=seq, head=head, clusters=clusters, releases=(*self.releases, summary),
                                   record_cluster=record_cluster, person_clusters=person_clusters,
                                   released_sizes=sizes, released_people=frozenset(released_people),
                                   entries=(*self.entries, doc))


def empty_state(dataset: str) -> LineageState:
    return LineageState(dataset=check_dataset_name(dataset))


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_bytes(doc: Mapping[str, Any]) -> bytes:
    """An entry's canonical JSON (sorted keys, no spaces, UTF-8): what is hashed and encrypted."""
    return _canonical_json(doc).encode("utf-8")


def canonical_pieces(doc: Mapping[str, Any], *, items: int = 32768) -> list[bytes]:
    """:func:`canonical_bytes` of ``doc`` in pieces whose concatenation is exactly those bytes.

    A top-level list longer than ``items`` (a release entry's ``new_clusters``) is encoded ``items``
    elements at a time: JSON without spaces is the same text piecewise, keys sorted at every level.
    At a million faces the entry is ~280 MB: in one piece it was held as a str and as its UTF-8 bytes
    at once, then beside its ciphertext (issue 32); in pieces, one piece's str at a time, and the
    registry seals them one after the other (:meth:`deid.release.lineage_registry.Registry._seal`).
    32,768 clusters of k=5 are ~46 MB, above glibc's largest mmap threshold (32 MB): a piece freed once
    sealed goes back to the OS at once (2,048 a piece were reused by nothing and kept: measured no gain).
    """
    if not all(isinstance(key, str) for key in doc):  # json.dumps converts other keys: left to it
        return [canonical_bytes(doc)]
    out: list[bytes] = []
    text = "{"
    for n, key in enumerate(sorted(doc)):
        value = doc[key]
        text += ("," if n else "") + _canonical_json(key) + ":"
        if isinstance(value, list) and len(value) > items:
            out.append((text + "[").encode("utf-8"))
            for start in range(0, len(value), items):
                part = _canonical_json(value[start:start + items])[1:-1]
                out.append((("," if start else "") + part).encode("utf-8"))
            text = "]"
        else:
            text += _canonical_json(value)
    out.append((text + "}").encode("utf-8"))
    return out


def chain_hash(prev: str, doc: Mapping[str, Any] | bytes | Sequence[bytes]) -> str:
    """``sha256(previous chain hash bytes + canonical entry bytes)`` as hex (``doc``, its canonical bytes, or
    their pieces: :func:`canonical_pieces`)."""
    h = hashlib.sha256(bytes.fromhex(prev))
    if isinstance(doc, (bytes, bytearray)):
        h.update(doc)  # no concatenated copy of a ~300 MB entry
    elif isinstance(doc, Mapping):
        h.update(canonical_bytes(doc))
    else:
        for piece in doc:
            h.update(piece)
    return h.hexdigest()


def replay(dataset: str, docs: Sequence[Mapping[str, Any]], *, seq: int | None = None,
           head: str | None = None, images: Any = None) -> LineageState:
    """Rebuild the state from entry documents (kinds ``genesis``, ``release``, ``published``, ``abandoned``).

    ``images`` reads the averages sealed beside the entries (the registry's; see :class:`StoredImage`).
    """
    status: dict[str, str] = {}
    for d in docs:
        if d["kind"] == "release":
            status[d["release_id"]] = "pending"
        elif d["kind"] in ("published", "abandoned"):
            if d["release_id"] not in status:
                raise LineageError(f"entry marks release {d['release_id']} {d['kind']} but it was never registered")
            status[d["release_id"]] = d["kind"]
    clusters: dict[str, LineageCluster] = {}
    record_cluster: dict[str, str] = {}
    person_clusters: dict[str, tuple[str, ...]] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    released_people: set[str] = set()
    summaries = []
    for i, d in enumerate(docs):
        if d["kind"] != "release":
            continue
        rid = d["release_id"]
        summaries.append(ReleaseSummary(release_id=rid, seq=int(d.get("seq", i)), status=status[rid],
                                        **{f: d["counts"][f] for f in _COUNT_FIELDS},
                                        k=int(d["k"]), method=d["method"], policy=d["policy"], absent=d["absent"],
                                        color=bool(d.get("color", False))))
        if status[rid] == "abandoned":
            continue
        _add_release(d, lambda cj: LineageCluster.from_json(cj, images=images), clusters=clusters,
                     record_cluster=record_cluster, person_clusters=person_clusters, sizes=sizes,
                     released_people=released_people)
    return LineageState(
        dataset=check_dataset_name(dataset), seq=len(docs) - 1 if seq is None else seq,
        head=GENESIS_PREV if head is None else head, clusters=clusters, releases=tuple(summaries),
        record_cluster=record_cluster, person_clusters=person_clusters,
        released_sizes=sizes, released_people=frozenset(released_people),
        entries=tuple(docs), images=images,
    )


def _add_release(doc: Mapping[str, Any], cluster_of: Callable[[Mapping[str, Any]], LineageCluster], *,
                 clusters: dict, record_cluster: dict, person_clusters: dict, sizes: dict,
                 released_people: set) -> None:
    """Add one release entry's new and republished clusters to the replayed maps, in place (the load's
    :func:`replay` and an append's :meth:`LineageState._with_release` share it)."""
    rid = doc["release_id"]
    for cj in doc["new_clusters"]:
        c = cluster_of(cj)
        if c.key in clusters:
            raise LineageError(f"cluster {c.key} registered twice; the registry is corrupt")
        clusters[c.key] = c
        sizes[c.key] = (*sizes.get(c.key, ()), c.n_released)
        for p in c.people:
            person_clusters[p] = (*person_clusters.get(p, ()), c.key)
        for r in c.records:
            record_cluster.setdefault(r, c.key)
        released_people |= c.people
    for rj in doc["republished"]:
        if rj["key"] not in clusters:
            raise LineageError(f"release {rid} republishes unknown cluster {rj['key']}; the registry is corrupt")
        sizes[rj["key"]] = (*sizes.get(rj["key"], ()), int(rj["n_released"]))
        for r in rj["added_records"]:
            record_cluster.setdefault(r, rj["key"])
        released_people |= set(rj["people_released"])


_COUNT_FIELDS = ("new_clusters", "republished_clusters", "suppressed_clusters", "records_released",
                 "counterfeit_records", "new_people", "returning_people", "waiting_people", "suppressed_records")


def describe_lineage(state: LineageState, *, members: bool = False) -> dict[str, Any]:
    """Releases, people counts and policy decisions of a lineage; ``members`` adds per-cluster pseudonyms."""
    out: dict[str, Any] = {
        "dataset": state.dataset, "entries": len(state.entries), "head": state.head,
        "registered_clusters": len(state.clusters), "registered_people": len(state.person_clusters),
        "color_mode": state.color_mode,
        "releases": [dataclasses.asdict(r) for r in state.releases],
    }
    if members:
        out["clusters"] = [
            {"key": c.key, "release_id": c.release_id, "partition": list(c.partition),
             "members": sorted(map(list, c.members)), "image_sha256": c.image_sha256, "released_sizes":
                 list(state.released_sizes.get(c.key, ()))}
            for c in sorted(state.clusters.values(), key=lambda c: c.key)]
    return out
