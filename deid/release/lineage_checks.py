"""Gate checks over a dataset's lineage: structural invariance and an empirical differencing attack.

Each release of a dataset is checked against every registered cluster of the earlier releases
(:class:`deid.release.lineage.LineageState`). Two clusters whose member records differ by ``d`` records
leak those records whenever ``d < k``: one swapped person gives ``s (M1 - M2) = a - b``, one added
face gives ``|C2| M2 - |C1| M1 = x`` (the composition attack, Ganta, Kasiviswanathan & Smith,
KDD 2008). :func:`check_structure` rules this out from the registry;
:func:`differencing_attack` runs the attack itself on the released pixels, as an attacker holding
every release and a gallery of original faces would.
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from deid.errors import ConfigError
from deid.release.lineage import (LineageCluster, LineagePlan, LineageRelease, LineageState, label_mix,
                                  stored_rows)

logger = logging.getLogger(__name__)

__all__ = ["REPUBLISHED_ONLY", "DifferencingMatch", "DifferencingResult", "LineageCheck", "PublishedDifferencingResult",
           "check_label_mix", "check_merges", "check_structure", "differencing_attack", "published_differencing_attack"]


@dataclass(frozen=True)
class LineageCheck:
    """One pass/fail lineage check; ``to_dict`` has the shape of the gate's checks (no private details).

    ``findings`` holds the offending cluster keys, pseudonyms etc. for the steward's logs only.
    """

    name: str
    passed: bool
    value: Any
    threshold: Any
    detail: str
    findings: tuple[dict, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": bool(self.passed), "value": self.value, "threshold": self.threshold,
                "detail": self.detail}

    def to_gate_check(self):
        """The gate's :class:`~deid.evaluation.checks.Check` (without the private ``findings``)."""
        from deid.evaluation.checks import Check  # noqa: PLC0415

        return Check(self.name, bool(self.passed), self.value, self.threshold, self.detail)


# --------------------------------------------------------------------------- structural checks


def check_structure(state: LineageState, release: LineageRelease) -> tuple[LineageCheck, LineageCheck]:
    """The two structural lineage checks of a release against the registered clusters.

    ``lineage_cluster_differences``: for every cluster first released now and every registered
    cluster, the basis records in one but not the other (symmetric difference of the records
    averaged into the two images) must be none, or belong to at least ``k`` distinct people. The
    difference of two such averages, scaled by the sizes, is the sum of those records (with signs):
    fewer than ``k`` people's faces, in the clear. This is "no two clusters differ by 1 to k-1
    member records" (the records then belong to at most k-1 people), extended to one added person
    with several photos (their summed photos give their mean face away). Two clusters of the same
    release share no record, so the rule never fires within a release. Clusters with the same basis
    must carry the bit-identical image, and a republished cluster the registered image. ``k`` is the
    largest of the two clusters' and the release's. Records released with a registered image
    without being averaged into it (new photos of returning people, counterfeits) change nothing.

    ``lineage_returning_identical``: every released record of a person or a source record already
    registered carries, bit for bit, a registered image of that person (that record's cluster for
    a registered record).

    Only pairs sharing a record are compared member by member; a disjoint pair differs by all its
    records, whose people number ``|P1 | P2| >= k`` unless both clusters are tiny (checked too).
    Republished clusters were compared when first released; only their image is checked again.

    People are counted under the release's merges (:attr:`LineageRelease.merged`: two steward ids this
    run resolves to one person, or registered bytes under another id, count once).
    """
    released = release.released_clusters(state)
    person = release.person

    def n_people(pseudonyms) -> int:
        return len({person(p) for p in pseudonyms})

    by_record: dict[str, set[str]] = defaultdict(set)
    for c in state.clusters.values():
        for r in c.records:
            by_record[r].add(c.key)
    findings: list[dict] = []
    n_pairs = 0
    kmax = max([release.k, *(c.k for c in state.clusters.values())])
    # A disjoint pair differs by all its records, of |P1 | P2| >= max(|P1|, |P2|) people: only two
    # clusters both below k people can fall short, so only those are compared beyond overlaps.
    tiny = [c2 for c2 in state.clusters.values() if n_people(c2.people) < kmax]
    for key, (c1, _) in released.items():
        if key in state.clusters:
            continue
        cands = set().union(*(by_record.get(r, ()) for r in c1.records))
        if n_people(c1.people) < kmax:
            cands |= {c2.key for c2 in tiny if n_people(c1.people | c2.people) < max(release.k, c1.k, c2.k)}
        for k2 in sorted(cands):
            c2 = state.clusters[k2]
            n_pairs += 1
            kk = max(release.k, c1.k, c2.k)
            delta = c1.members ^ c2.members
            d_people = n_people(p for _, p in delta)
            problem = None
            if delta and d_people < kk:
                problem = f"differ by {len(delta)} record(s) of {d_people} person(s)"
            elif not delta and c1.image_sha256 != c2.image_sha256:
                problem = "same records, different image"
            if problem:
                findings.append({"released": key, "registered": k2, "records": len(delta), "people": d_people,
                                 "problem": problem})
    # A republished cluster is the registered one: its image must not have changed either.
    for key, (c1, _) in released.items():
        if key in state.clusters and c1.image_sha256 != state.clusters[key].image_sha256:
            findings.append({"released": key, "registered": key, "problem": "registered image changed"})
    diff = LineageCheck(
        "lineage_cluster_differences", not findings, len(findings), 0,
        f"{len(released)} released clusters vs {len(state.clusters)} registered clusters of "
        f"{len(state.releases)} earlier releases: {n_pairs} overlapping pairs compared, {len(findings)} differ by "
        f"records of 1 to k-1 people" + (f" (e.g. {findings[0]['problem']})" if findings else ""),
        tuple(findings))
    return diff, _check_returning(state, release, released)


def _check_returning(state: LineageState, release: LineageRelease,
                     released: dict[str, tuple[LineageCluster, int]]) -> LineageCheck:
    person_images = {p: {state.clusters[c].image_sha256 for c in keys if c in state.clusters}
                     for p, keys in state.person_clusters.items()}
    # An id first seen now that this run joins with registered people: one of their images.
    joined: dict[str, set[str]] = defaultdict(set)
    for q, r in release.merged.items():
        joined[r].add(q)
    bad: list[dict] = []
    n_checked = 0
    people_checked: set[str] = set()
    for i, ckey in enumerate(release.record_cluster):
        if ckey is None:
            continue
        p, f = release.pseudonyms[i], release.fingerprints[i]
        want: set[str] | None = None
        reg = state.record_cluster.get(f)
        if reg is not None and reg in state.clusters:
            want = {state.clusters[reg].image_sha256}
        elif p in person_images:
            want = person_images[p]
        elif any(q in person_images for q in joined.get(release.person(p), ())):
            want = set().union(*(person_images.get(q, set()) for q in joined[release.person(p)]))
        elif p in state.released_people:
            want = set()  # released before, in a cluster no longer registered: any image is new information
        if want is None:
            continue
        n_checked += 1
        people_checked.add(p)
        got = released[ckey][0].image_sha256
        if got not in want:
            bad.append({"record": i, "person": p, "cluster": ckey})
    n_bad_people = len({b["person"] for b in bad})
    return LineageCheck(
        "lineage_returning_identical", not bad, n_bad_people, 0,
        f"{n_checked} released records of {len(people_checked)} returning people checked; {len(bad)} records of "
        f"{n_bad_people} people carry an image other than their registered one", tuple(bad))


def check_merges(plan: LineagePlan) -> LineageCheck | None:
    """``lineage_merges``: the registered clusters this run's merges put below k people or above 1/k.

    A merge between runs (identity resolution joining two steward ids, or registered bytes listed under
    another id) re-checks every registered cluster holding one of the joined people
    (:func:`deid.release.lineage.plan_release`); those that fail are withheld from the release. Under
    ``merges="withhold"`` the check passes and says how many; under ``"refuse"`` any such cluster fails
    it (the gate publishes nothing). None when this run re-checked no cluster (no merge touches the lineage).
    """
    m = plan.merges_summary()
    if not m["rechecked_clusters"]:
        return None
    withheld = m["withheld_clusters"]
    refuse = m["policy"] == "refuse"
    why = ", ".join(f"{n} {r}" for r, n in m["withheld_by_reason"].items())
    detail = (f"{m['rechecked_clusters']} registered clusters re-checked under this run's merges "
              f"({m['merged_people']} of the drop's people under several ids, {m['aliased_records']} records under "
              f"another id than registered): {withheld} fall below k={plan.k} people or hold one person above 1/k"
              + (f" ({why})" if why else "")
              + (f"; DEID_LINEAGE_MERGES={m['policy']}: " + ("the run is refused" if refuse else
                                                            "withheld from this release, the rest released")
                 if withheld else ": none withheld for a merge"))
    if refuse and withheld:
        detail += ("; set DEID_LINEAGE_MERGES=withhold to release without them, or check the merges in the report's "
                   "configuration.identity")
    return LineageCheck("lineage_merges", not (refuse and withheld), withheld, 0 if refuse else None, detail)


def check_label_mix(state: LineageState, release: LineageRelease,
                    rows: Sequence[tuple[str, tuple[str, ...]]], label_names: Sequence[str]) -> LineageCheck:
    """``lineage_label_mix``: every released cluster carries its registered label multiset.

    ``rows`` is (lineage cluster key, released label values in ``label_names`` order) of every row of
    the would-be release, counterfeits included. A republished cluster must release the rows the
    release says and carry exactly :func:`~deid.release.lineage.label_mix` of its registered labels
    at that size (the registered multiset itself at the registered size), or a part of the registered
    multiset when it is released with fewer rows (``absent="suppress"``): otherwise its label mix changes between
    releases and shows who is absent, or which labels they had. A new cluster must carry the labels
    this release registers for its members. Clusters registered before the registry kept labels
    cannot be checked: counted in the detail (they keep the earlier fallback labels).
    """
    got: dict[str, Counter] = defaultdict(Counter)
    for key, labels in rows:
        got[key][tuple(labels)] += 1
    expect: dict[str, tuple[Counter, int]] = {}   # key -> (labels it may carry, rows it releases)
    legacy = 0
    for c in release.new_clusters:
        reg = c.labels_for(label_names)
        if reg is not None:
            # Byte-identical photos listed twice share a fingerprint (one registered record): then the
            # registered labels can only bound the released ones.
            want = Counter(reg.values())
            expect[c.key] = (want if len(reg) == c.n_released else Counter({t: c.n_released for t in want}),
                             c.n_released)
    for r in release.republished:
        reg = state.clusters[r.key].labels_for(label_names)
        if reg is None:
            legacy += 1
            continue
        expect[r.key] = (Counter(label_mix(list(reg.values()), max(r.n_released, len(reg)))), r.n_released)
    findings = []
    for key, (want, n_rows) in sorted(expect.items()):
        have = got.get(key, Counter())
        ok = sum(have.values()) == n_rows and not (have - want)
        if not ok:
            findings.append({"cluster": key, "released": sorted(have.elements()),
                             "registered": sorted(want.elements())})
    if legacy:
        logger.warning("lineage: %d republished clusters were registered without labels (a registry written before "
                       "labels were kept); their counterfeits carry labels of present members", legacy)
    n_rep = len(release.republished)
    return LineageCheck(
        "lineage_label_mix", not findings, len(findings), 0,
        f"{len(expect)} released clusters checked ({n_rep - legacy} republished, {len(expect) - n_rep + legacy} new): "
        f"{len(findings)} carry a label mix other than their registered one"
        + (f"; {legacy} republished clusters registered without labels (registry written before labels were kept): "
           "label mix not checked, counterfeits carry labels of present members" if legacy else ""),
        tuple(findings))


# --------------------------------------------------------------------------- differencing attack


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


class _Averages:
    """The released averages of a list of clusters as rows: ``A[idx]`` reads just those rows
    (:func:`deid.release.lineage.stored_rows`), never the whole matrix."""

    def __init__(self, images: Sequence[Any]):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, idx) -> np.ndarray:
        return stored_rows(self.images, idx)


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
    """Difference every released average of this release against every registered one and every other one
    of this release; match to originals.

    The attacker sees each release's images and cluster sizes. For a released cluster (average
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
    originals, see :func:`_best_pairs`). So every difference the exhaustive search could verify as
    an exact difference of two released averages is still a candidate: at least today's power.
    At or below ``exhaustive_below`` originals, or without ``original_records``, the exhaustive
    search runs as before (its results on small drops are unchanged): single faces by nearest
    neighbour over all originals, pairs among the ``candidates`` originals most and least aligned
    with the difference in whitened PCA space (measured on London, 20 of 20 swapped pairs had
    ``a`` at rank 0 and ``b`` at rank <= 1).

    **Which pairs of averages are tested.** Up to ``max_pairs`` cluster pairs are all tested;
    beyond that each released average is paired with (i) every registered average whose cluster
    shares a basis record or a person with it (all record-level leaks across releases share
    records; copies within a release share people; people in more than ``max_person_clusters``
    clusters add no pairs this way) and (ii) its ``neighbors`` nearest registered averages in PCA
    space (a difference of fewer than k records moves an average by at most that share of a face,
    so leaking pairs are near neighbours): exact nearest neighbours by blocks while
    ``len(released) * len(registered) <= 4e8``, above that a k-d tree's (1 + eps)-approximate
    nearest neighbours (``eps = 1``: 97% of the exact ten, 1 ms each, measured on 200k Gaussian 50-d points),
    O(N log N) instead of O(N^2). Work is vectorised in blocks of ``block`` tests.

    Parameters
    ----------
    state, release
        The registered lineage and the release to check.
    originals : array-like (n, n_pixels), or a row source
        Aligned original faces the attacker may hold (the gate passes the drop's aligned faces).
        Any object with ``shape`` and ``__getitem__`` for integer index arrays (e.g.
        :class:`deid.operations.stages.RowFile`, rows read from disk) is read a chunk of rows at
        a time and never held whole (issue 13: a million faces are 7.5 GB of uint8, 30 GB as float32).
    original_people : sequence, optional
        Person of each original, to count the people identified.
    original_records : sequence of str, optional
        Source fingerprint of each original (the registry's record ids), to find clusters' members
        among them; by default ``release.fingerprints`` when there is one original per drop record.
    tolerance, unit : float, str
        The exact-match bound and its unit: grey levels for faces; for feature vectors (registered
        float averages, no rounding) the caller passes a small fraction of a feature's spread in the
        vectors' own units (:func:`deid.operations.features.apply_feature_lineage`).
    pca_sample : int
        The eigenfaces are fitted on at most this many originals (a seeded sample; all of them
        below it); every original is projected, in chunks.
    threads : int
        Blocks of tests run on this many threads (NumPy releases the GIL in their heavy passes); the
        matches and their order do not depend on it.
    exhaustive_below : int
        Up to this many originals every test searches the whole gallery (the reference search).
    max_person_clusters : int
        In neighbour mode, a person in more registered clusters than this adds no structural pairs.
    pairs : {"nearest", "content"}
        Which pairs of averages are tested. ``"nearest"`` (the reference search above): all pairs up
        to ``max_pairs``, else nearest neighbours and structural pairs. ``"content"`` (the release
        run's, issue 32): only clusters first released now are attacked (a republished cluster is
        the registered one, tested against every registered cluster when it was first released;
        it stays in the registered side with this release's size too), against the clusters whose
        basis can differ from theirs by at most ``max(2, k - 1)`` records, counted on content: an
        index from each member's content (the digest of its original's pixels when the gallery
        holds it, else its source fingerprint) to the clusters holding it (:func:`_content_pairs`).
        Every exact difference the attack can verify is one face or one swapped pair of faces, so
        two clusters whose bases differ in more than two contents cannot give one; pixel copies
        under other fingerprints count as the same content. A near-copy (not pixel-identical) under
        another fingerprint is not a shared content: only ``"nearest"`` pairs averages by pixels.
        Each average in a tested pair is read once; with no pair to test nothing else is read.
        Needs ``original_records``; without it ``"nearest"`` is used.

    Returns
    -------
    DifferencingResult
    """
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
    by_content = pairs == "content" and original_records is not None
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
    if not new or not reg:
        return DifferencingResult(0, 0, REPUBLISHED_ONLY if by_content and reg else "nothing to compare", (),
                                  frozenset(), tolerance, unit)
    for c, _ in new if by_content else new + reg:   # content: the averages of tested pairs are checked below
        if c.image.shape[0] != X.shape[1]:
            raise ConfigError(f"cluster averages have {c.image.shape[0]} values but originals {X.shape[1]}; pass the "
                              "aligned faces at the canonical size (or the drop's vectors of the same dimension)")
    if by_content:
        kmax = max([release.k, *(c.k for c, _ in new), *(c.k for c, _ in reg)])
        content = _content_ids(X, original_records, [c for c, _ in new] + [c for c, _ in reg])
        ci, cj = _content_pairs([c for c, _ in new], [c for c, _ in reg], content, max(2, kmax - 1))
        same = np.array([new[a][0].image_sha256 == reg[b][0].image_sha256 for a, b in zip(ci.tolist(), cj.tolist())],
                        dtype=bool)
        ci, cj = ci[~same], cj[~same]
        mode = f"clusters whose basis contents differ by at most {max(2, kmax - 1)} records (content index)"
        if not len(ci):
            return DifferencingResult(0, 0, mode, (), frozenset(), tolerance, unit)
        # Only the clusters of tested pairs go on, their averages read once, in memory (a handful of clusters).
        u1, ci = np.unique(ci, return_inverse=True)
        u2, cj = np.unique(cj, return_inverse=True)
        new = [new[a] for a in u1.tolist()]
        reg = [reg[b] for b in u2.tolist()]
        for c, _ in reg:
            if c.image.shape[0] != X.shape[1]:
                raise ConfigError(f"cluster averages have {c.image.shape[0]} values but originals {X.shape[1]}; pass "
                                  "the aligned faces at the canonical size (or the drop's vectors of the same "
                                  "dimension)")

    n_orig = X.shape[0]
    fit_rows = (np.arange(n_orig) if n_orig <= pca_sample else
                np.sort(np.random.default_rng(0).choice(n_orig, pca_sample, replace=False)))
    Wz, mu, sd = _pca(np.asarray(X[fit_rows], dtype=np.float32), n_components)  # (q, p) rows, mean, std
    Zc = np.vstack([(np.asarray(X[np.arange(a, min(a + 4096, n_orig))], dtype=np.float32) - mu) @ Wz.T
                    for a in range(0, n_orig, 4096)])  # centred projections of the originals, a chunk at a time
    members_only = original_records is not None and n_orig > exhaustive_below
    # Whitened projections (pair candidates): the rows a test asks for, divided when asked (bit-identical to
    # the whole quotient), when tests search their clusters' members; the whole matrix for the exhaustive search.
    Zw = _Whitened(Zc, sd) if members_only else Zc / sd
    # The averages stay where they are stored (a stored average is read from disk when asked: a million
    # faces have 1.5 GB of them, issue 13) and are read and converted a chunk of rows at a time.
    M1 = _Averages([c.image for c, _ in new])
    M2 = M1 if [c.key for c, _ in reg] == [c.key for c, _ in new] else _Averages([c.image for c, _ in reg])
    if by_content:   # each average read once (a registered one is decrypted from its pack once, not per test)
        M1, M2 = M1[np.arange(len(M1))], (None if M2 is M1 else M2[np.arange(len(M2))])
        M2 = M1 if M2 is None else M2

    def project(M: "_Averages") -> np.ndarray:
        return np.vstack([np.asarray(M[a:a + 4096], dtype=np.float32) @ Wz.T for a in range(0, len(M), 4096)])

    Y1 = project(M1)                                 # linear projections: differences are exact
    Y2 = Y1 if M2 is M1 else project(M2)
    muz = mu @ Wz.T
    h1 = [c.image_sha256 for c, _ in new]
    h2 = [c.image_sha256 for c, _ in reg]

    if by_content:
        pairs_i, pairs_j = ci.astype(np.int64), cj.astype(np.int64)
    else:
        all_pairs = len(new) * len(reg) <= max_pairs
        structural = None if all_pairs else _structural_pairs([c for c, _ in new], [c for c, _ in reg],
                                                              max_person_clusters)
        pairs_i, pairs_j = _pairs(Y1, Y2, all_pairs, neighbors, structural=structural, threads=threads)
        mode = "all pairs" if all_pairs else (f"{neighbors} nearest registered averages per released one and those "
                                              "sharing a record or a person")
    # Image hashes as integer codes: millions of pairs compared as arrays, not as Python objects (issue 13).
    codes: dict[str, int] = {}
    c1 = np.array([codes.setdefault(h, len(codes)) for h in h1], dtype=np.int64)
    c2 = np.array([codes.setdefault(h, len(codes)) for h in h2], dtype=np.int64)
    keep = c1[pairs_i] != c2[pairs_j]
    pairs_i, pairs_j = pairs_i[keep], pairs_j[keep]
    tests = _tests(pairs_i, pairs_j, [s for _, s in new], [s for _, s in reg])
    gallery = (None if not members_only else
               _MemberGallery(original_records, [c for c, _ in new], [c for c, _ in reg], Zc, Zw, muz, sd, candidates,
                              tolerance * np.sqrt(X.shape[1])))
    csq = np.einsum("ij,ij->i", Zc, Zc) if gallery is None else None

    def attack_block(start: int) -> list[DifferencingMatch]:
        found: list[DifferencingMatch] = []
        t = tests[start:start + block]
        i, j, s1, s2 = t.T
        sign = np.where(s1 >= s2, 1.0, -1.0).astype(np.float32)[:, None]  # larger cluster first: +x
        Dz = sign * (s1[:, None] * Y1[i] - s2[:, None] * Y2[j])
        single = s1 != s2
        if gallery is None:
            best = np.full((len(t), 2), -1, dtype=np.int64)
            if single.any():
                d = csq[None, :] - 2.0 * (Dz[single] - muz) @ Zc.T      # nearest original to the difference
                best[single, 0] = np.argmin(d, axis=1)
            if (~single).any():
                best[~single] = _best_pairs(Dz[~single] / sd, Zw, candidates, sd)
        else:
            best = gallery.best(Dz, i, j, single, np.maximum(s1, s2))
        for v in range(0, len(t), 256):  # verify in pixels, a few hundred differences at a time
            r = slice(v, v + 256)
            a, b = best[r, 0], best[r, 1]
            ok = np.flatnonzero(a >= 0)   # a test without a candidate (no member in the gallery) matches nothing
            if not len(ok):
                continue
            ir, jr, s1r, s2r, sg, a, b = i[r][ok], j[r][ok], s1[r][ok], s2[r][ok], sign[r][ok], a[ok], b[ok]
            D = sg * (s1r[:, None] * M1[ir].astype(np.float32) - s2r[:, None] * M2[jr].astype(np.float32))
            target = (np.asarray(X[a], dtype=np.float32)
                      - np.where(b[:, None] >= 0, np.asarray(X[np.maximum(b, 0)], dtype=np.float32), 0.0))
            mae = np.abs(D - target).mean(axis=1) / np.maximum(s1r, s2r)
            for hit in np.flatnonzero(mae < tolerance):
                origs = (int(a[hit]),) if b[hit] < 0 else (int(a[hit]), int(b[hit]))
                found.append(DifferencingMatch(new[int(ir[hit])][0].key, reg[int(jr[hit])][0].key,
                                               (int(s1r[hit]), int(s2r[hit])), "single" if b[hit] < 0 else "pair",
                                               origs, round(float(mae[hit]), 4)))
        return found

    starts = range(0, len(tests), block)
    if threads > 1 and len(starts) > 1:
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        # NumPy releases the GIL in the matrix products, partitions and element-wise passes of a block.
        with ThreadPoolExecutor(threads) as pool:
            matches = [m for found in pool.map(attack_block, starts) for m in found]
    else:
        matches = [m for start in starts for m in attack_block(start)]
    if original_people is not None:
        people = frozenset(original_people[g] for m in matches for g in m.originals)
    else:
        people = frozenset(g for m in matches for g in m.originals)
    if matches:
        logger.warning("lineage differencing attack: %d exact matches, %d people identified", len(matches), len(people))
    return DifferencingResult(len(pairs_i), len(tests), mode, tuple(matches), people, tolerance, unit)


def _tests(pairs_i: np.ndarray, pairs_j: np.ndarray, sizes1: Sequence[Sequence[int]],
           sizes2: Sequence[Sequence[int]]) -> np.ndarray:
    """(i, j, s1, s2) of every size hypothesis with ``|s1 - s2| <= 1``, pair by pair, ``s1`` then ``s2`` ascending.

    One int64 array (a million faces make millions of tests: Python tuples would cost gigabytes).
    """
    def table(sizes: Sequence[Sequence[int]]) -> np.ndarray:
        out = np.zeros((len(sizes), max(1, max(map(len, sizes)))), dtype=np.int64)
        for n, s in enumerate(sizes):
            out[n, :len(s)] = s
        return out

    S1, S2 = table(sizes1), table(sizes2)
    parts = []
    for a in range(S1.shape[1]):
        for b in range(S2.shape[1]):
            s1, s2 = S1[pairs_i, a], S2[pairs_j, b]
            p = np.flatnonzero((s1 > 0) & (s2 > 0) & (np.abs(s1 - s2) <= 1))
            parts.append(np.stack([p, np.full(len(p), a), np.full(len(p), b), pairs_i[p], pairs_j[p], s1[p], s2[p]],
                                  axis=1))
    t = np.concatenate(parts) if parts else np.zeros((0, 7), dtype=np.int64)
    t = t[np.lexsort((t[:, 2], t[:, 1], t[:, 0]))]
    return np.ascontiguousarray(t[:, 3:], dtype=np.int64)


def _content_ids(X: Any, records: Sequence[str], clusters: Sequence[LineageCluster],
                 chunk: int = 4096) -> dict[str, str]:
    """Member fingerprint -> content id: ``"px:"`` and the digest of its original's values when the gallery holds it.

    Only the rows of the ``clusters``' members are read (ascending, a chunk at a time). Two records
    with the same pixels (a copy under another fingerprint) get the same id; a fingerprint the
    gallery lacks is its own content (:func:`_content_pairs` maps it to itself).
    """
    import hashlib  # noqa: PLC0415

    members = set().union(*(c.records for c in clusters)) if clusters else set()
    row_of: dict[str, int] = {}
    for r, f in enumerate(records):
        if f in members:
            row_of.setdefault(f, r)
    rows = np.array(sorted(set(row_of.values())), dtype=np.int64)
    digest: dict[int, str] = {}
    for a in range(0, len(rows), chunk):
        part = rows[a:a + chunk]
        block = np.ascontiguousarray(np.asarray(X[part]))
        for r, row in zip(part.tolist(), block):
            digest[r] = "px:" + hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest()
    return {f: digest[r] for f, r in row_of.items()}


def _content_pairs(new: Sequence[LineageCluster], reg: Sequence[LineageCluster], content: dict[str, str],
                   max_diff: int) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) of every ``new[i]`` and ``reg[j]`` whose basis content multisets differ by at most ``max_diff`` records.

    An inverted index from content to the registered clusters holding it: a pair is looked at only
    if it shares a content (or both clusters are so small that, disjoint, they still differ by at
    most ``max_diff``). ``|A ^ B| = |A| + |B| - 2 |A & B|`` on multisets of contents.
    """
    def bag(c: LineageCluster) -> Counter:
        return Counter(content.get(f, "fp:" + f) for f in c.records)

    index: dict[str, list[tuple[int, int]]] = defaultdict(list)
    size2 = np.array([len(c.records) for c in reg], dtype=np.int64)
    for j, c in enumerate(reg):
        for cid, m in bag(c).items():
            index[cid].append((j, m))
    small2 = np.flatnonzero(size2 < max_diff)   # disjoint pairs of tiny clusters can differ by few records too
    out_i: list[int] = []
    out_j: list[int] = []
    for i, c in enumerate(new):
        overlap: dict[int, int] = defaultdict(int)
        for cid, n in bag(c).items():
            for j, m in index.get(cid, ()):
                overlap[j] += min(n, m)
        n1 = len(c.records)
        js = {j for j, ov in overlap.items() if n1 + int(size2[j]) - 2 * ov <= max_diff}
        if n1 < max_diff:
            js.update(int(j) for j in small2 if n1 + int(size2[j]) <= max_diff)
        out_i.extend([i] * len(js))
        out_j.extend(sorted(js))
    return np.asarray(out_i, dtype=np.int64), np.asarray(out_j, dtype=np.int64)


def _structural_pairs(new: Sequence[LineageCluster], reg: Sequence[LineageCluster],
                      max_person_clusters: int) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) of every released cluster ``new[i]`` and registered ``reg[j]`` sharing a basis record or a person.

    A person in more than ``max_person_clusters`` registered clusters adds no pairs this way (one
    person's many photos would make the pairs quadratic in their number); shared records still do.
    """
    by_record: dict[str, list[int]] = defaultdict(list)
    by_person: dict[str, list[int]] = defaultdict(list)
    for j, c in enumerate(reg):
        for f, p in c.members:
            by_record[f].append(j)
            by_person[p].append(j)
    out_i: list[int] = []
    out_j: list[int] = []
    for i, c in enumerate(new):
        js: set[int] = set()
        for f, p in c.members:
            js.update(by_record.get(f, ()))
            near = by_person.get(p, ())
            if len(near) <= max_person_clusters:
                js.update(near)
        out_i.extend([i] * len(js))
        out_j.extend(sorted(js))
    return np.asarray(out_i, dtype=np.int64), np.asarray(out_j, dtype=np.int64)


class _MemberGallery:
    """Candidate originals of each test: the present members of its two clusters (see :func:`differencing_attack`).

    Clusters with members absent from the gallery also get, through a k-d tree over the centred PCA
    projections, the nearest originals within the radius an exact difference lies at.
    """

    def __init__(self, records: Sequence[str], new: Sequence[LineageCluster], reg: Sequence[LineageCluster],
                 Zc: np.ndarray, Zw: np.ndarray, muz: np.ndarray, sd: np.ndarray, candidates: int,
                 radius_per_size: float):
        row_of: dict[str, int] = {}
        for r, f in enumerate(records):
            row_of.setdefault(f, r)   # byte-identical photos listed twice: one record, the same pixels
        cache: dict[str, tuple[tuple[int, ...], bool]] = {}

        def members(c: LineageCluster) -> tuple[tuple[int, ...], bool]:
            if c.key not in cache:
                rows = [row_of[f] for f in c.records if f in row_of]
                cache[c.key] = (tuple(sorted(set(rows))), len(rows) == len(c.records))
            return cache[c.key]

        m1, m2 = [members(c) for c in new], [members(c) for c in reg]
        self.rows1, self.full1 = [m for m, _ in m1], np.array([f for _, f in m1], dtype=bool)
        self.rows2, self.full2 = [m for m, _ in m2], np.array([f for _, f in m2], dtype=bool)
        self.Zc, self.Zw, self.muz, self.sd, self.candidates = Zc, Zw, muz, sd, candidates
        self.radius_per_size = float(radius_per_size)
        self.tree = None
        if not (self.full1.all() and self.full2.all()):
            from scipy.spatial import cKDTree  # noqa: PLC0415 - only lineages with absent members need it

            self.tree = cKDTree(Zc)

    def _near(self, Q: np.ndarray, radius: float) -> np.ndarray:
        """Nearest original to each query within ``radius`` (-1: none)."""
        _, idx = self.tree.query(np.asarray(Q, dtype=np.float64), k=1, distance_upper_bound=radius)
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        return np.where(idx < self.Zc.shape[0], idx, -1)

    def best(self, Dz: np.ndarray, i: np.ndarray, j: np.ndarray, single: np.ndarray, smax: np.ndarray) -> np.ndarray:
        """(a, b) of each test's best candidate (b = -1 for a single face, a = -1 when there is none)."""
        n = len(Dz)
        cand = [set(self.rows1[x]) | set(self.rows2[y]) for x, y in zip(i.tolist(), j.tolist())]
        partial = np.flatnonzero(~(self.full1[i] & self.full2[j]))
        full_search = []
        if len(partial):
            radius = self.radius_per_size * float(smax[partial].max())
            s_rows = partial[single[partial]]
            if len(s_rows):   # a single face: around the difference itself
                for t, g in zip(s_rows.tolist(), self._near(Dz[s_rows] - self.muz, radius).tolist()):
                    if g >= 0:
                        cand[t].add(g)
            owner, queries = [], []
            for t in partial[~single[partial]].tolist():
                if not cand[t]:
                    full_search.append(t)
                    continue
                for g in cand[t]:   # the other face of the pair: b = a - d, or a = b + d
                    owner += [t, t]
                    queries += [self.Zc[g] - Dz[t], self.Zc[g] + Dz[t]]
            if queries:
                for t, g in zip(owner, self._near(np.stack(queries), radius).tolist()):
                    if g >= 0:
                        cand[t].add(g)
        width = max(1, max(map(len, cand)))
        C = np.full((n, width), -1, dtype=np.int64)
        for t, c in enumerate(cand):
            C[t, :len(c)] = sorted(c)
        best = np.full((n, 2), -1, dtype=np.int64)
        s = np.flatnonzero(single)
        if len(s):
            R = self.Zc[np.maximum(C[s], 0)] - (Dz[s] - self.muz)[:, None, :]
            d = np.where(C[s] >= 0, np.einsum("bmq,bmq->bm", R, R), np.inf)
            k = np.argmin(d, axis=1)
            best[s, 0] = np.where(np.isfinite(d[np.arange(len(s)), k]), C[s, k], -1)
        p = np.flatnonzero(~single)
        if len(p):
            best[p] = _best_pairs_among(Dz[p] / self.sd, self.Zw, C[p], self.candidates, self.sd)
        if full_search:
            fs = np.asarray(full_search, dtype=np.int64)
            best[fs] = _best_pairs(Dz[fs] / self.sd, self.Zw, self.candidates, self.sd)
        return best


def _pca(X: np.ndarray, n_components: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Eigenfaces of the originals (Turk & Pentland 1991): components, mean, per-component std.

    Through the small Gram matrix when there are at most a few thousand faces, else randomized SVD
    (``X`` is then overwritten: pass a copy).
    """
    n, p = X.shape
    q = max(1, min(n_components, n - 1, p))
    mu = X.mean(axis=0)
    Xc = X - mu if n <= 3000 else np.subtract(X, mu, out=X)  # a large sample is centred in place (issue 13)
    if n <= 3000:
        vals, vecs = np.linalg.eigh(Xc @ Xc.T)
        order = np.argsort(vals)[::-1][:q]
        vals, vecs = np.maximum(vals[order], 1e-6), vecs[:, order]
        W = (Xc.T @ vecs / np.sqrt(vals)).T
    else:
        from sklearn.decomposition import PCA  # noqa: PLC0415 - only large galleries need it

        # copy=False: the sample is not copied again (20,000 faces are 600 MB of float32).
        W = PCA(q, svd_solver="randomized", random_state=0, copy=False).fit(Xc).components_
        vals = ((Xc @ W.T) ** 2).sum(axis=0)
    sd = np.sqrt(np.maximum(vals, 1e-6) / n).astype(np.float32)
    return W.astype(np.float32), mu.astype(np.float32), sd


def _pairs(Y1: np.ndarray, Y2: np.ndarray, all_pairs: bool, neighbors: int, *,
           structural: tuple[np.ndarray, np.ndarray] | None = None, brute_max: float = 4e8,
           threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Cluster pairs to test: all of them, or each released average's nearest registered ones and ``structural``.

    Exact nearest neighbours by blocks while ``len(Y1) * len(Y2) <= brute_max``; above that a k-d
    tree's (1 + eps)-approximate ones, eps = 1 (O(N log N), see :func:`differencing_attack`).
    """
    if all_pairs:
        i, j = np.meshgrid(np.arange(len(Y1)), np.arange(len(Y2)), indexing="ij")
        return i.ravel(), j.ravel()
    m = min(neighbors, len(Y2))
    out_i, out_j = [], []
    if len(Y1) * len(Y2) <= brute_max:
        y2sq = np.einsum("ij,ij->i", Y2, Y2)
        for start in range(0, len(Y1), 1024):
            d = y2sq[None, :] - 2.0 * Y1[start:start + 1024] @ Y2.T
            nn = np.argpartition(d, m - 1, axis=1)[:, :m]
            out_i.append(np.repeat(np.arange(start, start + len(d)), m))
            out_j.append(nn.ravel())
    else:
        from scipy.spatial import cKDTree  # noqa: PLC0415 - only large releases need it

        _, nn = cKDTree(Y2).query(Y1, k=m, eps=1.0, workers=max(1, threads))
        nn = np.asarray(nn, dtype=np.int64).reshape(len(Y1), m)
        out_i.append(np.repeat(np.arange(len(Y1)), m))
        out_j.append(nn.ravel())
    if structural is not None:
        out_i.append(structural[0])
        out_j.append(structural[1])
    i, j = np.concatenate(out_i), np.concatenate(out_j)
    code = np.unique(i * len(Y2) + j)   # each pair once, by released then registered average
    return code // len(Y2), code % len(Y2)


class _Whitened:
    """``Z / sd`` computed for the rows asked for: the same float32 values as the whole quotient's rows, without
    holding it (a million originals' projections are 200 MB; issue 13). ``np.asarray`` gives the whole."""

    def __init__(self, Z: np.ndarray, sd: np.ndarray):
        self.Z, self.sd = Z, sd

    @property
    def shape(self) -> tuple[int, ...]:
        return self.Z.shape

    def __getitem__(self, idx) -> np.ndarray:
        return self.Z[idx] / self.sd

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.Z / self.sd
        return out if dtype is None else out.astype(dtype, copy=False)


def _best_pairs(Dw: np.ndarray, Zw: np.ndarray, candidates: int, sd: np.ndarray | None = None) -> np.ndarray:
    """For each whitened difference D, the pair (a, b), a != b, of originals with Z_a - Z_b nearest to D.

    For the true pair, ``Z_a . D = Z_a . (Z_a - Z_b)`` is about ``|Z_a|^2``, far above the other
    originals in whitened space (where every component has unit variance), and ``Z_b . D`` far
    below; so ``a`` is searched among the ``candidates`` originals most aligned with D, ``b`` among
    the ``candidates`` least aligned, all combinations compared exactly. O(n q) per difference.
    With ``sd`` (the whitening scale) the combinations are compared unwhitened, as the pixel check
    that follows measures them: whitening multiplies the rounding error of the averages in the
    low-variance components, where a wrong pair can then come out nearest (seen on 36-pixel random
    faces at k=2, tests/test_lineage_differencing_scale.py).
    """
    Zw = np.asarray(Zw)   # every original is scored: the whole matrix, for this call only
    t = min(candidates, Zw.shape[0])
    u = Dw @ Zw.T                                                  # (B, n)
    A = np.argpartition(-u, t - 1, axis=1)[:, :t]                  # (B, t)
    C = np.argpartition(u, t - 1, axis=1)[:, :t]                   # (B, t)
    R = Zw[A][:, :, None, :] - Zw[C][:, None, :, :] - Dw[:, None, None, :]   # (B, t, t, q)
    if sd is not None:
        R = R * sd
    d = np.einsum("btcq,btcq->btc", R, R)
    d[A[:, :, None] == C[:, None, :]] = np.inf                     # a != b
    flat = np.argmin(d.reshape(len(Dw), -1), axis=1)
    ia, ic = np.divmod(flat, t)
    rows = np.arange(len(Dw))
    return np.stack([A[rows, ia], C[rows, ic]], axis=1)


def _best_pairs_among(Dw: np.ndarray, Zw: np.ndarray, cand: np.ndarray, candidates: int,
                      sd: np.ndarray | None = None) -> np.ndarray:
    """:func:`_best_pairs` with each difference's originals limited to its row of ``cand`` (-1: padding).

    (-1, -1) where no two distinct candidates exist.
    """
    B, m = cand.shape
    valid = cand >= 0
    Zs = Zw[np.maximum(cand, 0)]                                   # (B, m, q)
    u = np.einsum("bmq,bq->bm", Zs, Dw)
    t = min(candidates, m)
    A = np.argpartition(-np.where(valid, u, -np.inf), t - 1, axis=1)[:, :t]
    C = np.argpartition(np.where(valid, u, np.inf), t - 1, axis=1)[:, :t]
    rows = np.arange(B)[:, None]
    R = Zs[rows, A][:, :, None, :] - Zs[rows, C][:, None, :, :] - Dw[:, None, None, :]
    if sd is not None:
        R = R * sd
    d = np.einsum("btcq,btcq->btc", R, R)
    ga, gc = cand[rows, A], cand[rows, C]
    bad = (ga[:, :, None] == gc[:, None, :]) | (ga[:, :, None] < 0) | (gc[:, None, :] < 0)
    d[bad] = np.inf
    flat = np.argmin(d.reshape(B, -1), axis=1)
    ia, ic = np.divmod(flat, t)
    r = np.arange(B)
    out = np.stack([ga[r, ia], gc[r, ic]], axis=1)
    out[~np.isfinite(d.reshape(B, -1)[r, flat])] = -1
    return out


# --------------------------------------------------------------------------- releases published on disk


@dataclass(frozen=True)
class PublishedDifferencingResult:
    """Outcome of :func:`published_differencing_attack`; the gate fails on any match.

    ``matches`` holds gallery matches (``kind`` single/pair, the originals found) and differences that
    are a face image on their own (``kind="image"``: a plausible image at the rounding's precision, whoever
    it shows, e.g. a person who left the drop and has no original here).
    """

    releases: tuple[str, ...]
    n_cluster_pairs: int
    n_tests: int
    matches: tuple[DifferencingMatch, ...]
    people_identified: frozenset
    tolerance: float
    skipped: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.matches

    def to_check(self) -> LineageCheck:
        images = sum(1 for m in self.matches if m.kind == "image")
        detail = (f"{len(self.releases)} published releases of the dataset that the registry does not remember "
                  f"differenced against this release: {self.n_cluster_pairs} pairs of averages, {self.n_tests} size "
                  f"hypotheses (the sizes each release shows); {len(self.matches) - images} differences matched an "
                  f"original face or pair (mean abs error < {self.tolerance:.4g} grey level at the averages' scale), "
                  f"{images} are a face image on their own (every pixel within the averages' rounding of 0..255); "
                  f"{len(self.people_identified)} people identified")
        if self.skipped:
            detail += f"; {len(self.skipped)} releases not comparable (another image size) were not differenced"
        return LineageCheck("lineage_published_differencing", self.passed, len(self.people_identified) + images, 0,
                            detail, tuple(vars(m) for m in self.matches))


def published_differencing_attack(current_keys: Sequence[str], current_images: Sequence[Any],
                                  current_sizes: Sequence[Sequence[int]], published: Sequence[Any],
                                  originals: Any | None = None, *, original_people: Sequence[Hashable] | None = None,
                                  tolerance: float = 1.0, n_components: int = 50, max_pairs: int = 200_000,
                                  neighbors: int = 10, candidates: int = 16, block: int = 512,
                                  pca_sample: int = 20_000) -> PublishedDifferencingResult:
    """Difference this release's averages against every release of the dataset published on disk.

    The attacker of :func:`differencing_attack` (Ganta, Kasiviswanathan & Smith, KDD 2008), with
    only what a published release shows: each cluster id's image and how many records carry it. A
    release the registry does not remember (made on a registry restored from an earlier copy, or
    deleted) is attacked here. For a current average ``M1`` (sizes ``s1``: its basis and released
    sizes) and a published one ``M2`` (``s2``: its released size) with ``|s1 - s2| <= 1`` and
    different images, the difference ``D = +-(s1 M1 - s2 M2)`` is:

    - matched to the ``originals`` (the drop's aligned faces) as in :func:`differencing_attack`
      (exhaustive search: nearest original for a single face, the most and least aligned
      originals in whitened PCA space for a pair ``a - b``), verified in pixels: a match when the
      mean absolute error over ``max(s1, s2)`` is below ``tolerance`` grey levels;
    - and, for ``|s1 - s2| = 1``, tested as an image on its own: one face plus the rounding of two
      uint8 averages lies within ``[-(s1 + s2) / 2, 255 + (s1 + s2) / 2]`` at every pixel, while the
      difference of two unrelated averages is ``M1 + s2 (M1 - M2)``, far outside at many pixels
      (per-pixel spread about ``sqrt(2 s) x`` a face's). This finds a person who left the drop,
      whose original is not in the gallery (the issue's 6 m2 - 5 m3).

    Pairs: all while ``n_current * n_published <= max_pairs``, else each current average's
    ``neighbors`` nearest published ones in PCA space (a leaking pair's averages differ by one
    face over ``s``: near neighbours).

    Parameters
    ----------
    current_keys, current_images, current_sizes
        This release's clusters: key, average (flattened grey row, or a stored image), plausible sizes.
    published : sequence of :class:`deid.release.lineage_anchor.PublishedAverages`
        The published releases to attack (read from disk).
    originals : array-like (n, n_pixels), or a row source, optional
        The drop's aligned faces (the gallery); None: only the image test runs.
    original_people : sequence, optional
        Person of each original, to count the people identified.

    Returns
    -------
    PublishedDifferencingResult
    """
    import hashlib  # noqa: PLC0415

    if not tolerance > 0:
        raise ConfigError(f"tolerance={tolerance!r} must be > 0 grey levels, e.g. 1.0")
    releases = tuple(p.release_id for p in published)
    n1 = len(current_keys)
    if not n1 or not published:
        return PublishedDifferencingResult(releases, 0, 0, (), frozenset(), tolerance)
    M1 = _Averages(list(current_images))
    p_dim = int(np.asarray(M1[np.arange(1)]).shape[1])
    X = originals if originals is None or hasattr(originals, "shape") else np.asarray(originals, np.float32)
    if X is not None and (len(X.shape) != 2 or X.shape[0] < 2 or X.shape[1] != p_dim):
        X = None   # no usable gallery: the image test only
    if original_people is not None and X is not None and len(original_people) != X.shape[0]:
        raise ConfigError(f"original_people has {len(original_people)} entries for {X.shape[0]} originals")
    comparable = [p for p in published if p.images.shape[1] == p_dim and len(p.images)]
    skipped = tuple(p.release_id for p in published if p not in comparable)
    if not comparable:
        return PublishedDifferencingResult(releases, 0, 0, (), frozenset(), tolerance, skipped)
    # Eigenfaces (Turk & Pentland 1991) of the gallery, else of the averages themselves: for pairing and search.
    basis = (X if X is not None else np.vstack([p.images for p in comparable]))
    n_fit = basis.shape[0]
    fit = (np.arange(n_fit) if n_fit <= pca_sample
           else np.sort(np.random.default_rng(0).choice(n_fit, pca_sample, replace=False)))
    Wz, mu, sd = _pca(np.asarray(basis[fit], dtype=np.float32), n_components)
    if X is not None:
        Zc = np.vstack([(np.asarray(X[np.arange(a, min(a + 4096, X.shape[0]))], np.float32) - mu) @ Wz.T
                        for a in range(0, X.shape[0], 4096)])
        Zw, csq = Zc / sd, np.einsum("ij,ij->i", Zc, Zc)
    muz = mu @ Wz.T
    Y1 = np.vstack([np.asarray(M1[np.arange(a, min(a + 4096, n1))], np.float32) @ Wz.T
                    for a in range(0, n1, 4096)])
    h1 = [hashlib.sha256(np.ascontiguousarray(np.asarray(M1[np.arange(i, i + 1)], np.uint8)).tobytes()).hexdigest()
          for i in range(n1)]
    matches: list[DifferencingMatch] = []
    n_pairs = n_tests = 0
    for pub in comparable:
        M2 = pub.images

        def where(j: int, pub=pub) -> str:
            return f"{pub.release_id}/{pub.cluster_ids[j]}"

        Y2 = M2.astype(np.float32) @ Wz.T
        h2 = [hashlib.sha256(np.ascontiguousarray(r).tobytes()).hexdigest() for r in M2]
        pi, pj = _pairs(Y1, Y2, n1 * len(M2) <= max_pairs, neighbors)
        keep = np.array([h1[a] != h2[b] for a, b in zip(pi.tolist(), pj.tolist())], dtype=bool)
        pi, pj = pi[keep], pj[keep]
        tests = _tests(pi, pj, current_sizes, [[s] for s in pub.sizes])
        n_pairs, n_tests = n_pairs + len(pi), n_tests + len(tests)
        for start in range(0, len(tests), block):
            i, j, s1, s2 = tests[start:start + block].T
            sign = np.where(s1 >= s2, 1.0, -1.0).astype(np.float32)[:, None]
            D = sign * (s1[:, None] * np.asarray(M1[i], np.float32) - s2[:, None] * M2[j].astype(np.float32))
            single = s1 != s2
            smax = np.maximum(s1, s2)
            found = np.zeros(len(i), dtype=bool)
            if X is not None:
                Dz = D @ Wz.T
                best = np.full((len(i), 2), -1, dtype=np.int64)
                if single.any():
                    best[single, 0] = np.argmin(csq[None, :] - 2.0 * (Dz[single] - muz) @ Zc.T, axis=1)
                if (~single).any():
                    best[~single] = _best_pairs(Dz[~single] / sd, Zw, candidates, sd)
                a, b = best[:, 0], best[:, 1]
                target = (np.asarray(X[a], np.float32)
                          - np.where(b[:, None] >= 0, np.asarray(X[np.maximum(b, 0)], np.float32), 0.0))
                mae = np.abs(D - target).mean(axis=1) / smax
                for hit in np.flatnonzero(mae < tolerance):
                    found[hit] = True
                    origs = (int(a[hit]),) if b[hit] < 0 else (int(a[hit]), int(b[hit]))
                    matches.append(DifferencingMatch(current_keys[int(i[hit])], where(int(j[hit])),
                                                     (int(s1[hit]), int(s2[hit])), "single" if b[hit] < 0 else "pair",
                                                     origs, round(float(mae[hit]), 4)))
            r = (0.5 * (s1 + s2)).astype(np.float32) + 1e-3
            image = single & ~found & (D.min(axis=1) >= -r) & (D.max(axis=1) <= 255.0 + r)
            for hit in np.flatnonzero(image):
                # No original to compare with (e.g. a person who left): mae 0.0, the image is the finding.
                matches.append(DifferencingMatch(current_keys[int(i[hit])], where(int(j[hit])),
                                                 (int(s1[hit]), int(s2[hit])), "image", (), 0.0))
    people = frozenset((original_people[g] if original_people is not None else g)
                       for m in matches for g in m.originals)
    if matches:
        logger.warning("lineage differencing attack against published releases: %d matches, %d people identified",
                       len(matches), len(people))
    return PublishedDifferencingResult(releases, n_pairs, n_tests, tuple(matches), people, tolerance, skipped)
