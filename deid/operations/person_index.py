"""One person index per project, across datasets: the same people never start a second lineage.

The lineage (:mod:`deid.release.lineage`) keeps successive releases of *one dataset* from leaking
by differencing (m-invariance, Xiao & Tao, SIGMOD 2007). Its unit is a dataset name, so the same
people dropped under another name would start a second, independent lineage, and two releases
of overlapping clusters give faces away (``|C2| M2 - |C1| M1``; Ganta, Kasiviswanathan & Smith,
KDD 2008). This index is looked up by every run whatever its dataset name:

- every record a lineage run takes in is registered with its dataset: the keyed digest of its
  source bytes' SHA-256 (the record fingerprint) and of its normalised steward id
  (:func:`deid.anonymise.identity.normalize_subject_id`); the subject id it was listed under is
  kept sealed (AES-256-GCM) beside its fingerprint, so a re-keyed record (the same bytes under a
  new id) is recognised as that person and can be listed under the registered id again;
- a drop whose records (or, with ``DEID_CROSS_DATASET_IDS=project``, whose steward ids) are
  registered under another dataset is, by ``DEID_CROSS_DATASET``, refused naming that dataset
  (``refuse``, the default) or planned in that dataset's lineage (``route``, said in the report);
- a released face run also registers its faces' dlib descriptors (sealed with the subject id), and
  every face run searches its people the lookup did not find among them (:meth:`PersonIndex.route_faces`,
  :func:`decide_faces`) at identity resolution's calibrated threshold: other photographs of a
  registered person under a new id are that person, refused or routed as above (the claim
  withdrawn, or moved to that lineage: :meth:`PersonIndex.withdraw`, :meth:`PersonIndex.resettle`).

Identical bytes are the same person whatever the id. Steward ids are taken as project-wide only
with ``DEID_CROSS_DATASET_IDS=project``; by default (``linked``) an id counts across datasets only
towards a dataset the drop already shares a photograph with (the sites of one project often number
their participants from 1 each).

The drop's people are claimed in the same transaction as the lookup (before the run's stages), so
two concurrent runs under different names cannot both miss each other; a refused drop claims
nothing. Storage: ``<data>/private/person_index.sqlite`` (0600), or the table
``deid_person_index`` of ``DEID_DATABASE_URL`` (several machines; the same server as the run
ledger and the lineage registries). Nothing is stored in clear but dataset names: digests are
HMAC-SHA256 under a key derived (HKDF-SHA256) from the steward's linkage key, so without the key the
index cannot be joined with a manifest. A lookup is a primary-key (B-tree) probe per digest:
``O(log n)`` per record (``bench/bench_person_index.py``).

References
----------
X. Xiao, Y. Tao. m-Invariance: towards privacy preserving re-publication of dynamic datasets.
SIGMOD 2007, 689-700.
S. R. Ganta, S. P. Kasiviswanathan, A. Smith. Composition attacks and auxiliary information in
data privacy. KDD 2008, 265-273.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from deid.anonymise.identity import normalize_subject_id
from deid.errors import ConfigError, DataError, StateError
from deid.sqlstore import PostgresStore, SQLiteStore, Tx, run_tx

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["CROSS_DATASET_POLICIES", "ID_SCOPES", "INDEX_FILE", "CrossDatasetRefusal", "DescriptorSearch", "FaceMatch",
           "FaceRouting", "decide_faces",
           "Matches", "PersonIndex", "Routing", "decide"]

CROSS_DATASET_POLICIES = ("refuse", "route")
ID_SCOPES = ("linked", "project")
INDEX_FILE = "person_index.sqlite"
FINGERPRINT, STEWARD_ID, KEY_CHECK = "fp", "id", "key"
KEY_BYTES = 32
NONCE_BYTES = 12
_BATCH = 500  # digests per IN (...) probe: far below SQLite's and PostgreSQL's parameter limits
# HMAC-SHA256 truncated to 128 bits: a chance collision among a billion digests is ~1e-21; half the key bytes
# of the full digest, so more of the B-tree stays in the page cache.
DIGEST_BYTES = 16

_SQLITE_SCHEMA = ("CREATE TABLE IF NOT EXISTS deid_person_index (kind TEXT NOT NULL, digest BLOB NOT NULL, "
                  "dataset TEXT NOT NULL, person BLOB, PRIMARY KEY (kind, digest, dataset)) WITHOUT ROWID")
_POSTGRES_SCHEMA = ("CREATE TABLE IF NOT EXISTS deid_person_index (kind TEXT NOT NULL, digest BYTEA NOT NULL, "
                    "dataset TEXT NOT NULL, person BYTEA, PRIMARY KEY (kind, digest, dataset))")
# Face descriptors (dlib's 128-d, where a run computed them), each sealed with the subject id it was listed under.
_SQLITE_DESCRIPTORS = ("CREATE TABLE IF NOT EXISTS deid_person_descriptors (id INTEGER PRIMARY KEY, dataset TEXT NOT "
                       "NULL, sealed BLOB NOT NULL)")
_POSTGRES_DESCRIPTORS = ("CREATE TABLE IF NOT EXISTS deid_person_descriptors (id BIGSERIAL PRIMARY KEY, dataset TEXT "
                         "NOT NULL, sealed BYTEA NOT NULL)")
_INSERT = "INSERT INTO deid_person_index (kind, digest, dataset, person) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"


def _derive(key: bytes, purpose: str) -> bytes:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else type(key).__name__
        raise ConfigError(f"person index key must be {KEY_BYTES} bytes (the linkage key), got {got}; load it with "
                          "deid.release.linkage.ensure_linkage_key")
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=b"deid-person-index",
                info=f"deid-person-index-v1|{purpose}".encode()).derive(bytes(key))


def check_policy(policy: str, id_scope: str) -> None:
    """Refuse an unknown ``DEID_CROSS_DATASET`` or ``DEID_CROSS_DATASET_IDS`` value, naming the valid ones."""
    if policy not in CROSS_DATASET_POLICIES:
        raise ConfigError(f"DEID_CROSS_DATASET={policy!r} must be one of {CROSS_DATASET_POLICIES}: 'refuse' stops a "
                          "drop whose people another dataset released, 'route' plans it in that dataset's lineage")
    if id_scope not in ID_SCOPES:
        raise ConfigError(f"DEID_CROSS_DATASET_IDS={id_scope!r} must be one of {ID_SCOPES}: 'project' when steward "
                          "ids name the same person in every dataset of the project, else 'linked'")


# --------------------------------------------------------------------------- the decision (pure)


class CrossDatasetRefusal(DataError):
    """A drop holding people another dataset's lineage holds (the signed rejection's check ``person_index``)."""

    check = "person_index"


@dataclass(frozen=True)
class Matches:
    """What the index holds for a drop: per dataset, the drop's records and ids registered there.

    ``records[dataset]``: ``{row: registered subject id}`` of the drop rows whose fingerprint is
    registered under ``dataset``; ``ids[dataset]``: the drop's subject ids (as listed) whose
    normalised form is registered there.
    """

    records: dict[str, dict[int, str]] = field(default_factory=dict)
    ids: dict[str, set[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Routing:
    """Where a drop's lineage is planned, and under which ids.

    ``dataset``: the lineage to plan in (the drop's own, or the one it was routed to);
    ``routed_from``: the drop's own dataset when routed, else None; ``aliases``: subject id as listed
    -> the id its photographs are registered under (re-keyed records); ``overlap``: people of the drop
    per other dataset that holds them; ``note``: the sentence for the report (empty: nothing to say);
    ``held``: people of the drop that ``dataset`` held before this claim (by photograph or id);
    ``claimed`` / ``claimed_ids``: the fingerprint and id digests this claim added (16 bytes each,
    concatenated), what :meth:`PersonIndex.withdraw` takes back if a later stage refuses the drop.
    """

    dataset: str
    routed_from: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    overlap: dict[str, int] = field(default_factory=dict)
    note: str = ""
    held: int = 0
    claimed: bytes = field(default=b"", repr=False, compare=False)
    claimed_ids: bytes = field(default=b"", repr=False, compare=False)

    @property
    def own_dataset(self) -> str:
        """The drop's own dataset name (``dataset:`` in drop.yaml)."""
        return self.routed_from or self.dataset


def decide(matches: Matches, subject_ids: Sequence[str], *, dataset: str, policy: str = "refuse",
           id_scope: str = "linked") -> Routing:
    """Decide a drop's lineage from what the person index holds (pure).

    Parameters
    ----------
    matches : Matches
        :meth:`PersonIndex.lookup` of the drop.
    subject_ids : sequence of str
        Each drop row's subject id as listed (rows as in ``matches``).
    dataset : str
        The drop's dataset name (``dataset:`` in drop.yaml, default its name).
    policy : {"refuse", "route"}
        ``DEID_CROSS_DATASET``.
    id_scope : {"linked", "project"}
        ``DEID_CROSS_DATASET_IDS``: whether a steward id alone ties a person to another dataset.

    Returns
    -------
    Routing

    Raises
    ------
    DataError
        The drop holds people of another dataset and ``policy="refuse"``, people of two datasets
        besides (or of the drop's own and another), or an id whose photographs are registered under
        two different people: the message names the datasets and what to do.
    """
    check_policy(policy, id_scope)
    ids = [str(s) for s in subject_ids]
    people: dict[str, set[str]] = defaultdict(set)  # dataset -> the drop's subject ids found there
    for ds_name, rows in matches.records.items():
        people[ds_name].update(ids[r] for r in rows)
    for ds_name, found in matches.ids.items():
        if id_scope == "project" or ds_name in matches.records or ds_name == dataset:
            people[ds_name].update(found)
    others = sorted(d for d in people if d != dataset)
    overlap = {d: len(people[d]) for d in others}
    if not others:
        return Routing(dataset=dataset, aliases=_aliases(matches.records.get(dataset, {}), ids, dataset),
                       held=len(people.get(dataset, ())))
    named = ", ".join(f"{d!r} ({overlap[d]} people)" for d in others)
    if policy == "refuse":
        raise CrossDatasetRefusal(
            f"the drop of dataset {dataset!r} holds people already registered under dataset {named} in this project's "
            "person index (the same photographs or steward ids): releasing them independently would let the two "
            "lineages be differenced (DEID_CROSS_DATASET=refuse); set `dataset: "
            f"{others[0]}` in drop.yaml to release it in that lineage, or DEID_CROSS_DATASET=route")
    if len(others) > 1 or dataset in people:
        mine = f" and {len(people[dataset])} of its own dataset {dataset!r}" if dataset in people else ""
        raise CrossDatasetRefusal(
            f"the drop of dataset {dataset!r} holds people of datasets {named}{mine}: one run plans in one lineage "
            "(DEID_CROSS_DATASET=route); split the drop by the dataset its people were released in")
    target = others[0]
    aliases = _aliases(matches.records.get(target, {}), ids, target)
    note = (f"person index: {overlap[target]} of the drop's people are registered under dataset {target!r}: the drop "
            f"of dataset {dataset!r} is planned in {target!r}'s lineage (DEID_CROSS_DATASET=route)"
            + (f"; {len(aliases)} subject ids re-keyed (their photographs are registered under another id) are "
               "listed under their registered ids" if aliases else ""))
    return Routing(dataset=target, routed_from=dataset, aliases=aliases, overlap=overlap, note=note,
                   held=overlap[target])


def _aliases(rows: dict[int, str], ids: list[str], dataset: str) -> dict[str, str]:
    """Subject id as listed -> the id its registered photographs carry, where the two differ."""
    found: dict[str, dict[str, str]] = defaultdict(dict)  # id as listed -> {normalised registered id: registered id}
    for r, registered in rows.items():
        found[ids[r]].setdefault(normalize_subject_id(registered), registered)
    both = [s for s, r in found.items() if len(r) > 1]
    if both:
        raise DataError(f"{len(both)} subject ids of the drop list photographs registered under different people of "
                        f"dataset {dataset!r}; one id must be one person: fix the manifest")
    return {s: reg for s, r in sorted(found.items()) for norm, reg in r.items() if norm != normalize_subject_id(s)}


# --------------------------------------------------------------------------- face descriptors (pure)


@dataclass(frozen=True)
class FaceMatch:
    """A drop face within the same-person distance of a registered face: drop row, dataset, registered id, distance."""

    row: int
    dataset: str
    subject_id: str
    distance: float


# A descriptor this close to a registered one is that registered face again (the same photograph re-dropped): not
# registered twice. Two photographs of one person are >= 0.1 apart in dlib's space; float32 rounding is ~3e-4.
COPY_DISTANCE = 0.01


@dataclass(frozen=True)
class FaceRouting:
    """What the face search found for a drop: its people matched to people the index registered.

    ``dataset``: the lineage to plan in (the claim's, or the one matched faces routed the drop to);
    ``routed_from``: the lineage planned before, when routed; ``aliases``: drop person -> the registered
    person (in ``dataset``) it is planned as; ``matched``: drop people matched per dataset;
    ``searched``: drop people searched (with a descriptor, not found by the fingerprint and id lookup);
    ``faces``: descriptors of the drop; ``registered``: descriptors in the index; ``threshold``: the
    same-person distance used; ``fresh``: descriptor rows with no registered copy (registered with the
    release); ``note``: the sentence for the report (empty: nothing to say).
    """

    dataset: str
    threshold: float
    searched: int = 0
    faces: int = 0
    registered: int = 0
    matched: dict[str, int] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    routed_from: str | None = None
    fresh: tuple[int, ...] = ()
    note: str = ""

    @property
    def n_matched(self) -> int:
        return sum(self.matched.values())

    def detail(self) -> str:
        """The ``person_index`` check's detail: what was searched, how, and what was found (the recall's numerator)."""
        found = ", ".join(f"{n} of dataset {d!r}" for d, n in sorted(self.matched.items())) or "none"
        return (f"face search: {self.n_matched} of the {self.searched} people the fingerprint and id lookup did not "
                f"find matched a registered person by face ({found}); {self.faces} descriptors of the drop searched "
                f"among {self.registered} registered, at identity resolution's calibrated threshold "
                f"{self.threshold:.3f} (more than one matching pair for a person of several photographs)"
                + (f"; {self.note}" if self.note else ""))


def decide_faces(pairs: Sequence[tuple[int, int, float]], people: Sequence[str], owners: Sequence[tuple[str, str]], *,
                 lineage: str, dataset: str, threshold: float, known: frozenset[str] | set[str] = frozenset(),
                 held: int = 0, policy: str = "refuse") -> FaceRouting:
    """Decide a drop's lineage from its faces' matches among the registered faces (pure).

    A drop person A matches a registered person B when at least ``min(2, |A| |B|)`` of their cross
    pairs lie within ``threshold`` (|A|, |B|: their descriptors): the rule of identity resolution's
    merges (:func:`deid.anonymise.identity._evidence_merges`), one pair being evidence only where no
    second pair exists. Of several matching registered people the one with most pairs (then the
    nearest) is taken. Matches in ``lineage`` are planned as those people; matches in another dataset
    are refused naming it (``policy="refuse"``) or route the drop there (``"route"``), unless the drop
    also holds people of ``lineage`` or of a third dataset (refused either way: one run, one lineage).

    Parameters
    ----------
    pairs : sequence of (int, int, float)
        (descriptor row, registered descriptor, distance) within ``threshold``
        (:meth:`DescriptorSearch.within`).
    people : sequence of str
        The drop person (identity resolution's effective id) of each descriptor row.
    owners : sequence of (str, str)
        (dataset, subject id) of each registered descriptor.
    lineage : str
        The lineage the drop is planned in so far (the claim's :attr:`Routing.dataset`).
    dataset : str
        The drop's own dataset name (named in the messages).
    threshold : float
        Identity resolution's calibrated same-person distance (stated in the detail).
    known : set of str
        Drop people ``lineage`` holds already (found by the fingerprint and id lookup): not matched again.
    held : int
        People of the drop ``lineage`` held before this run.
    policy : {"refuse", "route"}
        ``DEID_CROSS_DATASET``.

    Returns
    -------
    FaceRouting

    Raises
    ------
    CrossDatasetRefusal
        People matched in another dataset under ``refuse``, or in two lineages under ``route``.

    References
    ----------
    D. E. King. High quality face recognition with deep metric learning. dlib blog, 2017.
    X. Xiao, Y. Tao. m-Invariance: towards privacy preserving re-publication of dynamic datasets. SIGMOD 2007.
    """
    check_policy(policy, ID_SCOPES[0])
    rows_of = Counter(people)
    keys = [(d, normalize_subject_id(s)) for d, s in owners]
    size = Counter(keys)
    evidence: dict[str, dict[tuple[str, str], list]] = defaultdict(dict)  # drop person -> {registered: [pairs, d]}
    for r, j, d in pairs:
        a, b = people[r], keys[j]
        if a in known or b == (lineage, a):
            continue
        e = evidence[a].setdefault(b, [0, np.inf])
        e[0] += 1
        e[1] = min(e[1], float(d))
    match: dict[str, tuple[str, str]] = {}
    for a, cands in evidence.items():
        ok = [(-c, d, b) for b, (c, d) in cands.items() if c >= min(2, rows_of[a] * size[b])]
        if ok:
            match[a] = min(ok)[2]
    matched = dict(sorted(Counter(ds for ds, _ in match.values()).items()))
    searched = len(set(rows_of) - set(known))
    base = FaceRouting(dataset=lineage, threshold=float(threshold), searched=searched, faces=len(people),
                       registered=len(owners), matched=matched)
    others = [d for d in matched if d != lineage]
    mine = {a: reg for a, (ds, reg) in sorted(match.items()) if ds == lineage}
    if not others:
        note = (f"{len(mine)} people of the drop match people of {lineage!r} registered under other ids by face: "
                "planned as those people" if mine else "")
        return replace(base, aliases=mine, note=note)
    named = ", ".join(f"{d!r} ({matched[d]} people)" for d in others)
    how = (f"other photographs under other ids, found by face at the recogniser's threshold {threshold:.3f}: "
           f"{sum(matched[d] for d in others)} of the {searched} people searched")
    if policy == "refuse":
        raise CrossDatasetRefusal(
            f"the drop of dataset {dataset!r} holds people whose faces match people registered under dataset {named} "
            f"in this project's person index ({how}): releasing them independently would let the two lineages be "
            f"differenced (DEID_CROSS_DATASET=refuse); set `dataset: {others[0]}` in drop.yaml to release it in that "
            "lineage, or DEID_CROSS_DATASET=route")
    if len(others) > 1 or held or mine:
        also = f" and {max(held, len(mine))} of the lineage {lineage!r} it is planned in" if held or mine else ""
        raise CrossDatasetRefusal(
            f"the drop of dataset {dataset!r} holds people whose faces match people of datasets {named}{also} ({how}): "
            "one run plans in one lineage (DEID_CROSS_DATASET=route); split the drop by the dataset its people were "
            "released in")
    target = others[0]
    aliases = {a: reg for a, (ds, reg) in sorted(match.items()) if ds == target}
    note = (f"person index: {matched[target]} of the drop's people match people registered under dataset {target!r} "
            f"by face (other photographs under other ids): the drop of dataset {dataset!r} is planned in {target!r}'s "
            "lineage, those people under their registered ids (DEID_CROSS_DATASET=route)")
    return replace(base, dataset=target, routed_from=lineage, aliases=aliases, note=note)


class DescriptorSearch:
    """Nearest registered face descriptor of each probe, sub-linear in the number registered.

    An inverted file (IVF; Sivic & Zisserman, ICCV 2003; Jegou, Douze & Schmid, TPAMI 2011): the
    registered descriptors are split by a coarse k-means quantiser into about ``sqrt(n)`` lists; a
    probe is compared with the list centroids and then, exactly, with the members of its
    ``nprobe`` nearest lists: ``O(sqrt(n) + nprobe * sqrt(n))`` distances per probe instead of
    ``n``. Below ``exact_below`` descriptors every probe is compared with all of them.

    A probe's true nearest neighbour can sit in a list that is not probed (a miss, never a false
    match): the bench reports the recall against the exact search.

    Parameters
    ----------
    vectors : ndarray (n, d)
        The registered descriptors.
    nprobe : int
        Lists searched per probe.
    seed : int
        Of the quantiser's k-means (the same index for the same descriptors; not a secret).
    """

    def __init__(self, vectors: np.ndarray, *, nprobe: int = 16, exact_below: int = 20_000, seed: int = 0,
                 iterations: int = 8, train_sample: int = 65_536):
        X = np.ascontiguousarray(vectors, dtype=np.float32)
        if X.ndim != 2:
            raise ConfigError(f"vectors has shape {X.shape}; pass an (n, d) array of face descriptors")
        self.X, self.nprobe = X, max(1, int(nprobe))
        self.sq = np.einsum("ij,ij->i", X, X)
        self.lists: list[np.ndarray] | None = None
        n = len(X)
        if n < exact_below:
            return
        n_lists = int(min(4096, max(16, round(np.sqrt(n)))))
        rng = np.random.default_rng(seed)
        # 32 training points per list (faiss's guideline is 30-256): the quantiser only has to split the space.
        train = X[np.sort(rng.choice(n, min(n, train_sample, 32 * n_lists), replace=False))]
        C = train[rng.choice(len(train), n_lists, replace=False)].copy()
        for _ in range(iterations):  # Lloyd's k-means on the sample; empty lists keep their centroid
            a = self._nearest(train, C)
            order = np.argsort(a, kind="stable")
            counts = np.bincount(a, minlength=n_lists)
            full = np.flatnonzero(counts)
            sums = np.add.reduceat(train[order], np.concatenate([[0], np.cumsum(counts)[:-1]])[full], axis=0)
            C[full] = sums / counts[full, None]
        self.C = C
        assign = np.concatenate([self._nearest(X[a:a + 65_536], C) for a in range(0, n, 65_536)])
        order = np.argsort(assign, kind="stable")
        bounds = np.searchsorted(assign[order], np.arange(n_lists + 1))
        self.lists = [order[bounds[i]:bounds[i + 1]] for i in range(n_lists)]
        # The descriptors stored list by list: a probe reads its lists as contiguous slices (no gather).
        self._order, self._bounds = order, bounds
        self._Xs, self._sqs = X[order], self.sq[order]

    @staticmethod
    def _nearest(X: np.ndarray, C: np.ndarray) -> np.ndarray:
        return np.argmin(np.einsum("ij,ij->i", C, C)[None, :] - 2.0 * X @ C.T, axis=1)

    def search(self, probes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index of the nearest registered descriptor, its Euclidean distance) of each probe."""
        Q = np.ascontiguousarray(probes, dtype=np.float32).reshape(-1, self.X.shape[1])
        idx = np.full(len(Q), -1, np.int64)
        dist = np.full(len(Q), np.inf)
        if not len(self.X):
            return idx, dist
        if self.lists is None:
            for a in range(0, len(Q), 256):
                q = Q[a:a + 256]
                d2 = self.sq[None, :] - 2.0 * q @ self.X.T + np.einsum("ij,ij->i", q, q)[:, None]
                j = np.argmin(d2, axis=1)
                idx[a:a + 256], dist[a:a + 256] = j, np.sqrt(np.maximum(d2[np.arange(len(q)), j], 0))
            return idx, dist
        dc = np.einsum("ij,ij->i", self.C, self.C)[None, :] - 2.0 * Q @ self.C.T
        near = np.argsort(dc, axis=1)[:, :self.nprobe]
        b = self._bounds
        for i, q in enumerate(Q):
            best, at = np.inf, -1
            for c in near[i].tolist():
                lo, hi = int(b[c]), int(b[c + 1])
                if hi == lo:
                    continue
                d2 = self._sqs[lo:hi] - 2.0 * (self._Xs[lo:hi] @ q)
                j = int(np.argmin(d2))
                if d2[j] < best:
                    best, at = float(d2[j]), lo + j
            if at >= 0:
                idx[i], dist[i] = self._order[at], float(np.sqrt(max(best + float(q @ q), 0.0)))
        return idx, dist

    def within(self, probes: np.ndarray, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every registered descriptor within ``radius`` of each probe: (probe, registered index, distance) arrays.

        The inverted file looks in the probe's ``nprobe`` nearest lists, as :meth:`search` does (a
        pair in a list not searched is missed, never invented).
        """
        Q = np.ascontiguousarray(probes, dtype=np.float32).reshape(-1, self.X.shape[1])
        r2 = float(radius) ** 2
        ps: list[np.ndarray] = []
        js: list[np.ndarray] = []
        ds: list[np.ndarray] = []
        if len(self.X) and len(Q) and self.lists is None:
            for a in range(0, len(Q), 256):
                q = Q[a:a + 256]
                d2 = self.sq[None, :] - 2.0 * q @ self.X.T + np.einsum("ij,ij->i", q, q)[:, None]
                i, j = np.nonzero(d2 < r2)
                ps.append(i + a)
                js.append(j)
                ds.append(np.sqrt(np.maximum(d2[i, j], 0)))
        elif len(self.X) and len(Q):
            near = np.argsort(np.einsum("ij,ij->i", self.C, self.C)[None, :] - 2.0 * Q @ self.C.T, axis=1)
            b = self._bounds
            for p, q in enumerate(Q):
                qq = float(q @ q)
                for c in near[p, :self.nprobe].tolist():
                    lo, hi = int(b[c]), int(b[c + 1])
                    d2 = self._sqs[lo:hi] - 2.0 * (self._Xs[lo:hi] @ q) + qq
                    j = np.flatnonzero(d2 < r2)
                    if len(j):
                        ps.append(np.full(len(j), p))
                        js.append(self._order[lo + j])
                        ds.append(np.sqrt(np.maximum(d2[j], 0)))
        if not ps:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
        return (np.concatenate(ps).astype(np.int64), np.concatenate(js).astype(np.int64),
                np.concatenate(ds).astype(np.float64))


# --------------------------------------------------------------------------- storage


class PersonIndex:
    """The project's person index (see the module docstring).

    Parameters
    ----------
    location : path or str
        A SQLite file (created 0600 with its parent), or a PostgreSQL URL (``DEID_DATABASE_URL``).
    key : bytes
        The steward's 32-byte linkage key; the digest and sealing keys are derived from it.
    """

    def __init__(self, location: str | os.PathLike, key: bytes):
        self._aead = AESGCM(_derive(key, "seal"))
        # Keyed once; each digest copies it (the key's pads are not recomputed per record).
        self._hmac = hmac.new(_derive(key, "digest"), digestmod=hashlib.sha256)
        if isinstance(location, str) and "://" in location:
            self._store: SQLiteStore | PostgresStore = PostgresStore(
                location, (_POSTGRES_SCHEMA, _POSTGRES_DESCRIPTORS), lock="deid.person_index.schema",
                application="deid-person-index", what="lineage database {url} (DEID_DATABASE_URL; the person index)")
        else:
            # WAL: NORMAL syncs at checkpoints (a committed claim survives a process crash, as the ledger's do);
            # a 64 MiB page cache holds the upper B-tree levels of a million-face index.
            self._store = SQLiteStore(Path(location), (_SQLITE_SCHEMA, _SQLITE_DESCRIPTORS), private=True,
                                      pragmas=("PRAGMA synchronous=NORMAL", "PRAGMA cache_size=-65536"))

    @classmethod
    def open(cls, data_dir: str | os.PathLike, key: bytes, *, database_url: str | None = None) -> PersonIndex:
        """``<data_dir>/private/person_index.sqlite``, or the database at ``database_url`` when set."""
        return cls(database_url or Path(data_dir) / "private" / INDEX_FILE, key)

    @property
    def where(self) -> str:
        return self._store.describe()

    def _digest(self, kind: str, value: str) -> bytes:
        h = self._hmac.copy()
        h.update(f"{kind}|{value}".encode())
        return h.digest()[:DIGEST_BYTES]

    def _seal(self, digest: bytes, dataset: str, subject_id: str) -> bytes:
        # Bound to its digest and dataset: a sealed id moved to another row does not open.
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, subject_id.encode(), digest + dataset.encode())

    def _open(self, digest: bytes, dataset: str, blob: bytes) -> str:
        try:
            return self._aead.decrypt(bytes(blob[:NONCE_BYTES]), bytes(blob[NONCE_BYTES:]),
                                      bytes(digest) + dataset.encode()).decode()
        except InvalidTag:
            raise StateError(f"person index {self.where}: an entry does not authenticate under this project's linkage "
                             "key (tampered, or another key); restore the index from backup") from None

    def _run(self, op: Callable[[Tx], T]) -> T:
        """``op`` in one transaction (lookup and claim under one writer lock), re-run when the database aborted it."""
        def exhausted(attempt: int, exc: BaseException) -> StateError:
            return StateError(f"person index {self.where}: aborted {attempt} times by concurrent writers "
                              f"({type(exc).__name__}); run again")
        return run_tx(self._store, op, exhausted=exhausted)

    def _check_key(self, tx: Tx, *, write: bool) -> None:
        """The index was written under this project's linkage key (another key would find no one: a silent miss)."""
        mine = self._digest(KEY_CHECK, "deid-person-index-v1")
        got = [bytes(d) for (d,) in tx.all("SELECT digest FROM deid_person_index WHERE kind = ?", (KEY_CHECK,))]
        if got and mine not in got:
            raise StateError(f"person index {self.where} was written under another linkage key: with this key no "
                             "registered person would be found; configure the project's linkage key (DEID_LINKAGE_KEY)")
        if not got and write:
            tx.run(_INSERT, (KEY_CHECK, mine, "", None))

    def _lookup(self, tx: Tx, fp_digests: list[bytes], id_digests: dict[bytes, list[str]]) -> Matches:
        self._check_key(tx, write=False)
        by_fp: dict[bytes, list[int]] = defaultdict(list)
        for row, d in enumerate(fp_digests):
            by_fp[d].append(row)
        records: dict[str, dict[int, str]] = defaultdict(dict)
        ids: dict[str, set[str]] = defaultdict(set)
        for kind, wanted in ((FINGERPRINT, list(by_fp)), (STEWARD_ID, list(id_digests))):
            for a in range(0, len(wanted), _BATCH):
                chunk = wanted[a:a + _BATCH]
                got = tx.all(f"SELECT digest, dataset, person FROM deid_person_index WHERE kind = ? AND digest IN "
                             f"({', '.join('?' * len(chunk))})", (kind, *chunk))
                for digest, ds_name, person in got:
                    digest = bytes(digest)
                    if kind == FINGERPRINT:
                        who = self._open(digest, ds_name, person)
                        for row in by_fp[digest]:
                            records[ds_name][row] = who
                    else:
                        ids[ds_name].update(id_digests[digest])
        return Matches(records=dict(records), ids=dict(ids))

    def _digests(self, subject_ids: Sequence[str], fingerprints: Sequence[str]):
        if len(subject_ids) != len(fingerprints):
            raise ConfigError(f"fingerprints has {len(fingerprints)} entries but subject_ids has {len(subject_ids)}; "
                              "pass the source_sha256 of every record")
        return [self._digest(FINGERPRINT, str(f)) for f in fingerprints], self._id_digests(subject_ids)

    def _id_digests(self, subject_ids: Sequence[str]) -> dict[bytes, list[str]]:
        """Digest of each distinct normalised id -> the ids as listed that normalise to it."""
        id_digests: dict[bytes, list[str]] = defaultdict(list)
        for s in dict.fromkeys(map(str, subject_ids)):
            id_digests[self._digest(STEWARD_ID, normalize_subject_id(s))].append(s)
        return dict(id_digests)

    def lookup(self, subject_ids: Sequence[str], fingerprints: Sequence[str]) -> Matches:
        """What the index holds for these records (subject id as listed, source SHA-256 each), in any dataset."""
        fps, id_digests = self._digests(subject_ids, fingerprints)
        return self._run(lambda tx: self._lookup(tx, fps, id_digests))

    def _insert(self, tx: Tx, dataset: str, subject_ids: Sequence[str], fps: list[bytes],
                id_digests: dict[bytes, list[str]]) -> None:
        self._check_key(tx, write=True)
        rows: list[tuple[str, bytes, str, bytes | None]] = [
            (FINGERPRINT, d, dataset, self._seal(d, dataset, str(s))) for d, s in dict(zip(fps, subject_ids)).items()]
        rows += [(STEWARD_ID, d, dataset, None) for d in id_digests]
        rows.sort(key=lambda r: (r[0], r[1]))  # in key order: B-tree appends, not a random page per row
        for a in range(0, len(rows), 5000):
            tx.many(_INSERT, rows[a:a + 5000])

    def register(self, dataset: str, subject_ids: Sequence[str], fingerprints: Sequence[str]) -> None:
        """Register records (subject id, source SHA-256 each) under ``dataset``; already registered ones are kept."""
        fps, id_digests = self._digests(subject_ids, fingerprints)
        self._run(lambda tx: self._insert(tx, dataset, list(map(str, subject_ids)), fps, id_digests))

    def claim(self, dataset: str, subject_ids: Sequence[str], fingerprints: Sequence[str], *,
              policy: str = "refuse", id_scope: str = "linked") -> Routing:
        """Look the drop up, decide its lineage (:func:`decide`) and register its people there, in one transaction.

        A refused drop (:class:`~deid.errors.DataError`) registers nothing. Re-keyed records are
        registered under the id they were aliased to. The routing carries what was added
        (:attr:`Routing.claimed`), so a stage that refuses the drop later takes it back (:meth:`withdraw`).
        """
        check_policy(policy, id_scope)
        ids = list(map(str, subject_ids))
        fps, id_digests = self._digests(ids, fingerprints)
        return self._run(lambda tx: self._claim(tx, dataset, ids, fps, id_digests, policy=policy, id_scope=id_scope))

    def _claim(self, tx: Tx, dataset: str, ids: list[str], fps: list[bytes], id_digests: dict[bytes, list[str]], *,
               policy: str, id_scope: str) -> Routing:
        matches = self._lookup(tx, fps, id_digests)
        routing = decide(matches, ids, dataset=dataset, policy=policy, id_scope=id_scope)
        # Records registered there already are not sealed and written again (a re-drop: most of them).
        known = matches.records.get(routing.dataset, {})
        keep = [r for r in range(len(ids)) if r not in known]
        final = [routing.aliases.get(ids[r], ids[r]) for r in keep]
        new_fps = [fps[r] for r in keep]
        final_ids = self._id_digests(final) if routing.aliases or len(keep) < len(ids) else id_digests
        self._insert(tx, routing.dataset, final, new_fps, final_ids)
        # What this claim added: ids neither found there by the lookup nor the registered ids re-keyed records took.
        found, targets = matches.ids.get(routing.dataset, set()), set(routing.aliases.values())
        added_ids = [d for d, names in final_ids.items() if not any(n in found or n in targets for n in names)]
        return replace(routing, claimed=b"".join(dict.fromkeys(new_fps)), claimed_ids=b"".join(added_ids))

    def _delete(self, tx: Tx, routing: Routing) -> None:
        for kind, blob in ((FINGERPRINT, routing.claimed), (STEWARD_ID, routing.claimed_ids)):
            digests = [blob[a:a + DIGEST_BYTES] for a in range(0, len(blob), DIGEST_BYTES)]
            for a in range(0, len(digests), _BATCH):
                chunk = digests[a:a + _BATCH]
                tx.run(f"DELETE FROM deid_person_index WHERE kind = ? AND dataset = ? AND digest IN "
                       f"({', '.join('?' * len(chunk))})", (kind, routing.dataset, *chunk))

    def withdraw(self, routing: Routing) -> None:
        """Take back what :meth:`claim` added (:attr:`Routing.claimed`): a drop refused after its claim claims nothing.

        Rows registered before the claim (people the lineage held) stay.
        """
        self._run(lambda tx: self._delete(tx, routing))

    def resettle(self, routing: Routing, dataset: str, subject_ids: Sequence[str], fingerprints: Sequence[str], *,
                 id_scope: str = "linked") -> Routing:
        """Move a claim to the lineage of ``dataset`` (a drop routed there after its claim, e.g. by face), in one
        transaction: what the claim added is withdrawn and the drop claimed in ``dataset`` (``subject_ids``: as
        the drop is now listed, e.g. under registered ids)."""
        check_policy("route", id_scope)
        ids = list(map(str, subject_ids))
        fps, id_digests = self._digests(ids, fingerprints)

        def op(tx: Tx) -> Routing:
            self._delete(tx, routing)
            moved = self._claim(tx, dataset, ids, fps, id_digests, policy="route", id_scope=id_scope)
            if moved.dataset != dataset:  # the drop's records are registered in a third lineage: never planned twice
                raise CrossDatasetRefusal(f"the drop's records are registered under dataset {moved.dataset!r}, not "
                                          f"{dataset!r}: one run plans in one lineage; split the drop")
            return replace(moved, routed_from=routing.own_dataset, note=routing.note)
        return self._run(op)

    def route_faces(self, routing: Routing, people: Sequence[str], descriptors: np.ndarray, *, threshold: float,
                    known: frozenset[str] | set[str] = frozenset(), held: int = 0, policy: str = "refuse",
                    nprobe: int = 16) -> FaceRouting:
        """Search a drop's faces among the registered ones and decide (:func:`decide_faces`).

        Parameters
        ----------
        routing : Routing
            The drop's :meth:`claim`.
        people, descriptors
            The drop person (identity resolution's effective id) and dlib descriptor of each embedded face.
        threshold : float
            Identity resolution's calibrated same-person distance.
        known, held, policy
            As :func:`decide_faces`; ``held`` adds to the people the claim found in its lineage.

        Returns
        -------
        FaceRouting
            When it routes the drop (``routed_from``), move the claim with :meth:`resettle`.

        Raises
        ------
        CrossDatasetRefusal
            As :func:`decide_faces`; the claim is withdrawn first (a refused drop claims nothing).
        """
        search, owners = self.face_search(nprobe=nprobe)
        D = np.asarray(descriptors, np.float32)
        probe, reg, dist = search.within(D, max(float(threshold), COPY_DISTANCE))
        pairs = [(int(p), int(j), float(d)) for p, j, d in zip(probe, reg, dist) if d < threshold]
        copies = set(probe[dist < COPY_DISTANCE].tolist())
        try:
            faces = decide_faces(pairs, [str(p) for p in people], owners, lineage=routing.dataset,
                                 dataset=routing.own_dataset, threshold=threshold, known=known,
                                 held=routing.held + held, policy=policy)
        except CrossDatasetRefusal:
            self.withdraw(routing)
            raise
        return replace(faces, fresh=tuple(i for i in range(len(D)) if i not in copies))

    def register_faces(self, dataset: str, subject_ids: Sequence[str], descriptors: np.ndarray) -> None:
        """Register face descriptors (one per record, with the subject id it is listed under) under ``dataset``."""
        D = np.asarray(descriptors, dtype="<f4")
        if D.ndim != 2 or len(D) != len(subject_ids):
            raise ConfigError(f"descriptors has shape {D.shape} for {len(subject_ids)} subject ids; pass one (d,) "
                              "descriptor per record")
        rows = []
        for s, v in zip(map(str, subject_ids), D):
            nonce = secrets.token_bytes(NONCE_BYTES)
            body = len(s.encode()).to_bytes(2, "big") + s.encode() + v.tobytes()
            rows.append((dataset, nonce + self._aead.encrypt(nonce, body, b"descriptor|" + dataset.encode())))

        def op(tx: Tx) -> None:
            self._check_key(tx, write=True)
            for a in range(0, len(rows), 5000):
                tx.many("INSERT INTO deid_person_descriptors (dataset, sealed) VALUES (?, ?)", rows[a:a + 5000])
        self._run(op)

    def face_search(self, *, nprobe: int = 16) -> tuple[DescriptorSearch, list[tuple[str, str]]]:
        """The registered descriptors opened and indexed; (search, (dataset, subject id) of each)."""
        def op(tx: Tx):
            self._check_key(tx, write=False)
            return tx.all("SELECT dataset, sealed FROM deid_person_descriptors ORDER BY id")
        owners, vecs = [], []
        for ds_name, blob in self._run(op):
            blob = bytes(blob)
            try:
                body = self._aead.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], b"descriptor|" + ds_name.encode())
            except InvalidTag:
                raise StateError(f"person index {self.where}: a face descriptor does not authenticate under this "
                                 "project's linkage key; restore the index from backup") from None
            n = int.from_bytes(body[:2], "big")
            owners.append((ds_name, body[2:2 + n].decode()))
            vecs.append(np.frombuffer(body[2 + n:], "<f4"))
        X = np.vstack(vecs) if vecs else np.zeros((0, 128), np.float32)
        return DescriptorSearch(X, nprobe=nprobe), owners

    def match_faces(self, descriptors: np.ndarray, *, threshold: float | None = None,
                    nprobe: int = 16) -> list[FaceMatch]:
        """Drop faces whose nearest registered face is within ``threshold`` (default: the recogniser's
        same-person distance, :data:`deid.evaluation.recognizer.SAME_PERSON_THRESHOLD`)."""
        if threshold is None:
            from deid.evaluation.recognizer import SAME_PERSON_THRESHOLD  # noqa: PLC0415 - dlib only when needed
            threshold = SAME_PERSON_THRESHOLD
        search, owners = self.face_search(nprobe=nprobe)
        idx, dist = search.search(np.asarray(descriptors, np.float32))
        return [FaceMatch(row=i, dataset=owners[j][0], subject_id=owners[j][1], distance=float(d))
                for i, (j, d) in enumerate(zip(idx.tolist(), dist.tolist())) if j >= 0 and d < threshold]

    def count(self) -> int:
        """Rows held (fingerprints and ids of every dataset)."""
        return int(self._run(lambda tx: tx.all("SELECT count(*) FROM deid_person_index WHERE kind <> ?",
                                               (KEY_CHECK,)))[0][0])
