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
from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

from deid.anonymise.identity_calibration import FALSE_MERGE_TARGET, MAX_SAME_PERSON, Calibration, calibrate_recogniser
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
CANDIDATES_PER_RECORD = 4  # nearest other-id neighbours per record in the cheap first pass
# A near miss (PeopleResolution.suspects): a face whose nearest face of another effective person is within the cap
# and within this fraction of its subset's median nearest-other-id distance. Planted copies sit at 0.16-0.4 x (re-lit
# ones, and copies 0.2 from their victim whose number dragged the threshold under them); London's closest two
# participants at 0.458 are above the cap; faces the recogniser does not separate sit near 1 x their median.
NEAR_MISS_RATIO = 0.5
# One pair joins two groups of several faces alone when it is a near copy: below the near-copy distance (0.12) and
# below this fraction of its subset's median nearest-other-id distance. Real faces' subsets sit at 0.52-0.62
# (London, and London at 48x48: the near-copy distance decides there); cartoons' at 0.18-0.25, where different
# people lie 0.11-0.12 apart (three false merges in a 5,000-face `deid synth --fast` drop without this ratio).
NEAR_COPY_RATIO = 0.25
_EXACT_LIMIT = 20_000
# Above _EXACT_LIMIT rows the nearest-other searches run within buckets of _BUCKET rows of _TREES trees
# (principal directions, then random ones). 200,000 48-d Gaussian rows with 4,000 planted near pairs
# (the figures in docs/pipeline.md): one tree of 2,000-row buckets missed 403 pairs (8.9 CPU-s), two
# trees of 2,000 37 (16.8), three of 1,000 8 (16.6), four of 700 1 (20.8).
_BUCKET = 1_000
_TREES = 3
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
    calibration: dict | None = None  # the recogniser's calibration on this drop (Calibration.to_dict), None: not run
    # Near misses: embedded records within the same-person cap (MAX_SAME_PERSON) and NEAR_MISS_RATIO x their subset's
    # median nearest-other-id distance of a record of another effective person, closest first. Not merged (too little evidence, or a subset the recogniser does not separate), they
    # are what a Sybil drop that identity resolution missed looks like: the gate's within-cluster check looks at
    # their clusters whatever its sample (issue 27).
    suspects: tuple[int, ...] = field(default_factory=tuple)

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
                "examples": [{key: v for key, v in m.items() if key != "ids"} for m in self.face_merges[:5]],
                **({"recogniser": self.calibration} if self.calibration is not None else {})}


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


def _buckets(X: np.ndarray, size: int, *, seed: int | None = None) -> list[np.ndarray]:
    """Split rows at the median of the leading principal direction until buckets hold <= size.

    With ``seed``, each node splits along a random unit direction instead (a random projection tree,
    Dasgupta and Freund, STOC 2008): two near rows that one tree separates are rarely separated by a tree of
    other directions too, so searching within the buckets of several trees misses far fewer near pairs.

    ``X`` may be float32 (the stage's features, half the memory of a float64 copy): each node is
    centred and projected in float64 a chunk of rows at a time, the same values as the float64
    copy of the node centred in place (the mean is a row-by-row sum, carried from chunk to chunk),
    so memory holds O(node) floats, not a float64 copy of the features (issue 13).
    """
    out, todo = [], [np.arange(len(X))]
    rng = None if seed is None else np.random.default_rng(seed)
    while todo:
        idx = todo.pop()
        if len(idx) <= size:
            out.append(idx)
            continue
        mean = _node_mean(X, idx)
        if rng is None:
            v = np.linalg.svd(X[idx[:: max(1, len(idx) // 2000)]].astype(np.float64) - mean,
                              full_matrices=False)[2][0]
        else:
            v = rng.standard_normal(X.shape[1])
            v /= np.linalg.norm(v)
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


def _search_groups(X: np.ndarray) -> list[list[np.ndarray]]:
    """The row groups a nearest-other search runs within: all rows up to ``_EXACT_LIMIT`` (exact); above it
    the buckets of ``_TREES`` trees (:func:`_buckets`), principal directions then random directions (seeds 0,
    1, ...), so a near pair is missed only when every tree splits it."""
    n = len(X)
    if n <= _EXACT_LIMIT:
        return [[np.arange(n)]]
    return [_buckets(X, _BUCKET, seed=None if t == 0 else t - 1) for t in range(_TREES)]


def _knn_other(X: np.ndarray, codes: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``m`` nearest rows under other codes (indices, squared distances), exact and blocked.

    Above ``_EXACT_LIMIT`` rows the search runs within the buckets of several trees (:func:`_search_groups`)
    and keeps each row's ``m`` nearest over all: near neighbours are found unless every tree splits them.
    """
    n = len(X)
    idx = np.full((n, m), -1, np.int64)
    d2 = np.full((n, m), np.inf)
    for groups in _search_groups(X):
        _knn_in_groups(X, codes, m, groups, idx, d2)
    idx[~np.isfinite(d2)] = -1
    return idx, d2


def _knn_in_groups(X: np.ndarray, codes: np.ndarray, m: int, groups: list[np.ndarray], idx: np.ndarray,
                   d2: np.ndarray) -> None:
    """One tree's share of :func:`_knn_other`: each row's ``m`` nearest other-code rows within its group, merged
    into ``idx``/``d2`` (kept sorted, nearest first; a row found by several trees counted once)."""
    for g in groups:
        Xg = X[g].astype(np.float64)
        for s, d in distance_blocks(Xg, max_cells=4_000_000):
            rows = np.arange(s, s + len(d))
            d[codes[g][rows, None] == codes[g][None, :]] = np.inf
            kk = min(m, d.shape[1])
            part = np.argpartition(d, kk - 1, axis=1)[:, :kk]
            vals = np.maximum(np.take_along_axis(d, part, axis=1), 0.0)
            new_idx = np.where(np.isfinite(vals), g[part], -1)
            # Merge with what an earlier tree found: a neighbour found twice is kept once (its first copy).
            at = g[rows]
            cand_i = np.concatenate([idx[at], new_idx], axis=1)
            cand_d = np.concatenate([d2[at], vals], axis=1)
            order = np.argsort(cand_d, axis=1, kind="stable")
            cand_i, cand_d = np.take_along_axis(cand_i, order, 1), np.take_along_axis(cand_d, order, 1)
            dup = np.zeros(cand_i.shape, bool)
            for c in range(1, cand_i.shape[1]):
                dup[:, c] = ((cand_i[:, :c] == cand_i[:, c:c + 1]) & (cand_i[:, c:c + 1] >= 0)).any(1)
            cand_d[dup] = np.inf
            order = np.argsort(cand_d, axis=1, kind="stable")[:, :m]
            idx[at] = np.take_along_axis(cand_i, order, 1)
            d2[at] = np.take_along_axis(cand_d, order, 1)


def cheap_candidates(X: np.ndarray, codes: np.ndarray, budget: int, *, per_record: int = CANDIDATES_PER_RECORD,
                     references: int = 0, seed: int = 0) -> tuple[np.ndarray, int]:
    """The records the deep recogniser should see: the closest cross-id pairs of a cheap first pass.

    Every record's ``per_record`` nearest records under other ids are found in the cheap space
    (e.g. self-quotient images, :class:`deid.alignment.features.IlluminationFeatures`: illumination-robust,
    ~0.1 ms a face; nearest-neighbour search, not all pairs);
    pairs are ranked by their distance over the median nearest-other distance and taken, closest first,
    until ``budget - references`` records are flagged. Then ``references`` records of ids with several
    faces (two per id) are added for the calibration: half among the flagged faces' nearest other ids, half
    drawn with ``seed``. Returns the sorted record
    positions and how many were flagged by the first pass.
    """
    n = len(X)
    if n <= budget:
        return np.arange(n), n
    nb, d2 = _knn_other(X, codes, per_record)
    finite = d2[:, 0][np.isfinite(d2[:, 0])]
    scale = float(np.median(finite)) if len(finite) else 1.0
    i, j = np.nonzero(np.isfinite(d2))
    ratio = d2[i, j] / max(scale, 1e-12)
    order = np.argsort(ratio, kind="stable")
    chosen: dict[int, None] = {}
    room = max(0, budget - references)
    for t in order:
        a, b = int(i[t]), int(nb[i[t], j[t]])
        if len(chosen) + (a not in chosen) + (b not in chosen) > room:
            break
        chosen[a] = chosen[b] = None
    flagged = len(chosen)
    if references:
        counts = np.bincount(codes)
        pos = np.argsort(codes, kind="stable")
        starts = np.concatenate([[0], np.cumsum(counts)])

        def add(c: int) -> bool:  # two faces of id c; False when the budget is full
            if len(chosen) + 2 > budget:
                return False
            chosen.update(dict.fromkeys(int(r) for r in pos[starts[c]:starts[c] + 2]))
            return True

        # Half the references are the flagged faces' own neighbours (ids with several faces among their nearest
        # other ids): the calibration judges each flagged face among faces of its kind (cartoons far away do
        # not decide for real faces); the other half ids drawn at random.
        local = budget - references // 2
        for a in list(chosen):
            for b in nb[a]:
                if b >= 0 and counts[codes[b]] >= 2 and len(chosen) < local:
                    add(int(codes[b]))
        several = np.flatnonzero(counts >= 2)
        np.random.default_rng(seed).shuffle(several)
        for c in several:
            if not add(int(c)):
                break
    return np.array(sorted(chosen), dtype=np.int64), flagged


def _evidence_merges(E: np.ndarray, codes: np.ndarray, cal: Calibration) -> list[tuple[int, int, float, int, list]]:
    """Groups of ids to join: (a, b, distance, pairs, rows matched) over descriptor rows, joined only on enough evidence.

    A pair of rows under different ids matches below the calibrated threshold when both lie in informative
    subsets, below the near-copy distance otherwise. Two groups join when at least ``min(2, |A| |B|)`` of
    their cross pairs match (|A|: the group's embedded rows): one pair is evidence only where no second
    pair exists, or when it is a near-copy (below ``cal.duplicate`` and :data:`NEAR_COPY_RATIO` x its subset's
    median nearest-other-id distance: one photograph twice, re-lit or noised; a victim's second photograph is as
    far from her planted copies as from any photograph of her). Groups grow closest pair first until no join is
    left.
    """
    n = len(E)
    pairs = []
    for s, d2 in distance_blocks(E, max_cells=4_000_000, upper=True):
        for a, off in zip(*np.nonzero(d2 < float(cal.row_threshold.max(initial=cal.duplicate)) ** 2)):
            a, b = int(a + s), int(off + s)
            if b <= a or codes[a] == codes[b]:
                continue
            d = float(np.sqrt(max(d2[a - s, off], 0.0)))
            if d < min(cal.row_threshold[a], cal.row_threshold[b]):
                pairs.append((d, a, b))
    pairs.sort()
    near_copy = np.fmin(cal.duplicate, NEAR_COPY_RATIO * cal.row_scale)  # fmin: no subset median, the duplicate
    members: dict[int, list[int]] = {}
    for i, c in enumerate(codes.tolist()):
        members.setdefault(c, []).append(i)
    group = {i: int(codes[i]) for i in range(n)}  # row -> group (an id code), updated on joins
    size = {c: len(v) for c, v in members.items()}
    out = []
    changed = True
    while changed:
        changed = False
        count: dict[tuple[int, int], list] = {}
        for d, a, b in pairs:
            ga, gb = group[a], group[b]
            if ga != gb:
                key = (min(ga, gb), max(ga, gb))
                count.setdefault(key, [d, a, b, 0])[3] += 1
        for (ga, gb), (d, a, b, c) in sorted(count.items(), key=lambda kv: kv[1][0]):
            if c >= min(2, size[ga] * size[gb]) or d < near_copy[a] and d < near_copy[b]:
                rows = sorted({r for _, x, y in pairs for r in (x, y) if {group[x], group[y]} == {ga, gb}})
                for r in members[gb]:
                    group[r] = ga
                members[ga] += members.pop(gb)
                size[ga] += size.pop(gb)
                out.append((a, b, d, c, rows))
                changed = True
                break
    return out


def resolve_people(subject_ids: Sequence[str], features: np.ndarray | None = None, *,
                   embeddings: np.ndarray | None = None, same_person_distance: float | None = None,
                   near_duplicate_ratio: float = NEAR_DUPLICATE_RATIO, space: str = "eigenface",
                   cheap: np.ndarray | None = None, embed: Callable[[np.ndarray], np.ndarray] | None = None,
                   embed_budget: int = 2000, false_merge_target: float = FALSE_MERGE_TARGET) -> PeopleResolution:
    """The effective person of every record.

    Three rules, each at any size: normalised ids; eigenface (or feature) near-duplicates; and the face
    recogniser, calibrated on the drop's own faces (:func:`calibrate_recogniser`). The recogniser sees
    every record (``embeddings``), or, through ``embed``, the at most ``embed_budget`` records a cheap
    first pass flags (:func:`cheap_candidates` on ``cheap``, e.g. self-quotient images) plus references of
    ids with several faces for the calibration. Groups of ids join on more than one pair's evidence
    where more than one pair exists (:func:`_evidence_merges`).

    Parameters
    ----------
    subject_ids : sequence of str
        The manifest's subject ids, one per record.
    features : ndarray of shape (n, d), optional
        Eigenface coefficients; records under different ids closer than
        ``near_duplicate_ratio`` x the median nearest-other-person distance are merged. Float32 is
        kept as it is (half the memory) and gives the same merges as its float64 copy.
    embeddings : ndarray of shape (n, 128), optional
        dlib ResNet descriptors of every record (:class:`deid.evaluation.recognizer.DlibEmbedder`).
    same_person_distance : float, optional
        Cap of the calibrated threshold (default :data:`MAX_SAME_PERSON`).
    near_duplicate_ratio : float, default 0.2
    space : str, default "eigenface"
        What ``features`` are, named in the evidence of a merge (``"feature"`` for the vectors
        of a feature drop: the same ratio rule applies to any vector space).
    cheap : ndarray of shape (n, q), optional
        Cheap features for the first pass (default: ``features``).
    embed : callable, optional
        ``embed(positions) -> (len(positions), 128)`` descriptors of those records; used when
        ``embeddings`` is None.
    embed_budget : int, default 2000
        Most records ``embed`` is asked for (~0.09 s each per core).
    false_merge_target : float, default 0.001
        The calibration's target share of records falsely within the threshold of another person.

    Returns
    -------
    PeopleResolution

    References
    ----------
    M. Turk, A. Pentland. Eigenfaces for recognition. J. Cognitive Neuroscience 3(1):71-86, 1991.
    T. Ahonen, A. Hadid, M. Pietikainen. Face description with local binary patterns. IEEE TPAMI 28(12), 2006.
    D. E. King. High quality face recognition with deep metric learning. dlib blog, 2017.
    """
    # One normalised str per distinct id, shared by its records (a million records: 500,000 str, not 2 M).
    normal = {s: normalize_subject_id(s) for s in dict.fromkeys(subject_ids)}
    ids = [normal[s] for s in subject_ids]
    n = len(ids)
    normalized_merges = len(normal) - len(set(normal.values()))
    _check_resolve(near_duplicate_ratio, embed_budget)
    uf = _UnionFind(sorted(set(ids)))
    merges: list[dict] = []
    flagged: set[int] = set()
    X = None
    if features is not None and n >= 3:
        # float32 stays float32 (converted a bucket or chunk at a time: the same values as a float64 copy).
        X = features if isinstance(features, np.ndarray) and features.dtype == np.float32 \
            else np.asarray(features, dtype=np.float64)
        if X.shape[0] != n:
            raise ConfigError(f"features has {X.shape[0]} rows but subject_ids has {n}; pass one row per record")
        _near_duplicate_merges(ids, X, f"{space} near-duplicate", near_duplicate_ratio, uf, merges, flagged)
    calibration, suspects = None, ()
    rows, E = _recogniser_rows(ids, embeddings=embeddings, embed=embed, cheap=cheap, X=X,
                               embed_budget=embed_budget)
    if rows is not None:
        cap = MAX_SAME_PERSON if same_person_distance is None else float(same_person_distance)
        calibration, suspects = _recogniser_merges(ids, rows, E, cap, false_merge_target, uf, merges, flagged)
    person = tuple(str(uf.find(x)) for x in ids)
    if normalized_merges or merges:
        log.warning("identity: %d ids merged by normalisation, %d by matching faces (%d records)",
                    normalized_merges, len(merges), len(flagged))
    return PeopleResolution(person=person, normalized_merges=normalized_merges, face_merges=tuple(merges),
                            flagged_records=tuple(sorted(flagged)), calibration=calibration, suspects=suspects)


def near_misses(E: np.ndarray, people: Sequence[str], within: float | np.ndarray, *,
                rows: np.ndarray | None = None) -> tuple[int, ...]:
    """The rows whose nearest row of another person lies within ``within`` (one distance, or one per row), closest
    first.

    Parameters
    ----------
    E : ndarray of shape (m, d)
        Descriptors.
    people : sequence of str
        Each row's effective person (after merges).
    within : float or ndarray of shape (m,)
        The distance (e.g. :data:`MAX_SAME_PERSON`), or each row's.
    rows : ndarray of int, optional
        What to return for each row (e.g. its record position); default the row itself.

    Returns
    -------
    tuple of int
    """
    if len(E) < 2:
        return ()
    codes = _person_codes(list(people))
    arg, d2 = _nearest_other(np.asarray(E, dtype=np.float64), codes)
    near = np.flatnonzero(d2 < np.square(within))
    near = near[np.argsort(d2[near], kind="stable")]
    out = near if rows is None else np.asarray(rows)[near]
    return tuple(int(i) for i in out)


def _check_resolve(near_duplicate_ratio: float, embed_budget: int) -> None:
    """:func:`resolve_people`'s ``near_duplicate_ratio`` (in (0, 1)) and ``embed_budget`` (an integer >= 0) checked.

    Raises
    ------
    ConfigError
        Either out of range; the message names it and a value to pass.
    """
    if not 0 < near_duplicate_ratio < 1:
        raise ConfigError(f"near_duplicate_ratio={near_duplicate_ratio!r} must be in (0, 1); e.g. 0.2")
    if isinstance(embed_budget, bool) or not isinstance(embed_budget, int) or embed_budget < 0:
        raise ConfigError(f"embed_budget={embed_budget!r} must be an integer >= 0 (faces the recogniser may embed); "
                          "e.g. 2000")


def _near_duplicate_merges(ids: list[str], X: np.ndarray, evidence: str, ratio: float, uf: _UnionFind,
                           merges: list[dict], flagged: set[int]) -> None:
    """The near-duplicate rule of :func:`resolve_people`: records under different ids closer than ``ratio`` x the
    median nearest-other-id distance are one person.

    Exact nearest neighbours up to ``_EXACT_LIMIT`` records; above, the nearest found within the buckets of
    several trees (:func:`_search_groups`), the median taken within each bucket of the first.

    Parameters
    ----------
    ids : list of str
        The normalised id of each record.
    X : ndarray of shape (n, d)
        The records' eigenface coefficients or feature vectors (float32 or float64).
    evidence : str
        What a merge names as its evidence (e.g. ``"eigenface near-duplicate"``).
    ratio : float
        The near-duplicate ratio.
    uf, merges, flagged
        Updated: the ids joined, one entry per join (ids, records, evidence, distance, threshold), and the records
        matched.
    """
    codes = _person_codes(ids)
    trees = _search_groups(X)
    best, arg = np.full(len(ids), np.inf), np.full(len(ids), -1, np.int64)
    for idx in (g for groups in trees for g in groups):  # each row's nearest other id over every tree
        if len(np.unique(codes[idx])) < 2:
            continue
        j, d2 = _nearest_other(X[idx].astype(np.float64), codes[idx])
        better = d2 < best[idx]
        best[idx[better]], arg[idx[better]] = d2[better], idx[j[better]]
    for idx in trees[0]:  # the scale: the median within each bucket of the first tree (the whole drop when exact)
        d2 = best[idx]
        if not np.isfinite(d2).any():
            continue
        limit = (ratio ** 2) * float(np.median(d2[np.isfinite(d2)]))
        for i in idx[d2 < limit]:
            a, b = int(i), int(arg[i])
            if uf.union(ids[a], ids[b]):
                merges.append({"ids": sorted({ids[a], ids[b]}), "records": sorted((a, b)), "evidence": evidence,
                               "distance": round(float(np.sqrt(best[i])), 4),
                               "threshold": round(float(np.sqrt(limit)), 4)})
            flagged.update((a, b))


def _recogniser_merges(ids: list[str], rows: np.ndarray, E: np.ndarray, cap: float, false_merge_target: float,
                       uf: _UnionFind, merges: list[dict], flagged: set[int]) -> tuple[dict, tuple[int, ...]]:
    """The face recogniser's rule of :func:`resolve_people`: the threshold calibrated on the drop's descriptors
    (:func:`calibrate_recogniser`), groups of ids joined on enough evidence (:func:`_evidence_merges`); then the
    near misses (:attr:`PeopleResolution.suspects`).

    Parameters
    ----------
    ids : list of str
        The normalised id of each record.
    rows, E : ndarray
        The records embedded and their descriptors, row for row (:func:`_recogniser_rows`).
    cap, false_merge_target : float
        The calibration's largest threshold and target false-merge share.
    uf, merges, flagged
        Updated as by :func:`_near_duplicate_merges` (a merge also counts its matching pairs).

    Returns
    -------
    dict
        The calibration as :attr:`PeopleResolution.calibration` reports it.
    tuple of int
        The near misses' record positions, closest first.
    """
    codes = _person_codes([ids[i] for i in rows])
    cal = calibrate_recogniser(E, codes, max_threshold=cap, false_merge_target=false_merge_target)
    for a, b, d, count, matched in _evidence_merges(E, codes, cal):
        ra, rb = int(rows[a]), int(rows[b])
        if uf.union(ids[ra], ids[rb]):
            merges.append({"ids": sorted({ids[ra], ids[rb]}), "records": sorted((ra, rb)),
                           "evidence": "face recogniser", "distance": round(d, 4),
                           "threshold": round(float(min(cal.row_threshold[a], cal.row_threshold[b])), 4),
                           "matching_pairs": int(count)})
        flagged.update(int(rows[r]) for r in matched)
    within = np.fmin(cap, NEAR_MISS_RATIO * cal.row_scale)  # fmin: a row without a subset median gets the cap
    suspects = near_misses(E, [str(uf.find(ids[int(r)])) for r in rows], within, rows=rows)
    return {**cal.to_dict(), "records_embedded": int(len(rows)), "records": len(ids)}, suspects


def _recogniser_rows(ids: list[str], *, embeddings, embed, cheap, X, embed_budget: int):
    """The records the recogniser's descriptors cover and those descriptors (float64): every record with
    ``embeddings``; else, with ``embed``, the ones the cheap first pass picks within ``embed_budget``; else
    ``(None, None)``."""
    n = len(ids)
    rows = E = None
    if embeddings is not None and n >= 2:
        E = np.asarray(embeddings, dtype=np.float64)
        if E.shape[0] != n:
            raise ConfigError(f"embeddings has {E.shape[0]} rows but subject_ids has {n}; pass one row per record")
        rows = np.arange(n)
    elif embed is not None and n >= 2 and embed_budget >= 2:
        C = cheap if cheap is not None else X
        if C is None:
            C = np.zeros((n, 1))
        if C.shape[0] != n:
            raise ConfigError(f"cheap has {C.shape[0]} rows but subject_ids has {n}; pass one row per record")
        rows, n_flagged = cheap_candidates(C, _person_codes(ids), embed_budget, references=min(400, embed_budget // 4))
        E = np.asarray(embed(rows), dtype=np.float64)
        if E.shape != (len(rows), E.shape[1] if E.ndim == 2 else -1):
            raise ConfigError(f"embed returned shape {E.shape}; expected ({len(rows)}, d), one row per position")
        log.info("identity: the cheap first pass flagged %d of %d records; the recogniser embedded %d", n_flagged, n,
                 len(rows))
    return rows, E
