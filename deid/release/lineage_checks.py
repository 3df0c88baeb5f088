"""Gate checks over a dataset's lineage: structural invariance, merges, label mix.

Each release of a dataset is checked against every registered cluster of the earlier releases
(:class:`deid.release.lineage_state.LineageState`). Two clusters whose member records differ by ``d`` records
leak those records whenever ``d < k``: one swapped person gives ``s (M1 - M2) = a - b``, one added
face gives ``|C2| M2 - |C1| M1 = x`` (the composition attack, Ganta, Kasiviswanathan & Smith,
KDD 2008). :func:`check_structure` rules this out from the registry; :func:`check_merges` reports the
registered clusters this run's merges withhold; :func:`check_label_mix` that every released cluster
carries its registered label multiset. The differencing attack itself, on the released pixels, is in
:mod:`deid.release.lineage_differencing` (against the registry) and
:mod:`deid.release.published_differencing` (against the releases published on disk).
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from deid.release.lineage import LineageRelease, label_mix
from deid.release.lineage_plan import LineagePlan
from deid.release.lineage_state import LineageCluster, LineageState

logger = logging.getLogger(__name__)

__all__ = ["LineageCheck", "check_label_mix", "check_merges", "check_structure"]


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


# The differencing attacks' names, read from here by deid.operations.deidentify_lineage, resolved
# on first use: their modules import LineageCheck from this one.
_MOVED = {"REPUBLISHED_ONLY": "deid.release.lineage_differencing", "DifferencingResult": "deid.release.lineage_differencing",
          "differencing_attack": "deid.release.lineage_differencing",
          "published_differencing_attack": "deid.release.published_differencing"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
