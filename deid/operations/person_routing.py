"""What the person index's lookup decides for a drop: its own lineage, refused, or routed to another (pure).

:func:`decide` reads the :class:`Matches` of a drop's records and steward ids registered under other
datasets and, by ``DEID_CROSS_DATASET``, refuses the drop naming that dataset (:class:`CrossDatasetRefusal`)
or plans it in that dataset's lineage (:class:`Routing`, re-keyed records listed under their registered
ids); :func:`decide_faces` does the same for the drop's people found by face among the registered
descriptors (:class:`FaceMatch`, :class:`FaceRouting`). The store that looks them up is
:class:`deid.operations.person_index.PersonIndex`.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from deid.anonymise.identity import normalize_subject_id
from deid.errors import ConfigError, DataError


CROSS_DATASET_POLICIES = ("refuse", "route")


ID_SCOPES = ("linked", "project")


def check_policy(policy: str, id_scope: str) -> None:
    """Refuse an unknown ``DEID_CROSS_DATASET`` or ``DEID_CROSS_DATASET_IDS`` value, naming the valid ones."""
    if policy not in CROSS_DATASET_POLICIES:
        raise ConfigError(f"DEID_CROSS_DATASET={policy!r} must be one of {CROSS_DATASET_POLICIES}: 'refuse' stops a "
                          "drop whose people another dataset released, 'route' plans it in that dataset's lineage")
    if id_scope not in ID_SCOPES:
        raise ConfigError(f"DEID_CROSS_DATASET_IDS={id_scope!r} must be one of {ID_SCOPES}: 'project' when steward "
                          "ids name the same person in every dataset of the project, else 'linked'")


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
    match = _face_matches(pairs, people, owners, rows_of, lineage=lineage, known=known)
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
    _refuse_unroutable(others, matched, mine, dataset=dataset, lineage=lineage, threshold=threshold,
                       searched=searched, held=held, policy=policy)
    target = others[0]
    aliases = {a: reg for a, (ds, reg) in sorted(match.items()) if ds == target}
    note = (f"person index: {matched[target]} of the drop's people match people registered under dataset {target!r} "
            f"by face (other photographs under other ids): the drop of dataset {dataset!r} is planned in {target!r}'s "
            "lineage, those people under their registered ids (DEID_CROSS_DATASET=route)")
    return replace(base, dataset=target, routed_from=lineage, aliases=aliases, note=note)


def _face_matches(pairs: Sequence[tuple[int, int, float]], people: Sequence[str], owners: Sequence[tuple[str, str]],
                  rows_of: Counter, *, lineage: str, known: frozenset[str] | set[str]) -> dict[str, tuple[str, str]]:
    """Each drop person's matching registered (dataset, subject id), by :func:`decide_faces`' rule: at least
    ``min(2, |A| |B|)`` cross pairs within the threshold, the one with most pairs (then the nearest) taken.
    ``rows_of``: each drop person's number of descriptor rows."""
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
    return match


def _refuse_unroutable(others: list[str], matched: dict[str, int], mine: dict[str, str], *, dataset: str,
                       lineage: str, threshold: float, searched: int, held: int, policy: str) -> None:
    """Raise :class:`CrossDatasetRefusal` for people matched in the ``others`` datasets: always under
    ``refuse``; under ``route`` when they are in more than one lineage (the drop's own included)."""
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
