"""Distinct people, verified: subject ids normalised, and one face under several ids found.

Every k rule rests on "k subject ids are k people". Ids that differ only by case, Unicode
normalisation or an invisible character are the same id; and records whose faces are
near-identical (the same photograph, perhaps with noise) or that a face recogniser matches as
the same person are the same person whatever their ids say. :func:`resolve_people` returns the
effective person of every record, used for every k rule downstream.
"""
from __future__ import annotations

import logging
import unicodedata
from dataclasses import dataclass, field, replace
from typing import Hashable, Mapping, Sequence

import numpy as np

from deid.errors import ConfigError
from deid.neighbours import distance_blocks

log = logging.getLogger(__name__)

# Near-duplicate rule: two records under different ids whose eigenface features are closer
# than this fraction of the median nearest-other-person distance are the same face. Measured
# on London (204 aligned faces, 50 eigenfaces): the nearest *other* person is never closer
# than 0.57 of that median (1st percentile 0.63); two copies of one photograph with Gaussian
# noise sigma 2/4/8 grey levels are at most 0.012/0.022/0.046. (Two different photographs of
# one person are 0.32-1.5: not near-duplicates; the face recogniser's threshold finds those.)
NEAR_DUPLICATE_RATIO = 0.2
_EXACT_LIMIT = 20_000
_BUCKET = 2_000
_ROWS = 65_536  # rows converted to float64 at a time by the bucket split (3.2 MB at 50-d)


def normalize_subject_id(value: str) -> str:
    """NFKC, case-folded, invisible characters removed, inner whitespace collapsed."""
    s = unicodedata.normalize("NFKC", str(value))
    s = "".join(ch for ch in s if unicodedata.category(ch) not in ("Cf", "Cc", "Cs", "Co", "Cn"))
    s = " ".join(s.split())
    return unicodedata.normalize("NFKC", s.casefold())


class _UnionFind:
    def __init__(self, items: Sequence[Hashable]):
        self.parent = {x: x for x in items}

    def find(self, x: Hashable) -> Hashable:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: Hashable, b: Hashable) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        # The smaller id (string order) represents the group, so the result is order-free.
        lo, hi = sorted((ra, rb), key=str)
        self.parent[hi] = lo
        return True


@dataclass(frozen=True)
class PeopleResolution:
    """Effective person of every record and how it was reached.

    ``person`` is aligned with the input records; ``normalized_merges`` counts ids that
    became one by normalisation, ``face_merges`` lists the groups of ids joined because
    their faces matched (each with the evidence), ``flagged_records`` the records involved.
    """

    person: tuple[str, ...]
    normalized_merges: int
    face_merges: tuple[dict, ...] = field(default_factory=tuple)
    flagged_records: tuple[int, ...] = field(default_factory=tuple)

    @property
    def n_people(self) -> int:
        return len(set(self.person))

    def named(self, record_names: Sequence[str] | Mapping[int, str]) -> "PeopleResolution":
        """The same resolution, each merge's ``records`` (input positions) given by name: ``record_names[i]``
        (e.g. the staging record id ``r00000012`` = manifest row 12, what the steward can look up).

        A mapping needs only the positions in :attr:`face_merges` (:meth:`merged_positions`).
        """
        return replace(self, face_merges=tuple({**m, "records": [str(record_names[int(i)]) for i in m["records"]]}
                                               for m in self.face_merges))

    def merged_positions(self) -> list[int]:
        """The input positions of the records in :attr:`face_merges` (before :meth:`named`)."""
        return sorted({int(i) for m in self.face_merges for i in m["records"]})

    def summary(self) -> dict:
        """The counts the report carries, and up to 5 merges as examples, by record (:meth:`named`).

        Never a subject id, not even the steward's own: a report goes to recipients, and the dataset
        card sends them to it (issue 28).
        """
        return {"normalized_id_merges": self.normalized_merges, "face_merges": len(self.face_merges),
                "records_in_face_merges": len(self.flagged_records), "people": self.n_people,
                "examples": [{key: v for key, v in m.items() if key != "ids"} for m in self.face_merges[:5]]}


def _nearest_other(X: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row, its nearest row under another code (index, squared distance); exact, blocked."""
    n = len(X)
    best = np.full(n, np.inf)
    arg = np.full(n, -1, dtype=np.int64)
    for s, d in distance_blocks(X, max_cells=4_000_000):
        d[codes[s:s + len(d), None] == codes[None, :]] = np.inf
        j = np.argmin(d, axis=1)
        arg[s:s + len(d)] = j
        best[s:s + len(d)] = d[np.arange(len(j)), j]
    return arg, np.maximum(best, 0.0)


def _buckets(X: np.ndarray, size: int) -> list[np.ndarray]:
    """Split rows at the median of the leading principal direction until buckets hold <= size.

    ``X`` may be float32 (the stage's features, half the memory of a float64 copy): each node is
    centred and projected in float64 a chunk of rows at a time, the same values as the float64
    copy of the node centred in place (the mean is a row-by-row sum, carried from chunk to chunk),
    so memory holds O(node) floats, not a float64 copy of the features (issue 13).
    """
    out, todo = [], [np.arange(len(X))]
    while todo:
        idx = todo.pop()
        if len(idx) <= size:
            out.append(idx)
            continue
        mean = _node_mean(X, idx)
        v = np.linalg.svd(X[idx[:: max(1, len(idx) // 2000)]].astype(np.float64) - mean, full_matrices=False)[2][0]
        proj = np.concatenate([(X[idx[a:a + _ROWS]].astype(np.float64) - mean) @ v
                               for a in range(0, len(idx), _ROWS)])
        order = np.argsort(proj, kind="stable")
        half = len(idx) // 2
        todo += [idx[order[:half]], idx[order[half:]]]
    return out


def _node_mean(X: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``X[idx].astype(float64).mean(axis=0)`` bit for bit, a chunk of rows at a time.

    NumPy sums an axis-0 reduction row by row; chaining each chunk onto the running sum keeps that order.
    """
    total = None
    for a in range(0, len(idx), _ROWS):
        rows = X[idx[a:a + _ROWS]].astype(np.float64)
        total = np.add.reduce(rows if total is None else np.vstack([total[None], rows]), axis=0)
    return total / len(idx)


def _person_codes(ids: Sequence[str]) -> np.ndarray:
    """An integer per record, equal for equal ids (a dict over the distinct ids: no sort of n str)."""
    code: dict[str, int] = {}
    return np.fromiter((code.setdefault(x, len(code)) for x in ids), dtype=np.int64, count=len(ids))


def resolve_people(subject_ids: Sequence[str], features: np.ndarray | None = None, *,
                   embeddings: np.ndarray | None = None, same_person_distance: float | None = None,
                   near_duplicate_ratio: float = NEAR_DUPLICATE_RATIO, space: str = "eigenface") -> PeopleResolution:
    """The effective person of every record.

    Parameters
    ----------
    subject_ids : sequence of str
        The manifest's subject ids, one per record.
    features : ndarray of shape (n, d), optional
        Eigenface coefficients; records under different ids closer than
        ``near_duplicate_ratio`` x the median nearest-other-person distance are merged. Float32 is
        kept as it is (half the memory) and gives the same merges as its float64 copy.
    embeddings : ndarray of shape (n, 128), optional
        dlib ResNet descriptors (:class:`deid.evaluation.recognizer.DlibEmbedder`); pairs under different
        ids that :func:`deid.evaluation.recognizer.same_person_pairs` calls the same person are merged.
    same_person_distance : float, optional
        Override of the recogniser's calibrated threshold (default
        :data:`deid.evaluation.recognizer.SAME_PERSON_THRESHOLD`).
    near_duplicate_ratio : float, default 0.2
    space : str, default "eigenface"
        What ``features`` are, named in the evidence of a merge (``"feature"`` for the vectors
        of a feature drop: the same ratio rule applies to any vector space).

    Returns
    -------
    PeopleResolution
    """
    # One normalised str per distinct id, shared by its records (a million records: 500,000 str, not 2 M).
    normal = {s: normalize_subject_id(s) for s in dict.fromkeys(subject_ids)}
    ids = [normal[s] for s in subject_ids]
    n = len(ids)
    normalized_merges = len(normal) - len(set(normal.values()))
    if not 0 < near_duplicate_ratio < 1:
        raise ConfigError(f"near_duplicate_ratio={near_duplicate_ratio!r} must be in (0, 1); e.g. 0.2")
    uf = _UnionFind(sorted(set(ids)))
    merges: list[dict] = []
    flagged: set[int] = set()

    def match(space: str, X: np.ndarray, threshold_sq: float | None, ratio: float | None) -> None:
        codes = _person_codes(ids)
        groups = [np.arange(n)] if n <= _EXACT_LIMIT else _buckets(X, _BUCKET)
        for idx in groups:
            if len(np.unique(codes[idx])) < 2:
                continue
            arg, d2 = _nearest_other(X[idx].astype(np.float64), codes[idx])
            limit = threshold_sq if threshold_sq is not None else (ratio ** 2) * float(np.median(d2))
            for i in np.flatnonzero(d2 < limit):
                a, b = int(idx[i]), int(idx[arg[i]])
                if uf.union(ids[a], ids[b]):
                    merges.append({"ids": sorted({ids[a], ids[b]}), "records": sorted((a, b)), "evidence": space,
                                   "distance": round(float(np.sqrt(d2[i])), 4),
                                   "threshold": round(float(np.sqrt(limit)), 4)})
                flagged.update((a, b))

    if features is not None and n >= 3:
        # float32 stays float32 (converted a bucket or chunk at a time: the same values as a float64 copy).
        X = features if isinstance(features, np.ndarray) and features.dtype == np.float32 \
            else np.asarray(features, dtype=np.float64)
        if X.shape[0] != n:
            raise ConfigError(f"features has {X.shape[0]} rows but subject_ids has {n}; pass one row per record")
        match(f"{space} near-duplicate", X, None, near_duplicate_ratio)
    if embeddings is not None and n >= 2:
        from deid.evaluation.recognizer import same_person_pairs  # noqa: PLC0415 (dlib import cost)

        E = np.asarray(embeddings, dtype=np.float64)
        if E.shape[0] != n:
            raise ConfigError(f"embeddings has {E.shape[0]} rows but subject_ids has {n}; pass one row per record")
        kw = {} if same_person_distance is None else {"threshold": float(same_person_distance)}
        found = same_person_pairs(E, ids, **kw)
        for pair in found.pairs:
            if uf.union(ids[pair.i], ids[pair.j]):
                merges.append({"ids": sorted({ids[pair.i], ids[pair.j]}),
                               "records": sorted((int(pair.i), int(pair.j))), "evidence": "face recogniser",
                               "distance": round(float(pair.distance), 4),
                               "threshold": round(float(found.threshold_used), 4)})
            flagged.update((int(pair.i), int(pair.j)))
    person = tuple(str(uf.find(x)) for x in ids)
    if normalized_merges or merges:
        log.warning("identity: %d ids merged by normalisation, %d by matching faces (%d records)",
                    normalized_merges, len(merges), len(flagged))
    return PeopleResolution(person=person, normalized_merges=normalized_merges, face_merges=tuple(merges),
                            flagged_records=tuple(sorted(flagged)))
