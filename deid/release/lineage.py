"""Release lineage: successive releases of one dataset that leak nothing by differencing.

Each release of a dataset is k-anonymous on its own; together they are not (the composition
problem of k-anonymity, Ganta, Kasiviswanathan & Smith, KDD 2008). Two clusters of successive
releases that differ by fewer than ``k`` member records give the differing faces away:
``s * (M1 - M2) = a - b`` for one swapped person, ``|C2| M2 - |C1| M1 = x`` for one added face.
The standard answer for re-publication is m-invariance (Xiao & Tao, SIGMOD 2007): a person keeps
the same published group in every release, and absent members are covered by counterfeits.

This module holds the pure part:

- the lineage *state* of a dataset (:class:`LineageState`), replayed from the registry entries
  (the encrypted, hash-chained store is :mod:`deid.release.lineage_registry`);
- :func:`plan_release`: for a new drop, which records are released as a registered cluster's
  stored average (bit-identical), which are new people to cluster among themselves, which wait
  or are suppressed, and how many counterfeit records each republished cluster needs;
- :func:`build_release` / :func:`release_from_clusters`: the release as the lineage sees it
  (basis records and people of every released cluster, released images), which the gate
  checks (:mod:`deid.release.lineage_checks`) and which becomes the next registry entry.

Identities never appear in clear: a person is a keyed pseudonym (HMAC-SHA256) and a record is the
SHA-256 of its source bytes. Keys are derived from the steward's 32-byte key (the linkage key)
with HKDF-SHA256, one key per purpose and dataset, so pseudonyms of two datasets cannot be linked.

References
----------
X. Xiao, Y. Tao. m-Invariance: towards privacy preserving re-publication of dynamic datasets.
SIGMOD 2007, 689-700.
S. R. Ganta, S. P. Kasiviswanathan, A. Smith. Composition attacks and auxiliary information in
data privacy. KDD 2008, 265-273.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from deid.errors import ConfigError, StateError
from deid.intake.drop import check_dataset_name

logger = logging.getLogger(__name__)

__all__ = [
    "ABSENT_POLICIES",
    "COLOUR_MODES",
    "MERGE_POLICIES",
    "POLICIES",
    "LineageCluster",
    "LineageError",
    "LineagePlan",
    "LineageRelease",
    "LineageState",
    "ReleaseSummary",
    "Republish",
    "RepublishedLabels",
    "StoredImage",
    "build_release",
    "canonical_bytes",
    "chain_hash",
    "check_dataset_name",
    "derive_key",
    "describe_lineage",
    "empty_state",
    "average_sha256",
    "image_sha256",
    "label_mix",
    "plan_release",
    "pseudonymize",
    "release_from_clusters",
    "replay",
    "stored_rows",
]

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


# --------------------------------------------------------------------------- keys and identities


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


def label_mix(labels: Sequence[tuple[str, ...]], n_rows: int) -> list[tuple[str, ...]]:
    """The label tuples of ``n_rows`` rows with the mix of ``labels`` (a cluster's registered basis records).

    ``n_rows == len(labels)``: ``labels`` itself (sorted). More rows (new photos of returning people,
    counterfeits added for the 1/k rule): each label tuple gets ``n_rows`` times its share, the
    remainder to the largest fractions (Hamilton's method; ties to the smallest tuple), so every
    tuple keeps at least its registered count and the mix is a function of the registered labels and
    the released size only, never of who is absent. Fewer rows: a ValueError (only a sub-multiset
    of the registered labels can be released then).
    """
    counts = Counter(labels)
    n = sum(counts.values())
    if n_rows < n or (n == 0 and n_rows):
        raise ValueError(f"n_rows={n_rows} must be >= the {n} registered label tuples")
    base = {t: c * n_rows // n for t, c in counts.items()}
    rest = n_rows - sum(base.values())
    for t in sorted(counts, key=lambda t: (-((counts[t] * n_rows) % n), t))[:rest]:
        base[t] += 1
    return [t for t in sorted(base) for _ in range(base[t])]


# Stored averages: a uint8 image (faces) or a float vector (feature drops), kept in its released dtype.
VECTOR_DTYPES = ("<f4", "<f8")


class StoredImage:
    """A stored average kept outside memory and read on demand (issue 13: a million faces register
    200,000 averages, 1.5 GB of pixels, which no stage should hold at once).

    ``source.read_image(key)`` returns the pixels (a row of a :class:`deid.operations.stages.RowFile`
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
    pos = range(len(images))[idx] if isinstance(idx, slice) else np.asarray(idx, dtype=np.int64).reshape(-1)
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


def _stored(average: np.ndarray) -> np.ndarray:
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
    a = _stored(average)
    return image_sha256(a) if a.dtype == np.uint8 else hashlib.sha256(a.tobytes()).hexdigest()


# --------------------------------------------------------------------------- the registered lineage


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
                 {"image": base64.b64encode(_stored(self.image).tobytes()).decode()})
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
                out["color"] = base64.b64encode(_stored(self.color).tobytes()).decode()
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, images: Any = None) -> "LineageCluster":
        """The cluster of an entry; ``images`` reads averages sealed beside the entries (``image_at``):
        they stay there, read when asked (:class:`StoredImage`); inline ones (older registries) are decoded."""
        dtype = str(d.get("dtype", "|u1"))
        if dtype not in ("|u1", *VECTOR_DTYPES):
            raise LineageError(f"registered cluster {d.get('key')}: stored average dtype {dtype!r} is not uint8, "
                               "float32 or float64; the registry is corrupt")
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
                  made: Mapping[str, LineageCluster] | None = None) -> tuple["LineageState", bytes]:
        """The state after ``body`` (chained to this state, which has its genesis entry) and the new
        entry's canonical bytes (hashed into the chain; what the registry encrypts).

        ``made``: the clusters of a release entry already built (key -> cluster, as registered), used
        instead of decoding the entry again.
        """
        seq = self.seq + 1
        doc = {**body, "format": ENTRY_FORMAT, "dataset": self.dataset, "seq": seq, "prev": self.head}
        payload = canonical_bytes(doc)
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


def canonical_bytes(doc: Mapping[str, Any]) -> bytes:
    """An entry's canonical JSON (sorted keys, no spaces, UTF-8): what is hashed and encrypted."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def chain_hash(prev: str, doc: Mapping[str, Any] | bytes) -> str:
    """``sha256(previous chain hash bytes + canonical entry bytes)`` as hex (``doc`` or its canonical bytes)."""
    h = hashlib.sha256(bytes.fromhex(prev))
    h.update(doc if isinstance(doc, bytes) else canonical_bytes(doc))  # no concatenated copy of a ~300 MB entry
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


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True, eq=False)
class Republish:
    """A registered cluster released again: these drop records (and counterfeits) get its stored average."""

    cluster: LineageCluster
    records: tuple[int, ...]      # drop record indices released as the stored average
    n_counterfeit: int            # counterfeit records (stored average, the cluster's labels, no source)


@dataclass(frozen=True, eq=False)
class LineagePlan:
    """What a new drop may release, given the lineage (see :func:`plan_release`).

    Every drop record index is in exactly one of: a :class:`Republish`'s ``records``,
    ``new_records`` (the caller clusters them with k-Same among themselves only) or ``suppressed``.
    """

    dataset: str
    policy: str
    absent: str
    k: int
    based_on_seq: int
    based_on_head: str
    pseudonyms: tuple[str, ...]            # per drop record
    fingerprints: tuple[str, ...]          # per drop record
    partitions: tuple[tuple[str, ...], ...] | None
    republish: tuple[Republish, ...]
    new_records: tuple[int, ...]
    suppressed: tuple[tuple[int, str], ...]            # (record index, reason)
    suppressed_clusters: tuple[tuple[str, str], ...]   # (registered cluster key, reason)
    n_new_people: int
    n_returning_people: int
    n_waiting_people: int
    label_names: tuple[str, ...] = ()
    record_labels: tuple[tuple[str, ...], ...] | None = None   # per drop record, released label values
    merges: str = "withhold"                                   # MERGE_POLICIES (DEID_LINEAGE_MERGES)
    # The overlay for the k rules: pseudonym -> the pseudonym representing its person in this run, for the
    # pseudonyms this run joins to another (identity merges, registered bytes under another steward id).
    merged: Mapping[str, str] = field(default_factory=dict)
    # merged_people (groups of several pseudonyms), aliased_records (registered under another pseudonym),
    # rechecked_clusters (registered clusters holding a joined pseudonym): the report's lineage.merges.
    merge_counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def n_counterfeit(self) -> int:
        return sum(r.n_counterfeit for r in self.republish)

    @property
    def withheld_by_merges(self) -> tuple[tuple[str, str], ...]:
        """The registered clusters this run's merges withhold: (key, :data:`MERGED_BELOW_K` or
        :data:`MERGED_OVER_SHARE`)."""
        return tuple(x for x in self.suppressed_clusters if x[1] in (MERGED_BELOW_K, MERGED_OVER_SHARE))

    def merges_summary(self) -> dict[str, Any]:
        """The report's ``merges`` entry: the policy and counts (no pseudonym, fingerprint or cluster key)."""
        reasons = Counter(r for _, r in self.withheld_by_merges)
        return {"policy": self.merges, **{f: int(self.merge_counts.get(f, 0)) for f in _MERGE_COUNT_FIELDS},
                "withheld_clusters": sum(reasons.values()), "withheld_by_reason": dict(sorted(reasons.items()))}

    def summary(self) -> dict[str, Any]:
        """Counts and decisions for the signed report: no pseudonym, fingerprint or cluster key."""
        reasons = Counter(r for _, r in self.suppressed)
        return {"dataset": self.dataset, "policy": self.policy, "absent": self.absent, "k": self.k,
                "based_on_entry": self.based_on_seq, "republished_clusters": len(self.republish),
                "republished_records": sum(len(r.records) for r in self.republish),
                "counterfeit_records": self.n_counterfeit,
                "suppressed_registered_clusters": len(self.suppressed_clusters),
                "new_records": len(self.new_records), "new_people": self.n_new_people,
                "returning_people": self.n_returning_people, "waiting_people": self.n_waiting_people,
                "suppressed_records": len(self.suppressed), "suppressed_by_reason": dict(sorted(reasons.items())),
                "merges": self.merges_summary()}


_MERGE_COUNT_FIELDS = ("merged_people", "aliased_records", "rechecked_clusters")


def _check_policy(policy: str, absent: str, k: Any) -> None:
    if policy not in POLICIES:
        raise ConfigError(f"lineage policy={policy!r} must be one of {POLICIES} (DEID_LINEAGE_POLICY); "
                          "'invariant' keeps returning people in their registered cluster")
    if absent not in ABSENT_POLICIES:
        raise ConfigError(f"absent={absent!r} must be one of {ABSENT_POLICIES} (DEID_LINEAGE_ABSENT)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ConfigError(f"k={k!r} must be an integer >= 2")


def _partition_keys(partitions: Sequence[Hashable] | None, n: int) -> tuple[tuple[str, ...], ...] | None:
    if partitions is None:
        return None
    shared: dict = {}  # one tuple per distinct key, shared by its records (8 bytes each; issue 13)

    def key(p):
        k = tuple(map(str, p)) if isinstance(p, tuple | list) else (str(p),)
        return shared.setdefault(k, k)

    out = tuple(key(p) for p in partitions)
    if len(out) != n:
        raise ConfigError(f"partitions has {len(out)} entries but there are {n} records; pass one per record")
    return out


def plan_release(state: LineageState, people: Sequence[Hashable], record_fingerprints: Sequence[str], *,
                 key: bytes, k: int, policy: str = "invariant", absent: str = "republish",
                 partitions: Sequence[Hashable] | None = None,
                 record_labels: Sequence[Sequence[Hashable]] | None = None, label_names: Sequence[str] = (),
                 persons: Sequence[Hashable] | None = None, merges: str = "withhold") -> LineagePlan:
    """Plan a new release of a dataset so that it adds no information about anyone already released.

    m-invariance adapted to face averages (Xiao & Tao 2007). Policy ``invariant``:

    1. A record already registered (same source fingerprint) goes to its registered cluster. A new
       record of a returning person goes to one of that person's registered clusters: the one of
       the record's partition (when ``partitions`` is given; none -> suppressed,
       ``returning_partition_mismatch``), the one with the fewest of their records so far, then
       the lowest key. Every such record is released as the cluster's *stored* average.
    2. Registered clusters never change: no new member joins, no average is recomputed.
    3. Records of people never released are ``new_records``: the caller runs k-Same on them only.
       Fewer than ``k`` new people (per partition, when given) -> they wait (suppressed,
       ``waiting_for_k_new_people``) until enough arrive.
    4. A registered cluster some of whose basis people have no record in it this time:
       ``absent="republish"`` releases it anyway, padded with counterfeit records (stored average)
       up to the size it was first released with; ``absent="suppress"`` suppresses the whole
       cluster (its records too). With ``republish`` every registered cluster reappears at least at
       its first size, whoever left, so absence reveals nothing; the counterfeits are counted in the
       private registry only. A registered cluster with fewer than ``k`` people (``k`` was raised)
       is suppressed.
    5. No person holds more than 1/k of a republished cluster's released rows (every row carries
       the same image: a recogniser naming one person for it is right on that person's share of the
       rows). A returning person with new photos could exceed it: ``republish`` adds counterfeits
       until the cluster has at least ``k`` times that person's rows; ``suppress`` withholds the
       surplus (``returning_surplus_over_1_k``, new photos first), as the partition stage does for
       new clusters.

    Policy ``release-once``: every record of a person already released (or a registered record) is
    suppressed (``released_before``); only new people are clustered; registered clusters retire.

    Records are keyed by what cannot flip between runs: the source fingerprint and the normalised
    steward id (``people``). Who is one person is an *overlay* for the k rules (issue 27): this
    run's identity merges (``persons``, the effective person of each record) and registered bytes
    now listed under another steward id (the same photograph: the same person under an alias) join
    pseudonyms for every count above (people per cluster, 1/k shares, new people per partition), and
    a person is returning when anyone they are joined with is. A merge can thus neither re-key nor
    block the lineage; it can only leave a registered cluster with fewer than ``k`` people among its
    basis records, or one person above 1/k of them: such a cluster is re-checked and withheld
    (``merged_below_k``, ``merged_over_1_k``; with ``merges="refuse"`` the gate's ``lineage_merges``
    check also fails the run). An un-merge only adds people to a count: nothing changes.

    Parameters
    ----------
    state : LineageState
        The dataset's registered lineage (:func:`deid.release.lineage_registry.Registry.load`).
    people : sequence of hashable
        Person id (subject id) of each drop record; pseudonymised here with ``key``.
    record_fingerprints : sequence of str
        SHA-256 of each record's source bytes (``source_sha256`` of the ingested table).
    key : bytes
        The steward's 32-byte key (the linkage key).
    k : int
        Minimum number of people per cluster.
    policy : {"invariant", "release-once"}
    absent : {"republish", "suppress"}
    partitions : sequence of hashable, optional
        Partition key of each record (label values tuple, as given to k-Same-Select).
    record_labels : sequence of sequences, optional
        The released label values of each record (in ``label_names`` order). New clusters register
        them per basis record, so a later release of the cluster reproduces its label mix exactly
        (:meth:`LineageRelease.republished_labels`).
    label_names : sequence of str
        The names of the labels in ``record_labels``.
    persons : sequence of hashable, optional
        The effective person of each record after this run's identity resolution
        (:func:`deid.anonymise.identity.resolve_people`); default ``people`` (no merges).
    merges : {"withhold", "refuse"}
        What a registered cluster the merges leave below k people or above 1/k does: withheld from
        this release, or also the run refused by the gate (``DEID_LINEAGE_MERGES``).

    Returns
    -------
    LineagePlan
    """
    _check_policy(policy, absent, k)
    if merges not in MERGE_POLICIES:
        raise ConfigError(f"merges={merges!r} must be one of {MERGE_POLICIES} (DEID_LINEAGE_MERGES); 'withhold' "
                          "leaves out a registered cluster that this run's merges put below k people")
    n = len(people)
    if len(record_fingerprints) != n:
        raise ConfigError(f"record_fingerprints has {len(record_fingerprints)} entries but people has {n}; "
                          "pass the source_sha256 of every record")
    if persons is not None and len(persons) != n:
        raise ConfigError(f"persons has {len(persons)} entries but people has {n}; pass the effective person of "
                          "every record (or None: no merges)")
    pseud = pseudonymize(key, state.dataset, people)
    fps = tuple(str(f) for f in record_fingerprints)
    parts = _partition_keys(partitions, n)
    labs = _record_labels(record_labels, label_names, n)
    effective: list[str] | None = None
    if persons is not None:
        # Only the records a merge moved are pseudonymised again (one HMAC per distinct id; issue 13).
        moved = [i for i, (a, b) in enumerate(zip(people, persons)) if str(a) != str(b)]
        if moved:
            effective = list(pseud)
            for i, e in zip(moved, pseudonymize(key, state.dataset, [persons[i] for i in moved])):
                effective[i] = e
    merged, n_aliased = _overlay(state, pseud, fps, effective)

    def root(p: str) -> str:
        return merged.get(p, p)

    members_of: dict[str, set[str]] = defaultdict(set)   # root -> its pseudonyms (joined groups only)
    for p, r in merged.items():
        members_of[r].add(p)
    # A person is returning when anyone this run joins them with was registered or released.
    returning = {r for r in {root(p) for p in pseud}
                 if any(m in state.person_clusters or m in state.released_people for m in members_of.get(r, (r,)))}
    suppressed: list[tuple[int, str]] = []
    assigned: dict[str, list[int]] = defaultdict(list)
    new_idx: list[int] = []
    for i, (p, f) in enumerate(zip(pseud, fps)):
        known_record = f in state.record_cluster
        if root(p) not in returning and not known_record:
            new_idx.append(i)
        elif policy == "release-once":
            suppressed.append((i, RELEASED_BEFORE))
        elif known_record:
            assigned[state.record_cluster[f]].append(i)
        else:
            choice = _choose_cluster(state, p, None if parts is None else parts[i], assigned, pseud,
                                     others=members_of.get(root(p), ()), root=root)
            if choice is None:
                suppressed.append((i, PARTITION_MISMATCH))
            else:
                assigned[choice].append(i)

    republish: list[Republish] = []
    suppressed_clusters: list[tuple[str, str]] = []
    rechecked = 0
    if policy == "invariant":
        for ckey in sorted(state.clusters):
            c = state.clusters[ckey]
            recs = assigned.get(ckey, [])
            reason = None
            if len(c.people) < k:
                reason = BELOW_K
            elif merged and any(p in merged for p in c.people):
                rechecked += 1
                reason = _merge_recheck(c, root, k)
            if reason is None and absent == "suppress" and not {root(p) for p in c.people} <= {root(pseud[i])
                                                                                             for i in recs}:
                reason = MEMBER_ABSENT
            if reason is not None:
                suppressed_clusters.append((ckey, reason))
                suppressed.extend((i, CLUSTER_SUPPRESSED) for i in recs)
                continue
            if absent == "suppress":
                recs, surplus = _trim_surplus(recs, pseud, fps, c, k, root=root)
                suppressed.extend((i, SURPLUS) for i in surplus)
            pad = _counterfeits_needed(c, recs, pseud, k, root=root) if absent == "republish" else 0
            if recs or pad:
                republish.append(Republish(c, tuple(sorted(recs)), pad))
    else:
        suppressed_clusters = [(ckey, RETIRED) for ckey in sorted(state.clusters)]

    # New people: clustered among themselves, only where there are at least k of them.
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i in new_idx:
        groups[parts[i] if parts is not None else ("all",)].append(i)
    new_records: list[int] = []
    waiting: set[str] = set()
    for g, idx in groups.items():
        who = {root(pseud[i]) for i in idx}
        if len(who) < k:
            waiting |= who
            suppressed.extend((i, WAITING) for i in idx)
        else:
            new_records.extend(idx)
    n_new_people = len({root(pseud[i]) for i in new_idx})
    withheld = sum(r in (MERGED_BELOW_K, MERGED_OVER_SHARE) for _, r in suppressed_clusters)
    if withheld:
        logger.warning("lineage %s: %d registered clusters withheld: this run's merges leave them below k=%d people "
                       "or one person above 1/k (%s)", state.dataset, withheld, k, merges)
    if waiting:
        logger.info("lineage %s: %d new people wait for more (fewer than k=%d new people in their partition)",
                    state.dataset, len(waiting), k)
    return LineagePlan(
        dataset=state.dataset, policy=policy, absent=absent, k=k, based_on_seq=state.seq,
        based_on_head=state.head, pseudonyms=tuple(pseud), fingerprints=fps, partitions=parts,
        republish=tuple(republish), new_records=tuple(sorted(new_records)),
        suppressed=tuple(sorted(suppressed)), suppressed_clusters=tuple(suppressed_clusters),
        n_new_people=n_new_people, n_returning_people=len(returning),
        n_waiting_people=len(waiting), label_names=tuple(map(str, label_names)), record_labels=labs,
        merges=merges, merged=merged,
        merge_counts={"merged_people": len(members_of), "aliased_records": n_aliased, "rechecked_clusters": rechecked},
    )


def _record_labels(record_labels: Sequence[Sequence[Hashable]] | None, label_names: Sequence[str],
                   n: int) -> tuple[tuple[str, ...], ...] | None:
    if record_labels is None:
        return None
    shared: dict = {}  # one tuple per distinct combination, shared by its records (issue 13)
    out = tuple(shared.setdefault(t, t) for t in (tuple(map(str, r)) for r in record_labels))
    if len(out) != n or any(len(r) != len(label_names) for r in out):
        raise ConfigError(f"record_labels must have one entry per record ({n}) of {len(label_names)} values "
                          f"(label_names={list(label_names)}); got {len(out)} entries")
    return out


def _same(p: str) -> str:
    return p


def _counterfeits_needed(c: LineageCluster, recs: Sequence[int], pseud: Sequence[str], k: int, *,
                         root: Callable[[str], str] = _same) -> int:
    """Counterfeit rows a republished cluster needs (``absent="republish"``).

    At least its first released size (so an absent member's rows look as before) and at least
    ``k`` times the rows of the person with the most of them: every row carries the same image,
    so a recogniser that names one person for it is right on at most that person's share of the
    rows. A counterfeit belongs to no one, so it dilutes a returning person who brought new photos
    exactly as an absent member's row would. ``root`` maps a pseudonym to its person under this
    run's merges (:func:`plan_release`).
    """
    top = max(Counter(root(pseud[i]) for i in recs).values(), default=0)
    return max(0, c.n_released - len(recs), k * top - len(recs))


def _trim_surplus(recs: Sequence[int], pseud: Sequence[str], fps: Sequence[str], c: LineageCluster,
                  k: int, *, root: Callable[[str], str] = _same) -> tuple[list[int], list[int]]:
    """``absent="suppress"`` (no counterfeits): withhold a person's rows above 1/k of the cluster's rows.

    As the partition stage does for new clusters. New photos go first, then registered ones, the
    highest record index first (deterministic).
    """
    keep = sorted(recs, key=lambda i: (fps[i] in c.records, -i))  # new photos first, then by index
    surplus: list[int] = []
    while keep:
        counts = Counter(root(pseud[i]) for i in keep)
        person, top = max(counts.items(), key=lambda x: (x[1], x[0]))
        if k * top <= len(keep):
            break
        drop = next(i for i in keep if root(pseud[i]) == person)
        keep.remove(drop)
        surplus.append(drop)
    return sorted(keep), surplus


def _overlay(state: LineageState, pseud: Sequence[str], fps: Sequence[str],
             effective: Sequence[str] | None) -> tuple[dict[str, str], int]:
    """Who is one person in this run, over the pseudonyms of the steward ids: ``(merged, n_aliased)``.

    Joins each record's pseudonym with its effective person's (this run's identity merges) and with
    the pseudonym its source bytes were registered under, when that differs (the same photograph is
    the same person: a re-keyed id, or a merge an earlier run registered under one id). ``merged``
    maps every pseudonym of a group of several to the group's smallest (order-free); pseudonyms on
    their own are not in it. ``n_aliased``: records whose registered pseudonym differs from today's.
    Before, such a record stopped the lineage for good (a state error, issue 27); the join keeps it
    in its registered cluster and counts its ids as one person.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        r = x
        while parent.get(r, r) != r:
            r = parent[r]
        while parent.get(x, x) != r:
            parent[x], x = r, parent[x]
        return r

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            lo, hi = sorted((ra, rb))
            parent[hi] = lo
            parent.setdefault(lo, lo)

    if effective is not None:
        for p, e in zip(pseud, effective):
            if p != e:
                union(p, e)
    aliased = 0
    for p, f in zip(pseud, fps):
        ckey = state.record_cluster.get(f)
        c = state.clusters.get(ckey) if ckey is not None else None
        if c is None or (f, p) in c.members:   # unregistered, or registered under this pseudonym (a set lookup)
            continue
        registered = next((q for g, q in c.members if g == f), None)  # a basis record's registered pseudonym
        if registered is not None and registered != p:
            aliased += 1
            union(p, registered)
    return {x: find(x) for x in list(parent)}, aliased


def _merge_recheck(c: LineageCluster, root: Callable[[str], str], k: int) -> str | None:
    """Why a registered cluster may not be republished under this run's merges (None: it may).

    Its basis records (the records averaged into its image) must still hold ``k`` distinct people,
    none of them above 1/k of the records: the k-Same guarantee of the stored image, re-counted.
    """
    counts = Counter(root(p) for _, p in c.members)
    if len(counts) < k:
        return MERGED_BELOW_K
    if k * max(counts.values()) > len(c.members):
        return MERGED_OVER_SHARE
    return None


def _choose_cluster(state: LineageState, person: str, part: tuple[str, ...] | None,
                    assigned: Mapping[str, list[int]], pseud: Sequence[str], *, others: Iterable[str] = (),
                    root: Callable[[str], str] = _same) -> str | None:
    """The registered cluster of a new record of a returning person: one of their own clusters, or (an id
    first seen now, joined with registered ones by this run's merges) one of the clusters of those ids."""
    own = state.person_clusters.get(person, ())
    keys = own or tuple(sorted({c for q in others for c in state.person_clusters.get(q, ())}))
    cands = [c for c in keys if c in state.clusters]
    if part is not None:
        cands = [c for c in cands if state.clusters[c].partition == part]
    if not cands:
        return None
    me = root(person)
    return min(cands, key=lambda c: (sum(root(pseud[i]) == me for i in assigned.get(c, ())), c))


# --------------------------------------------------------------------------- the release as the lineage sees it


@dataclass(frozen=True)
class RepublishedCluster:
    """A registered cluster in a later release: how many records carry its stored average."""

    key: str
    n_released: int                   # drop records + counterfeits
    n_counterfeit: int
    added_records: tuple[str, ...]    # fingerprints released with it for the first time
    people_released: tuple[str, ...]  # pseudonyms whose records carry it in this release


@dataclass(frozen=True)
class RepublishedLabels:
    """Released label values of a republished cluster's rows (:meth:`LineageRelease.republished_labels`)."""

    records: Mapping[int, tuple[str, ...]]   # drop record index -> label values
    counterfeits: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, eq=False)
class LineageRelease:
    """One release as the lineage sees it: checked by the gate, then appended to the registry.

    ``record_cluster[i]`` is the cluster key of drop record ``i`` (``None`` = not released);
    ``images`` maps every released cluster key to its released uint8 image.
    """

    dataset: str
    release_id: str
    k: int
    method: str
    policy: str
    absent: str
    based_on_seq: int
    based_on_head: str
    new_clusters: tuple[LineageCluster, ...]
    republished: tuple[RepublishedCluster, ...]
    suppressed_clusters: tuple[tuple[str, str], ...]
    pseudonyms: tuple[str, ...]
    fingerprints: tuple[str, ...]
    record_cluster: tuple[str | None, ...]
    counts: Mapping[str, int]
    color: bool = False   # released in colour: every new cluster holds its colour average, republished ones too
    # This run's overlay for the k rules (:attr:`LineagePlan.merged`): the gate counts people through it.
    merged: Mapping[str, str] = field(default_factory=dict)

    def person(self, pseudonym: str) -> str:
        """The person ``pseudonym`` counts as in this release (its group's pseudonym under this run's merges)."""
        return self.merged.get(pseudonym, pseudonym)

    def released_clusters(self, state: LineageState) -> dict[str, tuple[LineageCluster, int]]:
        """key -> (cluster with its basis, records released with it in this release)."""
        out = {c.key: (c, c.n_released) for c in self.new_clusters}
        for r in self.republished:
            out[r.key] = (state.clusters[r.key], r.n_released)
        return out

    def released_records(self, state: LineageState) -> list[tuple[int, str, np.ndarray]]:
        """(drop record index, cluster key, released uint8 image) of every released drop record, by index."""
        clusters = self.released_clusters(state)
        return [(i, key, clusters[key][0].image) for i, key in enumerate(self.record_cluster) if key is not None]

    def counterfeits(self, state: LineageState) -> list[tuple[np.ndarray, tuple[str, ...]]]:
        """(image, partition) of every counterfeit record to add to the release (private: not marked there)."""
        return [(state.clusters[r.key].image, state.clusters[r.key].partition)
                for r in self.republished for _ in range(r.n_counterfeit)]

    def republished_labels(self, state: LineageState,
                           label_names: Sequence[str]) -> dict[str, "RepublishedLabels | None"]:
        """The released labels of every republished cluster's rows: its registered label mix, reproduced.

        Per republished cluster key: each drop record released with it keeps the labels registered for
        it (a basis record), the others (new photos of returning people) and the counterfeits take the
        rest of :func:`label_mix` of the registered labels at the released size. The cluster's released
        label multiset is thus the registered one (the same size as registered: absent members'
        labels are carried by the counterfeits, so neither who left nor which labels they had shows),
        or its proportional extension to more rows; with fewer rows (``absent="suppress"``), a part of
        it. None for a cluster whose labels were not registered (a registry written before labels
        were kept, or a label column the registering release did not have): the caller falls back.
        """
        out: dict[str, RepublishedLabels | None] = {}
        # Each cluster's records from one pass (issue 32: a scan per cluster was 2e9 steps at 100,000 records).
        by_key: dict[str, list[int]] = defaultdict(list)
        if self.republished:
            for i, key in enumerate(self.record_cluster):
                if key is not None:
                    by_key[key].append(i)
        for r in self.republished:
            c = state.clusters[r.key]
            reg = c.labels_for(label_names)
            if reg is None:
                out[r.key] = None
                continue
            recs = by_key.get(r.key, [])
            pool = Counter(label_mix(list(reg.values()), max(len(reg), r.n_released)))
            mine: dict[int, tuple[str, ...]] = {}
            for i in recs:
                lab = reg.get(self.fingerprints[i])
                if lab is not None and pool[lab] > 0:
                    mine[i] = lab
                    pool[lab] -= 1
            rest = iter(sorted(pool.elements()))
            for i in recs:
                if i not in mine:
                    mine[i] = next(rest)
            out[r.key] = RepublishedLabels(records=mine, counterfeits=tuple(next(rest) for _ in range(r.n_counterfeit)))
        return out

    def to_entry(self, *, image_at: Mapping[str, Mapping[str, Any]] | None = None,
                 color_at: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """The registry entry document (kind ``release``); the registry adds seq and chain hash.

        ``image_at`` (``color_at``): cluster key -> where the registry sealed its (colour) average (then not
        inline). A colour release says so (``"color": true``: the lineage's mode); a grey one's entry is as before.
        """
        return {"format": ENTRY_FORMAT, "kind": "release", "dataset": self.dataset, "release_id": self.release_id,
                "k": self.k, "method": self.method, "policy": self.policy, "absent": self.absent,
                "based_on_seq": self.based_on_seq, "based_on_head": self.based_on_head,
                **({"color": True} if self.color else {}),
                "new_clusters": [c.to_json(image_at=None if image_at is None else image_at[c.key],
                                           color_at=None if color_at is None else color_at.get(c.key))
                                 for c in self.new_clusters],
                "republished": [{"key": r.key, "n_released": r.n_released, "n_counterfeit": r.n_counterfeit,
                                 "added_records": list(r.added_records), "people_released": list(r.people_released)}
                                for r in self.republished],
                "suppressed_clusters": [list(x) for x in self.suppressed_clusters],
                "counts": dict(self.counts)}


def _one_image(images: Any, rows: list[int], lab: int) -> Any:
    """The image all ``rows`` of new cluster ``lab`` carry (a stored row when ``images`` keeps them on disk)."""
    if hasattr(images, "stored_image"):
        # Rows sharing a stored row are equal by construction; only others are compared in pixels.
        img = images.stored_image(rows[0])
        same = images.same_image(rows)
    else:
        img = images[rows[0]]
        same = all(np.array_equal(images[r], img) for r in rows[1:])
        img = img.copy()
    if not same:
        raise ConfigError(f"new cluster {lab}: its records carry different images; pass the released "
                          "(cluster-average) images, one row per record")
    return img


def _new_clusters(release_id: str, idx: Sequence[int], labels: np.ndarray, images: np.ndarray,
                  pseud: Sequence[str], fps: Sequence[str], parts: Sequence[tuple[str, ...]] | None,
                  shape: tuple[int, ...], k: int, method: str, record_labels: Sequence[tuple[str, ...]] | None = None,
                  label_names: Sequence[str] = (), colors: Any = None) -> tuple[list[LineageCluster], dict[int, str]]:
    by_label: dict[int, list[int]] = defaultdict(list)
    for row, lab in enumerate(labels.tolist()):
        if lab >= 0:
            by_label[lab].append(row)
    clusters, where = [], {}
    for n, lab in enumerate(sorted(by_label)):
        rows = by_label[lab]
        img = _one_image(images, rows, lab)
        color = None if colors is None else _one_image(colors, rows, lab)
        members = [idx[r] for r in rows]
        ps = [parts[i] for i in members] if parts is not None else [()]
        part = min(Counter(ps).most_common(), key=lambda x: (-x[1], x[0]))[0]
        key = f"{release_id}/{n:05d}"
        clusters.append(LineageCluster(key=key, release_id=release_id,
                                       members=frozenset((fps[i], pseud[i]) for i in members), image=img, shape=shape,
                                       partition=tuple(part), n_released=len(members), k=k, method=method,
                                       label_names=tuple(label_names),
                                       member_labels=None if record_labels is None else
                                       {fps[i]: record_labels[i] for i in members}, color=color))
        for i in members:
            where[i] = key
    return clusters, where


def _check_new(labels: Any, images: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    labels = np.asarray(labels, dtype=np.intp).reshape(-1)
    # A matrix-like with shape, dtype and row indexing (one image per cluster behind it) is kept as it is:
    # np.asarray would hold one copy per record (issue 13).
    if not all(hasattr(images, a) for a in ("shape", "dtype", "ndim", "__getitem__")):
        images = np.asarray(images)
    released_dtype = images.dtype == np.uint8 or (images.dtype.kind == "f" and images.dtype.itemsize in (4, 8))
    if labels.shape[0] != n or images.ndim != 2 or images.shape[0] != n or not released_dtype:
        raise ConfigError(f"new cluster labels ({labels.shape}) and images ({images.shape}, {images.dtype}) must have "
                          f"one row per new record ({n}); images uint8 (n, n_pixels) as released, or feature "
                          "vectors float32/float64 (n, dim) as released")
    return labels, images


def build_release(plan: LineagePlan, state: LineageState, *, release_id: str, method: str,
                  new_labels: Any, new_images: Any, shape: tuple[int, ...], new_colors: Any = None) -> LineageRelease:
    """The release of a plan, once the caller has clustered ``plan.new_records``.

    ``new_labels[j]`` is the k-Same cluster of ``plan.new_records[j]`` (-1: the caller withheld it)
    and ``new_images[j]`` its released uint8 image (the cluster average, as published), or for a
    feature drop its released float32/float64 vector (``shape=(dim,)``), stored bit for bit.
    ``new_colors[j]``: a colour release's BGR average (uint8, 3 values per pixel), stored beside the grey
    ``new_images[j]`` (its grey, what the gate attacks); every republished cluster must then hold its colour.

    Raises
    ------
    ConfigError
        A colour release of a lineage registered in grey, or the reverse (:attr:`LineageState.color_mode`):
        a returning person's released image would change.
    """
    if plan.based_on_head != state.head or plan.dataset != state.dataset:
        raise LineageError(f"the plan was made on lineage entry {plan.based_on_seq} of {plan.dataset!r} but the "
                           f"registry is now at entry {state.seq} of {state.dataset!r}; plan again")
    color = new_colors is not None
    mode = state.color_mode
    if mode is not None and mode != ("colour" if color else "grey"):
        raise ConfigError(f"dataset {state.dataset!r} was released in {mode}; this release is in "
                          f"{'colour' if color else 'grey'} (DEID_COLOR), which would change returning people's "
                          f"images; unset DEID_COLOR (auto follows the lineage) or set it to "
                          f"{'true' if mode == 'colour' else 'false'}")
    labels, images = _check_new(new_labels, new_images, len(plan.new_records))
    if color:
        _, new_colors = _check_new(labels, new_colors, len(plan.new_records))
        if new_colors.dtype != np.uint8 or new_colors.shape[1] != 3 * images.shape[1]:
            raise ConfigError(f"new_colors ({new_colors.shape}, {new_colors.dtype}) must be uint8 with 3 values per "
                              f"pixel of new_images ({images.shape[1]} pixels)")
    new, where = _new_clusters(release_id, plan.new_records, labels, images, plan.pseudonyms, plan.fingerprints,
                               plan.partitions, tuple(shape), plan.k, method, plan.record_labels, plan.label_names,
                               colors=new_colors)
    record_cluster: list[str | None] = [None] * len(plan.pseudonyms)
    for i, ckey in where.items():
        record_cluster[i] = ckey
    rep = []
    # Each republished cluster's records released so far, from one pass over the registry (not one per cluster).
    released_before: dict[str, set[str]] = defaultdict(set)
    if plan.republish:
        for f, ckey in state.record_cluster.items():
            released_before[ckey].add(f)
    for r in plan.republish:
        for i in r.records:
            record_cluster[i] = r.cluster.key
        added = sorted({plan.fingerprints[i] for i in r.records} - released_before.get(r.cluster.key, set()))
        rep.append(RepublishedCluster(key=r.cluster.key, n_released=len(r.records) + r.n_counterfeit,
                                      n_counterfeit=r.n_counterfeit, added_records=tuple(added),
                                      people_released=tuple(sorted({plan.pseudonyms[i] for i in r.records}))))
    released = sum(c is not None for c in record_cluster)
    counts = {"new_clusters": len(new), "republished_clusters": len(rep),
              "suppressed_clusters": len(plan.suppressed_clusters), "records_released": released + plan.n_counterfeit,
              "counterfeit_records": plan.n_counterfeit, "new_people": plan.n_new_people,
              "returning_people": plan.n_returning_people, "waiting_people": plan.n_waiting_people,
              "suppressed_records": len(plan.pseudonyms) - released}
    return LineageRelease(dataset=plan.dataset, release_id=release_id, k=plan.k, method=method, policy=plan.policy,
                          absent=plan.absent, based_on_seq=plan.based_on_seq, based_on_head=plan.based_on_head,
                          new_clusters=tuple(new), republished=tuple(rep),
                          suppressed_clusters=plan.suppressed_clusters, pseudonyms=plan.pseudonyms,
                          fingerprints=plan.fingerprints, record_cluster=tuple(record_cluster), counts=counts,
                          color=color, merged=plan.merged)


def release_from_clusters(state: LineageState, people: Sequence[Hashable], record_fingerprints: Sequence[str], *,
                          key: bytes, release_id: str, k: int, method: str, labels: Any, images: Any,
                          shape: tuple[int, ...], partitions: Sequence[Hashable] | None = None,
                          record_labels: Sequence[Sequence[Hashable]] | None = None,
                          label_names: Sequence[str] = ()) -> LineageRelease:
    """A release clustered without the lineage policy (every cluster new): what the gate must catch.

    ``labels`` is the cluster of every record (-1: suppressed), ``images`` the released uint8 images.
    Used for releases made before the lineage existed and by tests that bypass the policy.
    """
    pseud = pseudonymize(key, state.dataset, people)
    fps = tuple(map(str, record_fingerprints))
    labels, images = _check_new(labels, images, len(pseud))
    parts = _partition_keys(partitions, len(pseud))
    new, where = _new_clusters(release_id, range(len(pseud)), labels, images, pseud, fps, parts, tuple(shape),
                               k, method, _record_labels(record_labels, label_names, len(pseud)), label_names)
    record_cluster = tuple(where.get(i) for i in range(len(pseud)))
    released = sum(c is not None for c in record_cluster)
    counts = {"new_clusters": len(new), "republished_clusters": 0, "suppressed_clusters": 0,
              "records_released": released, "counterfeit_records": 0, "new_people": len(set(pseud)),
              "returning_people": len(set(pseud) & set(state.person_clusters)), "waiting_people": 0,
              "suppressed_records": len(pseud) - released}
    return LineageRelease(dataset=state.dataset, release_id=release_id, k=k, method=method, policy="none",
                          absent="none", based_on_seq=state.seq, based_on_head=state.head, new_clusters=tuple(new),
                          republished=(), suppressed_clusters=(), pseudonyms=tuple(pseud), fingerprints=fps,
                          record_cluster=record_cluster, counts=counts)


# --------------------------------------------------------------------------- listing


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
