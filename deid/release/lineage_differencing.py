"""The differencing attack on a dataset's lineage: every released average against every registered one.

:func:`differencing_attack` runs the composition attack (Ganta, Kasiviswanathan & Smith, KDD 2008) on
the released pixels, as an attacker holding every release and a gallery of original faces would: the
difference of two averages whose clusters differ by one face, or one swapped pair, is that face or
pair, matched to the originals and verified in pixels (the search: :mod:`deid.release.differencing_search`).
The gate fails on any exact match (:class:`DifferencingResult`).

**The attack.** The attacker sees each release's images and cluster sizes. For a released cluster (average
``M1``, plausible sizes ``s1``) and a registered one (``M2``, ``s2``) with ``|s1 - s2| <= 1``:

- ``s1 = s2 = s``: ``s (M1 - M2)`` is ``a - b`` if the clusters differ by one swapped record;
  matched against pairs of originals;
- ``|s1 - s2| = 1``: ``s1 M1 - s2 M2`` (sign so that the larger cluster comes first) is the added
  face ``x``; matched against single originals.

Plausible sizes are those the releases show (records per image in each release) and the true
basis sizes (the gate knows them: the strongest attacker). Matching is done in PCA space
(eigenfaces of the originals; Turk & Pentland 1991). Every best candidate is verified in
pixels: it is an *exact* match when the mean absolute error divided by ``max(s1, s2)`` is below
``tolerance`` grey levels, i.e. the error at the scale of the released averages (uint8 rounding
of two averages explains at most ``0.5 (s1 + s2) / max(s1, s2) <= 1`` grey level per pixel
there; a wrong face is off by several). Pairs with identical images are skipped (their
difference is a multiple of the image).

**Which originals are candidates (issue 13: sub-quadratic, not weaker).** The gate is the
strongest attacker: it knows every cluster's basis records. If ``s1 M1 - s2 M2`` is one face
``x`` exactly, the two pixel multisets differ by ``x``, so ``x`` *is* a basis record of the
larger cluster (or a record with the same pixels: a byte-identical copy under another
fingerprint has the same pixels, and is found through the member itself); for a swapped pair
``a - b``, ``a`` is a member of the first cluster and ``b`` of the second. So, above
``exhaustive_below`` originals, each test searches only the members of its two clusters that
are among this drop's originals (``original_records`` maps them to rows): O(cluster size) per
test instead of O(N), and exact for the leak tested. This keeps the case that motivated
differencing within a release: two clusters sharing byte-identical copies of some people's
photos differ, in pixels, by the photos that are not shared, and those are members.

The gallery is this drop's originals, as before: a member of a registered cluster that is not
in this drop has no pixels here, and only a record of this drop with (nearly) its pixels under
another fingerprint could match it. For a test whose cluster has such absent members, the
search adds, from the whole gallery, the nearest original within the radius an exact
difference can lie at (``tolerance * max(s1, s2) * sqrt(n_pixels)`` in PCA space, which is
contractive: the rounding of two averages is at most ``0.5 (s1 + s2)`` per pixel), through a
k-d tree: for a single face around the difference, for a pair around ``z_c - d`` and
``z_c + d`` for each present member ``c``; a pair test whose clusters have no present member at
all is searched over the whole gallery as before (``candidates`` most and least aligned
originals, see :func:`~deid.release.differencing_search.best_pairs`). So every difference the
exhaustive search could verify as an exact difference of two released averages is still a
candidate: at least today's power. At or below ``exhaustive_below`` originals, or without
``original_records``, the exhaustive search runs as before (its results on small drops are
unchanged): single faces by nearest neighbour over all originals, pairs among the ``candidates``
originals most and least aligned with the difference in whitened PCA space (measured on London,
20 of 20 swapped pairs had ``a`` at rank 0 and ``b`` at rank <= 1).

**Which pairs of averages are tested** (``pairs="nearest"``, the reference search). Up to
``max_pairs`` cluster pairs are all tested; beyond that each released average is paired with (i)
every registered average whose cluster shares a basis record or a person with it (all record-level
leaks across releases share records; copies within a release share people; people in more than
``max_person_clusters`` clusters add no pairs this way) and (ii) its ``neighbors`` nearest
registered averages in PCA space (a difference of fewer than k records moves an average by at most
that share of a face, so leaking pairs are near neighbours): exact nearest neighbours by blocks
while ``len(released) * len(registered) <= 4e8``, above that a k-d tree's (1 + eps)-approximate
nearest neighbours (``eps = 1``: 97% of the exact ten, 1 ms each, measured on 200k Gaussian 50-d
points), O(N log N) instead of O(N^2). Work is vectorised in blocks of ``block`` tests.

``pairs="content"`` (the release run's, issue 32): only clusters first released now are attacked
(a republished cluster is the registered one, tested against every registered cluster when it was
first released; it stays in the registered side with this release's size too), against the
clusters whose basis can differ from theirs by at most ``max(2, k - 1)`` records, counted on
content: an index from each member's content (the digest of its original's pixels when the gallery
holds it, else its source fingerprint) to the clusters holding it
(:func:`~deid.release.differencing_search.content_pairs`). Every exact difference the attack can
verify is one face or one swapped pair of faces, so two clusters whose bases differ in more than
two contents cannot give one; pixel copies under other fingerprints count as the same content. A
near-copy (not pixel-identical) under another fingerprint is not a shared content: only
``"nearest"`` pairs averages by pixels. Each average in a tested pair is read once; with no pair
to test nothing else is read.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Hashable, Sequence, cast

import numpy as np

from deid.errors import ConfigError
from deid.release.differencing_search import (Averages, MemberGallery, Whitened, average_pairs, best_pairs,
                                              content_ids, content_pairs, eigenfaces, size_tests, structural_pairs)
from deid.release.lineage import LineageRelease
from deid.release.lineage_checks import LineageCheck
from deid.release.lineage_state import LineageCluster, LineageState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DifferencingMatch:
    """One difference image matched to originals: a single face (``kind="single"``) or a pair ``a - b``."""

    released: str          # cluster key in the new release
    registered: str        # registered cluster key
    sizes: tuple[int, int]
    kind: str              # "single" | "pair"
    originals: tuple[int, ...]   # gallery indices (a) or (a, b)
    mae: float             # mean abs error of the difference vs the originals, at the averages' scale


@dataclass(frozen=True)
class DifferencingResult:
    """Outcome of :func:`differencing_attack`; the gate fails on any exact match."""

    n_cluster_pairs: int
    n_tests: int
    mode: str
    matches: tuple[DifferencingMatch, ...]
    people_identified: frozenset
    tolerance: float
    unit: str = "grey level"   # of the tolerance: grey levels (faces) or the feature vectors' own units


    @property
    def passed(self) -> bool:
        return not self.matches

    def to_check(self) -> LineageCheck:
        what = "face or pair of faces" if self.unit == "grey level" else "vector or pair of vectors"
        return LineageCheck(
            "lineage_differencing_attack", self.passed, len(self.people_identified), 0,
            f"{self.n_cluster_pairs} pairs of released averages across the lineage ({self.mode}), {self.n_tests} "
            f"size hypotheses: {len(self.matches)} differences matched an original {what} "
            f"(mean abs error < {self.tolerance:.4g} {self.unit} at the averages' scale); "
            f"{len(self.people_identified)} people identified",
            tuple(vars(m) for m in self.matches))


# The mode of an attack with no cluster first released now: nothing can differ that was not tested before.
REPUBLISHED_ONLY = "no cluster first released now (republished clusters were tested when first released)"


def _cluster_sizes(c: LineageCluster, *more: int) -> list[int]:
    return sorted({len(c.records), *more} - {0})


def differencing_attack(state: LineageState, release: LineageRelease, originals: Any, *,
                        original_people: Sequence[Hashable] | None = None,
                        original_records: Sequence[str] | None = None, tolerance: float = 1.0,
                        n_components: int = 50, max_pairs: int = 200_000, neighbors: int = 10,
                        candidates: int = 16, block: int = 1024, unit: str = "grey level",
                        pca_sample: int = 20_000, threads: int = 1, exhaustive_below: int = 1000,
                        max_person_clusters: int = 64, pairs: str = "nearest") -> DifferencingResult:
    """Difference every released average of this release against every registered one and each other; match originals.

    The difference of two averages whose clusters differ by one face or one swapped pair is that face or pair: matched
    to the originals in PCA space, verified in pixels (the attack, its candidates and pairs: the module docstring).

    Parameters
    ----------
    state, release
        The registered lineage and the release to check.
    originals : array-like (n, n_pixels), or a row source
        Aligned original faces the attacker may hold (the gate passes the drop's aligned faces). Any object with
        ``shape`` and ``__getitem__`` for integer index arrays (e.g. :class:`deid.operations.worker_rows.RowFile`)
        is read a chunk of rows at a time and never held whole (issue 13: a million faces are 7.5 GB of uint8).
    original_people : sequence, optional
        Person of each original, to count the people identified.
    original_records : sequence of str, optional
        Source fingerprint of each original (the registry's record ids), to find clusters' members among them;
        by default ``release.fingerprints`` when there is one original per drop record.
    tolerance, unit : float, str
        The exact-match bound and its unit: grey levels for faces; for feature vectors (float averages, no rounding)
        a small fraction of a feature's spread, in their units (:func:`deid.operations.features.apply_feature_lineage`).
    n_components, pca_sample : int
        Eigenfaces fitted on at most ``pca_sample`` originals (a seeded sample); every original is projected.
    max_pairs, neighbors, max_person_clusters : int
        ``"nearest"``: all pairs up to ``max_pairs``, else the ``neighbors`` nearest registered averages and
        the structural pairs (a person in more than ``max_person_clusters`` registered clusters adds none).
    candidates, exhaustive_below : int
        Originals most and least aligned with a pair difference that are tried; up to ``exhaustive_below``
        originals every test searches the whole gallery (the reference search).
    block, threads : int
        Tests per vectorised block, and threads running blocks (the matches and their order do not depend on it).
    pairs : {"nearest", "content"}
        Which pairs of averages are tested: the reference search, or (the release run's, issue 32) the clusters first
        released now against those whose basis contents differ by <= ``max(2, k - 1)`` records (needs
        ``original_records``: without them ``"nearest"`` is used).

    Returns
    -------
    DifferencingResult

    Raises
    ------
    ConfigError
        Originals, their people or records, the tolerance or ``pairs`` unusable, or averages of another width.
    """
    X, original_records = _check_inputs(originals, release, original_people=original_people,
                                        original_records=original_records, tolerance=tolerance, unit=unit, pairs=pairs)
    by_content = pairs == "content" and original_records is not None
    new, reg = _sides(state, release, by_content)
    if not new or not reg:
        return DifferencingResult(0, 0, REPUBLISHED_ONLY if by_content and reg else "nothing to compare", (),
                                  frozenset(), tolerance, unit)
    for c, _ in new if by_content else new + reg:   # content: the averages of tested pairs are checked below
        _check_width(c, X)
    content_ij: tuple[np.ndarray, np.ndarray] | None = None
    if by_content:
        new, reg, content_ij, mode = _content_side(X, cast(Sequence[str], original_records), release, new, reg)
        if content_ij is None:
            return DifferencingResult(0, 0, mode, (), frozenset(), tolerance, unit)
    space = _Space.fit(X, n_components=n_components, pca_sample=pca_sample,
                       members_only=original_records is not None and X.shape[0] > exhaustive_below)
    M1, M2, Y1, Y2 = _averages(new, reg, space, by_content)
    if content_ij is not None:
        pairs_i, pairs_j = content_ij[0].astype(np.int64), content_ij[1].astype(np.int64)
    else:
        pairs_i, pairs_j, mode = _nearest_pairs(new, reg, Y1, Y2, max_pairs=max_pairs, neighbors=neighbors,
                                                max_person_clusters=max_person_clusters, threads=threads)
    pairs_i, pairs_j = _different_images(new, reg, pairs_i, pairs_j)
    tests = size_tests(pairs_i, pairs_j, [s for _, s in new], [s for _, s in reg])
    matches = _attack_tests(tests, X, space, new, reg, (M1, M2, Y1, Y2), original_records, block=block,
                            candidates=candidates, tolerance=tolerance, threads=threads)
    return DifferencingResult(len(pairs_i), len(tests), mode, tuple(matches), _identified(matches, original_people),
                              tolerance, unit)


def _attack_tests(tests: np.ndarray, X: Any, space: _Space, new: _Side, reg: _Side, averages: tuple,
                  original_records: Sequence[str] | None, *, block: int, candidates: int, tolerance: float,
                  threads: int) -> list[DifferencingMatch]:
    """The size hypotheses ``tests`` (rows ``i, j, s1, s2``) attacked ``block`` at a time on ``threads``: the
    candidates searched among the clusters' members when ``space.members_only`` (:class:`MemberGallery`), else over
    the whole gallery; ``averages`` is ``(M1, M2, Y1, Y2)`` (:func:`_averages`). Returns the exact matches."""
    M1, M2, Y1, Y2 = averages
    gallery = (None if not space.members_only else
               MemberGallery(cast(Sequence[str], original_records), [c for c, _ in new], [c for c, _ in reg], space.Zc,
                             space.Zw, space.muz, space.sd, candidates, tolerance * np.sqrt(X.shape[1])))
    attack = _BlockAttack(tests=tests, block=block, X=X, space=space, Y1=Y1, Y2=Y2, M1=M1, M2=M2, gallery=gallery,
                          candidates=candidates, tolerance=tolerance, keys1=[c.key for c, _ in new],
                          keys2=[c.key for c, _ in reg])
    return attack.run(threads)


def _identified(matches: list[DifferencingMatch], original_people: Sequence[Hashable] | None) -> frozenset:
    """The people the matches identify (their originals' people; the originals' rows without ``original_people``),
    logged as a warning when there is any match."""
    if original_people is not None:
        people = frozenset(original_people[g] for m in matches for g in m.originals)
    else:
        people = frozenset(g for m in matches for g in m.originals)
    if matches:
        logger.warning("lineage differencing attack: %d exact matches, %d people identified", len(matches), len(people))
    return people


def _averages(new: _Side, reg: _Side, space: _Space, by_content: bool) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """The averages of both sides (``M1``: ``new``, ``M2``: ``reg``; one object when the sides are the same clusters)
    and their projections ``Y1``, ``Y2`` on ``space`` (linear: differences of projections are exact).

    The averages stay where they are stored (a stored average is read from disk when asked: a million faces have
    1.5 GB of them, issue 13) and are read and converted a chunk of rows at a time; with ``by_content`` (a handful
    of clusters) each is read once into memory (a registered one is decrypted from its pack once, not per test).
    """
    M1: Any = Averages([c.image for c, _ in new])
    M2: Any = M1 if [c.key for c, _ in reg] == [c.key for c, _ in new] else Averages([c.image for c, _ in reg])
    if by_content:
        M1, M2 = M1[np.arange(len(M1))], (None if M2 is M1 else M2[np.arange(len(M2))])
        M2 = M1 if M2 is None else M2
    Y1 = space.project(M1)
    Y2 = Y1 if M2 is M1 else space.project(M2)
    return M1, M2, Y1, Y2


def _nearest_pairs(new: _Side, reg: _Side, Y1: np.ndarray, Y2: np.ndarray, *, max_pairs: int, neighbors: int,
                   max_person_clusters: int, threads: int) -> tuple[np.ndarray, np.ndarray, str]:
    """``pairs="nearest"``: every pair of averages up to ``max_pairs``, else each released average's ``neighbors``
    nearest registered ones (projections ``Y1``, ``Y2``) and the structural pairs (clusters sharing a basis record
    or a person: :func:`~deid.release.differencing_search.structural_pairs`).

    Returns
    -------
    pairs_i, pairs_j : ndarray of int
        Rows of ``new`` and ``reg``.
    mode : str
        The search, as the result states it.
    """
    all_pairs = len(new) * len(reg) <= max_pairs
    structural = None if all_pairs else structural_pairs([c for c, _ in new], [c for c, _ in reg],
                                                         max_person_clusters)
    pairs_i, pairs_j = average_pairs(Y1, Y2, all_pairs, neighbors, structural=structural, threads=threads)
    mode = "all pairs" if all_pairs else (f"{neighbors} nearest registered averages per released one and those "
                                          "sharing a record or a person")
    return pairs_i, pairs_j, mode


def _check_inputs(originals: Any, release: LineageRelease, *, original_people: Sequence[Hashable] | None,
                  original_records: Sequence[str] | None, tolerance: float, unit: str,
                  pairs: str) -> tuple[Any, Sequence[str] | None]:
    """:func:`differencing_attack`'s gallery and arguments checked: the originals (an array, or a row source kept as it
    is) and their source fingerprints (by default the release's, one original per drop record)."""
    # Arrays and row sources alike are converted to float32 a chunk of rows at a time (a whole uint8 gallery
    # as float32 would be four times its size: 3 GB at 100,000 faces).
    X = originals if hasattr(originals, "shape") else np.asarray(originals, dtype=np.float32)
    if len(X.shape) != 2 or X.shape[0] < 2:
        raise ConfigError(f"originals has shape {X.shape}; pass at least two aligned faces, one flattened row each")
    if original_people is not None and len(original_people) != X.shape[0]:
        raise ConfigError(f"original_people has {len(original_people)} entries for {X.shape[0]} originals")
    if original_records is None and len(release.fingerprints) == X.shape[0]:
        original_records = release.fingerprints
    if original_records is not None and len(original_records) != X.shape[0]:
        raise ConfigError(f"original_records has {len(original_records)} entries for {X.shape[0]} originals; pass "
                          "the source fingerprint of each original, in the originals' order")
    if not tolerance > 0:
        raise ConfigError(f"tolerance={tolerance!r} must be > 0 {unit}s, e.g. 1.0 grey level for faces")
    if pairs not in ("nearest", "content"):
        raise ConfigError(f"pairs={pairs!r} is not a pair search; pass 'nearest' (the reference) or 'content'")
    return X, original_records


_Side = list[tuple[LineageCluster, list[int]]]


def _sides(state: LineageState, release: LineageRelease, by_content: bool) -> tuple[_Side, _Side]:
    """The clusters attacked (``new``: this release's) and those they are differenced with (``reg``: the registered
    ones and this release's new ones), each with its plausible sizes."""
    released = release.released_clusters(state)
    new = [(c, _cluster_sizes(c, n)) for c, n in released.values()]
    if by_content:
        # A republished cluster is the registered one (same basis, bit-identical image): every pair it makes
        # was tested when it was first released. It stays on the registered side, with this release's size.
        now = {c.key: n for c, n in released.values()}
        new = [(c, s) for c, s in new if c.key not in state.clusters]
        reg = [(c, _cluster_sizes(c, *state.released_sizes.get(c.key, ()), *([now[c.key]] if c.key in now else [])))
               for c in state.clusters.values()]
    else:
        reg = [(c, _cluster_sizes(c, *state.released_sizes.get(c.key, ()))) for c in state.clusters.values()]
    # This release's own new clusters are differenced too, the first release's included: two clusters of
    # one release that share all but a few people's (near-)identical photos leak exactly as a pair across
    # releases does (measured: London photos each copied ten times, 40 people recovered).
    reg += [(c, sizes) for c, sizes in new if c.key not in state.clusters]
    return new, reg


def _check_width(c: LineageCluster, X: Any) -> None:
    if c.image.shape[0] != X.shape[1]:
        raise ConfigError(f"cluster averages have {c.image.shape[0]} values but originals {X.shape[1]}; pass the "
                          "aligned faces at the canonical size (or the drop's vectors of the same dimension)")


def _content_side(X: Any, original_records: Sequence[str], release: LineageRelease, new: _Side,
                  reg: _Side) -> tuple[_Side, _Side, tuple[np.ndarray, np.ndarray] | None, str]:
    """``pairs="content"``: the pairs whose basis contents differ by at most ``max(2, k - 1)`` records and different
    images, with only the clusters of those pairs kept (``new``, ``reg`` and the pairs renumbered on them); None
    pairs when there is none, and the mode either way."""
    kmax = max([release.k, *(c.k for c, _ in new), *(c.k for c, _ in reg)])
    content = content_ids(X, original_records, [c for c, _ in new] + [c for c, _ in reg])
    ci, cj = content_pairs([c for c, _ in new], [c for c, _ in reg], content, max(2, kmax - 1))
    same = np.array([new[a][0].image_sha256 == reg[b][0].image_sha256 for a, b in zip(ci.tolist(), cj.tolist())],
                    dtype=bool)
    ci, cj = ci[~same], cj[~same]
    mode = f"clusters whose basis contents differ by at most {max(2, kmax - 1)} records (content index)"
    if not len(ci):
        return new, reg, None, mode
    # Only the clusters of tested pairs go on, their averages read once, in memory (a handful of clusters).
    u1, ci = np.unique(ci, return_inverse=True)
    u2, cj = np.unique(cj, return_inverse=True)
    new = [new[a] for a in u1.tolist()]
    reg = [reg[b] for b in u2.tolist()]
    for c, _ in reg:
        _check_width(c, X)
    return new, reg, (ci, cj), mode


@dataclass(frozen=True)
class _Space:
    """The eigenfaces of the originals (``Wz`` rows, mean ``mu``, per-component ``sd``) and the originals in them:
    centred projections ``Zc``, whitened ``Zw`` (divided a row at a time when ``members_only``: tests search their
    clusters' members; else the whole matrix, for the exhaustive search), the mean's projection ``muz``."""

    Wz: np.ndarray
    mu: np.ndarray
    sd: np.ndarray
    Zc: np.ndarray
    Zw: Any
    muz: np.ndarray
    members_only: bool

    @classmethod
    def fit(cls, X: Any, *, n_components: int, pca_sample: int, members_only: bool) -> "_Space":
        n_orig = X.shape[0]
        fit_rows = (np.arange(n_orig) if n_orig <= pca_sample else
                    np.sort(np.random.default_rng(0).choice(n_orig, pca_sample, replace=False)))
        Wz, mu, sd = eigenfaces(np.asarray(X[fit_rows], dtype=np.float32), n_components)  # (q, p) rows, mean, std
        Zc = np.vstack([(np.asarray(X[np.arange(a, min(a + 4096, n_orig))], dtype=np.float32) - mu) @ Wz.T
                        for a in range(0, n_orig, 4096)])  # centred projections of the originals, a chunk at a time
        # Whitened projections (pair candidates): the rows a test asks for, divided when asked (bit-identical to
        # the whole quotient), when tests search their clusters' members; the whole matrix for the exhaustive search.
        Zw = Whitened(Zc, sd) if members_only else Zc / sd
        return cls(Wz, mu, sd, Zc, Zw, mu @ Wz.T, members_only)

    def project(self, M: Any) -> np.ndarray:
        """Rows of averages projected (not centred), a chunk at a time."""
        return np.vstack([np.asarray(M[a:a + 4096], dtype=np.float32) @ self.Wz.T for a in range(0, len(M), 4096)])


def _different_images(new: _Side, reg: _Side, pairs_i: np.ndarray,
                      pairs_j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs whose two averages differ (identical images: the difference is a multiple of the image)."""
    # Image hashes as integer codes: millions of pairs compared as arrays, not as Python objects (issue 13).
    codes: dict[str, int] = {}
    c1 = np.array([codes.setdefault(c.image_sha256, len(codes)) for c, _ in new], dtype=np.int64)
    c2 = np.array([codes.setdefault(c.image_sha256, len(codes)) for c, _ in reg], dtype=np.int64)
    keep = c1[pairs_i] != c2[pairs_j]
    return pairs_i[keep], pairs_j[keep]


@dataclass
class _BlockAttack:
    """The size hypotheses ``tests`` (rows ``i, j, s1, s2``) attacked ``block`` at a time: each difference's best
    candidate originals in PCA space, verified in pixels (mean absolute error over ``max(s1, s2)`` below
    ``tolerance``)."""

    tests: np.ndarray
    block: int
    X: Any
    space: _Space
    Y1: np.ndarray
    Y2: np.ndarray
    M1: Any
    M2: Any
    gallery: MemberGallery | None
    candidates: int
    tolerance: float
    keys1: list[str]
    keys2: list[str]

    def __post_init__(self) -> None:
        Zc = self.space.Zc
        self.csq: Any = np.einsum("ij,ij->i", Zc, Zc) if self.gallery is None else None

    def run(self, threads: int) -> list[DifferencingMatch]:
        starts = range(0, len(self.tests), self.block)
        if threads > 1 and len(starts) > 1:
            from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

            # NumPy releases the GIL in the matrix products, partitions and element-wise passes of a block.
            with ThreadPoolExecutor(threads) as pool:
                return [m for found in pool.map(self, starts) for m in found]
        return [m for start in starts for m in self(start)]

    def __call__(self, start: int) -> list[DifferencingMatch]:
        t = self.tests[start:start + self.block]
        i, j, s1, s2 = t.T
        sign = np.where(s1 >= s2, 1.0, -1.0).astype(np.float32)[:, None]  # larger cluster first: +x
        Dz = sign * (s1[:, None] * self.Y1[i] - s2[:, None] * self.Y2[j])
        single = s1 != s2
        if self.gallery is None:
            sp = self.space
            best = np.full((len(t), 2), -1, dtype=np.int64)
            if single.any():
                d = self.csq[None, :] - 2.0 * (Dz[single] - sp.muz) @ sp.Zc.T      # nearest original to the difference
                best[single, 0] = np.argmin(d, axis=1)
            if (~single).any():
                best[~single] = best_pairs(Dz[~single] / sp.sd, sp.Zw, self.candidates, sp.sd)
        else:
            best = self.gallery.best(Dz, i, j, single, np.maximum(s1, s2))
        found: list[DifferencingMatch] = []
        for v in range(0, len(t), 256):  # verify in pixels, a few hundred differences at a time
            r = slice(v, v + 256)
            a, b = best[r, 0], best[r, 1]
            ok = np.flatnonzero(a >= 0)   # a test without a candidate (no member in the gallery) matches nothing
            if len(ok):
                found += self._verify(i[r][ok], j[r][ok], s1[r][ok], s2[r][ok], sign[r][ok], a[ok], b[ok])
        return found

    def _verify(self, ir: np.ndarray, jr: np.ndarray, s1r: np.ndarray, s2r: np.ndarray, sg: np.ndarray, a: np.ndarray,
                b: np.ndarray) -> list[DifferencingMatch]:
        X = self.X
        D = sg * (s1r[:, None] * self.M1[ir].astype(np.float32) - s2r[:, None] * self.M2[jr].astype(np.float32))
        target = (np.asarray(X[a], dtype=np.float32)
                  - np.where(b[:, None] >= 0, np.asarray(X[np.maximum(b, 0)], dtype=np.float32), 0.0))
        mae = np.abs(D - target).mean(axis=1) / np.maximum(s1r, s2r)
        found = []
        for hit in np.flatnonzero(mae < self.tolerance):
            origs = (int(a[hit]),) if b[hit] < 0 else (int(a[hit]), int(b[hit]))
            found.append(DifferencingMatch(self.keys1[int(ir[hit])], self.keys2[int(jr[hit])],
                                           (int(s1r[hit]), int(s2r[hit])), "single" if b[hit] < 0 else "pair",
                                           origs, round(float(mae[hit]), 4)))
        return found
